/* ctxtans chunk version 3 with AVX-512 (F, BW, VL, VBMI, VPOPCNTDQ), 16 lanes a register: a group's
 * symbols, a group's stream, and the values of 16-bit dtypes.
 *
 * Decoding a token: per register, gather each lane's bucket (its slot's symbol is the bucket's first
 * plus a popcount of the starts before it), gather the symbol's frequency, start and next context,
 * and update the states; then, twice, hand the next bytes to the lanes below RANS_LOW in lane order
 * (an expand). Encoding a token: per register, gather the symbols' records, take the low bytes of
 * the states too large (written by compresses, lanes last to first), and update the states by
 * reciprocal multiplies.
 * Repeated rows and the stream's end take the portable step of ctxtans_lanes.h. The same symbols,
 * states and bytes as the portable kernels, bit for bit. */
#include "ctxtans_lanes.h"

#ifdef KVN_LANES_X86
#include <immintrin.h>

#define AVX512_INLINE KVN_TARGET_AVX512 static inline __attribute__((always_inline))

/* A group of 16 * NV lanes. */
AVX512_INLINE int group_w(lane_group *g, const int NV) {
    const __m512i slot_mask = _mm512_set1_epi32(T - 1), twelve = _mm512_set1_epi32(0xFFF), first = _mm512_set1_epi32(63);
    const __m512i fifteen = _mm512_set1_epi32(15), two = _mm512_set1_epi32(2), low = _mm512_set1_epi32(RANS_LOW);
    const __m512i low15 = _mm512_set1_epi32(RANS_LOW >> 8);
    const int *bucket = (const int *)g->bucket, *fcx = (const int *)g->fcx;
    __m512i x[4], model[4], cls[4];
    for (int v = 0; v < NV; v++) {
        x[v] = _mm512_loadu_si512(g->x + 16 * v);
        model[v] = _mm512_loadu_si512(g->model + 16 * v);
        cls[v] = _mm512_loadu_si512(g->cls + 16 * v);
    }
    size_t bp = g->bp;
    for (size_t t = 0; t < g->tokens; t++) {
        if (g->back[t * g->back_stride] || bp + LANES_MARGIN > g->n_bytes) {
            for (int v = 0; v < NV; v++) {
                _mm512_storeu_si512(g->x + 16 * v, x[v]);
                _mm512_storeu_si512(g->model + 16 * v, model[v]);
            }
            g->bp = bp;
            int rc = lanes_token(g, t);
            if (rc) return rc;
            for (int v = 0; v < NV; v++) {
                x[v] = _mm512_loadu_si512(g->x + 16 * v);
                model[v] = _mm512_loadu_si512(g->model + 16 * v);
            }
            bp = g->bp;
            continue;
        }
        uint8_t *s = g->sym + t * g->sym_stride;
        for (int v = 0; v < NV; v++) {
            __m512i slot = _mm512_and_si512(x[v], slot_mask);
            __m512i e = _mm512_i32gather_epi32(_mm512_add_epi32(_mm512_slli_epi32(model[v], 7), _mm512_srli_epi32(slot, 4)), bucket, 4);
            __m512i starts = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_sllv_epi32(two, _mm512_and_si512(slot, fifteen)), two), 8);
            __m512i sym = _mm512_add_epi32(_mm512_and_si512(e, first), _mm512_popcnt_epi32(_mm512_and_si512(e, starts)));
            __m512i fc = _mm512_i32gather_epi32(_mm512_add_epi32(_mm512_slli_epi32(model[v], 6), sym), fcx, 4);
            x[v] = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_and_si512(fc, twelve), _mm512_srli_epi32(x[v], L)),
                                    _mm512_sub_epi32(slot, _mm512_and_si512(_mm512_srli_epi32(fc, 12), twelve)));
            model[v] = _mm512_add_epi32(cls[v], _mm512_srli_epi32(fc, 24));
            _mm_storeu_si128((__m128i *)(s + 16 * v), _mm512_cvtepi32_epi8(sym));
        }
        /* the lanes below RANS_LOW take the next bytes, in lane order; those below 2^15 need a second round */
        unsigned second = 0;
        for (int round = 0; round < 2 && (round == 0 || second); round++)
            for (int v = 0; v < NV; v++) {
                __mmask16 refill = _mm512_cmplt_epu32_mask(x[v], low);
                __m512i in = _mm512_maskz_expand_epi32(refill, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(g->bytes + bp))));
                second |= _cvtmask16_u32(_mm512_cmplt_epu32_mask(x[v], low15));
                x[v] = _mm512_mask_or_epi32(x[v], refill, _mm512_slli_epi32(x[v], 8), in);
                bp += (size_t)__builtin_popcount(_cvtmask16_u32(refill));
            }
    }
    for (int v = 0; v < NV; v++) {
        _mm512_storeu_si512(g->x + 16 * v, x[v]);
        _mm512_storeu_si512(g->model + 16 * v, model[v]);
    }
    g->bp = bp;
    return KVN_OK;
}

KVN_TARGET_AVX512 int kvn_lanes_group_avx512(lane_group *g) {
    switch (g->lanes) {
    case 64: return group_w(g, 4);
    case 48: return group_w(g, 3);
    case 32: return group_w(g, 2);
    default: return group_w(g, 1);
    }
}

/* ---- encoding ------------------------------------------------------------------------------ */

/* The high 32 bits of the products of 16 pairs of 32-bit lanes. */
AVX512_INLINE __m512i mulhi(__m512i a, __m512i b) {
    __m512i even = _mm512_srli_epi64(_mm512_mul_epu32(a, b), 32);
    __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), _mm512_srli_epi64(b, 32));
    return _mm512_mask_blend_epi32(0xAAAA, even, odd);
}

/* The bytes of the lanes in `taken` (one per lane), written lanes last to first. */
AVX512_INLINE size_t write_bytes(uint8_t *out, __mmask16 taken, __m512i bytes) {
    const __m512i backwards = _mm512_setr_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 backwards_taken = (__mmask16)_mm512_cmpneq_epi32_mask(
        _mm512_permutexvar_epi32(backwards, _mm512_maskz_set1_epi32(taken, 1)), _mm512_setzero_si512());
    __m512i packed = _mm512_maskz_compress_epi32(backwards_taken, _mm512_permutexvar_epi32(backwards, bytes));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(packed));
    return (size_t)__builtin_popcount(_cvtmask16_u32(backwards_taken));
}

/* A group of 16 * NV lanes, tokens last to first: per register the records gathered, the low bytes of the
 * states too large taken (at most two), the states updated; then the token's bytes as lanes_put writes them. */
AVX512_INLINE void encode_w(lane_coder *e, const int NV) {
    const int *rcp = (const int *)e->rcp, *rec = (const int *)e->rec;
    const __m512i twelve = _mm512_set1_epi32(0xFFF), four = _mm512_set1_epi32(0xF), table = _mm512_set1_epi32(T);
    const __m512i byte = _mm512_set1_epi32(0xFF), start = _mm512_set1_epi32((int)e->start_context);
    const __m512i contexts = _mm512_loadu_si512(e->context_of); /* a vpermb table: 64 symbols' contexts */
    __m512i x[4], cls[4], chan[4], sym[4];
    for (int v = 0; v < NV; v++) {
        x[v] = _mm512_loadu_si512(e->x + 16 * v);
        cls[v] = _mm512_loadu_si512(e->cls + 16 * v);
        chan[v] = _mm512_loadu_si512(e->chan + 16 * v);
        sym[v] = _mm512_and_si512(_mm512_i32gather_epi32(chan[v], e->sym + (e->tokens - 1) * e->stride, 1), byte);
    }
    size_t n_out = e->n_out;
    for (size_t t = e->tokens; t-- > 0;) {
        __m512i prev[4], ctx[4]; /* the symbols of token t - 1, and the contexts they leave */
        for (int v = 0; v < NV; v++) {
            prev[v] = t ? _mm512_and_si512(_mm512_i32gather_epi32(chan[v], e->sym + (t - 1) * e->stride, 1), byte) : start;
            ctx[v] = t ? _mm512_and_si512(_mm512_permutexvar_epi8(prev[v], contexts), byte) : start;
        }
        if (e->back[t * e->back_stride]) {
            for (int v = 0; v < NV; v++) sym[v] = prev[v];
            continue;
        }
        __mmask16 once[4], twice[4];
        __m512i low[4], high[4]; /* per lane the first byte taken, and the second where there is one */
        for (int v = 0; v < NV; v++) {
            __m512i model = _mm512_add_epi32(cls[v], ctx[v]);
            __m512i at = _mm512_add_epi32(_mm512_slli_epi32(model, 6), sym[v]);
            sym[v] = prev[v];
            __m512i r = _mm512_i32gather_epi32(at, rec, 4), reciprocal = _mm512_i32gather_epi32(at, rcp, 4);
            __m512i f = _mm512_and_si512(r, twelve), limit = _mm512_slli_epi32(f, 31 - L);
            once[v] = _mm512_cmpge_epu32_mask(x[v], limit);
            low[v] = _mm512_and_si512(x[v], byte);
            __m512i y = _mm512_mask_srli_epi32(x[v], once[v], x[v], 8);
            twice[v] = _mm512_cmpge_epu32_mask(y, limit);
            high[v] = _mm512_and_si512(y, byte);
            y = _mm512_mask_srli_epi32(y, twice[v], y, 8);
            __m512i q = _mm512_srlv_epi32(mulhi(y, reciprocal), _mm512_and_si512(_mm512_srli_epi32(r, 12), four));
            x[v] = _mm512_add_epi32(_mm512_add_epi32(y, _mm512_srli_epi32(r, 16)), _mm512_mullo_epi32(q, _mm512_sub_epi32(table, f)));
        }
        for (int v = NV; v-- > 0;) n_out += write_bytes(e->out + n_out, twice[v], low[v]); /* the second round's */
        for (int v = NV; v-- > 0;) /* the first round's: the last byte each lane took */
            n_out += write_bytes(e->out + n_out, once[v], _mm512_mask_blend_epi32(twice[v], low[v], high[v]));
    }
    for (int v = 0; v < NV; v++) _mm512_storeu_si512(e->x + 16 * v, x[v]);
    e->n_out = n_out;
}

KVN_TARGET_AVX512 void kvn_lanes_encode_avx512(lane_coder *e) {
    switch (e->lanes) {
    case 64: encode_w(e, 4); break;
    case 48: encode_w(e, 3); break;
    case 32: encode_w(e, 2); break;
    default: encode_w(e, 1);
    }
}

/* ---- the values of a 16-bit dtype ---------------------------------------------------------- */

/* 64 bytes of a head's symbols in dim order: `perm` holds each dim's place (< D <= 128) within the head's
 * places, whose bytes are lo:hi. */
AVX512_INLINE __m512i dim_order(__m512i lo, __m512i hi, const uint16_t *local) {
    __m256i a = _mm512_cvtepi16_epi8(_mm512_loadu_si512(local)), b = _mm512_cvtepi16_epi8(_mm512_loadu_si512(local + 32));
    return _mm512_permutex2var_epi8(lo, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), hi);
}

KVN_TARGET_AVX512 int kvn_lanes_values16_avx512(const lane_values *v, uint8_t *dst, unsigned RB, unsigned SS,
                                                uint32_t LEVEL_COUNT) {
    const kvn_block *b = v->b;
    size_t H = b->heads, D = b->dim, C = H * D;
    side_data sides = *v->side;
    uint32_t bad = 0;
    /* field k of 32 (RB bits at bit RB * k of its 4 * RB bytes): its two bytes, then a shift and a mask */
    uint8_t take[64];
    uint16_t shift[32];
    for (unsigned k = 0; k < 32; k++) {
        take[2 * k] = (uint8_t)(RB * k / 8);
        take[2 * k + 1] = (uint8_t)(RB * k / 8 + 1);
        shift[k] = (uint16_t)(RB * k % 8);
    }
    const __m512i fields = _mm512_loadu_si512(take), shifts = _mm512_loadu_si512(shift);
    const __m512i raw_mask = _mm512_set1_epi16((short)((1u << RB) - 1)), q_mask = _mm512_set1_epi16(LEVELS - 1);
    const __m512i bias = _mm512_set1_epi16(LOW - 1), outside = _mm512_set1_epi16((short)~(LEVEL_COUNT - 1));
    __m512i out_of_range = _mm512_setzero_si512();
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
            __m512i lo = _mm512_loadu_si512(places), hi = _mm512_loadu_si512(places + 64), syms[2];
            __mmask64 escapes = 0;
            for (size_t i = 0; i < D / 64 + (D % 64 != 0); i++) {
                syms[i] = dim_order(lo, hi, v->local + h * D + 64 * i);
                escapes |= ~_mm512_test_epi8_mask(syms[i], _mm512_set1_epi8(LEVELS - 1)) & (D - 64 * i >= 64 ? ~0ull : 0xFFFFFFFFull);
            }
            if (escapes) { /* rare: the escapes are taken in order, value by value */
                value_row(v, t, h, raw, bit, &sides, &bad, (uint8_t *)row, 2, RB, SS, LEVEL_COUNT);
                continue;
            }
            const uint32_t *ref = v->refs + h * D;
            for (size_t d = 0; d < D; d += 32) {
                __m256i s8 = d % 64 ? _mm512_extracti64x4_epi64(syms[d / 64], 1) : _mm512_castsi512_si256(syms[d / 64]);
                __m512i s = _mm512_cvtepu8_epi16(s8);
                __m512i r = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_loadu_si512(ref + d))),
                                               _mm512_cvtepi32_epi16(_mm512_loadu_si512(ref + d + 16)), 1);
                __m512i level = _mm512_add_epi16(_mm512_add_epi16(r, _mm512_and_si512(s, q_mask)), bias);
                out_of_range = _mm512_or_si512(out_of_range, _mm512_and_si512(level, outside));
                __m512i bytes = _mm512_loadu_si512(raw + d * RB / 8); /* rows start on a byte: D * RB % 8 == 0 */
                __m512i low = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(fields, bytes), shifts), raw_mask);
                __m512i value = _mm512_or_si512(_mm512_slli_epi16(_mm512_srli_epi16(s, 5), SS),
                                                _mm512_or_si512(_mm512_sllv_epi16(level, _mm512_set1_epi16((short)RB)), low));
                _mm512_storeu_si512(row + d, value);
            }
        }
    *v->side = sides;
    return bad || _mm512_test_epi16_mask(out_of_range, out_of_range) ? KVN_ERR_CORRUPT : KVN_OK;
}
#endif
