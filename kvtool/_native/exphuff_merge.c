/* exphuff's last decoding step: each value from its symbol, its channel's reference and its raw bits.
 *
 * A row (one head, one token: dim values) is written where the destination wants it, then hashed
 * with the rows before it while still in L1, so the raw checksum costs no second pass over a block
 * that has left the cache. bf16 and fp16 rows (a coded byte and a raw byte per value) have AVX2 and
 * AVX-512 kernels, chosen by kvn_isa(); every kernel writes the bytes the portable loop writes.
 */
#include <stdlib.h>

#include "exphuff_impl.h"
#include "values.h"

/* Rows hashed together, at most: their bytes stay in L1 between the merge and the hash. */
#define GROUP_BYTES 8192

/* Two bytes a value: coded byte c = its symbol plus the reference within the exponent field, then
 * the value's low byte (c's low bit over the raw byte's seven) and high byte (the raw sign over c's seven). */
KVN_INLINE void row2_portable(const uint8_t *s, const uint8_t *r, const uint8_t *shifted, uint8_t emask, size_t dim,
                              uint8_t *restrict out) {
    uint8_t keep = (uint8_t)~emask;
    for (size_t d = 0; d < dim; d++) {
        uint8_t c = (uint8_t)((s[d] & keep) | ((uint8_t)(s[d] + shifted[d]) & emask));
        out[2 * d] = (uint8_t)((r[d] & 0x7Fu) | (uint8_t)(c << 7));
        out[2 * d + 1] = (uint8_t)((r[d] & 0x80u) | (c >> 1));
    }
}

typedef void rows2_fn(const uint8_t *sym, const uint8_t *raw, const uint8_t *shifted, uint8_t emask, size_t dim,
                      size_t count, uint8_t *const *out);

static void rows2_portable(const uint8_t *sym, const uint8_t *raw, const uint8_t *shifted, uint8_t emask, size_t dim,
                           size_t count, uint8_t *const *out) {
    for (size_t t = 0; t < count; t++) row2_portable(sym + t * dim, raw + t * dim, shifted, emask, dim, out[t]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx2"))) static void rows2_avx2(const uint8_t *sym, const uint8_t *raw, const uint8_t *shifted,
                                                       uint8_t emask, size_t dim, size_t count, uint8_t *const *out) {
    const __m256i em = _mm256_set1_epi8((char)emask), low7 = _mm256_set1_epi8(0x7F);
    for (size_t t = 0; t < count; t++) {
        const uint8_t *s = sym + t * dim, *r = raw + t * dim;
        uint8_t *o = out[t];
        size_t d = 0;
        for (; d + 32 <= dim; d += 32) {
            __m256i sv = _mm256_loadu_si256((const __m256i *)(s + d)), rv = _mm256_loadu_si256((const __m256i *)(r + d));
            __m256i sum = _mm256_add_epi8(sv, _mm256_loadu_si256((const __m256i *)(shifted + d)));
            __m256i c = _mm256_or_si256(_mm256_and_si256(em, sum), _mm256_andnot_si256(em, sv));
            __m256i lo = _mm256_or_si256(_mm256_and_si256(low7, rv), _mm256_andnot_si256(low7, _mm256_slli_epi16(c, 7)));
            __m256i hi = _mm256_or_si256(_mm256_andnot_si256(low7, rv), _mm256_and_si256(low7, _mm256_srli_epi16(c, 1)));
            __m256i a = _mm256_unpacklo_epi8(lo, hi), z = _mm256_unpackhi_epi8(lo, hi);
            _mm256_storeu_si256((__m256i *)(o + 2 * d), _mm256_permute2x128_si256(a, z, 0x20));
            _mm256_storeu_si256((__m256i *)(o + 2 * d + 32), _mm256_permute2x128_si256(a, z, 0x31));
        }
        row2_portable(s + d, r + d, shifted + d, emask, dim - d, o + 2 * d);
    }
}

__attribute__((target("avx512f,avx512bw,bmi2"))) static void rows2_avx512(const uint8_t *sym, const uint8_t *raw,
                                                                        const uint8_t *shifted, uint8_t emask,
                                                                        size_t dim, size_t count, uint8_t *const *out) {
    const __m512i em = _mm512_set1_epi8((char)emask), low7 = _mm512_set1_epi8(0x7F);
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (size_t t = 0; t < count; t++) {
        const uint8_t *s = sym + t * dim, *r = raw + t * dim;
        uint8_t *o = out[t];
        for (size_t d = 0; d < dim; d += 64) {
            size_t n = dim - d < 64 ? dim - d : 64;  /* the last piece of a row: masked, nothing read or written past it */
            __mmask64 in = _bzhi_u64(~0ull, (unsigned)n), out0 = _bzhi_u64(~0ull, (unsigned)(n < 32 ? 2 * n : 64));
            __mmask64 out1 = _bzhi_u64(~0ull, (unsigned)(n > 32 ? 2 * n - 64 : 0));
            __m512i sv = _mm512_maskz_loadu_epi8(in, s + d), rv = _mm512_maskz_loadu_epi8(in, r + d);
            __m512i sum = _mm512_add_epi8(sv, _mm512_maskz_loadu_epi8(in, shifted + d));
            __m512i c = _mm512_ternarylogic_epi32(em, sum, sv, 0xCA);  /* em ? sum : sv, bit by bit */
            __m512i lo = _mm512_ternarylogic_epi32(low7, rv, _mm512_slli_epi16(c, 7), 0xCA);
            __m512i hi = _mm512_ternarylogic_epi32(low7, _mm512_srli_epi16(c, 1), rv, 0xCA);
            __m512i a = _mm512_unpacklo_epi8(lo, hi), z = _mm512_unpackhi_epi8(lo, hi);
            _mm512_mask_storeu_epi8(o + 2 * d, out0, _mm512_permutex2var_epi64(a, first, z));
            if (out1) _mm512_mask_storeu_epi8(o + 2 * d + 64, out1, _mm512_permutex2var_epi64(a, second, z));
        }
    }
}
#endif

static rows2_fn *rows2_kernel(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    int isa = kvn_isa();
    if (isa >= KVN_ISA_AVX512) return rows2_avx512;
    if (isa >= KVN_ISA_AVX2) return rows2_avx2;
#endif
    return rows2_portable;
}

/* Four bytes a value (fp32: three raw bytes) or one (fp8: the coded byte is the value). */
KVN_INLINE void row_other(const kvn_family *f, const uint8_t *s, const uint8_t *r, const uint8_t *shifted, size_t dim,
                          uint8_t *restrict out) {
    uint8_t keep = (uint8_t)~f->emask, emask = f->emask;
    for (size_t d = 0; d < dim; d++) {
        uint8_t c = (uint8_t)((s[d] & keep) | ((uint8_t)(s[d] + shifted[d]) & emask));
        if (f->width == 4) {
            uint32_t bits = r[3 * d] | ((uint32_t)r[3 * d + 1] << 8) | ((uint32_t)r[3 * d + 2] << 16);
            uint32_t v = ((bits & 0x800000u) << 8) | ((uint32_t)c << 23) | (bits & 0x7FFFFFu);
            memcpy(out + 4 * d, &v, 4);
        } else {
            out[d] = c;
        }
    }
}

KVN_MULTIVERSION
static void rows_other(const kvn_family *f, const uint8_t *sym, const uint8_t *raw, const uint8_t *shifted, size_t dim,
                       size_t count, uint8_t *const *out) {
    for (size_t t = 0; t < count; t++) {
        if (f->width == 4) row_other(&(kvn_family){4, 3, f->emask, f->eshift}, sym + t * dim, raw + 3 * t * dim, shifted, dim, out[t]);
        else row_other(&(kvn_family){1, 0, f->emask, f->eshift}, sym + t * dim, raw, shifted, dim, out[t]);
    }
}

/* Runs of rows next to each other in memory, in row order; a group of rows is written in place only if
 * they form few runs and no run overlaps another, so that every row is still there when the group is hashed. */
#define MAX_RUNS 16

typedef struct {
    uintptr_t start[MAX_RUNS], end[MAX_RUNS];
    size_t count;
} runs;

static int find_runs(uint8_t *const *rows, size_t count, size_t row, runs *r) {
    r->count = 0;
    for (size_t t = 0; t < count; t++) {
        uintptr_t at = (uintptr_t)rows[t];
        if (r->count && at == r->end[r->count - 1]) {
            r->end[r->count - 1] += row;
            continue;
        }
        if (r->count == MAX_RUNS) return 0;
        r->start[r->count] = at;
        r->end[r->count++] = at + row;
    }
    for (size_t i = 0; i < r->count; i++)
        for (size_t j = i + 1; j < r->count; j++)
            if (r->start[i] < r->end[j] && r->start[j] < r->end[i]) return 0;
    return 1;
}

int kvn_exphuff_merge(const kvn_family *f, const kvn_block *b, const uint8_t *sym, const uint8_t *raw,
                      const uint8_t *refs, const kvn_row_map *to, kvn_xxh3_state *hash) {
    size_t dim = b->dim, row = dim * f->width, group = row ? GROUP_BYTES / row : 1;
    if (!group) group = 1;
    if (group > b->tokens) group = b->tokens ? b->tokens : 1;
    uint8_t *shifted = malloc(dim + 1), *spare = malloc(row * group + 1);
    uint8_t **out = malloc(2 * group * sizeof(uint8_t *));
    if (!shifted || !spare || !out) {
        free(shifted);
        free(spare);
        free(out);
        return KVN_ERR_NOMEM;
    }
    rows2_fn *rows2 = f->width == 2 ? rows2_kernel() : NULL;
    for (size_t h = 0; h < b->heads; h++) {
        for (size_t d = 0; d < dim; d++) shifted[d] = (uint8_t)(refs[h * dim + d] << f->eshift);
        for (size_t t0 = 0; t0 < b->tokens; t0 += group) {
            size_t count = b->tokens - t0 < group ? b->tokens - t0 : group, first = h * b->tokens + t0;
            int any = 0;
            for (size_t t = 0; t < count; t++) {  /* a row written nowhere still goes through the hash */
                out[t] = to->rows ? to->rows[first + t] : to->base + h * to->head_stride + (t0 + t) * row;
                if (!out[t]) out[t] = spare + t * row;
                else any = 1;
            }
            if (!any && !hash) continue;
            const uint8_t *s = sym + first * dim, *r = raw + first * dim * f->raw_bytes;
            runs in_place;
            if (!hash || find_runs(out, count, row, &in_place)) {
                if (rows2) rows2(s, r, shifted, f->emask, dim, count, out);
                else rows_other(f, s, r, shifted, dim, count, out);
                for (size_t k = 0; hash && k < in_place.count; k++)
                    kvn_xxh3_update(hash, (const uint8_t *)in_place.start[k], in_place.end[k] - in_place.start[k]);
                continue;
            }
            /* rows over each other, or scattered: through the spare rows, hashed there, then copied out in order */
            uint8_t **at = out + group;
            for (size_t t = 0; t < count; t++) at[t] = spare + t * row;
            if (rows2) rows2(s, r, shifted, f->emask, dim, count, at);
            else rows_other(f, s, r, shifted, dim, count, at);
            kvn_xxh3_update(hash, spare, count * row);
            for (size_t t = 0; t < count; t++)
                if (out[t] != at[t]) memcpy(out[t], at[t], row);
        }
    }
    free(shifted);
    free(spare);
    free(out);
    return KVN_OK;
}
