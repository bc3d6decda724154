/* ctxtans's encoder: symbols and references, repeated rows, each channel's class, the fallback
 * decision, the escapes and raw bits, and the tANS stream written last symbol first (see ctxtans.c
 * and docs/FORMAT.md). */
#include <stdlib.h>

#include "ctxtans_impl.h"
#include "huffman.h"

typedef struct {
    uint8_t *p;
    uint64_t acc;
    unsigned n;
} bit_writer;

KVN_INLINE void put_bits(bit_writer *w, uint64_t v, unsigned nb) {
    w->acc |= v << w->n;
    w->n += nb;
    kvn_wr64(w->p, w->acc);
    w->p += w->n >> 3;
    w->acc >>= w->n & ~7u; /* n < 8 + 22: never a whole word */
    w->n &= 7;
}

/* The bytes written; the last partial byte zero padded. */
static size_t finish_bits(bit_writer *w, uint8_t *start) {
    if (w->n) *w->p++ = (uint8_t)w->acc;
    return (size_t)(w->p - start);
}

/* ---- encode ---------------------------------------------------------------------------- */

/* Channel references (floor of the mean level) and every value's symbol, sym[t * C + c]. */
KVN_INLINE void symbols_w(const kvn_block *b, const uint8_t *src, const split *sp, uint32_t *restrict refs,
                          uint8_t *restrict sym, unsigned width) {
    size_t H = b->heads, T_ = b->tokens, D = b->dim, C = H * D;
    memset(refs, 0, C * sizeof(uint32_t));
    for (size_t h = 0; h < H; h++)
        for (size_t t = 0; t < T_; t++) {
            const uint8_t *row = src + (h * b->head_stride + t * D) * width;
            uint32_t *r = refs + h * D;
            for (size_t d = 0; d < D; d++) r[d] += (load(row + d * width, width) >> sp->raw_bits) & (sp->level_count - 1);
        }
    for (size_t c = 0; c < C; c++) refs[c] /= (uint32_t)T_;
    for (size_t h = 0; h < H; h++)
        for (size_t t = 0; t < T_; t++) {
            const uint8_t *row = src + (h * b->head_stride + t * D) * width;
            uint8_t *s = sym + t * C + h * D;
            const uint32_t *r = refs + h * D;
            for (size_t d = 0; d < D; d++) s[d] = (uint8_t)symbol_of(load(row + d * width, width), r[d], sp);
        }
}

KVN_TANS_MULTIVERSION
static void symbols(const kvn_block *b, const uint8_t *src, const split *sp, uint32_t *refs, uint8_t *sym) {
    switch (sp->width) {
    case 2: symbols_w(b, src, sp, refs, sym, 2); break;
    case 4: symbols_w(b, src, sp, refs, sym, 4); break;
    default: symbols_w(b, src, sp, refs, sym, 1);
    }
}

/* Each channel's class, the cheapest for its coded symbols in their contexts (the lowest on a tie);
 * returns the summed cost of the choices in 1/8 bits. */
KVN_TANS_MULTIVERSION
static uint64_t choose_classes(const kvn_tans_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                               uint8_t *cls) {
    size_t H = b->heads, D = b->dim, C = H * D;
    uint64_t total = 0;
    for (size_t c = 0; c < C; c++) {
        size_t h = c / D;
        int64_t sum[COST_LANES] = {0};
        uint16_t run[COST_LANES];
        size_t in_run = 0;
        memset(run, 0, sizeof(run));
        for (size_t t = 0; t < b->tokens; t++) {
            size_t ctx = t ? m->context_of[sym[(t - 1) * C + c]] : (size_t)m->start_context;
            if (!back[t * H + h]) {
                const int16_t *row = m->cost + (ctx * KVN_TANS_SYMBOLS + sym[t * C + c]) * COST_LANES;
                for (int k = 0; k < COST_LANES; k++) run[k] = (uint16_t)(run[k] + (uint16_t)row[k]);
            }
            if (++in_run == COST_RUN) {
                for (int k = 0; k < COST_LANES; k++) sum[k] += run[k];
                memset(run, 0, sizeof(run));
                in_run = 0;
            }
        }
        int best = 0;
        int64_t best_cost = INT64_MAX;
        for (int k = 0; k < m->classes; k++) {
            int64_t cost = sum[k] + run[k] + m->class_cost[k];
            if (cost < best_cost) { best_cost = cost; best = k; }
        }
        cls[c] = (uint8_t)best;
        total += (uint64_t)best_cost;
    }
    return total;
}

/* The bits a Huffman code of the chunk's own counts of the coded symbols would take. */
static uint64_t huffman_bits(const kvn_block *b, const uint8_t *sym, const uint32_t *back) {
    size_t H = b->heads, D = b->dim, C = H * D;
    uint32_t count[256] = {0};
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++)
            if (!back[t * H + h])
                for (size_t d = 0; d < D; d++) count[sym[t * C + h * D + d]]++;
    uint8_t len[256];
    kvn_huf_lengths(count, len);
    uint64_t bits = 0;
    for (int s = 0; s < 256; s++) bits += (uint64_t)count[s] * len[s];
    return bits;
}

KVN_INLINE void tans_put(const kvn_tans_model *m, size_t model, unsigned s, uint32_t *x, bit_writer *w) {
    uint32_t info = m->info[model * KVN_TANS_SYMBOLS + s], f = info & 0xFFF, shift = info >> 24;
    uint32_t nb = shift - (*x < f << shift);
    put_bits(w, *x & ((1u << nb) - 1), nb);
    *x = T + m->enc[model * T + ((info >> 12) & 0xFFF) + (*x >> nb) - f];
}

/* The tANS stream of the side information and the coded values, written forwards at w. */
KVN_TANS_MULTIVERSION
static void encode_stream(const kvn_tans_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                          const uint32_t *chan, const uint8_t *cls, const uint32_t *refs, uint32_t base, size_t n_coded,
                          bit_writer *w) {
    size_t H = b->heads, D = b->dim, C = H * D, X = (size_t)m->contexts;
    uint32_t x[STATES];
    for (int k = 0; k < STATES; k++) x[k] = T;
    size_t i = 2 * C + n_coded;
    if (D % GROUP == 0) { /* every token of a group codes 0 or 8 values, position k of the group with state k */
        uint32_t x0 = T, x1 = T, x2 = T, x3 = T, x4 = T, x5 = T, x6 = T, x7 = T;
        uint8_t *p = w->p;
        uint64_t acc = w->acc;
        unsigned n = w->n;
        for (size_t g = C; g > 0;) {
            g -= GROUP;
            const uint32_t *ch = chan + g;
            size_t c0 = ch[0], c1 = ch[1], c2 = ch[2], c3 = ch[3], c4 = ch[4], c5 = ch[5], c6 = ch[6], c7 = ch[7];
            size_t m0 = cls[c0] * X, m1 = cls[c1] * X, m2 = cls[c2] * X, m3 = cls[c3] * X;
            size_t m4 = cls[c4] * X, m5 = cls[c5] * X, m6 = cls[c6] * X, m7 = cls[c7] * X;
            const uint32_t *bk = back + g / D;
            for (size_t t = b->tokens; t-- > 0;) {
                if (bk[t * H]) continue;
                const uint8_t *sy = sym + t * C, *prev = sy - C;
#define PUT(k)                                                                                                 \
    do {                                                                                                       \
        size_t model = m##k + (t ? m->context_of[prev[c##k]] : (size_t)m->start_context);                       \
        uint32_t info = m->info[model * KVN_TANS_SYMBOLS + sy[c##k]], f = info & 0xFFF, shift = info >> 24;    \
        uint32_t nb = shift - (x##k < f << shift);                                                             \
        acc |= (uint64_t)(x##k & ((1u << nb) - 1)) << n;                                                       \
        n += nb;                                                                                               \
        x##k = T + m->enc[model * T + ((info >> 12) & 0xFFF) + (x##k >> nb) - f];                             \
        if (t) { /* the entry this state's next step (token t - 1) reads, prefetched */                       \
            size_t next = m##k + (t > 1 ? m->context_of[prev[c##k - C]] : (size_t)m->start_context);           \
            uint32_t ni = m->info[next * KVN_TANS_SYMBOLS + prev[c##k]], nf = ni & 0xFFF, ns = ni >> 24;      \
            ns -= x##k < nf << ns;                                                                             \
            __builtin_prefetch(m->enc + next * T + ((ni >> 12) & 0xFFF) + (x##k >> ns) - nf);                 \
        }                                                                                                      \
    } while (0)
#define FLUSH() /* n < 8 + 4 * 11: never a whole word */ \
    do {                                                 \
        kvn_wr64(p, acc);                                \
        p += n >> 3;                                     \
        acc >>= n & ~7u;                                 \
        n &= 7;                                          \
    } while (0)
                PUT(7); PUT(6); PUT(5); PUT(4);
                FLUSH();
                PUT(3); PUT(2); PUT(1); PUT(0);
                FLUSH();
#undef PUT
#undef FLUSH
            }
        }
        w->p = p;
        w->acc = acc;
        w->n = n;
        x[0] = x0; x[1] = x1; x[2] = x2; x[3] = x3; x[4] = x4; x[5] = x5; x[6] = x6; x[7] = x7;
    } else {
        for (size_t g = (C + GROUP - 1) / GROUP * GROUP; g > 0;) {
            g -= GROUP;
            size_t end = g + GROUP < C ? g + GROUP : C;
            for (size_t t = b->tokens; t-- > 0;) {
                const uint8_t *s = sym + t * C, *prev = t ? s - C : NULL;
                for (size_t p = end; p-- > g;) {
                    size_t c = chan[p];
                    if (back[t * H + c / D]) continue;
                    size_t ctx = prev ? m->context_of[prev[c]] : (size_t)m->start_context;
                    i--;
                    tans_put(m, (size_t)cls[c] * X + ctx, s[c], &x[i % STATES], w);
                }
            }
        }
    }
    for (size_t c = C; c-- > 0;) {
        uint32_t offset = refs[c] - base;
        tans_put(m, m->ref_model, offset < REF_SYMBOLS - 1 ? offset : REF_SYMBOLS - 1, &x[(2 * c + 1) % STATES], w);
        tans_put(m, m->class_model, cls[c], &x[(2 * c) % STATES], w);
    }
    for (int k = 0; k < STATES; k++) put_bits(w, x[k] - T, L);
    put_bits(w, 1, 1);
}

/* The escape list (references, then the levels of escaped values in coding order) and the raw bits. */
KVN_INLINE void escapes_and_raw_w(const kvn_block *b, const uint8_t *src, const uint8_t *sym, const uint32_t *back,
                                  const uint32_t *chan, const split *sp, uint8_t *esc, size_t *n_esc, bit_writer *raw,
                                  unsigned width) {
    size_t H = b->heads, D = b->dim, C = H * D;
    for (size_t g = 0; g < C; g += GROUP)
        for (size_t t = 0; t < b->tokens; t++)
            for (size_t p = g; p < g + GROUP && p < C; p++) {
                size_t c = chan[p], h = c / D;
                if (back[t * H + h]) continue;
                uint32_t v = load(src + (h * b->head_stride + t * D + c % D) * width, width);
                if (!(sym[t * C + c] % LEVELS)) {
                    uint32_t level = (v >> sp->raw_bits) & (sp->level_count - 1);
                    esc[2 * *n_esc] = (uint8_t)level;
                    esc[2 * *n_esc + 1] = (uint8_t)(level >> 8);
                    ++*n_esc;
                }
                put_bits(raw, v & sp->raw_mask, sp->raw_bits);
            }
}

KVN_TANS_MULTIVERSION
static void escapes_and_raw(const kvn_block *b, const uint8_t *src, const uint8_t *sym, const uint32_t *back,
                            const uint32_t *chan, const split *sp, uint8_t *esc, size_t *n_esc, bit_writer *raw) {
    switch (sp->width) {
    case 2: escapes_and_raw_w(b, src, sym, back, chan, sp, esc, n_esc, raw, 2); break;
    case 4: escapes_and_raw_w(b, src, sym, back, chan, sp, esc, n_esc, raw, 4); break;
    default: escapes_and_raw_w(b, src, sym, back, chan, sp, esc, n_esc, raw, 1);
    }
}

static void write_head(uint8_t *p, unsigned flags, const uint8_t tag[4], uint32_t base, size_t n_esc, size_t stream) {
    p[0] = VERSION;
    p[1] = MODE_DICT;
    p[2] = (uint8_t)flags;
    p[3] = 0;
    memcpy(p + 4, tag, 4);
    p[8] = (uint8_t)base;
    p[9] = (uint8_t)(base >> 8);
    kvn_wr32(p + 10, (uint32_t)n_esc);
    kvn_wr32(p + 14, (uint32_t)stream);
}

int kvn_tans_encode(const kvn_tans_model *m, const kvn_block *b, const void *src_, uint8_t *dst, size_t *written) {
    int rc = check_block(b);
    if (rc) return rc;
    const uint8_t *src = src_;
    split sp = split_of(b->dtype);
    size_t H = b->heads, D = b->dim, C = H * D, rows = H * b->tokens, n = rows * D;
    if (!n) {
        memset(dst, 0, HEAD_SIZE);
        write_head(dst, 0, m->tag, 0, 0, 0);
        *written = HEAD_SIZE;
        return KVN_OK;
    }
    uint8_t *sym = malloc(n), *cls = malloc(C);
    uint32_t *refs = malloc(C * sizeof(uint32_t)), *back = malloc(rows * sizeof(uint32_t));
    uint32_t *chan = malloc(C * sizeof(uint32_t));
    if (!sym || !cls || !refs || !back || !chan) { rc = KVN_ERR_NOMEM; goto done; }
    size_t repeated;
    symbols(b, src, &sp, refs, sym);
    rc = kvn_find_repeats(b, src, sp.width, back, &repeated);
    if (rc) goto done;
    uint64_t dict_cost = choose_classes(m, b, sym, back, cls);
    if (8 * huffman_bits(b, sym, back) < dict_cost) { /* the dictionary does not fit: per-chunk statistics */
        dst[0] = VERSION;
        dst[1] = MODE_EXPHUFF;
        rc = kvn_exphuff_encode(b, src, dst + 2, written, 0);
        *written += 2;
        goto done;
    }
    coding_channels(cls, H, D, VERSION, chan);
    uint32_t base = refs[0];
    for (size_t c = 1; c < C; c++) base = refs[c] < base ? refs[c] : base;
    uint8_t *p = dst + HEAD_SIZE;
    if (repeated) p = kvn_write_repeats(p, back, rows);
    size_t n_esc = 0;
    for (size_t c = 0; c < C; c++)
        if (refs[c] - base >= REF_SYMBOLS - 1) {
            p[2 * n_esc] = (uint8_t)refs[c];
            p[2 * n_esc + 1] = (uint8_t)(refs[c] >> 8);
            n_esc++;
        }
    /* the value escapes follow; the raw bits go after all escapes, so they are written once the count is known */
    size_t n_coded = (rows - repeated) * D, value_esc = 0;
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++)
            if (!back[t * H + h])
                for (size_t d = 0; d < D; d++) value_esc += !(sym[t * C + h * D + d] % LEVELS);
    uint8_t *raw_at = p + 2 * (n_esc + value_esc);
    bit_writer raw = {raw_at, 0, 0};
    escapes_and_raw(b, src, sym, back, chan, &sp, p, &n_esc, &raw);
    uint8_t *stream_at = raw_at + finish_bits(&raw, raw_at);
    bit_writer w = {stream_at, 0, 0};
    encode_stream(m, b, sym, back, chan, cls, refs, base, n_coded, &w);
    size_t stream_len = finish_bits(&w, stream_at);
    write_head(dst, repeated ? FLAG_REPEATS : 0, m->tag, base, n_esc, stream_len);
    *written = (size_t)(stream_at + stream_len - dst);
done:
    free(sym);
    free(cls);
    free(refs);
    free(back);
    free(chan);
    return rc;
}
