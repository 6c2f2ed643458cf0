/*
 * server/completion.c - POST /v1/completions and /v1/chat/completions.
 *
 * A request object (srv__req) lives until two things are both true: its HTTP side is
 * finished (the reply was sent, or the client went away) and the engine has reported
 * the final output of every choice. So the engine thread may hold the object's
 * address as an opaque tag without it ever dangling. A client that disconnects gets
 * its requests aborted through the inbox, which frees their KV blocks at the next
 * engine iteration.
 *
 * Streaming: SSE chunks produced by one engine step are gathered per request and
 * written with one evhttp_send_reply_chunk, so each step costs each stream one write.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <math.h>
#include <stdio.h>
#include <sys/socket.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>

#include "model/tok.h"
#include "server/server_impl.h"

typedef struct srv__choice {
    int prompt_index;
    bool first_of_prompt;  /* counts the prompt's tokens in usage */
    struct evbuffer *text; /* non-streaming: the whole text */
    /* logprobs, as comma-separated JSON items: completions use all four (tokens,
     * token_logprobs, top_logprobs, text_offset), chat only lp[0] (content entries) */
    struct evbuffer *lp[4];
    size_t text_offset;
    int n_prompt, n_cached, n_gen;
    td_finish finish;
    bool done;
    double t_first, t_last, t_queue;
} srv__choice;

typedef struct srv__req {
    srv_server *s;
    struct evhttp_request *req; /* NULL once the client is gone or the reply is sent */
    srv_request r;
    srv__choice *ch;
    int n_choices, outstanding;
    bool started, failed, touched;
    srv_error err;
    char id[80];
    long created;
    double t_recv;
    struct evbuffer *pending; /* SSE bytes not yet written */
    struct event *watch;      /* notices the client closing while we have not replied */
    struct srv__req *prev, *next;

    /* Prefill/decode (kv_transfer_params; one choice only). */
    int kv_mode;                /* KV_* below */
    pd_remote remote;           /* consumer: parsed, then moved to the engine thread */
    char kv_reason[200];        /* consumer: why the remote KV is not used ("" if it is) */
    double prod_queue_ms, prod_compute_ms; /* consumer: the producer's timing, if sent */
    char push_id[KVX_ID_HEX];   /* producer in write mode: the router's transfer id */
    bool skip_first;            /* consumer: the router streamed the first token already */
    int32_t first_token;        /* the first generated token */
    /* The first token's text as a stream that goes on emits it (producer: for the router
     * to stream at once; malloc'd), and its log-probabilities (producer: computed here;
     * consumer: the producer's, from kv_transfer_params). */
    char *first_text;
    int first_text_len;
    bool has_first_lp;
    srv__out first_lp;          /* token, logprob, n_top, top_ids, top_logprobs */
    srv__out kv_res;            /* the final output's KV fields (kv_blocks owned here) */
    double t_second;            /* when the second token arrived */
    int rank;                   /* the data-parallel rank that serves it */
} srv__req;

enum { KV_NONE = 0, KV_PRODUCE = 1, KV_CONSUME = 2 };

static const char *finish_name(td_finish f)
{
    return f == TD_FINISH_NONE ? "stop" : td_finish_name(f);
}

static void unwatch(srv__req *q)
{
    if (q->watch) event_free(q->watch);
    q->watch = NULL;
}

static void req_free(srv__req *q)
{
    srv_server *s = q->s;
    unwatch(q);
    if (q->prev)
        q->prev->next = q->next;
    else
        s->live = q->next;
    if (q->next) q->next->prev = q->prev;
    for (int i = 0; i < q->n_choices; i++) {
        if (q->ch[i].text) evbuffer_free(q->ch[i].text);
        for (int k = 0; k < 4; k++)
            if (q->ch[i].lp[k]) evbuffer_free(q->ch[i].lp[k]);
    }
    free(q->ch);
    if (q->pending) evbuffer_free(q->pending);
    srv_request_free(&q->r);
    pd_remote_free(&q->remote);
    free(q->kv_res.kv_blocks);
    free(q->first_text);
    free(q);
}

/* The client went away: abort its engine requests; the object goes when they end. */
static void on_close(struct evhttp_connection *evcon, void *arg)
{
    srv__req *q = arg;
    evhttp_connection_set_closecb(evcon, NULL, NULL);
    unwatch(q);
    struct evhttp_request *req = q->req;
    q->req = NULL;
    /* libevent detaches an unfinished request from a dying connection and leaves it to
     * us; one still attached is freed with the connection. */
    if (req && evhttp_request_get_connection(req) == NULL) evhttp_request_free(req);
    if (q->outstanding > 0) {
        TD_DEBUG("%s: client disconnected, aborting", q->id);
        srv__engine_abort(&q->s->ranks[q->rank].eng, q);
    } else {
        req_free(q);
    }
}

/*
 * While a request waits for its reply, evhttp does not read its connection, so it
 * would notice a client that hung up only when a write fails, and a non-streaming
 * request would run to its end for nobody. So we watch the socket ourselves: EOF (or
 * an error) means the client is gone, and freeing the connection runs on_close, which
 * aborts the request. Pipelined bytes just end the watch.
 */
static void on_readable(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    srv__req *q = arg;
    char c;
    ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    unwatch(q);
    if (r > 0) return;
    struct evhttp_connection *evcon = q->req ? evhttp_request_get_connection(q->req) : NULL;
    if (evcon) evhttp_connection_free(evcon); /* calls on_close */
}

static void watch(srv__req *q, struct evhttp_connection *evcon)
{
    struct bufferevent *bev = evhttp_connection_get_bufferevent(evcon);
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0) return;
    int one = 1; /* SSE chunks are small writes: no Nagle delay behind a delayed ACK */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    q->watch = event_new(q->s->base, fd, EV_READ | EV_PERSIST, on_readable, q);
    if (q->watch) event_add(q->watch, NULL);
}

/* The reply is complete: detach from the connection. */
static void http_done(srv__req *q)
{
    unwatch(q);
    struct evhttp_connection *evcon = evhttp_request_get_connection(q->req);
    if (evcon) evhttp_connection_set_closecb(evcon, NULL, NULL);
    q->req = NULL;
}

/* ---- JSON pieces ---- */

static void lp_add(struct evbuffer *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void lp_add(struct evbuffer *b, const char *fmt, ...)
{
    if (evbuffer_get_length(b)) evbuffer_add(b, ",", 1);
    va_list ap;
    va_start(ap, fmt);
    evbuffer_add_vprintf(b, fmt, ap);
    va_end(ap);
}

static double finite_lp(float v)
{
    return isfinite(v) ? (double)v : -9999.0;
}

static void bytes_json(struct evbuffer *b, const char *p, int n)
{
    evbuffer_add(b, "[", 1);
    for (int i = 0; i < n; i++)
        evbuffer_add_printf(b, i ? ",%u" : "%u", (unsigned char)p[i]);
    evbuffer_add(b, "]", 1);
}

/* n bytes as valid UTF-8 in out (3n bytes at most): each byte that starts no whole
 * character becomes U+FFFD, as srv__json_str writes it; returns the length. */
static size_t utf8_fix(const char *s, size_t n, char *out)
{
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        size_t clen = srv__utf8_char(s + i, n - i);
        if (clen) {
            memcpy(out + w, s + i, clen);
            w += clen;
            i += clen;
        } else {
            memcpy(out + w, "\xEF\xBF\xBD", 3);
            w += 3;
            i++;
        }
    }
    return w;
}

/* Characters (code points) in n bytes of UTF-8: text_offset counts them, as Python's len(). */
static size_t utf8_chars(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* Record one token's log-probabilities into the choice's buffers. */
static void logprobs_record(srv__req *q, srv__choice *c, const srv__out *o)
{
    const td_tokenizer *tok = q->s->tok;
    char piece[TOK_MAX_PIECE + 8];
    int n = tok_piece(tok, o->token, true, piece, sizeof(piece));
    n = n < 0 ? 0 : TD_MIN(n, (int)sizeof(piece));
    int top = TD_MIN(q->r.logprobs, o->n_top);
    for (int k = 0; k < 4; k++)
        if (!c->lp[k]) c->lp[k] = evbuffer_new();
    if (q->r.endpoint == SRV_EP_CHAT) {
        struct evbuffer *b = c->lp[0];
        if (evbuffer_get_length(b)) evbuffer_add(b, ",", 1);
        evbuffer_add(b, "{\"token\":", 9);
        srv__json_str(b, piece, (size_t)n);
        evbuffer_add_printf(b, ",\"logprob\":%.6g,\"bytes\":", finite_lp(o->logprob));
        bytes_json(b, piece, n);
        evbuffer_add(b, ",\"top_logprobs\":[", 17);
        for (int i = 0; i < top; i++) {
            char tp[TOK_MAX_PIECE + 8];
            int m = tok_piece(tok, o->top_ids[i], true, tp, sizeof(tp));
            m = m < 0 ? 0 : TD_MIN(m, (int)sizeof(tp));
            evbuffer_add(b, i ? ",{\"token\":" : "{\"token\":", i ? 10 : 9);
            srv__json_str(b, tp, (size_t)m);
            evbuffer_add_printf(b, ",\"logprob\":%.6g,\"bytes\":", finite_lp(o->top_logprobs[i]));
            bytes_json(b, tp, m);
            evbuffer_add(b, "}", 1);
        }
        evbuffer_add(b, "]}", 2);
        return;
    }
    if (evbuffer_get_length(c->lp[0])) evbuffer_add(c->lp[0], ",", 1);
    srv__json_str(c->lp[0], piece, (size_t)n);
    lp_add(c->lp[1], "%.6g", finite_lp(o->logprob));
    if (evbuffer_get_length(c->lp[2])) evbuffer_add(c->lp[2], ",", 1);
    evbuffer_add(c->lp[2], "{", 1);
    /* An object names each text once: tokens that print alike (byte tokens that are no
     * whole character all print as U+FFFD) keep the first, likelier one, as a dict would
     * (vLLM). Keys are compared as they are written. */
    enum { KEY_CAP = 3 * (TOK_MAX_PIECE + 8) };
    char *keys = malloc((size_t)TD_MAX_LOGPROBS * KEY_CAP);
    int key_len[TD_MAX_LOGPROBS], n_keys = 0;
    for (int i = 0; i < top && keys && n_keys < TD_MAX_LOGPROBS; i++) {
        char tp[TOK_MAX_PIECE + 8];
        int m = tok_piece(tok, o->top_ids[i], true, tp, sizeof(tp));
        m = m < 0 ? 0 : TD_MIN(m, (int)sizeof(tp));
        char *key = keys + (size_t)n_keys * KEY_CAP;
        int len = (int)utf8_fix(tp, (size_t)m, key);
        bool dup = false;
        for (int k = 0; k < n_keys && !dup; k++)
            dup = key_len[k] == len && !memcmp(keys + (size_t)k * KEY_CAP, key, (size_t)len);
        if (dup) continue;
        key_len[n_keys] = len;
        if (n_keys++) evbuffer_add(c->lp[2], ",", 1);
        srv__json_str(c->lp[2], key, (size_t)len);
        evbuffer_add_printf(c->lp[2], ":%.6g", finite_lp(o->top_logprobs[i]));
    }
    free(keys);
    evbuffer_add(c->lp[2], "}", 1);
    /* Where this token's text (as in "tokens") starts: the characters of the tokens before
     * it, as vLLM counts them, whatever text a stop string holds back meanwhile. */
    lp_add(c->lp[3], "%zu", c->text_offset);
    c->text_offset += utf8_chars(piece, (size_t)n);
}

/* Move the recorded logprobs into `b` as the value of a "logprobs" field, or null. */
static void logprobs_drain(srv__req *q, srv__choice *c, struct evbuffer *b)
{
    if (q->r.logprobs < 0 || !c->lp[0]) {
        evbuffer_add(b, "null", 4);
        return;
    }
    if (q->r.endpoint == SRV_EP_CHAT) {
        evbuffer_add(b, "{\"content\":[", 12);
        evbuffer_add_buffer(b, c->lp[0]);
        evbuffer_add(b, "]}", 2);
        return;
    }
    static const char *const names[4] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
    for (int k = 0; k < 4; k++) {
        evbuffer_add_printf(b, "%s\"%s\":[", k ? "," : "{", names[k]);
        evbuffer_add_buffer(b, c->lp[k]);
        evbuffer_add(b, "]", 1);
    }
    evbuffer_add(b, "}", 1);
}

/* ---- kv_transfer_params in responses ---- */

static double ms(double a, double b)
{
    return a > 0 && b > 0 && b >= a ? (b - a) * 1e3 : 0.0;
}

/* The producer's answer: where the prompt's KV is and how to check it (ARCHITECTURE.md
 * section 4), or do_remote_prefill false when nothing is held. */
static cJSON *kv_producer_json(srv__req *q)
{
    srv_server *s = q->s;
    pd_connector *pd = s->ranks[q->rank].pd; /* the agent of the rank that holds the blocks */
    const srv__out *o = &q->kv_res;
    cJSON *k = cJSON_CreateObject();
    cJSON_AddBoolToObject(k, "do_remote_decode", false);
    if (!o->transfer_id[0]) {
        cJSON_AddBoolToObject(k, "do_remote_prefill", false);
        cJSON_AddStringToObject(k, "reason", "the prefill did not complete, so no KV is held");
        return k;
    }
    cJSON_AddBoolToObject(k, "do_remote_prefill", true);
    cJSON_AddStringToObject(k, "transfer_mode", q->push_id[0] ? "write" : "read");
    cJSON_AddStringToObject(k, "remote_engine_id", pd_engine_id(pd));
    cJSON_AddStringToObject(k, "remote_host", pd_host(pd));
    cJSON_AddNumberToObject(k, "remote_handshake_port", pd_port(pd));
    cJSON_AddNumberToObject(k, "remote_port", pd_port(pd));
    cJSON *ids = cJSON_AddArrayToObject(k, "remote_block_ids");
    for (int i = 0; i < o->n_kv_blocks; i++)
        cJSON_AddItemToArray(ids, cJSON_CreateNumber(o->kv_blocks[i]));
    cJSON_AddStringToObject(k, "transfer_id", o->transfer_id);
    cJSON_AddNumberToObject(k, "num_prompt_tokens", o->num_prompt_tokens);
    cJSON_AddNumberToObject(k, "first_token_id", q->first_token);
    /* What the router may stream before the decode starts: not text held back as the
     * start of a stop string, nor a character whose bytes are not all there. */
    cJSON_AddItemToObject(k, "first_token_text",
                          cJSON_CreateString(q->first_text ? q->first_text : ""));
    if (q->has_first_lp) {
        cJSON_AddNumberToObject(k, "first_token_logprob", finite_lp(q->first_lp.logprob));
        cJSON *top = cJSON_AddArrayToObject(k, "first_token_top_logprobs");
        for (int i = 0; i < q->first_lp.n_top; i++) {
            cJSON *pair = cJSON_CreateArray();
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(q->first_lp.top_ids[i]));
            cJSON_AddItemToArray(pair, cJSON_CreateNumber(finite_lp(q->first_lp.top_logprobs[i])));
            cJSON_AddItemToArray(top, pair);
        }
    }
    cJSON_AddNumberToObject(k, "tp_size", s->cfg.tp_size > 0 ? s->cfg.tp_size : 1);
    cJSON_AddNumberToObject(k, "dp_rank", q->rank);
    cJSON_AddNumberToObject(k, "block_size", s->cfg.block_size);
    cJSON_AddStringToObject(k, "kv_dtype", s->kv_dtype);
    char fp[24];
    snprintf(fp, sizeof(fp), "%016llx", (unsigned long long)s->model_fingerprint);
    cJSON_AddStringToObject(k, "model_fingerprint", fp);
    cJSON_AddNumberToObject(k, "lease_ms", pd_lease_ms(pd));
    cJSON *t = cJSON_AddObjectToObject(k, "producer_timing");
    cJSON_AddNumberToObject(t, "queue_ms", ms(o->t_arrival, o->t_first_scheduled));
    cJSON_AddNumberToObject(t, "compute_ms", ms(o->t_first_scheduled, o->t_first_token));
    return k;
}

/* The consumer's echo: do_remote_prefill true, how the KV arrived, and the timing. */
static cJSON *kv_consumer_json(srv__req *q)
{
    const srv__out *o = &q->kv_res;
    cJSON *k = cJSON_CreateObject();
    cJSON_AddBoolToObject(k, "do_remote_prefill", true);
    cJSON_AddStringToObject(k, "transfer_mode", q->remote.push ? "write" : "read");
    if (q->remote.engine_id[0]) cJSON_AddStringToObject(k, "remote_engine_id", q->remote.engine_id);
    const char *how = q->kv_reason[0]                 ? "recomputed"
                      : o->kv_state == SRV__KV_LOADED ? "transferred"
                      : o->kv_state == SRV__KV_RECOMPUTED ? "recomputed"
                      : o->kv_state == SRV__KV_FAILED     ? "failed"
                                                          : "none";
    cJSON_AddStringToObject(k, "kv_load", how);
    if (q->kv_reason[0])
        cJSON_AddStringToObject(k, "kv_load_error", q->kv_reason);
    else if (o->kv_note[0])
        cJSON_AddStringToObject(k, "kv_load_error", o->kv_note);
    if (o->kv_state == SRV__KV_LOADED) {
        cJSON_AddNumberToObject(k, "transferred_blocks", o->kv_info.n_blocks);
        cJSON_AddNumberToObject(k, "cached_blocks", o->kv_blocks_cached);
        cJSON_AddNumberToObject(k, "transferred_bytes", (double)o->kv_info.bytes);
        cJSON_AddNumberToObject(k, "descriptors", o->kv_info.n_descriptors);
    }
    cJSON *t = cJSON_AddObjectToObject(k, "timing");
    bool pushed = q->remote.push && o->kv_state == SRV__KV_LOADED;
    cJSON_AddNumberToObject(t, "producer_queue_ms",
                            pushed ? o->kv_info.prod_queue_ms : q->prod_queue_ms);
    cJSON_AddNumberToObject(t, "producer_compute_ms",
                            pushed ? o->kv_info.prod_compute_ms : q->prod_compute_ms);
    bool loaded = o->t_kv_loaded > 0;
    cJSON_AddNumberToObject(t, "consumer_queue_ms", ms(o->t_arrival, o->t_first_scheduled));
    cJSON_AddNumberToObject(t, "transfer_ms", loaded ? ms(o->t_first_scheduled, o->t_kv_loaded) : 0);
    cJSON_AddNumberToObject(t, "transfer_wire_ms", o->kv_info.seconds * 1e3);
    /* the part of the transfer that the prefill did not hide: in write mode, from the
     * producer's end of prefill to the KV in place; in read mode all of it */
    cJSON_AddNumberToObject(t, "transfer_after_prefill_ms", o->kv_info.tail_seconds * 1e3);
    cJSON_AddNumberToObject(t, "first_decode_step_ms",
                            loaded && q->t_second > 0 ? ms(o->t_kv_loaded, q->t_second) : 0);
    return k;
}

/* Appends ,"kv_transfer_params":{...} when the request carried them. */
static void kv_params_add(srv__req *q, struct evbuffer *b)
{
    if (!q->r.kv_transfer_params) return;
    cJSON *k = q->kv_mode == KV_PRODUCE   ? kv_producer_json(q)
               : q->kv_mode == KV_CONSUME ? kv_consumer_json(q)
                                          : NULL;
    char *text = cJSON_PrintUnformatted(k ? k : q->r.kv_transfer_params);
    if (text) evbuffer_add_printf(b, ",\"kv_transfer_params\":%s", text);
    free(text);
    cJSON_Delete(k);
}

static void chunk_head(srv__req *q, struct evbuffer *b)
{
    evbuffer_add_printf(
        b, "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%ld,\"model\":", q->id,
        q->r.endpoint == SRV_EP_CHAT ? "chat.completion.chunk" : "text_completion", q->created);
    srv__json_str(b, q->s->model_name, strlen(q->s->model_name));
    evbuffer_add(b, ",\"choices\":[", 12);
}

/* One SSE event for a choice: text (may be empty), optional role, finish reason. */
static void chunk(srv__req *q, int index, const char *text, size_t len, bool role, td_finish fin)
{
    struct evbuffer *b = q->pending;
    srv__choice *c = &q->ch[index];
    chunk_head(q, b);
    if (q->r.endpoint == SRV_EP_CHAT) {
        evbuffer_add_printf(b, "{\"index\":%d,\"delta\":{", index);
        if (role) evbuffer_add(b, "\"role\":\"assistant\",", 19);
        if (len || role || fin == TD_FINISH_NONE) {
            evbuffer_add(b, "\"content\":", 10);
            srv__json_str(b, text, len);
        }
        evbuffer_add(b, "},\"logprobs\":", 13);
    } else {
        evbuffer_add_printf(b, "{\"index\":%d,\"text\":", index);
        srv__json_str(b, text, len);
        evbuffer_add(b, ",\"logprobs\":", 12);
    }
    if (role)
        evbuffer_add(b, "null", 4);
    else
        logprobs_drain(q, c, b);
    if (fin == TD_FINISH_NONE)
        evbuffer_add(b, ",\"finish_reason\":null}]", 23);
    else
        evbuffer_add_printf(b, ",\"finish_reason\":\"%s\"}]", finish_name(fin));
    if (fin != TD_FINISH_NONE) kv_params_add(q, b);
    /* With include_usage, every chunk but the last (the usage chunk) says usage: null. */
    if (q->r.include_usage) evbuffer_add(b, ",\"usage\":null", 13);
    evbuffer_add(b, "}\n\n", 3);
}

static void usage_json(srv__req *q, struct evbuffer *b)
{
    long prompt = 0, gen = 0, cached = 0;
    double ttft = -1, tpot_sum = 0, queue = 0;
    int tpot_n = 0;
    for (int i = 0; i < q->n_choices; i++) {
        srv__choice *c = &q->ch[i];
        if (c->first_of_prompt) {
            prompt += c->n_prompt;
            cached += c->n_cached;
        }
        gen += c->n_gen;
        if (c->n_gen > 0 && (ttft < 0 || c->t_first - q->t_recv < ttft))
            ttft = c->t_first - q->t_recv;
        if (c->n_gen > 1) {
            tpot_sum += (c->t_last - c->t_first) / (c->n_gen - 1);
            tpot_n++;
        }
        queue = TD_MAX(queue, c->t_queue);
    }
    evbuffer_add_printf(
        b,
        "{\"prompt_tokens\":%ld,\"completion_tokens\":%ld,\"total_tokens\":%ld,"
        "\"prompt_tokens_details\":{\"cached_tokens\":%ld},\"timings\":{"
        "\"queue_time_ms\":%.3f,\"ttft_ms\":%.3f,\"tpot_ms\":%.3f,\"e2e_ms\":%.3f}}",
        prompt, gen, prompt + gen, cached, queue * 1e3, ttft < 0 ? 0.0 : ttft * 1e3,
        tpot_n ? tpot_sum / tpot_n * 1e3 : 0.0, (td_now_s() - q->t_recv) * 1e3);
}

/* ---- finishing a request ---- */

static void send_complete(srv__req *q)
{
    srv_server *s = q->s;
    struct evbuffer *b = evbuffer_new();
    bool chat = q->r.endpoint == SRV_EP_CHAT;
    evbuffer_add_printf(b, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%ld,\"model\":", q->id,
                        chat ? "chat.completion" : "text_completion", q->created);
    srv__json_str(b, s->model_name, strlen(s->model_name));
    evbuffer_add(b, ",\"choices\":[", 12);
    for (int i = 0; i < q->n_choices; i++) {
        srv__choice *c = &q->ch[i];
        size_t len = evbuffer_get_length(c->text);
        const char *text = (const char *)evbuffer_pullup(c->text, -1);
        if (chat) {
            evbuffer_add_printf(
                b, "%s{\"index\":%d,\"message\":{\"role\":\"assistant\",\"content\":", i ? "," : "",
                i);
            srv__json_str(b, text ? text : "", len);
            evbuffer_add(b, "},\"logprobs\":", 13);
        } else {
            evbuffer_add_printf(b, "%s{\"index\":%d,\"text\":", i ? "," : "", i);
            srv__json_str(b, text ? text : "", len);
            evbuffer_add(b, ",\"logprobs\":", 12);
        }
        logprobs_drain(q, c, b);
        evbuffer_add_printf(b, ",\"finish_reason\":\"%s\"}", finish_name(c->finish));
    }
    evbuffer_add(b, "],\"usage\":", 10);
    usage_json(q, b);
    kv_params_add(q, b);
    evbuffer_add(b, "}\n", 2);
    evhttp_add_header(evhttp_request_get_output_headers(q->req), "Content-Type",
                      "application/json");
    s->metrics.http_requests[2]++;
    struct evhttp_request *req = q->req;
    http_done(q);
    td_replies_track(&q->s->replies, req);
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
}

static void start_stream(srv__req *q)
{
    struct evkeyvalq *h = evhttp_request_get_output_headers(q->req);
    evhttp_add_header(h, "Content-Type", "text/event-stream");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    q->s->metrics.http_requests[2]++;
    evhttp_send_reply_start(q->req, 200, "OK");
    q->started = true;
}

/*
 * Send an SSE chunk and write it now. evhttp arms the connection's write event and writes on
 * the next pass of the loop, then disarms it: two epoll_ctl calls per event on every stream,
 * a fifth of the I/O thread's time at one event per token. Written here instead, the chunk
 * usually leaves at once, and disarming the event in the same pass cancels the arming in
 * libevent's change list, so epoll is never told. A chunk the socket does not take whole
 * stays armed and is finished by the loop as before. (No callback waits on a chunk's write:
 * only evhttp_send_reply_end's does, and it is not sent this way.)
 */
static void send_chunk_now(struct evhttp_request *req, struct evbuffer *data)
{
    evhttp_send_reply_chunk(req, data);
    struct evhttp_connection *evcon = evhttp_request_get_connection(req);
    struct bufferevent *bev = evcon ? evhttp_connection_get_bufferevent(evcon) : NULL;
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    if (fd < 0) return;
    struct evbuffer *out = bufferevent_get_output(bev);
    while (evbuffer_get_length(out) > 0 && evbuffer_write(out, fd) > 0) {
    }
    if (evbuffer_get_length(out) == 0) bufferevent_disable(bev, EV_WRITE);
}

/* Write what a step produced for this request, and finish it when it is done. */
static void flush(srv__req *q)
{
    q->touched = false;
    if (!q->req) {
        if (q->outstanding == 0) {
            /* A producer whose client left while the prefill's last step ran: the abort
             * came too late, and the blocks went under a lease whose transfer id nobody
             * will ever learn. End it now rather than when the lease expires. (In write
             * mode the router knows the id and releases it.) */
            if (q->kv_mode == KV_PRODUCE && !q->push_id[0] && q->kv_res.transfer_id[0] &&
                q->s->ranks[q->rank].pd)
                pd_cancel(q->s->ranks[q->rank].pd, q->kv_res.transfer_id);
            req_free(q);
        }
        return;
    }
    if (q->failed) {
        if (q->outstanding > 0) return; /* the other choices are being aborted */
        if (!q->started) {
            struct evhttp_request *req = q->req;
            http_done(q);
            srv__send_error(q->s, req, &q->err);
        } else {
            evbuffer_drain(q->pending, evbuffer_get_length(q->pending));
            evbuffer_add_printf(q->pending, "data: {\"error\":{\"message\":");
            srv__json_str(q->pending, q->err.message, strlen(q->err.message));
            evbuffer_add_printf(q->pending,
                                ",\"type\":\"%s\",\"param\":null,\"code\":%d}}\n\n"
                                "data: [DONE]\n\n",
                                q->err.type, q->err.status);
            evhttp_send_reply_chunk(q->req, q->pending);
            struct evhttp_request *req = q->req;
            http_done(q);
            td_replies_track(&q->s->replies, req);
            evhttp_send_reply_end(req);
        }
        req_free(q);
        return;
    }
    if (!q->r.stream) {
        if (q->outstanding == 0) {
            send_complete(q);
            req_free(q);
        }
        return;
    }
    if (!q->started) start_stream(q);
    if (q->outstanding == 0) {
        if (q->r.include_usage) {
            chunk_head(q, q->pending);
            evbuffer_add(q->pending, "],\"usage\":", 10);
            usage_json(q, q->pending);
            evbuffer_add(q->pending, "}\n\n", 3);
        }
        evbuffer_add(q->pending, "data: [DONE]\n\n", 14);
    }
    if (evbuffer_get_length(q->pending)) {
        if (q->outstanding == 0)
            evhttp_send_reply_chunk(q->req, q->pending); /* evhttp_send_reply_end follows */
        else
            send_chunk_now(q->req, q->pending);
    }
    if (q->outstanding == 0) {
        struct evhttp_request *req = q->req;
        http_done(q);
        td_replies_track(&q->s->replies, req);
        evhttp_send_reply_end(req);
        req_free(q);
    }
}

/* A disaggregated request (one choice) keeps its final output's KV fields for the
 * response's kv_transfer_params; before the final chunk is written. */
static void kv_capture(srv__req *q, srv__out *o)
{
    if (q->kv_mode == KV_NONE) return;
    free(q->kv_res.kv_blocks);
    q->kv_res = *o;
    q->kv_res.text = q->kv_res.error = NULL;
    o->kv_blocks = NULL; /* owned by q now */
}

static void choice_finished(srv_server *s, srv__req *q, srv__choice *c, srv__out *o)
{
    c->done = true;
    c->finish = o->finish;
    c->n_prompt = o->num_prompt_tokens;
    c->n_cached = o->num_cached_tokens;
    if (o->t_first_scheduled > 0 && o->t_arrival > 0)
        c->t_queue = o->t_first_scheduled - o->t_arrival;
    q->outstanding--;
    s->outstanding--;
    s->ranks[q->rank].outstanding--;
    srv__metrics *m = &s->metrics;
    if ((unsigned)o->finish < 5) m->finished[o->finish]++;
    if (c->first_of_prompt) m->prompt_tokens += (uint64_t)c->n_prompt;
    double now = td_now_s();
    if (c->n_gen > 0) srv__hist_observe(&m->ttft, c->t_first - q->t_recv);
    if (c->n_gen > 1) srv__hist_observe(&m->tpot, (c->t_last - c->t_first) / (c->n_gen - 1));
    if (o->t_first_scheduled > 0) srv__hist_observe(&m->queue, c->t_queue);
    srv__hist_observe(&m->e2e, now - q->t_recv);
}

/* A producer keeps its first token's streamable text and log-probabilities for its
 * kv_transfer_params (kv_producer_json). */
static void first_token_seen(srv__req *q, const srv__out *o)
{
    if (q->kv_mode != KV_PRODUCE) return;
    int n = o->text_len - o->text_flush_len;
    free(q->first_text);
    q->first_text = malloc((size_t)n + 1);
    if (q->first_text) {
        memcpy(q->first_text, o->text, (size_t)n);
        q->first_text[n] = 0;
        q->first_text_len = n;
    }
    if (q->r.logprobs < 0) return;
    q->has_first_lp = true;
    q->first_lp.logprob = o->logprob;
    q->first_lp.n_top = TD_MIN(q->r.logprobs, o->n_top);
    memcpy(q->first_lp.top_ids, o->top_ids, sizeof(o->top_ids));
    memcpy(q->first_lp.top_logprobs, o->top_logprobs, sizeof(o->top_logprobs));
}

void srv__handle_outputs(srv_server *s, srv__out *outs, int n)
{
    /* Requests this batch touched, flushed once each at the end. */
    srv__req **touched = n ? malloc((size_t)n * sizeof(*touched)) : NULL;
    int n_touched = 0;
    for (int i = 0; i < n; i++) {
        srv__out *o = &outs[i];
        srv__req *q = o->user;
        srv__choice *c = &q->ch[o->choice];
        if (!q->touched) {
            q->touched = true;
            if (touched) touched[n_touched++] = q;
        }
        if (o->rejected || o->finish == TD_FINISH_ERROR) {
            if (!q->failed) {
                q->failed = true;
                srv_error_set(&q->err, o->rejected ? 400 : 500,
                              o->rejected ? "invalid_request_error" : "server_error", NULL, "%s",
                              o->error ? o->error : "the engine failed");
                if (q->outstanding > 1) srv__engine_abort(&s->ranks[q->rank].eng, q);
            }
        } else if (o->token >= 0) {
            double now = td_now_s();
            /* the engine's clock is the same monotonic clock as td_now_s */
            if (c->n_gen == 0) {
                c->t_first = o->t_first_token > 0 ? o->t_first_token : now;
                q->first_token = o->token;
                first_token_seen(q, o);
            } else if (c->n_gen == 1) {
                q->t_second = now;
            }
            c->t_last = now;
            c->n_gen = o->num_generated > 0 ? o->num_generated : c->n_gen + 1;
            s->metrics.generation_tokens++;
            if (q->r.logprobs >= 0) {
                srv__out lo;
                const srv__out *src = o;
                if (q->kv_mode == KV_CONSUME && c->n_gen == 1 && q->has_first_lp &&
                    o->token == q->first_lp.token) {
                    /* the producer sampled this token: its log-probabilities came along (a
                     * prompt recomputed here from scratch may have sampled another) */
                    lo = *o;
                    lo.logprob = q->first_lp.logprob;
                    lo.n_top = q->first_lp.n_top;
                    memcpy(lo.top_ids, q->first_lp.top_ids, sizeof(lo.top_ids));
                    memcpy(lo.top_logprobs, q->first_lp.top_logprobs, sizeof(lo.top_logprobs));
                    src = &lo;
                }
                logprobs_record(q, c, src);
            }
        }
        if (o->finish != TD_FINISH_NONE) kv_capture(q, o);
        if (!q->failed) {
            if (q->r.stream) {
                /* one chunk per token, even when its text is still incomplete UTF-8,
                 * so that clients see progress (and count tokens) as they happen */
                bool first = q->skip_first && o->token >= 0 && c->n_gen == 1;
                if (first && o->finish == TD_FINISH_NONE && o->text_flush_len == 0) {
                    /* the router streamed this token's text already (the producer's
                     * first_token_text: what a stream emits here, as this one does) */
                } else if (first) { /* and what only the end releases, if it ends here */
                    chunk(q, o->choice, o->text + o->text_len - o->text_flush_len,
                          (size_t)o->text_flush_len, false, o->finish);
                } else if (q->req && (o->token >= 0 || o->finish != TD_FINISH_NONE)) {
                    chunk(q, o->choice, o->text, (size_t)o->text_len, false, o->finish);
                }
            } else if (o->text_len > 0) {
                evbuffer_add(c->text, o->text, (size_t)o->text_len);
            }
        }
        if (o->finish != TD_FINISH_NONE) choice_finished(s, q, c, o);
    }
    for (int i = 0; i < n_touched; i++)
        flush(touched[i]);
    free(touched);
}

/* ---- accepting a request ---- */

/* Tokenize text with BOS as the model says; special tokens are parsed, as HF does. */
static int tokenize(srv_server *s, const char *text, size_t len, int32_t **out, srv_error *err)
{
    int cap = (int)TD_MIN(len + 8, (size_t)INT32_MAX / 8);
    for (int attempt = 0; attempt < 2; attempt++) {
        int32_t *ids = malloc((size_t)cap * sizeof(int32_t));
        if (!ids) return srv_error_set(err, 500, "server_error", "prompt", "out of memory");
        td_err te = {0};
        int n = tok_encode(s->tok, text, len, true, true, ids, cap, &te);
        if (n < 0) {
            free(ids);
            return srv_error_set(err, 400, "invalid_request_error", "prompt",
                                 "cannot tokenize the prompt: %s",
                                 te.msg[0] ? te.msg : td_strerror(n));
        }
        if (n <= cap) {
            *out = ids;
            return n;
        }
        free(ids);
        cap = n;
    }
    return srv_error_set(err, 500, "server_error", "prompt", "tokenizer count mismatch");
}

typedef struct prepared {
    int32_t *ids;
    int n_ids;
    int max_tokens;
    char *echo;
    size_t echo_len;
} prepared;

static void prepared_free(prepared *p, int n)
{
    for (int i = 0; p && i < n; i++) {
        free(p[i].ids);
        free(p[i].echo);
    }
    free(p);
}

static int prepare(srv_server *s, const srv_request *r, prepared **out, int *n_out, srv_error *err)
{
    bool chat = r->endpoint == SRV_EP_CHAT;
    int n = chat ? 1 : r->n_prompts;
    prepared *p = calloc((size_t)n, sizeof(*p));
    if (!p) return srv_error_set(err, 500, "server_error", NULL, "out of memory");
    const char *what = chat ? "messages" : "prompt";
    for (int i = 0; i < n; i++) {
        if (chat) {
            char *text =
                srv_chat_render_ex(s->chat, &s->chat_extras, r->messages, r->n_messages, err);
            if (!text) goto fail;
            int k = tokenize(s, text, strlen(text), &p[i].ids, err);
            free(text);
            if (k < 0) goto fail;
            p[i].n_ids = k;
        } else if (r->prompts[i].text) {
            int k = tokenize(s, r->prompts[i].text, r->prompts[i].text_len, &p[i].ids, err);
            if (k < 0) goto fail;
            p[i].n_ids = k;
            if (r->echo) {
                p[i].echo = malloc(r->prompts[i].text_len + 1);
                if (p[i].echo) memcpy(p[i].echo, r->prompts[i].text, r->prompts[i].text_len + 1);
                p[i].echo_len = r->prompts[i].text_len;
            }
        } else {
            const srv_prompt *pr = &r->prompts[i];
            for (int k = 0; k < pr->n_ids; k++)
                if (pr->ids[k] >= s->n_vocab) {
                    srv_error_set(err, 400, "invalid_request_error", "prompt",
                                  "token id %d at position %d of prompt %d is outside the "
                                  "vocabulary (size %d)",
                                  pr->ids[k], k, i, s->n_vocab);
                    goto fail;
                }
            p[i].ids = malloc((size_t)pr->n_ids * sizeof(int32_t));
            if (!p[i].ids) goto oom;
            memcpy(p[i].ids, pr->ids, (size_t)pr->n_ids * sizeof(int32_t));
            p[i].n_ids = pr->n_ids;
            if (r->echo) {
                int need = tok_decode(s->tok, pr->ids, pr->n_ids, true, NULL, 0);
                if (need >= 0) {
                    p[i].echo = malloc((size_t)need + 1);
                    if (p[i].echo)
                        tok_decode(s->tok, pr->ids, pr->n_ids, true, p[i].echo, need + 1);
                    p[i].echo_len = (size_t)need;
                }
            }
        }
        if (p[i].n_ids < 1) {
            srv_error_set(err, 400, "invalid_request_error", what, "the prompt is empty");
            goto fail;
        }
        int room = s->max_model_len - p[i].n_ids;
        int mt = r->max_tokens > 0 ? r->max_tokens : chat ? room : TD_MIN(16, room);
        if (room < 1 || p[i].n_ids + mt > s->max_model_len) {
            srv_error_set(err, 400, "invalid_request_error",
                          r->max_tokens > 0 ? "max_tokens" : what,
                          "This model's maximum context length is %d tokens. However, you "
                          "requested %d tokens (%d in the %s, %d for the completion). Please "
                          "reduce the length of the %s or the completion.",
                          s->max_model_len, p[i].n_ids + TD_MAX(mt, 1), p[i].n_ids, what,
                          TD_MAX(mt, 1), what);
            goto fail;
        }
        p[i].max_tokens = mt;
    }
    *out = p;
    *n_out = n;
    return 0;
oom:
    srv_error_set(err, 500, "server_error", NULL, "out of memory");
fail:
    prepared_free(p, n);
    return TD_EINVAL;
}

/* ---- kv_transfer_params in requests ---- */

/*
 * Decide what kv_transfer_params ask of this request (parsed by srv_kv_params_parse:
 * malformed fields are a 400). do_remote_decode: this server is the producer (hold the
 * prompt's KV). do_remote_prefill: this server is the consumer, and the producer's
 * layout and prompt length must match this engine's; a mismatch follows the failure
 * policy: recompute (the request runs here from scratch, the response says why) or fail.
 */
static int kv_prepare(srv_server *s, srv__req *q, const prepared *p, int n_choices, srv_error *err)
{
    if (!q->r.kv_transfer_params) return 0;
    const char *P = "kv_transfer_params";
    srv_kv_params kp;
    if (srv_kv_params_parse(&kp, q->r.kv_transfer_params, s->n_vocab, err)) return TD_EINVAL;
    int rc = 0;
    if (!kp.decode && !kp.prefill) goto out; /* echoed as given */
    if (n_choices != 1) {
        rc = srv_error_set(err, 400, "invalid_request_error", P,
                           "a disaggregated request must have one prompt and n = 1 (it has "
                           "%d choices)",
                           n_choices);
        goto out;
    }
    if (kp.decode) {
        if (!s->kv_producer)
            rc = srv_error_set(err, 400, "invalid_request_error", P,
                               "do_remote_decode: this server is not a KV producer (start it "
                               "with --kv-transfer-config '{\"kv_role\":\"kv_producer\"}')");
        else
            q->kv_mode = KV_PRODUCE;
        if (!rc && kp.write) memcpy(q->push_id, kp.transfer_id, KVX_ID_HEX);
        goto out;
    }
    if (!s->kv_consumer) {
        rc = srv_error_set(err, 400, "invalid_request_error", P,
                           "do_remote_prefill: this server is not a KV consumer (start it "
                           "with --kv-transfer-config '{\"kv_role\":\"kv_consumer\"}')");
        goto out;
    }
    q->kv_mode = KV_CONSUME;
    q->skip_first = kp.first_token_streamed && q->r.stream;
    pd_remote *r = &q->remote;
    snprintf(r->host, sizeof(r->host), "%s", kp.host);
    r->port = (uint16_t)kp.port;
    memcpy(r->engine_id, kp.engine_id, KVX_ID_HEX);
    memcpy(r->transfer_id, kp.transfer_id, KVX_ID_HEX);
    r->blocks = kp.blocks; /* moved */
    r->n_blocks = kp.n_blocks;
    kp.blocks = NULL;
    r->lease_ms = kp.lease_ms > 0 ? (uint32_t)kp.lease_ms : 0;
    r->push = kp.write;
    q->first_token = kp.first_token; /* -1 in write mode: it comes with the KV */
    q->prod_queue_ms = kp.prod_queue_ms;
    q->prod_compute_ms = kp.prod_compute_ms;
    if (kp.has_first_logprob) {
        q->has_first_lp = true;
        q->first_lp.token = kp.first_token;
        q->first_lp.logprob = kp.first_logprob;
        q->first_lp.n_top = kp.n_first_top;
        memcpy(q->first_lp.top_ids, kp.first_top_ids, sizeof(kp.first_top_ids));
        memcpy(q->first_lp.top_logprobs, kp.first_top_logprobs, sizeof(kp.first_top_logprobs));
    }

    /* Compatibility: a mismatch means the transferred KV would be wrong. */
    int bs = s->cfg.block_size;
    char ours[24];
    snprintf(ours, sizeof(ours), "%016llx", (unsigned long long)s->model_fingerprint);
    char *why = q->kv_reason;
    size_t cap = sizeof(q->kv_reason);
    if (kp.num_prompt_tokens != p[0].n_ids && !(kp.write && kp.num_prompt_tokens < 0))
        snprintf(why, cap,
                 "the producer's prompt had %d tokens, this server tokenizes it to %d "
                 "(different model or tokenizer?)",
                 kp.num_prompt_tokens, p[0].n_ids);
    else if (kp.block_size > 0 && kp.block_size != bs)
        snprintf(why, cap, "block_size differs: producer %d, consumer %d", kp.block_size, bs);
    else if (kp.kv_dtype[0] && strcmp(kp.kv_dtype, s->kv_dtype))
        snprintf(why, cap, "kv_dtype differs: producer %s, consumer %s", kp.kv_dtype, s->kv_dtype);
    else if (kp.fingerprint[0] && strcmp(kp.fingerprint, ours))
        snprintf(why, cap, "model_fingerprint differs: producer %s, consumer %s", kp.fingerprint,
                 ours);
    else if (!r->push && r->n_blocks != (p[0].n_ids + bs - 1) / bs)
        snprintf(why, cap, "the producer sent %d block ids for %d prompt tokens (block size %d)",
                 r->n_blocks, p[0].n_ids, bs);
    if (!why[0]) goto out;
    pd_release_remote(s->ranks[q->rank].pd, r); /* the producer's blocks are of no use here */
    if (!s->kv_recompute)
        rc = srv_error_set(err, 400, "invalid_request_error", P,
                           "cannot use the producer's KV: %s (kv_load_failure_policy is fail)",
                           why);
    else
        TD_WARN("%s: recomputing the prompt: %s", q->id, why);
out:
    srv_kv_params_free(&kp);
    return rc;
}

static void fill_sampling(const srv_request *r, int sample_index, int max_tokens, td_sampling *sp)
{
    td_sampling_default(sp);
    sp->temperature = (float)r->temperature;
    sp->top_p = (float)r->top_p;
    sp->top_k = r->top_k;
    sp->min_p = (float)r->min_p;
    sp->max_tokens = max_tokens;
    sp->ignore_eos = r->ignore_eos;
    sp->stop = (const char *const *)r->stop;
    sp->n_stop = r->n_stop;
    if (r->has_seed) {
        /* n > 1: distinct but reproducible seeds for the choices of one prompt */
        sp->has_seed = true;
        sp->seed = r->seed + (uint64_t)sample_index * 0x9E3779B97F4A7C15ull;
    }
    sp->logprobs = r->logprobs < 0 ? 0 : TD_MAX(1, r->logprobs);
    sp->presence_penalty = (float)r->presence_penalty;
    sp->frequency_penalty = (float)r->frequency_penalty;
    sp->repetition_penalty = (float)r->repetition_penalty;
    sp->logit_bias_ids = r->logit_bias_ids;
    sp->logit_bias = r->logit_bias;
    sp->n_logit_bias = r->n_logit_bias;
}

/* A request without data_parallel_rank goes to the live rank with the fewest requests in
 * flight (the lowest index among equals); rank 0 when none is live (it then answers 503). */
static int pick_rank(const srv_server *s)
{
    int best = -1;
    for (int r = 0; r < s->n_ranks; r++) {
        if (srv__engine_stopped(&s->ranks[r].eng, NULL, 0)) continue;
        if (best < 0 || s->ranks[r].outstanding < s->ranks[best].outstanding) best = r;
    }
    return best < 0 ? 0 : best;
}

void srv__handle_generate(srv_server *s, struct evhttp_request *req, srv_endpoint ep)
{
    srv_error err;
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *body = len ? (const char *)evbuffer_pullup(in, -1) : "";
    srv__req *q = calloc(1, sizeof(*q));
    if (!q) {
        srv_error_set(&err, 500, "server_error", NULL, "out of memory");
        srv__send_error(s, req, &err);
        return;
    }
    if (len > s->cfg.max_body_size) {
        /* evhttp's own limit is higher (see http.c), so that most oversized bodies get
         * an OpenAI-shaped error rather than libevent's HTML page. */
        free(q);
        srv_error_set(&err, 413, "invalid_request_error", NULL,
                      "the request body is %zu bytes; the limit is %zu (--max-body-size)", len,
                      s->cfg.max_body_size);
        srv__send_error(s, req, &err);
        return;
    }
    if (srv_request_parse(&q->r, ep, body, len, &err)) {
        free(q);
        srv__send_error(s, req, &err);
        return;
    }
    char reason[160];
    if (q->r.model && strcmp(q->r.model, s->model_name) != 0) {
        srv_error_set(&err, 404, "not_found_error", "model",
                      "The model `%.100s` does not exist "
                      "(this server serves `%.100s`).",
                      q->r.model, s->model_name);
        goto reject;
    }
    if (s->draining) {
        srv_error_set(&err, 503, "service_unavailable", NULL,
                      "the server is shutting down: it takes no new requests");
        goto reject;
    }
    if (q->r.dp_rank >= s->n_ranks) {
        srv_error_set(&err, 400, "invalid_request_error", "data_parallel_rank",
                      "'data_parallel_rank' is %d, but this server has %d data-parallel rank%s (0..%d)",
                      q->r.dp_rank, s->n_ranks, s->n_ranks == 1 ? "" : "s", s->n_ranks - 1);
        goto reject;
    }
    q->rank = q->r.dp_rank >= 0 ? q->r.dp_rank : pick_rank(s);
    if (srv__engine_stopped(&s->ranks[q->rank].eng, reason, sizeof(reason))) {
        if (s->n_ranks > 1)
            srv_error_set(&err, 503, "service_unavailable", NULL,
                          "the engine loop of data-parallel rank %d has stopped: %s", q->rank, reason);
        else
            srv_error_set(&err, 503, "service_unavailable", NULL, "the engine loop has stopped: %s", reason);
        goto reject;
    }
    prepared *p = NULL;
    int n_prompts = 0;
    if (prepare(s, &q->r, &p, &n_prompts, &err)) goto reject;
    int n_choices = n_prompts * q->r.n;
    /* A router's X-Request-Id names the response, so that both legs of a disaggregated
     * request (and what the router streams itself) carry the same id. */
    const char *rid = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Request-Id");
    bool rid_ok = rid && rid[0] && strlen(rid) <= 64;
    for (const char *c = rid; rid_ok && *c; c++)
        rid_ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
                 *c == '-' || *c == '_' || *c == '.';
    if (rid_ok)
        snprintf(q->id, sizeof(q->id), "%s-%s", ep == SRV_EP_CHAT ? "chatcmpl" : "cmpl", rid);
    else
        snprintf(q->id, sizeof(q->id), "%s-%llx%06llx", ep == SRV_EP_CHAT ? "chatcmpl" : "cmpl",
                 (unsigned long long)time(NULL), (unsigned long long)++s->next_id);
    if (kv_prepare(s, q, p, n_choices, &err)) {
        prepared_free(p, n_prompts);
        goto reject;
    }
    if (n_choices > s->max_num_seqs + s->cfg.max_queue) { /* never, not "later" */
        prepared_free(p, n_prompts);
        srv_error_set(&err, 400, "invalid_request_error", "n",
                      "the request has %d sequences (prompts x n); this server takes at most %d "
                      "at once (--max-num-seqs %d + --max-queue %d)",
                      n_choices, s->max_num_seqs + s->cfg.max_queue, s->max_num_seqs,
                      s->cfg.max_queue);
        goto reject;
    }
    if (s->outstanding + n_choices > s->max_num_seqs + s->cfg.max_queue) {
        prepared_free(p, n_prompts);
        s->metrics.rejected_queue_full++;
        srv_error_set(&err, 429, "rate_limit_error", NULL,
                      "the server is busy: %d requests in flight and the waiting queue is full "
                      "(--max-queue %d); retry later",
                      s->outstanding, s->cfg.max_queue);
        goto reject;
    }
    q->s = s;
    q->req = req;
    q->n_choices = n_choices;
    q->outstanding = 0;
    q->ch = calloc((size_t)n_choices, sizeof(srv__choice));
    q->pending = evbuffer_new();
    q->t_recv = td_now_s();
    q->created = (long)time(NULL);
    q->next = s->live;
    if (s->live) s->live->prev = q;
    s->live = q;
    for (int pi = 0; pi < n_prompts; pi++) {
        for (int j = 0; j < q->r.n; j++) {
            int ci = pi * q->r.n + j;
            srv__choice *c = &q->ch[ci];
            c->prompt_index = pi;
            c->first_of_prompt = j == 0;
            c->text = evbuffer_new();
            if (p[pi].echo) {
                if (q->r.stream)
                    chunk(q, ci, p[pi].echo, p[pi].echo_len, false, TD_FINISH_NONE);
                else
                    evbuffer_add(c->text, p[pi].echo, p[pi].echo_len);
                c->text_offset = utf8_chars(p[pi].echo, p[pi].echo_len);
            }
            if (q->r.stream && ep == SRV_EP_CHAT && !q->skip_first) chunk(q, ci, "", 0, true, TD_FINISH_NONE);
        }
    }
    int posted = 0;
    for (int pi = 0; pi < n_prompts; pi++) {
        for (int j = 0; j < q->r.n; j++) {
            td_sampling sp;
            /* A producer samples the first token only; the request's own max_tokens was
             * checked against the context like any other, so that a request the decode
             * would refuse is refused here, before the router streams anything. */
            fill_sampling(&q->r, j, q->kv_mode == KV_PRODUCE ? 1 : p[pi].max_tokens, &sp);
            td_request_kv kv = {.hold = q->kv_mode == KV_PRODUCE};
            bool remote = q->kv_mode == KV_CONSUME && !q->kv_reason[0];
            pd_remote moved = {0};
            if (remote) {
                kv.remote = true;
                kv.first_token = q->first_token;
                moved = q->remote; /* the engine thread owns the block list from here */
                moved.blocks = NULL;
                if (!q->remote.push) {
                    moved.blocks = malloc((size_t)q->remote.n_blocks * sizeof(int32_t));
                    if (moved.blocks)
                        memcpy(moved.blocks, q->remote.blocks,
                               (size_t)q->remote.n_blocks * sizeof(int32_t));
                    else
                        moved.n_blocks = 0, kv.remote = false;
                }
            }
            kv.stream_layers = q->push_id[0] != 0;
            if (srv__engine_add(&s->ranks[q->rank].eng, q, pi * q->r.n + j, q->push_id[0] ? q->push_id : NULL,
                                p[pi].ids, p[pi].n_ids, &sp, &kv, kv.remote ? &moved : NULL) != 0)
                goto posted_fail;
            posted++;
            q->outstanding++;
            s->outstanding++;
            s->ranks[q->rank].outstanding++;
        }
    }
    prepared_free(p, n_prompts);
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), on_close, q);
    watch(q, evhttp_request_get_connection(req));
    return;

posted_fail:
    prepared_free(p, n_prompts);
    /* The engine loop stopped between the check and the post: whatever was posted is
     * answered with rejections; the rest never will be. */
    q->failed = true;
    srv_error_set(&q->err, 503, "service_unavailable", NULL, "the engine loop has stopped");
    if (posted == 0) {
        srv_error e2 = q->err;
        q->req = NULL;
        req_free(q);
        srv__send_error(s, req, &e2);
        return;
    }
    q->n_choices = posted;
    evhttp_connection_set_closecb(evhttp_request_get_connection(req), on_close, q);
    return;

reject:
    srv_request_free(&q->r);
    pd_remote_free(&q->remote);
    free(q);
    srv__send_error(s, req, &err);
}

void srv__free_all_requests(srv_server *s)
{
    while (s->live) {
        srv__req *q = s->live;
        if (q->req) {
            struct evhttp_connection *evcon = evhttp_request_get_connection(q->req);
            if (evcon)
                evhttp_connection_set_closecb(evcon, NULL, NULL);
            else
                evhttp_request_free(q->req);
            q->req = NULL;
        }
        req_free(q);
    }
}

int srv__live_count(const srv_server *s)
{
    int n = 0;
    for (const srv__req *q = s->live; q; q = q->next)
        n++;
    return n;
}
