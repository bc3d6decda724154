/* Lane streams: exphuff version 2's symbols, dealt round-robin to many independent bit streams.
 *
 * Symbol i of a chunk goes to lane i % k, at position i / k; each lane is an LSB-first
 * bit stream of the block's canonical code, padded with fewer than 8 zero bits, its byte
 * length a u16 in the lane table. A GPU decodes every lane at once (neighbouring lanes
 * write neighbouring symbols); here lanes are decoded four at a time, one table lookup
 * per symbol. kvtool/_native/lanes_reference.py is the reference.
 */
#include "huffman.h"

void kvn_huf_encode_lanes(const uint8_t *sym, size_t n, size_t k, const uint16_t code[256], const uint8_t len[256],
                          uint8_t *lane_len, uint8_t *out, size_t *written) {
    uint8_t *o = out;
    for (size_t lane = 0; lane < k; lane++) {
        uint8_t *start = o;
        uint64_t acc = 0;
        unsigned nb = 0;
        for (size_t i = lane; i < n; i += k) {  /* 32 bits leave the accumulator at a time (<= 41 held) */
            acc |= (uint64_t)code[sym[i]] << nb;
            nb += len[sym[i]];
            if (nb >= 32) {
                kvn_wr32(o, (uint32_t)acc);
                o += 4;
                acc >>= 32;
                nb -= 32;
            }
        }
        for (; nb > 0; nb = nb > 8 ? nb - 8 : 0) {
            *o++ = (uint8_t)acc;
            acc >>= 8;
        }
        size_t bytes = (size_t)(o - start);
        lane_len[2 * lane] = (uint8_t)bytes;
        lane_len[2 * lane + 1] = (uint8_t)(bytes >> 8);
    }
    *written = (size_t)(o - out);
}

/* The MAXBITS bits at bit `pos` of `in` (zeros past `readable` bytes). */
static inline uint32_t window(const uint8_t *in, size_t readable, uint64_t pos) {
    size_t at = (size_t)(pos >> 3);
    uint32_t buf;
    if (at + 4 <= readable) {
        buf = kvn_rd32(in + at);
    } else {
        buf = 0;
        for (size_t b = 0; b < 3; b++) buf |= (uint32_t)(at + b < readable ? in[at + b] : 0) << (8 * b);
    }
    return (buf >> (pos & 7)) & (KVN_HUF_LUT_SIZE - 1);
}

int kvn_huf_decode_lanes(const kvn_huf_entry *lut, const uint8_t *lane_len, size_t k, const uint8_t *in, size_t size,
                         uint8_t *out, size_t n) {
    uint64_t begin = 0;
    for (size_t lane = 0; lane < k; lane += 4) {
        size_t m = k - lane < 4 ? k - lane : 4;
        uint64_t pos[4], end[4];
        for (size_t j = 0; j < m; j++) {
            pos[j] = begin;
            begin += 8 * (uint64_t)(lane_len[2 * (lane + j)] | lane_len[2 * (lane + j) + 1] << 8);
            end[j] = begin;
        }
        if (begin > 8 * (uint64_t)size) return KVN_ERR_CORRUPT;
        size_t i = lane;
        if (m == 4) {  /* four lanes side by side while all four have a symbol left */
            for (; i + 3 < n; i += k) {
                for (size_t j = 0; j < 4; j++) {
                    const kvn_huf_entry *e = &lut[window(in, size, pos[j])];
                    out[i + j] = (uint8_t)e->syms;
                    pos[j] += e->len1;
                }
            }
        }
        for (size_t j = 0; j < m; j++) {
            for (size_t at = i + j; at < n; at += k) {
                const kvn_huf_entry *e = &lut[window(in, size, pos[j])];
                out[at] = (uint8_t)e->syms;
                pos[j] += e->len1;
            }
            if (pos[j] > end[j] || end[j] - pos[j] >= 8) return KVN_ERR_CORRUPT;
        }
    }
    return begin == 8 * (uint64_t)size ? KVN_OK : KVN_ERR_CORRUPT;
}
