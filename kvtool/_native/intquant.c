/* The inverse of the lossy `int:BITS` stage (kvtool/layouts/int_quant.py, which is the reference):
 * codes packed most significant bit first, an fp16 (scale, min) pair per group, and each value
 * coming back as float32(code) * scale + min, rounded once per operation in float32 (no fused
 * multiply-add: the build passes -ffp-contract=off), then rounded to the cache's dtype to nearest,
 * ties to even, as numpy and ml_dtypes round.
 *
 * Non-finite scales are refused (KVN_ERR_ARG) and left to the reference: they come only from
 * damaged or crafted files, and finite ones keep every value finite (below 2^25), so no NaN
 * payload rule is needed here. */
#include "kvn.h"

#include <math.h>
#include <stdlib.h>

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    float magnitude;
    if (exponent == 0) {
        magnitude = ldexpf((float)mantissa, -24);  /* zero or subnormal: mantissa * 2^-24, exact */
    } else {
        uint32_t bits = ((exponent + 112u) << 23) | (mantissa << 13);
        memcpy(&magnitude, &bits, 4);
    }
    uint32_t out;
    memcpy(&out, &magnitude, 4);
    out |= sign;
    memcpy(&magnitude, &out, 4);
    return magnitude;
}

static uint16_t f32_to_bf16(float value) {
    uint32_t x;
    memcpy(&x, &value, 4);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static uint16_t f32_to_f16(float value) {
    uint32_t x;
    memcpy(&x, &value, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7FFFFFFFu;
    if (x >= 0x477FF000u) return sign | 0x7C00u;  /* 65520 and above round to infinity */
    if (x < 0x38800000u)                          /* below 2^-14: a subnormal half, in steps of 2^-24 */
        return sign | (uint16_t)nearbyintf(fabsf(value) * 16777216.0f);
    x += 0xFFFu + ((x >> 13) & 1u);  /* round the 13 dropped mantissa bits to nearest even */
    return sign | (uint16_t)((x - (112u << 23)) >> 13);
}

/* `count` codes of `bits` bits from bit position `bit` of a stream packed most significant bit first. */
static void unpack_codes(const uint8_t *codes, size_t len, size_t bit, size_t count, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, codes + bit / 8, count);
        return;
    }
    uint32_t mask = (1u << bits) - 1u;
    for (size_t d = 0; d < count; d++, bit += (size_t)bits) {
        size_t byte = bit >> 3;
        uint32_t window = (uint32_t)codes[byte] << 8 | (byte + 1 < len ? codes[byte + 1] : 0u);
        out[d] = (uint8_t)((window >> (16 - bits - (int)(bit & 7))) & mask);
    }
}

static void store_row(int dtype, const float *values, size_t count, void *out) {
    if (dtype == KVN_BF16) {
        for (size_t d = 0; d < count; d++) ((uint16_t *)out)[d] = f32_to_bf16(values[d]);
    } else if (dtype == KVN_FP16) {
        for (size_t d = 0; d < count; d++) ((uint16_t *)out)[d] = f32_to_f16(values[d]);
    } else {
        memcpy(out, values, count * sizeof(float));
    }
}

static int finite_pairs(const kvn_int_block *b, const uint16_t *scales, size_t used) {
    for (size_t h = 0; h < b->heads; h++)
        for (size_t i = 0; i < used * 2; i++)
            if ((scales[h * b->groups_per_head * 2 + i] & 0x7C00u) == 0x7C00u) return 0;
    return 1;
}

KVN_MULTIVERSION
int kvn_int_dequant(const kvn_int_block *b, const uint8_t *codes, size_t codes_len, const uint16_t *scales,
                    void *out) {
    size_t n = b->heads * b->tokens * b->dim, group = b->group, dim = b->dim;
    if (b->dtype > KVN_FP32 || b->bits < 1 || b->bits > 8 || group < 1 || dim == 0 ||
        codes_len < (n * (size_t)b->bits + 7) / 8)
        return KVN_ERR_ARG;
    size_t token_groups = (b->tokens + group - 1) / group, channel_groups = (dim + group - 1) / group;
    size_t used = b->channel_axis ? dim * token_groups : b->tokens * channel_groups;
    if (used > b->groups_per_head || !finite_pairs(b, scales, used)) return KVN_ERR_ARG;
    size_t itemsize = b->dtype == KVN_FP32 ? 4 : 2;
    /* one row of codes, then of values; per channel the (scale, min) of the current token group */
    uint8_t *row_codes = malloc(dim);
    float *values = malloc(dim * sizeof(float)), *scale = malloc(dim * sizeof(float)), *low = malloc(dim * sizeof(float));
    int rc = row_codes && values && scale && low ? KVN_OK : KVN_ERR_NOMEM;
    for (size_t h = 0; rc == KVN_OK && h < b->heads; h++) {
        const uint16_t *pairs = scales + h * b->groups_per_head * 2;
        for (size_t t = 0; t < b->tokens; t++) {
            size_t row = h * b->tokens + t;
            unpack_codes(codes, codes_len, row * dim * (size_t)b->bits, dim, b->bits, row_codes);
            if (b->channel_axis) {
                if (t % group == 0)
                    for (size_t d = 0; d < dim; d++) {
                        size_t g = d * token_groups + t / group;
                        scale[d] = f16_to_f32(pairs[2 * g]);
                        low[d] = f16_to_f32(pairs[2 * g + 1]);
                    }
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
            store_row(b->dtype, values, dim, (uint8_t *)out + row * dim * itemsize);
        }
    }
    free(row_codes);
    free(values);
    free(scale);
    free(low);
    return rc;
}
