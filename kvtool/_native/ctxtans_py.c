/* Python bindings of the ctxtans coder (listed in _core.c's method table). A dictionary's tANS
 * tables become a capsule once; encode and decode take it and release the GIL. */
#include "model_py.h"
#include "ctxtans.h"

#define CAPSULE_NAME "kvtool.ctxtans_model"

static void free_capsule(PyObject *capsule) { kvn_tans_model_free(PyCapsule_GetPointer(capsule, CAPSULE_NAME)); }

/* The model a capsule holds, NULL (with an exception set) for anything else. */
const kvn_tans_model *kvn_py_tans_model_of(PyObject *capsule) { return PyCapsule_GetPointer(capsule, CAPSULE_NAME); }

/* ctxtans_model(g, start, symbol, nbits, base, cost, class_cost, context_of, start_context, classes, contexts,
 * tag) -> capsule. */
PyObject *kvn_py_ctxtans_model(PyObject *self, PyObject *args) {
    Py_buffer g, start, symbol, nbits, base, cost, class_cost, context_of, tag;
    int start_context, classes, contexts;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*iiiy*", &g, &start, &symbol, &nbits, &base, &cost, &class_cost,
                          &context_of, &start_context, &classes, &contexts, &tag))
        return NULL;
    kvn_tans_model *m = NULL;
    int ok = classes >= 1 && classes <= KVN_TANS_MAX_CLASSES && contexts >= 1 && contexts <= KVN_TANS_MAX_CONTEXTS;
    if (ok) {
        size_t models = (size_t)classes * (size_t)contexts + 2, states = models * KVN_TANS_SIZE;
        ok = (size_t)g.len == models * KVN_TANS_SYMBOLS * 2 && (size_t)start.len == models * KVN_TANS_SYMBOLS * 2 &&
             (size_t)symbol.len == states && (size_t)nbits.len == states && (size_t)base.len == states * 2 &&
             (size_t)cost.len == (size_t)contexts * KVN_TANS_SYMBOLS * (size_t)classes * 4 &&
             (size_t)class_cost.len == (size_t)classes * 4 && context_of.len == KVN_TANS_SYMBOLS && tag.len == 4;
    }
    if (ok)
        m = kvn_tans_model_new(classes, contexts, start_context, g.buf, start.buf, symbol.buf, nbits.buf, base.buf,
                               cost.buf, class_cost.buf, context_of.buf, tag.buf);
    Py_buffer *all[] = {&g, &start, &symbol, &nbits, &base, &cost, &class_cost, &context_of, &tag};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) PyBuffer_Release(all[i]);
    if (!m) {
        PyErr_SetString(PyExc_ValueError, "inconsistent ctxtans coder tables");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(m, CAPSULE_NAME, free_capsule);
    if (!capsule) kvn_tans_model_free(m);
    return capsule;
}

/* The coder's functions with the model as model_py.h passes it. */
static int encode_chunk(const void *m, const kvn_block *b, const void *src, uint8_t *dst, size_t *written) {
    return kvn_tans_encode(m, b, src, dst, written);
}

static int decode_chunk(const void *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst) {
    return kvn_tans_decode(m, b, src, len, dst);
}

/* ctxtans_encode(block, model, dtype, heads, tokens, dim) -> bytes; block is C-contiguous. */
PyObject *kvn_py_ctxtans_encode(PyObject *self, PyObject *args) {
    return kvn_py_model_encode(args, CAPSULE_NAME, kvn_tans_bound, encode_chunk);
}

/* ctxtans_decode(chunk, out, model, dtype, heads, tokens, dim) -> status; out is a writable C-contiguous block. */
PyObject *kvn_py_ctxtans_decode(PyObject *self, PyObject *args) {
    return kvn_py_model_decode(args, CAPSULE_NAME, decode_chunk);
}
