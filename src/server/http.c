/*
 * server/http.c - the I/O thread: evhttp setup, routing, the informational
 * endpoints (/health, /metrics, /v1/models, /server_info, /kv_transfer_info),
 * errors in OpenAI's shape, and the wakeup that brings the engine's outputs in.
 * Generation requests live in completion.c.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include "model/gguf.h"
#include "model/model.h"
#include "model/tok.h"
#include "server/server_impl.h"
#include "util/pool.h"

void srv_config_default(srv_config *c)
{
    memset(c, 0, sizeof(*c));
    c->host = "0.0.0.0";
    c->port = 8000;
    c->max_queue = 1024;
    c->max_body_size = 4u << 20;
    c->health_stall_s = 60.0;
    c->shutdown_timeout_s = 30.0;
    c->tp_size = 1;
    c->dp_size = 1;
    c->block_size = 16;
    c->kv_cache_dtype = "f16";
}

int srv_server_port(const srv_server *s)
{
    return s->port;
}

size_t srv__utf8_char(const char *s, size_t n)
{
    unsigned char c = (unsigned char)s[0];
    if (c < 0x80) return 1;
    size_t clen = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
    return clen <= n && tok_utf8_valid_prefix(s, clen) >= clen ? clen : 0;
}

void srv__json_str(struct evbuffer *b, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    char tmp[512];
    size_t w = 0;
    tmp[w++] = '"';
    for (size_t i = 0; i < len;) {
        if (w > sizeof(tmp) - 16) {
            evbuffer_add(b, tmp, w);
            w = 0;
        }
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x80) {
            size_t clen = srv__utf8_char(s + i, len - i);
            if (clen) {
                memcpy(tmp + w, s + i, clen);
                w += clen;
                i += clen;
            } else {
                memcpy(tmp + w, "\xEF\xBF\xBD", 3);
                w += 3;
                i++;
            }
            continue;
        }
        i++;
        switch (c) {
        case '"':
            tmp[w++] = '\\';
            tmp[w++] = '"';
            break;
        case '\\':
            tmp[w++] = '\\';
            tmp[w++] = '\\';
            break;
        case '\n':
            tmp[w++] = '\\';
            tmp[w++] = 'n';
            break;
        case '\r':
            tmp[w++] = '\\';
            tmp[w++] = 'r';
            break;
        case '\t':
            tmp[w++] = '\\';
            tmp[w++] = 't';
            break;
        default:
            if (c < 0x20 || c == 0x7f) {
                memcpy(tmp + w, "\\u00", 4);
                w += 4;
                tmp[w++] = hex[c >> 4];
                tmp[w++] = hex[c & 15];
            } else {
                tmp[w++] = (char)c;
            }
        }
    }
    tmp[w++] = '"';
    evbuffer_add(b, tmp, w);
}

static void count_status(srv_server *s, int status)
{
    int cls = status / 100;
    if (cls >= 1 && cls <= 5) s->metrics.http_requests[cls]++;
}

void srv__send_json(srv_server *s, struct evhttp_request *req, int status, const char *json)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "application/json");
    struct evbuffer *b = evbuffer_new();
    evbuffer_add(b, json, strlen(json));
    evbuffer_add(b, "\n", 1);
    count_status(s, status);
    td_replies_track(&s->replies, req);
    evhttp_send_reply(req, status, td_http_reason(status), b);
    evbuffer_free(b);
}

void srv__send_error(srv_server *s, struct evhttp_request *req, const srv_error *e)
{
    cJSON *root = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(err, "message", e->message);
    cJSON_AddStringToObject(err, "type", e->type ? e->type : "invalid_request_error");
    if (e->param[0])
        cJSON_AddStringToObject(err, "param", e->param);
    else
        cJSON_AddNullToObject(err, "param");
    cJSON_AddNumberToObject(err, "code", e->status);
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (e->status == 405) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "Allow",
                          strstr(e->message, "GET") ? "GET" : "POST");
    }
    srv__send_json(s, req, e->status, json ? json : "{}");
    free(json);
}

static void send_cjson(srv_server *s, struct evhttp_request *req, int status, cJSON *root)
{
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    srv__send_json(s, req, status, json ? json : "{}");
    free(json);
}

/* ---- informational endpoints ---- */

/* "" for rank 0 of one, else "rank N: " (the prefix of a rank's health message) */
static const char *rank_prefix(const srv_server *s, int r, char *buf, size_t cap)
{
    if (s->n_ranks == 1) return "";
    snprintf(buf, cap, "data-parallel rank %d: ", r);
    return buf;
}

/* 200 while every rank's engine loop is alive and making progress. */
static void handle_health(srv_server *s, struct evhttp_request *req)
{
    char reason[160], pre[48], msg[320] = "";
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "instance_id", s->instance_id);
    /* Each rank's state ("ok", "stopped", "stalled"), so that a router that sends requests
     * to ranks (--dp-aware) keeps using those that still serve. */
    cJSON *states = s->n_ranks > 1 ? cJSON_CreateArray() : NULL;
    for (int r = 0; r < s->n_ranks; r++) {
        const srv__rank *k = &s->ranks[r];
        const char *state = "ok";
        char m[320] = "";
        if (srv__engine_stopped(&s->ranks[r].eng, reason, sizeof(reason))) {
            snprintf(m, sizeof(m), "%sthe engine loop has stopped: %s",
                     rank_prefix(s, r, pre, sizeof(pre)), reason);
            state = "stopped";
        } else if (k->outstanding > 0 &&
                   (double)(td_now_ns() - atomic_load(&k->eng.last_progress_ns)) / 1e9 >
                       s->cfg.health_stall_s) {
            snprintf(m, sizeof(m),
                     "%sthe engine loop is stalled: no step for %.1f s with %d requests in flight",
                     rank_prefix(s, r, pre, sizeof(pre)),
                     (double)(td_now_ns() - atomic_load(&k->eng.last_progress_ns)) / 1e9,
                     k->outstanding);
            state = "stalled";
        }
        if (m[0] && !msg[0]) snprintf(msg, sizeof(msg), "%s", m); /* the first one */
        if (states) cJSON_AddItemToArray(states, cJSON_CreateString(state));
    }
    if (states) cJSON_AddItemToObject(root, "rank_status", states);
    if (msg[0]) {
        cJSON_AddStringToObject(root, "status", "error");
        cJSON_AddStringToObject(root, "reason", msg);
        send_cjson(s, req, 503, root);
        return;
    }
    if (s->draining) {
        cJSON_AddStringToObject(root, "status", "draining");
        cJSON_AddStringToObject(root, "reason",
                                "the server is shutting down: it finishes what it has and takes "
                                "no new requests");
        send_cjson(s, req, 503, root);
        return;
    }
    cJSON_AddStringToObject(root, "status", "ok");
    cJSON_AddNumberToObject(root, "load", s->outstanding); /* for routers' load balancing */
    if (s->n_ranks > 1) {
        cJSON *loads = cJSON_AddArrayToObject(root, "rank_loads");
        for (int r = 0; r < s->n_ranks; r++) cJSON_AddItemToArray(loads, cJSON_CreateNumber(s->ranks[r].outstanding));
    }
    send_cjson(s, req, 200, root);
}

void srv__snapshot_sum(const srv_server *s, srv__snapshot *out)
{
    memset(out, 0, sizeof(*out));
    for (int r = 0; r < s->n_ranks; r++) {
        const srv__snapshot *a = &s->ranks[r].snap;
        td_engine_stats *o = &out->stats;
        const td_engine_stats *i = &a->stats;
        out->num_running += a->num_running;
        out->num_waiting += a->num_waiting;
        o->num_blocks_total += i->num_blocks_total;
        o->num_blocks_free += i->num_blocks_free;
        o->num_blocks_cached += i->num_blocks_cached;
        o->prefix_hits_tokens += i->prefix_hits_tokens;
        o->prefix_queries_tokens += i->prefix_queries_tokens;
        o->num_preemptions += i->num_preemptions;
        o->steps += i->steps;
        o->tokens_prefilled += i->tokens_prefilled;
        o->tokens_decoded += i->tokens_decoded;
        o->num_loading += i->num_loading;
        o->num_held += i->num_held;
        o->num_blocks_held += i->num_blocks_held;
        o->kv_loads += i->kv_loads;
        o->kv_load_failures += i->kv_load_failures;
        o->kv_tokens_loaded += i->kv_tokens_loaded;
        o->kv_tokens_skipped += i->kv_tokens_skipped;
        o->moe_expert_runs += i->moe_expert_runs;
        o->ep_exchange_bytes += i->ep_exchange_bytes;
        o->cpu_borrowed_runs += i->cpu_borrowed_runs;
        o->cpu_reclaims += i->cpu_reclaims;
        o->cpu_reclaim_ns += i->cpu_reclaim_ns;
        o->steps_prefill += i->steps_prefill;
        o->step_ns_prefill += i->step_ns_prefill;
        o->step_ns_decode += i->step_ns_decode;
        for (int b = 0; b <= TD_STEP_TOKEN_BUCKETS; b++)
            o->step_tokens_hist[b] += i->step_tokens_hist[b];
        for (int b = 0; b <= TD_STEP_TIME_BUCKETS; b++)
            o->step_time_hist[b] += i->step_time_hist[b];
    }
}

/* Prometheus text with dp_rank="r" added to every sample; HELP and TYPE lines only when
 * `comments` (the first rank's), so that each family is declared once. */
static void add_rank_label(struct evbuffer *b, const char *text, int rank, bool comments)
{
    for (const char *p = text; *p;) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        if (p[0] == '#') {
            if (comments) evbuffer_add_printf(b, "%.*s\n", (int)n, p);
        } else if (n > 0) {
            size_t name = strcspn(p, "{ ");
            if (name > n) name = n;
            if (p[name] == '{')
                evbuffer_add_printf(b, "%.*s{dp_rank=\"%d\",%.*s\n", (int)name, p, rank, (int)(n - name - 1),
                                    p + name + 1);
            else
                evbuffer_add_printf(b, "%.*s{dp_rank=\"%d\"}%.*s\n", (int)name, p, rank, (int)(n - name),
                                    p + name);
        }
        p += n + (nl ? 1 : 0);
    }
}

static void handle_metrics(srv_server *s, struct evhttp_request *req)
{
    srv__snapshot snap;
    srv__snapshot_sum(s, &snap);
    char model[512]; /* a served name may hold anything a label value must escape */
    td_prom_escape(s->model_name, model, sizeof(model));
    char *text = srv__metrics_render(&s->metrics, &snap, model);
    struct evbuffer *b = evbuffer_new();
    if (text) evbuffer_add(b, text, strlen(text));
    free(text);
    for (int r = 0; r < s->n_ranks; r++) { /* the transfers: per rank */
        if (!s->ranks[r].pd) continue;
        text = pd_metrics_render(s->ranks[r].pd);
        if (text && s->n_ranks == 1) evbuffer_add(b, text, strlen(text));
        else if (text) add_rank_label(b, text, r, r == 0);
        free(text);
    }
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "text/plain; version=0.0.4");
    count_status(s, 200);
    td_replies_track(&s->replies, req);
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}

static cJSON *model_json(const srv_server *s)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", s->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->started_at);
    cJSON_AddStringToObject(m, "owned_by", "tandem");
    cJSON_AddStringToObject(m, "root", s->model_path);
    cJSON_AddNumberToObject(m, "max_model_len", s->max_model_len);
    return m;
}

static void handle_models(srv_server *s, struct evhttp_request *req)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(root, "data"), model_json(s));
    send_cjson(s, req, 200, root);
}

/* GET /v1/models/{id} (the id percent-decoded: served names may hold '/'). */
static void handle_model(srv_server *s, struct evhttp_request *req, const char *enc)
{
    char *id = evhttp_uridecode(enc, 0, NULL);
    if (id && !strcmp(id, s->model_name)) {
        send_cjson(s, req, 200, model_json(s));
    } else {
        srv_error e;
        srv_error_set(&e, 404, "invalid_request_error", "model",
                      "The model '%.200s' does not exist (this server serves '%.200s')",
                      id ? id : enc, s->model_name);
        srv__send_error(s, req, &e);
    }
    free(id);
}

static cJSON *discovery(srv_server *s)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", s->model_name);
    cJSON_AddStringToObject(root, "model_path", s->model_path);
    char fp[32];
    snprintf(fp, sizeof(fp), "%016llx", (unsigned long long)s->model_fingerprint);
    cJSON_AddStringToObject(root, "model_fingerprint", fp);
    cJSON_AddStringToObject(root, "instance_id", s->instance_id);
    cJSON_AddNumberToObject(root, "block_size", s->cfg.block_size);
    cJSON_AddStringToObject(root, "kv_dtype", s->kv_dtype);
    cJSON_AddNumberToObject(root, "tp_size", s->cfg.tp_size);
    cJSON_AddNumberToObject(root, "dp_size", s->cfg.dp_size);
    cJSON_AddNumberToObject(root, "max_model_len", s->max_model_len);
    const srv_kv_config *kv = s->cfg.kv;
    cJSON_AddStringToObject(root, "kv_role", kv ? srv_kv_role_name(kv->role) : "none");
    /* how a router should dispatch: read = prefill first, then decode with its answer;
     * write = both at once with one transfer_id it draws (docs/ARCHITECTURE.md) */
    if (kv) cJSON_AddStringToObject(root, "transfer_mode", kv->write_mode ? "write" : "read");
    pd_connector *pd = s->ranks[0].pd;
    if (pd && s->kv_producer) {
        cJSON_AddNumberToObject(root, "handshake_port", pd_port(pd));
        cJSON_AddStringToObject(root, "kv_host", pd_host(pd));
        cJSON_AddStringToObject(root, "engine_id", pd_engine_id(pd));
    } else {
        cJSON_AddNullToObject(root, "handshake_port");
    }
    if (pd && s->kv_producer && s->n_ranks > 1) { /* each rank's agent (rank 0's above) */
        cJSON *a = cJSON_AddArrayToObject(root, "dp_ranks");
        for (int r = 0; r < s->n_ranks; r++) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "rank", r);
            cJSON_AddNumberToObject(o, "handshake_port", pd_port(s->ranks[r].pd));
            cJSON_AddStringToObject(o, "kv_host", pd_host(s->ranks[r].pd));
            cJSON_AddStringToObject(o, "engine_id", pd_engine_id(s->ranks[r].pd));
            cJSON_AddItemToArray(a, o);
        }
    }
    return root;
}

static void handle_server_info(srv_server *s, struct evhttp_request *req)
{
    cJSON *root = discovery(s);
    cJSON_AddStringToObject(root, "version", "tandem 0.1");
    cJSON_AddStringToObject(root, "chat_template", srv_chat_family_name(s->chat));
    cJSON_AddNumberToObject(root, "max_num_seqs", s->max_num_seqs);
    srv__snapshot snap;
    srv__snapshot_sum(s, &snap);
    cJSON_AddNumberToObject(root, "kv_blocks_total", snap.stats.num_blocks_total);
    const srv_kv_config *kv = s->cfg.kv;
    if (kv) {
        cJSON *k = cJSON_AddObjectToObject(root, "kv_transfer_config");
        cJSON_AddStringToObject(k, "kv_role", srv_kv_role_name(kv->role));
        if (kv->connector[0]) cJSON_AddStringToObject(k, "kv_connector", kv->connector);
        if (kv->ip[0]) cJSON_AddStringToObject(k, "kv_ip", kv->ip);
        if (kv->port > 0) cJSON_AddNumberToObject(k, "kv_port", kv->port);
        cJSON_AddNumberToObject(k, "kv_rank", kv->rank);
        cJSON_AddNumberToObject(k, "kv_parallel_size", kv->parallel_size);
    }
    send_cjson(s, req, 200, root);
}

/*
 * POST /kv_release {"transfer_id"}: a producer gives back the blocks it holds for a
 * transfer that no consumer will read (a router whose decode leg failed for good). The
 * transfer id, a random 128-bit name only the request's router learnt, is the capability.
 */
static void handle_kv_release(srv_server *s, struct evhttp_request *req)
{
    srv_error e;
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t n = evbuffer_get_length(in);
    cJSON *j = n && n < 4096 ? cJSON_ParseWithLength((const char *)evbuffer_pullup(in, -1), n) : NULL;
    const cJSON *tid = cJSON_GetObjectItemCaseSensitive(j, "transfer_id");
    if (!cJSON_IsString(tid)) {
        cJSON_Delete(j);
        srv_error_set(&e, 400, "invalid_request_error", "transfer_id",
                      "POST /kv_release takes {\"transfer_id\": \"...\"}");
        srv__send_error(s, req, &e);
        return;
    }
    bool released = false;
    for (int r = 0; r < s->n_ranks && !released; r++) /* ids are unique across ranks */
        released = s->ranks[r].pd && pd_cancel(s->ranks[r].pd, tid->valuestring) == 0;
    if (!released) {
        srv_error_set(&e, 404, "not_found_error", "transfer_id", "no KV is held here for transfer %.64s",
                      tid->valuestring);
        cJSON_Delete(j);
        srv__send_error(s, req, &e);
        return;
    }
    TD_INFO("kv: transfer %.64s released by POST /kv_release", tid->valuestring);
    cJSON_Delete(j);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddBoolToObject(root, "released", true);
    send_cjson(s, req, 200, root);
}

/* ---- routing ---- */

static void not_found(srv_server *s, struct evhttp_request *req, const char *path)
{
    srv_error e;
    srv_error_set(&e, 404, "not_found_error", NULL, "no route for '%.200s'", path);
    srv__send_error(s, req, &e);
}

static void wrong_method(srv_server *s, struct evhttp_request *req, const char *path, bool want_get)
{
    srv_error e;
    srv_error_set(&e, 405, "invalid_request_error", NULL, "%.200s only accepts %s", path,
                  want_get ? "GET" : "POST");
    srv__send_error(s, req, &e);
}

static void dispatch(struct evhttp_request *req, void *arg)
{
    srv_server *s = arg;
    const struct evhttp_uri *uri = evhttp_request_get_evhttp_uri(req);
    const char *path = uri ? evhttp_uri_get_path(uri) : NULL;
    if (!path || !*path) path = "/";
    enum evhttp_cmd_type m = evhttp_request_get_command(req);
    bool get = m == EVHTTP_REQ_GET || m == EVHTTP_REQ_HEAD, post = m == EVHTTP_REQ_POST;
    static const struct {
        const char *path;
        bool get;
    } routes[] = {{"/v1/completions", false},  {"/v1/chat/completions", false},
                  {"/v1/models", true},        {"/health", true},
                  {"/metrics", true},          {"/server_info", true},
                  {"/kv_transfer_info", true}, {"/debug/stop_engine", false},
                  {"/kv_release", false}};
    int r = -1;
    for (int i = 0; i < (int)TD_ARRAY_LEN(routes); i++)
        if (!strcmp(path, routes[i].path)) r = i;
    if (r == 7 && !s->cfg.enable_debug_endpoints) r = -1;
    if (r < 0 && !strncmp(path, "/v1/models/", 11) && path[11]) {
        if (!get)
            wrong_method(s, req, path, true);
        else
            handle_model(s, req, path + 11);
        return;
    }
    if (r < 0) {
        not_found(s, req, path);
        return;
    }
    if (routes[r].get ? !get : !post) {
        wrong_method(s, req, path, routes[r].get);
        return;
    }
    switch (r) {
    case 0:
        srv__handle_generate(s, req, SRV_EP_COMPLETIONS);
        break;
    case 1:
        srv__handle_generate(s, req, SRV_EP_CHAT);
        break;
    case 2:
        handle_models(s, req);
        break;
    case 3:
        handle_health(s, req);
        break;
    case 4:
        handle_metrics(s, req);
        break;
    case 5:
        handle_server_info(s, req);
        break;
    case 6:
        send_cjson(s, req, 200, discovery(s));
        break;
    case 8:
        handle_kv_release(s, req);
        break;
    case 7: {
        /* ?rank=N stops one data-parallel rank; without it, every rank */
        const char *q = evhttp_uri_get_query(uri);
        int64_t only = -1;
        if (q && (strncmp(q, "rank=", 5) || td_parse_i64(q + 5, &only) || only < 0 ||
                  only >= s->n_ranks)) {
            srv_error e;
            srv_error_set(&e, 400, "invalid_request_error", "rank",
                          "POST /debug/stop_engine takes ?rank=N, N from 0 to %d", s->n_ranks - 1);
            srv__send_error(s, req, &e);
            break;
        }
        for (int k = 0; k < s->n_ranks; k++)
            if (only < 0 || only == k) srv__engine_request_stop(&s->ranks[k].eng, "stopped by POST /debug/stop_engine");
        TD_WARN("engine loop stopped by POST /debug/stop_engine");
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "status", "engine loop stopping");
        send_cjson(s, req, 200, root);
        break;
    }
    }
}

/* Take everything a rank's engine thread posted, and hand it to the requests. */
static void take_outputs(srv__rank *k)
{
    srv__out *outs;
    int n;
    srv__engine_take(&k->eng, &outs, &n, &k->snap);
    srv__handle_outputs(k->s, outs, n);
    for (int i = 0; i < n; i++)
        srv__out_free(&outs[i]);
    free(outs);
}

/* A rank's engine thread wrote its eventfd. */
static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof(v));
    (void)r;
    take_outputs(arg);
}

/*
 * Graceful shutdown. The first SIGTERM or SIGINT starts a drain: new requests get 503,
 * /health answers 503 "draining" (so routers stop sending), and the loop goes on until no
 * request is in flight and no prompt KV is held for a consumer (a decode instance still
 * to pull it), or --shutdown-timeout passes. Then the engine loops are stopped, which ends
 * what is left with finish_reason "abort" (a complete answer, not a cut connection), and
 * the loop exits shortly after. A second signal exits at once.
 */
#define DRAIN_TICK_US 50000
#define DRAIN_GRACE_NS 2000000000ull /* after the cut: time for the abort answers to go out */

static int drain_count(const srv_server *s, int *leases)
{
    int n = srv__live_count(s);
    *leases = 0;
    for (int r = 0; r < s->n_ranks; r++)
        *leases += pd_leases_active(s->ranks[r].pd);
    return n;
}

static void on_drain_tick(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    srv_server *s = arg;
    int leases, n = drain_count(s, &leases);
    uint64_t now = td_now_ns();
    if (n == 0 && leases == 0) {
        TD_INFO("drained: shutting down");
        event_base_loopexit(s->base, NULL);
    } else if (!s->drain_cut && now >= s->drain_deadline_ns) {
        TD_WARN("--shutdown-timeout passed with %d request(s) in flight and %d KV lease(s) held: "
                "ending them",
                n, leases);
        s->drain_cut = true;
        s->drain_deadline_ns = now + DRAIN_GRACE_NS;
        for (int r = 0; r < s->n_ranks; r++)
            srv__engine_request_stop(&s->ranks[r].eng, "the server is shutting down");
    } else if (s->drain_cut && now >= s->drain_deadline_ns) {
        event_base_loopexit(s->base, NULL);
    }
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    (void)what;
    srv_server *s = arg;
    int leases, n = drain_count(s, &leases);
    if (s->draining || s->cfg.shutdown_timeout_s <= 0 || (n == 0 && leases == 0)) {
        TD_INFO("signal %d: shutting down", (int)sig);
        s->exit_now = s->draining;
        event_base_loopexit(s->base, NULL);
        return;
    }
    s->draining = true;
    s->drain_deadline_ns = td_now_ns() + (uint64_t)(s->cfg.shutdown_timeout_s * 1e9);
    TD_WARN("signal %d: draining: %d request(s) in flight, %d KV lease(s) held; new requests get "
            "503; exiting when they are done or in %.0f s (--shutdown-timeout); signal again to "
            "exit now",
            (int)sig, n, leases, s->cfg.shutdown_timeout_s);
    s->drain_ev = event_new(s->base, -1, EV_PERSIST, on_drain_tick, s);
    struct timeval tv = {0, DRAIN_TICK_US};
    if (!s->drain_ev || event_add(s->drain_ev, &tv)) event_base_loopexit(s->base, NULL);
}

static void detect_chat_template(srv_server *s, td_engine *e)
{
    if (s->cfg.chat_template) {
        s->chat = (srv_chat_family)srv_chat_family_by_name(s->cfg.chat_template);
        return;
    }
    const td_model *m = td_engine_model(e);
    gguf_str t = {0};
    if (!m || !m->gguf || gguf_get_str(m->gguf, "tokenizer.chat_template", &t, NULL) != 0) {
        s->chat = SRV_CHAT_NONE;
        TD_WARN("the model has no chat template: /v1/chat/completions will answer 400; "
                "pass --chat-template chatml|llama-2|llama-3|zephyr|mistral to enable it");
        return;
    }
    s->chat = srv_chat_detect_ex(t.ptr, t.len, &s->chat_extras);
    if (s->chat == SRV_CHAT_UNKNOWN)
        TD_WARN("the model's chat template (tokenizer.chat_template) is not a family tandem can "
                "render (chatml, llama-2, llama-3, zephyr, mistral): /v1/chat/completions will "
                "answer 400; pass --chat-template NAME to choose one");
    else
        TD_INFO("chat template: %s (detected from the GGUF)%s%s%s", srv_chat_family_name(s->chat),
                s->chat_extras.default_system[0] ? ", with its default system turn" : "",
                s->chat_extras.date[0] ? ", dated " : "", s->chat_extras.date);
}

/* The transfer connector for --kv-transfer-config. The agent (producer) binds to kv_ip,
 * else to the server's own address unless that is every interface, else 127.0.0.1: KV
 * blocks hold users' prompts, so they are never served on all interfaces by default. */
static int start_pd(srv_server *s, srv__rank *k, td_engine *e, const srv_kv_config *kv, td_err *err)
{
    static const kvx_protocol protos[] = {KVX_PROTO_TCP, KVX_PROTO_SHM, KVX_PROTO_UCX,
                                          KVX_PROTO_CUDA_IPC};
    pd_config pc = {
        .producer = kv->role == SRV_KV_PRODUCER || kv->role == SRV_KV_BOTH,
        .consumer = kv->role == SRV_KV_CONSUMER || kv->role == SRV_KV_BOTH,
        .protocol = protos[kv->protocol],
        /* rank r listens on handshake_port + r (each rank has its own agent) */
        .handshake_port = kv->handshake_port > 0 ? kv->handshake_port + k->index : 0,
        .num_worker_threads = kv->num_worker_threads,
        .qp_per_transfer = kv->qp_per_transfer,
        .lease_ms = (uint32_t)kv->lease_ms,
        .transfer_timeout_ms = (uint32_t)kv->transfer_timeout_ms,
        .verify_checksums = kv->verify_checksums,
        .tp_rank = kv->rank,
        .tp_size = s->cfg.tp_size > 0 ? s->cfg.tp_size : 1,
    };
    const char *host = s->cfg.host;
    if (kv->ip[0])
        host = kv->ip;
    else if (srv_kv_host_ip()) /* TANDEM_HOST_IP: the control address, never a rail's */
        host = srv_kv_host_ip();
    else if (!host || !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !host[0])
        host = "127.0.0.1";
    pc.host = host;
    if (kv->rails.n > 0) { /* resolved by srv_kv_rails at start-up */
        char desc[600];
        kvx_rails_describe(&kv->rails, desc, sizeof(desc));
        TD_INFO("kv transfer rails (%s): %s", kv->rails_matched ? "matched" : "one device", desc);
        pc.rails = &kv->rails;
        pc.matched_rails = kv->rails_matched;
        pc.rail_striping = kv->rail_striping;
    }
    const char *env = getenv("TANDEM_KV_TOKEN");
    pc.auth_token = kv->auth_token[0] ? kv->auth_token : env && env[0] ? env : NULL;
    if (kv->notes[0] && k->index == 0) TD_INFO("kv transfer config: %s", kv->notes);
    td_kv_info ki;
    td_engine_kv_info(e, &ki);
    int rc = pd_create(&k->pd, &pc, &ki, srv__engine_on_release, srv__engine_on_loaded, &k->eng, err);
    if (rc) return rc;
    s->kv_producer = pc.producer;
    s->kv_consumer = pc.consumer;
    s->kv_recompute = kv->recompute;
    char pre[48] = "";
    if (s->n_ranks > 1) snprintf(pre, sizeof(pre), " for data-parallel rank %d", k->index);
    if (pc.producer)
        fprintf(stderr, "kv transfer agent%s on %s:%d (engine %s, %s)\n", pre, pd_host(k->pd), pd_port(k->pd),
                pd_engine_id(k->pd), pc.auth_token ? "authentication on" : "no authentication");
    return 0;
}

/*
 * This thread runs the HTTP loop and starts the transfer agents' threads, which inherit its
 * CPUs: keep them all off the CPUs the engines compute on while other CPUs are left. A
 * woken thread is otherwise often placed on its waker's CPU, and the engine thread wakes
 * this one every step.
 */
static void keep_off_engine_cpus(td_engine *const *engines, int n_ranks)
{
    cpu_set_t busy, one;
    CPU_ZERO(&busy);
    for (int r = 0; r < n_ranks; r++)
        if (td_engine_cpus(engines[r], &one) > 0) CPU_OR(&busy, &busy, &one);
    td_thread_avoid_cpus(&busy); /* when the engines use every CPU, it shares them */
}

int srv_server_create(srv_server **out, td_engine *const *engines, int n_ranks, const srv_config *cfg,
                      td_err *err)
{
    srv_server *s = calloc(1, sizeof(*s));
    srv__rank *ranks = n_ranks >= 1 && n_ranks <= SRV_MAX_DP ? calloc((size_t)n_ranks, sizeof(*ranks)) : NULL;
    if (!s || !ranks) {
        for (int r = 0; r < n_ranks; r++) td_engine_free(engines[r]);
        free(s);
        free(ranks);
        return n_ranks < 1 || n_ranks > SRV_MAX_DP
                   ? td_err_set(err, TD_EINVAL, "the data-parallel size must be in [1, %d]", SRV_MAX_DP)
                   : td_err_set(err, TD_ENOMEM, "out of memory");
    }
    s->ranks = ranks;
    s->n_ranks = n_ranks;
    keep_off_engine_cpus(engines, n_ranks);
    for (int r = 0; r < n_ranks; r++) {
        ranks[r].s = s;
        ranks[r].index = r;
    }
    s->cfg = *cfg;
    s->cfg.dp_size = n_ranks;
    td_engine *e = engines[0]; /* every rank runs the same model with the same settings */
    int rc = 0;
    if (cfg->chat_template && srv_chat_family_by_name(cfg->chat_template) < 0)
        rc = td_err_set(err, TD_EINVAL,
                        "--chat-template must be chatml, llama-2, llama-3, "
                        "zephyr or mistral, got '%s'",
                        cfg->chat_template);
    if (rc) goto fail_engines;
    const td_model *m = td_engine_model(e);
    snprintf(s->model_name, sizeof(s->model_name), "%s",
             cfg->served_model_name ? cfg->served_model_name
             : cfg->model_path      ? cfg->model_path
                                    : m->name);
    snprintf(s->model_path, sizeof(s->model_path), "%s", cfg->model_path ? cfg->model_path : "");
    snprintf(s->kv_dtype, sizeof(s->kv_dtype), "%s",
             cfg->kv_cache_dtype ? cfg->kv_cache_dtype : "f16");
    s->tok = td_engine_tokenizer(e);
    s->max_model_len = td_engine_max_model_len(e);
    s->n_vocab = tok_n_vocab(s->tok);
    s->model_fingerprint = m->fingerprint;
    s->started_at = (long)time(NULL);
    {
        uint64_t id = 0;
        if (getentropy(&id, sizeof(id)) != 0)
            id = td_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)s;
        snprintf(s->instance_id, sizeof(s->instance_id), "%016llx", (unsigned long long)id);
    }
    detect_chat_template(s, e);
    srv__metrics_init(&s->metrics);
    signal(SIGPIPE, SIG_IGN);

    /* epoll's change list: an event armed and disarmed in one pass of the loop (a stream's
     * write event around an SSE chunk written at once, completion.c) costs no epoll_ctl.
     * Its one caveat, fds that are dup()s of each other, does not arise here. */
    struct event_config *ec = event_config_new();
    if (ec) event_config_set_flag(ec, EVENT_BASE_FLAG_EPOLL_USE_CHANGELIST);
    s->base = ec ? event_base_new_with_config(ec) : NULL;
    if (ec) event_config_free(ec);
    if (!s->base) s->base = event_base_new();
    s->http = s->base ? evhttp_new(s->base) : NULL;
    if (!s->http) {
        rc = td_err_set(err, TD_ENOMEM, "cannot create the event loop");
        goto fail_engines;
    }
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                            EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE |
                                            EVHTTP_REQ_OPTIONS | EVHTTP_REQ_PATCH);
    /* Bodies up to 4x the limit are read and refused with a JSON 413 (completion.c);
     * beyond that evhttp stops reading and answers 413 itself, so memory stays bounded. */
    evhttp_set_max_body_size(s->http, (ev_ssize_t)TD_MIN(cfg->max_body_size * 4, (size_t)1 << 30));
    evhttp_set_max_headers_size(s->http, 64 * 1024);
    evhttp_set_timeout(s->http, 600);
    evhttp_set_gencb(s->http, dispatch, s);
    struct evhttp_bound_socket *bound =
        evhttp_bind_socket_with_handle(s->http, cfg->host, (ev_uint16_t)cfg->port);
    if (!bound) {
        int code = errno;
        rc = td_err_set(err, TD_EIO, "cannot listen on %s:%d: %s", cfg->host, cfg->port,
                        code ? strerror(code) : "bind failed");
        goto fail_engines;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(evhttp_bound_socket_get_fd(bound), (struct sockaddr *)&ss, &sl) == 0)
        s->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
    s->listener = bound;
    s->accept_guard = td_accept_guard_new(s->base, bound, "serve");

    /* Each rank: its connector, then its engine thread (which owns the engine from then on;
     * srv_server_free frees the engines whose thread started, and the rest below). */
    int started = 0;
    for (int r = 0; r < n_ranks && !rc; r++) {
        srv__rank *k = &ranks[r];
        if (cfg->kv && (rc = start_pd(s, k, engines[r], cfg->kv, err))) break;
        cpu_set_t saved;
        bool pinned = cfg->rank_cpus && pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0 &&
                      pthread_setaffinity_np(pthread_self(), sizeof(cfg->rank_cpus[r]), &cfg->rank_cpus[r]) == 0;
        rc = srv__engine_start(&k->eng, engines[r], cfg->debug_step_delay_ms, k->pd, s->kv_recompute, cfg->ep, r,
                               err);
        if (pinned) pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved); /* its thread inherited it */
        if (rc) {
            k->eng.engine = NULL; /* no thread: freed below with the ranks not started */
            pd_destroy(k->pd);
            k->pd = NULL;
            break;
        }
        started++;
        k->wake_ev = event_new(s->base, k->eng.wake_fd, EV_READ | EV_PERSIST, on_wake, k);
        event_add(k->wake_ev, NULL);
        srv__engine_take(&k->eng, &(srv__out *){NULL}, &(int){0}, &k->snap);
    }
    if (rc) {
        for (int r = started; r < n_ranks; r++) td_engine_free(engines[r]);
        srv_server_free(s);
        return rc;
    }
    s->max_num_seqs = (cfg->max_num_seqs > 0 ? cfg->max_num_seqs : 64) * n_ranks;
    s->sigint_ev = evsignal_new(s->base, SIGINT, on_signal, s);
    s->sigterm_ev = evsignal_new(s->base, SIGTERM, on_signal, s);
    event_add(s->sigint_ev, NULL);
    event_add(s->sigterm_ev, NULL);
    if (cfg->kv && srv__register_start(s, cfg->kv, err)) {
        srv_server_free(s);
        return err->code;
    }
    fprintf(stderr, "listening on %s:%d\n", cfg->host, s->port);
    fflush(stderr);
    *out = s;
    return 0;

fail_engines: /* no engine thread started: the engines are still ours to free */
    for (int r = 0; r < n_ranks; r++) td_engine_free(engines[r]);
    srv_server_free(s);
    return rc;
}

/* At most this long after the loop ends for the replies already queued to be written. */
#define REPLY_FLUSH_MS 2000

int srv_server_run(srv_server *s)
{
    int rc = event_base_dispatch(s->base) < 0 ? TD_EIO : 0;
    if (s->exit_now) return rc;
    /* No new connections (they are refused now, not cut later); the answers given are sent. */
    td_accept_guard_free(s->accept_guard);
    s->accept_guard = NULL;
    if (s->listener) evhttp_del_accept_socket(s->http, s->listener);
    s->listener = NULL;
    int left = td_replies_flush(s->base, &s->replies, REPLY_FLUSH_MS);
    if (left)
        TD_WARN("exiting with %d repl%s not written out (a client not reading?)", left,
                left == 1 ? "y" : "ies");
    return rc;
}

void srv_server_stop(srv_server *s)
{
    event_base_loopexit(s->base, NULL);
}

void srv_server_free(srv_server *s)
{
    if (!s) return;
    for (int r = 0; r < s->n_ranks; r++) {
        srv__rank *k = &s->ranks[r];
        if (!k->eng.engine) continue;
        srv__engine_stop(&k->eng, "shutting down");
        take_outputs(k); /* the final outputs, so that request objects are released */
    }
    srv__free_all_requests(s);
    srv__register_stop(s);
    /* After the engine loops (which start loads) and before the engines (whose pools the
     * transfers read and write); their callbacks now find a closed inbox. */
    for (int r = 0; r < s->n_ranks; r++) {
        pd_destroy(s->ranks[r].pd);
        s->ranks[r].pd = NULL;
        if (s->ranks[r].wake_ev) event_free(s->ranks[r].wake_ev);
    }
    if (s->drain_ev) event_free(s->drain_ev);
    if (s->sigint_ev) event_free(s->sigint_ev);
    if (s->sigterm_ev) event_free(s->sigterm_ev);
    td_accept_guard_free(s->accept_guard);
    if (s->http) evhttp_free(s->http);
    if (s->base) event_base_free(s->base);
    for (int r = 0; r < s->n_ranks; r++) {
        td_engine *e = s->ranks[r].eng.engine;
        if (!e) continue;
        srv__engine_free(&s->ranks[r].eng);
        td_engine_free(e);
    }
    free(s->ranks);
    free(s);
}
