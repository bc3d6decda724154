/* The `outliers:F` side channel (kvtool/layouts/outliers.py, which is the reference), both ways.
 *
 * Forward: each row's values ordered by their bit patterns as sign-magnitude keys, ties by
 * position; of the c + 1 least and c + 1 greatest, the first i in 0..c whose kept range
 * (greatest[i] - least[i] in double; NaN counts as infinite) is least decides the outliers:
 * the i least and the c - i greatest. They go to the side planes (positions ascending, bit
 * patterns) and become, in the dense copy, the kept minimum or maximum. Rows are small and c
 * smaller, so the least and greatest are kept by insertion, O(L * c) per row.
 *
 * Inverse: the dense plane copied out, the outliers' bits written back; a position beyond the
 * row, positions that do not ascend or a non-zero unused tail make it decline (KVN_ERR_CORRUPT)
 * and the reference raises its own error. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>

#include "kvn.h"

typedef struct {
    int dtype;                 /* KVN_BF16, KVN_FP16 or KVN_FP32 */
    size_t heads, tokens, dim;
    int channel_axis;          /* rows are a channel over the tokens (else a token over the channels) */
    size_t per_row;            /* outliers per row, c */
    size_t pos_bytes;          /* 1, 2 or 4 */
    size_t entries;            /* the side planes' length, N */
} ol_block;

static size_t ol_rows(const ol_block *b) { return b->heads * (b->channel_axis ? b->dim : b->tokens); }
static size_t ol_length(const ol_block *b) { return b->channel_axis ? b->tokens : b->dim; }
static size_t ol_item(const ol_block *b) { return b->dtype == KVN_FP32 ? 4 : 2; }

/* Where row r starts in the block, and how far apart its elements are: element j is at start + j * step. */
static size_t ol_start(const ol_block *b, size_t r) {
    return b->channel_axis ? (r / b->dim) * b->tokens * b->dim + r % b->dim : r * b->dim;
}
static size_t ol_step(const ol_block *b) { return b->channel_axis ? b->dim : 1; }

static uint32_t ol_bits(const ol_block *b, const uint8_t *p, size_t i) {
    if (ol_item(b) == 4) return kvn_rd32(p + 4 * i);
    uint16_t v;
    memcpy(&v, p + 2 * i, 2);
    return v;
}

static void ol_put(const ol_block *b, uint8_t *p, size_t i, uint32_t v) {
    if (ol_item(b) == 4) {
        kvn_wr32(p + 4 * i, v);
    } else {
        uint16_t h = (uint16_t)v;
        memcpy(p + 2 * i, &h, 2);
    }
}

static double ol_value(int dtype, uint32_t bits) {
    float f;
    if (dtype == KVN_FP32) {
        memcpy(&f, &bits, 4);
        return f;
    }
    if (dtype == KVN_BF16) {
        uint32_t x = bits << 16;
        memcpy(&f, &x, 4);
        return f;
    }
    uint32_t exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;  /* fp16, exactly */
    double magnitude = exponent == 0 ? ldexp((double)mantissa, -24)
                       : exponent == 31 ? (mantissa ? NAN : INFINITY)
                       : ldexp((double)(mantissa | 0x400u), (int)exponent - 25);
    return (bits & 0x8000u) ? -magnitude : magnitude;
}

/* The order key: (sign-magnitude bits as an unsigned total order) << 32 | position. */
static uint64_t ol_key(const ol_block *b, uint32_t bits, size_t j) {
    uint32_t sign = ol_item(b) == 4 ? 0x80000000u : 0x8000u, mask = ol_item(b) == 4 ? 0xFFFFFFFFu : 0xFFFFu;
    uint32_t order = (bits & sign) ? (~bits & mask) : (bits | sign);
    return (uint64_t)order << 32 | (uint64_t)j;
}

static void ol_put_pos(uint8_t *pos, size_t width, size_t i, uint32_t v) {
    if (width == 1) pos[i] = (uint8_t)v;
    else if (width == 2) { uint16_t h = (uint16_t)v; memcpy(pos + 2 * i, &h, 2); }
    else kvn_wr32(pos + 4 * i, v);
}

static uint32_t ol_get_pos(const uint8_t *pos, size_t width, size_t i) {
    if (width == 1) return pos[i];
    if (width == 2) { uint16_t h; memcpy(&h, pos + 2 * i, 2); return h; }
    return kvn_rd32(pos + 4 * i);
}

static int ol_split(const ol_block *b, const uint8_t *src, uint8_t *dense, uint8_t *pos, uint8_t *val) {
    size_t rows = ol_rows(b), length = ol_length(b), c = b->per_row, item = ol_item(b), step = ol_step(b);
    memcpy(dense, src, b->heads * b->tokens * b->dim * item);
    if (!c || !rows) return KVN_OK;
    uint64_t *least = malloc(2 * (c + 1) * sizeof(uint64_t)), *most = least ? least + c + 1 : NULL;
    uint32_t *chosen = malloc(c * sizeof(uint32_t)), *row = malloc(length * sizeof(uint32_t));
    if (!least || !chosen || !row) { free(least); free(chosen); free(row); return KVN_ERR_NOMEM; }
    for (size_t r = 0; r < rows; r++) {
        size_t start = ol_start(b, r), n_least = 0, n_most = 0;  /* least and most ascending (most's last the greatest) */
        for (size_t j = 0; j < length; j++) row[j] = ol_bits(b, src, start + j * step);
        for (size_t j = 0; j < length; j++) {
            uint64_t key = ol_key(b, row[j], j);
            if (n_least < c + 1 || key < least[n_least - 1]) {
                size_t k = n_least < c + 1 ? n_least++ : c;
                while (k > 0 && least[k - 1] > key) { least[k] = least[k - 1]; k--; }
                least[k] = key;
            }
            if (n_most < c + 1 || key > most[0]) {
                size_t k;
                if (n_most < c + 1) {
                    k = n_most++;
                    while (k > 0 && most[k - 1] > key) { most[k] = most[k - 1]; k--; }
                } else {
                    k = 0;
                    while (k < c && most[k + 1] < key) { most[k] = most[k + 1]; k++; }
                }
                most[k] = key;
            }
        }
        size_t taken = 0;
        double best = INFINITY;
        for (size_t i = 0; i <= c; i++) {
            double span = ol_value(b->dtype, row[most[i] & 0xFFFFFFFFu]) - ol_value(b->dtype, row[least[i] & 0xFFFFFFFFu]);
            if (isnan(span)) span = INFINITY;
            if (i == 0 || span < best) { best = span; taken = i; }
        }
        uint32_t fill_low = row[least[taken] & 0xFFFFFFFFu], fill_high = row[most[taken] & 0xFFFFFFFFu];
        size_t n = 0;
        for (size_t i = 0; i < taken; i++) chosen[n++] = (uint32_t)(least[i] & 0xFFFFFFFFu);
        for (size_t i = taken + 1; i <= c; i++) chosen[n++] = (uint32_t)(most[i] & 0xFFFFFFFFu) | 0x80000000u;
        for (size_t i = 1; i < n; i++) {  /* by position; the top bit marks one of the greatest */
            uint32_t v = chosen[i];
            size_t k = i;
            while (k > 0 && (chosen[k - 1] & 0x7FFFFFFFu) > (v & 0x7FFFFFFFu)) { chosen[k] = chosen[k - 1]; k--; }
            chosen[k] = v;
        }
        for (size_t i = 0; i < c; i++) {
            uint32_t j = chosen[i] & 0x7FFFFFFFu;
            ol_put_pos(pos, b->pos_bytes, r * c + i, j);
            ol_put(b, val, r * c + i, row[j]);
            ol_put(b, dense, start + j * step, (chosen[i] & 0x80000000u) ? fill_high : fill_low);
        }
    }
    free(least);
    free(chosen);
    free(row);
    return KVN_OK;
}

static int ol_merge(const ol_block *b, const uint8_t *dense, const uint8_t *pos, const uint8_t *val, uint8_t *out) {
    size_t rows = ol_rows(b), length = ol_length(b), c = b->per_row, used = rows * c, item = ol_item(b);
    for (size_t i = used; i < b->entries; i++)
        if (ol_get_pos(pos, b->pos_bytes, i) || ol_bits(b, val, i)) return KVN_ERR_CORRUPT;
    for (size_t r = 0; r < rows; r++)
        for (size_t i = 0; i < c; i++) {
            uint32_t j = ol_get_pos(pos, b->pos_bytes, r * c + i);
            if (j >= length || (i && j <= ol_get_pos(pos, b->pos_bytes, r * c + i - 1))) return KVN_ERR_CORRUPT;
        }
    if (out != dense) memcpy(out, dense, b->heads * b->tokens * b->dim * item);
    for (size_t r = 0; r < rows; r++)
        for (size_t i = 0; i < c; i++)
            ol_put(b, out, ol_start(b, r) + ol_get_pos(pos, b->pos_bytes, r * c + i) * ol_step(b), ol_bits(b, val, r * c + i));
    return KVN_OK;
}

/* The geometry shared by both calls, checked against every buffer; -1 with an exception when it does not fit. */
static int ol_parse(ol_block *b, Py_buffer *block, Py_buffer *other, Py_buffer *pos, Py_buffer *val, int dtype,
                    Py_ssize_t heads, Py_ssize_t tokens, Py_ssize_t dim, int channel_axis, Py_ssize_t per_row) {
    if ((dtype != KVN_BF16 && dtype != KVN_FP16 && dtype != KVN_FP32) || heads < 0 || tokens < 0 || dim < 0 ||
        per_row < 0 || tokens > 0xFFFFFFF || dim > 0xFFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code or geometry");
        return -1;
    }
    *b = (ol_block){dtype, (size_t)heads, (size_t)tokens, (size_t)dim, channel_axis, (size_t)per_row, 0, 0};
    size_t item = ol_item(b), n = b->heads * b->tokens * b->dim, length = ol_length(b);
    size_t longest = b->tokens > b->dim ? b->tokens : b->dim;
    b->pos_bytes = longest <= 256 ? 1 : longest <= 65536 ? 2 : 4;
    b->entries = (size_t)pos->len / b->pos_bytes;
    if ((b->dim && b->tokens && n / b->dim / b->tokens != b->heads) || (size_t)block->len != n * item ||
        (size_t)other->len != n * item || (size_t)pos->len != b->entries * b->pos_bytes ||
        (size_t)val->len != b->entries * item || (b->per_row && 2 * b->per_row >= length) ||
        (b->per_row && ol_rows(b) > b->entries / b->per_row)) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the geometry");
        return -1;
    }
    return 0;
}

static PyObject *ol_status(int rc, Py_buffer *a, Py_buffer *b, Py_buffer *c, Py_buffer *d) {
    PyBuffer_Release(a);
    PyBuffer_Release(b);
    PyBuffer_Release(c);
    PyBuffer_Release(d);
    if (rc < 0) return NULL;
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

/* outliers_split(block, dense, pos, val, dtype, heads, tokens, dim, channel_axis, per_row) -> status;
 * pos and val zeroed by the caller. */
PyObject *kvn_py_outliers_split(PyObject *self, PyObject *args) {
    Py_buffer block, dense, pos, val;
    int dtype, channel_axis, rc = -1;
    Py_ssize_t heads, tokens, dim, per_row;
    if (!PyArg_ParseTuple(args, "y*w*w*w*innnpn", &block, &dense, &pos, &val, &dtype, &heads, &tokens, &dim,
                          &channel_axis, &per_row))
        return NULL;
    ol_block b;
    if (ol_parse(&b, &block, &dense, &pos, &val, dtype, heads, tokens, dim, channel_axis, per_row) == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = ol_split(&b, block.buf, dense.buf, pos.buf, val.buf);
        Py_END_ALLOW_THREADS
    }
    return ol_status(rc, &block, &dense, &pos, &val);
}

/* outliers_merge(dense, pos, val, out, dtype, heads, tokens, dim, channel_axis, per_row) -> status */
PyObject *kvn_py_outliers_merge(PyObject *self, PyObject *args) {
    Py_buffer dense, pos, val, out;
    int dtype, channel_axis, rc = -1;
    Py_ssize_t heads, tokens, dim, per_row;
    if (!PyArg_ParseTuple(args, "y*y*y*w*innnpn", &dense, &pos, &val, &out, &dtype, &heads, &tokens, &dim,
                          &channel_axis, &per_row))
        return NULL;
    ol_block b;
    if (ol_parse(&b, &out, &dense, &pos, &val, dtype, heads, tokens, dim, channel_axis, per_row) == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = ol_merge(&b, dense.buf, pos.buf, val.buf, out.buf);
        Py_END_ALLOW_THREADS
    }
    return ol_status(rc, &dense, &pos, &val, &out);
}
