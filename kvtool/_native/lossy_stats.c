/* What a lossy round trip costs a block (kvtool/layouts/lossy.py's ErrorTally.block is the reference):
 * the largest |approx - exact| and the sums of squared errors and of squared values, all in float64.
 * The maximum is exact in any order; the sums follow numpy's pairwise summation of a contiguous array
 * (blocks of at most 128 values in eight interleaved accumulators, longer runs halved on a multiple
 * of eight), so the bits equal numpy's and the header a writer fills from them stays the same. */
#include "kvn.h"

#include <math.h>

#define PAIRWISE_BLOCK 128

typedef struct {
    int dtype;
    const void *exact, *approx;
    double worst;
} stats_src;

static double half_to_double(uint16_t h) {
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    double magnitude = exponent == 0 ? ldexp((double)mantissa, -24)
                       : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                        : ldexp((double)(mantissa | 0x400u), (int)exponent - 25);
    return (h & 0x8000u) ? -magnitude : magnitude;
}

/* Values i..i+n-1 of p as doubles (exact for every dtype taken). */
static inline __attribute__((always_inline)) void load(int dtype, const void *p, size_t i, size_t n, double *out) {
    if (dtype == KVN_FP32) {
        for (size_t k = 0; k < n; k++) out[k] = ((const float *)p)[i + k];
    } else if (dtype == KVN_BF16) {
        for (size_t k = 0; k < n; k++) {
            uint32_t bits = (uint32_t)((const uint16_t *)p)[i + k] << 16;
            float f;
            memcpy(&f, &bits, 4);
            out[k] = f;
        }
    } else {
        for (size_t k = 0; k < n; k++) out[k] = half_to_double(((const uint16_t *)p)[i + k]);
    }
}

/* Values i..i+n-1: their squared errors' and squared values' sums into sums[0], sums[1], as numpy's
 * DOUBLE_pairwise_sum adds them; the largest |error| into src->worst. */
KVN_MULTIVERSION
static void pairwise(stats_src *src, size_t i, size_t n, double sums[2]) {
    if (n > PAIRWISE_BLOCK) {
        size_t half = n / 2;
        half -= half % 8;
        double a[2], b[2];
        pairwise(src, i, half, a);
        pairwise(src, i + half, n - half, b);
        sums[0] = a[0] + b[0];
        sums[1] = a[1] + b[1];
        return;
    }
    double e2[PAIRWISE_BLOCK], x2[PAIRWISE_BLOCK];
    load(src->dtype, src->exact, i, n, x2);
    load(src->dtype, src->approx, i, n, e2);
    /* the largest |error| in four lanes (exact in any order; magnitudes have no sign), NaN errors left out here:
     * kvn_error_stats finds them in the squares' sum */
    double worst[4] = {src->worst, src->worst, src->worst, src->worst};
    size_t k = 0;
    for (; k + 4 <= n; k += 4)
        for (int j = 0; j < 4; j++) {
            double e = e2[k + j] - x2[k + j], magnitude = fabs(e);
            worst[j] = magnitude > worst[j] ? magnitude : worst[j];
            e2[k + j] = e * e;
            x2[k + j] = x2[k + j] * x2[k + j];
        }
    for (; k < n; k++) {
        double e = e2[k] - x2[k], magnitude = fabs(e);
        worst[0] = magnitude > worst[0] ? magnitude : worst[0];
        e2[k] = e * e;
        x2[k] = x2[k] * x2[k];
    }
    for (int j = 1; j < 4; j++) worst[0] = worst[j] > worst[0] ? worst[j] : worst[0];
    src->worst = worst[0];
    const double *v[2] = {e2, x2};
    for (int s = 0; s < 2; s++) {
        const double *a = v[s];
        double res = 0.0;
        size_t k = 0;
        if (n < 8) {
            for (; k < n; k++) res += a[k];
        } else {
            double r[8];
            for (int j = 0; j < 8; j++) r[j] = a[j];
            for (k = 8; k < n - n % 8; k += 8)
                for (int j = 0; j < 8; j++) r[j] += a[k + j];
            res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
            for (; k < n; k++) res += a[k];
        }
        sums[s] = res;
    }
}

int kvn_error_stats(int dtype, const void *exact, const void *approx, size_t n, double out[3]) {
    if (dtype != KVN_BF16 && dtype != KVN_FP16 && dtype != KVN_FP32) return KVN_ERR_ARG;
    stats_src src = {dtype, exact, approx, 0.0};
    double sums[2] = {0.0, 0.0};
    if (n) pairwise(&src, 0, n, sums);
    out[0] = sums[0] != sums[0] ? NAN : src.worst;  /* squares are >= 0: their sum is NaN only where an error is, as numpy's max */
    out[1] = 0.0 + sums[0];  /* numpy starts a sum at the identity, 0.0 */
    out[2] = 0.0 + sums[1];
    return KVN_OK;
}
