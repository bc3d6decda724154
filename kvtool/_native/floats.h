/* Conversions between float32 and the 16-bit float types of a cache, rounding as numpy and ml_dtypes round
 * (to nearest, ties to even): what the lossy stages' inverses (intquant.c, pca.c) write. */
#ifndef KVN_FLOATS_H
#define KVN_FLOATS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) {
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

static inline uint16_t f32_to_bf16(float value) {
    uint32_t x;
    memcpy(&x, &value, 4);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static inline uint16_t f32_to_f16(float value) {
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

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#endif
