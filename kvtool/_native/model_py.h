/* The Python glue the dictionary coders (ctxans, ctxtans) share: one chunk encoded or decoded with the
 * coder model a capsule holds, the block's geometry checked against its buffer, the GIL released while
 * the coder runs. Each coder passes its capsule name and its functions (model_py.c). */
#ifndef KVN_MODEL_PY_H
#define KVN_MODEL_PY_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kvn.h"

typedef size_t (*kvn_py_bound_fn)(const kvn_block *b);
typedef int (*kvn_py_encode_fn)(const void *model, const kvn_block *b, const void *src, uint8_t *dst, size_t *written);
typedef int (*kvn_py_decode_fn)(const void *model, const kvn_block *b, const uint8_t *src, size_t len, void *dst);

/* args (block, model, dtype, heads, tokens, dim) -> bytes; block is C-contiguous. */
PyObject *kvn_py_model_encode(PyObject *args, const char *capsule_name, kvn_py_bound_fn bound, kvn_py_encode_fn encode);
/* args (chunk, out, model, dtype, heads, tokens, dim) -> status; out is a writable C-contiguous block. */
PyObject *kvn_py_model_decode(PyObject *args, const char *capsule_name, kvn_py_decode_fn decode);

#endif
