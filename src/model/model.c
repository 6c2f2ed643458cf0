/*
 * model/model.c - load a llama/qwen2/qwen2moe model from GGUF, or build one with
 * random weights (`--load-format dummy`), and describe it.
 *
 * Loading never copies weights: each td_weight points into the GGUF mapping.
 * Every tensor is checked against the hyper-parameters (shape) and against what
 * the compute code can handle (type), so the engine can trust the model blindly.
 */
#include "model/model.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend/cpu/cpu.h"
#include "model/gguf_impl.h"
#include "model/model_impl.h"

/* Sanity bounds on hyper-parameters: far above real models, low enough that sizes
 * computed from them cannot overflow 64-bit arithmetic. */
#define MAX_VOCAB (1 << 24)
#define MAX_EMBD (1 << 16)
#define MAX_LAYER 1024
#define MAX_HEAD 1024
#define MAX_HEAD_DIM 1024
#define MAX_FF (1 << 20)
#define MAX_CTX (1 << 24)
#define MAX_EXPERT TD_MODEL_MAX_EXPERTS

/* ---- shapes ---------------------------------------------------------------- */

const char *td_arch_name(td_arch a)
{
    switch (a) {
    case TD_ARCH_LLAMA:
        return "llama";
    case TD_ARCH_QWEN2:
        return "qwen2";
    case TD_ARCH_QWEN2MOE:
        return "qwen2moe";
    }
    return "?";
}

/* q/k/v biases: the qwen2 attention, in qwen2 and qwen2moe. */
static bool has_qkv_bias(const td_model_shape *s)
{
    return s->arch == TD_ARCH_QWEN2 || s->arch == TD_ARCH_QWEN2MOE;
}

/* The experts' fields: consistent with each other and with the architecture. */
static int validate_experts(const td_model_shape *s, td_err *err)
{
    const char *arch = td_arch_name(s->arch);
    if (s->n_expert < 0 || s->n_expert > MAX_EXPERT)
        return td_err_set(err, TD_EINVAL, "model: n_expert = %d is out of range (0..%d)",
                          s->n_expert, MAX_EXPERT);
    if (s->n_expert == 0) {
        if (s->arch == TD_ARCH_QWEN2MOE)
            return td_err_set(err, TD_EINVAL, "model: qwen2moe needs experts (n_expert >= 1)");
        if (s->n_expert_used || s->n_ff_exp || s->n_ff_shexp)
            return td_err_set(err, TD_EINVAL,
                              "model: a dense model has no n_expert_used, n_ff_exp or n_ff_shexp");
        return 0;
    }
    if (s->arch == TD_ARCH_QWEN2)
        return td_err_set(err, TD_EINVAL,
                          "model: qwen2 has no experts (its MoE architecture is qwen2moe)");
    if (s->n_expert_used < 1 || s->n_expert_used > s->n_expert)
        return td_err_set(err, TD_EINVAL,
                          "model: n_expert_used = %d must be in 1..n_expert (%d experts)",
                          s->n_expert_used, s->n_expert);
    if (s->n_ff_exp < 1 || s->n_ff_exp > MAX_FF)
        return td_err_set(err, TD_EINVAL, "model: n_ff_exp = %d is out of range (1..%d)",
                          s->n_ff_exp, MAX_FF);
    if (s->arch == TD_ARCH_LLAMA && s->n_ff_exp != s->n_ff)
        return td_err_set(err, TD_EINVAL,
                          "model: llama experts are n_ff wide: n_ff_exp %d differs from n_ff %d",
                          s->n_ff_exp, s->n_ff);
    bool shared = s->arch == TD_ARCH_QWEN2MOE;
    if (shared ? s->n_ff_shexp < 1 || s->n_ff_shexp > MAX_FF : s->n_ff_shexp != 0)
        return td_err_set(err, TD_EINVAL, "model: n_ff_shexp = %d: %s %s", s->n_ff_shexp, arch,
                          shared ? "needs a shared expert (1..1048576)" : "has no shared expert");
    return 0;
}

static int effective_head_dim(const td_model_shape *s)
{
    return s->head_dim > 0 ? s->head_dim : (s->n_head > 0 ? s->n_embd / s->n_head : 0);
}

int td_model_shape_validate(const td_model_shape *s, td_err *err)
{
    struct {
        const char *name;
        int v, max;
    } dims[] = {
        {"n_vocab", s->n_vocab, MAX_VOCAB},       {"n_embd", s->n_embd, MAX_EMBD},
        {"n_layer", s->n_layer, MAX_LAYER},       {"n_head", s->n_head, MAX_HEAD},
        {"n_head_kv", s->n_head_kv, MAX_HEAD},    {"n_ff", s->n_ff, MAX_FF},
        {"n_ctx_train", s->n_ctx_train, MAX_CTX},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(dims); i++)
        if (dims[i].v < 1 || dims[i].v > dims[i].max)
            return td_err_set(err, TD_EINVAL, "model: %s = %d is out of range (1..%d)",
                              dims[i].name, dims[i].v, dims[i].max);
    if (s->arch != TD_ARCH_LLAMA && s->arch != TD_ARCH_QWEN2 && s->arch != TD_ARCH_QWEN2MOE)
        return td_err_set(err, TD_EINVAL, "model: unknown architecture id %d", (int)s->arch);
    if (s->head_dim == 0 && s->n_embd % s->n_head)
        return td_err_set(err, TD_EINVAL, "model: n_head %d does not divide n_embd %d", s->n_head,
                          s->n_embd);
    if (s->n_head % s->n_head_kv)
        return td_err_set(err, TD_EINVAL, "model: n_head_kv %d does not divide n_head %d",
                          s->n_head_kv, s->n_head);
    int hd = effective_head_dim(s);
    if (hd < 2 || hd > MAX_HEAD_DIM || hd % 2)
        return td_err_set(err, TD_EINVAL,
                          "model: head_dim %d must be even and in 2..%d (RoPE rotates pairs)", hd,
                          MAX_HEAD_DIM);
    if (!(s->rms_eps > 0 && s->rms_eps < 1))
        return td_err_set(err, TD_EINVAL, "model: rms_eps %g must be in (0, 1)", s->rms_eps);
    if (!(s->rope_theta > 0 && isfinite(s->rope_theta)))
        return td_err_set(err, TD_EINVAL, "model: rope_theta %g must be positive", s->rope_theta);
    if (!(s->rope_freq_scale > 0 && isfinite(s->rope_freq_scale)))
        return td_err_set(err, TD_EINVAL, "model: rope_freq_scale %g must be positive",
                          s->rope_freq_scale);
    if (s->rope_type != TD_ROPE_NORM && s->rope_type != TD_ROPE_NEOX)
        return td_err_set(err, TD_EINVAL, "model: unknown rope type %d", (int)s->rope_type);
    return validate_experts(s, err);
}

/* Parameters with n_experts of each layer's experts counted (all, or the used ones). */
static int64_t count_params(const td_model_shape *s, int64_t n_experts)
{
    int64_t embd = s->n_embd, hd = effective_head_dim(s);
    int64_t q = s->n_head * hd, kv = s->n_head_kv * hd;
    int64_t layer = 2 * embd                   /* attn_norm, ffn_norm */
                    + embd * q + 2 * embd * kv /* wq, wk, wv */
                    + q * embd;                /* wo */
    if (s->n_expert == 0)
        layer += 3 * embd * s->n_ff; /* gate, up, down */
    else
        layer += embd * s->n_expert                   /* router */
                 + n_experts * 3 * embd * s->n_ff_exp /* experts' gate, up, down */
                 + (s->n_ff_shexp ? embd + 3 * embd * s->n_ff_shexp : 0); /* shared expert */
    if (has_qkv_bias(s)) layer += q + 2 * kv;
    int64_t vocab = (int64_t)s->n_vocab * embd;
    return vocab * (s->tied_output ? 1 : 2) + embd + s->n_layer * layer;
}

int64_t td_model_n_params(const td_model_shape *s)
{
    return count_params(s, s->n_expert);
}

int64_t td_model_n_active_params(const td_model_shape *s)
{
    return count_params(s, s->n_expert_used);
}

int td_model_preset(const char *name, td_model_shape *out, td_err *err)
{
    static const struct {
        const char *name;
        td_arch arch;
        int vocab, embd, layer, head, head_kv, ff, ctx;
        float theta;
        int expert, expert_used, ff_exp, ff_shexp;
    } presets[] = {
        /* A model small enough for unit tests, big enough for 2-way GQA and 4 layers. */
        {"tiny", TD_ARCH_LLAMA, 512, 128, 4, 4, 2, 384, 512, 10000.0f, 0, 0, 0, 0},
        /* llama2.c's 110M-class shape with a 32k vocab: 134,105,856 parameters. */
        {"llama-134m", TD_ARCH_LLAMA, 32000, 768, 12, 12, 12, 2048, 2048, 10000.0f, 0, 0, 0, 0},
        /* TinyLlama 1.1B. */
        {"llama-1b", TD_ARCH_LLAMA, 32000, 2048, 22, 32, 4, 5632, 2048, 10000.0f, 0, 0, 0, 0},
        /* Llama 3 8B. */
        {"llama3-8b", TD_ARCH_LLAMA, 128256, 4096, 32, 32, 8, 14336, 8192, 500000.0f, 0, 0, 0, 0},
        /* Mixtral-style (llama with experts) for unit tests: 8 experts, top-2, 1.8M params. */
        {"moe-tiny", TD_ARCH_LLAMA, 512, 128, 2, 4, 2, 256, 512, 10000.0f, 8, 2, 256, 0},
        /* qwen2moe for unit tests: 8 experts of 128, top-4, a shared expert of 256. */
        {"qwen2moe-tiny", TD_ARCH_QWEN2MOE, 512, 128, 2, 4, 2, 256, 512, 1000000.0f, 8, 4, 128,
         256},
        /* A mid-size Mixtral-style shape for benchmarks on one machine: 1.21B parameters,
         * 0.38B active (8 experts of 2816, top-2). */
        {"moe-1b", TD_ARCH_LLAMA, 32000, 1024, 16, 16, 4, 2816, 4096, 1000000.0f, 8, 2, 2816, 0},
        /* Mixtral 8x7B: 46.7B parameters, 12.9B active. */
        {"mixtral-8x7b", TD_ARCH_LLAMA, 32000, 4096, 32, 32, 8, 14336, 32768, 1000000.0f, 8, 2,
         14336, 0},
        /* Qwen1.5-MoE-A2.7B: 14.3B parameters, 2.7B active (60 experts, top-4, shared). */
        {"qwen2moe-a2.7b", TD_ARCH_QWEN2MOE, 151936, 2048, 24, 16, 16, 5632, 8192, 1000000.0f, 60,
         4, 1408, 5632},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(presets); i++) {
        if (strcmp(presets[i].name, name) != 0) continue;
        bool qwen = presets[i].arch != TD_ARCH_LLAMA;
        *out = (td_model_shape){
            .arch = presets[i].arch,
            .n_vocab = presets[i].vocab,
            .n_embd = presets[i].embd,
            .n_layer = presets[i].layer,
            .n_head = presets[i].head,
            .n_head_kv = presets[i].head_kv,
            .n_ff = presets[i].ff,
            .n_ctx_train = presets[i].ctx,
            .head_dim = presets[i].embd / presets[i].head,
            .rms_eps = 1e-5f,
            .rope_theta = presets[i].theta,
            .rope_freq_scale = 1.0f,
            .rope_type = qwen ? TD_ROPE_NEOX : TD_ROPE_NORM,
            .tied_output = false,
            .n_expert = presets[i].expert,
            .n_expert_used = presets[i].expert_used,
            .n_ff_exp = presets[i].ff_exp,
            .n_ff_shexp = presets[i].ff_shexp,
        };
        return 0;
    }
    return td_err_set(err, TD_EINVAL,
                      "model: unknown preset '%s' (known: tiny, llama-134m, llama-1b, llama3-8b, "
                      "moe-tiny, qwen2moe-tiny, moe-1b, mixtral-8x7b, qwen2moe-a2.7b)",
                      name);
}

/* ---- the tensor plan ------------------------------------------------------- */

td_model__tensor *td_model__plan(const td_model_shape *s, td_type wtype, td_model *m, int *n_out)
{
    int64_t hd = effective_head_dim(s);
    int64_t q = s->n_head * hd, kv = s->n_head_kv * hd, embd = s->n_embd;
    bool bias = has_qkv_bias(s), moe = s->n_expert > 0, shexp = s->n_ff_shexp > 0;
    int per_layer = 6 + (bias ? 3 : 0) + (moe ? 4 + (shexp ? 4 : 0) : 3);
    td_model__tensor *p = td_xcalloc((size_t)(3 + s->n_layer * per_layer), sizeof(*p));
    int n = 0;
#define ADD3(kind_, slot_, cols_, rows_, mats_, ...)                                               \
    do {                                                                                           \
        td_model__tensor *t = &p[n++];                                                             \
        snprintf(t->name, sizeof(t->name), __VA_ARGS__);                                           \
        t->kind = (kind_);                                                                         \
        t->type = (kind_) == TD_MODEL__MATRIX || (kind_) == TD_MODEL__EMBD ? wtype : TD_TYPE_F32;  \
        t->cols = (cols_);                                                                         \
        t->rows = (rows_);                                                                         \
        t->n_mats = (mats_);                                                                       \
        t->n_dims = (mats_) > 1 || moe_tensor ? 3 : (rows_) == 1 ? 1 : 2;                          \
        t->slot = m ? (slot_) : NULL;                                                              \
    } while (0)
    bool moe_tensor = false;
#define ADD(kind_, slot_, cols_, rows_, ...) ADD3(kind_, slot_, cols_, rows_, 1, __VA_ARGS__)
    ADD(TD_MODEL__EMBD, &m->tok_embd, embd, s->n_vocab, "token_embd.weight");
    ADD(TD_MODEL__NORM, &m->output_norm, embd, 1, "output_norm.weight");
    if (!s->tied_output) ADD(TD_MODEL__MATRIX, &m->output, embd, s->n_vocab, "output.weight");
    for (int l = 0; l < s->n_layer; l++) {
        td_layer *L = m ? &m->layers[l] : NULL;
        ADD(TD_MODEL__NORM, &L->attn_norm, embd, 1, "blk.%d.attn_norm.weight", l);
        ADD(TD_MODEL__MATRIX, &L->wq, embd, q, "blk.%d.attn_q.weight", l);
        ADD(TD_MODEL__MATRIX, &L->wk, embd, kv, "blk.%d.attn_k.weight", l);
        ADD(TD_MODEL__MATRIX, &L->wv, embd, kv, "blk.%d.attn_v.weight", l);
        if (bias) {
            ADD(TD_MODEL__BIAS, &L->bq, q, 1, "blk.%d.attn_q.bias", l);
            ADD(TD_MODEL__BIAS, &L->bk, kv, 1, "blk.%d.attn_k.bias", l);
            ADD(TD_MODEL__BIAS, &L->bv, kv, 1, "blk.%d.attn_v.bias", l);
        }
        ADD(TD_MODEL__MATRIX, &L->wo, q, embd, "blk.%d.attn_output.weight", l);
        ADD(TD_MODEL__NORM, &L->ffn_norm, embd, 1, "blk.%d.ffn_norm.weight", l);
        if (!moe) {
            ADD(TD_MODEL__MATRIX, &L->w_gate, embd, s->n_ff, "blk.%d.ffn_gate.weight", l);
            ADD(TD_MODEL__MATRIX, &L->w_up, embd, s->n_ff, "blk.%d.ffn_up.weight", l);
            ADD(TD_MODEL__MATRIX, &L->w_down, s->n_ff, embd, "blk.%d.ffn_down.weight", l);
            continue;
        }
        int64_t ne = s->n_expert, fe = s->n_ff_exp, fs = s->n_ff_shexp;
        ADD(TD_MODEL__ROUTER, &L->router, embd, ne, "blk.%d.ffn_gate_inp.weight", l);
        moe_tensor = true; /* 3-D even with one expert */
        ADD3(TD_MODEL__MATRIX, &L->w_gate_exps, embd, fe, ne, "blk.%d.ffn_gate_exps.weight", l);
        ADD3(TD_MODEL__MATRIX, &L->w_up_exps, embd, fe, ne, "blk.%d.ffn_up_exps.weight", l);
        ADD3(TD_MODEL__MATRIX, &L->w_down_exps, fe, embd, ne, "blk.%d.ffn_down_exps.weight", l);
        moe_tensor = false;
        if (shexp) {
            ADD(TD_MODEL__GATE, &L->shexp_gate, embd, 1, "blk.%d.ffn_gate_inp_shexp.weight", l);
            ADD(TD_MODEL__MATRIX, &L->w_gate_shexp, embd, fs, "blk.%d.ffn_gate_shexp.weight", l);
            ADD(TD_MODEL__MATRIX, &L->w_up_shexp, embd, fs, "blk.%d.ffn_up_shexp.weight", l);
            ADD(TD_MODEL__MATRIX, &L->w_down_shexp, fs, embd, "blk.%d.ffn_down_shexp.weight", l);
        }
    }
#undef ADD
#undef ADD3
    *n_out = n;
    return p;
}

/*
 * Random weights. Matrices are uniform with std 1/sqrt(cols) (a = sqrt(3/cols)),
 * which keeps y = W x at the scale of x: with RMSNorm in front of every block,
 * q/k/v, FFN activations and logits all stay O(1) through any number of layers,
 * attention is neither uniform nor one-hot, and the logits' top-2 margins are wide
 * enough (~0.1) for greedy decoding to be stable across batch shapes.
 */
/* A tensor's generator: its seed and the half-width of its uniform distribution. */
static td_weight_gen gen_params(const td_model__tensor *t, uint64_t seed)
{
    float a = t->kind == TD_MODEL__EMBD   ? 1.0f
              : t->kind == TD_MODEL__BIAS ? 0.1f
                                          : sqrtf(3.0f / (float)t->cols);
    return (td_weight_gen){true, td_hash64(t->name, strlen(t->name), seed), a};
}

static void gen_row(td_weight_gen g, int64_t cols, int64_t r, float *out)
{
    uint64_t row = (uint64_t)r;
    td_rng rng;
    td_rng_seed(&rng, td_hash64(&row, sizeof(row), g.seed));
    for (int64_t i = 0; i < cols; i++)
        out[i] = g.scale * (2.0f * td_rng_float(&rng) - 1.0f);
}

void td_model_gen_row(const td_weight *w, int64_t r, float *out)
{
    gen_row(w->gen, w->cols, r, out);
}

void td_model__gen_rows(const td_model__tensor *t, uint64_t seed, int64_t row0, int64_t n_rows,
                        void *dst, float *scratch)
{
    size_t row_bytes = td_row_bytes(t->type, t->cols);
    td_weight_gen g = gen_params(t, seed);
    for (int64_t r = 0; r < n_rows; r++) {
        if (t->kind == TD_MODEL__NORM) {
            for (int64_t i = 0; i < t->cols; i++)
                scratch[i] = 1.0f;
        } else {
            gen_row(g, t->cols, row0 + r, scratch);
        }
        td_quant_row_ref(t->type, scratch, (uint8_t *)dst + (size_t)r * row_bytes, t->cols);
    }
}

/* ---- fingerprint and summary ----------------------------------------------- */

/* The byte offset of the i-th (0..7) of the 32-byte windows hash_weight samples in an
 * n-byte tensor. */
static size_t fp_window(size_t n, int i)
{
    return n > 32 ? (n - 32) / 7 * (size_t)i : 0;
}

static uint64_t hash_weight(uint64_t h, const td_weight *w)
{
    bool present = w->data || w->gen.on;
    uint64_t head[4] = {(uint64_t)w->type, (uint64_t)w->cols, (uint64_t)w->rows, present};
    h = td_hash64(head, sizeof(head), h);
    if (!present) return h;
    /* Eight 32-byte windows spread over the tensor: enough to tell two weight sets
     * apart, cheap enough for a mapped 16 GB model (a few pages per tensor). A deferred
     * matrix makes the rows under each window, so it hashes as its materialised twin. */
    size_t n = w->row_bytes * (size_t)w->rows;
    float *f = w->data ? NULL : td_xmalloc((size_t)w->cols * sizeof(float));
    uint8_t *rows = w->data ? NULL : td_xmalloc(2 * w->row_bytes);
    for (int i = 0; i < 8; i++) {
        size_t off = fp_window(n, i), len = TD_MIN(n, (size_t)32);
        const uint8_t *p = (const uint8_t *)w->data + off;
        if (!w->data) {
            int64_t r = (int64_t)(off / w->row_bytes);
            for (int64_t k = 0; k < 2 && r + k < w->rows; k++) {
                td_model_gen_row(w, r + k, f);
                td_quant_row_ref(w->type, f, rows + (size_t)k * w->row_bytes, w->cols);
            }
            p = rows + off % w->row_bytes;
        }
        h = td_hash64(p, len, h);
    }
    free(f);
    free(rows);
    return h;
}

/* Every weight slot of a layer, in a fixed order (absent ones included). */
// clang-format off
#define LAYER_WEIGHTS(L)                                                                           \
    {&(L)->attn_norm,  &(L)->wq,           &(L)->wk,         &(L)->wv,                             \
     &(L)->bq,         &(L)->bk,           &(L)->bv,         &(L)->wo,                             \
     &(L)->ffn_norm,   &(L)->w_gate,       &(L)->w_up,       &(L)->w_down,                         \
     &(L)->router,     &(L)->w_gate_exps,  &(L)->w_up_exps,  &(L)->w_down_exps,                    \
     &(L)->shexp_gate, &(L)->w_gate_shexp, &(L)->w_up_shexp, &(L)->w_down_shexp}
// clang-format on
#define LAYER_N_DENSE 12 /* LAYER_WEIGHTS before the MoE slots */

static void finish_model(td_model *m)
{
    const td_model_shape *s = &m->shape;
    uint32_t eps, theta, scale;
    memcpy(&eps, &s->rms_eps, 4);
    memcpy(&theta, &s->rope_theta, 4);
    memcpy(&scale, &s->rope_freq_scale, 4);
    uint64_t fields[] = {s->arch,      s->n_vocab, s->n_embd,      s->n_layer,    s->n_head,
                         s->n_head_kv, s->n_ff,    s->n_ctx_train, s->head_dim,   eps,
                         theta,        scale,      s->rope_type,   s->tied_output};
    uint64_t h = td_hash64(fields, sizeof(fields), 0x746d6f64656cull);
    /* Only MoE shapes hash their expert fields, so dense fingerprints stay as they were. */
    uint64_t moe[] = {s->n_expert, s->n_expert_used, s->n_ff_exp, s->n_ff_shexp};
    if (s->n_expert) h = td_hash64(moe, sizeof(moe), h);
    h = hash_weight(h, &m->tok_embd);
    h = hash_weight(h, &m->output_norm);
    h = hash_weight(h, &m->output);
    size_t bytes = m->tok_embd.row_bytes * (size_t)m->tok_embd.rows +
                   m->output_norm.row_bytes * (size_t)m->output_norm.rows;
    if (!s->tied_output) bytes += m->output.row_bytes * (size_t)m->output.rows;
    /* Matrix bytes per type, to name the dominant type. */
    size_t by_type[TD_TYPE_BF16 + 1] = {0};
    by_type[m->tok_embd.type] += m->tok_embd.row_bytes * (size_t)m->tok_embd.rows;
    if (!s->tied_output) by_type[m->output.type] += m->output.row_bytes * (size_t)m->output.rows;
    for (int l = 0; l < s->n_layer; l++) {
        td_weight *ws[] = LAYER_WEIGHTS(&m->layers[l]);
        for (size_t i = 0; i < TD_ARRAY_LEN(ws); i++) {
            /* Absent MoE slots are not hashed, which keeps dense fingerprints unchanged. */
            if (i >= LAYER_N_DENSE && !ws[i]->data && !ws[i]->gen.on) continue;
            h = hash_weight(h, ws[i]);
            if (!ws[i]->data && !ws[i]->gen.on) continue;
            size_t b = ws[i]->row_bytes * (size_t)ws[i]->rows;
            bytes += b;
            if (ws[i]->rows > 1) by_type[ws[i]->type] += b;
        }
    }
    if (m->rope_freqs) {
        size_t n = (size_t)effective_head_dim(s) / 2 * sizeof(float);
        h = td_hash64(m->rope_freqs, n, h);
        bytes += n;
    }
    m->fingerprint = h;
    m->weight_bytes = bytes;
    m->weight_type = TD_TYPE_F32;
    for (int t = 0; t <= TD_TYPE_BF16; t++)
        if (by_type[t] > by_type[m->weight_type]) m->weight_type = (td_type)t;
}

/* ---- packing for the CPU kernels ------------------------------------------- */

/*
 * Matrices whose type has a CPU panel layout (q8_0) get a packed copy, made once here,
 * so that no matmul repacks them per call; the forward pass reads only the copy. It is
 * one anonymous allocation of the same size as the matrices (cpu_pack_bytes). With a
 * GGUF the mapped originals are then clean page cache that is not read again (only the
 * embedding table, never packed, keeps being read), so the memory held stays about one
 * copy of the weights; dummy weights keep both. The embedding table is not packed: rows
 * are looked up from it, and a tied output matrix shares it, so it stays native.
 */
typedef struct pack_item {
    td_weight *w;
    int64_t r0, r1;
} pack_item;

typedef struct pack_job {
    const pack_item *items;
    int64_t n_items;
    atomic_int_fast64_t next;
} pack_job;

/*
 * Run worker(job) on this thread and on helpers (one per CPU, at most 32; none for less
 * than 64 MiB of work), and wait for all. Workers take items from the job themselves, so
 * the result never depends on the number of threads.
 */
static void run_workers(void *(*worker)(void *), void *job, uint64_t total)
{
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n_threads = total < (64u << 20) ? 1 : (int)TD_MIN(TD_MAX(ncpu, 1), 32);
    pthread_t th[32];
    int started = 0;
    for (int i = 1; i < n_threads; i++)
        if (pthread_create(&th[started], NULL, worker, job) == 0) started++;
    worker(job);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
}

static void *pack_worker(void *arg)
{
    pack_job *job = arg;
    for (;;) {
        int64_t i = atomic_fetch_add(&job->next, 1);
        if (i >= job->n_items) break;
        const pack_item *it = &job->items[i];
        cpu_pack_rows(it->w->type, (void *)it->w->packed, it->w->data, it->w->row_bytes,
                      it->w->rows, (int)it->w->cols, it->r0, it->r1);
    }
    return NULL;
}

/* Collect the packable matrices (ws may be NULL to count them). */
static int packable(td_model *m, td_weight **ws)
{
    int n = 0;
    /* An expert's slice of a packed tensor is itself a packed matrix only when the expert's
     * rows fill whole 32-row panels; otherwise the experts stay unpacked. */
    const td_model_shape *s = &m->shape;
    bool exps_ff = s->n_ff_exp % 32 == 0, exps_embd = s->n_embd % 32 == 0;
    for (int l = 0; l < m->shape.n_layer; l++) {
        td_layer *L = &m->layers[l];
        td_weight *gate_exps = exps_ff ? &L->w_gate_exps : NULL;
        td_weight *up_exps = exps_ff ? &L->w_up_exps : NULL;
        td_weight *down_exps = exps_embd ? &L->w_down_exps : NULL;
        td_weight *c[] = {&L->wq,    &L->wk,           &L->wv,         &L->wo,          &L->w_gate,
                          &L->w_up,  &L->w_down,       &L->router,     gate_exps,       up_exps,
                          down_exps, &L->w_gate_shexp, &L->w_up_shexp, &L->w_down_shexp};
        for (size_t i = 0; i < TD_ARRAY_LEN(c); i++)
            if (c[i] && c[i]->data && c[i]->rows > 1 && cpu_pack_supported(c[i]->type)) {
                if (ws) ws[n] = c[i];
                n++;
            }
    }
    if (!m->shape.tied_output && m->output.data && cpu_pack_supported(m->output.type)) {
        if (ws) ws[n] = &m->output;
        n++;
    }
    return n;
}

/* Rows of one expert if w is one of a layer's expert tensors (w_*_exps), else 0. */
static int64_t expert_rows(const td_model *m, const td_weight *w)
{
    if (!m->shape.n_expert) return 0;
    for (int l = 0; l < m->shape.n_layer; l++) {
        const td_layer *L = &m->layers[l];
        if (w == &L->w_gate_exps || w == &L->w_up_exps || w == &L->w_down_exps)
            return w->rows / m->shape.n_expert;
    }
    return 0;
}

/* The rows of w this process uses: all of them, or for an expert tensor those of the
 * experts it holds (td_model_load_part). */
static void used_rows(const td_model *m, const td_weight *w, int64_t *r0, int64_t *r1)
{
    int64_t per = expert_rows(m, w);
    *r0 = per ? per * m->expert_lo : 0;
    *r1 = per ? per * m->expert_hi : w->rows;
}

/* Pack what can be packed; on failure (out of memory) the model simply stays unpacked.
 * The experts another process holds are not packed (their part of the copy is never
 * touched, so it takes no memory). */
static void pack_weights(td_model *m)
{
    /* TD_PACK_WEIGHTS=0 keeps the native layout (for comparisons). */
    const char *env = getenv("TD_PACK_WEIGHTS");
    if (env && strcmp(env, "0") == 0) return;
    int n = packable(m, NULL);
    if (n == 0) return;
    td_weight **ws = td_xmalloc(sizeof(*ws) * (size_t)n);
    packable(m, ws);
    size_t total = 0;
    int64_t n_items = 0;
    for (int i = 0; i < n; i++) {
        total = TD_ALIGN_UP(total, 64) + cpu_pack_bytes(ws[i]->type, ws[i]->rows, (int)ws[i]->cols);
        n_items += (ws[i]->rows + 1023) / 1024;
    }
    /* An anonymous mapping, zero until written: what is not packed (another process's
     * experts) never takes memory. */
    uint8_t *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        TD_WARN("model: no memory for %.1f MiB of packed weights; using the slower unpacked "
                "kernels",
                (double)total / 1048576.0);
        free(ws);
        return;
    }
    /* Work items of 1024 rows (a multiple of the 32-row panel). */
    pack_item *items = td_xmalloc(sizeof(*items) * (size_t)n_items);
    size_t off = 0;
    int64_t k = 0;
    for (int i = 0; i < n; i++) {
        off = TD_ALIGN_UP(off, 64);
        ws[i]->packed = base + off;
        off += cpu_pack_bytes(ws[i]->type, ws[i]->rows, (int)ws[i]->cols);
        int64_t r0, r1;
        used_rows(m, ws[i], &r0, &r1); /* experts' rows are whole 32-row panels */
        for (int64_t r = r0; r < r1; r += 1024)
            items[k++] = (pack_item){ws[i], r, TD_MIN(r1, r + 1024)};
    }
    pack_job job = {.items = items, .n_items = k};
    atomic_init(&job.next, 0);
    run_workers(pack_worker, &job, total);
    free(items);
    free(ws);
    m->packed = base;
    m->packed_bytes = total;
}

/* Give back the whole pages inside [p, p + n) (they are never read again). */
static size_t drop_pages(const void *p, size_t n)
{
    if (!p || !n) return 0;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = TD_ALIGN_UP((uintptr_t)p, page), b = ((uintptr_t)p + n) / page * page;
    if (b <= a) return 0;
    return madvise((void *)a, b - a, MADV_DONTNEED) == 0 ? b - a : 0;
}

size_t td_model_drop_experts(td_model *m, int lo, int hi)
{
    const td_model_shape *s = &m->shape;
    size_t dropped = 0;
    for (int l = 0; l < s->n_layer; l++) {
        td_layer *L = &m->layers[l];
        const td_weight *ws[] = {&L->w_gate_exps, &L->w_up_exps, &L->w_down_exps};
        for (size_t i = 0; i < TD_ARRAY_LEN(ws); i++) {
            const td_weight *w = ws[i];
            if (!w->data || w->rows % s->n_expert) continue;
            /* expert e is rows [e * per, (e + 1) * per), in the original and in the packed copy */
            size_t per = (size_t)(w->rows / s->n_expert) * w->row_bytes;
            size_t first = (size_t)lo * per, last = (size_t)hi * per, all = (size_t)s->n_expert * per;
            const uint8_t *bases[] = {w->data, w->packed};
            for (size_t k = 0; k < 2; k++) {
                if (!bases[k]) continue;
                dropped += drop_pages(bases[k], first);            /* the experts before ours */
                dropped += drop_pages(bases[k] + last, all - last); /* and after */
            }
        }
    }
    return dropped;
}

void td_model_describe(const td_model *m, char *buf, size_t cap)
{
    const td_model_shape *s = &m->shape;
    double params = (double)td_model_n_params(s);
    const char *unit = params >= 1e9 ? "B" : params >= 1e6 ? "M" : "K";
    char packed[64] = "";
    if (m->packed_bytes)
        snprintf(packed, sizeof(packed), " (+%.1f MiB packed for the CPU kernels)",
                 (double)m->packed_bytes / (1024.0 * 1024.0));
    double pv = params >= 1e9 ? params / 1e9 : params >= 1e6 ? params / 1e6 : params / 1e3;
    char ffn[128];
    if (s->n_expert) {
        double active = (double)td_model_n_active_params(s);
        int n = snprintf(ffn, sizeof(ffn), "%d experts (top-%d, ffn %d", s->n_expert,
                         s->n_expert_used, s->n_ff_exp);
        if (s->n_ff_shexp)
            n += snprintf(ffn + n, sizeof(ffn) - (size_t)n, ", shared %d", s->n_ff_shexp);
        snprintf(ffn + n, sizeof(ffn) - (size_t)n, "; %.1f%s active)",
                 params >= 1e9   ? active / 1e9
                 : params >= 1e6 ? active / 1e6
                                 : active / 1e3,
                 unit);
    } else {
        snprintf(ffn, sizeof(ffn), "ffn %d", s->n_ff);
    }
    snprintf(buf, cap,
             "%s (%s): %.1f%s params, dim %d, %d layers, %d heads (%d kv, head_dim %d), %s, "
             "vocab %d, ctx %d, %s, %.1f MiB%s, rope %s theta %g%s",
             m->name, td_arch_name(s->arch), pv, unit, s->n_embd, s->n_layer, s->n_head,
             s->n_head_kv, s->head_dim, ffn, s->n_vocab, s->n_ctx_train,
             td_type_name(m->weight_type), (double)m->weight_bytes / (1024.0 * 1024.0), packed,
             s->rope_type == TD_ROPE_NEOX ? "neox" : "norm", (double)s->rope_theta,
             s->tied_output ? ", tied output" : "");
}

/* ---- loading from GGUF ----------------------------------------------------- */

/* Read `<arch>.<suffix>` as an int in 1..max; absent → *out = def, or an error if def < 0. */
static int hparam(const gguf_file *f, const char *arch, const char *suffix, int def, int max,
                  int *out, td_err *err)
{
    char key[128];
    snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    int64_t v;
    int rc = gguf_get_i64(f, key, &v, err);
    if (rc == TD_ENOTFOUND) {
        if (def < 0) return td_err_set(err, TD_EFORMAT, "model: missing key '%s'", key);
        *out = def;
        return 0;
    }
    if (rc) return rc;
    if (v < 1 || v > max)
        return td_err_set(err, TD_EFORMAT, "model: key '%s' = %lld is out of range (1..%d)", key,
                          (long long)v, max);
    *out = (int)v;
    return 0;
}

static int fparam(const gguf_file *f, const char *arch, const char *suffix, float def, float *out,
                  td_err *err)
{
    char key[128];
    snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    int rc = gguf_get_f32(f, key, out, err);
    if (rc == TD_ENOTFOUND) {
        *out = def;
        return 0;
    }
    if (rc) return rc;
    if (!(*out > 0 && isfinite(*out)))
        return td_err_set(err, TD_EFORMAT, "model: key '%s' = %g must be positive", key,
                          (double)*out);
    return 0;
}

/*
 * The experts: `<arch>.expert_count` (absent or 0: a dense FFN), `<arch>.expert_used_count`,
 * and for qwen2moe the experts' and the shared expert's widths (llama.cpp's defaults when
 * absent: n_ff / n_expert_used and n_ff). Llama experts are n_ff wide.
 */
static int read_experts(const gguf_file *f, const char *arch, td_model_shape *s, td_err *err)
{
    char key[128], used_key[128];
    snprintf(key, sizeof(key), "%s.expert_count", arch);
    snprintf(used_key, sizeof(used_key), "%s.expert_used_count", arch);
    int64_t v = 0;
    int rc = gguf_get_i64(f, key, &v, err);
    if (rc && rc != TD_ENOTFOUND) return rc;
    bool qwen2moe = s->arch == TD_ARCH_QWEN2MOE;
    if (rc == TD_ENOTFOUND && qwen2moe)
        return td_err_set(err, TD_EFORMAT, "model: missing key '%s'", key);
    if (v < (qwen2moe ? 1 : 0) || v > MAX_EXPERT)
        return td_err_set(err, TD_EFORMAT, "model: key '%s' = %lld is out of range (%d..%d)", key,
                          (long long)v, qwen2moe ? 1 : 0, MAX_EXPERT);
    if (v == 0) {
        /* Experts without a count would otherwise surface as a missing dense FFN tensor. */
        if (gguf_find_tensor(f, "blk.0.ffn_gate_exps.weight"))
            return td_err_set(err, TD_EFORMAT,
                              "model: the file has expert tensors (blk.0.ffn_gate_exps.weight) "
                              "but no '%s'",
                              key);
        return 0;
    }
    if (s->arch == TD_ARCH_QWEN2)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "model: '%s' = %lld: qwen2 has no experts (its MoE architecture is "
                          "qwen2moe)",
                          key, (long long)v);
    s->n_expert = (int)v;
    if ((rc = hparam(f, arch, "expert_used_count", -1, MAX_EXPERT, &s->n_expert_used, err)))
        return rc;
    if (s->n_expert_used > s->n_expert)
        return td_err_set(err, TD_EFORMAT, "model: key '%s' = %d exceeds '%s' = %d", used_key,
                          s->n_expert_used, key, s->n_expert);
    s->n_ff_exp = s->n_ff;
    if (qwen2moe && ((rc = hparam(f, arch, "expert_feed_forward_length", s->n_ff / s->n_expert_used,
                                  MAX_FF, &s->n_ff_exp, err)) ||
                     (rc = hparam(f, arch, "expert_shared_feed_forward_length", s->n_ff, MAX_FF,
                                  &s->n_ff_shexp, err))))
        return rc;
    /* Old Mixtral conversions stored each expert as its own 2-D tensor. */
    if (!gguf_find_tensor(f, "blk.0.ffn_gate_exps.weight") &&
        gguf_find_tensor(f, "blk.0.ffn_gate.0.weight"))
        return td_err_set(err, TD_EUNSUPPORTED,
                          "model: per-expert tensors (blk.0.ffn_gate.0.weight, the old Mixtral "
                          "layout) are not supported; convert the model again to get 3-D "
                          "ffn_gate_exps/ffn_up_exps/ffn_down_exps tensors");
    return 0;
}

static int read_shape(const gguf_file *f, td_model_shape *s, td_err *err)
{
    gguf_str a;
    int rc = gguf_get_str(f, "general.architecture", &a, err);
    if (rc == TD_ENOTFOUND)
        return td_err_set(err, TD_EFORMAT, "model: missing key 'general.architecture'");
    if (rc) return rc;
    char arch[32];
    if (a.len == 5 && !memcmp(a.ptr, "llama", 5)) {
        s->arch = TD_ARCH_LLAMA;
        s->rope_type = TD_ROPE_NORM;
    } else if (a.len == 5 && !memcmp(a.ptr, "qwen2", 5)) {
        s->arch = TD_ARCH_QWEN2;
        s->rope_type = TD_ROPE_NEOX;
    } else if (a.len == 8 && !memcmp(a.ptr, "qwen2moe", 8)) {
        s->arch = TD_ARCH_QWEN2MOE;
        s->rope_type = TD_ROPE_NEOX;
    } else {
        return td_err_set(err, TD_EUNSUPPORTED,
                          "model: unsupported architecture '%.*s' (supported: llama, qwen2, "
                          "qwen2moe)",
                          a.len > 40 ? 40 : (int)a.len, a.ptr);
    }
    memcpy(arch, a.ptr, a.len);
    arch[a.len] = 0;

    if ((rc = hparam(f, arch, "embedding_length", -1, MAX_EMBD, &s->n_embd, err)) ||
        (rc = hparam(f, arch, "block_count", -1, MAX_LAYER, &s->n_layer, err)) ||
        (rc = hparam(f, arch, "attention.head_count", -1, MAX_HEAD, &s->n_head, err)) ||
        (rc =
             hparam(f, arch, "attention.head_count_kv", s->n_head, MAX_HEAD, &s->n_head_kv, err)) ||
        (rc = hparam(f, arch, "feed_forward_length", -1, MAX_FF, &s->n_ff, err)) ||
        (rc = hparam(f, arch, "context_length", -1, MAX_CTX, &s->n_ctx_train, err)) ||
        (rc = read_experts(f, arch, s, err)))
        return rc;
    int hd_default = s->n_embd % s->n_head ? 0 : s->n_embd / s->n_head;
    if ((rc = hparam(f, arch, "attention.key_length", hd_default ? hd_default : -1, MAX_HEAD_DIM,
                     &s->head_dim, err)))
        return rc;
    int vlen = 0, rot = 0;
    if ((rc = hparam(f, arch, "attention.value_length", s->head_dim, MAX_HEAD_DIM, &vlen, err)))
        return rc;
    if (vlen != s->head_dim)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "model: value_length %d differs from key_length %d (not supported)", vlen,
                          s->head_dim);
    if ((rc = hparam(f, arch, "rope.dimension_count", s->head_dim, MAX_HEAD_DIM, &rot, err)))
        return rc;
    if (rot != s->head_dim)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "model: partial RoPE (rope.dimension_count %d of head_dim %d) is not "
                          "supported",
                          rot, s->head_dim);

    if ((rc = fparam(f, arch, "attention.layer_norm_rms_epsilon", 1e-5f, &s->rms_eps, err)) ||
        (rc = fparam(f, arch, "rope.freq_base", 10000.0f, &s->rope_theta, err)))
        return rc;
    s->rope_freq_scale = 1.0f;
    char key[128];
    snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
    gguf_str st;
    rc = gguf_get_str(f, key, &st, err);
    if (rc && rc != TD_ENOTFOUND) return rc;
    if (rc == 0 && !(st.len == 4 && !memcmp(st.ptr, "none", 4))) {
        if (!(st.len == 6 && !memcmp(st.ptr, "linear", 6)))
            return td_err_set(err, TD_EUNSUPPORTED,
                              "model: rope scaling '%.*s' is not supported (none, linear are)",
                              st.len > 32 ? 32 : (int)st.len, st.ptr);
        float factor;
        if ((rc = fparam(f, arch, "rope.scaling.factor", 1.0f, &factor, err))) return rc;
        s->rope_freq_scale = 1.0f / factor;
    }

    /* Vocabulary size: the tokenizer's list, else <arch>.vocab_size, else the
     * embedding's row count (checked against the tensor when it is bound). */
    uint64_t n_tok;
    gguf_vtype et;
    rc = gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n_tok, err);
    if (rc == 0) {
        if (n_tok < 1 || n_tok > MAX_VOCAB)
            return td_err_set(err, TD_EFORMAT, "model: tokenizer.ggml.tokens has %llu entries",
                              (unsigned long long)n_tok);
        s->n_vocab = (int)n_tok;
    } else if (rc == TD_ENOTFOUND) {
        if ((rc = hparam(f, arch, "vocab_size", 0, MAX_VOCAB, &s->n_vocab, err))) return rc;
        if (s->n_vocab == 0) {
            const gguf_tensor *te = gguf_find_tensor(f, "token_embd.weight");
            if (!te)
                return td_err_set(err, TD_EFORMAT, "model: missing tensor 'token_embd.weight'");
            if (te->ne[1] < 1 || te->ne[1] > MAX_VOCAB)
                return td_err_set(err, TD_EFORMAT, "model: token_embd.weight has %lld rows",
                                  (long long)te->ne[1]);
            s->n_vocab = (int)te->ne[1];
        }
    } else {
        return rc;
    }
    s->tied_output = gguf_find_tensor(f, "output.weight") == NULL;
    return td_model_shape_validate(s, err);
}

static const char *kind_what(td_model__kind k)
{
    return k == TD_MODEL__NORM   ? "norms"
           : k == TD_MODEL__BIAS ? "biases"
           : k == TD_MODEL__GATE ? "gate vectors"
                                 : "matrices";
}

/* Point a planned tensor's slot at the file's tensor after checking shape and type. */
static int bind_tensor(const gguf_file *f, const td_model__tensor *p, td_err *err)
{
    const gguf_tensor *t = gguf_find_tensor(f, p->name);
    if (!t) return td_err_set(err, TD_EFORMAT, "model: missing tensor '%s'", p->name);
    bool three = p->n_dims == 3;
    if (t->ne[0] != p->cols || t->ne[1] != p->rows || t->ne[2] != p->n_mats || t->ne[3] != 1) {
        char want[96];
        if (three)
            snprintf(want, sizeof(want), "[%lld, %lld, %lld] (one [%lld, %lld] matrix per expert)",
                     (long long)p->cols, (long long)p->rows, (long long)p->n_mats,
                     (long long)p->cols, (long long)p->rows);
        else
            snprintf(want, sizeof(want), "[%lld, %lld]", (long long)p->cols, (long long)p->rows);
        return td_err_set(err, TD_EFORMAT,
                          "model: tensor '%s' has shape [%lld, %lld, %lld, %lld], expected %s",
                          p->name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                          (long long)t->ne[3], want);
    }
    bool want_f32 =
        p->kind == TD_MODEL__NORM || p->kind == TD_MODEL__BIAS || p->kind == TD_MODEL__GATE;
    if (want_f32 ? t->type != TD_TYPE_F32 : !td_row_bytes(t->type, t->ne[0]))
        return td_err_set(
            err, TD_EUNSUPPORTED, "model: tensor '%s' has type %s, which is not supported for %s%s",
            p->name, td_type_name(t->type), kind_what(p->kind), want_f32 ? " (must be f32)" : "");
    *p->slot = (td_weight){
        .type = t->type,
        .cols = t->ne[0],
        .rows = t->ne[1] * t->ne[2],
        .row_bytes = td_row_bytes(t->type, t->ne[0]),
        .data = t->data,
    };
    return 0;
}

/* The experts part `part` of n_parts holds: [part E / n, (part + 1) E / n), as td_ep_experts. */
static void set_part(td_model *m, int part, int n_parts)
{
    int64_t e = m->shape.n_expert;
    m->expert_lo = (int)(part * e / n_parts);
    m->expert_hi = (int)((part + 1) * e / n_parts);
}

static int check_part(int part, int n_parts, td_err *err)
{
    if (n_parts < 1 || part < 0 || part >= n_parts)
        return td_err_set(err, TD_EINVAL, "model: expert part %d of %d", part, n_parts);
    return 0;
}

static int from_gguf(td_model **out, gguf_file *f, int part, int n_parts, td_err *err)
{
    *out = NULL;
    int rc = check_part(part, n_parts, err);
    if (rc) return rc;
    td_model *m = calloc(1, sizeof(*m));
    if (!m) return td_err_set(err, TD_ENOMEM, "model: out of memory");
    rc = read_shape(f, &m->shape, err);
    if (rc) {
        free(m);
        return rc;
    }
    set_part(m, part, n_parts);
    m->layers = calloc((size_t)m->shape.n_layer, sizeof(*m->layers));
    if (!m->layers) {
        free(m);
        return td_err_set(err, TD_ENOMEM, "model: out of memory");
    }
    int n;
    td_model__tensor *plan = td_model__plan(&m->shape, TD_TYPE_F32, m, &n);
    for (int i = 0; i < n && !rc; i++)
        rc = bind_tensor(f, &plan[i], err);
    if (!rc && m->shape.tied_output) m->output = m->tok_embd;

    const gguf_tensor *rf = rc ? NULL : gguf_find_tensor(f, "rope_freqs.weight");
    if (rf) {
        if (rf->type != TD_TYPE_F32 || rf->ne[0] != m->shape.head_dim / 2 || rf->ne[1] != 1 ||
            rf->ne[2] != 1 || rf->ne[3] != 1)
            rc = td_err_set(err, TD_EFORMAT,
                            "model: tensor 'rope_freqs.weight' must be f32 [%d] (head_dim/2), "
                            "has %s [%lld, %lld]",
                            m->shape.head_dim / 2, td_type_name(rf->type), (long long)rf->ne[0],
                            (long long)rf->ne[1]);
        for (int64_t i = 0; !rc && i < rf->ne[0]; i++) {
            float v;
            memcpy(&v, (const uint8_t *)rf->data + 4 * i, 4);
            if (!(v > 0 && v < 1e30f))
                rc = td_err_set(err, TD_EFORMAT,
                                "model: tensor 'rope_freqs.weight' holds %g at %lld: its RoPE "
                                "frequency factors must be positive and finite",
                                (double)v, (long long)i);
        }
        if (!rc) m->rope_freqs = rf->data;
    }
    /* Every tensor of the file is one the model uses (the whole model: an expert part
     * leaves the other parts' experts alone): a tensor left over means the metadata
     * describes another model than the tensors do (block_count too low, say), which would
     * otherwise run a model with layers missing. */
    for (int64_t i = 0; !rc && n_parts == 1 && i < gguf_n_tensors(f); i++) {
        const char *name = gguf_tensor_at(f, i)->name;
        bool used = !strcmp(name, "rope_freqs.weight") ||
                    (strlen(name) > 14 && !strcmp(name + strlen(name) - 14, ".attn_rot_embd"));
        for (int k = 0; k < n && !used; k++)
            used = !strcmp(name, plan[k].name);
        if (!used)
            rc = td_err_set(err, TD_EFORMAT,
                            "model: tensor '%s' is not part of the model the metadata describes "
                            "(%s, %d layers)",
                            name, td_arch_name(m->shape.arch),
                            m->shape.n_layer);
    }
    free(plan);
    if (rc) {
        free(m->layers);
        free(m);
        return rc;
    }
    gguf_str name;
    if (gguf_get_str(f, "general.name", &name, NULL) == 0 && name.len > 0) {
        size_t len = TD_MIN(name.len, sizeof(m->name) - 1);
        memcpy(m->name, name.ptr, len);
        m->name[len] = 0;
    }
    finish_model(m);
    pack_weights(m);
    m->gguf = f;
    *out = m;
    return 0;
}

int td_model_from_gguf(td_model **out, gguf_file *f, td_err *err)
{
    return from_gguf(out, f, 0, 1, err);
}

int td_model_load(td_model **out, const char *path, td_err *err)
{
    return td_model_load_part(out, path, 0, 1, err);
}

int td_model_load_part(td_model **out, const char *path, int part, int n_parts, td_err *err)
{
    *out = NULL;
    gguf_file *f;
    int rc = check_part(part, n_parts, err);
    if (rc) return rc;
    if ((rc = gguf_open(&f, path, err))) return rc;
    if ((rc = from_gguf(out, f, part, n_parts, err))) {
        gguf_close(f);
        return rc;
    }
    if (!(*out)->name[0]) {
        const char *base = strrchr(path, '/');
        snprintf((*out)->name, sizeof((*out)->name), "%s", base ? base + 1 : path);
    }
    return 0;
}

/* ---- dummy weights --------------------------------------------------------- */

int td_model__check_wtype(const td_model_shape *s, td_type wtype, td_err *err)
{
    if (!gguf__tensor_type_ok((uint32_t)wtype))
        return td_err_set(err, TD_EUNSUPPORTED,
                          "model: weight type %s is not supported (f32, f16, bf16, q8_0, q4_0 are)",
                          td_type_name(wtype));
    int hd = effective_head_dim(s);
    if (!td_row_bytes(wtype, s->n_embd) || !td_row_bytes(wtype, s->n_ff) ||
        !td_row_bytes(wtype, (int64_t)s->n_head * hd))
        return td_err_set(err, TD_EINVAL,
                          "model: %s needs every row length (n_embd %d, n_ff %d, q dim %d) to be "
                          "a multiple of %d",
                          td_type_name(wtype), s->n_embd, s->n_ff, s->n_head * hd,
                          td_type_block_elems(wtype));
    if ((s->n_ff_exp && !td_row_bytes(wtype, s->n_ff_exp)) ||
        (s->n_ff_shexp && !td_row_bytes(wtype, s->n_ff_shexp)))
        return td_err_set(err, TD_EINVAL,
                          "model: %s needs the experts' widths (n_ff_exp %d, n_ff_shexp %d) to be "
                          "multiples of %d",
                          td_type_name(wtype), s->n_ff_exp, s->n_ff_shexp,
                          td_type_block_elems(wtype));
    return 0;
}

typedef struct fill_chunk {
    int tensor;
    int64_t row0, n_rows;
} fill_chunk;

typedef struct fill_job {
    const td_model__tensor *plan;
    const fill_chunk *chunks;
    int64_t n_chunks;
    atomic_llong next;
    uint64_t seed;
    int64_t max_cols;
} fill_job;

static void *fill_worker(void *arg)
{
    fill_job *job = arg;
    float *scratch = td_xmalloc((size_t)job->max_cols * sizeof(float));
    for (;;) {
        int64_t c = atomic_fetch_add(&job->next, 1);
        if (c >= job->n_chunks) break;
        const fill_chunk *ch = &job->chunks[c];
        const td_model__tensor *t = &job->plan[ch->tensor];
        uint8_t *dst = (uint8_t *)t->slot->data + (size_t)ch->row0 * t->slot->row_bytes;
        td_model__gen_rows(t, job->seed, ch->row0, ch->n_rows, dst, scratch);
    }
    free(scratch);
    return NULL;
}

static int load_dummy(td_model **out, const td_model_shape *shape, td_type weight_type,
                      uint64_t seed, bool deferred, int part, int n_parts, td_err *err)
{
    *out = NULL;
    td_model_shape s = *shape;
    int rc = check_part(part, n_parts, err);
    if (!rc) rc = td_model_shape_validate(&s, err);
    if (rc) return rc;
    if (s.head_dim == 0) s.head_dim = s.n_embd / s.n_head;
    if ((rc = td_model__check_wtype(&s, weight_type, err))) return rc;
    if (deferred && weight_type != TD_TYPE_F32 && weight_type != TD_TYPE_BF16)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "model: deferred dummy weights are f32 or bf16, not %s",
                          td_type_name(weight_type));

    td_model *m = td_xcalloc(1, sizeof(*m));
    m->shape = s;
    set_part(m, part, n_parts);
    m->layers = td_xcalloc((size_t)s.n_layer, sizeof(*m->layers));
    snprintf(m->name, sizeof(m->name), "dummy");
    int n;
    td_model__tensor *plan = td_model__plan(&s, weight_type, m, &n);

    /* One anonymous mapping for all tensors, each 64-byte aligned. */
    size_t total = 0;
    int64_t max_cols = 1, n_chunks = 0;
    /* Deferred: the embedding and the projections get no host memory. */
#define DEFERRED(t) (deferred && ((t).kind == TD_MODEL__EMBD || (t).kind == TD_MODEL__MATRIX))
    for (int i = 0; i < n; i++) {
        if (DEFERRED(plan[i])) continue;
        size_t rb = td_row_bytes(plan[i].type, plan[i].cols);
        int64_t rows = plan[i].rows * plan[i].n_mats; /* every expert's rows */
        total = TD_ALIGN_UP(total, 64) + rb * (size_t)rows;
        max_cols = TD_MAX(max_cols, plan[i].cols);
        int64_t rows_per = TD_MAX(1, (int64_t)((4u << 20) / rb));
        n_chunks += (rows + rows_per - 1) / rows_per + 16; /* + fingerprint rows (below) */
    }
    void *base = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        free(plan);
        free(m->layers);
        free(m);
        return td_err_set(err, TD_ENOMEM, "model: cannot allocate %.1f MiB for dummy weights",
                          (double)total / (1024.0 * 1024.0));
    }
    m->owned = base;
    m->owned_bytes = total;

    fill_chunk *chunks = td_xmalloc((size_t)n_chunks * sizeof(*chunks));
    size_t off = 0;
    int64_t c = 0;
    for (int i = 0; i < n; i++) {
        size_t rb = td_row_bytes(plan[i].type, plan[i].cols);
        int64_t rows = plan[i].rows * plan[i].n_mats;
        if (DEFERRED(plan[i])) {
            *plan[i].slot = (td_weight){
                plan[i].type, plan[i].cols, rows, rb, NULL, NULL, gen_params(&plan[i], seed)};
            continue;
        }
        off = TD_ALIGN_UP(off, 64);
        *plan[i].slot =
            (td_weight){plan[i].type, plan[i].cols, rows, rb, (uint8_t *)base + off, NULL, {0}};
        off += rb * (size_t)rows;
        int64_t rows_per = TD_MAX(1, (int64_t)((4u << 20) / rb));
        /* An expert tensor is made only for the experts this process holds; of the
         * others, only the rows under the fingerprint's windows (so that every part of a
         * model has its fingerprint), and the rest is never touched. */
        int64_t r0 = 0, r1 = rows;
        if (plan[i].n_mats > 1) {
            r0 = plan[i].rows * m->expert_lo;
            r1 = plan[i].rows * m->expert_hi;
            size_t n_bytes = rb * (size_t)rows;
            for (int w = 0; w < 8; w++) {
                size_t a = fp_window(n_bytes, w), b = a + TD_MIN(n_bytes, (size_t)32) - 1;
                for (int64_t r = (int64_t)(a / rb); r <= (int64_t)(b / rb); r++)
                    if (r < r0 || r >= r1) chunks[c++] = (fill_chunk){i, r, 1};
            }
        }
        for (int64_t r = r0; r < r1; r += rows_per)
            chunks[c++] = (fill_chunk){i, r, TD_MIN(rows_per, r1 - r)};
    }
    n_chunks = c;

    /* Fill in parallel: rows are seeded independently, so the result is the same for
     * any number of threads. Small models are filled on this thread. */
    fill_job job = {
        .plan = plan, .chunks = chunks, .n_chunks = n_chunks, .seed = seed, .max_cols = max_cols};
    atomic_init(&job.next, 0);
    run_workers(fill_worker, &job, total);
    free(chunks);
    free(plan);
#undef DEFERRED

    if (s.tied_output) m->output = m->tok_embd;
    finish_model(m);
    if (!deferred) pack_weights(m);
    *out = m;
    return 0;
}

int td_model_load_dummy(td_model **out, const td_model_shape *shape, td_type weight_type,
                        uint64_t seed, td_err *err)
{
    return load_dummy(out, shape, weight_type, seed, false, 0, 1, err);
}

int td_model_load_dummy_part(td_model **out, const td_model_shape *shape, td_type weight_type,
                             uint64_t seed, int part, int n_parts, td_err *err)
{
    return load_dummy(out, shape, weight_type, seed, false, part, n_parts, err);
}

int td_model_load_dummy_deferred(td_model **out, const td_model_shape *shape, td_type weight_type,
                                 uint64_t seed, td_err *err)
{
    return load_dummy(out, shape, weight_type, seed, true, 0, 1, err);
}

void td_model_prefault(const td_model *m)
{
    /* A process that holds part of the experts maps only what it reads. */
    if (m && m->gguf && m->expert_hi - m->expert_lo >= m->shape.n_expert) gguf_prefault(m->gguf);
}

void td_model_free(td_model *m)
{
    if (!m) return;
    if (m->owned) munmap(m->owned, m->owned_bytes);
    if (m->gguf) gguf_close(m->gguf);
    if (m->packed) munmap(m->packed, m->packed_bytes);
    free(m->layers);
    free(m);
}
