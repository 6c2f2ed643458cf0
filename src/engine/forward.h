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
#include "model/model.h"
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
    int max_tokens, max_logits, max_ctx, n_threads;
    /* Workspace, planned at start-up for max_tokens rows (shapes per row): */
    float *x;      /* [max_tokens][n_embd] residual stream */
    float *xb;     /* [max_tokens][n_embd] normed input of a sub-layer */
    float *xb2;    /* [max_tokens][n_embd] sub-layer output */
    float *q;      /* [max_tokens][n_head * head_dim] */
    float *k, *v;  /* [max_tokens][n_head_kv * head_dim] */
    float *att;    /* [max_tokens][n_head * head_dim] attention output */
    float *hb, *hb2; /* [max_tokens][n_ff] */
    float *xo;     /* [max_logits][n_embd] final-normed rows for the output matmul */
    float *scores; /* [n_threads][min(n_head, 16)][max_ctx] attention scores */
    void *mm_scratch;
    size_t workspace_bytes;
} fwd_ctx;

/** Bytes of workspace fwd_init allocates for these limits (for the memory plan). */
size_t fwd_workspace_bytes(const td_model *m, int max_tokens, int max_logits, int max_ctx,
                           int n_threads);

int fwd_init(fwd_ctx *f, const td_model *m, kv_pool *kv, td_pool *pool, int max_tokens,
             int max_logits, int max_ctx, td_err *err);
void fwd_free(fwd_ctx *f);

/** Run the batch (n_tokens <= max_tokens, n_logits <= max_logits, positions < max_ctx). */
void fwd_run(fwd_ctx *f, const fwd_batch *b);

#endif
