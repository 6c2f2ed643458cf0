/*
 * The engine's side of prefill/decode disaggregation, with two real engines on
 * stories260K in one process and the "transfer" done by memcpy between their pools
 * (the transfer engine itself is tested in tests/unit/kvx and end to end in
 * tests/integration/test_pd.sh):
 *  - a producer request with hold keeps its prompt blocks after it ends, and gives them
 *    back at td_engine_kv_release;
 *  - a consumer request with remote gets blocks, lets the caller fill them, appends the
 *    producer's first token and decodes: the same tokens as one engine, for prompts of
 *    1 token, exact multiples of the block size and several blocks, greedy and seeded;
 *  - a consumer prefix-cache hit leaves only the tail to copy;
 *  - a failed load recomputes (same tokens) or fails with the message;
 *  - an abort during the copy ends the request after it, and no block leaks anywhere;
 *  - with kv_checksums, every full block of a held prompt carries the CRC32C of its bytes
 *    in every layer, whatever the chunk size and threads; a partial block carries none.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/engine.h"
#include "test_shared.h"
#include "util/crc32c.h"

#define MAX_OUT 32

static td_engine *make_engine(int block_size)
{
    td_engine_config c;
    td_engine_config_default(&c);
    c.model_path = td_test_shared_path("models/stories260K.gguf");
    c.n_threads = 1;
    c.pin_threads = false;
    c.block_size = block_size;
    c.max_num_batched_tokens = 64;
    c.kv_shareable = true;
    td_engine *e = NULL;
    td_err err = {0};
    int rc = td_engine_create(&e, &c, &err);
    if (rc) fprintf(stderr, "engine create: %s\n", err.msg);
    assert_int_equal(rc, 0);
    return e;
}

static void sampling(td_sampling *sp, int max_tokens, float temperature, uint64_t seed)
{
    td_sampling_default(sp);
    sp->temperature = temperature;
    sp->max_tokens = max_tokens;
    sp->ignore_eos = true;
    sp->has_seed = true;
    sp->seed = seed;
}

/* One engine, start to end. Returns the number of tokens. */
static int run_plain(td_engine *e, const int32_t *prompt, int n, const td_sampling *sp,
                     int32_t *out)
{
    uint64_t id;
    td_err err = {0};
    assert_int_equal(td_engine_add_request(e, &id, prompt, n, sp, &err), 0);
    int k = 0;
    bool done = false;
    while (!done) {
        assert_true(td_engine_step(e, &err) >= 0);
        td_output o;
        while (td_engine_poll(e, &o)) {
            if (o.token >= 0) out[k++] = o.token;
            if (o.finish != TD_FINISH_NONE) done = true;
        }
    }
    return k;
}

/* Producer: prefill with hold, max_tokens 1. Returns the first token; the held blocks go
 * to blocks/n_blocks. */
static int32_t run_producer(td_engine *p, const int32_t *prompt, int n, const td_sampling *sp0,
                            uint64_t *id, int32_t *blocks, int *n_blocks)
{
    td_sampling sp = *sp0;
    sp.max_tokens = 1;
    td_request_kv kv = {.hold = true};
    td_err err = {0};
    assert_int_equal(td_engine_add_request_kv(p, id, prompt, n, &sp, &kv, &err), 0);
    int32_t first = -1;
    bool done = false;
    while (!done) {
        assert_true(td_engine_step(p, &err) >= 0);
        td_output o;
        while (td_engine_poll(p, &o)) {
            if (o.token >= 0) first = o.token;
            if (o.finish != TD_FINISH_NONE) {
                assert_int_equal(o.finish, TD_FINISH_LENGTH);
                assert_int_equal(o.n_kv_blocks, (n + 15) / 16);
                memcpy(blocks, o.kv_blocks, (size_t)o.n_kv_blocks * sizeof(int32_t));
                *n_blocks = o.n_kv_blocks;
                done = true;
            }
        }
    }
    return first;
}

/* Copy blocks src[i] of the producer to dst[i] of the consumer, every layer. */
static void copy_blocks(td_engine *p, td_engine *c, const int32_t *src, const int32_t *dst, int n)
{
    td_kv_info pi, ci;
    td_engine_kv_info(p, &pi);
    td_engine_kv_info(c, &ci);
    assert_int_equal(pi.block_bytes, ci.block_bytes);
    assert_int_equal(pi.n_layers, ci.n_layers);
    for (int l = 0; l < pi.n_layers; l++)
        for (int i = 0; i < n; i++)
            memcpy((uint8_t *)ci.base + l * ci.layer_bytes + (size_t)dst[i] * ci.block_bytes,
                   (uint8_t *)pi.base + l * pi.layer_bytes + (size_t)src[i] * pi.block_bytes,
                   pi.block_bytes);
}

typedef enum { LOAD_OK, LOAD_FAIL_RECOMPUTE, LOAD_FAIL, LOAD_ABORT } load_mode;

typedef struct consumer_result {
    int32_t out[MAX_OUT];
    int n_out;
    int kv_skip;
    td_finish finish;
    char error[160];
} consumer_result;

static void run_consumer(td_engine *c, td_engine *p, const int32_t *prompt, int n,
                         const td_sampling *sp, int32_t first, const int32_t *pblocks,
                         int n_pblocks, load_mode mode, consumer_result *res)
{
    memset(res, 0, sizeof(*res));
    uint64_t id;
    td_request_kv kv = {.remote = true, .first_token = first};
    td_err err = {0};
    assert_int_equal(td_engine_add_request_kv(c, &id, prompt, n, sp, &kv, &err), 0);
    bool done = false, loaded = false;
    int guard = 0;
    while (!done) {
        assert_true(++guard < 10000);
        assert_true(td_engine_step(c, &err) >= 0);
        td_output o;
        int32_t blocks[64];
        int nb = 0, skip = 0;
        bool load = false;
        while (td_engine_poll(c, &o)) {
            if (o.kv_load) {
                assert_false(loaded);
                assert_int_equal(o.token, -1);
                assert_int_equal(o.finish, TD_FINISH_NONE);
                assert_int_equal(o.n_kv_blocks, n_pblocks);
                memcpy(blocks, o.kv_blocks, (size_t)o.n_kv_blocks * sizeof(int32_t));
                nb = o.n_kv_blocks;
                skip = o.kv_skip;
                res->kv_skip = skip;
                load = true;
                continue;
            }
            if (o.token >= 0) res->out[res->n_out++] = o.token;
            if (o.finish != TD_FINISH_NONE) {
                res->finish = o.finish;
                if (o.error) snprintf(res->error, sizeof(res->error), "%s", o.error);
                done = true;
            }
        }
        if (!load) continue;
        loaded = true;
        /* While loading, the request is not scheduled: a step does nothing. */
        assert_false(td_engine_has_work(c));
        assert_int_equal(td_engine_step(c, &err), 0);
        td_engine_stats st;
        td_engine_get_stats(c, &st);
        assert_int_equal(st.num_loading, 1);
        switch (mode) {
        case LOAD_OK:
            copy_blocks(p, c, pblocks + skip, blocks + skip, nb - skip);
            assert_int_equal(td_engine_kv_loaded(c, id, 0, true, NULL, -1), 0);
            break;
        case LOAD_FAIL_RECOMPUTE:
            /* Leave garbage in the blocks: recompute must not read it. */
            assert_int_equal(td_engine_kv_loaded(c, id, TD_ECONN, true, "peer died", -1), 0);
            break;
        case LOAD_FAIL:
            assert_int_equal(td_engine_kv_loaded(c, id, TD_ECONN, false, "kv transfer failed: peer died", -1), 0);
            break;
        case LOAD_ABORT:
            assert_int_equal(td_engine_abort(c, id), 0);
            td_engine_stats st2;
            td_engine_get_stats(c, &st2);
            assert_int_equal(st2.num_loading, 1); /* the copy is still writing */
            assert_false(td_engine_poll(c, &o));
            assert_int_equal(td_engine_kv_loaded(c, id, 0, true, NULL, -1), 0);
            break;
        }
        assert_int_equal(td_engine_kv_loaded(c, id, 0, true, NULL, -1), TD_ENOTFOUND);
    }
}

static void fill_prompt(int32_t *p, int n, uint32_t seed)
{
    p[0] = 1; /* BOS */
    for (int i = 1; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = 2 + (int32_t)((seed >> 8) % 500);
    }
}

static void assert_pools_idle(td_engine *e)
{
    td_engine_stats st;
    td_engine_get_stats(e, &st);
    assert_int_equal(st.num_blocks_free, st.num_blocks_total);
    assert_int_equal(st.num_held, 0);
    assert_int_equal(st.num_blocks_held, 0);
    assert_int_equal(st.num_loading, 0);
    assert_false(td_engine_has_work(e));
}

static void check_equivalence(float temperature)
{
    td_engine *agg = make_engine(16), *p = make_engine(16), *c = make_engine(16);
    const int lens[] = {1, 2, 15, 16, 17, 32, 33, 47, 48, 64, 70, 100};
    for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
        int n = lens[k];
        int32_t prompt[128], want[MAX_OUT];
        fill_prompt(prompt, n, (uint32_t)(7 + k));
        td_sampling sp;
        sampling(&sp, 12, temperature, 1000 + k);
        int n_want = run_plain(agg, prompt, n, &sp, want);
        assert_int_equal(n_want, 12);

        uint64_t pid;
        int32_t pblocks[64];
        int npb = 0;
        int32_t first = run_producer(p, prompt, n, &sp, &pid, pblocks, &npb);
        assert_int_equal(first, want[0]);
        td_engine_stats st;
        td_engine_get_stats(p, &st);
        assert_int_equal(st.num_held, 1);
        assert_int_equal(st.num_blocks_held, npb);
        assert_int_equal(st.num_blocks_total - st.num_blocks_free, npb);

        consumer_result r;
        run_consumer(c, p, prompt, n, &sp, first, pblocks, npb, LOAD_OK, &r);
        assert_int_equal(r.finish, TD_FINISH_LENGTH);
        assert_int_equal(r.n_out, n_want);
        for (int i = 0; i < n_want; i++) assert_int_equal(r.out[i], want[i]);

        assert_int_equal(td_engine_kv_release(p, pid), 0);
        assert_int_equal(td_engine_kv_release(p, pid), TD_ENOTFOUND);
    }
    /* Free blocks may stay cached (prefix index) but none is referenced. */
    assert_pools_idle(p);
    assert_pools_idle(c);
    td_engine_free(agg);
    td_engine_free(p);
    td_engine_free(c);
}

static void test_equivalence_greedy(void **state)
{
    (void)state;
    check_equivalence(0.0f);
}

static void test_equivalence_seeded(void **state)
{
    (void)state;
    check_equivalence(0.8f);
}

static void test_consumer_prefix_hit(void **state)
{
    (void)state;
    td_engine *p = make_engine(16), *c = make_engine(16);
    int32_t prompt[80];
    fill_prompt(prompt, 80, 99);
    td_sampling sp;
    sampling(&sp, 8, 0.0f, 1);
    consumer_result r1, r2;
    for (int round = 0; round < 2; round++) {
        uint64_t pid;
        int32_t pb[64];
        int npb = 0;
        int32_t first = run_producer(p, prompt, 80, &sp, &pid, pb, &npb);
        run_consumer(c, p, prompt, 80, &sp, first, pb, npb, LOAD_OK, round ? &r2 : &r1);
        assert_int_equal(td_engine_kv_release(p, pid), 0);
    }
    /* 80 tokens = 5 full blocks; the lookup never covers the last prompt token, so the
     * second consumer request finds 4 blocks and copies only the fifth. */
    assert_int_equal(r1.kv_skip, 0);
    assert_int_equal(r2.kv_skip, 4);
    assert_int_equal(r1.n_out, r2.n_out);
    for (int i = 0; i < r1.n_out; i++) assert_int_equal(r1.out[i], r2.out[i]);
    td_engine_stats st;
    td_engine_get_stats(c, &st);
    assert_int_equal(st.kv_tokens_loaded, 80 + 16);
    assert_int_equal(st.kv_tokens_skipped, 64);
    assert_int_equal(st.kv_loads, 2);
    assert_pools_idle(p);
    assert_pools_idle(c);
    td_engine_free(p);
    td_engine_free(c);
}

static void test_failed_load(void **state)
{
    (void)state;
    td_engine *agg = make_engine(16), *p = make_engine(16), *c = make_engine(16);
    int32_t prompt[40], want[MAX_OUT];
    fill_prompt(prompt, 40, 5);
    td_sampling sp;
    sampling(&sp, 10, 0.0f, 1);
    int n_want = run_plain(agg, prompt, 40, &sp, want);
    uint64_t pid;
    int32_t pb[64];
    int npb = 0;
    int32_t first = run_producer(p, prompt, 40, &sp, &pid, pb, &npb);

    consumer_result r;
    run_consumer(c, p, prompt, 40, &sp, first, pb, npb, LOAD_FAIL_RECOMPUTE, &r);
    assert_int_equal(r.finish, TD_FINISH_LENGTH);
    assert_int_equal(r.n_out, n_want);
    for (int i = 0; i < n_want; i++) assert_int_equal(r.out[i], want[i]);

    run_consumer(c, p, prompt, 40, &sp, first, pb, npb, LOAD_FAIL, &r);
    assert_int_equal(r.finish, TD_FINISH_ERROR);
    assert_int_equal(r.n_out, 0);
    assert_non_null(strstr(r.error, "peer died"));

    run_consumer(c, p, prompt, 40, &sp, first, pb, npb, LOAD_ABORT, &r);
    assert_int_equal(r.finish, TD_FINISH_ABORT);
    assert_int_equal(r.n_out, 0);

    td_engine_stats st;
    td_engine_get_stats(c, &st);
    assert_int_equal(st.kv_load_failures, 2);
    assert_int_equal(td_engine_kv_release(p, pid), 0);
    assert_pools_idle(p);
    assert_pools_idle(c);
    td_engine_free(agg);
    td_engine_free(p);
    td_engine_free(c);
}

/* A first token that ends the request (EOS, max_tokens 1) needs no decode step. */
static void test_first_token_ends(void **state)
{
    (void)state;
    td_engine *c = make_engine(16), *p = make_engine(16);
    int32_t prompt[20];
    fill_prompt(prompt, 20, 3);
    td_sampling sp;
    sampling(&sp, 1, 0.0f, 1);
    uint64_t pid;
    int32_t pb[8];
    int npb = 0;
    int32_t first = run_producer(p, prompt, 20, &sp, &pid, pb, &npb);
    consumer_result r;
    run_consumer(c, p, prompt, 20, &sp, first, pb, npb, LOAD_OK, &r);
    assert_int_equal(r.finish, TD_FINISH_LENGTH);
    assert_int_equal(r.n_out, 1);
    assert_int_equal(r.out[0], first);

    sampling(&sp, 8, 0.0f, 1);
    sp.ignore_eos = false;
    run_consumer(c, p, prompt, 20, &sp, 2 /* EOS of stories260K */, pb, npb, LOAD_OK, &r);
    assert_int_equal(r.finish, TD_FINISH_STOP);
    assert_int_equal(r.n_out, 1);
    assert_int_equal(td_engine_kv_release(p, pid), 0);
    assert_pools_idle(c);
    assert_pools_idle(p);
    td_engine_free(c);
    td_engine_free(p);
}

/* An aborted or failed producer request holds nothing; bad arguments are refused. */
static void test_hold_edges(void **state)
{
    (void)state;
    td_engine *p = make_engine(16);
    int32_t prompt[20];
    fill_prompt(prompt, 20, 3);
    td_sampling sp;
    sampling(&sp, 4, 0.0f, 1);
    td_request_kv kv = {.hold = true};
    uint64_t id;
    td_err err = {0};
    assert_int_equal(td_engine_add_request_kv(p, &id, prompt, 20, &sp, &kv, &err), 0);
    assert_int_equal(td_engine_abort(p, id), 0);
    td_output o;
    assert_true(td_engine_poll(p, &o));
    assert_int_equal(o.finish, TD_FINISH_ABORT);
    assert_int_equal(o.n_kv_blocks, 0);
    assert_int_equal(td_engine_kv_release(p, id), TD_ENOTFOUND);

    td_request_kv both = {.hold = true, .remote = true};
    assert_int_equal(td_engine_add_request_kv(p, &id, prompt, 20, &sp, &both, &err), TD_EINVAL);
    td_request_kv bad = {.remote = true, .first_token = 1 << 20};
    assert_int_equal(td_engine_add_request_kv(p, &id, prompt, 20, &sp, &bad, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "first token"));

    td_kv_info ki;
    td_engine_kv_info(p, &ki);
    assert_true(ki.shm_fd >= 0);
    assert_int_equal(ki.block_size, 16);
    assert_true(ki.block_bytes > 0 && ki.layer_bytes == ki.block_bytes * (size_t)ki.n_blocks);
    assert_pools_idle(p);
    td_engine_free(p);
}

/* Push mode: a streaming producer reports each layer's progress during the steps of its
 * (chunked) prefill, and a consumer that learns the first token only at the end of the
 * load continues exactly as one engine. */
typedef struct layer_log {
    int calls, n_layers, n_prompt;
    int done[16];      /* per layer: the latest n_done */
    int32_t blocks[16]; /* the blocks reported with the whole prompt */
    bool went_back, preempted;
} layer_log;

static void on_layer(void *user, int layer, const td_layer_progress *p, int n)
{
    layer_log *L = user;
    assert_int_equal(n, 1);
    if (layer < 0) {
        L->preempted = true;
        return;
    }
    assert_true(layer < L->n_layers);
    assert_int_equal(p->n_prompt, L->n_prompt);
    if (p->n_done < L->done[layer]) L->went_back = true;
    L->done[layer] = p->n_done;
    if (p->n_done == p->n_prompt)
        memcpy(L->blocks, p->blocks, (size_t)((p->n_done + 15) / 16) * sizeof(int32_t));
    L->calls++;
}

typedef struct load_log {
    int calls;
    uint64_t id;
    int32_t blocks[16];
    int n, skip;
} load_log;

static void on_load(void *user, uint64_t id, const int32_t *blocks, int n, int skip)
{
    load_log *L = user;
    L->calls++;
    L->id = id;
    L->n = n;
    L->skip = skip;
    memcpy(L->blocks, blocks, (size_t)TD_MIN(n, 16) * sizeof(int32_t));
}

static void test_stream_layers_and_late_first_token(void **state)
{
    (void)state;
    td_engine *agg = make_engine(16), *p = make_engine(16), *c = make_engine(16);
    td_kv_info ki;
    td_engine_kv_info(p, &ki);
    const int n = 100; /* two chunks of at most 64 tokens */
    int32_t prompt[128], want[MAX_OUT];
    fill_prompt(prompt, n, 99);
    td_sampling sp;
    sampling(&sp, 8, 0.0f, 5);
    assert_int_equal(run_plain(agg, prompt, n, &sp, want), 8);

    layer_log L = {.n_layers = ki.n_layers, .n_prompt = n};
    td_engine_set_layer_fn(p, on_layer, &L);
    td_sampling one = sp;
    one.max_tokens = 1;
    td_request_kv kv = {.hold = true, .stream_layers = true};
    uint64_t pid;
    td_err err = {0};
    assert_int_equal(td_engine_add_request_kv(p, &pid, prompt, n, &one, &kv, &err), 0);
    int32_t first = -1, pblocks[16];
    int npb = 0;
    int steps = 0;
    for (bool done = false; !done;) {
        assert_true(td_engine_step(p, &err) >= 0);
        steps++;
        td_output o;
        while (td_engine_poll(p, &o)) {
            if (o.token >= 0) first = o.token;
            if (o.finish != TD_FINISH_NONE) {
                npb = o.n_kv_blocks;
                memcpy(pblocks, o.kv_blocks, (size_t)npb * sizeof(int32_t));
                done = true;
            }
        }
    }
    assert_int_equal(steps, 2);
    assert_int_equal(L.calls, 2 * ki.n_layers); /* every layer of both chunks */
    assert_false(L.went_back);
    assert_false(L.preempted);
    for (int l = 0; l < ki.n_layers; l++) assert_int_equal(L.done[l], n);
    assert_int_equal(npb, 7);
    assert_memory_equal(L.blocks, pblocks, (size_t)npb * sizeof(int32_t));
    assert_int_equal(first, want[0]);

    /* The consumer is told the first token with the end of the load; the admission
     * callback names the blocks before the step's forward pass, as the output does after. */
    load_log LL = {0};
    td_engine_set_load_fn(c, on_load, &LL);
    consumer_result r = {0};
    td_request_kv ckv = {.remote = true, .first_token = -1};
    uint64_t cid;
    assert_int_equal(td_engine_add_request_kv(c, &cid, prompt, n, &sp, &ckv, &err), 0);
    for (bool done = false; !done;) {
        assert_true(td_engine_step(c, &err) >= 0);
        td_output o;
        while (td_engine_poll(c, &o)) {
            if (o.kv_load) {
                assert_int_equal(LL.calls, 1);
                assert_true(LL.id == cid);
                assert_int_equal(LL.n, o.n_kv_blocks);
                assert_int_equal(LL.skip, o.kv_skip);
                assert_memory_equal(LL.blocks, o.kv_blocks, (size_t)o.n_kv_blocks * sizeof(int32_t));
                copy_blocks(p, c, pblocks, o.kv_blocks, o.n_kv_blocks);
                assert_int_equal(td_engine_kv_loaded(c, cid, 0, true, NULL, first), 0);
                continue;
            }
            if (o.token >= 0) r.out[r.n_out++] = o.token;
            if (o.finish != TD_FINISH_NONE) done = true;
        }
    }
    assert_int_equal(r.n_out, 8);
    for (int i = 0; i < 8; i++) assert_int_equal(r.out[i], want[i]);
    /* A load that "succeeds" without ever learning the first token recomputes instead. */
    r.n_out = 0;
    assert_int_equal(td_engine_add_request_kv(c, &cid, prompt, n, &sp, &ckv, &err), 0);
    td_engine_stats before;
    td_engine_get_stats(c, &before);
    for (bool done = false; !done;) {
        assert_true(td_engine_step(c, &err) >= 0);
        td_output o;
        while (td_engine_poll(c, &o)) {
            if (o.kv_load) {
                assert_int_equal(td_engine_kv_loaded(c, cid, 0, true, NULL, -1), 0);
                continue;
            }
            if (o.token >= 0) r.out[r.n_out++] = o.token;
            if (o.finish != TD_FINISH_NONE) done = true;
        }
    }
    td_engine_stats after;
    td_engine_get_stats(c, &after);
    assert_int_equal(after.kv_load_failures - before.kv_load_failures, 1);
    assert_int_equal(r.n_out, 8);
    for (int i = 0; i < 8; i++) assert_int_equal(r.out[i], want[i]);
    assert_int_equal(td_engine_kv_release(p, pid), 0);
    assert_pools_idle(p);
    assert_pools_idle(c);
    td_engine_free(agg);
    td_engine_free(p);
    td_engine_free(c);
}


/* The checksums a producer keeps: right for every full block in every layer, absent for
 * the partial last block, with prompts split into chunks of 1, 7, 16 and 64 tokens over
 * two threads (a block's slots then come from several threads and several steps). */
static void test_block_checksums(void **state)
{
    (void)state;
    const int chunks[] = {1, 7, 16, 64};
    const int lens[] = {15, 16, 17, 48, 100};
    for (size_t ci = 0; ci < sizeof(chunks) / sizeof(chunks[0]); ci++) {
        td_engine_config c;
        td_engine_config_default(&c);
        c.model_path = td_test_shared_path("models/stories260K.gguf");
        c.n_threads = 2;
        c.pin_threads = false;
        c.max_num_batched_tokens = chunks[ci];
        c.kv_checksums = true;
        td_engine *p = NULL;
        td_err err = {0};
        assert_int_equal(td_engine_create(&p, &c, &err), 0);
        td_kv_info ki;
        td_engine_kv_info(p, &ki);
        assert_non_null(ki.block_crc);
        assert_non_null(ki.block_crc_ok);
        for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
            int n = lens[k];
            int32_t prompt[128], blocks[64];
            fill_prompt(prompt, n, (uint32_t)(31 * ci + k));
            td_sampling sp;
            sampling(&sp, 1, 0.0f, 1);
            uint64_t id;
            int nb = 0;
            run_producer(p, prompt, n, &sp, &id, blocks, &nb);
            int full = n / ki.block_size;
            for (int l = 0; l < ki.n_layers; l++)
                for (int i = 0; i < nb; i++) {
                    size_t at = (size_t)l * (size_t)ki.n_blocks + (size_t)blocks[i];
                    const uint8_t *bytes = (const uint8_t *)ki.base + (size_t)l * ki.layer_bytes +
                                           (size_t)blocks[i] * ki.block_bytes;
                    if (i < full) {
                        assert_int_equal(ki.block_crc_ok[at], 1);
                        assert_int_equal(ki.block_crc[at], td_crc32c(0, bytes, ki.block_bytes));
                    } else {
                        assert_int_equal(ki.block_crc_ok[at], 0);
                    }
                }
            assert_int_equal(td_engine_kv_release(p, id), 0);
        }
        assert_pools_idle(p);
        td_engine_free(p);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_equivalence_greedy),
        cmocka_unit_test(test_equivalence_seeded),
        cmocka_unit_test(test_consumer_prefix_hit),
        cmocka_unit_test(test_failed_load),
        cmocka_unit_test(test_first_token_ends),
        cmocka_unit_test(test_hold_edges),
        cmocka_unit_test(test_stream_layers_and_late_first_token),
        cmocka_unit_test(test_block_checksums),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
