/* ctxtans chunk version 3 with AVX2, 8 lanes a register: a group's symbols, a group's stream, and the
 * values of 16-bit dtypes.
 *
 * Decoding a token: per register, gather each lane's bucket (its slot's symbol is the bucket's first
 * plus a popcount of the starts before it), gather the symbol's frequency, start and next context,
 * and update the states; then, twice, hand the next bytes to the lanes below RANS_LOW in lane order
 * (a permute). Encoding a token: per register, gather the symbols' records, take the low bytes of
 * the states too large (written lanes last to first), and update the states by reciprocal multiplies. Repeated rows and
 * the stream's end take the portable step of ctxtans_lanes.h. The same symbols, states and bytes as
 * the portable kernels, bit for bit. */
#include "ctxtans_lanes.h"

#ifdef KVN_LANES_X86
#include <immintrin.h>

#define AVX2_INLINE KVN_TARGET_AVX2 static inline __attribute__((always_inline))

/* The set bits of each 32-bit lane (a nibble table, then the lane's bytes summed by a multiply). */
AVX2_INLINE __m256i popcount32(__m256i v) {
    const __m256i table = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i c = _mm256_add_epi8(_mm256_shuffle_epi8(table, _mm256_and_si256(v, nibble)),
                                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)));
    return _mm256_srli_epi32(_mm256_mullo_epi32(c, _mm256_set1_epi32(0x01010101)), 24);
}

/* A group of 8 * NV lanes. */
AVX2_INLINE int group_w(lane_group *g, const int NV) {
    const __m256i slot_mask = _mm256_set1_epi32(T - 1), twelve = _mm256_set1_epi32(0xFFF), first = _mm256_set1_epi32(63);
    const __m256i fifteen = _mm256_set1_epi32(15), two = _mm256_set1_epi32(2), low = _mm256_set1_epi32(RANS_LOW);
    const __m256i low15 = _mm256_set1_epi32(RANS_LOW >> 8);
    const int *bucket = (const int *)g->bucket, *fcx = (const int *)g->fcx;
    __m256i x[8], model[8];
    for (int v = 0; v < NV; v++) {
        x[v] = _mm256_loadu_si256((const __m256i *)(g->x + 8 * v));
        model[v] = _mm256_loadu_si256((const __m256i *)(g->model + 8 * v));
    }
    size_t bp = g->bp;
    for (size_t t = 0; t < g->tokens; t++) {
        if (g->back[t * g->back_stride] || bp + LANES_MARGIN > g->n_bytes) {
            for (int v = 0; v < NV; v++) {
                _mm256_storeu_si256((__m256i *)(g->x + 8 * v), x[v]);
                _mm256_storeu_si256((__m256i *)(g->model + 8 * v), model[v]);
            }
            g->bp = bp;
            int rc = lanes_token(g, t);
            if (rc) return rc;
            for (int v = 0; v < NV; v++) {
                x[v] = _mm256_loadu_si256((const __m256i *)(g->x + 8 * v));
                model[v] = _mm256_loadu_si256((const __m256i *)(g->model + 8 * v));
            }
            bp = g->bp;
            continue;
        }
        uint8_t *s = g->sym + t * g->sym_stride;
        for (int v = 0; v < NV; v++) {
            __m256i slot = _mm256_and_si256(x[v], slot_mask);
            __m256i e = _mm256_i32gather_epi32(bucket, _mm256_add_epi32(_mm256_slli_epi32(model[v], 7), _mm256_srli_epi32(slot, 4)), 4);
            __m256i starts = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_sllv_epi32(two, _mm256_and_si256(slot, fifteen)), two), 8);
            __m256i sym = _mm256_add_epi32(_mm256_and_si256(e, first), popcount32(_mm256_and_si256(e, starts)));
            __m256i fc = _mm256_i32gather_epi32(fcx, _mm256_add_epi32(_mm256_slli_epi32(model[v], 6), sym), 4);
            x[v] = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_and_si256(fc, twelve), _mm256_srli_epi32(x[v], L)),
                                    _mm256_sub_epi32(slot, _mm256_and_si256(_mm256_srli_epi32(fc, 12), twelve)));
            __m256i cls = _mm256_loadu_si256((const __m256i *)(g->cls + 8 * v));
            model[v] = _mm256_add_epi32(cls, _mm256_srli_epi32(fc, 24));
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(sym), _mm256_extracti128_si256(sym, 1));
            _mm_storel_epi64((__m128i *)(s + 8 * v), _mm_packus_epi16(packed, packed));
        }
        /* the lanes below RANS_LOW take the next bytes, in lane order; those below 2^15 need a second round */
        unsigned second = 0;
        for (int round = 0; round < 2 && (round == 0 || second); round++)
            for (int v = 0; v < NV; v++) {
                __m256i refill = _mm256_cmpgt_epi32(low, x[v]);
                unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(refill));
                __m256i which = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)g->refill_index[mask]));
                __m256i in = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(g->bytes + bp))), which);
                second |= (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(low15, x[v])));
                x[v] = _mm256_blendv_epi8(x[v], _mm256_or_si256(_mm256_slli_epi32(x[v], 8), in), refill);
                bp += (size_t)__builtin_popcount(mask);
            }
    }
    for (int v = 0; v < NV; v++) {
        _mm256_storeu_si256((__m256i *)(g->x + 8 * v), x[v]);
        _mm256_storeu_si256((__m256i *)(g->model + 8 * v), model[v]);
    }
    g->bp = bp;
    return KVN_OK;
}

KVN_TARGET_AVX2 int kvn_lanes_group_avx2(lane_group *g) {
    switch (g->lanes) {
    case 64: return group_w(g, 8);
    case 56: return group_w(g, 7);
    case 48: return group_w(g, 6);
    case 40: return group_w(g, 5);
    case 32: return group_w(g, 4);
    case 24: return group_w(g, 3);
    case 16: return group_w(g, 2);
    default: return group_w(g, 1);
    }
}

/* ---- encoding ------------------------------------------------------------------------------ */

/* The high 32 bits of the products of 8 pairs of 32-bit lanes. */
AVX2_INLINE __m256i mulhi(__m256i a, __m256i b) {
    __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(a, b), 32);
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), _mm256_srli_epi64(b, 32));
    return _mm256_blend_epi32(even, odd, 0xAA);
}

/* The bytes of the lanes set in `taken` (a lane mask), written lanes last to first. */
AVX2_INLINE size_t write_bytes(uint8_t *out, unsigned taken, __m256i bytes) {
    uint32_t lanes[8];
    size_t n = 0;
    _mm256_storeu_si256((__m256i *)lanes, bytes);
    for (int k = 8; k-- > 0;)
        if (taken >> k & 1) out[n++] = (uint8_t)lanes[k];
    return n;
}

/* A group of 8 * NV lanes, tokens last to first: per register the records gathered, the low bytes of the
 * states too large taken (at most two), the states updated; then the token's bytes as lanes_put writes them. */
AVX2_INLINE void encode_w(lane_coder *e, const int NV) {
    const int *rcp = (const int *)e->rcp, *rec = (const int *)e->rec;
    const __m256i twelve = _mm256_set1_epi32(0xFFF), four = _mm256_set1_epi32(0xF), table = _mm256_set1_epi32(T);
    const __m256i byte = _mm256_set1_epi32(0xFF), start = _mm256_set1_epi32((int)e->start_context);
    const int *contexts = (const int *)e->context32;
    __m256i x[8], sym[8];
    for (int v = 0; v < NV; v++) {
        x[v] = _mm256_loadu_si256((const __m256i *)(e->x + 8 * v));
        __m256i chan = _mm256_loadu_si256((const __m256i *)(e->chan + 8 * v));
        sym[v] = _mm256_and_si256(_mm256_i32gather_epi32((const int *)(e->sym + (e->tokens - 1) * e->stride), chan, 1), byte);
    }
    size_t n_out = e->n_out;
    for (size_t t = e->tokens; t-- > 0;) {
        __m256i prev[8], ctx[8]; /* the symbols of token t - 1, and the contexts they leave */
        for (int v = 0; v < NV; v++) {
            __m256i chan = _mm256_loadu_si256((const __m256i *)(e->chan + 8 * v));
            prev[v] = t ? _mm256_and_si256(_mm256_i32gather_epi32((const int *)(e->sym + (t - 1) * e->stride), chan, 1), byte) : start;
            ctx[v] = t ? _mm256_i32gather_epi32(contexts, prev[v], 4) : start;
        }
        if (e->back[t * e->back_stride]) {
            for (int v = 0; v < NV; v++) sym[v] = prev[v];
            continue;
        }
        unsigned once[8], twice[8];
        __m256i low[8], last[8]; /* per lane the first byte taken, and the last */
        for (int v = 0; v < NV; v++) {
            __m256i model = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(e->cls + 8 * v)), ctx[v]);
            __m256i at = _mm256_add_epi32(_mm256_slli_epi32(model, 6), sym[v]);
            sym[v] = prev[v];
            __m256i r = _mm256_i32gather_epi32(rec, at, 4), reciprocal = _mm256_i32gather_epi32(rcp, at, 4);
            __m256i f = _mm256_and_si256(r, twelve), limit = _mm256_slli_epi32(f, 31 - L);
            __m256i first = _mm256_cmpeq_epi32(_mm256_max_epu32(x[v], limit), x[v]); /* x >= limit, unsigned */
            low[v] = _mm256_and_si256(x[v], byte);
            __m256i y = _mm256_blendv_epi8(x[v], _mm256_srli_epi32(x[v], 8), first);
            __m256i second = _mm256_cmpeq_epi32(_mm256_max_epu32(y, limit), y);
            last[v] = _mm256_blendv_epi8(low[v], _mm256_and_si256(y, byte), second);
            y = _mm256_blendv_epi8(y, _mm256_srli_epi32(y, 8), second);
            once[v] = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(first));
            twice[v] = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(second));
            __m256i q = _mm256_srlv_epi32(mulhi(y, reciprocal), _mm256_and_si256(_mm256_srli_epi32(r, 12), four));
            x[v] = _mm256_add_epi32(_mm256_add_epi32(y, _mm256_srli_epi32(r, 16)), _mm256_mullo_epi32(q, _mm256_sub_epi32(table, f)));
        }
        for (int v = NV; v-- > 0;) n_out += write_bytes(e->out + n_out, twice[v], low[v]); /* the second round's */
        for (int v = NV; v-- > 0;) n_out += write_bytes(e->out + n_out, once[v], last[v]);  /* the first round's */
    }
    for (int v = 0; v < NV; v++) _mm256_storeu_si256((__m256i *)(e->x + 8 * v), x[v]);
    e->n_out = n_out;
}

KVN_TARGET_AVX2 void kvn_lanes_encode_avx2(lane_coder *e) {
    switch (e->lanes) {
    case 64: encode_w(e, 8); break;
    case 56: encode_w(e, 7); break;
    case 48: encode_w(e, 6); break;
    case 40: encode_w(e, 5); break;
    case 32: encode_w(e, 4); break;
    case 24: encode_w(e, 3); break;
    case 16: encode_w(e, 2); break;
    default: encode_w(e, 1);
    }
}

/* ---- the values of a 16-bit dtype ---------------------------------------------------------- */

/* 32 of a head's symbols in dim order: each byte of `index` a place (< 16 * quarters) of the head's
 * places, whose 16-byte quarters are q (each in both halves of its register). */
AVX2_INLINE __m256i dim_order(const __m256i *q, int quarters, __m256i index) {
    __m256i out = _mm256_setzero_si256(), low = _mm256_and_si256(index, _mm256_set1_epi8(15));
    __m256i which = _mm256_srli_epi16(_mm256_andnot_si256(_mm256_set1_epi8(15), index), 4);
    for (int j = 0; j < quarters; j++) {
        __m256i pick = _mm256_cmpeq_epi8(which, _mm256_set1_epi8((char)j));
        out = _mm256_or_si256(out, _mm256_and_si256(pick, _mm256_shuffle_epi8(q[j], low)));
    }
    return out;
}

KVN_TARGET_AVX2 int kvn_lanes_values16_avx2(const lane_values *v, uint8_t *dst, unsigned RB, unsigned SS, uint32_t LEVEL_COUNT) {
    const kvn_block *b = v->b;
    size_t H = b->heads, D = b->dim, C = H * D;
    side_data sides = *v->side;
    uint32_t bad = 0;
    /* field k of 8 (RB bits at bit RB * k of its RB bytes), in each half: its two bytes, then a multiply
     * that puts its bits at the top of the lane and a shift down */
    uint8_t take[32];
    uint16_t scale[16];
    for (unsigned k = 0; k < 16; k++) {
        take[2 * k] = (uint8_t)(RB * (k % 8) / 8);
        take[2 * k + 1] = (uint8_t)(RB * (k % 8) / 8 + 1);
        scale[k] = (uint16_t)(1u << (16 - RB - RB * (k % 8) % 8));
    }
    const __m256i fields = _mm256_loadu_si256((const __m256i *)take), scales = _mm256_loadu_si256((const __m256i *)scale);
    const __m256i q_mask = _mm256_set1_epi16(LEVELS - 1), bias = _mm256_set1_epi16(LOW - 1);
    const __m256i outside = _mm256_set1_epi16((short)~(LEVEL_COUNT - 1)), zero = _mm256_setzero_si256();
    __m256i out_of_range = zero;
    int quarters = (int)(D / 16);
    uint64_t pos = 0;
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++) {
            uint16_t *row = (uint16_t *)(dst + (h * b->head_stride + t * D) * 2);
            uint32_t bk = v->back[t * H + h];
            if (bk) {
                memcpy(row, row - (size_t)bk * D, D * 2);
                continue;
            }
            unsigned bit;
            const uint8_t *raw = raw_at(&v->raw, pos, D * RB, &bit), *places = v->sym + t * C + h * D;
            pos += D * RB;
            __m256i q[8], syms[4];
            for (int j = 0; j < quarters; j++) q[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(places + 16 * j)));
            const uint16_t *local = v->local + h * D;
            int escapes = 0;
            for (size_t i = 0; i < D / 32; i++) {
                __m256i a = _mm256_loadu_si256((const __m256i *)(local + 32 * i));
                __m256i c = _mm256_loadu_si256((const __m256i *)(local + 32 * i + 16));
                __m256i index = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, c), 0xD8);
                syms[i] = dim_order(q, quarters, index);
                escapes |= _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(syms[i], _mm256_set1_epi8(LEVELS - 1)), zero));
            }
            if (escapes) { /* rare: the escapes are taken in order, value by value */
                value_row(v, t, h, raw, bit, &sides, &bad, (uint8_t *)row, 2, RB, SS, LEVEL_COUNT);
                continue;
            }
            const uint32_t *ref = v->refs + h * D;
            for (size_t d = 0; d < D; d += 16) {
                __m256i s = _mm256_cvtepu8_epi16(d % 32 ? _mm256_extracti128_si256(syms[d / 32], 1) : _mm256_castsi256_si128(syms[d / 32]));
                __m256i r = _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_loadu_si256((const __m256i *)(ref + d)),
                                                                         _mm256_loadu_si256((const __m256i *)(ref + d + 8))), 0xD8);
                __m256i level = _mm256_add_epi16(_mm256_add_epi16(r, _mm256_and_si256(s, q_mask)), bias);
                out_of_range = _mm256_or_si256(out_of_range, _mm256_and_si256(level, outside));
                const uint8_t *at = raw + d * RB / 8; /* rows start on a byte: D * RB % 8 == 0 */
                __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)at)),
                                                        _mm_loadu_si128((const __m128i *)(at + RB)), 1);
                __m256i low = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, fields), scales), 16 - RB);
                __m256i value = _mm256_or_si256(_mm256_slli_epi16(_mm256_srli_epi16(s, 5), SS),
                                                _mm256_or_si256(_mm256_slli_epi16(level, RB), low));
                _mm256_storeu_si256((__m256i *)(row + d), value);
            }
        }
    *v->side = sides;
    return bad || !_mm256_testz_si256(out_of_range, out_of_range) ? KVN_ERR_CORRUPT : KVN_OK;
}
#endif
