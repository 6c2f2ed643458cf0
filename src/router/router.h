/*
 * router/router.h - `tandem router`: the OpenAI-compatible front of a tandem cluster.
 *
 * One thread runs one libevent loop. It accepts client requests (evhttp), picks workers
 * with the per-role policies (policy.h), relays requests to them over pooled keep-alive
 * connections (evhttp client), and relays their answers back, SSE streams chunk by chunk
 * as they arrive. It knows the engines only through their HTTP API: /v1/completions,
 * /v1/chat/completions, /health, /kv_transfer_info and the kv_transfer_params contract
 * (docs/ARCHITECTURE.md); nothing of the engine's internals.
 *
 * Modes:
 *  - aggregated (--worker URL ...): each request goes to one plain engine;
 *  - PD (--pd-disaggregation --prefill URL ... --decode URL ...): read mode asks a prefill
 *    instance for the prompt's KV (do_remote_decode, max_tokens 1, no stream), then a
 *    decode instance with the prefill's kv_transfer_params; write mode (the prefill
 *    instances' /kv_transfer_info says transfer_mode "write") asks both at once with one
 *    transfer id the router draws.
 *
 * Every request ends: with the answer, a relayed error, 502 (no worker could take it
 * after the retries), 504 (--request-timeout-secs passed before the answer began), 429
 * (the queue is full) or 408 (it waited in the queue longer than --queue-timeout-secs).
 */
#ifndef TD_ROUTER_ROUTER_H
#define TD_ROUTER_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "router/policy.h"
#include "util/td.h"

#define RT_MAX_URLS 64

typedef struct rt_config {
    const char *host; /* bind address ("0.0.0.0") */
    int port;         /* 0 = a free port (the "listening on" line says which) */
    bool pd;          /* --pd-disaggregation */
    const char *prefill[RT_MAX_URLS], *decode[RT_MAX_URLS], *worker[RT_MAX_URLS];
    int n_prefill, n_decode, n_worker;
    rt_policy_kind prefill_policy, decode_policy, worker_policy;
    double request_timeout_s;   /* 1800 */
    bool health_checks;         /* !--disable-health-check */
    double health_interval_s;   /* 10 */
    double health_timeout_s;    /* 5 */
    int health_failure_threshold, health_success_threshold; /* 3, 2 */
    const char *health_endpoint; /* "/health" */
    bool circuit_breaker;       /* !--disable-circuit-breaker */
    int cb_failure_threshold, cb_success_threshold; /* 5, 2 */
    double cb_timeout_s;        /* 30: open, then half-open */
    int retry_max_retries;      /* 3 */
    double retry_initial_backoff_s, retry_max_backoff_s, retry_backoff_multiplier,
        retry_jitter_factor;    /* 0.05, 2, 1.5, 0.2 */
    int max_concurrent_requests; /* 0 = unlimited */
    int queue_size;              /* 100: requests waiting for a slot; beyond: 429 */
    double queue_timeout_s;      /* 60: waiting longer: 408 */
    const char *api_key;         /* NULL = none; else clients must send Bearer KEY (401) */
    bool dp_aware;
    const char *rank_mapping;    /* "none" | "idx2idx" */
    const char *backend;         /* "atom" | "tandem" (same protocol) */
    double worker_ttl_s;         /* registered workers missing heartbeats this long: evicted (15) */
    double shutdown_timeout_s;   /* on SIGTERM/SIGINT, drain this long at most; 0: at once (30) */
    uint64_t seed;               /* policies' PRNG */
    size_t max_payload_bytes;    /* larger request bodies: 413 (4 MiB, as an engine's) */
} rt_config;

void rt_config_default(rt_config *c);

/** Check a configuration (URLs, counts, thresholds): 0 or TD_EINVAL with a message. */
int rt_config_check(const rt_config *c, td_err *err);

/** Run the router until SIGINT or SIGTERM. Returns 0 after a clean shutdown. */
int rt_run(const rt_config *c, td_err *err);

#endif
