/* ctxtans's shared pieces: the chunk's constants, the model, how values split (ctxtans.c decodes,
 * ctxtans_encode.c encodes). */
#ifndef KVN_CTXTANS_IMPL_H
#define KVN_CTXTANS_IMPL_H
#include "ctxtans.h"
#include "repeats.h"
#include "values.h"

#define VERSION 2 /* what the encoder writes; version 1 chunks (channels in their own order) still decode */
#define MODE_DICT 0
#define MODE_EXPHUFF 1
#define FLAG_REPEATS 1u
#define HEAD_SIZE 18 /* version, mode, flags, reserved, tag[4], u16 base, u32 escapes, u32 stream bytes */
#define STATES 8
#define GROUP 8 /* values are coded a group of channels at a time, each group token by token */
#define L KVN_TANS_LOG
#define T KVN_TANS_SIZE
#define LEVELS 32
#define LOW (-22)
#define REF_SYMBOLS 32
#define COST_LANES KVN_TANS_MAX_CLASSES
#define COST_RUN 512 /* tokens summed in 16-bit lanes: a symbol costs at most 8 * 11 */
#define MIN_STREAM 12 /* eight states of 11 bits and the end marker */

/* The tANS loops read variable bit fields: with BMI2 (x86-64-v3) a read is shrx + bzhi. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KVN_NO_MULTIVERSION)
#define KVN_TANS_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVN_TANS_MULTIVERSION
#endif

struct kvn_tans_model {
    int classes, contexts, start_context;
    size_t class_model, ref_model;
    uint32_t *dec;   /* per model and state: symbol | nbits << 6 | (context_of[symbol] << 11 | base) << 16 */
    uint16_t *enc;   /* per model: the states of each symbol, by symbol then rank */
    uint32_t *info;  /* per model and symbol: g | start << 12 | (11 - floor(log2 g)) << 24 */
    int16_t *cost;   /* [contexts * 64][COST_LANES]: classes' costs, zero padded */
    int32_t class_cost[KVN_TANS_MAX_CLASSES];
    uint8_t context_of[KVN_TANS_SYMBOLS];
    uint8_t tag[4];
};

/* ---- values ---------------------------------------------------------------------------- */

typedef struct {
    unsigned width, raw_bits, sign_shift;
    uint32_t level_count, raw_mask;
} split;

static inline split split_of(int dtype) {
    static const unsigned EBITS[KVN_NDTYPES] = {8, 5, 8, 4, 5}, MBITS[KVN_NDTYPES] = {7, 10, 23, 3, 2};
    unsigned w = (unsigned)kvn_itemsize(dtype), e = EBITS[dtype], mb = MBITS[dtype];
    split s = {w, mb - 1, 8 * w - 1, 1u << (e + 1), (1u << (mb - 1)) - 1};
    return s;
}

KVN_INLINE unsigned symbol_of(uint32_t v, uint32_t ref, const split *sp) {
    uint32_t level = (v >> sp->raw_bits) & (sp->level_count - 1);
    uint32_t q = level - ref - (uint32_t)LOW + 1; /* wraps to a large number below the window */
    return (v >> sp->sign_shift) * LEVELS + (q - 1 < LEVELS - 1 ? q : 0);
}

static inline int check_block(const kvn_block *b) {
    if (b->dtype < 0 || b->dtype >= KVN_NDTYPES) return KVN_ERR_ARG;
    if (b->heads > 1 && b->head_stride < b->tokens * b->dim) return KVN_ERR_ARG;
    if (b->tokens > KVN_TANS_MAX_TOKENS || b->heads * b->tokens > 0xFFFFFFFFu) return KVN_ERR_ARG;
    return KVN_OK;
}

/* The channels in coding order: in version 2 each head's channels sorted by class (stable), so a
 * group of 8 sweeps the tables of 2-3 classes instead of 6; in version 1 in their own order. */
static inline void coding_channels(const uint8_t *cls, size_t heads, size_t dim, unsigned version, uint32_t *chan) {
    for (size_t h = 0; h < heads; h++) {
        uint32_t *out = chan + h * dim;
        const uint8_t *c = cls + h * dim;
        if (version < 2) {
            for (size_t d = 0; d < dim; d++) out[d] = (uint32_t)(h * dim + d);
            continue;
        }
        size_t at[KVN_TANS_MAX_CLASSES + 1] = {0};
        for (size_t d = 0; d < dim; d++) at[c[d] + 1]++;
        for (int k = 0; k < KVN_TANS_MAX_CLASSES; k++) at[k + 1] += at[k];
        for (size_t d = 0; d < dim; d++) out[at[c[d]]++] = (uint32_t)(h * dim + d);
    }
}

static inline size_t raw_bytes(size_t values, unsigned raw_bits) { return (values * raw_bits + 7) / 8; }

#endif
