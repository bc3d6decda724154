/* Repeated rows, as ctxans and ctxtans chunks name them: each row (token t, head h) of a block gets in
 * back[t * heads + h] how many tokens back the nearest earlier equal row of its head is (0: none). The
 * repeat section holds a bitmap of the repeated rows, then each one's distance - 1 as a LEB128 varint. */
#ifndef KVN_REPEATS_H
#define KVN_REPEATS_H
#include "kvn.h"

/* The repeat distances of a block of `width`-byte values; the number of repeated rows in *repeated. */
int kvn_find_repeats(const kvn_block *b, const uint8_t *src, unsigned width, uint32_t *back, size_t *repeated);
/* The repeat section (u32 length, bitmap, varints) of `rows` rows' distances, written at p; returns its end. */
uint8_t *kvn_write_repeats(uint8_t *p, const uint32_t *back, size_t rows);
/* The repeat distances a repeat section of `len` bytes gives `rows` rows; KVN_ERR_CORRUPT where it is malformed. */
int kvn_read_repeats(const uint8_t *p, size_t len, size_t rows, uint32_t *back, size_t *repeated);

#endif
