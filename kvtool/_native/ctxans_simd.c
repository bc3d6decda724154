/* ctxans decoder rows with AVX2 (x86-64 GCC/Clang builds; chosen at run time in kvn_ctx_model_new). */
#include "ctxans_impl.h"

#ifdef KVN_AVX2_ROWS

/* rans_row with AVX2: states 0-7 and 8-15 are two vectors, each decoding eight channels at once.
 * Words are handed to the lanes that renormalise in lane order, as the scalar decoder reads them. */
__attribute__((target("avx2,popcnt"))) void kvn_ctx_rans_row_avx2(
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
__attribute__((target("avx2"))) int kvn_ctx_put_values_bf16_avx2(const layout *l, const split *sp, const uint8_t *syms,
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
