/* ctxtans's shared pieces: the chunk's constants, the model, how values split, the escapes and raw bits
 * of a chunk, a bit writer (ctxtans.c holds the model and decodes versions 1 and 2; ctxtans_lanes*.c
 * decode chunk version 3, ctxtans_encode.c and ctxtans_lanes_encode.c encode it). */
#ifndef KVN_CTXTANS_IMPL_H
#define KVN_CTXTANS_IMPL_H
#include "ctxtans.h"
#include "repeats.h"
#include "values.h"

#define VERSION 3 /* what the encoder writes; chunks of versions 1 and 2 still decode */
#define MODE_DICT 0
#define MODE_EXPHUFF 1
#define FLAG_REPEATS 1u
#define HEAD_SIZE 18 /* version, mode, flags, reserved, tag[4], u16 base, u32 escapes, u32 stream bytes */
#define STATES 8 /* versions 1 and 2: symbol i takes state i % 8 */
#define GROUP 8 /* versions 1 and 2: values are coded a group of channels at a time, each group token by token */
#define LANES 64 /* version 3: a group is 64 channels of a head, each with its own rANS state (its lane) */
#define RANS_LOW (1u << 23) /* version 3's states lie in [RANS_LOW, 2^31), refilled a byte at a time */
#define HELD_PER_STATE 30 /* version 3's states start from 2^30 plus 30 of the raw plane's last bits each */
#define HELD_BITS (LANES * HELD_PER_STATE)
#define BUCKETS (T / 16) /* version 3's decoders find a slot's symbol in buckets of 16 slots */
#define L KVN_TANS_LOG
#define T KVN_TANS_SIZE
#define LEVELS 32
#define LOW (-22)
#define REF_SYMBOLS 32
#define COST_LANES KVN_TANS_MAX_CLASSES /* the cost rows' stride: 32 when the classes fit, else 64 */
#define COST_RUN 512 /* tokens summed in 16-bit lanes: a symbol costs at most 8 * 11 */
#define MIN_STREAM 12 /* eight states of 11 bits and the end marker */

/* The tANS loops read variable bit fields: with BMI2 (x86-64-v3) a read is shrx + bzhi. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KVN_NO_MULTIVERSION)
#define KVN_TANS_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVN_TANS_MULTIVERSION
#endif
/* The lane kernels of chunk version 3 have AVX2 and AVX-512 variants on x86-64 (GCC and Clang), chosen
 * at each call by kvn_isa() (isa.c); every build keeps the portable one. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVN_NO_MULTIVERSION)
#define KVN_LANES_X86 1
#define KVN_TARGET_AVX2 __attribute__((target("avx2,bmi,bmi2,popcnt,lzcnt")))
#define KVN_TARGET_AVX512 \
    __attribute__((target("avx2,bmi,bmi2,popcnt,lzcnt,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vpopcntdq")))
#endif

struct kvn_tans_model {
    int classes, contexts, start_context;
    size_t class_model, ref_model;
    uint32_t *dec;    /* versions 1 and 2, per model and state: symbol | nbits << 6 | (context_of[symbol] << 11 | base) << 16 */
    /* version 3 (rANS), per symbol model and bucket of 16 slots: its first slot's symbol | bit 8 + i set where a
     * symbol starts at its slot i (1-15), so a slot's symbol is the first plus the starts at or before it */
    uint32_t *bucket;
    uint32_t *fcx;    /* version 3, per model and symbol: g | cum << 12 | context_of[symbol] << 24 */
    uint32_t *rcp;    /* version 3's encoder, per model and symbol: the reciprocal of g (x / g = x * rcp >> 32 >> shift) */
    uint32_t *rec;    /* version 3's encoder, per model and symbol: g | shift << 12 | bias << 16 */
    uint8_t refill_index[256][8]; /* version 3's AVX2 decoder: per mask of 8 lanes, which of the next bytes each takes */
    uint8_t *cost;    /* [contexts * 64][cost_lanes]: classes' costs (at most 8 * 11), zero padded */
    int cost_lanes;
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

/* Returns CALL(bytes a value, raw bits, sign shift, level count) for a dtype: loops written once and specialised
 * on each dtype's constants. */
#define RETURN_BY_DTYPE(dtype, CALL)              \
    switch (dtype) {                              \
    case KVN_BF16: return CALL(2, 6, 15, 512);    \
    case KVN_FP16: return CALL(2, 9, 15, 64);     \
    case KVN_FP32: return CALL(4, 22, 31, 512);   \
    case KVN_FP8_E4M3: return CALL(1, 2, 7, 32);  \
    default: return CALL(1, 1, 7, 64);            \
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

/* The chunk's escape list and raw bits, handed out in order. */
typedef struct {
    const uint8_t *esc;
    size_t n_esc, esc_at;
    const uint8_t *raw;
    uint64_t raw_pos;
} side_data;

KVN_INLINE int next_escape(side_data *sd, uint32_t *level) {
    if (sd->esc_at == sd->n_esc) return 0;
    *level = sd->esc[2 * sd->esc_at] | (uint32_t)sd->esc[2 * sd->esc_at + 1] << 8;
    sd->esc_at++;
    return 1;
}

/* ---- writing bits ---------------------------------------------------------------------- */

typedef struct {
    uint8_t *p;
    uint64_t acc;
    unsigned n;
} bit_writer;

/* Appends the nb (at most 56) low bits of v, LSB first. */
KVN_INLINE void put_bits(bit_writer *w, uint64_t v, unsigned nb) {
    w->acc |= v << w->n;
    w->n += nb;
    kvn_wr64(w->p, w->acc);
    w->p += w->n >> 3;
    w->acc >>= w->n & ~7u; /* n < 8 + 56: never a whole word */
    w->n &= 7;
}

/* The bytes written from `start`; the last partial byte zero padded. */
static inline size_t finish_bits(bit_writer *w, uint8_t *start) {
    if (w->n) *w->p++ = (uint8_t)w->acc;
    return (size_t)(w->p - start);
}

/* ---- chunk version 3: lanes ----------------------------------------------------------- */

/* The raw bits of a chunk's coded values a version holds in its raw section (version 3 holds the last
 * HELD_BITS in its states). */
static inline uint64_t section_bits(unsigned version, uint64_t raw_bits) {
    return version < 3 ? raw_bits : raw_bits > HELD_BITS ? raw_bits - HELD_BITS : 0;
}

/* A version 3 chunk's sections (ctxtans.c reads them): each row's repeat distance, the escapes and raw
 * section, the rANS stream, the base reference and how many raw bits the coded values have. */
typedef struct {
    const uint32_t *back;
    side_data *side;
    const uint8_t *stream;
    size_t stream_len;
    uint32_t base;
    uint64_t raw_bits;
} lane_chunk;

/* A version 3 chunk's stream and values, into the block at dst (ctxtans_lanes.c). */
int kvn_tans_lanes_decode(const kvn_tans_model *m, const kvn_block *b, const lane_chunk *c, uint8_t *dst);
/* Version 3's stream at out (ctxtans_lanes_encode.c): sym[t * C + c] the symbols, cls and refs per channel,
 * chan the channels in coding order, x the states to start from; its bytes in *written. */
int kvn_tans_lanes_encode(const kvn_tans_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                          const uint32_t *chan, const uint8_t *cls, const uint32_t *refs, uint32_t base, uint32_t *x,
                          uint8_t *out, size_t *written);

#endif
