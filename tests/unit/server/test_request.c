/* Unit tests for server/request.c, kvconfig.c and chat.c: the pure parts of the server. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include <cjson/cJSON.h>

#include "server/server.h"

static int parse(srv_request *r, srv_endpoint ep, const char *body, srv_error *err)
{
    memset(err, 0, sizeof(*err));
    return srv_request_parse(r, ep, body, strlen(body), err);
}

/* Expect a 400 naming `param` ("" for none). */
static void expect_bad(srv_endpoint ep, const char *body, const char *param)
{
    srv_request r;
    srv_error err;
    int rc = parse(&r, ep, body, &err);
    if (rc == 0) {
        srv_request_free(&r);
        fail_msg("accepted: %s", body);
    }
    assert_int_equal(err.status, 400);
    assert_true(err.message[0] != '\0');
    if (strcmp(err.param, param) != 0)
        fail_msg("%s: param '%s', want '%s' (%s)", body, err.param, param, err.message);
}

static void test_prompt_variants(void **state)
{
    (void)state;
    srv_request r;
    srv_error err;
    assert_int_equal(parse(&r, SRV_EP_COMPLETIONS, "{\"prompt\":\"hello\"}", &err), 0);
    assert_int_equal(r.n_prompts, 1);
    assert_string_equal(r.prompts[0].text, "hello");
    assert_int_equal(r.max_tokens, -1);
    assert_true(r.temperature == 1.0 && r.n == 1 && r.logprobs == -1);
    srv_request_free(&r);

    assert_int_equal(parse(&r, SRV_EP_COMPLETIONS, "{\"prompt\":[\"a\",\"b\"]}", &err), 0);
    assert_int_equal(r.n_prompts, 2);
    assert_string_equal(r.prompts[1].text, "b");
    srv_request_free(&r);

    assert_int_equal(parse(&r, SRV_EP_COMPLETIONS, "{\"prompt\":[1,2,3]}", &err), 0);
    assert_int_equal(r.n_prompts, 1);
    assert_null(r.prompts[0].text);
    assert_int_equal(r.prompts[0].n_ids, 3);
    assert_int_equal(r.prompts[0].ids[2], 3);
    srv_request_free(&r);

    assert_int_equal(parse(&r, SRV_EP_COMPLETIONS, "{\"prompt\":[[1,2],[3]]}", &err), 0);
    assert_int_equal(r.n_prompts, 2);
    assert_int_equal(r.prompts[1].n_ids, 1);
    srv_request_free(&r);
}

static void test_fields(void **state)
{
    (void)state;
    srv_request r;
    srv_error err;
    const char *body =
        "{\"prompt\":[1],\"max_tokens\":7,\"temperature\":0.5,\"top_p\":0.9,\"top_k\":-1,"
        "\"min_p\":0.1,\"seed\":42,\"stop\":\"END\",\"stream\":true,\"stream_options\":"
        "{\"include_usage\":true},\"ignore_eos\":true,\"n\":3,\"echo\":false,\"logprobs\":2,"
        "\"user\":\"u\",\"kv_transfer_params\":{\"do_remote_decode\":true},\"unknown\":[{}],"
        "\"data_parallel_rank\":3}";
    assert_int_equal(parse(&r, SRV_EP_COMPLETIONS, body, &err), 0);
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.temperature == 0.5 && r.top_p == 0.9 && r.min_p == 0.1);
    assert_int_equal(r.top_k, 0);
    assert_true(r.has_seed && r.seed == 42);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "END");
    assert_true(r.stream && r.include_usage && r.ignore_eos && !r.echo);
    assert_int_equal(r.n, 3);
    assert_int_equal(r.logprobs, 2);
    assert_string_equal(r.user, "u");
    assert_non_null(r.kv_transfer_params);
    assert_int_equal(r.dp_rank, 3);
    srv_request_free(&r);

    /* nulls are the same as absent */
    assert_int_equal(parse(&r, SRV_EP_COMPLETIONS,
                           "{\"prompt\":[1],\"max_tokens\":null,\"stop\":null,\"seed\":null}",
                           &err),
                     0);
    assert_int_equal(r.max_tokens, -1);
    assert_false(r.has_seed);
    assert_int_equal(r.dp_rank, -1);
    srv_request_free(&r);
}

static void test_chat(void **state)
{
    (void)state;
    srv_request r;
    srv_error err;
    const char *body =
        "{\"messages\":[{\"role\":\"developer\",\"content\":\"S\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
        "{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\",\"content\":null},"
        "{\"role\":\"user\",\"content\":\"U2\"}],\"logprobs\":true,\"top_logprobs\":3}";
    assert_int_equal(parse(&r, SRV_EP_CHAT, body, &err), 0);
    assert_int_equal(r.n_messages, 4);
    assert_string_equal(r.messages[0].role, "system");
    assert_string_equal(r.messages[1].content, "ab");
    assert_string_equal(r.messages[2].content, "");
    assert_int_equal(r.logprobs, 3);

    char *t = srv_chat_render(SRV_CHAT_CHATML, r.messages, r.n_messages, &err);
    assert_string_equal(t, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nab<|im_end|>\n"
                           "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
                           "<|im_start|>assistant\n");
    free(t);
    t = srv_chat_render(SRV_CHAT_LLAMA3, r.messages, 2, &err);
    assert_string_equal(t, "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                           "<|start_header_id|>user<|end_header_id|>\n\nab<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n");
    free(t);
    t = srv_chat_render(SRV_CHAT_LLAMA2, r.messages, r.n_messages, &err);
    assert_string_equal(t, "[INST] <<SYS>>\nS\n<</SYS>>\n\nab [/INST]  </s><s>[INST] U2 [/INST]");
    free(t);
    t = srv_chat_render(SRV_CHAT_MISTRAL, r.messages + 1, 1, &err);
    assert_string_equal(t, "[INST] ab [/INST]");
    free(t);
    t = srv_chat_render(SRV_CHAT_ZEPHYR, r.messages + 1, 1, &err);
    assert_string_equal(t, "<|user|>\nab</s>\n<|assistant|>\n");
    free(t);
    assert_null(srv_chat_render(SRV_CHAT_UNKNOWN, r.messages, 1, &err));
    assert_int_equal(err.status, 400);
    assert_null(srv_chat_render(SRV_CHAT_NONE, r.messages, 1, &err));
    srv_request_free(&r);
}

static void test_detect(void **state)
{
    (void)state;
    const char *chatml = "{% for m in messages %}<|im_start|>{{m.role}}...";
    const char *l3 = "<|start_header_id|>' + m['role'] + '<|end_header_id|>...<|eot_id|>";
    const char *l2 = "[INST] <<SYS>>\\n' + system + '\\n<</SYS>>' + m + ' [/INST]";
    const char *mi = "{{ '[INST] ' + m['content'] + ' [/INST]' }}";
    const char *ze = "<|user|>\n' + m + eos_token ...<|assistant|>\n";
    assert_int_equal(srv_chat_detect(chatml, strlen(chatml)), SRV_CHAT_CHATML);
    assert_int_equal(srv_chat_detect(l3, strlen(l3)), SRV_CHAT_LLAMA3);
    assert_int_equal(srv_chat_detect(l2, strlen(l2)), SRV_CHAT_LLAMA2);
    assert_int_equal(srv_chat_detect(mi, strlen(mi)), SRV_CHAT_MISTRAL);
    assert_int_equal(srv_chat_detect(ze, strlen(ze)), SRV_CHAT_ZEPHYR);
    assert_int_equal(srv_chat_detect("{{ weird }}", 11), SRV_CHAT_UNKNOWN);
    assert_int_equal(srv_chat_detect(NULL, 0), SRV_CHAT_NONE);
    assert_int_equal(srv_chat_family_by_name("llama-3"), SRV_CHAT_LLAMA3);
    assert_int_equal(srv_chat_family_by_name("jinja"), -1);
}

static void test_bad(void **state)
{
    (void)state;
    const srv_endpoint C = SRV_EP_COMPLETIONS, H = SRV_EP_CHAT;
    expect_bad(C, "", "");
    expect_bad(C, "{", "");
    expect_bad(C, "[]", "");
    expect_bad(C, "{\"prompt\":[1]} x", "");
    expect_bad(C, "{\"prompt\":\"a\",\"temperature\":NaN}", "");
    expect_bad(
        C, "{\"prompt\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}",
        "");
    expect_bad(C, "{\"prompt\":\"\xff\"}", "");
    expect_bad(C, "{\"prompt\":\"a\\u0000bcd\"}", "");
    expect_bad(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}", "");
    expect_bad(C, "{\"prompt\":[1],\"max_tokens\":2,\"max_tokens\":0}", "");
    expect_bad(C, "{\"prompt\":[1],\"kv_transfer_params\":{\"a\":1,\"b\":2,\"a\":3}}", "");
    expect_bad(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"role\":\"system\"}]}", "");
    expect_bad(C, "{}", "prompt");
    expect_bad(C, "{\"prompt\":null}", "prompt");
    expect_bad(C, "{\"prompt\":{}}", "prompt");
    expect_bad(C, "{\"prompt\":[1,\"a\"]}", "prompt");
    expect_bad(C, "{\"prompt\":[[1],[]]}", "prompt");
    expect_bad(C, "{\"prompt\":[4294967296]}", "prompt");
    expect_bad(C, "{\"prompt\":[1],\"max_tokens\":1.5}", "max_tokens");
    expect_bad(C, "{\"prompt\":[1],\"max_tokens\":true}", "max_tokens");
    expect_bad(C, "{\"prompt\":[1],\"temperature\":3}", "temperature");
    expect_bad(C, "{\"prompt\":[1],\"top_k\":-2}", "top_k");
    expect_bad(C, "{\"prompt\":[1],\"min_p\":2}", "min_p");
    expect_bad(C, "{\"prompt\":[1],\"n\":65}", "n");
    expect_bad(C, "{\"prompt\":[1],\"data_parallel_rank\":-1}", "data_parallel_rank");
    expect_bad(C, "{\"prompt\":[1],\"data_parallel_rank\":64}", "data_parallel_rank");
    expect_bad(C, "{\"prompt\":[1],\"data_parallel_rank\":\"0\"}", "data_parallel_rank");
    expect_bad(C, "{\"prompt\":[1],\"stop\":[1]}", "stop");
    expect_bad(C, "{\"prompt\":[1],\"stream_options\":1}", "stream_options");
    expect_bad(C, "{\"prompt\":[1],\"stream_options\":{\"include_usage\":1}}",
               "stream_options.include_usage");
    expect_bad(C, "{\"prompt\":[1],\"echo\":1}", "echo");
    expect_bad(C, "{\"prompt\":[1],\"logprobs\":-1}", "logprobs");
    expect_bad(C, "{\"prompt\":[1],\"user\":5}", "user");
    expect_bad(C, "{\"prompt\":[1],\"model\":[]}", "model");
    expect_bad(H, "{\"messages\":[]}", "messages");
    expect_bad(H, "{\"messages\":[1]}", "messages");
    expect_bad(H, "{\"messages\":[{\"content\":\"x\"}]}", "messages.role");
    expect_bad(H, "{\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", "messages.role");
    expect_bad(H, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}",
               "messages.content");
    expect_bad(H, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":2}",
               "logprobs");
    /* Known OpenAI fields that ask for what is not implemented: a 400 naming them, never
     * ignored; values that ask for nothing pass (parsed below). */
    expect_bad(C, "{\"prompt\":[1],\"presence_penalty\":2.5}", "presence_penalty");
    expect_bad(C, "{\"prompt\":[1],\"frequency_penalty\":\"x\"}", "frequency_penalty");
    expect_bad(C, "{\"prompt\":[1],\"frequency_penalty\":5}", "frequency_penalty");
    expect_bad(C, "{\"prompt\":[1],\"repetition_penalty\":0}", "repetition_penalty");
    expect_bad(C, "{\"prompt\":[1],\"logit_bias\":{\"abc\":1}}", "logit_bias");
    expect_bad(C, "{\"prompt\":[1],\"logit_bias\":{\"-1\":1}}", "logit_bias");
    expect_bad(C, "{\"prompt\":[1],\"logit_bias\":{\"306\":101}}", "logit_bias");
    expect_bad(C, "{\"prompt\":[1],\"logit_bias\":[1]}", "logit_bias");
    expect_bad(C, "{\"prompt\":[1],\"best_of\":3}", "best_of");
    expect_bad(C, "{\"prompt\":[1],\"suffix\":\"x\"}", "suffix");
    expect_bad(C, "{\"prompt\":[1],\"echo\":true,\"logprobs\":0}", "logprobs");
    expect_bad(C, "{\"prompt\":[1],\"stream_options\":{\"include_usage\":true}}", "stream_options");
    const char *U = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],";
    static const char *const chat_bad[][2] = {
        {"\"response_format\":{\"type\":\"json_object\"}}", "response_format"},
        {"\"response_format\":\"json\"}", "response_format"},
        {"\"tools\":[{\"type\":\"function\"}]}", "tools"},
        {"\"functions\":[{}]}", "functions"},
        {"\"tool_choice\":\"required\"}", "tool_choice"},
        {"\"function_call\":{\"name\":\"f\"}}", "function_call"},
        {"\"parallel_tool_calls\":1}", "parallel_tool_calls"},
        {"\"modalities\":[\"text\",\"audio\"]}", "modalities"},
        {"\"audio\":{}}", "audio"},
        {"\"prediction\":{}}", "prediction"},
    };
    for (size_t i = 0; i < sizeof(chat_bad) / sizeof(chat_bad[0]); i++) {
        char body[256];
        snprintf(body, sizeof(body), "%s%s", U, chat_bad[i][0]);
        expect_bad(H, body, chat_bad[i][1]);
    }
    expect_bad(H, "{\"messages\":[{\"role\":\"user\"}]}", "messages.content");
    expect_bad(H,
               "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":"
               "\"a\"}]}]}",
               "messages.tool_calls");
    srv_request r;
    srv_error err;
    const char *lit = "{\"prompt\":\"a\\\\u0000b\"}"; /* an escaped backslash, then text */
    assert_int_equal(srv_request_parse(&r, C, lit, strlen(lit), &err), 0);
    assert_string_equal(r.prompts[0].text, "a\\u0000b");
    srv_request_free(&r);
    const char *fine =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\","
        "\"content\":null,\"tool_calls\":[]}],\"presence_penalty\":0,\"frequency_penalty\":0,"
        "\"logit_bias\":{},\"response_format\":{\"type\":\"text\"},\"tools\":[],"
        "\"tool_choice\":\"none\",\"parallel_tool_calls\":false,\"modalities\":[\"text\"]}";
    assert_int_equal(srv_request_parse(&r, H, fine, strlen(fine), &err), 0);
    srv_request_free(&r);
    const char *fine_c = "{\"prompt\":[1],\"n\":2,\"best_of\":2,\"suffix\":\"\"}";
    assert_int_equal(srv_request_parse(&r, C, fine_c, strlen(fine_c), &err), 0);
    assert_true(r.repetition_penalty == 1.0 && r.presence_penalty == 0 && r.n_logit_bias == 0);
    srv_request_free(&r);
    const char *pen = "{\"prompt\":[1],\"presence_penalty\":-0.5,\"frequency_penalty\":1.5,"
                      "\"repetition_penalty\":1.2,\"logit_bias\":{\"306\":-100,\"7\":2.5}}";
    assert_int_equal(srv_request_parse(&r, C, pen, strlen(pen), &err), 0);
    assert_true(r.presence_penalty == -0.5 && r.frequency_penalty == 1.5 &&
                r.repetition_penalty == 1.2);
    assert_int_equal(r.n_logit_bias, 2);
    assert_int_equal(r.logit_bias_ids[0], 306);
    assert_true(r.logit_bias[0] == -100.0f && r.logit_bias[1] == 2.5f);
    srv_request_free(&r);
    /* Positive values too small for the engine's float stay positive there (0 would be
     * "off" for the penalty and a refused top_p) */
    const char *tiny = "{\"prompt\":[1],\"repetition_penalty\":1e-300,\"top_p\":1e-300}";
    assert_int_equal(srv_request_parse(&r, C, tiny, strlen(tiny), &err), 0);
    assert_true((float)r.repetition_penalty > 0 && (float)r.top_p > 0);
    srv_request_free(&r);
}

static void test_kv_config(void **state)
{
    (void)state;
    srv_kv_config c;
    char msg[320];
    assert_int_equal(srv_kv_config_parse(&c,
                                         "{\"kv_role\":\"kv_consumer\",\"kv_connector\":\"moriio\","
                                         "\"handshake_port\":5600,\"kv_ip\":\"10.0.0.1\","
                                         "\"kv_port\":14579,\"kv_rank\":1,\"kv_parallel_size\":2,"
                                         "\"kv_buffer_device\":\"cpu\",\"kv_buffer_size\":1e9,"
                                         "\"kv_connector_extra_config\":{\"k\":1}}",
                                         msg, sizeof(msg)),
                     0);
    assert_int_equal(c.role, SRV_KV_CONSUMER);
    assert_int_equal(c.handshake_port, 5600);
    assert_int_equal(c.port, 14579);
    assert_string_equal(c.ip, "10.0.0.1");
    assert_non_null(c.extra);
    assert_string_equal(c.connector, "moriio");
    assert_int_equal(c.protocol, SRV_KV_TCP);
    assert_false(c.write_mode);
    assert_int_equal(c.qp_per_transfer, 4);
    assert_int_equal(c.num_worker_threads, 4);
    assert_true(c.recompute);
    assert_true(c.verify_checksums);
    srv_kv_config_free(&c);
    /* Every key of the issue, and the seed recipes' MORI-IO keys (noted as ignored). */
    assert_int_equal(
        srv_kv_config_parse(&c,
                            "{\"kv_role\":\"kv_producer\",\"kv_connector\":\"tandem\","
                            "\"protocol\":\"ucx\",\"transfer_mode\":\"read\",\"handshake_port\":6301,"
                            "\"num_worker_threads\":8,\"qp_per_transfer\":2,\"lease_ms\":5000,"
                            "\"transfer_timeout_ms\":2000,\"kv_load_failure_policy\":\"fail\","
                            "\"verify_checksums\":false,\"proxy_ip\":\"127.0.0.1\","
                            "\"proxy_ping_port\":36367,\"http_port\":8003,\"auth_token\":\"s3cret\","
                            "\"post_batch_size\":-1,\"max_send_wr\":0,\"max_cqe_num\":0,"
                            "\"max_msg_sge\":0,\"enable_notification\":false}",
                            msg, sizeof(msg)),
        0);
    assert_int_equal(c.role, SRV_KV_PRODUCER);
    assert_int_equal(c.protocol, SRV_KV_UCX);
    assert_int_equal(c.num_worker_threads, 8);
    assert_int_equal(c.qp_per_transfer, 2);
    assert_int_equal(c.lease_ms, 5000);
    assert_int_equal(c.transfer_timeout_ms, 2000);
    assert_false(c.recompute);
    assert_false(c.verify_checksums);
    assert_string_equal(c.proxy_ip, "127.0.0.1");
    assert_int_equal(c.proxy_ping_port, 36367);
    assert_int_equal(c.http_port, 8003);
    assert_string_equal(c.auth_token, "s3cret");
    assert_non_null(strstr(c.notes, "max_send_wr is ignored for protocol ucx"));
    srv_kv_config_free(&c);
    /* The seed recipe's mooncake alias means push; an explicit transfer_mode wins. */
    assert_int_equal(srv_kv_config_parse(&c,
                                         "{\"kv_role\":\"kv_consumer\",\"kv_connector\":"
                                         "\"mooncake\",\"handshake_port\":6301}",
                                         msg, sizeof(msg)),
                     0);
    assert_true(c.write_mode);
    srv_kv_config_free(&c);
    assert_int_equal(srv_kv_config_parse(&c,
                                         "{\"kv_role\":\"kv_consumer\",\"kv_connector\":"
                                         "\"mooncake\",\"transfer_mode\":\"read\"}",
                                         msg, sizeof(msg)),
                     0);
    assert_false(c.write_mode);
    srv_kv_config_free(&c);
    assert_int_equal(srv_kv_config_parse(&c,
                                         "{\"kv_role\":\"kv_producer\",\"transfer_mode\":"
                                         "\"write\"}",
                                         msg, sizeof(msg)),
                     0);
    assert_true(c.write_mode);
    srv_kv_config_free(&c);
    /* cuda_ipc parses in any build (serve checks --device); it always reads */
    assert_int_equal(srv_kv_config_parse(&c,
                                         "{\"kv_role\":\"kv_consumer\",\"kv_connector\":"
                                         "\"mooncake\",\"protocol\":\"cuda_ipc\","
                                         "\"kv_buffer_device\":\"cuda\"}",
                                         msg, sizeof(msg)),
                     0);
    assert_int_equal(c.protocol, SRV_KV_CUDA_IPC);
    assert_false(c.write_mode);
    srv_kv_config_free(&c);
    static const char *const bad[] = {
        "{}",
        "[]",
        "x",
        "{\"kv_role\":\"kv_both\",\"zzz\":1}",
        "{\"kv_role\":1}",
        "{\"kv_role\":\"kv_both\",\"handshake_port\":70000}",
        "{\"kv_role\":\"kv_both\",\"kv_rank\":2,\"kv_parallel_size\":2}",
        "{\"kv_role\":\"kv_both\",\"kv_buffer_device\":\"tpu\"}",
        "{\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":\"s\"}",
        "{\"kv_role\":\"kv_both\",\"kv_connector\":\"nixl\"}",
        "{\"kv_role\":\"kv_both\",\"protocol\":\"hip\"}",
        "{\"kv_role\":\"kv_both\",\"protocol\":\"cuda_ipc\",\"kv_buffer_device\":\"cpu\"}",
        "{\"kv_role\":\"kv_both\",\"protocol\":\"shm\",\"kv_buffer_device\":\"cuda\"}",
        "{\"kv_role\":\"kv_both\",\"protocol\":\"cuda_ipc\",\"transfer_mode\":\"write\"}",
        "{\"kv_role\":\"kv_both\",\"transfer_mode\":\"pull\"}",
        "{\"kv_role\":\"kv_both\",\"kv_load_failure_policy\":\"retry\"}",
        "{\"kv_role\":\"kv_both\",\"verify_checksums\":1}",
        "{\"kv_role\":\"kv_both\",\"qp_per_transfer\":0}",
        "{\"kv_role\":\"kv_both\",\"num_worker_threads\":2.5}",
        "{\"kv_role\":\"kv_both\",\"lease_ms\":5}",
        "{\"kv_role\":\"kv_both\",\"auth_token\":\"\"}",
        "{\"kv_role\":\"kv_both\",\"max_send_wr\":-3}",
        "{\"kv_role\":\"kv_both\",\"enable_notification\":\"yes\"}",
        "{\"kv_role\":\"kv_both\",\"qp_per_transfers\":4}",
        "{\"kv_role\":\"kv_both\",\"rail_device\":\"tdr0,tdr1\"}",
        "{\"kv_role\":\"kv_both\",\"ib_device\":7}",
        "{\"kv_role\":\"kv_both\",\"matched_rails\":\"\"}",
        "{\"kv_role\":\"kv_both\",\"rail_striping\":\"yes\"}",
        /* a recipe cut or pasted wrong: nothing after the object, no key twice */
        "{\"kv_role\":\"kv_producer\"}, \"protocol\":\"shm\"}",
        "{\"kv_role\":\"kv_producer\",\"kv_role\":\"kv_consumer\"}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        msg[0] = '\0';
        if (srv_kv_config_parse(&c, bad[i], msg, sizeof(msg)) == 0) fail_msg("accepted %s", bad[i]);
        assert_non_null(strstr(msg, "--kv-transfer-config"));
    }
}

/* Rails from the config and the environment, resolved on a fixture sysfs. */
static void test_kv_rails(void **state)
{
    (void)state;
    char root[] = "/tmp/td-kvrails-XXXXXX", path[256], msg[600];
    assert_non_null(mkdtemp(root));
    const char *devs[] = {"tdr0", "tdr1", "tdr2"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof(path), "mkdir -p %s/class/net/%s %s/class/infiniband/mlx5_0/ports/1 && "
                 "echo up > %s/class/net/%s/operstate && echo '4: ACTIVE' > "
                 "%s/class/infiniband/mlx5_0/ports/1/state", root, devs[i], root, root, devs[i], root);
        assert_int_equal(system(path), 0);
    }
    setenv("TANDEM_SYSFS_ROOT", root, 1);
    srv_kv_config c;
    assert_int_equal(srv_kv_config_parse(&c, "{\"kv_role\":\"kv_consumer\",\"ib_device\":"
                                             "\"tdr1\",\"matched_rails\":\"auto\","
                                             "\"rail_striping\":true}",
                                         msg, sizeof(msg)),
                     0);
    assert_string_equal(c.rail_device, "tdr1");
    assert_true(c.rail_striping);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), 0);
    assert_int_equal(c.rails.n, 3);
    assert_int_equal(c.rails.primary, 1);
    assert_true(c.rails_matched);
    /* The environment may say the same; saying something else is an error. */
    setenv("TANDEM_MATCHED_RAILS", "auto", 1);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), 0);
    setenv("TANDEM_MATCHED_RAILS", "tdr0,tdr1", 1);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), TD_EINVAL);
    assert_non_null(strstr(msg, "disagree"));
    unsetenv("TANDEM_MATCHED_RAILS");
    srv_kv_config_free(&c);
    /* Only the environment: the seed's names work, and two names that disagree do not. */
    assert_int_equal(srv_kv_config_parse(&c, "{\"kv_role\":\"kv_producer\"}", msg, sizeof(msg)), 0);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), 0);
    assert_int_equal(c.rails.n, 0);
    setenv("ATOM_MOONCAKE_MATCHED_RAILS", "tdr2,tdr0", 1);
    setenv("ATOM_MOONCAKE_IB_DEVICE", "tdr0", 1);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), 0);
    assert_int_equal(c.rails.n, 2);
    assert_string_equal(c.rails.name[c.rails.primary], "tdr0");
    setenv("TANDEM_RAIL_DEVICE", "tdr2", 1);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), TD_EINVAL);
    assert_non_null(strstr(msg, "TANDEM_RAIL_DEVICE"));
    unsetenv("TANDEM_RAIL_DEVICE");
    unsetenv("ATOM_MOONCAKE_MATCHED_RAILS");
    /* One device, not matched. */
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), 0);
    assert_int_equal(c.rails.n, 1);
    assert_false(c.rails_matched);
    /* An RDMA device needs protocol ucx; rails need tcp or ucx; a bad SL. */
    setenv("ATOM_MOONCAKE_IB_DEVICE", "mlx5_0", 1);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), TD_EINVAL);
    assert_non_null(strstr(msg, "need protocol ucx"));
    c.protocol = SRV_KV_UCX;
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), 0);
    assert_int_equal(c.rails.kind, KVX_RAIL_RDMA);
    unsetenv("ATOM_MOONCAKE_IB_DEVICE");
    srv_kv_config_free(&c);
    assert_int_equal(srv_kv_config_parse(&c, "{\"kv_role\":\"kv_producer\",\"protocol\":\"shm\","
                                             "\"rail_device\":\"tdr0\"}",
                                         msg, sizeof(msg)),
                     0);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), TD_EINVAL);
    assert_non_null(strstr(msg, "tcp or ucx"));
    srv_kv_config_free(&c);
    assert_int_equal(srv_kv_config_parse(&c, "{\"kv_role\":\"kv_producer\",\"rail_striping\":true}",
                                         msg, sizeof(msg)),
                     0);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), TD_EINVAL);
    assert_non_null(strstr(msg, "matched_rails"));
    c.rail_striping = false;
    setenv("MORI_RDMA_SL", "16", 1);
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), TD_EINVAL);
    assert_non_null(strstr(msg, "[0, 15]"));
    setenv("MORI_RDMA_SL", "3", 1);
    unsetenv("UCX_IB_SL");
    assert_int_equal(srv_kv_rails(&c, msg, sizeof(msg)), 0);
    assert_string_equal(getenv("UCX_IB_SL"), "3");
    unsetenv("MORI_RDMA_SL");
    unsetenv("UCX_IB_SL");
    srv_kv_config_free(&c);
    unsetenv("TANDEM_SYSFS_ROOT");
    snprintf(path, sizeof(path), "rm -rf %s", root);
    assert_int_equal(system(path), 0);
}

static void test_kv_params(void **state)
{
    (void)state;
    srv_error err;
    srv_kv_params kp;
    const char *good =
        "{\"do_remote_prefill\":true,\"remote_host\":\"10.0.0.2\",\"remote_port\":6301,"
        "\"remote_engine_id\":\"0123456789abcdef0123456789abcdef\","
        "\"transfer_id\":\"fedcba9876543210fedcba9876543210\",\"remote_block_ids\":[4,5,6],"
        "\"first_token_id\":42,\"num_prompt_tokens\":40,\"block_size\":16,\"kv_dtype\":\"f16\","
        "\"model_fingerprint\":\"87eb12a93d3fd764\",\"lease_ms\":5000,"
        "\"producer_timing\":{\"queue_ms\":1.5,\"compute_ms\":20},"
        "\"first_token_logprob\":-0.5,\"first_token_top_logprobs\":[[42,-0.5],[7,-1.25]]}";
    cJSON *j = cJSON_Parse(good);
    assert_int_equal(srv_kv_params_parse(&kp, j, 512, &err), 0);
    assert_true(kp.prefill);
    assert_false(kp.decode);
    assert_string_equal(kp.host, "10.0.0.2");
    assert_int_equal(kp.port, 6301);
    assert_int_equal(kp.n_blocks, 3);
    assert_int_equal(kp.blocks[2], 6);
    assert_int_equal(kp.first_token, 42);
    assert_int_equal(kp.num_prompt_tokens, 40);
    assert_int_equal(kp.block_size, 16);
    assert_string_equal(kp.kv_dtype, "f16");
    assert_int_equal(kp.lease_ms, 5000);
    assert_true(kp.prod_compute_ms == 20.0);
    assert_true(kp.has_first_logprob);
    assert_true(kp.first_logprob == -0.5f);
    assert_int_equal(kp.n_first_top, 2);
    assert_int_equal(kp.first_top_ids[1], 7);
    assert_true(kp.first_top_logprobs[1] == -1.25f);
    srv_kv_params_free(&kp);
    /* Each field broken in turn: a 400 naming it. */
    static const char *const bad[][2] = {
        {"remote_host", "7"},
        {"remote_port", "0"},
        {"remote_engine_id", "\"0123\""},
        {"remote_engine_id", "\"0123456789ABCDEF0123456789ABCDEF\""},
        {"transfer_id", "null"},
        {"remote_block_ids", "[]"},
        {"remote_block_ids", "[1,-2]"},
        {"remote_block_ids", "[1.5]"},
        {"first_token_id", "512"},
        {"num_prompt_tokens", "0"},
        {"block_size", "\"16\""},
        {"lease_ms", "-1"},
        {"kv_dtype", "3"},
        {"first_token_logprob", "0.5"},
        {"first_token_logprob", "\"x\""},
        {"first_token_top_logprobs", "[[512,-1]]"},
        {"first_token_top_logprobs", "[[1.5,-1]]"},
        {"first_token_top_logprobs", "[[1,-1,2]]"},
        {"first_token_top_logprobs", "[[1,1]]"},
        {"first_token_top_logprobs", "{\"a\":1}"},
        {"first_token_top_logprobs",
         "[[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],"
         "[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1],[1,-1]]"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cJSON *b = cJSON_Duplicate(j, 1);
        cJSON_ReplaceItemInObject(b, bad[i][0], cJSON_Parse(bad[i][1]));
        memset(&err, 0, sizeof(err));
        if (srv_kv_params_parse(&kp, b, 512, &err) == 0) fail_msg("accepted %s = %s", bad[i][0], bad[i][1]);
        assert_int_equal(err.status, 400);
        assert_string_equal(err.param, "kv_transfer_params");
        cJSON_Delete(b);
    }
    /* remote_port is also read as remote_handshake_port; both roles at once are refused;
     * neither role parses to nothing. */
    cJSON *b = cJSON_Duplicate(j, 1);
    cJSON_DeleteItemFromObject(b, "remote_port");
    cJSON_AddNumberToObject(b, "remote_handshake_port", 7000);
    assert_int_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_int_equal(kp.port, 7000);
    srv_kv_params_free(&kp);
    cJSON_AddTrueToObject(b, "do_remote_decode");
    assert_int_not_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_non_null(strstr(err.message, "both"));
    cJSON_Delete(b);
    b = cJSON_Parse("{\"do_remote_decode\":false,\"x\":[1]}");
    assert_int_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_false(kp.decode || kp.prefill);
    srv_kv_params_free(&kp);
    cJSON_Delete(b);
    cJSON_Delete(j);
    /* Write mode: the producer needs the router's transfer id; the consumer needs no
     * block ids or first token (they come over the transfer). */
    b = cJSON_Parse("{\"do_remote_decode\":true,\"transfer_mode\":\"write\","
                    "\"transfer_id\":\"fedcba9876543210fedcba9876543210\"}");
    assert_int_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_true(kp.decode && kp.write);
    assert_string_equal(kp.transfer_id, "fedcba9876543210fedcba9876543210");
    srv_kv_params_free(&kp);
    cJSON_DeleteItemFromObject(b, "transfer_id");
    assert_int_not_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_non_null(strstr(err.message, "transfer_id"));
    cJSON_ReplaceItemInObject(b, "transfer_mode", cJSON_CreateString("push"));
    assert_int_not_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_non_null(strstr(err.message, "transfer_mode"));
    cJSON_Delete(b);
    b = cJSON_Parse("{\"do_remote_prefill\":true,\"transfer_mode\":\"write\","
                    "\"remote_host\":\"127.0.0.1\",\"remote_handshake_port\":6301,"
                    "\"remote_engine_id\":\"0123456789abcdef0123456789abcdef\","
                    "\"transfer_id\":\"fedcba9876543210fedcba9876543210\"}");
    assert_int_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_true(kp.prefill && kp.write);
    assert_int_equal(kp.n_blocks, 0);
    assert_int_equal(kp.first_token, -1);
    assert_int_equal(kp.num_prompt_tokens, -1);
    srv_kv_params_free(&kp);
    cJSON_DeleteItemFromObject(b, "remote_engine_id");
    assert_int_not_equal(srv_kv_params_parse(&kp, b, 512, &err), 0);
    assert_non_null(strstr(err.message, "kv_transfer_info"));
    cJSON_Delete(b);
}

/* Real templates from the shared folder: the families render, look-alikes are refused. */
/* A template of the shared folder into g_tmpl; its length (the test is skipped without it). */
static char g_tmpl[1 << 20];
static size_t read_template(const char *dir, const char *file)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/chat-templates/%s", dir, file);
    FILE *f = fopen(path, "rb");
    if (!f) skip();
    size_t n = fread(g_tmpl, 1, sizeof(g_tmpl), f);
    fclose(f);
    return n;
}

static void test_detect_shared(void **state)
{
    (void)state;
    const char *dir = getenv("TD_SHARED_DIR");
    if (!dir) skip();
    static const struct {
        const char *file;
        srv_chat_family want;
    } cases[] = {
        {"Qwen-Qwen2.5-7B-Instruct.jinja", SRV_CHAT_CHATML},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja", SRV_CHAT_LLAMA3},
        {"Qwen-QwQ-32B.jinja", SRV_CHAT_UNKNOWN},    /* opens <think> in the prompt */
        {"Qwen-Qwen3-0.6B.jinja", SRV_CHAT_UNKNOWN}, /* reasoning blocks in the turns */
        {"HuggingFaceTB-SmolLM3-3B.jinja", SRV_CHAT_UNKNOWN},
        {"mistralai-Mistral-Nemo-Instruct-2407.jinja", SRV_CHAT_UNKNOWN},
        {"Mistral-Small-3.2-24B-Instruct-2506.jinja", SRV_CHAT_UNKNOWN},
        {"microsoft-Phi-3.5-mini-instruct.jinja", SRV_CHAT_UNKNOWN},
        {"GLM-4.6.jinja", SRV_CHAT_UNKNOWN},
        {"google-gemma-2-2b-it.jinja", SRV_CHAT_UNKNOWN},
        {"deepseek-ai-DeepSeek-V3.1.jinja", SRV_CHAT_UNKNOWN},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t n = read_template(dir, cases[i].file);
        srv_chat_family got = srv_chat_detect(g_tmpl, n);
        if (got != cases[i].want)
            fail_msg("%s: detected %s, want %s", cases[i].file, srv_chat_family_name(got),
                     srv_chat_family_name(cases[i].want));
    }
    /* What the templates add, rendered as jinja2 renders these files (the expected texts
     * were made so: trim_blocks, lstrip_blocks, add_generation_prompt, no BOS): Qwen2.5's
     * default system turn, Llama-3.1's dated system turn and trimmed turns. */
    static const struct {
        const char *file;
        srv_chat_msg msgs[2];
        int n;
        const char *want;
    } renders[] = {
        {"Qwen-Qwen2.5-7B-Instruct.jinja",
         {{"user", "Hi"}},
         1,
         "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
         "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"},
        {"Qwen-Qwen2.5-7B-Instruct.jinja",
         {{"system", "S"}, {"user", "Hi"}},
         2,
         "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>"
         "assistant\n"},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja",
         {{"system", " SYS \n"}, {"user", " Hi "}},
         2,
         "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
         "2023\nToday Date: 26 Jul 2024\n\nSYS<|eot_id|><|start_header_id|>user<|end_header_id|>"
         "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
        {"meta-llama-Llama-3.1-8B-Instruct.jinja",
         {{"user", "Hi"}},
         1,
         "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December "
         "2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>"
         "\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
    };
    for (size_t i = 0; i < sizeof(renders) / sizeof(renders[0]); i++) {
        size_t n = read_template(dir, renders[i].file);
        srv_chat_extras x;
        srv_chat_family fam = srv_chat_detect_ex(g_tmpl, n, &x);
        srv_error err;
        char *got = srv_chat_render_ex(fam, &x, renders[i].msgs, renders[i].n, &err);
        assert_non_null(got);
        if (strcmp(got, renders[i].want))
            fail_msg("%s: rendered\n%s\nwant\n%s", renders[i].file, got, renders[i].want);
        free(got);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompt_variants),
        cmocka_unit_test(test_fields),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_detect),
        cmocka_unit_test(test_bad),
        cmocka_unit_test(test_kv_config),
        cmocka_unit_test(test_kv_rails),
        cmocka_unit_test(test_kv_params),
        cmocka_unit_test(test_detect_shared),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
