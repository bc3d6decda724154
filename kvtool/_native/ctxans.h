/* ctxans: KV blocks coded with a model dictionary's context models and interleaved rANS.
 * The API of ctxans_model.c, ctxans_encode.c and ctxans_decode.c (their shared insides: ctxans_impl.h). */
#ifndef KVN_CTXANS_H
#define KVN_CTXANS_H
#include "kvn.h"

/* The format's constants; Python has them too (kvtool/modeldict/format.py, ctxans_reference.py) and
 * checks them against the core's CTXANS_CONSTANTS when it loads the core. */
#define KVN_CTX_VERSION 1
#define KVN_CTX_FLAG_REPEATS 1u
#define KVN_CTX_HEAD_SIZE 16 /* version, flags, tag[4], u16 base reference, u32 escapes, u32 rANS bytes */
#define KVN_CTX_STATES 16
#define KVN_CTX_PROB_BITS 15
#define KVN_CTX_RANS_LOW (1u << 16)
#define KVN_CTX_SYMBOLS 64
#define KVN_CTX_LEVELS 32
#define KVN_CTX_LOW (-22)
#define KVN_CTX_REF_SYMBOLS 32
#define KVN_CTX_MAX_CLASSES 64
#define KVN_CTX_MAX_CONTEXTS 32
/* The most tokens one block may hold. */
#define KVN_CTX_MAX_TOKENS (1u << 22)

/* A dictionary's coder tables (kvtool/modeldict/format.py, CoderTables), copied in. */
typedef struct kvn_ctx_model kvn_ctx_model;

/* freq and cum: [(classes * contexts + 2) * 64] (symbol models, the class model, the
 * reference model); cost: [contexts * 64 * classes]; class_cost: [classes]; context_of: [64].
 * NULL when out of memory or the tables are inconsistent. */
kvn_ctx_model *kvn_ctx_model_new(int classes, int contexts, int start_context, const uint16_t *freq,
                                 const uint16_t *cum, const int32_t *cost, const int32_t *class_cost,
                                 const uint8_t *context_of, const uint8_t tag[4]);
void kvn_ctx_model_free(kvn_ctx_model *m);

/* An upper bound on the bytes kvn_ctx_encode writes for a block. */
size_t kvn_ctx_bound(const kvn_block *b);
/* Encode the block at `src` into `dst` (room for kvn_ctx_bound bytes); the chunk length in *written. */
int kvn_ctx_encode(const kvn_ctx_model *m, const kvn_block *b, const void *src, uint8_t *dst, size_t *written);
/* Decode a chunk into the block at `dst` (laid out as b describes). */
int kvn_ctx_decode(const kvn_ctx_model *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst);

#endif
