/* Which vector instructions the kernels use: the best level this CPU offers, at most a cap.
 *
 * Kernels with vector variants ask kvn_isa() once per call and take the variant of that
 * level; every variant writes the same bytes as the portable C. The cap lets tests run each
 * level this CPU has (the portable one always) and compare them with the numpy reference, and
 * KVTOOL_NATIVE_ISA lets a user pin one (kvtool/_native/__init__.py applies it at load).
 */
#include "kvn.h"

static int detected = -1;
static int cap = KVN_ISA_AVX512;

int kvn_isa_detected(void) {
    int level = __atomic_load_n(&detected, __ATOMIC_RELAXED);
    if (level >= 0) return level;
    level = KVN_ISA_PORTABLE;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
        __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("popcnt"))
        level = KVN_ISA_AVX2;
    if (level == KVN_ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        level = KVN_ISA_AVX512;
#endif
    __atomic_store_n(&detected, level, __ATOMIC_RELAXED);
    return level;
}

int kvn_isa(void) {
    int level = kvn_isa_detected(), most = __atomic_load_n(&cap, __ATOMIC_RELAXED);
    return level < most ? level : most;
}

void kvn_isa_cap(int level) {
    __atomic_store_n(&cap, level < KVN_ISA_PORTABLE ? KVN_ISA_PORTABLE : level, __ATOMIC_RELAXED);
}
