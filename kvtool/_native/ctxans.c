/* ctxans: a float KV block coded with a model dictionary's context models and interleaved rANS.
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
 * independent chains in flight. kvtool/_native/ctxans_reference.py is the same
 * format in numpy; docs/FORMAT.md describes the bytes.
 */
#include <stdlib.h>

#include "ctxans.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
/* On x86-64 the decoder's common rows run on AVX2 where the CPU has it (chosen at run time). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVN_NO_MULTIVERSION)
#include <immintrin.h>
#define KVN_AVX2_ROWS 1
#endif

#define VERSION 1
#define FLAG_REPEATS 1u
#define HEAD_SIZE 16 /* version, flags, tag[4], u16 base reference, u32 escapes, u32 rANS bytes */
#define STATES 16
#define PROB_BITS 15
#define PROB_MASK ((1u << PROB_BITS) - 1)
#define RANS_LOW (1u << 16)
#define LEVELS 32
#define LOW (-22)
#define REF_SYMBOLS 32

#define KVN_INLINE static inline __attribute__((always_inline))

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

typedef struct {
    unsigned width, ebits, mbits;
} family;

static const family FAMILIES[KVN_NDTYPES] = {
    [KVN_BF16] = {2, 8, 7},
    [KVN_FP16] = {2, 5, 10},
    [KVN_FP32] = {4, 8, 23},
    [KVN_FP8_E4M3] = {1, 4, 3},
    [KVN_FP8_E5M2] = {1, 5, 2},
};

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

/* The symbol whose interval holds `slot`. */
static unsigned symbol_at(const uint16_t *cum, const uint16_t *freq, uint32_t slot) {
    unsigned s = 0;
    while (s + 1 < KVN_CTX_SYMBOLS && cum[s + 1] <= slot) s++;
    (void)freq;
    return s;
}

/* A bucket's entry: first symbol | second symbol << 8 | second's start << 16, the second being
 * the first's successor inside the bucket (or the first itself, starting past every slot);
 * second == BUCKET_SEARCH when the bucket holds more than one boundary. */
static uint32_t bucket_entry(const uint16_t *cum, const uint16_t *freq, uint32_t b) {
    uint32_t lo = b << BUCKET_SHIFT, hi = lo + (1u << BUCKET_SHIFT) - 1;
    unsigned first = symbol_at(cum, freq, lo), last = symbol_at(cum, freq, hi);
    if (first == last) return first | first << 8 | 0x8000u << 16;
    unsigned second = symbol_at(cum, freq, cum[first] + freq[first]);
    if (second != last) return first | BUCKET_SEARCH << 8;
    return first | second << 8 | (uint32_t)cum[second] << 16;
}

kvn_ctx_model *kvn_ctx_model_new(int classes, int contexts, int start_context, const uint16_t *freq,
                                 const uint16_t *cum, const int32_t *cost, const int32_t *class_cost,
                                 const uint8_t *context_of, const uint8_t tag[4]) {
    if (classes < 1 || classes > KVN_CTX_MAX_CLASSES || contexts < 1 || contexts > KVN_CTX_MAX_CONTEXTS ||
        start_context < 0 || start_context >= contexts)
        return NULL;
    size_t models = (size_t)classes * (size_t)contexts + 2;
    for (size_t k = 0; k < models; k++) {
        uint32_t total = 0;
        for (int s = 0; s < KVN_CTX_SYMBOLS; s++) {
            uint16_t f = freq[k * KVN_CTX_SYMBOLS + s];
            if (cum[k * KVN_CTX_SYMBOLS + s] != total || (f == 0 && k + 2 < models)) return NULL;
            total += f;
        }
        if (total != 1u << PROB_BITS) return NULL;
    }
    for (int s = 0; s < KVN_CTX_SYMBOLS; s++)
        if (context_of[s] >= contexts) return NULL;
    for (size_t i = 0; i < (size_t)contexts * KVN_CTX_SYMBOLS * (size_t)classes; i++)
        if (cost[i] < 0 || cost[i] > 8 * PROB_BITS) return NULL;
    kvn_ctx_model *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->rec = malloc(models * REC_WORDS * sizeof(uint32_t));
    m->rcp = malloc(models * KVN_CTX_SYMBOLS * sizeof(uint64_t));
    m->search = malloc(models * KVN_CTX_SYMBOLS * sizeof(int16_t));
    m->coarse = malloc(models * 8 * sizeof(int16_t));
    m->cost = calloc((size_t)contexts * KVN_CTX_SYMBOLS * COST_LANES, sizeof(int16_t));
    if (!m->rec || !m->rcp || !m->search || !m->coarse || !m->cost) {
        kvn_ctx_model_free(m);
        return NULL;
    }
    m->classes = classes;
    m->contexts = contexts;
    m->start_context = start_context;
    m->class_model = classes * contexts;
    m->ref_model = classes * contexts + 1;
    for (size_t i = 0; i < models * KVN_CTX_SYMBOLS; i++) {
        FC(m, i / KVN_CTX_SYMBOLS, i % KVN_CTX_SYMBOLS) = freq[i] | (uint32_t)cum[i] << 16;
        m->rcp[i] = freq[i] ? ((1ull << 47) + freq[i] - 1) / freq[i] : 0;
        m->search[i] = (int16_t)(cum[i] ^ 0x8000u);
    }
    for (size_t k = 0; k < models; k++)
        for (int g = 0; g < 8; g++) m->coarse[k * 8 + g] = m->search[k * KVN_CTX_SYMBOLS + 8 * g];
    for (size_t k = 0; k < models; k++)
        for (uint32_t b = 0; b < BUCKETS; b++)
            m->rec[k * REC_WORDS + b] = bucket_entry(cum + k * KVN_CTX_SYMBOLS, freq + k * KVN_CTX_SYMBOLS, b);
    for (size_t r = 0; r < (size_t)contexts * KVN_CTX_SYMBOLS; r++)
        for (int k = 0; k < classes; k++) m->cost[r * COST_LANES + k] = (int16_t)cost[r * (size_t)classes + (size_t)k];
    memcpy(m->class_cost, class_cost, (size_t)classes * sizeof(int32_t));
    memcpy(m->context_of, context_of, KVN_CTX_SYMBOLS);
    for (int sym = 0; sym < KVN_CTX_SYMBOLS; sym++) m->context_off[sym] = (uint32_t)context_of[sym] * REC_WORDS;
    m->context_off[KVN_CTX_SYMBOLS] = (uint32_t)start_context * REC_WORDS;
    for (unsigned mask = 0; mask < 256; mask++)
        for (unsigned lane = 0; lane < 8; lane++)
            m->refill[mask * 8 + lane] = (uint32_t)__builtin_popcount(mask & ((1u << lane) - 1));
#ifdef KVN_AVX2_ROWS
    __builtin_cpu_init();
    m->avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
#endif
    memcpy(m->tag, tag, 4);
    return m;
}

void kvn_ctx_model_free(kvn_ctx_model *m) {
    if (!m) return;
    free(m->rec);
    free(m->rcp);
    free(m->search);
    free(m->coarse);
    free(m->cost);
    free(m);
}

/* ---- shared pieces --------------------------------------------------------------------- */

KVN_INLINE uint32_t load(const uint8_t *p, unsigned width) {
    if (width == 2) { uint16_t v; memcpy(&v, p, 2); return v; }
    if (width == 4) { uint32_t v; memcpy(&v, p, 4); return v; }
    return *p;
}

KVN_INLINE void store(uint8_t *p, uint32_t v, unsigned width) {
    if (width == 2) { uint16_t w = (uint16_t)v; memcpy(p, &w, 2); }
    else if (width == 4) memcpy(p, &v, 4);
    else *p = (uint8_t)v;
}

typedef struct {
    unsigned width, raw_bits, sign_shift;
    uint32_t level_mask, raw_mask;
} split;

static split split_of(const family *f) {
    split s = {f->width, f->mbits - 1, 8 * f->width - 1, (1u << (f->ebits + 1)) - 1, (1u << (f->mbits - 1)) - 1};
    return s;
}

KVN_INLINE unsigned symbol_of(uint32_t v, uint32_t ref, const split *sp) {
    uint32_t level = (v >> sp->raw_bits) & sp->level_mask;
    uint32_t q = level - ref - (uint32_t)LOW + 1;  /* wraps to a large number below the window */
    return (v >> sp->sign_shift) * LEVELS + (q - 1 < LEVELS - 1 ? q : 0);
}

static int check_block(const kvn_block *b) {
    if (b->dtype < 0 || b->dtype >= KVN_NDTYPES) return KVN_ERR_ARG;
    if (b->heads > 1 && b->head_stride < b->tokens * b->dim) return KVN_ERR_ARG;
    /* level sums and class costs stay within 32 bits, row numbers too */
    if (b->tokens > KVN_CTX_MAX_TOKENS || b->heads * b->tokens > 0xFFFFFFFFu) return KVN_ERR_ARG;
    return KVN_OK;
}

static size_t raw_bytes(size_t values, unsigned raw_bits) { return (values * raw_bits + 7) / 8; }

size_t kvn_ctx_bound(const kvn_block *b) {
    size_t n = b->heads * b->tokens * b->dim, channels = b->heads * b->dim, rows = b->heads * b->tokens;
    unsigned raw_bits = FAMILIES[b->dtype].mbits - 1;
    return HEAD_SIZE + 4 + (rows + 7) / 8 + 5 * rows + 2 * (n + channels) + raw_bytes(n, raw_bits) + 8 +
           4 * STATES + 2 * (n + 2 * channels) + 8;
}

/* For each row (t, h) in back[t * heads + h]: how many tokens back the nearest earlier equal row
 * of the head is, 0 for none. Rows are found by hash and confirmed byte for byte. */
static int find_repeats(const kvn_block *b, const uint8_t *src, unsigned width, uint32_t *back, size_t *repeated) {
    size_t T = b->tokens, row_bytes = b->dim * width, size = 16;
    while (size < 2 * T) size <<= 1;
    uint64_t *hashes = malloc(size * sizeof(uint64_t));
    uint32_t *latest = malloc(size * sizeof(uint32_t)); /* token + 1 of the latest row with that hash; 0: empty */
    if (!hashes || !latest) {
        free(hashes);
        free(latest);
        return KVN_ERR_NOMEM;
    }
    *repeated = 0;
    for (size_t h = 0; h < b->heads; h++) {
        const uint8_t *head = src + h * b->head_stride * width;
        memset(latest, 0, size * sizeof(uint32_t));
        for (size_t t = 0; t < T; t++) {
            const uint8_t *row = head + t * row_bytes;
            uint64_t hash = kvn_xxh3_64(row, row_bytes);
            size_t slot = (size_t)hash & (size - 1);
            while (latest[slot] && hashes[slot] != hash) slot = (slot + 1) & (size - 1);
            uint32_t found = 0;
            if (latest[slot]) {
                size_t prev = latest[slot] - 1;
                if (!memcmp(head + prev * row_bytes, row, row_bytes)) found = (uint32_t)(t - prev);
                else /* two rows with one hash: look back row by row, as the format defines */
                    for (size_t u = t; u-- > 0;)
                        if (!memcmp(head + u * row_bytes, row, row_bytes)) { found = (uint32_t)(t - u); break; }
            }
            hashes[slot] = hash;
            latest[slot] = (uint32_t)(t + 1);
            back[t * b->heads + h] = found;
            *repeated += found != 0;
        }
    }
    free(hashes);
    free(latest);
    return KVN_OK;
}

/* ---- encode --------------------------------------------------------------------------- */

/* Code one symbol (its freq | cum << 16, and rcp = ceil(2^47 / freq)) with state *x, renormalising
 * into the words below *words. The word is written whether it is needed or not (below the stream,
 * where the next word goes), so nothing branches on the state; x / freq is one multiplication,
 * exact for x < 2^32 and freq <= 2^15. */
KVN_INLINE void rans_put(uint32_t *x, uint32_t fc, uint64_t rcp, uint8_t **words) {
    uint32_t f = fc & 0xFFFF, v = *x;
    uint32_t need = v >= f << (32 - PROB_BITS);
    (*words)[-2] = (uint8_t)v;
    (*words)[-1] = (uint8_t)(v >> 8);
    *words -= 2 * need;
    v >>= 16 * need;
    uint32_t q = (uint32_t)(((unsigned __int128)v * rcp) >> 47);
    *x = (q << PROB_BITS) + (v - q * f) + (fc >> 16);
}

KVN_INLINE void symbols_w(const kvn_block *b, const uint8_t *src, const uint32_t *refs, const split *sp,
                          uint8_t *restrict sym, unsigned width) {
    size_t H = b->heads, T = b->tokens, D = b->dim, C = H * D;
    for (size_t h = 0; h < H; h++)
        for (size_t t = 0; t < T; t++) {
            const uint8_t *row = src + (h * b->head_stride + t * D) * width;
            uint8_t *s = sym + t * C + h * D;
            const uint32_t *r = refs + h * D;
            for (size_t d = 0; d < D; d++) s[d] = (uint8_t)symbol_of(load(row + d * width, width), r[d], sp);
        }
}

KVN_INLINE void level_sums_w(const kvn_block *b, const uint8_t *src, const split *sp, uint32_t *restrict sum,
                             unsigned width) {
    size_t D = b->dim;
    for (size_t h = 0; h < b->heads; h++)
        for (size_t t = 0; t < b->tokens; t++) {
            const uint8_t *row = src + (h * b->head_stride + t * D) * width;
            uint32_t *s = sum + h * D;
            for (size_t d = 0; d < D; d++) s[d] += (load(row + d * width, width) >> sp->raw_bits) & sp->level_mask;
        }
}

KVN_MULTIVERSION
static void symbols(const kvn_block *b, const uint8_t *src, uint32_t *refs, const split *sp, uint8_t *sym) {
    size_t C = b->heads * b->dim;
    memset(refs, 0, C * sizeof(uint32_t));
    switch (sp->width) {
    case 2: level_sums_w(b, src, sp, refs, 2); break;
    case 4: level_sums_w(b, src, sp, refs, 4); break;
    default: level_sums_w(b, src, sp, refs, 1);
    }
    for (size_t c = 0; c < C; c++) refs[c] /= (uint32_t)b->tokens;
    switch (sp->width) {
    case 2: symbols_w(b, src, refs, sp, sym, 2); break;
    case 4: symbols_w(b, src, refs, sp, sym, 4); break;
    default: symbols_w(b, src, refs, sp, sym, 1);
    }
}

/* Each channel's class: the cheapest for its coded symbols in their contexts, the lowest on a tie.
 * A channel at a time, its classes' running costs in 16-bit lanes the compiler keeps in registers. */
KVN_INLINE void channel_costs(const kvn_ctx_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                              size_t c, int64_t *total, size_t lanes) {
    size_t H = b->heads, C = H * b->dim, h = c / b->dim;
    const int16_t *restrict table = m->cost;
    for (size_t t0 = 0; t0 < b->tokens; t0 += COST_RUN) {
        int16_t acc[COST_LANES] = {0};
        size_t t1 = t0 + COST_RUN < b->tokens ? t0 + COST_RUN : b->tokens;
        for (size_t t = t0; t < t1; t++) {
            if (back[t * H + h]) continue;
            unsigned ctx = t ? m->context_of[sym[(t - 1) * C + c]] : (unsigned)m->start_context;
            const int16_t *restrict row = table + ((size_t)ctx * KVN_CTX_SYMBOLS + sym[t * C + c]) * COST_LANES;
            for (size_t k = 0; k < lanes; k++) acc[k] = (int16_t)(acc[k] + row[k]);
        }
        for (size_t k = 0; k < lanes; k++) total[k] += acc[k];
    }
}

KVN_MULTIVERSION
static void choose_classes(const kvn_ctx_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                           uint8_t *cls) {
    size_t C = b->heads * b->dim, N = (size_t)m->classes;
    for (size_t c = 0; c < C; c++) {
        int64_t total[COST_LANES] = {0};
        if (N <= 16) channel_costs(m, b, sym, back, c, total, 16);
        else if (N <= 32) channel_costs(m, b, sym, back, c, total, 32);
        else channel_costs(m, b, sym, back, c, total, COST_LANES);
        size_t best = 0;
        for (size_t k = 1; k < N; k++)
            if (total[k] + m->class_cost[k] < total[best] + m->class_cost[best]) best = k;
        cls[c] = (uint8_t)best;
    }
}

/* Escaped levels (after the references' escapes already in esc) and the raw bits of the coded values. */
KVN_INLINE void escapes_and_raw_w(const kvn_block *b, const uint8_t *src, const uint8_t *sym, const uint32_t *back,
                                  const split *sp, uint16_t *esc, size_t *n_esc, uint8_t *raw, unsigned width) {
    size_t H = b->heads, D = b->dim, C = H * D, ne = *n_esc;
    uint64_t acc = 0;
    unsigned bits = 0, R = sp->raw_bits;
    uint8_t *out = raw;
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++) {
            if (back[t * H + h]) continue;
            const uint8_t *row = src + (h * b->head_stride + t * D) * width;
            const uint8_t *s = sym + t * C + h * D;
            for (size_t d = 0; d < D; d++) {
                uint32_t v = load(row + d * width, width);
                if (!(s[d] & (LEVELS - 1))) esc[ne++] = (uint16_t)((v >> R) & sp->level_mask);
                acc |= (uint64_t)(v & sp->raw_mask) << bits;
                bits += R;
                if (bits >= 32) {
                    kvn_wr32(out, (uint32_t)acc);
                    out += 4;
                    acc >>= 32;
                    bits -= 32;
                }
            }
        }
    for (; bits > 0; bits = bits > 8 ? bits - 8 : 0) {
        *out++ = (uint8_t)acc;
        acc >>= 8;
    }
    *n_esc = ne;
}

static void escapes_and_raw(const kvn_block *b, const uint8_t *src, const uint8_t *sym, const uint32_t *back,
                            const split *sp, uint16_t *esc, size_t *n_esc, uint8_t *raw) {
    switch (sp->width) {
    case 2: escapes_and_raw_w(b, src, sym, back, sp, esc, n_esc, raw, 2); break;
    case 4: escapes_and_raw_w(b, src, sym, back, sp, esc, n_esc, raw, 4); break;
    default: escapes_and_raw_w(b, src, sym, back, sp, esc, n_esc, raw, 1);
    }
}

#define RCP(m, model, s) ((m)->rcp[(size_t)(model) * KVN_CTX_SYMBOLS + (s)])

/* The coded values, backwards, when every row's symbols fill whole rounds of the states starting
 * on state 0 (dim a multiple of 16, as in the common geometries): each state index is a constant,
 * so the states stay in registers. */
KVN_MULTIVERSION
static void put_values_aligned(const kvn_ctx_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                               const uint8_t *cls, uint32_t *xs, uint8_t **words_) {
    size_t H = b->heads, D = b->dim, C = H * D, X = (size_t)m->contexts, start = (size_t)m->start_context;
    uint32_t x[STATES];
    memcpy(x, xs, sizeof(x));
    uint8_t *words = *words_;
    for (size_t t = b->tokens; t-- > 0;) {
        const uint8_t *s = sym + t * C, *prev = t ? s - C : NULL;
        for (size_t h = H; h-- > 0;) {
            if (back[t * H + h]) continue;
            for (size_t d = (h + 1) * D; d > h * D;) {
                d -= STATES;
#define PUT(k)                                                                                    \
    do {                                                                                          \
        size_t c = d + (k), model = (size_t)cls[c] * X + (prev ? m->context_of[prev[c]] : start); \
        rans_put(&x[k], FC(m, model, s[c]), RCP(m, model, s[c]), &words);                         \
    } while (0)
                PUT(15); PUT(14); PUT(13); PUT(12); PUT(11); PUT(10); PUT(9); PUT(8);
                PUT(7); PUT(6); PUT(5); PUT(4); PUT(3); PUT(2); PUT(1); PUT(0);
#undef PUT
            }
        }
    }
    memcpy(xs, x, sizeof(x));
    *words_ = words;
}

/* The rANS stream, written backwards from `end`; returns its first byte. */
KVN_MULTIVERSION
static uint8_t *encode_stream(const kvn_ctx_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                              const uint8_t *cls, const uint32_t *refs, uint32_t base, size_t n_coded, uint8_t *end) {
    size_t H = b->heads, D = b->dim, C = H * D, X = (size_t)m->contexts;
    uint32_t x[STATES];
    for (int j = 0; j < STATES; j++) x[j] = RANS_LOW;
    uint8_t *words = end;
    if (D % STATES == 0 && (2 * C) % STATES == 0) {
        put_values_aligned(m, b, sym, back, cls, x, &words);
    } else {
        size_t i = 2 * C + n_coded;
        for (size_t t = b->tokens; t-- > 0;) {
            const uint8_t *s = sym + t * C, *prev = t ? s - C : NULL;
            for (size_t h = H; h-- > 0;) {
                if (back[t * H + h]) continue;
                for (size_t c = (h + 1) * D; c-- > h * D;) {
                    size_t ctx = prev ? m->context_of[prev[c]] : (size_t)m->start_context;
                    size_t model = (size_t)cls[c] * X + ctx;
                    i--;
                    rans_put(&x[i % STATES], FC(m, model, s[c]), RCP(m, model, s[c]), &words);
                }
            }
        }
    }
    for (size_t c = C; c-- > 0;) {
        uint32_t offset = refs[c] - base;
        offset = offset < REF_SYMBOLS - 1 ? offset : REF_SYMBOLS - 1;
        rans_put(&x[(2 * c + 1) % STATES], FC(m, m->ref_model, offset), RCP(m, m->ref_model, offset), &words);
        rans_put(&x[(2 * c) % STATES], FC(m, m->class_model, cls[c]), RCP(m, m->class_model, cls[c]), &words);
    }
    uint8_t *p = words - 4 * STATES;
    for (int j = 0; j < STATES; j++) kvn_wr32(p + 4 * j, x[j]);
    return p;
}

static uint8_t *put_varint(uint8_t *p, uint32_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

static void write_head(uint8_t *p, unsigned flags, const uint8_t tag[4], uint32_t base, size_t n_esc, size_t stream) {
    p[0] = VERSION;
    p[1] = (uint8_t)flags;
    memcpy(p + 2, tag, 4);
    p[6] = (uint8_t)base;
    p[7] = (uint8_t)(base >> 8);
    kvn_wr32(p + 8, (uint32_t)n_esc);
    kvn_wr32(p + 12, (uint32_t)stream);
}

int kvn_ctx_encode(const kvn_ctx_model *m, const kvn_block *b, const void *src_, uint8_t *dst, size_t *written) {
    int rc = check_block(b);
    if (rc) return rc;
    const split sp = split_of(&FAMILIES[b->dtype]);
    const uint8_t *src = src_;
    size_t H = b->heads, T = b->tokens, D = b->dim, C = H * D, n = H * T * D;
    if (!n) {
        write_head(dst, 0, m->tag, 0, 0, 0);
        *written = HEAD_SIZE;
        return KVN_OK;
    }
    uint32_t *refs = malloc(C * sizeof(uint32_t));
    uint32_t *back = malloc(T * H * sizeof(uint32_t));
    uint8_t *sym = malloc(n);
    uint8_t *cls = malloc(C);
    uint16_t *esc = malloc((n + C) * sizeof(uint16_t));
    size_t raw_room = raw_bytes(n, sp.raw_bits) + 8, stream_room = 4 * STATES + 2 * (n + 2 * C);
    uint8_t *raw = malloc(raw_room + stream_room);
    if (!refs || !back || !sym || !cls || !esc || !raw) { rc = KVN_ERR_NOMEM; goto done; }

    size_t repeated = 0;
    rc = find_repeats(b, src, sp.width, back, &repeated);
    if (rc) goto done;
    symbols(b, src, refs, &sp, sym);
    choose_classes(m, b, sym, back, cls);
    uint32_t base = refs[0];
    for (size_t c = 1; c < C; c++) base = refs[c] < base ? refs[c] : base;
    size_t n_esc = 0, n_coded = (T * H - repeated) * D;
    for (size_t c = 0; c < C; c++)
        if (refs[c] - base >= REF_SYMBOLS - 1) esc[n_esc++] = (uint16_t)refs[c];
    escapes_and_raw(b, src, sym, back, &sp, esc, &n_esc, raw);
    uint8_t *stream_end = raw + raw_room + stream_room;
    uint8_t *stream = encode_stream(m, b, sym, back, cls, refs, base, n_coded, stream_end);
    size_t stream_len = (size_t)(stream_end - stream);

    uint8_t *p = dst + HEAD_SIZE;
    if (repeated) {
        uint8_t *body = p + 4, *q = body + (T * H + 7) / 8;
        memset(body, 0, (T * H + 7) / 8);
        for (size_t r = 0; r < T * H; r++)
            if (back[r]) {
                body[r >> 3] |= (uint8_t)(1u << (r & 7));
                q = put_varint(q, back[r] - 1);
            }
        kvn_wr32(p, (uint32_t)(q - body));
        p = q;
    }
    for (size_t k = 0; k < n_esc; k++, p += 2) {
        p[0] = (uint8_t)esc[k];
        p[1] = (uint8_t)(esc[k] >> 8);
    }
    memcpy(p, raw, raw_bytes(n_coded, sp.raw_bits));
    p += raw_bytes(n_coded, sp.raw_bits);
    memcpy(p, stream, stream_len);
    p += stream_len;
    write_head(dst, repeated ? FLAG_REPEATS : 0, m->tag, base, n_esc, stream_len);
    *written = (size_t)(p - dst);
done:
    free(refs);
    free(back);
    free(sym);
    free(cls);
    free(esc);
    free(raw);
    return rc;
}

/* ---- decode --------------------------------------------------------------------------- */

/* What the decoder reads words from: a copy of them followed by zeros, so that a row's symbols
 * read without a bounds check once the row starts within the words; a stream that ends early
 * reads zeros, and the checks at the end (every word used, none more) refuse it. */
typedef struct {
    const uint8_t *words;
    size_t pos, len;
} word_reader;

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



/* Decode one symbol with the model at record offset `off` and state *x; *pos moves over the words. */
KVN_INLINE unsigned rans_get(dec_tables t, uint32_t *x, size_t off, const uint8_t *words, size_t *pos) {
    uint32_t v = *x, slot = v & PROB_MASK;
    const uint32_t *rec = t.rec + off;
    uint32_t e = rec[slot >> BUCKET_SHIFT];
    uint32_t first = e & 0xFF, second = (e >> 8) & 0xFF;
    unsigned s = first + ((second - first) & (0u - (uint32_t)(slot >= e >> 16)));
    if (__builtin_expect(second == BUCKET_SEARCH, 0)) {
        size_t model = off / REC_WORDS;
        s = find_symbol(t.coarse + model * 8, t.search + model * KVN_CTX_SYMBOLS, slot);
    }
    uint32_t fc = rec[BUCKETS + s];
    v = (fc & 0xFFFF) * (v >> PROB_BITS) + slot - (fc >> 16);
    uint32_t word = (uint32_t)words[*pos] | (uint32_t)words[*pos + 1] << 8;
    uint32_t need = v < RANS_LOW; /* about one symbol in four: arithmetic, not a branch */
    *x = v << (need << 4) | (word & (0u - need));
    *pos += need << 1;
    return s;
}

static dec_tables tables_of(const kvn_ctx_model *m) {
    dec_tables t = {m->coarse, m->search, m->rec};
    return t;
}

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

/* A row whose symbols fill whole rounds of the states, starting on state 0 (the common geometry:
 * dim a multiple of 16): the state of each symbol is a constant. */
KVN_INLINE void rans_row(dec_tables tab, const uint32_t *restrict class_off, uint32_t *restrict cx,
                         const uint32_t *restrict context_off, uint8_t *restrict syms, size_t D, uint32_t *x,
                         const uint8_t *words, size_t *pos) {
    for (size_t d = 0; d < D; d += STATES) {
#pragma GCC unroll 16
        for (int k = 0; k < STATES; k++) {
            unsigned s = rans_get(tab, &x[k], class_off[d + k] + cx[d + k], words, pos);
            cx[d + k] = context_off[s];
            syms[d + k] = (uint8_t)s;
        }
    }
}

#ifdef KVN_AVX2_ROWS

/* rans_row with AVX2: states 0-7 and 8-15 are two vectors, each decoding eight channels at once.
 * Words are handed to the lanes that renormalise in lane order, as the scalar decoder reads them. */
__attribute__((target("avx2,popcnt"))) static void rans_row_avx2(
    dec_tables tab, const uint32_t *restrict class_off, uint32_t *restrict cx, const uint32_t *restrict context_off,
    uint8_t *restrict syms, size_t D, uint32_t *x, const uint8_t *words, size_t *pos_, const uint32_t *refill) {
    const __m256i slot_mask = _mm256_set1_epi32(PROB_MASK), byte = _mm256_set1_epi32(0xFF);
    const __m256i low = _mm256_set1_epi32(0xFFFF), search = _mm256_set1_epi32(BUCKET_SEARCH);
    const __m256i to_fc = _mm256_set1_epi32(BUCKETS), one = _mm256_set1_epi32(1);
    const int *rec = (const int *)tab.rec;
    size_t pos = *pos_;
    __m256i xs[2] = {_mm256_loadu_si256((const __m256i *)x), _mm256_loadu_si256((const __m256i *)(x + 8))};
    for (size_t d = 0; d < D; d += 8) {
        __m256i v = xs[(d >> 3) & 1];
        __m256i slot = _mm256_and_si256(v, slot_mask);
        __m256i off = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(class_off + d)),
                                       _mm256_loadu_si256((const __m256i *)(cx + d)));
        __m256i e = _mm256_i32gather_epi32(rec, _mm256_add_epi32(off, _mm256_srli_epi32(slot, BUCKET_SHIFT)), 4);
        __m256i first = _mm256_and_si256(e, byte), second = _mm256_and_si256(_mm256_srli_epi32(e, 8), byte);
        __m256i take = _mm256_cmpgt_epi32(_mm256_add_epi32(slot, one), _mm256_srli_epi32(e, 16));
        __m256i s = _mm256_add_epi32(first, _mm256_and_si256(_mm256_sub_epi32(second, first), take));
        unsigned hard = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(second, search)));
        if (__builtin_expect(hard != 0, 0)) {
            uint32_t sv[8], slots[8], offs[8];
            _mm256_storeu_si256((__m256i *)sv, s);
            _mm256_storeu_si256((__m256i *)slots, slot);
            _mm256_storeu_si256((__m256i *)offs, off);
            for (; hard; hard &= hard - 1) {
                int k = __builtin_ctz(hard);
                size_t model = offs[k] / REC_WORDS;
                sv[k] = find_symbol(tab.coarse + model * 8, tab.search + model * KVN_CTX_SYMBOLS, slots[k]);
            }
            s = _mm256_loadu_si256((const __m256i *)sv);
        }
        __m256i fc = _mm256_i32gather_epi32(rec, _mm256_add_epi32(_mm256_add_epi32(off, to_fc), s), 4);
        v = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_and_si256(fc, low), _mm256_srli_epi32(v, PROB_BITS)),
                             _mm256_sub_epi32(slot, _mm256_srli_epi32(fc, 16)));
        __m256i need = _mm256_cmpeq_epi32(_mm256_min_epu32(v, low), v);
        unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(need));
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(words + pos)));
        w = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256((const __m256i *)(refill + 8 * mask)));
        v = _mm256_blendv_epi8(v, _mm256_or_si256(_mm256_slli_epi32(v, 16), w), need);
        pos += 2 * (size_t)__builtin_popcount(mask);
        xs[(d >> 3) & 1] = v;
        _mm256_storeu_si256((__m256i *)(cx + d), _mm256_i32gather_epi32((const int *)context_off, s, 4));
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        _mm_storel_epi64((__m128i *)(syms + d), _mm_packus_epi16(packed, packed));
    }
    _mm256_storeu_si256((__m256i *)x, xs[0]);
    _mm256_storeu_si256((__m256i *)(x + 8), xs[1]);
    *pos_ = pos;
}

/* put_values for bf16 (6 raw bits a value) with AVX2, 16 values at a time; a group holding an
 * escape takes the scalar path. The raw bits of a group start on a byte (16 x 6 bits = 12 bytes). */
__attribute__((target("avx2"))) static int put_values_bf16_avx2(const layout *l, const split *sp, const uint8_t *syms,
                                                               size_t c0, size_t D, size_t *ei, size_t *bit,
                                                               uint8_t *row) {
    /* bytes 3g..3g+2 hold values 4g..4g+3; each 16-bit lane takes the two bytes its 6 bits start in,
     * and a multiply moves its bits to the top of the lane */
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 2, 3, 3, 4, 3, 4, 4, 5, 5, 6,
                                            6, 7, 6, 7, 7, 8, 8, 9, 9, 10, 9, 10, 10, 11, 11, 12);
    const __m256i scale = _mm256_setr_epi16(1 << 10, 1 << 4, 1 << 6, 1 << 8, 1 << 10, 1 << 4, 1 << 6, 1 << 8,
                                            1 << 10, 1 << 4, 1 << 6, 1 << 8, 1 << 10, 1 << 4, 1 << 6, 1 << 8);
    const __m256i q_mask = _mm256_set1_epi16(LEVELS - 1), bias = _mm256_set1_epi16(LOW - 1);
    const __m256i outside = _mm256_set1_epi16((short)~sp->level_mask);
    __m256i bad = _mm256_setzero_si256();
    for (size_t d = 0; d < D; d += 16) {
        __m256i s = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(syms + d)));
        __m256i q = _mm256_and_si256(s, q_mask);
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(q, _mm256_setzero_si256()))) {
            if (put_values(l, sp, syms + d, l->refs + c0 + d, 16, ei, bit, row + 2 * d, 2)) return KVN_ERR_CORRUPT;
            continue;
        }
        __m256i level = _mm256_add_epi16(_mm256_add_epi16(_mm256_loadu_si256((const __m256i *)(l->refs16 + c0 + d)), q), bias);
        bad = _mm256_or_si256(bad, _mm256_and_si256(level, outside));
        __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(l->raw + (*bit >> 3))));
        __m256i raw = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, spread), scale), 10);
        __m256i v = _mm256_or_si256(_mm256_slli_epi16(_mm256_srli_epi16(s, 5), 15),
                                    _mm256_or_si256(_mm256_slli_epi16(level, 6), raw));
        _mm256_storeu_si256((__m256i *)(row + 2 * d), v);
        *bit += 96;
    }
    return _mm256_testz_si256(bad, bad) ? KVN_OK : KVN_ERR_CORRUPT;
}
#endif

KVN_INLINE int decode_values_w(const kvn_ctx_model *m, const kvn_block *b, const layout *l, const split *sp,
                               uint32_t *x, word_reader *r, uint32_t *ctx, uint8_t *syms, uint8_t *dst, unsigned width) {
    size_t H = b->heads, D = b->dim, C = H * D;
    size_t i = 2 * C, ei = 0, bit = 0, pos = r->pos, len = r->len;
    const uint8_t *words = r->words;
    int aligned = D % STATES == 0 && (2 * C) % STATES == 0;
    const dec_tables tab = tables_of(m);
    const layout lay = *l;
    const split spl = *sp;
    int rc = KVN_OK;
#ifdef KVN_AVX2_ROWS
    int avx2_rows = aligned && m->avx2, avx2_values = avx2_rows && width == 2 && spl.raw_bits == 6;
#endif
    for (size_t c = 0; c < C; c++) ctx[c] = m->context_off[KVN_CTX_SYMBOLS]; /* the start context */
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++) {
            uint8_t *row = dst + (h * b->head_stride + t * D) * width;
            const uint32_t *restrict refs = lay.refs + h * D, *restrict class_off = lay.class_off + h * D;
            uint32_t *restrict cx = ctx + h * D;
            uint32_t back = lay.back[t * H + h];
            if (back) {
                if (back > t) { rc = KVN_ERR_CORRUPT; goto out; }
                memcpy(row, row - (size_t)back * D * width, D * width);
                for (size_t d = 0; d < D; d++) cx[d] = m->context_off[symbol_of(load(row + d * width, width), refs[d], &spl)];
                continue;
            }
            if (pos > len) { rc = KVN_ERR_CORRUPT; goto out; }
#ifdef KVN_AVX2_ROWS
            if (avx2_rows) {
                rans_row_avx2(tab, class_off, cx, m->context_off, syms, D, x, words, &pos, m->refill);
                int bad = avx2_values ? put_values_bf16_avx2(&lay, &spl, syms, h * D, D, &ei, &bit, row)
                                      : put_values(&lay, &spl, syms, refs, D, &ei, &bit, row, width);
                if (bad) { rc = KVN_ERR_CORRUPT; goto out; }
                continue;
            }
#endif
            if (aligned) {
                rans_row(tab, class_off, cx, m->context_off, syms, D, x, words, &pos);
            } else {
                for (size_t d = 0; d < D; d++, i++) {
                    unsigned s = rans_get(tab, &x[i % STATES], class_off[d] + cx[d], words, &pos);
                    cx[d] = m->context_off[s];
                    syms[d] = (uint8_t)s;
                }
            }
            if (put_values(&lay, &spl, syms, refs, D, &ei, &bit, row, width)) { rc = KVN_ERR_CORRUPT; goto out; }
        }
    if (ei != lay.n_esc) rc = KVN_ERR_CORRUPT;
out:
    r->pos = pos;
    return rc;
}

KVN_MULTIVERSION
static int decode_values(const kvn_ctx_model *m, const kvn_block *b, const layout *l, const split *sp, uint32_t *x,
                         word_reader *r, uint32_t *ctx, uint8_t *syms, uint8_t *dst) {
    uint32_t s[STATES];  /* a local copy the compiler can keep in registers */
    memcpy(s, x, sizeof(s));
    int rc;
    switch (sp->width) {
    case 2: rc = decode_values_w(m, b, l, sp, s, r, ctx, syms, dst, 2); break;
    case 4: rc = decode_values_w(m, b, l, sp, s, r, ctx, syms, dst, 4); break;
    default: rc = decode_values_w(m, b, l, sp, s, r, ctx, syms, dst, 1);
    }
    memcpy(x, s, sizeof(s));
    return rc;
}

static int read_repeats(const uint8_t *p, size_t len, size_t rows, uint32_t *back, size_t *repeated) {
    size_t bitmap = (rows + 7) / 8;
    if (len < bitmap) return KVN_ERR_CORRUPT;
    if ((rows & 7) && (p[bitmap - 1] >> (rows & 7))) return KVN_ERR_CORRUPT;
    const uint8_t *q = p + bitmap, *end = p + len;
    *repeated = 0;
    for (size_t r = 0; r < rows; r++) {
        back[r] = 0;
        if (!(p[r >> 3] >> (r & 7) & 1)) continue;
        uint64_t v = 0;
        for (unsigned shift = 0;; shift += 7) {
            if (q == end || shift > 28) return KVN_ERR_CORRUPT;
            uint8_t byte = *q++;
            v |= (uint64_t)(byte & 0x7F) << shift;
            if (!(byte & 0x80)) break;
        }
        if (v >= 0xFFFFFFFFu) return KVN_ERR_CORRUPT;
        back[r] = (uint32_t)v + 1;
        ++*repeated;
    }
    return q == end ? KVN_OK : KVN_ERR_CORRUPT;
}

int kvn_ctx_decode(const kvn_ctx_model *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst) {
    int rc = check_block(b);
    if (rc) return rc;
    const split sp = split_of(&FAMILIES[b->dtype]);
    size_t H = b->heads, T = b->tokens, D = b->dim, C = H * D, n = H * T * D;
    if (len < HEAD_SIZE || src[0] != VERSION || (src[1] & ~FLAG_REPEATS)) return KVN_ERR_CORRUPT;
    if (memcmp(src + 2, m->tag, 4)) return KVN_ERR_ARG;
    uint32_t flags = src[1], base = src[6] | (uint32_t)src[7] << 8;
    size_t n_esc = kvn_rd32(src + 8), stream_len = kvn_rd32(src + 12);
    if (!n) return len == HEAD_SIZE && !flags && !base && !n_esc && !stream_len ? KVN_OK : KVN_ERR_CORRUPT;
    const uint8_t *p = src + HEAD_SIZE, *end = src + len;
    uint32_t *back = calloc(T * H, sizeof(uint32_t));
    uint32_t *refs = malloc(C * sizeof(uint32_t));
    uint32_t *class_off = malloc(C * sizeof(uint32_t)), *ctx = malloc(C * sizeof(uint32_t));
    uint16_t *esc = malloc((n_esc ? n_esc : 1) * sizeof(uint16_t)), *refs16 = malloc(C * sizeof(uint16_t));
    uint8_t *syms = malloc(D + 16), *words = NULL;
    if (!back || !refs || !class_off || !ctx || !esc || !refs16 || !syms) { rc = KVN_ERR_NOMEM; goto done; }
    size_t repeated = 0;
    if (flags & FLAG_REPEATS) {
        if ((size_t)(end - p) < 4 || kvn_rd32(p) > (size_t)(end - p) - 4) { rc = KVN_ERR_CORRUPT; goto done; }
        size_t body = kvn_rd32(p);
        if ((rc = read_repeats(p + 4, body, T * H, back, &repeated))) goto done;
        p += 4 + body;
    }
    size_t n_coded = (T * H - repeated) * D, raw_len = raw_bytes(n_coded, sp.raw_bits);
    if ((size_t)(end - p) < 2 * n_esc || (size_t)(end - p) - 2 * n_esc < raw_len ||
        (size_t)(end - p) - 2 * n_esc - raw_len != stream_len || stream_len < 4 * STATES || stream_len % 2) {
        rc = KVN_ERR_CORRUPT;
        goto done;
    }
    for (size_t k = 0; k < n_esc; k++) esc[k] = (uint16_t)(p[2 * k] | p[2 * k + 1] << 8);
    p += 2 * n_esc;
    layout l = {back, refs, esc, n_esc, p, class_off, refs16};
    p += raw_len;
    uint32_t x[STATES];
    for (int j = 0; j < STATES; j++) x[j] = kvn_rd32(p + 4 * j);
    size_t n_words = stream_len - 4 * STATES, pad = 2 * (D > 2 ? D : 2) + 32;
    words = malloc(n_words + pad);
    if (!words) { rc = KVN_ERR_NOMEM; goto done; }
    memcpy(words, p + 4 * STATES, n_words);
    memset(words + n_words, 0, pad);
    word_reader r = {words, 0, n_words};
    /* side information: each channel's class and reference */
    size_t ei = 0;
    for (size_t c = 0; c < C; c++) {
        if (r.pos > r.len) { rc = KVN_ERR_CORRUPT; goto done; }
        unsigned cls = rans_get(tables_of(m), &x[(2 * c) % STATES], (size_t)m->class_model * REC_WORDS, r.words, &r.pos);
        unsigned offset = rans_get(tables_of(m), &x[(2 * c + 1) % STATES], (size_t)m->ref_model * REC_WORDS, r.words, &r.pos);
        uint32_t ref;
        if (offset < REF_SYMBOLS - 1) ref = base + offset;
        else if (ei < n_esc) ref = esc[ei++];
        else { rc = KVN_ERR_CORRUPT; goto done; }
        if (ref > sp.level_mask) { rc = KVN_ERR_CORRUPT; goto done; }
        refs[c] = ref;
        refs16[c] = (uint16_t)ref;
        class_off[c] = cls * (uint32_t)m->contexts * REC_WORDS;
    }
    l.esc += ei;
    l.n_esc -= ei;
    rc = decode_values(m, b, &l, &sp, x, &r, ctx, syms, dst);
    if (!rc && r.pos != r.len) rc = KVN_ERR_CORRUPT;
    for (int j = 0; j < STATES && !rc; j++)
        if (x[j] != RANS_LOW) rc = KVN_ERR_CORRUPT;
done:
    free(back);
    free(refs);
    free(class_off);
    free(ctx);
    free(esc);
    free(refs16);
    free(syms);
    free(words);
    return rc;
}
