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

static uint16_t reverse_bits(uint16_t code, int bits) {
    uint16_t r = 0;
    for (int b = 0; b < bits; b++) r |= (uint16_t)(((code >> b) & 1u) << (bits - 1 - b));
    return r;
}

void kvn_huf_codes(const uint8_t len[256], uint16_t code[256]) {
    unsigned bl_count[KVN_HUF_MAXBITS + 2] = {0};
    uint16_t next[KVN_HUF_MAXBITS + 2];
    for (int s = 0; s < 256; s++) bl_count[len[s]]++;
    bl_count[0] = 0;
    uint16_t c = 0;
    for (int l = 1; l <= KVN_HUF_MAXBITS; l++) {
        c = (uint16_t)((c + bl_count[l - 1]) << 1);
        next[l] = c;
    }
    for (int s = 0; s < 256; s++) code[s] = len[s] ? reverse_bits(next[len[s]]++, len[s]) : 0;
}

int kvn_huf_table(const uint8_t len[256], kvn_huf_entry lut[KVN_HUF_LUT_SIZE]) {
    uint32_t kraft = 0;  /* in units of 2^-MAXBITS */
    for (int s = 0; s < 256; s++) {
        if (len[s] > KVN_HUF_MAXBITS) return KVN_ERR_CORRUPT;
        if (len[s]) kraft += KVN_HUF_LUT_SIZE >> len[s];
    }
    if (kraft != KVN_HUF_LUT_SIZE) return KVN_ERR_CORRUPT;
    uint16_t code[256];
    kvn_huf_codes(len, code);
    /* First each slot's first symbol and its length. Then, in increasing order, slot i = its first
     * symbol (l bits) followed by what slot i >> l (final already, as i >> l < i) holds within the
     * L - l bits left; `ends` keeps per slot the bit position where each of its symbols ends
     * (255: no such symbol). */
    static const uint32_t KEEP[4] = {0xFFu, 0xFFFFu, 0xFFFFFFu, 0xFFFFFFFFu};
    uint8_t first[KVN_HUF_LUT_SIZE], first_len[KVN_HUF_LUT_SIZE];
    uint32_t syms[KVN_HUF_LUT_SIZE], ends[KVN_HUF_LUT_SIZE];
    for (int s = 0; s < 256; s++) {
        if (!len[s]) continue;
        for (uint32_t i = code[s]; i < KVN_HUF_LUT_SIZE; i += 1u << len[s]) {
            first[i] = (uint8_t)s;
            first_len[i] = len[s];
        }
    }
    for (uint32_t i = 0; i < KVN_HUF_LUT_SIZE; i++) {
        uint32_t l1 = first_len[i], left = KVN_HUF_MAXBITS - l1, sym = first[i];
        uint32_t rest_syms, rest_ends;
        if (i == 0) {  /* slot 0's tail is all zero bits: slot 0 again */
            rest_syms = sym * 0x01010101u;
            rest_ends = l1 | (2 * l1) << 8 | (3 * l1) << 16 | 0xFFu << 24;
        } else {
            rest_syms = syms[i >> l1];
            rest_ends = ends[i >> l1];
        }
        /* how many of the rest's symbols end within `left` bits (ends increase; 255 marks none) */
        uint32_t k = ((rest_ends & 0xFFu) <= left) + (((rest_ends >> 8) & 0xFFu) <= left) +
                     (((rest_ends >> 16) & 0xFFu) <= left);
        uint32_t keep = KEEP[k];
        uint32_t e = ((((rest_ends << 8) + l1 * 0x01010100u) | l1) & keep) | ~keep;
        ends[i] = e;
        syms[i] = (sym | rest_syms << 8) & keep;
        lut[i] = (kvn_huf_entry){syms[i], (uint8_t)(k + 1), 0, (uint8_t)l1, (uint8_t)(e >> (8 * k))};
    }
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
 * streams run side by side. A table slot (uint64): symbols in bits 0-31, their count in
 * bits 32-39, the first one's length in bits 48-55, all their bits in bits 56-63. */
#define KVN_HUF_STEP(pos, o, in, lut)                                          \
    do {                                                                       \
        uint64_t buf_ = (kvn_rd64((in) + ((pos) >> 3)) >> ((pos) & 7)) | 1ull << 63; \
        for (int step_ = 0; step_ < 5; step_++) {                              \
            uint64_t e_ = (lut)[buf_ & (KVN_HUF_LUT_SIZE - 1)];                \
            kvn_wr32(o, (uint32_t)e_);                                         \
            o += (uint8_t)(e_ >> 32);                                          \
            buf_ >>= e_ >> 56;                                                 \
        }                                                                      \
        pos += (uint64_t)__builtin_clzll(buf_);                                \
    } while (0)

/* Room for a step: 20 symbols of output, 8 readable bytes at the position. */
#define FAST_OK(pos, o, oend) ((oend) - (o) >= 20 && ((pos) >> 3) + 8 <= readable)

/* Finish one stream (bits [pos, end_bit) of `in`) symbol by symbol, reading zeros past its end,
 * and check that it was used up exactly. */
static int finish(uint64_t pos, uint64_t end_bit, uint8_t *o, uint8_t *oend, const uint8_t *in, uint64_t readable,
                  const uint64_t *lut) {
    while (FAST_OK(pos, o, oend)) KVN_HUF_STEP(pos, o, in, lut);
    uint64_t end_byte = (end_bit + 7) >> 3;
    while (o < oend) {
        uint64_t buf = 0;
        for (uint64_t b = 0; b < 3; b++) {  /* 3 bytes hold MAXBITS (<= 17) bits from any bit offset */
            uint64_t at = (pos >> 3) + b;
            buf |= (uint64_t)(at < end_byte ? in[at] : 0) << (8 * b);
        }
        uint64_t e = lut[(buf >> (pos & 7)) & (KVN_HUF_LUT_SIZE - 1)];
        *o++ = (uint8_t)e;
        pos += (e >> 48) & 0xFF;
    }
    if (pos > end_bit || end_bit - pos >= 8) return KVN_ERR_CORRUPT;
    return KVN_OK;
}

static inline __attribute__((always_inline)) int decode4(const kvn_huf_entry *table, const uint8_t *in,
                                                        const size_t stream_len[KVN_HUF_STREAMS],
                                                        const uint8_t *readable_end, uint8_t *out, size_t n) {
    const uint64_t *lut = (const uint64_t *)table;
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
    while (FAST_OK(q0, o0, last[0]) && FAST_OK(q1, o1, last[1]) && FAST_OK(q2, o2, last[2]) &&
           FAST_OK(q3, o3, last[3])) {
        KVN_HUF_STEP(q0, o0, in, lut);
        KVN_HUF_STEP(q1, o1, in, lut);
        KVN_HUF_STEP(q2, o2, in, lut);
        KVN_HUF_STEP(q3, o3, in, lut);
    }
    uint64_t pos[] = {q0, q1, q2, q3};
    uint8_t *o[] = {o0, o1, o2, o3};
    for (int k = 0; k < KVN_HUF_STREAMS; k++)
        if (finish(pos[k], begin[k + 1], o[k], last[k], in, readable, lut) != KVN_OK) return KVN_ERR_CORRUPT;
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
    if (__builtin_cpu_supports("bmi2")) return decode4_bmi2(table, in, stream_len, readable_end, out, n);
#endif
    return decode4(table, in, stream_len, readable_end, out, n);
}
