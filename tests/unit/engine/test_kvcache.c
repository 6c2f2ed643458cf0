/* Unit tests for the paged KV pool: allocation order, reference counts, the prefix
 * index, eviction order, and the layout promise (consecutive blocks are contiguous). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "engine/kvcache.h"
#include "engine/sampler.h"

static void test_layout_and_alloc(void **state)
{
    (void)state;
    kv_pool p;
    td_err err;
    assert_int_equal(kv_pool_init(&p, 3, 64, 16, TD_TYPE_F16, 10, false, &err), 0);
    assert_int_equal(p.token_bytes, 128);
    assert_int_equal(p.block_bytes, 2 * 16 * 128);
    assert_int_equal(p.n_free, 10);
    int a = kv_alloc(&p), b = kv_alloc(&p), c = kv_alloc(&p);
    assert_int_equal(a, 0);
    assert_int_equal(b, 1);
    assert_int_equal(c, 2);
    /* Consecutive block ids of a layer form one contiguous byte range. */
    assert_ptr_equal(kv_k(&p, 1, b), kv_k(&p, 1, a) + p.block_bytes);
    assert_ptr_equal(kv_v(&p, 2, a), kv_k(&p, 2, a) + 16 * p.token_bytes);
    assert_int_equal(p.n_free, 7);
    kv_release(&p, b);
    assert_int_equal(kv_alloc(&p), b); /* uncached blocks are reused first */
    kv_release(&p, a);
    kv_release(&p, b);
    kv_release(&p, c);
    assert_int_equal(p.n_free, 10);
    for (int i = 0; i < 10; i++) assert_true(kv_alloc(&p) >= 0);
    assert_int_equal(kv_alloc(&p), -1);
    kv_pool_free(&p);
}

/* Kept checksums survive a block's release and a prefix-cache revival (the bytes are
 * unchanged) and are cleared in every layer when the block is handed out again. */
static void test_checksums_cleared_on_reuse(void **state)
{
    (void)state;
    kv_pool p;
    td_err err;
    assert_int_equal(kv_pool_init(&p, 3, 64, 16, TD_TYPE_F16, 2, false, &err), 0);
    assert_null(p.crc);
    assert_int_equal(kv_pool_keep_checksums(&p, &err), 0);
    assert_non_null(p.crc);
    int a = kv_alloc(&p);
    for (int l = 0; l < 3; l++) p.crc_ok[l * 2 + a] = 1;
    kv_register(&p, a, 77);
    kv_release(&p, a);
    assert_int_equal(kv_lookup(&p, 77), a); /* revived: contents and checksums kept */
    for (int l = 0; l < 3; l++) assert_int_equal(p.crc_ok[l * 2 + a], 1);
    kv_release(&p, a);
    int b = kv_alloc(&p), c = kv_alloc(&p); /* the second one evicts a */
    assert_int_equal(b + c, 1);
    for (int l = 0; l < 3; l++) assert_int_equal(p.crc_ok[l * 2 + a], 0);
    kv_pool_free(&p);
    assert_null(p.crc);
}

/* A shareable pool lives in a memfd that another mapping sees; prefaulting commits the
 * pages and leaves the contents alone. */
static void test_shareable_and_prefault(void **state)
{
    (void)state;
    kv_pool p;
    td_err err;
    assert_int_equal(kv_pool_init(&p, 2, 64, 16, TD_TYPE_F16, 64, true, &err), 0);
    assert_true(p.fd >= 0);
    memset(kv_k(&p, 1, 5), 0xab, p.block_bytes);
    kv_pool_prefault(&p);
    for (size_t i = 0; i < p.block_bytes; i++) assert_int_equal(kv_k(&p, 1, 5)[i], 0xab);
    assert_int_equal(kv_k(&p, 0, 0)[0], 0);
    uint8_t *view = mmap(NULL, p.total_bytes, PROT_READ, MAP_SHARED, p.fd, 0);
    assert_true(view != MAP_FAILED);
    assert_int_equal(view[kv_k(&p, 1, 5) - p.base], 0xab);
    munmap(view, p.total_bytes);
    kv_pool_free(&p);
    assert_int_equal(p.fd, -1);
}

/* The index under churn, against a model: whatever kv_lookup returns holds the key it was
 * registered under and has not been handed out since. Few keys and many blocks, so that
 * blocks share keys (identical prompts admitted together, a last block recomputed) and
 * probe chains cross tombstones; an index that left a stale entry behind after evicting
 * one of two blocks of a key failed this within a few hundred steps. */
static void test_prefix_index_churn(void **state)
{
    (void)state;
    enum { NB = 16, NK = 6, STEPS = 20000 };
    kv_pool p;
    td_err err;
    assert_int_equal(kv_pool_init(&p, 1, 8, 4, TD_TYPE_F32, NB, false, &err), 0);
    uint64_t keys[NK], holds[NB] = {0}; /* holds[b]: the key b's contents are for, or 0 */
    int refs[NB] = {0};
    /* Keys that all start at one slot of the table (its hash, as kvcache.c computes it),
     * so that every probe chain crosses the others' entries and tombstones. */
    for (int k = 0, n = 0; k < NK; n++) {
        uint64_t c = 1000003ull * (uint64_t)(n + 1) + 7;
        if (((c * 0x9e3779b97f4a7c15ull >> 7) & (p.tab_cap - 1)) == 3) keys[k++] = c;
    }
    td_rng rng;
    td_rng_seed(&rng, 12345);
    for (int step = 0; step < STEPS; step++) {
        uint64_t r = td_rng_next(&rng);
        int op = (int)(r % 4), b = (int)((r >> 8) % NB);
        uint64_t key = keys[(r >> 16) % NK];
        if (op == 0) { /* a new block, its contents about to be written */
            int a = kv_alloc(&p);
            if (a >= 0) {
                holds[a] = 0;
                refs[a]++;
            }
        } else if (op == 1 && refs[b] > 0) { /* its contents computed for key */
            if (!holds[b]) holds[b] = key;
            kv_register(&p, b, holds[b]);
        } else if (op == 2 && refs[b] > 0) {
            refs[b]--;
            kv_release(&p, b);
        } else if (op == 3) {
            int hit = kv_lookup(&p, key);
            if (hit >= 0) {
                if (holds[hit] != key)
                    fail_msg("step %d: the index gave block %d for key %d, which holds %s", step,
                             hit, (int)((r >> 16) % NK),
                             holds[hit] ? "another key" : "nothing yet");
                refs[hit]++;
            }
        }
    }
    for (int b = 0; b < NB; b++)
        while (refs[b]-- > 0)
            kv_release(&p, b);
    assert_int_equal(p.n_free, NB);
    kv_pool_free(&p);
}

static void test_prefix_index(void **state)
{
    (void)state;
    kv_pool p;
    td_err err;
    assert_int_equal(kv_pool_init(&p, 1, 8, 4, TD_TYPE_F32, 4, false, &err), 0);
    int32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    uint64_t h0 = kv_block_hash(99, toks, 4), h1 = kv_block_hash(h0, toks + 4, 4);
    assert_true(h0 != h1);
    assert_true(kv_block_hash(98, toks, 4) != h0); /* the chain depends on the parent */
    int a = kv_alloc(&p), b = kv_alloc(&p);
    kv_register(&p, a, h0);
    kv_register(&p, b, h1);
    assert_int_equal(p.n_cached, 2);
    /* Shared while referenced. */
    assert_int_equal(kv_lookup(&p, h0), a);
    assert_int_equal(p.ref[a], 2);
    kv_release(&p, a);
    kv_release(&p, a);
    kv_release(&p, b);
    assert_int_equal(p.n_free, 4);
    /* Free but still cached: found again, and taken off the free queue. */
    assert_int_equal(kv_lookup(&p, h1), b);
    assert_int_equal(p.n_free, 3);
    kv_release(&p, b);
    /* Fresh blocks are handed out before cached ones; then cached ones, least recent first. */
    int x = kv_alloc(&p), y = kv_alloc(&p);
    assert_true(x != a && x != b && y != a && y != b);
    assert_int_equal(kv_alloc(&p), a); /* a was freed before b */
    assert_int_equal(kv_lookup(&p, h0), -1); /* evicted */
    assert_int_equal(kv_lookup(&p, h1), b);
    assert_int_equal(p.n_cached, 1);
    kv_pool_free(&p);
}

static void test_sampler(void **state)
{
    (void)state;
    float logits[6] = {0.1f, 3.0f, 2.9f, -1.0f, 3.0f, 0.0f};
    assert_int_equal(sampler_argmax(logits, 6), 1); /* lowest id on ties */
    sampler_scratch s;
    assert_int_equal(sampler_scratch_init(&s, 6), 0);
    td_rng rng;
    td_rng_seed(&rng, 1);
    sampler_params topk1 = {1.0f, 1, 1.0f, 0.0f};
    assert_int_equal(sampler_sample(&topk1, logits, 6, &rng, &s), 1);
    /* top_k = 3 only ever returns the three best tokens. */
    sampler_params topk3 = {1.0f, 3, 1.0f, 0.0f};
    int seen[6] = {0};
    for (int i = 0; i < 2000; i++) seen[sampler_sample(&topk3, logits, 6, &rng, &s)]++;
    assert_int_equal(seen[0] + seen[3] + seen[5], 0);
    assert_true(seen[1] > 0 && seen[2] > 0 && seen[4] > 0);
    /* min_p = 0.5 drops tokens below half the best probability. */
    sampler_params minp = {1.0f, 0, 1.0f, 0.5f};
    for (int i = 0; i < 500; i++) {
        int t = sampler_sample(&minp, logits, 6, &rng, &s);
        assert_true(t == 1 || t == 2 || t == 4);
    }
    /* a tiny top_p keeps only the single best token. */
    sampler_params topp = {1.0f, 0, 0.01f, 0.0f};
    for (int i = 0; i < 100; i++) assert_int_equal(sampler_sample(&topp, logits, 6, &rng, &s), 1);
    td_err err;
    sampler_params bad = {-1.0f, 0, 1.0f, 0.0f};
    assert_int_equal(sampler_check(&bad, &err), TD_EINVAL);
    sampler_scratch_free(&s);
}

/* The sampler before it sorted only candidates: every kept token sorted (the reference). */
static int ref_cmp(const void *a, const void *b, void *ctx)
{
    const float *prob = ctx;
    int32_t ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    if (prob[ia] != prob[ib]) return prob[ia] > prob[ib] ? -1 : 1;
    return ia < ib ? -1 : 1;
}

static int32_t ref_sample(const sampler_params *p, const float *logits, int nv, td_rng *rng,
                          float *prob, int32_t *idx)
{
    if (p->temperature <= 0.0f || p->top_k == 1) return sampler_argmax(logits, nv);
    float maxl = logits[0];
    for (int i = 1; i < nv; i++) maxl = fmaxf(maxl, logits[i]);
    float inv_t = 1.0f / p->temperature;
    for (int i = 0; i < nv; i++) prob[i] = expf((logits[i] - maxl) * inv_t);
    float thresh = p->min_p > 0.0f ? p->min_p : 0.0f;
    int n = 0;
    for (int i = 0; i < nv; i++)
        if (prob[i] >= thresh && prob[i] > 0.0f) idx[n++] = i;
    if (p->top_k > 0 || p->top_p < 1.0f) {
        qsort_r(idx, (size_t)n, sizeof(int32_t), ref_cmp, prob);
        if (p->top_k > 0 && n > p->top_k) n = p->top_k;
    }
    double sum = 0;
    for (int i = 0; i < n; i++) sum += prob[idx[i]];
    if (p->top_p < 1.0f) {
        double cum = 0, limit = p->top_p * sum;
        int keep = n;
        for (int i = 0; i < n; i++)
            if ((cum += prob[idx[i]]) >= limit) {
                keep = i + 1;
                break;
            }
        n = keep;
        sum = 0;
        for (int i = 0; i < n; i++) sum += prob[idx[i]];
    }
    double r = (double)td_rng_float(rng) * sum, acc = 0;
    for (int i = 0; i < n; i++)
        if (r < (acc += prob[idx[i]])) return idx[i];
    return idx[n > 0 ? n - 1 : 0];
}

/*
 * The sampler sorts only the candidates an ordered cut can keep (a histogram of the
 * probabilities by exponent picks them): the same tokens as sorting every kept token, for
 * top-k, top-p, min-p and their mixes, on a 32,000-token vocabulary of peaked, flat and
 * tied rows, with the same draws.
 */
static void test_sampler_candidates(void **state)
{
    (void)state;
    enum { V = 32000 };
    float *lg = malloc(V * sizeof(float)), *prob = malloc(V * sizeof(float));
    int32_t *idx = malloc(V * sizeof(int32_t));
    sampler_scratch s;
    assert_int_equal(sampler_scratch_init(&s, V), 0);
    const sampler_params ps[] = {
        {0.8f, 0, 0.9f, 0.0f},  {1.0f, 40, 1.0f, 0.0f},  {1.0f, 50, 0.95f, 0.0f},
        {1.3f, 0, 0.5f, 0.05f}, {0.7f, 0, 0.99f, 0.0f}, {2.0f, 0, 0.9f, 0.0f},
        {1.0f, 0, 1.0f, 0.02f}, {1.0f, 3, 0.3f, 0.0f},  {0.5f, 1000, 1.0f, 0.0f},
    };
    td_rng data, a, b;
    td_rng_seed(&data, 3);
    td_rng_seed(&a, 17);
    td_rng_seed(&b, 17);
    for (int kind = 0; kind < 3; kind++)
        for (int row = 0; row < 8; row++) {
            for (int i = 0; i < V; i++) {
                float g = 0;
                for (int k = 0; k < 4; k++) g += td_rng_float(&data) - 0.5f;
                lg[i] = kind == 1 ? 0.0f : (kind == 2 ? (i % 50 ? 1.0f : 5.0f) : 6.0f * g);
            }
            for (size_t pi = 0; pi < TD_ARRAY_LEN(ps); pi++)
                for (int d = 0; d < 4; d++) {
                    int32_t got = sampler_sample(&ps[pi], lg, V, &a, &s);
                    int32_t want = ref_sample(&ps[pi], lg, V, &b, prob, idx);
                    if (got != want)
                        fail_msg("kind %d row %d params %zu draw %d: %d, reference %d", kind, row, pi,
                                 d, got, want);
                }
        }
    sampler_scratch_free(&s);
    free(lg);
    free(prob);
    free(idx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_and_alloc),
        cmocka_unit_test(test_sampler_candidates),
        cmocka_unit_test(test_shareable_and_prefault),
        cmocka_unit_test(test_checksums_cleared_on_reuse),
        cmocka_unit_test(test_prefix_index),
        cmocka_unit_test(test_prefix_index_churn),
        cmocka_unit_test(test_sampler),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
