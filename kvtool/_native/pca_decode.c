/* The lossy `pca` stage's inverse: a plane back to its block's rows (pca.c has the forward and the format's
 * arithmetic; kvtool/layouts/pca_reference.py is the reference).
 *
 * Per token: its symbols from eight interleaved rANS states (one packed table entry a symbol), its
 * coefficients q, then sum[i] = sum_j q[j] * basis[j][i]: integers, so any order gives the reference's sums;
 * with AVX2 or AVX-512 two components at a time (vpmaddwd on rows interleaved in pairs), for eight tokens per
 * pass over the basis, over the pairs whose coefficients are not all zero in those tokens. */
#include "pca_impl.h"
#include "pca_symbols.h"

#include <stdlib.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PCA_AVX2 1
#endif

/* Tokens whose basis sums are taken together: each basis row read from the cache once for all of them. */
#define PCA_BATCH 8

/* The pairs with a coefficient that is not zero in any of `count` tokens (q2 rows `npairs` apart), listed without a
 * branch: the sums read only those. */
static size_t nonzero_pairs(const int32_t *q2, size_t npairs, size_t count, uint32_t *nz) {
    size_t n = 0;
    for (size_t p = 0; p < npairs; p++) {
        int32_t any = 0;
        for (size_t b = 0; b < count; b++) any |= q2[b * npairs + p];
        nz[n] = (uint32_t)p;
        n += any != 0;
    }
    return n;
}

/* Row b of sums ([count][width]) = sum over the listed pairs p of q_b[2p] * row 2p + q_b[2p + 1] * row 2p + 1, q_b
 * the coefficients of token b (rows interleaved in `pairs`): integers, equal in any order. */
static void sums_plain(const int32_t *pairs, const int32_t *q2, size_t npairs, const uint32_t *nz, size_t n,
                       size_t width, size_t count, int32_t *sums) {
    memset(sums, 0, count * width * sizeof(int32_t));
    for (size_t b = 0; b < count; b++)
        for (size_t k = 0; k < n; k++) {
            int32_t both = q2[b * npairs + nz[k]];
            int32_t lo = (int16_t)(both & 0xFFFF), hi = both >> 16;
            const int32_t *row = pairs + nz[k] * width;
            for (size_t i = 0; i < width; i++) sums[b * width + i] += lo * (int16_t)(row[i] & 0xFFFF) + hi * (row[i] >> 16);
        }
}

#ifdef PCA_AVX2
/* PCA_BATCH tokens (count of them kept) 8 outputs a pass with AVX2, then the outputs past the last 8. */
__attribute__((target("avx2"))) static void sums_avx2(const int32_t *pairs, const int32_t *q2, size_t npairs,
                                                      const uint32_t *nz, size_t n, size_t width, size_t count,
                                                      int32_t *sums) {
    size_t i0 = 0;
    for (; i0 + 8 <= width; i0 += 8) {
        __m256i a[PCA_BATCH];
        for (int b = 0; b < PCA_BATCH; b++) a[b] = _mm256_setzero_si256();
        for (size_t k = 0; k < n; k++) {
            __m256i r = _mm256_loadu_si256((const __m256i *)(pairs + nz[k] * width + i0));
            for (int b = 0; b < PCA_BATCH; b++)
                a[b] = _mm256_add_epi32(a[b], _mm256_madd_epi16(_mm256_set1_epi32(q2[b * npairs + nz[k]]), r));
        }
        for (size_t b = 0; b < count; b++) _mm256_storeu_si256((__m256i *)(sums + b * width + i0), a[b]);
    }
    for (size_t b = 0; i0 < width && b < count; b++) {  /* a width that is not a multiple of 8 */
        memset(sums + b * width + i0, 0, (width - i0) * sizeof(int32_t));
        for (size_t k = 0; k < n; k++) {
            int32_t both = q2[b * npairs + nz[k]], lo = (int16_t)(both & 0xFFFF), hi = both >> 16;
            const int32_t *row = pairs + nz[k] * width;
            for (size_t i = i0; i < width; i++) sums[b * width + i] += lo * (int16_t)(row[i] & 0xFFFF) + hi * (row[i] >> 16);
        }
    }
}

/* The same with AVX-512: 32 outputs a pass (16 a register), then 16, the last ones masked. */
__attribute__((target("avx2,avx512f,avx512bw"))) static void sums_avx512(const int32_t *pairs, const int32_t *q2,
                                                                        size_t npairs, const uint32_t *nz, size_t n,
                                                                        size_t width, size_t count, int32_t *sums) {
    size_t i0 = 0;
    for (; i0 + 32 <= width; i0 += 32) {
        __m512i a[PCA_BATCH][2];
        for (int b = 0; b < PCA_BATCH; b++) a[b][0] = a[b][1] = _mm512_setzero_si512();
        for (size_t k = 0; k < n; k++) {
            const int32_t *row = pairs + nz[k] * width + i0;
            __m512i r0 = _mm512_loadu_si512(row), r1 = _mm512_loadu_si512(row + 16);
            for (int b = 0; b < PCA_BATCH; b++) {
                __m512i q = _mm512_set1_epi32(q2[b * npairs + nz[k]]);
                a[b][0] = _mm512_add_epi32(a[b][0], _mm512_madd_epi16(q, r0));
                a[b][1] = _mm512_add_epi32(a[b][1], _mm512_madd_epi16(q, r1));
            }
        }
        for (size_t b = 0; b < count; b++) {
            _mm512_storeu_si512(sums + b * width + i0, a[b][0]);
            _mm512_storeu_si512(sums + b * width + i0 + 16, a[b][1]);
        }
    }
    for (; i0 < width; i0 += 16) {
        __mmask16 lanes = width - i0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (width - i0)) - 1u);
        __m512i a[PCA_BATCH];
        for (int b = 0; b < PCA_BATCH; b++) a[b] = _mm512_setzero_si512();
        for (size_t k = 0; k < n; k++) {
            __m512i r = _mm512_maskz_loadu_epi32(lanes, pairs + nz[k] * width + i0);
            for (int b = 0; b < PCA_BATCH; b++)
                a[b] = _mm512_add_epi32(a[b], _mm512_madd_epi16(_mm512_set1_epi32(q2[b * npairs + nz[k]]), r));
        }
        for (size_t b = 0; b < count; b++) _mm512_mask_storeu_epi32(sums + b * width + i0, lanes, a[b]);
    }
}
#endif

/* The magnitude base, extra bits and sign of symbol s (kvn_pca_symbol). */
static kvn_pca_symbol info_of(unsigned s) {
    kvn_pca_symbol out = {0, 0, 0};
    if (s > KVN_PCA_MAX_SYMBOL) out.base = 0xFFFF;  /* a symbol the format does not use: its value is beyond MAX_Q */
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

/* A row of n values rounded to `dtype` (nearest, ties to even), a loop per dtype the compiler vectorises. */
static void store_row(int dtype, uint8_t *restrict row, const float *restrict x, size_t n) {
    if (dtype == KVN_BF16) {
        uint16_t h[n];
        for (size_t d = 0; d < n; d++) h[d] = f32_to_bf16(x[d]);
        memcpy(row, h, sizeof h);
    } else if (dtype == KVN_FP16) {
        uint16_t h[n];
        for (size_t d = 0; d < n; d++) h[d] = f32_to_f16(x[d]);
        memcpy(row, h, sizeof h);
    } else {
        memcpy(row, x, n * sizeof(float));
    }
}

typedef struct {
    int32_t *q2, *sums;     /* [PCA_BATCH][pairs]: each pair of coefficients as int16 halves; [PCA_BATCH][width] */
    float *x, *cs, *sn;
    uint8_t *cls;
    uint32_t *live;         /* the components with a class, in order */
    uint32_t *base;         /* [components + 8]: each live component's slot row (its class * 2^11) */
    uint8_t *words;         /* the stream's words and 8 zero words, allocated only where the plane holds fewer past
                             * them (a crafted plane: a real one has room to spare) */
    uint32_t *nz;           /* [pairs]: a token's pairs with a coefficient that is not zero */
    const kvn_pca_angles *angles;  /* the block's rotary angles, computed before its tokens; NULL: per token */
    int isa;                /* the basis sums' vector level (the process's, kvn_isa(), asked once a plane) */
} decode_scratch;

/* The coded tokens `which` (count of them, their coefficients in q2 rows 0..count-1): their sums together, then
 * each token's values, rotated forward where keys are, into its rows. */
static void restore_tokens(const kvn_pca_model *m, int dtype, uint64_t position, decode_scratch *s, uint8_t *const *rows,
                           size_t tokens, const size_t *which, size_t count) {
    size_t npairs = (m->components + 1) / 2, n = nonzero_pairs(s->q2, npairs, count, s->nz);
#ifdef PCA_AVX2
    if (s->isa >= KVN_ISA_AVX512) sums_avx512(m->pairs, s->q2, npairs, s->nz, n, m->width, count, s->sums);
    else if (s->isa >= KVN_ISA_AVX2) sums_avx2(m->pairs, s->q2, npairs, s->nz, n, m->width, count, s->sums);
    else
#endif
        sums_plain(m->pairs, s->q2, npairs, s->nz, n, m->width, count, s->sums);
    const float gain = m->gain, *restrict mean = m->mean;
    float *restrict x = s->x;
    for (size_t b = 0; b < count; b++) {
        const int32_t *restrict sums = s->sums + b * m->width;
        size_t t = which[b];
        for (size_t i = 0; i < m->width; i++) x[i] = (float)sums[i] * gain + mean[i];
        if (m->rope) {
            const float *cs = s->cs, *sn = s->sn;
            if (s->angles) {
                size_t at = (size_t)(position + t - s->angles->first) * s->angles->half;
                cs = s->angles->cs + at;
                sn = s->angles->sn + at;
            } else {
                kvn_pca_rotation(m, position + t, s->cs, s->sn);
            }
            kvn_pca_rotate(m, s->x, cs, sn, 0);
        }
        for (size_t h = 0; h < m->heads; h++)
            if (rows[h * tokens + t]) store_row(dtype, rows[h * tokens + t], x + h * m->dim, m->dim);
    }
}

/* The head, bitmap and lengths of a coded plane checked; the stream's and extra bits' offsets in *stream_at. */
/* Whether the n bytes at p are all zero: a plane's room past its content, most of a coded plane, read eight bytes
 * at a time. */
static int all_zero(const uint8_t *p, size_t n) {
    uint64_t any = 0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, sizeof w);
        any |= w[0] | w[1] | w[2] | w[3];
    }
    for (; i < n; i++) any |= p[i];
    return !any;
}

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
    if (!all_zero(plane + at + kept + stream_len + extra_len, plane_len - (at + kept + stream_len + extra_len)))
        return KVN_ERR_CORRUPT;
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
    kvn_pca_symbol info[KVN_PCA_SYMBOLS];
    for (unsigned k = 0; k < KVN_PCA_SYMBOLS; k++) info[k] = info_of(k);
    for (size_t k = 0; k < nlive; k++) s->base[k] = (uint32_t)s->cls[s->live[k]] << KVN_PCA_PROB_BITS;
    size_t npairs = (c + 1) / 2, batch[PCA_BATCH], queued = 0;
    memset(s->q2, 0, PCA_BATCH * npairs * sizeof(int32_t));  /* components without a class stay zero */
    const uint8_t *exact_values = plane + KVN_PCA_HEAD + (tokens + 7) / 8;
    kvn_pca_reader reader = {.phase = r.i, .words = r.words, .pos = r.pos, .nwords = r.nwords, .bytes = bits.data,
                             .nbytes = bits.len};
    memcpy(reader.x, r.x, sizeof reader.x);
    if ((size_t)(r.words - plane) + 2 * (r.nwords + 8) > plane_len) {  /* readers read 8 words past the last */
        s->words = calloc(r.nwords + 8, 2);
        if (!s->words) return KVN_ERR_NOMEM;
        memcpy(s->words, r.words, 2 * r.nwords);
        reader.words = s->words;
    }
    kvn_pca_token_fn token = kvn_pca_token_scalar;
#ifdef KVN_PCA_TOKEN_AVX2
    if (s->isa >= KVN_ISA_AVX2) token = kvn_pca_token_avx2;
#endif
    const uint32_t *slots = m->slots[0];
    for (size_t t = 0; t < tokens; t++) {
        if ((plane[KVN_PCA_HEAD + t / 8] >> (t % 8)) & 1) {
            for (size_t h = 0; h < m->heads; h++, exact_values += row)
                if (rows[h * tokens + t]) memcpy(rows[h * tokens + t], exact_values, row);
            continue;
        }
        uint32_t total;
        uint16_t *q16 = (uint16_t *)(s->q2 + queued * npairs);  /* component j is half j % 2 of pair j / 2 */
        if (token(&reader, slots, s->live, s->base, nlive, info, q16, &total) || total >= KVN_PCA_MAX_SUM ||
            reader.pos > reader.nwords)
            return KVN_ERR_CORRUPT;
        batch[queued++] = t;
        if (queued == PCA_BATCH) {
            restore_tokens(m, dtype, position, s, rows, tokens, batch, queued);
            queued = 0;
        }
    }
    if (queued) restore_tokens(m, dtype, position, s, rows, tokens, batch, queued);
    /* every word and extra bit read to the last byte, less than a byte of zero padding left, every state back
     * where the encoder began it */
    if (reader.pos != reader.nwords || reader.fill + 8 * (reader.nbytes - reader.at_byte) >= 8 || reader.acc)
        return KVN_ERR_CORRUPT;
    for (int k = 0; k < KVN_PCA_STATES; k++)
        if (reader.x[k] != KVN_PCA_LOW) return KVN_ERR_CORRUPT;
    return KVN_OK;
}

void kvn_pca_angles_free(kvn_pca_angles *angles) {
    free(angles->cs);
    free(angles->sn);
    free(angles->freqs);
    *angles = (kvn_pca_angles){0};
}

/* `angles` holding the positions position .. position + tokens - 1 under m's frequencies (computed here where
 * it does not); KVN_ERR_NOMEM without memory. */
static int angles_for(kvn_pca_angles *a, const kvn_pca_model *m, uint64_t position, size_t tokens) {
    size_t half = m->dim / 2;
    if (a->freqs && a->half == half && !memcmp(a->freqs, m->freqs, half * sizeof(float)) && a->first <= position &&
        position + tokens <= a->first + a->count)
        return KVN_OK;
    if (tokens * half > a->cap || !a->freqs || a->half != half) {
        kvn_pca_angles_free(a);
        a->cs = malloc(tokens * half * sizeof(float) + 4);
        a->sn = malloc(tokens * half * sizeof(float) + 4);
        a->freqs = malloc(half * sizeof(float) + 4);
        if (!a->cs || !a->sn || !a->freqs) {
            kvn_pca_angles_free(a);
            return KVN_ERR_NOMEM;
        }
        a->cap = tokens * half;
    }
    a->half = half;
    memcpy(a->freqs, m->freqs, half * sizeof(float));
    for (size_t t = 0; t < tokens; t++) kvn_pca_rotation(m, position + t, a->cs + t * half, a->sn + t * half);
    a->first = position;
    a->count = tokens;
    return KVN_OK;
}

int kvn_pca_decode_rows(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                        uint8_t *const *rows) {
    return kvn_pca_decode_rows_with(m, dtype, tokens, plane, plane_len, rows, NULL);
}

int kvn_pca_decode_rows_with(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                             uint8_t *const *rows, kvn_pca_angles *angles) {
    if (dtype > KVN_FP32 || plane_len != kvn_pca_plane_size(m, dtype, tokens)) return KVN_ERR_ARG;
    size_t row = m->dim * kvn_itemsize(dtype), raw = tokens * m->heads * row;
    if (plane[0] > 1) return KVN_ERR_CORRUPT;
    if (plane[0] == 0) {
        if (!all_zero(plane + 1 + raw, plane_len - 1 - raw)) return KVN_ERR_CORRUPT;
        for (size_t h = 0; h < m->heads; h++)
            for (size_t t = 0; t < tokens; t++)
                if (rows[h * tokens + t]) memcpy(rows[h * tokens + t], plane + 1 + (h * tokens + t) * row, row);
        return KVN_OK;
    }
    size_t c = m->components, npairs = (c + 1) / 2 + 1;
    decode_scratch s = {malloc(4 * PCA_BATCH * npairs), malloc(4 * PCA_BATCH * m->width), malloc(4 * m->width),
                        malloc(2 * m->dim + 4), malloc(2 * m->dim + 4), malloc(c + 1), malloc(4 * c + 4),
                        malloc(4 * c + 32), NULL, malloc(4 * npairs), NULL, KVN_ISA_SCALAR};
#ifdef PCA_AVX2
    s.isa = kvn_isa();
#endif
    if (m->rope && angles) {  /* a coded plane's position is checked with its head, before a token is restored */
        uint64_t position = kvn_rd64(plane + 8);
        if (position <= KVN_PCA_MAX_POSITION - tokens && angles_for(angles, m, position, tokens) == KVN_OK)
            s.angles = angles;
    }
    int rc = s.q2 && s.sums && s.x && s.cs && s.sn && s.cls && s.live && s.base && s.nz
                 ? decode_coded(m, dtype, tokens, plane, plane_len, rows, &s)
                 : KVN_ERR_NOMEM;
    free(s.q2);
    free(s.sums);
    free(s.x);
    free(s.cs);
    free(s.sn);
    free(s.cls);
    free(s.live);
    free(s.base);
    free(s.words);
    free(s.nz);
    return rc;
}
