/* ctxtans chunk version 3: the model's rANS tables, and a chunk's stream and values decoded.
 *
 * The stream starts with the 64 lanes' states; then come each channel's class and reference offset
 * (symbol i with lane i % 64, a step each), then the values' symbols group by group (64 channels of a head, one
 * lane each: ctxtans_lanes.h), decoded into a buffer of [tokens][places], a repeated row taking the
 * symbols of the row it repeats. The final states give back the raw plane's last bits. Then the
 * values, row by row in the block's order, each from its channel's symbol, reference, escape and raw
 * bits (which the chunk holds in that order). The model's instruction set picks the kernels: the
 * portable ones here, or those of ctxtans_avx2.c and ctxtans_avx512.c, which decode the same bytes.
 */
#include <stdlib.h>

#include "ctxtans_lanes.h"

int kvn_lanes_tables(kvn_tans_model *m, const uint16_t *g, const uint16_t *start) {
    size_t models = m->class_model + 2, S = KVN_TANS_SYMBOLS;
    m->bucket = malloc(m->class_model * BUCKETS * sizeof(uint32_t));
    m->fcx = malloc(models * S * sizeof(uint32_t));
    m->rcp = malloc(models * S * sizeof(uint32_t));
    m->rec = malloc(models * S * sizeof(uint32_t));
    if (!m->bucket || !m->fcx || !m->rcp || !m->rec) return -1;
    for (size_t i = 0; i < models * S; i++) {
        uint32_t f = g[i], cum = start[i], shift = 0;
        m->fcx[i] = f | cum << 12 | (uint32_t)m->context_of[i % S] << 24;
        while (f > 1u << shift) shift++;
        /* x / f = (x * rcp >> 32) >> (shift - 1) for x < 2^31 (f >= 2); f == 1: x * (2^32 - 1) >> 32 = x - 1 */
        m->rcp[i] = f > 1 ? (uint32_t)(((1ull << (shift + 31)) + f - 1) / f) : 0xFFFFFFFFu;
        m->rec[i] = f | (f > 1 ? shift - 1 : 0) << 12 | (f > 1 ? cum : cum + T - 1) << 16;
    }
    for (unsigned mask = 0; mask < 256; mask++)
        for (unsigned lane = 0; lane < 8; lane++) m->refill_index[mask][lane] = (uint8_t)__builtin_popcount(mask & ((1u << lane) - 1));
    for (size_t k = 0; k < m->class_model; k++) /* symbol models: every frequency 1 or more */
        for (uint32_t b = 0; b < BUCKETS; b++) {
            uint32_t first = 0, e = 0;
            for (unsigned s = 0; s < S; s++) {
                uint32_t at = start[k * S + s];
                if (at <= 16 * b) first = s;
                else if (at < 16 * b + 16) e |= 1u << (8 + at - 16 * b);
            }
            m->bucket[k * BUCKETS + b] = first | e;
        }
    return 0;
}

/* ---- the symbols ------------------------------------------------------------------------- */

static int group_portable(lane_group *g) {
    for (size_t t = 0; t < g->tokens; t++) {
        int rc = lanes_token(g, t);
        if (rc) return rc;
    }
    return KVN_OK;
}

static int decode_group(int isa, lane_group *g) {
#ifdef KVN_LANES_X86
    if (g->lanes % 16 == 0 && isa >= KVN_ISA_AVX512) return kvn_lanes_group_avx512(g);
    if (g->lanes % 8 == 0 && isa >= KVN_ISA_AVX2) return kvn_lanes_group_avx2(g);
#else
    (void)isa;
#endif
    return group_portable(g);
}

/* A side information symbol (class or reference offset) with model `model` and state *x: the last symbol
 * starting at or before the slot (symbols of frequency 0 start where the next one does). */
static int side_symbol(const kvn_tans_model *m, size_t model, uint32_t *x, lane_group *g, unsigned *sym) {
    const uint32_t *fcx = m->fcx + model * KVN_TANS_SYMBOLS;
    uint32_t slot = *x & (T - 1);
    unsigned s = KVN_TANS_SYMBOLS - 1;
    while (((fcx[s] >> 12) & 0xFFF) > slot) s--;
    uint32_t v = (fcx[s] & 0xFFF) * (*x >> L) + slot - ((fcx[s] >> 12) & 0xFFF);
    for (int round = 0; round < 2 && v < RANS_LOW; round++) {
        if (g->bp == g->n_bytes) return KVN_ERR_CORRUPT;
        v = v << 8 | g->bytes[g->bp++];
    }
    *x = v;
    *sym = s;
    return KVN_OK;
}

/* Each channel's class and reference, then every value's symbol, sym[t * C + place]; `chan` gets the channels
 * in coding order, `refs` each channel's reference. */
static int decode_symbols(int isa, const kvn_tans_model *m, const kvn_block *b, const lane_chunk *c, lane_group *g,
                          uint8_t *cls, uint32_t *chan, uint32_t *refs, uint8_t *sym) {
    size_t H = b->heads, D = b->dim, C = H * D;
    uint32_t level_count = split_of(b->dtype).level_count;
    for (size_t ch = 0; ch < C; ch++) {
        unsigned k, offset;
        if (side_symbol(m, m->class_model, &g->x[(2 * ch) % LANES], g, &k) ||
            side_symbol(m, m->ref_model, &g->x[(2 * ch + 1) % LANES], g, &offset))
            return KVN_ERR_CORRUPT;
        uint32_t ref = c->base + offset;
        if ((offset == REF_SYMBOLS - 1 && !next_escape(c->side, &ref)) || ref >= level_count || k >= (unsigned)m->classes)
            return KVN_ERR_CORRUPT;
        cls[ch] = (uint8_t)k;
        refs[ch] = ref;
    }
    coding_channels(cls, H, D, 3, chan);
    uint32_t x[LANES];
    memcpy(x, g->x, sizeof(x));
    for (size_t h = 0; h < H; h++)
        for (size_t d0 = 0; d0 < D; d0 += LANES) {
            size_t place = h * D + d0;
            g->back = c->back + h;
            g->lanes = D - d0 < LANES ? D - d0 : LANES;
            g->sym = sym + place;
            for (size_t k = 0; k < g->lanes; k++) {
                g->cls[k] = cls[chan[place + k]] * (uint32_t)m->contexts;
                g->model[k] = g->cls[k] + (uint32_t)m->start_context;
                g->x[k] = x[k];
            }
            int rc = decode_group(isa, g);
            if (rc) return rc;
            memcpy(x, g->x, g->lanes * sizeof(uint32_t));
        }
    memcpy(g->x, x, sizeof(x));
    return g->bp == g->n_bytes ? KVN_OK : KVN_ERR_CORRUPT;
}

/* ---- the values -------------------------------------------------------------------------- */

/* The plane's tail put together from the final states `x`; KVN_ERR_CORRUPT where a state holds no raw bits
 * or holds bits past the plane's end. */
static int join_tail(const lane_chunk *c, const uint32_t *x, uint64_t row_bits, raw_plane *rp) {
    uint64_t total = c->raw_bits, split = section_bits(3, total), held = total - split;
    rp->section = c->side->raw;
    rp->split = split;
    rp->joined_at = split > row_bits ? (split - row_bits) / 8 * 8 : 0;
    size_t from = (size_t)(rp->joined_at / 8), section_end = (size_t)((split + 7) / 8);
    rp->joined = calloc((size_t)((total + 7) / 8) - from + JOINED_PAD, 1);
    if (!rp->joined) return KVN_ERR_NOMEM;
    memcpy(rp->joined, rp->section + from, section_end - from);
    uint64_t at = split - rp->joined_at;
    if (at & 7) rp->joined[at >> 3] &= (uint8_t)((1u << (at & 7)) - 1); /* the section's padding */
    for (uint64_t i = 0; i < HELD_BITS; i++) {
        uint32_t state = x[i / HELD_PER_STATE];
        if (state >> HELD_PER_STATE != 1) return KVN_ERR_CORRUPT;
        uint32_t bit = state >> (i % HELD_PER_STATE) & 1;
        if (i >= held) {
            if (bit) return KVN_ERR_CORRUPT;
            continue;
        }
        rp->joined[(at + i) >> 3] |= (uint8_t)(bit << ((at + i) & 7));
    }
    return KVN_OK;
}

/* The values of the block, row by row. */
KVN_INLINE int values_w(const lane_values *v, uint8_t *dst, unsigned width, unsigned RB, unsigned SS, uint32_t LEVEL_COUNT) {
    const kvn_block *b = v->b;
    size_t H = b->heads, D = b->dim;
    side_data sides = *v->side; /* in locals: the stores to dst could alias it otherwise */
    uint32_t bad = 0;
    uint64_t pos = 0; /* the plane's bit of the row's first value */
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++) {
            uint8_t *row = dst + (h * b->head_stride + t * D) * width;
            uint32_t bk = v->back[t * H + h];
            if (bk) { /* the symbols' pass checked that it points into the block */
                memcpy(row, row - (size_t)bk * D * width, D * width);
                continue;
            }
            unsigned bit;
            const uint8_t *raw = raw_at(&v->raw, pos, D * RB, &bit);
            value_row(v, t, h, raw, bit, &sides, &bad, row, width, RB, SS, LEVEL_COUNT);
            pos += D * RB;
        }
    *v->side = sides;
    return bad ? KVN_ERR_CORRUPT : KVN_OK;
}

static int decode_values(int isa, const lane_values *v, uint8_t *dst) {
    size_t D = v->b->dim;
#ifdef KVN_LANES_X86
    int simd16 = D % 32 == 0 && D <= 128 && (v->b->dtype == KVN_BF16 || v->b->dtype == KVN_FP16);
    if (simd16 && isa >= KVN_ISA_AVX512)
        return v->b->dtype == KVN_BF16 ? kvn_lanes_values16_avx512(v, dst, 6, 15, 512) : kvn_lanes_values16_avx512(v, dst, 9, 15, 64);
    if (simd16 && isa >= KVN_ISA_AVX2)
        return v->b->dtype == KVN_BF16 ? kvn_lanes_values16_avx2(v, dst, 6, 15, 512) : kvn_lanes_values16_avx2(v, dst, 9, 15, 64);
#else
    (void)isa;
    (void)D;
#endif
#define DTYPE(w, rb, ss, levels) values_w(v, dst, w, rb, ss, levels)
    RETURN_BY_DTYPE(v->b->dtype, DTYPE)
#undef DTYPE
}

int kvn_tans_lanes_decode(const kvn_tans_model *m, const kvn_block *b, const lane_chunk *c, uint8_t *dst) {
    size_t D = b->dim, C = b->heads * D;
    if (D > 65536) return KVN_ERR_ARG; /* a channel's place within its head is 16 bits */
    if (c->stream_len < 4 * LANES) return KVN_ERR_CORRUPT;
    int isa = kvn_isa();
    lane_group g = {m->bucket, m->fcx, m->refill_index, m->context_of, NULL, b->heads, b->tokens, 0, C, NULL, c->stream + 4 * LANES,
                    c->stream_len - 4 * LANES, 0, {0}, {0}, {0}};
    for (int k = 0; k < LANES; k++) {
        g.x[k] = kvn_rd32(c->stream + 4 * k);
        if (g.x[k] < RANS_LOW || g.x[k] >> 31) return KVN_ERR_CORRUPT;
    }
    /* the SIMD kernels read up to 128 symbols and 64 places past a head's first */
    uint8_t *sym = malloc(b->tokens * C + 128), *cls = malloc(C);
    uint16_t *local = calloc(C + 64, sizeof(uint16_t));
    uint32_t *chan = malloc(C * sizeof(uint32_t)), *refs = malloc(C * sizeof(uint32_t));
    lane_values v = {b, sym, local, refs, c->back, {NULL, NULL, 0, 0}, c->side};
    int rc = KVN_ERR_NOMEM;
    if (sym && cls && local && chan && refs) {
        rc = decode_symbols(isa, m, b, c, &g, cls, chan, refs, sym);
        for (size_t p = 0; !rc && p < C; p++) local[chan[p]] = (uint16_t)(p % D);
        if (!rc) rc = join_tail(c, g.x, (uint64_t)D * split_of(b->dtype).raw_bits, &v.raw);
        if (!rc) rc = decode_values(isa, &v, dst);
    }
    free(sym);
    free(cls);
    free(local);
    free(chan);
    free(refs);
    free(v.raw.joined);
    return rc;
}
