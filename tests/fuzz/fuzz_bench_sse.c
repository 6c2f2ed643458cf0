/*
 * libFuzzer target for `tandem bench`'s reader of a server's SSE stream (bench/sse.c): any
 * server can be benchmarked, so its bytes are untrusted. The first byte picks where the
 * stream is cut into chunks (as they might arrive over the network); the rest is the
 * stream. Nothing may crash; the counts taken are in range; one line never grows past the
 * cap; and the same bytes in one chunk or in pieces give the same result.
 *
 *   build-fuzz/fuzz_bench_sse -max_total_time=60 tests/fuzz/corpus_bench_sse
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/sse.h"

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_bench_sse: invariant broken: %s\n", what);
        abort();
    }
}

/* The stream in pieces of `step` bytes (0: whole), then its end. */
static void read_all(bench_sse *s, bench_request *r, const char *p, size_t n, size_t step)
{
    bench_request_init(r);
    bench_sse_init(s, r);
    r->t_send = 1.0;
    double now = 2.0;
    bool go = true;
    for (size_t at = 0; go && at < n; at += step ? step : n) {
        size_t k = step && n - at > step ? step : n - at;
        go = bench_sse_feed(s, p + at, k, now);
        now += 0.001;
    }
    if (go) bench_sse_end(s, now);
    check(s->line_cap <= BENCH_SSE_LINE_CAP, "the line buffer stays under the cap");
    check(r->prompt_tokens >= 0 && r->output_tokens >= 0 && r->cached_tokens >= -1,
          "counts are counts");
    check(s->done == (r->t_end > 0), "t_end is set by [DONE]");
    for (size_t i = 1; i < r->num_events; i++)
        check(r->t_events[i] >= r->t_events[i - 1], "events in time order");
    r->ok = s->done && !s->bad_event;
    (void)bench_ttft_ms(r);
    (void)bench_tpot_ms(r);
    (void)bench_e2el_ms(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    size_t step = 1 + data[0] % 97;
    const char *p = (const char *)data + 1;
    size_t n = size - 1;
    bench_sse a, b;
    bench_request ra, rb;
    read_all(&a, &ra, p, n, 0);
    read_all(&b, &rb, p, n, step);
    check(a.done == b.done && a.bad_event == b.bad_event && a.too_long == b.too_long &&
              a.have_usage == b.have_usage && !strcmp(a.stream_error, b.stream_error),
          "chunking changes nothing but the timestamps");
    check(ra.num_events == rb.num_events && ra.output_tokens == rb.output_tokens &&
              ra.prompt_tokens == rb.prompt_tokens && ra.cached_tokens == rb.cached_tokens,
          "chunking changes no count");
    for (int f = 0; f < BENCH_T_COUNT; f++)
        check((isnan(ra.timing_ms[f]) && isnan(rb.timing_ms[f])) ||
                  ra.timing_ms[f] == rb.timing_ms[f],
              "chunking changes no timing");
    bench_sse_free(&a);
    bench_sse_free(&b);
    bench_request_free(&ra);
    bench_request_free(&rb);
    return 0;
}
