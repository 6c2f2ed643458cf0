/*
 * golden_fixture.h - what the engine tests on stories260K share (test_engine.c on the CPU,
 * test_engine_cuda.c on the GPU): llama.cpp's greedy outputs, an engine maker, running
 * requests to completion, and the golden check. Included by the test files, never compiled
 * alone; include after <cmocka.h>, <cjson/cJSON.h>, "tandem/engine.h" and "test_shared.h".
 */
#ifndef TD_TESTS_GOLDEN_FIXTURE_H
#define TD_TESTS_GOLDEN_FIXTURE_H

#define MAX_CASES 32
#define N_OUT 24

typedef struct golden {
    int32_t prompt[128];
    int n_prompt;
    int32_t out[N_OUT];
} golden;

static golden g_cases[MAX_CASES];
static int g_n_cases;

static inline void load_golden(void)
{
    if (g_n_cases) return;
    FILE *f = fopen(td_test_shared_path("golden/stories260K-greedy.jsonl"), "r");
    assert_non_null(f);
    char line[16384];
    while (fgets(line, sizeof(line), f) && g_n_cases < MAX_CASES) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        golden *g = &g_cases[g_n_cases++];
        cJSON *p = cJSON_GetObjectItem(j, "prompt_ids"), *o = cJSON_GetObjectItem(j, "output_ids");
        g->n_prompt = cJSON_GetArraySize(p);
        assert_true(g->n_prompt <= 128);
        for (int i = 0; i < g->n_prompt; i++) g->prompt[i] = cJSON_GetArrayItem(p, i)->valueint;
        assert_int_equal(cJSON_GetArraySize(o), N_OUT);
        for (int i = 0; i < N_OUT; i++) g->out[i] = cJSON_GetArrayItem(o, i)->valueint;
        cJSON_Delete(j);
    }
    fclose(f);
    assert_true(g_n_cases >= 8);
}

/* The device the engines of this test program run on ("cpu" unless the program says). */
static const char *g_device = "cpu";

static inline td_engine *make_engine(int threads, int chunk, uint64_t kv_bytes, const char *kv_dtype,
                              bool prefix)
{
    td_engine_config c;
    td_engine_config_default(&c);
    c.device = g_device;
    c.model_path = td_test_shared_path("models/stories260K.gguf");
    c.n_threads = threads;
    c.pin_threads = false;
    c.max_num_batched_tokens = chunk;
    c.kv_cache_memory = kv_bytes;
    c.kv_cache_dtype = kv_dtype;
    c.enable_prefix_caching = prefix;
    td_engine *e = NULL;
    td_err err = {0};
    int rc = td_engine_create(&e, &c, &err);
    if (rc) fprintf(stderr, "engine create: %s\n", err.msg);
    assert_int_equal(rc, 0);
    return e;
}

/* Run requests to completion; outs[i] receives request i's tokens. */
static inline void run_all(td_engine *e, const int32_t *const *prompts, const int *n_prompts, int n,
                    int max_tokens, int32_t (*outs)[N_OUT], int *n_outs)
{
    uint64_t ids[64];
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = 0;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    td_err err;
    for (int i = 0; i < n; i++) {
        assert_int_equal(td_engine_add_request(e, &ids[i], prompts[i], n_prompts[i], &sp, &err), 0);
        n_outs[i] = 0;
    }
    int guard = 0;
    while (td_engine_has_work(e)) {
        assert_true(td_engine_step(e, &err) >= 0);
        assert_true(++guard < 100000);
        td_output o;
        while (td_engine_poll(e, &o)) {
            int k = -1;
            for (int i = 0; i < n; i++)
                if (ids[i] == o.id) k = i;
            assert_true(k >= 0);
            if (o.token >= 0) {
                assert_true(n_outs[k] < N_OUT);
                outs[k][n_outs[k]++] = o.token;
            }
            assert_true(o.finish == TD_FINISH_NONE || o.finish == TD_FINISH_LENGTH);
        }
    }
    td_engine_stats st;
    td_engine_get_stats(e, &st);
    assert_int_equal(st.num_blocks_free, st.num_blocks_total); /* nothing leaked */
}

static inline void check_golden(td_engine *e, const int *order, int n)
{
    const int32_t *prompts[64] = {0};
    int lens[64] = {0};
    int32_t outs[64][N_OUT];
    int n_outs[64] = {0};
    assert_true(n <= 64);
    for (int i = 0; i < n; i++) {
        prompts[i] = g_cases[order[i]].prompt;
        lens[i] = g_cases[order[i]].n_prompt;
    }
    run_all(e, prompts, lens, n, N_OUT, outs, n_outs);
    for (int i = 0; i < n; i++) {
        assert_int_equal(n_outs[i], N_OUT);
        for (int t = 0; t < N_OUT; t++) {
            if (outs[i][t] != g_cases[order[i]].out[t])
                fprintf(stderr, "case %d token %d: got %d want %d\n", order[i], t, outs[i][t],
                        g_cases[order[i]].out[t]);
            assert_int_equal(outs[i][t], g_cases[order[i]].out[t]);
        }
    }
}

#endif
