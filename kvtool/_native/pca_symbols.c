/* The coefficient stream of a `pca` plane, a token at a time (pca_symbols.h). Neither reader branches on the
 * data but for the rare refill of extra bits: states are renormalised by a select, every symbol's extra bits are
 * taken (none for most), and a malformed stream is noted and refused at the end of its token. Reads stay inside
 * the plane whatever its bytes: slots are masked, words clamped, bits bounded. */
#include "pca_symbols.h"

#include <string.h>
#if defined(KVN_PCA_TOKEN_AVX2)
#include <immintrin.h>
#endif

#define SLOT_MASK ((1u << KVN_PCA_PROB_BITS) - 1u)

#if defined(KVN_PCA_TOKEN_AVX2)
/* RANKS[m] byte u: how many of the lanes below u have their bit set in mask m, the word a renormalising lane u
 * takes among the run's next eight (a table of constants: no pdep, which some AVX2 CPUs run in microcode). */
#define RANK(m, u) ((uint64_t)__builtin_popcount((m) & ((1u << (u)) - 1u)) << (8 * (u)))
#define RANKS_OF(m) (RANK(m, 1) | RANK(m, 2) | RANK(m, 3) | RANK(m, 4) | RANK(m, 5) | RANK(m, 6) | RANK(m, 7))
#define RANKS4(m) RANKS_OF(m), RANKS_OF((m) + 1), RANKS_OF((m) + 2), RANKS_OF((m) + 3)
#define RANKS16(m) RANKS4(m), RANKS4((m) + 4), RANKS4((m) + 8), RANKS4((m) + 12)
#define RANKS64(m) RANKS16(m), RANKS16((m) + 16), RANKS16((m) + 32), RANKS16((m) + 48)
static const uint64_t RANKS[256] = {RANKS64(0), RANKS64(64), RANKS64(128), RANKS64(192)};
#endif

/* The value of a symbol (its extra bits taken from the reader) into *q; nonzero where malformed. */
static inline uint32_t put_value(unsigned sym, const kvn_pca_symbol *info, uint64_t *acc, unsigned *fill,
                                 const uint8_t *bytes, size_t *at_byte, size_t nbytes, uint32_t *total, uint16_t *q) {
    kvn_pca_symbol in = info[sym];
    uint32_t bad = 0;
    if (*fill < in.nbits) {
        for (; *fill <= 56 && *at_byte < nbytes; *fill += 8) *acc |= (uint64_t)bytes[(*at_byte)++] << *fill;
        bad |= *fill < in.nbits;
    }
    uint32_t extra = (uint32_t)(*acc & ((1u << in.nbits) - 1u));
    *acc >>= in.nbits;
    *fill -= in.nbits;
    uint32_t value = (in.base + extra + 1) & -(uint32_t)(sym != 0);
    bad |= value > KVN_PCA_MAX_Q;
    *total += value;
    uint32_t negative = in.negative;
    *q = (uint16_t)((value ^ -negative) + negative);
    return bad;
}

uint32_t kvn_pca_token_scalar(kvn_pca_reader *r, const uint32_t *slots, const uint32_t *live, const uint32_t *base,
                              size_t nlive, const kvn_pca_symbol *info, uint16_t *q16, uint32_t *total) {
    /* everything the loop updates in locals, which the compiler keeps in registers (the core is built without
     * strict aliasing: through r, every coefficient stored would reload them) */
    const uint8_t *words = r->words, *bytes = r->bytes;
    size_t pos = r->pos, nwords = r->nwords, at_byte = r->at_byte, nbytes = r->nbytes;
    uint64_t acc = r->acc;
    unsigned fill = r->fill, phase = r->phase;
    uint32_t sum = 0, bad = 0;
    uint32_t y0 = r->x[phase & 7], y1 = r->x[(phase + 1) & 7], y2 = r->x[(phase + 2) & 7], y3 = r->x[(phase + 3) & 7],
             y4 = r->x[(phase + 4) & 7], y5 = r->x[(phase + 5) & 7], y6 = r->x[(phase + 6) & 7], y7 = r->x[(phase + 7) & 7];
#define STEP(Y, K)                                                                                              \
    do {                                                                                                        \
        uint32_t e = slots[base[K] + (Y & SLOT_MASK)];                                                          \
        uint32_t v = (e & 0xFFFu) * (Y >> KVN_PCA_PROB_BITS) + ((e >> 12) & 0x7FFu);                            \
        uint16_t word;                                                                                          \
        memcpy(&word, words + 2 * (pos < nwords ? pos : nwords), 2);                                            \
        uint32_t renorm = v < KVN_PCA_LOW;                                                                      \
        Y = renorm ? v << 16 | word : v;                                                                        \
        pos += renorm;                                                                                          \
        bad |= put_value(e >> 23, info, &acc, &fill, bytes, &at_byte, nbytes, &sum, q16 + live[K]);             \
    } while (0)
    size_t k = 0;
    for (; k + 8 <= nlive; k += 8) {  /* eight symbols, one of each state, the states in registers */
        STEP(y0, k);
        STEP(y1, k + 1);
        STEP(y2, k + 2);
        STEP(y3, k + 3);
        STEP(y4, k + 4);
        STEP(y5, k + 5);
        STEP(y6, k + 6);
        STEP(y7, k + 7);
    }
    uint32_t ys[8] = {y0, y1, y2, y3, y4, y5, y6, y7};  /* the last few symbols: states by index */
    for (size_t u = 0; k < nlive; k++, u++) STEP(ys[u], k);
#undef STEP
    for (unsigned u = 0; u < 8; u++) r->x[(phase + u) & 7] = ys[u];
    r->phase = phase + (unsigned)nlive;
    r->pos = pos;
    r->at_byte = at_byte;
    r->acc = acc;
    r->fill = fill;
    *total = sum;
    return bad;
}

#if defined(KVN_PCA_TOKEN_AVX2)
/* Eight symbols a step, lane u holding the state of symbol k + u: their slots gathered, the new states computed
 * together, and the lanes that renormalise given the next words in lane order (each lane's rank among them from
 * RANKS); then their values, in order, as the portable reader takes them. */
__attribute__((target("avx2,popcnt"))) uint32_t kvn_pca_token_avx2(
    kvn_pca_reader *r, const uint32_t *slots, const uint32_t *live, const uint32_t *base, size_t nlive,
    const kvn_pca_symbol *info, uint16_t *q16, uint32_t *total) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), seven = _mm256_set1_epi32(7);
    const __m256i order = _mm256_and_si256(_mm256_add_epi32(_mm256_set1_epi32((int)r->phase), lane), seven);
    __m256i x = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)r->x), order);
    const __m256i slot_mask = _mm256_set1_epi32((int)SLOT_MASK), freq_mask = _mm256_set1_epi32(0xFFF),
                  below = _mm256_set1_epi32((int)(KVN_PCA_LOW - 1u));
    const uint8_t *bytes = r->bytes;
    size_t pos = r->pos, nwords = r->nwords, at_byte = r->at_byte, nbytes = r->nbytes;
    uint64_t acc = r->acc;
    unsigned fill = r->fill;
    uint32_t sum = 0, bad = 0;
    for (size_t k = 0; k < nlive; k += 8) {
        size_t count = nlive - k < 8 ? nlive - k : 8;
        __m256i active = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), lane);
        __m256i rows = _mm256_maskload_epi32((const int *)(base + k), active);
        __m256i e = _mm256_i32gather_epi32((const int *)slots, _mm256_add_epi32(rows, _mm256_and_si256(x, slot_mask)), 4);
        __m256i v = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_and_si256(e, freq_mask), _mm256_srli_epi32(x, KVN_PCA_PROB_BITS)),
                                     _mm256_and_si256(_mm256_srli_epi32(e, 12), slot_mask));
        __m256i renorm = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_min_epu32(v, below), v), active);
        unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(renorm));
        const uint8_t *at = r->words + 2 * (pos < nwords ? pos : nwords);
        __m256i next = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)at));
        __m256i rank = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)RANKS[mask]));
        __m256i renormed = _mm256_or_si256(_mm256_slli_epi32(v, 16), _mm256_permutevar8x32_epi32(next, rank));
        x = _mm256_blendv_epi8(x, _mm256_blendv_epi8(v, renormed, renorm), active);
        pos += (size_t)__builtin_popcount(mask);
        uint32_t syms[8];
        _mm256_storeu_si256((__m256i *)syms, _mm256_srli_epi32(e, 23));
        for (size_t u = 0; u < count; u++)
            bad |= put_value(syms[u], info, &acc, &fill, bytes, &at_byte, nbytes, &sum, q16 + live[k + u]);
    }
    uint32_t states[8];
    _mm256_storeu_si256((__m256i *)states, x);
    for (unsigned u = 0; u < 8; u++) r->x[(r->phase + u) & 7] = states[u];
    r->phase += (unsigned)nlive;
    r->pos = pos;
    r->at_byte = at_byte;
    r->acc = acc;
    r->fill = fill;
    *total = sum;
    return bad;
}
#endif
