/*
 * engine/forward.c - llama / qwen2 / qwen2moe forward pass on the CPU backend.
 *
 * Per layer, for the T tokens of the batch:
 *   xb  = rmsnorm(x) * attn_norm
 *   q,k,v = xb Wq^T (+bq), xb Wk^T (+bk), xb Wv^T (+bv)       [T][...]
 *   rope(q, k) at each token's position; k, v -> paged cache
 *   att = softmax(q k^T / sqrt(d)) v  over the cache, per head  [T][n_head*d]
 *   x  += att Wo^T
 *   xb  = rmsnorm(x) * ffn_norm
 *   x  += (silu(xb Wg^T) * (xb Wu^T)) Wd^T     (with experts: x += moe_ffn(xb), moe.c)
 * then logits = rmsnorm(x[r]) * out_norm Wout^T for the rows that need them.
 */
#include "engine/forward.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "engine/ep.h"
#include "util/crc32c.h"

/* Most heads one attention work item covers (each thread keeps their scores). */
#define ATT_MAX_HEADS 16
/* Rows of one sequence whose attention runs together (att_rows). */
#define ATT_TILE_ROWS 4

static int q_dim(const td_model *m)
{
    return m->shape.n_head * m->shape.head_dim;
}

static int kv_dim(const td_model *m)
{
    return m->shape.n_head_kv * m->shape.head_dim;
}

/* Heads whose scores one thread holds at a time (see task_attention). */
static int score_heads(const td_model *m)
{
    return TD_MIN(m->shape.n_head, ATT_MAX_HEADS);
}

/* Width of the dense FFN's hidden rows (hb, hb2): n_ff, or with experts the shared
 * expert's (0 when there is none; the routed experts have their own buffers in moe.c). */
static int dense_ff(const td_model *m)
{
    return m->shape.n_expert ? m->shape.n_ff_shexp : m->shape.n_ff;
}

static size_t mm_scratch_bytes(const td_model *m, int rows, int n_threads)
{
    const td_model_shape *s = &m->shape;
    int widest = TD_MAX(TD_MAX(s->n_embd, dense_ff(m)), TD_MAX(q_dim(m), s->n_ff_exp));
    size_t most = 0;
    const td_type types[] = {TD_TYPE_F32, TD_TYPE_F16, TD_TYPE_BF16, TD_TYPE_Q8_0, TD_TYPE_Q4_0};
    for (size_t i = 0; i < TD_ARRAY_LEN(types); i++)
        most = TD_MAX(most, cpu_matmul_scratch_size(types[i], rows, widest, n_threads));
    return most;
}

/* Floats between two heads' scores: max_ctx rounded up to a cache line, and an odd
 * number of cache lines, so that the heads' rows never lie a multiple of 4 KiB apart.
 * Decode attention stores one score per head for each position; at a 4 KiB stride
 * (max_ctx 2048: 8 KiB) those stores would all fall in one L1 set. */
static size_t score_ld(int max_ctx)
{
    size_t ld = ((size_t)max_ctx + 15) & ~(size_t)15;
    return (ld / 16) % 2 ? ld : ld + 16;
}

size_t fwd_workspace_bytes(const td_model *m, int max_tokens, int max_logits, int max_ctx,
                           int n_threads)
{
    const td_model_shape *s = &m->shape;
    size_t T = (size_t)max_tokens;
    size_t floats = T * (size_t)s->n_embd * 3 + T * (size_t)q_dim(m) * 2 +
                    T * (size_t)kv_dim(m) * 2 + T * (size_t)dense_ff(m) * 2 +
                    (size_t)max_logits * (size_t)s->n_embd +
                    (size_t)n_threads * (size_t)score_heads(m) * score_ld(max_ctx);
    int rows = TD_MAX(max_tokens, max_logits);
    return floats * sizeof(float) + mm_scratch_bytes(m, rows, n_threads) + 64 * 16 +
           moe_workspace_bytes(m, max_tokens, false);
}

int fwd_init(fwd_ctx *f, const td_model *m, kv_pool *kv, td_pool *pool, int max_tokens,
             int max_logits, int max_ctx, td_err *err)
{
    memset(f, 0, sizeof(*f));
    const td_model_shape *s = &m->shape;
    f->model = m;
    f->kv = kv;
    f->pool = pool;
    f->max_tokens = max_tokens;
    f->max_logits = max_logits;
    f->max_ctx = max_ctx;
    f->n_threads = td_pool_size(pool);
    size_t T = (size_t)max_tokens;
    struct { float **dst; size_t n; } bufs[] = {
        {&f->x, T * s->n_embd},   {&f->xb, T * s->n_embd},       {&f->xb2, T * s->n_embd},
        {&f->q, T * q_dim(m)},    {&f->k, T * kv_dim(m)},        {&f->v, T * kv_dim(m)},
        {&f->att, T * q_dim(m)},  {&f->hb, T * dense_ff(m)},     {&f->hb2, T * dense_ff(m)},
        {&f->xo, (size_t)max_logits * s->n_embd},
        {&f->scores, (size_t)f->n_threads * score_heads(m) * score_ld(max_ctx)},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(bufs); i++) {
        if (!bufs[i].n) continue; /* hb, hb2 of an MoE model without a shared expert */
        *bufs[i].dst = td_aligned_alloc(bufs[i].n * sizeof(float));
        if (!*bufs[i].dst) goto oom;
        f->workspace_bytes += bufs[i].n * sizeof(float);
    }
    size_t mm = mm_scratch_bytes(m, TD_MAX(max_tokens, max_logits), f->n_threads);
    f->mm_scratch = td_aligned_alloc(mm);
    if (!f->mm_scratch) goto oom;
    f->workspace_bytes += mm;
    if (moe_init(&f->moe, m, max_tokens, false)) goto oom;
    f->workspace_bytes += f->moe.bytes;
    return 0;
oom:
    fwd_free(f);
    return td_err_set(err, TD_ENOMEM, "forward: cannot allocate the activation workspace");
}

int fwd_enable_ep(fwd_ctx *f, td_ep_group *g, int rank, td_err *err)
{
    f->workspace_bytes -= f->moe.bytes;
    moe_free(&f->moe);
    if (moe_init(&f->moe, f->model, f->max_tokens, true))
        return td_err_set(err, TD_ENOMEM, "forward: cannot allocate the expert exchange's buffers");
    f->workspace_bytes += f->moe.bytes;
    f->ep = g;
    f->ep_rank = rank;
    ep__attach(g, rank, f->moe.xg, f->moe.start, f->moe.yg);
    return 0;
}

/* Expert parallelism, a step with no rows: every MoE layer's exchange still runs (this
 * rank holds experts that the other ranks' rows need). */
static int ep_empty_step(fwd_ctx *f)
{
    for (int il = 0; il < f->model->shape.n_layer; il++)
        if (moe_ffn(f, &f->model->layers[il], NULL, NULL, 0)) return -1;
    return 0;
}

void fwd_free(fwd_ctx *f)
{
    float *bufs[] = {f->x, f->xb, f->xb2, f->q, f->k, f->v, f->att, f->hb, f->hb2, f->xo,
                     f->scores};
    for (size_t i = 0; i < TD_ARRAY_LEN(bufs); i++) td_aligned_free(bufs[i]);
    td_aligned_free(f->mm_scratch);
    moe_free(&f->moe);
    memset(f, 0, sizeof(*f));
}

/* ---- row-parallel tasks ----------------------------------------------------- */

typedef struct task {
    fwd_ctx *f;
    const fwd_batch *b;
    const td_layer *layer;
    const td_layer *next_layer; /* for the fused residual + next norm */
    int il;
    int n_rows;
    const int32_t *row_map; /* compacted row i is batch row row_map[i]; NULL = identity */
    int64_t next_item; /* attention work queue (atomic) */
} task;

/*
 * Decode-sized batches (M <= PACKED_MAX_M rows) read a weight's packed copy when it has
 * one: measured on Sapphire Rapids, it makes batch-32 decode 20% faster, while a 512-row
 * prefill chunk ran 20% slower from it than from the GGUF layout (which repacks each panel
 * once per call and amortises that over the rows).
 */
#define PACKED_MAX_M 64

/* One output of cpu_matmul_multi for weight w with M rows of input. */
static cpu_mm_out mm_out(float *y, const td_weight *w, int M)
{
    bool packed = w->packed && M <= PACKED_MAX_M;
    return (cpu_mm_out){.y = y, .ldy = w->rows, .w = packed ? w->packed : w->data,
                        .w_row_bytes = w->row_bytes, .N = (int)w->rows, .packed = packed};
}

void fwd__matmul(fwd_ctx *f, float *y, const float *x, const td_weight *w, int M)
{
    cpu_mm_out o = mm_out(y, w, M);
    cpu_matmul_multi(f->pool, &o, 1, x, w->cols, w->type, M, (int)w->cols, f->mm_scratch);
}

/*
 * y[i] = x w[i]^T for n weights that read the same x (Q/K/V, gate/up): one pool run
 * when the weights share a type and width, so one join (and for quantized weights one
 * quantization of x) instead of n; each output is bit-identical either way.
 */
void fwd__matmul_same_x(fwd_ctx *f, float *const *y, const float *x, const td_weight *const *w,
                        int n, int M)
{
    bool same = true;
    for (int i = 1; i < n; i++)
        same = same && w[i]->type == w[0]->type && w[i]->cols == w[0]->cols;
    if (!same) {
        for (int i = 0; i < n; i++) fwd__matmul(f, y[i], x, w[i], M);
        return;
    }
    cpu_mm_out outs[CPU_MM_MAX_OUT];
    TD_ASSERT(n <= CPU_MM_MAX_OUT);
    for (int i = 0; i < n; i++)
        outs[i] = mm_out(y[i], w[i], M);
    cpu_matmul_multi(f->pool, outs, n, x, w[0]->cols, w[0]->type, M, (int)w[0]->cols,
                     f->mm_scratch);
}

/* x[t] = embedding(token[t]); xb[t] = rmsnorm(x[t]) * layer0.attn_norm */
static void task_embed(void *ctx, int ith, int nth)
{
    task *tk = ctx;
    fwd_ctx *f = tk->f;
    const td_model *m = f->model;
    int d = m->shape.n_embd;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        int32_t id = tk->b->tokens[t];
        const uint8_t *row = (const uint8_t *)m->tok_embd.data + (size_t)id * m->tok_embd.row_bytes;
        cpu_dequant_row(m->tok_embd.type, row, f->x + t * d, d);
        cpu_rmsnorm(f->xb + t * d, f->x + t * d, tk->next_layer->attn_norm.data, d,
                    m->shape.rms_eps);
    }
}

/* Add biases, apply RoPE to q and k, and store k, v into the paged cache. */
static void task_rope_store(void *ctx, int ith, int nth)
{
    task *tk = ctx;
    fwd_ctx *f = tk->f;
    const td_model_shape *s = &f->model->shape;
    const td_layer *L = tk->layer;
    const kv_pool *kv = f->kv;
    int hd = s->head_dim, qd = q_dim(f->model), kd = kv_dim(f->model);
    int neox = s->rope_type == TD_ROPE_NEOX;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        float *q = f->q + t * qd, *k = f->k + t * kd, *v = f->v + t * kd;
        if (L->bq.data) cpu_add(q, L->bq.data, qd);
        if (L->bk.data) cpu_add(k, L->bk.data, kd);
        if (L->bv.data) cpu_add(v, L->bv.data, kd);
        int32_t pos = tk->b->pos[t];
        cpu_rope_heads(q, s->n_head, hd, hd, pos, s->rope_theta, s->rope_freq_scale,
                       f->model->rope_freqs, neox);
        cpu_rope_heads(k, s->n_head_kv, hd, hd, pos, s->rope_theta, s->rope_freq_scale,
                       f->model->rope_freqs, neox);
        const int32_t *table = tk->b->block_tables[tk->b->seq[t]];
        int block = table[pos / kv->block_size];
        size_t off = (size_t)(pos % kv->block_size) * kv->token_bytes;
        cpu_quant_row(kv->dtype, k, kv_k(kv, tk->il, block) + off, kd);
        cpu_quant_row(kv->dtype, v, kv_v(kv, tk->il, block) + off, kd);
    }
}

/* Checksum the blocks this layer's rows completed (kv_pool.crc). Separate from
 * task_rope_store because a block's slots may have been written by several threads. */
static void task_block_crc(void *ctx, int ith, int nth)
{
    task *tk = ctx;
    kv_pool *kv = tk->f->kv;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        int32_t pos = tk->b->pos[t];
        if ((pos + 1) % kv->block_size) continue;
        int block = tk->b->block_tables[tk->b->seq[t]][pos / kv->block_size];
        size_t i = (size_t)tk->il * (size_t)kv->n_blocks + (size_t)block;
        kv->crc[i] = td_crc32c(0, kv_k(kv, tk->il, block), kv->block_bytes);
        kv->crc_ok[i] = 1;
    }
}

/* How many KV rows ahead attention prefetches: about 8 x 1.5 KiB in llama-134m, enough
 * to cover memory latency without crowding the cache (BENCHMARKS.md, issue 6). */
#define ATT_PREFETCH_ROWS 8
/* Fewest bytes of a row an item must read for attention to walk row by row. */
#define ATT_ROW_MIN_BYTES 512

/* Heads per attention item: all of them when there are enough tokens to share among
 * the threads, fewer when the batch is small (batch-1 decode still uses every thread). */
static int att_heads(const fwd_ctx *f, int n_rows)
{
    int n_head = f->model->shape.n_head;
    int nt = td_pool_active(f->pool); /* this run's threads (borrowed CPUs come and go) */
    /* A lone thread has nothing to balance: whole rows read the cache in order. */
    int chunks = nt == 1 ? 1 : TD_MIN(n_head, (4 * nt + n_rows - 1) / n_rows);
    /* A decode row walks the cache row by row only when its item covers half a row or
     * more (task_attention). Where half a row is big enough for that, and two items per
     * row still give every thread one, they read in address order and beat more,
     * narrower items that read it strided: at batch 1 with 2 threads, attention took 18%
     * of a step in 2-head items. */
    if (chunks > 2 && 2 * n_rows >= nt && f->kv->token_bytes / 2 >= ATT_ROW_MIN_BYTES)
        chunks = 2;
    chunks = TD_MAX(chunks, (n_head + ATT_MAX_HEADS - 1) / ATT_MAX_HEADS);
    return (n_head + chunks - 1) / chunks;
}

/* Prefetch bytes [from, to) of KV row j + ATT_PREFETCH_ROWS, which lies in this block
 * (blk) or the next one (nxt; NULL past the last block), into the L2: prefetches into the
 * L1 each hold one of its few miss buffers until the line arrives, which capped the rows
 * in flight (decode at batch 8, one thread, 1,024-token contexts: +31-41% with the L2;
 * BENCHMARKS.md). */
static inline void att_prefetch(const uint8_t *blk, const uint8_t *nxt, int j, int bs,
                                size_t row_bytes, size_t from, size_t to)
{
    int r = j + ATT_PREFETCH_ROWS;
    const uint8_t *p = r < bs ? blk + (size_t)r * row_bytes : nxt;
    if (!p || r >= 2 * bs) return; /* blocks smaller than the distance: no prefetch */
    if (r >= bs) p += (size_t)(r - bs) * row_bytes;
    for (size_t o = from; o < to; o += 64) __builtin_prefetch(p + o, 0, 2);
}

/*
 * Attention: one work item is (token, a run of up to att_heads consecutive heads), or, in
 * a batch with prefill chunks and rows enough to share, (up to ATT_TILE_ROWS tokens,
 * heads).
 * Items are taken from a shared counter because their cost grows with the position;
 * which thread computes an item, and which heads share it, does not change any head's
 * arithmetic (the same kernel arithmetic in the same position order), so the result
 * stays deterministic.
 *
 * Memory order: a token's K (and V) row holds every KV head side by side (token_bytes),
 * and a block holds block_size rows. Both orders below do the same arithmetic per head
 * and position, so they give equal bits:
 *   - a row alone in the batch for its sequence (a decode token) reads its sequence's
 *     KV from memory, once: it walks the cache row by row, each row for all the item's
 *     heads at once (cpu_dot_kv_heads, cpu_axpy_kv_heads), so each block is read in
 *     address order, and prefetches ATT_PREFETCH_ROWS rows ahead, into the next block of
 *     the sequence. One head at a time down a block is a strided walk that the hardware
 *     prefetchers do not follow: decode attention ran at about half the machine's read
 *     bandwidth that way (BENCHMARKS.md);
 *   - rows of a prefill chunk share their sequence's KV, which stays in cache: one head
 *     at a time over a block's positions (cpu_dot_kv_multi) loads q once per 8 keys and
 *     is faster there; and up to ATT_TILE_ROWS rows of one chunk together
 *     (cpu_dot_kv_rows, cpu_axpy_kv_rows) load each key and value vector once for all of
 *     them rather than once per row: prefill attention -39% in time (llama-134m pp512:
 *     f16 +5-15%, q8_0 +16%; BENCHMARKS.md).
 */
/* What every attention item of one task shares. */
typedef struct att_env {
    task *tk;
    const kv_pool *kv;
    int hd, qd, bs, group, n_head;
    size_t head_bytes, rb, ld;
    float scale;
} att_env;

/* Whether batch row r is the only row of its sequence in the batch (a decode token). */
static bool att_single(const task *tk, int r)
{
    const int32_t *seq = tk->b->seq;
    return (r == 0 || seq[r - 1] != seq[r]) && (r + 1 >= tk->b->n_tokens || seq[r + 1] != seq[r]);
}

/* Row t (batch row r), heads [h0, h1): its scores in sc (a row of ld per head). */
static void att_row(const att_env *e, float *sc, int t, int h0, int h1)
{
    task *tk = e->tk;
    fwd_ctx *f = tk->f;
    const kv_pool *kv = e->kv;
    const int hd = e->hd, bs = e->bs, group = e->group, nh = h1 - h0;
    const size_t head_bytes = e->head_bytes, rb = e->rb, ld = e->ld;
    const float *q = f->q + (size_t)t * e->qd + (size_t)h0 * hd;
    float *out = f->att + (size_t)t * e->qd + (size_t)h0 * hd;
    int r = tk->row_map ? tk->row_map[t] : t;
    const int32_t *table = tk->b->block_tables[tk->b->seq[r]];
    int n = tk->b->pos[r] + 1;
    /* The part of each row these heads read. */
    size_t pf0 = (size_t)(h0 / group) * head_bytes;
    size_t pf1 = (size_t)((h1 - 1) / group + 1) * head_bytes;
    /* Walking rows pays when the item reads at least half of each row, and enough of it to
     * outweigh a call per row (a tiny model's whole row can be 64 bytes). */
    bool alone = 2 * nh >= e->n_head && pf1 - pf0 >= ATT_ROW_MIN_BYTES && att_single(tk, r);
    for (int j0 = 0; j0 < n; j0 += bs) {
        const uint8_t *kb = kv_k(kv, tk->il, table[j0 / bs]);
        const uint8_t *kn = j0 + bs < n ? kv_k(kv, tk->il, table[j0 / bs + 1]) : NULL;
        int jn = TD_MIN(bs, n - j0);
        if (!alone) {
            for (int i = 0; i < nh; i++)
                cpu_dot_kv_multi(sc + (size_t)i * ld + j0, q + (size_t)i * hd,
                                 kb + (size_t)((h0 + i) / group) * head_bytes, rb, kv->dtype, hd,
                                 jn);
            continue;
        }
        for (int j = 0; j < jn; j++) {
            att_prefetch(kb, kn, j, bs, rb, pf0, pf1);
            cpu_dot_kv_heads(sc + j0 + j, ld, q, kb + (size_t)j * rb, head_bytes, kv->dtype, hd, h0,
                             nh, group);
        }
    }
    for (int i = 0; i < nh; i++) {
        float *sh = sc + (size_t)i * ld;
        for (int j = 0; j < n; j++)
            sh[j] *= e->scale;
        cpu_softmax(sh, n);
    }
    memset(out, 0, (size_t)nh * hd * sizeof(float));
    for (int j0 = 0; j0 < n; j0 += bs) {
        const uint8_t *vb = kv_v(kv, tk->il, table[j0 / bs]);
        const uint8_t *vn = j0 + bs < n ? kv_v(kv, tk->il, table[j0 / bs + 1]) : NULL;
        int jn = TD_MIN(bs, n - j0);
        if (!alone) {
            for (int i = 0; i < nh; i++)
                cpu_axpy_kv_multi(out + (size_t)i * hd, sc + (size_t)i * ld + j0,
                                  vb + (size_t)((h0 + i) / group) * head_bytes, rb, kv->dtype, hd,
                                  jn);
            continue;
        }
        for (int j = 0; j < jn; j++) {
            att_prefetch(vb, vn, j, bs, rb, pf0, pf1);
            cpu_axpy_kv_heads(out, sc + j0 + j, ld, vb + (size_t)j * rb, head_bytes, kv->dtype, hd,
                              h0, nh, group);
        }
    }
}

/*
 * Rows t0 .. t0 + nr - 1 of one sequence (a prefill chunk's), heads [h0, h1): one head at a
 * time, every KV vector read once for all the rows (cpu_dot_kv_rows, cpu_axpy_kv_rows) over
 * the keys they all see, and row by row past the shortest row's length. The same arithmetic
 * per row, head and key as att_row's, in the same key order, so the same bits.
 * sc holds nr rows of ld.
 */
static void att_rows(const att_env *e, float *sc, int t0, int nr, int h0, int h1)
{
    task *tk = e->tk;
    fwd_ctx *f = tk->f;
    const kv_pool *kv = e->kv;
    const int hd = e->hd, qd = e->qd, bs = e->bs;
    const size_t ld = e->ld, rb = e->rb;
    int n[ATT_TILE_ROWS], n_min = INT_MAX, n_max = 0;
    for (int i = 0; i < nr; i++) {
        int r = tk->row_map ? tk->row_map[t0 + i] : t0 + i;
        n[i] = tk->b->pos[r] + 1;
        n_min = TD_MIN(n_min, n[i]);
        n_max = TD_MAX(n_max, n[i]);
    }
    int r0 = tk->row_map ? tk->row_map[t0] : t0;
    const int32_t *table = tk->b->block_tables[tk->b->seq[r0]];
    for (int h = h0; h < h1; h++) {
        const size_t kvo = (size_t)(h / e->group) * e->head_bytes;
        const float *q = f->q + (size_t)t0 * qd + (size_t)h * hd;
        float *out = f->att + (size_t)t0 * qd + (size_t)h * hd;
        for (int j0 = 0; j0 < n_max; j0 += bs) {
            const uint8_t *kb = kv_k(kv, tk->il, table[j0 / bs]) + kvo;
            int jc = TD_MAX(0, TD_MIN(bs, n_min - j0)); /* keys every row sees */
            if (jc) cpu_dot_kv_rows(sc + j0, ld, q, qd, nr, kb, rb, kv->dtype, hd, jc);
            for (int i = 0; i < nr; i++) {
                int jn = TD_MIN(bs, n[i] - j0);
                if (jn > jc)
                    cpu_dot_kv_multi(sc + (size_t)i * ld + j0 + jc, q + (size_t)i * qd,
                                     kb + (size_t)jc * rb, rb, kv->dtype, hd, jn - jc);
            }
        }
        for (int i = 0; i < nr; i++) {
            float *sh = sc + (size_t)i * ld;
            for (int j = 0; j < n[i]; j++)
                sh[j] *= e->scale;
            cpu_softmax(sh, n[i]);
            memset(out + (size_t)i * qd, 0, (size_t)hd * sizeof(float));
        }
        for (int j0 = 0; j0 < n_max; j0 += bs) {
            const uint8_t *vb = kv_v(kv, tk->il, table[j0 / bs]) + kvo;
            int jc = TD_MAX(0, TD_MIN(bs, n_min - j0));
            if (jc) cpu_axpy_kv_rows(out, qd, sc + j0, ld, nr, vb, rb, kv->dtype, hd, jc);
            for (int i = 0; i < nr; i++) {
                int jn = TD_MIN(bs, n[i] - j0);
                if (jn > jc)
                    cpu_axpy_kv_multi(out + (size_t)i * qd, sc + (size_t)i * ld + j0 + jc,
                                      vb + (size_t)jc * rb, rb, kv->dtype, hd, jn - jc);
            }
        }
    }
}

static void task_attention(void *ctx, int ith, int nth)
{
    task *tk = ctx;
    fwd_ctx *f = tk->f;
    const td_model_shape *s = &f->model->shape;
    const kv_pool *kv = f->kv;
    att_env e = {.tk = tk,
                 .kv = kv,
                 .hd = s->head_dim,
                 .qd = q_dim(f->model),
                 .bs = kv->block_size,
                 .group = s->n_head / s->n_head_kv,
                 .n_head = s->n_head,
                 .head_bytes = (size_t)s->head_dim * (size_t)td_type_block_bytes(kv->dtype),
                 .rb = kv->token_bytes,
                 .ld = score_ld(f->max_ctx),
                 .scale = 1.0f / sqrtf((float)s->head_dim)};
    const int hc = att_heads(f, tk->n_rows);
    TD_ASSERT(hc <= score_heads(f->model));
    const int chunks = (s->n_head + hc - 1) / hc;
    float *sc = f->scores + (size_t)ith * score_heads(f->model) * e.ld;
    /* Batches with prefill chunks, and rows enough to share: items of up to ATT_TILE_ROWS
     * rows, whose runs of one sequence's rows go through att_rows; otherwise one row an
     * item (decode batches keep their finer items). */
    bool chunks_in = false;
    for (int t = 0; t + 1 < tk->n_rows && !chunks_in; t++) {
        int r = tk->row_map ? tk->row_map[t] : t, rn = tk->row_map ? tk->row_map[t + 1] : t + 1;
        chunks_in = tk->b->seq[r] == tk->b->seq[rn];
    }
    const int G =
        chunks_in && tk->n_rows >= 8 * nth && score_heads(f->model) >= ATT_TILE_ROWS
            ? ATT_TILE_ROWS
            : 1;
    const int n_groups = (tk->n_rows + G - 1) / G;
    int64_t n_items = (int64_t)n_groups * chunks;
    for (;;) {
        int64_t item = __atomic_fetch_add(&tk->next_item, 1, __ATOMIC_RELAXED);
        if (item >= n_items) break;
        int g = (int)(item / chunks), h0 = (int)(item % chunks) * hc;
        int h1 = TD_MIN(s->n_head, h0 + hc);
        int t1 = TD_MIN(tk->n_rows, g * G + G);
        for (int t = g * G; t < t1;) {
            /* The run of rows from t that share t's sequence, none of them alone in it. */
            int r = tk->row_map ? tk->row_map[t] : t, nr = 1;
            while (t + nr < t1 && !att_single(tk, r)) {
                int rn = tk->row_map ? tk->row_map[t + nr] : t + nr;
                if (tk->b->seq[rn] != tk->b->seq[r]) break;
                nr++;
            }
            if (nr > 1)
                att_rows(&e, sc, t, nr, h0, h1);
            else
                att_row(&e, sc, t, h0, h1);
            t += nr;
        }
    }
}

/* x += xb2; xb = rmsnorm(x) * norm   (norm is the next sub-layer's; NULL: skip) */
static void task_residual_norm(void *ctx, int ith, int nth)
{
    task *tk = ctx;
    fwd_ctx *f = tk->f;
    int d = f->model->shape.n_embd;
    const float *norm = tk->next_layer ? tk->next_layer->attn_norm.data : NULL;
    if (tk->layer) norm = tk->layer->ffn_norm.data; /* after attention: the FFN norm */
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        cpu_add(f->x + t * d, f->xb2 + t * d, d);
        if (norm) cpu_rmsnorm(f->xb + t * d, f->x + t * d, norm, d, f->model->shape.rms_eps);
    }
}

static void task_silu(void *ctx, int ith, int nth)
{
    task *tk = ctx;
    fwd_ctx *f = tk->f;
    int ff = f->model->shape.n_ff;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) cpu_silu_mul(f->hb + t * ff, f->hb + t * ff, f->hb2 + t * ff, ff);
}

static void task_final_norm(void *ctx, int ith, int nth)
{
    task *tk = ctx;
    fwd_ctx *f = tk->f;
    const td_model *m = f->model;
    int d = m->shape.n_embd;
    int64_t r0, r1;
    td_split_range(tk->b->n_logits, ith, nth, &r0, &r1);
    for (int64_t i = r0; i < r1; i++) {
        size_t row = tk->row_map ? (size_t)i : (size_t)tk->b->logit_rows[i];
        cpu_rmsnorm(f->xo + i * d, f->x + row * d, m->output_norm.data, d, m->shape.rms_eps);
    }
}

/* Move the residual and query rows of the logit rows to the front (rows ascend, so
 * copying forward in order never overwrites a row still to be read). */
static void compact_rows(fwd_ctx *f, const fwd_batch *b)
{
    int d = f->model->shape.n_embd, qd = q_dim(f->model);
    for (int i = 0; i < b->n_logits; i++) {
        int r = b->logit_rows[i];
        TD_ASSERT(r >= i && (i == 0 || r > b->logit_rows[i - 1]));
        if (r == i) continue;
        memcpy(f->x + (size_t)i * d, f->x + (size_t)r * d, (size_t)d * sizeof(float));
        memcpy(f->q + (size_t)i * qd, f->q + (size_t)r * qd, (size_t)qd * sizeof(float));
    }
}

int fwd_run(fwd_ctx *f, const fwd_batch *b)
{
    const td_model *m = f->model;
    const td_model_shape *s = &m->shape;
    int T = b->n_tokens;
    if (T == 0 && f->ep) return ep_empty_step(f);
    TD_ASSERT(T > 0 && T <= f->max_tokens && b->n_logits <= f->max_logits);
    task tk = {.f = f, .b = b, .n_rows = T, .next_layer = &m->layers[0]};
    bool fills_block = false; /* some row writes the last slot of a block */
    for (int t = 0; t < T && f->kv->crc && !fills_block; t++)
        fills_block = (b->pos[t] + 1) % f->kv->block_size == 0;
    td_pool_run(f->pool, task_embed, &tk);
    for (int il = 0; il < s->n_layer; il++) {
        const td_layer *L = &m->layers[il];
        tk.il = il;
        fwd__matmul_same_x(f, (float *const[]){f->q, f->k, f->v}, f->xb,
                           (const td_weight *const[]){&L->wq, &L->wk, &L->wv}, 3, T);
        tk.layer = L;
        td_pool_run(f->pool, task_rope_store, &tk);
        if (fills_block) td_pool_run(f->pool, task_block_crc, &tk);
        if (b->kv_stored) b->kv_stored(b->kv_user, il);
        if (il == s->n_layer - 1 && b->n_logits < T) {
            /* The last layer's output matters only for the rows that produce logits, and
             * every row's K and V are already stored: finish just those rows. */
            if (b->n_logits == 0) /* with experts held elsewhere: still serve the exchange */
                return f->ep ? moe_ffn(f, L, NULL, NULL, 0) : 0;
            compact_rows(f, b);
            tk.row_map = b->logit_rows;
            tk.n_rows = T = b->n_logits;
        }
        tk.next_item = 0;
        td_pool_run(f->pool, task_attention, &tk);
        fwd__matmul(f, f->xb2, f->att, &L->wo, T);
        tk.layer = L; /* residual, then the FFN norm of this layer */
        td_pool_run(f->pool, task_residual_norm, &tk);
        if (s->n_expert) {
            if (moe_ffn(f, L, f->xb, f->xb2, T)) return -1; /* the group broke */
        } else {
            fwd__matmul_same_x(f, (float *const[]){f->hb, f->hb2}, f->xb,
                               (const td_weight *const[]){&L->w_gate, &L->w_up}, 2, T);
            td_pool_run(f->pool, task_silu, &tk);
            fwd__matmul(f, f->xb2, f->hb, &L->w_down, T);
        }
        tk.layer = NULL; /* residual, then the next layer's attention norm (if any) */
        tk.next_layer = il + 1 < s->n_layer ? &m->layers[il + 1] : NULL;
        td_pool_run(f->pool, task_residual_norm, &tk);
    }
    if (b->n_logits > 0) {
        td_pool_run(f->pool, task_final_norm, &tk);
        fwd__matmul(f, b->logits, f->xo, &m->output, b->n_logits);
    }
    return 0;
}
