/*
 * Engine tests on the real stories260K model against llama.cpp's greedy outputs,
 * and the invariance contract: the same greedy tokens whether a prompt runs alone,
 * batched with 15 others, in chunks of 1, 7, 16 or 64 tokens, with or without a
 * prefix-cache hit, after preemption, with 1 or 2 threads.
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

#include "model/model.h"
#include "tandem/engine.h"
#include "test_shared.h"

#include "golden_fixture.h"

static void test_golden_alone(void **state)
{
    (void)state;
    load_golden();
    const char *dtypes[] = {"f32", "f16"};
    for (int d = 0; d < 2; d++) {
        td_engine *e = make_engine(2, 512, 0, dtypes[d], false);
        for (int i = 0; i < g_n_cases; i++) check_golden(e, &i, 1);
        td_engine_free(e);
    }
}

static void test_golden_one_thread(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(1, 512, 0, "f32", false);
    for (int i = 0; i < g_n_cases; i++) check_golden(e, &i, 1);
    td_engine_free(e);
}

/* The narrower KV dtypes round K and V, so tokens may drift from the f32 golden output
 * (bf16 keeps 8 bits of mantissa and still gets the first token right; fp8 e4m3 keeps 3
 * and may not). Every request must end, and the result must not depend on batching. */
static void test_kv_dtypes(void **state)
{
    (void)state;
    load_golden();
    const char *dtypes[] = {"bf16", "fp8"};
    for (int d = 0; d < 2; d++) {
        td_engine *e = make_engine(2, 512, 0, dtypes[d], true);
        const int32_t *prompts[16];
        int lens[16];
        int32_t alone[16][N_OUT], batched[16][N_OUT];
        int n_alone[16], n_batched[16];
        for (int i = 0; i < g_n_cases; i++) {
            prompts[i] = g_cases[i].prompt;
            lens[i] = g_cases[i].n_prompt;
            run_all(e, &prompts[i], &lens[i], 1, N_OUT, &alone[i], &n_alone[i]);
            assert_int_equal(n_alone[i], N_OUT);
            if (d == 0) assert_int_equal(alone[i][0], g_cases[i].out[0]);
        }
        run_all(e, prompts, lens, g_n_cases, N_OUT, batched, n_batched);
        for (int i = 0; i < g_n_cases; i++) assert_memory_equal(alone[i], batched[i], sizeof(alone[i]));
        td_engine_free(e);
    }
}

/* 16 requests of mixed lengths in one batch: the golden cases plus repeats in other
 * orders; every one must produce its own golden tokens. */
static void test_golden_batched(void **state)
{
    (void)state;
    load_golden();
    int order[16];
    for (int i = 0; i < 16; i++) order[i] = (i * 5 + 3) % g_n_cases;
    td_engine *e = make_engine(2, 512, 0, "f32", false);
    check_golden(e, order, 16);
    td_engine_free(e);
}

static void test_golden_chunked(void **state)
{
    (void)state;
    load_golden();
    const int chunks[] = {1, 7, 16, 64};
    int order[16];
    for (int i = 0; i < 16; i++) order[i] = i % g_n_cases;
    for (size_t c = 0; c < 4; c++) {
        td_engine *e = make_engine(2, chunks[c], 0, "f32", false);
        check_golden(e, order, chunks[c] == 1 ? 4 : 16); /* chunk 1 is slow: fewer requests */
        td_engine_free(e);
    }
}

static void test_golden_prefix_cache(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(2, 512, 0, "f32", true);
    for (int i = 0; i < g_n_cases; i++) check_golden(e, &i, 1); /* fills the cache */
    td_engine_stats before, after;
    td_engine_get_stats(e, &before);
    for (int i = 0; i < g_n_cases; i++) check_golden(e, &i, 1); /* hits */
    td_engine_get_stats(e, &after);
    assert_true(after.prefix_hits_tokens > before.prefix_hits_tokens);
    /* A longer prompt that starts with a cached one: run prompt+output as a new prompt and
     * check it continues exactly like the golden tail. */
    int32_t ext[160];
    int k = 0;
    for (int i = 0; i < g_n_cases; i++)
        if (g_cases[i].n_prompt + 8 > g_cases[k].n_prompt + 8 && g_cases[i].n_prompt >= 16) k = i;
    golden *g = &g_cases[k];
    memcpy(ext, g->prompt, (size_t)g->n_prompt * 4);
    memcpy(ext + g->n_prompt, g->out, 8 * 4);
    const int32_t *pp[1] = {ext};
    int lens[1] = {g->n_prompt + 8};
    int32_t outs[1][N_OUT];
    int n_outs[1];
    td_engine_get_stats(e, &before);
    run_all(e, pp, lens, 1, 16, outs, n_outs);
    td_engine_get_stats(e, &after);
    assert_true(after.prefix_hits_tokens - before.prefix_hits_tokens >= 16);
    for (int t = 0; t < 16; t++) assert_int_equal(outs[0][t], g->out[8 + t]);
    td_engine_free(e);
}

static void test_golden_preemption(void **state)
{
    (void)state;
    load_golden();
    /* stories260K: 5 layers x 4 kv heads x 8 dims x 2 (K,V) x 4 bytes = 1280 B/token in f32,
     * so 12 blocks of 16 tokens is 240 KiB: room for about three sequences at a time. */
    uint64_t kv = 5ull * 32 * 2 * 4 * 16 * 12;
    int order[16];
    for (int i = 0; i < 16; i++) order[i] = (i * 7) % g_n_cases;
    const int chunks[] = {512, 16};
    for (int c = 0; c < 2; c++) {
        td_engine *e = make_engine(2, chunks[c], kv, "f32", c == 1);
        check_golden(e, order, 16);
        td_engine_stats st;
        td_engine_get_stats(e, &st);
        assert_true(st.num_preemptions > 0);
        if (c == 1) {
            /* Each request counts in the prefix cache's statistics once, however many
             * steps it waited for blocks and however often it was preempted. */
            uint64_t prompt = 0;
            for (int i = 0; i < 16; i++) prompt += (uint64_t)g_cases[order[i]].n_prompt;
            assert_int_equal(st.prefix_queries_tokens, prompt);
            assert_true(st.prefix_hits_tokens <= prompt);
        }
        td_engine_free(e);
    }
}

static void test_abort_frees_everything(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(2, 16, 0, "f16", true);
    td_sampling sp;
    td_sampling_default(&sp);
    sp.max_tokens = 50;
    td_err err;
    uint64_t ids[8];
    for (int i = 0; i < 8; i++)
        assert_int_equal(td_engine_add_request(e, &ids[i], g_cases[i].prompt, g_cases[i].n_prompt,
                                               &sp, &err), 0);
    for (int s = 0; s < 3; s++) td_engine_step(e, &err);
    td_output o;
    while (td_engine_poll(e, &o)) {}
    for (int i = 0; i < 8; i++) assert_int_equal(td_engine_abort(e, ids[i]), 0);
    assert_int_equal(td_engine_abort(e, ids[0]), TD_ENOTFOUND);
    int aborted = 0;
    while (td_engine_poll(e, &o))
        if (o.finish == TD_FINISH_ABORT) aborted++;
    assert_int_equal(aborted, 8);
    assert_false(td_engine_has_work(e));
    td_engine_stats st;
    td_engine_get_stats(e, &st);
    assert_int_equal(st.num_blocks_free, st.num_blocks_total);
    td_engine_free(e);
}

/* The step counters behind /metrics' tandem_engine_step_* and tandem_iteration_tokens:
 * every step lands in one bucket of each histogram, no step computes more than the token
 * budget, and the tokens add up to the prompts and the decode rows. */
static void test_step_counters(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(2, 16, 0, "f32", false);
    const int32_t *prompts[4];
    int lens[4], n_outs[4], prompt_total = 0;
    int32_t outs[4][N_OUT];
    for (int i = 0; i < 4; i++) {
        prompts[i] = g_cases[i].prompt;
        lens[i] = g_cases[i].n_prompt;
        prompt_total += lens[i];
    }
    run_all(e, prompts, lens, 4, N_OUT, outs, n_outs);
    td_engine_stats st;
    td_engine_get_stats(e, &st);
    uint64_t n_tok = 0, n_time = 0;
    for (int b = 0; b <= TD_STEP_TOKEN_BUCKETS; b++) {
        n_tok += st.step_tokens_hist[b];
        if ((1 << b) > 16 || b == TD_STEP_TOKEN_BUCKETS)
            assert_int_equal(st.step_tokens_hist[b], 0);
    }
    for (int b = 0; b <= TD_STEP_TIME_BUCKETS; b++)
        n_time += st.step_time_hist[b];
    assert_int_equal(n_tok, st.steps);
    assert_int_equal(n_time, st.steps);
    assert_int_equal(st.tokens_prefilled, prompt_total);
    assert_int_equal(st.tokens_decoded, 4 * (N_OUT - 1)); /* the first token comes from prefill */
    assert_true(st.steps_prefill >= (uint64_t)(prompt_total + 15) / 16);
    assert_true(st.steps_prefill < st.steps);
    assert_true(st.step_ns_prefill > 0 && st.step_ns_decode > 0);
    td_engine_free(e);
}

static void test_refuses_what_never_fits(void **state)
{
    (void)state;
    td_engine *e = make_engine(1, 512, 0, "f32", true);
    td_sampling sp;
    td_sampling_default(&sp);
    td_err err = {0};
    int32_t prompt[200];
    for (int i = 0; i < 200; i++) prompt[i] = 5;
    /* stories260K's context is 128 tokens. */
    assert_int_equal(td_engine_add_request(e, NULL, prompt, 200, &sp, &err), TD_ETOOLARGE);
    assert_non_null(strstr(err.msg, "maximum context length is 128"));
    sp.max_tokens = 100;
    assert_int_equal(td_engine_add_request(e, NULL, prompt, 50, &sp, &err), TD_ETOOLARGE);
    assert_int_equal(td_engine_add_request(e, NULL, prompt, 0, &sp, &err), TD_EINVAL);
    prompt[3] = 512;
    sp.max_tokens = 4;
    assert_int_equal(td_engine_add_request(e, NULL, prompt, 10, &sp, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "outside the vocabulary"));
    prompt[3] = 5;
    sp.top_p = 0;
    assert_int_equal(td_engine_add_request(e, NULL, prompt, 10, &sp, &err), TD_EINVAL);
    assert_false(td_engine_has_work(e));
    td_engine_free(e);
}

/* Same seed, same tokens - alone or next to other requests; different seeds differ. */
static void test_seeded_sampling(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(2, 512, 0, "f32", true);
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = 1.0f;
    sp.top_k = 40;
    sp.top_p = 0.9f;
    sp.min_p = 0.01f;
    sp.max_tokens = 20;
    sp.ignore_eos = true;
    sp.has_seed = true;
    int32_t got[3][20];
    td_err err;
    for (int run = 0; run < 3; run++) {
        uint64_t id, other;
        sp.seed = run == 2 ? 1234 : 77;
        assert_int_equal(td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), 0);
        if (run == 1) {
            td_sampling sp2 = sp;
            sp2.seed = 5;
            assert_int_equal(td_engine_add_request(e, &other, g_cases[1].prompt,
                                                   g_cases[1].n_prompt, &sp2, &err), 0);
        }
        int n = 0;
        while (td_engine_has_work(e)) {
            td_engine_step(e, &err);
            td_output o;
            while (td_engine_poll(e, &o))
                if (o.id == id && o.token >= 0) got[run][n++] = o.token;
        }
        assert_int_equal(n, 20);
    }
    assert_memory_equal(got[0], got[1], sizeof(got[0]));
    assert_memory_not_equal(got[0], got[2], sizeof(got[0]));
    td_engine_free(e);
}

/* Greedy sampling of max_tokens tokens, past EOS. */
static td_sampling greedy(int max_tokens)
{
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = 0;
    sp.max_tokens = max_tokens;
    sp.ignore_eos = true;
    return sp;
}

/* Stop strings end the request, across token boundaries, and are not in the text. */
static void test_stop_string(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(1, 512, 0, "f32", true);
    td_sampling sp = greedy(N_OUT);
    td_err err;
    /* First get the full text of case 0. */
    char full[4096] = "";
    uint64_t id;
    assert_int_equal(td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), 0);
    while (td_engine_has_work(e)) {
        td_engine_step(e, &err);
        td_output o;
        while (td_engine_poll(e, &o)) strncat(full, o.text, (size_t)o.text_len);
    }
    size_t len = strlen(full);
    assert_true(len > 12);
    /* A stop string that spans the middle of the text (likely crossing a token boundary). */
    char stop[8];
    memcpy(stop, full + len / 2, 5);
    stop[5] = '\0';
    const char *where = strstr(full, stop);
    const char *stops[1] = {stop};
    sp.stop = stops;
    sp.n_stop = 1;
    char text[4096] = "";
    td_finish fin = TD_FINISH_NONE;
    int n_tok = 0;
    assert_int_equal(td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), 0);
    while (td_engine_has_work(e)) {
        td_engine_step(e, &err);
        td_output o;
        while (td_engine_poll(e, &o)) {
            strncat(text, o.text, (size_t)o.text_len);
            if (o.token >= 0) n_tok++;
            if (o.finish) fin = o.finish;
        }
    }
    assert_int_equal(fin, TD_FINISH_STOP);
    assert_int_equal(strlen(text), (size_t)(where - full));
    assert_memory_equal(text, full, strlen(text));
    assert_true(n_tok < N_OUT);
    td_engine_free(e);
}

/* text_flush_len: text held back as a stop string's start comes out at the end, and the
 * output says which of its bytes only the end released (what a KV producer's stream, which
 * goes on elsewhere, has not emitted). */
static void test_flush_len(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(1, 512, 0, "f32", true);
    td_sampling sp = greedy(1);
    td_err err;
    uint64_t id;
    char first[256] = "";
    assert_int_equal(
        td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), 0);
    while (td_engine_has_work(e)) {
        td_engine_step(e, &err);
        td_output o;
        while (td_engine_poll(e, &o)) {
            strncat(first, o.text, (size_t)o.text_len);
            assert_int_equal(o.text_flush_len, 0); /* nothing was held */
        }
    }
    assert_true(strlen(first) > 0 && strlen(first) < 200);
    char stop[sizeof(first) + 2];
    snprintf(stop, sizeof(stop), "%s\x01", first); /* starts with the token, never matches */
    const char *stops[1] = {stop};
    sp.stop = stops;
    sp.n_stop = 1;
    for (int max = 1; max <= 2; max++) {
        sp.max_tokens = max;
        assert_int_equal(
            td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), 0);
        int k = 0;
        char text[512] = "";
        while (td_engine_has_work(e)) {
            td_engine_step(e, &err);
            td_output o;
            while (td_engine_poll(e, &o)) {
                if (o.token < 0) continue;
                if (k++ == 0 && max == 1) { /* ends here: all of it released by the end */
                    assert_int_equal(o.text_len, (int)strlen(first));
                    assert_int_equal(o.text_flush_len, o.text_len);
                } else if (k == 1) { /* goes on: held */
                    assert_int_equal(o.text_len, 0);
                    assert_int_equal(o.text_flush_len, 0);
                } else { /* the second token ends the match: out as plain text */
                    assert_int_equal(o.text_flush_len, 0);
                }
                strncat(text, o.text, (size_t)o.text_len);
            }
        }
        assert_memory_equal(text, first, strlen(first));
    }
    td_engine_free(e);
}

/* logprobs: the greedy token is the most likely one, the list is sorted, probabilities
 * are at most 1 in total; timings are ordered. */
static void test_logprobs_and_timings(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(2, 512, 0, "f32", true);
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = 0;
    sp.max_tokens = 8;
    sp.logprobs = 5;
    td_err err;
    uint64_t id;
    assert_int_equal(td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), 0);
    int n = 0;
    while (td_engine_has_work(e)) {
        td_engine_step(e, &err);
        td_output o;
        while (td_engine_poll(e, &o)) {
            if (o.token < 0) continue;
            assert_int_equal(o.token, g_cases[0].out[n]);
            n++;
            assert_int_equal(o.n_top, 5);
            assert_int_equal(o.top_ids[0], o.token);
            assert_true(o.logprob <= 0.0f && o.logprob == o.top_logprobs[0]);
            double total = 0;
            for (int k = 0; k < 5; k++) {
                if (k) assert_true(o.top_logprobs[k] <= o.top_logprobs[k - 1]);
                total += exp(o.top_logprobs[k]);
            }
            assert_true(total <= 1.0 + 1e-5);
            assert_true(o.t_arrival > 0 && o.t_first_scheduled >= o.t_arrival &&
                        o.t_first_token >= o.t_first_scheduled);
        }
    }
    assert_int_equal(n, 8);
    sp.logprobs = TD_MAX_LOGPROBS + 1;
    assert_int_equal(td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &sp, &err), TD_EINVAL);
    td_engine_free(e);
}

/* Run one request (alone, or beside a plain one when `crowd`) and collect its tokens and
 * their top-20 log-probabilities. */
static int run_penalised(td_engine *e, const td_sampling *sp, bool crowd, int32_t *toks,
                         int32_t (*top_ids)[TD_MAX_LOGPROBS], float (*top_lp)[TD_MAX_LOGPROBS])
{
    td_err err;
    uint64_t id, other;
    assert_int_equal(
        td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, sp, &err), 0);
    if (crowd) {
        td_sampling plain;
        td_sampling_default(&plain);
        plain.max_tokens = 20;
        assert_int_equal(
            td_engine_add_request(e, &other, g_cases[1].prompt, g_cases[1].n_prompt, &plain, &err),
            0);
    }
    int n = 0;
    while (td_engine_has_work(e)) {
        td_engine_step(e, &err);
        td_output o;
        while (td_engine_poll(e, &o)) {
            if (o.id != id || o.token < 0) continue;
            toks[n] = o.token;
            if (top_ids) {
                assert_int_equal(o.n_top, TD_MAX_LOGPROBS);
                memcpy(top_ids[n], o.top_ids, sizeof(top_ids[n]));
                memcpy(top_lp[n], o.top_logprobs, sizeof(top_lp[n]));
            }
            n++;
        }
    }
    return n;
}

/* Penalties and logit_bias: greedy picks the argmax of the changed logits. Log-probabilities
 * are the model's own, so the expected token at each step follows from the top 20 (their
 * differences are the logits' differences) wherever the winner is surely among them. */
static void test_penalties(void **state)
{
    (void)state;
    load_golden();
    td_engine *e = make_engine(2, 512, 0, "f32", true);
    enum { N = 24 };
    td_sampling sp = greedy(N);
    sp.logprobs = TD_MAX_LOGPROBS;
    int32_t plain[N], toks[N], ids[N][TD_MAX_LOGPROBS];
    float lps[N][TD_MAX_LOGPROBS];
    assert_int_equal(run_penalised(e, &sp, false, plain, NULL, NULL), N);
    sp.frequency_penalty = 1.0f;
    sp.presence_penalty = 0.5f;
    int32_t bias_id = plain[3];
    float bias = -3.0f;
    sp.logit_bias_ids = &bias_id;
    sp.logit_bias = &bias;
    sp.n_logit_bias = 1;
    assert_int_equal(run_penalised(e, &sp, false, toks, ids, lps), N);
    assert_memory_not_equal(toks, plain, sizeof(toks));
    int checked = 0;
    for (int t = 0; t < N; t++) {
        float best = -INFINITY;
        int32_t want = -1;
        for (int k = 0; k < TD_MAX_LOGPROBS; k++) {
            int count = 0;
            for (int j = 0; j < t; j++)
                count += toks[j] == ids[t][k];
            float v = lps[t][k] - sp.frequency_penalty * (float)count -
                      (count ? sp.presence_penalty : 0.0f) + (ids[t][k] == bias_id ? bias : 0.0f);
            if (v > best) {
                best = v;
                want = ids[t][k];
            }
        }
        /* Tokens past the top 20 have no higher log-probability than the 20th, and the
         * changes only lower them: the winner is among the 20 if it beats the 20th. */
        if (best > lps[t][TD_MAX_LOGPROBS - 1] + 1e-4f) {
            assert_int_equal(toks[t], want);
            checked++;
        }
    }
    assert_true(checked >= N / 2);
    /* The same tokens next to another request; repetition_penalty changes the output and
     * is as reproducible. */
    int32_t again[N];
    assert_int_equal(run_penalised(e, &sp, true, again, NULL, NULL), N);
    assert_memory_equal(again, toks, sizeof(toks));
    td_sampling rp = greedy(N);
    rp.repetition_penalty = 1.5f;
    int32_t r1[N], r2[N];
    assert_int_equal(run_penalised(e, &rp, false, r1, NULL, NULL), N);
    assert_int_equal(run_penalised(e, &rp, true, r2, NULL, NULL), N);
    assert_memory_equal(r1, r2, sizeof(r1));
    assert_memory_not_equal(r1, plain, sizeof(r1));
    /* A temperature too small to divide by is greedy; a penalty that sends logits to
     * infinity still samples real tokens (it gave token 0 from NaN probabilities). */
    td_sampling tiny;
    td_sampling_default(&tiny);
    tiny.temperature = 1e-40f;
    tiny.max_tokens = N;
    tiny.ignore_eos = true;
    int32_t t1[N];
    assert_int_equal(run_penalised(e, &tiny, false, t1, NULL, NULL), N);
    assert_memory_equal(t1, plain, sizeof(t1));
    tiny.temperature = 1.0f;
    tiny.repetition_penalty = 1e-38f;
    tiny.has_seed = true;
    tiny.seed = 3;
    assert_int_equal(run_penalised(e, &tiny, false, t1, NULL, NULL), N);
    int zeros = 0;
    for (int i = 0; i < N; i++)
        zeros += t1[i] == 0;
    assert_true(zeros < N / 2);
    /* Out of range: refused at add time. */
    td_err err;
    uint64_t id;
    rp.repetition_penalty = 11;
    assert_int_equal(
        td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &rp, &err),
        TD_EINVAL);
    rp.repetition_penalty = 1;
    bias_id = 1 << 20;
    rp.logit_bias_ids = &bias_id;
    rp.logit_bias = &bias;
    rp.n_logit_bias = 1;
    assert_int_equal(
        td_engine_add_request(e, &id, g_cases[0].prompt, g_cases[0].n_prompt, &rp, &err),
        TD_EINVAL);
    assert_non_null(strstr(err.msg, "vocabulary"));
    td_engine_free(e);
}

/* llama-2-tiny-random (f16 weights, real Llama-2 vocabulary): its logits are nearly
 * uniform (top-2 margins down to 1e-5), so only the first greedy token of each prompt is
 * compared with llama.cpp's; it is robust to f32 rounding where later steps are not. */
static void test_llama2_tiny_first_token(void **state)
{
    (void)state;
    FILE *f = fopen(td_test_shared_path("golden/llama-2-tiny-random.jsonl"), "r");
    assert_non_null(f);
    td_engine_config c;
    td_engine_config_default(&c);
    c.model_path = td_test_shared_path("models/llama-2-tiny-random.gguf");
    c.n_threads = 2;
    c.pin_threads = false;
    c.kv_cache_dtype = "f32";
    c.max_model_len = 256;
    td_engine *e = NULL;
    td_err err = {0};
    assert_int_equal(td_engine_create(&e, &c, &err), 0);
    char line[16384];
    int n_cases = 0;
    while (fgets(line, sizeof(line), f)) {
        cJSON *j = cJSON_Parse(line);
        assert_non_null(j);
        cJSON *p = cJSON_GetObjectItem(j, "prompt_ids"), *o = cJSON_GetObjectItem(j, "output_ids");
        int32_t prompt[256];
        int n = cJSON_GetArraySize(p);
        assert_true(n > 0 && n < 256);
        for (int i = 0; i < n; i++) prompt[i] = cJSON_GetArrayItem(p, i)->valueint;
        const int32_t *pp[1] = {prompt};
        int32_t outs[1][N_OUT];
        int n_outs[1];
        run_all(e, pp, &n, 1, 1, outs, n_outs);
        assert_int_equal(n_outs[0], 1);
        assert_int_equal(outs[0][0], cJSON_GetArrayItem(o, 0)->valueint);
        cJSON_Delete(j);
        n_cases++;
    }
    fclose(f);
    assert_true(n_cases >= 4);
    td_engine_free(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_alone),
        cmocka_unit_test(test_golden_one_thread),
        cmocka_unit_test(test_golden_batched),
        cmocka_unit_test(test_kv_dtypes),
        cmocka_unit_test(test_golden_chunked),
        cmocka_unit_test(test_golden_prefix_cache),
        cmocka_unit_test(test_golden_preemption),
        cmocka_unit_test(test_abort_frees_everything),
        cmocka_unit_test(test_step_counters),
        cmocka_unit_test(test_refuses_what_never_fits),
        cmocka_unit_test(test_seeded_sampling),
        cmocka_unit_test(test_stop_string),
        cmocka_unit_test(test_flush_len),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_logprobs_and_timings),
        cmocka_unit_test(test_llama2_tiny_first_token),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
