/* exphuff's two halves share this: how a dtype's values split, and where decoded rows go. */
#ifndef KVN_EXPHUFF_IMPL_H
#define KVN_EXPHUFF_IMPL_H
#include "kvn.h"

typedef struct {
    unsigned width;     /* bytes per value */
    unsigned raw_bytes; /* raw bytes per value */
    uint8_t emask;      /* the exponent field within the coded byte */
    unsigned eshift;
} kvn_family;

/* Where row (h, t) of a decoded block goes: rows[h * tokens + t] (NULL: nowhere) when rows is set,
 * else base + h * head_stride + t * row bytes. */
typedef struct {
    uint8_t *base;
    size_t head_stride;  /* bytes */
    uint8_t *const *rows;
} kvn_row_map;

/* Put a block's values back together from its symbols, raw plane and channel references (the
 * symbols buffer has `dim` bytes of room after its n symbols), row by row into `to`; with `hash`,
 * also hash every row (those written nowhere too) in C order while it is still in cache. */
int kvn_exphuff_merge(const kvn_family *f, const kvn_block *b, const uint8_t *sym, const uint8_t *raw,
                      const uint8_t *refs, const kvn_row_map *to, kvn_xxh3_state *hash);

#endif
