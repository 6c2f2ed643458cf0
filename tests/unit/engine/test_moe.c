/*
 * Mixture-of-experts forward pass (engine/moe.c) on tiny random models of the mkmodel
 * presets moe-tiny (llama, Mixtral-style routing) and qwen2moe-tiny (softmax over all
 * experts, a gated shared expert):
 *   - routing: top-k with ties to the lower index, and each architecture's weights;
 *   - the MoE layer against a naive per-token reference written here (plain loops over the
 *     selected experts, in double), in f32, f16, bf16 and q8_0;
 *   - batch invariance of the layer: a row's output is bit-identical alone and in batches of
 *     other rows (up to 300 rows, so q8_0 experts run both the packed decode kernels and
 *     the prefill ones), and each selected expert runs once per call;
 *   - the engine: greedy tokens identical alone, batched, chunked, with prefix-cache hits,
 *     after preemption and with 1 or 2 threads.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/forward.h"
#include "engine/moe.h"
#include "model/model.h"
#include "tandem/engine.h"
#include "test_shared.h"

#include "golden_fixture.h"

/* ---- routing ------------------------------------------------------------------ */

static void test_route_row(void **state)
{
    (void)state;
    int32_t sel[4];
    float w[4];
    /* ties go to the lower index, whatever their position */
    const float tie[6] = {0.5f, 2.0f, 1.0f, 2.0f, 1.0f, 2.0f};
    moe__route_row(tie, 6, 4, true, sel, w);
    assert_int_equal(sel[0], 1);
    assert_int_equal(sel[1], 3);
    assert_int_equal(sel[2], 5);
    assert_int_equal(sel[3], 2);
    /* Mixtral: softmax over the selected logits only */
    const float lg[5] = {1.0f, 3.0f, -2.0f, 2.0f, 0.0f};
    moe__route_row(lg, 5, 2, true, sel, w);
    assert_int_equal(sel[0], 1);
    assert_int_equal(sel[1], 3);
    assert_float_equal(w[0], 1.0 / (1.0 + exp(-1.0)), 1e-6);
    assert_float_equal(w[0] + w[1], 1.0, 1e-6);
    /* qwen2moe: the selected probabilities of the softmax over all experts, not renormalised */
    moe__route_row(lg, 5, 2, false, sel, w);
    double z = exp(1.0) + exp(3.0) + exp(-2.0) + exp(2.0) + exp(0.0);
    assert_float_equal(w[0], exp(3.0) / z, 1e-6);
    assert_float_equal(w[1], exp(2.0) / z, 1e-6);
    assert_true(w[0] + w[1] < 0.95f);
    /* a NaN logit never wins while a number is left */
    const float nan_lg[3] = {NAN, -1.0f, -3.0f};
    moe__route_row(nan_lg, 3, 2, true, sel, w);
    assert_int_equal(sel[0], 1);
    assert_int_equal(sel[1], 2);
}

/* ---- the layer against a naive reference ----------------------------------------- */

typedef struct layer_env {
    td_model *m;
    td_pool *pool;
    fwd_ctx f;
} layer_env;

static void env_init(layer_env *env, const char *preset, td_type type, int max_tokens)
{
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset(preset, &s, &err), 0);
    if (td_model_load_dummy(&env->m, &s, type, 17, &err)) fail_msg("%s", err.msg);
    if (td_pool_create(&env->pool, 2, false, &err)) fail_msg("%s", err.msg);
    if (fwd_init(&env->f, env->m, NULL, env->pool, max_tokens, 1, 16, &err))
        fail_msg("%s", err.msg);
}

static void env_free(layer_env *env)
{
    fwd_free(&env->f);
    td_pool_free(env->pool);
    td_model_free(env->m);
}

/* Rows like the FFN norm's output: RMS about 1. */
static void random_rows(float *x, int n, uint64_t seed)
{
    td_rng rng;
    td_rng_seed(&rng, seed);
    for (int i = 0; i < n; i++)
        x[i] = 1.7320508f * (2.0f * td_rng_float(&rng) - 1.0f);
}

/*
 * y[i] = row r0 + i of w . x, for n rows, in double. The quantized kernels quantize x to
 * q8_0 first (exactly as the reference quantizer does); so does this, so that the two
 * differ only in the order of their sums.
 */
static void ref_matvec(const td_weight *w, int64_t r0, int64_t n, const float *x, double *y)
{
    int64_t K = w->cols;
    float *xr = malloc((size_t)K * sizeof(float)), *row = malloc((size_t)K * sizeof(float));
    if (w->type == TD_TYPE_Q8_0 || w->type == TD_TYPE_Q4_0) {
        uint8_t *q = malloc(td_row_bytes(TD_TYPE_Q8_0, K));
        td_quant_row_ref(TD_TYPE_Q8_0, x, q, K);
        td_dequant_row_ref(TD_TYPE_Q8_0, q, xr, K);
        free(q);
    } else {
        memcpy(xr, x, (size_t)K * sizeof(float));
    }
    for (int64_t i = 0; i < n; i++) {
        td_dequant_row_ref(w->type, (const uint8_t *)w->data + (size_t)(r0 + i) * w->row_bytes, row,
                           K);
        double acc = 0;
        for (int64_t k = 0; k < K; k++)
            acc += (double)row[k] * xr[k];
        y[i] = acc;
    }
    free(xr);
    free(row);
}

/* One SwiGLU FFN (rows r0.. of gate/up, rows d0.. of down) of x, added to out with weight a. */
static void ref_ffn(const td_weight *gate, const td_weight *up, const td_weight *down, int64_t r0,
                    int64_t ff, int64_t d0, int64_t d, const float *x, double a, double *out)
{
    double *g = malloc((size_t)ff * sizeof(double)), *u = malloc((size_t)ff * sizeof(double));
    double *y = malloc((size_t)d * sizeof(double));
    float *h = malloc((size_t)ff * sizeof(float));
    ref_matvec(gate, r0, ff, x, g);
    ref_matvec(up, r0, ff, x, u);
    for (int64_t i = 0; i < ff; i++)
        h[i] = (float)(g[i] / (1.0 + exp(-g[i])) * u[i]);
    ref_matvec(down, d0, d, h, y);
    for (int64_t i = 0; i < d; i++)
        out[i] += a * y[i];
    free(g);
    free(u);
    free(y);
    free(h);
}

/*
 * The MoE FFN of one row, naively: every router logit, a sort for the top-k, the weights
 * as the architecture says, then a plain loop over the selected experts (and the shared
 * expert). Returns false when the k-th and (k+1)-th logits are too close to call (the
 * kernel's float logits could then rightly pick the other expert); sel gets the choice.
 */
static bool ref_moe_row(const td_model *m, const td_layer *L, const float *x, double *out,
                        int32_t *sel)
{
    const td_model_shape *s = &m->shape;
    int E = s->n_expert, k = s->n_expert_used, d = s->n_embd, ffe = s->n_ff_exp;
    double lg[64];
    assert_true(E <= 64);
    ref_matvec(&L->router, 0, E, x, lg);
    bool taken[64] = {false};
    for (int j = 0; j <= k && j < E; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || lg[e] > lg[best])) best = e;
        taken[best] = true;
        if (j < k)
            sel[j] = best;
        else if (lg[sel[k - 1]] - lg[best] < 1e-4)
            return false;
    }
    double w[64], z = 0, top = lg[sel[0]];
    if (td_moe_norm_topk(s)) {
        for (int j = 0; j < k; j++)
            z += w[j] = exp(lg[sel[j]] - top);
        for (int j = 0; j < k; j++)
            w[j] /= z;
    } else {
        for (int e = 0; e < E; e++)
            z += exp(lg[e] - top);
        for (int j = 0; j < k; j++)
            w[j] = exp(lg[sel[j]] - top) / z;
    }
    memset(out, 0, (size_t)d * sizeof(double));
    for (int j = 0; j < k; j++)
        ref_ffn(&L->w_gate_exps, &L->w_up_exps, &L->w_down_exps, (int64_t)sel[j] * ffe, ffe,
                (int64_t)sel[j] * d, d, x, w[j], out);
    if (s->n_ff_shexp) {
        const float *gv = L->shexp_gate.data;
        double g = 0;
        for (int i = 0; i < d; i++)
            g += (double)gv[i] * x[i];
        ref_ffn(&L->w_gate_shexp, &L->w_up_shexp, &L->w_down_shexp, 0, s->n_ff_shexp, 0, d, x,
                1.0 / (1.0 + exp(-g)), out);
    }
    return true;
}

static void test_layer_vs_reference(void **state)
{
    (void)state;
    static const struct {
        const char *preset;
        td_type type;
        double tol; /* of the largest output magnitude (measured: 1.2e-7 to 2.3e-7) */
    } cases[] = {
        {"moe-tiny", TD_TYPE_F32, 2e-6},      {"moe-tiny", TD_TYPE_BF16, 2e-6},
        {"moe-tiny", TD_TYPE_Q8_0, 1e-5},     {"qwen2moe-tiny", TD_TYPE_F32, 2e-6},
        {"qwen2moe-tiny", TD_TYPE_F16, 2e-6}, {"qwen2moe-tiny", TD_TYPE_Q8_0, 1e-5},
    };
    const int T = 40;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        layer_env env;
        env_init(&env, cases[c].preset, cases[c].type, T);
        const td_model_shape *s = &env.m->shape;
        int d = s->n_embd, k = s->n_expert_used;
        float *x = env.f.xb, *out = env.f.xb2;
        random_rows(x, T * d, 100 + c);
        for (int l = 0; l < s->n_layer; l++) {
            const td_layer *L = &env.m->layers[l];
            moe_ffn(&env.f, L, x, out, T);
            double *ref = malloc((size_t)d * sizeof(double)), max_ref = 0, max_diff = 0;
            int compared = 0;
            for (int t = 0; t < T; t++) {
                int32_t sel[8];
                if (!ref_moe_row(env.m, L, x + (size_t)t * d, ref, sel)) continue;
                compared++;
                /* the kernel chose the same experts, best first */
                assert_memory_equal(sel, env.f.moe.sel + (size_t)t * k,
                                    (size_t)k * sizeof(int32_t));
                for (int i = 0; i < d; i++) {
                    max_ref = fmax(max_ref, fabs(ref[i]));
                    max_diff = fmax(max_diff, fabs(ref[i] - out[(size_t)t * d + i]));
                }
            }
            free(ref);
            if (max_diff > cases[c].tol * max_ref || compared < T * 3 / 4)
                fail_msg("%s %s layer %d: max |diff| %.3g, max |ref| %.3g (tol %.1g), %d of %d "
                         "rows compared",
                         cases[c].preset, td_type_name(cases[c].type), l, max_diff, max_ref,
                         cases[c].tol, compared, T);
            assert_true(max_ref > 0.01);
        }
        env_free(&env);
    }
}

/* ---- batch invariance of the layer -------------------------------------------------- */

static void test_layer_batch_invariance(void **state)
{
    (void)state;
    static const struct {
        const char *preset;
        td_type type;
    } cases[] = {{"moe-tiny", TD_TYPE_Q8_0},
                 {"moe-tiny", TD_TYPE_F16},
                 {"qwen2moe-tiny", TD_TYPE_Q8_0},
                 {"qwen2moe-tiny", TD_TYPE_BF16}};
    const int T = 300;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        layer_env env;
        env_init(&env, cases[c].preset, cases[c].type, T);
        const td_model_shape *s = &env.m->shape;
        size_t d = (size_t)s->n_embd;
        const td_layer *L = &env.m->layers[1];
        float *x = malloc(T * d * sizeof(float)), *all = malloc(T * d * sizeof(float));
        random_rows(x, T * (int)d, 7 + c);
        /* the whole batch: every expert gets far more than 64 rows here */
        memcpy(env.f.xb, x, T * d * sizeof(float));
        uint64_t runs = env.f.moe_expert_runs;
        moe_ffn(&env.f, L, env.f.xb, env.f.xb2, T);
        assert_int_equal(env.f.moe_expert_runs - runs, s->n_expert); /* each expert once */
        int big = 0; /* experts whose rows run the prefill kernels, not the decode ones */
        for (int e = 0; e < s->n_expert; e++)
            big += env.f.moe.start[e + 1] - env.f.moe.start[e] > 64;
        assert_true(big >= s->n_expert / 2);
        memcpy(all, env.f.xb2, T * d * sizeof(float));
        /* each row alone (one row: exactly k experts run), and in a batch of 37 other rows */
        for (int t = 0; t < T; t += 7) {
            memcpy(env.f.xb, x + t * d, d * sizeof(float));
            runs = env.f.moe_expert_runs;
            moe_ffn(&env.f, L, env.f.xb, env.f.xb2, 1);
            assert_int_equal(env.f.moe_expert_runs - runs, s->n_expert_used);
            if (memcmp(env.f.xb2, all + t * d, d * sizeof(float)))
                fail_msg("%s %s: row %d alone differs from the batch", cases[c].preset,
                         td_type_name(cases[c].type), t);
        }
        for (int i = 0; i < 37; i++)
            memcpy(env.f.xb + i * d, x + (size_t)((i * 11 + 5) % T) * d, d * sizeof(float));
        moe_ffn(&env.f, L, env.f.xb, env.f.xb2, 37);
        for (int i = 0; i < 37; i++)
            assert_memory_equal(env.f.xb2 + i * d, all + (size_t)((i * 11 + 5) % T) * d,
                                d * sizeof(float));
        free(x);
        free(all);
        env_free(&env);
    }
}

/* The memory plan counts the experts' workspace: what fwd_init allocates. */
static void test_workspace_budget(void **state)
{
    (void)state;
    const char *presets[] = {"moe-tiny", "qwen2moe-tiny", "tiny"};
    for (int p = 0; p < 3; p++) {
        layer_env env;
        env_init(&env, presets[p], TD_TYPE_F32, 96);
        size_t planned = fwd_workspace_bytes(env.m, 96, 1, 16, 2);
        assert_true(env.f.workspace_bytes <= planned);
        assert_true(planned - env.f.workspace_bytes <= 64 * 16);
        assert_int_equal(env.f.moe.bytes, moe_workspace_bytes(env.m, 96, false));
        assert_true((env.f.moe.bytes > 0) == (env.m->shape.n_expert > 0));
        if (env.m->shape.n_expert) /* gathered inputs: 96 rows x k experts x n_embd */
            assert_true(env.f.moe.bytes > (size_t)96 * env.m->shape.n_expert_used * 128 * 4);
        env_free(&env);
    }
}

/* ---- the engine ------------------------------------------------------------------ */

static td_engine *make_moe_engine(const char *preset, const char *dtype, int threads, int chunk,
                                  uint64_t kv_bytes, int max_len, bool prefix)
{
    td_engine_config c;
    td_engine_config_default(&c);
    c.load_format = "dummy";
    c.model_path = preset;
    c.dummy_type = dtype;
    c.seed = 5;
    c.n_threads = threads;
    c.pin_threads = false;
    c.max_num_batched_tokens = chunk;
    c.kv_cache_memory = kv_bytes;
    c.max_model_len = max_len;
    c.enable_prefix_caching = prefix;
    td_engine *e = NULL;
    td_err err = {0};
    if (td_engine_create(&e, &c, &err)) fail_msg("engine create: %s", err.msg);
    return e;
}

#define N_PROMPTS 12

static int32_t g_prompts[N_PROMPTS][96];
static int g_lens[N_PROMPTS];

static void make_prompts(void)
{
    td_rng rng;
    td_rng_seed(&rng, 99);
    for (int i = 0; i < N_PROMPTS; i++) {
        g_lens[i] = 3 + (int)(td_rng_next(&rng) % 88);
        for (int j = 0; j < g_lens[i]; j++)
            g_prompts[i][j] = 3 + (int32_t)(td_rng_next(&rng) % 509);
    }
}

/* Run prompts (indices order[0..n)) to N_OUT greedy tokens and check them against want. */
static void expect_tokens(td_engine *e, const int *order, int n, int32_t (*want)[N_OUT],
                          const char *what)
{
    const int32_t *pp[N_PROMPTS] = {0};
    int lens[N_PROMPTS] = {0}, n_outs[N_PROMPTS] = {0};
    int32_t outs[N_PROMPTS][N_OUT];
    for (int i = 0; i < n; i++) {
        pp[i] = g_prompts[order[i]];
        lens[i] = g_lens[order[i]];
    }
    run_all(e, pp, lens, n, N_OUT, outs, n_outs);
    for (int i = 0; i < n; i++) {
        assert_int_equal(n_outs[i], N_OUT);
        if (memcmp(outs[i], want[order[i]], sizeof(outs[i])))
            fail_msg("%s: prompt %d differs from its tokens alone", what, order[i]);
    }
}

static void test_engine_invariance(void **state)
{
    (void)state;
    make_prompts();
    static const struct {
        const char *preset, *dtype;
    } models[] = {{"moe-tiny", "q8_0"}, {"qwen2moe-tiny", "f16"}};
    int order[N_PROMPTS], one[1];
    for (int i = 0; i < N_PROMPTS; i++)
        order[i] = (i * 5 + 3) % N_PROMPTS;
    for (int mi = 0; mi < 2; mi++) {
        const char *preset = models[mi].preset, *dt = models[mi].dtype;
        /* each prompt alone: the reference */
        int32_t alone[N_PROMPTS][N_OUT];
        td_engine *e = make_moe_engine(preset, dt, 2, 512, 0, 0, false);
        for (int i = 0; i < N_PROMPTS; i++) {
            const int32_t *pp[1] = {g_prompts[i]};
            int n_out;
            run_all(e, pp, &g_lens[i], 1, N_OUT, &alone[i], &n_out);
            assert_int_equal(n_out, N_OUT);
        }
        int distinct = 0;
        for (int t = 1; t < N_OUT; t++)
            distinct += alone[0][t] != alone[0][0];
        assert_true(distinct > 0); /* the random model does not just repeat one token */
        td_engine_stats st;
        td_engine_get_stats(e, &st);
        assert_true(st.moe_expert_runs > 0);
        /* batched: all prompts together, in another order */
        expect_tokens(e, order, N_PROMPTS, alone, "batched");
        td_engine_free(e);

        /* chunked prefill */
        const int chunks[] = {7, 16, 64};
        for (int c = 0; c < 3; c++) {
            e = make_moe_engine(preset, dt, 2, chunks[c], 0, 0, false);
            expect_tokens(e, order, N_PROMPTS, alone, "chunked");
            td_engine_free(e);
        }

        /* prefix-cache hits: the same prompts again */
        e = make_moe_engine(preset, dt, 2, 512, 0, 0, true);
        expect_tokens(e, order, N_PROMPTS, alone, "prefix cache (fill)");
        td_engine_stats before, after;
        td_engine_get_stats(e, &before);
        expect_tokens(e, order, N_PROMPTS, alone, "prefix cache (hits)");
        td_engine_get_stats(e, &after);
        assert_true(after.prefix_hits_tokens > before.prefix_hits_tokens);
        td_engine_free(e);

        /* preemption: 12 blocks of 16 tokens (2 layers x 64 x 2 x f16 = 512 B a token) */
        e = make_moe_engine(preset, dt, 2, 16, 512ull * 16 * 12, 128, true);
        expect_tokens(e, order, N_PROMPTS, alone, "preemption");
        td_engine_get_stats(e, &st);
        assert_true(st.num_preemptions > 0);
        td_engine_free(e);

        /* one thread */
        e = make_moe_engine(preset, dt, 1, 512, 0, 0, false);
        for (int i = 0; i < N_PROMPTS; i += 3) {
            one[0] = i;
            expect_tokens(e, one, 1, alone, "one thread");
        }
        td_engine_free(e);
    }
}

int main(void)
{
    td_log_set_level(TD_LOG_WARN); /* one engine description per engine is noise here */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_route_row),
        cmocka_unit_test(test_layer_vs_reference),
        cmocka_unit_test(test_layer_batch_invariance),
        cmocka_unit_test(test_workspace_budget),
        cmocka_unit_test(test_engine_invariance),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
