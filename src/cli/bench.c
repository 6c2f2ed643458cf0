/*
 * cli/bench.c - `tandem bench`: the serving benchmark against any OpenAI-compatible server
 * (tandem, llama.cpp's server, vLLM), in the manner of vLLM's benchmark_serving.
 *
 * A dataset (random token ids, ShareGPT conversations, or a file of prompts) becomes
 * --num-prompts streamed requests. They arrive as a Poisson (or gamma, --burstiness)
 * process at --request-rate, all at once by default, and at most --max-concurrency are in
 * flight. One thread drives every request with libcurl's multi interface; the write
 * callback parses the SSE stream as it arrives and timestamps each content-carrying event,
 * so TTFT, TPOT, ITL and E2EL are the client's view. The arithmetic lives in bench/metrics.c
 * and the table, the result JSON and --compare in bench/report.c.
 *
 *   tandem bench --base-url http://127.0.0.1:8000 --num-prompts 200 --max-concurrency 16 \
 *       --input-len 512 --output-len 128 --ignore-eos --save-result c16.json --label tandem
 *   tandem bench --compare c1.json c4.json c16.json --plot compare.svg
 *
 * Exit status: 0 when the run completed at least one request, 1 when none completed (or
 * the result could not be saved), 2 for a usage error.
 */
#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bench/metrics.h"
#include "bench/report.h"
#include "bench/sse.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "util/td.h"

#define ERROR_BODY_CAP 200       /* bytes of a failed response kept for the message */
#define MAX_FAILURE_KINDS 32     /* distinct failure reasons tallied */
#define MAX_FAILURES_SHOWN 3     /* failed requests described on stderr */
#define SHAREGPT_OUTPUT_CAP 1024 /* ShareGPT output lengths are capped here without --output-len   \
                                  */

typedef enum dataset_kind { DATASET_RANDOM, DATASET_SHAREGPT, DATASET_PROMPTS } dataset_kind;

typedef struct bench_opts {
    const char *base_url, *endpoint, *model, *dataset_name, *dataset_path, *label;
    const char *save_result, *plot, *percentiles_text, *request_rate_text;
    dataset_kind dataset;
    bool chat, ignore_eos, output_len_given;
    int64_t input_len, output_len, prefix_len, num_prompts, max_concurrency, seed, vocab;
    double range_ratio, request_rate, burstiness, temperature, idle_timeout;
    bench_slo slo;
    double percentiles[BENCH_MAX_PERCENTILES];
    int num_percentiles;
} bench_opts;

/* One prompt of the dataset: token ids (random dataset, completions endpoint) or text. */
typedef struct bench_prompt {
    int32_t *ids;
    int num_ids;
    char *text;
    long prompt_len; /* tokens, or words as an estimate for text */
    int output_len;  /* max_tokens */
} bench_prompt;

/* ---- datasets ---- */

/* Words of the random chat prompts: short and common, so that each is about one token. */
static const char *const random_words[] = {
    "the",   "of",   "and",  "to",    "in",   "is",    "was",   "for",  "on",     "with",   "as",
    "at",    "by",   "from", "time",  "day",  "cat",   "dog",   "tree", "house",  "sun",    "moon",
    "star",  "blue", "red",  "green", "big",  "small", "happy", "sad",  "run",    "jump",   "play",
    "walk",  "sing", "read", "book",  "ball", "girl",  "boy",   "mom",  "dad",    "friend", "park",
    "water", "fish", "bird", "sky",   "cake", "toy",   "box",   "hat",  "car",    "road",   "hill",
    "rain",  "snow", "wind", "door",  "bed",  "cup",   "apple", "bear", "garden",
};

static int64_t uniform_len(td_rng *rng, int64_t len, double ratio)
{
    int64_t lo = (int64_t)floor((double)len * (1.0 - ratio));
    int64_t hi = (int64_t)ceil((double)len * (1.0 + ratio));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    return lo + (int64_t)(td_rng_next(rng) % (uint64_t)(hi - lo + 1));
}

/* Appends n random words to a text of capacity cap (sized by the caller). */
static size_t append_words(char *text, size_t off, td_rng *rng, int64_t n)
{
    for (int64_t k = 0; k < n; k++) {
        const char *w = random_words[td_rng_next(rng) % TD_ARRAY_LEN(random_words)];
        off += (size_t)sprintf(text + off, "%s%s", off ? " " : "", w);
    }
    return off;
}

static int dataset_random(const bench_opts *o, bench_prompt *prompts)
{
    td_rng rng;
    td_rng_seed(&rng, (uint64_t)o->seed);
    int32_t *prefix = malloc((size_t)(o->prefix_len + 1) * sizeof(int32_t));
    if (!prefix) return TD_ENOMEM;
    td_rng prefix_rng;
    td_rng_seed(&prefix_rng, (uint64_t)o->seed ^ 0x5eedf00dull);
    for (int64_t k = 0; k < o->prefix_len; k++)
        prefix[k] = 3 + (int32_t)(td_rng_next(&prefix_rng) % (uint64_t)(o->vocab - 3));
    for (int64_t i = 0; i < o->num_prompts; i++) {
        bench_prompt *p = &prompts[i];
        int64_t in_len = uniform_len(&rng, o->input_len, o->range_ratio);
        p->output_len = (int)uniform_len(&rng, o->output_len, o->range_ratio);
        p->prompt_len = (long)(o->prefix_len + in_len);
        if (o->chat) {
            /* Chat takes text: the same words for the prefix on every prompt. */
            p->text = malloc((size_t)p->prompt_len * 8 + 1);
            if (!p->text) break;
            td_rng words_rng;
            td_rng_seed(&words_rng, (uint64_t)o->seed ^ 0x5eedf00dull);
            size_t off = append_words(p->text, 0, &words_rng, o->prefix_len);
            off = append_words(p->text, off, &rng, in_len);
            p->text[off] = '\0';
        } else {
            p->num_ids = (int)p->prompt_len;
            p->ids = malloc((size_t)p->num_ids * sizeof(int32_t));
            if (!p->ids) break;
            memcpy(p->ids, prefix, (size_t)o->prefix_len * sizeof(int32_t));
            for (int64_t k = 0; k < in_len; k++)
                p->ids[o->prefix_len + k] =
                    3 + (int32_t)(td_rng_next(&rng) % (uint64_t)(o->vocab - 3));
        }
    }
    free(prefix);
    for (int64_t i = 0; i < o->num_prompts; i++)
        if (!prompts[i].ids && !prompts[i].text) return TD_ENOMEM;
    return 0;
}

static char *read_file(const char *path, td_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        td_err_set(err, TD_EIO, "cannot open '%s': %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    long size = -1;
    if (!fseek(f, 0, SEEK_END) && (size = ftell(f)) >= 0 && !fseek(f, 0, SEEK_SET))
        buf = malloc((size_t)size + 1);
    if (!buf || fread(buf, 1, (size_t)size, f) != (size_t)size) {
        td_err_set(err, TD_EIO, "cannot read '%s'", path);
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    buf[size] = '\0';
    return buf;
}

static long count_words(const char *s)
{
    long n = 0;
    bool in_word = false;
    for (; *s; s++) {
        bool space = *s == ' ' || *s == '\n' || *s == '\t' || *s == '\r';
        if (!space && !in_word) n++;
        in_word = !space;
    }
    return n;
}

/* The first human turn and the gpt turn after it, or false when there are none. */
static bool sharegpt_pair(const cJSON *entry, const char **human, const char **gpt)
{
    const cJSON *conv = cJSON_GetObjectItemCaseSensitive(entry, "conversations");
    if (!cJSON_IsArray(conv)) return false;
    *human = *gpt = NULL;
    const cJSON *turn;
    cJSON_ArrayForEach(turn, conv)
    {
        const cJSON *from = cJSON_GetObjectItemCaseSensitive(turn, "from");
        const cJSON *value = cJSON_GetObjectItemCaseSensitive(turn, "value");
        if (!cJSON_IsString(from) || !cJSON_IsString(value)) return false;
        if (!*human) {
            if (strcmp(from->valuestring, "human")) return false;
            if (!value->valuestring[0]) return false;
            *human = value->valuestring;
        } else {
            if (strcmp(from->valuestring, "gpt")) return false;
            *gpt = value->valuestring;
            return true;
        }
    }
    return false;
}

/* ShareGPT: entries shuffled with the seed; prompt = first human turn; output length = the
 * gpt answer's word count, capped. Lowers o->num_prompts when the file has fewer. */
static int dataset_sharegpt(bench_opts *o, bench_prompt *prompts, td_err *err)
{
    char *text = read_file(o->dataset_path, err);
    if (!text) return TD_EIO;
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsArray(root)) {
        cJSON_Delete(root);
        return td_err_set(err, TD_EFORMAT, "'%s' is not a ShareGPT JSON array", o->dataset_path);
    }
    int n = cJSON_GetArraySize(root);
    int *order = malloc((size_t)(n + 1) * sizeof(int));
    if (!order) {
        cJSON_Delete(root);
        return td_err_set(err, TD_ENOMEM, "out of memory");
    }
    const cJSON **entries = malloc((size_t)(n + 1) * sizeof(*entries));
    int k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, root)
    {
        if (entries) entries[k] = e;
        order[k] = k;
        k++;
    }
    td_rng rng;
    td_rng_seed(&rng, (uint64_t)o->seed);
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(td_rng_next(&rng) % (uint64_t)(i + 1));
        int t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    long cap = o->output_len_given ? (long)o->output_len : SHAREGPT_OUTPUT_CAP;
    int64_t got = 0;
    for (int i = 0; entries && i < n && got < o->num_prompts; i++) {
        const char *human, *gpt;
        if (!sharegpt_pair(entries[order[i]], &human, &gpt)) continue;
        bench_prompt *p = &prompts[got];
        p->text = strdup(human);
        if (!p->text) break;
        p->prompt_len = count_words(human);
        long out = count_words(gpt);
        p->output_len = (int)TD_MAX(1, TD_MIN(out, cap));
        got++;
    }
    free(entries);
    free(order);
    cJSON_Delete(root);
    if (got == 0)
        return td_err_set(err, TD_EFORMAT,
                          "'%s' has no conversation that starts with a human "
                          "turn followed by a gpt turn",
                          o->dataset_path);
    if (got < o->num_prompts) {
        fprintf(stderr, "warning: '%s' has only %ld usable conversations; running %ld prompts\n",
                o->dataset_path, (long)got, (long)got);
        o->num_prompts = got;
    }
    return 0;
}

/* One prompt a line (empty lines skipped), reused from the top when there are fewer lines
 * than --num-prompts. */
static int dataset_prompts(const bench_opts *o, bench_prompt *prompts, td_err *err)
{
    char *text = read_file(o->dataset_path, err);
    if (!text) return TD_EIO;
    char **lines = NULL;
    size_t num_lines = 0, cap = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        size_t len = strlen(line);
        if (len && line[len - 1] == '\r') line[--len] = '\0';
        if (!len) continue;
        if (num_lines == cap) {
            cap = cap ? cap * 2 : 256;
            char **grown = realloc(lines, cap * sizeof(char *));
            if (!grown) break;
            lines = grown;
        }
        lines[num_lines++] = line;
    }
    int rc = 0;
    if (!num_lines) rc = td_err_set(err, TD_EFORMAT, "'%s' has no prompts", o->dataset_path);
    for (int64_t i = 0; !rc && i < o->num_prompts; i++) {
        const char *line = lines[(size_t)i % num_lines];
        if (!(prompts[i].text = strdup(line))) rc = td_err_set(err, TD_ENOMEM, "out of memory");
        prompts[i].prompt_len = count_words(line);
        prompts[i].output_len = (int)o->output_len;
    }
    free(lines);
    free(text);
    return rc;
}

/* ---- requests ---- */

typedef struct bench_call {
    bench_request *r;
    const bench_prompt *prompt;
    CURL *easy;
    char *body;
    bench_sse sse; /* the stream's reader, filling r */
    char error_body[ERROR_BODY_CAP + 1];
    size_t error_len;
    double t_heard; /* when it was sent, or when the server last sent a byte of it */
} bench_call;

typedef struct bench_run {
    const bench_opts *o;
    CURLM *multi;
    struct curl_slist *headers;
    char url[1100]; /* base URL (< 1024 bytes) and endpoint */
    bench_call *calls;
    long in_flight, finished;
    bench_failure failures[MAX_FAILURE_KINDS];
    int num_failures;
    long failures_shown;
} bench_run;

/* The SSE stream as it arrives: every event of this chunk gets the same timestamp, the
 * moment its bytes reached us. */
static size_t on_data(char *p, size_t size, size_t n, void *arg)
{
    bench_call *c = arg;
    size_t len = size * n;
    c->t_heard = td_now_s();
    if (c->error_len < ERROR_BODY_CAP) {
        size_t k = TD_MIN(len, ERROR_BODY_CAP - c->error_len);
        memcpy(c->error_body + c->error_len, p, k);
        c->error_len += k;
        c->error_body[c->error_len] = '\0';
    }
    return bench_sse_feed(&c->sse, p, len, td_now_s()) ? len : 0; /* 0: CURLE_WRITE_ERROR */
}

static char *request_body(const bench_opts *o, const bench_prompt *p)
{
    cJSON *b = cJSON_CreateObject();
    if (!b) return NULL;
    if (o->model) cJSON_AddStringToObject(b, "model", o->model);
    if (o->chat) {
        cJSON *messages = cJSON_AddArrayToObject(b, "messages");
        cJSON *m = cJSON_CreateObject();
        cJSON_AddItemToArray(messages, m);
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", p->text);
    } else if (p->ids) {
        cJSON_AddItemToObject(b, "prompt", cJSON_CreateIntArray(p->ids, p->num_ids));
    } else {
        cJSON_AddStringToObject(b, "prompt", p->text);
    }
    cJSON_AddNumberToObject(b, "max_tokens", p->output_len);
    cJSON_AddNumberToObject(b, "temperature", o->temperature);
    cJSON_AddTrueToObject(b, "stream");
    cJSON_AddTrueToObject(cJSON_AddObjectToObject(b, "stream_options"), "include_usage");
    if (o->ignore_eos) cJSON_AddTrueToObject(b, "ignore_eos");
    char *text = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    return text;
}

static int call_start(bench_run *run, bench_call *c)
{
    c->body = request_body(run->o, c->prompt);
    c->easy = curl_easy_init();
    if (!c->body || !c->easy) return TD_ENOMEM;
    CURL *e = c->easy;
    curl_easy_setopt(e, CURLOPT_URL, run->url);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, c->body);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, run->headers);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(e, CURLOPT_PRIVATE, c);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT, 30L);
    /* A server that goes silent (no answer, or a stream that stops) fails the request
     * after --idle-timeout seconds instead of holding the run forever: run_requests
     * watches t_heard (libcurl's low-speed limit averages over seconds, the upload
     * included, and fired 5 s late). */
    c->r->t_send = c->t_heard = td_now_s();
    if (curl_multi_add_handle(run->multi, e) != CURLM_OK) return TD_EIO;
    run->in_flight++;
    return 0;
}

static void tally_failure(bench_run *run, const char *reason)
{
    int slot = 0;
    while (slot < run->num_failures && strcmp(run->failures[slot].reason, reason))
        slot++;
    if (slot == run->num_failures) {
        /* A new reason; past the table's size, the last row becomes "other". */
        if (run->num_failures < MAX_FAILURE_KINDS)
            run->num_failures++;
        else
            slot = MAX_FAILURE_KINDS - 1, reason = "other";
        snprintf(run->failures[slot].reason, sizeof(run->failures[slot].reason), "%s", reason);
    }
    run->failures[slot].count++;
}

/* Decides how a finished request went and releases what it held but its timestamps. */
static void call_finish(bench_run *run, bench_call *c, CURLcode result)
{
    bench_request *r = c->r;
    long code = 0;
    curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &code);
    double now = td_now_s();
    bench_sse_end(&c->sse, now);
    char reason[96] = "";
    if (c->sse.too_long) {
        snprintf(reason, sizeof(reason), "SSE line longer than %u bytes", BENCH_SSE_LINE_CAP);
    } else if (result == CURLE_OPERATION_TIMEDOUT) {
        snprintf(reason, sizeof(reason),
                 "timeout: nothing from the server for %g s (--idle-timeout)",
                 run->o->idle_timeout);
    } else if (result != CURLE_OK) {
        snprintf(reason, sizeof(reason), "connection error: %s", curl_easy_strerror(result));
    } else if (code != 200) {
        snprintf(reason, sizeof(reason), "HTTP %ld", code);
    } else if (c->sse.stream_error[0]) {
        snprintf(reason, sizeof(reason), "%.90s", c->sse.stream_error);
    } else if (!c->sse.done) {
        snprintf(reason, sizeof(reason), "stream ended without [DONE]");
    } else if (c->sse.bad_event) {
        snprintf(reason, sizeof(reason), "malformed SSE event");
    }
    r->ok = !reason[0];
    if (r->ok) {
        if (!c->sse.have_usage) r->output_tokens = (long)r->num_events;
        if (r->prompt_tokens <= 0) r->prompt_tokens = c->prompt->prompt_len;
    } else {
        snprintf(r->error, sizeof(r->error), "%s", reason);
        tally_failure(run, reason);
        while (c->error_len &&
               (c->error_body[c->error_len - 1] == '\n' || c->error_body[c->error_len - 1] == '\r'))
            c->error_body[--c->error_len] = '\0';
        if (run->failures_shown++ < MAX_FAILURES_SHOWN)
            fprintf(stderr, "request failed: %s; body: %.200s\n", reason,
                    c->error_len ? c->error_body : "(none)");
    }
    curl_multi_remove_handle(run->multi, c->easy);
    curl_easy_cleanup(c->easy);
    c->easy = NULL;
    free(c->body);
    c->body = NULL;
    bench_sse_free(&c->sse);
    run->in_flight--;
    run->finished++;
}

static void progress(const bench_run *run, long total, double t0, bool final)
{
    const int width = 30;
    int filled = (int)(width * run->finished / (total ? total : 1));
    char bar[64];
    memset(bar, '=', (size_t)filled);
    memset(bar + filled, ' ', (size_t)(width - filled));
    bar[width] = '\0';
    fprintf(stderr, "\r[%s] %ld/%ld requests, %ld in flight, %.1f s%s", bar, run->finished, total,
            run->in_flight, td_now_s() - t0, final ? "\n" : "");
    fflush(stderr);
}

/*
 * Runs every request: request i becomes due at t0 + offset[i], and starts when it is due
 * and fewer than --max-concurrency are in flight (so a request that waited for a slot
 * starts as soon as one frees, and its latencies count from then). Returns the duration in
 * seconds, from the start to the last request's end, or a negative code.
 */
static double run_requests(bench_run *run, const double *offset)
{
    const bench_opts *o = run->o;
    long n = (long)o->num_prompts, next = 0;
    bool show_progress = isatty(STDERR_FILENO);
    double t0 = td_now_s(), t_progress = 0, t_idle_check = 0;
    while (run->finished < n) {
        double now = td_now_s();
        while (next < n && t0 + offset[next] <= now &&
               (o->max_concurrency == 0 || run->in_flight < o->max_concurrency)) {
            if (call_start(run, &run->calls[next])) {
                fprintf(stderr, "error: cannot start request %ld\n", next);
                return TD_ENOMEM;
            }
            next++;
        }
        int running;
        CURLMcode mc = curl_multi_perform(run->multi, &running);
        if (mc != CURLM_OK) {
            fprintf(stderr, "error: curl_multi_perform: %s\n", curl_multi_strerror(mc));
            return TD_EIO;
        }
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(run->multi, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            bench_call *c;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&c);
            call_finish(run, c, msg->data.result);
        }
        if (run->finished >= n) break;
        if (o->idle_timeout > 0 && td_now_s() - t_idle_check >= 0.05) {
            t_idle_check = td_now_s();
            for (long i = 0; i < next; i++) {
                bench_call *c = &run->calls[i];
                if (c->easy && t_idle_check - c->t_heard > o->idle_timeout)
                    call_finish(run, c, CURLE_OPERATION_TIMEDOUT);
            }
            if (run->finished >= n) break;
        }
        /* Sleep until data arrives, the next request is due, or 100 ms pass (the progress
         * bar's tick). A request whose slot is free but is not yet due bounds the wait. */
        now = td_now_s();
        int wait_ms = 100;
        bool slot_free = o->max_concurrency == 0 || run->in_flight < o->max_concurrency;
        if (next < n && slot_free) {
            double due = t0 + offset[next] - now;
            wait_ms = due <= 0 ? 0 : TD_MIN(wait_ms, (int)ceil(due * 1e3));
        }
        if (wait_ms > 0) curl_multi_poll(run->multi, NULL, 0, wait_ms, NULL);
        if (show_progress && td_now_s() - t_progress > 0.1) {
            progress(run, n, t0, false);
            t_progress = td_now_s();
        }
    }
    double duration = td_now_s() - t0;
    if (show_progress) progress(run, n, t0, true);
    return duration;
}

/* GET /v1/models (with the run's headers: the API key) and take the first id; NULL when
 * there is none. */
static char *first_model_id(const char *base_url, struct curl_slist *headers)
{
    struct {
        char data[65536];
        size_t len;
    } *buf = calloc(1, sizeof(*buf));
    CURL *e = curl_easy_init();
    char url[1100]; /* base_url is at most 1023 bytes */
    snprintf(url, sizeof(url), "%s/v1/models", base_url);
    char *id = NULL;
    if (!buf || !e) goto out;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(e, CURLOPT_TIMEOUT, 30L);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    FILE *mem = fmemopen(buf->data, sizeof(buf->data) - 1, "w");
    if (!mem) goto out;
    curl_easy_setopt(e, CURLOPT_WRITEDATA, mem);
    CURLcode rc = curl_easy_perform(e);
    long code = 0;
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &code);
    buf->len = (size_t)ftell(mem);
    fclose(mem);
    buf->data[buf->len] = '\0';
    if (rc != CURLE_OK || code != 200) {
        fprintf(stderr, "warning: GET %s failed (%s); sending no model name\n", url,
                rc != CURLE_OK ? curl_easy_strerror(rc) : "HTTP error");
        goto out;
    }
    cJSON *j = cJSON_Parse(buf->data);
    const cJSON *first = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(j, "data"), 0);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(first, "id");
    if (cJSON_IsString(name)) id = strdup(name->valuestring);
    cJSON_Delete(j);
    if (!id) fprintf(stderr, "warning: %s lists no model; sending no model name\n", url);
out:
    if (e) curl_easy_cleanup(e);
    free(buf);
    return id;
}

/* ---- flags ---- */

/*
 * `--compare a.json b.json ...` and `--goodput ttft:500 tpot:50` take several values, as in
 * vLLM. The strict parser takes one value a flag, so the arguments that follow these two
 * flags (up to the next option) are rewritten into one flag each. Returns a new argv (free
 * it) of *out_argc entries.
 */
static char **expand_multi_value_flags(int argc, char **argv, int *out_argc)
{
    char **args = malloc((size_t)(2 * argc + 1) * sizeof(char *));
    if (!args) return NULL;
    int n = 0;
    args[n++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool multi = !strcmp(a, "--compare") || !strcmp(a, "--goodput");
        args[n++] = argv[i];
        if (!multi || i + 1 >= argc) continue;
        args[n++] = argv[++i]; /* the first value, whatever it is */
        while (i + 1 < argc && argv[i + 1][0] != '-') {
            args[n++] = (char *)a;
            args[n++] = argv[++i];
        }
    }
    args[n] = NULL;
    *out_argc = n;
    return args;
}

static int parse_percentiles(const char *text, bench_opts *o)
{
    o->num_percentiles = 0;
    const char *p = text;
    while (*p) {
        char *end;
        double v = strtod(p, &end);
        if (end == p || !(v > 0 && v <= 100) || (*end && *end != ',') ||
            o->num_percentiles == BENCH_MAX_PERCENTILES)
            return TD_EINVAL;
        for (int i = 0; i < o->num_percentiles; i++) /* a key twice in the result */
            if (o->percentiles[i] == v) return TD_EINVAL;
        o->percentiles[o->num_percentiles++] = v;
        p = *end ? end + 1 : end;
    }
    return o->num_percentiles ? 0 : TD_EINVAL;
}

static int usage_error(const char *fmt, const char *what)
{
    fprintf(stderr, "error: ");
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n");
    return 2;
}

/* Checks and completes the options; returns 0 or 2 (a usage error, printed). */
static int check_opts(bench_opts *o, const cli_str_list *goodput)
{
    if (!o->base_url) return usage_error("%s is required", "--base-url");
    if (!strcmp(o->endpoint, "/v1/completions"))
        o->chat = false;
    else if (!strcmp(o->endpoint, "/v1/chat/completions"))
        o->chat = true;
    else
        return usage_error("--endpoint must be /v1/completions or /v1/chat/completions, not '%s'",
                           o->endpoint);
    if (!strcmp(o->dataset_name, "random"))
        o->dataset = DATASET_RANDOM;
    else if (!strcmp(o->dataset_name, "sharegpt"))
        o->dataset = DATASET_SHAREGPT;
    else if (!strcmp(o->dataset_name, "prompts"))
        o->dataset = DATASET_PROMPTS;
    else
        return usage_error("--dataset must be random, sharegpt or prompts, not '%s'",
                           o->dataset_name);
    if (o->dataset != DATASET_RANDOM && !o->dataset_path)
        return usage_error("--dataset %s needs --dataset-path FILE", o->dataset_name);
    if (o->num_prompts < 1 || o->num_prompts > 10000000)
        return usage_error("%s must be between 1 and 10000000", "--num-prompts");
    if (o->max_concurrency < 0)
        return usage_error("%s must be 0 (unlimited) or more", "--max-concurrency");
    if (o->input_len < 1 || o->input_len > 1 << 20)
        return usage_error("%s must be between 1 and 1048576", "--input-len");
    if (o->output_len < 1 || o->output_len > 1 << 20)
        return usage_error("%s must be between 1 and 1048576", "--output-len");
    if (o->prefix_len < 0 || o->prefix_len > 1 << 20)
        return usage_error("%s must be between 0 and 1048576", "--prefix-len");
    if (!(o->range_ratio >= 0 && o->range_ratio < 1))
        return usage_error("%s must be in [0, 1)", "--range-ratio");
    if (o->vocab < 4 || o->vocab > INT32_MAX)
        return usage_error("%s must be at least 4", "--vocab");
    if (!(o->burstiness > 0)) return usage_error("%s must be positive", "--burstiness");
    if (!(o->temperature >= 0)) return usage_error("%s must be 0 or more", "--temperature");
    if (!(o->idle_timeout >= 0 && o->idle_timeout <= 86400))
        return usage_error("%s must be in [0, 86400] seconds", "--idle-timeout");
    if (!strcasecmp(o->request_rate_text, "inf")) {
        o->request_rate = INFINITY;
    } else if (td_parse_f64(o->request_rate_text, &o->request_rate) || !(o->request_rate > 0)) {
        return usage_error("--request-rate must be a positive number or inf, not '%s'",
                           o->request_rate_text);
    }
    for (int i = 0; i < goodput->n; i++) {
        td_err err = {0};
        if (bench_slo_parse(goodput->v[i], &o->slo, &err))
            return usage_error("--goodput: %s", err.msg);
    }
    if (parse_percentiles(o->percentiles_text, o))
        return usage_error("--percentiles must be numbers in (0, 100] separated by commas, not "
                           "'%s'",
                           o->percentiles_text);
    size_t len = strlen(o->base_url);
    if (len >= 900) return usage_error("%s is too long", "--base-url");
    return 0;
}

/* ---- the subcommand ---- */

static int run_benchmark(bench_opts *o)
{
    int rc = 1;
    td_err err = {0};
    char base[1024];
    snprintf(base, sizeof(base), "%s", o->base_url);
    for (size_t len = strlen(base); len && base[len - 1] == '/';)
        base[--len] = '\0';
    if (o->save_result) { /* before the run, not after it: an unwritable path fails now */
        bool existed = access(o->save_result, F_OK) == 0;
        FILE *f = fopen(o->save_result, "a");
        if (!f) {
            fprintf(stderr, "error: --save-result %s: cannot write it: %s\n", o->save_result,
                    strerror(errno));
            return 2;
        }
        fclose(f);
        if (!existed) unlink(o->save_result);
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    char *model_owned = NULL;
    bench_prompt *prompts = calloc((size_t)o->num_prompts, sizeof(bench_prompt));
    bench_request *reqs = NULL;
    double *offset = NULL;
    bench_run run = {.o = o};
    if (!prompts) goto out;
    int drc = o->dataset == DATASET_RANDOM     ? dataset_random(o, prompts)
              : o->dataset == DATASET_SHAREGPT ? dataset_sharegpt(o, prompts, &err)
                                               : dataset_prompts(o, prompts, &err);
    if (drc) {
        fprintf(stderr, "error: %s\n", err.msg[0] ? err.msg : td_strerror(drc));
        goto out;
    }
    long n = (long)o->num_prompts;
    reqs = calloc((size_t)n, sizeof(bench_request));
    run.calls = calloc((size_t)n, sizeof(bench_call));
    offset = calloc((size_t)n, sizeof(double));
    if (!reqs || !run.calls || !offset) goto out;
    bench_arrivals arrivals;
    bench_arrivals_init(&arrivals, o->request_rate, o->burstiness, (uint64_t)o->seed + 1);
    for (long i = 0; i < n; i++) {
        bench_request_init(&reqs[i]);
        run.calls[i].r = &reqs[i];
        bench_sse_init(&run.calls[i].sse, &reqs[i]);
        run.calls[i].prompt = &prompts[i];
        /* the first request goes at once, then a gap after each, as vLLM does */
        if (i > 0) offset[i] = offset[i - 1] + bench_arrivals_next(&arrivals);
    }
    snprintf(run.url, sizeof(run.url), "%s%s", base, o->endpoint);
    run.headers = curl_slist_append(NULL, "Content-Type: application/json");
    run.headers = curl_slist_append(run.headers, "Expect:");
    const char *key = getenv("OPENAI_API_KEY");
    if (key && *key) {
        char auth[512];
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", key);
        run.headers = curl_slist_append(run.headers, auth);
    }
    run.multi = curl_multi_init();
    if (!run.headers || !run.multi) goto out;
    if (!o->model) o->model = model_owned = first_model_id(base, run.headers);
    if (o->max_concurrency > 0) {
        curl_multi_setopt(run.multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, (long)o->max_concurrency);
        curl_multi_setopt(run.multi, CURLMOPT_MAXCONNECTS, (long)o->max_concurrency);
    }
    fprintf(stderr, "bench: %ld requests to %s (model %s), rate %g req/s, max concurrency %ld%s\n",
            n, run.url, o->model ? o->model : "(none)", o->request_rate, (long)o->max_concurrency,
            o->max_concurrency ? "" : " (unlimited)");
    double duration = run_requests(&run, offset);
    if (duration < 0) goto out;

    bench_results res;
    if (bench_compute(reqs, (size_t)n, duration, &o->slo, o->percentiles, o->num_percentiles,
                      &res)) {
        fprintf(stderr, "error: out of memory computing the results\n");
        goto out;
    }
    bench_run_info info = {
        .label = o->label,
        .base_url = base,
        .endpoint = o->endpoint,
        .model = o->model,
        .dataset = o->dataset_name,
        .num_prompts = n,
        .max_concurrency = (long)o->max_concurrency,
        .request_rate = o->request_rate,
        .burstiness = o->burstiness,
        .input_len = (long)o->input_len,
        .output_len = (long)o->output_len,
        .prefix_len = (long)o->prefix_len,
        .range_ratio = o->range_ratio,
        .slo = &o->slo,
        .percentiles = o->percentiles,
        .num_percentiles = o->num_percentiles,
        .failures = run.failures,
        .num_failures = run.num_failures,
    };
    bench_report_print(stdout, &info, &res);
    fflush(stdout);
    /* Random prompts share no prefix unless --prefix-len asks for one: cached tokens mean
     * the server saw these prompts before (the same --seed against the same server), and
     * their prefills were skipped. */
    if (o->dataset == DATASET_RANDOM && o->prefix_len == 0 && res.total_input_tokens > 0 &&
        res.total_cached_tokens * 20 > res.total_input_tokens)
        fprintf(stderr,
                "warning: %.0f%% of the prompt tokens came from the server's prefix cache: it has "
                "seen these prompts before (use another --seed against the same server)\n",
                100.0 * (double)res.total_cached_tokens / (double)res.total_input_tokens);
    rc = res.completed > 0 ? 0 : 1;
    if (o->save_result && bench_report_save(o->save_result, &info, &res, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        rc = 1;
    }
out:
    for (long i = 0; run.calls && i < (long)o->num_prompts; i++) {
        bench_call *c = &run.calls[i];
        if (c->easy) {
            curl_multi_remove_handle(run.multi, c->easy);
            curl_easy_cleanup(c->easy);
        }
        free(c->body);
        bench_sse_free(&c->sse);
    }
    for (long i = 0; reqs && i < (long)o->num_prompts; i++)
        bench_request_free(&reqs[i]);
    for (long i = 0; prompts && i < (long)o->num_prompts; i++) {
        free(prompts[i].ids);
        free(prompts[i].text);
    }
    if (run.multi) curl_multi_cleanup(run.multi);
    curl_slist_free_all(run.headers);
    free(run.calls);
    free(reqs);
    free(offset);
    free(prompts);
    free(model_owned);
    o->model = NULL;
    curl_global_cleanup();
    return rc;
}

int cli_bench(int argc, char **argv)
{
    bench_opts o = {
        .endpoint = "/v1/completions",
        .dataset_name = "random",
        .plot = "compare.svg",
        .percentiles_text = "50,90,99",
        .request_rate_text = "inf",
        .input_len = 1024,
        .output_len = 128,
        .num_prompts = 1000,
        .vocab = 32000,
        .burstiness = 1.0,
        .idle_timeout = 300,
    };
    cli_str_list goodput = {0}, compare = {0};
    cli_flag flags[] = {
        CLI_FLAG("base-url", CLI_FLAG_STR, &o.base_url,
                 "the server, e.g. http://127.0.0.1:8000 (required)"),
        CLI_FLAG("endpoint", CLI_FLAG_STR, &o.endpoint,
                 "/v1/completions or /v1/chat/completions (/v1/completions)"),
        CLI_FLAG("model", CLI_FLAG_STR, &o.model,
                 "model name sent in each request (the first id of GET /v1/models)"),
        CLI_FLAG("dataset", CLI_FLAG_STR, &o.dataset_name, "random, sharegpt or prompts (random)"),
        CLI_FLAG("dataset-path", CLI_FLAG_STR, &o.dataset_path,
                 "ShareGPT JSON, or a file of prompts one a line"),
        CLI_FLAG("num-prompts", CLI_FLAG_INT, &o.num_prompts, "requests to send (1000)"),
        CLI_FLAG("input-len", CLI_FLAG_INT, &o.input_len, "random: prompt tokens (1024)"),
        CLI_FLAG("output-len", CLI_FLAG_INT, &o.output_len,
                 "max_tokens (128); caps ShareGPT outputs (else 1024)"),
        CLI_FLAG("range-ratio", CLI_FLAG_FLOAT, &o.range_ratio,
                 "random: lengths uniform in [len*(1-r), len*(1+r)] (0)"),
        CLI_FLAG("prefix-len", CLI_FLAG_INT, &o.prefix_len,
                 "random: tokens of a prefix shared by every prompt, before input-len (0)"),
        CLI_FLAG("vocab", CLI_FLAG_INT, &o.vocab,
                 "random: token ids drawn from [3, vocab) (32000)"),
        CLI_FLAG("max-concurrency", CLI_FLAG_INT, &o.max_concurrency,
                 "requests in flight at most (0 = unlimited)"),
        CLI_FLAG("request-rate", CLI_FLAG_STR, &o.request_rate_text,
                 "arrivals per second, Poisson (inf = all at once)"),
        CLI_FLAG("burstiness", CLI_FLAG_FLOAT, &o.burstiness,
                 "gamma shape of the inter-arrival times (1 = Poisson)"),
        CLI_FLAG("ignore-eos", CLI_FLAG_BOOL, &o.ignore_eos, "send ignore_eos: true"),
        CLI_FLAG("temperature", CLI_FLAG_FLOAT, &o.temperature, "sampling temperature (0)"),
        CLI_FLAG("idle-timeout", CLI_FLAG_FLOAT, &o.idle_timeout,
                 "seconds without a byte from the server before a request fails (300; 0: none)"),
        CLI_FLAG("seed", CLI_FLAG_INT, &o.seed, "seed of the dataset and the arrivals (0)"),
        CLI_FLAG("goodput", CLI_FLAG_LIST, &goodput,
                 "SLOs in ms: ttft:MS tpot:MS e2el:MS (any subset)"),
        CLI_FLAG("percentiles", CLI_FLAG_STR, &o.percentiles_text,
                 "percentiles reported (50,90,99)"),
        CLI_FLAG("save-result", CLI_FLAG_STR, &o.save_result, "write every metric to FILE.json"),
        CLI_FLAG("label", CLI_FLAG_STR, &o.label, "name of this run in the results"),
        CLI_FLAG("compare", CLI_FLAG_LIST, &compare,
                 "result files: print them side by side and plot them (runs nothing)"),
        CLI_FLAG("plot", CLI_FLAG_STR, &o.plot, "--compare: the SVG written (compare.svg)"),
    };
    int n_args;
    char **args = expand_multi_value_flags(argc, argv, &n_args);
    if (!args) return 1;
    int rc = cli_flags_parse(flags, (int)TD_ARRAY_LEN(flags), n_args, args,
                             "tandem bench --base-url URL [options] | "
                             "tandem bench --compare a.json b.json ... [--plot FILE.svg]");
    free(args);
    if (rc) return rc == 1 ? 0 : 2;
    for (size_t i = 0; i < TD_ARRAY_LEN(flags); i++)
        if (!strcmp(flags[i].name, "output-len")) o.output_len_given = flags[i].seen;
    if (compare.n > 0) {
        if (o.base_url) return usage_error("%s runs nothing: leave out --base-url", "--compare");
        td_err err = {0};
        if (bench_compare(compare.v, compare.n, o.plot, stdout, &err)) {
            fprintf(stderr, "error: %s\n", err.msg);
            return 1;
        }
        return 0;
    }
    rc = check_opts(&o, &goodput);
    if (rc) return rc;
    return run_benchmark(&o);
}
