/* kvtool's native core: shared declarations.
 *
 * The core is plain C99 with GCC/Clang builtins. Hot loops are compiled twice
 * (AVX2 and the baseline) through KVN_MULTIVERSION and chosen at load time;
 * every variant computes the same bytes.
 */
#ifndef KVN_H
#define KVN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvtool's native core assumes a little-endian machine"
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(KVN_NO_MULTIVERSION)
#define KVN_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define KVN_MULTIVERSION
#endif

static inline uint64_t kvn_rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t kvn_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline void kvn_wr64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void kvn_wr32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

/* The vector instructions kernels use (isa.c), one level for every kernel of the process: the best level
 * this CPU (and this build) has, at most the cap set last. Every level writes and reads the same bytes. */
enum kvn_isa_level { KVN_ISA_SCALAR = 0, KVN_ISA_AVX2 = 1, KVN_ISA_AVX512 = 2 };
int kvn_isa(void);
int kvn_isa_best(void);
void kvn_isa_cap(int level);

/* XXH3-64 with seed 0 and the default secret (xxhash_spec.md), the checksum of .kvz chunks. */
uint64_t kvn_xxh3_64(const uint8_t *data, size_t len);
/* The same hash of bytes that arrive in pieces: reset, update with each piece in order, digest. */
typedef struct {
    uint64_t acc[8];
    uint64_t total;
    unsigned stripe;     /* stripes of the current 1024-byte block already accumulated */
    unsigned part_len;   /* bytes in part */
    int held;            /* whether last holds a stripe */
    uint8_t last[64];    /* the newest whole stripe, held back: it may be the input's last */
    uint8_t part[64];    /* the bytes after it, fewer than a stripe */
    uint8_t head[240];   /* the first bytes: an input of at most 240 is hashed from here */
} kvn_xxh3_state;
void kvn_xxh3_reset(kvn_xxh3_state *st);
void kvn_xxh3_update(kvn_xxh3_state *st, const uint8_t *data, size_t len);
uint64_t kvn_xxh3_digest(const kvn_xxh3_state *st);

/* ---- exphuff: one KV block [heads, tokens, dim] <-> one coded chunk (see exphuff.c) ---- */

enum kvn_dtype { KVN_BF16 = 0, KVN_FP16 = 1, KVN_FP32 = 2, KVN_FP8_E4M3 = 3, KVN_FP8_E5M2 = 4, KVN_NDTYPES };

typedef struct {
    int dtype;           /* enum kvn_dtype */
    size_t heads, tokens, dim;
    /* Elements between consecutive heads; tokens are dim apart and a token's row is contiguous. */
    size_t head_stride;
} kvn_block;

enum kvn_status {
    KVN_OK = 0,
    KVN_ERR_CORRUPT = 1,    /* the chunk is malformed */
    KVN_ERR_NOMEM = 2,
    KVN_ERR_ARG = 3,        /* unsupported dtype or geometry */
    KVN_ERR_CHECKSUM = 4,   /* stored bytes do not match their checksum */
    KVN_ERR_DECLINED = 5,   /* valid input the kernel leaves to the numpy reference (the int stage's non-finite scales) */
};

size_t kvn_itemsize(int dtype);
/* An upper bound on the bytes kvn_exphuff_encode writes for a block. */
size_t kvn_exphuff_bound(const kvn_block *b);
/* exphuff-lanes (chunk version 2) takes KVN_LANE_MIN..KVN_LANE_MAX symbols per lane stream. */
#define KVN_LANE_MIN 16
#define KVN_LANE_MAX 16384
/* Encode the block at `src` into `dst` (room for kvn_exphuff_bound bytes); the chunk length in *written.
 * `lane` 0 writes version 1 (four streams), else version 2 with `lane` symbols per lane. */
int kvn_exphuff_encode(const kvn_block *b, const void *src, uint8_t *dst, size_t *written, unsigned lane);
/* Decode a chunk of either version into the block at `dst` (laid out as b describes). */
int kvn_exphuff_decode(const kvn_block *b, const uint8_t *src, size_t len, void *dst);
/* The same values, row (h, t) (dim values) written to rows[h * tokens + t], or nowhere where that is NULL; with
 * raw_hash, the XXH3-64 of the whole block's bytes in C order (rows written nowhere included) lands there. The rows
 * are written before the hash is known: a caller that finds it wrong must treat them as garbage. */
int kvn_exphuff_decode_rows(const kvn_block *b, const uint8_t *src, size_t len, uint8_t *const *rows,
                            uint64_t *raw_hash);

/* ---- int: the lossy int:BITS stage, both ways (see intquant.c) ---- */

typedef struct {
    int dtype;             /* KVN_BF16, KVN_FP16 or KVN_FP32: the restored block's */
    size_t heads, tokens, dim;
    int bits;              /* 1..8 */
    int channel_axis;      /* groups run along a channel's tokens (else along a token's channels) */
    size_t group;          /* values per group */
    size_t groups_per_head;/* (scale, min) pairs per head in the scales plane */
} kvn_int_block;

/* Restore a C-contiguous block from its codes plane and its fp16 scales plane [heads, groups_per_head, 2]. */
int kvn_int_dequant(const kvn_int_block *b, const uint8_t *codes, size_t codes_len, const uint16_t *scales, void *out);
/* The same values, row (h, t) written to rows[h * tokens + t] (dim values), or nowhere where that is NULL: any
 * destination whose rows are contiguous. KVN_ERR_DECLINED on non-finite scales (kvn_int_dequant: KVN_ERR_ARG). */
int kvn_int_dequant_rows(const kvn_int_block *b, const uint8_t *codes, size_t codes_len, const uint16_t *scales,
                         uint8_t *const *rows);
/* Quantize a C-contiguous block into its codes plane (exactly its size) and scales plane. KVN_ERR_ARG also
 * where the reference refuses the values (non-finite, beyond fp16, a range its scale cannot hold). */
int kvn_int_quant(const kvn_int_block *b, const void *src, uint8_t *codes, size_t codes_len, uint16_t *scales);

/* ---- what a lossy round trip costs a block (see lossy_stats.c) ---- */

/* Over n values of `dtype` (bf16, fp16 or fp32), as float64: the largest |approx - exact|, and the sums of the
 * squared errors and of the squared exact values, summed pairwise in numpy's order, so the bits equal numpy's. */
int kvn_error_stats(int dtype, const void *exact, const void *approx, size_t n, double out[3]);

#endif
