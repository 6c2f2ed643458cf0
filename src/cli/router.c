/*
 * cli/router.c - `tandem router`: flags (atomesh's and sgl-router's names), then
 * rt_run. `tandem router launch ...` is accepted too, as atomesh spells it.
 */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "router/router.h"

static int policy_flag(const char *name, const char *v, rt_policy_kind *out)
{
    if (rt_policy_parse(v, out) == 0) return 0;
    fprintf(stderr,
            "error: --%s must be random, round_robin, power_of_two, cache_aware or prefix_hash, "
            "got '%s'\n",
            name, v);
    return 2;
}

int cli_router(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "launch")) { /* atomesh launch ... */
        argv++;
        argc--;
    }
    rt_config c;
    rt_config_default(&c);
    const char *host = c.host, *policy = NULL, *ppol = NULL, *dpol = NULL, *level = "info";
    const char *hc_endpoint = c.health_endpoint, *api_key = NULL, *rank_map = c.rank_mapping,
               *backend = c.backend;
    cli_str_list prefill = {0}, decode = {0}, worker = {0};
    int64_t port = c.port, hc_fail = c.health_failure_threshold, hc_ok = c.health_success_threshold,
            cb_fail = c.cb_failure_threshold, cb_ok = c.cb_success_threshold,
            retries = c.retry_max_retries, max_conc = 0, queue = c.queue_size, seed = 0;
    double req_to = c.request_timeout_s, hc_iv = c.health_interval_s, hc_to = c.health_timeout_s,
           cb_to = c.cb_timeout_s, b0 = c.retry_initial_backoff_s, bmax = c.retry_max_backoff_s,
           bmul = c.retry_backoff_multiplier, jit = c.retry_jitter_factor, q_to = c.queue_timeout_s,
           ttl = c.worker_ttl_s, drain = c.shutdown_timeout_s;
    uint64_t max_payload = c.max_payload_bytes;
    bool pd = false, no_hc = false, no_cb = false, dp_aware = false;
    cli_flag f[] = {
        CLI_FLAG("host", CLI_FLAG_STR, &host, "address to listen on (0.0.0.0)"),
        CLI_FLAG("port", CLI_FLAG_INT, &port, "port (8000; 0 picks a free one)"),
        CLI_FLAG("pd-disaggregation", CLI_FLAG_BOOL, &pd, "prefill/decode mode"),
        CLI_FLAG("prefill", CLI_FLAG_LIST, &prefill, "a prefill instance URL (repeat for more)"),
        CLI_FLAG("decode", CLI_FLAG_LIST, &decode, "a decode instance URL (repeat for more)"),
        CLI_FLAG("worker", CLI_FLAG_LIST, &worker, "a plain engine URL, aggregated mode (repeat)"),
        CLI_FLAG("policy", CLI_FLAG_STR, &policy,
                 "random | round_robin | power_of_two | cache_aware | prefix_hash, every role "
                 "(round_robin)"),
        CLI_FLAG("prefill-policy", CLI_FLAG_STR, &ppol, "the prefill role's policy"),
        CLI_FLAG("decode-policy", CLI_FLAG_STR, &dpol, "the decode role's policy"),
        CLI_FLAG("backend", CLI_FLAG_STR, &backend,
                 "atom | tandem | vllm | sglang (same protocol)"),
        CLI_FLAG("log-level", CLI_FLAG_STR, &level, "debug | info | warn | error"),
        CLI_FLAG("request-timeout-secs", CLI_FLAG_FLOAT, &req_to,
                 "a request's whole time; before the answer begins, 504 (1800)"),
        CLI_FLAG("disable-health-check", CLI_FLAG_BOOL, &no_hc, "no active health checks"),
        CLI_FLAG("health-check-interval-secs", CLI_FLAG_FLOAT, &hc_iv, "(10)"),
        CLI_FLAG("health-check-timeout-secs", CLI_FLAG_FLOAT, &hc_to, "(5)"),
        CLI_FLAG("health-failure-threshold", CLI_FLAG_INT, &hc_fail,
                 "failed checks in a row to mark a worker unhealthy (3)"),
        CLI_FLAG("health-success-threshold", CLI_FLAG_INT, &hc_ok,
                 "passed checks in a row to mark it healthy again (2)"),
        CLI_FLAG("health-check-endpoint", CLI_FLAG_STR, &hc_endpoint, "(/health)"),
        CLI_FLAG("disable-circuit-breaker", CLI_FLAG_BOOL, &no_cb, "no circuit breakers"),
        CLI_FLAG("cb-failure-threshold", CLI_FLAG_INT, &cb_fail,
                 "failed requests in a row that open a worker's breaker (5)"),
        CLI_FLAG("cb-success-threshold", CLI_FLAG_INT, &cb_ok,
                 "successes in half-open state that close it (2)"),
        CLI_FLAG("cb-timeout-duration-secs", CLI_FLAG_FLOAT, &cb_to,
                 "how long a breaker stays open before a trial request (30)"),
        CLI_FLAG("retry-max-retries", CLI_FLAG_INT, &retries,
                 "retries of a request that has not started streaming, on another worker (3)"),
        CLI_FLAG("retry-initial-backoff-secs", CLI_FLAG_FLOAT, &b0, "(0.05)"),
        CLI_FLAG("retry-max-backoff-secs", CLI_FLAG_FLOAT, &bmax, "(2)"),
        CLI_FLAG("retry-backoff-multiplier", CLI_FLAG_FLOAT, &bmul, "(1.5)"),
        CLI_FLAG("retry-jitter-factor", CLI_FLAG_FLOAT, &jit, "(0.2)"),
        CLI_FLAG("max-concurrent-requests", CLI_FLAG_INT, &max_conc,
                 "requests relayed at once; 0 = unlimited (0)"),
        CLI_FLAG("queue-size", CLI_FLAG_INT, &queue,
                 "requests waiting beyond that; more: 429 (100)"),
        CLI_FLAG("queue-timeout-secs", CLI_FLAG_FLOAT, &q_to,
                 "longest wait in the queue: 408 (60)"),
        CLI_FLAG("api-key", CLI_FLAG_STR, &api_key,
                 "clients must send 'Authorization: Bearer KEY'"),
        CLI_FLAG("dp-aware", CLI_FLAG_BOOL, &dp_aware, "data-parallel ranks as separate workers"),
        CLI_FLAG("atom-pd-rank-mapping-policy", CLI_FLAG_STR, &rank_map, "none | idx2idx (none)"),
        CLI_FLAG("worker-ttl-secs", CLI_FLAG_FLOAT, &ttl,
                 "a self-registered worker that sends no heartbeat this long is evicted (15)"),
        CLI_FLAG("shutdown-timeout-secs", CLI_FLAG_FLOAT, &drain,
                 "on SIGTERM or SIGINT, seconds to let requests in flight finish before exiting "
                 "(30; 0: exit at once)"),
        CLI_FLAG("seed", CLI_FLAG_INT, &seed, "the policies' random seed (0: from the clock)"),
        CLI_FLAG("max-payload-size", CLI_FLAG_SIZE, &max_payload,
                 "largest request body; larger ones get 413 (4M)"),
    };
    int rc = cli_flags_parse(f, (int)TD_ARRAY_LEN(f), argc, argv,
                             "tandem router [--pd-disaggregation --prefill URL ... --decode URL "
                             "...] [--worker URL ...] [options]");
    if (rc) return rc == 1 ? 0 : 2;
    td_log_level lv;
    if (td_log_parse_level(level, &lv)) {
        fprintf(stderr, "error: --log-level must be debug, info, warn or error\n");
        return 2;
    }
    td_log_set_level(lv);
    if (policy && (rc = policy_flag("policy", policy, &c.worker_policy))) return rc;
    c.prefill_policy = c.decode_policy = c.worker_policy;
    if (ppol && (rc = policy_flag("prefill-policy", ppol, &c.prefill_policy))) return rc;
    if (dpol && (rc = policy_flag("decode-policy", dpol, &c.decode_policy))) return rc;
    c.host = host;
    c.port = (int)port;
    c.pd = pd;
    for (int i = 0; i < prefill.n; i++)
        c.prefill[c.n_prefill++] = prefill.v[i];
    for (int i = 0; i < decode.n; i++)
        c.decode[c.n_decode++] = decode.v[i];
    for (int i = 0; i < worker.n; i++)
        c.worker[c.n_worker++] = worker.v[i];
    c.request_timeout_s = req_to;
    c.health_checks = !no_hc;
    c.health_interval_s = hc_iv;
    c.health_timeout_s = hc_to;
    c.health_failure_threshold = (int)hc_fail;
    c.health_success_threshold = (int)hc_ok;
    c.health_endpoint = hc_endpoint;
    c.circuit_breaker = !no_cb;
    c.cb_failure_threshold = (int)cb_fail;
    c.cb_success_threshold = (int)cb_ok;
    c.cb_timeout_s = cb_to;
    c.retry_max_retries = (int)retries;
    c.retry_initial_backoff_s = b0;
    c.retry_max_backoff_s = bmax;
    c.retry_backoff_multiplier = bmul;
    c.retry_jitter_factor = jit;
    c.max_concurrent_requests = (int)max_conc;
    c.queue_size = (int)queue;
    c.queue_timeout_s = q_to;
    c.api_key = api_key;
    c.dp_aware = dp_aware;
    c.rank_mapping = rank_map;
    c.backend = backend;
    c.worker_ttl_s = ttl;
    c.shutdown_timeout_s = drain;
    c.max_payload_bytes = (size_t)max_payload;
    c.seed = (uint64_t)seed;
    /* (checked before the int casts above mean anything: -4294967295 would read as 1) */
    if (hc_fail > 1000 || hc_ok > 1000 || cb_fail > 1000 || cb_ok > 1000 || max_conc > 1000000 ||
        queue > 1000000 || port > 65535 || port < 0 || retries > 100 || hc_fail < -1 ||
        hc_ok < -1 || cb_fail < -1 || cb_ok < -1 || max_conc < -1 || queue < -1 || retries < -1) {
        fprintf(stderr, "error: a count or port is out of range\n");
        return 2;
    }
    td_err err;
    if ((rc = rt_config_check(&c, &err))) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 2;
    }
    if ((rc = rt_run(&c, &err))) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    return 0;
}
