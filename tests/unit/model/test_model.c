/*
 * Unit tests for model/model.c: loading the shared models, shape and type checks
 * (each bad file asserts the code and the message), presets, parameter counts
 * and dummy weights; models with experts (llama/Mixtral and qwen2moe): their 3-D
 * tensors and metadata, and one clear error for each kind of malformed MoE file.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "test_shared.h"

#include <math.h>
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
    snprintf(buf, cap, "%s/td_test_model_%d_%s", dir && *dir ? dir : "/tmp", (int)getpid(), name);
}

#define assert_err(rc_expr, err, code, substr)                                                     \
    do {                                                                                           \
        int rc_ = (rc_expr);                                                                       \
        if (rc_ != (code) || !strstr((err).msg, (substr)))                                         \
            fail_msg("expected %d with '%s', got %d: '%s'", (code), (substr), rc_, (err).msg);     \
    } while (0)

static td_model *load_shared(const char *rel)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", td_test_shared_dir(), rel);
    td_model *m;
    td_err err;
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    return m;
}

static void test_stories260k(void **state)
{
    (void)state;
    td_model *m = load_shared("models/stories260K.gguf");
    const td_model_shape *s = &m->shape;
    assert_int_equal(s->arch, TD_ARCH_LLAMA);
    assert_int_equal(s->n_embd, 64);
    assert_int_equal(s->n_layer, 5);
    assert_int_equal(s->n_head, 8);
    assert_int_equal(s->n_head_kv, 4);
    assert_int_equal(s->n_ff, 172);
    assert_int_equal(s->n_vocab, 512);
    assert_int_equal(s->n_ctx_train, 128);
    assert_int_equal(s->head_dim, 8);
    assert_true(s->rms_eps == 1e-5f);
    assert_true(s->rope_theta == 10000.0f);
    assert_true(s->rope_freq_scale == 1.0f);
    assert_int_equal(s->rope_type, TD_ROPE_NORM);
    assert_false(s->tied_output);
    assert_int_equal(m->weight_type, TD_TYPE_F32);
    assert_int_equal(m->tok_embd.cols, 64);
    assert_int_equal(m->tok_embd.rows, 512);
    assert_int_equal(m->tok_embd.row_bytes, 256);
    assert_int_equal(m->layers[0].wk.rows, 32);
    assert_int_equal(m->layers[4].w_down.cols, 172);
    assert_int_equal(m->layers[4].w_down.rows, 64);
    assert_int_equal(m->output_norm.cols, 64);
    assert_null(m->layers[0].bq.data);
    assert_null(m->rope_freqs);
    assert_ptr_not_equal(m->output.data, m->tok_embd.data);
    assert_non_null(m->gguf);
    assert_string_equal(m->name, "llama");
    /* every tensor of the file is used: the byte count equals the file's data */
    size_t sum = 0;
    for (int64_t i = 0; i < gguf_n_tensors(m->gguf); i++)
        sum += gguf_tensor_at(m->gguf, i)->nbytes;
    assert_int_equal(m->weight_bytes, sum);
    assert_int_equal(td_model_n_params(s), (int64_t)(sum / 4));
    char desc[512];
    td_model_describe(m, desc, sizeof(desc));
    assert_non_null(strstr(desc, "dim 64, 5 layers, 8 heads (4 kv, head_dim 8)"));
    /* the fingerprint is stable across loads */
    uint64_t fp = m->fingerprint;
    assert_true(fp != 0);
    td_model_free(m);
    m = load_shared("models/stories260K.gguf");
    assert_true(m->fingerprint == fp);
    td_model_free(m);
}

static void test_tiny_random(void **state)
{
    (void)state;
    td_model *m = load_shared("models/llama-2-tiny-random.gguf");
    const td_model_shape *s = &m->shape;
    assert_int_equal(s->n_embd, 8);
    assert_int_equal(s->n_layer, 1);
    assert_int_equal(s->n_head, 2);
    assert_int_equal(s->n_head_kv, 2);
    assert_int_equal(s->head_dim, 4);
    assert_int_equal(s->n_ff, 32);
    assert_int_equal(s->n_vocab, 32000);
    assert_int_equal(s->n_ctx_train, 4096);
    assert_int_equal(m->weight_type, TD_TYPE_F16);
    assert_int_equal(m->tok_embd.type, TD_TYPE_F16);
    assert_int_equal(m->layers[0].attn_norm.type, TD_TYPE_F32);
    assert_false(s->tied_output);
    assert_string_equal(m->name, "LLaMA v2");
    td_model_free(m);
}

/* ---- malformed models ------------------------------------------------------- */

/*
 * Rewrite a model file with one change: keys edited by `edit`, a key dropped, a tensor
 * dropped, renamed, its shape transposed or replaced (`reshape`, with `ne`: as many dims as
 * ne has non-zero entries), or its type changed to f16 (data zeroed).
 */
typedef struct rewrite_opts {
    void (*edit)(gguf_writer *w);
    const char *drop;
    const char *transpose;
    const char *to_f16;
    const char *drop_key;
    const char *rename_from, *rename_to;
    const char *reshape;
    int64_t ne[4];
} rewrite_opts;

static int copy_fill(void *ctx, const gguf_tensor *t, void *dst, td_err *err)
{
    (void)err;
    const gguf_tensor *src = ctx;
    memset(dst, 0, t->nbytes);
    memcpy(dst, src->data, TD_MIN(t->nbytes, src->nbytes));
    return 0;
}

static void rewrite(const char *src_path, const char *dst_path, const rewrite_opts *o)
{
    gguf_file *src;
    td_err err;
    if (gguf_open(&src, src_path, &err)) fail_msg("%s", err.msg);
    gguf_writer *w = gguf_writer_new();
    if (o->drop_key) {
        /* Copy the keys one by one (a key's full name as the prefix), all but one. */
        for (int64_t i = 0; i < gguf_n_kv(src); i++) {
            gguf_str k = gguf_key_name(src, i);
            char key[256];
            snprintf(key, sizeof(key), "%.*s", (int)k.len, k.ptr);
            if (strcmp(key, o->drop_key))
                assert_int_equal(gguf_writer_copy_kv(w, src, key, &err), 0);
        }
    } else {
        assert_int_equal(gguf_writer_copy_kv(w, src, "", &err), 0);
    }
    if (o->edit) o->edit(w);
    for (int64_t i = 0; i < gguf_n_tensors(src); i++) {
        const gguf_tensor *t = gguf_tensor_at(src, i);
        if (o->drop && !strcmp(t->name, o->drop)) continue;
        int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        int n_dims = t->n_dims;
        if (o->transpose && !strcmp(t->name, o->transpose)) {
            ne[0] = t->ne[1];
            ne[1] = t->ne[0];
            n_dims = 2;
        }
        if (o->reshape && !strcmp(t->name, o->reshape)) {
            for (n_dims = 0; n_dims < 4 && o->ne[n_dims]; n_dims++)
                ne[n_dims] = o->ne[n_dims];
            for (int d = n_dims; d < 4; d++)
                ne[d] = 1;
        }
        td_type type = o->to_f16 && !strcmp(t->name, o->to_f16) ? TD_TYPE_F16 : t->type;
        const char *name =
            o->rename_from && !strcmp(t->name, o->rename_from) ? o->rename_to : t->name;
        assert_int_equal(
            gguf_writer_add_tensor(w, name, type, n_dims, ne, copy_fill, (void *)t, &err), 0);
    }
    if (gguf_writer_write(w, dst_path, &err)) fail_msg("%s", err.msg);
    gguf_writer_free(w);
    gguf_close(src);
}

static void edit_arch_gpt2(gguf_writer *w)
{
    gguf_writer_set_str(w, "general.architecture", "gpt2");
}
static void edit_arch_qwen2(gguf_writer *w)
{
    /* qwen2 keys come from the llama ones; the biases are still missing */
    gguf_writer_set_str(w, "general.architecture", "qwen2");
    gguf_writer_set_u32(w, "qwen2.embedding_length", 64);
    gguf_writer_set_u32(w, "qwen2.block_count", 5);
    gguf_writer_set_u32(w, "qwen2.attention.head_count", 8);
    gguf_writer_set_u32(w, "qwen2.attention.head_count_kv", 4);
    gguf_writer_set_u32(w, "qwen2.feed_forward_length", 172);
    gguf_writer_set_u32(w, "qwen2.context_length", 128);
}
static void edit_no_embd(gguf_writer *w)
{
    gguf_writer_set_str(w, "llama.embedding_length", "64");
}
static void edit_kv_heads(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.attention.head_count_kv", 3);
}
static void edit_rope_linear(gguf_writer *w)
{
    gguf_writer_set_str(w, "llama.rope.scaling.type", "linear");
    gguf_writer_set_f32(w, "llama.rope.scaling.factor", 4.0f);
    gguf_writer_set_f32(w, "llama.rope.freq_base", 500000.0f);
}
static void edit_rope_yarn(gguf_writer *w)
{
    gguf_writer_set_str(w, "llama.rope.scaling.type", "yarn");
}
static void edit_partial_rope(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.rope.dimension_count", 4);
}
static void edit_fewer_layers(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.block_count", 4); /* the file has 5 layers' tensors */
}
static void edit_huge_layers(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.block_count", 100000);
}

static void test_bad_models(void **state)
{
    (void)state;
    char src[1024], dst[512];
    snprintf(src, sizeof(src), "%s/models/stories260K.gguf", td_test_shared_dir());
    tmp_path(dst, sizeof(dst), "bad.gguf");
    td_model *m = NULL;
    td_err err;
    static const struct {
        rewrite_opts o;
        int code;
        const char *msg;
    } cases[] = {
        {{.edit = edit_arch_gpt2},
         TD_EUNSUPPORTED,
         "model: unsupported architecture 'gpt2' (supported: llama, qwen2, qwen2moe)"},
        {{.drop = "blk.3.ffn_up.weight"},
         TD_EFORMAT,
         "model: missing tensor 'blk.3.ffn_up.weight'"},
        {{.drop = "token_embd.weight"}, TD_EFORMAT, "missing tensor 'token_embd.weight'"},
        {{.drop = "blk.0.attn_norm.weight"}, TD_EFORMAT, "missing tensor 'blk.0.attn_norm.weight'"},
        {{.transpose = "blk.2.attn_k.weight"},
         TD_EFORMAT,
         "tensor 'blk.2.attn_k.weight' has shape [32, 64, 1, 1], expected [64, 32]"},
        {{.transpose = "blk.0.ffn_down.weight"}, TD_EFORMAT, "'blk.0.ffn_down.weight' has shape"},
        {{.to_f16 = "blk.1.ffn_norm.weight"},
         TD_EUNSUPPORTED,
         "tensor 'blk.1.ffn_norm.weight' has type f16, which is not supported for norms (must be "
         "f32)"},
        {{.edit = edit_arch_qwen2}, TD_EFORMAT, "missing tensor 'blk.0.attn_q.bias'"},
        {{.edit = edit_no_embd}, TD_EFORMAT, "'llama.embedding_length' has type string"},
        {{.edit = edit_kv_heads}, TD_EINVAL, "n_head_kv 3 does not divide n_head 8"},
        {{.edit = edit_rope_yarn}, TD_EUNSUPPORTED, "rope scaling 'yarn' is not supported"},
        {{.edit = edit_partial_rope}, TD_EUNSUPPORTED, "partial RoPE"},
        {{.edit = edit_huge_layers}, TD_EFORMAT, "'llama.block_count' = 100000 is out of range"},
        {{.edit = edit_fewer_layers},
         TD_EFORMAT,
         "is not part of the model the metadata describes (llama, 4 layers)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        rewrite(src, dst, &cases[i].o);
        td_err_clear(&err);
        int rc = td_model_load(&m, dst, &err);
        if (rc != cases[i].code || !strstr(err.msg, cases[i].msg))
            fail_msg("case %zu: expected %d '%s', got %d '%s'", i, cases[i].code, cases[i].msg, rc,
                     err.msg);
        assert_null(m);
    }

    /* linear rope scaling is read, and output.weight absent means tied */
    rewrite_opts o = {.edit = edit_rope_linear, .drop = "output.weight"};
    rewrite(src, dst, &o);
    if (td_model_load(&m, dst, &err)) fail_msg("%s", err.msg);
    assert_true(m->shape.rope_freq_scale == 0.25f);
    assert_true(m->shape.rope_theta == 500000.0f);
    assert_true(m->shape.tied_output);
    assert_ptr_equal(m->output.data, m->tok_embd.data);
    assert_int_equal(m->output.rows, 512);
    td_model_free(m);
    unlink(dst);

    /* not a model at all */
    assert_err(td_model_load(&m, "/nonexistent/model.gguf", &err), err, TD_EIO, "cannot open");
    char path[1024];
    snprintf(path, sizeof(path), "%s/tokenizer/ggml-vocab-gpt-2.gguf", td_test_shared_dir());
    assert_err(td_model_load(&m, path, &err), err, TD_EUNSUPPORTED, "architecture 'gpt2'");
    snprintf(path, sizeof(path), "%s/tokenizer/ggml-vocab-llama-spm.gguf", td_test_shared_dir());
    assert_err(td_model_load(&m, path, &err), err, TD_EFORMAT,
               "missing tensor 'token_embd.weight'");
}

/* ---- presets, shapes, dummy weights ---------------------------------------- */

static void test_presets(void **state)
{
    (void)state;
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("llama-134m", &s, &err), 0);
    assert_int_equal(s.n_embd, 768);
    assert_int_equal(s.n_layer, 12);
    assert_int_equal(s.n_head, 12);
    assert_int_equal(s.n_head_kv, 12);
    assert_int_equal(s.n_ff, 2048);
    assert_int_equal(s.n_ctx_train, 2048);
    assert_int_equal(s.n_vocab, 32000);
    assert_false(s.tied_output);
    assert_int_equal(td_model_n_params(&s), 134105856);
    assert_int_equal(td_model_shape_validate(&s, &err), 0);

    assert_int_equal(td_model_preset("llama3-8b", &s, &err), 0);
    assert_int_equal(s.n_vocab, 128256);
    assert_int_equal(s.n_head_kv, 8);
    assert_true(s.rope_theta == 500000.0f);
    assert_int_equal(td_model_n_params(&s), 8030261248ll); /* Meta's Llama-3-8B count */
    assert_int_equal(td_model_preset("llama-1b", &s, &err), 0);
    assert_int_equal(td_model_n_params(&s), 1100048384ll); /* TinyLlama-1.1B */
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    assert_int_equal(s.n_embd, 128);
    assert_int_equal(s.n_head_kv, 2);
    assert_err(td_model_preset("gpt-5", &s, &err), err, TD_EINVAL, "unknown preset 'gpt-5'");

    td_model_shape b = s;
    b.n_head = 3;
    b.head_dim = 0;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL,
               "n_head 3 does not divide n_embd 128");
    b = s;
    b.n_head_kv = 3;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "n_head_kv 3 does not divide");
    b = s;
    b.n_layer = 0;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "n_layer = 0 is out of range");
    b = s;
    b.head_dim = 7;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "head_dim 7 must be even");
    b = s;
    b.rope_theta = NAN;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "rope_theta");
}

/* Deferred dummy weights (made on the GPU): no host matrices, the same fingerprint, size
 * and rows as the materialised model with the same seed, in f32 and in bf16. */
static void test_dummy_deferred(void **state)
{
    (void)state;
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    const td_type types[] = {TD_TYPE_F32, TD_TYPE_BF16};
    for (int t = 0; t < 2; t++) {
        td_model *a, *d;
        if (td_model_load_dummy(&a, &s, types[t], 5, &err)) fail_msg("%s", err.msg);
        if (td_model_load_dummy_deferred(&d, &s, types[t], 5, &err)) fail_msg("%s", err.msg);
        assert_null(d->layers[2].w_up.data);
        assert_true(d->layers[2].w_up.gen.on);
        assert_null(d->tok_embd.data);
        assert_non_null(d->layers[2].ffn_norm.data);
        assert_true(a->fingerprint == d->fingerprint);
        assert_int_equal(a->weight_bytes, d->weight_bytes);
        assert_int_equal(a->weight_type, d->weight_type);
        const td_weight *ws[][2] = {{&a->layers[2].w_up, &d->layers[2].w_up},
                                    {&a->tok_embd, &d->tok_embd},
                                    {&a->layers[0].wk, &d->layers[0].wk}};
        float *f = malloc((size_t)s.n_ff * 4 + (size_t)s.n_vocab * 4);
        uint8_t *row = malloc((size_t)s.n_ff * 4 + (size_t)s.n_vocab * 4);
        for (size_t i = 0; i < sizeof(ws) / sizeof(ws[0]); i++)
            for (int64_t r = 0; r < ws[i][0]->rows; r += 7) {
                td_model_gen_row(ws[i][1], r, f);
                td_quant_row_ref(ws[i][1]->type, f, row, ws[i][1]->cols);
                assert_memory_equal(row, (const uint8_t *)ws[i][0]->data + (size_t)r * ws[i][0]->row_bytes,
                                    ws[i][0]->row_bytes);
            }
        free(f);
        free(row);
        td_model_free(a);
        td_model_free(d);
    }
    td_model *q;
    assert_err(td_model_load_dummy_deferred(&q, &s, TD_TYPE_Q8_0, 5, &err), err, TD_EUNSUPPORTED,
               "f32 or bf16");
}

static void test_dummy(void **state)
{
    (void)state;
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    td_model *a, *b, *c;
    if (td_model_load_dummy(&a, &s, TD_TYPE_F32, 7, &err)) fail_msg("%s", err.msg);
    if (td_model_load_dummy(&b, &s, TD_TYPE_F32, 7, &err)) fail_msg("%s", err.msg);
    if (td_model_load_dummy(&c, &s, TD_TYPE_F32, 8, &err)) fail_msg("%s", err.msg);
    assert_true(a->fingerprint == b->fingerprint);
    assert_true(a->fingerprint != c->fingerprint);
    assert_memory_equal(a->layers[3].w_down.data, b->layers[3].w_down.data,
                        a->layers[3].w_down.row_bytes * 128);
    assert_null(a->gguf);
    assert_non_null(a->owned);
    assert_int_equal(a->weight_type, TD_TYPE_F32);
    assert_int_equal(a->weight_bytes, (size_t)td_model_n_params(&s) * 4);

    /* distributions: norms 1, embeddings in [-1, 1), matrices std 1/sqrt(cols) */
    const float *norm = a->layers[0].attn_norm.data;
    for (int i = 0; i < 128; i++)
        assert_true(norm[i] == 1.0f);
    const float *e = a->tok_embd.data;
    double sum2 = 0;
    for (int i = 0; i < 512 * 128; i++) {
        assert_true(e[i] >= -1.0f && e[i] < 1.0f);
        sum2 += (double)e[i] * e[i];
    }
    assert_true(fabs(sqrt(sum2 / (512 * 128)) - 1 / sqrt(3.0)) < 0.01);
    const float *wq = a->layers[1].wq.data;
    sum2 = 0;
    for (int i = 0; i < 128 * 128; i++)
        sum2 += (double)wq[i] * wq[i];
    assert_true(fabs(sqrt(sum2 / (128 * 128)) * sqrt(128.0) - 1.0) < 0.03);
    td_model_free(a);
    td_model_free(b);
    td_model_free(c);

    /* every weight type; q8_0 dequantizes close to the f32 weights */
    td_type types[] = {TD_TYPE_F16, TD_TYPE_BF16, TD_TYPE_Q8_0, TD_TYPE_Q4_0};
    if (td_model_load_dummy(&a, &s, TD_TYPE_F32, 1, &err)) fail_msg("%s", err.msg);
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        if (td_model_load_dummy(&b, &s, types[i], 1, &err)) fail_msg("%s", err.msg);
        assert_int_equal(b->weight_type, types[i]);
        assert_int_equal(b->layers[0].wq.type, types[i]);
        assert_int_equal(b->layers[0].attn_norm.type, TD_TYPE_F32);
        float row[128];
        td_dequant_row_ref(types[i], b->layers[2].w_up.data, row, 128);
        const float *ref = a->layers[2].w_up.data;
        float tol = types[i] == TD_TYPE_Q4_0 ? 0.03f : 0.003f;
        for (int k = 0; k < 128; k++)
            assert_true(fabsf(row[k] - ref[k]) < tol);
        td_model_free(b);
    }
    td_model_free(a);

    td_model_shape q = s;
    q.arch = TD_ARCH_QWEN2;
    q.rope_type = TD_ROPE_NEOX;
    q.tied_output = true;
    if (td_model_load_dummy(&a, &q, TD_TYPE_F16, 1, &err)) fail_msg("%s", err.msg);
    assert_non_null(a->layers[0].bq.data);
    assert_int_equal(a->layers[0].bk.cols, 64);
    assert_ptr_equal(a->output.data, a->tok_embd.data);
    char desc[512];
    td_model_describe(a, desc, sizeof(desc));
    assert_non_null(strstr(desc, "qwen2"));
    assert_non_null(strstr(desc, "tied output"));
    td_model_free(a);

    td_model_shape bad = s;
    bad.n_ff = 100; /* not a multiple of 32 */
    assert_err(td_model_load_dummy(&a, &bad, TD_TYPE_Q8_0, 1, &err), err, TD_EINVAL,
               "multiple of 32");
    assert_err(td_model_load_dummy(&a, &s, TD_TYPE_FP8_E4M3, 1, &err), err, TD_EUNSUPPORTED,
               "fp8_e4m3");
}

/* ---- mixture of experts ------------------------------------------------------ */

/* A preset written by mkmodel into a temporary file (path out). */
static void write_preset(const char *preset, td_type t, const char *name, char *path, size_t cap)
{
    tmp_path(path, cap, name);
    td_model_shape s;
    td_err err;
    assert_int_equal(td_model_preset(preset, &s, &err), 0);
    if (td_mkmodel_write(path, &s, t, NULL, 3, &err)) fail_msg("%s", err.msg);
}

/* Every tensor of the file is bound: the weight bytes are the file's tensor bytes. */
static size_t file_tensor_bytes(const td_model *m)
{
    size_t sum = 0;
    for (int64_t i = 0; i < gguf_n_tensors(m->gguf); i++)
        sum += gguf_tensor_at(m->gguf, i)->nbytes;
    return sum;
}

static void test_moe_load(void **state)
{
    (void)state;
    char path[512];
    td_err err;
    td_model *m;

    /* llama with experts (Mixtral style) */
    write_preset("moe-tiny", TD_TYPE_F32, "moe.gguf", path, sizeof(path));
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    const td_model_shape *s = &m->shape;
    assert_int_equal(s->arch, TD_ARCH_LLAMA);
    assert_int_equal(s->n_expert, 8);
    assert_int_equal(s->n_expert_used, 2);
    assert_int_equal(s->n_ff_exp, 256);
    assert_int_equal(s->n_ff_shexp, 0);
    assert_true(td_moe_norm_topk(s));
    const td_layer *L = &m->layers[1];
    assert_null(L->w_gate.data);
    assert_null(L->shexp_gate.data);
    assert_int_equal(L->router.cols, 128);
    assert_int_equal(L->router.rows, 8);
    assert_int_equal(L->w_gate_exps.cols, 128);
    assert_int_equal(L->w_gate_exps.rows, 8 * 256);
    assert_int_equal(L->w_down_exps.cols, 256);
    assert_int_equal(L->w_down_exps.rows, 8 * 128);
    /* the 3-D tensor is viewed in place: expert e is the contiguous rows [256e, 256e + 256) */
    const gguf_tensor *t = gguf_find_tensor(m->gguf, "blk.1.ffn_up_exps.weight");
    assert_non_null(t);
    assert_int_equal(t->n_dims, 3);
    assert_int_equal(t->ne[2], 8);
    assert_ptr_equal(L->w_up_exps.data, t->data);
    assert_int_equal(L->w_up_exps.row_bytes * (size_t)L->w_up_exps.rows, t->nbytes);
    assert_int_equal(m->weight_bytes, file_tensor_bytes(m));
    assert_int_equal(td_model_n_params(s), (int64_t)(file_tensor_bytes(m) / 4));
    char desc[512];
    td_model_describe(m, desc, sizeof(desc));
    assert_non_null(strstr(desc, "(llama)"));
    assert_non_null(strstr(desc, "8 experts (top-2, ffn 256;"));
    td_model_free(m);
    unlink(path);

    /* qwen2moe: qwen2 attention (biases, NeoX), experts and a gated shared expert */
    write_preset("qwen2moe-tiny", TD_TYPE_F32, "q2moe.gguf", path, sizeof(path));
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    s = &m->shape;
    assert_int_equal(s->arch, TD_ARCH_QWEN2MOE);
    assert_int_equal(s->rope_type, TD_ROPE_NEOX);
    assert_int_equal(s->n_expert, 8);
    assert_int_equal(s->n_expert_used, 4);
    assert_int_equal(s->n_ff_exp, 128);
    assert_int_equal(s->n_ff_shexp, 256);
    assert_false(td_moe_norm_topk(s));
    L = &m->layers[0];
    assert_non_null(L->bq.data);
    assert_int_equal(L->w_gate_exps.rows, 8 * 128);
    assert_int_equal(L->shexp_gate.type, TD_TYPE_F32);
    assert_int_equal(L->shexp_gate.cols, 128);
    assert_int_equal(L->shexp_gate.rows, 1);
    assert_int_equal(L->w_up_shexp.rows, 256);
    assert_int_equal(L->w_down_shexp.cols, 256);
    assert_int_equal(m->weight_bytes, file_tensor_bytes(m));
    assert_int_equal(td_model_n_params(s), (int64_t)(file_tensor_bytes(m) / 4));
    td_model_describe(m, desc, sizeof(desc));
    assert_non_null(strstr(desc, "(qwen2moe)"));
    assert_non_null(strstr(desc, "shared 256"));
    td_model_free(m);
    unlink(path);

    /* q8_0 experts are packed for the CPU kernels, an expert per whole panels */
    write_preset("moe-tiny", TD_TYPE_Q8_0, "moe8.gguf", path, sizeof(path));
    if (td_model_load(&m, path, &err)) fail_msg("%s", err.msg);
    assert_non_null(m->layers[0].w_gate_exps.packed);
    assert_non_null(m->layers[0].w_down_exps.packed);
    assert_int_equal(m->layers[0].router.type, TD_TYPE_F32); /* the router stays f32 */
    td_model_free(m);
    unlink(path);
}

static void test_moe_presets(void **state)
{
    (void)state;
    td_model_shape s;
    td_err err;
    /* the published totals: Mixtral-8x7B 46.7B (12.9B active), Qwen1.5-MoE-A2.7B 14.3B (2.7B) */
    assert_int_equal(td_model_preset("mixtral-8x7b", &s, &err), 0);
    assert_int_equal(td_model_n_params(&s), 46702792704ll);
    assert_int_equal(td_model_n_active_params(&s), 12879925248ll);
    assert_int_equal(td_model_preset("qwen2moe-a2.7b", &s, &err), 0);
    assert_int_equal(td_model_n_params(&s), 14315784192ll);
    assert_int_equal(td_model_n_active_params(&s), 2689173504ll);
    assert_int_equal(td_model_preset("moe-1b", &s, &err), 0);
    assert_int_equal(td_model_n_params(&s), 1214940160ll);
    assert_int_equal(td_model_n_active_params(&s), 384467968ll);
    assert_int_equal(td_model_shape_validate(&s, &err), 0);
    assert_int_equal(td_model_preset("tiny", &s, &err), 0);
    assert_int_equal(td_model_n_active_params(&s), td_model_n_params(&s));

    /* shape validation of the experts */
    td_model_shape m0;
    assert_int_equal(td_model_preset("moe-tiny", &m0, &err), 0);
    td_model_shape b = m0;
    b.n_expert_used = 9;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL,
               "n_expert_used = 9 must be in 1..n_expert (8 experts)");
    b = m0;
    b.n_expert = 513;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "n_expert = 513 is out of range");
    b = m0;
    b.n_ff_exp = 128;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL,
               "llama experts are n_ff wide: n_ff_exp 128 differs from n_ff 256");
    b = m0;
    b.n_ff_shexp = 64;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "llama has no shared expert");
    b = m0;
    b.arch = TD_ARCH_QWEN2;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "qwen2 has no experts");
    assert_int_equal(td_model_preset("qwen2moe-tiny", &b, &err), 0);
    b.n_ff_shexp = 0;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "qwen2moe needs a shared expert");
    assert_int_equal(td_model_preset("qwen2moe-tiny", &b, &err), 0);
    b.n_expert = b.n_expert_used = b.n_ff_exp = b.n_ff_shexp = 0;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL, "qwen2moe needs experts");
    assert_int_equal(td_model_preset("tiny", &b, &err), 0);
    b.n_expert_used = 2;
    assert_err(td_model_shape_validate(&b, &err), err, TD_EINVAL,
               "a dense model has no n_expert_used");
    /* q8_0 rows of the experts */
    assert_int_equal(td_model_preset("qwen2moe-tiny", &b, &err), 0);
    b.n_ff_exp = 100;
    td_model *m;
    assert_err(td_model_load_dummy(&m, &b, TD_TYPE_Q8_0, 1, &err), err, TD_EINVAL,
               "experts' widths (n_ff_exp 100, n_ff_shexp 256) to be multiples of 32");
}

static void edit_used_9(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.expert_used_count", 9);
}
static void edit_experts_0(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.expert_count", 0);
}
static void edit_experts_4(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.expert_count", 4);
}
static void edit_experts_huge(gguf_writer *w)
{
    gguf_writer_set_u32(w, "llama.expert_count", 1000);
}
static void edit_used_str(gguf_writer *w)
{
    gguf_writer_set_str(w, "llama.expert_used_count", "2");
}
static void edit_moe_as_qwen2(gguf_writer *w)
{
    gguf_writer_set_str(w, "general.architecture", "qwen2");
    gguf_writer_set_u32(w, "qwen2.embedding_length", 128);
    gguf_writer_set_u32(w, "qwen2.block_count", 2);
    gguf_writer_set_u32(w, "qwen2.attention.head_count", 4);
    gguf_writer_set_u32(w, "qwen2.feed_forward_length", 256);
    gguf_writer_set_u32(w, "qwen2.context_length", 512);
    gguf_writer_set_u32(w, "qwen2.expert_count", 8);
}
static void edit_shared_512(gguf_writer *w)
{
    gguf_writer_set_u32(w, "qwen2moe.expert_shared_feed_forward_length", 512);
}

static void test_bad_moe_models(void **state)
{
    (void)state;
    char llama[512], qwen[512], dst[512];
    write_preset("moe-tiny", TD_TYPE_F32, "src_moe.gguf", llama, sizeof(llama));
    write_preset("qwen2moe-tiny", TD_TYPE_F32, "src_q2moe.gguf", qwen, sizeof(qwen));
    tmp_path(dst, sizeof(dst), "bad_moe.gguf");
    td_model *m = NULL;
    td_err err;
    static const struct {
        bool qwen;
        rewrite_opts o;
        int code;
        const char *msg;
    } cases[] = {
        {false,
         {.edit = edit_used_9},
         TD_EFORMAT,
         "model: key 'llama.expert_used_count' = 9 exceeds 'llama.expert_count' = 8"},
        {false,
         {.drop_key = "llama.expert_used_count"},
         TD_EFORMAT,
         "model: missing key 'llama.expert_used_count'"},
        {false, {.edit = edit_used_str}, TD_EFORMAT, "'llama.expert_used_count' has type string"},
        {false,
         {.edit = edit_experts_0},
         TD_EFORMAT,
         "model: the file has expert tensors (blk.0.ffn_gate_exps.weight) but no "
         "'llama.expert_count'"},
        {false,
         {.drop_key = "llama.expert_count"},
         TD_EFORMAT,
         "expert tensors (blk.0.ffn_gate_exps.weight) but no 'llama.expert_count'"},
        {false,
         {.edit = edit_experts_huge},
         TD_EFORMAT,
         "model: key 'llama.expert_count' = 1000 is out of range (0..512)"},
        /* the count disagrees with the tensors: the router is the first to say so */
        {false,
         {.edit = edit_experts_4},
         TD_EFORMAT,
         "model: tensor 'blk.0.ffn_gate_inp.weight' has shape [128, 8, 1, 1], expected [128, 4]"},
        {false,
         {.drop = "blk.1.ffn_down_exps.weight"},
         TD_EFORMAT,
         "model: missing tensor 'blk.1.ffn_down_exps.weight'"},
        {false,
         {.drop = "blk.0.ffn_gate_inp.weight"},
         TD_EFORMAT,
         "model: missing tensor 'blk.0.ffn_gate_inp.weight'"},
        /* 2-D where the experts' 3-D tensor belongs */
        {false,
         {.reshape = "blk.1.ffn_up_exps.weight", .ne = {128, 2048}},
         TD_EFORMAT,
         "model: tensor 'blk.1.ffn_up_exps.weight' has shape [128, 2048, 1, 1], expected [128, "
         "256, 8] (one [128, 256] matrix per expert)"},
        /* the experts' matrices transposed (ggml order is ne0 = n_embd, ne1 = ff) */
        {false,
         {.reshape = "blk.0.ffn_gate_exps.weight", .ne = {256, 128, 8}},
         TD_EFORMAT,
         "'blk.0.ffn_gate_exps.weight' has shape [256, 128, 8, 1], expected [128, 256, 8]"},
        /* 3-D where a 2-D matrix belongs */
        {false,
         {.reshape = "blk.0.ffn_gate_inp.weight", .ne = {128, 4, 2}},
         TD_EFORMAT,
         "model: tensor 'blk.0.ffn_gate_inp.weight' has shape [128, 4, 2, 1], expected [128, 8]"},
        {false,
         {.reshape = "blk.1.attn_q.weight", .ne = {128, 64, 2}},
         TD_EFORMAT,
         "'blk.1.attn_q.weight' has shape [128, 64, 2, 1], expected [128, 128]"},
        /* the old layout: one 2-D tensor per expert */
        {false,
         {.rename_from = "blk.0.ffn_gate_exps.weight", .rename_to = "blk.0.ffn_gate.0.weight"},
         TD_EUNSUPPORTED,
         "per-expert tensors (blk.0.ffn_gate.0.weight, the old Mixtral layout) are not supported"},
        {false,
         {.edit = edit_moe_as_qwen2},
         TD_EUNSUPPORTED,
         "model: 'qwen2.expert_count' = 8: qwen2 has no experts (its MoE architecture is "
         "qwen2moe)"},
        {true,
         {.drop_key = "qwen2moe.expert_count"},
         TD_EFORMAT,
         "model: missing key 'qwen2moe.expert_count'"},
        {true,
         {.drop = "blk.1.ffn_gate_inp_shexp.weight"},
         TD_EFORMAT,
         "model: missing tensor 'blk.1.ffn_gate_inp_shexp.weight'"},
        {true,
         {.drop = "blk.0.ffn_up_shexp.weight"},
         TD_EFORMAT,
         "model: missing tensor 'blk.0.ffn_up_shexp.weight'"},
        {true,
         {.to_f16 = "blk.0.ffn_gate_inp_shexp.weight"},
         TD_EUNSUPPORTED,
         "tensor 'blk.0.ffn_gate_inp_shexp.weight' has type f16, which is not supported for "
         "gate vectors (must be f32)"},
        {true,
         {.edit = edit_shared_512},
         TD_EFORMAT,
         "tensor 'blk.0.ffn_gate_shexp.weight' has shape [128, 256, 1, 1], expected [128, 512]"},
        /* without its width the experts default to n_ff / n_expert_used = 64 (llama.cpp's) */
        {true,
         {.drop_key = "qwen2moe.expert_feed_forward_length"},
         TD_EFORMAT,
         "'blk.0.ffn_gate_exps.weight' has shape [128, 128, 8, 1], expected [128, 64, 8]"},
        {true, {.drop = "blk.0.attn_k.bias"}, TD_EFORMAT, "missing tensor 'blk.0.attn_k.bias'"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        rewrite(cases[i].qwen ? qwen : llama, dst, &cases[i].o);
        td_err_clear(&err);
        int rc = td_model_load(&m, dst, &err);
        if (rc != cases[i].code || !strstr(err.msg, cases[i].msg))
            fail_msg("case %zu: expected %d '%s', got %d '%s'", i, cases[i].code, cases[i].msg, rc,
                     err.msg);
        assert_null(m);
    }
    /* an unchanged rewrite loads: the cases above fail for their change alone */
    rewrite_opts same = {0};
    rewrite(qwen, dst, &same);
    if (td_model_load(&m, dst, &err)) fail_msg("%s", err.msg);
    td_model_free(m);
    unlink(dst);
    unlink(llama);
    unlink(qwen);
}

/*
 * Expert parallelism: a part of a MoE model makes ready only its experts. Its fingerprint is
 * the whole model's; every tensor but the experts', and its own experts' rows (original
 * and packed), are byte for byte the whole model's; the other experts' rows are never
 * made (zero) but for the rows under the fingerprint's windows; and the other experts'
 * part of the packed copy is never written. For dummy weights and for a file.
 */
static void expect_part(const td_model *whole, const td_model *part, int lo, int hi)
{
    assert_int_equal(part->fingerprint, whole->fingerprint);
    assert_int_equal(part->expert_lo, lo);
    assert_int_equal(part->expert_hi, hi);
    const td_model_shape *s = &whole->shape;
    for (int l = 0; l < s->n_layer; l++) {
        const td_layer *W = &whole->layers[l], *P = &part->layers[l];
        assert_memory_equal(P->router.data, W->router.data, P->router.row_bytes * (size_t)P->router.rows);
        assert_memory_equal(P->wq.data, W->wq.data, P->wq.row_bytes * (size_t)P->wq.rows);
        const td_weight *ws[] = {&W->w_gate_exps, &W->w_up_exps, &W->w_down_exps};
        const td_weight *ps[] = {&P->w_gate_exps, &P->w_up_exps, &P->w_down_exps};
        for (int i = 0; i < 3; i++) {
            const uint8_t *wd = ws[i]->data, *pd = ps[i]->data, *wp = ws[i]->packed, *pp = ps[i]->packed;
            size_t per = (size_t)(ws[i]->rows / s->n_expert) * ws[i]->row_bytes;
            size_t a = (size_t)lo * per, b = (size_t)hi * per, all = (size_t)s->n_expert * per;
            assert_memory_equal(pd + a, wd + a, b - a);
            if (wp) {
                assert_non_null(pp);
                assert_memory_equal(pp + a, wp + a, b - a);
                size_t nz = 0; /* the packed copy of the others' experts: never written */
                for (size_t k = 0; k < all; k++)
                    if ((k < a || k >= b) && pp[k]) nz++;
                assert_int_equal(nz, 0);
            }
            if (part->owned) { /* dummy: the others' rows not made, but a few sampled ones */
                size_t made = 0;
                for (size_t r = 0; r < all / ws[i]->row_bytes; r++) {
                    size_t off = r * ws[i]->row_bytes;
                    if (off >= a && off < b) continue;
                    bool zero = true;
                    for (size_t k = 0; k < ws[i]->row_bytes && zero; k++) zero = !pd[off + k];
                    if (!zero) {
                        made++;
                        assert_memory_equal(pd + off, wd + off, ws[i]->row_bytes);
                    }
                }
                assert_true(made <= 16);
            }
        }
    }
}

static void test_moe_part(void **state)
{
    (void)state;
    td_err err;
    td_model_shape s;
    assert_int_equal(td_model_preset("moe-tiny", &s, &err), 0);
    static const td_type types[] = {TD_TYPE_F32, TD_TYPE_Q8_0};
    for (size_t t = 0; t < TD_ARRAY_LEN(types); t++) {
        td_model *whole, *part;
        if (td_model_load_dummy(&whole, &s, types[t], 5, &err)) fail_msg("%s", err.msg);
        for (int p = 0; p < 3; p++) { /* 8 experts in 3 parts: [0, 2), [2, 5), [5, 8) */
            if (td_model_load_dummy_part(&part, &s, types[t], 5, p, 3, &err)) fail_msg("%s", err.msg);
            expect_part(whole, part, p * 8 / 3, (p + 1) * 8 / 3);
            td_model_free(part);
        }
        td_model_free(whole);
    }
    char path[512];
    write_preset("moe-tiny", TD_TYPE_Q8_0, "part.gguf", path, sizeof(path));
    td_model *whole, *part;
    if (td_model_load(&whole, path, &err)) fail_msg("%s", err.msg);
    if (td_model_load_part(&part, path, 1, 2, &err)) fail_msg("%s", err.msg);
    expect_part(whole, part, 4, 8);
    td_model_free(part);
    td_model_free(whole);
    assert_int_equal(td_model_load_part(&part, path, 2, 2, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "expert part 2 of 2"));
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stories260k),    cmocka_unit_test(test_tiny_random),
        cmocka_unit_test(test_bad_models),     cmocka_unit_test(test_presets),
        cmocka_unit_test(test_dummy),          cmocka_unit_test(test_dummy_deferred),
        cmocka_unit_test(test_moe_load),       cmocka_unit_test(test_moe_presets),
        cmocka_unit_test(test_bad_moe_models),  cmocka_unit_test(test_moe_part),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
