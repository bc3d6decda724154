/* Which vector instructions the kernels use: the best level this CPU offers, at most a cap.
 *
 * Kernels with vector variants (exphuff's decoder and row merge, XXH3, ctxtans's lanes) ask
 * kvn_isa() once per call and take the variant of that level; every variant writes the same
 * bytes as the portable C. A level is the union of what its kernels need: AVX2 with BMI1/2,
 * LZCNT and POPCNT (Haswell, Zen 1); AVX-512 F, BW, VL, VBMI and VPOPCNTDQ (Ice Lake, Zen 4;
 * Skylake-SP and Cascade Lake run the AVX2 kernels). The cap lets tests run each level this CPU
 * has (the portable one always) against the numpy reference, and KVTOOL_SIMD lets a user hold
 * the process to one (kvtool/_native/__init__.py applies it when the core is loaded).
 */
#include "kvn.h"

static int best = -1;
static int cap = KVN_ISA_AVX512;

int kvn_isa_best(void) {
    int level = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (level >= 0) return level;
    level = KVN_ISA_SCALAR;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVN_NO_MULTIVERSION)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
        __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("popcnt"))
        level = KVN_ISA_AVX2;
    if (level == KVN_ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
        __builtin_cpu_supports("avx512vpopcntdq"))
        level = KVN_ISA_AVX512;
#endif
    __atomic_store_n(&best, level, __ATOMIC_RELAXED);
    return level;
}

int kvn_isa(void) {
    int level = kvn_isa_best(), most = __atomic_load_n(&cap, __ATOMIC_RELAXED);
    return level < most ? level : most;
}

void kvn_isa_cap(int level) {
    __atomic_store_n(&cap, level < KVN_ISA_SCALAR ? KVN_ISA_SCALAR : level, __ATOMIC_RELAXED);
}
