/*
 * router/router.c - the router's HTTP server: its own endpoints, the worker API, the
 * start-up and the shutdown (see router.h).
 */
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/rt_impl.h"
#include "server/server.h"

void rt_config_default(rt_config *c)
{
    memset(c, 0, sizeof(*c));
    c->host = "0.0.0.0";
    c->port = 8000;
    c->prefill_policy = c->decode_policy = c->worker_policy = RT_POLICY_ROUND_ROBIN;
    c->request_timeout_s = 1800;
    c->health_checks = true;
    c->health_interval_s = 10;
    c->health_timeout_s = 5;
    c->health_failure_threshold = 3;
    c->health_success_threshold = 2;
    c->health_endpoint = "/health";
    c->circuit_breaker = true;
    c->cb_failure_threshold = 5;
    c->cb_success_threshold = 2;
    c->cb_timeout_s = 30;
    c->retry_max_retries = 3;
    c->retry_initial_backoff_s = 0.05;
    c->retry_max_backoff_s = 2;
    c->retry_backoff_multiplier = 1.5;
    c->retry_jitter_factor = 0.2;
    c->queue_size = 100;
    c->queue_timeout_s = 60;
    c->rank_mapping = "none";
    c->backend = "atom";
    c->worker_ttl_s = 15;
    c->shutdown_timeout_s = 30;
    c->max_payload_bytes = 4u << 20;
}

int rt_config_check(const rt_config *c, td_err *err)
{
    if (c->pd && (c->n_worker > 0))
        return td_err_set(err, TD_EINVAL, "--worker is for aggregated mode; with "
                                          "--pd-disaggregation use --prefill and --decode");
    if (!c->pd && (c->n_prefill > 0 || c->n_decode > 0))
        return td_err_set(err, TD_EINVAL,
                          "--prefill and --decode need --pd-disaggregation (or use --worker)");
    if (c->port < 0 || c->port > 65535) return td_err_set(err, TD_EINVAL, "--port out of range");
    const char *const *lists[3] = {c->prefill, c->decode, c->worker};
    int counts[3] = {c->n_prefill, c->n_decode, c->n_worker};
    for (int l = 0; l < 3; l++)
        for (int i = 0; i < counts[l]; i++) {
            int rc = rt_url_check(lists[l][i], err);
            if (rc) return rc;
            for (int k = 0; k < i; k++)
                if (rt_url_same(lists[l][k], lists[l][i]))
                    return td_err_set(err, TD_EINVAL, "%s %s is given twice",
                                      l == 0   ? "--prefill"
                                      : l == 1 ? "--decode"
                                               : "--worker",
                                      lists[l][i]);
        }
    if (!(c->request_timeout_s > 0) || !(c->health_interval_s > 0) || !(c->health_timeout_s > 0) ||
        !(c->cb_timeout_s >= 0) || !(c->queue_timeout_s > 0) || !(c->worker_ttl_s > 0))
        return td_err_set(err, TD_EINVAL, "timeouts and intervals must be positive");
    /* A bound on every duration, so that none overflows the timers' integer seconds and
     * nanoseconds (1e7 s is 115 days: far past any request). */
    const double max_s = 1e7;
    if (c->request_timeout_s > max_s || c->health_interval_s > max_s ||
        c->health_timeout_s > max_s || c->cb_timeout_s > max_s || c->queue_timeout_s > max_s ||
        c->worker_ttl_s > max_s || c->retry_initial_backoff_s > max_s ||
        c->retry_max_backoff_s > max_s)
        return td_err_set(err, TD_EINVAL, "timeouts, intervals and backoffs must be at most 1e7 s");
    if (!(c->shutdown_timeout_s >= 0 && c->shutdown_timeout_s <= 86400))
        return td_err_set(err, TD_EINVAL, "--shutdown-timeout-secs must be in [0, 86400]");
    if (c->max_payload_bytes < 1024 || c->max_payload_bytes > (1u << 30))
        return td_err_set(err, TD_EINVAL, "--max-payload-size must be in [1K, 1G]");
    if (c->health_failure_threshold < 1 || c->health_success_threshold < 1 ||
        c->cb_failure_threshold < 1 || c->cb_success_threshold < 1)
        return td_err_set(err, TD_EINVAL, "thresholds must be at least 1");
    if (c->retry_max_retries < 0 || c->retry_max_retries > 100 ||
        !(c->retry_initial_backoff_s >= 0) || !(c->retry_max_backoff_s >= 0) ||
        !(c->retry_backoff_multiplier >= 1) || !(c->retry_jitter_factor >= 0) ||
        c->retry_jitter_factor > 1)
        return td_err_set(err, TD_EINVAL,
                          "retries: 0..100 retries, backoffs >= 0, multiplier >= 1, jitter 0..1");
    if (c->max_concurrent_requests < 0 || c->queue_size < 0)
        return td_err_set(err, TD_EINVAL, "--max-concurrent-requests and --queue-size must be >= 0");
    if (strcmp(c->rank_mapping, "none") && strcmp(c->rank_mapping, "idx2idx"))
        return td_err_set(err, TD_EINVAL, "--atom-pd-rank-mapping-policy must be none or idx2idx");
    if (strcmp(c->backend, "atom") && strcmp(c->backend, "tandem") && strcmp(c->backend, "vllm") &&
        strcmp(c->backend, "sglang"))
        return td_err_set(err, TD_EINVAL, "--backend must be atom, tandem, vllm or sglang");
    if (c->health_endpoint[0] != '/')
        return td_err_set(err, TD_EINVAL, "--health-check-endpoint must start with /");
    return 0;
}

/* ---------------------------------------------------------------- replies */

void rt_send_json(rt_router *r, struct evhttp_request *req, int status, const char *json)
{
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, json, strlen(json));
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "application/json");
    td_replies_track(&r->replies, req);
    evhttp_send_reply(req, status, td_http_reason(status), b);
    evbuffer_free(b);
}

void rt_send_error(rt_router *r, struct evhttp_request *req, int status, const char *type,
                   const char *msg)
{
    cJSON *root = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", type);
    cJSON_AddNullToObject(e, "param");
    cJSON_AddNumberToObject(e, "code", status);
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    rt_send_json(r, req, status, json ? json : "{}");
    free(json);
}

static void send_cjson(rt_router *r, struct evhttp_request *req, int status, cJSON *root)
{
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    rt_send_json(r, req, status, json ? json : "{}");
    free(json);
}

/* ---------------------------------------------------------------- endpoints */

static bool authorized(rt_router *r, struct evhttp_request *req)
{
    if (!r->cfg.api_key || !r->cfg.api_key[0]) return true;
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    if (h && !strncmp(h, "Bearer ", 7) && !strcmp(h + 7, r->cfg.api_key)) return true;
    cJSON *root = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(e, "message",
                            h ? "Incorrect API key provided" : "Missing API key: send "
                                                               "'Authorization: Bearer KEY'");
    cJSON_AddStringToObject(e, "type", "invalid_request_error");
    cJSON_AddNullToObject(e, "param");
    cJSON_AddStringToObject(e, "code", "invalid_api_key");
    send_cjson(r, req, 401, root);
    return false;
}

/* 200 while every role the mode needs has a worker that can take requests. */
static void handle_health(rt_router *r, struct evhttp_request *req)
{
    rt_worker *ws[4];
    cJSON *root = cJSON_CreateObject();
    const char *missing = NULL;
    if (r->cfg.pd) {
        if (!rt_eligible(r, RT_ROLE_PREFILL, ws, 1, NULL))
            missing = "no prefill instance can take requests";
        else if (!rt_eligible(r, RT_ROLE_DECODE, ws, 1, NULL))
            missing = "no decode instance can take requests";
    } else if (!rt_eligible(r, RT_ROLE_WORKER, ws, 1, NULL)) {
        missing = "no worker can take requests";
    }
    if (r->draining) missing = "the router is shutting down: it finishes what it has";
    cJSON_AddStringToObject(root, "status", r->draining ? "draining" : missing ? "error" : "ok");
    if (missing) cJSON_AddStringToObject(root, "reason", missing);
    send_cjson(r, req, missing ? 503 : 200, root);
}

/* The union of the workers' models; with `only`, that one model (NULL if none serves it). */
static cJSON *models_json(rt_router *r, const char *only)
{
    cJSON *data = cJSON_CreateArray();
    for (rt_worker *w = r->workers; w; w = w->next) {
        if (!w->model[0] || (only && strcmp(only, w->model))) continue;
        bool dup = false;
        const cJSON *it;
        cJSON_ArrayForEach(it, data)
        {
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
            if (cJSON_IsString(id) && !strcmp(id->valuestring, w->model)) dup = true;
        }
        if (dup) continue;
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "id", w->model);
        cJSON_AddStringToObject(m, "object", "model");
        cJSON_AddNumberToObject(m, "created", 0);
        cJSON_AddStringToObject(m, "owned_by", "tandem");
        cJSON_AddItemToArray(data, m);
    }
    return data;
}

static void handle_models(rt_router *r, struct evhttp_request *req)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON_AddItemToObject(root, "data", models_json(r, NULL));
    send_cjson(r, req, 200, root);
}

/* GET /v1/models/{id} (percent-decoded: served names may hold '/'). */
static void handle_model(rt_router *r, struct evhttp_request *req, const char *enc)
{
    char *id = evhttp_uridecode(enc, 0, NULL);
    cJSON *data = id ? models_json(r, id) : NULL;
    cJSON *m = data ? cJSON_DetachItemFromArray(data, 0) : NULL;
    cJSON_Delete(data);
    if (m) {
        send_cjson(r, req, 200, m);
    } else {
        char msg[300];
        snprintf(msg, sizeof(msg), "The model '%.200s' does not exist", id ? id : enc);
        rt_send_error(r, req, 404, "invalid_request_error", msg);
    }
    free(id);
}

static void handle_metrics(rt_router *r, struct evhttp_request *req)
{
    struct evbuffer *b = evbuffer_new();
    evbuffer_add_printf(b,
                        "# HELP tandem_router_requests_total Client requests received.\n"
                        "# TYPE tandem_router_requests_total counter\n"
                        "tandem_router_requests_total %llu\n"
                        "# HELP tandem_router_responses_total Client responses by status class.\n"
                        "# TYPE tandem_router_responses_total counter\n",
                        (unsigned long long)r->requests_total);
    for (int c = 2; c <= 5; c++)
        evbuffer_add_printf(b, "tandem_router_responses_total{class=\"%dxx\"} %llu\n", c,
                            (unsigned long long)r->responses_by_class[c]);
    evbuffer_add_printf(
        b,
        "# HELP tandem_router_retries_total Legs retried on another worker.\n"
        "# TYPE tandem_router_retries_total counter\ntandem_router_retries_total %llu\n"
        "# HELP tandem_router_breaker_transitions_total Circuit breaker state changes.\n"
        "# TYPE tandem_router_breaker_transitions_total counter\n"
        "tandem_router_breaker_transitions_total %llu\n"
        "# HELP tandem_router_timeouts_total Requests answered 504.\n"
        "# TYPE tandem_router_timeouts_total counter\ntandem_router_timeouts_total %llu\n"
        "# HELP tandem_router_bad_gateway_total Requests no worker could take (502/503).\n"
        "# TYPE tandem_router_bad_gateway_total counter\ntandem_router_bad_gateway_total %llu\n"
        "# HELP tandem_router_rejected_total Requests refused with 429 (queue full).\n"
        "# TYPE tandem_router_rejected_total counter\ntandem_router_rejected_total %llu\n"
        "# HELP tandem_router_queue_timeouts_total Requests answered 408 (waited too long).\n"
        "# TYPE tandem_router_queue_timeouts_total counter\n"
        "tandem_router_queue_timeouts_total %llu\n"
        "# HELP tandem_router_client_disconnects_total Clients that hung up before the end.\n"
        "# TYPE tandem_router_client_disconnects_total counter\n"
        "tandem_router_client_disconnects_total %llu\n"
        "# HELP tandem_router_requests_running Requests being relayed.\n"
        "# TYPE tandem_router_requests_running gauge\ntandem_router_requests_running %d\n"
        "# HELP tandem_router_queue_depth Requests waiting for a slot.\n"
        "# TYPE tandem_router_queue_depth gauge\ntandem_router_queue_depth %d\n"
        "# HELP tandem_router_worker_evictions_total Registered workers evicted (no heartbeat).\n"
        "# TYPE tandem_router_worker_evictions_total counter\n"
        "tandem_router_worker_evictions_total %llu\n"
        "# HELP tandem_router_kv_releases_total Prefill KV given back at once because no decode read it.\n"
        "# TYPE tandem_router_kv_releases_total counter\ntandem_router_kv_releases_total %llu\n",
        (unsigned long long)r->retries, (unsigned long long)r->breaker_transitions,
        (unsigned long long)r->timeouts_504, (unsigned long long)r->bad_gateway_502,
        (unsigned long long)r->rejected_429, (unsigned long long)r->timed_out_408,
        (unsigned long long)r->client_disconnects, r->active, r->queued,
        (unsigned long long)r->evictions, (unsigned long long)r->kv_releases);
    rt_workers_metrics(r, b);
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "text/plain; version=0.0.4");
    td_replies_track(&r->replies, req);
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}

static int role_parse(const char *s, rt_role *out)
{
    if (!strcmp(s, "prefill")) *out = RT_ROLE_PREFILL;
    else if (!strcmp(s, "decode")) *out = RT_ROLE_DECODE;
    else if (!strcmp(s, "worker")) *out = RT_ROLE_WORKER;
    else return TD_EINVAL;
    return 0;
}

/*
 * POST /workers {"url", "role", "engine_id"?, "heartbeat"?}: add a worker, or, for one
 * that is known, record a heartbeat. An engine that registers itself (its kv-transfer
 * config names this router) sends this every few seconds with heartbeat true; a new
 * engine id at a known URL is a restart: its stale state (breaker, health, KV identity)
 * is dropped at once.
 */
static void handle_workers_post(rt_router *r, struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t n = evbuffer_get_length(in);
    char *s = malloc(n + 1);
    if (!s) return rt_send_error(r, req, 500, "server_error", "out of memory");
    evbuffer_copyout(in, s, n);
    s[n] = 0;
    cJSON *j = cJSON_Parse(s);
    free(s);
    const cJSON *url = cJSON_GetObjectItemCaseSensitive(j, "url");
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(j, "role");
    const cJSON *eid = cJSON_GetObjectItemCaseSensitive(j, "engine_id");
    const cJSON *inst = cJSON_GetObjectItemCaseSensitive(j, "instance_id");
    bool beat = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "heartbeat"));
    rt_role ro = r->cfg.pd ? RT_ROLE_DECODE : RT_ROLE_WORKER;
    if (!cJSON_IsString(url) ||
        (role && (!cJSON_IsString(role) || role_parse(role->valuestring, &ro)))) {
        cJSON_Delete(j);
        return rt_send_error(r, req, 400, "invalid_request_error",
                             "POST /workers takes {\"url\": \"http://host:port\", \"role\": "
                             "\"prefill\" | \"decode\" | \"worker\"}");
    }
    if (r->cfg.pd && ro == RT_ROLE_WORKER) {
        cJSON_Delete(j);
        return rt_send_error(r, req, 400, "invalid_request_error",
                             "this router runs --pd-disaggregation: role must be prefill or "
                             "decode");
    }
    if (!r->cfg.pd) ro = RT_ROLE_WORKER; /* any engine serves plain requests */
    rt_worker *w = rt_worker_find_url(r, url->valuestring);
    if (w && w->role != ro) { /* the same engine in another role now: start afresh */
        rt_worker_remove(r, w);
        w = NULL;
    }
    int status = 200;
    int n_workers = 0;
    for (rt_worker *x = r->workers; x; x = x->next)
        n_workers++;
    if (!w && n_workers >= RT_MAX_WORKERS) {
        cJSON_Delete(j);
        return rt_send_error(r, req, 503, "service_unavailable",
                             "the router has as many workers as it takes (256)");
    }
    if (!w) {
        td_err err;
        if (rt_worker_add(r, url->valuestring, ro, beat, &w, &err)) {
            cJSON_Delete(j);
            return rt_send_error(r, req, 400, "invalid_request_error", err.msg);
        }
        r->registrations++;
        status = 201;
        TD_INFO("router: %s %s registered%s", rt_role_name(ro), w->url,
                beat ? " (heartbeats)" : "");
        rt_worker_probe(r, w);
    } else {
        if (beat) w->dynamic = true;
        /* Restarted (a new engine id, or a new instance: a consumer has no engine id):
         * forget what we knew of the old incarnation, its open breaker included. */
        bool new_engine = cJSON_IsString(eid) && eid->valuestring[0] && w->engine_id[0] &&
                          strcmp(eid->valuestring, w->engine_id);
        bool new_instance = cJSON_IsString(inst) &&
                            strlen(inst->valuestring) < sizeof(w->instance) && w->instance[0] &&
                            strcmp(inst->valuestring, w->instance);
        if (new_engine || new_instance) {
            TD_INFO("router: %s %s restarted (%s %s, was %s)", rt_role_name(ro), w->url,
                    new_engine ? "engine" : "instance",
                    new_engine ? eid->valuestring : inst->valuestring,
                    new_engine ? w->engine_id : w->instance);
            rt_worker_reincarnated(r, w);
        }
        if (cJSON_IsString(inst) && strlen(inst->valuestring) < sizeof(w->instance))
            snprintf(w->instance, sizeof(w->instance), "%s", inst->valuestring);
    }
    /* every data-parallel rank of this engine beats with it */
    for (rt_worker *x = r->workers; x; x = x->next)
        if (!strcmp(x->url, w->url)) x->last_seen_ns = td_now_ns();
    cJSON *out = cJSON_CreateObject();
    cJSON_AddNumberToObject(out, "id", (double)w->id);
    cJSON_AddStringToObject(out, "url", w->url);
    cJSON_AddStringToObject(out, "role", rt_role_name(w->role));
    cJSON_Delete(j);
    send_cjson(r, req, status, out);
}

static void handle_workers(rt_router *r, struct evhttp_request *req, const char *path)
{
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    if (!strcmp(path, "/workers")) {
        if (m == EVHTTP_REQ_GET) {
            cJSON *root = cJSON_CreateObject();
            cJSON_AddItemToObject(root, "workers", rt_workers_json(r));
            return send_cjson(r, req, 200, root);
        }
        if (m == EVHTTP_REQ_POST) return handle_workers_post(r, req);
        return rt_send_error(r, req, 405, "invalid_request_error", "/workers takes GET or POST");
    }
    /* /workers/{id} */
    int64_t id;
    if (td_parse_i64(path + strlen("/workers/"), &id) || id < 1)
        return rt_send_error(r, req, 404, "not_found_error", "no such worker");
    rt_worker *w = rt_worker_find_id(r, (uint64_t)id);
    if (!w) return rt_send_error(r, req, 404, "not_found_error", "no such worker");
    if (m != EVHTTP_REQ_DELETE)
        return rt_send_error(r, req, 405, "invalid_request_error", "/workers/{id} takes DELETE");
    TD_INFO("router: %s %s removed", rt_role_name(w->role), w->url);
    rt_worker_remove(r, w);
    rt_send_json(r, req, 200, "{\"deleted\":true}");
}

static void on_request(struct evhttp_request *req, void *arg)
{
    rt_router *r = arg;
    const char *uri = evhttp_request_get_uri(req);
    char path[256];
    size_t k = 0;
    while (uri[k] && uri[k] != '?' && k < sizeof(path) - 1) {
        path[k] = uri[k];
        k++;
    }
    path[k] = 0;
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    if (m == EVHTTP_REQ_HEAD) m = EVHTTP_REQ_GET; /* evhttp sends a HEAD's headers only */
    if (!strcmp(path, "/health")) {
        if (m != EVHTTP_REQ_GET)
            return rt_send_error(r, req, 405, "invalid_request_error", "GET only");
        return handle_health(r, req);
    }
    if (!strcmp(path, "/metrics")) {
        if (m != EVHTTP_REQ_GET)
            return rt_send_error(r, req, 405, "invalid_request_error", "GET only");
        return handle_metrics(r, req);
    }
    bool completion = !strcmp(path, "/v1/completions") || !strcmp(path, "/v1/chat/completions");
    if (!authorized(r, req)) {
        /* the request and response counters count completion requests, refused ones too */
        if (completion) {
            r->requests_total++;
            rt_count_status(r, 401);
        }
        return;
    }
    if (completion) {
        if (m != EVHTTP_REQ_POST)
            return rt_send_error(r, req, 405, "invalid_request_error", "POST only");
        if (r->draining) {
            r->requests_total++;
            rt_count_status(r, 503);
            return rt_send_error(r, req, 503, "service_unavailable",
                                 "the router is shutting down: it takes no new requests");
        }
        return rt_relay_start(r, req, !strcmp(path, "/v1/chat/completions") ? SRV_EP_CHAT
                                                                              : SRV_EP_COMPLETIONS);
    }
    if (!strcmp(path, "/v1/models")) {
        if (m != EVHTTP_REQ_GET)
            return rt_send_error(r, req, 405, "invalid_request_error", "GET only");
        return handle_models(r, req);
    }
    if (!strncmp(path, "/v1/models/", 11) && path[11]) {
        if (m != EVHTTP_REQ_GET)
            return rt_send_error(r, req, 405, "invalid_request_error", "GET only");
        return handle_model(r, req, path + 11);
    }
    if (!strcmp(path, "/workers") || !strncmp(path, "/workers/", 9))
        return handle_workers(r, req, path);
    char msg[300];
    snprintf(msg, sizeof(msg), "no route for '%.200s'", path);
    rt_send_error(r, req, 404, "not_found_error", msg);
}

/* ---------------------------------------------------------------- run */

/*
 * Graceful shutdown, as the engines do it: the first SIGTERM or SIGINT starts a drain (new
 * requests get 503, /health says "draining") until no request is left or
 * --shutdown-timeout-secs passes; what is left then ends with a 503 or an error event
 * (rt_relay_shutdown). A second signal exits at once.
 */
static void on_drain_tick(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    rt_router *r = arg;
    if (!r->reqs) {
        TD_INFO("router: drained: shutting down");
        event_base_loopexit(r->base, NULL);
    } else if (td_now_ns() >= r->drain_deadline_ns) {
        TD_WARN("router: --shutdown-timeout-secs passed with requests in flight: ending them");
        event_base_loopexit(r->base, NULL);
    }
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    (void)what;
    rt_router *r = arg;
    if (r->draining || r->cfg.shutdown_timeout_s <= 0 || !r->reqs) {
        TD_INFO("router: signal %d: shutting down", (int)sig);
        r->exit_now = r->draining;
        event_base_loopexit(r->base, NULL);
        return;
    }
    int n = rt_relay_count(r);
    r->draining = true;
    r->drain_deadline_ns = td_now_ns() + (uint64_t)(r->cfg.shutdown_timeout_s * 1e9);
    TD_WARN("router: signal %d: draining: %d request(s) in flight; new requests get 503; "
            "exiting when they are done or in %.0f s (--shutdown-timeout-secs); signal again to "
            "exit now",
            (int)sig, n, r->cfg.shutdown_timeout_s);
    r->drain_ev = event_new(r->base, -1, EV_PERSIST, on_drain_tick, r);
    struct timeval tv = {0, 50000};
    if (!r->drain_ev || event_add(r->drain_ev, &tv)) event_base_loopexit(r->base, NULL);
}

int rt_run(const rt_config *cfg, td_err *err)
{
    int rc = rt_config_check(cfg, err);
    if (rc) return rc;
    signal(SIGPIPE, SIG_IGN);
    rt_router *r = calloc(1, sizeof(*r));
    if (!r) return td_err_set(err, TD_ENOMEM, "out of memory");
    r->cfg = *cfg;
    td_rng_seed(&r->rng, cfg->seed ? cfg->seed : td_now_ns());
    r->base = event_base_new();
    r->http = r->base ? evhttp_new(r->base) : NULL;
    if (!r->http) {
        rc = td_err_set(err, TD_ENOMEM, "cannot create the event loop");
        goto out;
    }
    rt_policy_kind kinds[RT_N_ROLES] = {cfg->worker_policy, cfg->prefill_policy, cfg->decode_policy};
    for (int i = 0; i < RT_N_ROLES; i++) {
        rt_policy_opts po;
        rt_policy_opts_default(&po, kinds[i]);
        po.seed = td_rng_next(&r->rng);
        if ((rc = rt_policy_create(&r->policy[i], &po))) {
            td_err_set(err, rc, "cannot create the %s policy", rt_role_name((rt_role)i));
            goto out;
        }
    }
    for (int i = 0; i < cfg->n_prefill && !rc; i++)
        rc = rt_worker_add(r, cfg->prefill[i], RT_ROLE_PREFILL, false, NULL, err);
    for (int i = 0; i < cfg->n_decode && !rc; i++)
        rc = rt_worker_add(r, cfg->decode[i], RT_ROLE_DECODE, false, NULL, err);
    for (int i = 0; i < cfg->n_worker && !rc; i++)
        rc = rt_worker_add(r, cfg->worker[i], RT_ROLE_WORKER, false, NULL, err);
    if (rc) goto out;
    evhttp_set_gencb(r->http, on_request, r);
    /* Bodies up to 4x the limit are read and refused with a JSON 413 (relay.c); beyond
     * that evhttp stops reading and answers 413 itself, so memory stays bounded. */
    evhttp_set_max_body_size(r->http,
                             (ev_ssize_t)TD_MIN(r->cfg.max_payload_bytes * 4, (size_t)1 << 30));
    evhttp_set_max_headers_size(r->http, 64 * 1024); /* as the engines: a 400 past that */
    /* Every method reaches on_request, which answers what it does not take with a JSON 405
     * (as the engines do) rather than libevent's HTML 501. */
    evhttp_set_allowed_methods(r->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_HEAD | EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PUT |
                                            EVHTTP_REQ_PATCH);
    evhttp_set_timeout(r->http, (int)(cfg->request_timeout_s + 60));
    r->sock = evhttp_bind_socket_with_handle(r->http, cfg->host, (uint16_t)cfg->port);
    if (!r->sock) {
        rc = td_err_set(err, TD_EIO, "cannot listen on %s:%d (in use?)", cfg->host, cfg->port);
        goto out;
    }
    r->accept_guard = td_accept_guard_new(r->base, r->sock, "router");
    evutil_socket_t fd = evhttp_bound_socket_get_fd(r->sock);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    int port = cfg->port;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
        port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                              : ((struct sockaddr_in *)&ss)->sin_port);
    r->sig_int = evsignal_new(r->base, SIGINT, on_signal, r);
    r->sig_term = evsignal_new(r->base, SIGTERM, on_signal, r);
    event_add(r->sig_int, NULL);
    event_add(r->sig_term, NULL);
    if (cfg->pd ? (cfg->n_prefill == 0 || cfg->n_decode == 0) : cfg->n_worker == 0)
        TD_WARN("router: no %s given; waiting for workers to register (POST /workers)",
                cfg->pd ? "prefill or decode instance" : "worker");
    rt_health_start(r);
    TD_INFO("router: %s mode, %d prefill, %d decode, %d worker(s); policies %s/%s/%s",
            cfg->pd ? "PD" : "aggregated", cfg->n_prefill, cfg->n_decode, cfg->n_worker,
            rt_policy_name(cfg->prefill_policy), rt_policy_name(cfg->decode_policy),
            rt_policy_name(cfg->worker_policy));
    fprintf(stderr, "listening on %s:%d\n", cfg->host, port);
    fflush(stderr);
    event_base_dispatch(r->base);
    rt_relay_shutdown(r);
    if (!r->exit_now) { /* refuse new connections; send the answers given (util/reply_flush.h) */
        td_accept_guard_free(r->accept_guard);
        r->accept_guard = NULL;
        evhttp_del_accept_socket(r->http, r->sock);
        int left = td_replies_flush(r->base, &r->replies, 2000);
        if (left)
            TD_WARN("router: exiting with %d repl%s not written out (a client not reading?)", left,
                    left == 1 ? "y" : "ies");
    }
out:
    if (r->drain_ev) event_free(r->drain_ev);
    if (r->health_timer) event_free(r->health_timer);
    if (r->discovery_timer) event_free(r->discovery_timer);
    if (r->sig_int) event_free(r->sig_int);
    if (r->sig_term) event_free(r->sig_term);
    td_accept_guard_free(r->accept_guard);
    if (r->http) evhttp_free(r->http);
    rt_workers_free(r);
    for (int i = 0; i < RT_N_ROLES; i++)
        rt_policy_free(r->policy[i]);
    if (r->base) event_base_free(r->base);
    free(r);
    return rc;
}
