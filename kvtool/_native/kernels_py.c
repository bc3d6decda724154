/* Python bindings of what every kernel shares: the chunk checksum, and the vector level the kernels use. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kvn.h"

/* xxh3_64(data, piece=0): with piece > 0, hashed in pieces of that many bytes, as decoders hash what they write. */
PyObject *kvn_py_xxh3_64(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t piece = 0;
    if (!PyArg_ParseTuple(args, "y*|n", &buf, &piece)) return NULL;
    uint64_t h;
    const uint8_t *data = buf.buf;
    size_t len = (size_t)buf.len;
    Py_BEGIN_ALLOW_THREADS
    if (piece > 0) {
        kvn_xxh3_state st;
        kvn_xxh3_reset(&st);
        for (size_t at = 0; at < len; at += (size_t)piece)
            kvn_xxh3_update(&st, data + at, len - at < (size_t)piece ? len - at : (size_t)piece);
        h = kvn_xxh3_digest(&st);
    } else {
        h = kvn_xxh3_64(data, len);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLongLong(h);
}

/* isa(cap=-1) -> the vector level every kernel uses (0 scalar, 1 AVX2, 2 AVX-512), after capping it at `cap` when given. */
PyObject *kvn_py_isa(PyObject *self, PyObject *args) {
    int level = -1;
    if (!PyArg_ParseTuple(args, "|i", &level)) return NULL;
    if (level >= 0) kvn_isa_cap(level);
    return PyLong_FromLong(kvn_isa());
}
