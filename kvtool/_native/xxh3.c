/* XXH3-64 (seed 0, default secret), written from the algorithm's specification
 * (xxhash_spec.md, "XXH3 Algorithm Description"). The Python `xxhash` package
 * computes the same function; tests check the two agree on every input length
 * class. Here it lets a whole batch of chunks be verified without the GIL, and a
 * decoder hash its output in pieces while they are still in cache (kvn_xxh3_update).
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

/* Accumulate n stripes from p, the first being stripe *at of its block; a block's last stripe is
 * followed by the scramble. Every variant below computes the same acc. */
static void consume_portable(uint64_t acc[8], const uint8_t *p, size_t n, unsigned *at) {
    unsigned s = *at;
    while (n) {
        size_t run = n < STRIPES_PER_BLOCK - s ? n : STRIPES_PER_BLOCK - s;  /* to the block's end at most */
        n -= run;
        for (const uint8_t *secret = SECRET + 8 * s, *stop = secret + 8 * run; secret < stop; secret += 8, p += STRIPE)
            accumulate(acc, p, secret);
        if ((s += (unsigned)run) < STRIPES_PER_BLOCK) continue;
        s = 0;
        scramble(acc);
    }
    *at = s;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* Four 64-bit lanes at a time. */
__attribute__((target("avx2"))) static void consume_avx2(uint64_t acc[8], const uint8_t *p, size_t n, unsigned *at) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc), a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    const uint8_t *last = SECRET + sizeof(SECRET) - STRIPE;
    unsigned s = *at;
    while (n) {
        size_t run = n < STRIPES_PER_BLOCK - s ? n : STRIPES_PER_BLOCK - s;  /* to the block's end at most */
        n -= run;
        for (const uint8_t *k = SECRET + 8 * s, *stop = k + 8 * run; k < stop; k += 8, p += STRIPE) {
            __m256i d0 = _mm256_loadu_si256((const __m256i *)p), d1 = _mm256_loadu_si256((const __m256i *)(p + 32));
            __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256((const __m256i *)k));
            __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256((const __m256i *)(k + 32)));
            __m256i p0 = _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32));
            __m256i p1 = _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32));
            /* acc[i ^ 1] += data[i]: swap the 64-bit halves of each 128-bit pair. */
            a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(d0, _MM_SHUFFLE(1, 0, 3, 2))));
            a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(d1, _MM_SHUFFLE(1, 0, 3, 2))));
        }
        if ((s += (unsigned)run) < STRIPES_PER_BLOCK) continue;
        s = 0;
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
    *at = s;
}

/* A whole stripe in one register. */
__attribute__((target("avx512f"))) static void consume_avx512(uint64_t acc[8], const uint8_t *p, size_t n,
                                                               unsigned *at) {
    __m512i a = _mm512_loadu_si512(acc);
    const __m512i prime = _mm512_set1_epi32((int)P32_1), last = _mm512_loadu_si512(SECRET + sizeof(SECRET) - STRIPE);
    unsigned s = *at;
    while (n) {
        size_t run = n < STRIPES_PER_BLOCK - s ? n : STRIPES_PER_BLOCK - s;  /* to the block's end at most */
        n -= run;
        for (const uint8_t *secret = SECRET + 8 * s, *stop = secret + 8 * run; secret < stop; secret += 8, p += STRIPE) {
            __m512i d = _mm512_loadu_si512(p);
            __m512i k = _mm512_xor_si512(d, _mm512_loadu_si512(secret));
            __m512i prod = _mm512_mul_epu32(k, _mm512_srli_epi64(k, 32));
            a = _mm512_add_epi64(a, _mm512_add_epi64(prod, _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2))));
        }
        if ((s += (unsigned)run) < STRIPES_PER_BLOCK) continue;
        s = 0;
        a = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), last);
        __m512i lo = _mm512_mul_epu32(a, prime), hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
        a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
    }
    _mm512_storeu_si512(acc, a);
    *at = s;
}
#endif

static void consume(uint64_t acc[8], const uint8_t *p, size_t n, unsigned *at) {
#if defined(__x86_64__) && defined(__GNUC__)
    int isa = kvn_isa();
    if (isa >= KVN_ISA_AVX512) { consume_avx512(acc, p, n, at); return; }
    if (isa >= KVN_ISA_AVX2) { consume_avx2(acc, p, n, at); return; }
#endif
    consume_portable(acc, p, n, at);
}

static const uint64_t INIT[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};

/* The end of a long input: its last 64 bytes with their own secret, then the accumulators folded. */
static uint64_t finish_large(uint64_t acc[8], const uint8_t *last_stripe, uint64_t len) {
    accumulate(acc, last_stripe, SECRET + sizeof(SECRET) - STRIPE - 7);
    uint64_t result = len * P64_1;
    for (int i = 0; i < 4; i++)
        result += fold128(acc[2 * i] ^ kvn_rd64(SECRET + 11 + 16 * i), acc[2 * i + 1] ^ kvn_rd64(SECRET + 19 + 16 * i));
    return avalanche(result);
}

/* Every whole stripe but the last 64 bytes' (the last block is never scrambled, even if full). */
static uint64_t hash_large(const uint8_t *p, size_t len) {
    uint64_t acc[8];
    memcpy(acc, INIT, sizeof(acc));
    unsigned at = 0;
    size_t blocks = (len - 1) / BLOCK, rest = len - blocks * BLOCK;
    consume(acc, p, blocks * STRIPES_PER_BLOCK + (rest - 1) / STRIPE, &at);
    return finish_large(acc, p + len - STRIPE, len);
}

void kvn_xxh3_reset(kvn_xxh3_state *st) {
    memcpy(st->acc, INIT, sizeof(st->acc));
    st->total = 0;
    st->stripe = st->part_len = 0;
    st->held = 0;
}

/* Whole stripes in: the one held back goes first, the newest is held back in its turn. */
static void take_stripes(kvn_xxh3_state *st, const uint8_t *p, size_t n) {
    if (st->held) consume(st->acc, st->last, 1, &st->stripe);
    consume(st->acc, p, n - 1, &st->stripe);
    memcpy(st->last, p + (n - 1) * STRIPE, STRIPE);
    st->held = 1;
}

void kvn_xxh3_update(kvn_xxh3_state *st, const uint8_t *p, size_t len) {
    if (st->total < sizeof(st->head)) {
        size_t n = sizeof(st->head) - st->total < len ? sizeof(st->head) - st->total : len;
        memcpy(st->head + st->total, p, n);
    }
    st->total += len;
    if (st->part_len) {
        size_t n = STRIPE - st->part_len < len ? STRIPE - st->part_len : len;
        memcpy(st->part + st->part_len, p, n);
        st->part_len += (unsigned)n;
        p += n;
        len -= n;
        if (st->part_len < STRIPE) return;
        st->part_len = 0;
        take_stripes(st, st->part, 1);
    }
    if (len >= STRIPE) {
        take_stripes(st, p, len / STRIPE);
        p += len / STRIPE * STRIPE;
        len %= STRIPE;
    }
    memcpy(st->part, p, len);
    st->part_len = (unsigned)len;
}

uint64_t kvn_xxh3_digest(const kvn_xxh3_state *st) {
    if (st->total <= sizeof(st->head)) return kvn_xxh3_64(st->head, st->total);
    uint64_t acc[8];
    uint8_t last[STRIPE];
    memcpy(acc, st->acc, sizeof(acc));
    if (!st->part_len) return finish_large(acc, st->last, st->total);
    unsigned at = st->stripe;
    consume(acc, st->last, 1, &at);  /* a whole stripe, not the last 64 bytes: those end in part */
    memcpy(last, st->last + st->part_len, STRIPE - st->part_len);
    memcpy(last + STRIPE - st->part_len, st->part, st->part_len);
    return finish_large(acc, last, st->total);
}

uint64_t kvn_xxh3_64(const uint8_t *data, size_t len) {
    if (len <= 16) return hash_0to16(data, len);
    if (len <= 128) return hash_17to128(data, len);
    if (len <= 240) return hash_129to240(data, len);
    return hash_large(data, len);
}
