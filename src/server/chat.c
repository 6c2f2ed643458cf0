/*
 * server/chat.c - chat templates rendered in C for the common families. A GGUF's
 * tokenizer.chat_template is Jinja; rather than embed a Jinja interpreter we
 * recognise the family by its markers and render it here. A template we do not
 * recognise is reported at start-up and makes chat requests fail with a 400, so a
 * prompt is never silently built in the wrong format.
 *
 * The rendered text carries no BOS: the server tokenizes it with add_special, which
 * adds BOS as the model's metadata says.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/server.h"

static const char *const k_names[] = {"none",    "unknown", "chatml", "llama-2",
                                      "llama-3", "zephyr",  "mistral"};

const char *srv_chat_family_name(srv_chat_family f)
{
    return (unsigned)f < TD_ARRAY_LEN(k_names) ? k_names[f] : "?";
}

int srv_chat_family_by_name(const char *name)
{
    for (int f = SRV_CHAT_CHATML; f < (int)TD_ARRAY_LEN(k_names); f++)
        if (!strcmp(name, k_names[f])) return f;
    if (!strcmp(name, "llama2")) return SRV_CHAT_LLAMA2;
    if (!strcmp(name, "llama3")) return SRV_CHAT_LLAMA3;
    return -1;
}

static bool has(const char *t, size_t len, const char *marker)
{
    return memmem(t, len, marker, strlen(marker)) != NULL;
}

/*
 * A chatml template's default system turn: the string literal that opens a system turn and
 * goes on with text ('<|im_start|>system\nYou are ...<|im_end|>' in the Jinja source, the
 * newline written as the two characters \n). 1: found and copied (\n unescaped); 0: none;
 * -1: one that is not plain text (an expression, or too long), which we cannot render.
 */
static int default_system(const char *t, size_t len, char *out, size_t cap)
{
    static const char open[] = "<|im_start|>system\\n";
    const size_t ol = sizeof(open) - 1;
    for (const char *p = t, *end = t + len; (p = memmem(p, (size_t)(end - p), open, ol));) {
        p += ol;
        if (p >= end || *p == '\'' || *p == '"') continue; /* the literal ends: content follows */
        const char *stop = memmem(p, (size_t)(end - p), "<|im_end|>", 10);
        if (!stop) return -1;
        size_t w = 0;
        for (const char *c = p; c < stop; c++) {
            if (*c == '\'' || *c == '"' || *c == '{' || *c == '}' || w + 2 > cap) return -1;
            if (*c == '\\' && c + 1 < stop && c[1] == 'n') {
                out[w++] = '\n';
                c++;
            } else {
                out[w++] = *c;
            }
        }
        out[w] = 0;
        return 1;
    }
    return 0;
}

/* A Llama-3.1-style template's Today Date: today (UTC) where it asks strftime_now, as
 * transformers renders it; else its own date_string default. */
static void knowledge_date(const char *t, size_t len, char *out, size_t cap)
{
    if (has(t, len, "strftime_now")) {
        time_t now = time(NULL);
        struct tm tm;
        gmtime_r(&now, &tm);
        strftime(out, cap, "%d %b %Y", &tm);
        return;
    }
    snprintf(out, cap, "26 Jul 2024");
    static const char key[] = "set date_string = \"";
    const char *p = memmem(t, len, key, sizeof(key) - 1);
    if (!p) return;
    p += sizeof(key) - 1;
    const char *q = memchr(p, '"', len - (size_t)(p - t));
    if (q && (size_t)(q - p) < cap) snprintf(out, cap, "%.*s", (int)(q - p), p);
}

srv_chat_family srv_chat_detect(const char *t, size_t len)
{
    srv_chat_extras x;
    return srv_chat_detect_ex(t, len, &x);
}

srv_chat_family srv_chat_detect_ex(const char *t, size_t len, srv_chat_extras *x)
{
    memset(x, 0, sizeof(*x));
    if (!t || !len) return SRV_CHAT_NONE;
    if (has(t, len, "<|im_start|>")) {
        /* Reasoning templates open or close a <think> block in the generation prompt or
         * rewrite past turns: not plain chatml. */
        if (has(t, len, "<think>")) return SRV_CHAT_UNKNOWN;
        return default_system(t, len, x->default_system, sizeof(x->default_system)) < 0
                   ? SRV_CHAT_UNKNOWN
                   : SRV_CHAT_CHATML;
    }
    if (has(t, len, "<|start_header_id|>") && has(t, len, "<|eot_id|>")) {
        if (has(t, len, "Cutting Knowledge Date")) knowledge_date(t, len, x->date, sizeof(x->date));
        return SRV_CHAT_LLAMA3;
    }
    /* Zephyr ends turns with EOS. Phi-3 (<|end|>) and GLM ([gMASK]) share the role tags
     * but not the format, so they are not rendered as zephyr. */
    if (has(t, len, "<|user|>") && has(t, len, "<|assistant|>"))
        return has(t, len, "eos_token") && !has(t, len, "<|end|>") && !has(t, len, "gMASK")
                   ? SRV_CHAT_ZEPHYR
                   : SRV_CHAT_UNKNOWN;
    /* Llama-2 and Mistral v1 write "[INST] text [/INST]" with spaces. Later Mistral
     * formats (no spaces, [SYSTEM_PROMPT] tokens, the system prompt moved to the last
     * user turn) differ, and are refused rather than rendered wrongly. */
    if (has(t, len, "[INST]")) {
        if (has(t, len, "[SYSTEM_PROMPT]") || !has(t, len, " [/INST]")) return SRV_CHAT_UNKNOWN;
        return has(t, len, "<<SYS>>") ? SRV_CHAT_LLAMA2 : SRV_CHAT_MISTRAL;
    }
    return SRV_CHAT_UNKNOWN;
}

/* Append a string; an allocation failure is reported once, at the end (td_sbuf.oom). */
static void put(td_sbuf *b, const char *s)
{
    td_sbuf_add(b, s, strlen(s));
}

/* Append s without its leading and trailing white space (Jinja's trim, Python's strip). */
static void put_trimmed(td_sbuf *b, const char *s)
{
    while (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')
        s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r'))
        n--;
    td_sbuf_add(b, s, n);
}

/* Llama-2 and Mistral: [INST] turns; Llama-2 folds the system prompt into the first user
 * turn inside <<SYS>>, Mistral prepends it to the first user message. Llama-2's template
 * strips each turn's text (the system block and the user text together). */
static void render_inst(td_sbuf *b, const srv_chat_msg *m, int n, bool llama2)
{
    const char *system = NULL;
    bool first_user = true;
    for (int i = 0; i < n; i++) {
        if (!strcmp(m[i].role, "system")) {
            system = m[i].content;
        } else if (!strcmp(m[i].role, "user")) {
            if (!first_user) put(b, llama2 ? "<s>" : "");
            put(b, "[INST] ");
            if (system && first_user) {
                if (llama2) {
                    put(b, "<<SYS>>\n");
                    put(b, system);
                    put(b, "\n<</SYS>>\n\n");
                } else {
                    put(b, system);
                    put(b, "\n\n");
                }
            }
            if (llama2)
                put_trimmed(b, m[i].content);
            else
                put(b, m[i].content);
            put(b, " [/INST]");
            first_user = false;
        } else {
            put(b, llama2 ? " " : "");
            if (llama2)
                put_trimmed(b, m[i].content);
            else
                put(b, m[i].content);
            put(b, llama2 ? " </s>" : "</s>");
        }
    }
}

char *srv_chat_render(srv_chat_family f, const srv_chat_msg *m, int n, srv_error *err)
{
    return srv_chat_render_ex(f, NULL, m, n, err);
}

char *srv_chat_render_ex(srv_chat_family f, const srv_chat_extras *x, const srv_chat_msg *m, int n,
                         srv_error *err)
{
    static const srv_chat_extras none;
    if (!x) x = &none;
    td_sbuf b = {0};
    put(&b, "");
    bool sys0 = n > 0 && !strcmp(m[0].role, "system");
    switch (f) {
    case SRV_CHAT_CHATML:
        if (x->default_system[0] && !sys0) {
            put(&b, "<|im_start|>system\n");
            put(&b, x->default_system);
            put(&b, "<|im_end|>\n");
        }
        for (int i = 0; i < n; i++) {
            put(&b, "<|im_start|>");
            put(&b, m[i].role);
            put(&b, "\n");
            put(&b, m[i].content);
            put(&b, "<|im_end|>\n");
        }
        put(&b, "<|im_start|>assistant\n");
        break;
    case SRV_CHAT_LLAMA3: /* each turn's text trimmed, as the templates do */
        if (x->date[0]) { /* 3.1 and later: a system turn always, with the dates */
            put(&b, "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                    "December 2023\nToday Date: ");
            put(&b, x->date);
            put(&b, "\n\n");
            if (sys0) put_trimmed(&b, m[0].content);
            put(&b, "<|eot_id|>");
        }
        for (int i = x->date[0] && sys0 ? 1 : 0; i < n; i++) {
            put(&b, "<|start_header_id|>");
            put(&b, m[i].role);
            put(&b, "<|end_header_id|>\n\n");
            put_trimmed(&b, m[i].content);
            put(&b, "<|eot_id|>");
        }
        put(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case SRV_CHAT_ZEPHYR:
        for (int i = 0; i < n; i++) {
            put(&b, "<|");
            put(&b, m[i].role);
            put(&b, "|>\n");
            put(&b, m[i].content);
            put(&b, "</s>\n");
        }
        put(&b, "<|assistant|>\n");
        break;
    case SRV_CHAT_LLAMA2:
    case SRV_CHAT_MISTRAL:
        render_inst(&b, m, n, f == SRV_CHAT_LLAMA2);
        break;
    case SRV_CHAT_NONE:
        free(b.p);
        srv_error_set(err, 400, "invalid_request_error", "messages",
                      "this model has no chat template; start the server with --chat-template "
                      "chatml|llama-2|llama-3|zephyr|mistral, or use /v1/completions");
        return NULL;
    case SRV_CHAT_UNKNOWN:
        free(b.p);
        srv_error_set(err, 400, "invalid_request_error", "messages",
                      "this model's chat template is not one tandem can render; start the "
                      "server with --chat-template chatml|llama-2|llama-3|zephyr|mistral");
        return NULL;
    }
    if (b.oom) {
        free(b.p);
        srv_error_set(err, 500, "server_error", NULL, "out of memory rendering the chat prompt");
        return NULL;
    }
    return b.p;
}
