/* Encode and decode bindings shared by the dictionary coders (model_py.h). */
#include "model_py.h"

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

PyObject *kvn_py_model_encode(PyObject *args, const char *capsule_name, kvn_py_bound_fn bound, kvn_py_encode_fn encode) {
    Py_buffer buf;
    PyObject *capsule;
    int dtype;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*Oinnn", &buf, &capsule, &dtype, &heads, &tokens, &dim)) return NULL;
    const void *m = PyCapsule_GetPointer(capsule, capsule_name);
    if (!m || check_geometry(dtype, heads, tokens, dim, buf.len)) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound(&b));
    if (!out) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    size_t written = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = encode(m, &b, buf.buf, (uint8_t *)PyBytes_AS_STRING(out), &written);
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

PyObject *kvn_py_model_decode(PyObject *args, const char *capsule_name, kvn_py_decode_fn decode) {
    Py_buffer src, dst;
    PyObject *capsule;
    int dtype;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*w*Oinnn", &src, &dst, &capsule, &dtype, &heads, &tokens, &dim)) return NULL;
    const void *m = PyCapsule_GetPointer(capsule, capsule_name);
    if (!m || check_geometry(dtype, heads, tokens, dim, dst.len)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = decode(m, &b, src.buf, (size_t)src.len, dst.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}
