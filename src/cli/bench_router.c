/*
 * cli/bench_router.c - `tandem bench-router`: the router's own overhead.
 *
 * A stub upstream inside this process (an evhttp server on its own thread) answers every
 * streamed completion with a fixed number of canned SSE events as fast as it can, so
 * whatever latency and throughput limits remain belong to the HTTP path, not to a model.
 * A libcurl multi load generator (one thread) runs C streams, each a loop of requests, for
 * a warm-up and then a measured window, twice: as a closed loop (every stream starts its
 * next request at once), which saturates the path and gives its throughput, and paced to
 * --rate requests/s in all, which stays below saturation and gives latency without
 * queueing (a closed loop's latency is mostly C / throughput). All of it runs against two
 * targets, one after the other: straight at the stub ("direct"), and through a `tandem
 * router` child that has the stub as its only worker ("router"). The difference is the
 * router's cost: added time to first byte and total latency at p50 and p99, and the ratio
 * of relayed SSE events per second.
 *
 * The router is pinned to one CPU (--router-cpu), and the load generator and the stub to
 * the others, so that on a small machine the router's figures are what one core of it can
 * do. The direct run uses the same pinning, so both runs see the same client. Targets (not
 * asserted, this is a benchmark): added p50 < 0.5 ms and p99 < 2 ms at 64 streams, and at
 * least 100,000 relayed SSE events/s. A failed request (an HTTP error, or a stream without
 * every event and the final [DONE]) makes the exit status 1.
 *
 *   tandem bench-router                       # direct, then through a spawned router
 *   tandem bench-router --direct-only --duration-secs 2
 *   tandem bench-router --stub-port 18080 --router-url http://127.0.0.1:8000
 */
#include <curl/curl.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/http.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "util/td.h"

#define MAX_SAMPLES (16u << 20) /* latency samples kept per run; more are counted only */
#define MAX_ERRORS_SHOWN 5

typedef struct bench_opts {
    int concurrency;   /* streams in flight at once */
    int num_tokens;    /* token events per streamed answer */
    double warmup_s;   /* not measured */
    double duration_s; /* measured window, when num_requests is 0 */
    long num_requests; /* measured requests; 0 = run for duration_s */
    double rate;       /* requests/s of the paced latency runs; 0 = none */
} bench_opts;

/* ---- the stub upstream ---------------------------------------------------------------- */

typedef struct stub {
    struct event_base *base;
    struct evhttp *http;
    struct event *stop_event;
    int stop_fds[2]; /* a byte written to [1] breaks the loop: the only cross-thread call */
    pthread_t thread;
    int port;
    int num_tokens;
    /* Pre-rendered events, "data: {...}\n\n": a token chunk and the last one (finish_reason
     * "length"), for /v1/completions [0] and /v1/chat/completions [1]. */
    char *chunk[2], *last_chunk[2];
    size_t chunk_len[2], last_chunk_len[2];
} stub;

static const char *const stub_chunk_fmt[2] = {
    "data: {\"id\":\"cmpl-stub\",\"object\":\"text_completion\",\"created\":0,\"model\":\"stub\","
    "\"choices\":[{\"index\":0,\"text\":\" tok\",\"logprobs\":null,\"finish_reason\":%s}]}\n\n",
    "data: {\"id\":\"chatcmpl-stub\",\"object\":\"chat.completion.chunk\",\"created\":0,"
    "\"model\":\"stub\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok\"},"
    "\"logprobs\":null,\"finish_reason\":%s}]}\n\n",
};

static char *render(const char *fmt, const char *arg, size_t *len)
{
    int n = snprintf(NULL, 0, fmt, arg);
    char *s = malloc((size_t)n + 1);
    if (!s) return NULL;
    snprintf(s, (size_t)n + 1, fmt, arg);
    *len = (size_t)n;
    return s;
}

static void stub_reply(struct evhttp_request *req, int code, const char *reason,
                       const char *content_type, const char *body)
{
    struct evbuffer *out = evbuffer_new();
    if (body) evbuffer_add(out, body, strlen(body));
    if (content_type)
        evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", content_type);
    evhttp_send_reply(req, code, reason, out);
    evbuffer_free(out);
}

/* True when the JSON request body asks for "stream": true. */
static bool body_wants_stream(struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t len = evbuffer_get_length(in);
    const char *data = (const char *)evbuffer_pullup(in, (ssize_t)len);
    if (!data) return false;
    cJSON *j = cJSON_ParseWithLength(data, len);
    bool stream = j && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "stream"));
    cJSON_Delete(j);
    return stream;
}

/* Every event goes out as its own HTTP chunk, all from this one callback: the stub is as
 * fast as an upstream can be, and the stream is still a real chunked SSE stream. */
static void stub_stream(stub *s, struct evhttp_request *req, int kind)
{
    /* evhttp leaves Nagle on; an upstream that holds back its last segment for the peer's
     * delayed ACK would put 40 ms stalls into the router's figures that are not its own. */
    struct bufferevent *bev = evhttp_connection_get_bufferevent(evhttp_request_get_connection(req));
    evutil_socket_t fd = bev ? bufferevent_getfd(bev) : -1;
    int one = 1;
    if (fd >= 0) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Content-Type", "text/event-stream");
    evhttp_add_header(h, "Cache-Control", "no-cache");
    evhttp_send_reply_start(req, 200, "OK");
    struct evbuffer *out = evbuffer_new();
    for (int i = 0; i < s->num_tokens; i++) {
        if (i + 1 < s->num_tokens)
            evbuffer_add(out, s->chunk[kind], s->chunk_len[kind]);
        else
            evbuffer_add(out, s->last_chunk[kind], s->last_chunk_len[kind]);
        evhttp_send_reply_chunk(req, out); /* moves out's contents */
    }
    evbuffer_add(out, "data: [DONE]\n\n", 14);
    evhttp_send_reply_chunk(req, out);
    evhttp_send_reply_end(req);
    evbuffer_free(out);
}

static void stub_handle(struct evhttp_request *req, void *arg)
{
    stub *s = arg;
    const char *path = evhttp_uri_get_path(evhttp_request_get_evhttp_uri(req));
    enum evhttp_cmd_type method = evhttp_request_get_command(req);
    if (!path) path = "";
    if (method == EVHTTP_REQ_GET && !strcmp(path, "/health")) {
        stub_reply(req, 200, "OK", NULL, NULL);
    } else if (method == EVHTTP_REQ_GET && !strcmp(path, "/kv_transfer_info")) {
        stub_reply(req, 200, "OK", "application/json", "{\"kv_role\":\"none\"}");
    } else if (method == EVHTTP_REQ_GET && !strcmp(path, "/v1/models")) {
        stub_reply(req, 200, "OK", "application/json",
                   "{\"object\":\"list\",\"data\":[{\"id\":\"stub\",\"object\":\"model\","
                   "\"created\":0,\"owned_by\":\"tandem\"}]}");
    } else if (method == EVHTTP_REQ_POST &&
               (!strcmp(path, "/v1/completions") || !strcmp(path, "/v1/chat/completions"))) {
        if (body_wants_stream(req))
            stub_stream(s, req, !strcmp(path, "/v1/chat/completions"));
        else
            stub_reply(req, 400, "Bad Request", "application/json",
                       "{\"error\":{\"message\":\"the stub only streams: send \\\"stream\\\": "
                       "true\",\"type\":\"invalid_request_error\"}}");
    } else {
        stub_reply(req, 404, "Not Found", "application/json",
                   "{\"error\":{\"message\":\"not found\",\"type\":\"not_found\"}}");
    }
}

static void stub_on_stop(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    event_base_loopbreak(((stub *)arg)->base);
}

static void *stub_main(void *arg)
{
    event_base_dispatch(((stub *)arg)->base);
    return NULL;
}

static void stub_free(stub *s)
{
    if (s->http) evhttp_free(s->http);
    if (s->stop_event) event_free(s->stop_event);
    if (s->base) event_base_free(s->base);
    for (int i = 0; i < 2; i++) {
        if (s->stop_fds[i] >= 0) close(s->stop_fds[i]);
        free(s->chunk[i]);
        free(s->last_chunk[i]);
    }
    memset(s, 0, sizeof(*s));
    s->stop_fds[0] = s->stop_fds[1] = -1;
}

/* Listen on 127.0.0.1:port (0: a free one) and serve from a new thread, which inherits the
 * caller's CPU affinity. */
static int stub_start(stub *s, int port, int num_tokens)
{
    memset(s, 0, sizeof(*s));
    s->stop_fds[0] = s->stop_fds[1] = -1;
    s->num_tokens = num_tokens;
    for (int k = 0; k < 2; k++) {
        s->chunk[k] = render(stub_chunk_fmt[k], "null", &s->chunk_len[k]);
        s->last_chunk[k] = render(stub_chunk_fmt[k], "\"length\"", &s->last_chunk_len[k]);
        if (!s->chunk[k] || !s->last_chunk[k]) goto fail;
    }
    if (!(s->base = event_base_new()) || !(s->http = evhttp_new(s->base))) goto fail;
    evhttp_set_gencb(s->http, stub_handle, s);
    evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST);
    struct evhttp_bound_socket *bound =
        evhttp_bind_socket_with_handle(s->http, "127.0.0.1", (ev_uint16_t)port);
    if (!bound) {
        fprintf(stderr, "error: the stub cannot listen on 127.0.0.1:%d: %s\n", port,
                strerror(errno));
        goto fail;
    }
    struct sockaddr_in addr;
    socklen_t addr_len = sizeof(addr);
    if (getsockname(evhttp_bound_socket_get_fd(bound), (struct sockaddr *)&addr, &addr_len))
        goto fail;
    s->port = ntohs(addr.sin_port);
    if (pipe2(s->stop_fds, O_CLOEXEC | O_NONBLOCK)) goto fail;
    s->stop_event = event_new(s->base, s->stop_fds[0], EV_READ, stub_on_stop, s);
    if (!s->stop_event || event_add(s->stop_event, NULL)) goto fail;
    if (pthread_create(&s->thread, NULL, stub_main, s)) goto fail;
    return 0;
fail:
    stub_free(s);
    return -1;
}

static void stub_stop(stub *s)
{
    ssize_t w;
    do
        w = write(s->stop_fds[1], "x", 1);
    while (w < 0 && errno == EINTR);
    pthread_join(s->thread, NULL);
    stub_free(s);
}

/* ---- the load generator --------------------------------------------------------------- */

typedef struct run_result {
    const char *mode;
    double rate; /* requests/s asked for; 0 = a closed loop */
    double window_s;
    long requests; /* completed in the measured window */
    long events;   /* "data: " lines of those requests, [DONE] included */
    long all_requests, failures;
    double *ttfb_ms, *total_ms; /* requests both started and completed in the window */
    size_t num_samples;
    double req_per_s, events_per_s, ttfb_p50, ttfb_p99, total_p50, total_p99;
} run_result;

/* One stream: an easy handle that is re-added for a new request as soon as one ends. */
typedef struct stream {
    CURL *easy;
    double t_next;  /* paced runs: when its next request is due; 0 = in flight or stopped */
    double t_sched; /* paced runs: when the current request was due */
    double t_start, t_first_byte, t_done_line; /* td_now_s(); 0 = not yet */
    long token_events, data_lines;
    bool done, event_after_done;
    int line_len;       /* bytes of the current line so far, '\r' not counted */
    char line_head[12]; /* its first bytes: enough to tell "data: " and "data: [DONE]" */
    char error_body[160];
    size_t error_len;
} stream;

static void sse_end_line(stream *st)
{
    if (st->line_len >= 6 && !memcmp(st->line_head, "data: ", 6)) {
        st->data_lines++;
        if (st->line_len == 12 && !memcmp(st->line_head, "data: [DONE]", 12)) {
            if (!st->done) st->t_done_line = td_now_s();
            st->done = true;
        } else if (st->done) {
            st->event_after_done = true;
        } else {
            st->token_events++;
        }
    }
    st->line_len = 0;
}

/* The body is parsed as it arrives and never kept, apart from a prefix for error messages. */
static size_t on_data(char *p, size_t size, size_t n, void *arg)
{
    stream *st = arg;
    size_t len = size * n;
    if (!st->t_first_byte) st->t_first_byte = td_now_s();
    if (st->error_len < sizeof(st->error_body) - 1) {
        size_t k = sizeof(st->error_body) - 1 - st->error_len;
        if (k > len) k = len;
        memcpy(st->error_body + st->error_len, p, k);
        st->error_len += k;
        st->error_body[st->error_len] = '\0';
    }
    for (size_t i = 0; i < len; i++) {
        char c = p[i];
        if (c == '\n') {
            sse_end_line(st);
        } else if (c != '\r') {
            if (st->line_len < (int)sizeof(st->line_head)) st->line_head[st->line_len] = c;
            if (st->line_len < 1 << 30) st->line_len++;
        }
    }
    return len;
}

static void stream_begin(stream *st, CURLM *multi)
{
    st->t_start = td_now_s();
    st->t_first_byte = st->t_done_line = 0;
    st->token_events = st->data_lines = 0;
    st->done = st->event_after_done = false;
    st->line_len = 0;
    st->error_len = 0;
    st->error_body[0] = '\0';
    curl_multi_add_handle(multi, st->easy);
}

/* Checks one finished request; returns true when it is complete and well formed. */
static bool stream_check(stream *st, CURLcode result, int num_tokens, long *failures)
{
    long code = 0;
    curl_easy_getinfo(st->easy, CURLINFO_RESPONSE_CODE, &code);
    if (st->line_len) sse_end_line(st); /* a last line without its newline */
    const char *why = NULL;
    char detail[96] = "";
    if (result != CURLE_OK) {
        why = curl_easy_strerror(result);
    } else if (code != 200) {
        snprintf(detail, sizeof(detail), "HTTP %ld", code);
        why = detail;
    } else if (!st->done) {
        why = "the stream did not end with data: [DONE]";
    } else if (st->event_after_done) {
        why = "events after data: [DONE]";
    } else if (st->token_events != num_tokens) {
        snprintf(detail, sizeof(detail), "%ld token events, expected %d", st->token_events,
                 num_tokens);
        why = detail;
    }
    if (!why) return true;
    if ((*failures)++ < MAX_ERRORS_SHOWN)
        fprintf(stderr, "request failed: %s; body: %.160s\n", why,
                st->error_len ? st->error_body : "(none)");
    return false;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of n sorted values. */
static double percentile(const double *sorted, size_t n, double q)
{
    if (!n) return NAN;
    size_t rank = (size_t)ceil(q * (double)n);
    return sorted[rank ? rank - 1 : 0];
}

static void finish_stats(run_result *r)
{
    r->req_per_s = r->window_s > 0 ? r->requests / r->window_s : 0;
    r->events_per_s = r->window_s > 0 ? r->events / r->window_s : 0;
    qsort(r->ttfb_ms, r->num_samples, sizeof(double), cmp_double);
    qsort(r->total_ms, r->num_samples, sizeof(double), cmp_double);
    r->ttfb_p50 = percentile(r->ttfb_ms, r->num_samples, 0.50);
    r->ttfb_p99 = percentile(r->ttfb_ms, r->num_samples, 0.99);
    r->total_p50 = percentile(r->total_ms, r->num_samples, 0.50);
    r->total_p99 = percentile(r->total_ms, r->num_samples, 0.99);
}

/*
 * Runs o->concurrency streams against base_url for a warm-up and then the measured window;
 * requests still in flight when the window closes are finished (and checked) but not
 * counted. With rate 0 each stream starts its next request as soon as one ends (a closed
 * loop, which saturates the path and so measures throughput, with queueing in the
 * latencies); with rate > 0 the streams together start rate requests/s, each at most one at
 * a time, which measures latency below saturation. Returns 0, or 1 when any request failed
 * or nothing could be measured.
 */
static int run_load(const char *mode, const char *base_url, const bench_opts *o, double rate,
                    run_result *r)
{
    memset(r, 0, sizeof(*r));
    r->mode = mode;
    r->rate = rate;
    char endpoint[512], body[128];
    snprintf(endpoint, sizeof(endpoint), "%s/v1/completions", base_url);
    snprintf(body, sizeof(body), "{\"prompt\":\"x\",\"max_tokens\":%d,\"stream\":true}",
             o->num_tokens);
    size_t samples_cap = 1 << 16;
    r->ttfb_ms = malloc(samples_cap * sizeof(double));
    r->total_ms = malloc(samples_cap * sizeof(double));
    stream *streams = calloc((size_t)o->concurrency, sizeof(stream));
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    hdr = curl_slist_append(hdr, "Expect:");
    CURLM *multi = curl_multi_init();
    if (!r->ttfb_ms || !r->total_ms || !streams || !hdr || !multi) {
        fprintf(stderr, "error: out of memory\n");
        r->failures++;
        goto done;
    }
    /* One connection per stream, kept alive from one request to the next. */
    curl_multi_setopt(multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, (long)o->concurrency);
    curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, (long)o->concurrency);
    for (int i = 0; i < o->concurrency; i++) {
        CURL *e = streams[i].easy = curl_easy_init();
        if (!e) {
            fprintf(stderr, "error: curl_easy_init failed\n");
            r->failures++;
            goto done;
        }
        curl_easy_setopt(e, CURLOPT_URL, endpoint);
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, hdr);
        curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_data);
        curl_easy_setopt(e, CURLOPT_WRITEDATA, &streams[i]);
        curl_easy_setopt(e, CURLOPT_PRIVATE, &streams[i]);
        curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
        curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(e, CURLOPT_TIMEOUT, 60L);
    }
    double t_begin = td_now_s(), t_window = t_begin + o->warmup_s;
    double t_stop = o->num_requests ? INFINITY : t_window + o->duration_s, t_end = 0;
    bool stopping = false;
    int active = 0, waiting = 0;
    /* Paced: stream i starts every interval seconds, the streams spread evenly over it. */
    double interval = rate > 0 ? o->concurrency / rate : 0;
    for (int i = 0; i < o->concurrency; i++) {
        if (rate > 0 && i > 0) {
            streams[i].t_next = streams[i].t_sched = t_begin + interval * i / o->concurrency;
            waiting++;
        } else {
            streams[i].t_sched = t_begin;
            stream_begin(&streams[i], multi);
            active++;
        }
    }
    while (active > 0 || (waiting > 0 && !stopping)) {
        int running;
        CURLMcode mc = curl_multi_perform(multi, &running);
        if (mc != CURLM_OK) {
            fprintf(stderr, "error: curl_multi_perform: %s\n", curl_multi_strerror(mc));
            r->failures++;
            break;
        }
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(multi, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            stream *st;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&st);
            CURLcode result = msg->data.result;
            double now = td_now_s();
            double t_done = st->t_done_line ? st->t_done_line : now;
            bool ok = stream_check(st, result, o->num_tokens, &r->failures);
            curl_multi_remove_handle(multi, st->easy);
            active--;
            r->all_requests++;
            if (!stopping && t_done > t_stop) {
                stopping = true;
                t_end = t_stop;
            }
            if (ok && !stopping && t_done >= t_window) {
                r->requests++;
                r->events += st->data_lines;
                if (st->t_start >= t_window && r->num_samples < MAX_SAMPLES) {
                    if (r->num_samples == samples_cap) {
                        samples_cap *= 2;
                        double *a = realloc(r->ttfb_ms, samples_cap * sizeof(double));
                        if (a) r->ttfb_ms = a;
                        double *b = realloc(r->total_ms, samples_cap * sizeof(double));
                        if (b) r->total_ms = b;
                        if (!a || !b) samples_cap /= 2; /* keep counting, stop sampling */
                    }
                    if (r->num_samples < samples_cap) {
                        double first = st->t_first_byte ? st->t_first_byte : t_done;
                        r->ttfb_ms[r->num_samples] = (first - st->t_start) * 1e3;
                        r->total_ms[r->num_samples] = (t_done - st->t_start) * 1e3;
                        r->num_samples++;
                    }
                }
                if (o->num_requests && r->requests >= o->num_requests) {
                    stopping = true;
                    t_end = t_done;
                }
            }
            if (!stopping && now > t_stop) {
                stopping = true;
                t_end = t_stop;
            }
            if (!stopping && rate > 0) {
                /* Behind schedule (the path is saturated): start now, and slip. */
                st->t_next = st->t_sched + interval > now ? st->t_sched + interval : now;
                waiting++;
            } else if (!stopping) {
                stream_begin(st, multi);
                active++;
            }
        }
        double now = td_now_s();
        if (!stopping && now >= t_stop) {
            stopping = true;
            t_end = t_stop;
        }
        /* Start the paced streams that are due, and sleep until the next one is at most. */
        double next_due = now + 0.010;
        for (int i = 0; waiting > 0 && !stopping && i < o->concurrency; i++) {
            stream *st = &streams[i];
            if (!st->t_next) continue;
            if (st->t_next <= now) {
                st->t_sched = st->t_next;
                st->t_next = 0;
                waiting--;
                stream_begin(st, multi);
                active++;
            } else if (st->t_next < next_due) {
                next_due = st->t_next;
            }
        }
        /* A short poll, so that the window closes on time even while nothing arrives. */
        int wait_ms = (int)ceil((next_due - now) * 1e3);
        if (active > 0 || waiting > 0)
            curl_multi_poll(multi, NULL, 0, wait_ms > 0 ? wait_ms : 0, NULL);
    }
    r->window_s = t_end > t_window ? t_end - t_window : 0;
    finish_stats(r);
done:
    for (int i = 0; streams && i < o->concurrency; i++) {
        if (!streams[i].easy) continue;
        curl_multi_remove_handle(multi, streams[i].easy);
        curl_easy_cleanup(streams[i].easy);
    }
    if (multi) curl_multi_cleanup(multi);
    curl_slist_free_all(hdr);
    free(streams);
    if (!r->failures && !r->num_samples) {
        fprintf(stderr, "error: %s: no request completed inside the measured window\n", mode);
        return 1;
    }
    fprintf(stderr, "%s: %ld requests (%ld in the %.2f s window), %ld failed\n", mode,
            r->all_requests, r->requests, r->window_s, r->failures);
    return r->failures ? 1 : 0;
}

static void run_result_free(run_result *r)
{
    free(r->ttfb_ms);
    free(r->total_ms);
    r->ttfb_ms = r->total_ms = NULL;
}

/* ---- the router child ----------------------------------------------------------------- */

typedef struct router_child {
    pid_t pid;
    int stderr_fd;
    pthread_t relay;
    bool relaying;
    char pending[4096]; /* stderr read past the "listening on" line, relayed first */
    size_t pending_len;
} router_child;

/* Copies the router's stderr to ours until it closes, so that it never blocks on a pipe. */
static void *relay_stderr(void *arg)
{
    router_child *rc = arg;
    if (rc->pending_len) fwrite(rc->pending, 1, rc->pending_len, stderr);
    char buf[4096];
    for (;;) {
        ssize_t n = read(rc->stderr_fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        fwrite(buf, 1, (size_t)n, stderr);
    }
    return NULL;
}

static int router_stop(router_child *rc)
{
    int failed = 0, status = 0;
    if (rc->pid > 0) {
        kill(rc->pid, SIGTERM);
        while (waitpid(rc->pid, &status, 0) < 0 && errno == EINTR) {
        }
        if (WIFSIGNALED(status) && WTERMSIG(status) != SIGTERM) {
            fprintf(stderr, "error: the router died of signal %d\n", WTERMSIG(status));
            failed = 1;
        } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
            fprintf(stderr, "error: the router exited with status %d\n", WEXITSTATUS(status));
            failed = 1;
        }
        rc->pid = -1;
    }
    if (rc->relaying) pthread_join(rc->relay, NULL);
    rc->relaying = false;
    if (rc->stderr_fd >= 0) close(rc->stderr_fd);
    rc->stderr_fd = -1;
    return failed;
}

/*
 * Starts `tandem router --worker stub_url` on a free loopback port, pinned to cpu (-1: not
 * pinned), and waits up to 30 s for its "listening on HOST:PORT" line. Writes its URL.
 */
static int router_start(router_child *rc, const char *stub_url, int cpu, char *url, size_t cap)
{
    memset(rc, 0, sizeof(*rc));
    rc->pid = -1;
    rc->stderr_fd = -1;
    int fds[2];
    if (pipe2(fds, O_CLOEXEC)) return -1;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (cpu >= 0) CPU_SET(cpu, &set);
    char *args[] = {"tandem",   "router",         "--host",      "127.0.0.1", "--port", "0",
                    "--worker", (char *)stub_url, "--log-level", "warn",      NULL};
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        /* Only async-signal-safe calls between fork and exec: the parent has threads. */
        dup2(fds[1], 2);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(127);
        if (cpu >= 0 && sched_setaffinity(0, sizeof(set), &set)) _exit(126);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    close(fds[1]);
    rc->pid = pid;
    rc->stderr_fd = fds[0];
    char buf[sizeof(rc->pending)];
    size_t len = 0;
    int port = 0;
    double deadline = td_now_s() + 30;
    while (port <= 0) {
        char *nl;
        while (!port && (nl = memchr(buf, '\n', len))) {
            *nl = '\0';
            const char *p = strstr(buf, "listening on ");
            if (p && (p = strrchr(p, ':'))) port = atoi(p + 1);
            if (!port) fprintf(stderr, "%s\n", buf);
            size_t used = (size_t)(nl + 1 - buf);
            memmove(buf, nl + 1, len - used);
            len -= used;
        }
        if (port > 0) break;
        if (len == sizeof(buf)) { /* a line longer than the buffer: relay it as it is */
            fwrite(buf, 1, len, stderr);
            len = 0;
        }
        double left = deadline - td_now_s();
        struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
        int ready = left > 0 ? poll(&pfd, 1, (int)(left * 1e3) + 1) : 0;
        if (ready < 0 && errno == EINTR) continue;
        ssize_t n = ready > 0 ? read(fds[0], buf + len, sizeof(buf) - len) : -1;
        if (ready > 0 && n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            fprintf(stderr, "error: the router %s before it printed \"listening on\"\n",
                    ready > 0 ? "exited" : "did not start in 30 s");
            if (len) fwrite(buf, 1, len, stderr);
            router_stop(rc);
            return -1;
        }
        len += (size_t)n;
    }
    memcpy(rc->pending, buf, len);
    rc->pending_len = len;
    rc->relaying = pthread_create(&rc->relay, NULL, relay_stderr, rc) == 0;
    snprintf(url, cap, "http://127.0.0.1:%d", port);
    return 0;
}

/* ---- the report ----------------------------------------------------------------------- */

static void print_machine(void)
{
    char model[256] = "unknown", line[512];
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof(line), f)) {
        const char *colon = strchr(line, ':');
        if (!strncmp(line, "model name", 10) && colon) {
            snprintf(model, sizeof(model), "%s", colon + 2);
            model[strcspn(model, "\n")] = '\0';
            break;
        }
    }
    if (f) fclose(f);
    printf("machine : %s, %ld CPUs online\n", model, sysconf(_SC_NPROCESSORS_ONLN));
}

static void print_row(const run_result *r)
{
    printf("%-8s %10.0f %12.0f %9.3f %9.3f %9.3f %9.3f\n", r->mode, r->req_per_s, r->events_per_s,
           r->ttfb_p50, r->ttfb_p99, r->total_p50, r->total_p99);
}

/* One table: the direct run, the routed one (NULL: none) and what the router added. */
static void print_table(const char *title, const run_result *direct, const run_result *router)
{
    printf("\n%s\n%-8s %10s %12s %9s %9s %9s %9s\n", title, "mode", "requests/s", "SSE events/s",
           "ttfb p50", "ttfb p99", "total p50", "total p99");
    print_row(direct);
    if (!router) return;
    print_row(router);
    printf("%-8s %10s %12s %+9.3f %+9.3f %+9.3f %+9.3f\n", "added", "", "",
           router->ttfb_p50 - direct->ttfb_p50, router->ttfb_p99 - direct->ttfb_p99,
           router->total_p50 - direct->total_p50, router->total_p99 - direct->total_p99);
    printf("router / direct: %.3f of the requests/s, %.3f of the SSE events/s\n",
           direct->req_per_s > 0 ? router->req_per_s / direct->req_per_s : 0.0,
           direct->events_per_s > 0 ? router->events_per_s / direct->events_per_s : 0.0);
}

/* A paced run that could not keep its rate measured a saturated path, not latency. */
static void warn_if_behind(const run_result *r)
{
    if (r->rate > 0 && r->req_per_s < 0.95 * r->rate)
        printf("note: %s kept only %.0f of the %.0f requests/s asked for: it was saturated, "
               "so its latencies include queueing\n",
               r->mode, r->req_per_s, r->rate);
}

static void print_report(const bench_opts *o, const run_result *runs, bool routed)
{
    printf("\nworkload: %d concurrent streams, %d token events + [DONE] each, %.1f s warm-up, ",
           o->concurrency, o->num_tokens, o->warmup_s);
    if (o->num_requests)
        printf("%ld measured requests per run\n", o->num_requests);
    else
        printf("%.1f s measured per run\n", o->duration_s);
    printf("latencies in ms from the request's start; SSE events count every \"data: \" line\n");
    print_table("throughput: closed loop, every stream starts its next request at once "
                "(latencies include queueing)",
                &runs[0], routed ? &runs[2] : NULL);
    if (o->rate > 0) {
        char title[160];
        snprintf(title, sizeof(title), "latency: the streams paced to %.0f requests/s in all",
                 o->rate);
        print_table(title, &runs[1], routed ? &runs[3] : NULL);
        warn_if_behind(&runs[1]);
        if (routed) warn_if_behind(&runs[3]);
    }
    if (routed)
        printf("\ntargets: added p50 < 0.5 ms and p99 < 2 ms at 64 streams; >= 100000 relayed "
               "SSE events/s with the router on one core\n");
}

/* The closed-loop run, then the paced one when o->rate > 0, into runs[0] and runs[1]. */
static int run_mode(const char *mode, const char *url, const bench_opts *o, run_result *runs)
{
    if (run_load(mode, url, o, 0, &runs[0])) return 1;
    if (o->rate > 0 && run_load(mode, url, o, o->rate, &runs[1])) return 1;
    return 0;
}

/* ---- the command ---------------------------------------------------------------------- */

int cli_bench_router(int argc, char **argv)
{
    int64_t concurrency = 64, tokens = 64, router_cpu = 0, requests = 0, stub_port = 0;
    double duration = 5, warmup = 1, rate = 1000;
    const char *router_url = NULL;
    bool direct_only = false;
    cli_flag flags[] = {
        CLI_FLAG("concurrency", CLI_FLAG_INT, &concurrency, "concurrent streams (64)"),
        CLI_FLAG("duration-secs", CLI_FLAG_FLOAT, &duration, "measured time per run (5)"),
        CLI_FLAG("requests", CLI_FLAG_INT, &requests,
                 "measured requests per run instead of a duration (0 = use the duration)"),
        CLI_FLAG("warmup-secs", CLI_FLAG_FLOAT, &warmup, "unmeasured time before each run (1)"),
        CLI_FLAG("rate", CLI_FLAG_FLOAT, &rate,
                 "requests/s of the paced latency runs, below saturation (1000; 0 = none)"),
        CLI_FLAG("tokens", CLI_FLAG_INT, &tokens, "SSE token events per streamed answer (64)"),
        CLI_FLAG("router-cpu", CLI_FLAG_INT, &router_cpu,
                 "the CPU the router is pinned to; the load generator and the stub use the "
                 "others (0; -1 = nothing pinned)"),
        CLI_FLAG("router-url", CLI_FLAG_STR, &router_url,
                 "a running router, with this stub as its worker (see --stub-port), instead "
                 "of starting one; nothing is pinned unless --router-cpu is given"),
        CLI_FLAG("stub-port", CLI_FLAG_INT, &stub_port, "the stub's port (0 = a free one)"),
        CLI_FLAG("direct-only", CLI_FLAG_BOOL, &direct_only, "skip the run through the router"),
    };
    int n_flags = (int)(sizeof(flags) / sizeof(flags[0]));
    int rc = cli_flags_parse(flags, n_flags, argc, argv, "tandem bench-router [options]");
    if (rc) return rc == 1 ? 0 : 2;
    bool router_cpu_given = false;
    for (int i = 0; i < n_flags; i++)
        if (!strcmp(flags[i].name, "router-cpu")) router_cpu_given = flags[i].seen;
    if (concurrency < 1 || concurrency > 4096 || tokens < 1 || tokens > 1 << 20 || requests < 0 ||
        stub_port < 0 || stub_port > 65535 || !(duration > 0) || !(warmup >= 0) || !(rate >= 0) ||
        duration > 86400 || warmup > 86400) {
        fprintf(stderr, "error: --concurrency must be 1..4096, --tokens positive, "
                        "--duration-secs positive, --requests, --warmup-secs, --rate and "
                        "--stub-port not negative\n");
        return 2;
    }
    /* The load generator and the stub go on every allowed CPU but the router's. */
    cpu_set_t original, others;
    bool pinned = false;
    if (pthread_getaffinity_np(pthread_self(), sizeof(original), &original)) CPU_ZERO(&original);
    if (router_cpu >= 0 && (router_cpu >= CPU_SETSIZE || !CPU_ISSET(router_cpu, &original))) {
        fprintf(stderr, "error: --router-cpu %lld is not a CPU this process may run on\n",
                (long long)router_cpu);
        return 2;
    }
    bool pin = router_cpu >= 0 && (!router_url || router_cpu_given);
    if (pin) {
        others = original;
        CPU_CLR(router_cpu, &others);
        if (CPU_COUNT(&others) == 0)
            fprintf(stderr, "warning: only CPU %lld is available: nothing pinned\n",
                    (long long)router_cpu);
        else
            pinned = !pthread_setaffinity_np(pthread_self(), sizeof(others), &others);
    }

    bench_opts o = {(int)concurrency, (int)tokens, warmup, duration, (long)requests, rate};
    print_machine();
    if (router_cpu >= 0 && !router_url && !direct_only)
        printf("pinning : router on CPU %lld, ", (long long)router_cpu);
    else
        printf("pinning : ");
    if (pinned) {
        printf("load generator and stub on CPUs");
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &others)) printf(" %d", c);
        printf("\n");
    } else {
        printf("load generator and stub not pinned\n");
    }
    fflush(stdout);

    if (curl_global_init(CURL_GLOBAL_DEFAULT)) {
        fprintf(stderr, "error: curl_global_init failed\n");
        return 1;
    }
    int exit_code = 0;
    stub s;
    run_result runs[4] = {0}; /* direct closed, direct paced, router closed, router paced */
    bool have_routed = false;
    char stub_url[64], url_buf[256];
    if (stub_start(&s, (int)stub_port, o.num_tokens)) {
        exit_code = 1;
        goto out;
    }
    snprintf(stub_url, sizeof(stub_url), "http://127.0.0.1:%d", s.port);
    fprintf(stderr, "stub upstream at %s\n", stub_url);

    if (run_mode("direct", stub_url, &o, &runs[0])) exit_code = 1;
    if (!direct_only && !exit_code) {
        router_child child = {.pid = -1, .stderr_fd = -1};
        const char *url = router_url;
        if (!url) {
            if (router_start(&child, stub_url, (int)router_cpu, url_buf, sizeof(url_buf))) {
                fprintf(stderr, "error: could not start `tandem router`\n");
                exit_code = 1;
            }
            url = url_buf;
        }
        if (!exit_code) {
            fprintf(stderr, "router at %s\n", url);
            if (run_mode("router", url, &o, &runs[2])) exit_code = 1;
            have_routed = true;
        }
        if (router_stop(&child)) exit_code = 1;
    }
    stub_stop(&s);
    if (!exit_code) print_report(&o, runs, have_routed);
out:
    for (int i = 0; i < 4; i++)
        run_result_free(&runs[i]);
    curl_global_cleanup();
    if (pinned) pthread_setaffinity_np(pthread_self(), sizeof(original), &original);
    return exit_code;
}
