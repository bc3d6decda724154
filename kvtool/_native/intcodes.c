/* The `int` stage's codes plane with `codes=ctx` (kvtool/layouts/int_codes.py, the reference, documents
 * the format): a block's codes coded with order-1 tables whose context is the previous token's code of the
 * same channel (rows equal to an earlier row of their head named in a repeat section instead), by a 4-state
 * interleaved rANS coder (32-bit states, byte renormalisation, 12-bit
 * frequencies), or the packed codes where that is not smaller. Every choice the encoder makes (the
 * frequencies, the context bits) is integer arithmetic, so it writes the reference's bytes.
 *
 * The decoder returns a reason (INTCODES_*) for a plane it refuses; the Python side words it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "kvn.h"
#include "repeats.h"

#define PROB_BITS 12
#define TOTAL (1u << PROB_BITS)
#define LOW (1u << 23)
#define STATES 4
#define HEADER 14

enum { INTCODES_MODE = 1, INTCODES_LENGTHS = 2, INTCODES_MODEL = 3, INTCODES_STREAM = 4, INTCODES_TAIL = 5, INTCODES_REPEATS = 6 };

/* -log2(f / 4096) in 16-bit fixed point, f = 1..4096, as int_codes._costs computes it. */
static uint32_t costs[TOTAL + 1];

__attribute__((constructor)) static void init_costs(void) {
    for (uint32_t f = 1; f <= TOTAL; f++) {
        int whole = 31 - __builtin_clz(f);
        uint64_t x = (uint64_t)f << (30 - whole);
        uint32_t frac = 0;
        for (int b = 15; b >= 0; b--) {
            x = (x * x) >> 30;
            if (x >= (1ull << 31)) x >>= 1, frac |= 1u << b;
        }
        costs[f] = (PROB_BITS << 16) - (((uint32_t)whole << 16) | frac);
    }
}

static void unpack(const uint8_t *packed, size_t count, int bits, uint8_t *codes) {
    uint32_t acc = 0, mask = (1u << bits) - 1u;
    int held = 0;
    for (size_t i = 0, at = 0; i < count; i++) {
        if (held < bits) acc = acc << 8 | packed[at++], held += 8;
        codes[i] = (uint8_t)(acc >> (held -= bits) & mask);
    }
}

static void pack(const uint8_t *codes, size_t count, int bits, uint8_t *packed) {
    uint32_t acc = 0;
    int held = 0;
    size_t at = 0;
    for (size_t i = 0; i < count; i++) {
        acc = acc << bits | codes[i];
        held += bits;
        if (held >= 8) packed[at++] = (uint8_t)(acc >> (held -= 8));
    }
    if (held) packed[at] = (uint8_t)(acc << (8 - held));
}

/* One context's counts as frequencies summing to TOTAL (int_codes._normalise); 0 where it never occurs. */
static int normalise(const uint64_t *counts, size_t symbols, uint32_t *freqs) {
    uint64_t total = 0, most = 0;
    size_t top = 0;
    for (size_t s = 0; s < symbols; s++) {
        total += counts[s];
        if (counts[s] > most) most = counts[s], top = s;
    }
    if (total == 0) return 0;
    int64_t spare = TOTAL;
    for (size_t s = 0; s < symbols; s++) {
        uint64_t f = counts[s] ? counts[s] * TOTAL / total : 0;
        freqs[s] = (uint32_t)(counts[s] && f == 0 ? 1 : f);
        spare -= freqs[s];
    }
    if (spare > 0) freqs[top] += (uint32_t)spare;
    while (spare < 0) {
        size_t j = 0;
        for (size_t s = 1; s < symbols; s++)
            if (freqs[s] > freqs[j]) j = s;
        uint32_t take = (uint32_t)(-spare < (int64_t)freqs[j] - 1 ? -spare : (int64_t)freqs[j] - 1);
        freqs[j] -= take;
        spare += take;
    }
    return 1;
}

/* The model section of `contexts` rows of frequencies (0 rows: absent) at p; returns its length. */
static size_t write_model(const uint32_t *freqs, const uint8_t *present, size_t contexts, size_t symbols, uint8_t *p) {
    size_t head = (contexts + 7) / 8, at = head, width = (symbols + 7) / 8;
    memset(p, 0, head);
    for (size_t k = 0; k < contexts; k++) {
        if (!present[k]) continue;
        p[k / 8] |= (uint8_t)(1u << (k % 8));
        const uint32_t *row = freqs + k * symbols;
        memset(p + at, 0, width);
        size_t last = 0;
        for (size_t s = 0; s < symbols; s++)
            if (row[s]) p[at + s / 8] |= (uint8_t)(1u << (s % 8)), last = s;
        at += width;
        for (size_t s = 0; s < last; s++) {
            uint32_t f = row[s];
            if (!f) continue;
            for (; f >= 0x80; f >>= 7) p[at++] = (uint8_t)(0x80 | (f & 0x7F));
            p[at++] = (uint8_t)f;
        }
    }
    return at;
}

/* The contexts' frequencies for context bits c (merged from the full counts), their model at `model`;
 * returns the estimated size in 1/65536 bits (model bytes plus the codes' cost). */
static uint64_t build(const uint64_t *counts, int bits, int c, uint64_t *merged, uint32_t *freqs, uint8_t *present,
                      uint8_t *model, size_t *model_len) {
    size_t symbols = (size_t)1 << bits, contexts = ((size_t)1 << c) + 1, per = symbols >> c;
    memset(merged, 0, contexts * symbols * sizeof(uint64_t));
    for (size_t k = 0; k <= symbols; k++) {
        uint64_t *into = merged + (k == symbols ? contexts - 1 : k / per) * symbols;
        for (size_t s = 0; s < symbols; s++) into[s] += counts[k * symbols + s];
    }
    uint64_t cost = 0;
    for (size_t k = 0; k < contexts; k++) {
        present[k] = (uint8_t)normalise(merged + k * symbols, symbols, freqs + k * symbols);
        if (!present[k]) memset(freqs + k * symbols, 0, symbols * sizeof(uint32_t));
        for (size_t s = 0; present[k] && s < symbols; s++) cost += merged[k * symbols + s] * costs[freqs[k * symbols + s]];
    }
    *model_len = write_model(freqs, present, contexts, symbols, model);
    return cost + ((uint64_t)*model_len * 8 << 16);
}

/* The rANS stream of the codes at dst (room for 16 + 2 * count bytes); returns its length. */
/* back (NULL: no repeats) holds per row (t, h) at t * heads + h how many tokens back its repeat is, 0 if coded. */
static size_t rans_encode(const uint8_t *codes, size_t count, size_t heads, size_t tokens, size_t dim, int bits, int c,
                          const uint32_t *back, const uint32_t *freqs, const uint32_t *starts, uint8_t *dst, size_t room) {
    size_t symbols = (size_t)1 << bits, start_ctx = (size_t)1 << c, at = room;
    int shift = bits - c;
    uint32_t x[STATES] = {LOW, LOW, LOW, LOW};
    for (size_t i = count; i-- > 0;) {
        size_t t = i / dim % tokens, k = t == 0 ? start_ctx : (size_t)(codes[i - dim] >> shift);
        if (back && back[t * heads + i / dim / tokens]) continue;
        uint32_t f = freqs[k * symbols + codes[i]], top = f << (31 - PROB_BITS), *s = &x[i & (STATES - 1)];
        while (*s >= top) dst[--at] = (uint8_t)*s, *s >>= 8;
        *s = ((*s / f) << PROB_BITS) + *s % f + starts[k * symbols + codes[i]];
    }
    for (int j = STATES - 1; j >= 0; j--) at -= 4, kvn_wr32(dst + at, x[j]);
    memmove(dst, dst + at, room - at);
    return room - at;
}

/* The full contexts' counts of the coded rows (all where back is NULL). */
static void count_codes(const uint8_t *codes, size_t heads, size_t tokens, size_t dim, int bits, const uint32_t *back,
                        uint64_t *counts) {
    size_t symbols = (size_t)1 << bits;
    memset(counts, 0, (symbols + 1) * symbols * sizeof(uint64_t));
    for (size_t h = 0, i = 0; h < heads; h++)
        for (size_t t = 0; t < tokens; t++, i += dim)
            if (!back || !back[t * heads + h])
                for (size_t d = 0; d < dim; d++) counts[(t == 0 ? symbols : codes[i + d - dim]) * symbols + codes[i + d]]++;
}

static int encode(const uint8_t *packed, size_t heads, size_t tokens, size_t dim, int bits, uint8_t *plane,
                  size_t plane_len) {
    size_t count = heads * tokens * dim, used = (count * (size_t)bits + 7) / 8, rows = heads * tokens;
    memset(plane, 0, plane_len);
    memcpy(plane + 1, packed, used);
    if (count == 0) return KVN_OK;
    size_t symbols = (size_t)1 << bits, contexts = symbols + 1, width = (symbols + 7) / 8, repeated = 0;
    size_t model_room = (contexts + 7) / 8 + contexts * (width + 2 * symbols), room = 16 + 2 * count;
    size_t section_room = 4 + (rows + 7) / 8 + 5 * rows;
    uint8_t *codes = malloc(count), *model = malloc(model_room), *present = malloc(contexts), *stream = malloc(room);
    uint8_t *section = malloc(section_room);
    uint64_t *counts = malloc(contexts * symbols * sizeof(uint64_t)), *merged = malloc(contexts * symbols * sizeof(uint64_t));
    uint32_t *freqs = malloc(contexts * symbols * sizeof(uint32_t)), *starts = malloc(contexts * symbols * sizeof(uint32_t));
    uint32_t *back = malloc(rows * sizeof(uint32_t));
    int rc = codes && model && present && stream && section && counts && merged && freqs && starts && back ? KVN_OK
                                                                                                        : KVN_ERR_NOMEM;
    if (rc == KVN_OK) {
        unpack(packed, count, bits, codes);
        kvn_block rows_of = {KVN_BF16, heads, tokens, dim, tokens * dim};
        rc = kvn_find_repeats(&rows_of, codes, 1, back, &repeated);
    }
    if (rc == KVN_OK) {
        /* the least estimated size, the first of equal ones: without repeats, then with; the smallest c first */
        int best = 0, with_repeats = 0;
        uint64_t least = UINT64_MAX;
        size_t model_len, section_len = (size_t)(kvn_write_repeats(section, back, rows) - section);
        for (int r = 0; r <= (repeated > 0); r++) {
            count_codes(codes, heads, tokens, dim, bits, r ? back : NULL, counts);
            for (int c = 0; c <= bits; c++) {
                uint64_t cost = build(counts, bits, c, merged, freqs, present, model, &model_len);
                cost += (uint64_t)(r ? section_len : 4) * 8 << 16;
                if (cost < least) least = cost, best = c, with_repeats = r;
            }
        }
        count_codes(codes, heads, tokens, dim, bits, with_repeats ? back : NULL, counts);
        build(counts, bits, best, merged, freqs, present, model, &model_len);
        size_t used_contexts = ((size_t)1 << best) + 1;
        for (size_t k = 0; k < used_contexts; k++)
            for (size_t s = 0, at = 0; s < symbols; s++) starts[k * symbols + s] = (uint32_t)at, at += freqs[k * symbols + s];
        size_t stream_len = rans_encode(codes, count, heads, tokens, dim, bits, best, with_repeats ? back : NULL, freqs,
                                        starts, stream, room);
        if (!with_repeats) section_len = 4, memset(section, 0, 4);
        if (10 + section_len + model_len + stream_len < 1 + used) {
            memset(plane, 0, plane_len);
            plane[0] = 1;
            plane[1] = (uint8_t)best;
            kvn_wr32(plane + 2, (uint32_t)model_len);
            kvn_wr32(plane + 6, (uint32_t)stream_len);
            memcpy(plane + 10, section, section_len);
            memcpy(plane + 10 + section_len, model, model_len);
            memcpy(plane + 10 + section_len + model_len, stream, stream_len);
        }
    }
    free(codes), free(model), free(present), free(stream), free(section), free(counts), free(merged), free(freqs);
    free(starts), free(back);
    return rc;
}

/* The model section's frequencies (int_codes._read_model); 0 or INTCODES_MODEL. */
static int read_model(const uint8_t *p, size_t len, int bits, int c, uint32_t *freqs, uint8_t *present) {
    size_t contexts = ((size_t)1 << c) + 1, symbols = (size_t)1 << bits, head = (contexts + 7) / 8, at = head;
    size_t width = (symbols + 7) / 8;
    if (len < head || (contexts % 8 && p[head - 1] >> (contexts % 8))) return INTCODES_MODEL;
    for (size_t k = 0; k < contexts; k++) {
        uint32_t *row = freqs + k * symbols;
        memset(row, 0, symbols * sizeof(uint32_t));
        present[k] = p[k / 8] >> (k % 8) & 1;
        if (!present[k]) continue;
        if (at + width > len) return INTCODES_MODEL;
        const uint8_t *mask = p + at;
        at += width;
        size_t last = symbols, n = 0;
        for (size_t s = 0; s < symbols; s++)
            if (mask[s / 8] >> (s % 8) & 1) last = s, n++;
        if (n == 0 || (symbols % 8 && mask[width - 1] >> (symbols % 8))) return INTCODES_MODEL;
        uint32_t sum = 0;
        for (size_t s = 0; s < last; s++) {
            if (!(mask[s / 8] >> (s % 8) & 1)) continue;
            uint32_t f = 0, shift = 0, byte;
            do {
                if (at >= len || shift > 7) return INTCODES_MODEL;
                byte = p[at++];
                f |= (byte & 0x7Fu) << shift;
                shift += 7;
            } while (byte & 0x80);
            if ((byte == 0 && shift > 7) || f < 1 || f >= TOTAL) return INTCODES_MODEL;
            row[s] = f;
            sum += f;
        }
        if (sum >= TOTAL) return INTCODES_MODEL;
        row[last] = TOTAL - sum;
    }
    return at == len ? 0 : INTCODES_MODEL;
}

/* One decoding step of state *x with a slot entry (symbol | (frequency - 1) << 8 | (slot - start) << 20);
 * returns the symbol. The caller renormalises. */
static inline uint8_t rans_step(uint32_t *x, const uint32_t *table) {
    uint32_t e = table[*x & (TOTAL - 1)];
    *x = ((e >> 8 & (TOTAL - 1)) + 1) * (*x >> PROB_BITS) + (e >> 20);
    return (uint8_t)e;
}

static int rans_decode(const uint8_t *p, size_t len, size_t heads, size_t tokens, size_t dim, int bits, int c,
                       const uint32_t *freqs, const uint8_t *present, const uint32_t *back, uint8_t *codes) {
    size_t symbols = (size_t)1 << bits, contexts = ((size_t)1 << c) + 1, start_ctx = (size_t)1 << c;
    if (len < 4 * STATES) return INTCODES_STREAM;
    uint32_t x[STATES];
    for (int j = 0; j < STATES; j++)
        if ((x[j] = kvn_rd32(p + 4 * j)) < LOW || x[j] >= (LOW << 8)) return INTCODES_STREAM;
    uint32_t *slots = malloc(contexts * TOTAL * sizeof(uint32_t));  /* per context, per slot: rans_step's entry */
    if (!slots) return -KVN_ERR_NOMEM;
    for (size_t k = 0; k < contexts; k++) {
        if (!present[k]) memset(slots + k * TOTAL, 0, TOTAL * sizeof(uint32_t));  /* read, never used: rows using it fail */
        for (uint32_t s = 0, at = 0; present[k] && s < symbols; s++)
            for (uint32_t f = freqs[k * symbols + s], u = 0; u < f; u++, at++)
                slots[k * TOTAL + at] = s | (f - 1) << 8 | u << 20;
    }
    int shift = bits - c, rc = 0;
    size_t at = 4 * STATES, i = 0;
    for (size_t h = 0; h < heads && !rc; h++)
        for (size_t t = 0; t < tokens && !rc; t++, i += dim) {
            if (back[t * heads + h]) {  /* checked: at most t */
                memcpy(codes + i, codes + i - back[t * heads + h] * dim, dim);
                continue;
            }
            const uint8_t *above = codes + i - dim;  /* the previous token's row, for t > 0 */
            int fast = len - at >= 2 * dim;  /* a step reads at most 2 bytes: no bounds checks in this row */
            if (fast && dim % STATES == 0) {  /* the row starts with state 0: the four states in registers */
                uint32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3], absent = 0;
#define STEP(X, D)                                                                  \
    do {                                                                            \
        size_t k = t == 0 ? start_ctx : (size_t)(above[D] >> shift);               \
        absent |= !present[k];                                                      \
        codes[i + (D)] = rans_step(&X, slots + k * TOTAL);                         \
        if (X < LOW) X = X << 8 | p[at++];                                          \
        if (X < LOW) X = X << 8 | p[at++];                                          \
    } while (0)
                for (size_t d = 0; d < dim; d += STATES) {
                    STEP(x0, d);
                    STEP(x1, d + 1);
                    STEP(x2, d + 2);
                    STEP(x3, d + 3);
                }
#undef STEP
                x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3;
                if (absent) rc = INTCODES_STREAM;
                continue;
            }
            for (size_t d = 0; d < dim; d++) {
                size_t k = t == 0 ? start_ctx : (size_t)(above[d] >> shift);
                if (!present[k]) { rc = INTCODES_STREAM; break; }
                uint32_t *s = &x[(i + d) & (STATES - 1)];
                codes[i + d] = rans_step(s, slots + k * TOTAL);
                if (fast) {
                    if (*s < LOW) *s = *s << 8 | p[at++];
                    if (*s < LOW) *s = *s << 8 | p[at++];
                    continue;
                }
                while (*s < LOW) {
                    if (at >= len) { rc = INTCODES_STREAM; break; }
                    *s = *s << 8 | p[at++];
                }
                if (rc) break;
            }
        }
    free(slots);
    if (rc) return rc;
    for (int j = 0; j < STATES; j++)
        if (x[j] != LOW) return INTCODES_STREAM;
    return at == len ? 0 : INTCODES_STREAM;
}

static int decode(const uint8_t *plane, size_t plane_len, size_t heads, size_t tokens, size_t dim, int bits,
                  uint8_t *packed) {
    size_t count = heads * tokens * dim, used = (count * (size_t)bits + 7) / 8, end;
    if (plane_len == 0 || plane[0] > 1) return INTCODES_MODE;
    if (plane[0] == 0) {
        if (plane_len < 1 + used) return INTCODES_LENGTHS;
        memcpy(packed, plane + 1, used);
        unsigned tail = (unsigned)(count * (size_t)bits % 8);
        if (used && tail && (packed[used - 1] & (0xFFu >> tail))) return INTCODES_TAIL;
        end = 1 + used;
    } else {
        if (plane_len < HEADER) return INTCODES_LENGTHS;
        int c = plane[1];
        size_t model_len = kvn_rd32(plane + 2), stream_len = kvn_rd32(plane + 6), section_len = kvn_rd32(plane + 10);
        size_t model_at = HEADER + section_len, rows = heads * tokens, repeated;
        end = model_at + model_len + stream_len;
        if (c > bits) return INTCODES_MODEL;
        if (end > plane_len) return INTCODES_LENGTHS;
        size_t contexts = ((size_t)1 << c) + 1, symbols = (size_t)1 << bits;
        uint32_t *freqs = malloc(contexts * symbols * sizeof(uint32_t)), *back = calloc(rows ? rows : 1, sizeof(uint32_t));
        uint8_t *present = malloc(contexts), *codes = malloc(count ? count : 1);
        int rc = freqs && back && present && codes ? 0 : -KVN_ERR_NOMEM;
        if (!rc && section_len && kvn_read_repeats(plane + HEADER, section_len, rows, back, &repeated)) rc = INTCODES_REPEATS;
        for (size_t r = 0; !rc && r < rows; r++)
            if (back[r] > r / heads) rc = INTCODES_REPEATS;  /* row r is token r / heads */
        if (!rc) rc = read_model(plane + model_at, model_len, bits, c, freqs, present);
        if (!rc)
            rc = rans_decode(plane + model_at + model_len, stream_len, heads, tokens, dim, bits, c, freqs, present, back,
                             codes);
        if (!rc) pack(codes, count, bits, packed);
        free(freqs), free(back), free(present), free(codes);
        if (rc) return rc;
    }
    for (size_t i = end; i < plane_len; i++)
        if (plane[i]) return INTCODES_TAIL;
    return 0;
}

/* The geometry both bindings check: count codes of `bits` bits, without overflow. */
static int geometry(Py_ssize_t heads, Py_ssize_t tokens, Py_ssize_t dim, int bits, size_t *count) {
    size_t n;
    if (heads < 0 || tokens < 0 || dim < 0 || bits < 1 || bits > 8 ||
        __builtin_mul_overflow((size_t)heads, (size_t)tokens, &n) || __builtin_mul_overflow(n, (size_t)dim, &n) ||
        n > ((size_t)1 << 40)) {
        PyErr_SetString(PyExc_ValueError, "bad int codes geometry");
        return -1;
    }
    *count = n;
    return 0;
}

/* int_codes_encode(packed, plane, heads, tokens, dim, bits) -> status (0; 3 where the buffers do not fit) */
PyObject *kvn_py_int_codes_encode(PyObject *self, PyObject *args) {
    Py_buffer packed, plane;
    Py_ssize_t heads, tokens, dim;
    int bits;
    size_t count;
    if (!PyArg_ParseTuple(args, "y*w*nnni", &packed, &plane, &heads, &tokens, &dim, &bits)) return NULL;
    int rc = geometry(heads, tokens, dim, bits, &count);
    if (rc == 0) {
        size_t used = (count * (size_t)bits + 7) / 8;
        if ((size_t)packed.len < used || (size_t)plane.len < 1 + used || dim == 0) {
            rc = KVN_ERR_ARG;
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = encode(packed.buf, (size_t)heads, (size_t)tokens, (size_t)dim, bits, plane.buf, (size_t)plane.len);
            Py_END_ALLOW_THREADS
        }
    }
    PyBuffer_Release(&packed);
    PyBuffer_Release(&plane);
    if (rc < 0) return NULL;
    if (rc == KVN_ERR_NOMEM) return PyErr_NoMemory();
    return PyLong_FromLong(rc);
}

/* int_codes_decode(plane, packed, heads, tokens, dim, bits) -> 0, or the reason (1-5) the plane is refused */
PyObject *kvn_py_int_codes_decode(PyObject *self, PyObject *args) {
    Py_buffer plane, packed;
    Py_ssize_t heads, tokens, dim;
    int bits;
    size_t count;
    if (!PyArg_ParseTuple(args, "y*w*nnni", &plane, &packed, &heads, &tokens, &dim, &bits)) return NULL;
    int rc = geometry(heads, tokens, dim, bits, &count);
    if (rc == 0 && (size_t)packed.len != (count * (size_t)bits + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "the packed codes buffer does not match the geometry");
        rc = -1;
    }
    if (rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = decode(plane.buf, (size_t)plane.len, (size_t)heads, (size_t)tokens, (size_t)dim, bits, packed.buf);
        Py_END_ALLOW_THREADS
        if (rc == -KVN_ERR_NOMEM) PyErr_NoMemory();
    }
    PyBuffer_Release(&plane);
    PyBuffer_Release(&packed);
    return rc < 0 ? NULL : PyLong_FromLong(rc);
}
