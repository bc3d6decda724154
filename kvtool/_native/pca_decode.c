/* The lossy `pca` stage's inverse: a plane back to its block's rows (pca.c has the forward and the format's
 * arithmetic; kvtool/layouts/pca_reference.py is the reference).
 *
 * Per token: its symbols from eight interleaved rANS states (one packed table entry a symbol), its
 * coefficients q, then sum[i] = sum_j q[j] * basis[j][i]: integers, so any order gives the reference's sums;
 * with AVX2 two components at a time (vpmaddwd on rows interleaved in pairs), 64 outputs in registers. */
#include "pca_impl.h"

#include <stdlib.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PCA_AVX2 1
#endif

/* sums[i] = sum over pairs p of q[2p] * row 2p + q[2p + 1] * row 2p + 1 (rows interleaved in `pairs`). */
static void sums_plain(const int32_t *pairs, const int32_t *q2, size_t npairs, size_t width, int32_t *sums) {
    memset(sums, 0, width * sizeof(int32_t));
    for (size_t p = 0; p < npairs; p++) {
        int32_t both = q2[p];
        if (!both) continue;
        int32_t lo = (int16_t)(both & 0xFFFF), hi = both >> 16;
        const int32_t *row = pairs + p * width;
        for (size_t i = 0; i < width; i++) sums[i] += lo * (int16_t)(row[i] & 0xFFFF) + hi * (row[i] >> 16);
    }
}

#ifdef PCA_AVX2
__attribute__((target("avx2"))) static void sums_avx2(const int32_t *pairs, const int32_t *q2, size_t npairs, size_t width,
                                                      int32_t *sums) {
    size_t i0 = 0;
    for (; i0 + 64 <= width; i0 += 64) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (size_t p = 0; p < npairs; p++) {
            if (!q2[p]) continue;
            __m256i b = _mm256_set1_epi32(q2[p]);
            const __m256i *row = (const __m256i *)(pairs + p * width + i0);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(b, _mm256_loadu_si256(row)));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(b, _mm256_loadu_si256(row + 1)));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(b, _mm256_loadu_si256(row + 2)));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(b, _mm256_loadu_si256(row + 3)));
            a4 = _mm256_add_epi32(a4, _mm256_madd_epi16(b, _mm256_loadu_si256(row + 4)));
            a5 = _mm256_add_epi32(a5, _mm256_madd_epi16(b, _mm256_loadu_si256(row + 5)));
            a6 = _mm256_add_epi32(a6, _mm256_madd_epi16(b, _mm256_loadu_si256(row + 6)));
            a7 = _mm256_add_epi32(a7, _mm256_madd_epi16(b, _mm256_loadu_si256(row + 7)));
        }
        __m256i *out = (__m256i *)(sums + i0);
        _mm256_storeu_si256(out, a0);
        _mm256_storeu_si256(out + 1, a1);
        _mm256_storeu_si256(out + 2, a2);
        _mm256_storeu_si256(out + 3, a3);
        _mm256_storeu_si256(out + 4, a4);
        _mm256_storeu_si256(out + 5, a5);
        _mm256_storeu_si256(out + 6, a6);
        _mm256_storeu_si256(out + 7, a7);
    }
    for (; i0 + 8 <= width; i0 += 8) {
        __m256i a = _mm256_setzero_si256();
        for (size_t p = 0; p < npairs; p++)
            if (q2[p]) a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_set1_epi32(q2[p]), _mm256_loadu_si256((const __m256i *)(pairs + p * width + i0))));
        _mm256_storeu_si256((__m256i *)(sums + i0), a);
    }
    if (i0 < width) {  /* the last outputs, a width that is not a multiple of 8 */
        int32_t tail[8];
        memset(tail, 0, sizeof tail);
        for (size_t p = 0; p < npairs; p++) {
            int32_t lo = (int16_t)(q2[p] & 0xFFFF), hi = q2[p] >> 16;
            for (size_t i = i0; i < width; i++)
                tail[i - i0] += lo * (int16_t)(pairs[p * width + i] & 0xFFFF) + hi * (pairs[p * width + i] >> 16);
        }
        memcpy(sums + i0, tail, (width - i0) * sizeof(int32_t));
    }
}
#endif

/* The magnitude base, extra bits and sign of each symbol (zero for symbol 0 and for the unused ones). */
typedef struct { uint16_t base; uint8_t nbits, negative; } symbol_info;

static symbol_info info_of(unsigned s) {
    symbol_info out = {0, 0, 0};
    if (s == 0 || s > KVN_PCA_MAX_SYMBOL) return out;
    unsigned cls = (s - 1) >> 1;
    out.negative = (uint8_t)((s - 1) & 1);
    if (cls < 4) {
        out.base = (uint16_t)cls;
    } else {
        unsigned e = ((cls - 4) >> 1) + 2;
        out.base = (uint16_t)((2u + ((cls - 4) & 1u)) << (e - 1));
        out.nbits = (uint8_t)(e - 1);
    }
    return out;
}

typedef struct { const uint8_t *data; size_t len, at; uint64_t acc; unsigned fill; } bit_reader;

static inline int get_bits(bit_reader *b, unsigned n, uint32_t *value) {
    while (b->fill < n) {
        if (b->at >= b->len) return KVN_ERR_CORRUPT;
        b->acc |= (uint64_t)b->data[b->at++] << b->fill;
        b->fill += 8;
    }
    *value = (uint32_t)(b->acc & ((1u << n) - 1u));
    b->acc >>= n;
    b->fill -= n;
    return KVN_OK;
}

typedef struct {
    const uint8_t *words;
    size_t nwords, pos;
    uint32_t x[KVN_PCA_STATES];
    unsigned i;
} rans_decoder;

/* One symbol with `slots` (a model's packed entries); KVN_ERR_CORRUPT where the stream ends early. */
static inline int next_symbol(rans_decoder *r, const uint32_t *slots, unsigned *sym) {
    uint32_t *x = &r->x[r->i++ & (KVN_PCA_STATES - 1)];
    uint32_t e = slots[*x & ((1u << KVN_PCA_PROB_BITS) - 1u)];
    *x = (e & 0xFFFu) * (*x >> KVN_PCA_PROB_BITS) + ((e >> 12) & 0x7FFu);
    if (*x < KVN_PCA_LOW) {
        if (r->pos == r->nwords) return KVN_ERR_CORRUPT;
        uint16_t word;
        memcpy(&word, r->words + 2 * r->pos++, 2);
        *x = *x << 16 | word;
    }
    *sym = e >> 23;
    return KVN_OK;
}

static inline void store_value(int dtype, uint8_t *p, float v) {
    if (dtype == KVN_BF16) { uint16_t h = f32_to_bf16(v); memcpy(p, &h, 2); }
    else if (dtype == KVN_FP16) { uint16_t h = f32_to_f16(v); memcpy(p, &h, 2); }
    else memcpy(p, &v, 4);
}

typedef struct {
    int32_t *q2, *sums;     /* [pairs]: each pair of coefficients as int16 halves; [width] */
    float *x, *cs, *sn;
    uint8_t *cls;
    uint32_t *live;         /* the components with a class, in order */
    int avx2;               /* the basis sums in AVX2 (the process's vector level, kvn_isa(), asked once a plane) */
} decode_scratch;

/* One coded token's values from its coefficient pairs, into its rows. */
static void restore_token(const kvn_pca_model *m, int dtype, uint64_t position, decode_scratch *s, uint8_t *const *rows,
                          size_t tokens, size_t t) {
    size_t npairs = (m->components + 1) / 2;
#ifdef PCA_AVX2
    if (s->avx2) sums_avx2(m->pairs, s->q2, npairs, m->width, s->sums);
    else
#endif
        sums_plain(m->pairs, s->q2, npairs, m->width, s->sums);
    for (size_t i = 0; i < m->width; i++) s->x[i] = (float)s->sums[i] * m->gain + m->mean[i];
    if (m->rope) {
        kvn_pca_rotation(m, position, s->cs, s->sn);
        kvn_pca_rotate(m, s->x, s->cs, s->sn, 0);
    }
    size_t w = kvn_itemsize(dtype);
    for (size_t h = 0; h < m->heads; h++) {
        uint8_t *row = rows[h * tokens + t];
        if (row)
            for (size_t d = 0; d < m->dim; d++) store_value(dtype, row + d * w, s->x[h * m->dim + d]);
    }
}

/* The head, bitmap and lengths of a coded plane checked; the stream's and extra bits' offsets in *stream_at. */
static int check_head(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                      size_t *stream_at) {
    size_t row = m->dim * kvn_itemsize(dtype), at = KVN_PCA_HEAD + (tokens + 7) / 8, count = 0;
    uint16_t components;
    memcpy(&components, plane + 2, 2);
    uint64_t position = kvn_rd64(plane + 8);
    size_t stream_len = kvn_rd32(plane + 16), extra_len = kvn_rd32(plane + 20), nexact = kvn_rd32(plane + 24);
    if (plane[1] != KVN_PCA_VERSION || memcmp(plane + 4, m->tag, 4) || components != m->components ||
        position > KVN_PCA_MAX_POSITION - tokens)
        return KVN_ERR_CORRUPT;
    for (size_t t = 0; t < ((tokens + 7) & ~(size_t)7); t++) {
        int bit = (plane[KVN_PCA_HEAD + t / 8] >> (t % 8)) & 1;
        if (bit && t >= tokens) return KVN_ERR_CORRUPT;
        count += (size_t)bit;
    }
    if (count != nexact) return KVN_ERR_CORRUPT;
    size_t kept = nexact * m->heads * row;
    if (at + kept > plane_len || stream_len > plane_len - at - kept || extra_len > plane_len - at - kept - stream_len ||
        stream_len < 4 * KVN_PCA_STATES || stream_len % 2)
        return KVN_ERR_CORRUPT;
    for (size_t b = at + kept + stream_len + extra_len; b < plane_len; b++)
        if (plane[b]) return KVN_ERR_CORRUPT;
    *stream_at = at + kept;
    return KVN_OK;
}

static int decode_coded(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                        uint8_t *const *rows, decode_scratch *s) {
    size_t row = m->dim * kvn_itemsize(dtype), c = m->components, at;
    int rc = check_head(m, dtype, tokens, plane, plane_len, &at);
    if (rc) return rc;
    size_t stream_len = kvn_rd32(plane + 16), extra_len = kvn_rd32(plane + 20);
    uint64_t position = kvn_rd64(plane + 8);
    rans_decoder r = {plane + at + 4 * KVN_PCA_STATES, (stream_len - 4 * KVN_PCA_STATES) / 2, 0, {0}, 0};
    for (int k = 0; k < KVN_PCA_STATES; k++) r.x[k] = kvn_rd32(plane + at + 4 * k);
    bit_reader bits = {plane + at + stream_len, extra_len, 0, 0, 0};
    size_t nlive = 0;
    for (size_t j = 0; j < c; j++) {
        unsigned sym;
        if (next_symbol(&r, m->slots[0], &sym) || sym > (unsigned)m->classes) return KVN_ERR_CORRUPT;
        s->cls[j] = (uint8_t)sym;
        if (sym) s->live[nlive++] = (uint32_t)j;
    }
    symbol_info info[KVN_PCA_SYMBOLS];
    for (unsigned k = 0; k < KVN_PCA_SYMBOLS; k++) info[k] = info_of(k);
    memset(s->q2, 0, ((c + 1) / 2) * sizeof(int32_t));
    const uint8_t *exact_values = plane + KVN_PCA_HEAD + (tokens + 7) / 8;
    for (size_t t = 0; t < tokens; t++) {
        if ((plane[KVN_PCA_HEAD + t / 8] >> (t % 8)) & 1) {
            for (size_t h = 0; h < m->heads; h++, exact_values += row)
                if (rows[h * tokens + t]) memcpy(rows[h * tokens + t], exact_values, row);
            continue;
        }
        uint32_t total = 0;
        uint16_t *q16 = (uint16_t *)s->q2;  /* the pairs' halves: component j is half j % 2 of pair j / 2 */
        for (size_t k = 0; k < nlive; k++) {
            size_t j = s->live[k];
            unsigned sym;
            if (next_symbol(&r, m->slots[s->cls[j]], &sym) || sym > KVN_PCA_MAX_SYMBOL) return KVN_ERR_CORRUPT;
            symbol_info in = info[sym];
            uint32_t mag = in.base, extra = 0;
            if (in.nbits) {
                if (get_bits(&bits, in.nbits, &extra)) return KVN_ERR_CORRUPT;
                mag += extra;
            }
            uint32_t value = sym ? mag + 1 : 0;
            if (value > KVN_PCA_MAX_Q) return KVN_ERR_CORRUPT;
            total += value;
            q16[j] = (uint16_t)(in.negative ? -(int32_t)value : (int32_t)value);
        }
        if (total >= KVN_PCA_MAX_SUM) return KVN_ERR_CORRUPT;
        restore_token(m, dtype, position + t, s, rows, tokens, t);
    }
    if (r.pos != r.nwords || bits.at != bits.len || bits.acc) return KVN_ERR_CORRUPT;
    for (int k = 0; k < KVN_PCA_STATES; k++)
        if (r.x[k] != KVN_PCA_LOW) return KVN_ERR_CORRUPT;
    return KVN_OK;
}

int kvn_pca_decode_rows(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                        uint8_t *const *rows) {
    if (dtype > KVN_FP32 || plane_len != kvn_pca_plane_size(m, dtype, tokens)) return KVN_ERR_ARG;
    size_t row = m->dim * kvn_itemsize(dtype), raw = tokens * m->heads * row;
    if (plane[0] > 1) return KVN_ERR_CORRUPT;
    if (plane[0] == 0) {
        for (size_t b = 1 + raw; b < plane_len; b++)
            if (plane[b]) return KVN_ERR_CORRUPT;
        for (size_t h = 0; h < m->heads; h++)
            for (size_t t = 0; t < tokens; t++)
                if (rows[h * tokens + t]) memcpy(rows[h * tokens + t], plane + 1 + (h * tokens + t) * row, row);
        return KVN_OK;
    }
    size_t c = m->components, npairs = (c + 1) / 2 + 1;
    decode_scratch s = {malloc(4 * npairs), malloc(4 * m->width), malloc(4 * m->width), malloc(2 * m->dim + 4),
                        malloc(2 * m->dim + 4), malloc(c + 1), malloc(4 * c + 4), 0};
#ifdef PCA_AVX2
    s.avx2 = kvn_isa() >= KVN_ISA_AVX2;
#endif
    int rc = s.q2 && s.sums && s.x && s.cs && s.sn && s.cls && s.live ? decode_coded(m, dtype, tokens, plane, plane_len, rows, &s)
                                                                     : KVN_ERR_NOMEM;
    free(s.q2);
    free(s.sums);
    free(s.x);
    free(s.cs);
    free(s.sn);
    free(s.cls);
    free(s.live);
    return rc;
}
