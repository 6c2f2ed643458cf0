/*
 * cli/bench-serve.c - `tandem bench-serve`: the server's own overhead.
 *
 * The same workload (N concurrent greedy requests with distinct token-id prompts, a
 * fixed number of tokens each, ignore_eos) runs twice: through the C API in this
 * process, and as N concurrent SSE streams through HTTP to a `tandem serve` (started
 * here on a free loopback port with the same engine flags, or a running one given
 * with --url). It prints both rates in generated tokens per second and their ratio;
 * the target is a ratio of at least 0.95.
 *
 * A first HTTP round opens the client's connections (its figure is printed as "new
 * connections"). Then C-API and HTTP rounds alternate (--rounds of each, new prompts
 * every round so that no round hits the prefix cache of another), never at the same time,
 * and the ratio is of the two medians. The C-API engine steps on a thread of its own, so
 * that its pinned CPU never holds the HTTP client.
 *
 *   tandem bench-serve --model ../shared/models/stories260K.gguf --threads 2
 */
#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/engine_opts.h"
#include "cli/spawn.h"
#include "model/tok.h"
#include "util/pool.h"

typedef struct workload {
    int streams, prompt_len, max_tokens, n_vocab;
} workload;

/* Stream i's prompt: BOS, then i in base n_vocab - 3 (two digits, so the first (n_vocab - 3)^2
 * prompts differ in their first block and no round hits another's prefix cache), then ids
 * that vary with i. */
static void prompt_ids(const workload *w, int i, int32_t *ids)
{
    uint32_t v = (uint32_t)(w->n_vocab - 3);
    ids[0] = 1;
    for (int k = 1; k < w->prompt_len; k++)
        ids[k] = 3 + (int32_t)(k == 1   ? (uint32_t)i % v
                               : k == 2 ? (uint32_t)i / v % v
                                        : (uint32_t)(i * 131 + k * 17 + i * k) % v);
}

typedef struct capi_round {
    td_engine *e;
    const workload *w;
    int salt, failed;
    long tokens;
    double dt, first_ms, steady;
} capi_round;

/* One C-API round: every stream's request at once, then steps until all are done. */
static void *capi_round_main(void *arg)
{
    capi_round *r = arg;
    const workload *w = r->w;
    td_err err = {0};
    int32_t *ids = malloc((size_t)w->prompt_len * sizeof(int32_t));
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = 0;
    sp.max_tokens = w->max_tokens;
    sp.ignore_eos = true;
    double t0 = td_now_s();
    for (int i = 0; i < w->streams; i++) {
        uint64_t id;
        prompt_ids(w, i + r->salt, ids);
        if (td_engine_add_request(r->e, &id, ids, w->prompt_len, &sp, &err)) {
            fprintf(stderr, "error: %s\n", err.msg);
            r->failed = 1;
            free(ids);
            return NULL;
        }
    }
    long tokens = 0, tokens_at_all_started = 0;
    int started = 0;
    double t_all_started = 0;
    while (td_engine_has_work(r->e)) {
        if (td_engine_step(r->e, &err) < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            r->failed = 1;
            break;
        }
        td_output o;
        while (td_engine_poll(r->e, &o)) {
            if (o.token < 0) continue;
            tokens++;
            if (o.num_generated == 1 && ++started == w->streams) {
                t_all_started = td_now_s();
                tokens_at_all_started = tokens;
            }
        }
    }
    double t1 = td_now_s();
    r->tokens = tokens;
    r->dt = t1 - t0;
    r->first_ms = t_all_started > 0 ? (t_all_started - t0) * 1e3 : 0.0;
    r->steady = t1 > t_all_started && t_all_started > 0
                    ? (tokens - tokens_at_all_started) / (t1 - t_all_started)
                    : 0;
    free(ids);
    return NULL;
}

static int run_capi(td_engine *e, const workload *w, int salt, const char *what, double *tok_s,
                    double *steady)
{
    capi_round r = {.e = e, .w = w, .salt = salt};
    pthread_t t;
    if (pthread_create(&t, NULL, capi_round_main, &r) != 0) {
        fprintf(stderr, "error: cannot start a thread\n");
        return 1;
    }
    pthread_join(t, NULL);
    if (r.failed) return 1;
    *tok_s = r.tokens / r.dt;
    *steady = r.steady;
    printf("%s: %d streams x %d tokens: %ld tokens in %.3f s = %.1f tok/s "
           "(every stream's first token by %.1f ms; %.1f tok/s after that)\n",
           what, w->streams, w->max_tokens, r.tokens, r.dt, *tok_s, r.first_ms, r.steady);
    return 0;
}

/* Token chunks seen by all streams, and when the last stream saw its first. */
typedef struct http_progress {
    long chunks, chunks_at_all_started;
    int started, streams;
    double t0, t_all_started;
    double client_cpu; /* this thread's CPU seconds in the round */
} http_progress;

typedef struct stream_buf {
    td_sbuf text;
    http_progress *progress;
} stream_buf;

static size_t on_data(char *p, size_t size, size_t n, void *arg)
{
    stream_buf *b = arg;
    size_t k = size * n;
    /* Every token chunk carries one "finish_reason" (the usage chunk none). */
    http_progress *pr = b->progress;
    bool first = b->text.len == 0;
    for (const char *q = p; (q = memmem(q, k - (size_t)(q - p), "finish_reason", 13)); q += 13)
        pr->chunks++;
    if (first && ++pr->started == pr->streams) {
        pr->t_all_started = td_now_s();
        pr->chunks_at_all_started = pr->chunks;
    }
    /* a stream's whole answer in one allocation (tens of KiB), not a dozen doublings */
    if (!b->text.p && td_sbuf_reserve(&b->text, 65536)) return 0;
    return td_sbuf_add(&b->text, p, k) ? 0 : k;
}

/* A request body: stream i's prompt (offset by `salt` streams, so that a warm-up round
 * shares no prefix with the timed one), max_tokens, greedy, streamed with usage. */
static char *request_body(const workload *w, int i, int max_tokens, int32_t *ids)
{
    prompt_ids(w, i, ids);
    size_t cap = (size_t)w->prompt_len * 12 + 256;
    char *body = malloc(cap);
    size_t off = (size_t)snprintf(body, cap, "{\"prompt\":[");
    for (int k = 0; k < w->prompt_len; k++)
        off += (size_t)snprintf(body + off, cap - off, k ? ",%d" : "%d", ids[k]);
    snprintf(body + off, cap - off,
             "],\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
             "\"stream_options\":{\"include_usage\":true}}",
             max_tokens);
    return body;
}

/*
 * One round: every stream sends its request at once on its handle and the round ends
 * when all have finished. Handles keep their connections between rounds (curl's
 * connection cache), as a client with a keep-alive pool does. Returns the generated
 * tokens (from each stream's usage), or -1 if a stream failed.
 */
static long http_round(CURLM *multi, CURL **easy, const workload *w, int salt, int max_tokens,
                       http_progress *progress, double *dt)
{
    stream_buf *bufs = calloc((size_t)w->streams, sizeof(stream_buf));
    char **bodies = calloc((size_t)w->streams, sizeof(char *));
    int32_t *ids = malloc((size_t)w->prompt_len * sizeof(int32_t));
    *progress = (http_progress){.streams = w->streams};
    for (int i = 0; i < w->streams; i++) {
        bodies[i] = request_body(w, i + salt, max_tokens, ids);
        curl_easy_setopt(easy[i], CURLOPT_POSTFIELDS, bodies[i]);
        bufs[i].progress = progress;
        curl_easy_setopt(easy[i], CURLOPT_WRITEDATA, &bufs[i]);
    }
    struct rusage ru0, ru1;
    getrusage(RUSAGE_THREAD, &ru0);
    double t0 = td_now_s();
    for (int i = 0; i < w->streams; i++)
        curl_multi_add_handle(multi, easy[i]);
    int running = 1;
    while (running) {
        curl_multi_perform(multi, &running);
        if (running) curl_multi_poll(multi, NULL, 0, 100, NULL);
    }
    *dt = td_now_s() - t0;
    getrusage(RUSAGE_THREAD, &ru1);
    progress->t0 = t0;
    progress->client_cpu = (double)(ru1.ru_utime.tv_sec - ru0.ru_utime.tv_sec) +
                           (ru1.ru_utime.tv_usec - ru0.ru_utime.tv_usec) * 1e-6 +
                           (double)(ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) +
                           (ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec) * 1e-6;
    long tokens = 0;
    int failed = 0;
    for (int i = 0; i < w->streams; i++) {
        long code = 0;
        curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &code);
        const char *u = bufs[i].text.p ? strstr(bufs[i].text.p, "\"completion_tokens\":") : NULL;
        bool done = bufs[i].text.p && strstr(bufs[i].text.p, "data: [DONE]");
        if (code != 200 || !u || !done) {
            if (!failed++)
                fprintf(stderr, "stream %d failed: HTTP %ld: %.300s\n", i, code,
                        bufs[i].text.p ? bufs[i].text.p : "(no body)");
        } else {
            tokens += strtol(u + 20, NULL, 10);
        }
        curl_multi_remove_handle(multi, easy[i]);
        free(bodies[i]);
        free(bufs[i].text.p);
    }
    free(bufs);
    free(bodies);
    free(ids);
    return failed ? -1 : tokens;
}

static void print_http(const char *what, const workload *w, long tokens, double dt,
                       const http_progress *pr, double steady)
{
    printf("%s: %d streams x %d tokens: %ld tokens in %.3f s = %.1f tok/s "
           "(every stream's first token by %.1f ms; %.1f tok/s after that; client CPU %.1f "
           "us/token)\n",
           what, w->streams, w->max_tokens, tokens, dt, tokens / dt,
           pr->t_all_started > 0 ? (pr->t_all_started - pr->t0) * 1e3 : 0.0, steady,
           tokens ? pr->client_cpu / tokens * 1e6 : 0.0);
}

static double steady_rate(const http_progress *pr, double t_end)
{
    return t_end > pr->t_all_started && pr->t_all_started > 0
               ? (pr->chunks - pr->chunks_at_all_started) / (t_end - pr->t_all_started)
               : 0;
}

/* The HTTP client: one handle (and so one kept-alive connection) per stream. */
typedef struct http_client {
    CURLM *multi;
    CURL **easy;
    struct curl_slist *hdr;
    char endpoint[512];
} http_client;

static void http_client_open(http_client *c, const char *url, const workload *w)
{
    snprintf(c->endpoint, sizeof(c->endpoint), "%s/v1/completions", url);
    c->multi = curl_multi_init();
    c->easy = calloc((size_t)w->streams, sizeof(CURL *));
    c->hdr = curl_slist_append(NULL, "Content-Type: application/json");
    curl_multi_setopt(c->multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, (long)w->streams);
    curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, (long)w->streams);
    for (int i = 0; i < w->streams; i++) {
        c->easy[i] = curl_easy_init();
        curl_easy_setopt(c->easy[i], CURLOPT_URL, c->endpoint);
        curl_easy_setopt(c->easy[i], CURLOPT_HTTPHEADER, c->hdr);
        curl_easy_setopt(c->easy[i], CURLOPT_WRITEFUNCTION, on_data);
        curl_easy_setopt(c->easy[i], CURLOPT_TCP_NODELAY, 1L);
        curl_easy_setopt(c->easy[i], CURLOPT_NOSIGNAL, 1L);
    }
}

static void http_client_close(http_client *c, const workload *w)
{
    for (int i = 0; i < w->streams; i++)
        curl_easy_cleanup(c->easy[i]);
    curl_multi_cleanup(c->multi);
    curl_slist_free_all(c->hdr);
    free(c->easy);
}

/* One HTTP round; `what` names it in the output line. */
static int run_http(http_client *c, const workload *w, int salt, const char *what, double *tok_s,
                    double *steady)
{
    http_progress pr;
    double dt;
    long tokens = http_round(c->multi, c->easy, w, salt, w->max_tokens, &pr, &dt);
    if (tokens < 0) return 1;
    *tok_s = tokens / dt;
    *steady = steady_rate(&pr, pr.t0 + dt);
    print_http(what, w, tokens, dt, &pr, *steady);
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int cli_bench_serve(int argc, char **argv)
{
    engine_opts eo;
    cli_flag flags[ENGINE_OPTS_MAX_FLAGS + 8];
    int nf = engine_opts_register(&eo, flags);
    const char *url = NULL;
    int64_t streams = 64, prompt_len = 16, max_tokens = 64, rounds = 5;
    flags[nf++] = CLI_FLAG("url", CLI_FLAG_STR, &url,
                           "a running `tandem serve` (default: start one with the same flags)");
    flags[nf++] = CLI_FLAG("streams", CLI_FLAG_INT, &streams, "concurrent requests (64)");
    flags[nf++] = CLI_FLAG("prompt-len", CLI_FLAG_INT, &prompt_len, "prompt tokens each (16)");
    flags[nf++] = CLI_FLAG("max-tokens", CLI_FLAG_INT, &max_tokens, "tokens generated each (64)");
    flags[nf++] = CLI_FLAG("rounds", CLI_FLAG_INT, &rounds,
                           "measured rounds of each half, alternating; the medians count (5)");
    int rc = cli_flags_parse(flags, nf, argc, argv, "tandem bench-serve --model M [options]");
    if (rc) return rc == 1 ? 0 : 2;
    if (streams < 1 || streams > 4096 || prompt_len < 1 || prompt_len > 1 << 16 || max_tokens < 1 ||
        max_tokens > 1 << 16 || rounds < 1 || rounds > 100) {
        fprintf(stderr, "error: --streams, --prompt-len and --max-tokens must be positive, and "
                        "--rounds in [1, 100]\n");
        return 2;
    }
    td_engine_config cfg;
    if (engine_opts_apply(&eo, &cfg)) return 2;
    workload w = {(int)streams, (int)prompt_len, (int)max_tokens, 0};

    /* Loading may run the engine's pool on this thread, which pins it: this thread is the
     * HTTP client and the server's parent, so it gets its CPUs back at once. */
    cpu_set_t mine;
    bool saved = pthread_getaffinity_np(pthread_self(), sizeof(mine), &mine) == 0;
    td_err err = {0};
    td_engine *e;
    rc = td_engine_create(&e, &cfg, &err);
    if (saved) pthread_setaffinity_np(pthread_self(), sizeof(mine), &mine);
    if (rc) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    w.n_vocab = tok_n_vocab(td_engine_tokenizer(e));

    pid_t server = -1;
    char url_buf[256];
    if (!url) {
        server = cli_spawn_serve(&eo, NULL, url_buf, sizeof(url_buf));
        if (server < 0) {
            fprintf(stderr, "error: could not start `tandem serve`\n");
            td_engine_free(e);
            return 1;
        }
        url = url_buf;
    }
    /* The client keeps off the CPUs the engines compute on (the server's engine, made with
     * the same flags, pins the same ones) while others are left, as the server's own HTTP
     * thread does. */
    cpu_set_t busy;
    if (td_engine_cpus(e, &busy) > 0) td_thread_avoid_cpus(&busy);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    http_client c;
    http_client_open(&c, url, &w);
    double capi[100], capi_steady[100], http[100], http_steady[100], cold = 0, cold_steady = 0;
    /* warm-up: the client opens its connections, each engine touches its pages once */
    double warm = 0, warm_steady = 0;
    rc = run_http(&c, &w, 0, "HTTP, new connections  ", &cold, &cold_steady) ||
         run_capi(e, &w, w.streams, "C API, warm-up         ", &warm, &warm_steady);
    for (int r = 0; r < rounds && !rc; r++) {
        int salt = (2 * r + 2) * w.streams; /* prompts no other round has sent */
        rc = run_capi(e, &w, salt, "C API                  ", &capi[r], &capi_steady[r]) ||
             run_http(&c, &w, salt + w.streams, "HTTP, kept-alive       ", &http[r],
                      &http_steady[r]);
    }
    http_client_close(&c, &w);
    curl_global_cleanup();
    td_engine_free(e);
    if (server > 0) {
        kill(server, SIGTERM);
        waitpid(server, NULL, 0);
    }
    if (rc) return 1;
    double mc = median(capi, (int)rounds), mh = median(http, (int)rounds);
    double sc = median(capi_steady, (int)rounds), sh = median(http_steady, (int)rounds);
    printf("median: C API %.1f tok/s (%.1f after the first tokens), HTTP %.1f tok/s (%.1f)\n",
           mc, sc, mh, sh);
    printf("ratio : HTTP / C API = %.3f end to end, %.3f once all streams run (target >= 0.95; "
           "medians of %d rounds on kept-alive connections); %.3f for the round that opened "
           "the connections\n",
           mc > 0 ? mh / mc : 0.0, sc > 0 ? sh / sc : 0.0, (int)rounds, mc > 0 ? cold / mc : 0.0);
    return 0;
}
