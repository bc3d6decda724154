/* ctxtans's encoder: symbols and references, repeated rows, each channel's class, the fallback
 * decision, the escapes and raw bits (the raw plane's last bits going into the states), then the
 * tANS stream of chunk version 3 (ctxtans_lanes_encode.c). See ctxtans.c and docs/FORMAT.md. */
#include <stdlib.h>

#include "ctxtans_impl.h"
#include "huffman.h"

/* ---- encode ---------------------------------------------------------------------------- */

/* Channel references (floor of the mean level) and every value's symbol, sym[t * C + c]. */
KVN_INLINE void symbols_w(const kvn_block *b, const uint8_t *src, const split *sp, uint32_t *restrict refs,
                          uint8_t *restrict sym, unsigned width) {
    size_t H = b->heads, T_ = b->tokens, D = b->dim, C = H * D;
    memset(refs, 0, C * sizeof(uint32_t));
    for (size_t h = 0; h < H; h++)
        for (size_t t = 0; t < T_; t++) {
            const uint8_t *row = src + (h * b->head_stride + t * D) * width;
            uint32_t *r = refs + h * D;
            for (size_t d = 0; d < D; d++) r[d] += (load(row + d * width, width) >> sp->raw_bits) & (sp->level_count - 1);
        }
    for (size_t c = 0; c < C; c++) refs[c] /= (uint32_t)T_;
    for (size_t h = 0; h < H; h++)
        for (size_t t = 0; t < T_; t++) {
            const uint8_t *row = src + (h * b->head_stride + t * D) * width;
            uint8_t *s = sym + t * C + h * D;
            const uint32_t *r = refs + h * D;
            for (size_t d = 0; d < D; d++) s[d] = (uint8_t)symbol_of(load(row + d * width, width), r[d], sp);
        }
}

KVN_TANS_MULTIVERSION
static void symbols(const kvn_block *b, const uint8_t *src, const split *sp, uint32_t *refs, uint8_t *sym) {
    switch (sp->width) {
    case 2: symbols_w(b, src, sp, refs, sym, 2); break;
    case 4: symbols_w(b, src, sp, refs, sym, 4); break;
    default: symbols_w(b, src, sp, refs, sym, 1);
    }
}

/* 16 classes' costs of a symbol as bytes (a cost row holds 32 or 64), and their sums in 16-bit lanes: GCC
 * vectors (__builtin_convertvector: GCC 9, Clang 3.9). */
typedef uint8_t cost_bytes __attribute__((vector_size(16)));
typedef uint16_t cost_sums __attribute__((vector_size(32)));

/* Adds the costs of 16 classes at `at` to `run`. */
#define ADD_COSTS(run, at)                                                  \
    do {                                                                    \
        cost_bytes costs_;                                                  \
        memcpy(&costs_, (at), sizeof(costs_));                              \
        run += __builtin_convertvector(costs_, cost_sums);                  \
    } while (0)

/* Each channel's class, the cheapest for its coded symbols in their contexts (the lowest on a tie);
 * returns the summed cost of the choices in 1/8 bits. A cost row holds 32 * NB classes' costs (a byte each:
 * 32 KiB in all for 32 classes and 16 contexts, a core's first cache), summed in 2 * NB cost_sums COST_RUN
 * tokens at a time, then in 64 bits. */
KVN_INLINE uint64_t choose_classes_w(const kvn_tans_model *m, const kvn_block *b, const uint8_t *sym,
                                     const uint32_t *back, uint8_t *cls, const int NB) {
    size_t H = b->heads, D = b->dim, C = H * D, row_bytes = (size_t)NB * 32;
    uint64_t total = 0;
    for (size_t c = 0; c < C; c++) {
        size_t h = c / D;
        int64_t sum[COST_LANES] = {0};
        cost_sums r0 = {0}, r1 = {0}, r2 = {0}, r3 = {0}; /* in registers: no array, no address taken */
        size_t in_run = 0;
        for (size_t t = 0; t < b->tokens; t++) {
            if (!back[t * H + h]) {
                size_t ctx = t ? m->context_of[sym[(t - 1) * C + c]] : (size_t)m->start_context;
                const uint8_t *row = m->cost + (ctx * KVN_TANS_SYMBOLS + sym[t * C + c]) * row_bytes;
                ADD_COSTS(r0, row);
                ADD_COSTS(r1, row + 16);
                if (NB == 2) {
                    ADD_COSTS(r2, row + 32);
                    ADD_COSTS(r3, row + 48);
                }
            }
            if (++in_run == COST_RUN || t + 1 == b->tokens) {
                cost_sums runs[4] = {r0, r1, r2, r3};
                const uint16_t *lanes = (const uint16_t *)runs;
                for (int k = 0; k < 32 * NB; k++) sum[k] += lanes[k];
                r0 = r1 = r2 = r3 = (cost_sums){0};
                in_run = 0;
            }
        }
        int best = 0;
        int64_t best_cost = INT64_MAX;
        for (int k = 0; k < m->classes; k++) {
            int64_t cost = sum[k] + m->class_cost[k];
            if (cost < best_cost) { best_cost = cost; best = k; }
        }
        cls[c] = (uint8_t)best;
        total += (uint64_t)best_cost;
    }
    return total;
}

KVN_TANS_MULTIVERSION
static uint64_t choose_classes(const kvn_tans_model *m, const kvn_block *b, const uint8_t *sym, const uint32_t *back,
                               uint8_t *cls) {
    return m->cost_lanes == 32 ? choose_classes_w(m, b, sym, back, cls, 1) : choose_classes_w(m, b, sym, back, cls, 2);
}

/* The bits a Huffman code of the chunk's own counts of the coded symbols would take. */
static uint64_t huffman_bits(const kvn_block *b, const uint8_t *sym, const uint32_t *back) {
    size_t H = b->heads, D = b->dim, C = H * D;
    uint32_t count[256] = {0}, part[4][KVN_TANS_SYMBOLS] = {{0}}; /* four counts: a symbol's runs need no chain */
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++) {
            if (back[t * H + h]) continue;
            const uint8_t *s = sym + t * C + h * D;
            size_t d = 0;
            for (; d + 4 <= D; d += 4) {
                part[0][s[d]]++;
                part[1][s[d + 1]]++;
                part[2][s[d + 2]]++;
                part[3][s[d + 3]]++;
            }
            for (; d < D; d++) part[0][s[d]]++;
        }
    for (int s = 0; s < KVN_TANS_SYMBOLS; s++) count[s] = part[0][s] + part[1][s] + part[2][s] + part[3][s];
    uint8_t len[256];
    kvn_huf_lengths(count, len);
    uint64_t bits = 0;
    for (int s = 0; s < 256; s++) bits += (uint64_t)count[s] * len[s];
    return bits;
}

/* The raw bits of a row of D bf16 values (D a multiple of 4), 6 a value: four values are 24 bits, three bytes. */
KVN_INLINE void raw_row_bf16(const uint8_t *row, size_t D, bit_writer *raw) {
    uint8_t *p = raw->p;
    for (size_t d = 0; d < D; d += 4, p += 3) {
        uint64_t v = kvn_rd64(row + 2 * d) & 0x003F003F003F003Full;
        v = (v | v >> 10) & 0x00000FFF00000FFFull; /* two values in each 32-bit half */
        kvn_wr32(p, (uint32_t)(v | v >> 20));
    }
    raw->p = p;
}

/* The levels of the escaped values and the raw bits, in the block's order (token, head, dim). */
KVN_INLINE void escapes_and_raw_w(const kvn_block *b, const uint8_t *src, const uint8_t *sym, const uint32_t *back,
                                  const split *sp, uint8_t *esc, size_t *n_esc, bit_writer *raw, unsigned width) {
    size_t H = b->heads, D = b->dim, C = H * D;
    int bf16_rows = b->dtype == KVN_BF16 && D % 4 == 0; /* every row's bits whole bytes */
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++) {
            if (back[t * H + h]) continue;
            const uint8_t *row = src + (h * b->head_stride + t * D) * width, *s = sym + t * C + h * D;
            unsigned escapes = 0; /* rare: a vectorised look first */
            for (size_t d = 0; d < D; d++) escapes |= !(s[d] % LEVELS);
            for (size_t d = 0; escapes && d < D; d++)
                if (!(s[d] % LEVELS)) {
                    uint32_t level = (load(row + d * width, width) >> sp->raw_bits) & (sp->level_count - 1);
                    esc[2 * *n_esc] = (uint8_t)level;
                    esc[2 * *n_esc + 1] = (uint8_t)(level >> 8);
                    ++*n_esc;
                }
            if (bf16_rows) {
                raw_row_bf16(row, D, raw);
                continue;
            }
            for (size_t d = 0; d < D; d++) put_bits(raw, load(row + d * width, width) & sp->raw_mask, sp->raw_bits);
        }
}

KVN_TANS_MULTIVERSION
static void escapes_and_raw(const kvn_block *b, const uint8_t *src, const uint8_t *sym, const uint32_t *back,
                            const split *sp, uint8_t *esc, size_t *n_esc, bit_writer *raw) {
    switch (sp->width) {
    case 2: escapes_and_raw_w(b, src, sym, back, sp, esc, n_esc, raw, 2); break;
    case 4: escapes_and_raw_w(b, src, sym, back, sp, esc, n_esc, raw, 4); break;
    default: escapes_and_raw_w(b, src, sym, back, sp, esc, n_esc, raw, 1);
    }
}

static void write_head(uint8_t *p, unsigned flags, const uint8_t tag[4], uint32_t base, size_t n_esc, size_t stream) {
    p[0] = VERSION;
    p[1] = MODE_DICT;
    p[2] = (uint8_t)flags;
    p[3] = 0;
    memcpy(p + 4, tag, 4);
    p[8] = (uint8_t)base;
    p[9] = (uint8_t)(base >> 8);
    kvn_wr32(p + 10, (uint32_t)n_esc);
    kvn_wr32(p + 14, (uint32_t)stream);
}

int kvn_tans_encode(const kvn_tans_model *m, const kvn_block *b, const void *src_, uint8_t *dst, size_t *written) {
    int rc = check_block(b);
    if (rc) return rc;
    const uint8_t *src = src_;
    split sp = split_of(b->dtype);
    size_t H = b->heads, D = b->dim, C = H * D, rows = H * b->tokens, n = rows * D;
    if (!n) {
        memset(dst, 0, HEAD_SIZE);
        write_head(dst, 0, m->tag, 0, 0, 0);
        *written = HEAD_SIZE;
        return KVN_OK;
    }
    uint8_t *sym = malloc(n + 4), *cls = malloc(C); /* the SIMD encoders read symbols 4 bytes at a time */
    uint32_t *refs = malloc(C * sizeof(uint32_t)), *back = malloc(rows * sizeof(uint32_t));
    uint32_t *chan = malloc(C * sizeof(uint32_t));
    if (!sym || !cls || !refs || !back || !chan) { rc = KVN_ERR_NOMEM; goto done; }
    size_t repeated;
    symbols(b, src, &sp, refs, sym);
    rc = kvn_find_repeats(b, src, sp.width, back, &repeated);
    if (rc) goto done;
    uint64_t dict_cost = choose_classes(m, b, sym, back, cls);
    if (8 * huffman_bits(b, sym, back) < dict_cost) { /* the dictionary does not fit: per-chunk statistics */
        dst[0] = VERSION;
        dst[1] = MODE_EXPHUFF;
        rc = kvn_exphuff_encode(b, src, dst + 2, written, 0);
        *written += 2;
        goto done;
    }
    coding_channels(cls, H, D, VERSION, chan);
    uint32_t base = refs[0];
    for (size_t c = 1; c < C; c++) base = refs[c] < base ? refs[c] : base;
    uint8_t *p = dst + HEAD_SIZE;
    if (repeated) p = kvn_write_repeats(p, back, rows);
    size_t n_esc = 0;
    for (size_t c = 0; c < C; c++)
        if (refs[c] - base >= REF_SYMBOLS - 1) {
            p[2 * n_esc] = (uint8_t)refs[c];
            p[2 * n_esc + 1] = (uint8_t)(refs[c] >> 8);
            n_esc++;
        }
    /* the value escapes follow; the raw bits go after all escapes, so they are written once the count is known */
    size_t value_esc = 0;
    for (size_t t = 0; t < b->tokens; t++)
        for (size_t h = 0; h < H; h++)
            if (!back[t * H + h])
                for (size_t d = 0; d < D; d++) value_esc += !(sym[t * C + h * D + d] % LEVELS);
    uint8_t *raw_at = p + 2 * (n_esc + value_esc);
    bit_writer raw = {raw_at, 0, 0};
    escapes_and_raw(b, src, sym, back, &sp, p, &n_esc, &raw);
    finish_bits(&raw, raw_at);
    /* the raw plane's last bits go into the states, which the decoder ends with */
    uint64_t raw_total = (uint64_t)(rows - repeated) * D * sp.raw_bits, split = section_bits(VERSION, raw_total);
    uint32_t x[LANES];
    for (uint64_t k = 0, held = raw_total - split; k < LANES; k++) { /* state k holds tail bits 30k .. 30k + 29 */
        uint64_t at = split + HELD_PER_STATE * k, bits = k * HELD_PER_STATE < held ? held - k * HELD_PER_STATE : 0;
        uint32_t tail = bits ? (uint32_t)(kvn_rd64(raw_at + (at >> 3)) >> (at & 7)) : 0;
        x[k] = 1u << HELD_PER_STATE | (bits < HELD_PER_STATE ? tail & ((1u << bits) - 1) : tail & ((1u << HELD_PER_STATE) - 1));
    }
    uint8_t *stream_at = raw_at + (split + 7) / 8;
    if (split & 7) stream_at[-1] &= (uint8_t)((1u << (split & 7)) - 1);
    size_t stream_len;
    rc = kvn_tans_lanes_encode(m, b, sym, back, chan, cls, refs, base, x, stream_at, &stream_len);
    if (rc) goto done;
    write_head(dst, repeated ? FLAG_REPEATS : 0, m->tag, base, n_esc, stream_len);
    *written = (size_t)(stream_at + stream_len - dst);
done:
    free(sym);
    free(cls);
    free(refs);
    free(back);
    free(chan);
    return rc;
}
