/* The lossy `pca` stage's block plane (pca.c; kvtool/layouts/pca_reference.py is the reference). */
#ifndef KVN_PCA_H
#define KVN_PCA_H
#include "kvn.h"

#define KVN_PCA_VERSION 1
#define KVN_PCA_HEAD 28
#define KVN_PCA_SLACK 64
#define KVN_PCA_STATES 8
#define KVN_PCA_PROB_BITS 11
#define KVN_PCA_LOW (1u << 16)
#define KVN_PCA_SYMBOLS 64
#define KVN_PCA_MAX_SYMBOL 60
#define KVN_PCA_MAX_CLASSES 32
#define KVN_PCA_MAX_Q 32767
#define KVN_PCA_MAX_SUM (1 << 17)
#define KVN_PCA_MAX_POSITION (1ull << 40)
#define KVN_PCA_BASIS_BITS 14

/* One tensor's coder: built once from its dictionary's basis, the recipe's step and the coefficient tables. */
typedef struct {
    size_t heads, dim, width, components;
    int classes, rope;
    uint8_t tag[4];
    float step, gain;          /* gain: step * 2^-14, the float32 the inverse multiplies the integer sums by */
    double inverse, mean_max;  /* 1 / step; the largest |mean| */
    float *mean;               /* [width] */
    float *weights;            /* [width][components]: the basis times 2^-14, by value, for the forward */
    int16_t *basis;            /* [components][width] */
    float *freqs;              /* [dim / 2] where keys are de-rotated */
    uint16_t freq[KVN_PCA_MAX_CLASSES + 1][KVN_PCA_SYMBOLS], cum[KVN_PCA_MAX_CLASSES + 1][KVN_PCA_SYMBOLS];
    /* The encoder's: ceil(2^64 / freq), so that a state x < 2^32 over freq is (x * rcp) >> 64 exactly (the error,
     * under x / 2^64 < 2^-32, is below the 1 / freq >= 2^-11 that parts x / freq from the next integer); freq 1
     * is taken as it is. */
    uint64_t rcp[KVN_PCA_MAX_CLASSES + 1][KVN_PCA_SYMBOLS];
    int64_t table_costs[KVN_PCA_MAX_CLASSES][KVN_PCA_SYMBOLS], class_costs[KVN_PCA_MAX_CLASSES + 1];
    /* The decoder's: per model and slot, (frequency, slot - cumulative frequency, symbol) packed as 12, 11 and 6
     * bits, in a table every coder of the same coefficient tables (one dictionary's tensors) shares, so a
     * restore that goes from tensor to tensor reads one table from the cache, not one per tensor; the basis
     * rows two by two, row 2p's entry in the low and row 2p + 1's in the high half of an int32
     * ([ceil(c / 2)][width], zero past the last row). */
    const uint32_t (*slots)[1 << KVN_PCA_PROB_BITS];
    void *shared;              /* the bindings' handle on the shared table */
    int32_t *pairs;
} kvn_pca_model;

/* The plane's bytes for a block of `tokens` tokens of `dtype`. */
size_t kvn_pca_plane_size(const kvn_pca_model *m, int dtype, size_t tokens);
/* Code the C-contiguous block [heads][tokens][dim] at src (first token at sequence `position`; exact_in[t]
 * nonzero keeps token t exact) into the plane (exactly kvn_pca_plane_size bytes, written whole). KVN_ERR_ARG
 * for a dtype or geometry the stage does not take, or a non-finite value. */
int kvn_pca_encode(const kvn_pca_model *m, int dtype, size_t tokens, const void *src, uint64_t position,
                   const uint8_t *exact_in, uint8_t *plane, size_t plane_len);
/* Restore a plane: row (h, t) of the block to rows[h * tokens + t] (dim values of `dtype`), or nowhere where
 * that is NULL. KVN_ERR_CORRUPT where the plane is malformed; rows may then hold part of the block. */
int kvn_pca_decode_rows(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                        uint8_t *const *rows);

/* The rotary angles (cos, sin: [count][half]) of the positions first .. first + count - 1 under the frequencies
 * `freqs`, kept between the blocks of one restore: every key tensor of a dictionary turns a token by the same
 * angles, so a run of blocks of one span of positions computes them once. Zero-initialised; freed with
 * kvn_pca_angles_free. */
typedef struct {
    float *cs, *sn, *freqs;
    size_t cap, half, count;
    uint64_t first;
} kvn_pca_angles;
/* kvn_pca_decode_rows with the angles kept in `angles` (NULL: each token's computed as it is restored). */
int kvn_pca_decode_rows_with(const kvn_pca_model *m, int dtype, size_t tokens, const uint8_t *plane, size_t plane_len,
                             uint8_t *const *rows, kvn_pca_angles *angles);
void kvn_pca_angles_free(kvn_pca_angles *angles);

#endif
