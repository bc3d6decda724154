/* The lossy `int:BITS` stage (kvtool/layouts/int_quant.py, which is the reference), both ways.
 *
 * Forward: per group the least value rounded down to fp16 (`min`) and (max - min) / (2^BITS - 1)
 * rounded up to fp16 (`scale`), computed in double as numpy does; each code is
 * round-half-even((value - min) / scale), packed most significant bit first. Values the reference
 * refuses (NaN, infinity, beyond fp16, ranges a scale cannot hold, codes that would come back
 * infinite) make it decline (KVN_ERR_ARG), and the reference raises its own error.
 *
 * Inverse: each value comes back as float32(code) * scale + min, rounded once per operation in
 * float32 (no fused multiply-add: the build passes -ffp-contract=off), then rounded to the cache's
 * dtype to nearest, ties to even, as numpy and ml_dtypes round. Non-finite scales are declined
 * and left to the reference: they come only from damaged or crafted files, and finite ones keep
 * every value finite (below 2^25), so no NaN payload rule is needed here. */
#include "kvn.h"
#include "floats.h"

#include <math.h>
#include <stdlib.h>

/* Codes d.. of a row from 64-bit big-endian windows, eight codes each, while a window lies inside the
 * plane; `bits` is a constant in each caller, so the shifts are too. Returns how many it unpacked. */
static inline __attribute__((always_inline)) size_t unpack_windows(const uint8_t *codes, size_t len, size_t bit,
                                                                  size_t count, const int bits, uint8_t *out) {
    const uint64_t mask = (1u << bits) - 1u;
    size_t d = 0;
    for (; d + 8 <= count && (bit >> 3) + 8 <= len; d += 8, bit += 8 * (size_t)bits) {
        uint64_t window = __builtin_bswap64(kvn_rd64(codes + (bit >> 3))) << (bit & 7);
        for (int k = 0; k < 8; k++) out[d + k] = (uint8_t)((window >> (64 - bits * (k + 1))) & mask);
    }
    return d;
}

/* `count` codes of `bits` bits from bit position `bit` of a stream packed most significant bit first. */
static void unpack_codes(const uint8_t *codes, size_t len, size_t bit, size_t count, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, codes + bit / 8, count);
        return;
    }
    size_t d;
    switch (bits) {  /* one copy of the window loop per width */
    case 1: d = unpack_windows(codes, len, bit, count, 1, out); break;
    case 2: d = unpack_windows(codes, len, bit, count, 2, out); break;
    case 3: d = unpack_windows(codes, len, bit, count, 3, out); break;
    case 4: d = unpack_windows(codes, len, bit, count, 4, out); break;
    case 5: d = unpack_windows(codes, len, bit, count, 5, out); break;
    case 6: d = unpack_windows(codes, len, bit, count, 6, out); break;
    default: d = unpack_windows(codes, len, bit, count, 7, out); break;
    }
    uint32_t mask = (1u << bits) - 1u;
    for (bit += d * (size_t)bits; d < count; d++, bit += (size_t)bits) {
        size_t byte = bit >> 3;
        uint32_t window = (uint32_t)codes[byte] << 8 | (byte + 1 < len ? codes[byte + 1] : 0u);
        out[d] = (uint8_t)((window >> (16 - bits - (int)(bit & 7))) & mask);
    }
}

static inline __attribute__((always_inline)) void store_row(int dtype, const float *values, size_t count, void *out) {
    if (dtype == KVN_BF16) {
        for (size_t d = 0; d < count; d++) ((uint16_t *)out)[d] = f32_to_bf16(values[d]);
    } else if (dtype == KVN_FP16) {
        for (size_t d = 0; d < count; d++) ((uint16_t *)out)[d] = f32_to_f16(values[d]);
    } else {
        memcpy(out, values, count * sizeof(float));
    }
}

/* The checks both ways share; the (scale, min) pairs each head uses go to *used. */
static int check_block(const kvn_int_block *b, size_t *used) {
    if (b->dtype > KVN_FP32 || b->bits < 1 || b->bits > 8 || b->group < 1 || b->dim == 0) return KVN_ERR_ARG;
    size_t token_groups = (b->tokens + b->group - 1) / b->group, channel_groups = (b->dim + b->group - 1) / b->group;
    *used = b->channel_axis ? b->dim * token_groups : b->tokens * channel_groups;
    return *used > b->groups_per_head ? KVN_ERR_ARG : KVN_OK;
}

/* The codes plane's size: every value's code, packed. */
static size_t codes_bytes(const kvn_int_block *b) {
    return (b->heads * b->tokens * b->dim * (size_t)b->bits + 7) / 8;
}

static int finite_pairs(const kvn_int_block *b, const uint16_t *scales, size_t used) {
    for (size_t h = 0; h < b->heads; h++)
        for (size_t i = 0; i < used * 2; i++)
            if ((scales[h * b->groups_per_head * 2 + i] & 0x7C00u) == 0x7C00u) return 0;
    return 1;
}

KVN_MULTIVERSION
int kvn_int_dequant_rows(const kvn_int_block *b, const uint8_t *codes, size_t codes_len, const uint16_t *scales,
                         uint8_t *const *rows) {
    size_t used, group = b->group, dim = b->dim;
    if (check_block(b, &used) || codes_len < codes_bytes(b)) return KVN_ERR_ARG;
    if (!finite_pairs(b, scales, used)) return KVN_ERR_DECLINED;
    size_t token_groups = (b->tokens + group - 1) / group, channel_groups = (dim + group - 1) / group;
    /* one row of codes, then of values; per channel the (scale, min) of the current token group */
    uint8_t *row_codes = malloc(dim);
    float *values = malloc(dim * sizeof(float)), *scale = malloc(dim * sizeof(float)), *low = malloc(dim * sizeof(float));
    int rc = row_codes && values && scale && low ? KVN_OK : KVN_ERR_NOMEM;
    for (size_t h = 0; rc == KVN_OK && h < b->heads; h++) {
        const uint16_t *pairs = scales + h * b->groups_per_head * 2;
        for (size_t t = 0; t < b->tokens; t++) {
            size_t row = h * b->tokens + t;
            if (b->channel_axis && t % group == 0)  /* a new token group: every channel's pair, even for a row left out */
                for (size_t d = 0; d < dim; d++) {
                    size_t g = d * token_groups + t / group;
                    scale[d] = f16_to_f32(pairs[2 * g]);
                    low[d] = f16_to_f32(pairs[2 * g + 1]);
                }
            if (!rows[row]) continue;
            unpack_codes(codes, codes_len, row * dim * (size_t)b->bits, dim, b->bits, row_codes);
            if (b->channel_axis) {
                for (size_t d = 0; d < dim; d++) {
                    float value = (float)row_codes[d] * scale[d];
                    values[d] = value + low[d];
                }
            } else {
                for (size_t g = 0; g < channel_groups; g++) {
                    const uint16_t *pair = pairs + 2 * (t * channel_groups + g);
                    float s = f16_to_f32(pair[0]), l = f16_to_f32(pair[1]);
                    size_t end = (g + 1) * group < dim ? (g + 1) * group : dim;
                    for (size_t d = g * group; d < end; d++) {
                        float value = (float)row_codes[d] * s;
                        values[d] = value + l;
                    }
                }
            }
            store_row(b->dtype, values, dim, rows[row]);
        }
    }
    free(row_codes);
    free(values);
    free(scale);
    free(low);
    return rc;
}

int kvn_int_dequant(const kvn_int_block *b, const uint8_t *codes, size_t codes_len, const uint16_t *scales,
                    void *out) {
    size_t n = b->heads * b->tokens, row_bytes = b->dim * (b->dtype == KVN_FP32 ? 4 : 2);
    uint8_t **rows = malloc((n ? n : 1) * sizeof(uint8_t *));
    if (!rows) return KVN_ERR_NOMEM;
    for (size_t r = 0; r < n; r++) rows[r] = (uint8_t *)out + r * row_bytes;
    int rc = kvn_int_dequant_rows(b, codes, codes_len, scales, rows);
    free(rows);
    return rc == KVN_ERR_DECLINED ? KVN_ERR_ARG : rc;
}

/* ---- the forward ---- */

/* The fp16 nearest to x in one direction (up: the least fp16 >= x, else the greatest <= x), as
 * bits; infinity past the largest finite one. x is finite. */
static inline __attribute__((always_inline)) uint16_t f64_to_f16_directed(double x, int up) {
    uint16_t sign = signbit(x) ? 0x8000u : 0u;
    double magnitude = fabs(x);
    int away = sign ? !up : up;  /* round the magnitude up (away from zero) or down */
    if (magnitude == 0.0) return sign;
    uint64_t bits64;
    memcpy(&bits64, &magnitude, 8);
    int exponent = (int)((bits64 >> 52) & 0x7FFu) - 1023;  /* magnitude in [2^exponent, 2^(exponent+1)) */
    if (exponent < -14) exponent = -14;  /* subnormals share the smallest binade's step, 2^-24 (so do tiny doubles) */
    uint64_t scale_bits = (uint64_t)(10 - exponent + 1023) << 52;  /* 2^(10 - exponent), a normal double */
    double scale;
    memcpy(&scale, &scale_bits, 8);
    double steps = magnitude * scale;  /* exact: a power-of-two scaling */
    double q = away ? ceil(steps) : floor(steps);
    /* bits = biased exponent and mantissa; a carry out of the mantissa moves to the next binade */
    uint32_t bits = exponent == -14 && q < 1024.0 ? (uint32_t)q : ((uint32_t)(exponent + 15) << 10) + (uint32_t)q - 1024u;
    if (bits >= 0x7C00u) bits = 0x7C00u;
    return sign | (uint16_t)bits;
}

/* One row of a block as doubles (exact for every input dtype). */
static inline __attribute__((always_inline)) void load_row(int dtype, const void *src, size_t count, double *out) {
    if (dtype == KVN_BF16) {
        for (size_t d = 0; d < count; d++) {
            uint32_t bits = (uint32_t)((const uint16_t *)src)[d] << 16;
            float f;
            memcpy(&f, &bits, 4);
            out[d] = f;
        }
    } else if (dtype == KVN_FP16) {
        for (size_t d = 0; d < count; d++) out[d] = f16_to_f32(((const uint16_t *)src)[d]);
    } else {
        for (size_t d = 0; d < count; d++) out[d] = ((const float *)src)[d];
    }
}

/* x rounded to the nearest integer, ties to even, for 0 <= x < 2^51: what rint does, inline. */
static inline __attribute__((always_inline)) double round_even(double x) {
    const double shift = 6755399441055744.0; /* 1.5 * 2^52: the sum keeps no fraction bits */
    return (x + shift) - shift;
}

/* Each group's least and greatest value into least/most (indexed as the scales plane); nonzero
 * on a value the reference refuses (NaN, infinity, beyond fp16). Channel groups keep a running
 * range per channel over their tokens; token groups are runs within a row. */
static inline __attribute__((always_inline)) int group_ranges(const kvn_int_block *b, const void *src, double *row, double *lo, double *hi,
                        double *least, double *most) {
    size_t dim = b->dim, group = b->group, itemsize = b->dtype == KVN_FP32 ? 4 : 2;
    size_t token_groups = (b->tokens + group - 1) / group, channel_groups = (dim + group - 1) / group;
    int bad = 0;
    for (size_t h = 0; h < b->heads; h++) {
        double *h_least = least + h * b->groups_per_head, *h_most = most + h * b->groups_per_head;
        for (size_t t = 0; t < b->tokens; t++) {
            load_row(b->dtype, (const uint8_t *)src + (h * b->tokens + t) * dim * itemsize, dim, row);
            for (size_t d = 0; d < dim; d++) bad |= !(fabs(row[d]) <= 65504.0);
            if (!b->channel_axis) {
                for (size_t g = 0; g < channel_groups; g++) {
                    size_t d = g * group, end = (g + 1) * group < dim ? (g + 1) * group : dim;
                    /* four lanes, then one: which of two equal zeros wins does not matter (the caller adds 0.0) */
                    double m4[4] = {INFINITY, INFINITY, INFINITY, INFINITY}, M4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
                    for (; d + 4 <= end; d += 4)
                        for (int k = 0; k < 4; k++) {
                            m4[k] = row[d + k] < m4[k] ? row[d + k] : m4[k];
                            M4[k] = row[d + k] > M4[k] ? row[d + k] : M4[k];
                        }
                    double m = m4[0], M = M4[0];
                    for (int k = 1; k < 4; k++) {
                        m = m4[k] < m ? m4[k] : m;
                        M = M4[k] > M ? M4[k] : M;
                    }
                    for (; d < end; d++) {
                        m = row[d] < m ? row[d] : m;
                        M = row[d] > M ? row[d] : M;
                    }
                    h_least[t * channel_groups + g] = m;
                    h_most[t * channel_groups + g] = M;
                }
                continue;
            }
            if (t % group == 0)
                for (size_t d = 0; d < dim; d++) lo[d] = INFINITY, hi[d] = -INFINITY;
            for (size_t d = 0; d < dim; d++) {
                lo[d] = row[d] < lo[d] ? row[d] : lo[d];
                hi[d] = row[d] > hi[d] ? row[d] : hi[d];
            }
            if (t % group == group - 1 || t == b->tokens - 1)
                for (size_t d = 0; d < dim; d++) {
                    h_least[d * token_groups + t / group] = lo[d];
                    h_most[d * token_groups + t / group] = hi[d];
                }
        }
    }
    return bad;
}

/* Row (h, t)'s per-channel min and step (scale, or 1 where the scale is 0), from the groups' (channel axis). */
static inline __attribute__((always_inline)) void row_params(const kvn_int_block *b, size_t h, size_t t,
                                                             const double *low, const double *step, double *row_low,
                                                             double *row_step) {
    size_t token_groups = (b->tokens + b->group - 1) / b->group, at = h * b->groups_per_head + t / b->group;
    for (size_t d = 0; d < b->dim; d++) {
        row_low[d] = low[at + d * token_groups];
        row_step[d] = step[at + d * token_groups];
    }
}

/* Eight codes at a time into `bits` bytes, most significant bit first; `bits` is a constant in each caller. */
static inline __attribute__((always_inline)) void pack_eights(const uint8_t *row_codes, size_t count, const int bits,
                                                             uint8_t *out) {
    for (size_t d = 0; d < count; d += 8, out += bits) {
        uint64_t word = 0;
        for (int k = 0; k < 8; k++) word = word << bits | row_codes[d + k];
        for (int k = 0; k < bits; k++) out[k] = (uint8_t)(word >> (8 * (bits - 1 - k)));
    }
}

/* A row of `count` codes (a multiple of eight) packed from a byte boundary. */
static void pack_row(const uint8_t *row_codes, size_t count, int bits, uint8_t *out) {
    switch (bits) {  /* one copy of the loop per width */
    case 1: pack_eights(row_codes, count, 1, out); break;
    case 2: pack_eights(row_codes, count, 2, out); break;
    case 3: pack_eights(row_codes, count, 3, out); break;
    case 4: pack_eights(row_codes, count, 4, out); break;
    case 5: pack_eights(row_codes, count, 5, out); break;
    case 6: pack_eights(row_codes, count, 6, out); break;
    default: pack_eights(row_codes, count, 7, out); break;
    }
}

KVN_MULTIVERSION
int kvn_int_quant(const kvn_int_block *b, const void *src, uint8_t *codes, size_t codes_len, uint16_t *scales) {
    size_t used, group = b->group, dim = b->dim;
    if (check_block(b, &used) || codes_len != codes_bytes(b)) return KVN_ERR_ARG;
    size_t pairs = b->heads * b->groups_per_head + 1, itemsize = b->dtype == KVN_FP32 ? 4 : 2;
    double *least = malloc(pairs * sizeof(double)), *most = malloc(pairs * sizeof(double));
    double *low = malloc(pairs * sizeof(double)), *step = malloc(pairs * sizeof(double));
    double *row = malloc(dim * sizeof(double)), *row_low = malloc(dim * sizeof(double));
    double *row_step = malloc(dim * sizeof(double));
    uint8_t *row_codes = malloc(dim);
    int rc = least && most && low && step && row && row_low && row_step && row_codes ? KVN_OK : KVN_ERR_NOMEM;
    if (rc == KVN_OK && group_ranges(b, src, row, row_low, row_step, least, most)) rc = KVN_ERR_ARG;
    uint32_t top_code = (1u << b->bits) - 1u;
    double top = top_code;
    memset(scales, 0, b->heads * b->groups_per_head * 2 * sizeof(uint16_t));
    for (size_t h = 0; rc == KVN_OK && h < b->heads; h++)
        for (size_t u = 0; rc == KVN_OK && u < used; u++) {
            size_t g = h * b->groups_per_head + u;
            /* + 0.0 makes a zero's sign +: a group's least zero is stored the same whichever zero came first */
            uint16_t low_bits = f64_to_f16_directed(least[g] + 0.0, 0);
            low[g] = f16_to_f32(low_bits);
            uint16_t scale_bits = f64_to_f16_directed((most[g] + 0.0 - low[g]) / top_code, 1);
            if ((scale_bits & 0x7C00u) == 0x7C00u) rc = KVN_ERR_ARG;  /* the range needs more bits */
            float scale = f16_to_f32(scale_bits), largest = (float)top_code * scale;
            largest = largest + (float)low[g];
            if (b->dtype == KVN_FP16 && (f32_to_f16(largest) & 0x7C00u) == 0x7C00u) rc = KVN_ERR_ARG;  /* comes back infinite */
            step[g] = scale > 0 ? (double)scale : 1.0;
            scales[2 * g] = scale_bits;
            scales[2 * g + 1] = low_bits;
        }
    /* the codes, packed most significant bit first */
    uint64_t acc = 0;
    int held = 0;
    size_t at = 0;
    for (size_t h = 0; rc == KVN_OK && h < b->heads; h++)
        for (size_t t = 0; t < b->tokens; t++) {
            load_row(b->dtype, (const uint8_t *)src + (h * b->tokens + t) * dim * itemsize, dim, row);
            if (b->channel_axis) {
                if (t % group == 0) row_params(b, h, t, low, step, row_low, row_step);
                for (size_t d = 0; d < dim; d++) {  /* >= 0: a group's min is at most its least value */
                    double code = round_even((row[d] - row_low[d]) / row_step[d]);
                    row_codes[d] = (uint8_t)(int32_t)(code < top ? code : top);
                }
            } else {
                size_t base = h * b->groups_per_head + t * ((dim + group - 1) / group);
                for (size_t d0 = 0; d0 < dim; d0 += group, base++) {  /* one (min, step) per group of the row */
                    double l = low[base], st = step[base];
                    size_t end = d0 + group < dim ? d0 + group : dim;
                    for (size_t d = d0; d < end; d++) {
                        double code = round_even((row[d] - l) / st);
                        row_codes[d] = (uint8_t)(int32_t)(code < top ? code : top);
                    }
                }
            }
            if (held == 0 && dim % 8 == 0) {  /* whole bytes per row: eight codes are `bits` bytes */
                if (b->bits == 8) memcpy(codes + at, row_codes, dim);
                else pack_row(row_codes, dim, b->bits, codes + at);
                at += dim * (size_t)b->bits / 8;
                continue;
            }
            for (size_t d = 0; d < dim; d++) {
                acc = acc << b->bits | row_codes[d];
                held += b->bits;
                while (held >= 8) codes[at++] = (uint8_t)(acc >> (held -= 8));
            }
        }
    if (rc == KVN_OK && held) codes[at] = (uint8_t)(acc << (8 - held));
    free(least);
    free(most);
    free(low);
    free(step);
    free(row);
    free(row_low);
    free(row_step);
    free(row_codes);
    return rc;
}
