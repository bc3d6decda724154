/* Python bindings of kvtool's native core. Every entry point releases the GIL
 * around its loops; buffers stay pinned by their Py_buffer meanwhile. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "kvn.h"
#include "ctxtans.h"

/* One chunk to decode: must match kvtool/_native/__init__.py's JOB_DTYPE. */
typedef struct {
    uint64_t offset;      /* in the source buffer */
    uint64_t stored_len;
    uint64_t stored_xxh3;
    uint64_t raw_xxh3;    /* of the decoded block's bytes in C order */
    uint32_t out_index;   /* which [heads, tokens, dim] tensor of the output */
    uint32_t flags;       /* JOB_STORED_RAW: the block's bytes as they are */
    uint32_t block_tokens;
    uint32_t reserved;
    int64_t block_start;  /* output token of the block's first token; may be negative */
} job;

#define JOB_STORED_RAW 1u

/* Per encoded block: must match BLOCK_META_DTYPE. */
typedef struct {
    uint64_t stored_len, raw_len, stored_xxh3, raw_xxh3, flags;
} block_meta;

/* The array codec of a batch: exphuff, or ctxtans with a dictionary's tables (a capsule of ctxtans_py.c). */
const kvn_tans_model *kvn_py_tans_model_of(PyObject *capsule);

/* The ctxtans model `obj` names (NULL for None: exphuff); -1 with an exception for anything else. */
static int batch_model(PyObject *obj, const kvn_tans_model **model) {
    *model = obj && obj != Py_None ? kvn_py_tans_model_of(obj) : NULL;
    return obj && obj != Py_None && !*model ? -1 : 0;
}

static size_t coder_bound(const kvn_tans_model *m, const kvn_block *b) {
    return m ? kvn_tans_bound(b) : kvn_exphuff_bound(b);
}

static int coder_encode(const kvn_tans_model *m, const kvn_block *b, const void *src, uint8_t *dst, size_t *written,
                        unsigned lane) {
    return m ? kvn_tans_encode(m, b, src, dst, written) : kvn_exphuff_encode(b, src, dst, written, lane);
}

static int coder_decode(const kvn_tans_model *m, const kvn_block *b, const uint8_t *src, size_t len, void *dst) {
    return m ? kvn_tans_decode(m, b, src, len, dst) : kvn_exphuff_decode(b, src, len, dst);
}

static PyObject *error_status(int status) {
    PyErr_Format(PyExc_ValueError, "native core status %d", status);
    return NULL;
}

static int parse_geometry(int dtype, Py_ssize_t heads, Py_ssize_t tokens, Py_ssize_t dim, Py_ssize_t buflen,
                          size_t *elems) {
    if (kvn_itemsize(dtype) == 0 || heads < 0 || tokens < 0 || dim < 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code or geometry");
        return -1;
    }
    size_t n = (size_t)heads * (size_t)tokens * (size_t)dim;
    if (heads && tokens && dim && (n / (size_t)heads / (size_t)tokens != (size_t)dim || n * kvn_itemsize(dtype) / kvn_itemsize(dtype) != n)) {
        PyErr_SetString(PyExc_OverflowError, "block too large");
        return -1;
    }
    if ((size_t)buflen != n * kvn_itemsize(dtype)) {
        PyErr_SetString(PyExc_ValueError, "buffer size does not match dtype x shape");
        return -1;
    }
    *elems = n;
    return 0;
}

/* exphuff_encode(block, dtype, heads, tokens, dim, lane=0) -> bytes; block is C-contiguous [heads, tokens, dim];
 * lane > 0: exphuff-lanes (chunk version 2) with that many symbols per lane. */
static PyObject *py_exphuff_encode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int dtype;
    unsigned lane = 0;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*innn|I", &buf, &dtype, &heads, &tokens, &dim, &lane)) return NULL;
    size_t n;
    if (parse_geometry(dtype, heads, tokens, dim, buf.len, &n)) { PyBuffer_Release(&buf); return NULL; }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)kvn_exphuff_bound(&b));
    if (!out) { PyBuffer_Release(&buf); return NULL; }
    size_t written = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvn_exphuff_encode(&b, buf.buf, (uint8_t *)PyBytes_AS_STRING(out), &written, lane);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (rc) { Py_DECREF(out); return rc == KVN_ERR_NOMEM ? PyErr_NoMemory() : error_status(rc); }
    if (_PyBytes_Resize(&out, (Py_ssize_t)written) < 0) return NULL;
    return out;
}

/* exphuff_decode(chunk, out, dtype, heads, tokens, dim) -> status; out is a writable C-contiguous block. */
static PyObject *py_exphuff_decode(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    int dtype;
    Py_ssize_t heads, tokens, dim;
    if (!PyArg_ParseTuple(args, "y*w*innn", &src, &dst, &dtype, &heads, &tokens, &dim)) return NULL;
    size_t n;
    if (parse_geometry(dtype, heads, tokens, dim, dst.len, &n)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    kvn_block b = {dtype, (size_t)heads, (size_t)tokens, (size_t)dim, (size_t)tokens * (size_t)dim};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kvn_exphuff_decode(&b, src.buf, (size_t)src.len, dst.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

/* The shared tail of int_quant and int_dequant: the block's geometry, checked against the
 * float buffer (the input or the output) and the scales plane. */
static int int_block(kvn_int_block *b, Py_buffer *floats, Py_buffer *scales, int dtype, Py_ssize_t heads,
                     Py_ssize_t tokens, Py_ssize_t dim, int bits, int channel_axis, Py_ssize_t group,
                     Py_ssize_t groups_per_head) {
    size_t n;
    if (parse_geometry(dtype, heads, tokens, dim, floats->len, &n)) return -1;
    if (group < 1 || groups_per_head < 0 ||
        (heads && (size_t)groups_per_head > (size_t)scales->len / 4 / (size_t)heads)) {
        PyErr_SetString(PyExc_ValueError, "bad group or scales plane size");
        return -1;
    }
    *b = (kvn_int_block){dtype, (size_t)heads, (size_t)tokens, (size_t)dim, bits, channel_axis, (size_t)group,
                         (size_t)groups_per_head};
    return 0;
}

#define INT_ARGS "innnipnn"
#define INT_ARG_PTRS &dtype, &heads, &tokens, &dim, &bits, &channel_axis, &group, &groups_per_head
#define INT_ARG_VALS dtype, heads, tokens, dim, bits, channel_axis, group, groups_per_head

/* The shared end of int_quant and int_dequant: release the three buffers, the status as Python sees it. */
static PyObject *int_status(int rc, Py_buffer *a, Py_buffer *b, Py_buffer *c) {
    PyBuffer_Release(a);
    PyBuffer_Release(b);
    PyBuffer_Release(c);
    if (rc < 0) return NULL;  /* int_block raised */
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

/* int_quant(block, codes, scales, dtype, heads, tokens, dim, bits, channel_axis, group, groups_per_head) -> status */
static PyObject *py_int_quant(PyObject *self, PyObject *args) {
    Py_buffer block, codes, scales;
    int dtype, bits, channel_axis, rc = -1;
    Py_ssize_t heads, tokens, dim, group, groups_per_head;
    if (!PyArg_ParseTuple(args, "y*w*w*" INT_ARGS, &block, &codes, &scales, INT_ARG_PTRS)) return NULL;
    kvn_int_block b;
    if (int_block(&b, &block, &scales, INT_ARG_VALS) == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = kvn_int_quant(&b, block.buf, codes.buf, (size_t)codes.len, scales.buf);
        Py_END_ALLOW_THREADS
    }
    return int_status(rc, &block, &codes, &scales);
}

/* int_dequant(codes, scales, out, dtype, heads, tokens, dim, bits, channel_axis, group, groups_per_head) -> status */
static PyObject *py_int_dequant(PyObject *self, PyObject *args) {
    Py_buffer codes, scales, out;
    int dtype, bits, channel_axis, rc = -1;
    Py_ssize_t heads, tokens, dim, group, groups_per_head;
    if (!PyArg_ParseTuple(args, "y*y*w*" INT_ARGS, &codes, &scales, &out, INT_ARG_PTRS)) return NULL;
    kvn_int_block b;
    if (int_block(&b, &out, &scales, INT_ARG_VALS) == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = kvn_int_dequant(&b, codes.buf, (size_t)codes.len, scales.buf, out.buf);
        Py_END_ALLOW_THREADS
    }
    return int_status(rc, &codes, &scales, &out);
}

/* Copy tokens [t0, t1) of every head between two [heads, *, dim] layouts. */
static void copy_tokens(uint8_t *dst, size_t dst_head, const uint8_t *src, size_t src_head, size_t heads,
                        size_t row_bytes, size_t count) {
    for (size_t h = 0; h < heads; h++) memcpy(dst + h * dst_head, src + h * src_head, count * row_bytes);
}

/* encode_blocks(tensor, dtype, heads, tokens, dim, chunk_tokens, coded[, model[, lane]]) -> (blob, meta)
 * Cuts a C-contiguous tensor [heads, tokens, dim] into blocks of chunk_tokens tokens; each is
 * coded when `coded` and that is smaller, else stored as its C-order bytes: exphuff (exphuff-lanes
 * when `lane`), or ctxtans when `model` is a ctxtans model. */
static PyObject *py_encode_blocks(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int dtype, coded;
    unsigned lane = 0;
    Py_ssize_t heads, tokens, dim, chunk;
    PyObject *model_obj = NULL;
    const kvn_tans_model *model;
    if (!PyArg_ParseTuple(args, "y*innnnp|OI", &buf, &dtype, &heads, &tokens, &dim, &chunk, &coded, &model_obj, &lane))
        return NULL;
    size_t n;
    if (batch_model(model_obj, &model) || parse_geometry(dtype, heads, tokens, dim, buf.len, &n) || chunk < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "chunk tokens must be >= 1");
        PyBuffer_Release(&buf);
        return NULL;
    }
    size_t w = kvn_itemsize(dtype), row = (size_t)dim * w;
    size_t nblocks = ((size_t)tokens + (size_t)chunk - 1) / (size_t)chunk, total = 0, scratch_size = 0;
    for (size_t k = 0; k < nblocks; k++) {
        size_t tb = (size_t)tokens - k * (size_t)chunk < (size_t)chunk ? (size_t)tokens - k * (size_t)chunk : (size_t)chunk;
        kvn_block b = {dtype, (size_t)heads, tb, (size_t)dim, tb * (size_t)dim};
        size_t raw = (size_t)heads * tb * row, bound = coded ? coder_bound(model, &b) : 0;
        total += bound > raw ? bound : raw;
        if (raw > scratch_size) scratch_size = raw;
    }
    PyObject *blob = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    PyObject *meta = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nblocks * sizeof(block_meta)));
    uint8_t *scratch = malloc(scratch_size ? scratch_size : 1);
    if (!blob || !meta || !scratch) {
        Py_XDECREF(blob);
        Py_XDECREF(meta);
        free(scratch);
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(blob);
    block_meta *m = (block_meta *)PyBytes_AS_STRING(meta);
    int rc = KVN_OK;
    size_t pos = 0;
    Py_BEGIN_ALLOW_THREADS
    for (size_t k = 0; k < nblocks && rc == KVN_OK; k++) {
        size_t t0 = k * (size_t)chunk, tb = (size_t)tokens - t0 < (size_t)chunk ? (size_t)tokens - t0 : (size_t)chunk;
        size_t raw_len = (size_t)heads * tb * row;
        const uint8_t *block = (const uint8_t *)buf.buf + t0 * row;
        if (heads > 1 && tb != (size_t)tokens) {  /* gather the block's heads: its bytes in C order */
            copy_tokens(scratch, tb * row, block, (size_t)tokens * row, (size_t)heads, row, tb);
            block = scratch;
        }
        uint64_t raw_hash = kvn_xxh3_64(block, raw_len);
        size_t written = raw_len;
        if (coded) {
            kvn_block b = {dtype, (size_t)heads, tb, (size_t)dim, tb * (size_t)dim};
            rc = coder_encode(model, &b, block, out + pos, &written, lane);
        }
        if (rc) break;
        if (!coded || written >= raw_len) {
            memcpy(out + pos, block, raw_len);
            m[k] = (block_meta){raw_len, raw_len, raw_hash, raw_hash, JOB_STORED_RAW};
        } else {
            m[k] = (block_meta){written, raw_len, kvn_xxh3_64(out + pos, written), raw_hash, 0};
        }
        pos += m[k].stored_len;
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    PyBuffer_Release(&buf);
    if (rc) {
        Py_DECREF(blob);
        Py_DECREF(meta);
        return rc == KVN_ERR_NOMEM ? PyErr_NoMemory() : error_status(rc);
    }
    if (_PyBytes_Resize(&blob, (Py_ssize_t)pos) < 0) { Py_DECREF(meta); return NULL; }
    return Py_BuildValue("(NN)", blob, meta);
}

/* *buf with room for `need` bytes (grown as needed, kept across jobs), or NULL. */
static void *room_for(void **buf, size_t *size, size_t need) {
    if (need > *size || !*buf) {
        need = need ? need : 1;
        free(*buf);
        *buf = malloc(need);
        *size = *buf ? need : 0;
    }
    return *buf;
}

/* A job's buffers, reused from block to block: the row pointers, and the block-sized scratch a ctxtans block decodes into. */
typedef struct {
    void *rows, *scratch;
    size_t rows_size, scratch_size;
} job_room;

/* Decodes a block of `tb` tokens (exphuff, or ctxtans with `model`), row (h, t) to rows[h * tb + t] (NULL: nowhere),
 * checking its raw checksum when verifying. exphuff writes each row in place and hashes the rows while they are in
 * cache (a mismatch leaves garbage there, reported as a checksum error); ctxtans decodes into the scratch, checked
 * there before its rows are copied out. */
static int decode_block_rows(const kvn_tans_model *model, const job *j, const uint8_t *chunk, int dtype, size_t heads,
                             size_t dim, size_t raw_len, int verify, uint8_t *const *rows, job_room *room) {
    kvn_block b = {dtype, heads, j->block_tokens, dim, (size_t)j->block_tokens * dim};
    if (!model) {
        uint64_t hash = 0;
        int rc = kvn_exphuff_decode_rows(&b, chunk, j->stored_len, rows, verify ? &hash : NULL);
        return !rc && verify && hash != j->raw_xxh3 ? KVN_ERR_CHECKSUM : rc;
    }
    uint8_t *scratch = room_for(&room->scratch, &room->scratch_size, raw_len);
    if (!scratch) return KVN_ERR_NOMEM;
    int rc = coder_decode(model, &b, chunk, j->stored_len, scratch);
    if (!rc && verify && kvn_xxh3_64(scratch, raw_len) != j->raw_xxh3) rc = KVN_ERR_CHECKSUM;
    size_t nr = heads * j->block_tokens, row = nr ? raw_len / nr : 0;
    for (size_t r = 0; !rc && r < nr; r++)
        if (rows[r]) memcpy(rows[r], scratch + r * row, row);
    return rc;
}

/* decode_blocks(src, jobs, out, dtype, heads, tokens, dim, verify[, model]) -> (status, failed job or -1)
 * `out` holds C-contiguous tensors [heads, tokens, dim] back to back; each job decodes one block
 * into tensor out_index at token block_start, clipped to the tensor's tokens. */
static PyObject *py_decode_blocks(PyObject *self, PyObject *args) {
    Py_buffer src, jobs_buf, dst;
    int dtype, verify;
    Py_ssize_t heads, tokens, dim;
    PyObject *model_obj = NULL;
    const kvn_tans_model *model;
    if (!PyArg_ParseTuple(args, "y*y*w*innnp|O", &src, &jobs_buf, &dst, &dtype, &heads, &tokens, &dim, &verify,
                          &model_obj))
        return NULL;
    size_t w = kvn_itemsize(dtype), row = (size_t)dim * w, tensor = (size_t)heads * (size_t)tokens * row;
    if (batch_model(model_obj, &model) || !w || heads < 0 || tokens < 0 || dim < 0 || jobs_buf.len % sizeof(job) ||
        (tensor && dst.len % tensor)) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&jobs_buf);
        PyBuffer_Release(&dst);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad geometry, job array or output size");
        return NULL;
    }
    size_t njobs = (size_t)jobs_buf.len / sizeof(job), ntensors = tensor ? (size_t)dst.len / tensor : 0;
    const job *jobs = jobs_buf.buf;
    const uint8_t *base = src.buf;
    uint8_t *out = dst.buf;
    job_room room = {0};
    int rc = KVN_OK;
    Py_ssize_t failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < njobs; i++) {
        const job *j = &jobs[i];
        size_t tb = j->block_tokens, raw_len;
        if (__builtin_mul_overflow((size_t)heads * row, tb, &raw_len) || j->out_index >= ntensors || j->offset > (uint64_t)src.len || j->stored_len > (uint64_t)src.len - j->offset ||
            j->block_start >= (int64_t)tokens || j->block_start + (int64_t)tb <= 0 || (j->flags & ~JOB_STORED_RAW)) {
            rc = KVN_ERR_ARG;
        } else if (verify && kvn_xxh3_64(base + j->offset, j->stored_len) != j->stored_xxh3) {
            rc = KVN_ERR_CHECKSUM;
        } else if ((j->flags & JOB_STORED_RAW) && j->stored_len != raw_len) {
            rc = KVN_ERR_CORRUPT;
        }
        if (rc) { failed = (Py_ssize_t)i; break; }
        int64_t lo = j->block_start < 0 ? 0 : j->block_start;
        int64_t hi = j->block_start + (int64_t)tb > (int64_t)tokens ? (int64_t)tokens : j->block_start + (int64_t)tb;
        uint8_t *target = out + j->out_index * tensor + (size_t)lo * row;
        const uint8_t *chunk = base + j->offset;
        if (j->flags & JOB_STORED_RAW) {
            copy_tokens(target, (size_t)tokens * row, chunk + (size_t)(lo - j->block_start) * row, tb * row,
                        (size_t)heads, row, (size_t)(hi - lo));
            continue;
        }
        uint8_t **at = room_for(&room.rows, &room.rows_size, (size_t)heads * tb * sizeof(uint8_t *));
        for (size_t h = 0; at && h < (size_t)heads; h++)  /* the block's tokens outside the tensor: nowhere */
            for (size_t t = 0; t < tb; t++) {
                int64_t token = j->block_start + (int64_t)t;
                at[h * tb + t] = token >= lo && token < hi ? target + (h * (size_t)tokens + (size_t)(token - lo)) * row : NULL;
            }
        rc = at ? decode_block_rows(model, j, chunk, dtype, (size_t)heads, (size_t)dim, raw_len, verify, at, &room)
                : KVN_ERR_NOMEM;
        if (rc) { failed = (Py_ssize_t)i; break; }
    }
    Py_END_ALLOW_THREADS
    free(room.rows);
    free(room.scratch);
    PyBuffer_Release(&src);
    PyBuffer_Release(&jobs_buf);
    PyBuffer_Release(&dst);
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return Py_BuildValue("(in)", rc, failed);
}

/* decode_rows(src, jobs, row_starts, rows, targets, dtype, heads, dim, verify[, model]) -> (status, failed job or -1)
 * Decodes each job's block (block_tokens tokens) and writes its row (head h, token t) to byte
 * offset rows[row_starts[i] + h * block_tokens + t] of targets[out_index], or nowhere when that
 * offset is negative: any destination whose token rows are contiguous, such as an engine's
 * paged KV blocks. */
static PyObject *py_decode_rows(PyObject *self, PyObject *args) {
    Py_buffer src, jobs_buf, starts_buf, rows_buf;
    PyObject *targets;
    int dtype, verify;
    Py_ssize_t heads, dim;
    PyObject *model_obj = NULL;
    const kvn_tans_model *model;
    if (!PyArg_ParseTuple(args, "y*y*y*y*O!innp|O", &src, &jobs_buf, &starts_buf, &rows_buf, &PyList_Type, &targets,
                          &dtype, &heads, &dim, &verify, &model_obj))
        return NULL;
    Py_ssize_t ntargets = PyList_GET_SIZE(targets);
    Py_buffer *dst = calloc((size_t)(ntargets ? ntargets : 1), sizeof(Py_buffer));
    Py_ssize_t got = 0;
    size_t w = kvn_itemsize(dtype), row = (size_t)dim * w;
    size_t njobs = (size_t)jobs_buf.len / sizeof(job), nrows = (size_t)rows_buf.len / sizeof(int64_t);
    int ok = batch_model(model_obj, &model) == 0 && dst && w && heads >= 0 && dim >= 0 && jobs_buf.len % sizeof(job) == 0 && rows_buf.len % sizeof(int64_t) == 0 &&
             (size_t)starts_buf.len == njobs * sizeof(int64_t);
    for (; ok && got < ntargets; got++)
        if (PyObject_GetBuffer(PyList_GET_ITEM(targets, got), &dst[got], PyBUF_WRITABLE) < 0) ok = 0;
    PyObject *result = NULL;
    if (!ok) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad geometry, jobs, rows or targets");
        goto release;
    }
    const job *jobs = jobs_buf.buf;
    const int64_t *starts = starts_buf.buf, *rows = rows_buf.buf;
    const uint8_t *base = src.buf;
    job_room room = {0};
    int rc = KVN_OK;
    Py_ssize_t failed = -1;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < njobs && rc == KVN_OK; i++) {
        const job *j = &jobs[i];
        size_t tb = j->block_tokens, raw_len, nr = (size_t)heads * tb;
        if (__builtin_mul_overflow((size_t)heads * row, tb, &raw_len) || j->out_index >= (uint64_t)ntargets ||
            j->offset > (uint64_t)src.len || j->stored_len > (uint64_t)src.len - j->offset || starts[i] < 0 ||
            (uint64_t)starts[i] > nrows || nr > nrows - (size_t)starts[i] || (j->flags & ~JOB_STORED_RAW)) {
            rc = KVN_ERR_ARG;
        } else if (verify && kvn_xxh3_64(base + j->offset, j->stored_len) != j->stored_xxh3) {
            rc = KVN_ERR_CHECKSUM;
        } else if ((j->flags & JOB_STORED_RAW) && j->stored_len != raw_len) {
            rc = KVN_ERR_CORRUPT;
        }
        const Py_buffer *t = rc ? NULL : &dst[j->out_index];
        uint8_t **to = t ? room_for(&room.rows, &room.rows_size, nr * sizeof(uint8_t *)) : NULL;
        if (t && !to) rc = KVN_ERR_NOMEM;
        for (size_t r = 0; to && r < nr; r++) {  /* every row inside its target before anything is written */
            int64_t at = rows[starts[i] + (int64_t)r];
            if (at >= 0 && ((uint64_t)at > (uint64_t)t->len || row > (size_t)t->len - (size_t)at)) { rc = KVN_ERR_ARG; break; }
            to[r] = at >= 0 ? (uint8_t *)t->buf + at : NULL;
        }
        const uint8_t *block = base + j->offset;
        if (!rc && (j->flags & JOB_STORED_RAW)) {
            for (size_t r = 0; r < nr; r++)
                if (to[r]) memcpy(to[r], block + r * row, row);
        } else if (!rc) {
            rc = decode_block_rows(model, j, block, dtype, (size_t)heads, (size_t)dim, raw_len, verify, to, &room);
        }
        if (rc) { failed = (Py_ssize_t)i; break; }
    }
    Py_END_ALLOW_THREADS
    free(room.rows);
    free(room.scratch);
    result = rc == KVN_ERR_NOMEM ? PyErr_NoMemory() : Py_BuildValue("(in)", rc, failed);
release:
    for (Py_ssize_t k = 0; k < got; k++) PyBuffer_Release(&dst[k]);
    free(dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&jobs_buf);
    PyBuffer_Release(&starts_buf);
    PyBuffer_Release(&rows_buf);
    return result;
}

/* The checksum's and the vector level's bindings live in kernels_py.c. */
PyObject *kvn_py_xxh3_64(PyObject *self, PyObject *args);
PyObject *kvn_py_isa(PyObject *self, PyObject *args);
/* The ctxans coder's bindings live in ctxans_py.c. */
PyObject *kvn_py_ctxans_model(PyObject *self, PyObject *args);
PyObject *kvn_py_ctxans_encode(PyObject *self, PyObject *args);
PyObject *kvn_py_ctxans_decode(PyObject *self, PyObject *args);
int kvn_py_ctxans_add_constants(PyObject *module);
/* The ctxtans coder's bindings live in ctxtans_py.c. */
PyObject *kvn_py_ctxtans_model(PyObject *self, PyObject *args);
PyObject *kvn_py_ctxtans_encode(PyObject *self, PyObject *args);
PyObject *kvn_py_ctxtans_decode(PyObject *self, PyObject *args);
/* The outliers side channel's bindings live in outliers.c. */
PyObject *kvn_py_outliers_split(PyObject *self, PyObject *args);
PyObject *kvn_py_outliers_merge(PyObject *self, PyObject *args);
/* The int stage's batch restore and the lossy error statistics live in intquant_batch.c. */
PyObject *kvn_py_int_decode_blocks(PyObject *self, PyObject *args);
PyObject *kvn_py_error_stats(PyObject *self, PyObject *args);
int kvn_py_intquant_add_constants(PyObject *module);
/* The int stage's coded codes plane (codes=ctx) lives in intcodes.c. */
PyObject *kvn_py_int_codes_encode(PyObject *self, PyObject *args);
PyObject *kvn_py_int_codes_decode(PyObject *self, PyObject *args);
PyObject *kvn_py_pca_model(PyObject *self, PyObject *args);
PyObject *kvn_py_pca_encode(PyObject *self, PyObject *args);
PyObject *kvn_py_pca_decode(PyObject *self, PyObject *args);
PyObject *kvn_py_pca_decode_run(PyObject *self, PyObject *args);

static PyMethodDef methods[] = {
    {"xxh3_64", kvn_py_xxh3_64, METH_VARARGS, "XXH3-64 (seed 0) of a buffer, in one piece or in pieces of a given size."},
    {"isa", kvn_py_isa, METH_VARARGS, "The vector level every kernel uses (0 scalar, 1 AVX2, 2 AVX-512), capped first if given."},
    {"exphuff_encode", py_exphuff_encode, METH_VARARGS, "Encode one C-contiguous block as an exphuff chunk."},
    {"exphuff_decode", py_exphuff_decode, METH_VARARGS, "Decode one exphuff chunk into a C-contiguous block; returns a status."},
    {"encode_blocks", py_encode_blocks, METH_VARARGS, "Encode a tensor's token blocks: (blob, meta)."},
    {"decode_blocks", py_decode_blocks, METH_VARARGS, "Decode a batch of chunks into tensors: (status, failed job)."},
    {"ctxans_model", kvn_py_ctxans_model, METH_VARARGS, "A dictionary's ctxans coder tables, as a capsule."},
    {"ctxans_encode", kvn_py_ctxans_encode, METH_VARARGS, "Encode one C-contiguous block as a ctxans chunk."},
    {"ctxans_decode", kvn_py_ctxans_decode, METH_VARARGS, "Decode one ctxans chunk into a C-contiguous block; returns a status."},
    {"ctxtans_model", kvn_py_ctxtans_model, METH_VARARGS, "A dictionary's ctxtans tANS tables, as a capsule."},
    {"ctxtans_encode", kvn_py_ctxtans_encode, METH_VARARGS, "Encode one C-contiguous block as a ctxtans chunk."},
    {"ctxtans_decode", kvn_py_ctxtans_decode, METH_VARARGS, "Decode one ctxtans chunk into a C-contiguous block; returns a status."},
    {"int_quant", py_int_quant, METH_VARARGS, "Quantize one block for the lossy int stage; returns a status."},
    {"int_dequant", py_int_dequant, METH_VARARGS, "Restore one block of the lossy int stage; returns a status."},
    {"outliers_split", kvn_py_outliers_split, METH_VARARGS, "Keep each row's outliers of one block apart; returns a status."},
    {"outliers_merge", kvn_py_outliers_merge, METH_VARARGS, "Write a block's outliers back into it; returns a status."},
    {"int_decode_blocks", kvn_py_int_decode_blocks, METH_VARARGS, "Restore a batch of int-stage blocks into given rows: (status, failed job)."},
    {"error_stats", kvn_py_error_stats, METH_VARARGS, "A lossy block's (max abs error, squared errors, squared values), as numpy sums them."},
    {"int_codes_encode", kvn_py_int_codes_encode, METH_VARARGS, "Code one block's packed int codes as a codes=ctx plane; returns a status."},
    {"int_codes_decode", kvn_py_int_codes_decode, METH_VARARGS, "The packed int codes a codes=ctx plane holds; returns 0 or why it is refused."},
    {"pca_model", kvn_py_pca_model, METH_VARARGS, "One tensor's pca coder (basis, step, tables), as a capsule."},
    {"pca_encode", kvn_py_pca_encode, METH_VARARGS, "Code one C-contiguous block as a pca plane; returns a status."},
    {"pca_decode", kvn_py_pca_decode, METH_VARARGS, "Restore one pca plane into a C-contiguous block; returns a status."},
    {"pca_decode_run", kvn_py_pca_decode_run, METH_VARARGS,
     "Restore a run of pca planes straight into a destination's rows; returns (status, failing block)."},
    {"decode_rows", py_decode_rows, METH_VARARGS, "Decode a batch of chunks row by row into given byte offsets: (status, failed job)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_core", "kvtool's native codec core.", -1, methods};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "JOB_SIZE", (long)sizeof(job)) < 0 ||
        PyModule_AddIntConstant(m, "BLOCK_META_SIZE", (long)sizeof(block_meta)) < 0 ||
        PyModule_AddIntConstant(m, "STATUS_CORRUPT", KVN_ERR_CORRUPT) < 0 ||
        PyModule_AddIntConstant(m, "STATUS_CHECKSUM", KVN_ERR_CHECKSUM) < 0 ||
        PyModule_AddIntConstant(m, "STATUS_ARG", KVN_ERR_ARG) < 0 || kvn_py_ctxans_add_constants(m) < 0 ||
        kvn_py_intquant_add_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
