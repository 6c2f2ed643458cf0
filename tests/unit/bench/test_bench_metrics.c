/* Unit tests for bench/metrics.c: the benchmark's latency definitions on synthetic
 * timestamps, percentiles, goodput, throughput and the arrival generator. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/metrics.h"

#define EPS 1e-9

/* A completed request sent at t_send whose content events arrived at t[0..n), ending at
 * t_end, with `tokens` output tokens. */
static bench_request make(double t_send, const double *t, size_t n, double t_end, long tokens)
{
    bench_request r;
    bench_request_init(&r);
    r.t_send = t_send;
    for (size_t i = 0; i < n; i++)
        assert_int_equal(bench_request_add_event(&r, t[i]), 0);
    r.t_end = t_end;
    r.output_tokens = tokens;
    r.prompt_tokens = 10;
    r.ok = true;
    return r;
}

static void test_tpot_excludes_first_token(void **state)
{
    (void)state;
    /* First token after 100 ms, then 4 more tokens, the last at 500 ms: TPOT is the 400 ms
     * after the first token over 4 tokens, not 500 / 5. */
    double t[] = {1.1, 1.2, 1.3, 1.4, 1.5};
    bench_request r = make(1.0, t, 5, 1.5, 5);
    assert_float_equal(bench_ttft_ms(&r), 100.0, EPS);
    assert_float_equal(bench_e2el_ms(&r), 500.0, EPS);
    assert_float_equal(bench_tpot_ms(&r), 100.0, EPS);
    bench_request_free(&r);
}

static void test_itl_uses_event_gaps(void **state)
{
    (void)state;
    /* Uneven gaps (10, 30, 60 ms) in one request and one gap (20 ms) in another: ITL pools
     * the four gaps, TPOT averages per request. An event carrying two tokens (the usage
     * count is above the event count) does not make up gaps. */
    double a[] = {0.100, 0.110, 0.140, 0.200};
    double b[] = {0.050, 0.070};
    bench_request reqs[2] = {make(0, a, 4, 0.200, 4), make(0, b, 2, 0.070, 3)};
    double pct[] = {50};
    bench_results res;
    assert_int_equal(bench_compute(reqs, 2, 1.0, NULL, pct, 1, &res), 0);
    assert_int_equal(res.itl.count, 4);
    assert_float_equal(res.itl.mean, (10 + 30 + 60 + 20) / 4.0, 1e-6);
    assert_float_equal(res.itl.min, 10, 1e-6);
    assert_float_equal(res.itl.max, 60, 1e-6);
    assert_float_equal(res.itl.median, 25, 1e-6);
    /* TPOT: (200-100)/3 and (70-50)/2 */
    assert_int_equal(res.tpot.count, 2);
    assert_float_equal(res.tpot.mean, (100.0 / 3 + 10.0) / 2, 1e-6);
    for (int i = 0; i < 2; i++)
        bench_request_free(&reqs[i]);
}

static void test_one_token_tpot_excluded(void **state)
{
    (void)state;
    double a[] = {0.1};
    double b[] = {0.1, 0.2, 0.3};
    bench_request reqs[2] = {make(0, a, 1, 0.1, 1), make(0, b, 3, 0.3, 3)};
    assert_true(isnan(bench_tpot_ms(&reqs[0])));
    double pct[] = {99};
    bench_results res;
    assert_int_equal(bench_compute(reqs, 2, 2.0, NULL, pct, 1, &res), 0);
    assert_int_equal(res.completed, 2);
    assert_int_equal(res.ttft.count, 2);
    assert_int_equal(res.tpot.count, 1);
    assert_float_equal(res.tpot.mean, 100, 1e-6);
    /* Without SLOs there is no goodput. */
    assert_true(isnan(res.goodput));
    for (int i = 0; i < 2; i++)
        bench_request_free(&reqs[i]);
}

static void test_goodput_requires_every_slo(void **state)
{
    (void)state;
    bench_slo slo = {0};
    td_err err;
    assert_int_equal(bench_slo_parse("ttft:200 tpot:50", &slo, &err), 0);
    assert_float_equal(slo.ttft_ms, 200, EPS);
    assert_float_equal(slo.tpot_ms, 50, EPS);
    assert_float_equal(slo.e2el_ms, 0, EPS);
    /* good: TTFT 100, TPOT 40. slow decode: TTFT 100, TPOT 100 (meets ttft, not tpot).
     * slow prefill: TTFT 300, TPOT 10. one token: TTFT 150, TPOT undefined (meets). */
    double good[] = {0.1, 0.14, 0.18};
    double slow_decode[] = {0.1, 0.2, 0.3};
    double slow_prefill[] = {0.3, 0.31, 0.32};
    double one[] = {0.15};
    bench_request reqs[5] = {make(0, good, 3, 0.18, 3), make(0, slow_decode, 3, 0.3, 3),
                             make(0, slow_prefill, 3, 0.32, 3), make(0, one, 1, 0.15, 1),
                             make(0, good, 3, 0.18, 3)};
    reqs[4].ok = false; /* failed requests are never good */
    assert_true(bench_request_meets_slo(&reqs[0], &slo));
    assert_false(bench_request_meets_slo(&reqs[1], &slo));
    assert_false(bench_request_meets_slo(&reqs[2], &slo));
    assert_true(bench_request_meets_slo(&reqs[3], &slo));
    assert_false(bench_request_meets_slo(&reqs[4], &slo));
    double pct[] = {50};
    bench_results res;
    assert_int_equal(bench_compute(reqs, 5, 4.0, &slo, pct, 1, &res), 0);
    assert_int_equal(res.good_requests, 2);
    assert_float_equal(res.goodput, 0.5, EPS);

    /* e2el alone; terms can also come comma separated and one at a time. */
    bench_slo e2 = {0};
    assert_int_equal(bench_slo_parse("e2el:250", &e2, &err), 0);
    assert_true(bench_request_meets_slo(&reqs[0], &e2));
    assert_false(bench_request_meets_slo(&reqs[1], &e2));
    assert_int_equal(bench_slo_parse("ttft:1,tpot:2", &e2, &err), 0);
    assert_float_equal(e2.e2el_ms, 250, EPS);
    assert_float_equal(e2.tpot_ms, 2, EPS);

    bench_slo bad = {0};
    assert_int_equal(bench_slo_parse("nonsense", &bad, &err), TD_EINVAL);
    assert_int_equal(bench_slo_parse("ttft:", &bad, &err), TD_EINVAL);
    assert_int_equal(bench_slo_parse("ttft:-5", &bad, &err), TD_EINVAL);
    assert_int_equal(bench_slo_parse("ttft:5ms", &bad, &err), TD_EINVAL);
    assert_int_equal(bench_slo_parse("itl:5", &bad, &err), TD_EINVAL);
    assert_int_equal(bench_slo_parse("  ", &bad, &err), TD_EINVAL);
    for (int i = 0; i < 5; i++)
        bench_request_free(&reqs[i]);
}

static void test_percentiles(void **state)
{
    (void)state;
    /* numpy.percentile([1, 2, 3, 4], p): 50 -> 2.5, 90 -> 3.7, 99 -> 3.97, 0 -> 1. */
    double a[] = {1, 2, 3, 4};
    assert_float_equal(bench_percentile_sorted(a, 4, 50), 2.5, EPS);
    assert_float_equal(bench_percentile_sorted(a, 4, 90), 3.7, EPS);
    assert_float_equal(bench_percentile_sorted(a, 4, 99), 3.97, EPS);
    assert_float_equal(bench_percentile_sorted(a, 4, 0), 1, EPS);
    assert_float_equal(bench_percentile_sorted(a, 4, 100), 4, EPS);
    double one[] = {7};
    assert_float_equal(bench_percentile_sorted(one, 1, 99), 7, EPS);
    assert_true(isnan(bench_percentile_sorted(a, 0, 50)));

    /* 1..101 unsorted: percentile p is 1 + p. bench_summarize sorts in place. */
    double v[101];
    for (int i = 0; i < 101; i++)
        v[i] = (double)((i * 37) % 101) + 1;
    double pct[] = {90, 99, 12.5};
    bench_summary s;
    bench_summarize(v, 101, pct, 3, &s);
    assert_int_equal(s.count, 101);
    assert_float_equal(s.mean, 51, EPS);
    assert_float_equal(s.median, 51, EPS);
    assert_float_equal(s.pct[0], 91, EPS);
    assert_float_equal(s.pct[1], 100, EPS);
    assert_float_equal(s.pct[2], 13.5, EPS);
    assert_float_equal(s.min, 1, EPS);
    assert_float_equal(s.max, 101, EPS);
    for (int i = 1; i < 101; i++)
        assert_true(v[i - 1] <= v[i]);
    /* Population std of {2, 4, 4, 4, 5, 5, 7, 9} is 2. */
    double w[] = {9, 2, 4, 4, 4, 5, 5, 7};
    bench_summarize(w, 8, NULL, 0, &s);
    assert_float_equal(s.std, 2, EPS);
    bench_summarize(w, 0, pct, 3, &s);
    assert_true(isnan(s.mean) && isnan(s.median) && isnan(s.pct[0]));
}

static void test_throughput_and_failures(void **state)
{
    (void)state;
    double a[] = {0.1, 0.2, 0.3, 0.4};
    double slow[] = {5.0, 6.0};
    bench_request reqs[3] = {make(0, a, 4, 0.4, 4), make(0, a, 4, 0.4, 4),
                             make(0, slow, 2, 6.0, 2)};
    reqs[0].prompt_tokens = 100;
    reqs[1].prompt_tokens = 50;
    /* A failed request: its huge latencies and tokens must not show anywhere. */
    reqs[2].ok = false;
    snprintf(reqs[2].error, sizeof(reqs[2].error), "HTTP 500");
    double pct[] = {99};
    bench_results res;
    assert_int_equal(bench_compute(reqs, 3, 2.0, NULL, pct, 1, &res), 0);
    assert_int_equal(res.completed, 2);
    assert_int_equal(res.failed, 1);
    assert_int_equal(res.total_input_tokens, 150);
    assert_int_equal(res.total_output_tokens, 8);
    assert_float_equal(res.request_throughput, 1.0, EPS);
    assert_float_equal(res.output_throughput, 4.0, EPS);
    assert_float_equal(res.total_token_throughput, 79.0, EPS);
    assert_int_equal(res.ttft.count, 2);
    assert_float_equal(res.ttft.max, 100, 1e-6);
    assert_float_equal(res.e2el.max, 400, 1e-6);
    assert_int_equal(res.itl.count, 6);
    assert_float_equal(res.itl.max, 100, 1e-6);
    assert_true(isnan(bench_ttft_ms(&reqs[2])));
    assert_true(isnan(bench_e2el_ms(&reqs[2])));
    /* No server breakdown was reported: every timing summary is empty. */
    for (int f = 0; f < BENCH_T_COUNT; f++)
        assert_int_equal(res.timing[f].count, 0);
    assert_true(isnan(res.transfer_share_of_ttft));
    /* No request reported cached prompt tokens. */
    assert_int_equal(res.cached_reported, 0);
    assert_int_equal(res.total_cached_tokens, 0);
    for (int i = 0; i < 3; i++)
        bench_request_free(&reqs[i]);
}

/* Cached prompt tokens are summed over the completed requests that reported them; a
 * failed request's do not count. */
static void test_cached_tokens(void **state)
{
    (void)state;
    double a[] = {0.1, 0.2};
    bench_request reqs[4] = {make(0, a, 2, 0.2, 2), make(0, a, 2, 0.2, 2), make(0, a, 2, 0.2, 2),
                             make(0, a, 2, 0.2, 2)};
    assert_int_equal(reqs[0].cached_tokens, -1); /* not reported until the usage says so */
    reqs[0].cached_tokens = 16;
    reqs[1].cached_tokens = 0;
    reqs[3].cached_tokens = 32;
    reqs[3].ok = false;
    double pct[] = {50};
    bench_results res;
    assert_int_equal(bench_compute(reqs, 4, 1.0, NULL, pct, 1, &res), 0);
    assert_int_equal(res.cached_reported, 2);
    assert_int_equal(res.total_cached_tokens, 16);
    for (int i = 0; i < 4; i++)
        bench_request_free(&reqs[i]);
}

static void test_server_breakdown(void **state)
{
    (void)state;
    double a[] = {0.1, 0.2};
    double b[] = {0.3, 0.4};
    bench_request reqs[2] = {make(0, a, 2, 0.2, 2), make(0, b, 2, 0.4, 2)};
    reqs[0].timing_ms[BENCH_T_TRANSFER] = 20;
    reqs[1].timing_ms[BENCH_T_TRANSFER] = 60;
    reqs[0].timing_ms[BENCH_T_SERVER_QUEUE] = 1;
    double pct[] = {50};
    bench_results res;
    assert_int_equal(bench_compute(reqs, 2, 1.0, NULL, pct, 1, &res), 0);
    assert_int_equal(res.timing[BENCH_T_TRANSFER].count, 2);
    assert_float_equal(res.timing[BENCH_T_TRANSFER].mean, 40, EPS);
    assert_int_equal(res.timing[BENCH_T_SERVER_QUEUE].count, 1);
    assert_int_equal(res.timing[BENCH_T_CONSUMER_QUEUE].count, 0);
    /* mean TTFT is 200 ms */
    assert_float_equal(res.transfer_share_of_ttft, 0.2, 1e-6);
    assert_string_equal(bench_timing_json_name(BENCH_T_SERVER_QUEUE), "queue_time_ms");
    assert_string_equal(bench_timing_result_name(BENCH_T_SERVER_QUEUE), "server_queue_time_ms");
    for (int i = 0; i < 2; i++)
        bench_request_free(&reqs[i]);
}

static double mean_gap(double rate, double burstiness, uint64_t seed, int n, double *var)
{
    bench_arrivals arr;
    bench_arrivals_init(&arr, rate, burstiness, seed);
    double sum = 0, sq = 0;
    for (int i = 0; i < n; i++) {
        double g = bench_arrivals_next(&arr);
        assert_true(g >= 0);
        sum += g;
        sq += g * g;
    }
    double mean = sum / n;
    if (var) *var = sq / n - mean * mean;
    return mean;
}

static void test_arrivals(void **state)
{
    (void)state;
    const int n = 200000;
    double var;
    /* Poisson: exponential gaps, mean 1/rate and variance 1/rate^2. */
    double m = mean_gap(20, 1.0, 42, n, &var);
    assert_float_equal(m, 0.05, 0.05 * 0.02);
    assert_float_equal(var, 0.05 * 0.05, 0.05 * 0.05 * 0.05);
    /* Gamma shapes keep the mean; the variance is mean^2 / shape. */
    m = mean_gap(20, 0.5, 7, n, &var);
    assert_float_equal(m, 0.05, 0.05 * 0.02);
    assert_float_equal(var, 0.05 * 0.05 / 0.5, 0.05 * 0.05 / 0.5 * 0.08);
    m = mean_gap(4, 4.0, 9, n, &var);
    assert_float_equal(m, 0.25, 0.25 * 0.02);
    assert_float_equal(var, 0.25 * 0.25 / 4, 0.25 * 0.25 / 4 * 0.05);
    /* The same seed gives the same sequence. */
    bench_arrivals x, y;
    bench_arrivals_init(&x, 3, 2, 5);
    bench_arrivals_init(&y, 3, 2, 5);
    for (int i = 0; i < 100; i++)
        assert_true(bench_arrivals_next(&x) == bench_arrivals_next(&y));
    /* An infinite rate sends everything at once. */
    bench_arrivals_init(&x, INFINITY, 1, 5);
    assert_float_equal(bench_arrivals_next(&x), 0, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tpot_excludes_first_token),
        cmocka_unit_test(test_itl_uses_event_gaps),
        cmocka_unit_test(test_one_token_tpot_excluded),
        cmocka_unit_test(test_goodput_requires_every_slo),
        cmocka_unit_test(test_percentiles),
        cmocka_unit_test(test_throughput_and_failures),
        cmocka_unit_test(test_cached_tokens),
        cmocka_unit_test(test_server_breakdown),
        cmocka_unit_test(test_arrivals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
