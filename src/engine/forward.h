/*
 * engine/forward.h - the transformer forward pass over a flat batch of tokens.
 *
 * One call runs every token of the step (prefill chunks and decode tokens of
 * many sequences) through every layer, so each weight matrix is read once per
 * step. K and V of every token are written into the paged cache first, and
 * attention then reads only from the cache; together with batch-invariant
 * kernels this makes a row's result independent of what else is in the batch,
 * how the prompt was chunked, and whether its prefix came from the cache.
 */
#ifndef TD_ENGINE_FORWARD_H
#define TD_ENGINE_FORWARD_H

#include "engine/kvcache.h"
#include "engine/moe.h"
#include "model/model.h"
#include "tandem/ep.h"
#include "util/pool.h"

typedef struct fwd_batch {
    int n_tokens;
    const int32_t *tokens;           /* [n_tokens] */
    const int32_t *pos;              /* [n_tokens] position of the token in its sequence */
    const int32_t *seq;              /* [n_tokens] index into block_tables */
    const int32_t *const *block_tables; /* per sequence: its KV block ids */
    int n_logits;
    const int32_t *logit_rows;       /* [n_logits] batch rows whose next-token logits are needed */
    float *logits;                   /* out: [n_logits][n_vocab] */
    /* Called after each layer has stored the batch's K and V (NULL: not called). */
    void (*kv_stored)(void *user, int layer);
    void *kv_user;
} fwd_batch;

typedef struct fwd_ctx {
    const td_model *model;
    kv_pool *kv;
    td_pool *pool;
    int max_tokens, max_logits, max_ctx, n_threads; /* n_threads: the pool's, guests included */
    /* Workspace, planned at start-up for max_tokens rows (shapes per row): */
    float *x;      /* [max_tokens][n_embd] residual stream */
    float *xb;     /* [max_tokens][n_embd] normed input of a sub-layer */
    float *xb2;    /* [max_tokens][n_embd] sub-layer output */
    float *q;      /* [max_tokens][n_head * head_dim] */
    float *k, *v;  /* [max_tokens][n_head_kv * head_dim] */
    float *att;    /* [max_tokens][n_head * head_dim] attention output */
    float *hb, *hb2; /* [max_tokens][n_ff], or [max_tokens][n_ff_shexp] with experts (the
                        shared expert's; NULL without one) */
    float *xo;     /* [max_logits][n_embd] final-normed rows for the output matmul */
    float *scores; /* [n_threads][min(n_head, 16)][score_ld(max_ctx)] attention scores */
    void *mm_scratch;
    fwd_moe moe;   /* the experts' workspace (model with experts), else all NULL */
    size_t workspace_bytes;
    uint64_t moe_expert_runs; /* experts run (each reading its weights once), summed over
                                 the layers of every step so far */
    td_ep_group *ep;          /* expert parallelism: the group, or NULL */
    int ep_rank;
} fwd_ctx;

/** Bytes of workspace fwd_init allocates for these limits (for the memory plan). */
size_t fwd_workspace_bytes(const td_model *m, int max_tokens, int max_logits, int max_ctx,
                           int n_threads);

int fwd_init(fwd_ctx *f, const td_model *m, kv_pool *kv, td_pool *pool, int max_tokens,
             int max_logits, int max_ctx, td_err *err);
void fwd_free(fwd_ctx *f);

/**
 * Run the batch (n_tokens <= max_tokens, n_logits <= max_logits, positions < max_ctx).
 * Returns 0, or -1 when the expert-parallel group broke (the outputs are then not valid).
 * With expert parallelism a batch of no tokens is a step too: it serves the exchanges.
 */
int fwd_run(fwd_ctx *f, const fwd_batch *b);

/** Expert parallelism: this forward pass is rank `rank` of g (after fwd_init; allocates the
 *  exchange's buffers, counted in workspace_bytes and in moe.ep_bytes). */
int fwd_enable_ep(fwd_ctx *f, td_ep_group *g, int rank, td_err *err);

/* Internal to engine/ (moe.c): y = x W^T for M rows of x (M <= max_tokens), on the pool,
 * reading W's packed copy for decode-sized M; and the same for n weights that read one x
 * (one pool run where their types and widths agree). Batch invariant, like cpu_matmul. */
void fwd__matmul(fwd_ctx *f, float *y, const float *x, const td_weight *w, int M);
void fwd__matmul_same_x(fwd_ctx *f, float *const *y, const float *x, const td_weight *const *w,
                        int n, int M);

#endif
