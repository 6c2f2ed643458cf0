/*
 * Unit tests for model/mkmodel.c: files written with a generated vocabulary and
 * with one copied (and padded) from a vocabulary GGUF load back with the right
 * shape and tokenizer keys, and hold the same weights as td_model_load_dummy; models
 * with experts get their metadata keys and 3-D expert tensors.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "test_shared.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/mkmodel.h"
#include "model/model.h"

static void tmp_path(char *buf, size_t cap, const char *name)
{
    const char *dir = getenv("TMPDIR");
    snprintf(buf, cap, "%s/td_test_mkmodel_%d_%s", dir && *dir ? dir : "/tmp", (int)getpid(), name);
}

#define assert_err(rc_expr, err, code, substr)                                                     \
    do {                                                                                           \
        int rc_ = (rc_expr);                                                                       \
        if (rc_ != (code) || !strstr((err).msg, (substr)))                                         \
            fail_msg("expected %d with '%s', got %d: '%s'", (code), (substr), rc_, (err).msg);     \
    } while (0)

static bool str_eq(gguf_str s, const char *c)
{
    return s.len == strlen(c) && memcmp(s.ptr, c, s.len) == 0;
}

/* Every weight of two models is byte-identical. */
static void assert_same_weights(const td_model *a, const td_model *b)
{
    assert_true(a->fingerprint == b->fingerprint);
    const td_weight *wa[] = {&a->tok_embd, &a->output_norm, &a->output};
    const td_weight *wb[] = {&b->tok_embd, &b->output_norm, &b->output};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(wa[i]->type, wb[i]->type);
        assert_memory_equal(wa[i]->data, wb[i]->data, wa[i]->row_bytes * (size_t)wa[i]->rows);
    }
    for (int l = 0; l < a->shape.n_layer; l++) {
        const td_weight *la = &a->layers[l].attn_norm, *lb = &b->layers[l].attn_norm;
        for (size_t k = 0; k < sizeof(td_layer) / sizeof(td_weight); k++) {
            assert_int_equal(la[k].data == NULL, lb[k].data == NULL);
            if (la[k].data)
                assert_memory_equal(la[k].data, lb[k].data, la[k].row_bytes * (size_t)la[k].rows);
        }
    }
}

static void test_generated_vocab(void **state)
{
    (void)state;
    char path[512];
    tmp_path(path, sizeof(path), "tiny.gguf");
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    if (td_mkmodel_write(path, &s, TD_TYPE_Q8_0, NULL, 42, &err)) fail_msg("%s", err.msg);
    td_model *m;
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(m->shape.n_embd, 128);
    assert_int_equal(m->shape.n_layer, 4);
    assert_int_equal(m->shape.n_head, 4);
    assert_int_equal(m->shape.n_head_kv, 2);
    assert_int_equal(m->shape.n_ff, 384);
    assert_int_equal(m->shape.n_vocab, 512);
    assert_int_equal(m->shape.n_ctx_train, 512);
    assert_int_equal(m->shape.head_dim, 32);
    assert_int_equal(m->weight_type, TD_TYPE_Q8_0);
    assert_int_equal(td_model_n_params(&m->shape), td_model_n_params(&s));

    const gguf_file *f = m->gguf;
    gguf_str str;
    assert_int_equal(gguf_get_str(f, "tokenizer.ggml.model", &str, &err), 0);
    assert_true(str_eq(str, "llama"));
    assert_int_equal(gguf_get_str(f, "tokenizer.ggml.pre", &str, &err), 0);
    assert_true(str_eq(str, "default"));
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 0), "<unk>"));
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 2), "</s>"));
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 3), "<0x00>"));
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 258), "<0xFF>"));
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 511), "<pad_511>"));
    const int32_t *types = gguf_get_arr_data(f, "tokenizer.ggml.token_type");
    assert_non_null(types);
    assert_int_equal(types[0], 2);
    assert_int_equal(types[1], 3);
    assert_int_equal(types[100], 6);
    assert_int_equal(types[300], 5);
    uint32_t u;
    bool b;
    assert_int_equal(gguf_get_u32(f, "tokenizer.ggml.bos_token_id", &u, &err), 0);
    assert_int_equal(u, 1);
    assert_int_equal(gguf_get_u32(f, "tokenizer.ggml.eos_token_id", &u, &err), 0);
    assert_int_equal(u, 2);
    assert_int_equal(gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b, &err), 0);
    assert_true(b);
    gguf_vtype et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.scores", &et, &n, &err), 0);
    assert_int_equal(et, GGUF_VT_FLOAT32);
    assert_int_equal(n, 512);

    /* the same weights as --load-format dummy with the same seed */
    td_model *d;
    if (td_model_load_dummy(&d, &s, TD_TYPE_Q8_0, 42, &err)) fail_msg("%s", err.msg);
    assert_same_weights(m, d);
    td_model_free(d);
    td_model_free(m);

    /* qwen2 with f16 weights */
    s.arch = TD_ARCH_QWEN2;
    s.rope_type = TD_ROPE_NEOX;
    if (td_mkmodel_write(path, &s, TD_TYPE_F16, NULL, 3, &err)) fail_msg("%s", err.msg);
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(m->shape.arch, TD_ARCH_QWEN2);
    assert_int_equal(m->shape.rope_type, TD_ROPE_NEOX);
    assert_non_null(m->layers[3].bv.data);
    assert_int_equal(m->layers[3].bv.type, TD_TYPE_F32);
    if (td_model_load_dummy(&d, &s, TD_TYPE_F16, 3, &err)) fail_msg("%s", err.msg);
    assert_same_weights(m, d);
    td_model_free(d);
    td_model_free(m);
    unlink(path);

    /* errors */
    s.n_vocab = 100;
    assert_err(td_mkmodel_write(path, &s, TD_TYPE_F16, NULL, 3, &err), err, TD_EINVAL,
               "too small for the generated byte-level vocabulary");
    assert_err(td_mkmodel_check(&s, TD_TYPE_F16, false, &err), err, TD_EINVAL, "too small");
    s.n_vocab = 512;
    s.n_ff = 100;
    assert_err(td_mkmodel_write(path, &s, TD_TYPE_Q4_0, NULL, 3, &err), err, TD_EINVAL,
               "multiple of 32");
    assert_int_not_equal(access(path, F_OK), 0);
}

static void test_vocab_from(void **state)
{
    (void)state;
    char vocab[1024], path[512];
    snprintf(vocab, sizeof(vocab), "%s/tokenizer/ggml-vocab-llama-spm.gguf", td_test_shared_dir());
    tmp_path(path, sizeof(path), "spm.gguf");
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);

    gguf_file *src;
    if (gguf_open(&src, vocab, &err)) fail_msg("%s", err.msg);

    /* n_vocab 0: the vocabulary's size */
    s.n_vocab = 0;
    if (td_mkmodel_write(path, &s, TD_TYPE_F32, vocab, 1, &err)) fail_msg("%s", err.msg);
    td_model *m;
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(m->shape.n_vocab, 32000);
    assert_int_equal(m->tok_embd.rows, 32000);
    assert_int_equal(m->output.rows, 32000);
    assert_int_equal(m->shape.n_embd, 128);
    /* every tokenizer key is copied */
    for (int64_t i = 0; i < gguf_n_kv(src); i++) {
        gguf_str k = gguf_key_name(src, i);
        if (k.len < 10 || memcmp(k.ptr, "tokenizer.", 10)) continue;
        char key[128];
        snprintf(key, sizeof(key), "%.*s", (int)k.len, k.ptr);
        int64_t j = gguf_find_key(m->gguf, key);
        if (j < 0) fail_msg("key '%s' not copied", key);
        assert_int_equal(gguf_kv_type(m->gguf, j), gguf_kv_type(src, i));
    }
    for (uint64_t i = 0; i < 32000; i += 1111) {
        gguf_str a = gguf_get_arr_str(src, "tokenizer.ggml.tokens", i);
        gguf_str b = gguf_get_arr_str(m->gguf, "tokenizer.ggml.tokens", i);
        assert_int_equal(a.len, b.len);
        assert_memory_equal(a.ptr, b.ptr, a.len);
    }
    td_model_free(m);

    /* a bigger request pads with unused tokens */
    s.n_vocab = 32010;
    if (td_mkmodel_write(path, &s, TD_TYPE_F16, vocab, 1, &err)) fail_msg("%s", err.msg);
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    assert_int_equal(m->shape.n_vocab, 32010);
    const gguf_file *f = m->gguf;
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 31999),
                       "\xe7\xbb\x99")); /* the last real piece */
    assert_true(str_eq(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 32005), "<pad_32005>"));
    const int32_t *types = gguf_get_arr_data(f, "tokenizer.ggml.token_type");
    assert_int_equal(types[32009], 5);
    assert_int_equal(types[1], 3);
    gguf_vtype et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.scores", &et, &n, &err), 0);
    assert_int_equal(n, 32010);
    const float *sc = gguf_get_arr_data(f, "tokenizer.ggml.scores");
    assert_memory_equal(sc, gguf_get_arr_data(src, "tokenizer.ggml.scores"), 32000 * 4);
    td_model_free(m);

    /* a smaller request is an error */
    s.n_vocab = 512;
    assert_err(td_mkmodel_write(path, &s, TD_TYPE_F16, vocab, 1, &err), err, TD_EINVAL,
               "requested vocabulary of 512 tokens is smaller than the 32000 tokens");
    assert_err(td_mkmodel_write(path, &s, TD_TYPE_F16, "/nonexistent.gguf", 1, &err), err, TD_EIO,
               "cannot open");
    gguf_close(src);
    unlink(path);
}

/* A model over the 64 MiB mark is filled by several threads; the weights must not
 * depend on that (rows are seeded independently). */
static void test_threaded_dummy_matches_file(void **state)
{
    (void)state;
    char path[512];
    tmp_path(path, sizeof(path), "big.gguf");
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    s.n_vocab = 32000;
    s.n_embd = 256;
    s.head_dim = 64;
    s.n_ff = 512;
    s.n_layer = 2;
    td_model *d, *m;
    if (td_model_load_dummy(&d, &s, TD_TYPE_F32, 11, &err)) fail_msg("%s", err.msg);
    assert_true(d->weight_bytes > (64u << 20));
    if (td_mkmodel_write(path, &s, TD_TYPE_F32, NULL, 11, &err)) fail_msg("%s", err.msg);
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    assert_same_weights(m, d);
    td_model_free(d);
    td_model_free(m);
    unlink(path);
}

/* MoE presets: the experts' keys and 3-D tensors in ggml order, the same weights as
 * --load-format dummy (every td_layer slot, the experts' included), in each weight type. */
static void test_moe_files(void **state)
{
    (void)state;
    char path[512];
    tmp_path(path, sizeof(path), "moe.gguf");
    td_err err;
    static const struct {
        const char *preset;
        td_type type;
    } cases[] = {{"moe-tiny", TD_TYPE_F16},
                 {"moe-tiny", TD_TYPE_Q8_0},
                 {"qwen2moe-tiny", TD_TYPE_BF16},
                 {"qwen2moe-tiny", TD_TYPE_F32}};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        td_model_shape s;
        assert_int_equal(td_model_preset(cases[c].preset, &s, &err), 0);
        if (td_mkmodel_write(path, &s, cases[c].type, NULL, 9, &err)) fail_msg("%s", err.msg);
        td_model *m, *d;
        if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
        const gguf_file *f = m->gguf;
        bool qwen = s.arch == TD_ARCH_QWEN2MOE;
        const char *arch = qwen ? "qwen2moe" : "llama";
        char key[96];
        uint32_t u;
        gguf_str str;
        assert_int_equal(gguf_get_str(f, "general.architecture", &str, &err), 0);
        assert_true(str_eq(str, arch));
        snprintf(key, sizeof(key), "%s.expert_count", arch);
        assert_int_equal(gguf_get_u32(f, key, &u, &err), 0);
        assert_int_equal(u, 8);
        snprintf(key, sizeof(key), "%s.expert_used_count", arch);
        assert_int_equal(gguf_get_u32(f, key, &u, &err), 0);
        assert_int_equal(u, (uint32_t)s.n_expert_used);
        snprintf(key, sizeof(key), "%s.expert_shared_feed_forward_length", arch);
        assert_int_equal(gguf_get_u32(f, key, &u, NULL), qwen ? 0 : TD_ENOTFOUND);
        if (qwen) assert_int_equal(u, 256);
        const gguf_tensor *t = gguf_find_tensor(f, "blk.1.ffn_down_exps.weight");
        assert_non_null(t);
        assert_int_equal(t->n_dims, 3);
        assert_int_equal(t->ne[0], s.n_ff_exp);
        assert_int_equal(t->ne[1], 128);
        assert_int_equal(t->ne[2], 8);
        assert_int_equal(t->type, cases[c].type);
        t = gguf_find_tensor(f, "blk.0.ffn_gate_inp.weight");
        assert_int_equal(t->n_dims, 2);
        assert_int_equal(t->type, TD_TYPE_F32);
        assert_null(gguf_find_tensor(f, "blk.0.ffn_gate.weight"));
        assert_true((gguf_find_tensor(f, "blk.0.ffn_gate_inp_shexp.weight") != NULL) == qwen);
        assert_int_equal(m->weight_type, cases[c].type);
        if (td_model_load_dummy(&d, &s, cases[c].type, 9, &err)) fail_msg("%s", err.msg);
        assert_same_weights(m, d);
        td_model_free(d);
        td_model_free(m);
    }
    unlink(path);
}

static void test_byte_vocab_api(void **state)
{
    (void)state;
    td_err err;
    gguf_writer *w = gguf_writer_new();
    assert_err(td_mkmodel_add_byte_vocab(w, 258, &err), err, TD_EINVAL, "259");
    assert_int_equal(td_mkmodel_add_byte_vocab(w, 259, &err), 0);
    gguf_writer_free(w);
    td_model_shape s;
    assert_int_equal(td_model_preset("llama-134m", &s, &err), 0);
    assert_int_equal(td_model_n_params(&s), 134105856);
    assert_int_equal(td_mkmodel_check(&s, TD_TYPE_Q4_0, false, &err), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_generated_vocab),
        cmocka_unit_test(test_vocab_from),
        cmocka_unit_test(test_threaded_dummy_matches_file),
        cmocka_unit_test(test_byte_vocab_api),
        cmocka_unit_test(test_moe_files),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
