/* XXH3-64 (seed 0, default secret), written from the algorithm's specification
 * (xxhash_spec.md, "XXH3 Algorithm Description"). The Python `xxhash` package
 * computes the same function; tests check the two agree on every input length
 * class. Here it lets a whole batch of chunks be verified without the GIL.
 */
#include "kvn.h"

static const uint8_t SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define P32_1 0x9E3779B1ULL
#define P32_2 0x85EBCA77ULL
#define P32_3 0xC2B2AE3DULL
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

#define STRIPE 64
#define STRIPES_PER_BLOCK ((sizeof(SECRET) - STRIPE) / 8)
#define BLOCK (STRIPE * STRIPES_PER_BLOCK)

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fold128(uint64_t a, uint64_t b) {
    __uint128_t m = (__uint128_t)a * b;
    return (uint64_t)m ^ (uint64_t)(m >> 64);
}

static uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PMX_1;
    return h ^ (h >> 32);
}

static uint64_t avalanche_xxh64(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *d, const uint8_t *s) {
    return fold128(kvn_rd64(d) ^ kvn_rd64(s), kvn_rd64(d + 8) ^ kvn_rd64(s + 8));
}

static uint64_t hash_0to16(const uint8_t *p, size_t len) {
    if (len > 8) {
        uint64_t lo = (kvn_rd64(SECRET + 24) ^ kvn_rd64(SECRET + 32)) ^ kvn_rd64(p);
        uint64_t hi = (kvn_rd64(SECRET + 40) ^ kvn_rd64(SECRET + 48)) ^ kvn_rd64(p + len - 8);
        return avalanche(len + __builtin_bswap64(lo) + hi + fold128(lo, hi));
    }
    if (len >= 4) {
        uint64_t combined = (uint64_t)kvn_rd32(p + len - 4) | ((uint64_t)kvn_rd32(p) << 32);
        uint64_t v = (kvn_rd64(SECRET + 8) ^ kvn_rd64(SECRET + 16)) ^ combined;
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PMX_2;
        v ^= (v >> 35) + len;
        v *= PMX_2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        uint32_t combined = (uint32_t)p[len - 1] | ((uint32_t)len << 8) | ((uint32_t)p[0] << 16) |
                            ((uint32_t)p[len >> 1] << 24);
        return avalanche_xxh64((uint64_t)(kvn_rd32(SECRET) ^ kvn_rd32(SECRET + 4)) ^ combined);
    }
    return avalanche_xxh64(kvn_rd64(SECRET + 56) ^ kvn_rd64(SECRET + 64));
}

static uint64_t hash_17to128(const uint8_t *p, size_t len) {
    uint64_t acc = len * P64_1;
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = rounds; i-- > 0;) {
        acc += mix16(p + 16 * i, SECRET + 32 * i);
        acc += mix16(p + len - 16 * i - 16, SECRET + 32 * i + 16);
    }
    return avalanche(acc);
}

static uint64_t hash_129to240(const uint8_t *p, size_t len) {
    uint64_t acc = len * P64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) acc += mix16(p + 16 * i, SECRET + 16 * i);
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; i++) acc += mix16(p + 16 * i, SECRET + 16 * (i - 8) + 3);
    acc += mix16(p + len - 16, SECRET + 119);
    return avalanche(acc);
}

static inline void accumulate(uint64_t acc[8], const uint8_t *stripe, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = kvn_rd64(stripe + 8 * i);
        uint64_t k = v ^ kvn_rd64(secret + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFu) * (k >> 32);
    }
}

static inline void scramble(uint64_t acc[8]) {
    const uint8_t *s = SECRET + sizeof(SECRET) - STRIPE;
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= kvn_rd64(s + 8 * i);
        acc[i] = a * P32_1;
    }
}

static void accumulate_blocks_scalar(uint64_t acc[8], const uint8_t *p, size_t blocks) {
    for (size_t b = 0; b < blocks; b++, p += BLOCK) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++) accumulate(acc, p + n * STRIPE, SECRET + 8 * n);
        scramble(acc);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The same rounds on four 64-bit lanes at a time. */
__attribute__((target("avx2"))) static void accumulate_blocks_avx2(uint64_t acc[8], const uint8_t *p, size_t blocks) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc), a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    const uint8_t *last = SECRET + sizeof(SECRET) - STRIPE;
    for (size_t b = 0; b < blocks; b++, p += BLOCK) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++) {
            const uint8_t *d = p + n * STRIPE, *s = SECRET + 8 * n;
            __m256i d0 = _mm256_loadu_si256((const __m256i *)d), d1 = _mm256_loadu_si256((const __m256i *)(d + 32));
            __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)s));
            __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(s + 32)));
            __m256i p0 = _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32));
            __m256i p1 = _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32));
            /* acc[i ^ 1] += data[i]: swap the 64-bit halves of each 128-bit pair. */
            a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
            a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
        }
        __m256i s0 = _mm256_loadu_si256((const __m256i *)last), s1 = _mm256_loadu_si256((const __m256i *)(last + 32));
        a0 = _mm256_xor_si256(_mm256_xor_si256(a0, _mm256_srli_epi64(a0, 47)), s0);
        a1 = _mm256_xor_si256(_mm256_xor_si256(a1, _mm256_srli_epi64(a1, 47)), s1);
        /* a * P32_1 on 64 bits = lo32(a) * P + (hi32(a) * P) << 32 */
        __m256i lo0 = _mm256_mul_epu32(a0, prime), hi0 = _mm256_mul_epu32(_mm256_srli_epi64(a0, 32), prime);
        __m256i lo1 = _mm256_mul_epu32(a1, prime), hi1 = _mm256_mul_epu32(_mm256_srli_epi64(a1, 32), prime);
        a0 = _mm256_add_epi64(lo0, _mm256_slli_epi64(hi0, 32));
        a1 = _mm256_add_epi64(lo1, _mm256_slli_epi64(hi1, 32));
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
}

static void accumulate_blocks(uint64_t acc[8], const uint8_t *p, size_t blocks) {
    if (__builtin_cpu_supports("avx2")) accumulate_blocks_avx2(acc, p, blocks);
    else accumulate_blocks_scalar(acc, p, blocks);
}
#else
#define accumulate_blocks accumulate_blocks_scalar
#endif

static uint64_t hash_large(const uint8_t *p, size_t len) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    size_t blocks = (len - 1) / BLOCK;  /* the last block, even if full, is left for below */
    accumulate_blocks(acc, p, blocks);
    const uint8_t *last = p + blocks * BLOCK;
    size_t rest = len - blocks * BLOCK;
    size_t full_stripes = (rest - 1) / STRIPE;
    for (size_t n = 0; n < full_stripes; n++) accumulate(acc, last + n * STRIPE, SECRET + 8 * n);
    accumulate(acc, p + len - STRIPE, SECRET + sizeof(SECRET) - STRIPE - 7);
    uint64_t result = len * P64_1;
    for (int i = 0; i < 4; i++)
        result += fold128(acc[2 * i] ^ kvn_rd64(SECRET + 11 + 16 * i), acc[2 * i + 1] ^ kvn_rd64(SECRET + 19 + 16 * i));
    return avalanche(result);
}

uint64_t kvn_xxh3_64(const uint8_t *data, size_t len) {
    if (len <= 16) return hash_0to16(data, len);
    if (len <= 128) return hash_17to128(data, len);
    if (len <= 240) return hash_129to240(data, len);
    return hash_large(data, len);
}
