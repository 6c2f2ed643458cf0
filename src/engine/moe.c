/*
 * engine/moe.c - the mixture-of-experts FFN on the CPU backend.
 *
 * For the T rows x[t] of a step (already FFN-normed), with E experts of which each row
 * uses k:
 *   logits = x Wr^T                                    [T][E]   one matmul
 *   sel[t] = the k best experts (ties: lower index), weight[t][j] from the logits
 *   rows grouped by expert: expert e's rows are gathered into xg[start[e] ..)
 *   for each expert e with rows (ascending e):
 *     hg  = xg_e Wg_e^T, hg2 = xg_e Wu_e^T             one fused matmul on e's slice
 *   hg = silu(hg) * hg2                                all gathered rows at once
 *   for each expert e with rows: yg_e = hg_e Wd_e^T    one matmul on e's slice
 *   out[t] = g[t] * shared(x[t]) (qwen2moe) or 0; then out[t] += weight[t][j] * yg[slot[t][j]]
 *            for j = 0 .. k-1 in that order
 * So each selected expert's weights are read once per step however many rows chose it,
 * and every value a row gets is computed by the batch-invariant kernels from that row
 * alone, then summed in a fixed order: the output of a row does not depend on the batch.
 */
#include "engine/moe.h"

#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "engine/ep.h"
#include "engine/forward.h"

typedef struct moe_buf {
    void **dst;
    size_t bytes; /* a multiple of 64 */
} moe_buf;

#define MOE_N_BUFS 16
#define MOE_N_EP_BUFS 4 /* the last ones: expert parallelism's */

/* The workspace's buffers for max_tokens rows: where each goes in w, and its size. */
static void moe_buffers(fwd_moe *w, const td_model_shape *s, int max_tokens, moe_buf *out)
{
    size_t T = (size_t)max_tokens, k = (size_t)s->n_expert_used, E = (size_t)s->n_expert;
    size_t R = T * k, d = (size_t)s->n_embd, ffe = (size_t)s->n_ff_exp;
    moe_buf bufs[MOE_N_BUFS] = {
        {(void **)&w->logits, T * E * sizeof(float)},
        {(void **)&w->sel, T * k * sizeof(int32_t)},
        {(void **)&w->weight, T * k * sizeof(float)},
        {(void **)&w->slot, T * k * sizeof(int32_t)},
        {(void **)&w->row_token, R * sizeof(int32_t)},
        {(void **)&w->start, (E + 1) * sizeof(int32_t)},
        {(void **)&w->fill, E * sizeof(int32_t)},
        {(void **)&w->xg, R * d * sizeof(float)},
        {(void **)&w->hg, R * ffe * sizeof(float)},
        {(void **)&w->hg2, R * ffe * sizeof(float)},
        {(void **)&w->yg, R * d * sizeof(float)},
        {(void **)&w->shexp_gate, T * sizeof(float)},
        {(void **)&w->xs, T * d * sizeof(float)},
        {(void **)&w->hs, T * ffe * sizeof(float)},
        {(void **)&w->hs2, T * ffe * sizeof(float)},
        {(void **)&w->ys, T * d * sizeof(float)},
    };
    for (int i = 0; i < MOE_N_BUFS; i++) {
        out[i] = bufs[i];
        out[i].bytes = TD_ALIGN_UP(bufs[i].bytes, 64);
    }
}

size_t moe_workspace_bytes(const td_model *m, int max_tokens, bool ep)
{
    if (!m->shape.n_expert) return 0;
    fwd_moe w;
    moe_buf bufs[MOE_N_BUFS];
    moe_buffers(&w, &m->shape, max_tokens, bufs);
    size_t total = 0;
    for (int i = 0; i < MOE_N_BUFS - (ep ? 0 : MOE_N_EP_BUFS); i++)
        total += bufs[i].bytes;
    return total;
}

int moe_init(fwd_moe *w, const td_model *m, int max_tokens, bool ep)
{
    memset(w, 0, sizeof(*w));
    if (!m->shape.n_expert) return 0;
    moe_buf bufs[MOE_N_BUFS];
    moe_buffers(w, &m->shape, max_tokens, bufs);
    for (int i = 0; i < MOE_N_BUFS - (ep ? 0 : MOE_N_EP_BUFS); i++) {
        *bufs[i].dst = td_aligned_alloc(bufs[i].bytes);
        if (!*bufs[i].dst) {
            moe_free(w);
            return TD_ENOMEM;
        }
        w->bytes += bufs[i].bytes;
        if (i >= MOE_N_BUFS - MOE_N_EP_BUFS) w->ep_bytes += bufs[i].bytes;
    }
    return 0;
}

void moe_free(fwd_moe *w)
{
    void *bufs[] = {w->logits, w->sel, w->weight, w->slot,       w->row_token, w->start,
                    w->fill,   w->xg,  w->hg,     w->hg2,        w->yg,        w->shexp_gate,
                    w->xs,     w->hs,  w->hs2,    w->ys};
    for (size_t i = 0; i < TD_ARRAY_LEN(bufs); i++)
        td_aligned_free(bufs[i]);
    memset(w, 0, sizeof(*w));
}

/* Logit a beats logit b: greater, or a number against a NaN (NaN ranks below everything). */
static inline bool beats(float a, float b)
{
    return a > b || (isnan(b) && !isnan(a));
}

void moe__route_row(const float *logits, int n_expert, int k, bool norm_topk, int32_t *sel,
                    float *weight)
{
    /* Top-k by repeated selection: only a strictly better logit replaces the best so far, so
     * ties go to the lower index, and the choice never depends on anything but this row. */
    bool taken[TD_MODEL_MAX_EXPERTS] = {false};
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++)
            if (!taken[e] && (best < 0 || beats(logits[e], logits[best]))) best = e;
        taken[best] = true;
        sel[j] = best;
    }
    if (norm_topk) {
        /* Mixtral: softmax over the k selected logits (the best is the largest). */
        float top = logits[sel[0]], sum = 0;
        for (int j = 0; j < k; j++)
            sum += weight[j] = expf(logits[sel[j]] - top);
        for (int j = 0; j < k; j++)
            weight[j] /= sum;
    } else {
        /* qwen2moe: softmax over all experts; the selected probabilities as they are. */
        float top = logits[0], sum = 0;
        for (int e = 1; e < n_expert; e++)
            top = logits[e] > top ? logits[e] : top;
        for (int e = 0; e < n_expert; e++)
            sum += expf(logits[e] - top);
        for (int j = 0; j < k; j++)
            weight[j] = expf(logits[sel[j]] - top) / sum;
    }
}

/* ---- row-parallel tasks ------------------------------------------------------ */

typedef struct moe_task {
    fwd_ctx *f;
    const td_layer *L;
    const float *x;
    float *out;
    int n_rows;    /* T, or R for the gathered rows */
    float *h, *h2; /* task_silu: h = silu(h) * h2, rows of `width` */
    int width;
} moe_task;

/* Top-k and weights of each row; for qwen2moe also the shared expert's gate. */
static void task_route(void *ctx, int ith, int nth)
{
    moe_task *tk = ctx;
    const td_model_shape *s = &tk->f->model->shape;
    fwd_moe *w = &tk->f->moe;
    int E = s->n_expert, k = s->n_expert_used, d = s->n_embd;
    bool norm = td_moe_norm_topk(s);
    const float *gate = tk->L->shexp_gate.data;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        moe__route_row(w->logits + t * E, E, k, norm, w->sel + t * k, w->weight + t * k);
        if (gate) w->shexp_gate[t] = 1.0f / (1.0f + expf(-cpu_dot_f32(tk->x + t * d, gate, d)));
    }
}

/* xg[i] = x[row_token[i]] for the gathered rows. */
static void task_gather(void *ctx, int ith, int nth)
{
    moe_task *tk = ctx;
    fwd_moe *w = &tk->f->moe;
    size_t d = (size_t)tk->f->model->shape.n_embd;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t i = r0; i < r1; i++)
        memcpy(w->xg + (size_t)i * d, tk->x + (size_t)w->row_token[i] * d, d * sizeof(float));
}

static void task_silu(void *ctx, int ith, int nth)
{
    moe_task *tk = ctx;
    size_t n = (size_t)tk->width;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t i = r0; i < r1; i++)
        cpu_silu_mul(tk->h + (size_t)i * n, tk->h + (size_t)i * n, tk->h2 + (size_t)i * n, (int)n);
}

/* out[t] = g[t] * out[t] (the shared expert's output) or 0, then += weight * expert
 * output for j = 0 .. k-1: the same order for every row, whatever the batch. */
static void task_combine(void *ctx, int ith, int nth)
{
    moe_task *tk = ctx;
    const td_model_shape *s = &tk->f->model->shape;
    fwd_moe *w = &tk->f->moe;
    int k = s->n_expert_used, d = s->n_embd;
    bool shared = tk->L->shexp_gate.data != NULL;
    int64_t r0, r1;
    td_split_range(tk->n_rows, ith, nth, &r0, &r1);
    for (int64_t t = r0; t < r1; t++) {
        float *o = tk->out + t * d;
        if (shared) {
            float g = w->shexp_gate[t];
            for (int i = 0; i < d; i++)
                o[i] *= g;
        } else {
            memset(o, 0, (size_t)d * sizeof(float));
        }
        for (int j = 0; j < k; j++) {
            float a = w->weight[t * k + j];
            const float *y = w->yg + (size_t)w->slot[t * k + j] * d;
            for (int i = 0; i < d; i++)
                o[i] += a * y[i];
        }
    }
}

/* ---- the layer --------------------------------------------------------------- */

/* Expert e's matrix: rows [e * rows, (e + 1) * rows) of an expert tensor, as a weight of
 * its own (and of the packed copy, whose panels those rows fill exactly: model.c packs
 * an expert tensor only when `rows` is a multiple of the 32-row panel). */
static td_weight expert_view(const td_weight *w, int e, int64_t rows)
{
    td_weight v = *w;
    size_t off = (size_t)e * (size_t)rows * w->row_bytes;
    v.rows = rows;
    v.data = (const uint8_t *)w->data + off;
    if (w->packed) v.packed = (const uint8_t *)w->packed + off;
    return v;
}

/* Group the T rows' selections by expert: start[e] .. start[e + 1] are expert e's
 * gathered rows, in ascending token order; slot[t][j] says where (t, j) went. Returns the
 * number of experts with at least one row. */
static int group_rows(fwd_moe *w, int E, int k, int T)
{
    memset(w->start, 0, (size_t)(E + 1) * sizeof(int32_t));
    for (int i = 0; i < T * k; i++)
        w->start[w->sel[i] + 1]++;
    int used = 0;
    for (int e = 0; e < E; e++) {
        used += w->start[e + 1] > 0;
        w->start[e + 1] += w->start[e];
        w->fill[e] = 0;
    }
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e = w->sel[t * k + j];
            int r = w->start[e] + w->fill[e]++;
            w->slot[t * k + j] = r;
            w->row_token[r] = t;
        }
    return used;
}

/*
 * Expert parallelism: run the experts this rank holds on the rows of every rank. Every
 * rank's xg and start are final (the first barrier); expert e's rows of rank r are
 * xg_r[start_r[e] ..), so they are gathered into xs (ranks in order, at most max_tokens
 * rows at a time), run, and the results put back into yg_r at the same rows. A row's
 * result is the same as in one engine: the kernels are batch invariant.
 */
static void run_held_experts(fwd_ctx *f, const td_layer *L)
{
    const td_model_shape *s = &f->model->shape;
    fwd_moe *w = &f->moe;
    const int E = s->n_expert, d = s->n_embd, ffe = s->n_ff_exp, n_ranks = td_ep_size(f->ep);
    const size_t row = (size_t)d * sizeof(float);
    int lo, hi;
    td_ep_experts(f->ep, f->ep_rank, E, &lo, &hi);
    for (int e = lo; e < hi; e++) {
        td_weight g = expert_view(&L->w_gate_exps, e, ffe), u = expert_view(&L->w_up_exps, e, ffe);
        td_weight dn = expert_view(&L->w_down_exps, e, d);
        bool ran = false;
        int r = 0, next = -1; /* the rank, and the next of its rows to gather (-1: start) */
        while (r < n_ranks) {
            /* gather up to max_tokens rows, remembering where each run came from */
            struct {
                float *yg;
                int src, n;
            } runs[64];
            int n_runs = 0, n = 0;
            while (r < n_ranks && n < f->max_tokens) {
                const float *xg;
                const int32_t *start;
                float *yg;
                ep__peer(f->ep, r, &xg, &start, &yg);
                if (next < 0) next = start[e];
                int take = TD_MIN(start[e + 1] - next, f->max_tokens - n);
                if (take > 0) {
                    memcpy(w->xs + (size_t)n * d, xg + (size_t)next * d, (size_t)take * row);
                    runs[n_runs].yg = yg, runs[n_runs].src = next, runs[n_runs].n = take;
                    n_runs++;
                    n += take;
                    next += take;
                }
                if (next >= start[e + 1]) r++, next = -1;
            }
            if (!n) continue;
            ran = true;
            fwd__matmul_same_x(f, (float *const[]){w->hs, w->hs2}, w->xs, (const td_weight *const[]){&g, &u}, 2, n);
            moe_task tk = {.f = f, .n_rows = n, .h = w->hs, .h2 = w->hs2, .width = ffe};
            td_pool_run(f->pool, task_silu, &tk);
            fwd__matmul(f, w->ys, w->hs, &dn, n);
            for (int i = 0, at = 0; i < n_runs; at += runs[i].n, i++)
                memcpy(runs[i].yg + (size_t)runs[i].src * d, w->ys + (size_t)at * d, (size_t)runs[i].n * row);
        }
        f->moe_expert_runs += ran;
    }
}

int moe_ffn(fwd_ctx *f, const td_layer *L, const float *x, float *out, int T)
{
    const td_model_shape *s = &f->model->shape;
    fwd_moe *w = &f->moe;
    const int E = s->n_expert, k = s->n_expert_used, d = s->n_embd, ffe = s->n_ff_exp;
    TD_ASSERT(T >= 0 && T <= f->max_tokens && (T > 0 || f->ep));
    moe_task tk = {.f = f, .L = L, .x = x, .out = out, .n_rows = T};

    if (T > 0) {
        fwd__matmul(f, w->logits, x, &L->router, T);
        td_pool_run(f->pool, task_route, &tk);
    }
    int used = group_rows(w, E, k, T);
    const int R = T * k;
    tk.n_rows = R;
    if (R > 0) td_pool_run(f->pool, task_gather, &tk);

    if (f->ep) {
        /* every rank's rows are gathered; each runs the experts it holds; then each rank's
         * yg holds its own rows' results */
        if (ep__barrier(f->ep)) return -1;
        run_held_experts(f, L);
        if (ep__barrier(f->ep)) return -1;
        if (T == 0) return 0;
    } else {
        f->moe_expert_runs += (uint64_t)used;
    }
    for (int e = 0; e < E && !f->ep; e++) {
        int r0 = w->start[e], n = w->start[e + 1] - r0;
        if (!n) continue;
        td_weight g = expert_view(&L->w_gate_exps, e, ffe), u = expert_view(&L->w_up_exps, e, ffe);
        fwd__matmul_same_x(f, (float *const[]){w->hg + (size_t)r0 * ffe, w->hg2 + (size_t)r0 * ffe},
                           w->xg + (size_t)r0 * d, (const td_weight *const[]){&g, &u}, 2, n);
    }
    tk.h = w->hg;
    tk.h2 = w->hg2;
    tk.width = ffe;
    if (!f->ep) td_pool_run(f->pool, task_silu, &tk);
    for (int e = 0; e < E && !f->ep; e++) {
        int r0 = w->start[e], n = w->start[e + 1] - r0;
        if (!n) continue;
        td_weight dn = expert_view(&L->w_down_exps, e, d);
        fwd__matmul(f, w->yg + (size_t)r0 * d, w->hg + (size_t)r0 * ffe, &dn, n);
    }

    tk.n_rows = T;
    if (L->shexp_gate.data) {
        /* The shared expert runs on every row, straight into out (scaled in task_combine). */
        int ffs = s->n_ff_shexp;
        fwd__matmul_same_x(f, (float *const[]){f->hb, f->hb2}, x,
                           (const td_weight *const[]){&L->w_gate_shexp, &L->w_up_shexp}, 2, T);
        tk.h = f->hb;
        tk.h2 = f->hb2;
        tk.width = ffs;
        td_pool_run(f->pool, task_silu, &tk);
        fwd__matmul(f, out, f->hb, &L->w_down_shexp, T);
    }
    td_pool_run(f->pool, task_combine, &tk);
    return 0;
}
