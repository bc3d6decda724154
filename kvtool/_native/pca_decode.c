/* The lossy `pca` stage's inverse: a plane back to its block's rows (pca.c has the forward and the format's
 * arithmetic; kvtool/layouts/pca_reference.py is the reference). */
#include "pca_impl.h"

#include <stdlib.h>

/* sums[i] += q * basis row j, for one coefficient: integers, exact in any order. */
KVN_MULTIVERSION
static void accumulate(const int16_t *row, int32_t q, size_t width, int32_t *sums) {
    for (size_t i = 0; i < width; i++) sums[i] += q * (int32_t)row[i];
}

typedef struct {
    const uint8_t *words;
    size_t nwords, pos, i;
    uint32_t x[KVN_PCA_STATES];
} rans_decoder;

static inline int next_symbol(const kvn_pca_model *m, rans_decoder *r, unsigned model, unsigned *sym) {
    uint32_t *x = &r->x[r->i++ % KVN_PCA_STATES];
    uint32_t slot = *x & ((1u << KVN_PCA_PROB_BITS) - 1u);
    unsigned s = m->lookup[model][slot];
    *x = m->freq[model][s] * (*x >> KVN_PCA_PROB_BITS) + slot - m->cum[model][s];
    if (*x < KVN_PCA_LOW) {
        if (r->pos == r->nwords) return KVN_ERR_CORRUPT;
        uint16_t word;
        memcpy(&word, r->words + 2 * r->pos++, 2);
        *x = *x << 16 | word;
    }
    *sym = s;
    return KVN_OK;
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

static inline void store_value(int dtype, uint8_t *p, float v) {
    if (dtype == KVN_BF16) { uint16_t h = f32_to_bf16(v); memcpy(p, &h, 2); }
    else if (dtype == KVN_FP16) { uint16_t h = f32_to_f16(v); memcpy(p, &h, 2); }
    else memcpy(p, &v, 4);
}

/* One coded token's values from its coefficients q (zero where not coded), into its rows. */
static void restore_token(const kvn_pca_model *m, int dtype, const int32_t *q, uint64_t position, int32_t *sums, float *x,
                          float *cs, float *sn, uint8_t *const *rows, size_t tokens, size_t t) {
    memset(sums, 0, m->width * sizeof(int32_t));
    for (size_t j = 0; j < m->components; j++)
        if (q[j]) accumulate(m->basis + j * m->width, q[j], m->width, sums);
    for (size_t i = 0; i < m->width; i++) x[i] = (float)sums[i] * m->gain + m->mean[i];
    if (m->rope) {
        kvn_pca_rotation(m, position, cs, sn);
        kvn_pca_rotate(m, x, cs, sn, 0);
    }
    size_t w = kvn_itemsize(dtype);
    for (size_t h = 0; h < m->heads; h++) {
        uint8_t *row = rows[h * tokens + t];
        if (row)
            for (size_t d = 0; d < m->dim; d++) store_value(dtype, row + d * w, x[h * m->dim + d]);
    }
}

static int decode_coded(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                        uint8_t *const *rows, int32_t *q, int32_t *sums, float *x, float *cs, float *sn, uint8_t *cls) {
    size_t w = kvn_itemsize(dtype), row = m->dim * w, c = m->components, at = KVN_PCA_HEAD + (tokens + 7) / 8;
    uint16_t components;
    memcpy(&components, plane + 2, 2);
    uint64_t position = kvn_rd64(plane + 8);
    size_t stream_len = kvn_rd32(plane + 16), extra_len = kvn_rd32(plane + 20), nexact = kvn_rd32(plane + 24), count = 0;
    if (plane[1] != KVN_PCA_VERSION || memcmp(plane + 4, m->tag, 4) || components != c || position + tokens > KVN_PCA_MAX_POSITION)
        return KVN_ERR_CORRUPT;
    for (size_t t = 0; t < ((tokens + 7) & ~(size_t)7); t++) {
        int bit = (plane[KVN_PCA_HEAD + t / 8] >> (t % 8)) & 1;
        if (bit && t >= tokens) return KVN_ERR_CORRUPT;
        count += (size_t)bit;
    }
    if (count != nexact || nexact > tokens) return KVN_ERR_CORRUPT;
    size_t kept = nexact * m->heads * row;
    if (at + kept > plane_len || stream_len > plane_len - at - kept || extra_len > plane_len - at - kept - stream_len ||
        stream_len < 4 * KVN_PCA_STATES || stream_len % 2)
        return KVN_ERR_CORRUPT;
    size_t end = at + kept + stream_len + extra_len;
    for (size_t b = end; b < plane_len; b++)
        if (plane[b]) return KVN_ERR_CORRUPT;
    rans_decoder r = {plane + at + kept + 4 * KVN_PCA_STATES, (stream_len - 4 * KVN_PCA_STATES) / 2, 0, 0, {0}};
    for (int s = 0; s < KVN_PCA_STATES; s++) r.x[s] = kvn_rd32(plane + at + kept + 4 * s);
    bit_reader bits = {plane + at + kept + stream_len, extra_len, 0, 0, 0};
    for (size_t j = 0; j < c; j++) {
        unsigned s;
        if (next_symbol(m, &r, 0, &s) || s > (unsigned)m->classes) return KVN_ERR_CORRUPT;
        cls[j] = (uint8_t)s;
    }
    const uint8_t *exact_values = plane + at;
    for (size_t t = 0; t < tokens; t++) {
        if ((plane[KVN_PCA_HEAD + t / 8] >> (t % 8)) & 1) {
            for (size_t h = 0; h < m->heads; h++, exact_values += row)
                if (rows[h * tokens + t]) memcpy(rows[h * tokens + t], exact_values, row);
            continue;
        }
        uint32_t total = 0;
        for (size_t j = 0; j < c; j++) {
            q[j] = 0;
            if (!cls[j]) continue;
            unsigned s;
            if (next_symbol(m, &r, cls[j], &s) || s > KVN_PCA_MAX_SYMBOL) return KVN_ERR_CORRUPT;
            if (!s) continue;
            uint32_t cl = (s - 1) >> 1, mag = cl;
            if (cl >= 4) {
                unsigned e = ((cl - 4) >> 1) + 2;
                uint32_t extra;
                if (get_bits(&bits, e - 1, &extra)) return KVN_ERR_CORRUPT;
                mag = ((2u + ((cl - 4) & 1u)) << (e - 1)) + extra;
            }
            q[j] = (s - 1) & 1 ? -(int32_t)(mag + 1) : (int32_t)(mag + 1);
            total += mag + 1;
        }
        if (total >= KVN_PCA_MAX_SUM) return KVN_ERR_CORRUPT;
        restore_token(m, dtype, q, position + t, sums, x, cs, sn, rows, tokens, t);
    }
    if (r.pos != r.nwords || bits.at != bits.len || bits.acc) return KVN_ERR_CORRUPT;
    for (int s = 0; s < KVN_PCA_STATES; s++)
        if (r.x[s] != KVN_PCA_LOW) return KVN_ERR_CORRUPT;
    return KVN_OK;
}

int kvn_pca_decode_rows(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                        uint8_t *const *rows) {
    if (dtype > KVN_FP32 || plane_len != kvn_pca_plane_size(m, dtype, tokens)) return KVN_ERR_ARG;
    size_t w = kvn_itemsize(dtype), row = m->dim * w, raw = tokens * m->heads * row;
    if (plane[0] > 1) return KVN_ERR_CORRUPT;
    if (plane[0] == 0) {
        for (size_t b = 1 + raw; b < plane_len; b++)
            if (plane[b]) return KVN_ERR_CORRUPT;
        for (size_t h = 0; h < m->heads; h++)
            for (size_t t = 0; t < tokens; t++)
                if (rows[h * tokens + t]) memcpy(rows[h * tokens + t], plane + 1 + (h * tokens + t) * row, row);
        return KVN_OK;
    }
    size_t c = m->components;
    int32_t *q = malloc(4 * c + 4), *sums = malloc(4 * m->width);
    float *x = malloc(4 * m->width), *cs = malloc(2 * m->dim + 4), *sn = malloc(2 * m->dim + 4);
    uint8_t *cls = malloc(c + 1);
    int rc = q && sums && x && cs && sn && cls
                 ? decode_coded(m, dtype, tokens, plane, plane_len, rows, q, sums, x, cs, sn, cls)
                 : KVN_ERR_NOMEM;
    free(q);
    free(sums);
    free(x);
    free(cs);
    free(sn);
    free(cls);
    return rc;
}
