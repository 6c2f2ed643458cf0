/*
 * bench/metrics.h - the arithmetic of `tandem bench`, the serving benchmark: what a
 * request's timestamps mean (TTFT, TPOT, ITL, E2EL), summaries with percentiles, goodput
 * against SLOs, throughput, and the arrival process (Poisson or gamma inter-arrival times).
 *
 * Nothing here does I/O: the CLI (src/cli/bench.c) fills one bench_request per request from
 * the SSE stream and hands the array over, which keeps every formula testable on synthetic
 * timestamps. Times are seconds from td_now_s() (CLOCK_MONOTONIC) in a request and
 * milliseconds in every derived latency, as in vLLM's benchmark_serving.
 *
 * Definitions (the same as vLLM's):
 *  - TTFT: first content-carrying SSE event minus the send time;
 *  - E2EL: the end of the stream minus the send time;
 *  - TPOT: (E2EL - TTFT) / (output_tokens - 1), the mean time per token after the first;
 *    undefined (left out of the statistics) for outputs of one token;
 *  - ITL: the gaps between consecutive content-carrying events of one request, pooled over
 *    all requests (an event can carry more than one token, so ITL and TPOT can differ);
 *  - a failed request counts in `failed` and nowhere else.
 */
#ifndef TD_BENCH_METRICS_H
#define TD_BENCH_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "util/td.h"

/* Per-request timings a server may report about itself (tandem does; others do not). The
 * names are the JSON field names; the first group is kv_transfer_params.timing of a
 * disaggregated request, the second usage.timings. */
typedef enum bench_timing_field {
    BENCH_T_PRODUCER_QUEUE,         /* kv_transfer_params.timing.producer_queue_ms */
    BENCH_T_PRODUCER_COMPUTE,       /* ...producer_compute_ms */
    BENCH_T_CONSUMER_QUEUE,         /* ...consumer_queue_ms */
    BENCH_T_TRANSFER,               /* ...transfer_ms */
    BENCH_T_TRANSFER_WIRE,          /* ...transfer_wire_ms */
    BENCH_T_TRANSFER_AFTER_PREFILL, /* ...transfer_after_prefill_ms */
    BENCH_T_FIRST_DECODE_STEP,      /* ...first_decode_step_ms */
    BENCH_T_SERVER_QUEUE,           /* usage.timings.queue_time_ms */
    BENCH_T_SERVER_TTFT,            /* usage.timings.ttft_ms */
    BENCH_T_SERVER_TPOT,            /* usage.timings.tpot_ms */
    BENCH_T_SERVER_E2E,             /* usage.timings.e2e_ms */
    BENCH_T_COUNT
} bench_timing_field;

/** The field's name in the server's JSON ("transfer_ms", "queue_time_ms", ...). */
const char *bench_timing_json_name(bench_timing_field f);
/** The name under which results report it ("transfer_ms", "server_queue_time_ms", ...). */
const char *bench_timing_result_name(bench_timing_field f);

/** One request of a run. The caller owns the struct; bench_request_free frees the events. */
typedef struct bench_request {
    double t_send;    /* s: when the request was handed to the HTTP client */
    double t_end;     /* s: when its stream ended ([DONE], or the transfer's end) */
    double *t_events; /* s: arrival of each content-carrying SSE event, in order */
    size_t num_events, cap_events;
    long prompt_tokens; /* the server's usage.prompt_tokens, else the dataset's count */
    long output_tokens; /* usage.completion_tokens, else num_events; <= 0: unknown */
    long cached_tokens; /* usage.prompt_tokens_details.cached_tokens (prompt tokens the
                           server's prefix cache answered); -1: not reported */
    bool ok;            /* completed: HTTP 200 and a stream that ended with [DONE] */
    char error[160];    /* why it failed, when !ok */
    double timing_ms[BENCH_T_COUNT]; /* server-reported timings; NAN where absent */
} bench_request;

/** Zero a request and mark every timing absent. */
void bench_request_init(bench_request *r);
void bench_request_free(bench_request *r);
/** Record a content event at time t (seconds). Returns 0 or TD_ENOMEM. */
int bench_request_add_event(bench_request *r, double t);

/** TTFT in ms, or NAN when the request failed or carried no content event. */
double bench_ttft_ms(const bench_request *r);
/** E2EL in ms, or NAN for a failed request. */
double bench_e2el_ms(const bench_request *r);
/** TPOT in ms, or NAN when it is undefined (failed, no content, or fewer than 2 tokens). */
double bench_tpot_ms(const bench_request *r);

/** Service-level objectives in ms; 0 means "not set". */
typedef struct bench_slo {
    double ttft_ms, tpot_ms, e2el_ms;
} bench_slo;

/**
 * Parse goodput terms such as "ttft:500 tpot:50" (whitespace or comma separated, any subset
 * of ttft, tpot and e2el, each a positive number of ms) into `slo`, adding to what is there.
 * Returns 0, or TD_EINVAL with a message in err.
 */
int bench_slo_parse(const char *text, bench_slo *slo, td_err *err);
bool bench_slo_any(const bench_slo *slo);
/**
 * True when a completed request meets every SLO that is set. A request whose TPOT is
 * undefined (one output token) has no time per output token to violate, so it meets the
 * TPOT objective, as in vLLM, where its TPOT counts as 0.
 */
bool bench_request_meets_slo(const bench_request *r, const bench_slo *slo);

/**
 * The p-th percentile (p in [0, 100]) of n ascending values by linear interpolation between
 * the closest ranks, numpy's default: the value at fractional index p/100 * (n - 1). NAN for
 * n == 0.
 */
double bench_percentile_sorted(const double *sorted, size_t n, double p);

#define BENCH_MAX_PERCENTILES 16
/** Summary of one latency metric, in ms; NAN when there were no samples. */
typedef struct bench_summary {
    size_t count;
    double mean, median, std, min, max;
    double pct[BENCH_MAX_PERCENTILES]; /* at the caller's percentiles, in their order */
} bench_summary;

/**
 * Summarize n values: sorts them in place (NANs must already be left out). std is the
 * population standard deviation (numpy's default), as vLLM reports it.
 */
void bench_summarize(double *values, size_t n, const double *percentiles, int num_percentiles,
                     bench_summary *out);

/** Everything a run reports. */
typedef struct bench_results {
    long completed, failed;
    long total_input_tokens, total_output_tokens;
    /* prompt tokens answered from the server's prefix cache, summed over the completed
     * requests that reported it (cached_reported of them; 0: the server reports none) */
    long total_cached_tokens, cached_reported;
    long good_requests; /* completed and meeting every SLO */
    double duration_s;
    double request_throughput;     /* completed / duration, req/s */
    double output_throughput;      /* output tokens / duration, tok/s */
    double total_token_throughput; /* (input + output tokens) / duration, tok/s */
    double goodput;                /* good_requests / duration, req/s; NAN without SLOs */
    bench_summary ttft, tpot, itl, e2el;
    bench_summary timing[BENCH_T_COUNT]; /* count 0 where no request reported the field */
    double transfer_share_of_ttft;       /* mean(transfer_ms) / mean(TTFT); NAN when not reported */
} bench_results;

/**
 * Compute every metric of n requests run over duration_s seconds. slo may be NULL or have
 * nothing set (goodput is then NAN). Returns 0 or TD_ENOMEM.
 */
int bench_compute(const bench_request *reqs, size_t n, double duration_s, const bench_slo *slo,
                  const double *percentiles, int num_percentiles, bench_results *out);

/**
 * The arrival process: inter-arrival gaps drawn from a gamma distribution with shape
 * `burstiness` and mean 1/rate, as vLLM's benchmark_serving does. burstiness 1 is a Poisson
 * process (exponential gaps); below 1 arrivals come in bursts, above 1 more evenly. A rate
 * of 0 or infinity means every request at once (every gap 0).
 */
typedef struct bench_arrivals {
    td_rng rng;
    double rate;       /* requests/s */
    double burstiness; /* gamma shape */
} bench_arrivals;

void bench_arrivals_init(bench_arrivals *a, double rate, double burstiness, uint64_t seed);
/** The next gap in seconds (>= 0). */
double bench_arrivals_next(bench_arrivals *a);

/** A uniform double in (0, 1) from rng, with 53 bits. */
double bench_uniform(td_rng *rng);

#endif
