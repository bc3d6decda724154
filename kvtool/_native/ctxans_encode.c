/* ctxans encoder: references, classes, repeated rows, escapes and raw bits, then the rANS stream
 * written backwards. The format is described in ctxans_impl.h and docs/FORMAT.md. */
#include "ctxans_impl.h"

size_t kvn_ctx_bound(const kvn_block *b) {
    size_t n = b->heads * b->tokens * b->dim, channels = b->heads * b->dim, rows = b->heads * b->tokens;
    unsigned raw_bits = kvn_ctx_families[b->dtype].mbits - 1;
    return HEAD_SIZE + 4 + (rows + 7) / 8 + 5 * rows + 2 * (n + channels) + raw_bytes(n, raw_bits) + 8 +
           4 * STATES + 2 * (n + 2 * channels) + 8;
}

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
    const split sp = split_of(&kvn_ctx_families[b->dtype]);
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
    rc = kvn_find_repeats(b, src, sp.width, back, &repeated);
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
    if (repeated) p = kvn_write_repeats(p, back, T * H);
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
