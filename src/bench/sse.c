/*
 * bench/sse.c - see sse.h.
 */
#include "bench/sse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

static double json_number(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) ? v->valuedouble : NAN;
}

/* A count the server reports: *out = an integer in [0, 2^40], or -1 where the field is
 * absent or null; false if it is there but not such a count (a double beyond a long's range
 * would be undefined to convert). */
static bool json_count(const cJSON *o, const char *name, long *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    *out = -1;
    if (!v || cJSON_IsNull(v)) return true;
    double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
    if (!(d >= 0 && d <= 1099511627776.0 && d == floor(d))) return false;
    *out = (long)d;
    return true;
}

static bool nonempty_string(const cJSON *v)
{
    return cJSON_IsString(v) && v->valuestring[0];
}

/* One "data:" payload of the stream, received at time now. */
static void handle_event(bench_sse *s, const char *data, size_t len, double now)
{
    bench_request *r = s->r;
    if (s->done) { /* nothing may follow [DONE]: what does is not believed */
        s->bad_event = true;
        return;
    }
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        s->done = true;
        r->t_end = now;
        return;
    }
    const char *end = NULL;
    cJSON *ev = cJSON_ParseWithLengthOpts(data, len, &end, false);
    for (const char *p = end; ev && p && p < data + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') { /* one JSON value only */
            cJSON_Delete(ev);
            ev = NULL;
        }
    if (!ev) {
        s->bad_event = true;
        return;
    }
    const cJSON *error = cJSON_GetObjectItemCaseSensitive(ev, "error");
    if (error && !cJSON_IsNull(error) && !s->stream_error[0]) {
        const cJSON *msg = cJSON_GetObjectItemCaseSensitive(error, "message");
        snprintf(s->stream_error, sizeof(s->stream_error), "error event: %.80s",
                 cJSON_IsString(msg) ? msg->valuestring : "(no message)");
    }
    /* A token event: a choice with text (completions) or delta content (chat; a reasoning
     * model's reasoning_content counts as output too). Servers that stream one event per
     * token (tandem) send some with empty text: a token whose bytes do not complete a
     * UTF-8 character yet. Those count, or time to first token and the gaps would be
     * measured to the first printable text instead. Not counted: the role-only first chunk
     * of a chat stream, and an empty chunk that only carries the finish reason. */
    bool content = false;
    const cJSON *choice;
    cJSON_ArrayForEach(choice, cJSON_GetObjectItemCaseSensitive(ev, "choices"))
    {
        const cJSON *delta = cJSON_GetObjectItemCaseSensitive(choice, "delta");
        const cJSON *fin = cJSON_GetObjectItemCaseSensitive(choice, "finish_reason");
        bool finishing = fin && !cJSON_IsNull(fin);
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(choice, "text");
        const cJSON *dc = cJSON_GetObjectItemCaseSensitive(delta, "content");
        bool role = cJSON_GetObjectItemCaseSensitive(delta, "role") != NULL;
        content |= nonempty_string(text) || nonempty_string(dc) ||
                   nonempty_string(cJSON_GetObjectItemCaseSensitive(delta, "reasoning_content")) ||
                   (!finishing && !role && (cJSON_IsString(text) || cJSON_IsString(dc)));
    }
    if (content && bench_request_add_event(r, now)) s->bad_event = true;
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(ev, "usage");
    if (cJSON_IsObject(usage)) {
        long prompt, completion, cached;
        bool ok = json_count(usage, "prompt_tokens", &prompt);
        ok &= json_count(usage, "completion_tokens", &completion);
        ok &= json_count(cJSON_GetObjectItemCaseSensitive(usage, "prompt_tokens_details"),
                         "cached_tokens", &cached);
        if (!ok) s->bad_event = true;
        if (prompt >= 0) r->prompt_tokens = prompt;
        if (cached >= 0) r->cached_tokens = cached;
        if (completion >= 0) {
            r->output_tokens = completion;
            s->have_usage = true;
        }
        const cJSON *timings = cJSON_GetObjectItemCaseSensitive(usage, "timings");
        for (int f = BENCH_T_SERVER_QUEUE; f <= BENCH_T_SERVER_E2E; f++) {
            double v = json_number(timings, bench_timing_json_name((bench_timing_field)f));
            if (!isnan(v)) r->timing_ms[f] = v;
        }
    }
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(ev, "kv_transfer_params");
    const cJSON *timing = cJSON_GetObjectItemCaseSensitive(kv, "timing");
    for (int f = BENCH_T_PRODUCER_QUEUE; timing && f <= BENCH_T_FIRST_DECODE_STEP; f++) {
        double v = json_number(timing, bench_timing_json_name((bench_timing_field)f));
        if (!isnan(v)) r->timing_ms[f] = v;
    }
    cJSON_Delete(ev);
}

static void end_line(bench_sse *s, double now)
{
    const char *l = s->line;
    size_t len = s->line_len;
    s->line_len = 0;
    if (len < 5 || memcmp(l, "data:", 5)) return; /* comments, event:, id:, blank lines */
    l += 5;
    len -= 5;
    if (len && *l == ' ') l++, len--;
    handle_event(s, l, len, now);
}

void bench_sse_init(bench_sse *s, bench_request *r)
{
    memset(s, 0, sizeof(*s));
    s->r = r;
}

bool bench_sse_feed(bench_sse *s, const char *p, size_t len, double now)
{
    for (size_t i = 0; i < len; i++) {
        char ch = p[i];
        if (ch == '\n') {
            end_line(s, now);
            continue;
        }
        if (ch == '\r') continue;
        if (s->line_len + 1 >= s->line_cap) {
            if (s->line_cap >= BENCH_SSE_LINE_CAP) {
                s->too_long = true;
                return false;
            }
            size_t cap = s->line_cap ? s->line_cap * 2 : 4096;
            char *grown = realloc(s->line, cap);
            if (!grown) return false;
            s->line = grown;
            s->line_cap = cap;
        }
        s->line[s->line_len++] = ch;
    }
    return true;
}

void bench_sse_end(bench_sse *s, double now)
{
    if (s->line_len) end_line(s, now);
}

void bench_sse_free(bench_sse *s)
{
    free(s->line);
    s->line = NULL;
    s->line_cap = s->line_len = 0;
}
