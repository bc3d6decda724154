/* ctxans, inside: what the model, encoder, decoder and SIMD files share (not part of the core's API).
 *
 * Every value splits into its sign, its level (exponent and top mantissa bit: the
 * magnitude in half-binade steps) and raw low mantissa bits. Channels (head, dim
 * position) keep their scale over the tokens but drift from block to block, so
 * each channel of a block gets a reference (the floor of its mean level) and a
 * class of the dictionary (the cheapest for its symbols); both go first in the
 * coded stream. A value's symbol is its sign and its level relative to the
 * reference (31 steps, else an escape with the level stored aside); it is coded
 * with the distribution its class has for the context the channel's previous
 * token left: signs of post-RoPE keys persist from token to token, and a large
 * value tends to follow a large one. A row equal to an earlier row of its head
 * (the values of layer 0 repeat with their token) is named, not coded.
 *
 * The coder is rANS with 32-bit states, 15-bit frequencies and 16-bit words,
 * sixteen states interleaved (symbol i uses state i % 16), so a decoder keeps sixteen
 * independent chains in flight. kvtool/modeldict/ctxans_reference.py is the same
 * format in numpy; docs/FORMAT.md describes the bytes.
 */
#ifndef KVN_CTXANS_IMPL_H
#define KVN_CTXANS_IMPL_H
#include <stdlib.h>

#include "ctxans.h"
#include "repeats.h"
#include "values.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
/* On x86-64 the decoder's common rows run on AVX2 where the CPU has it (chosen at run time). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVN_NO_MULTIVERSION)
#include <immintrin.h>
#define KVN_AVX2_ROWS 1
#endif

/* the format's constants under the names the code uses (ctxans.h has them public) */
#define VERSION KVN_CTX_VERSION
#define FLAG_REPEATS KVN_CTX_FLAG_REPEATS
#define HEAD_SIZE KVN_CTX_HEAD_SIZE
#define STATES KVN_CTX_STATES
#define PROB_BITS KVN_CTX_PROB_BITS
#define PROB_MASK ((1u << PROB_BITS) - 1)
#define RANS_LOW KVN_CTX_RANS_LOW
#define LEVELS KVN_CTX_LEVELS
#define LOW KVN_CTX_LOW
#define REF_SYMBOLS KVN_CTX_REF_SYMBOLS

/* Class costs are summed in 16-bit lanes over at most COST_RUN tokens (a symbol costs at most
 * 8 * 15 = 120), then in 64 bits. */
#define COST_LANES KVN_CTX_MAX_CLASSES
#define COST_RUN 256

/* The decoder finds a slot's symbol in a table of BUCKETS buckets per model: a bucket's entry
 * names the symbol at its start, the next symbol and where that one starts, so one load and
 * one comparison decode a symbol; buckets that hold two or more boundaries (only symbols of
 * frequency below the bucket width, rare) say so and take the full search. */
#define BUCKET_BITS 8
#define BUCKETS (1u << BUCKET_BITS)
#define BUCKET_SHIFT (PROB_BITS - BUCKET_BITS)
#define BUCKET_SEARCH 0xFFu
#define REC_WORDS (BUCKETS + KVN_CTX_SYMBOLS)
#define FC(m, model, s) ((m)->rec[(size_t)(model) * REC_WORDS + BUCKETS + (s)])
#define RCP(m, model, s) ((m)->rcp[(size_t)(model) * KVN_CTX_SYMBOLS + (s)])

typedef struct {
    unsigned width, ebits, mbits;
} family;

/* Per dtype: bytes per value, exponent bits, mantissa bits (ctxans_model.c). */
extern const family kvn_ctx_families[KVN_NDTYPES];

struct kvn_ctx_model {
    int classes, contexts, start_context;
    int class_model, ref_model; /* the models of the side information */
    uint32_t *rec;              /* per model REC_WORDS words: its buckets (bucket_entry), then per symbol freq | cum << 16 */
    uint64_t *rcp;              /* per model and symbol: ceil(2^47 / freq), 0 for frequency 0 */
    int16_t *search;            /* per model: cum[i] ^ 0x8000, signed-comparable */
    int16_t *coarse;            /* per model: search[0], search[8], ..., search[56] */
    int16_t *cost;              /* [contexts * 64][COST_LANES]: classes' costs, zero padded */
    int32_t class_cost[KVN_CTX_MAX_CLASSES];
    uint8_t context_of[KVN_CTX_SYMBOLS];
    /* the record offset each symbol's context adds for the next token; [64]: the start context's */
    uint32_t context_off[KVN_CTX_SYMBOLS + 1];
    int avx2;                   /* the AVX2 row decoder runs here */
    uint32_t refill[256 * 8];   /* per mask of renormalising lanes: which word each lane takes */
    uint8_t tag[4];
};

/* ---- shared pieces --------------------------------------------------------------------- */

typedef struct {
    unsigned width, raw_bits, sign_shift;
    uint32_t level_mask, raw_mask;
} split;

static inline split split_of(const family *f) {
    split s = {f->width, f->mbits - 1, 8 * f->width - 1, (1u << (f->ebits + 1)) - 1, (1u << (f->mbits - 1)) - 1};
    return s;
}

KVN_INLINE unsigned symbol_of(uint32_t v, uint32_t ref, const split *sp) {
    uint32_t level = (v >> sp->raw_bits) & sp->level_mask;
    uint32_t q = level - ref - (uint32_t)LOW + 1;  /* wraps to a large number below the window */
    return (v >> sp->sign_shift) * LEVELS + (q - 1 < LEVELS - 1 ? q : 0);
}

static inline int check_block(const kvn_block *b) {
    if (b->dtype < 0 || b->dtype >= KVN_NDTYPES) return KVN_ERR_ARG;
    if (b->heads > 1 && b->head_stride < b->tokens * b->dim) return KVN_ERR_ARG;
    /* level sums and class costs stay within 32 bits, row numbers too */
    if (b->tokens > KVN_CTX_MAX_TOKENS || b->heads * b->tokens > 0xFFFFFFFFu) return KVN_ERR_ARG;
    return KVN_OK;
}

static inline size_t raw_bytes(size_t values, unsigned raw_bits) { return (values * raw_bits + 7) / 8; }

/* ---- the decoder's, shared with its SIMD rows ----------------------------------------- */

/* The symbol whose frequency interval holds `slot`: the last with cum <= slot (zero-frequency
 * symbols share their successor's cum, so they are never the last). The biased cums are sorted,
 * so the lanes above the slot are a suffix and a trailing-zero count finds the first of them. */
KVN_INLINE unsigned find_symbol(const int16_t *coarse, const int16_t *search, uint32_t slot) {
#if defined(__SSE2__)
    __m128i v = _mm_set1_epi16((short)(int16_t)(slot ^ 0x8000u));
    unsigned above = (unsigned)_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_loadu_si128((const __m128i *)coarse), v));
    unsigned g = ((unsigned)__builtin_ctz(above | 0x10000u) >> 1) - 1;
    above = (unsigned)_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_loadu_si128((const __m128i *)(search + 8 * g)), v));
    return 8 * g + ((unsigned)__builtin_ctz(above | 0x10000u) >> 1) - 1;
#else
    int16_t v = (int16_t)(slot ^ 0x8000u);
    unsigned g = 0, s = 0;
    for (int k = 1; k < 8; k++) g += coarse[k] <= v;
    for (int k = 1; k < 8; k++) s += search[8 * g + k] <= v;
    return 8 * g + s;
#endif
}

/* The decoder's tables, copied out of the model so that the compiler knows the stores of
 * decoded bytes do not change them. A model is addressed by the offset of its record in
 * `rec` (REC_WORDS words per model): a channel's class gives one part, its context the other. */
typedef struct {
    const int16_t *coarse, *search;
    const uint32_t *rec;
} dec_tables;

typedef struct {
    const uint32_t *back;
    const uint32_t *refs;
    const uint16_t *esc;
    size_t n_esc;
    const uint8_t *raw;
    const uint32_t *class_off; /* per channel: the record offset of its class's first model */
    const uint16_t *refs16;    /* the references again, 16 bits each */
} layout;

/* The values of a coded row from its symbols; *ei and *bit advance over the escapes and raw bits. */
KVN_INLINE int put_values(const layout *l, const split *sp, const uint8_t *syms, const uint32_t *refs, size_t D,
                          size_t *ei, size_t *bit, uint8_t *row, unsigned width) {
    uint32_t level_count = sp->level_mask + 1, bad = 0;
    unsigned R = sp->raw_bits;
    size_t pos = *bit;
    for (size_t d = 0; d < D; d++) {
        unsigned s = syms[d], q = s & (LEVELS - 1);
        uint32_t level = refs[d] + (uint32_t)(LOW - 1) + q;
        if (!q) {
            if (*ei == l->n_esc) return KVN_ERR_CORRUPT;
            level = l->esc[(*ei)++];
        }
        bad |= level >= level_count;
        uint32_t raw = (uint32_t)(kvn_rd64(l->raw + (pos >> 3)) >> (pos & 7)) & sp->raw_mask;
        pos += R;
        store(row + d * width, (uint32_t)(s >> 5) << sp->sign_shift | level << R | raw, width);
    }
    *bit = pos;
    return bad ? KVN_ERR_CORRUPT : KVN_OK;
}

#ifdef KVN_AVX2_ROWS
/* rans_row and put_values with AVX2 (ctxans_simd.c); called only where m->avx2 says the CPU has it. */
__attribute__((target("avx2,popcnt"))) void kvn_ctx_rans_row_avx2(
    dec_tables tab, const uint32_t *restrict class_off, uint32_t *restrict cx, const uint32_t *restrict context_off,
    uint8_t *restrict syms, size_t D, uint32_t *x, const uint8_t *words, size_t *pos_, const uint32_t *refill);
__attribute__((target("avx2"))) int kvn_ctx_put_values_bf16_avx2(const layout *l, const split *sp, const uint8_t *syms,
                                                                 size_t c0, size_t D, size_t *ei, size_t *bit,
                                                                 uint8_t *row);
#endif

#endif
