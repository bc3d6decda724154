/* ctxtans: KV blocks coded with a model dictionary's context models and tANS (one table step a value). */
#ifndef KVN_CTXTANS_H
#define KVN_CTXTANS_H
#include "kvn.h"

#define KVN_TANS_SYMBOLS 64
#define KVN_TANS_LOG 11
#define KVN_TANS_SIZE (1u << KVN_TANS_LOG)
#define KVN_TANS_MAX_CLASSES 64
#define KVN_TANS_MAX_CONTEXTS 32
#define KVN_TANS_MAX_TOKENS (1u << 22)

/* A dictionary's tANS tables (kvtool/_native/ctxtans_tables.py, TansTables), copied in. */
typedef struct kvn_tans_model kvn_tans_model;

/* Per model (classes * contexts symbol models, then the class and the reference model):
 * g [64] (u16), start [64] (u16), and per state symbol, nbits (u8) and base (u16) (the tANS tables of
 * versions 1 and 2); cost [contexts * 64 * classes] and class_cost [classes] (i32); context_of [64]. NULL
 * when out of memory or the tables are inconsistent. The lane coders (chunk version 3) run the kernels
 * of kvn_isa()'s level at each call. */
kvn_tans_model *kvn_tans_model_new(int classes, int contexts, int start_context, const uint16_t *g,
                                   const uint16_t *start, const uint8_t *symbol, const uint8_t *nbits,
                                   const uint16_t *base, const int32_t *cost, const int32_t *class_cost,
                                   const uint8_t *context_of, const uint8_t tag[4]);
void kvn_tans_model_free(kvn_tans_model *m);

/* An upper bound on the bytes kvn_tans_encode writes for a block. */
size_t kvn_tans_bound(const kvn_block *b);
/* Encode the block at `src` into `dst` (room for kvn_tans_bound bytes); the chunk length in *written. */
int kvn_tans_encode(const kvn_tans_model *m, const kvn_block *b, const void *src, uint8_t *dst, size_t *written);
/* Decode a chunk into the block at `dst` (laid out as b describes). KVN_ERR_ARG: another dictionary's chunk. */
int kvn_tans_decode(const kvn_tans_model *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst);

#endif
