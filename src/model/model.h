/*
 * model/model.h - a loaded transformer: hyper-parameters and weight views.
 *
 * Weights point into the GGUF mapping (never copied), or into one owned
 * allocation for `--load-format dummy`. Every matrix is stored as GGUF stores
 * it: `rows` rows of `cols` contiguous elements, so y = W x is
 * y[r] = dot(row r, x) over `cols` elements.
 *
 * Supported architectures: `llama` (Llama 2/3, TinyLlama, Mistral; adjacent-pair
 * RoPE; with experts, Mixtral), `qwen2` (llama with q/k/v biases; NeoX RoPE over
 * halves) and `qwen2moe` (qwen2 attention, routed experts plus a gated shared expert).
 */
#ifndef TD_MODEL_MODEL_H
#define TD_MODEL_MODEL_H

#include "model/gguf.h"
#include "model/types.h"
#include "util/td.h"

typedef enum td_arch { TD_ARCH_LLAMA = 0, TD_ARCH_QWEN2 = 1, TD_ARCH_QWEN2MOE = 2 } td_arch;

/** The GGUF name of an architecture ("llama", "qwen2", "qwen2moe"). */
const char *td_arch_name(td_arch a);

/** RoPE layouts: NORM rotates adjacent pairs (2i, 2i+1); NEOX rotates (i, i + d/2). */
typedef enum td_rope_type { TD_ROPE_NORM = 0, TD_ROPE_NEOX = 2 } td_rope_type;

typedef enum td_rope_scaling {
    TD_ROPE_SCALING_NONE = 0,
    TD_ROPE_SCALING_LINEAR = 1, /* positions multiplied by rope_freq_scale */
} td_rope_scaling;

/*
 * Deferred random weights (`--load-format dummy` on the GPU): the matrix has no host
 * data (data == NULL) and a device backend makes row r itself, exactly as
 * td_model_gen_row does: scale * (2u - 1) for u from a xoshiro256** stream seeded with
 * td_hash64(&r, 8, seed), rounded to the weight's type.
 */
typedef struct td_weight_gen {
    bool on;
    uint64_t seed; /* the tensor's seed: td_hash64(name, model seed) */
    float scale;
} td_weight_gen;

typedef struct td_weight {
    td_type type;
    int64_t cols;     /* contiguous elements per row (the input dimension) */
    int64_t rows;     /* number of rows (the output dimension); 1 for vectors */
    size_t row_bytes; /* td_row_bytes(type, cols) */
    const void *data; /* NULL when the tensor is absent (optional biases) */
    /* The same matrix in the CPU kernels' panel layout (cpu_pack_rows), made once at load
     * for types that have one (q8_0), or NULL. The matmuls read this instead of data. */
    const void *packed;
    td_weight_gen gen; /* deferred random rows (data == NULL), or gen.on false */
} td_weight;

typedef struct td_layer {
    td_weight attn_norm; /* f32 [n_embd] */
    td_weight wq;        /* [n_head*head_dim rows][n_embd cols] */
    td_weight wk;        /* [n_head_kv*head_dim][n_embd] */
    td_weight wv;        /* [n_head_kv*head_dim][n_embd] */
    td_weight bq, bk, bv;/* f32 biases (qwen2), else data == NULL */
    td_weight wo;        /* [n_embd][n_head*head_dim] */
    td_weight ffn_norm;  /* f32 [n_embd] */
    td_weight w_gate;    /* [n_ff][n_embd]; absent (data NULL) in MoE models */
    td_weight w_up;      /* [n_ff][n_embd]; absent in MoE models */
    td_weight w_down;    /* [n_embd][n_ff]; absent in MoE models */
    /*
     * Mixture of experts (shape.n_expert > 0). The GGUF's 3-D expert tensors
     * (ne0 = cols, ne1 = rows of one expert, ne2 = n_expert) are viewed as one matrix of
     * n_expert * ne1 rows: expert e's matrix is the contiguous rows [e * ne1, (e + 1) * ne1),
     * so the ordinary matmul kernels run on it as on any matrix.
     */
    td_weight router;       /* ffn_gate_inp: [n_expert][n_embd], one logit per expert */
    td_weight w_gate_exps;  /* [n_expert * n_ff_exp][n_embd] */
    td_weight w_up_exps;    /* [n_expert * n_ff_exp][n_embd] */
    td_weight w_down_exps;  /* [n_expert * n_embd][n_ff_exp] */
    td_weight shexp_gate;   /* qwen2moe ffn_gate_inp_shexp: f32 [n_embd], the shared expert's
                               scalar gate sigmoid(shexp_gate . x) */
    td_weight w_gate_shexp; /* qwen2moe shared expert: [n_ff_shexp][n_embd] */
    td_weight w_up_shexp;   /* [n_ff_shexp][n_embd] */
    td_weight w_down_shexp; /* [n_embd][n_ff_shexp] */
} td_layer;

typedef struct td_model_shape {
    td_arch arch;
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff, n_ctx_train;
    int head_dim;          /* n_embd / n_head unless the file says otherwise */
    float rms_eps;         /* default 1e-5 */
    float rope_theta;      /* default 10000 */
    float rope_freq_scale; /* 1.0 = no scaling */
    td_rope_type rope_type;
    bool tied_output;      /* output reuses tok_embd */
    /* Mixture of experts: every layer's FFN is n_expert experts of which each token uses
     * the n_expert_used best by the router (0 experts: a dense FFN of n_ff). llama takes
     * its experts' width from n_ff (n_ff_exp == n_ff); qwen2moe has its own, and a shared
     * expert of n_ff_shexp (> 0) that every token uses. */
    int n_expert, n_expert_used;
    int n_ff_exp;   /* one expert's FFN width */
    int n_ff_shexp; /* the shared expert's FFN width (qwen2moe), else 0 */
} td_model_shape;

/** Most experts a layer may have (llama.cpp's LLAMA_MAX_EXPERTS). */
#define TD_MODEL_MAX_EXPERTS 512

/**
 * How an MoE architecture turns the router's logits into the weights of the selected
 * experts. true (llama/Mixtral): softmax over the top-k logits only, so the k weights sum
 * to 1. false (qwen2moe, norm_topk_prob false): softmax over all experts, then the top-k
 * probabilities as they are.
 */
static inline bool td_moe_norm_topk(const td_model_shape *s)
{
    return s->arch != TD_ARCH_QWEN2MOE;
}

typedef struct td_model {
    td_model_shape shape;
    char name[64];           /* general.name or the file's base name */
    td_weight tok_embd;      /* [n_vocab rows][n_embd cols] */
    td_weight output_norm;   /* f32 [n_embd] */
    td_weight output;        /* [n_vocab][n_embd]; aliases tok_embd when tied */
    td_layer *layers;        /* [n_layer] */
    const float *rope_freqs; /* optional per-dimension divisors [head_dim/2] (llama3), or NULL */
    td_type weight_type;     /* the dominant matrix type, for reports */
    uint64_t fingerprint;    /* hash of shape, types and a sample of the weights */
    size_t weight_bytes;     /* bytes of all tensors */
    gguf_file *gguf;         /* the mapping, or NULL for dummy weights */
    void *owned;             /* dummy weights, or NULL */
    size_t owned_bytes;      /* size of the `owned` mapping */
    void *packed;            /* one allocation for every td_weight.packed, or NULL */
    size_t packed_bytes;     /* its size (reported by td_model_describe) */
    int expert_lo, expert_hi; /* the experts this process holds (td_model_load_part) */
} td_model;

/**
 * Load a model from a GGUF file. Missing tensors, bad shapes, unsupported
 * architectures and types each fail with one message naming the problem.
 * The model keeps the gguf mapping open; the tokenizer reads it via model->gguf.
 */
int td_model_load(td_model **out, const char *path, td_err *err);

/**
 * Build a model over an already opened GGUF (what td_model_load does after
 * gguf_open). On success the model owns `f` (td_model_free closes it); on
 * failure the caller still owns it.
 */
int td_model_from_gguf(td_model **out, gguf_file *f, td_err *err);

/** Random weights at a shape, in memory (`--load-format dummy`). */
int td_model_load_dummy(td_model **out, const td_model_shape *shape, td_type weight_type,
                        uint64_t seed, td_err *err);

/**
 * Expert parallelism: the same models with only part `part` of `n_parts` of each layer's
 * experts made ready, experts [part E / n_parts, (part + 1) E / n_parts) as
 * td_ep_experts splits them. The other experts are not packed, and with dummy weights not
 * made (but for the few rows the fingerprint samples, so that every part has the whole
 * model's fingerprint): their memory is never touched, and they must never be read. A
 * model without experts, or n_parts 1, loads whole.
 */
int td_model_load_part(td_model **out, const char *path, int part, int n_parts, td_err *err);
int td_model_load_dummy_part(td_model **out, const td_model_shape *shape, td_type weight_type,
                             uint64_t seed, int part, int n_parts, td_err *err);

/**
 * The same random model as td_model_load_dummy, with the matrices deferred: the
 * embedding and projection matrices get no host memory (td_weight.gen says how to make
 * them), so a device backend can fill an 8B shape in its own memory in moments. Norms
 * and biases are made here. Only f32 and bf16 weights can be deferred. A CPU engine
 * cannot run such a model.
 */
int td_model_load_dummy_deferred(td_model **out, const td_model_shape *shape, td_type weight_type,
                                 uint64_t seed, td_err *err);

/** Row r of a deferred matrix as f32, before rounding to w->type (w->cols values). */
void td_model_gen_row(const td_weight *w, int64_t r, float *out);

void td_model_free(td_model *m);

/** Map every page of the model's file now (gguf_prefault); dummy weights are in memory
 *  already, and a model that holds only part of its experts (td_model_load_part) is left
 *  as it is, so that the other parts' experts are never read. */
void td_model_prefault(const td_model *m);

/**
 * Expert parallelism: this process runs only experts [lo, hi) of every layer. The pages
 * of the other experts' matrices (the mapped or made originals and their packed copies)
 * are given back to the system; they must not be read again. Returns the bytes released.
 */
size_t td_model_drop_experts(td_model *m, int lo, int hi);

/**
 * Fill a shape from a preset name: tiny, llama-134m, llama-1b, llama3-8b, and the MoE
 * shapes moe-tiny, qwen2moe-tiny, moe-1b, mixtral-8x7b, qwen2moe-a2.7b.
 */
int td_model_preset(const char *name, td_model_shape *out, td_err *err);

/**
 * Check that a shape is usable: dims positive and within sane bounds, heads divide
 * the embedding, kv heads divide heads, head_dim even, rope values finite and
 * positive, expert counts consistent with the architecture (used <= experts, a shared
 * expert only and always for qwen2moe). Fills err with the first problem (TD_EINVAL).
 */
int td_model_shape_validate(const td_model_shape *s, td_err *err);

/** Number of parameters (all elements of all tensors, norms and biases included). */
int64_t td_model_n_params(const td_model_shape *s);

/** Parameters one token uses: td_model_n_params less the experts it is not routed to. */
int64_t td_model_n_active_params(const td_model_shape *s);

/** Human-readable one-line description (arch, dims, type, size). */
void td_model_describe(const td_model *m, char *buf, size_t cap);

#endif
