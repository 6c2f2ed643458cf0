/*
 * libFuzzer target for the server's request parser: the input is a request body for
 * /v1/completions or /v1/chat/completions (the first byte picks which). The parser
 * must return a request or an error with a status and message, never crash, and a
 * parsed request must respect the documented limits. The same bytes also go through
 * the --kv-transfer-config parser, its kv_transfer_params through the PD contract's
 * parser, and, as chat messages, through every template.
 *
 *   build-fuzz/fuzz_request -max_total_time=60 tests/fuzz/corpus_request
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tok.h"
#include "server/server.h"

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_request: invariant broken: %s\n", what);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    srv_endpoint ep = (data[0] & 1) ? SRV_EP_CHAT : SRV_EP_COMPLETIONS;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    srv_request r;
    srv_error err;
    memset(&err, 0, sizeof(err));
    int rc = srv_request_parse(&r, ep, body, len, &err);
    if (rc != 0) {
        check(err.status >= 400 && err.status < 600, "error status");
        check(err.message[0] != '\0', "error message");
        check(err.type != NULL, "error type");
        return 0;
    }
    check(r.n >= 1 && r.n <= SRV_MAX_N, "n in range");
    check(r.max_tokens == -1 || r.max_tokens >= 1, "max_tokens");
    check(r.temperature >= 0 && r.temperature <= 2, "temperature");
    check(r.top_p > 0 && r.top_p <= 1, "top_p");
    check(r.n_stop <= SRV_MAX_STOP, "stop count");
    check(r.logprobs >= -1 && r.logprobs <= TD_MAX_LOGPROBS, "logprobs");
    if (ep == SRV_EP_COMPLETIONS) {
        check(r.n_prompts >= 1 && r.n_prompts <= SRV_MAX_PROMPTS, "prompt count");
        for (int i = 0; i < r.n_prompts; i++) {
            const srv_prompt *p = &r.prompts[i];
            if (p->text) {
                check(tok_utf8_valid_prefix(p->text, p->text_len) == p->text_len, "prompt UTF-8");
            } else {
                check(p->n_ids >= 1, "ids prompt not empty");
                for (int k = 0; k < p->n_ids; k++)
                    check(p->ids[k] >= 0, "ids non-negative");
            }
        }
    } else {
        check(r.n_messages >= 1, "messages");
        for (int f = SRV_CHAT_CHATML; f <= SRV_CHAT_MISTRAL; f++) {
            char *text = srv_chat_render((srv_chat_family)f, r.messages, r.n_messages, &err);
            check(text != NULL, "render");
            free(text);
        }
    }
    if (r.kv_transfer_params) {
        /* The PD contract's parser: fields in range, or a 400 that names them. */
        srv_kv_params kp;
        srv_error kerr;
        memset(&kerr, 0, sizeof(kerr));
        if (srv_kv_params_parse(&kp, r.kv_transfer_params, 32000, &kerr) == 0) {
            check(!(kp.decode && kp.prefill), "one role");
            if (kp.prefill) {
                check(kp.port >= 1 && kp.port <= 65535, "port");
                check(kp.n_blocks >= 1 && kp.blocks != NULL, "blocks");
                for (int i = 0; i < kp.n_blocks; i++) check(kp.blocks[i] >= 0, "block ids");
                check(kp.first_token >= 0 && kp.first_token < 32000, "first token");
                check(strlen(kp.engine_id) == 32 && strlen(kp.transfer_id) == 32, "ids");
            }
            srv_kv_params_free(&kp);
        } else {
            check(kerr.status == 400 || kerr.status == 500, "kv params error status");
            check(kerr.message[0] != '\0', "kv params error message");
        }
    }
    srv_request_free(&r);

    /* The kv-transfer-config parser takes NUL-terminated text. */
    char *s = malloc(len + 1);
    memcpy(s, body, len);
    s[len] = '\0';
    srv_kv_config kv;
    char msg[320];
    if (srv_kv_config_parse(&kv, s, msg, sizeof(msg)) == 0) {
        check(kv.role != SRV_KV_NONE, "kv_role required");
        srv_kv_config_free(&kv);
    }
    free(s);
    return 0;
}
