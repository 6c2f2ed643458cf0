/*
 * server/request.c - request bodies to srv_request, or to an OpenAI-style error.
 *
 * The parser is deliberately pure (bytes in, struct or error out) so that it can be
 * fuzzed. Before cJSON sees the bytes they are checked to be valid UTF-8 (cJSON does
 * not check) and to nest at most SRV_MAX_JSON_DEPTH levels (cJSON recurses), so a
 * hostile body can cost neither a wrong prompt nor a deep stack.
 */
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "model/tok.h"
#include "util/json.h"
#include "server/server.h"

int srv_error_set(srv_error *err, int status, const char *type, const char *param, const char *fmt,
                  ...)
{
    if (!err) return TD_EINVAL;
    err->status = status;
    err->type = type;
    snprintf(err->param, sizeof(err->param), "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    return TD_EINVAL;
}

#define BAD(param, ...) srv_error_set(err, 400, "invalid_request_error", (param), __VA_ARGS__)

/* Depth of brackets outside strings; -1 when over the limit. */
static int json_depth_ok(const char *s, size_t len)
{
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '[' || c == '{') {
            if (++depth > SRV_MAX_JSON_DEPTH) return 0;
        } else if (c == ']' || c == '}') {
            depth--;
        }
    }
    return 1;
}

static char *dup_str(const char *s)
{
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

/* An integer-valued JSON number within [lo, hi]. */
static int get_int(const cJSON *v, const char *name, int64_t lo, int64_t hi, int64_t *out,
                   srv_error *err)
{
    if (!cJSON_IsNumber(v)) return BAD(name, "'%s' must be an integer", name);
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d)) return BAD(name, "'%s' must be an integer", name);
    if (d < (double)lo || d > (double)hi)
        return BAD(name, "'%s' must be in [%lld, %lld], got %.17g", name, (long long)lo,
                   (long long)hi, d);
    *out = (int64_t)d;
    return 0;
}

static int get_num(const cJSON *v, const char *name, double lo, double hi, double *out,
                   srv_error *err)
{
    if (!cJSON_IsNumber(v)) return BAD(name, "'%s' must be a number", name);
    double d = v->valuedouble;
    if (!isfinite(d) || d < lo || d > hi)
        return BAD(name, "'%s' must be in [%g, %g], got %.17g", name, lo, hi, d);
    *out = d;
    return 0;
}

static int get_bool(const cJSON *v, const char *name, bool *out, srv_error *err)
{
    if (!cJSON_IsBool(v)) return BAD(name, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(v);
    return 0;
}

/* An array of token ids; `name` for messages. */
static int parse_ids(const cJSON *arr, const char *name, srv_prompt *p, srv_error *err)
{
    int n = cJSON_GetArraySize(arr);
    if (n == 0) return BAD(name, "'%s' must not be empty", name);
    p->ids = malloc((size_t)n * sizeof(int32_t));
    if (!p->ids) return srv_error_set(err, 500, "server_error", name, "out of memory");
    int i = 0;
    const cJSON *el;
    cJSON_ArrayForEach(el, arr)
    {
        int64_t v = 0;
        if (!cJSON_IsNumber(el))
            return BAD(name,
                       "'%s' must be a string, an array of strings, an array of token "
                       "ids or an array of token-id arrays",
                       name);
        if (get_int(el, name, 0, INT32_MAX, &v, err)) return TD_EINVAL;
        p->ids[i++] = (int32_t)v;
    }
    p->n_ids = n;
    return 0;
}

static int set_text(srv_prompt *p, const char *s, const char *name, srv_error *err)
{
    p->text = dup_str(s);
    if (!p->text) return srv_error_set(err, 500, "server_error", name, "out of memory");
    p->text_len = strlen(s);
    return 0;
}

static int parse_prompt(srv_request *r, const cJSON *v, srv_error *err)
{
    const char *kind =
        "'prompt' must be a string, an array of strings, an array of token ids or an array "
        "of token-id arrays";
    if (!v) return BAD("prompt", "'prompt' is required");
    if (cJSON_IsString(v)) {
        r->prompts = calloc(1, sizeof(srv_prompt));
        if (!r->prompts) return srv_error_set(err, 500, "server_error", "prompt", "out of memory");
        r->n_prompts = 1;
        return set_text(&r->prompts[0], v->valuestring, "prompt", err);
    }
    if (!cJSON_IsArray(v)) return BAD("prompt", "%s", kind);
    int n = cJSON_GetArraySize(v);
    if (n == 0) return BAD("prompt", "'prompt' must not be empty");
    const cJSON *first = v->child;
    if (cJSON_IsNumber(first)) { /* one prompt of token ids */
        r->prompts = calloc(1, sizeof(srv_prompt));
        if (!r->prompts) return srv_error_set(err, 500, "server_error", "prompt", "out of memory");
        r->n_prompts = 1;
        return parse_ids(v, "prompt", &r->prompts[0], err);
    }
    if (n > SRV_MAX_PROMPTS)
        return BAD("prompt", "'prompt' may hold at most %d prompts, got %d", SRV_MAX_PROMPTS, n);
    r->prompts = calloc((size_t)n, sizeof(srv_prompt));
    if (!r->prompts) return srv_error_set(err, 500, "server_error", "prompt", "out of memory");
    r->n_prompts = n;
    bool strings = cJSON_IsString(first);
    int i = 0;
    const cJSON *el;
    cJSON_ArrayForEach(el, v)
    {
        if (strings && cJSON_IsString(el)) {
            if (set_text(&r->prompts[i], el->valuestring, "prompt", err)) return TD_EINVAL;
        } else if (!strings && cJSON_IsArray(el)) {
            if (parse_ids(el, "prompt", &r->prompts[i], err)) return TD_EINVAL;
        } else {
            return BAD("prompt", "%s (elements must all be of one kind)", kind);
        }
        i++;
    }
    return 0;
}

/* Content: a string, null, or an array of {"type": "text", "text": "..."} parts. */
static int parse_content(const cJSON *c, char **out, srv_error *err)
{
    const char *name = "messages.content";
    if (!c || cJSON_IsNull(c)) {
        *out = dup_str("");
    } else if (cJSON_IsString(c)) {
        *out = dup_str(c->valuestring);
    } else if (cJSON_IsArray(c)) {
        size_t total = 0;
        const cJSON *part;
        cJSON_ArrayForEach(part, c)
        {
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
            const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
            if (!cJSON_IsObject(part) || !cJSON_IsString(type) || strcmp(type->valuestring, "text"))
                return BAD(name, "only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                 "are supported");
            if (!cJSON_IsString(text)) return BAD(name, "a text part's 'text' must be a string");
            total += strlen(text->valuestring);
        }
        char *s = malloc(total + 1);
        if (!s) return srv_error_set(err, 500, "server_error", name, "out of memory");
        size_t w = 0;
        cJSON_ArrayForEach(part, c)
        {
            const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
            size_t l = strlen(t);
            memcpy(s + w, t, l);
            w += l;
        }
        s[w] = '\0';
        *out = s;
    } else {
        return BAD(name, "'content' must be a string, null or an array of text parts");
    }
    if (!*out) return srv_error_set(err, 500, "server_error", name, "out of memory");
    return 0;
}

static int parse_messages(srv_request *r, const cJSON *v, srv_error *err)
{
    if (!v) return BAD("messages", "'messages' is required");
    if (!cJSON_IsArray(v)) return BAD("messages", "'messages' must be an array of objects");
    int n = cJSON_GetArraySize(v);
    if (n == 0) return BAD("messages", "'messages' must not be empty");
    if (n > SRV_MAX_MESSAGES)
        return BAD("messages", "'messages' may hold at most %d messages", SRV_MAX_MESSAGES);
    r->messages = calloc((size_t)n, sizeof(srv_chat_msg));
    if (!r->messages) return srv_error_set(err, 500, "server_error", "messages", "out of memory");
    const cJSON *m;
    cJSON_ArrayForEach(m, v)
    {
        if (!cJSON_IsObject(m)) return BAD("messages", "each message must be an object");
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsString(role))
            return BAD("messages.role", "each message needs a string 'role'");
        const char *rs = role->valuestring;
        if (!strcmp(rs, "developer")) rs = "system";
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant"))
            return BAD("messages.role",
                       "unsupported role '%.64s' (system, developer, user and assistant are)", rs);
        const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (calls && !cJSON_IsNull(calls) && !(cJSON_IsArray(calls) && !calls->child))
            return BAD("messages.tool_calls", "tool calls are not supported (no tools or "
                                              "functions); an assistant message carries content");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if ((!content || cJSON_IsNull(content)) && strcmp(rs, "assistant"))
            return BAD("messages.content", "a %s message needs 'content'", rs);
        srv_chat_msg *msg = &r->messages[r->n_messages++];
        msg->role = dup_str(rs);
        if (!msg->role) return srv_error_set(err, 500, "server_error", "messages", "out of memory");
        if (parse_content(cJSON_GetObjectItemCaseSensitive(m, "content"), &msg->content, err))
            return TD_EINVAL;
    }
    return 0;
}

static int parse_stop(srv_request *r, const cJSON *v, srv_error *err)
{
    if (!v || cJSON_IsNull(v)) return 0;
    int n = cJSON_IsString(v) ? 1 : cJSON_IsArray(v) ? cJSON_GetArraySize(v) : -1;
    if (n < 0) return BAD("stop", "'stop' must be a string or an array of strings");
    if (n > SRV_MAX_STOP) return BAD("stop", "'stop' may hold at most %d strings", SRV_MAX_STOP);
    if (n == 0) return 0;
    r->stop = calloc((size_t)n, sizeof(char *));
    if (!r->stop) return srv_error_set(err, 500, "server_error", "stop", "out of memory");
    const cJSON *el = cJSON_IsString(v) ? v : v->child;
    for (; el && r->n_stop < n; el = el->next) {
        if (!cJSON_IsString(el))
            return BAD("stop", "'stop' must be a string or an array of strings");
        size_t l = strlen(el->valuestring);
        if (l == 0) return BAD("stop", "stop strings must not be empty");
        if (l > SRV_MAX_STOP_LEN)
            return BAD("stop", "stop strings may be at most %d bytes", SRV_MAX_STOP_LEN);
        r->stop[r->n_stop] = dup_str(el->valuestring);
        if (!r->stop[r->n_stop]) return srv_error_set(err, 500, "server_error", "stop", "oom");
        r->n_stop++;
        if (cJSON_IsString(v)) break;
    }
    return 0;
}

/* logit_bias: {"token id": bias in [-100, 100], ...}; the ids are checked against the
 * vocabulary when the engine takes the request. */
static int parse_logit_bias(srv_request *r, const cJSON *v, srv_error *err)
{
    const char *P = "logit_bias";
    if (!cJSON_IsObject(v)) return BAD(P, "'logit_bias' must be an object of token id: bias");
    int n = cJSON_GetArraySize(v);
    if (n > TD_MAX_LOGIT_BIAS)
        return BAD(P, "'logit_bias' may hold at most %d tokens", TD_MAX_LOGIT_BIAS);
    if (n == 0) return 0;
    r->logit_bias_ids = malloc((size_t)n * sizeof(int32_t));
    r->logit_bias = malloc((size_t)n * sizeof(float));
    if (!r->logit_bias_ids || !r->logit_bias)
        return srv_error_set(err, 500, "server_error", P, "out of memory");
    const cJSON *e;
    cJSON_ArrayForEach(e, v)
    {
        int64_t id;
        if (!e->string || td_parse_i64(e->string, &id) || id < 0 || id > INT32_MAX)
            return BAD(P, "'logit_bias' keys must be token ids, got '%.32s'",
                       e->string ? e->string : "");
        if (!cJSON_IsNumber(e) || !(e->valuedouble >= -100 && e->valuedouble <= 100))
            return BAD(P, "'logit_bias' values must be numbers in [-100, 100]");
        r->logit_bias_ids[r->n_logit_bias] = (int32_t)id;
        r->logit_bias[r->n_logit_bias++] = (float)e->valuedouble;
    }
    return 0;
}

/*
 * OpenAI fields this server knows but does not implement: a value that asks for nothing
 * (a zero penalty, an empty bias, "text" format, no tools) is accepted; anything else is a
 * 400 naming the field, never silently ignored. Wrong types are a 400 too.
 */
static int refuse_unsupported(const srv_request *r, const cJSON *root, srv_error *err)
{
    const cJSON *v;
#define GIVEN(name) ((v = cJSON_GetObjectItemCaseSensitive(root, name)) && !cJSON_IsNull(v))
    if (r->endpoint == SRV_EP_COMPLETIONS) {
        if (GIVEN("best_of")) {
            if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 1)
                return BAD("best_of", "'best_of' must be a positive integer");
            if (v->valuedouble != r->n)
                return BAD("best_of", "'best_of' is not supported (only equal to n); ask for n "
                                      "choices instead");
        }
        if (GIVEN("suffix")) {
            if (!cJSON_IsString(v)) return BAD("suffix", "'suffix' must be a string");
            if (v->valuestring[0]) return BAD("suffix", "'suffix' (insertion) is not supported");
        }
    }
    if (GIVEN("response_format")) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(v, "type");
        if (!cJSON_IsObject(v) || !cJSON_IsString(t))
            return BAD("response_format", "'response_format' must be an object with a 'type'");
        if (strcmp(t->valuestring, "text"))
            return BAD("response_format",
                       "response_format '%.32s' is not supported (only "
                       "\"text\": no structured output)",
                       t->valuestring);
    }
    static const char *const lists[] = {"tools", "functions"};
    for (int i = 0; i < 2; i++)
        if (GIVEN(lists[i])) {
            if (!cJSON_IsArray(v)) return BAD(lists[i], "'%s' must be an array", lists[i]);
            if (v->child)
                return BAD(lists[i], "'%s' are not supported (no tool calling)", lists[i]);
        }
    static const char *const choices[] = {"tool_choice", "function_call"};
    for (int i = 0; i < 2; i++)
        if (GIVEN(choices[i]) && !(cJSON_IsString(v) && (!strcmp(v->valuestring, "none") ||
                                                         !strcmp(v->valuestring, "auto"))))
            return BAD(choices[i],
                       "'%s' is not supported (no tool calling): only \"none\" or "
                       "\"auto\"",
                       choices[i]);
    if (GIVEN("parallel_tool_calls") && !cJSON_IsBool(v))
        return BAD("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
    if (GIVEN("modalities")) {
        const cJSON *m0 = cJSON_IsArray(v) ? v->child : NULL;
        if (!cJSON_IsArray(v) ||
            (m0 && !(cJSON_IsString(m0) && !strcmp(m0->valuestring, "text") && !m0->next)))
            return BAD("modalities", "'modalities' is not supported beyond [\"text\"]");
    }
    static const char *const never[] = {"audio", "prediction"};
    for (int i = 0; i < 2; i++)
        if (GIVEN(never[i])) return BAD(never[i], "'%s' is not supported", never[i]);
    if (r->endpoint == SRV_EP_COMPLETIONS && r->echo && r->logprobs >= 0)
        return BAD("logprobs", "'echo' with 'logprobs' (the prompt's log-probabilities) is not "
                               "supported: ask for one or the other");
    if (GIVEN("stream_options") && !r->stream)
        return BAD("stream_options", "'stream_options' is only allowed with 'stream': true");
#undef GIVEN
    return 0;
}

/* A \u0000 escape in a JSON string (an odd run of backslashes before "u0000"): the parsed
 * strings are C strings, which would end there and silently lose the rest of the text. */
static bool has_nul_escape(const char *s, size_t len)
{
    for (const char *p = s, *end = s + len; (p = memmem(p, (size_t)(end - p), "u0000", 5)); p++) {
        size_t bs = 0;
        for (const char *q = p; q > s && q[-1] == '\\'; q--)
            bs++;
        if (bs % 2 == 1) return true;
    }
    return false;
}

/*
 * A request that names a key twice is refused (td_json_duplicate_key): JSON leaves
 * duplicate keys to the parser, and parsers differ (first wins, last wins), so a router
 * and an engine that read different values would check one and use the other.
 */
static int parse_fields(srv_request *r, const cJSON *root, srv_error *err)
{
    const cJSON *v;
    int64_t i64;
#define FIELD(name) ((v = cJSON_GetObjectItemCaseSensitive(root, name)) && !cJSON_IsNull(v))
    if (r->endpoint == SRV_EP_COMPLETIONS) {
        if (parse_prompt(r, cJSON_GetObjectItemCaseSensitive(root, "prompt"), err))
            return TD_EINVAL;
    } else {
        if (parse_messages(r, cJSON_GetObjectItemCaseSensitive(root, "messages"), err))
            return TD_EINVAL;
    }
    if (FIELD("model")) {
        if (!cJSON_IsString(v)) return BAD("model", "'model' must be a string");
        r->model = dup_str(v->valuestring);
    }
    const char *mt_name = "max_tokens";
    if (r->endpoint == SRV_EP_CHAT && FIELD("max_completion_tokens"))
        mt_name = "max_completion_tokens";
    if (FIELD(mt_name)) {
        if (get_int(v, mt_name, 1, 1 << 24, &i64, err)) return TD_EINVAL;
        r->max_tokens = (int)i64;
    }
    if (FIELD("temperature") && get_num(v, "temperature", 0, 2, &r->temperature, err))
        return TD_EINVAL;
    if (FIELD("top_p")) {
        if (get_num(v, "top_p", 0, 1, &r->top_p, err)) return TD_EINVAL;
        if (r->top_p <= 0) return BAD("top_p", "'top_p' must be in (0, 1], got 0");
        r->top_p = fmax(r->top_p, FLT_MIN); /* the engine's float: no positive value reads 0 */
    }
    if (FIELD("top_k")) {
        if (get_int(v, "top_k", -1, 1 << 20, &i64, err)) return TD_EINVAL;
        r->top_k = i64 < 0 ? 0 : (int)i64;
    }
    if (FIELD("min_p") && get_num(v, "min_p", 0, 1, &r->min_p, err)) return TD_EINVAL;
    if (FIELD("seed")) {
        if (get_int(v, "seed", -(1LL << 53), 1LL << 53, &i64, err)) return TD_EINVAL;
        r->has_seed = true;
        r->seed = (uint64_t)i64;
    }
    if (parse_stop(r, cJSON_GetObjectItemCaseSensitive(root, "stop"), err)) return TD_EINVAL;
    if (FIELD("stream") && get_bool(v, "stream", &r->stream, err)) return TD_EINVAL;
    if (FIELD("stream_options")) {
        if (!cJSON_IsObject(v)) return BAD("stream_options", "'stream_options' must be an object");
        const cJSON *iu = cJSON_GetObjectItemCaseSensitive(v, "include_usage");
        if (iu && !cJSON_IsNull(iu) &&
            get_bool(iu, "stream_options.include_usage", &r->include_usage, err))
            return TD_EINVAL;
    }
    if (FIELD("ignore_eos") && get_bool(v, "ignore_eos", &r->ignore_eos, err)) return TD_EINVAL;
    if (FIELD("echo") && get_bool(v, "echo", &r->echo, err)) return TD_EINVAL;
    if (FIELD("n")) {
        if (get_int(v, "n", 1, SRV_MAX_N, &i64, err)) return TD_EINVAL;
        r->n = (int)i64;
    }
    if (r->endpoint == SRV_EP_COMPLETIONS) {
        if (FIELD("logprobs")) {
            if (get_int(v, "logprobs", 0, TD_MAX_LOGPROBS, &i64, err)) return TD_EINVAL;
            r->logprobs = (int)i64;
        }
    } else {
        bool want = false;
        if (FIELD("logprobs") && get_bool(v, "logprobs", &want, err)) return TD_EINVAL;
        int64_t top = 0;
        if (FIELD("top_logprobs")) {
            if (get_int(v, "top_logprobs", 0, TD_MAX_LOGPROBS, &top, err)) return TD_EINVAL;
            if (!want) return BAD("top_logprobs", "'top_logprobs' needs 'logprobs': true");
        }
        if (want) r->logprobs = (int)top;
    }
    if (FIELD("presence_penalty") &&
        get_num(v, "presence_penalty", -2, 2, &r->presence_penalty, err))
        return TD_EINVAL;
    if (FIELD("frequency_penalty") &&
        get_num(v, "frequency_penalty", -2, 2, &r->frequency_penalty, err))
        return TD_EINVAL;
    if (FIELD("repetition_penalty")) {
        if (get_num(v, "repetition_penalty", 0, 10, &r->repetition_penalty, err)) return TD_EINVAL;
        if (r->repetition_penalty <= 0)
            return BAD("repetition_penalty", "'repetition_penalty' must be in (0, 10]");
        r->repetition_penalty = fmax(r->repetition_penalty, FLT_MIN);
    }
    if (FIELD("logit_bias") && parse_logit_bias(r, v, err)) return TD_EINVAL;
    if (FIELD("user")) {
        if (!cJSON_IsString(v)) return BAD("user", "'user' must be a string");
        r->user = dup_str(v->valuestring);
    }
    if (FIELD("data_parallel_rank")) { /* the server checks it against its dp_size */
        if (get_int(v, "data_parallel_rank", 0, SRV_MAX_DP - 1, &i64, err)) return TD_EINVAL;
        r->dp_rank = (int)i64;
    }
    if (FIELD("kv_transfer_params")) {
        if (!cJSON_IsObject(v))
            return BAD("kv_transfer_params", "'kv_transfer_params' must be an object");
        r->kv_transfer_params = cJSON_Duplicate(v, 1);
    }
#undef FIELD
    if (refuse_unsupported(r, root, err)) return TD_EINVAL;
    int choices = r->endpoint == SRV_EP_CHAT ? r->n : r->n_prompts * r->n;
    if (choices > SRV_MAX_CHOICES)
        return BAD("n", "prompts x n must be at most %d, got %d", SRV_MAX_CHOICES, choices);
    return 0;
}

int srv_request_parse(srv_request *out, srv_endpoint ep, const char *body, size_t len,
                      srv_error *err)
{
    memset(out, 0, sizeof(*out));
    out->endpoint = ep;
    out->max_tokens = -1;
    out->dp_rank = -1;
    out->temperature = 1.0;
    out->top_p = 1.0;
    out->n = 1;
    out->logprobs = -1;
    out->repetition_penalty = 1.0;
    if (len == 0) return BAD(NULL, "the request body is empty; send a JSON object");
    size_t valid = tok_utf8_valid_prefix(body, len);
    if (valid != len) return BAD(NULL, "the request body is not valid UTF-8 (at byte %zu)", valid);
    if (memchr(body, '\0', len)) return BAD(NULL, "the request body contains a NUL byte");
    if (has_nul_escape(body, len))
        return BAD(NULL, "the request body contains U+0000 (\\u0000), which text may not hold");
    if (!json_depth_ok(body, len))
        return BAD(NULL, "the request body nests deeper than %d levels", SRV_MAX_JSON_DEPTH);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!root) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        return BAD(NULL, "malformed JSON in the request body near byte %zu", at);
    }
    /* Only whitespace may follow the value. */
    for (const char *p = end; p && p < body + len; p++)
        if (*p != ' ' && *p != '\n' && *p != '\r' && *p != '\t') {
            cJSON_Delete(root);
            return BAD(NULL, "malformed JSON: trailing data after the object at byte %zu",
                       (size_t)(p - body));
        }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return BAD(NULL, "the request body must be a JSON object");
    }
    const char *dup = td_json_duplicate_key(root);
    int rc = dup ? BAD(NULL, "the request body names the key '%.64s' twice in one object", dup)
                 : parse_fields(out, root, err);
    cJSON_Delete(root);
    if (rc) {
        srv_request_free(out);
        memset(out, 0, sizeof(*out));
    }
    return rc;
}

void srv_request_free(srv_request *r)
{
    if (!r) return;
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    for (int i = 0; i < r->n_messages; i++) {
        free(r->messages[i].role);
        free(r->messages[i].content);
    }
    free(r->messages);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->model);
    free(r->user);
    free(r->logit_bias_ids);
    free(r->logit_bias);
    cJSON_Delete(r->kv_transfer_params);
    memset(r, 0, sizeof(*r));
}

/* ---- kv_transfer_params ---- */

static const cJSON *kvp_get(const cJSON *o, const char *name)
{
    return cJSON_GetObjectItemCaseSensitive(o, name);
}

/* 0, TD_ENOTFOUND when absent, TD_EINVAL when not an integer in [lo, hi]. */
static int kvp_int(const cJSON *o, const char *name, double lo, double hi, int64_t *out)
{
    const cJSON *v = kvp_get(o, name);
    if (!v) return TD_ENOTFOUND;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble < lo || v->valuedouble > hi)
        return TD_EINVAL;
    *out = (int64_t)v->valuedouble;
    return 0;
}

static bool kvp_hex_id(const cJSON *o, const char *name, char out[33])
{
    const cJSON *v = kvp_get(o, name);
    if (!cJSON_IsString(v) || strlen(v->valuestring) != 32) return false;
    for (int i = 0; i < 32; i++) {
        char c = v->valuestring[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
    }
    memcpy(out, v->valuestring, 33);
    return true;
}

static bool kvp_str(const cJSON *o, const char *name, char *out, size_t cap)
{
    const cJSON *v = kvp_get(o, name);
    if (!v) return true; /* optional */
    if (!cJSON_IsString(v) || strlen(v->valuestring) >= cap) return false;
    snprintf(out, cap, "%s", v->valuestring);
    return true;
}

void srv_kv_params_free(srv_kv_params *p)
{
    free(p->blocks);
    p->blocks = NULL;
    p->n_blocks = 0;
}

int srv_kv_params_parse(srv_kv_params *p, const void *kv_transfer_params, int n_vocab,
                        srv_error *err)
{
    const cJSON *k = kv_transfer_params;
    const char *P = "kv_transfer_params";
    memset(p, 0, sizeof(*p));
    p->block_size = p->lease_ms = p->first_token = p->num_prompt_tokens = -1;
    if (!cJSON_IsObject(k))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "'kv_transfer_params' must be an object");
    p->decode = cJSON_IsTrue(kvp_get(k, "do_remote_decode"));
    p->prefill = cJSON_IsTrue(kvp_get(k, "do_remote_prefill"));
    const cJSON *fts = kvp_get(k, "first_token_streamed");
    if (fts && !cJSON_IsBool(fts))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.first_token_streamed must be a boolean");
    p->first_token_streamed = cJSON_IsTrue(fts);
    if (p->decode && p->prefill)
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "do_remote_decode and do_remote_prefill cannot both be true");
    const cJSON *mode = kvp_get(k, "transfer_mode");
    if (mode && !(cJSON_IsString(mode) && (!strcmp(mode->valuestring, "read") ||
                                           !strcmp(mode->valuestring, "write"))))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.transfer_mode must be \"read\" or \"write\"");
    p->write = mode && !strcmp(mode->valuestring, "write");
    if (p->decode && p->write && !kvp_hex_id(k, "transfer_id", p->transfer_id))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.transfer_id must be 32 lowercase hex digits in "
                             "write mode: the router draws it and gives it to both instances");
    if (!p->prefill) return 0;

    const cJSON *host = kvp_get(k, "remote_host");
    int64_t v = 0;
    int rc = kvp_int(k, "remote_handshake_port", 1, 65535, &v);
    if (rc == TD_ENOTFOUND) rc = kvp_int(k, "remote_port", 1, 65535, &v);
    if (!cJSON_IsString(host) || !host->valuestring[0] || strlen(host->valuestring) >= sizeof(p->host))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.remote_host must be a non-empty string");
    snprintf(p->host, sizeof(p->host), "%s", host->valuestring);
    if (rc)
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.remote_handshake_port (or remote_port) must be "
                             "a port number");
    p->port = (int)v;
    if (!kvp_hex_id(k, "remote_engine_id", p->engine_id) || !kvp_hex_id(k, "transfer_id", p->transfer_id))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.remote_engine_id and transfer_id must be 32 "
                             "lowercase hex digits, as the producer returned them%s",
                             p->write ? " (write mode: the producer's engine id from its "
                                        "/kv_transfer_info, the transfer id the router drew)"
                                      : "");
    if (p->write) { /* the producer's first token and timing come over the transfer */
        rc = kvp_int(k, "num_prompt_tokens", 1, 1 << 30, &v);
        if (rc == TD_EINVAL)
            return srv_error_set(err, 400, "invalid_request_error", P,
                                 "kv_transfer_params.num_prompt_tokens must be a positive "
                                 "integer");
        if (rc == 0) p->num_prompt_tokens = (int)v;
        return 0;
    }
    if (kvp_int(k, "first_token_id", 0, n_vocab - 1, &v))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.first_token_id must be a token id below %d",
                             n_vocab);
    p->first_token = (int)v;
    if (kvp_int(k, "num_prompt_tokens", 1, 1 << 30, &v))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.num_prompt_tokens must be a positive integer");
    p->num_prompt_tokens = (int)v;
    const cJSON *ids = kvp_get(k, "remote_block_ids");
    int n_ids = cJSON_IsArray(ids) ? cJSON_GetArraySize(ids) : -1;
    if (n_ids < 1 || n_ids > (1 << 20))
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params.remote_block_ids must be a non-empty array");
    p->blocks = malloc((size_t)n_ids * sizeof(int32_t));
    if (!p->blocks) return srv_error_set(err, 500, "server_error", P, "out of memory");
    const cJSON *it;
    cJSON_ArrayForEach(it, ids)
    {
        if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) ||
            it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
            it->valuedouble > INT32_MAX) {
            srv_kv_params_free(p);
            return srv_error_set(err, 400, "invalid_request_error", P,
                                 "kv_transfer_params.remote_block_ids must hold block numbers");
        }
        p->blocks[p->n_blocks++] = (int32_t)it->valuedouble;
    }
    /* Optional layout fields (compared by the caller) and the producer's timing. */
    bool ok = true;
    rc = kvp_int(k, "block_size", 1, 1 << 20, &v);
    if (rc == 0) p->block_size = (int)v;
    ok &= rc != TD_EINVAL;
    rc = kvp_int(k, "lease_ms", 1, 1e9, &v);
    if (rc == 0) p->lease_ms = (int)v;
    ok &= rc != TD_EINVAL;
    ok &= kvp_str(k, "kv_dtype", p->kv_dtype, sizeof(p->kv_dtype));
    ok &= kvp_str(k, "model_fingerprint", p->fingerprint, sizeof(p->fingerprint));
    if (!ok) {
        srv_kv_params_free(p);
        return srv_error_set(err, 400, "invalid_request_error", P,
                             "kv_transfer_params: block_size and lease_ms must be positive "
                             "integers, kv_dtype and model_fingerprint short strings");
    }
    const cJSON *flp = kvp_get(k, "first_token_logprob");
    const cJSON *ftop = kvp_get(k, "first_token_top_logprobs");
    if (flp || ftop) {
        bool good = cJSON_IsNumber(flp) && flp->valuedouble <= 0 &&
                    (!ftop || (cJSON_IsArray(ftop) && cJSON_GetArraySize(ftop) <= TD_MAX_LOGPROBS));
        const cJSON *e;
        cJSON_ArrayForEach(e, ftop)
        {
            const cJSON *id = cJSON_GetArrayItem(e, 0), *lp = cJSON_GetArrayItem(e, 1);
            if (!good || !cJSON_IsArray(e) || cJSON_GetArraySize(e) != 2 || !cJSON_IsNumber(id) ||
                id->valuedouble != floor(id->valuedouble) || id->valuedouble < 0 ||
                id->valuedouble >= n_vocab || !cJSON_IsNumber(lp) || lp->valuedouble > 0) {
                good = false;
                break;
            }
            p->first_top_ids[p->n_first_top] = (int32_t)id->valuedouble;
            p->first_top_logprobs[p->n_first_top++] = (float)lp->valuedouble;
        }
        if (!good) {
            srv_kv_params_free(p);
            return srv_error_set(err, 400, "invalid_request_error", P,
                                 "kv_transfer_params.first_token_logprob must be a number <= 0 "
                                 "and first_token_top_logprobs at most %d pairs [token id, "
                                 "logprob <= 0]",
                                 TD_MAX_LOGPROBS);
        }
        p->has_first_logprob = true;
        p->first_logprob = (float)flp->valuedouble;
    }
    const cJSON *t = kvp_get(k, "producer_timing");
    if (cJSON_IsObject(t)) {
        const cJSON *a = kvp_get(t, "queue_ms"), *c = kvp_get(t, "compute_ms");
        if (cJSON_IsNumber(a) && isfinite(a->valuedouble)) p->prod_queue_ms = a->valuedouble;
        if (cJSON_IsNumber(c) && isfinite(c->valuedouble)) p->prod_compute_ms = c->valuedouble;
    }
    return 0;
}
