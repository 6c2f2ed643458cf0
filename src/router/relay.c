/*
 * router/relay.c - one client request through the router.
 *
 * A request has up to two legs, each an HTTP request to one worker over a pooled
 * connection: in aggregated mode one (relayed), in PD read mode the prefill (collected:
 * its kv_transfer_params go into the decode's body) then the decode (relayed), in PD
 * write mode both at once. A relayed leg's answer goes to the client as it arrives: the
 * status and content type when its headers come, then every chunk of the body (an SSE
 * stream stays an SSE stream, event by event).
 *
 * Failures: a leg that fails before the client saw a byte (connection refused or reset,
 * a 5xx, a broken answer) counts against its worker's breaker and is retried on another
 * worker of its role, with exponential backoff and jitter, up to --retry-max-retries
 * times; then the client gets a 502 naming the last error. 4xx answers are the client's
 * and are relayed as they are. --request-timeout-secs bounds the whole request: before
 * the answer began that is a 504, after it the stream is cut. A client that hangs up
 * cancels every leg, which closes the upstream connections, so the engines abort the
 * requests and free their KV blocks.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "router/rt_impl.h"
#include "server/server.h"

enum { LEG_IDLE = 0, LEG_RUNNING, LEG_DONE };

typedef struct rt_leg {
    rt_req *q;
    rt_role role;
    bool relay; /* stream the answer to the client */
    int state;
    rt_worker *w;
    struct evhttp_connection *conn;
    struct evhttp_request *ereq; /* while running */
    int status;
    struct evbuffer *body; /* a collected answer (not relayed), or a 5xx's */
    double t0;
    char *payload; /* what was sent (kept for retries) */
    int tries;
    bool passthrough;     /* this attempt's body goes straight to the client */
    bool relayed;         /* ... and some of it went */
    rt_worker *failed_on; /* excluded from the next pick */
    char last_error[200];
    /* inside evhttp_make_request, which fails some requests at once (no descriptor for the
     * socket) by calling on_leg_done before it returns: the caller then ends the attempt */
    bool sending, failed_at_once;
} rt_leg;

struct rt_req {
    rt_router *r;
    uint64_t n;
    struct evhttp_request *client;
    struct event *watch;
    int endpoint;
    const char *path;
    char rid[80];
    cJSON *body;
    char *route;
    size_t route_len;
    bool stream;
    bool write_mode;
    bool started;  /* the client's reply has begun */
    bool finished; /* the client's reply is complete (or the client is gone) */
    rt_leg pre, dec;
    struct event *timer;      /* request timeout, or the queue timeout while queued */
    struct event *retry_ev;   /* a retry waiting for its backoff */
    rt_leg *retry_leg;
    uint64_t paired_decode; /* --atom-pd-rank-mapping-policy idx2idx: the prefill's twin (id) */
    /* The KV a prefill holds for this request, and where: given back at the end unless a
     * decode answered in full (it then released it itself). */
    char held_tid[65], held_url[256];
    bool dec_ok;
    bool queued, admitted;
    double t_start;
    rt_req *next_queued;
    rt_req *next_live, *prev_live;
};

static void leg_start(rt_req *q, rt_leg *leg);
static void req_maybe_free(rt_req *q);
static void pair_with(rt_req *q, const rt_worker *p);

/* ---------------------------------------------------------------- client side */

static void unwatch(rt_req *q)
{
    if (q->watch) {
        event_free(q->watch);
        q->watch = NULL;
    }
}

/* The reply is complete or abandoned: detach from the client's connection. */
static void client_detach(rt_req *q)
{
    unwatch(q);
    if (q->client) {
        struct evhttp_connection *evcon = evhttp_request_get_connection(q->client);
        if (evcon) evhttp_connection_set_closecb(evcon, NULL, NULL);
    }
    q->client = NULL;
    q->finished = true;
}

void rt_count_status(rt_router *r, int status)
{
    int c = status / 100;
    if (c >= 1 && c <= 5) r->responses_by_class[c]++;
}

static void reply_error(rt_req *q, int status, const char *type, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void reply_error(rt_req *q, int status, const char *type, const char *fmt, ...)
{
    if (q->finished) return;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (!q->started) { /* a stream cut later was counted by its status line already */
        rt_count_status(q->r, status);
        TD_WARN("router %s: %d %s", q->rid, status, msg);
        rt_send_error(q->r, q->client, status, type, msg);
    } else {
        /* The answer began: end it with an SSE error event and [DONE], as the engines do. */
        TD_WARN("router %s: stream cut: %s", q->rid, msg);
        if (q->stream) {
            struct evbuffer *b = evbuffer_new();
            cJSON *e = cJSON_CreateObject(), *err = cJSON_AddObjectToObject(e, "error");
            cJSON_AddStringToObject(err, "message", msg);
            cJSON_AddStringToObject(err, "type", type);
            cJSON_AddNumberToObject(err, "code", status);
            char *t = cJSON_PrintUnformatted(e);
            evbuffer_add_printf(b, "data: %s\n\ndata: [DONE]\n\n", t ? t : "{}");
            free(t);
            cJSON_Delete(e);
            evhttp_send_reply_chunk(q->client, b);
            evbuffer_free(b);
        }
        td_replies_track(&q->r->replies, q->client);
        evhttp_send_reply_end(q->client);
    }
    client_detach(q);
}

/* ---------------------------------------------------------------- legs */

static void leg_release(rt_req *q, rt_leg *leg)
{
    if (leg->conn) rt_conn_put(leg->w, leg->conn);
    leg->conn = NULL;
    if (leg->w) {
        leg->w->in_flight--;
        rt_worker_unref(q->r, leg->w);
        leg->w = NULL;
    }
}

/* Stop a running leg: closing its connection makes the engine abort the request. */
static void leg_cancel(rt_req *q, rt_leg *leg)
{
    if (leg->state != LEG_RUNNING) return;
    struct evhttp_request *e = leg->ereq;
    leg->ereq = NULL;
    leg->state = LEG_DONE;
    if (e) evhttp_cancel_request(e); /* our callbacks see ereq NULL and return */
    leg_release(q, leg);
}

/*
 * A read-mode prefill whose answer is arriving (its headers read, or bytes of it in the
 * router's buffer or socket): the KV it holds under a lease is named only by that answer,
 * so a request whose client left reads it to its end and gives the KV back (req_free)
 * rather than drop it and leave the lease to expire.
 */
static bool prefill_answer_arriving(rt_req *q)
{
    rt_leg *leg = &q->pre;
    if (q->write_mode || leg->state != LEG_RUNNING || !leg->conn || !leg->ereq) return false;
    if (evhttp_request_get_response_code(leg->ereq) > 0) return true;
    struct bufferevent *bev = evhttp_connection_get_bufferevent(leg->conn);
    if (!bev) return false;
    if (evbuffer_get_length(bufferevent_get_input(bev)) > 0) return true;
    evutil_socket_t fd = bufferevent_getfd(bev);
    char c;
    return fd >= 0 && recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
}

/* The client is gone: stop every leg, except a prefill whose answer (naming its KV) is
 * already arriving. */
static void req_end_legs_for_gone_client(rt_req *q)
{
    if (!prefill_answer_arriving(q)) leg_cancel(q, &q->pre);
    leg_cancel(q, &q->dec);
    if (q->retry_ev) event_del(q->retry_ev);
    q->retry_leg = NULL;
}

static void req_end_legs(rt_req *q)
{
    leg_cancel(q, &q->pre);
    leg_cancel(q, &q->dec);
    if (q->retry_ev) event_del(q->retry_ev);
    q->retry_leg = NULL;
}

static void on_retry(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    rt_req *q = arg;
    rt_leg *leg = q->retry_leg;
    q->retry_leg = NULL;
    if (leg && !q->finished) leg_start(q, leg);
    req_maybe_free(q);
}

/* The leg failed before the client saw any of its answer: try another worker, or give up. */
static void leg_failed(rt_req *q, rt_leg *leg, int status, const char *why)
{
    rt_router *r = q->r;
    snprintf(leg->last_error, sizeof(leg->last_error), "%s", why);
    if (q->finished) return;
    if (leg == &q->pre && q->write_mode) { /* the decode recomputes without it */
        TD_WARN("router %s: the prefill failed (%s); the decode will compute the prompt",
                q->rid, why);
        return;
    }
    if (leg->tries <= r->cfg.retry_max_retries) {
        r->retries++;
        double b = r->cfg.retry_initial_backoff_s;
        for (int i = 1; i < leg->tries; i++)
            b *= r->cfg.retry_backoff_multiplier;
        if (b > r->cfg.retry_max_backoff_s) b = r->cfg.retry_max_backoff_s;
        double j = r->cfg.retry_jitter_factor * (2.0 * td_rng_float(&r->rng) - 1.0);
        b *= 1.0 + j;
        if (b < 0) b = 0;
        TD_INFO("router %s: %s leg failed on %s (%s); retry %d in %.0f ms", q->rid,
                rt_role_name(leg->role), leg->failed_on ? leg->failed_on->url : "?", why,
                leg->tries, b * 1e3);
        struct timeval tv = {(time_t)b, (suseconds_t)((b - (double)(time_t)b) * 1e6)};
        q->retry_leg = leg;
        event_add(q->retry_ev, &tv);
        return;
    }
    r->bad_gateway_502++;
    if (!q->started && status >= 500 && status < 600 && leg->body &&
        evbuffer_get_length(leg->body)) {
        /* The worker's own 5xx answer, relayed as it is. */
        rt_count_status(r, status);
        struct evbuffer *b = leg->body;
        evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type",
                          "application/json");
        td_replies_track(&q->r->replies, q->client);
        evhttp_send_reply(q->client, status, td_http_reason(status), b);
        client_detach(q);
    } else {
        reply_error(q, 502, "bad_gateway", "no %s instance could take the request: %s",
                    rt_role_name(leg->role), why);
    }
    req_end_legs(q);
}

static void start_decode_with(rt_req *q, const cJSON *kv);

/*
 * A streaming client gets the prefill's first token at once, before the decode even
 * starts: the router writes the stream's first events itself (with the prefill's id,
 * which is the request id on both legs), and tells the decode, through
 * kv_transfer_params.first_token_streamed, to begin its stream after that token. Only
 * for one plain choice: with logprobs, echo or n > 1 the decode streams everything.
 * The text is the producer's first_token_text, what a stream emits after that token: it
 * keeps back the start of a possible stop string and an unfinished character, which the
 * decode's stream releases (or drops) as the text goes on.
 */
static bool stream_first_token(rt_req *q, const cJSON *pre, const cJSON *kv)
{
    if (!q->stream) return false;
    const cJSON *b = q->body;
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(b, "n");
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(b, "logprobs");
    const cJSON *tlp = cJSON_GetObjectItemCaseSensitive(b, "top_logprobs");
    const cJSON *echo = cJSON_GetObjectItemCaseSensitive(b, "echo");
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(b, "prompt");
    if ((n && !(cJSON_IsNumber(n) && n->valuedouble == 1)) ||
        (lp && !cJSON_IsNull(lp) && !cJSON_IsFalse(lp)) || (tlp && !cJSON_IsNull(tlp)) ||
        cJSON_IsTrue(echo))
        return false;
    if (cJSON_IsArray(prompt) && cJSON_GetArraySize(prompt) > 0 &&
        !cJSON_IsNumber(cJSON_GetArrayItem(prompt, 0)))
        return false; /* several prompts */
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(pre, "id");
    const cJSON *created = cJSON_GetObjectItemCaseSensitive(pre, "created");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(pre, "model");
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(kv, "first_token_text");
    if (!cJSON_IsString(id) || !cJSON_IsNumber(created) || !cJSON_IsString(model) ||
        !cJSON_IsString(text))
        return false;
    bool chat = q->endpoint == SRV_EP_CHAT;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(b, "stream_options");
    bool usage = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(so, "include_usage"));
    struct evbuffer *out = evbuffer_new();
    for (int k = chat ? 0 : 1; k < 2; k++) {
        cJSON *c = cJSON_CreateObject();
        cJSON_AddStringToObject(c, "id", id->valuestring);
        cJSON_AddStringToObject(c, "object", chat ? "chat.completion.chunk" : "text_completion");
        cJSON_AddNumberToObject(c, "created", created->valuedouble);
        cJSON_AddStringToObject(c, "model", model->valuestring);
        cJSON *choices = cJSON_AddArrayToObject(c, "choices");
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "index", 0);
        if (chat) {
            cJSON *d = cJSON_AddObjectToObject(x, "delta");
            if (k == 0) cJSON_AddStringToObject(d, "role", "assistant");
            cJSON_AddStringToObject(d, "content", k == 0 ? "" : text->valuestring);
        } else {
            cJSON_AddStringToObject(x, "text", text->valuestring);
        }
        cJSON_AddNullToObject(x, "logprobs");
        cJSON_AddNullToObject(x, "finish_reason");
        cJSON_AddItemToArray(choices, x);
        if (usage) cJSON_AddNullToObject(c, "usage"); /* as the engine's chunks say it */
        char *t = cJSON_PrintUnformatted(c);
        cJSON_Delete(c);
        if (t) evbuffer_add_printf(out, "data: %s\n\n", t);
        free(t);
    }
    struct evkeyvalq *h = evhttp_request_get_output_headers(q->client);
    evhttp_add_header(h, "Content-Type", "text/event-stream");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_add_header(h, "X-Request-Id", q->rid);
    rt_count_status(q->r, 200);
    evhttp_send_reply_start(q->client, 200, "OK");
    evhttp_send_reply_chunk(q->client, out);
    evbuffer_free(out);
    q->started = true;
    return true;
}

/* A read-mode prefill's answer (leg->body) for a request whose client is gone: keep the
 * transfer id it names, so that req_free gives the KV back at once. */
static void note_held_tid(rt_req *q, rt_leg *leg)
{
    size_t n = evbuffer_get_length(leg->body);
    cJSON *j = cJSON_ParseWithLength((const char *)evbuffer_pullup(leg->body, -1), n);
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(j, "kv_transfer_params");
    const cJSON *tid = cJSON_GetObjectItemCaseSensitive(kv, "transfer_id");
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kv, "do_remote_prefill")) &&
        cJSON_IsString(tid))
        snprintf(q->held_tid, sizeof(q->held_tid), "%s", tid->valuestring);
    cJSON_Delete(j);
}

/* PD read mode: the prefill answered. */
static void prefill_done(rt_req *q, rt_leg *leg)
{
    size_t n = evbuffer_get_length(leg->body);
    char *s = malloc(n + 1);
    if (!s) {
        reply_error(q, 500, "server_error", "out of memory");
        return;
    }
    evbuffer_remove(leg->body, s, n);
    s[n] = 0;
    if (leg->status != 200) { /* the client's error (4xx): relay it */
        rt_count_status(q->r, leg->status);
        struct evbuffer *b = evbuffer_new();
        evbuffer_add(b, s, n);
        evhttp_add_header(evhttp_request_get_output_headers(q->client), "Content-Type",
                          "application/json");
        td_replies_track(&q->r->replies, q->client);
        evhttp_send_reply(q->client, leg->status, td_http_reason(leg->status), b);
        evbuffer_free(b);
        client_detach(q);
        free(s);
        return;
    }
    cJSON *j = cJSON_Parse(s);
    free(s);
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(j, "kv_transfer_params");
    if (!cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(kv, "do_remote_prefill"))) {
        /* The prefill holds no KV (it ended early): the decode computes the prompt. */
        TD_INFO("router %s: the prefill returned no KV; the decode computes the prompt", q->rid);
        kv = NULL;
    }
    const cJSON *tid = cJSON_GetObjectItemCaseSensitive(kv, "transfer_id");
    if (cJSON_IsString(tid) && q->held_url[0])
        snprintf(q->held_tid, sizeof(q->held_tid), "%s", tid->valuestring);
    cJSON *kv2 = kv ? cJSON_Duplicate(kv, 1) : NULL;
    if (kv2 && stream_first_token(q, j, kv)) cJSON_AddTrueToObject(kv2, "first_token_streamed");
    start_decode_with(q, kv2);
    cJSON_Delete(kv2);
    cJSON_Delete(j);
}

static void on_leg_done(struct evhttp_request *req, void *arg)
{
    rt_leg *leg = arg;
    rt_req *q = leg->q;
    if (leg->sending) { /* failed inside evhttp_make_request: its caller ends the attempt */
        leg->failed_at_once = true;
        return;
    }
    if (!leg->ereq) return; /* cancelled */
    leg->ereq = NULL;
    leg->state = LEG_DONE;
    rt_worker *w = leg->w;
    int status = req ? evhttp_request_get_response_code(req) : 0;
    double secs = td_now_s() - leg->t0;
    bool ok = req && status > 0 && status < 500;
    if (w && status > 0) w->reachable = true;
    if (req && !leg->relay) /* a collected answer: keep its body */
        evbuffer_add_buffer(leg->body, evhttp_request_get_input_buffer(req));
    if (w) rt_worker_result(q->r, w, ok, ok ? secs : -1);
    leg->failed_on = ok ? NULL : w;
    leg->status = status;
    if (ok && status == 200 && w && leg == &q->pre && !q->write_mode) {
        snprintf(q->held_url, sizeof(q->held_url), "%s", w->url); /* its transfer_id: prefill_done */
        pair_with(q, w); /* a retry may have moved the prefill to another instance */
    }
    if (ok && status == 200 && leg == &q->dec) q->dec_ok = true;
    leg_release(q, leg);
    if (q->finished) {
        if (ok && status == 200 && leg == &q->pre && !q->write_mode && q->held_url[0])
            note_held_tid(q, leg); /* req_free gives that KV back */
        req_maybe_free(q);
        return;
    }
    if (!ok) {
        char why[160];
        if (status >= 500)
            snprintf(why, sizeof(why), "HTTP %d", status);
        else
            snprintf(why, sizeof(why), "connection failed or closed before the answer ended");
        if (leg->relayed) {
            reply_error(q, 502, "bad_gateway", "the %s instance failed mid-answer: %s",
                        rt_role_name(leg->role), why);
            req_end_legs(q);
        } else {
            leg_failed(q, leg, status, why);
        }
        req_maybe_free(q);
        return;
    }
    if (leg->relay) {
        if (leg->passthrough) {
            td_replies_track(&q->r->replies, q->client);
            evhttp_send_reply_end(q->client);
        } else if (!q->started) { /* an answer kept whole */
            const char *ct =
                req ? evhttp_find_header(evhttp_request_get_input_headers(req), "Content-Type")
                    : NULL;
            struct evkeyvalq *out = evhttp_request_get_output_headers(q->client);
            evhttp_add_header(out, "Content-Type", ct ? ct : "application/json");
            evhttp_add_header(out, "X-Request-Id", q->rid);
            rt_count_status(q->r, status);
            td_replies_track(&q->r->replies, q->client);
            evhttp_send_reply(q->client, status, td_http_reason(status), leg->body);
        } else { /* the router streamed the first token, then the decode refused (4xx) */
            size_t n = evbuffer_get_length(leg->body);
            char *t = malloc(n + 1);
            if (t) {
                evbuffer_remove(leg->body, t, n);
                t[n] = 0;
            }
            reply_error(q, status, "invalid_request_error", "the decode instance answered %d: %.200s",
                        status, t ? t : "");
            free(t);
        }
        client_detach(q);
        if (!q->write_mode || q->pre.state != LEG_RUNNING) req_end_legs(q);
    } else if (leg == &q->pre && !q->write_mode) {
        prefill_done(q, leg);
    }
    req_maybe_free(q);
}

static int on_leg_header(struct evhttp_request *req, void *arg)
{
    rt_leg *leg = arg;
    rt_req *q = leg->q;
    if (!leg->ereq || q->finished) return 0;
    int status = evhttp_request_get_response_code(req);
    leg->status = status;
    /* Collected, and relayed (or retried) at the end: a 5xx, and any answer that is not a
     * stream (small, and whole or not at all: a client never gets a 200 whose body the
     * router had to cut short). */
    if (!leg->relay || status >= 500 || !q->stream) return 0;
    if (q->started) { /* the router began the answer (the first token) */
        leg->passthrough = status == 200;
        return 0;
    }
    /* Relay the status and the content type now, then the body as it arrives. */
    struct evkeyvalq *in = evhttp_request_get_input_headers(req);
    const char *ct = evhttp_find_header(in, "Content-Type");
    struct evkeyvalq *out = evhttp_request_get_output_headers(q->client);
    evhttp_add_header(out, "Content-Type", ct ? ct : "application/json");
    if (ct && strstr(ct, "event-stream")) evhttp_add_header(out, "Cache-Control", "no-cache");
    evhttp_add_header(out, "X-Request-Id", q->rid);
    rt_count_status(q->r, status);
    evhttp_send_reply_start(q->client, status, td_http_reason(status));
    q->started = true;
    leg->passthrough = true;
    return 0;
}

static void on_leg_chunk(struct evhttp_request *req, void *arg)
{
    rt_leg *leg = arg;
    rt_req *q = leg->q;
    if (!leg->ereq) return;
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    if (!leg->passthrough || q->finished) {
        /* collected: a prefill's answer, or an error kept for the reply */
        evbuffer_add_buffer(leg->body, in);
        return;
    }
    if (evbuffer_get_length(in)) leg->relayed = true;
    evhttp_send_reply_chunk(q->client, in);
    evbuffer_drain(in, evbuffer_get_length(in));
}

/* Send the leg's payload to worker w. */
static void leg_start_on(rt_req *q, rt_leg *leg, rt_worker *w)
{
    rt_router *r = q->r;
    evbuffer_drain(leg->body, evbuffer_get_length(leg->body));
    leg->w = w;
    rt_worker_ref(w);
    w->in_flight++;
    leg->conn = rt_conn_get(r, w, r->cfg.request_timeout_s + 1);
    struct evhttp_request *e = leg->conn && leg->payload ? evhttp_request_new(on_leg_done, leg) : NULL;
    if (!e) {
        leg_release(q, leg);
        leg_failed(q, leg, 0, leg->payload ? "cannot open a connection" : "out of memory");
        return;
    }
    evhttp_request_set_header_cb(e, on_leg_header);
    evhttp_request_set_chunked_cb(e, on_leg_chunk);
    struct evkeyvalq *h = evhttp_request_get_output_headers(e);
    evhttp_add_header(h, "Host", w->host);
    evhttp_add_header(h, "Content-Type", "application/json");
    evhttp_add_header(h, "X-Request-Id", q->rid);
    char *ranked = NULL;
    if (w->dp_rank >= 0) { /* --dp-aware: the rank this worker stands for */
        cJSON *b = cJSON_Parse(leg->payload);
        if (b) {
            cJSON_DeleteItemFromObjectCaseSensitive(b, "data_parallel_rank");
            cJSON_AddNumberToObject(b, "data_parallel_rank", w->dp_rank);
            ranked = cJSON_PrintUnformatted(b);
            cJSON_Delete(b);
        }
    }
    const char *body = ranked ? ranked : leg->payload;
    evbuffer_add(evhttp_request_get_output_buffer(e), body, strlen(body));
    free(ranked);
    leg->ereq = e;
    leg->state = LEG_RUNNING;
    leg->status = 0;
    leg->passthrough = leg->relayed = false;
    leg->t0 = td_now_s();
    leg->sending = true;
    leg->failed_at_once = false;
    int rc = evhttp_make_request(leg->conn, e, EVHTTP_REQ_POST, q->path);
    leg->sending = false;
    if (rc || leg->failed_at_once) {
        /* Failed before it left this process (no descriptor or memory for the socket): not
         * the worker's fault, so its breaker is not charged (a router out of descriptors
         * would otherwise eject every worker); its health checks judge it. */
        leg->ereq = NULL; /* libevent freed it */
        leg->state = LEG_DONE;
        leg->failed_on = w;
        leg_release(q, leg);
        leg_failed(q, leg, 0, "cannot send the request");
        return;
    }
    struct bufferevent *bev = evhttp_connection_get_bufferevent(leg->conn);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
}

static void leg_start(rt_req *q, rt_leg *leg)
{
    rt_router *r = q->r;
    leg->tries++;
    rt_worker *w = NULL;
    if (leg->role == RT_ROLE_DECODE && leg->tries == 1 && q->paired_decode) {
        rt_worker *ok[256];
        int n = rt_eligible(r, RT_ROLE_DECODE, ok, 256, NULL);
        for (int i = 0; i < n && !w; i++)
            if (ok[i]->id == q->paired_decode) w = ok[i];
    }
    if (!w) w = rt_pick(r, leg->role, q->route, q->route_len, leg->failed_on);
    if (!w && leg->failed_on) /* the only one failed: try it again after the backoff */
        w = rt_pick(r, leg->role, q->route, q->route_len, NULL);
    if (!w) {
        if (leg->tries == 1 || leg->tries > r->cfg.retry_max_retries) {
            r->bad_gateway_502++;
            reply_error(q, 503, "service_unavailable",
                        "no healthy %s instance is available%s%s", rt_role_name(leg->role),
                        leg->last_error[0] ? "; last error: " : "", leg->last_error);
            req_end_legs(q);
        } else {
            leg_failed(q, leg, 0, leg->last_error[0] ? leg->last_error : "no instance left");
        }
        return;
    }
    leg_start_on(q, leg, w);
}

static void leg_init(rt_req *q, rt_leg *leg, rt_role role, bool relay, char *payload)
{
    free(leg->payload);
    leg->q = q;
    leg->role = role;
    leg->relay = relay;
    leg->payload = payload;
    leg->tries = 0;
    leg->failed_on = NULL;
    if (!leg->body) leg->body = evbuffer_new();
}

/* The client's body with kv_transfer_params set to kv (a copy), as JSON text. */
static char *body_with_kv(rt_req *q, const cJSON *kv)
{
    cJSON *b = cJSON_Duplicate(q->body, 1);
    if (!b) return NULL;
    cJSON_DeleteItemFromObjectCaseSensitive(b, "kv_transfer_params");
    if (kv) cJSON_AddItemToObject(b, "kv_transfer_params", cJSON_Duplicate(kv, 1));
    char *s = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    return s;
}

static void start_decode_with(rt_req *q, const cJSON *kv)
{
    char *payload = body_with_kv(q, kv);
    if (!payload) {
        reply_error(q, 500, "server_error", "out of memory");
        return;
    }
    leg_init(q, &q->dec, RT_ROLE_DECODE, true, payload);
    leg_start(q, &q->dec);
}

/* The prefill leg's body: the client's request as a prefill-only request. */
static char *prefill_body(rt_req *q, const char *write_tid)
{
    cJSON *b = cJSON_Duplicate(q->body, 1);
    if (!b) return NULL;
    /* max_tokens stays: the producer checks it against the context (so that a request
     * the decode would refuse is refused before anything is streamed) and samples one
     * token. logprobs stay: the first token's come back in kv_transfer_params. */
    static const char *const drop[] = {"kv_transfer_params", "stream", "stream_options", "n",
                                       "echo"};
    for (size_t i = 0; i < TD_ARRAY_LEN(drop); i++)
        cJSON_DeleteItemFromObjectCaseSensitive(b, drop[i]);
    cJSON_AddBoolToObject(b, "stream", false);
    cJSON *kv = cJSON_AddObjectToObject(b, "kv_transfer_params");
    cJSON_AddBoolToObject(kv, "do_remote_decode", true);
    cJSON_AddBoolToObject(kv, "do_remote_prefill", false);
    if (write_tid) {
        cJSON_AddStringToObject(kv, "transfer_mode", "write");
        cJSON_AddStringToObject(kv, "transfer_id", write_tid);
    }
    char *s = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    return s;
}

static void random_hex(rt_router *r, char out[33])
{
    uint8_t b[16];
    FILE *f = fopen("/dev/urandom", "rb");
    bool ok = f && fread(b, 1, sizeof(b), f) == sizeof(b);
    if (f) fclose(f);
    for (int i = 0; i < 16; i++) {
        if (!ok) b[i] = (uint8_t)td_rng_next(&r->rng);
        snprintf(out + 2 * i, 3, "%02x", b[i]);
    }
}

/* ---------------------------------------------------------------- lifecycle */

/* Take a waiting request out of the admission queue. */
static void queue_remove(rt_router *r, rt_req *q)
{
    for (rt_req **pp = &r->queue_head; *pp; pp = &(*pp)->next_queued)
        if (*pp == q) {
            *pp = q->next_queued;
            break;
        }
    r->queue_tail = NULL;
    for (rt_req *x = r->queue_head; x; x = x->next_queued)
        r->queue_tail = x;
    r->queued--;
    q->queued = false;
}

static void on_timeout(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    rt_req *q = arg;
    rt_router *r = q->r;
    if (q->queued) {
        /* still waiting for a slot */
        queue_remove(r, q);
        r->timed_out_408++;
        reply_error(q, 408, "timeout",
                    "the request waited %.0f s for a free slot (--max-concurrent-requests)",
                    r->cfg.queue_timeout_s);
    } else {
        r->timeouts_504++;
        reply_error(q, 504, "gateway_timeout",
                    "no complete answer within %.0f s (--request-timeout-secs)",
                    r->cfg.request_timeout_s);
        req_end_legs(q);
    }
    req_maybe_free(q);
}

static void begin(rt_req *q);

/* Start queued requests while slots are free. One that ends at once (no worker to take
 * it: begin() answered it) is freed at once, giving its slot back: otherwise it kept the
 * slot until its request timer fired. */
static void admit_next(rt_router *r)
{
    if (r->admitting) return; /* req_free below calls back here; this loop goes on */
    r->admitting = true;
    while (r->queue_head &&
           (r->cfg.max_concurrent_requests <= 0 || r->active < r->cfg.max_concurrent_requests)) {
        rt_req *q = r->queue_head;
        r->queue_head = q->next_queued;
        if (!r->queue_head) r->queue_tail = NULL;
        r->queued--;
        q->queued = false;
        event_del(q->timer);
        begin(q);
        req_maybe_free(q);
    }
    r->admitting = false;
}

static void req_free(rt_req *q)
{
    rt_router *r = q->r;
    /* A prefill's KV that no decode read in full (every decode failed, the client left,
     * the request timed out): give it back now rather than when its lease expires. */
    if (q->held_tid[0] && !q->dec_ok && !r->shutting_down) rt_worker_release_kv(r, q->held_url, q->held_tid);
    if (q->admitted) {
        r->active--;
        q->admitted = false;
    }
    if (q->client) { /* never answered (shutdown) */
        client_detach(q);
    }
    unwatch(q);
    if (q->prev_live)
        q->prev_live->next_live = q->next_live;
    else
        r->reqs = q->next_live;
    if (q->next_live) q->next_live->prev_live = q->prev_live;
    if (q->timer) event_free(q->timer);
    if (q->retry_ev) event_free(q->retry_ev);
    for (rt_leg *l = &q->pre; l <= &q->dec; l++) {
        free(l->payload);
        if (l->body) evbuffer_free(l->body);
    }
    cJSON_Delete(q->body);
    free(q->route);
    free(q);
    admit_next(r);
}

/* Free the request once its reply is over and nothing of it runs any more. */
static void req_maybe_free(rt_req *q)
{
    if (!q->finished || q->queued) return;
    if (q->pre.state == LEG_RUNNING || q->dec.state == LEG_RUNNING || q->retry_leg) {
        /* write mode: the prefill may still run after the decode's answer ended: it ends
         * by itself (its KV goes back after the lease), but nobody waits for it */
        if (q->pre.state == LEG_RUNNING && q->dec.state != LEG_RUNNING && !q->retry_leg &&
            !prefill_answer_arriving(q))
            leg_cancel(q, &q->pre);
        else
            return;
    }
    req_free(q);
}

/* idx2idx: the i-th prefill pairs with the i-th decode (in the order given or registered);
 * set from the prefill that holds the request's KV (the first pick, and again if a retry
 * moved the prefill elsewhere). */
static void pair_with(rt_req *q, const rt_worker *p)
{
    rt_router *r = q->r;
    if (strcmp(r->cfg.rank_mapping, "idx2idx") || !p) return;
    q->paired_decode = 0;
    int i = 0, k = 0;
    for (rt_worker *x = r->workers; x && x != p; x = x->next)
        i += x->role == RT_ROLE_PREFILL;
    for (rt_worker *x = r->workers; x && !q->paired_decode; x = x->next)
        if (x->role == RT_ROLE_DECODE && k++ == i) q->paired_decode = x->id;
}

static void begin(rt_req *q)
{
    rt_router *r = q->r;
    q->admitted = true;
    r->active++;
    struct timeval tv = {(time_t)r->cfg.request_timeout_s,
                         (suseconds_t)((r->cfg.request_timeout_s -
                                        (double)(time_t)r->cfg.request_timeout_s) *
                                       1e6)};
    event_add(q->timer, &tv);
    if (!r->cfg.pd) {
        char *payload = cJSON_PrintUnformatted(q->body);
        leg_init(q, &q->dec, RT_ROLE_WORKER, true, payload);
        leg_start(q, &q->dec);
        return;
    }
    /* PD with several choices (n > 1, or a batch of prompts): the KV contract moves one
     * prompt's KV for one sequence, so a decode instance computes the whole request. */
    const cJSON *nn = cJSON_GetObjectItemCaseSensitive(q->body, "n");
    const cJSON *pr = cJSON_GetObjectItemCaseSensitive(q->body, "prompt");
    if ((cJSON_IsNumber(nn) && nn->valuedouble > 1) ||
        (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) > 1 &&
         !cJSON_IsNumber(cJSON_GetArrayItem(pr, 0)))) {
        leg_init(q, &q->dec, RT_ROLE_DECODE, true, body_with_kv(q, NULL));
        leg_start(q, &q->dec);
        return;
    }
    /* PD: the prefill first (its mode decides the pattern). */
    rt_worker *p = rt_pick(r, RT_ROLE_PREFILL, q->route, q->route_len, NULL);
    if (!p) {
        reply_error(q, 503, "service_unavailable", "no healthy prefill instance is available");
        return;
    }
    pair_with(q, p);
    if (p->write_mode) {
        /* Push: both legs at once, with a transfer id drawn here. The decode is told the
         * prefill instance's transfer agent; a retried prefill would need another decode
         * body, so the prefill leg goes to this instance only. */
        q->write_mode = true;
        char tid[33];
        random_hex(r, tid);
        snprintf(q->held_tid, sizeof(q->held_tid), "%s", tid);
        snprintf(q->held_url, sizeof(q->held_url), "%s", p->url);
        leg_init(q, &q->pre, RT_ROLE_PREFILL, false, prefill_body(q, tid));
        q->pre.tries = r->cfg.retry_max_retries + 1; /* no retry elsewhere */
        cJSON *kv = cJSON_CreateObject();
        cJSON_AddBoolToObject(kv, "do_remote_prefill", true);
        cJSON_AddStringToObject(kv, "transfer_mode", "write");
        cJSON_AddStringToObject(kv, "transfer_id", tid);
        cJSON_AddStringToObject(kv, "remote_engine_id", p->engine_id);
        cJSON_AddStringToObject(kv, "remote_host", p->kv_host);
        cJSON_AddNumberToObject(kv, "remote_handshake_port", p->kv_port);
        start_decode_with(q, kv);
        cJSON_Delete(kv);
        if (q->finished) return;
        /* The prefill leg goes to p and nowhere else: the decode was told p's agent. If
         * it fails, the decode recomputes (leg_failed sees no retries left). */
        leg_start_on(q, &q->pre, p);
        return;
    }
    char *payload = prefill_body(q, NULL);
    leg_init(q, &q->pre, RT_ROLE_PREFILL, false, payload);
    q->pre.tries = 1; /* p was picked above: one pick per attempt */
    leg_start_on(q, &q->pre, p);
}

/* ---------------------------------------------------------------- entry */

static void on_client_close(struct evhttp_connection *evcon, void *arg)
{
    rt_req *q = arg;
    evhttp_connection_set_closecb(evcon, NULL, NULL);
    struct evhttp_request *req = q->client;
    q->client = NULL;
    unwatch(q);
    if (req && evhttp_request_get_connection(req) == NULL) evhttp_request_free(req);
    if (!q->finished) {
        q->r->client_disconnects++;
        TD_INFO("router %s: the client hung up; cancelling upstream", q->rid);
    }
    q->finished = true;
    if (q->queued) queue_remove(q->r, q);
    req_end_legs_for_gone_client(q);
    req_maybe_free(q);
}

/* EOF on the client's socket while we wait: it hung up (see server/completion.c). */
static void on_client_readable(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    rt_req *q = arg;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    unwatch(q);
    if (n > 0) return;
    struct evhttp_connection *evcon = q->client ? evhttp_request_get_connection(q->client) : NULL;
    if (evcon) evhttp_connection_free(evcon); /* runs on_client_close */
}

/* The text the policies route on: the prompt, or the chat messages' contents. */
static void route_text(rt_req *q)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(q->body, "prompt");
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(q->body, "messages");
    if (cJSON_IsString(p)) {
        q->route = strdup(p->valuestring);
    } else if (cJSON_IsArray(m)) {
        size_t cap = 256, len = 0;
        char *s = malloc(cap);
        const cJSON *it;
        cJSON_ArrayForEach(it, m)
        {
            const cJSON *c = cJSON_GetObjectItemCaseSensitive(it, "content");
            if (!cJSON_IsString(c) || !s) continue;
            size_t n = strlen(c->valuestring);
            if (len + n + 2 > cap) {
                while (len + n + 2 > cap)
                    cap *= 2;
                char *ns = realloc(s, cap);
                if (!ns) {
                    free(s);
                    s = NULL;
                    continue;
                }
                s = ns;
            }
            memcpy(s + len, c->valuestring, n);
            len += n;
            s[len++] = '\n';
            s[len] = 0;
        }
        if (s) s[len] = 0;
        q->route = s;
    } else if (p) {
        q->route = cJSON_PrintUnformatted(p); /* token ids: their text form */
    }
    q->route_len = q->route ? strlen(q->route) : 0;
}

void rt_relay_start(rt_router *r, struct evhttp_request *req, int endpoint)
{
    r->requests_total++;
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    if (len > r->cfg.max_payload_bytes) {
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "the request body is %zu bytes; the limit is %zu "
                 "(--max-payload-size)",
                 len, r->cfg.max_payload_bytes);
        rt_count_status(r, 413);
        rt_send_error(r, req, 413, "invalid_request_error", msg);
        return;
    }
    char *text = malloc(len + 1);
    if (!text) {
        rt_count_status(r, 500);
        rt_send_error(r, req, 500, "server_error", "out of memory");
        return;
    }
    evbuffer_copyout(in, text, len);
    text[len] = 0;
    /* The same validation, and the same error shapes, as the engines. */
    srv_request parsed;
    srv_error err;
    if (srv_request_parse(&parsed, endpoint == SRV_EP_CHAT ? SRV_EP_CHAT : SRV_EP_COMPLETIONS,
                          text, len, &err)) {
        free(text);
        rt_count_status(r, err.status);
        cJSON *root = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(root, "error");
        cJSON_AddStringToObject(e, "message", err.message);
        cJSON_AddStringToObject(e, "type", err.type ? err.type : "invalid_request_error");
        if (err.param[0])
            cJSON_AddStringToObject(e, "param", err.param);
        else
            cJSON_AddNullToObject(e, "param");
        cJSON_AddNumberToObject(e, "code", err.status);
        char *json = cJSON_PrintUnformatted(root);
        cJSON_Delete(root);
        rt_send_json(r, req, err.status, json ? json : "{}");
        free(json);
        return;
    }
    bool stream = parsed.stream;
    srv_request_free(&parsed);
    rt_req *q = calloc(1, sizeof(*q));
    if (!q) {
        free(text);
        rt_count_status(r, 500);
        rt_send_error(r, req, 500, "server_error", "out of memory");
        return;
    }
    q->r = r;
    q->n = ++r->next_req;
    q->client = req;
    q->endpoint = endpoint;
    q->path = endpoint == SRV_EP_CHAT ? "/v1/chat/completions" : "/v1/completions";
    q->stream = stream;
    q->body = cJSON_Parse(text);
    free(text);
    q->t_start = td_now_s();
    /* The client's id where the engines take it too (at most 64 of [A-Za-z0-9._-], as
     * server/completion.c checks): an id one side takes and the other replaces would give
     * one stream two ids. Another gets one drawn here. */
    const char *rid = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Request-Id");
    size_t rid_len = rid ? strlen(rid) : 0;
    if (rid_len >= 1 && rid_len <= 64 &&
        strspn(rid, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") == rid_len)
        snprintf(q->rid, sizeof(q->rid), "%s", rid);
    else
        snprintf(q->rid, sizeof(q->rid), "rt-%llx-%llu", (unsigned long long)td_rng_next(&r->rng),
                 (unsigned long long)q->n);
    route_text(q);
    q->timer = event_new(r->base, -1, 0, on_timeout, q);
    q->retry_ev = event_new(r->base, -1, 0, on_retry, q);
    q->next_live = r->reqs;
    if (r->reqs) r->reqs->prev_live = q;
    r->reqs = q;
    if (!q->body || !q->timer || !q->retry_ev) {
        reply_error(q, 500, "server_error", "out of memory");
        req_free(q);
        return;
    }
    struct evhttp_connection *evcon = evhttp_request_get_connection(req);
    evhttp_connection_set_closecb(evcon, on_client_close, q);
    struct bufferevent *bev = evhttp_connection_get_bufferevent(evcon);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd >= 0) {
        /* Relayed SSE events are small writes: without this, Nagle holds each one until
         * the client's delayed ACK (40 ms). */
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        q->watch = event_new(r->base, fd, EV_READ | EV_PERSIST, on_client_readable, q);
        if (q->watch) event_add(q->watch, NULL);
    }
    if (r->cfg.max_concurrent_requests > 0 && r->active >= r->cfg.max_concurrent_requests) {
        if (r->queued >= r->cfg.queue_size) {
            r->rejected_429++;
            reply_error(q, 429, "rate_limit_exceeded",
                        "too many requests: %d running and %d queued (--queue-size)", r->active,
                        r->queued);
            req_free(q);
            return;
        }
        q->queued = true;
        r->queued++;
        if (r->queue_tail)
            r->queue_tail->next_queued = q;
        else
            r->queue_head = q;
        r->queue_tail = q;
        struct timeval tv = {(time_t)r->cfg.queue_timeout_s,
                             (suseconds_t)((r->cfg.queue_timeout_s -
                                            (double)(time_t)r->cfg.queue_timeout_s) *
                                           1e6)};
        event_add(q->timer, &tv);
        return;
    }
    begin(q);
    req_maybe_free(q);
}

void rt_relay_shutdown(rt_router *r)
{
    r->shutting_down = true; /* no KV releases from here: the leases expire */
    while (r->reqs) {
        rt_req *q = r->reqs;
        if (q->queued) {
            q->queued = false;
            r->queued--;
        }
        reply_error(q, 503, "service_unavailable", "the router is shutting down");
        req_end_legs(q);
        req_free(q);
    }
    r->queue_head = r->queue_tail = NULL;
}

int rt_relay_count(const rt_router *r)
{
    int n = 0;
    for (const rt_req *q = r->reqs; q; q = q->next_live)
        n++;
    return n;
}
