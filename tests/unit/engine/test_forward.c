/*
 * The forward pass's attention orders give the same bits. A decode row that is alone in
 * the batch for its sequence walks the KV cache row by row (several heads per row, two
 * items per row with two threads), a row of a prefill chunk goes head by head down each
 * block; the per-head arithmetic is the same, so a token's logits must not depend on
 * which order, how many threads, or what else is in the batch. Rows here are wide enough
 * (1 KiB of f16 per token) for the row walk to be taken, which stories260K's are not.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "engine/forward.h"
#include "engine/kvcache.h"
#include "model/model.h"
#include "util/pool.h"

enum { BS = 16, N_BLOCKS = 16, MAX_CTX = 128, CTX = 70 };

typedef struct env {
    td_model *m;
    kv_pool kv;
    td_pool *pool[2]; /* 1 thread, 2 threads */
    fwd_ctx f[2];
    int32_t t0[N_BLOCKS / 2], t1[N_BLOCKS / 2];
    const int32_t *tables[2];
    int32_t prompt[2][CTX + 2];
    size_t V;
} env;

static void env_init(env *e, int n_head_kv)
{
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    s.n_embd = 512;
    s.n_layer = 2;
    s.n_head = 8;
    s.n_head_kv = n_head_kv;
    s.head_dim = 64;
    s.n_ff = 1024;
    if (td_model_load_dummy(&e->m, &s, TD_TYPE_F16, 5, &err)) fail_msg("%s", err.msg);
    if (kv_pool_init(&e->kv, s.n_layer, n_head_kv * 64, BS, TD_TYPE_F16, N_BLOCKS, false, &err))
        fail_msg("%s", err.msg);
    for (int i = 0; i < 2; i++) {
        if (td_pool_create(&e->pool[i], i + 1, false, &err)) fail_msg("%s", err.msg);
        if (fwd_init(&e->f[i], e->m, &e->kv, e->pool[i], MAX_CTX, MAX_CTX, MAX_CTX, &err))
            fail_msg("%s", err.msg);
    }
    /* sequence 1's blocks in reverse: a sequence's blocks need not be in order */
    for (int i = 0; i < N_BLOCKS / 2; i++) e->t0[i] = i, e->t1[i] = N_BLOCKS - 1 - i;
    e->tables[0] = e->t0;
    e->tables[1] = e->t1;
    e->V = (size_t)s.n_vocab;
    for (int q = 0; q < 2; q++)
        for (int i = 0; i < CTX + 2; i++) e->prompt[q][i] = (int32_t)((i * 37 + q * 11 + 1) % s.n_vocab);
}

static void env_free(env *e)
{
    for (int i = 0; i < 2; i++) {
        fwd_free(&e->f[i]);
        td_pool_free(e->pool[i]);
    }
    kv_pool_free(&e->kv);
    td_model_free(e->m);
}

/* Run rows (seq, pos) as one batch on f; every row's logits go to out[row]. */
static void run(env *e, fwd_ctx *f, int n, const int *seqs, const int *poss, float *out)
{
    int32_t tok[MAX_CTX], pos[MAX_CTX], seq[MAX_CTX], rows[MAX_CTX];
    for (int i = 0; i < n; i++) {
        seq[i] = seqs[i];
        pos[i] = poss[i];
        tok[i] = e->prompt[seqs[i]][poss[i]];
        rows[i] = i;
    }
    fwd_batch b = {.n_tokens = n, .tokens = tok, .pos = pos, .seq = seq, .block_tables = e->tables,
                   .n_logits = n, .logit_rows = rows, .logits = out};
    fwd_run(f, &b);
}

/* Both sequences' first CTX positions, as prefill chunks (head by head). */
static void prefill(env *e)
{
    int seqs[MAX_CTX], poss[MAX_CTX];
    float *out = malloc((size_t)MAX_CTX * e->V * sizeof(float));
    for (int q = 0; q < 2; q++) {
        for (int i = 0; i < CTX; i++) seqs[i] = q, poss[i] = i;
        run(e, &e->f[0], CTX, seqs, poss, out);
    }
    free(out);
}

static void check_orders(int n_head_kv)
{
    env e;
    env_init(&e, n_head_kv);
    prefill(&e);
    size_t V = e.V;
    float *ref = malloc(V * sizeof(float)), *out = malloc((size_t)4 * V * sizeof(float));

    /* Reference: position CTX of sequence 0 as the first row of a two-row chunk, so its
     * attention goes head by head; one thread. */
    run(&e, &e.f[0], 2, (int[]){0, 0}, (int[]){CTX, CTX + 1}, out);
    memcpy(ref, out, V * sizeof(float));
    for (int th = 0; th < 2; th++) {
        /* alone: a decode step of batch 1 (row walk; with two threads, two half rows) */
        run(&e, &e.f[th], 1, (int[]){0}, (int[]){CTX}, out);
        if (memcmp(out, ref, V * sizeof(float)))
            fail_msg("%d KV heads, %d thread(s): a decode row alone differs from the chunked row",
                     n_head_kv, th + 1);
        /* batch 2: beside sequence 1's decode row */
        run(&e, &e.f[th], 2, (int[]){1, 0}, (int[]){CTX, CTX}, out);
        if (memcmp(out + V, ref, V * sizeof(float)))
            fail_msg("%d KV heads, %d thread(s): a decode row beside another differs", n_head_kv,
                     th + 1);
        /* after a prefill chunk of sequence 1 (positions CTX - 2 .. CTX, rewritten with the
         * same values) */
        run(&e, &e.f[th], 4, (int[]){1, 1, 1, 0}, (int[]){CTX - 2, CTX - 1, CTX, CTX}, out);
        if (memcmp(out + 3 * V, ref, V * sizeof(float)))
            fail_msg("%d KV heads, %d thread(s): a decode row inside a mixed batch differs",
                     n_head_kv, th + 1);
    }
    free(ref);
    free(out);
    env_free(&e);
}

/* 8 KV heads: 1 KiB rows, walked whole (1 thread) or in halves (2 threads). */
static void test_orders_mha(void **state)
{
    (void)state;
    check_orders(8);
}

/* 4 KV heads (2 query heads each): 512-byte rows, walked whole by one thread. */
static void test_orders_gqa(void **state)
{
    (void)state;
    check_orders(4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_orders_mha),
        cmocka_unit_test(test_orders_gqa),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
