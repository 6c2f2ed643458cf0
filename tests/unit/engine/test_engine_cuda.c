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
#include "backend/cuda/cuda_fwd.h"

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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#endif
}
