/*
 * model/model_impl.h - internals shared by model.c (loader, dummy weights) and
 * mkmodel.c (GGUF writer of random models): the list of tensors a shape implies
 * and the random-weight generator, so that `--load-format dummy` and a file from
 * `tandem mkmodel` with the same (shape, type, seed) hold identical weights.
 */
#ifndef TD_MODEL_MODEL_IMPL_H
#define TD_MODEL_MODEL_IMPL_H

#include "model/model.h"

/* What a tensor is, which decides its type and its random distribution. */
typedef enum td_model__kind {
    TD_MODEL__EMBD,   /* token embedding: weight type, uniform in [-1, 1) */
    TD_MODEL__MATRIX, /* projection: weight type, uniform with std 1/sqrt(cols) */
    TD_MODEL__NORM,   /* RMSNorm gain: f32, all 1.0 */
    TD_MODEL__BIAS,   /* qwen2 q/k/v bias: f32, uniform in [-0.1, 0.1) */
    TD_MODEL__ROUTER, /* MoE router (ffn_gate_inp): written f32 as llama.cpp keeps it, loaded
                         in any matrix type; uniform with std 1/sqrt(cols) */
    TD_MODEL__GATE,   /* qwen2moe shared expert's gate vector: f32, std 1/sqrt(cols) */
} td_model__kind;

typedef struct td_model__tensor {
    char name[48];
    td_model__kind kind;
    td_type type;
    int64_t cols, rows; /* GGUF ne[0], ne[1] (for expert tensors: one expert's rows) */
    int64_t n_mats;     /* GGUF ne[2]: n_expert for the 3-D expert tensors, else 1 */
    int n_dims;         /* 1 for vectors, 2 for matrices, 3 for expert tensors */
    td_weight *slot;    /* where the loaded view goes in the model (NULL without a model);
                           it holds all rows * n_mats rows as one matrix */
} td_model__tensor;

/**
 * The tensors of a shape, in file order: token_embd, output_norm, output (unless
 * tied), then per layer attn_norm, attn_q, attn_k, attn_v (+ biases for qwen2 and
 * qwen2moe), attn_output, ffn_norm, then ffn_gate, ffn_up, ffn_down for a dense FFN, or
 * ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps (+ ffn_gate_inp_shexp,
 * ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp for qwen2moe) with experts. `m` (may be
 * NULL) gives each entry's slot; m->layers must already be allocated. Returns a malloc'd
 * array.
 */
td_model__tensor *td_model__plan(const td_model_shape *s, td_type wtype, td_model *m, int *n_out);

/**
 * Random data for rows [row0, row0 + n_rows) of a planned tensor, in its type (rows
 * counted over all rows * n_mats rows of an expert tensor).
 * Each row is seeded from (seed, tensor name, row index), so the result does not
 * depend on how the rows are chunked or which thread fills them.
 * scratch holds t->cols floats.
 */
void td_model__gen_rows(const td_model__tensor *t, uint64_t seed, int64_t row0, int64_t n_rows,
                        void *dst, float *scratch);

/** Check that a weight type is usable for a shape (block sizes divide every row). */
int td_model__check_wtype(const td_model_shape *s, td_type wtype, td_err *err);

#endif
