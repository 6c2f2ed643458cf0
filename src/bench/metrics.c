/* bench/metrics.c - see metrics.h. */
#include "bench/metrics.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const timing_json_names[BENCH_T_COUNT] = {
    "producer_queue_ms",
    "producer_compute_ms",
    "consumer_queue_ms",
    "transfer_ms",
    "transfer_wire_ms",
    "transfer_after_prefill_ms",
    "first_decode_step_ms",
    "queue_time_ms",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
};

/* usage.timings fields get a "server_" prefix, so that the server's own TTFT does not read
 * like the client-side mean_ttft_ms. */
static const char *const timing_result_names[BENCH_T_COUNT] = {
    "producer_queue_ms",    "producer_compute_ms",  "consumer_queue_ms",
    "transfer_ms",          "transfer_wire_ms",     "transfer_after_prefill_ms",
    "first_decode_step_ms", "server_queue_time_ms", "server_ttft_ms",
    "server_tpot_ms",       "server_e2e_ms",
};

const char *bench_timing_json_name(bench_timing_field f)
{
    return f >= 0 && f < BENCH_T_COUNT ? timing_json_names[f] : "?";
}

const char *bench_timing_result_name(bench_timing_field f)
{
    return f >= 0 && f < BENCH_T_COUNT ? timing_result_names[f] : "?";
}

/* ---- one request ---- */

void bench_request_init(bench_request *r)
{
    memset(r, 0, sizeof(*r));
    r->cached_tokens = -1;
    for (int f = 0; f < BENCH_T_COUNT; f++)
        r->timing_ms[f] = NAN;
}

void bench_request_free(bench_request *r)
{
    free(r->t_events);
    r->t_events = NULL;
    r->num_events = r->cap_events = 0;
}

int bench_request_add_event(bench_request *r, double t)
{
    if (r->num_events == r->cap_events) {
        size_t cap = r->cap_events ? r->cap_events * 2 : 64;
        double *grown = realloc(r->t_events, cap * sizeof(double));
        if (!grown) return TD_ENOMEM;
        r->t_events = grown;
        r->cap_events = cap;
    }
    r->t_events[r->num_events++] = t;
    return 0;
}

double bench_ttft_ms(const bench_request *r)
{
    if (!r->ok || r->num_events == 0) return NAN;
    return (r->t_events[0] - r->t_send) * 1e3;
}

double bench_e2el_ms(const bench_request *r)
{
    if (!r->ok) return NAN;
    return (r->t_end - r->t_send) * 1e3;
}

double bench_tpot_ms(const bench_request *r)
{
    double ttft = bench_ttft_ms(r);
    if (isnan(ttft) || r->output_tokens < 2) return NAN;
    return (bench_e2el_ms(r) - ttft) / (double)(r->output_tokens - 1);
}

/* ---- SLOs ---- */

int bench_slo_parse(const char *text, bench_slo *slo, td_err *err)
{
    const char *p = text;
    bool any = false;
    for (;;) {
        while (*p && (isspace((unsigned char)*p) || *p == ','))
            p++;
        if (!*p) break;
        const char *colon = strchr(p, ':');
        size_t name_len = colon ? (size_t)(colon - p) : 0;
        double *dst = NULL;
        if (name_len == 4 && !strncmp(p, "ttft", 4))
            dst = &slo->ttft_ms;
        else if (name_len == 4 && !strncmp(p, "tpot", 4))
            dst = &slo->tpot_ms;
        else if (name_len == 4 && !strncmp(p, "e2el", 4))
            dst = &slo->e2el_ms;
        if (!dst)
            return td_err_set(err, TD_EINVAL,
                              "goodput term '%.40s' is not ttft:MS, tpot:MS or e2el:MS", p);
        char *end;
        double v = strtod(colon + 1, &end);
        if (end == colon + 1 || !(v > 0) || !isfinite(v) ||
            (*end && !isspace((unsigned char)*end) && *end != ','))
            return td_err_set(err, TD_EINVAL, "goodput term '%.40s' needs a positive number of ms",
                              p);
        *dst = v;
        any = true;
        p = end;
    }
    if (!any)
        return td_err_set(err, TD_EINVAL, "goodput needs at least one of ttft:MS tpot:MS e2el:MS");
    return 0;
}

bool bench_slo_any(const bench_slo *slo)
{
    return slo && (slo->ttft_ms > 0 || slo->tpot_ms > 0 || slo->e2el_ms > 0);
}

bool bench_request_meets_slo(const bench_request *r, const bench_slo *slo)
{
    if (!r->ok) return false;
    if (slo->ttft_ms > 0) {
        double v = bench_ttft_ms(r);
        if (isnan(v) || v > slo->ttft_ms) return false;
    }
    if (slo->tpot_ms > 0) {
        double v = bench_tpot_ms(r);
        if (!isnan(v) && v > slo->tpot_ms) return false;
    }
    if (slo->e2el_ms > 0 && bench_e2el_ms(r) > slo->e2el_ms) return false;
    return true;
}

/* ---- statistics ---- */

double bench_percentile_sorted(const double *sorted, size_t n, double p)
{
    if (n == 0) return NAN;
    if (p <= 0) return sorted[0];
    if (p >= 100) return sorted[n - 1];
    double rank = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(rank);
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    double frac = rank - (double)lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void bench_summarize(double *values, size_t n, const double *percentiles, int num_percentiles,
                     bench_summary *out)
{
    memset(out, 0, sizeof(*out));
    out->count = n;
    out->mean = out->median = out->std = out->min = out->max = NAN;
    for (int i = 0; i < BENCH_MAX_PERCENTILES; i++)
        out->pct[i] = NAN;
    if (n == 0) return;
    qsort(values, n, sizeof(double), cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += values[i];
    out->mean = sum / (double)n;
    double sq = 0;
    for (size_t i = 0; i < n; i++)
        sq += (values[i] - out->mean) * (values[i] - out->mean);
    out->std = sqrt(sq / (double)n);
    out->min = values[0];
    out->max = values[n - 1];
    out->median = bench_percentile_sorted(values, n, 50);
    for (int i = 0; i < num_percentiles && i < BENCH_MAX_PERCENTILES; i++)
        out->pct[i] = bench_percentile_sorted(values, n, percentiles[i]);
}

int bench_compute(const bench_request *reqs, size_t n, double duration_s, const bench_slo *slo,
                  const double *percentiles, int num_percentiles, bench_results *out)
{
    memset(out, 0, sizeof(*out));
    size_t num_gaps = 0;
    for (size_t i = 0; i < n; i++)
        if (reqs[i].ok && reqs[i].num_events > 1) num_gaps += reqs[i].num_events - 1;
    /* One scratch array per metric; +1 keeps malloc(0) out of the picture. */
    double *ttft = malloc((n + 1) * sizeof(double));
    double *tpot = malloc((n + 1) * sizeof(double));
    double *e2el = malloc((n + 1) * sizeof(double));
    double *itl = malloc((num_gaps + 1) * sizeof(double));
    double *timing = malloc((n + 1) * sizeof(double));
    int rc = 0;
    if (!ttft || !tpot || !e2el || !itl || !timing) {
        rc = TD_ENOMEM;
        goto out;
    }
    size_t n_ttft = 0, n_tpot = 0, n_e2el = 0, n_itl = 0;
    bool use_slo = bench_slo_any(slo);
    for (size_t i = 0; i < n; i++) {
        const bench_request *r = &reqs[i];
        if (!r->ok) {
            out->failed++;
            continue;
        }
        out->completed++;
        out->total_input_tokens += r->prompt_tokens > 0 ? r->prompt_tokens : 0;
        out->total_output_tokens += r->output_tokens > 0 ? r->output_tokens : 0;
        if (r->cached_tokens >= 0) {
            out->total_cached_tokens += r->cached_tokens;
            out->cached_reported++;
        }
        double v = bench_ttft_ms(r);
        if (!isnan(v)) ttft[n_ttft++] = v;
        v = bench_tpot_ms(r);
        if (!isnan(v)) tpot[n_tpot++] = v;
        e2el[n_e2el++] = bench_e2el_ms(r);
        for (size_t k = 1; k < r->num_events; k++)
            itl[n_itl++] = (r->t_events[k] - r->t_events[k - 1]) * 1e3;
        if (use_slo && bench_request_meets_slo(r, slo)) out->good_requests++;
    }
    out->duration_s = duration_s;
    if (duration_s > 0) {
        out->request_throughput = out->completed / duration_s;
        out->output_throughput = out->total_output_tokens / duration_s;
        out->total_token_throughput =
            (out->total_input_tokens + out->total_output_tokens) / duration_s;
    }
    out->goodput = use_slo ? (duration_s > 0 ? out->good_requests / duration_s : 0) : NAN;
    bench_summarize(ttft, n_ttft, percentiles, num_percentiles, &out->ttft);
    bench_summarize(tpot, n_tpot, percentiles, num_percentiles, &out->tpot);
    bench_summarize(itl, n_itl, percentiles, num_percentiles, &out->itl);
    bench_summarize(e2el, n_e2el, percentiles, num_percentiles, &out->e2el);
    for (int f = 0; f < BENCH_T_COUNT; f++) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            if (reqs[i].ok && !isnan(reqs[i].timing_ms[f])) timing[k++] = reqs[i].timing_ms[f];
        bench_summarize(timing, k, percentiles, num_percentiles, &out->timing[f]);
    }
    out->transfer_share_of_ttft = NAN;
    if (out->timing[BENCH_T_TRANSFER].count > 0 && out->ttft.mean > 0)
        out->transfer_share_of_ttft = out->timing[BENCH_T_TRANSFER].mean / out->ttft.mean;
out:
    free(ttft);
    free(tpot);
    free(e2el);
    free(itl);
    free(timing);
    return rc;
}

/* ---- arrivals ---- */

double bench_uniform(td_rng *rng)
{
    return ((double)(td_rng_next(rng) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static double standard_normal(td_rng *rng)
{
    /* Box-Muller; one of the pair is thrown away, which keeps the generator stateless. */
    double u1 = bench_uniform(rng), u2 = bench_uniform(rng);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

/* Gamma(shape, 1) by Marsaglia and Tsang (2000); shapes below 1 are boosted to shape + 1
 * and scaled back by U^(1/shape). */
static double standard_gamma(td_rng *rng, double shape)
{
    if (shape < 1.0) return standard_gamma(rng, shape + 1.0) * pow(bench_uniform(rng), 1.0 / shape);
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x, v;
        do {
            x = standard_normal(rng);
            v = 1.0 + c * x;
        } while (v <= 0);
        v = v * v * v;
        double u = bench_uniform(rng);
        if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
        if (log(u) < 0.5 * x * x + d * (1.0 - v + log(v))) return d * v;
    }
}

void bench_arrivals_init(bench_arrivals *a, double rate, double burstiness, uint64_t seed)
{
    td_rng_seed(&a->rng, seed);
    a->rate = rate;
    a->burstiness = burstiness > 0 ? burstiness : 1.0;
}

double bench_arrivals_next(bench_arrivals *a)
{
    if (!(a->rate > 0) || isinf(a->rate)) return 0;
    /* Gamma(shape k, scale theta) has mean k * theta; theta = 1 / (rate * k) makes it 1/rate. */
    double theta = 1.0 / (a->rate * a->burstiness);
    if (a->burstiness == 1.0) return -log(bench_uniform(&a->rng)) * theta;
    return standard_gamma(&a->rng, a->burstiness) * theta;
}
