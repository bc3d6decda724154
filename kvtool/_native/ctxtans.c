/* ctxtans: a float KV block coded with a model dictionary's context models, brought to 11-bit
 * frequencies once per dictionary (kvtool/_native/ctxtans_tables.py).
 *
 * The symbols are ctxans's (see ctxans.c): each value's sign and level (exponent and
 * top mantissa bit) relative to its channel's reference, coded in the context its
 * channel's previous token left with the models of the channel's dictionary class;
 * repeated rows named; the low mantissa bits raw. Values go a group of channels at a
 * time, token by token, each head's channels in class order, so a group sweeps only the
 * tables of its channels' classes. Chunk version 3 (what the encoder writes) codes them
 * with rANS, a state per channel of a head's groups of 64: the lanes of SIMD registers,
 * which the lane kernels step together (ctxtans_lanes*.c, ctxtans_avx*.c). Versions 1 and 2
 * code them with tANS, eight states taking the symbols in turn, each model a table of 2^11
 * states sharing one state space, so a value decodes in one table step: entry = table[class
 * row + context row + state] gives the symbol, how many bits to read and the next state's
 * base, with the context the symbol leaves packed in. Here are the model, the chunk's head and
 * sections, and versions 1 and 2's stream. A chunk the dictionary codes worse than a Huffman
 * code of its own counts would is an exphuff chunk instead (mode 1).
 *
 * kvtool/_native/ctxtans_reference.py is the same format in numpy; docs/FORMAT.md
 * describes the bytes.
 */
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ctxtans_lanes.h"

/* The decode tables (4 MiB for 32 classes x 16 contexts) are read at random: on 2 MiB pages where
 * the system has them (fewer TLB misses; no gain was measurable on the loaded machine here). */
static void *table_alloc(size_t size) {
    void *p = NULL;
    size_t huge = (size_t)1 << 21;
    if (posix_memalign(&p, huge, (size + huge - 1) / huge * huge)) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(p, (size + huge - 1) / huge * huge, MADV_HUGEPAGE);
#endif
    return p;
}

kvn_tans_model *kvn_tans_model_new(int classes, int contexts, int start_context, const uint16_t *g,
                                   const uint16_t *start, const uint8_t *symbol, const uint8_t *nbits,
                                   const uint16_t *base, const int32_t *cost, const int32_t *class_cost,
                                   const uint8_t *context_of, const uint8_t tag[4]) {
    if (classes < 1 || classes > KVN_TANS_MAX_CLASSES || contexts < 1 || contexts > KVN_TANS_MAX_CONTEXTS ||
        start_context < 0 || start_context >= contexts)
        return NULL;
    for (int s = 0; s < KVN_TANS_SYMBOLS; s++)
        if (context_of[s] >= contexts) return NULL;
    size_t models = (size_t)classes * (size_t)contexts + 2;
    for (size_t k = 0; k < models; k++) { /* every state decodes to a used symbol and a state of the table */
        uint32_t total = 0;
        for (int s = 0; s < KVN_TANS_SYMBOLS; s++) {
            if (start[k * KVN_TANS_SYMBOLS + s] != total || (g[k * KVN_TANS_SYMBOLS + s] == 0 && k + 2 < models)) return NULL;
            total += g[k * KVN_TANS_SYMBOLS + s];
        }
        if (total != T) return NULL;
        for (size_t u = 0; u < T; u++) {
            size_t i = k * T + u;
            if (symbol[i] >= KVN_TANS_SYMBOLS || !g[k * KVN_TANS_SYMBOLS + symbol[i]] || nbits[i] > L ||
                (uint32_t)base[i] + (1u << nbits[i]) > T)
                return NULL;
        }
    }
    for (size_t i = 0; i < (size_t)contexts * KVN_TANS_SYMBOLS * (size_t)classes; i++)
        if (cost[i] < 0 || cost[i] > 8 * L) return NULL;
    kvn_tans_model *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->dec = table_alloc(models * T * sizeof(uint32_t));
    m->cost_lanes = classes <= 32 ? 32 : COST_LANES;
    m->cost = calloc((size_t)contexts * KVN_TANS_SYMBOLS * (size_t)m->cost_lanes, 1);
    m->classes = classes;
    m->contexts = contexts;
    m->start_context = start_context;
    m->class_model = (size_t)classes * (size_t)contexts;
    m->ref_model = m->class_model + 1;
    memcpy(m->context_of, context_of, KVN_TANS_SYMBOLS);
    if (!m->dec || !m->cost || kvn_lanes_tables(m, g, start)) {
        kvn_tans_model_free(m);
        return NULL;
    }
    for (size_t i = 0; i < models * T; i++)
        m->dec[i] = symbol[i] | (uint32_t)nbits[i] << 6 | ((uint32_t)context_of[symbol[i]] << L | base[i]) << 16;
    for (size_t r = 0; r < (size_t)contexts * KVN_TANS_SYMBOLS; r++)
        for (int k = 0; k < classes; k++) m->cost[r * (size_t)m->cost_lanes + k] = (uint8_t)cost[r * (size_t)classes + (size_t)k];
    memcpy(m->class_cost, class_cost, (size_t)classes * sizeof(int32_t));
    memcpy(m->tag, tag, 4);
    return m;
}

void kvn_tans_model_free(kvn_tans_model *m) {
    if (!m) return;
    free(m->dec);
    free(m->bucket);
    free(m->fcx);
    free(m->rcp);
    free(m->rec);
    free(m->cost);
    free(m);
}

size_t kvn_tans_bound(const kvn_block *b) {
    size_t n = b->heads * b->tokens * b->dim, channels = b->heads * b->dim, rows = b->heads * b->tokens;
    size_t coded = HEAD_SIZE + 4 + (rows + 7) / 8 + 5 * rows + 2 * (n + channels) + raw_bytes(n, split_of(b->dtype).raw_bits) +
                   2 * (n + 2 * channels) + 4 * LANES + 16; /* two bytes at most a symbol, and the states */
    size_t fallback = 2 + kvn_exphuff_bound(b);
    return coded > fallback ? coded : fallback;
}

/* ---- decode ---------------------------------------------------------------------------- */

/* Reads the stream backwards from bit `pos`: `bits` holds the 64 stream bits from bit `at` (a
 * multiple of 8), at least 57 of them below pos after each reload. Bytes up to 8 before the stream
 * are read (never used): the chunk's head is there. */
typedef struct {
    const uint8_t *stream;
    int64_t pos, at;
    uint64_t bits;
} bit_reader;

KVN_INLINE int reload(bit_reader *r) {
    if (r->pos < 0) return 0;
    r->at = ((r->pos + 7) >> 3) - 8;
    r->bits = kvn_rd64(r->stream + r->at);
    r->at *= 8;
    return 1;
}

KVN_INLINE uint32_t read_bits(bit_reader *r, unsigned nb) {
    r->pos -= nb;
    return (uint32_t)(r->bits >> (r->pos - r->at)) & ((1u << nb) - 1);
}

KVN_INLINE unsigned tans_get(const uint32_t *table, uint32_t *x, bit_reader *r) {
    uint32_t e = table[*x];
    *x = ((e >> 16) & (T - 1)) + read_bits(r, (e >> 6) & 0xF);
    return e & 63;
}

/* One value from its symbol, its channel's reference, the escapes and the raw bits. */
KVN_INLINE uint32_t value_of(const split *sp, unsigned sym, uint32_t ref, side_data *sd, uint32_t *bad) {
    uint32_t q = sym % LEVELS, level = ref + (uint32_t)(LOW - 1) + q;
    if (__builtin_expect(!q, 0) && !next_escape(sd, &level)) *bad = 1;
    *bad |= level >= sp->level_count;
    uint32_t raw = (uint32_t)(kvn_rd64(sd->raw + (sd->raw_pos >> 3)) >> (sd->raw_pos & 7)) & sp->raw_mask;
    sd->raw_pos += sp->raw_bits;
    return (uint32_t)(sym / LEVELS) << sp->sign_shift | level << sp->raw_bits | raw;
}

/* A repeated value: copied from `back` tokens before; the context its symbol leaves. */
KVN_INLINE uint32_t repeat_value(const kvn_tans_model *m, const split *sp, uint8_t *out, size_t back_bytes,
                                 uint32_t ref, unsigned width) {
    uint32_t v = load(out - back_bytes, width);
    store(out, v, width);
    return (uint32_t)m->context_of[symbol_of(v, ref, sp)] << L;
}

/* The values, group by group, each group token by token. The reader and, on the fast path (whole
 * groups of one head: dim a multiple of 8), the eight states live in locals; there a state is kept
 * as y = context << L | state, the entry's high half (the context its symbol leaves and the next
 * state's base) plus the bits read, so the next lookup is table[class row + y], prefetched at once
 * (1.5-2x faster: the loads otherwise wait behind the values' assembly). Every token of a fast
 * group codes 0 or 8 values, so its raw bits are RB whole bytes, read at constant offsets.
 * Position p of the coding order is channel chan[p]; refs and cls_row are by position. */
KVN_INLINE int decode_values_w(const kvn_tans_model *m, const kvn_block *b, const split *sp, const uint32_t *back,
                               const uint32_t *chan, const uint32_t *refs, const uint32_t *restrict cls_row,
                               uint32_t *restrict row_of, uint32_t *x, bit_reader *reader, side_data *side, uint8_t *dst,
                               unsigned width, unsigned RB, unsigned SS, uint32_t LEVEL_COUNT) {
    size_t H = b->heads, D = b->dim, C = H * D, T_ = b->tokens;
    const uint32_t *restrict dec = m->dec;
    bit_reader rd = *reader;
    side_data sides = *side, *sd = &sides; /* in locals: the stores to dst could alias them otherwise */
    uint32_t bad = 0;
    size_t i = 2 * C;
    const uint32_t start_row = (uint32_t)m->start_context << L, raw_mask = (1u << RB) - 1;
    for (size_t g = 0; g < C; g += GROUP) {
        if (D % GROUP == 0) { /* i % 8 == 0 here: the states are constants */
            size_t h = g / D;
            size_t o0 = chan[g] % D, o1 = chan[g + 1] % D, o2 = chan[g + 2] % D, o3 = chan[g + 3] % D;
            size_t o4 = chan[g + 4] % D, o5 = chan[g + 5] % D, o6 = chan[g + 6] % D, o7 = chan[g + 7] % D;
            uint32_t y0 = start_row + x[0], y1 = start_row + x[1], y2 = start_row + x[2], y3 = start_row + x[3];
            uint32_t y4 = start_row + x[4], y5 = start_row + x[5], y6 = start_row + x[6], y7 = start_row + x[7];
            const uint32_t *t0 = dec + cls_row[g], *t1 = dec + cls_row[g + 1], *t2 = dec + cls_row[g + 2];
            const uint32_t *t3 = dec + cls_row[g + 3], *t4 = dec + cls_row[g + 4], *t5 = dec + cls_row[g + 5];
            const uint32_t *t6 = dec + cls_row[g + 6], *t7 = dec + cls_row[g + 7];
            const uint32_t *rf = refs + g;
            int64_t pos = rd.pos, at = rd.at;
            uint64_t bits = rd.bits;
            const uint8_t *stream = rd.stream, *rawp = sd->raw + (sd->raw_pos >> 3);
            uint8_t *out = dst + h * b->head_stride * width;
            const uint32_t *bk_of = back + h;
            for (size_t t = 0; t < T_; t++, out += D * width, bk_of += H) {
                uint32_t bk = *bk_of;
                if (bk) {
                    if (bk > t) return KVN_ERR_CORRUPT;
                    size_t bb = (size_t)bk * D * width;
#define REP(k) y##k = (y##k & (T - 1)) + (repeat_value(m, sp, out + o##k * width, bb, rf[k], width))
                    REP(0); REP(1); REP(2); REP(3); REP(4); REP(5); REP(6); REP(7);
#undef REP
                    continue;
                }
#define RELOAD()                                        \
    do {                                                \
        if (pos < 0) return KVN_ERR_CORRUPT;            \
        at = ((pos + 7) >> 3) - 8;                      \
        bits = kvn_rd64(stream + at);                   \
        at *= 8;                                        \
    } while (0)
#define GET(k)                                                                                \
    unsigned s##k;                                                                            \
    do {                                                                                      \
        uint32_t e = t##k[y##k], nb = (e >> 6) & 0xF;                                         \
        pos -= nb;                                                                            \
        y##k = (e >> 16) + ((uint32_t)(bits >> (pos - at)) & ((1u << nb) - 1));               \
        s##k = e & 63;                                                                        \
        __builtin_prefetch(t##k + y##k);                                                      \
    } while (0)
#define PUT(k)                                                                                          \
    do {                                                                                                \
        uint32_t q = s##k % LEVELS, level = rf[k] + (uint32_t)(LOW - 1) + q;                           \
        if (__builtin_expect(!q, 0) && !next_escape(sd, &level)) bad = 1;                               \
        bad |= level >= LEVEL_COUNT;                                                                    \
        uint32_t raw = (uint32_t)(kvn_rd64(rawp + (k) * RB / 8) >> ((k) * RB % 8)) & raw_mask;          \
        store(out + o##k * width, (uint32_t)(s##k / LEVELS) << SS | level << RB | raw, width);          \
    } while (0)
                RELOAD();
                GET(0); GET(1); GET(2); GET(3);
                RELOAD();
                GET(4); GET(5); GET(6); GET(7);
                PUT(0); PUT(1); PUT(2); PUT(3); PUT(4); PUT(5); PUT(6); PUT(7);
                rawp += RB;
#undef GET
#undef PUT
#undef RELOAD
            }
            rd.pos = pos;
            rd.at = at;
            rd.bits = bits;
            sd->raw_pos = (uint64_t)(rawp - sd->raw) * 8;
            x[0] = y0 & (T - 1); x[1] = y1 & (T - 1); x[2] = y2 & (T - 1); x[3] = y3 & (T - 1);
            x[4] = y4 & (T - 1); x[5] = y5 & (T - 1); x[6] = y6 & (T - 1); x[7] = y7 & (T - 1);
        } else {
            size_t end = g + GROUP < C ? g + GROUP : C;
            for (size_t t = 0; t < T_; t++)
                for (size_t c = g; c < end; c++) {
                    size_t h = chan[c] / D;
                    uint8_t *out = dst + (h * b->head_stride + t * D + chan[c] % D) * width;
                    uint32_t bk = back[t * H + h];
                    if (bk) {
                        if (bk > t) return KVN_ERR_CORRUPT;
                        row_of[c] = cls_row[c] + repeat_value(m, sp, out, (size_t)bk * D * width, refs[c], width);
                        continue;
                    }
                    if (!reload(&rd)) return KVN_ERR_CORRUPT;
                    unsigned sym = tans_get(dec + row_of[c], &x[i++ % STATES], &rd);
                    row_of[c] = cls_row[c] + ((uint32_t)m->context_of[sym] << L);
                    store(out, value_of(sp, sym, refs[c], sd, &bad), width);
                }
        }
    }
    *reader = rd;
    *side = sides;
    return bad || rd.pos < 0 ? KVN_ERR_CORRUPT : KVN_OK;
}

/* One variant per dtype: its width, raw bits, sign shift and level count are constants there. */
KVN_TANS_MULTIVERSION
static int decode_values(const kvn_tans_model *m, const kvn_block *b, const split *sp, const uint32_t *back,
                         const uint32_t *chan, const uint32_t *refs, const uint32_t *cls_row, uint32_t *row_of,
                         uint32_t *x, bit_reader *r, side_data *sd, uint8_t *dst) {
#define DTYPE(w, rb, ss, levels) decode_values_w(m, b, sp, back, chan, refs, cls_row, row_of, x, r, sd, dst, w, rb, ss, levels)
    RETURN_BY_DTYPE(b->dtype, DTYPE)
#undef DTYPE
}

/* Versions 1 and 2 after their sections: the tANS stream's states and side information, then the values. */
static int decode_tans(const kvn_tans_model *m, const kvn_block *b, unsigned version, const uint32_t *back,
                       side_data *sd, const uint8_t *end, size_t stream_len, uint32_t base, uint8_t *dst) {
    size_t H = b->heads, D = b->dim, C = H * D;
    split sp = split_of(b->dtype);
    if (stream_len < MIN_STREAM || !end[-1]) return KVN_ERR_CORRUPT;
    uint32_t *refs = malloc(C * sizeof(uint32_t)), *cls_row = malloc(C * sizeof(uint32_t));
    uint32_t *row_of = malloc(C * sizeof(uint32_t)), *chan = malloc(C * sizeof(uint32_t));
    uint32_t *by_chan = malloc(2 * C * sizeof(uint32_t));
    uint8_t *cls = malloc(C);
    int rc = KVN_ERR_NOMEM;
    if (!refs || !cls_row || !row_of || !chan || !by_chan || !cls) goto done;
    rc = KVN_ERR_CORRUPT;
    bit_reader r = {end - stream_len, 8 * (int64_t)(stream_len - 1) + (31 - __builtin_clz(end[-1])), 0, 0};
    uint32_t x[STATES];
    for (int k = STATES; k-- > 0;) {
        if (!reload(&r)) goto done;
        x[k] = read_bits(&r, L);
    }
    const uint32_t *class_table = m->dec + m->class_model * T, *ref_table = m->dec + m->ref_model * T;
    uint32_t start_row = (uint32_t)m->start_context << L;
    for (size_t c = 0; c < C; c++) {
        if (!reload(&r)) goto done;
        unsigned k = tans_get(class_table, &x[(2 * c) % STATES], &r);
        unsigned offset = tans_get(ref_table, &x[(2 * c + 1) % STATES], &r);
        uint32_t ref = base + offset;
        if ((offset == REF_SYMBOLS - 1 && !next_escape(sd, &ref)) || ref >= sp.level_count) goto done;
        cls[c] = (uint8_t)k;
        by_chan[c] = ref;
        by_chan[C + c] = (uint32_t)((size_t)k * (size_t)m->contexts * T);
    }
    coding_channels(cls, H, D, version, chan);
    for (size_t p = 0; p < C; p++) {
        refs[p] = by_chan[chan[p]];
        cls_row[p] = by_chan[C + chan[p]];
        row_of[p] = cls_row[p] + start_row;
    }
    rc = decode_values(m, b, &sp, back, chan, refs, cls_row, row_of, x, &r, sd, dst);
    for (int k = 0; !rc && k < STATES; k++)
        if (x[k]) rc = KVN_ERR_CORRUPT;
    if (!rc && r.pos) rc = KVN_ERR_CORRUPT;
done:
    free(refs);
    free(cls_row);
    free(row_of);
    free(chan);
    free(by_chan);
    free(cls);
    return rc;
}

int kvn_tans_decode(const kvn_tans_model *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst) {
    int rc = check_block(b);
    if (rc) return rc;
    size_t rows = b->heads * b->tokens, n = rows * b->dim;
    unsigned version = len ? src[0] : 0;
    if (len >= 2 && version >= 1 && version <= VERSION && src[1] == MODE_EXPHUFF)
        return n ? kvn_exphuff_decode(b, src + 2, len - 2, dst) : KVN_ERR_CORRUPT;
    if (len < HEAD_SIZE || version < 1 || version > VERSION || src[1] != MODE_DICT || (src[2] & ~FLAG_REPEATS) || src[3])
        return KVN_ERR_CORRUPT;
    if (memcmp(src + 4, m->tag, 4)) return KVN_ERR_ARG;
    uint32_t base = src[8] | (uint32_t)src[9] << 8;
    size_t n_esc = kvn_rd32(src + 10), stream_len = kvn_rd32(src + 14);
    if (!n) return len == HEAD_SIZE && !src[2] && !base && !n_esc && !stream_len ? KVN_OK : KVN_ERR_CORRUPT;
    uint32_t *back = malloc(rows * sizeof(uint32_t));
    if (!back) return KVN_ERR_NOMEM;
    const uint8_t *p = src + HEAD_SIZE, *end = src + len;
    size_t repeated = 0;
    rc = KVN_ERR_CORRUPT;
    if (src[2] & FLAG_REPEATS) {
        if ((size_t)(end - p) < 4) goto done;
        size_t body = kvn_rd32(p);
        p += 4;
        if ((size_t)(end - p) < body) goto done;
        rc = kvn_read_repeats(p, body, rows, back, &repeated);
        if (rc) goto done;
        rc = KVN_ERR_CORRUPT;
        p += body;
    } else {
        memset(back, 0, rows * sizeof(uint32_t));
    }
    uint64_t raw_total = (uint64_t)(rows - repeated) * b->dim * split_of(b->dtype).raw_bits;
    size_t raw_len = (size_t)((section_bits(version, raw_total) + 7) / 8), rest = (size_t)(end - p);
    if (n_esc > rest / 2 || raw_len > rest - 2 * n_esc || stream_len != rest - 2 * n_esc - raw_len) goto done;
    side_data sd = {p, n_esc, 0, p + 2 * n_esc, 0};
    if (version >= 3) {
        lane_chunk lc = {back, &sd, end - stream_len, stream_len, base, raw_total};
        rc = kvn_tans_lanes_decode(m, b, &lc, dst);
    } else {
        rc = decode_tans(m, b, version, back, &sd, end, stream_len, base, dst);
    }
    if (!rc && sd.esc_at != n_esc) rc = KVN_ERR_CORRUPT;
done:
    free(back);
    return rc;
}
