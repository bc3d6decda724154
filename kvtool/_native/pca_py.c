/* Python bindings of the pca stage (listed in _core.c's method table): a tensor's coder becomes a capsule once;
 * encode and decode take it and release the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>

#include "pca.h"

#define CAPSULE_NAME "kvtool.pca_model"

/* The decoder's slot tables, one per distinct set of coefficient tables, shared by every coder built from
 * them and freed with the last: touched only with the GIL held (model_new and the capsules' destructor). */
typedef struct shared_slots {
    struct shared_slots *next;
    size_t refs;
    int classes;
    uint16_t freq[KVN_PCA_MAX_CLASSES + 1][KVN_PCA_SYMBOLS];
    uint32_t slots[KVN_PCA_MAX_CLASSES + 1][1 << KVN_PCA_PROB_BITS];
} shared_slots;

static shared_slots *shared_tables;

/* The shared table of m's coefficient tables (m->freq, m->classes), built where none is; NULL without memory. */
static shared_slots *shared_acquire(const kvn_pca_model *m) {
    size_t rows = (size_t)(m->classes + 1) * sizeof m->freq[0];
    for (shared_slots *t = shared_tables; t; t = t->next)
        if (t->classes == m->classes && !memcmp(t->freq, m->freq, rows)) {
            t->refs++;
            return t;
        }
    shared_slots *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->refs = 1;
    t->classes = m->classes;
    memcpy(t->freq, m->freq, rows);
    for (int model = 0; model <= m->classes; model++)
        for (int s = 0; s < KVN_PCA_SYMBOLS; s++) {
            uint32_t f = m->freq[model][s], sum = m->cum[model][s];
            for (uint32_t slot = sum; slot < sum + f && slot < (1u << KVN_PCA_PROB_BITS); slot++)
                t->slots[model][slot] = f | (slot - sum) << 12 | (uint32_t)s << 23;
        }
    t->next = shared_tables;
    shared_tables = t;
    return t;
}

static void shared_release(shared_slots *t) {
    if (!t || --t->refs) return;
    for (shared_slots **at = &shared_tables; *at; at = &(*at)->next)
        if (*at == t) {
            *at = t->next;
            break;
        }
    free(t);
}

static void model_free(kvn_pca_model *m) {
    if (!m) return;
    shared_release(m->shared);
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
            m->rcp[model][s] = f > 1 ? UINT64_MAX / f + 1 : 0;
            sum += f;
        }
        if (sum != 1u << KVN_PCA_PROB_BITS) {
            model_free(m);
            return NULL;
        }
    }
    shared_slots *shared = shared_acquire(m);
    if (!shared) {
        model_free(m);
        return NULL;
    }
    m->shared = shared;
    m->slots = (const uint32_t(*)[1 << KVN_PCA_PROB_BITS])shared->slots;
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

/* pca_decode_run(planes, models, dtype, tokens, rows, starts, out_index, targets) -> (status, block)
 * A run of blocks straight into a destination's rows, the GIL released: block i is pca plane planes[i] of
 * tokens[i] tokens, coded with models[i]; its row (h, t) goes to byte rows[starts[i] + h * tokens[i] + t] of
 * targets[out_index[i]], nowhere where that is -1 (int64 arrays). Every offset is checked against its target
 * before a byte is written. Stops at the first block whose status is not 0 and says which. */
PyObject *kvn_py_pca_decode_run(PyObject *self, PyObject *args) {
    PyObject *planes_obj, *models_obj, *targets_obj;
    Py_buffer tokens_buf, rows_buf, starts_buf, index_buf;
    int dtype;
    if (!PyArg_ParseTuple(args, "OOiy*y*y*y*O", &planes_obj, &models_obj, &dtype, &tokens_buf, &rows_buf, &starts_buf,
                          &index_buf, &targets_obj))
        return NULL;
    PyObject *planes = PySequence_Fast(planes_obj, "planes must be a sequence");
    PyObject *models = planes ? PySequence_Fast(models_obj, "models must be a sequence") : NULL;
    PyObject *targets = models ? PySequence_Fast(targets_obj, "targets must be a sequence") : NULL;
    Py_ssize_t n = planes ? PySequence_Fast_GET_SIZE(planes) : 0, ntargets = targets ? PySequence_Fast_GET_SIZE(targets) : 0;
    Py_buffer *views = targets ? calloc((size_t)(n + ntargets) + 1, sizeof *views) : NULL;
    const kvn_pca_model **coders = views ? calloc((size_t)n + 1, sizeof *coders) : NULL;
    Py_ssize_t held = 0, failed_at = 0;
    int rc = KVN_ERR_ARG, ok = coders != NULL;
    if (targets && !coders) PyErr_NoMemory();
    const int64_t *tokens = tokens_buf.buf, *rows = rows_buf.buf, *starts = starts_buf.buf, *out_index = index_buf.buf;
    size_t nrows = (size_t)rows_buf.len / 8;
    ok = ok && PySequence_Fast_GET_SIZE(models) == n && tokens_buf.len == 8 * n && starts_buf.len == 8 * n &&
         index_buf.len == 8 * n && rows_buf.len % 8 == 0 && dtype >= 0 && dtype <= KVN_FP32;
    for (Py_ssize_t i = 0; ok && i < n + ntargets; i++, held++) {
        PyObject *item = i < n ? PySequence_Fast_GET_ITEM(planes, i) : PySequence_Fast_GET_ITEM(targets, i - n);
        if (PyObject_GetBuffer(item, &views[i], i < n ? PyBUF_SIMPLE : PyBUF_WRITABLE)) ok = 0;
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        coders[i] = PyCapsule_GetPointer(PySequence_Fast_GET_ITEM(models, i), CAPSULE_NAME);
        ok = coders[i] != NULL;
    }
    size_t most = 0;
    for (Py_ssize_t i = 0; ok && i < n; i++) {  /* shapes and offsets checked before anything is written */
        size_t count = (size_t)tokens[i] * coders[i]->heads, row = coders[i]->dim * kvn_itemsize(dtype);
        ok = tokens[i] >= 0 && starts[i] >= 0 && (size_t)starts[i] <= nrows && count <= nrows - (size_t)starts[i] &&
             out_index[i] >= 0 && out_index[i] < ntargets;
        for (size_t r = 0; ok && r < count; r++) {
            int64_t at = rows[starts[i] + r];
            ok = at == -1 || (at >= 0 && (size_t)at <= (size_t)views[n + out_index[i]].len &&
                              row <= (size_t)views[n + out_index[i]].len - (size_t)at);
        }
        if (count > most) most = count;
    }
    uint8_t **pointers = ok ? malloc((most + 1) * sizeof *pointers) : NULL;
    if (ok && !pointers) rc = KVN_ERR_NOMEM;
    if (pointers) {
        rc = KVN_OK;
        kvn_pca_angles angles = {0};  /* the run's key tensors share their blocks' angles */
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; rc == KVN_OK && i < n; i++) {
            uint8_t *base = views[n + out_index[i]].buf;
            size_t count = (size_t)tokens[i] * coders[i]->heads;
            for (size_t r = 0; r < count; r++) pointers[r] = rows[starts[i] + r] < 0 ? NULL : base + rows[starts[i] + r];
            rc = kvn_pca_decode_rows_with(coders[i], dtype, (size_t)tokens[i], views[i].buf, (size_t)views[i].len, pointers,
                                          &angles);
            failed_at = i;
        }
        kvn_pca_angles_free(&angles);
        Py_END_ALLOW_THREADS
    }
    free(pointers);
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    free(views);
    free(coders);
    Py_XDECREF(planes);
    Py_XDECREF(models);
    Py_XDECREF(targets);
    PyBuffer_Release(&tokens_buf);
    PyBuffer_Release(&rows_buf);
    PyBuffer_Release(&starts_buf);
    PyBuffer_Release(&index_buf);
    if (PyErr_Occurred()) return NULL;
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return Py_BuildValue("in", rc, failed_at);
}
