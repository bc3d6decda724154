/* Canonical, length-limited Huffman codes over byte symbols, four interleaved streams. */
#ifndef KVN_HUFFMAN_H
#define KVN_HUFFMAN_H
#include "kvn.h"

/* Codes are at most this long: a table of 2^MAXBITS slots is built for every chunk, so
 * it is kept small (10 bits cost 0.1% of ratio against 11 and save a third of the build). */
#define KVN_HUF_MAXBITS 10
#define KVN_HUF_LUT_SIZE (1u << KVN_HUF_MAXBITS)
#define KVN_HUF_STREAMS 4

/* One decode-table slot: up to four symbols that the next KVN_HUF_MAXBITS bits begin with. */
typedef struct {
    uint32_t syms;   /* the symbols, first in the low byte */
    uint8_t count;   /* how many (>= 1) */
    uint8_t pad;
    uint8_t len1;    /* bits the first one takes */
    uint8_t bits;    /* bits they take together */
} kvn_huf_entry;

/* Code lengths (0 = unused) for the counts; returns the number of used symbols. */
int kvn_huf_lengths(const uint32_t count[256], uint8_t len[256]);
/* Canonical codes for the lengths, bit-reversed for an LSB-first stream. */
void kvn_huf_codes(const uint8_t len[256], uint16_t code[256]);
/* The decode table; KVN_ERR_CORRUPT unless the lengths form a complete code. */
int kvn_huf_table(const uint8_t len[256], kvn_huf_entry lut[KVN_HUF_LUT_SIZE]);
/* Symbols of stream k: [k * seg, min(n, (k + 1) * seg)) with seg = ceil(n / 4). */
size_t kvn_huf_segment(size_t n, int k, size_t *start);
/* Bit-pack the n symbols LSB first into four streams at out[k] (each with room for its
 * segment at KVN_HUF_MAXBITS bits a symbol plus 8 bytes); their lengths in written[k]. */
void kvn_huf_encode4(const uint8_t *sym, size_t n, const uint16_t code[256], const uint8_t len[256],
                     uint8_t *out[KVN_HUF_STREAMS], size_t written[KVN_HUF_STREAMS]);
/* Decode four streams (lengths in stream_len, back to back at `in`) into n symbols.
 * Bytes up to `readable_end` may be read (not used) past the streams. */
int kvn_huf_decode4(const kvn_huf_entry *lut, const uint8_t *in, const size_t stream_len[KVN_HUF_STREAMS],
                    const uint8_t *readable_end, uint8_t *out, size_t n);
/* exphuff version 2 (lanes.c): symbol i to lane i % k, each lane byte-padded, its length a u16
 * (little-endian) in lane_len; the lanes back to back at out, their total in *written. */
void kvn_huf_encode_lanes(const uint8_t *sym, size_t n, size_t k, const uint16_t code[256], const uint8_t len[256],
                          uint8_t *lane_len, uint8_t *out, size_t *written);
/* Decode k lanes (lengths in lane_len, `size` bytes back to back at `in`) into n symbols. */
int kvn_huf_decode_lanes(const kvn_huf_entry *lut, const uint8_t *lane_len, size_t k, const uint8_t *in, size_t size,
                         uint8_t *out, size_t n);

#endif
