/* The lossy `pca` stage's block plane, both ways (kvtool/layouts/pca_reference.py is the reference; docs/FORMAT.md
 * specifies the bytes).
 *
 * Forward, per token not kept exact: its heads * dim values as float32, keys turned back by their position's
 * angles (a float64 polynomial rounded to float32, then float32 products and sums), the mean taken off, each
 * coefficient the float32 sum over the values in order of value * basis (no fused multiply-add: the build
 * passes -ffp-contract=off), then rint(coefficient * (1 / step)) in float64. The coefficients are coded as
 * symbols with the dictionary's tables by an 8-state rANS coder (ctxans's), their extra bits apart.
 *
 * Inverse: the integer sum of q * basis (exact in any order, so it runs along the values, skipping zeros),
 * float32(sum) * (step * 2^-14) + mean, turned forward, rounded to the cache's dtype. */
#include "pca_impl.h"

#include <math.h>
#include <stdlib.h>

static const double SIN_C[8] = {1.0 / 1307674368000.0, -1.0 / 6227020800.0, 1.0 / 39916800.0, -1.0 / 362880.0,
                                1.0 / 5040.0, -1.0 / 120.0, 1.0 / 6.0, -1.0};
static const double COS_C[9] = {1.0 / 20922789888000.0, -1.0 / 87178291200.0, 1.0 / 479001600.0, -1.0 / 3628800.0,
                                1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -1.0 / 2.0, 1.0};
#define HALF_PI 1.5707963267948966

void kvn_pca_rotation(const kvn_pca_model *m, uint64_t position, float *cos_out, float *sin_out) {
    for (size_t i = 0; i < m->dim / 2; i++) {
        double angle = (double)position * (double)m->freqs[i];
        double k = floor(angle / HALF_PI + 0.5);
        double r = angle - k * HALF_PI, r2 = r * r, s = 0.0, c = 0.0;
        for (int a = 0; a < 8; a++) s = s * r2 + SIN_C[a];
        for (int a = 0; a < 9; a++) c = c * r2 + COS_C[a];
        s = -(s * r);
        long long quadrant = ((long long)k % 4 + 4) % 4;
        double sn = quadrant == 0 ? s : quadrant == 1 ? c : quadrant == 2 ? -s : -c;
        double cs = quadrant == 0 ? c : quadrant == 1 ? -s : quadrant == 2 ? -c : s;
        cos_out[i] = (float)cs;
        sin_out[i] = (float)sn;
    }
}

void kvn_pca_rotate(const kvn_pca_model *m, float *x, const float *cs, const float *sn, int back) {
    size_t half = m->dim / 2;
    for (size_t h = 0; h < m->heads; h++) {
        float *a = x + h * m->dim, *b = a + half;
        for (size_t i = 0; i < half; i++) {
            float u = a[i], w = b[i], c = cs[i], s = sn[i];
            if (back) {
                a[i] = u * c + w * s;
                b[i] = w * c - u * s;
            } else {
                a[i] = u * c - w * s;
                b[i] = w * c + u * s;
            }
        }
    }
}

static inline float load_value(int dtype, const uint8_t *p) {
    if (dtype == KVN_BF16) { uint16_t v; memcpy(&v, p, 2); return bf16_to_f32(v); }
    if (dtype == KVN_FP16) { uint16_t v; memcpy(&v, p, 2); return f16_to_f32(v); }
    float v;
    memcpy(&v, p, 4);
    return v;
}

/* Tokens projected together: each row of the weights read from the cache once for all of them. */
#define PCA_PROJECT 8

/* acc[b][j] = sum over i in order of y[b][i] * weights[i][j], for `count` tokens b (rows of y `width` apart, of acc
 * `components`), vectorised across j. */
KVN_MULTIVERSION
static void project(const kvn_pca_model *m, const float *y, size_t count, float *acc) {
    size_t c = m->components, width = m->width;
    for (size_t k = 0; k < count * c; k++) acc[k] = 0.0f;
    for (size_t i = 0; i < width; i++) {
        const float *w = m->weights + i * c;
        for (size_t b = 0; b < count; b++) {
            float v = y[b * width + i], *a = acc + b * c;
            for (size_t j = 0; j < c; j++) a[j] = a[j] + v * w[j];
        }
    }
}

/* ---- symbols and the coder ------------------------------------------------------------------------------ */

typedef struct { uint8_t sym, nbits; uint16_t extra; } coded_q;

static inline coded_q symbol_of(int32_t q) {
    coded_q out = {0, 0, 0};
    if (q == 0) return out;
    uint32_t mag = (uint32_t)(q < 0 ? -q : q) - 1u;
    uint32_t cls = mag;
    if (mag >= 4) {
        int e = 31 - __builtin_clz(mag);
        uint32_t h = (mag >> (e - 1)) & 1u;
        cls = 4u + 2u * (uint32_t)(e - 2) + h;
        out.nbits = (uint8_t)(e - 1);
        out.extra = (uint16_t)(mag & ((1u << (e - 1)) - 1u));
    }
    out.sym = (uint8_t)(1u + 2u * cls + (q < 0));
    return out;
}

typedef struct { uint8_t *buf; size_t cap, len; uint64_t acc; unsigned fill; } bit_writer;

static inline int put_bits(bit_writer *w, uint32_t value, unsigned n) {
    w->acc |= (uint64_t)value << w->fill;
    w->fill += n;
    while (w->fill >= 8) {
        if (w->len >= w->cap) return KVN_ERR_NOMEM;
        w->buf[w->len++] = (uint8_t)w->acc;
        w->acc >>= 8;
        w->fill -= 8;
    }
    return KVN_OK;
}

/* The rANS stream into dst (its bytes in *len): the class of each component with the class model, then each
 * coded token's symbols of the components that have a class, with that class's table (ctxans's coder: symbol
 * i by state i % STATES, coded last to first). KVN_ERR_NOMEM where it would pass `cap`. */
static int rans_encode(const kvn_pca_model *m, const uint8_t *cls, const uint8_t *syms, const uint32_t *live,
                       size_t nlive, size_t ntokens, uint8_t *dst, size_t cap, size_t *len) {
    size_t c = m->components, total = c + ntokens * nlive, nwords = 0;
    if (cap < 4 * KVN_PCA_STATES) return KVN_ERR_NOMEM;
    size_t words_cap = (cap - 4 * KVN_PCA_STATES) / 2;
    uint8_t *words = dst + 4 * KVN_PCA_STATES;
    uint32_t x[KVN_PCA_STATES];
    for (int s = 0; s < KVN_PCA_STATES; s++) x[s] = KVN_PCA_LOW;
    /* Symbol i (in reading order: the classes, then each coded token's live components) takes state i % 8; coded
     * from the last, each division by a frequency a multiplication by its reciprocal (exact: rcp in pca.h). */
    size_t i = total;
#define PUT(MODEL, SYM)                                                                                          \
    do {                                                                                                         \
        unsigned model_ = (MODEL), sym_ = (SYM);                                                                 \
        uint32_t f = m->freq[model_][sym_], *state = &x[--i % KVN_PCA_STATES];                                   \
        if (*state >= f << (32 - KVN_PCA_PROB_BITS)) {                                                           \
            if (nwords >= words_cap) return KVN_ERR_NOMEM;                                                       \
            uint16_t word = (uint16_t)*state;                                                                    \
            memcpy(words + 2 * nwords++, &word, 2); /* in coding order; reversed below */                        \
            *state >>= 16;                                                                                       \
        }                                                                                                        \
        uint32_t q = f == 1 ? *state : (uint32_t)(((unsigned __int128)*state * m->rcp[model_][sym_]) >> 64);     \
        *state = (q << KVN_PCA_PROB_BITS) + (*state - q * f) + m->cum[model_][sym_];                             \
    } while (0)
    for (size_t t = ntokens; t-- > 0;)
        for (size_t k = nlive; k-- > 0;) PUT(cls[live[k]], syms[t * c + live[k]]);
    for (size_t j = c; j-- > 0;) PUT(0, cls[j]);
#undef PUT
    for (size_t a = 0, b = nwords; a + 1 < b; a++, b--) {
        uint16_t lo, hi;
        memcpy(&lo, words + 2 * a, 2);
        memcpy(&hi, words + 2 * (b - 1), 2);
        memcpy(words + 2 * a, &hi, 2);
        memcpy(words + 2 * (b - 1), &lo, 2);
    }
    for (int s = 0; s < KVN_PCA_STATES; s++) kvn_wr32(dst + 4 * s, x[s]);
    *len = 4 * KVN_PCA_STATES + 2 * nwords;
    return KVN_OK;
}

/* What encode_coded returns where the coded block would not fit its plane (only adversarial blocks). */
#define DOES_NOT_FIT (-1)

/* ---- the plane ------------------------------------------------------------------------------------------ */

size_t kvn_pca_plane_size(const kvn_pca_model *m, int dtype, size_t tokens) {
    return KVN_PCA_HEAD + (tokens + 7) / 8 + tokens * m->width * kvn_itemsize(dtype) + KVN_PCA_SLACK;
}

/* The largest finite value of a dtype, as the reference computes it. */
static double top_of(int dtype) {
    int exponent_bits = dtype == KVN_FP16 ? 5 : 8, mantissa_bits = dtype == KVN_BF16 ? 7 : dtype == KVN_FP16 ? 10 : 23;
    return (2.0 - ldexp(1.0, -mantissa_bits)) * ldexp(1.0, (1 << (exponent_bits - 1)) - 1);
}

typedef struct {
    uint8_t *exact;    /* [tokens] */
    uint8_t *syms;     /* [tokens][components]: the coded tokens', in order */
    uint8_t *nbits;
    uint16_t *extra;
    float *x, *y, *acc, *cs, *sn;  /* y: [PCA_PROJECT][width], acc: [PCA_PROJECT][components] */
} encode_scratch;

/* Each token's coefficients and symbols; tokens that cannot be coded join the exact ones. Returns the count
 * of coded tokens. */
/* The symbols of the projected tokens which[0..count-1] (their coefficients in rows of s->acc) into the rows
 * from `coded` on, in order; a token whose coefficients do not fit is kept exact instead. The rows used. */
static size_t quantize_tokens(const kvn_pca_model *m, double top, const size_t *which, size_t count, encode_scratch *s,
                              size_t coded) {
    size_t c = m->components, first = coded;
    for (size_t b = 0; b < count; b++) {
        const float *acc = s->acc + b * c;
        double total = 0.0;
        int beyond = 0;
        uint8_t *sym = s->syms + coded * c, *nbits = s->nbits + coded * c;
        uint16_t *extra = s->extra + coded * c;
        for (size_t j = 0; j < c; j++) {
            double q = rint((double)acc[j] * m->inverse);
            if (!(fabs(q) <= KVN_PCA_MAX_Q)) { beyond = 1; continue; }  /* NaN too: only from overflowing sums */
            total += fabs(q);
            coded_q one = symbol_of((int32_t)q);
            sym[j] = one.sym;
            nbits[j] = one.nbits;
            extra[j] = one.extra;
        }
        if (beyond || total >= KVN_PCA_MAX_SUM || 2.0 * (total * (double)m->step + m->mean_max) >= top) {
            s->exact[which[b]] = 1;
            continue;
        }
        coded++;
    }
    return coded - first;
}

static size_t quantize_block(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *src, uint64_t position,
                           encode_scratch *s) {
    size_t w = kvn_itemsize(dtype), coded = 0, batch[PCA_PROJECT], queued = 0;
    double top = top_of(dtype) / 2;
    for (size_t t = 0; t < tokens; t++) {
        if (s->exact[t]) continue;
        for (size_t h = 0; h < m->heads; h++)
            for (size_t d = 0; d < m->dim; d++) {
                s->x[h * m->dim + d] = load_value(dtype, src + ((h * tokens + t) * m->dim + d) * w);
            }
        if (m->rope) {
            kvn_pca_rotation(m, position + t, s->cs, s->sn);
            kvn_pca_rotate(m, s->x, s->cs, s->sn, 1);
        }
        float *y = s->y + queued * m->width;
        for (size_t i = 0; i < m->width; i++) y[i] = s->x[i] - m->mean[i];
        batch[queued++] = t;
        if (queued == PCA_PROJECT) {
            project(m, s->y, queued, s->acc);
            coded += quantize_tokens(m, top, batch, queued, s, coded);
            queued = 0;
        }
    }
    if (queued) {
        project(m, s->y, queued, s->acc);
        coded += quantize_tokens(m, top, batch, queued, s, coded);
    }
    return coded;
}

/* Each component's class (0: every symbol 0), as the reference's choose_classes. */
static void choose_classes(const kvn_pca_model *m, const uint8_t *syms, size_t ntokens, uint8_t *cls, uint32_t *counts) {
    size_t c = m->components;
    memset(counts, 0, c * KVN_PCA_SYMBOLS * sizeof(uint32_t));
    for (size_t t = 0; t < ntokens; t++)
        for (size_t j = 0; j < c; j++) counts[j * KVN_PCA_SYMBOLS + syms[t * c + j]]++;
    for (size_t j = 0; j < c; j++) {
        const uint32_t *n = counts + j * KVN_PCA_SYMBOLS;
        cls[j] = 0;
        if ((size_t)n[0] == ntokens) continue;
        int64_t best = 0;
        for (int k = 0; k < m->classes; k++) {
            int64_t cost = m->class_costs[k + 1];
            for (int sy = 0; sy < KVN_PCA_SYMBOLS; sy++) cost += (int64_t)n[sy] * m->table_costs[k][sy];
            if (k == 0 || cost < best) {
                best = cost;
                cls[j] = (uint8_t)(k + 1);
            }
        }
    }
}

static int encode_coded(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *src, uint64_t position,
                        encode_scratch *s, size_t ncoded, uint8_t *plane, size_t plane_len) {
    size_t c = m->components, w = kvn_itemsize(dtype), row = m->dim * w, nexact = tokens - ncoded;
    uint8_t *cls = malloc(c + 1);
    uint32_t *counts = malloc((c + 1) * KVN_PCA_SYMBOLS * sizeof(uint32_t)), *live = malloc((c + 1) * sizeof(uint32_t));
    uint8_t *bits = malloc(ncoded * c * 2 + 8);
    int rc = cls && counts && live && bits ? KVN_OK : KVN_ERR_NOMEM;
    size_t nlive = 0, at = KVN_PCA_HEAD + (tokens + 7) / 8, stream_len = 0;
    bit_writer bw = {bits, ncoded * c * 2 + 8, 0, 0, 0};
    if (rc == KVN_OK) {
        choose_classes(m, s->syms, ncoded, cls, counts);
        for (size_t j = 0; j < c; j++)
            if (cls[j]) live[nlive++] = (uint32_t)j;
        for (size_t t = 0; t < ncoded && rc == KVN_OK; t++)
            for (size_t k = 0; k < nlive && rc == KVN_OK; k++) {
                size_t j = live[k];
                if (s->nbits[t * c + j]) rc = put_bits(&bw, s->extra[t * c + j], s->nbits[t * c + j]);
            }
        if (rc == KVN_OK && bw.fill) rc = put_bits(&bw, 0, 8 - bw.fill);
        if (rc == KVN_ERR_NOMEM) rc = DOES_NOT_FIT;  /* the bits' buffer holds two bytes a coefficient: never */
    }
    if (rc == KVN_OK && at + nexact * m->heads * row <= plane_len) {
        for (size_t t = 0; t < tokens; t++) {
            if (!s->exact[t]) continue;
            plane[KVN_PCA_HEAD + t / 8] |= (uint8_t)(1u << (t % 8));
            for (size_t h = 0; h < m->heads; h++, at += row) memcpy(plane + at, src + (h * tokens + t) * row, row);
        }
        rc = rans_encode(m, cls, s->syms, live, nlive, ncoded, plane + at, plane_len - at, &stream_len);
        if (rc == KVN_ERR_NOMEM || (rc == KVN_OK && at + stream_len + bw.len > plane_len)) rc = DOES_NOT_FIT;
    } else if (rc == KVN_OK) {
        rc = DOES_NOT_FIT;
    }
    if (rc == KVN_OK) {
        memcpy(plane + at + stream_len, bits, bw.len);
        plane[0] = 1;
        plane[1] = KVN_PCA_VERSION;
        uint16_t components = (uint16_t)c;
        memcpy(plane + 2, &components, 2);
        memcpy(plane + 4, m->tag, 4);
        kvn_wr64(plane + 8, position);
        kvn_wr32(plane + 16, (uint32_t)stream_len);
        kvn_wr32(plane + 20, (uint32_t)bw.len);
        kvn_wr32(plane + 24, (uint32_t)nexact);
    }
    free(cls);
    free(counts);
    free(live);
    free(bits);
    return rc;
}

int kvn_pca_encode(const kvn_pca_model *m, int dtype, size_t tokens, const void *src, uint64_t position,
                   const uint8_t *exact_in, uint8_t *plane, size_t plane_len) {
    if (dtype > KVN_FP32 || plane_len != kvn_pca_plane_size(m, dtype, tokens) || position + tokens > KVN_PCA_MAX_POSITION)
        return KVN_ERR_ARG;
    size_t c = m->components, n = tokens * (c ? c : 1);
    encode_scratch s = {malloc(tokens + 1), malloc(n + 1), malloc(n + 1), malloc(2 * n + 2), malloc(4 * m->width),
                        malloc(4 * PCA_PROJECT * m->width), malloc(4 * PCA_PROJECT * c + 4), malloc(2 * m->dim + 4),
                        malloc(2 * m->dim + 4)};
    int rc = s.exact && s.syms && s.nbits && s.extra && s.x && s.y && s.acc && s.cs && s.sn ? KVN_OK : KVN_ERR_NOMEM;
    memset(plane, 0, plane_len);
    size_t w = kvn_itemsize(dtype), count = tokens * m->width;
    for (size_t i = 0; rc == KVN_OK && i < count; i++)  /* exact tokens too: a NaN is refused wherever it is */
        if (!isfinite(load_value(dtype, (const uint8_t *)src + i * w))) rc = KVN_ERR_ARG;
    if (rc == KVN_OK) {
        for (size_t t = 0; t < tokens; t++) s.exact[t] = exact_in[t] != 0;
        size_t coded = quantize_block(m, dtype, tokens, src, position, &s);
        if ((rc = encode_coded(m, dtype, tokens, src, position, &s, coded, plane, plane_len)) == DOES_NOT_FIT) {
            memset(plane, 0, plane_len);  /* the block as it is */
            memcpy(plane + 1, src, tokens * m->width * kvn_itemsize(dtype));
            rc = KVN_OK;
        }
    }
    free(s.exact);
    free(s.syms);
    free(s.nbits);
    free(s.extra);
    free(s.x);
    free(s.y);
    free(s.acc);
    free(s.cs);
    free(s.sn);
    return rc;
}

