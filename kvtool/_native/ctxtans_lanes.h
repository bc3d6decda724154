/* Chunk version 3's lane kernels, inside: one group's symbols decoded and encoded the same way by the
 * portable, AVX2 and AVX-512 variants (ctxtans_lanes.c, ctxtans_lanes_encode.c, ctxtans_avx2.c,
 * ctxtans_avx512.c).
 *
 * A group is up to 64 channels of one head (its lanes), each with its own rANS state; the group's
 * tokens go in order, and at each token (a step) every lane whose row is coded decodes its symbol:
 * the slot (the state's low 11 bits) gives the symbol through the model's buckets, the symbol its
 * frequency and start; then each state that fell below RANS_LOW takes the stream's next byte, in
 * lane order, and each still below takes another. The lanes are independent but for whose byte
 * comes next: what a SIMD register does for 8 or 16 lanes at once, with a gather for each table. */
#ifndef KVN_CTXTANS_LANES_H
#define KVN_CTXTANS_LANES_H
#include "ctxtans_impl.h"

/* A SIMD step reads up to 2 * LANES + 16 bytes past the stream's next one: the portable step runs nearer the end. */
#define LANES_MARGIN (2 * LANES + 16)

/* The symbol of `slot` in symbol model `model` (every symbol of frequency 1 or more), from its bucket. */
KVN_INLINE unsigned bucket_symbol(const uint32_t *bucket, uint32_t model, uint32_t slot) {
    uint32_t e = bucket[model * BUCKETS + (slot >> 4)], i = slot & 15;
    return (e & 63) + (unsigned)__builtin_popcount(e & ((2u << i) - 2) << 8);
}

/* ---- decoding -------------------------------------------------------------------------- */

typedef struct {
    const uint32_t *bucket, *fcx; /* the model's tables */
    const uint8_t (*refill_index)[8]; /* per mask of 8 lanes that take a byte: each lane's byte among them */
    const uint8_t *context_of;
    const uint32_t *back;         /* back[t * back_stride]: the repeat distance of the group's head's row t */
    size_t back_stride, tokens, lanes, sym_stride;
    uint8_t *sym;                 /* sym[t * sym_stride + lane]: the symbols decoded */
    const uint8_t *bytes;         /* the stream's bytes after the states, n_bytes of them; the next is bytes[bp] */
    size_t n_bytes, bp;
    uint32_t cls[LANES];          /* per lane: its class's first model (class * contexts) */
    uint32_t model[LANES];        /* per lane: the model of its next symbol */
    uint32_t x[LANES];            /* per lane: its state */
} lane_group;

/* A repeated row: each lane takes the symbol of the row `bk` tokens back, and the context it leaves. */
KVN_INLINE void lanes_repeat(lane_group *g, size_t t, uint32_t bk) {
    uint8_t *s = g->sym + t * g->sym_stride;
    const uint8_t *from = s - (size_t)bk * g->sym_stride;
    for (size_t k = 0; k < g->lanes; k++) {
        s[k] = from[k];
        g->model[k] = g->cls[k] + g->context_of[from[k]];
    }
}

/* A coded row: each lane's symbol, then the two rounds of refills; 0 when the stream ends before it. */
KVN_INLINE int lanes_step(lane_group *g, size_t t) {
    uint8_t *s = g->sym + t * g->sym_stride;
    for (size_t k = 0; k < g->lanes; k++) {
        uint32_t x = g->x[k], slot = x & (T - 1), model = g->model[k];
        unsigned sym = bucket_symbol(g->bucket, model, slot);
        uint32_t fc = g->fcx[model * KVN_TANS_SYMBOLS + sym];
        g->x[k] = (fc & 0xFFF) * (x >> L) + slot - ((fc >> 12) & 0xFFF);
        g->model[k] = g->cls[k] + (fc >> 24);
        s[k] = (uint8_t)sym;
    }
    for (int round = 0; round < 2; round++)
        for (size_t k = 0; k < g->lanes; k++)
            if (g->x[k] < RANS_LOW) {
                if (g->bp == g->n_bytes) return 0;
                g->x[k] = g->x[k] << 8 | g->bytes[g->bp++];
            }
    return 1;
}

/* Token t of the group the portable way (a repeat, or a coded row); KVN_ERR_CORRUPT where malformed. */
KVN_INLINE int lanes_token(lane_group *g, size_t t) {
    uint32_t bk = g->back[t * g->back_stride];
    if (bk) {
        if (bk > t) return KVN_ERR_CORRUPT;
        lanes_repeat(g, t, bk);
        return KVN_OK;
    }
    return lanes_step(g, t) ? KVN_OK : KVN_ERR_CORRUPT;
}

/* ---- the values ---------------------------------------------------------------------------- */

/* The raw bits of the coded values: the section's, then, from bit `split` on, those the final states
 * held. A row whose bits reach past `split` reads them from `joined`, a copy of the plane's bits from
 * bit `joined_at` (a multiple of 8) to its end, padded for reads of 64 bytes. */
typedef struct {
    const uint8_t *section;
    uint8_t *joined;
    uint64_t split, joined_at;
} raw_plane;

#define JOINED_PAD 64

/* Where row bits [pos, pos + n) are: the byte that holds bit pos, and pos's bit in it. */
KVN_INLINE const uint8_t *raw_at(const raw_plane *rp, uint64_t pos, uint64_t n, unsigned *bit) {
    if (pos + n > rp->split) {
        pos -= rp->joined_at;
        *bit = (unsigned)(pos & 7);
        return rp->joined + (pos >> 3);
    }
    *bit = (unsigned)(pos & 7);
    return rp->section + (pos >> 3);
}

/* What the values' pass reads: the symbols by place (sym[t * C + place]), each channel's place within its
 * head (local) and reference, the rows' repeat distances, the raw plane and the escapes. */
typedef struct {
    const kvn_block *b;
    const uint8_t *sym;
    const uint16_t *local;
    const uint32_t *refs, *back;
    raw_plane raw;
    side_data *side;
} lane_values;

/* One coded row (t, h) of D values, the portable way; its raw bits start `bit` bits into `raw`. Sets *bad
 * where a level is out of range or the escapes run out. */
KVN_INLINE void value_row(const lane_values *v, size_t t, size_t h, const uint8_t *raw, uint64_t bit, side_data *sd,
                          uint32_t *bad, uint8_t *row, unsigned width, unsigned RB, unsigned SS, uint32_t LEVEL_COUNT) {
    size_t D = v->b->dim;
    const uint8_t *s = v->sym + t * v->b->heads * D + h * D;
    const uint16_t *at = v->local + h * D;
    const uint32_t *ref = v->refs + h * D, raw_mask = (1u << RB) - 1;
    for (size_t d = 0; d < D; d++, bit += RB) {
        unsigned sy = s[at[d]];
        uint32_t q = sy % LEVELS, level = ref[d] + (uint32_t)(LOW - 1) + q;
        if (__builtin_expect(!q, 0) && !next_escape(sd, &level)) *bad = 1;
        *bad |= level >= LEVEL_COUNT;
        uint32_t r = (uint32_t)(kvn_rd64(raw + (bit >> 3)) >> (bit & 7)) & raw_mask;
        store(row + d * width, (uint32_t)(sy / LEVELS) << SS | level << RB | r, width);
    }
}

/* ---- encoding ---------------------------------------------------------------------------- */

/* One group being encoded: the block's symbols, the group's channels, and the lanes' states. */
typedef struct {
    const uint32_t *rcp, *rec;  /* the model's encoder records */
    const uint8_t *sym;         /* sym[t * stride + c]: the symbol of channel c at token t (padded for 4-byte reads) */
    const uint8_t *context_of;
    uint32_t start_context;
    const uint32_t *back;       /* back[t * back_stride]: the repeat distance of the group's head's row t */
    size_t back_stride, stride, tokens, lanes;
    uint32_t context32[KVN_TANS_SYMBOLS]; /* context_of, 32 bits each (for gathers) */
    uint32_t chan[LANES];       /* per lane: its channel */
    uint32_t cls[LANES];        /* per lane: its class's first model (class * contexts) */
    uint32_t x[LANES];          /* per lane: its state */
    uint8_t *out;               /* the bytes, in the order they are written: a decoder reads them backwards */
    size_t n_out;
} lane_coder;

/* Codes symbol `idx` (model * 64 + symbol) with state *x: first the low bytes a decoder will refill it with
 * (0, 1 or 2: `taken`, the first taken in taken[0]), then *x = (x / g << 11) + x % g + cum, the division
 * through the symbol's reciprocal (exact for x < 2^31). Returns how many bytes were taken. */
KVN_INLINE int rans_put(const uint32_t *rcp, const uint32_t *rec, size_t idx, uint32_t *x, uint8_t taken[2]) {
    uint32_t r = rec[idx], f = r & 0xFFF, v = *x, limit = f << (31 - L);
    int n = 0;
    while (v >= limit) { /* at most twice: v < 2^31 and f >= 1 */
        taken[n++] = (uint8_t)v;
        v >>= 8;
    }
    uint32_t q = (uint32_t)((uint64_t)v * rcp[idx] >> 32) >> ((r >> 12) & 0xF);
    *x = v + (r >> 16) + q * (T - f);
    return n;
}

/* One coded row of the group: the lanes' states, then their bytes as written for a step (a decoder reads
 * the first round's in lane order, then the second's): the second round's lanes last to first, then the
 * first round's lanes last to first. */
KVN_INLINE void lanes_put(lane_coder *e, size_t t) {
    const uint8_t *s = e->sym + t * e->stride, *prev = s - e->stride;
    uint8_t taken[LANES][2];
    int count[LANES];
    for (size_t k = 0; k < e->lanes; k++) {
        uint32_t c = e->chan[k], ctx = t ? e->context_of[prev[c]] : e->start_context;
        count[k] = rans_put(e->rcp, e->rec, (e->cls[k] + ctx) * (size_t)KVN_TANS_SYMBOLS + s[c], &e->x[k], taken[k]);
    }
    for (size_t k = e->lanes; k-- > 0;)
        if (count[k] == 2) e->out[e->n_out++] = taken[k][0];
    for (size_t k = e->lanes; k-- > 0;)
        if (count[k]) e->out[e->n_out++] = taken[k][count[k] - 1];
}

#ifdef KVN_LANES_X86
/* A group of 8 to LANES lanes (a multiple of 8; of 16 for AVX-512), its states in SIMD registers. */
KVN_TARGET_AVX2 int kvn_lanes_group_avx2(lane_group *g);
KVN_TARGET_AVX512 int kvn_lanes_group_avx512(lane_group *g);
/* A group's tokens of 8 to LANES lanes (a multiple of 8; of 16 for AVX-512), last to first. */
KVN_TARGET_AVX2 void kvn_lanes_encode_avx2(lane_coder *e);
KVN_TARGET_AVX512 void kvn_lanes_encode_avx512(lane_coder *e);
/* The values of a 16-bit dtype (raw_bits at most 9) whose heads hold 32, 64, 96 or 128 channels; into dst. */
KVN_TARGET_AVX2 int kvn_lanes_values16_avx2(const lane_values *v, uint8_t *dst, unsigned RB, unsigned SS, uint32_t LEVEL_COUNT);
KVN_TARGET_AVX512 int kvn_lanes_values16_avx512(const lane_values *v, uint8_t *dst, unsigned RB, unsigned SS,
                                                uint32_t LEVEL_COUNT);
#endif

/* The model's version 3 tables (bucket, fcx, rcp, rec) from its frequencies and their starts; 0, or -1
 * out of memory. */
int kvn_lanes_tables(kvn_tans_model *m, const uint16_t *g, const uint16_t *start);

#endif
