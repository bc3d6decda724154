/* Python bindings of the ctxtans coder (listed in _core.c's method table). A dictionary's tANS
 * tables become a capsule once; encode and decode take it and release the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ctxtans.h"

#define CAPSULE_NAME "kvtool.ctxtans_model"

static void free_capsule(PyObject *capsule) { kvn_tans_model_free(PyCapsule_GetPointer(capsule, CAPSULE_NAME)); }

/* The model a capsule holds, NULL (with an exception set) for anything else. */
const kvn_tans_model *kvn_py_tans_model_of(PyObject *capsule) { return PyCapsule_GetPointer(capsule, CAPSULE_NAME); }

/* ctxtans_model(g, start, symbol, nbits, base, encode, cost, class_cost, context_of, start_context, classes,
 * contexts, tag) -> capsule */
PyObject *kvn_py_ctxtans_model(PyObject *self, PyObject *args) {
    Py_buffer g, start, symbol, nbits, base, encode, cost, class_cost, context_of, tag;
    int start_context, classes, contexts;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*y*iiiy*", &g, &start, &symbol, &nbits, &base, &encode, &cost,
                          &class_cost, &context_of, &start_context, &classes, &contexts, &tag))
        return NULL;
    kvn_tans_model *m = NULL;
    int ok = classes >= 1 && classes <= KVN_TANS_MAX_CLASSES && contexts >= 1 && contexts <= KVN_TANS_MAX_CONTEXTS;
    if (ok) {
        size_t models = (size_t)classes * (size_t)contexts + 2, states = models * KVN_TANS_SIZE;
        ok = (size_t)g.len == models * KVN_TANS_SYMBOLS * 2 && (size_t)start.len == models * KVN_TANS_SYMBOLS * 2 &&
             (size_t)symbol.len == states && (size_t)nbits.len == states && (size_t)base.len == states * 2 &&
             (size_t)encode.len == states * 2 &&
             (size_t)cost.len == (size_t)contexts * KVN_TANS_SYMBOLS * (size_t)classes * 4 &&
             (size_t)class_cost.len == (size_t)classes * 4 && context_of.len == KVN_TANS_SYMBOLS && tag.len == 4;
    }
    if (ok)
        m = kvn_tans_model_new(classes, contexts, start_context, g.buf, start.buf, symbol.buf, nbits.buf, base.buf,
                               encode.buf, cost.buf, class_cost.buf, context_of.buf, tag.buf);
    Py_buffer *all[] = {&g, &start, &symbol, &nbits, &base, &encode, &cost, &class_cost, &context_of, &tag};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) PyBuffer_Release(all[i]);
    if (!m) {
        PyErr_SetString(PyExc_ValueError, "inconsistent ctxtans coder tables");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(m, CAPSULE_NAME, free_capsule);
    if (!capsule) kvn_tans_model_free(m);
    return capsule;
}

static int check_geometry(int dtype, Py_ssize_t heads, Py_ssize_t tokens, Py_ssize_t dim, Py_ssize_t buflen) {
    size_t w = kvn_itemsize(dtype);
    if (!w || heads < 0 || tokens < 0 || dim < 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code or geometry");
        return -1;
    }
    size_t n = (size_t)heads * (size_t)tokens * (size_t)dim;
    if (heads && tokens && dim && (n / (size_t)heads / (size_t)tokens != (size_t)dim || n * w / w != n)) {
        PyErr_SetString(PyExc_OverflowError, "block too large");
        return -1;
    }
    if ((size_t)buflen != n * w) {
        PyErr_SetString(PyExc_ValueError, "buffer size does not match dtype x shape");
        return -1;
    }
    return 0;
}

/* ctxtans_encode(block, model, dtype, heads, tokens, dim) -> bytes; block is C-contiguous. */
PyObject *kvn_py_ctxtans_encode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *capsule;
    int dtype;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*Oinnn", &buf, &capsule, &dtype, &heads, &tokens, &dim)) return NULL;
    const kvn_tans_model *m = kvn_py_tans_model_of(capsule);
    if (!m || check_geometry(dtype, heads, tokens, dim, buf.len)) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)kvn_tans_bound(&b));
    if (!out) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    size_t written = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvn_tans_encode(m, &b, buf.buf, (uint8_t *)PyBytes_AS_STRING(out), &written);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (rc) {
        Py_DECREF(out);
        if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
        PyErr_Format(PyExc_ValueError, "native core status %d", rc);
        return NULL;
    }
    if (_PyBytes_Resize(&out, (Py_ssize_t)written) < 0) return NULL;
    return out;
}

/* ctxtans_decode(chunk, out, model, dtype, heads, tokens, dim) -> status; out is a writable C-contiguous block. */
PyObject *kvn_py_ctxtans_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    PyObject *capsule;
    int dtype;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*w*Oinnn", &src, &dst, &capsule, &dtype, &heads, &tokens, &dim)) return NULL;
    const kvn_tans_model *m = kvn_py_tans_model_of(capsule);
    if (!m || check_geometry(dtype, heads, tokens, dim, dst.len)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvn_tans_decode(m, &b, src.buf, (size_t)src.len, dst.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}
