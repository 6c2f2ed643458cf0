/*
 * The engine on the GPU (--device cuda): on stories260K in f32, the same greedy tokens as
 * llama.cpp's golden outputs (and so as the CPU engine) for every golden prompt, alone and
 * all batched together, with chunked prefill and prefix-cache hits, and with a KV cache in
 * f16; in bf16, the first tokens are golden and batching changes nothing.
 * Skips (ctest skip code 77) in builds without the CUDA backend and on machines without
 * a GPU.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/engine.h"
#include "test_shared.h"

#include "golden_fixture.h"

#ifdef TD_HAVE_CUDA
#include <math.h>

#include <cuda_runtime_api.h>
#include <pthread.h>

#include "backend/cuda/cuda_fwd.h"
#include "engine/forward.h"
#include "engine/sampler.h"
#include "util/pool.h"

/*
 * GPU logits against the CPU forward pass on a random bf16 model, within a relative
 * error of 1e-2 per row (|gpu - cpu| / |cpu|, Euclidean norms over the vocabulary). The GPU makes its weights on the
 * device (deferred dummy weights), the CPU on the host, from the same seed. Four steps
 * cover the attention kernels: two prompts of 40 and 23 tokens in one batch (tensor-core
 * tiles where the KV type allows, split-K otherwise), a chunk of 7 beside a decode row,
 * two decode steps (a CUDA graph, captured and replayed), then three steps of one decode
 * row (one kernel for the whole step, where the model allows).
 */
/* Logits of the GPU against the CPU's over four steps of two sequences: a prefill, more
 * prompt rows, then two decode steps. Long: contexts of up to 211 tokens, so that decode
 * attention splits its keys across blocks (short: at most 48). */
static void compare_logits(const td_model_shape *shape, const char *kv_name, double tol, bool long_ctx)
{
    td_err err;
    td_type kvt = td_type_parse(kv_name);
    td_model *cm = NULL, *gm = NULL;
    if (td_model_load_dummy(&cm, shape, TD_TYPE_BF16, 11, &err)) fail_msg("%s", err.msg);
    if (td_model_load_dummy_deferred(&gm, shape, TD_TYPE_BF16, 11, &err)) fail_msg("%s", err.msg);
    assert_true(cm->fingerprint == gm->fingerprint);
    const int bs = 16, n_blocks = long_ctx ? 32 : 8, max_ctx = long_ctx ? 256 : 64;
    const int max_tokens = max_ctx, max_logits = max_ctx;
    int hd = shape->head_dim ? shape->head_dim : shape->n_embd / shape->n_head;
    td_pool *pool = NULL;
    if (td_pool_create(&pool, 8, false, &err)) fail_msg("%s", err.msg);
    kv_pool kv;
    if (kv_pool_init(&kv, shape->n_layer, shape->n_head_kv * hd, bs, kvt, n_blocks, false, &err))
        fail_msg("%s", err.msg);
    fwd_ctx cf;
    if (fwd_init(&cf, cm, &kv, pool, max_tokens, max_logits, max_ctx, &err)) fail_msg("%s", err.msg);
    td_cuda_fwd *gf = NULL;
    if (td_cuda_fwd_create(&gf, gm, 0, kvt, bs, n_blocks, max_tokens, max_logits, max_ctx, &err))
        fail_msg("%s", err.msg);
    int group = shape->n_head / shape->n_head_kv;
    const char *mega = getenv("TD_CUDA_MEGA");
    bool want_mk = (kvt == TD_TYPE_BF16 || kvt == TD_TYPE_F16) && (hd == 64 || hd == 128) &&
                   (group == 1 || group == 2 || group == 4 || group == 8) && !(mega && !strcmp(mega, "0"));
    assert_int_equal(td_cuda_fwd_one_kernel(gf), want_mk);
    int32_t t0[16], t1[16]; /* sequence 1's blocks in reverse: tables need not be in order */
    for (int i = 0; i < n_blocks / 2; i++) t0[i] = i, t1[i] = n_blocks - 1 - i;
    const int32_t *tables[2] = {t0, t1};
    size_t V = (size_t)shape->n_vocab;
    float *lc = malloc((size_t)max_logits * V * 4), *lg = malloc((size_t)max_logits * V * 4);
    td_rng rng;
    td_rng_seed(&rng, 3);
    /* (rows of seq 0, rows of seq 1) per step; positions continue from the last step */
    /* The last three steps decode one row: the one-kernel decode (k_mega) where the model
     * allows, for either sequence (sequence 1's block table is in reverse). */
    const int short_steps[7][2] = {{40, 23}, {7, 1}, {1, 1}, {1, 1}, {1, 0}, {0, 1}, {1, 0}};
    const int long_steps[7][2] = {{150, 100}, {60, 1}, {1, 1}, {1, 1}, {1, 0}, {0, 1}, {1, 0}};
    const int(*steps)[2] = long_ctx ? long_steps : short_steps;
    int next[2] = {0, 0};
    double worst = 0, worst_max = 0;
    for (int st = 0; st < 7; st++) {
        int32_t tok[256], pos[256], seq[256], rows[256];
        int T = 0;
        for (int sq = 0; sq < 2; sq++)
            for (int i = 0; i < steps[st][sq]; i++, T++) {
                tok[T] = (int32_t)(td_rng_next(&rng) % V);
                pos[T] = next[sq]++;
                seq[T] = sq;
                rows[T] = T;
            }
        fwd_batch b = {.n_tokens = T, .tokens = tok, .pos = pos, .seq = seq, .block_tables = tables,
                       .n_logits = T, .logit_rows = rows, .logits = lc};
        fwd_run(&cf, &b);
        int32_t am[256];
        if (td_cuda_fwd_run(gf, T, tok, pos, seq, tables, 2, T, rows, lg, NULL, NULL, am, &err)) fail_msg("%s", err.msg);
        for (int r = 0; r < T; r++) assert_int_equal(am[r], sampler_argmax(lg + (size_t)r * V, (int)V));
        for (int r = 0; r < T; r++) {
            double n2 = 0, d2 = 0, mx = 0, dmax = 0;
            for (size_t v = 0; v < V; v++) {
                double c = lc[r * V + v], dd = (double)lg[r * V + v] - c;
                n2 += c * c;
                d2 += dd * dd;
                mx = fmax(mx, fabs(c));
                dmax = fmax(dmax, fabs(dd));
            }
            double rel = sqrt(d2 / n2);
            worst = fmax(worst, rel);
            worst_max = fmax(worst_max, dmax / mx);
            if (!(rel <= tol))
                fail_msg("%s KV, step %d row %d (seq %d pos %d): |gpu - cpu| / |cpu| = %.4g",
                         kv_name, st, r, seq[r], pos[r], rel);
        }
    }
    printf("  %s KV%s%s%s: relative error of the logits (L2 per row) at most %.2e; largest element "
           "difference %.2e of the row's largest logit\n", kv_name, long_ctx ? " (long)" : "",
           shape->rope_type == TD_ROPE_NEOX ? ", NeoX RoPE" : "", want_mk ? ", one-kernel decode" : "", worst,
           worst_max);
    free(lc);
    free(lg);
    td_cuda_fwd_free(gf);
    fwd_free(&cf);
    kv_pool_free(&kv);
    td_pool_free(pool);
    td_model_free(cm);
    td_model_free(gm);
}

/* head_dim 128, 4 query heads per KV head (the Llama-3-8B layout), small. */
static void test_logits_hd128(void **state)
{
    (void)state;
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    s.n_vocab = 2048;
    s.n_embd = 1024;
    s.n_layer = 3;
    s.n_head = 8;
    s.n_head_kv = 2;
    s.n_ff = 2816;
    s.head_dim = 128;
    s.rope_theta = 500000.0f;
    const char *kvs[] = {"bf16", "f16", "f32"};
    for (int i = 0; i < 3; i++) compare_logits(&s, kvs[i], 1e-2, false);
    compare_logits(&s, "bf16", 1e-2, true);
    compare_logits(&s, "f16", 1e-2, true);
    s.rope_type = TD_ROPE_NEOX; /* pairs (i, i + 64): across lanes in the one-kernel decode */
    compare_logits(&s, "bf16", 1e-2, true);
    s.rope_type = TD_ROPE_NORM;
    /* fp8 rounds K and V to 3 mantissa bits on both sides; a rounding that differs by one
     * step (the GPU's K differs from the CPU's in the last bits) moves a logit further */
    compare_logits(&s, "fp8", 3e-2, false);
}

/* llama-1b (the TinyLlama shape: head_dim 64, 8 query heads per KV head), as issue 8 asks. */
static void test_logits_llama1b(void **state)
{
    (void)state;
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("llama-1b", &s, &err), 0);
    compare_logits(&s, "bf16", 1e-2, false);
}

/* head_dim 64 with 8 and with 16 query heads per KV head, long contexts: the decode
 * kernel's second row of heads (16), and prompts that go to it rather than to the tile
 * kernel (which takes groups of up to 8). */
static void test_logits_groups(void **state)
{
    (void)state;
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    s.n_vocab = 2048;
    s.n_embd = 1024;
    s.n_layer = 2;
    s.n_head = 16;
    s.n_ff = 2048;
    s.head_dim = 64;
    s.n_head_kv = 2;
    compare_logits(&s, "bf16", 1e-2, true);
    s.n_head_kv = 1;
    compare_logits(&s, "bf16", 1e-2, true);
}

static void test_golden_alone(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(1, 512, 0, "f32", false);
    for (int i = 0; i < g_n_cases; i++) check_golden(e, &i, 1);
    td_engine_free(e);
}

static void test_golden_batched_and_chunked(void **state)
{
    (void)state;
    load_golden();
    int order[MAX_CASES];
    for (int i = 0; i < g_n_cases; i++) order[i] = g_n_cases - 1 - i;
    const int chunks[] = {512, 7, 16};
    for (size_t c = 0; c < sizeof(chunks) / sizeof(chunks[0]); c++) {
        td_engine *e = make_engine(1, chunks[c], 0, "f32", c == 2);
        check_golden(e, order, g_n_cases);
        check_golden(e, order, g_n_cases); /* with c == 2, from the prefix cache */
        td_engine_free(e);
    }
}

/* A KV cache in f16 keeps the golden tokens; bf16 rounds K and V harder, so (as on the
 * CPU, test_engine.c) only its first token must be golden, and batching must not change
 * its output. */
static void test_golden_kv_types(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(1, 512, 0, "f16", false);
    for (int i = 0; i < g_n_cases; i++) check_golden(e, &i, 1);
    td_engine_free(e);
    e = make_engine(1, 512, 0, "bf16", false);
    const int32_t *prompts[MAX_CASES];
    int lens[MAX_CASES], n_alone[MAX_CASES], n_batched[MAX_CASES];
    static int32_t alone[MAX_CASES][N_OUT], batched[MAX_CASES][N_OUT];
    for (int i = 0; i < g_n_cases; i++) {
        prompts[i] = g_cases[i].prompt;
        lens[i] = g_cases[i].n_prompt;
        run_all(e, &prompts[i], &lens[i], 1, N_OUT, &alone[i], &n_alone[i]);
        assert_int_equal(n_alone[i], N_OUT);
        assert_int_equal(alone[i][0], g_cases[i].out[0]);
    }
    run_all(e, prompts, lens, g_n_cases, N_OUT, batched, n_batched);
    for (int i = 0; i < g_n_cases; i++)
        assert_memory_equal(alone[i], batched[i], sizeof(alone[i]));
    td_engine_free(e);
}
/* --device cuda:N: GPU 0 by number, used from another thread than the one that made the
 * engine (as the server's engine thread does); a GPU this process does not see is a clear
 * error. */
static void *golden_on_thread(void *arg)
{
    for (int i = 0; i < g_n_cases; i++) check_golden(arg, &i, 1);
    return NULL;
}

static void test_device_choice(void **state)
{
    (void)state;
    load_golden();
    const char *saved = g_device;
    g_device = "cuda:0";
    td_engine *e = make_engine(1, 512, 0, "f32", false);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, golden_on_thread, e), 0);
    pthread_join(th, NULL);
    td_engine_free(e);
    int n = 0;
    cudaGetDeviceCount(&n);
    char dev[32], want[64];
    snprintf(dev, sizeof(dev), "cuda:%d", n);
    snprintf(want, sizeof(want), "this process sees %d GPU", n);
    td_engine_config c;
    td_engine_config_default(&c);
    c.model_path = td_test_shared_path("models/stories260K.gguf");
    c.device = dev;
    c.n_threads = 1;
    td_err err = {0};
    assert_int_not_equal(td_engine_create(&e, &c, &err), 0);
    assert_non_null(strstr(err.msg, want));
    g_device = saved;
}

/* Logit rows of four kinds: peaked random, ties alone, random with NaN and -inf entries, flat. */
static void sample_rows(float *lg, int V, int kind, td_rng *rng)
{
    for (int i = 0; i < V; i++) {
        float g = 0;
        for (int k = 0; k < 4; k++) g += td_rng_float(rng) - 0.5f;
        lg[i] = kind == 3 ? 0.0f : 3.0f * g;
    }
    if (kind == 1) /* 330 tokens tie, the rest impossible: p is exactly 1 or 0 on both sides */
        for (int i = 0; i < V; i++) lg[i] = i % 97 ? -INFINITY : 4.0f;
    if (kind == 2) {
        for (int i = 0; i < V; i += 13) lg[i] = -INFINITY;
        lg[5] = NAN;
        lg[77] = NAN;
    }
}

/*
 * The GPU's sampler against the host's (sampler_sample) on the same logits and the same
 * draw: temperature, top-k, top-p and min-p alone and together, and the path without an
 * order (min-p alone: ids in order). The probabilities are computed by two expf (the
 * device's is within 2 ulp), and the sums in double in different orders, so a draw that
 * falls within ~1e-7 of a boundary between two tokens may go either way: rows of ties alone
 * and flat rows must agree every time, random rows in all but 1% of the draws.
 */
static void test_device_sampling(void **state)
{
    (void)state;
    td_err err;
    td_model_shape shp;
    assert_int_equal(td_model_preset("tiny", &shp, &err), 0);
    shp.n_vocab = 32003; /* not a multiple of the block's threads */
    shp.n_layer = 1;
    td_model *gm = NULL;
    if (td_model_load_dummy_deferred(&gm, &shp, TD_TYPE_BF16, 5, &err)) fail_msg("%s", err.msg);
    const int V = shp.n_vocab, R = 16;
    td_cuda_fwd *gf = NULL;
    if (td_cuda_fwd_create(&gf, gm, 0, TD_TYPE_BF16, 16, 8, 64, R, 64, &err)) fail_msg("%s", err.msg);
    const sampler_params ps[] = {
        {0.7f, 0, 0.9f, 0.0f}, {1.0f, 40, 1.0f, 0.0f},  {1.3f, 0, 1.0f, 0.05f},
        {0.8f, 50, 0.95f, 0.02f}, {1.0f, 0, 1.0f, 0.0f}, {0.5f, 0, 0.5f, 0.0f},
        {2.0f, 0, 1.0f, 0.1f},
    };
    float *lg = malloc((size_t)R * V * 4);
    sampler_scratch sc;
    assert_int_equal(sampler_scratch_init(&sc, V), 0);
    td_rng rng, data;
    td_rng_seed(&rng, 99);
    td_rng_seed(&data, 7);
    int draws = 0, off_random = 0;
    for (size_t pi = 0; pi < TD_ARRAY_LEN(ps); pi++)
        for (int kind = 0; kind < 4; kind++) {
            td_cuda_sample cs[16];
            int32_t host[16], dev[16];
            for (int r = 0; r < R; r++) {
                sample_rows(lg + (size_t)r * V, V, kind, &data);
                td_rng peek = rng;
                cs[r] = (td_cuda_sample){ps[pi].temperature, ps[pi].top_p, ps[pi].min_p, td_rng_float(&peek),
                                         ps[pi].top_k};
                host[r] = sampler_sample(&ps[pi], lg + (size_t)r * V, V, &rng, &sc); /* draws that u */
            }
            if (td_cuda_sample_logits(gf, lg, R, cs, dev, &err)) fail_msg("%s", err.msg);
            for (int r = 0; r < R; r++, draws++) {
                assert_true(dev[r] >= 0 && dev[r] < V);
                assert_true(lg[(size_t)r * V + dev[r]] > -INFINITY); /* never NaN or -inf */
                if (dev[r] == host[r]) continue;
                if (kind == 1 || kind == 3)
                    fail_msg("params %zu, row kind %d, draw %d: device %d, host %d", pi, kind, r, dev[r],
                             host[r]);
                off_random++;
            }
        }
    printf("  device sampling: %d draws, %d of them (random rows) on the other side of a boundary\n", draws,
           off_random);
    assert_true(off_random * 100 <= draws);

    /* Through a step: the sampled token of a prompt's last row, and of a decode row (the
     * one-kernel step where it runs), is what the host samples from the same logits. */
    int32_t t0[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t *tables[1] = {t0};
    int32_t tok[5] = {11, 22, 33, 44, 55}, pos[5] = {0, 1, 2, 3, 4}, seq[5] = {0};
    int32_t last = 4, first = 0;
    const sampler_params sp = {0.9f, 30, 0.9f, 0.0f};
    for (int step = 0; step < 2; step++) {
        int T = step == 0 ? 5 : 1;
        const int32_t *tk = step == 0 ? tok : &tok[0], *ps_ = step == 0 ? pos : &pos[4];
        int32_t row = step == 0 ? last : first, got = -1, want = -2;
        if (step == 1) {
            tok[0] = 66;
            pos[4] = 5;
        }
        td_rng peek = rng;
        td_cuda_sample cs = {sp.temperature, sp.top_p, sp.min_p, td_rng_float(&peek), sp.top_k};
        uint8_t no = 0, yes = 1;
        if (td_cuda_fwd_run(gf, T, tk, ps_, seq, tables, 1, 1, &row, lg, &no, &cs, &got, &err))
            fail_msg("%s", err.msg);
        int32_t am;
        if (td_cuda_fwd_run(gf, T, tk, ps_, seq, tables, 1, 1, &row, lg, &yes, &cs, &am, &err))
            fail_msg("%s", err.msg);
        want = sampler_sample(&sp, lg, V, &rng, &sc);
        assert_int_equal(got, want);
    }
    sampler_scratch_free(&sc);
    free(lg);
    td_cuda_fwd_free(gf);
    td_model_free(gm);
}

/* One request on stories260K with the given sampling; its tokens into out (n of them). */
static int sampled_run(td_engine *e, float temperature, float top_p, int top_k, uint64_t seed, int logprobs,
                       int32_t *out)
{
    load_golden();
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = temperature;
    sp.top_p = top_p;
    sp.top_k = top_k;
    sp.has_seed = true;
    sp.seed = seed;
    sp.logprobs = logprobs;
    sp.max_tokens = 24;
    sp.ignore_eos = true;
    td_err err;
    uint64_t id;
    assert_int_equal(td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), 0);
    int n = 0;
    while (td_engine_has_work(e)) {
        assert_true(td_engine_step(e, &err) >= 0);
        td_output o;
        while (td_engine_poll(e, &o))
            if (o.token >= 0 && n < 24) out[n++] = o.token;
    }
    return n;
}

/*
 * Seeded sampling through the engine on the GPU: the same seed gives the same tokens, and
 * the rows sampled on the device (no logprobs) give the tokens that the host's sampler
 * gives from the same logits and the same draws (logprobs bring a row's logits to the
 * host), for top-p, top-k and plain temperature.
 */
static void test_engine_sampling(void **state)
{
    (void)state;
    td_engine *e = make_engine(1, 512, 0, "f32", false);
    const struct {
        float t, p;
        int k;
    } cases[] = {{0.9f, 0.9f, 0}, {1.2f, 1.0f, 20}, {1.0f, 1.0f, 0}};
    for (size_t c = 0; c < TD_ARRAY_LEN(cases); c++) {
        int32_t a[24], b[24], h[24];
        int na = sampled_run(e, cases[c].t, cases[c].p, cases[c].k, 5 + c, 0, a);
        int nb = sampled_run(e, cases[c].t, cases[c].p, cases[c].k, 5 + c, 0, b);
        int nh = sampled_run(e, cases[c].t, cases[c].p, cases[c].k, 5 + c, 2, h);
        assert_int_equal(na, 24);
        assert_int_equal(nb, 24);
        assert_int_equal(nh, 24);
        assert_memory_equal(a, b, sizeof(a));
        assert_memory_equal(a, h, sizeof(a));
    }
    td_engine_free(e);
}

/* A mixture-of-experts model is refused on the GPU at start-up, with a clear error. */
static void test_moe_refused(void **state)
{
    (void)state;
    td_engine_config c;
    td_engine_config_default(&c);
    c.load_format = "dummy";
    c.dummy_preset = "moe-tiny";
    c.device = "cuda";
    c.n_threads = 1;
    td_engine *e = NULL;
    td_err err = {0};
    assert_int_equal(td_engine_create(&e, &c, &err), TD_EUNSUPPORTED);
    assert_null(e);
    assert_non_null(strstr(err.msg, "the GPU backend does not run mixture-of-experts models"));
}
#endif

int main(void)
{
#ifndef TD_HAVE_CUDA
    printf("SKIP: this build has no CUDA backend (configure with -DTANDEM_CUDA=ON)\n");
    return 77;
#else
    char why[256];
    if (!td_cuda_available(why, sizeof(why))) {
        printf("SKIP: %s\n", why);
        return 77;
    }
    g_device = "cuda";
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_alone),
        cmocka_unit_test(test_golden_batched_and_chunked),
        cmocka_unit_test(test_golden_kv_types),
        cmocka_unit_test(test_logits_hd128),
        cmocka_unit_test(test_logits_llama1b),
        cmocka_unit_test(test_logits_groups),
        cmocka_unit_test(test_device_choice),
        cmocka_unit_test(test_device_sampling),
        cmocka_unit_test(test_engine_sampling),
        cmocka_unit_test(test_moe_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
