/* Python bindings of the pca stage (listed in _core.c's method table): a tensor's coder becomes a capsule once;
 * encode and decode take it and release the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>

#include "pca.h"

#define CAPSULE_NAME "kvtool.pca_model"

static void model_free(kvn_pca_model *m) {
    if (!m) return;
    free(m->mean);
    free(m->weights);
    free(m->basis);
    free(m->freqs);
    free(m->pairs);
    free(m);
}

static void free_capsule(PyObject *capsule) { model_free(PyCapsule_GetPointer(capsule, CAPSULE_NAME)); }

/* The coder of one tensor; NULL where a table is inconsistent (frequencies that do not sum to 2^11). */
static kvn_pca_model *model_new(size_t heads, size_t dim, size_t components, int classes, float step, const float *mean,
                                const int16_t *basis, const float *freqs, const uint16_t *freq, const int64_t *table_costs,
                                const int64_t *class_costs, const uint8_t *tag) {
    size_t width = heads * dim;
    kvn_pca_model *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    *m = (kvn_pca_model){.heads = heads, .dim = dim, .width = width, .components = components, .classes = classes,
                         .rope = freqs != NULL, .step = step};
    m->gain = (float)((double)step * ldexp(1.0, -KVN_PCA_BASIS_BITS));
    m->inverse = 1.0 / (double)step;
    memcpy(m->tag, tag, 4);
    m->mean = malloc(4 * width);
    m->weights = malloc(4 * width * (components ? components : 1));
    m->basis = malloc(2 * width * (components ? components : 1));
    m->freqs = freqs ? malloc(4 * (dim / 2) + 4) : NULL;
    m->pairs = calloc((components + 1) / 2 + 1, 4 * width);
    if (!m->mean || !m->weights || !m->basis || (freqs && !m->freqs) || !m->pairs) {
        model_free(m);
        return NULL;
    }
    memcpy(m->mean, mean, 4 * width);
    for (size_t i = 0; i < width; i++) m->mean_max = fmax(m->mean_max, fabs((double)mean[i]));
    memcpy(m->basis, basis, 2 * width * components);
    for (size_t j = 0; j < components; j++)
        for (size_t i = 0; i < width; i++) {
            m->weights[i * components + j] = (float)basis[j * width + i] * (float)ldexp(1.0, -KVN_PCA_BASIS_BITS);
            uint32_t half = (uint16_t)basis[j * width + i];
            m->pairs[(j / 2) * width + i] |= (int32_t)(j % 2 ? half << 16 : half);
        }
    if (freqs) memcpy(m->freqs, freqs, 4 * (dim / 2));
    for (int model = 0; model <= classes; model++) {
        uint32_t sum = 0;
        for (int s = 0; s < KVN_PCA_SYMBOLS; s++) {
            uint16_t f = freq[model * KVN_PCA_SYMBOLS + s];
            m->freq[model][s] = f;
            m->cum[model][s] = (uint16_t)sum;
            for (uint32_t slot = sum; slot < sum + f && slot < (1u << KVN_PCA_PROB_BITS); slot++) {
                m->slots[model][slot] = f | (slot - sum) << 12 | (uint32_t)s << 23;
            }
            sum += f;
        }
        if (sum != 1u << KVN_PCA_PROB_BITS) {
            model_free(m);
            return NULL;
        }
    }
    for (int k = 0; k < classes; k++)
        for (int s = 0; s < KVN_PCA_SYMBOLS; s++) m->table_costs[k][s] = table_costs[k * KVN_PCA_SYMBOLS + s];
    for (int k = 0; k <= classes; k++) m->class_costs[k] = class_costs[k];
    return m;
}

/* pca_model(mean f32[D], basis i16[c, D], freqs f32[dim/2] or b"", freq u16[C + 1, 64], table_costs i64[C, 64],
 *           class_costs i64[C + 1], heads, dim, components, classes, step, tag) -> capsule */
PyObject *kvn_py_pca_model(PyObject *self, PyObject *args) {
    Py_buffer mean, basis, freqs, freq, table_costs, class_costs, tag;
    Py_ssize_t heads, dim, components;
    int classes;
    double step;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*nnnidy*", &mean, &basis, &freqs, &freq, &table_costs, &class_costs, &heads,
                          &dim, &components, &classes, &step, &tag))
        return NULL;
    kvn_pca_model *m = NULL;
    size_t width = (size_t)heads * (size_t)dim;
    int ok = heads > 0 && dim > 0 && components >= 0 && (size_t)components <= width && classes >= 1 &&
             classes <= KVN_PCA_MAX_CLASSES && (size_t)mean.len == 4 * width &&
             (size_t)basis.len == 2 * width * (size_t)components && (freqs.len == 0 || (size_t)freqs.len == 4 * (size_t)(dim / 2)) &&
             (size_t)freq.len == 2 * (size_t)(classes + 1) * KVN_PCA_SYMBOLS &&
             (size_t)table_costs.len == 8 * (size_t)classes * KVN_PCA_SYMBOLS && (size_t)class_costs.len == 8 * (size_t)(classes + 1) &&
             tag.len == 4 && step > 0 && isfinite(step) && (float)step == step;
    if (ok)
        m = model_new((size_t)heads, (size_t)dim, (size_t)components, classes, (float)step, mean.buf, basis.buf,
                      freqs.len ? freqs.buf : NULL, freq.buf, table_costs.buf, class_costs.buf, tag.buf);
    PyBuffer_Release(&mean);
    PyBuffer_Release(&basis);
    PyBuffer_Release(&freqs);
    PyBuffer_Release(&freq);
    PyBuffer_Release(&table_costs);
    PyBuffer_Release(&class_costs);
    PyBuffer_Release(&tag);
    if (!m) {
        PyErr_SetString(PyExc_ValueError, "inconsistent pca coder tables");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(m, CAPSULE_NAME, free_capsule);
    if (!capsule) model_free(m);
    return capsule;
}

/* pca_encode(block, plane, model, dtype, tokens, position, exact) -> status; block C-contiguous [heads, tokens, dim] */
PyObject *kvn_py_pca_encode(PyObject *self, PyObject *args) {
    Py_buffer block, plane, exact;
    PyObject *capsule;
    int dtype;
    Py_ssize_t tokens;
    unsigned long long position;
    if (!PyArg_ParseTuple(args, "y*w*OinKy*", &block, &plane, &capsule, &dtype, &tokens, &position, &exact)) return NULL;
    const kvn_pca_model *m = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    int rc = KVN_ERR_ARG;
    if (m && dtype >= 0 && dtype <= KVN_FP32 && tokens >= 0 && exact.len == tokens &&
        (size_t)block.len == (size_t)tokens * m->width * kvn_itemsize(dtype)) {
        Py_BEGIN_ALLOW_THREADS
        rc = kvn_pca_encode(m, dtype, (size_t)tokens, block.buf, position, exact.buf, plane.buf, (size_t)plane.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&block);
    PyBuffer_Release(&plane);
    PyBuffer_Release(&exact);
    if (!m) return NULL;
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

/* pca_decode(plane, out, model, dtype, tokens) -> status; out a writable C-contiguous [heads, tokens, dim] */
PyObject *kvn_py_pca_decode(PyObject *self, PyObject *args) {
    Py_buffer plane, out;
    PyObject *capsule;
    int dtype;
    Py_ssize_t tokens;
    if (!PyArg_ParseTuple(args, "y*w*Oin", &plane, &out, &capsule, &dtype, &tokens)) return NULL;
    const kvn_pca_model *m = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    int rc = KVN_ERR_ARG;
    size_t row = m ? m->dim * kvn_itemsize(dtype) : 0, nrows = m ? m->heads * (size_t)tokens : 0;
    uint8_t **rows = m && tokens >= 0 ? malloc((nrows + 1) * sizeof *rows) : NULL;
    if (m && !rows) rc = KVN_ERR_NOMEM;
    if (rows && dtype >= 0 && dtype <= KVN_FP32 && (size_t)out.len == nrows * row) {
        for (size_t r = 0; r < nrows; r++) rows[r] = (uint8_t *)out.buf + r * row;
        Py_BEGIN_ALLOW_THREADS
        rc = kvn_pca_decode_rows(m, dtype, (size_t)tokens, plane.buf, (size_t)plane.len, rows);
        Py_END_ALLOW_THREADS
    }
    free(rows);
    PyBuffer_Release(&plane);
    PyBuffer_Release(&out);
    if (!m) return NULL;
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}
