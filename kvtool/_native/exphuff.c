/* exphuff: a float KV block as Huffman-coded exponents and raw sign/mantissa bits.
 *
 * A block is [heads, tokens, dim] values of one float dtype. Every value is cut
 * into a *coded byte* (the exponent field, for fp16 with the top three
 * mantissa bits, for fp8 the whole value) and *raw bits* (the sign and the
 * remaining mantissa bits). A channel (one head and dim position) keeps its
 * scale over the tokens, so its exponents cluster; subtracting the channel's
 * reference exponent (the floor of their mean) lines every channel up, and
 * one Huffman code per block then comes close to a code per channel. The raw
 * bits are nearly random and are stored as they are.
 *
 * Chunk (little-endian), docs/FORMAT.md has the full description:
 *   u8 version (1) | u8 mode | refs[heads * dim] | raw plane | mode 1: u8 symbol
 *   mode 0: used-symbol bitmap[32] | 4-bit code lengths | u32 stream lengths[4] | streams
 * Version 2 (exphuff-lanes, for parallel decoders; lanes.c): the same up to the raw plane, then
 *   mode 0: u16 symbols per lane L | bitmap | lengths | u16 lane lengths[ceil(N / L)] | lanes
 */
#include <stdlib.h>

#include "exphuff_impl.h"
#include "huffman.h"

#define VERSION 1
#define VERSION_LANES 2
#define MODE_CODED 0
#define MODE_ONE_SYMBOL 1

typedef kvn_family family;

static const family FAMILIES[KVN_NDTYPES] = {
    [KVN_BF16] = {2, 1, 0xFF, 0},
    [KVN_FP16] = {2, 1, 0xF8, 3},
    [KVN_FP32] = {4, 3, 0xFF, 0},
    [KVN_FP8_E4M3] = {1, 0, 0x78, 3},
    [KVN_FP8_E5M2] = {1, 0, 0x7C, 2},
};

size_t kvn_itemsize(int dtype) { return dtype >= 0 && dtype < KVN_NDTYPES ? FAMILIES[dtype].width : 0; }

static int check_block(const kvn_block *b) {
    if (b->dtype < 0 || b->dtype >= KVN_NDTYPES) return KVN_ERR_ARG;
    if (b->heads > 1 && b->head_stride < b->tokens * b->dim) return KVN_ERR_ARG;
    return KVN_OK;
}

static size_t header_size(const kvn_block *b) { return 2 + b->heads * b->dim; }

size_t kvn_exphuff_bound(const kvn_block *b) {
    size_t n = b->heads * b->tokens * b->dim;
    size_t streams = (n * KVN_HUF_MAXBITS + 7) / 8 + KVN_HUF_STREAMS * 2;
    size_t lanes = 2 + 3 * (n / KVN_LANE_MIN + 1);  /* version 2: L, a u16 and a partial byte per lane */
    return header_size(b) + n * FAMILIES[b->dtype].raw_bytes + 32 + 128 + 16 + streams + lanes + 8;
}

/* ---- splitting values ----------------------------------------------------------------- */

/* The loops below are written once and instantiated per value width, so each copy vectorises. */
#define KVN_INLINE static inline __attribute__((always_inline))

KVN_INLINE unsigned coded_byte(const uint8_t *row, size_t d, unsigned width) {
    if (width == 2) { uint16_t v; memcpy(&v, row + 2 * d, 2); return (v >> 7) & 0xFFu; }
    if (width == 4) { uint32_t v; memcpy(&v, row + 4 * d, 4); return (v >> 23) & 0xFFu; }
    return row[d];
}

KVN_INLINE void channel_refs_w(const family *f, const kvn_block *b, const uint8_t *src, uint8_t *refs,
                               uint32_t *restrict sum, unsigned width) {
    size_t dim = b->dim;
    uint8_t emask = f->emask;
    unsigned eshift = f->eshift;
    for (size_t h = 0; h < b->heads; h++) {
        memset(sum, 0, dim * sizeof(uint32_t));
        for (size_t t = 0; t < b->tokens; t++) {
            const uint8_t *row = src + (h * b->head_stride + t * dim) * width;
            for (size_t d = 0; d < dim; d++) sum[d] += (coded_byte(row, d, width) & emask) >> eshift;
        }
        for (size_t d = 0; d < dim; d++) refs[h * dim + d] = b->tokens ? (uint8_t)(sum[d] / b->tokens) : 0;
    }
}

KVN_INLINE void split_w(const family *f, const kvn_block *b, const uint8_t *src, const uint8_t *refs,
                        uint8_t *restrict shifted, uint8_t *restrict sym, uint8_t *restrict raw, unsigned width) {
    size_t dim = b->dim;
    uint8_t keep = (uint8_t)~f->emask, emask = f->emask;
    for (size_t h = 0; h < b->heads; h++) {
        for (size_t d = 0; d < dim; d++) shifted[d] = (uint8_t)(refs[h * dim + d] << f->eshift);
        for (size_t t = 0; t < b->tokens; t++) {
            size_t i = (h * b->tokens + t) * dim;
            const uint8_t *row = src + (h * b->head_stride + t * dim) * width;
            uint8_t *restrict s = sym + i;
            for (size_t d = 0; d < dim; d++) {
                uint8_t c = (uint8_t)coded_byte(row, d, width);
                s[d] = (uint8_t)((c & keep) | ((uint8_t)(c - shifted[d]) & emask));
            }
            if (width == 2) {
                uint8_t *restrict r = raw + i;
                for (size_t d = 0; d < dim; d++) {
                    uint16_t v;
                    memcpy(&v, row + 2 * d, 2);
                    r[d] = (uint8_t)(((v >> 8) & 0x80) | (v & 0x7F));
                }
            } else if (width == 4) {
                uint8_t *restrict r = raw + 3 * i;
                for (size_t d = 0; d < dim; d++) {
                    uint32_t v;
                    memcpy(&v, row + 4 * d, 4);
                    uint32_t bits = ((v >> 8) & 0x800000u) | (v & 0x7FFFFFu);
                    r[3 * d] = (uint8_t)bits;
                    r[3 * d + 1] = (uint8_t)(bits >> 8);
                    r[3 * d + 2] = (uint8_t)(bits >> 16);
                }
            }
        }
    }
}

KVN_MULTIVERSION
static void channel_refs(const family *f, const kvn_block *b, const uint8_t *src, uint8_t *refs, uint32_t *sum) {
    switch (f->width) {
    case 2: channel_refs_w(f, b, src, refs, sum, 2); break;
    case 4: channel_refs_w(f, b, src, refs, sum, 4); break;
    default: channel_refs_w(f, b, src, refs, sum, 1);
    }
}

KVN_MULTIVERSION
static void split(const family *f, const kvn_block *b, const uint8_t *src, const uint8_t *refs, uint8_t *shifted,
                  uint8_t *sym, uint8_t *raw) {
    switch (f->width) {
    case 2: split_w(f, b, src, refs, shifted, sym, raw, 2); break;
    case 4: split_w(f, b, src, refs, shifted, sym, raw, 4); break;
    default: split_w(f, b, src, refs, shifted, sym, raw, 1);
    }
}

static void histogram(const uint8_t *sym, size_t n, uint32_t count[256]) {
    uint32_t hist[4][256];
    memset(hist, 0, sizeof(hist));
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {  /* four tables: consecutive equal symbols do not wait on each other */
        hist[0][sym[i]]++;
        hist[1][sym[i + 1]]++;
        hist[2][sym[i + 2]]++;
        hist[3][sym[i + 3]]++;
    }
    for (; i < n; i++) hist[0][sym[i]]++;
    for (int s = 0; s < 256; s++) count[s] = hist[0][s] + hist[1][s] + hist[2][s] + hist[3][s];
}

/* ---- encode --------------------------------------------------------------------------- */

int kvn_exphuff_encode(const kvn_block *b, const void *src_, uint8_t *dst, size_t *written, unsigned lane) {
    int rc = check_block(b);
    if (rc) return rc;
    if (lane && (lane < KVN_LANE_MIN || lane > KVN_LANE_MAX)) return KVN_ERR_ARG;
    const family *f = &FAMILIES[b->dtype];
    const uint8_t *src = src_;
    size_t n = b->heads * b->tokens * b->dim, channels = b->heads * b->dim;
    uint8_t *refs = dst + 2, *raw = refs + channels, *p = raw + n * f->raw_bytes;
    dst[0] = lane ? VERSION_LANES : VERSION;
    uint8_t *sym = malloc(n + 1);
    uint8_t *streams = malloc(KVN_HUF_STREAMS * (((n + KVN_HUF_STREAMS - 1) / KVN_HUF_STREAMS * KVN_HUF_MAXBITS + 7) / 8 + 8));
    uint32_t *sum = malloc((b->dim + 1) * sizeof(uint32_t));
    uint8_t *shifted = malloc(b->dim + 1);
    if (!sym || !streams || !sum || !shifted) { rc = KVN_ERR_NOMEM; goto done; }
    channel_refs(f, b, src, refs, sum);
    split(f, b, src, refs, shifted, sym, raw);
    uint32_t count[256];
    histogram(sym, n, count);
    uint8_t len[256];
    int used = kvn_huf_lengths(count, len);
    if (used <= 1) {
        dst[1] = MODE_ONE_SYMBOL;
        *p++ = n ? sym[0] : 0;
        *written = (size_t)(p - dst);
        goto done;
    }
    dst[1] = MODE_CODED;
    if (lane) {
        *p++ = (uint8_t)lane;
        *p++ = (uint8_t)(lane >> 8);
    }
    memset(p, 0, 32);
    for (int s = 0; s < 256; s++)
        if (len[s]) p[s >> 3] |= (uint8_t)(1u << (s & 7));
    p += 32;
    int k = 0;
    for (int s = 0; s < 256; s++) {
        if (!len[s]) continue;
        if (k & 1) p[k >> 1] |= (uint8_t)(len[s] << 4);
        else p[k >> 1] = len[s];
        k++;
    }
    p += (used + 1) / 2;
    uint16_t code[256];
    kvn_huf_codes(len, code);
    if (lane) {
        size_t k = (n + lane - 1) / lane, bytes;
        kvn_huf_encode_lanes(sym, n, k, code, len, p, p + 2 * k, &bytes);
        *written = (size_t)(p + 2 * k + bytes - dst);
        goto done;
    }
    uint8_t *lens = p;
    p += 4 * KVN_HUF_STREAMS;
    size_t seg = (n + KVN_HUF_STREAMS - 1) / KVN_HUF_STREAMS, room = (seg * KVN_HUF_MAXBITS + 7) / 8 + 8;
    uint8_t *parts[KVN_HUF_STREAMS];
    size_t part_len[KVN_HUF_STREAMS];
    for (int j = 0; j < KVN_HUF_STREAMS; j++) parts[j] = streams + j * room;
    kvn_huf_encode4(sym, n, code, len, parts, part_len);
    for (int j = 0; j < KVN_HUF_STREAMS; j++) {
        kvn_wr32(lens + 4 * j, (uint32_t)part_len[j]);
        memcpy(p, parts[j], part_len[j]);
        p += part_len[j];
    }
    *written = (size_t)(p - dst);
done:
    free(sym);
    free(streams);
    free(sum);
    free(shifted);
    return rc;
}

/* ---- decode --------------------------------------------------------------------------- */

/* Version 2's lane table and lanes, from `p` to the chunk's end, into n symbols. */
static int decode_lanes(const uint8_t len[256], const uint8_t *p, const uint8_t *end, uint8_t *sym, size_t n, size_t lane) {
    size_t k = (n + lane - 1) / lane;
    if ((size_t)(end - p) / 2 < k) return KVN_ERR_CORRUPT;
    kvn_huf_entry *lut = malloc(sizeof(kvn_huf_entry) * KVN_HUF_LUT_SIZE);
    if (!lut) return KVN_ERR_NOMEM;
    int rc = kvn_huf_table(len, lut);
    if (!rc) rc = kvn_huf_decode_lanes(lut, p, k, p + 2 * k, (size_t)(end - p) - 2 * k, sym, n);
    free(lut);
    return rc;
}

/* A chunk's symbols into sym (n of them, with 32 bytes of room after), and where its raw plane and
 * channel references lie. */
static int decode_symbols(const family *f, const kvn_block *b, const uint8_t *src, size_t len_, uint8_t *sym,
                          const uint8_t **raw_at, const uint8_t **refs_at) {
    size_t n = b->heads * b->tokens * b->dim, channels = b->heads * b->dim;
    const uint8_t *end = src + len_;
    size_t fixed = 2 + channels + n * f->raw_bytes;
    if (len_ < fixed + 1 || (src[0] != VERSION && src[0] != VERSION_LANES) || src[1] > MODE_ONE_SYMBOL) return KVN_ERR_CORRUPT;
    const uint8_t *refs = src + 2, *raw = refs + channels, *p = raw + n * f->raw_bytes;
    unsigned eref_max = f->emask >> f->eshift;
    for (size_t c = 0; c < channels; c++)
        if (refs[c] > eref_max) return KVN_ERR_CORRUPT;
    *raw_at = raw;
    *refs_at = refs;
    if (src[1] == MODE_ONE_SYMBOL) {
        if (len_ != fixed + 1) return KVN_ERR_CORRUPT;
        memset(sym, *p, n);
        return KVN_OK;
    }
    size_t lane = 0;
    if (src[0] == VERSION_LANES) {
        if ((size_t)(end - p) < 2) return KVN_ERR_CORRUPT;
        lane = (size_t)p[0] | (size_t)p[1] << 8;
        p += 2;
        if (lane < KVN_LANE_MIN || lane > KVN_LANE_MAX) return KVN_ERR_CORRUPT;
    }
    if ((size_t)(end - p) < 32) return KVN_ERR_CORRUPT;
    const uint8_t *bitmap = p;
    p += 32;
    int used = 0;
    for (int i = 0; i < 32; i++)
        for (unsigned bits = bitmap[i]; bits; bits &= bits - 1) used++;
    if (used < 2 || (size_t)(end - p) < (size_t)(used + 1) / 2 + (lane ? 0 : 4 * KVN_HUF_STREAMS)) return KVN_ERR_CORRUPT;
    uint8_t len[256] = {0};
    int k = 0;
    for (int s = 0; s < 256; s++) {
        if (!(bitmap[s >> 3] >> (s & 7) & 1)) continue;
        len[s] = (p[k >> 1] >> (4 * (k & 1))) & 0xF;
        if (len[s] == 0) return KVN_ERR_CORRUPT;
        k++;
    }
    if ((used & 1) && (p[used >> 1] >> 4)) return KVN_ERR_CORRUPT;
    p += (used + 1) / 2;
    if (lane) return decode_lanes(len, p, end, sym, n, lane);
    size_t stream_len[KVN_HUF_STREAMS], total = 0;
    for (int j = 0; j < KVN_HUF_STREAMS; j++) {
        stream_len[j] = kvn_rd32(p + 4 * j);
        total += stream_len[j];
    }
    p += 4 * KVN_HUF_STREAMS;
    if (total != (size_t)(end - p)) return KVN_ERR_CORRUPT;
    kvn_huf_entry *lut = malloc(sizeof(kvn_huf_entry) * KVN_HUF_LUT_SIZE);
    if (!lut) return KVN_ERR_NOMEM;
    int rc = kvn_huf_table(len, lut);
    if (!rc) rc = kvn_huf_decode4(lut, p, stream_len, end, sym, n);
    free(lut);
    return rc;
}

static int decode_into(const kvn_block *b, const uint8_t *src, size_t len, const kvn_row_map *to, kvn_xxh3_state *hash) {
    int rc = check_block(b);
    if (rc) return rc;
    const family *f = &FAMILIES[b->dtype];
    uint8_t *sym = malloc(b->heads * b->tokens * b->dim + 32);
    if (!sym) return KVN_ERR_NOMEM;
    const uint8_t *raw = NULL, *refs = NULL;
    rc = decode_symbols(f, b, src, len, sym, &raw, &refs);
    if (!rc) rc = kvn_exphuff_merge(f, b, sym, raw, refs, to, hash);
    free(sym);
    return rc;
}

int kvn_exphuff_decode(const kvn_block *b, const uint8_t *src, size_t len, void *dst) {
    kvn_row_map to = {dst, b->head_stride * kvn_itemsize(b->dtype), NULL};
    return decode_into(b, src, len, &to, NULL);
}

int kvn_exphuff_decode_rows(const kvn_block *b, const uint8_t *src, size_t len, uint8_t *const *rows,
                            uint64_t *raw_hash) {
    kvn_row_map to = {NULL, 0, rows};
    kvn_xxh3_state *hash = raw_hash ? malloc(sizeof(kvn_xxh3_state)) : NULL;
    if (raw_hash && !hash) return KVN_ERR_NOMEM;
    if (hash) kvn_xxh3_reset(hash);
    int rc = decode_into(b, src, len, &to, hash);
    if (hash && !rc) *raw_hash = kvn_xxh3_digest(hash);
    free(hash);
    return rc;
}
