/*
 * bench/report.h - what `tandem bench` prints and saves: the human summary table (laid out
 * like vLLM's benchmark_serving), the result JSON (with vLLM's metric names), and
 * `--compare`, which reads result files back into a side-by-side table and an SVG plot.
 *
 * No I/O other than the FILE and paths handed in; no HTTP.
 */
#ifndef TD_BENCH_REPORT_H
#define TD_BENCH_REPORT_H

#include <stdio.h>

#include "bench/metrics.h"

/* One reason requests failed for, and how many did. */
typedef struct bench_failure {
    char reason[96];
    long count;
} bench_failure;

/** What was run: the settings echoed into the table and the JSON. Borrowed strings. */
typedef struct bench_run_info {
    const char *label;                       /* may be NULL */
    const char *base_url, *endpoint, *model; /* model may be NULL (not sent) */
    const char *dataset;
    long num_prompts;
    long max_concurrency; /* 0 = unlimited */
    double request_rate;  /* requests/s; INFINITY = all at once */
    double burstiness;
    long input_len, output_len, prefix_len;
    double range_ratio;
    const bench_slo *slo; /* may be NULL */
    const double *percentiles;
    int num_percentiles;
    const bench_failure *failures;
    int num_failures;
} bench_run_info;

/** Print the summary table. */
void bench_report_print(FILE *out, const bench_run_info *info, const bench_results *res);

/**
 * Write the result JSON to path: every metric (completed, failed, duration, *_throughput,
 * {mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms, goodput), the settings, and the server's
 * breakdown fields that any request reported. Returns 0 or a TD_E* code with err filled.
 */
int bench_report_save(const char *path, const bench_run_info *info, const bench_results *res,
                      td_err *err);

/**
 * Read result files written by bench_report_save, print a table of the main metrics with
 * one column per file (its label as the header) to out, and write an SVG of median TTFT
 * and median TPOT against max_concurrency, one line per label, to svg_path. Returns 0 or
 * a TD_E* code with err filled.
 */
int bench_compare(const char *const *paths, int num_paths, const char *svg_path, FILE *out,
                  td_err *err);

#endif
