/* The lossy int stage's restore on the batch path (kvtool/_native/int_batch.py): many blocks per call,
 * each from its two decompressed planes (codes, scales) straight into the destination's rows, raw
 * checksums verified, the GIL released throughout. The inverse is intquant.c's, byte for byte. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "kvn.h"

/* One block to restore: must match kvtool/_native/int_batch.py's INT_JOB_DTYPE. */
typedef struct {
    uint64_t codes_xxh3, scales_xxh3;  /* the planes' raw checksums */
    /* listed rows: its heads * block_tokens row offsets start here in `rows`; INT_STRIDED: the byte offset of
     * row (0, 0) in the target, row (h, t) lying head_stride * h + t * row bytes further, for t in token_lo..token_hi */
    int64_t row_start;
    int64_t head_stride;
    uint32_t token_lo, token_hi;
    uint32_t out_index;                /* the target its rows go to */
    uint32_t block_tokens;
    uint32_t groups_per_head;          /* (scale, min) pairs per head in its scales plane */
    uint8_t bits, channel_axis, flags, reserved;
} int_job;

#define INT_VERIFY_CODES 1u   /* check the codes plane's raw checksum (it was decompressed) */
#define INT_VERIFY_SCALES 2u
#define INT_STRIDED 4u        /* rows at strides (a [heads, tokens, dim] tensor), not listed */
#define INT_FLAGS 7u

/* A strided job's rows: the first and the last must lie inside the target (strides are >= 0), so all do. */
static int strided_rows(const int_job *j, const Py_buffer *t, size_t heads, size_t row_bytes, uint8_t **rows) {
    int64_t rb = (int64_t)row_bytes, first, last, span;
    if (j->token_lo > j->token_hi || j->token_hi > j->block_tokens || j->head_stride < 0) return KVN_ERR_ARG;
    if (j->token_lo < j->token_hi && heads) {
        if (__builtin_mul_overflow((int64_t)j->token_lo, rb, &first) || __builtin_add_overflow(first, j->row_start, &first) ||
            __builtin_mul_overflow((int64_t)(heads - 1), j->head_stride, &span) ||
            __builtin_mul_overflow((int64_t)j->token_hi, rb, &last) || __builtin_add_overflow(last, span, &last) ||
            __builtin_add_overflow(last, j->row_start, &last) || first < 0 || last > (int64_t)t->len)
            return KVN_ERR_ARG;
    }
    for (size_t h = 0; h < heads; h++)
        for (size_t k = 0; k < j->block_tokens; k++)
            rows[h * j->block_tokens + k] = k >= j->token_lo && k < j->token_hi
                ? (uint8_t *)t->buf + (j->row_start + (int64_t)h * j->head_stride + (int64_t)k * rb) : NULL;
    return KVN_OK;
}

/* Checks one job against its planes and targets and points its rows into the target; a status. */
static int int_job_rows(const int_job *j, const Py_buffer *codes, const Py_buffer *scales, const Py_buffer *t,
                        const int64_t *offsets, size_t nrows, size_t heads, size_t row_bytes, uint8_t **rows) {
    size_t n = heads * j->block_tokens;
    if ((uint64_t)scales->len / 4 < (uint64_t)heads * j->groups_per_head || (j->flags & ~INT_FLAGS)) return KVN_ERR_ARG;
    if (j->flags & INT_STRIDED) {
        int rc = strided_rows(j, t, heads, row_bytes, rows);
        if (rc) return rc;
    } else {
        if (j->row_start < 0 || (uint64_t)j->row_start > nrows || n > nrows - (size_t)j->row_start) return KVN_ERR_ARG;
        for (size_t r = 0; r < n; r++) {  /* every row inside its target before anything is written */
            int64_t at = offsets[j->row_start + (int64_t)r];
            if (at >= 0 && ((uint64_t)at > (uint64_t)t->len || row_bytes > (size_t)t->len - (size_t)at)) return KVN_ERR_ARG;
            rows[r] = at >= 0 ? (uint8_t *)t->buf + at : NULL;
        }
    }
    if ((j->flags & INT_VERIFY_CODES) && kvn_xxh3_64(codes->buf, (size_t)codes->len) != j->codes_xxh3)
        return KVN_ERR_CHECKSUM;
    if ((j->flags & INT_VERIFY_SCALES) && kvn_xxh3_64(scales->buf, (size_t)scales->len) != j->scales_xxh3)
        return KVN_ERR_CHECKSUM;
    return KVN_OK;
}

/* int_decode_blocks(planes, jobs, rows, targets, dtype, heads, dim, group) -> (status, failed job or -1)
 * Job i restores the block whose codes and scales planes are planes[2i] and planes[2i + 1]; its row
 * (head h, token t) goes to byte offset rows[row_start + h * block_tokens + t] of targets[out_index],
 * or nowhere where that offset is negative (INT_STRIDED: to row_start + h * head_stride + t * row
 * bytes, for t in token_lo..token_hi). STATUS_DECLINED: a block with non-finite scales, which
 * only the numpy reference restores. */
PyObject *kvn_py_int_decode_blocks(PyObject *self, PyObject *args) {
    PyObject *planes, *targets;
    Py_buffer jobs_buf, rows_buf;
    int dtype;
    Py_ssize_t heads, dim, group;
    if (!PyArg_ParseTuple(args, "O!y*y*O!innn", &PyList_Type, &planes, &jobs_buf, &rows_buf, &PyList_Type, &targets,
                          &dtype, &heads, &dim, &group))
        return NULL;
    size_t njobs = (size_t)jobs_buf.len / sizeof(int_job), nrows = (size_t)rows_buf.len / sizeof(int64_t);
    Py_ssize_t nplanes = PyList_GET_SIZE(planes), ntargets = PyList_GET_SIZE(targets), got_p = 0, got_t = 0;
    Py_buffer *pb = calloc((size_t)nplanes + 1, sizeof(Py_buffer)), *tb = calloc((size_t)ntargets + 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    int ok = pb && tb && (dtype == KVN_BF16 || dtype == KVN_FP16 || dtype == KVN_FP32) && heads >= 0 && dim > 0 &&
             group > 0 && jobs_buf.len % sizeof(int_job) == 0 && rows_buf.len % sizeof(int64_t) == 0 &&
             (size_t)nplanes == 2 * njobs;
    for (; ok && got_p < nplanes; got_p++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(planes, got_p), &pb[got_p], PyBUF_SIMPLE) < 0) ok = 0;
    for (; ok && got_t < ntargets; got_t++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(targets, got_t), &tb[got_t], PyBUF_WRITABLE) < 0) ok = 0;
    if (!ok) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad geometry, jobs, planes, rows or targets");
        goto release;
    }
    const int_job *jobs = jobs_buf.buf;
    const int64_t *offsets = rows_buf.buf;
    size_t row_bytes = (size_t)dim * (dtype == KVN_FP32 ? 4 : 2);
    uint8_t **rows = NULL;
    size_t rows_size = 0;
    int rc = KVN_OK;
    Py_ssize_t failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < njobs; i++) {
        const int_job *j = &jobs[i];
        size_t n = (size_t)heads * j->block_tokens;
        if (n > rows_size) {
            free(rows);
            rows = malloc(n * sizeof(uint8_t *));
            rows_size = rows ? n : 0;
        }
        if (!rows && n) rc = KVN_ERR_NOMEM;
        else if (j->out_index >= (uint64_t)ntargets) rc = KVN_ERR_ARG;
        else rc = int_job_rows(j, &pb[2 * i], &pb[2 * i + 1], &tb[j->out_index], offsets, nrows, (size_t)heads,
                               row_bytes, rows);
        if (!rc) {
            kvn_int_block b = {dtype, (size_t)heads, j->block_tokens, (size_t)dim, j->bits, j->channel_axis,
                               (size_t)group, j->groups_per_head};
            rc = kvn_int_dequant_rows(&b, pb[2 * i].buf, (size_t)pb[2 * i].len, pb[2 * i + 1].buf, rows);
        }
        if (rc) { failed = (Py_ssize_t)i; break; }
    }
    Py_END_ALLOW_THREADS
    free(rows);
    result = rc == KVN_ERR_NOMEM ? PyErr_NoMemory() : Py_BuildValue("(in)", rc, failed);
release:
    for (Py_ssize_t k = 0; k < got_p; k++) PyBuffer_Release(&pb[k]);
    for (Py_ssize_t k = 0; k < got_t; k++) PyBuffer_Release(&tb[k]);
    free(pb);
    free(tb);
    PyBuffer_Release(&jobs_buf);
    PyBuffer_Release(&rows_buf);
    return result;
}

/* error_stats(exact, approx, dtype) -> (max |approx - exact|, sum of squared errors, sum of squared values),
 * or None for a dtype it does not take; both buffers hold the same number of C-ordered values. */
PyObject *kvn_py_error_stats(PyObject *self, PyObject *args) {
    Py_buffer exact, approx;
    int dtype;
    if (!PyArg_ParseTuple(args, "y*y*i", &exact, &approx, &dtype)) return NULL;
    size_t w = dtype == KVN_FP32 ? 4 : 2;
    double out[3];
    int rc = KVN_ERR_ARG;
    if (exact.len == approx.len && exact.len % (Py_ssize_t)w == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = kvn_error_stats(dtype, exact.buf, approx.buf, (size_t)exact.len / w, out);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&exact);
    PyBuffer_Release(&approx);
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    if (rc) Py_RETURN_NONE;
    return Py_BuildValue("(ddd)", out[0], out[1], out[2]);
}

int kvn_py_intquant_add_constants(PyObject *module) {
    return PyModule_AddIntConstant(module, "INT_JOB_SIZE", (long)sizeof(int_job)) < 0 ||
                   PyModule_AddIntConstant(module, "STATUS_DECLINED", KVN_ERR_DECLINED) < 0
               ? -1
               : 0;
}
