/* Python bindings of the ctxans coder (listed in _core.c's method table). A dictionary's
 * coder tables become a capsule once; encode and decode take it and release the GIL. */
#include "model_py.h"
#include "ctxans.h"

#define CAPSULE_NAME "kvtool.ctxans_model"

static void free_capsule(PyObject *capsule) {
    kvn_ctx_model_free(PyCapsule_GetPointer(capsule, CAPSULE_NAME));
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

/* The coder's functions with the model as model_py.h passes it. */
static int encode_chunk(const void *m, const kvn_block *b, const void *src, uint8_t *dst, size_t *written) {
    return kvn_ctx_encode(m, b, src, dst, written);
}

static int decode_chunk(const void *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst) {
    return kvn_ctx_decode(m, b, src, len, dst);
}

/* ctxans_encode(block, model, dtype, heads, tokens, dim) -> bytes; block is C-contiguous. */
PyObject *kvn_py_ctxans_encode(PyObject *self, PyObject *args) {
    return kvn_py_model_encode(args, CAPSULE_NAME, kvn_ctx_bound, encode_chunk);
}

/* ctxans_decode(chunk, out, model, dtype, heads, tokens, dim) -> status; out is a writable C-contiguous block. */
PyObject *kvn_py_ctxans_decode(PyObject *self, PyObject *args) {
    return kvn_py_model_decode(args, CAPSULE_NAME, decode_chunk);
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
