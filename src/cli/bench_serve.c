/*
 * cli/bench-serve.c - `tandem bench-serve`: the server's own overhead.
 *
 * The same workload (N concurrent greedy requests with distinct token-id prompts, a
 * fixed number of tokens each, ignore_eos) runs twice: through the C API in this
 * process, and as N concurrent SSE streams through HTTP to a `tandem serve` (started
 * here on a free loopback port with the same engine flags, or a running one given
 * with --url). It prints both rates in generated tokens per second and their ratio;
 * the target is a ratio of at least 0.95. The two halves run one after the other, so
 * they never compete for CPUs.
 *
 *   tandem bench-serve --model ../shared/models/stories260K.gguf --threads 2
 */
#include <curl/curl.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/engine_opts.h"
#include "cli/spawn.h"
#include "model/tok.h"

typedef struct workload {
    int streams, prompt_len, max_tokens, n_vocab;
    double steady_capi, steady_http; /* tok/s after every stream has its first token */
} workload;

/* Stream i's prompt: BOS then ids that differ per stream, so no prefix is shared. */
static void prompt_ids(const workload *w, int i, int32_t *ids)
{
    ids[0] = 1;
    for (int k = 1; k < w->prompt_len; k++)
        ids[k] = 3 + (int32_t)((uint32_t)(i * 131 + k * 17 + i * k) % (uint32_t)(w->n_vocab - 3));
}

static int run_capi(const td_engine_config *cfg, workload *w, double *tok_s)
{
    td_err err = {0};
    td_engine *e;
    if (td_engine_create(&e, cfg, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return 1;
    }
    w->n_vocab = tok_n_vocab(td_engine_tokenizer(e));
    int32_t *ids = malloc((size_t)w->prompt_len * sizeof(int32_t));
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = 0;
    sp.max_tokens = w->max_tokens;
    sp.ignore_eos = true;
    double t0 = td_now_s();
    for (int i = 0; i < w->streams; i++) {
        uint64_t id;
        prompt_ids(w, i, ids);
        if (td_engine_add_request(e, &id, ids, w->prompt_len, &sp, &err)) {
            fprintf(stderr, "error: %s\n", err.msg);
            free(ids);
            td_engine_free(e);
            return 1;
        }
    }
    long tokens = 0, tokens_at_all_started = 0;
    int started = 0;
    double t_all_started = 0;
    while (td_engine_has_work(e)) {
        if (td_engine_step(e, &err) < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            break;
        }
        td_output o;
        while (td_engine_poll(e, &o)) {
            if (o.token < 0) continue;
            tokens++;
            if (o.num_generated == 1 && ++started == w->streams) {
                t_all_started = td_now_s();
                tokens_at_all_started = tokens;
            }
        }
    }
    double t1 = td_now_s(), dt = t1 - t0;
    *tok_s = tokens / dt;
    w->steady_capi = t1 > t_all_started && t_all_started > 0
                         ? (tokens - tokens_at_all_started) / (t1 - t_all_started)
                         : 0;
    printf("C API : %d streams x %d tokens: %ld tokens in %.3f s = %.1f tok/s "
           "(%.1f tok/s once every stream has its first token)\n",
           w->streams, w->max_tokens, tokens, dt, *tok_s, w->steady_capi);
    free(ids);
    td_engine_free(e);
    return 0;
}

/* Token chunks seen by all streams, and when the last stream saw its first. */
typedef struct http_progress {
    long chunks, chunks_at_all_started;
    int started, streams;
    double t_all_started;
} http_progress;

typedef struct stream_buf {
    char *data;
    size_t len, cap;
    http_progress *progress;
} stream_buf;

static size_t on_data(char *p, size_t size, size_t n, void *arg)
{
    stream_buf *b = arg;
    size_t k = size * n;
    /* Every token chunk carries one "finish_reason" (the usage chunk none). */
    http_progress *pr = b->progress;
    bool first = b->len == 0;
    for (const char *q = p; (q = memmem(q, k - (size_t)(q - p), "finish_reason", 13)); q += 13)
        pr->chunks++;
    if (first && ++pr->started == pr->streams) {
        pr->t_all_started = td_now_s();
        pr->chunks_at_all_started = pr->chunks;
    }
    if (b->len + k + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 65536;
        while (cap < b->len + k + 1)
            cap *= 2;
        char *g = realloc(b->data, cap);
        if (!g) return 0;
        b->data = g;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, k);
    b->len += k;
    b->data[b->len] = '\0';
    return k;
}

static int run_http(const char *url, workload *w, double *tok_s)
{
    http_progress progress = {.streams = w->streams};
    char endpoint[512];
    snprintf(endpoint, sizeof(endpoint), "%s/v1/completions", url);
    CURLM *multi = curl_multi_init();
    CURL **easy = calloc((size_t)w->streams, sizeof(CURL *));
    char **bodies = calloc((size_t)w->streams, sizeof(char *));
    stream_buf *bufs = calloc((size_t)w->streams, sizeof(stream_buf));
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    int32_t *ids = malloc((size_t)w->prompt_len * sizeof(int32_t));
    curl_multi_setopt(multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, (long)w->streams);
    for (int i = 0; i < w->streams; i++) {
        prompt_ids(w, i, ids);
        size_t cap = (size_t)w->prompt_len * 12 + 256;
        char *body = malloc(cap);
        size_t off = (size_t)snprintf(body, cap, "{\"prompt\":[");
        for (int k = 0; k < w->prompt_len; k++)
            off += (size_t)snprintf(body + off, cap - off, k ? ",%d" : "%d", ids[k]);
        snprintf(body + off, cap - off,
                 "],\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                 "\"stream_options\":{\"include_usage\":true}}",
                 w->max_tokens);
        bodies[i] = body;
        easy[i] = curl_easy_init();
        curl_easy_setopt(easy[i], CURLOPT_URL, endpoint);
        curl_easy_setopt(easy[i], CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(easy[i], CURLOPT_HTTPHEADER, hdr);
        curl_easy_setopt(easy[i], CURLOPT_WRITEFUNCTION, on_data);
        bufs[i].progress = &progress;
        curl_easy_setopt(easy[i], CURLOPT_WRITEDATA, &bufs[i]);
        curl_easy_setopt(easy[i], CURLOPT_TCP_NODELAY, 1L);
    }
    double t0 = td_now_s();
    for (int i = 0; i < w->streams; i++)
        curl_multi_add_handle(multi, easy[i]);
    int running = 1;
    while (running) {
        curl_multi_perform(multi, &running);
        if (running) curl_multi_poll(multi, NULL, 0, 100, NULL);
    }
    double t1 = td_now_s(), dt = t1 - t0;
    w->steady_http =
        t1 > progress.t_all_started && progress.t_all_started > 0
            ? (progress.chunks - progress.chunks_at_all_started) / (t1 - progress.t_all_started)
            : 0;
    long tokens = 0;
    int failed = 0;
    for (int i = 0; i < w->streams; i++) {
        long code = 0;
        curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &code);
        const char *u = bufs[i].data ? strstr(bufs[i].data, "\"completion_tokens\":") : NULL;
        bool done = bufs[i].data && strstr(bufs[i].data, "data: [DONE]");
        if (code != 200 || !u || !done) {
            if (!failed++)
                fprintf(stderr, "stream %d failed: HTTP %ld: %.300s\n", i, code,
                        bufs[i].data ? bufs[i].data : "(no body)");
        } else {
            tokens += strtol(u + 20, NULL, 10);
        }
        curl_multi_remove_handle(multi, easy[i]);
        curl_easy_cleanup(easy[i]);
        free(bodies[i]);
        free(bufs[i].data);
    }
    curl_multi_cleanup(multi);
    curl_slist_free_all(hdr);
    free(easy);
    free(bodies);
    free(bufs);
    free(ids);
    *tok_s = tokens / dt;
    printf("HTTP  : %d streams x %d tokens: %ld tokens in %.3f s = %.1f tok/s "
           "(%.1f tok/s once every stream has its first token)%s\n",
           w->streams, w->max_tokens, tokens, dt, *tok_s, w->steady_http,
           failed ? " (with failures)" : "");
    return failed ? 1 : 0;
}

int cli_bench_serve(int argc, char **argv)
{
    engine_opts eo;
    cli_flag flags[ENGINE_OPTS_MAX_FLAGS + 8];
    int nf = engine_opts_register(&eo, flags);
    const char *url = NULL;
    int64_t streams = 64, prompt_len = 16, max_tokens = 64;
    flags[nf++] = CLI_FLAG("url", CLI_FLAG_STR, &url,
                           "a running `tandem serve` (default: start one with the same flags)");
    flags[nf++] = CLI_FLAG("streams", CLI_FLAG_INT, &streams, "concurrent requests (64)");
    flags[nf++] = CLI_FLAG("prompt-len", CLI_FLAG_INT, &prompt_len, "prompt tokens each (16)");
    flags[nf++] = CLI_FLAG("max-tokens", CLI_FLAG_INT, &max_tokens, "tokens generated each (64)");
    int rc = cli_flags_parse(flags, nf, argc, argv, "tandem bench-serve --model M [options]");
    if (rc) return rc == 1 ? 0 : 2;
    if (streams < 1 || streams > 4096 || prompt_len < 1 || prompt_len > 1 << 16 || max_tokens < 1 ||
        max_tokens > 1 << 16) {
        fprintf(stderr, "error: --streams, --prompt-len and --max-tokens must be positive\n");
        return 2;
    }
    td_engine_config cfg;
    if (engine_opts_apply(&eo, &cfg)) return 2;
    workload w = {(int)streams, (int)prompt_len, (int)max_tokens, 0, 0, 0};
    double capi = 0, http = 0;
    if (run_capi(&cfg, &w, &capi)) return 1;

    pid_t server = -1;
    char url_buf[256];
    if (!url) {
        server = cli_spawn_serve(&eo, NULL, url_buf, sizeof(url_buf));
        if (server < 0) {
            fprintf(stderr, "error: could not start `tandem serve`\n");
            return 1;
        }
        url = url_buf;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    rc = run_http(url, &w, &http);
    curl_global_cleanup();
    if (server > 0) {
        kill(server, SIGTERM);
        waitpid(server, NULL, 0);
    }
    if (rc) return 1;
    printf("ratio : HTTP / C API = %.3f end to end, %.3f once all streams run (target >= 0.95)\n",
           capi > 0 ? http / capi : 0.0, w.steady_capi > 0 ? w.steady_http / w.steady_capi : 0.0);
    return 0;
}
