/*
 * engine/moe.h - the mixture-of-experts FFN of the CPU forward pass (forward.c calls it
 * for models with shape.n_expert > 0).
 *
 * Per step, for the T rows of the batch: the router's logits, the top-k experts of each
 * row and their weights (td_moe_norm_topk says how), then the rows grouped by expert so
 * that each selected expert's weights are read once for all the rows routed to it (one
 * gate/up matmul and one down matmul per expert, on that expert's contiguous slice of
 * the 3-D tensors), SwiGLU, and the weighted outputs added back into each row in
 * ascending k order; qwen2moe adds its shared expert scaled by a sigmoid gate. Every
 * step of that is a function of the row alone, so a row's output does not depend on what
 * else is in the batch.
 */
#ifndef TD_ENGINE_MOE_H
#define TD_ENGINE_MOE_H

#include "model/model.h"

struct fwd_ctx;

/* The MoE workspace, sized at start-up for max_tokens rows (R = max_tokens * n_expert_used
 * gathered rows). Part of the forward pass's workspace (fwd_workspace_bytes counts it). */
typedef struct fwd_moe {
    float *logits;      /* [max_tokens][n_expert] router logits */
    int32_t *sel;       /* [max_tokens][n_expert_used] selected experts, best first */
    float *weight;      /* [max_tokens][n_expert_used] their routing weights */
    int32_t *slot;      /* [max_tokens][n_expert_used] gathered row of (token, j) */
    int32_t *row_token; /* [R] the token each gathered row came from */
    int32_t *start;     /* [n_expert + 1] first gathered row of each expert */
    int32_t *fill;      /* [n_expert] rows placed so far per expert (grouping scratch) */
    float *xg;          /* [R][n_embd] gathered inputs, grouped by expert, tokens ascending */
    float *hg, *hg2;    /* [R][n_ff_exp] the experts' gate and up outputs */
    float *yg;          /* [R][n_embd] the experts' outputs */
    float *shexp_gate;  /* [max_tokens] sigmoid gate of the shared expert (qwen2moe) */
    /* Expert parallelism only: where this rank runs the experts it holds for the rows of
     * every rank, max_tokens rows at a time (engine/ep.h). */
    float *xs, *hs, *hs2, *ys; /* [max_tokens][n_embd], [max_tokens][n_ff_exp] x2, [..][n_embd] */
    size_t bytes;       /* what moe_init allocated */
    size_t ep_bytes;    /* of which the expert exchange's (xs .. ys) */
} fwd_moe;

/** Bytes moe_init allocates for max_tokens rows (0 for a dense model); ep: with the
 *  expert exchange's buffers. */
size_t moe_workspace_bytes(const td_model *m, int max_tokens, bool ep);

/** Allocate the workspace (nothing for a dense model). 0 or TD_ENOMEM. */
int moe_init(fwd_moe *w, const td_model *m, int max_tokens, bool ep);
void moe_free(fwd_moe *w);

/**
 * out[t] = MoE FFN of x[t] for t < T (x: the FFN-normed rows [T][n_embd], out: [T][n_embd],
 * not aliasing x). Runs on f's thread pool; uses f->hb and f->hb2 for the shared expert and
 * f->moe for everything else; adds the number of experts run to f->moe_expert_runs.
 * With expert parallelism (f->ep) every rank calls it for every MoE layer of every step,
 * T = 0 included: the rows go to the ranks holding their experts and back. Returns 0, or
 * -1 when the group broke (out is then not valid).
 */
int moe_ffn(struct fwd_ctx *f, const td_layer *L, const float *x, float *out, int T);

/**
 * Routing of one row (internal; exposed for the tests): the k best of n_expert logits,
 * best first, ties to the lower index, into sel[0..k); their weights into weight[0..k):
 * with norm_topk the softmax of the k selected logits, else each one's probability under
 * the softmax of all n_expert logits.
 */
void moe__route_row(const float *logits, int n_expert, int k, bool norm_topk, int32_t *sel,
                    float *weight);

#endif
