/*
 * bench/sse.h - the reader of an OpenAI-style SSE stream for `tandem bench`: bytes in as
 * they arrive, a bench_request's timestamps and counts out.
 *
 * The stream comes from any server the benchmark is pointed at, so it is untrusted input:
 * lines are bounded (BENCH_SSE_LINE_CAP), counts are taken only when they are integers in
 * range, and anything malformed is noted (bad_event) rather than believed. A "data:"
 * payload that carries a token (text or delta content, empty strings included: a token
 * that does not complete a UTF-8 character yet) adds an event at the time its bytes
 * arrived; "[DONE]" ends the stream; usage, usage.timings and kv_transfer_params.timing
 * fill the request's counts and the server's own timings. Fuzzed by
 * tests/fuzz/fuzz_bench_sse.c.
 */
#ifndef TD_BENCH_SSE_H
#define TD_BENCH_SSE_H

#include <stdbool.h>
#include <stddef.h>

#include "bench/metrics.h"

#define BENCH_SSE_LINE_CAP (4u << 20) /* longest line accepted: an error beyond it */

typedef struct bench_sse {
    bench_request *r; /* where the events go (not owned) */
    char *line;       /* the line being received */
    size_t line_len, line_cap;
    bool done;             /* [DONE] seen */
    bool have_usage;       /* usage.completion_tokens seen */
    bool too_long;         /* a line past BENCH_SSE_LINE_CAP: the stream was given up */
    bool bad_event;        /* a data: payload that is not JSON, or an event out of order */
    char stream_error[96]; /* the first {"error": ...} event's message */
} bench_sse;

/** A reader that fills r. */
void bench_sse_init(bench_sse *s, bench_request *r);
/** Bytes received at time now (s). False: stop reading (a line too long, out of memory). */
bool bench_sse_feed(bench_sse *s, const char *p, size_t len, double now);
/** The stream has ended: a last line without its newline counts. */
void bench_sse_end(bench_sse *s, double now);
/** Frees the line buffer (the reader can be fed again after bench_sse_init). */
void bench_sse_free(bench_sse *s);

#endif
