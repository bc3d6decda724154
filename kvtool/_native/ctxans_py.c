/* Python bindings of the ctxans coder (listed in _core.c's method table). A dictionary's
 * coder tables become a capsule once; encode and decode take it and release the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ctxans.h"

#define CAPSULE_NAME "kvtool.ctxans_model"

static void free_capsule(PyObject *capsule) {
    kvn_ctx_model_free(PyCapsule_GetPointer(capsule, CAPSULE_NAME));
}

static kvn_ctx_model *model_of(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, CAPSULE_NAME);
}

/* ctxans_model(freq, cum, cost, class_cost, context_of, start, classes, contexts, tag) -> capsule */
PyObject *kvn_py_ctxans_model(PyObject *self, PyObject *args) {
    Py_buffer freq, cum, cost, class_cost, context_of, tag;
    int start, classes, contexts;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*iiiy*", &freq, &cum, &cost, &class_cost, &context_of, &start, &classes,
                          &contexts, &tag))
        return NULL;
    kvn_ctx_model *m = NULL;
    int sizes_ok = classes >= 1 && classes <= KVN_CTX_MAX_CLASSES && contexts >= 1 && contexts <= KVN_CTX_MAX_CONTEXTS;
    if (sizes_ok) {
        size_t models = (size_t)classes * (size_t)contexts + 2;
        sizes_ok = (size_t)freq.len == models * KVN_CTX_SYMBOLS * 2 && (size_t)cum.len == models * KVN_CTX_SYMBOLS * 2 &&
                   (size_t)cost.len == (size_t)contexts * KVN_CTX_SYMBOLS * (size_t)classes * 4 &&
                   (size_t)class_cost.len == (size_t)classes * 4 && context_of.len == KVN_CTX_SYMBOLS && tag.len == 4;
    }
    if (sizes_ok)
        m = kvn_ctx_model_new(classes, contexts, start, freq.buf, cum.buf, cost.buf, class_cost.buf, context_of.buf,
                              tag.buf);
    PyBuffer_Release(&freq);
    PyBuffer_Release(&cum);
    PyBuffer_Release(&cost);
    PyBuffer_Release(&class_cost);
    PyBuffer_Release(&context_of);
    PyBuffer_Release(&tag);
    if (!m) {
        PyErr_SetString(PyExc_ValueError, "inconsistent ctxans coder tables");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(m, CAPSULE_NAME, free_capsule);
    if (!capsule) kvn_ctx_model_free(m);
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

/* ctxans_encode(block, model, dtype, heads, tokens, dim) -> bytes; block is C-contiguous. */
PyObject *kvn_py_ctxans_encode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *capsule;
    int dtype;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*Oinnn", &buf, &capsule, &dtype, &heads, &tokens, &dim)) return NULL;
    kvn_ctx_model *m = model_of(capsule);
    if (!m || check_geometry(dtype, heads, tokens, dim, buf.len)) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)kvn_ctx_bound(&b));
    if (!out) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    size_t written = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvn_ctx_encode(m, &b, buf.buf, (uint8_t *)PyBytes_AS_STRING(out), &written);
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

/* ctxans_decode(chunk, out, model, dtype, heads, tokens, dim) -> status; out is a writable C-contiguous block. */
PyObject *kvn_py_ctxans_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    PyObject *capsule;
    int dtype;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*w*Oinnn", &src, &dst, &capsule, &dtype, &heads, &tokens, &dim)) return NULL;
    kvn_ctx_model *m = model_of(capsule);
    if (!m || check_geometry(dtype, heads, tokens, dim, dst.len)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvn_ctx_decode(m, &b, src.buf, (size_t)src.len, dst.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

/* The format's constants as the core was built with them, as the module's CTXANS_CONSTANTS dict;
 * kvtool._native refuses a core whose constants differ from Python's. 0 on success, -1 with an error set. */
int kvn_py_ctxans_add_constants(PyObject *module) {
    const struct { const char *name; long value; } constants[] = {
        {"VERSION", KVN_CTX_VERSION},         {"FLAG_REPEATS", KVN_CTX_FLAG_REPEATS},
        {"HEAD_SIZE", KVN_CTX_HEAD_SIZE},     {"STATES", KVN_CTX_STATES},
        {"PROB_BITS", KVN_CTX_PROB_BITS},     {"RANS_LOW", KVN_CTX_RANS_LOW},
        {"SYMBOLS", KVN_CTX_SYMBOLS},         {"LEVELS", KVN_CTX_LEVELS},
        {"LOW", KVN_CTX_LOW},                 {"REF_SYMBOLS", KVN_CTX_REF_SYMBOLS},
        {"MAX_CLASSES", KVN_CTX_MAX_CLASSES}, {"MAX_CONTEXTS", KVN_CTX_MAX_CONTEXTS},
        {"MAX_TOKENS", (long)KVN_CTX_MAX_TOKENS},
    };
    PyObject *dict = PyDict_New();
    if (!dict) return -1;
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        PyObject *value = PyLong_FromLong(constants[i].value);
        if (!value || PyDict_SetItemString(dict, constants[i].name, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(dict);
            return -1;
        }
        Py_DECREF(value);
    }
    if (PyModule_AddObject(module, "CTXANS_CONSTANTS", dict) < 0) {
        Py_DECREF(dict);
        return -1;
    }
    return 0;
}
