/* ctxans model: a dictionary's coder tables checked and laid out for the encoder and decoder. */
#include "ctxans_impl.h"

const family kvn_ctx_families[KVN_NDTYPES] = {
    [KVN_BF16] = {2, 8, 7},
    [KVN_FP16] = {2, 5, 10},
    [KVN_FP32] = {4, 8, 23},
    [KVN_FP8_E4M3] = {1, 4, 3},
    [KVN_FP8_E5M2] = {1, 5, 2},
};

/* The symbol whose interval holds `slot`. */
static unsigned symbol_at(const uint16_t *cum, const uint16_t *freq, uint32_t slot) {
    unsigned s = 0;
    while (s + 1 < KVN_CTX_SYMBOLS && cum[s + 1] <= slot) s++;
    (void)freq;
    return s;
}

/* A bucket's entry: first symbol | second symbol << 8 | second's start << 16, the second being
 * the first's successor inside the bucket (or the first itself, starting past every slot);
 * second == BUCKET_SEARCH when the bucket holds more than one boundary. */
static uint32_t bucket_entry(const uint16_t *cum, const uint16_t *freq, uint32_t b) {
    uint32_t lo = b << BUCKET_SHIFT, hi = lo + (1u << BUCKET_SHIFT) - 1;
    unsigned first = symbol_at(cum, freq, lo), last = symbol_at(cum, freq, hi);
    if (first == last) return first | first << 8 | 0x8000u << 16;
    unsigned second = symbol_at(cum, freq, cum[first] + freq[first]);
    if (second != last) return first | BUCKET_SEARCH << 8;
    return first | second << 8 | (uint32_t)cum[second] << 16;
}

kvn_ctx_model *kvn_ctx_model_new(int classes, int contexts, int start_context, const uint16_t *freq,
                                 const uint16_t *cum, const int32_t *cost, const int32_t *class_cost,
                                 const uint8_t *context_of, const uint8_t tag[4]) {
    if (classes < 1 || classes > KVN_CTX_MAX_CLASSES || contexts < 1 || contexts > KVN_CTX_MAX_CONTEXTS ||
        start_context < 0 || start_context >= contexts)
        return NULL;
    size_t models = (size_t)classes * (size_t)contexts + 2;
    for (size_t k = 0; k < models; k++) {
        uint32_t total = 0;
        for (int s = 0; s < KVN_CTX_SYMBOLS; s++) {
            uint16_t f = freq[k * KVN_CTX_SYMBOLS + s];
            if (cum[k * KVN_CTX_SYMBOLS + s] != total || (f == 0 && k + 2 < models)) return NULL;
            total += f;
        }
        if (total != 1u << PROB_BITS) return NULL;
    }
    for (int s = 0; s < KVN_CTX_SYMBOLS; s++)
        if (context_of[s] >= contexts) return NULL;
    for (size_t i = 0; i < (size_t)contexts * KVN_CTX_SYMBOLS * (size_t)classes; i++)
        if (cost[i] < 0 || cost[i] > 8 * PROB_BITS) return NULL;
    kvn_ctx_model *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->rec = malloc(models * REC_WORDS * sizeof(uint32_t));
    m->rcp = malloc(models * KVN_CTX_SYMBOLS * sizeof(uint64_t));
    m->search = malloc(models * KVN_CTX_SYMBOLS * sizeof(int16_t));
    m->coarse = malloc(models * 8 * sizeof(int16_t));
    m->cost = calloc((size_t)contexts * KVN_CTX_SYMBOLS * COST_LANES, sizeof(int16_t));
    if (!m->rec || !m->rcp || !m->search || !m->coarse || !m->cost) {
        kvn_ctx_model_free(m);
        return NULL;
    }
    m->classes = classes;
    m->contexts = contexts;
    m->start_context = start_context;
    m->class_model = classes * contexts;
    m->ref_model = classes * contexts + 1;
    for (size_t i = 0; i < models * KVN_CTX_SYMBOLS; i++) {
        FC(m, i / KVN_CTX_SYMBOLS, i % KVN_CTX_SYMBOLS) = freq[i] | (uint32_t)cum[i] << 16;
        m->rcp[i] = freq[i] ? ((1ull << 47) + freq[i] - 1) / freq[i] : 0;
        m->search[i] = (int16_t)(cum[i] ^ 0x8000u);
    }
    for (size_t k = 0; k < models; k++)
        for (int g = 0; g < 8; g++) m->coarse[k * 8 + g] = m->search[k * KVN_CTX_SYMBOLS + 8 * g];
    for (size_t k = 0; k < models; k++)
        for (uint32_t b = 0; b < BUCKETS; b++)
            m->rec[k * REC_WORDS + b] = bucket_entry(cum + k * KVN_CTX_SYMBOLS, freq + k * KVN_CTX_SYMBOLS, b);
    for (size_t r = 0; r < (size_t)contexts * KVN_CTX_SYMBOLS; r++)
        for (int k = 0; k < classes; k++) m->cost[r * COST_LANES + k] = (int16_t)cost[r * (size_t)classes + (size_t)k];
    memcpy(m->class_cost, class_cost, (size_t)classes * sizeof(int32_t));
    memcpy(m->context_of, context_of, KVN_CTX_SYMBOLS);
    for (int sym = 0; sym < KVN_CTX_SYMBOLS; sym++) m->context_off[sym] = (uint32_t)context_of[sym] * REC_WORDS;
    m->context_off[KVN_CTX_SYMBOLS] = (uint32_t)start_context * REC_WORDS;
    for (unsigned mask = 0; mask < 256; mask++)
        for (unsigned lane = 0; lane < 8; lane++)
            m->refill[mask * 8 + lane] = (uint32_t)__builtin_popcount(mask & ((1u << lane) - 1));
#ifdef KVN_AVX2_ROWS
    __builtin_cpu_init();
    m->avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
#endif
    memcpy(m->tag, tag, 4);
    return m;
}

void kvn_ctx_model_free(kvn_ctx_model *m) {
    if (!m) return;
    free(m->rec);
    free(m->rcp);
    free(m->search);
    free(m->coarse);
    free(m->cost);
    free(m);
}
