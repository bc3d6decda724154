/* Canonical Huffman coding of byte symbols, as exphuff's format defines it.
 *
 * Code lengths: leaves sorted by (count, symbol), the two-queue Huffman
 * construction (a leaf wins ties), lengths above KVN_HUF_MAXBITS folded back
 * with the JPEG (Annex K.3) adjustment, then lengths handed out again, the
 * longest to the first leaves of that order. kvtool/_native/reference.py does
 * the same steps, so both write the same bytes.
 *
 * Streams are LSB first: a code's first bit is the lowest unread bit. The
 * decoder looks up KVN_HUF_MAXBITS bits at a time in a table that yields up
 * to four symbols per lookup, and runs four streams side by side.
 */
#include "huffman.h"

_Static_assert(5 * KVN_HUF_MAXBITS <= 56, "a decode step takes five lookups from one 57-bit refill");

typedef struct { uint32_t count; uint16_t sym; } leaf;

int kvn_huf_lengths(const uint32_t count[256], uint8_t len[256]) {
    leaf leaves[256];
    int n = 0;
    memset(len, 0, 256);
    for (int s = 0; s < 256; s++)
        if (count[s]) leaves[n++] = (leaf){count[s], (uint16_t)s};
    if (n == 0) return 0;
    if (n == 1) { len[leaves[0].sym] = 1; return 1; }
    /* insertion sort by (count, symbol): n <= 256 and the input is already in symbol order */
    for (int i = 1; i < n; i++) {
        leaf x = leaves[i];
        int j = i - 1;
        while (j >= 0 && leaves[j].count > x.count) { leaves[j + 1] = leaves[j]; j--; }
        leaves[j + 1] = x;
    }
    uint64_t weight[255];
    int leaf_parent[256], node_parent[255];
    int next_leaf = 0, next_node = 0;
    for (int k = 0; k < n - 1; k++) {
        uint64_t w = 0;
        for (int pick = 0; pick < 2; pick++) {
            if (next_leaf < n && (next_node >= k || leaves[next_leaf].count <= weight[next_node])) {
                w += leaves[next_leaf].count;
                leaf_parent[next_leaf++] = k;
            } else {
                w += weight[next_node];
                node_parent[next_node++] = k;
            }
        }
        weight[k] = w;
    }
    int depth[255];
    unsigned bl_count[256] = {0};
    depth[n - 2] = 0;
    for (int k = n - 3; k >= 0; k--) depth[k] = depth[node_parent[k]] + 1;
    int maxlen = 0;
    for (int i = 0; i < n; i++) {
        int d = depth[leaf_parent[i]] + 1;
        bl_count[d]++;
        if (d > maxlen) maxlen = d;
    }
    for (int i = maxlen; i > KVN_HUF_MAXBITS; i--) {
        while (bl_count[i] > 0) {
            int j = i - 2;
            while (bl_count[j] == 0) j--;
            bl_count[i] -= 2;
            bl_count[i - 1] += 1;
            bl_count[j + 1] += 2;
            bl_count[j] -= 1;
        }
    }
    int i = 0;
    for (int l = KVN_HUF_MAXBITS; l >= 1; l--)
        for (unsigned c = 0; c < bl_count[l]; c++) len[leaves[i++].sym] = (uint8_t)l;
    return n;
}

/* MAXBITS-bit numbers bit-reversed: canonical codes are numbered MSB first, streams read LSB first. */
#define S2(n) n, n + 2 * 256, n + 1 * 256, n + 3 * 256
#define S4(n) S2(n), S2(n + 2 * 64), S2(n + 1 * 64), S2(n + 3 * 64)
#define S6(n) S4(n), S4(n + 2 * 16), S4(n + 1 * 16), S4(n + 3 * 16)
#define S8(n) S6(n), S6(n + 2 * 4), S6(n + 1 * 4), S6(n + 3 * 4)
static const uint16_t REVERSED[KVN_HUF_LUT_SIZE] = {S8(0), S8(2), S8(1), S8(3)};
_Static_assert(KVN_HUF_MAXBITS == 10, "REVERSED is written out for 10 bits");

static inline uint32_t reverse_bits(uint32_t code, unsigned bits) { return REVERSED[code] >> (KVN_HUF_MAXBITS - bits); }

/* The canonical codes, MSB first: numbered in order of (length, symbol). */
static void canonical(const uint8_t len[256], uint16_t code[256]) {
    unsigned bl_count[KVN_HUF_MAXBITS + 2] = {0};
    uint16_t next[KVN_HUF_MAXBITS + 2];
    for (int s = 0; s < 256; s++) bl_count[len[s]]++;
    bl_count[0] = 0;
    uint16_t c = 0;
    for (int l = 1; l <= KVN_HUF_MAXBITS; l++) {
        c = (uint16_t)((c + bl_count[l - 1]) << 1);
        next[l] = c;
    }
    for (int s = 0; s < 256; s++) code[s] = len[s] ? next[len[s]]++ : 0;
}

void kvn_huf_codes(const uint8_t len[256], uint16_t code[256]) {
    canonical(len, code);
    for (int s = 0; s < 256; s++) code[s] = len[s] ? (uint16_t)reverse_bits(code[s], len[s]) : 0;
}

/* The used symbols in canonical order (shortest codes first), for building the decode table. */
typedef struct {
    kvn_huf_entry *lut;
    uint8_t sym[256], len[256];
    uint16_t canon[256];                /* MSB first */
    int fits[KVN_HUF_MAXBITS + 1];      /* how many codes are at most this long */
} table_build;

/* Slots [lo, hi) of the table in MSB-first order (one run there, scattered in the table's own order). */
static inline void put(kvn_huf_entry *lut, uint32_t lo, uint32_t hi, uint32_t syms, unsigned count, unsigned len1,
                       unsigned bits) {
    kvn_huf_entry e = {syms, (uint8_t)count, 0, (uint8_t)len1, (uint8_t)bits};
    for (uint32_t x = lo; x < hi; x++) lut[REVERSED[x]] = e;
}

/* The slots whose first L bits read, MSB first, are `prefix`, holding k symbols `syms` (the first `len1`
 * bits long): those whose next code does not fit in the bits left end here (canonical codes that long
 * begin with the last windows); each next symbol that fits leads a branch of its own, which ends at
 * once where it holds four symbols or no code fits after it. */
static void fill(const table_build *t, uint32_t prefix, unsigned L, unsigned k, uint32_t syms, unsigned len1) {
    unsigned left = KVN_HUF_MAXBITS - L;
    int fit = t->fits[left];
    if (fit < t->fits[KVN_HUF_MAXBITS])
        put(t->lut, prefix << left | (uint32_t)t->canon[fit] >> (t->len[fit] - left), (prefix + 1) << left, syms, k,
            len1, L);
    for (int q = 0; q < fit; q++) {
        uint32_t at = prefix << t->len[q] | t->canon[q], more = syms | (uint32_t)t->sym[q] << (8 * k);
        unsigned end = L + t->len[q], first = k ? len1 : t->len[q], rest = KVN_HUF_MAXBITS - end;
        if (k < 3 && rest >= t->len[0]) fill(t, at, end, k + 1, more, first);
        else put(t->lut, at << rest, (at + 1) << rest, more, k + 1, first, end);
    }
}

int kvn_huf_table(const uint8_t len[256], kvn_huf_entry lut[KVN_HUF_LUT_SIZE]) {
    /* Every slot gets what a greedy decode of its MAXBITS bits yields: up to four symbols whose codes end
     * within them. Filled branch by branch of the code tree, not slot by slot. */
    unsigned count[KVN_HUF_MAXBITS + 1] = {0};
    uint32_t kraft = 0;  /* in units of 2^-MAXBITS */
    for (int s = 0; s < 256; s++) {
        if (len[s] > KVN_HUF_MAXBITS) return KVN_ERR_CORRUPT;
        count[len[s]]++;
    }
    table_build t;
    t.lut = lut;
    t.fits[0] = 0;
    uint16_t next[KVN_HUF_MAXBITS + 1];
    unsigned slot[KVN_HUF_MAXBITS + 1], c = 0;
    for (unsigned l = 1; l <= KVN_HUF_MAXBITS; l++) {
        kraft += count[l] << (KVN_HUF_MAXBITS - l);
        c = (c + count[l - 1] * (l > 1)) << 1;  /* canonical: the first code of each length */
        next[l] = (uint16_t)c;
        slot[l] = (unsigned)t.fits[l - 1];
        t.fits[l] = t.fits[l - 1] + (int)count[l];
    }
    if (kraft != KVN_HUF_LUT_SIZE) return KVN_ERR_CORRUPT;
    for (int s = 0; s < 256; s++) {
        unsigned l = len[s];
        if (!l) continue;
        t.sym[slot[l]] = (uint8_t)s;
        t.len[slot[l]] = (uint8_t)l;
        t.canon[slot[l]++] = next[l]++;
    }
    fill(&t, 0, 0, 0, 0, 0);
    return KVN_OK;
}

size_t kvn_huf_segment(size_t n, int k, size_t *start) {
    size_t seg = (n + KVN_HUF_STREAMS - 1) / KVN_HUF_STREAMS;
    size_t lo = seg * (size_t)k;
    *start = lo < n ? lo : n;
    size_t hi = lo + seg < n ? lo + seg : n;
    return hi > *start ? hi - *start : 0;
}

/* One stream: whole bytes leave the 64-bit accumulator after every four symbols (<= 44 bits). */
static size_t encode_stream(const uint8_t *sym, size_t n, const uint16_t code[256], const uint8_t len[256],
                            uint8_t *out) {
    uint64_t acc = 0;
    unsigned nb = 0;
    uint8_t *o = out;
    size_t i = 0;
    for (; i < n; i += 4) {
        size_t m = n - i < 4 ? n - i : 4;
        for (size_t j = 0; j < m; j++) {
            acc |= (uint64_t)code[sym[i + j]] << nb;
            nb += len[sym[i + j]];
        }
        kvn_wr64(o, acc);
        o += nb >> 3;
        acc >>= nb & ~7u;
        nb &= 7;
    }
    if (nb) *o++ = (uint8_t)acc;
    return (size_t)(o - out);
}

void kvn_huf_encode4(const uint8_t *sym, size_t n, const uint16_t code[256], const uint8_t len[256],
                     uint8_t *out[KVN_HUF_STREAMS], size_t written[KVN_HUF_STREAMS]) {
    for (int k = 0; k < KVN_HUF_STREAMS; k++) {
        size_t lo, count = kvn_huf_segment(n, k, &lo);
        written[k] = encode_stream(sym + lo, count, code, len, out[k]);
    }
}

/* A stream is read through an absolute bit position `pos` from the start of all four streams:
 * eight bytes loaded at pos / 8 hold at least 57 unread bits, enough for five lookups of
 * KVN_HUF_MAXBITS bits (<= 55 while MAXBITS <= 11). A sentinel bit at 63, where no lookup reaches, tells by its
 * leading zeros how many bits the five took. Few registers per stream (pos, o) let four
 * streams run side by side. A lookup reads the slot's symbols, count and bits as three loads
 * of their own (one register each, no shifting them out of a loaded slot). */
#define KVN_HUF_STEP(pos, o, in, table)                                        \
    do {                                                                       \
        uint64_t buf_ = (kvn_rd64((in) + ((pos) >> 3)) >> ((pos) & 7)) | 1ull << 63; \
        for (int step_ = 0; step_ < 5; step_++) {                              \
            const kvn_huf_entry *e_ = &(table)[buf_ & (KVN_HUF_LUT_SIZE - 1)]; \
            kvn_wr32(o, e_->syms);                                             \
            o += e_->count;                                                    \
            buf_ >>= e_->bits;                                                 \
        }                                                                      \
        pos += (uint64_t)__builtin_clzll(buf_);                                \
    } while (0)

/* Room for a step: 20 symbols of output, 8 readable bytes at the position. */
#define FAST_OK(pos, o, oend) ((oend) - (o) >= 20 && ((pos) >> 3) + 8 <= readable)

/* The 64 bits from bit `pos` on, with the sentinel at 63. */
static inline uint64_t window(const uint8_t *in, uint64_t pos) { return (kvn_rd64(in + (pos >> 3)) >> (pos & 7)) | 1ull << 63; }

/* One lookup: up to four symbols out, their bits shifted out of the window. */
#define LOOKUP(buf, o, table)                                             \
    do {                                                                  \
        const kvn_huf_entry *e_ = &(table)[(buf) & (KVN_HUF_LUT_SIZE - 1)]; \
        kvn_wr32(o, e_->syms);                                            \
        o += e_->count;                                                   \
        buf >>= e_->bits;                                                 \
    } while (0)

/* How many steps surely have room from here: at most 20 symbols written and 5 * MAXBITS bits read a step. */
static inline uint64_t safe_steps(uint64_t pos, const uint8_t *o, const uint8_t *oend, uint64_t readable) {
    if (oend - o < 20 || (pos >> 3) + 8 > readable) return 0;
    uint64_t by_out = (uint64_t)(oend - o) / 20, by_in = (8 * (readable - 8) - pos) / (5 * KVN_HUF_MAXBITS) + 1;
    return by_out < by_in ? by_out : by_in;
}

/* Finish one stream (bits [pos, end_bit) of `in`) symbol by symbol, reading zeros past its end,
 * and check that it was used up exactly. */
static int finish(uint64_t pos, uint64_t end_bit, uint8_t *o, uint8_t *oend, const uint8_t *in, uint64_t readable,
                  const kvn_huf_entry *table) {
    while (FAST_OK(pos, o, oend)) KVN_HUF_STEP(pos, o, in, table);
    uint64_t end_byte = (end_bit + 7) >> 3;
    while (o < oend) {
        uint64_t buf = 0;
        for (uint64_t b = 0; b < 3; b++) {  /* 3 bytes hold MAXBITS (<= 17) bits from any bit offset */
            uint64_t at = (pos >> 3) + b;
            buf |= (uint64_t)(at < end_byte ? in[at] : 0) << (8 * b);
        }
        const kvn_huf_entry *e = &table[(buf >> (pos & 7)) & (KVN_HUF_LUT_SIZE - 1)];
        *o++ = (uint8_t)e->syms;
        pos += e->len1;
    }
    if (pos > end_bit || end_bit - pos >= 8) return KVN_ERR_CORRUPT;
    return KVN_OK;
}

static inline __attribute__((always_inline)) int decode4(const kvn_huf_entry *table, const uint8_t *in,
                                                        const size_t stream_len[KVN_HUF_STREAMS],
                                                        const uint8_t *readable_end, uint8_t *out, size_t n) {
    uint64_t readable = (uint64_t)(readable_end - in);
    uint64_t begin[KVN_HUF_STREAMS + 1];
    uint8_t *first[KVN_HUF_STREAMS], *last[KVN_HUF_STREAMS];
    begin[0] = 0;
    for (int k = 0; k < KVN_HUF_STREAMS; k++) {
        size_t lo, count = kvn_huf_segment(n, k, &lo);
        first[k] = out + lo;
        last[k] = out + lo + count;
        begin[k + 1] = begin[k] + 8 * (uint64_t)stream_len[k];
    }
    uint64_t q0 = begin[0], q1 = begin[1], q2 = begin[2], q3 = begin[3];
    uint8_t *o0 = first[0], *o1 = first[1], *o2 = first[2], *o3 = first[3];
    for (;;) {  /* as many steps as every stream surely has room for, then look again */
        uint64_t steps = safe_steps(q0, o0, last[0], readable), s;
        if ((s = safe_steps(q1, o1, last[1], readable)) < steps) steps = s;
        if ((s = safe_steps(q2, o2, last[2], readable)) < steps) steps = s;
        if ((s = safe_steps(q3, o3, last[3], readable)) < steps) steps = s;
        if (!steps) break;
        for (; steps; steps--) {  /* the four streams' lookups interleaved: four independent chains in a short window */
            uint64_t b0 = window(in, q0), b1 = window(in, q1), b2 = window(in, q2), b3 = window(in, q3);
            for (int round = 0; round < 5; round++) {
                LOOKUP(b0, o0, table);
                LOOKUP(b1, o1, table);
                LOOKUP(b2, o2, table);
                LOOKUP(b3, o3, table);
            }
            q0 += (uint64_t)__builtin_clzll(b0);
            q1 += (uint64_t)__builtin_clzll(b1);
            q2 += (uint64_t)__builtin_clzll(b2);
            q3 += (uint64_t)__builtin_clzll(b3);
        }
    }
    uint64_t pos[] = {q0, q1, q2, q3};
    uint8_t *o[] = {o0, o1, o2, o3};
    for (int k = 0; k < KVN_HUF_STREAMS; k++)
        if (finish(pos[k], begin[k + 1], o[k], last[k], in, readable, table) != KVN_OK) return KVN_ERR_CORRUPT;
    return KVN_OK;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* With BMI2 a shift by a variable count does not wait on the cl register. */
__attribute__((target("bmi,bmi2,lzcnt"))) static int decode4_bmi2(const kvn_huf_entry *table, const uint8_t *in,
                                                              const size_t stream_len[KVN_HUF_STREAMS],
                                                              const uint8_t *readable_end, uint8_t *out, size_t n) {
    return decode4(table, in, stream_len, readable_end, out, n);
}
#endif

int kvn_huf_decode4(const kvn_huf_entry *table, const uint8_t *in, const size_t stream_len[KVN_HUF_STREAMS],
                    const uint8_t *readable_end, uint8_t *out, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (kvn_isa() >= KVN_ISA_AVX2) return decode4_bmi2(table, in, stream_len, readable_end, out, n);
#endif
    return decode4(table, in, stream_len, readable_end, out, n);
}
