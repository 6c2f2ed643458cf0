/*
 * server/metrics.c - Prometheus text for GET /metrics. Counters and histograms live
 * on the I/O thread only (every observation is made there), so they need no locks;
 * engine gauges come from the snapshot the engine thread publishes each step.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_impl.h"

static const double k_latency_bounds[SRV__HIST_BUCKETS] = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
static const double k_tpot_bounds[SRV__HIST_BUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05,   0.075,   0.1,    0.15,  0.2,    0.3,   0.5,  1.0};

void srv__metrics_init(srv__metrics *m)
{
    memset(m, 0, sizeof(*m));
    m->ttft.bounds = k_latency_bounds;
    m->e2e.bounds = k_latency_bounds;
    m->queue.bounds = k_latency_bounds;
    m->tpot.bounds = k_tpot_bounds;
}

void srv__hist_observe(srv__hist *h, double v)
{
    int i = 0;
    while (i < SRV__HIST_BUCKETS && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
}

/* A histogram: counts by bucket, the last one past every bound. */
static void counts_hist(td_sbuf *o, const char *name, const char *help, const double *bounds,
                        const uint64_t *counts, int n, double sum, const char *model)
{
    td_sbuf_printf(o, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < n; i++) {
        cum += counts[i];
        td_sbuf_printf(o, "%s_bucket{model_name=\"%s\",le=\"%g\"} %llu\n", name, model, bounds[i],
                       (unsigned long long)cum);
    }
    cum += counts[n];
    td_sbuf_printf(o, "%s_bucket{model_name=\"%s\",le=\"+Inf\"} %llu\n", name, model,
                   (unsigned long long)cum);
    td_sbuf_printf(o, "%s_sum{model_name=\"%s\"} %.9g\n%s_count{model_name=\"%s\"} %llu\n", name,
                   model, sum, name, model, (unsigned long long)cum);
}

static void hist(td_sbuf *o, const char *name, const char *help, const srv__hist *h,
                 const char *model)
{
    counts_hist(o, name, help, h->bounds, h->counts, SRV__HIST_BUCKETS, h->sum, model);
}

static void gauge(td_sbuf *o, const char *name, const char *type, const char *help,
                  const char *model, double v)
{
    td_sbuf_printf(o, "# HELP %s %s\n# TYPE %s %s\n%s{model_name=\"%s\"} %.17g\n", name, help, name,
                   type, name, model, v);
}

char *srv__metrics_render(const srv__metrics *m, const srv__snapshot *s, const char *model)
{
    td_sbuf o = {0};
    const td_engine_stats *st = &s->stats;
    gauge(&o, "tandem_num_requests_running", "gauge", "Requests in the running batch.", model,
          s->num_running);
    gauge(&o, "tandem_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", model,
          s->num_waiting);
    gauge(&o, "tandem_kv_blocks_total", "gauge", "KV cache blocks in the pool.", model,
          st->num_blocks_total);
    gauge(&o, "tandem_kv_blocks_used", "gauge", "KV cache blocks held by requests.", model,
          st->num_blocks_total - st->num_blocks_free);
    gauge(&o, "tandem_kv_cache_usage_perc", "gauge", "Fraction of KV blocks held by requests.",
          model,
          st->num_blocks_total
              ? (double)(st->num_blocks_total - st->num_blocks_free) / st->num_blocks_total
              : 0.0);
    gauge(&o, "tandem_prefix_cache_queries_total", "counter",
          "Prompt tokens looked up in the prefix cache.", model, (double)st->prefix_queries_tokens);
    gauge(&o, "tandem_prefix_cache_hits_total", "counter",
          "Prompt tokens served from the prefix cache.", model, (double)st->prefix_hits_tokens);
    gauge(&o, "tandem_prefix_cache_hit_rate", "gauge",
          "Prefix cache hits / queries, in tokens, since start.", model,
          st->prefix_queries_tokens ? (double)st->prefix_hits_tokens / st->prefix_queries_tokens
                                    : 0.0);
    gauge(&o, "tandem_num_preemptions_total", "counter", "Preempted requests.", model,
          (double)st->num_preemptions);
    gauge(&o, "tandem_ep_exchange_bytes", "gauge",
          "Expert parallelism: the expert exchange's buffers, apart from the KV pool.", model,
          (double)st->ep_exchange_bytes);
    gauge(&o, "tandem_cpu_borrowed_runs_total", "counter",
          "--cpu-board: parallel runs that used CPUs borrowed from an idle engine.", model,
          (double)st->cpu_borrowed_runs);
    gauge(&o, "tandem_cpu_reclaims_total", "counter",
          "--cpu-board: times this engine waited for a borrower to give its CPUs back.", model,
          (double)st->cpu_reclaims);
    gauge(&o, "tandem_cpu_reclaim_seconds_total", "counter",
          "--cpu-board: time spent waiting for lent CPUs to come back.", model,
          (double)st->cpu_reclaim_ns / 1e9);
    /* The engine's steps: how full they ran and where its time went. */
    td_sbuf_printf(
        &o, "# HELP tandem_engine_steps_total Engine steps (forward passes), by kind: prefill "
            "(computed prompt tokens, with or without decode rows) or decode (decode rows "
            "only).\n# TYPE tandem_engine_steps_total counter\n");
    td_sbuf_printf(&o, "tandem_engine_steps_total{model_name=\"%s\",kind=\"prefill\"} %llu\n",
                   model, (unsigned long long)st->steps_prefill);
    td_sbuf_printf(&o, "tandem_engine_steps_total{model_name=\"%s\",kind=\"decode\"} %llu\n", model,
                   (unsigned long long)(st->steps - st->steps_prefill));
    td_sbuf_printf(
        &o, "# HELP tandem_engine_step_seconds_total Time in engine steps, by kind (as "
            "tandem_engine_steps_total).\n# TYPE tandem_engine_step_seconds_total counter\n");
    td_sbuf_printf(&o,
                   "tandem_engine_step_seconds_total{model_name=\"%s\",kind=\"prefill\"} %.9g\n",
                   model, (double)st->step_ns_prefill / 1e9);
    td_sbuf_printf(&o, "tandem_engine_step_seconds_total{model_name=\"%s\",kind=\"decode\"} %.9g\n",
                   model, (double)st->step_ns_decode / 1e9);
    double tok_bounds[TD_STEP_TOKEN_BUCKETS];
    for (int i = 0; i < TD_STEP_TOKEN_BUCKETS; i++)
        tok_bounds[i] = (double)(1 << i);
    counts_hist(&o, "tandem_iteration_tokens", "Tokens computed per engine step.", tok_bounds,
                st->step_tokens_hist, TD_STEP_TOKEN_BUCKETS,
                (double)(st->tokens_prefilled + st->tokens_decoded), model);
    counts_hist(&o, "tandem_engine_step_duration_seconds", "Duration of an engine step.",
                td_step_seconds_bounds, st->step_time_hist, TD_STEP_TIME_BUCKETS,
                (double)(st->step_ns_prefill + st->step_ns_decode) / 1e9, model);
    gauge(&o, "tandem_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", model,
          (double)m->prompt_tokens);
    gauge(&o, "tandem_generation_tokens_total", "counter", "Generated tokens.", model,
          (double)m->generation_tokens);
    td_sbuf_printf(&o, "# HELP tandem_request_success_total Finished requests by finish reason.\n"
                       "# TYPE tandem_request_success_total counter\n");
    static const char *const reasons[5] = {"none", "stop", "length", "abort", "error"};
    for (int i = 1; i < 5; i++)
        td_sbuf_printf(
            &o, "tandem_request_success_total{model_name=\"%s\",finished_reason=\"%s\"} %llu\n",
            model, reasons[i], (unsigned long long)m->finished[i]);
    td_sbuf_printf(&o, "# HELP tandem_http_requests_total HTTP responses by status class.\n"
                       "# TYPE tandem_http_requests_total counter\n");
    for (int i = 1; i < 6; i++)
        td_sbuf_printf(&o, "tandem_http_requests_total{status=\"%dxx\"} %llu\n", i,
                       (unsigned long long)m->http_requests[i]);
    gauge(&o, "tandem_requests_rejected_queue_full_total", "counter",
          "Requests refused because the waiting queue was full.", model,
          (double)m->rejected_queue_full);
    hist(&o, "tandem_time_to_first_token_seconds", "Time from receipt to the first token.",
         &m->ttft, model);
    hist(&o, "tandem_time_per_output_token_seconds", "Mean time between output tokens.", &m->tpot,
         model);
    hist(&o, "tandem_e2e_request_latency_seconds", "Time from receipt to the last token.", &m->e2e,
         model);
    hist(&o, "tandem_request_queue_time_seconds", "Time waiting before first scheduled.", &m->queue,
         model);
    if (o.oom) {
        free(o.p);
        return NULL;
    }
    return o.p;
}
