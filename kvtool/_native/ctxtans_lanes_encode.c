/* ctxtans chunk version 3: the rANS stream. A decoder reads it forwards, so the encoder takes the
 * steps last to first: each head's groups of LANES places (last group first), each group's coded
 * tokens last to first (lane k coding with state k); then the side information (each channel's class
 * and reference offset, symbol i with state i % LANES, a step each). The stream is the final states,
 * then the bytes written, last first.
 *
 * The model's instruction set picks the group kernel: the portable one here, or those of
 * ctxtans_avx2.c and ctxtans_avx512.c, which write the same bytes. */
#include <stdlib.h>

#include "ctxtans_lanes.h"

static void group_portable(lane_coder *e) {
    for (size_t t = e->tokens; t-- > 0;)
        if (!e->back[t * e->back_stride]) lanes_put(e, t);
}

static void encode_group(int isa, lane_coder *e) {
#ifdef KVN_LANES_X86
    if (e->lanes % 16 == 0 && isa >= KVN_ISA_AVX512) {
        kvn_lanes_encode_avx512(e);
        return;
    }
    if (e->lanes % 8 == 0 && isa >= KVN_ISA_AVX2) {
        kvn_lanes_encode_avx2(e);
        return;
    }
#else
    (void)isa;
#endif
    group_portable(e);
}

/* The n bytes of `in` into `out` last first. */
static void reversed(uint8_t *out, const uint8_t *in, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) kvn_wr64(out + i, __builtin_bswap64(kvn_rd64(in + n - i - 8)));
    for (; i < n; i++) out[i] = in[n - 1 - i];
}

int kvn_tans_lanes_encode(const kvn_tans_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                          const uint32_t *chan, const uint8_t *cls, const uint32_t *refs, uint32_t base, uint32_t *x,
                          uint8_t *out, size_t *written) {
    size_t H = b->heads, D = b->dim, C = H * D, n = b->tokens * C;
    uint8_t *bytes = malloc(2 * (n + 2 * C) + 64); /* two bytes at most a symbol; the SIMD kernels store 16 at a time */
    if (!bytes) return KVN_ERR_NOMEM;
    int isa = kvn_isa();
    lane_coder e = {m->rcp, m->rec, sym, m->context_of, (uint32_t)m->start_context, NULL, H, C, b->tokens, 0,
                    {0}, {0}, {0}, {0}, bytes, 0};
    for (int s = 0; s < KVN_TANS_SYMBOLS; s++) e.context32[s] = m->context_of[s];
    for (size_t h = H; h-- > 0;)
        for (size_t d0 = (D - 1) / LANES * LANES + LANES; d0 > 0;) {
            d0 -= LANES;
            size_t place = h * D + d0;
            e.lanes = D - d0 < LANES ? D - d0 : LANES;
            e.back = back + h;
            for (size_t k = 0; k < e.lanes; k++) {
                e.chan[k] = chan[place + k];
                e.cls[k] = cls[chan[place + k]] * (uint32_t)m->contexts;
                e.x[k] = x[k];
            }
            encode_group(isa, &e);
            memcpy(x, e.x, e.lanes * sizeof(uint32_t));
        }
    for (size_t i = 2 * C; i-- > 0;) { /* class, reference offset, class, ...: a step each */
        size_t c = i / 2;
        uint32_t offset = refs[c] - base;
        size_t idx = i % 2 ? m->ref_model * KVN_TANS_SYMBOLS + (offset < REF_SYMBOLS - 1 ? offset : REF_SYMBOLS - 1)
                           : m->class_model * KVN_TANS_SYMBOLS + cls[c];
        uint8_t taken[2];
        int n_taken = rans_put(m->rcp, m->rec, idx, &x[i % LANES], taken);
        for (int j = 0; j < n_taken; j++) bytes[e.n_out++] = taken[j]; /* read backwards: the last taken first */
    }
    for (int k = 0; k < LANES; k++) kvn_wr32(out + 4 * k, x[k]);
    reversed(out + 4 * LANES, bytes, e.n_out);
    *written = 4 * LANES + e.n_out;
    free(bytes);
    return KVN_OK;
}
