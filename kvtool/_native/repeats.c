/* Finding and reading repeated rows (repeats.h). */
#include <stdlib.h>

#include "repeats.h"

static uint8_t *put_varint(uint8_t *p, uint32_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

uint8_t *kvn_write_repeats(uint8_t *p, const uint32_t *back, size_t rows) {
    uint8_t *body = p + 4, *q = body + (rows + 7) / 8;
    memset(body, 0, (rows + 7) / 8);
    for (size_t r = 0; r < rows; r++)
        if (back[r]) {
            body[r >> 3] |= (uint8_t)(1u << (r & 7));
            q = put_varint(q, back[r] - 1);
        }
    kvn_wr32(p, (uint32_t)(q - body));
    return q;
}

/* For each row (t, h) in back[t * heads + h]: how many tokens back the nearest earlier equal row
 * of the head is, 0 for none. Rows are found by hash and confirmed byte for byte. */
int kvn_find_repeats(const kvn_block *b, const uint8_t *src, unsigned width, uint32_t *back, size_t *repeated) {
    size_t T = b->tokens, row_bytes = b->dim * width, size = 16;
    while (size < 2 * T) size <<= 1;
    uint64_t *hashes = malloc(size * sizeof(uint64_t));
    uint32_t *latest = malloc(size * sizeof(uint32_t)); /* token + 1 of the latest row with that hash; 0: empty */
    if (!hashes || !latest) {
        free(hashes);
        free(latest);
        return KVN_ERR_NOMEM;
    }
    *repeated = 0;
    for (size_t h = 0; h < b->heads; h++) {
        const uint8_t *head = src + h * b->head_stride * width;
        memset(latest, 0, size * sizeof(uint32_t));
        for (size_t t = 0; t < T; t++) {
            const uint8_t *row = head + t * row_bytes;
            uint64_t hash = kvn_xxh3_64(row, row_bytes);
            size_t slot = (size_t)hash & (size - 1);
            while (latest[slot] && hashes[slot] != hash) slot = (slot + 1) & (size - 1);
            uint32_t found = 0;
            if (latest[slot]) {
                size_t prev = latest[slot] - 1;
                if (!memcmp(head + prev * row_bytes, row, row_bytes)) found = (uint32_t)(t - prev);
                else /* two rows with one hash: look back row by row, as the format defines */
                    for (size_t u = t; u-- > 0;)
                        if (!memcmp(head + u * row_bytes, row, row_bytes)) { found = (uint32_t)(t - u); break; }
            }
            hashes[slot] = hash;
            latest[slot] = (uint32_t)(t + 1);
            back[t * b->heads + h] = found;
            *repeated += found != 0;
        }
    }
    free(hashes);
    free(latest);
    return KVN_OK;
}

int kvn_read_repeats(const uint8_t *p, size_t len, size_t rows, uint32_t *back, size_t *repeated) {
    size_t bitmap = (rows + 7) / 8;
    if (len < bitmap) return KVN_ERR_CORRUPT;
    if ((rows & 7) && (p[bitmap - 1] >> (rows & 7))) return KVN_ERR_CORRUPT;
    const uint8_t *q = p + bitmap, *end = p + len;
    *repeated = 0;
    for (size_t r = 0; r < rows; r++) {
        back[r] = 0;
        if (!(p[r >> 3] >> (r & 7) & 1)) continue;
        uint64_t v = 0;
        for (unsigned shift = 0;; shift += 7) {
            if (q == end || shift > 28) return KVN_ERR_CORRUPT;
            uint8_t byte = *q++;
            v |= (uint64_t)(byte & 0x7F) << shift;
            if (!(byte & 0x80)) break;
        }
        if (v >= 0xFFFFFFFFu) return KVN_ERR_CORRUPT;
        back[r] = (uint32_t)v + 1;
        ++*repeated;
    }
    return q == end ? KVN_OK : KVN_ERR_CORRUPT;
}
