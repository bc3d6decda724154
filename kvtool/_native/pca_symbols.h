/* The coefficient stream of a `pca` plane, read a token at a time: eight interleaved rANS states over 16-bit
 * words (symbol k of the stream takes state k % 8), then the extra bits of each large coefficient, LSB first.
 * A portable reader and, on x86-64, one that steps the eight states as the lanes of an AVX2 register; both give
 * the same coefficients and refuse the same streams (pca_decode.c calls them; pca_reference.py is the spec). */
#ifndef KVN_PCA_SYMBOLS_H
#define KVN_PCA_SYMBOLS_H

#include "pca.h"

/* The magnitude base, extra bits and sign of each symbol (zero for symbol 0; a value beyond KVN_PCA_MAX_Q for
 * the symbols the format does not use). */
typedef struct { uint16_t base; uint8_t nbits, negative; } kvn_pca_symbol;

typedef struct {
    uint32_t x[KVN_PCA_STATES];
    unsigned phase;        /* the state of the next symbol: phase % 8 */
    const uint8_t *words;  /* the stream's words; at least 8 readable words past the last (pos is clamped there) */
    size_t pos, nwords;
    const uint8_t *bytes;  /* the extra bits */
    size_t at_byte, nbytes;
    uint64_t acc;
    unsigned fill;
} kvn_pca_reader;

/* One token's coefficients: component live[k] (k < nlive) decoded with slot row base[k] of `slots` (its class
 * times 2^11) into q16[live[k]]. Nonzero where the stream is malformed (a symbol the format does not use, a value
 * beyond KVN_PCA_MAX_Q, extra bits past the end; words past the end show as pos > nwords); *total: sum of |q|. */
typedef uint32_t (*kvn_pca_token_fn)(kvn_pca_reader *r, const uint32_t *slots, const uint32_t *live,
                                     const uint32_t *base, size_t nlive, const kvn_pca_symbol *info, uint16_t *q16,
                                     uint32_t *total);

uint32_t kvn_pca_token_scalar(kvn_pca_reader *r, const uint32_t *slots, const uint32_t *live, const uint32_t *base,
                              size_t nlive, const kvn_pca_symbol *info, uint16_t *q16, uint32_t *total);
#if defined(__x86_64__) && defined(__GNUC__)
#define KVN_PCA_TOKEN_AVX2 1
uint32_t kvn_pca_token_avx2(kvn_pca_reader *r, const uint32_t *slots, const uint32_t *live, const uint32_t *base,
                            size_t nlive, const kvn_pca_symbol *info, uint16_t *q16, uint32_t *total);
#endif

#endif
