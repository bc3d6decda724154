/* One value of a block, 1, 2 or 4 bytes wide, read or written as an unsigned integer: the
 * context coders' (ctxans, ctxtans) inner loops, with the width a constant they are specialised on. */
#ifndef KVN_VALUES_H
#define KVN_VALUES_H
#include <stdint.h>
#include <string.h>

#define KVN_INLINE static inline __attribute__((always_inline))

KVN_INLINE uint32_t load(const uint8_t *p, unsigned width) {
    if (width == 2) { uint16_t v; memcpy(&v, p, 2); return v; }
    if (width == 4) { uint32_t v; memcpy(&v, p, 4); return v; }
    return *p;
}

KVN_INLINE void store(uint8_t *p, uint32_t v, unsigned width) {
    if (width == 2) { uint16_t w = (uint16_t)v; memcpy(p, &w, 2); }
    else if (width == 4) memcpy(p, &v, 4);
    else *p = (uint8_t)v;
}

#endif
