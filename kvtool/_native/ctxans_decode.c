/* ctxans decoder: side information, then every row's symbols from the interleaved rANS states
 * into the destination block; repeated rows are copied. */
#include "ctxans_impl.h"

/* What the decoder reads words from: a copy of them followed by zeros, so that a row's symbols
 * read without a bounds check once the row starts within the words; a stream that ends early
 * reads zeros, and the checks at the end (every word used, none more) refuse it. */
typedef struct {
    const uint8_t *words;
    size_t pos, len;
} word_reader;

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
                kvn_ctx_rans_row_avx2(tab, class_off, cx, m->context_off, syms, D, x, words, &pos, m->refill);
                int bad = avx2_values ? kvn_ctx_put_values_bf16_avx2(&lay, &spl, syms, h * D, D, &ei, &bit, row)
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

int kvn_ctx_decode(const kvn_ctx_model *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst) {
    int rc = check_block(b);
    if (rc) return rc;
    const split sp = split_of(&kvn_ctx_families[b->dtype]);
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
        if ((rc = kvn_read_repeats(p + 4, body, T * H, back, &repeated))) goto done;
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

