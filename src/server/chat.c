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

srv_chat_family srv_chat_detect(const char *t, size_t len)
{
    if (!t || !len) return SRV_CHAT_NONE;
    if (has(t, len, "<|im_start|>")) return SRV_CHAT_CHATML;
    if (has(t, len, "<|start_header_id|>") && has(t, len, "<|eot_id|>")) return SRV_CHAT_LLAMA3;
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

/* Llama-2 and Mistral: [INST] turns; Llama-2 folds the system prompt into the first user
 * turn inside <<SYS>>, Mistral prepends it to the first user message. */
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
            put(b, m[i].content);
            put(b, " [/INST]");
            first_user = false;
        } else {
            put(b, llama2 ? " " : "");
            put(b, m[i].content);
            put(b, llama2 ? " </s>" : "</s>");
        }
    }
}

char *srv_chat_render(srv_chat_family f, const srv_chat_msg *m, int n, srv_error *err)
{
    td_sbuf b = {0};
    put(&b, "");
    switch (f) {
    case SRV_CHAT_CHATML:
        for (int i = 0; i < n; i++) {
            put(&b, "<|im_start|>");
            put(&b, m[i].role);
            put(&b, "\n");
            put(&b, m[i].content);
            put(&b, "<|im_end|>\n");
        }
        put(&b, "<|im_start|>assistant\n");
        break;
    case SRV_CHAT_LLAMA3:
        for (int i = 0; i < n; i++) {
            put(&b, "<|start_header_id|>");
            put(&b, m[i].role);
            put(&b, "<|end_header_id|>\n\n");
            put(&b, m[i].content);
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
