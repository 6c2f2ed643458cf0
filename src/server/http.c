/*
 * server/http.c - the I/O thread: evhttp setup, routing, the informational
 * endpoints (/health, /metrics, /v1/models, /server_info, /kv_transfer_info),
 * errors in OpenAI's shape, and the wakeup that brings the engine's outputs in.
 * Generation requests live in completion.c.
 */
#include <errno.h>
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

void srv_config_default(srv_config *c)
{
    memset(c, 0, sizeof(*c));
    c->host = "0.0.0.0";
    c->port = 8000;
    c->max_queue = 1024;
    c->max_body_size = 4u << 20;
    c->health_stall_s = 60.0;
    c->tp_size = 1;
    c->dp_size = 1;
    c->block_size = 16;
    c->kv_cache_dtype = "f16";
}

int srv_server_port(const srv_server *s)
{
    return s->port;
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
            size_t ok = tok_utf8_valid_prefix(s + i, TD_MIN(len - i, (size_t)4));
            size_t clen = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
            if (ok >= clen && clen <= len - i) {
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
    const char *reason = status == 200   ? "OK"
                         : status == 400 ? "Bad Request"
                         : status == 404 ? "Not Found"
                         : status == 405 ? "Method Not Allowed"
                         : status == 413 ? "Payload Too Large"
                         : status == 429 ? "Too Many Requests"
                         : status == 503 ? "Service Unavailable"
                                         : "Error";
    evhttp_send_reply(req, status, reason, b);
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

static void handle_health(srv_server *s, struct evhttp_request *req)
{
    char reason[160];
    cJSON *root = cJSON_CreateObject();
    if (srv__engine_stopped(&s->eng, reason, sizeof(reason))) {
        cJSON_AddStringToObject(root, "status", "error");
        char msg[224];
        snprintf(msg, sizeof(msg), "the engine loop has stopped: %s", reason);
        cJSON_AddStringToObject(root, "reason", msg);
        send_cjson(s, req, 503, root);
        return;
    }
    double idle_s = (double)(td_now_ns() - atomic_load(&s->eng.last_progress_ns)) / 1e9;
    if (s->outstanding > 0 && idle_s > s->cfg.health_stall_s) {
        cJSON_AddStringToObject(root, "status", "error");
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "the engine loop is stalled: no step for %.1f s with %d "
                 "requests in flight",
                 idle_s, s->outstanding);
        cJSON_AddStringToObject(root, "reason", msg);
        send_cjson(s, req, 503, root);
        return;
    }
    cJSON_AddStringToObject(root, "status", "ok");
    cJSON_AddNumberToObject(root, "load", s->outstanding); /* for routers' load balancing */
    send_cjson(s, req, 200, root);
}

static void handle_metrics(srv_server *s, struct evhttp_request *req)
{
    char *text = srv__metrics_render(&s->metrics, &s->snap, s->model_name);
    struct evbuffer *b = evbuffer_new();
    if (text) evbuffer_add(b, text, strlen(text));
    free(text);
    if (s->pd) {
        text = pd_metrics_render(s->pd);
        if (text) evbuffer_add(b, text, strlen(text));
        free(text);
    }
    evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type",
                      "text/plain; version=0.0.4");
    count_status(s, 200);
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}

static void handle_models(srv_server *s, struct evhttp_request *req)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", s->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->started_at);
    cJSON_AddStringToObject(m, "owned_by", "tandem");
    cJSON_AddStringToObject(m, "root", s->model_path);
    cJSON_AddNumberToObject(m, "max_model_len", s->max_model_len);
    cJSON_AddItemToArray(data, m);
    send_cjson(s, req, 200, root);
}

static cJSON *discovery(srv_server *s)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", s->model_name);
    cJSON_AddStringToObject(root, "model_path", s->model_path);
    char fp[32];
    snprintf(fp, sizeof(fp), "%016llx", (unsigned long long)s->model_fingerprint);
    cJSON_AddStringToObject(root, "model_fingerprint", fp);
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
    if (s->pd && s->kv_producer) {
        cJSON_AddNumberToObject(root, "handshake_port", pd_port(s->pd));
        cJSON_AddStringToObject(root, "kv_host", pd_host(s->pd));
        cJSON_AddStringToObject(root, "engine_id", pd_engine_id(s->pd));
    } else {
        cJSON_AddNullToObject(root, "handshake_port");
    }
    return root;
}

static void handle_server_info(srv_server *s, struct evhttp_request *req)
{
    cJSON *root = discovery(s);
    cJSON_AddStringToObject(root, "version", "tandem 0.1");
    cJSON_AddStringToObject(root, "chat_template", srv_chat_family_name(s->chat));
    cJSON_AddNumberToObject(root, "max_num_seqs", s->max_num_seqs);
    cJSON_AddNumberToObject(root, "kv_blocks_total", s->snap.stats.num_blocks_total);
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
                  {"/kv_transfer_info", true}, {"/debug/stop_engine", false}};
    int r = -1;
    for (int i = 0; i < (int)TD_ARRAY_LEN(routes); i++)
        if (!strcmp(path, routes[i].path)) r = i;
    if (r == 7 && !s->cfg.enable_debug_endpoints) r = -1;
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
    case 7: {
        srv__engine_request_stop(&s->eng, "stopped by POST /debug/stop_engine");
        TD_WARN("engine loop stopped by POST /debug/stop_engine");
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "status", "engine loop stopping");
        send_cjson(s, req, 200, root);
        break;
    }
    }
}

/* The engine thread wrote the eventfd: take everything it posted. */
static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    srv_server *s = arg;
    uint64_t v;
    ssize_t r = read(fd, &v, sizeof(v));
    (void)r;
    srv__out *outs;
    int n;
    srv__engine_take(&s->eng, &outs, &n, &s->snap);
    srv__handle_outputs(s, outs, n);
    for (int i = 0; i < n; i++)
        srv__out_free(&outs[i]);
    free(outs);
}

static void on_signal(evutil_socket_t sig, short what, void *arg)
{
    (void)what;
    srv_server *s = arg;
    TD_INFO("signal %d: shutting down", (int)sig);
    event_base_loopexit(s->base, NULL);
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
    s->chat = srv_chat_detect(t.ptr, t.len);
    if (s->chat == SRV_CHAT_UNKNOWN)
        TD_WARN("the model's chat template (tokenizer.chat_template) is not a family tandem can "
                "render (chatml, llama-2, llama-3, zephyr, mistral): /v1/chat/completions will "
                "answer 400; pass --chat-template NAME to choose one");
    else
        TD_INFO("chat template: %s (detected from the GGUF)", srv_chat_family_name(s->chat));
}

/* The transfer connector for --kv-transfer-config. The agent (producer) binds to kv_ip,
 * else to the server's own address unless that is every interface, else 127.0.0.1: KV
 * blocks hold users' prompts, so they are never served on all interfaces by default. */
static int start_pd(srv_server *s, td_engine *e, const srv_kv_config *kv, td_err *err)
{
    static const kvx_protocol protos[] = {KVX_PROTO_TCP, KVX_PROTO_SHM, KVX_PROTO_UCX,
                                          KVX_PROTO_CUDA_IPC};
    pd_config pc = {
        .producer = kv->role == SRV_KV_PRODUCER || kv->role == SRV_KV_BOTH,
        .consumer = kv->role == SRV_KV_CONSUMER || kv->role == SRV_KV_BOTH,
        .protocol = protos[kv->protocol],
        .handshake_port = kv->handshake_port > 0 ? kv->handshake_port : 0,
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
    if (kv->notes[0]) TD_INFO("kv transfer config: %s", kv->notes);
    td_kv_info ki;
    td_engine_kv_info(e, &ki);
    int rc = pd_create(&s->pd, &pc, &ki, srv__engine_on_release, srv__engine_on_loaded, &s->eng,
                       err);
    if (rc) return rc;
    s->kv_producer = pc.producer;
    s->kv_consumer = pc.consumer;
    s->kv_recompute = kv->recompute;
    if (pc.producer)
        fprintf(stderr, "kv transfer agent on %s:%d (engine %s, %s)\n", pd_host(s->pd),
                pd_port(s->pd), pd_engine_id(s->pd),
                pc.auth_token ? "authentication on" : "no authentication");
    return 0;
}

int srv_server_create(srv_server **out, td_engine *e, const srv_config *cfg, td_err *err)
{
    srv_server *s = calloc(1, sizeof(*s));
    if (!s) return td_err_set(err, TD_ENOMEM, "out of memory");
    s->cfg = *cfg;
    if (cfg->chat_template && srv_chat_family_by_name(cfg->chat_template) < 0) {
        free(s);
        return td_err_set(err, TD_EINVAL,
                          "--chat-template must be chatml, llama-2, llama-3, "
                          "zephyr or mistral, got '%s'",
                          cfg->chat_template);
    }
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
    detect_chat_template(s, e);
    srv__metrics_init(&s->metrics);
    signal(SIGPIPE, SIG_IGN);

    s->base = event_base_new();
    s->http = s->base ? evhttp_new(s->base) : NULL;
    if (!s->http) {
        srv_server_free(s);
        return td_err_set(err, TD_ENOMEM, "cannot create the event loop");
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
        srv_server_free(s);
        return td_err_set(err, TD_EIO, "cannot listen on %s:%d: %s", cfg->host, cfg->port,
                          code ? strerror(code) : "bind failed");
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(evhttp_bound_socket_get_fd(bound), (struct sockaddr *)&ss, &sl) == 0)
        s->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);

    if (cfg->kv && start_pd(s, e, cfg->kv, err)) {
        srv_server_free(s); /* the engine stays the caller's: it has no thread yet */
        return err->code;
    }
    if (srv__engine_start(&s->eng, e, cfg->debug_step_delay_ms, s->pd, s->kv_recompute, err)) {
        pd_destroy(s->pd);
        s->pd = NULL;
        srv_server_free(s);
        return err->code;
    }
    s->max_num_seqs = cfg->max_num_seqs > 0 ? cfg->max_num_seqs : 64;
    s->wake_ev = event_new(s->base, s->eng.wake_fd, EV_READ | EV_PERSIST, on_wake, s);
    event_add(s->wake_ev, NULL);
    s->sigint_ev = evsignal_new(s->base, SIGINT, on_signal, s);
    s->sigterm_ev = evsignal_new(s->base, SIGTERM, on_signal, s);
    event_add(s->sigint_ev, NULL);
    event_add(s->sigterm_ev, NULL);
    srv__engine_take(&s->eng, &(srv__out *){NULL}, &(int){0}, &s->snap);
    if (cfg->kv && srv__register_start(s, cfg->kv, err)) {
        srv_server_free(s);
        return err->code;
    }
    fprintf(stderr, "listening on %s:%d\n", cfg->host, s->port);
    fflush(stderr);
    *out = s;
    return 0;
}

int srv_server_run(srv_server *s)
{
    return event_base_dispatch(s->base) < 0 ? TD_EIO : 0;
}

void srv_server_stop(srv_server *s)
{
    event_base_loopexit(s->base, NULL);
}

void srv_server_free(srv_server *s)
{
    if (!s) return;
    td_engine *e = s->eng.engine;
    if (e) {
        srv__engine_stop(&s->eng, "shutting down");
        /* Deliver the final outputs so that request objects are released. */
        srv__out *outs;
        int n;
        srv__engine_take(&s->eng, &outs, &n, &s->snap);
        srv__handle_outputs(s, outs, n);
        for (int i = 0; i < n; i++)
            srv__out_free(&outs[i]);
        free(outs);
    }
    srv__free_all_requests(s);
    srv__register_stop(s);
    /* After the engine loop (which starts loads) and before the engine (whose pool the
     * transfers read and write); its callbacks now find a closed inbox. */
    pd_destroy(s->pd);
    s->pd = NULL;
    if (s->wake_ev) event_free(s->wake_ev);
    if (s->sigint_ev) event_free(s->sigint_ev);
    if (s->sigterm_ev) event_free(s->sigterm_ev);
    if (s->http) evhttp_free(s->http);
    if (s->base) event_base_free(s->base);
    if (e) {
        srv__engine_free(&s->eng);
        td_engine_free(e);
    }
    free(s);
}
