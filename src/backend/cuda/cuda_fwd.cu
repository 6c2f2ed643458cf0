/*
 * backend/cuda/cuda_fwd.cu - the forward pass on the GPU (cuda_fwd.h).
 *
 * First version, correctness before speed: cuBLAS for the matrices (SGEMM for f32
 * weights, bf16 GEMM with f32 accumulation otherwise) and plain kernels for the rest, one
 * launch per operation, attention one block per (token, head) reading the paged pool.
 * What comes next is in docs/ARCHITECTURE.md ("The CUDA backend").
 */
extern "C" {
#include "backend/cuda/cuda_fwd.h"
#include "backend/cpu/cpu.h"
}

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace {

struct dev_mat {
    void *p = nullptr;
    bool f32 = false; /* else bf16 */
    int64_t rows = 0, cols = 0;
};

struct dev_layer {
    dev_mat wq, wk, wv, wo, gate, up, down;
    float *attn_norm = nullptr, *ffn_norm = nullptr, *bq = nullptr, *bk = nullptr, *bv = nullptr;
};

} // namespace

struct td_cuda_fwd {
    const td_model *m;
    int n_layer, d, qd, kd, hd, n_head, n_kv, ff, vocab;
    int block_size, n_blocks, max_tokens, max_logits, max_ctx, max_blocks;
    int kv_type; /* 0 f32, 1 f16, 2 bf16 */
    size_t token_bytes, block_bytes, layer_bytes, device_bytes, att_smem;
    cudaStream_t stream;
    cublasHandle_t blas;
    dev_mat embd, output;
    float *output_norm, *rope_freqs;
    dev_layer *layers;
    uint8_t *pool;
    /* workspace */
    float *x, *xb, *xb2, *q, *k, *v, *att, *hb, *hb2, *xo, *logits;
    __nv_bfloat16 *xbf;
    int32_t *tokens, *pos, *seq, *rows, *tables;
    int32_t *h_ints; /* pinned staging for the batch's integers */
    float *h_logits; /* pinned: the logits come back here, then to the caller */
    void *blas_ws;   /* cuBLAS's workspace, fixed so that GEMMs can be captured in graphs */
    /* Decode steps (every row a sequence's next token) of T rows replay a CUDA graph made
     * on the first such step: graphs[T], or graph_bad[T] if capturing failed. */
    cudaGraphExec_t *graphs;
    bool *graph_bad, use_graphs;
};

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return td_err_set(err, TD_EIO, "cuda: %s: %s", #call, cudaGetErrorString(e_));         \
    } while (0)

bool td_cuda_available(char *why, size_t cap)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        if (why) snprintf(why, cap, "no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
        return false;
    }
    return true;
}

static uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Upload a matrix: f32 stays f32, anything else becomes bf16 (dequantized on the host). */
static int upload_mat(td_cuda_fwd *f, dev_mat *dm, const td_weight *w, td_err *err)
{
    dm->rows = w->rows;
    dm->cols = w->cols;
    dm->f32 = w->type == TD_TYPE_F32;
    size_t bytes = (size_t)w->rows * (size_t)w->cols * (dm->f32 ? 4 : 2);
    CK(cudaMalloc(&dm->p, bytes));
    f->device_bytes += bytes;
    if (dm->f32) {
        CK(cudaMemcpy(dm->p, w->data, bytes, cudaMemcpyHostToDevice));
        return 0;
    }
    /* In slabs of rows: f32 scratch for one row, bf16 staging for the slab. */
    const int64_t slab = 256;
    float *row = (float *)malloc((size_t)w->cols * sizeof(float));
    uint16_t *stage = (uint16_t *)malloc((size_t)slab * (size_t)w->cols * 2);
    if (!row || !stage) {
        free(row);
        free(stage);
        return td_err_set(err, TD_ENOMEM, "cuda: out of host memory converting weights");
    }
    int rc = 0;
    for (int64_t r0 = 0; r0 < w->rows && !rc; r0 += slab) {
        int64_t nr = w->rows - r0 < slab ? w->rows - r0 : slab;
        for (int64_t r = 0; r < nr; r++) {
            cpu_dequant_row(w->type, (const uint8_t *)w->data + (size_t)(r0 + r) * w->row_bytes, row,
                            w->cols);
            for (int64_t c = 0; c < w->cols; c++) stage[r * w->cols + c] = f32_to_bf16(row[c]);
        }
        cudaError_t e = cudaMemcpy((uint16_t *)dm->p + (size_t)r0 * w->cols, stage,
                                   (size_t)nr * w->cols * 2, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) rc = td_err_set(err, TD_EIO, "cuda: weight upload: %s", cudaGetErrorString(e));
    }
    free(row);
    free(stage);
    return rc;
}

static int upload_vec(td_cuda_fwd *f, float **out, const td_weight *w, td_err *err)
{
    *out = nullptr;
    if (!w->data) return 0;
    size_t n = (size_t)w->rows * (size_t)w->cols;
    float *tmp = (float *)malloc(n * sizeof(float));
    if (!tmp) return td_err_set(err, TD_ENOMEM, "cuda: out of host memory");
    cpu_dequant_row(w->type, w->data, tmp, (int64_t)n);
    cudaError_t e = cudaMalloc(out, n * sizeof(float));
    if (e == cudaSuccess) e = cudaMemcpy(*out, tmp, n * sizeof(float), cudaMemcpyHostToDevice);
    free(tmp);
    if (e != cudaSuccess) return td_err_set(err, TD_EIO, "cuda: vector upload: %s", cudaGetErrorString(e));
    f->device_bytes += n * sizeof(float);
    return 0;
}

/* ---------------------------------------------------------------- kernels */

__device__ inline float load_kv(const uint8_t *p, int i, int t)
{
    if (t == 0) return ((const float *)p)[i];
    if (t == 1) return __half2float(((const __half *)p)[i]);
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}

__device__ inline void store_kv(uint8_t *p, int i, int t, float v)
{
    if (t == 0) ((float *)p)[i] = v;
    else if (t == 1) ((__half *)p)[i] = __float2half_rn(v);
    else ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
}

__device__ inline float block_sum(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) / 32;
    v = threadIdx.x < nw ? red[threadIdx.x] : 0.0f;
    if (w == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    return red[0];
}

__device__ inline float block_max(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) / 32;
    v = threadIdx.x < nw ? red[threadIdx.x] : -INFINITY;
    if (w == 0)
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) red[0] = v;
    __syncthreads();
    return red[0];
}

/* x[t] = embedding(token[t]) */
__global__ void k_embed(const void *emb, bool f32, const int32_t *tok, float *x, int d)
{
    int t = blockIdx.x;
    size_t base = (size_t)tok[t] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        x[(size_t)t * d + i] = f32 ? ((const float *)emb)[base + i]
                                   : __bfloat162float(((const __nv_bfloat16 *)emb)[base + i]);
}

/* out[r] = rmsnorm(x[src(r)]) * w, src(r) = rows ? rows[r] : r; optionally x += add first. */
__global__ void k_norm(float *x, const float *add, const float *w, float *out, const int32_t *rows,
                       int d, float eps)
{
    __shared__ float red[32];
    int r = blockIdx.x;
    size_t src = (size_t)(rows ? rows[r] : r) * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = x[src + i];
        if (add) {
            v += add[src + i];
            x[src + i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss, red);
    float scale = 1.0f / sqrtf(ss / (float)d + eps);
    if (!w) return;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        out[(size_t)r * d + i] = x[src + i] * scale * w[i];
}

__global__ void k_to_bf16(const float *x, __nv_bfloat16 *y, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void k_silu_mul(float *a, const float *b, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = a[i];
        a[i] = g / (1.0f + expf(-g)) * b[i];
    }
}

/*
 * Biases, RoPE on q and k, and K/V into the pool: one block per token, one thread per
 * rotation pair of any head (q heads first, then k heads), then V.
 */
__global__ void k_rope_store(float *q, float *k, float *v, const float *bq, const float *bk,
                             const float *bv, const int32_t *pos, const int32_t *seq,
                             const int32_t *tables, int max_blocks, uint8_t *layer, int n_head,
                             int n_kv, int hd, float base, float freq_scale, const float *ff,
                             int neox, int block_size, size_t token_bytes, size_t block_bytes,
                             int kv_type)
{
    int t = blockIdx.x, half = hd / 2, qd = n_head * hd, kd = n_kv * hd;
    int p = pos[t];
    int block = tables[(size_t)seq[t] * max_blocks + p / block_size];
    uint8_t *kb = layer + (size_t)block * block_bytes + (size_t)(p % block_size) * token_bytes;
    uint8_t *vb = kb + (size_t)block_size * token_bytes;
    float *qt = q + (size_t)t * qd, *kt = k + (size_t)t * kd, *vt = v + (size_t)t * kd;
    for (int j = threadIdx.x; j < (n_head + n_kv) * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        bool isq = h < n_head;
        float *x = isq ? qt + h * hd : kt + (h - n_head) * hd;
        const float *b = isq ? bq : bk;
        int off = isq ? h * hd : (h - n_head) * hd;
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = x[i0], x1 = x[i1];
        if (b) {
            x0 += b[off + i0];
            x1 += b[off + i1];
        }
        double inv = pow((double)base, -2.0 * i / hd);
        double th = (double)p * (double)freq_scale * inv;
        if (ff) th /= (double)ff[i];
        float c = (float)cos(th), s = (float)sin(th);
        float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
        x[i0] = y0;
        x[i1] = y1;
        if (!isq) {
            store_kv(kb, off + i0, kv_type, y0);
            store_kv(kb, off + i1, kv_type, y1);
        }
    }
    for (int i = threadIdx.x; i < kd; i += blockDim.x) {
        float val = vt[i] + (bv ? bv[i] : 0.0f);
        store_kv(vb, i, kv_type, val);
    }
}

/*
 * Causal attention over the pool for one (token, KV head): the `group` query heads that
 * share the KV head are done together, so each K and V row is read once for all of them.
 * Scores: each warp takes positions in turn, its lanes split the head dimension (a K row
 * is read by one warp in one coalesced sweep), and a shuffle reduction gives each head's
 * dot product. Softmax per head over shared memory. Output: each thread owns (head, dim)
 * pairs and sums over the positions, reading V rows coalesced. Shared memory:
 * group x (max_ctx + 1) scores.
 */
#define ATT_THREADS 256
#define ATT_MAX_GROUP 16
#define ATT_MAX_PER_LANE 8 /* head_dim <= 256 */

__global__ void k_attention(const float *q, float *out, const int32_t *pos, const int32_t *seq,
                            const int32_t *tables, int max_blocks, const uint8_t *layer, int n_head,
                            int n_kv, int hd, int block_size, size_t token_bytes, size_t block_bytes,
                            int esize, int kv_type, int max_ctx)
{
    extern __shared__ float sc[];
    __shared__ float red[32];
    const int t = blockIdx.x, kh = blockIdx.y, group = n_head / n_kv;
    const int p = pos[t], lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n_warps = blockDim.x / 32, per_lane = (hd + 31) / 32;
    const int32_t *table = tables + (size_t)seq[t] * max_blocks;
    const float scale = 1.0f / sqrtf((float)hd);
    const float *qt = q + (size_t)t * n_head * hd + (size_t)kh * group * hd;
    float qr[ATT_MAX_GROUP][ATT_MAX_PER_LANE];
    for (int g = 0; g < group; g++)
        for (int k = 0; k < per_lane; k++) {
            int i = lane + 32 * k;
            qr[g][k] = i < hd ? qt[(size_t)g * hd + i] : 0.0f;
        }
    for (int j = warp; j <= p; j += n_warps) {
        const uint8_t *kr = layer + (size_t)table[j / block_size] * block_bytes +
                            (size_t)(j % block_size) * token_bytes + (size_t)kh * hd * esize;
        float kv[ATT_MAX_PER_LANE];
        for (int k = 0; k < per_lane; k++) {
            int i = lane + 32 * k;
            kv[k] = i < hd ? load_kv(kr, i, kv_type) : 0.0f;
        }
        for (int g = 0; g < group; g++) {
            float s = 0.0f;
            for (int k = 0; k < per_lane; k++) s += qr[g][k] * kv[k];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) sc[(size_t)g * (max_ctx + 1) + j] = s * scale;
        }
    }
    __syncthreads();
    for (int g = 0; g < group; g++) {
        float *row = sc + (size_t)g * (max_ctx + 1);
        float mx = -INFINITY;
        for (int j = threadIdx.x; j <= p; j += blockDim.x) mx = fmaxf(mx, row[j]);
        mx = block_max(mx, red);
        float sum = 0.0f;
        for (int j = threadIdx.x; j <= p; j += blockDim.x) {
            float e = expf(row[j] - mx);
            row[j] = e;
            sum += e;
        }
        sum = block_sum(sum, red); /* the same value in every thread */
        if (threadIdx.x == 0) row[max_ctx] = 1.0f / sum;
        __syncthreads();
    }
    for (int c = threadIdx.x; c < group * hd; c += blockDim.x) {
        int g = c / hd, i = c % hd;
        const float *row = sc + (size_t)g * (max_ctx + 1);
        float acc = 0.0f;
        for (int j = 0; j <= p; j++) {
            const uint8_t *vr = layer + (size_t)table[j / block_size] * block_bytes +
                                (size_t)block_size * token_bytes +
                                (size_t)(j % block_size) * token_bytes + (size_t)kh * hd * esize;
            acc += row[j] * load_kv(vr, i, kv_type);
        }
        out[(size_t)t * n_head * hd + (size_t)(kh * group + g) * hd + i] = acc * row[max_ctx];
    }
}

/* ---------------------------------------------------------------- host side */

static int gemm(td_cuda_fwd *f, float *y, const float *x, const dev_mat *w, int T, td_err *err)
{
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st;
    if (w->f32) {
        st = cublasSgemm(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, T, (int)w->cols, &one,
                         (const float *)w->p, (int)w->cols, x, (int)w->cols, &zero, y, (int)w->rows);
    } else {
        size_t n = (size_t)T * (size_t)w->cols;
        k_to_bf16<<<(unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096), 256, 0, f->stream>>>(x, f->xbf, n);
        st = cublasGemmEx(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, T, (int)w->cols, &one, w->p,
                          CUDA_R_16BF, (int)w->cols, f->xbf, CUDA_R_16BF, (int)w->cols, &zero, y,
                          CUDA_R_32F, (int)w->rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (st != CUBLAS_STATUS_SUCCESS) return td_err_set(err, TD_EIO, "cuda: cuBLAS GEMM failed (%d)", (int)st);
    return 0;
}

static void free_mat(dev_mat *m)
{
    if (m->p) cudaFree(m->p);
    m->p = nullptr;
}

void td_cuda_fwd_free(td_cuda_fwd *f)
{
    if (!f) return;
    if (f->layers)
        for (int l = 0; l < f->n_layer; l++) {
            dev_layer *L = &f->layers[l];
            dev_mat *ms[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->gate, &L->up, &L->down};
            for (dev_mat *m : ms) free_mat(m);
            float *vs[] = {L->attn_norm, L->ffn_norm, L->bq, L->bk, L->bv};
            for (float *v : vs)
                if (v) cudaFree(v);
        }
    delete[] f->layers;
    if (f->output.p != f->embd.p) free_mat(&f->output);
    free_mat(&f->embd);
    void *bufs[] = {f->output_norm, f->rope_freqs, f->pool, f->x, f->xb, f->xb2, f->q, f->k, f->v,
                    f->att, f->hb, f->hb2, f->xo, f->logits, f->xbf, f->tokens, f->pos, f->seq,
                    f->rows, f->tables};
    for (void *b : bufs)
        if (b) cudaFree(b);
    if (f->h_ints) cudaFreeHost(f->h_ints);
    if (f->h_logits) cudaFreeHost(f->h_logits);
    for (int i = 0; f->graphs && i <= f->max_logits; i++)
        if (f->graphs[i]) cudaGraphExecDestroy(f->graphs[i]);
    free(f->graphs);
    free(f->graph_bad);
    if (f->blas_ws) cudaFree(f->blas_ws);
    if (f->blas) cublasDestroy(f->blas);
    if (f->stream) cudaStreamDestroy(f->stream);
    free(f);
}

size_t td_cuda_fwd_device_bytes(const td_cuda_fwd *f)
{
    return f->device_bytes;
}

int td_cuda_fwd_create(td_cuda_fwd **out, const td_model *m, td_type kv_dtype, int block_size,
                       int n_blocks, int max_tokens, int max_logits, int max_ctx, td_err *err)
{
    *out = nullptr;
    char why[256];
    if (!td_cuda_available(why, sizeof(why))) return td_err_set(err, TD_EUNSUPPORTED, "%s", why);
    int kv_type = kv_dtype == TD_TYPE_F32 ? 0 : kv_dtype == TD_TYPE_F16 ? 1 : kv_dtype == TD_TYPE_BF16 ? 2 : -1;
    if (kv_type < 0)
        return td_err_set(err, TD_EUNSUPPORTED, "cuda: KV cache dtype %s is not supported on the GPU yet (f32, f16, bf16)",
                          td_type_name(kv_dtype));
    const td_model_shape *s = &m->shape;
    td_cuda_fwd *f = (td_cuda_fwd *)calloc(1, sizeof(*f));
    if (!f) return td_err_set(err, TD_ENOMEM, "cuda: out of memory");
    f->m = m;
    f->n_layer = s->n_layer;
    f->d = s->n_embd;
    f->hd = s->head_dim;
    f->n_head = s->n_head;
    f->n_kv = s->n_head_kv;
    f->qd = s->n_head * s->head_dim;
    f->kd = s->n_head_kv * s->head_dim;
    f->ff = s->n_ff;
    f->vocab = s->n_vocab;
    f->block_size = block_size;
    f->n_blocks = n_blocks;
    f->max_tokens = max_tokens;
    f->max_logits = max_logits;
    f->max_ctx = max_ctx;
    f->max_blocks = (max_ctx + block_size - 1) / block_size;
    f->kv_type = kv_type;
    int esize = kv_type == 0 ? 4 : 2;
    f->token_bytes = (size_t)f->kd * esize;
    f->block_bytes = 2 * (size_t)block_size * f->token_bytes;
    f->layer_bytes = (size_t)n_blocks * f->block_bytes;
    int rc = 0;
#define TRY(x)                                                                                     \
    do {                                                                                           \
        if (!rc) rc = (x);                                                                         \
    } while (0)
#define DMALLOC(ptr, bytes)                                                                        \
    do {                                                                                           \
        if (!rc) {                                                                                 \
            cudaError_t e_ = cudaMalloc((void **)&(ptr), (bytes));                                 \
            if (e_ != cudaSuccess)                                                                 \
                rc = td_err_set(err, TD_ENOMEM, "cuda: cannot allocate %zu bytes: %s", (size_t)(bytes), \
                                cudaGetErrorString(e_));                                           \
            else                                                                                   \
                f->device_bytes += (bytes);                                                        \
        }                                                                                          \
    } while (0)
    if (cudaStreamCreate(&f->stream) != cudaSuccess || cublasCreate(&f->blas) != CUBLAS_STATUS_SUCCESS)
        rc = td_err_set(err, TD_EIO, "cuda: cannot create a stream or the cuBLAS handle");
    if (!rc) {
        cublasSetStream(f->blas, f->stream);
        cublasSetMathMode(f->blas, CUBLAS_DEFAULT_MATH); /* no TF32: f32 stays f32 */
    }
    f->layers = new dev_layer[s->n_layer];
    TRY(upload_mat(f, &f->embd, &m->tok_embd, err));
    if (m->output.data == m->tok_embd.data) f->output = f->embd;
    else TRY(upload_mat(f, &f->output, &m->output, err));
    TRY(upload_vec(f, &f->output_norm, &m->output_norm, err));
    if (m->rope_freqs && !rc) {
        DMALLOC(f->rope_freqs, (size_t)(f->hd / 2) * sizeof(float));
        if (!rc && cudaMemcpy(f->rope_freqs, m->rope_freqs, (size_t)(f->hd / 2) * sizeof(float),
                              cudaMemcpyHostToDevice) != cudaSuccess)
            rc = td_err_set(err, TD_EIO, "cuda: rope_freqs upload failed");
    }
    for (int l = 0; l < s->n_layer && !rc; l++) {
        const td_layer *L = &m->layers[l];
        dev_layer *D = &f->layers[l];
        TRY(upload_mat(f, &D->wq, &L->wq, err));
        TRY(upload_mat(f, &D->wk, &L->wk, err));
        TRY(upload_mat(f, &D->wv, &L->wv, err));
        TRY(upload_mat(f, &D->wo, &L->wo, err));
        TRY(upload_mat(f, &D->gate, &L->w_gate, err));
        TRY(upload_mat(f, &D->up, &L->w_up, err));
        TRY(upload_mat(f, &D->down, &L->w_down, err));
        TRY(upload_vec(f, &D->attn_norm, &L->attn_norm, err));
        TRY(upload_vec(f, &D->ffn_norm, &L->ffn_norm, err));
        TRY(upload_vec(f, &D->bq, &L->bq, err));
        TRY(upload_vec(f, &D->bk, &L->bk, err));
        TRY(upload_vec(f, &D->bv, &L->bv, err));
    }
    size_t T = (size_t)max_tokens, widest = (size_t)(f->ff > f->d ? f->ff : f->d);
    if ((size_t)f->qd > widest) widest = (size_t)f->qd;
    DMALLOC(f->pool, (size_t)f->n_layer * f->layer_bytes);
    DMALLOC(f->x, T * f->d * 4);
    DMALLOC(f->xb, T * f->d * 4);
    DMALLOC(f->xb2, T * f->d * 4);
    DMALLOC(f->q, T * f->qd * 4);
    DMALLOC(f->k, T * f->kd * 4);
    DMALLOC(f->v, T * f->kd * 4);
    DMALLOC(f->att, T * f->qd * 4);
    DMALLOC(f->hb, T * f->ff * 4);
    DMALLOC(f->hb2, T * f->ff * 4);
    DMALLOC(f->xbf, T * widest * 2);
    DMALLOC(f->xo, (size_t)max_logits * f->d * 4);
    DMALLOC(f->logits, (size_t)max_logits * f->vocab * 4);
    DMALLOC(f->tokens, T * 4);
    DMALLOC(f->pos, T * 4);
    DMALLOC(f->seq, T * 4);
    DMALLOC(f->rows, (size_t)max_logits * 4);
    DMALLOC(f->tables, (size_t)max_logits * f->max_blocks * 4);
    if (!rc && cudaMallocHost((void **)&f->h_logits, (size_t)max_logits * f->vocab * 4) != cudaSuccess)
        rc = td_err_set(err, TD_ENOMEM, "cuda: cannot allocate pinned logits");
    DMALLOC(f->blas_ws, (size_t)32 << 20);
    if (!rc && cublasSetWorkspace(f->blas, f->blas_ws, (size_t)32 << 20) != CUBLAS_STATUS_SUCCESS)
        rc = td_err_set(err, TD_EIO, "cuda: cannot give cuBLAS its workspace");
    f->graphs = (cudaGraphExec_t *)calloc((size_t)max_logits + 1, sizeof(cudaGraphExec_t));
    f->graph_bad = (bool *)calloc((size_t)max_logits + 1, sizeof(bool));
    if (!rc && (!f->graphs || !f->graph_bad)) rc = td_err_set(err, TD_ENOMEM, "cuda: out of memory");
    {
        const char *g = getenv("TD_CUDA_GRAPHS");
        f->use_graphs = !(g && !strcmp(g, "0"));
    }
    if (!rc && cudaMallocHost((void **)&f->h_ints, (3 * T + (size_t)max_logits * (1 + f->max_blocks)) * 4) != cudaSuccess)
        rc = td_err_set(err, TD_ENOMEM, "cuda: cannot allocate pinned staging");
    size_t att_smem = (size_t)(f->n_head / f->n_kv) * (size_t)(max_ctx + 1) * sizeof(float);
    if (!rc && (f->n_head / f->n_kv > ATT_MAX_GROUP || f->hd > 32 * ATT_MAX_PER_LANE))
        rc = td_err_set(err, TD_EUNSUPPORTED, "cuda: %d query heads per KV head or head_dim %d exceed the attention kernel (%d, %d)",
                        f->n_head / f->n_kv, f->hd, ATT_MAX_GROUP, 32 * ATT_MAX_PER_LANE);
    if (!rc && att_smem > 200 * 1024)
        rc = td_err_set(err, TD_EUNSUPPORTED, "cuda: a context of %d positions exceeds the attention kernel's shared memory (lower --max-model-len)", max_ctx);
    if (!rc && att_smem > 48 * 1024 &&
        cudaFuncSetAttribute(k_attention, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)att_smem) != cudaSuccess)
        rc = td_err_set(err, TD_EIO, "cuda: cannot raise the attention kernel's shared memory");
    f->att_smem = att_smem;
#undef TRY
#undef DMALLOC
    if (rc) {
        td_cuda_fwd_free(f);
        return rc;
    }
    *out = f;
    return 0;
}

/*
 * Queue one step on the stream: the staged integers to the device (f->h_ints, filled by
 * td_cuda_fwd_run), every layer, and the logits back to f->h_logits. Nothing here reads
 * the host otherwise, so a decode step can be captured as a graph and replayed.
 */
static int enqueue(td_cuda_fwd *f, int T, int ns, int n_logits, td_err *err)
{
    const td_model_shape *s = &f->m->shape;
    const int mb = f->max_blocks;
    int32_t *h = f->h_ints, *tab = h + 3 * T + f->max_logits;
    cudaStream_t st = f->stream;
    CK(cudaMemcpyAsync(f->tokens, h, (size_t)T * 4, cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(f->pos, h + T, (size_t)T * 4, cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(f->seq, h + 2 * T, (size_t)T * 4, cudaMemcpyHostToDevice, st));
    if (n_logits) CK(cudaMemcpyAsync(f->rows, h + 3 * T, (size_t)n_logits * 4, cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(f->tables, tab, (size_t)ns * mb * 4, cudaMemcpyHostToDevice, st));

    int d = f->d, esize = f->kv_type == 0 ? 4 : 2;
    float eps = s->rms_eps;
    k_embed<<<T, 256, 0, st>>>(f->embd.p, f->embd.f32, f->tokens, f->x, d);
    k_norm<<<T, 256, 0, st>>>(f->x, nullptr, f->layers[0].attn_norm, f->xb, nullptr, d, eps);
    int rc = 0;
    for (int l = 0; l < f->n_layer && !rc; l++) {
        dev_layer *L = &f->layers[l];
        uint8_t *layer = f->pool + (size_t)l * f->layer_bytes;
        if (!rc) rc = gemm(f, f->q, f->xb, &L->wq, T, err);
        if (!rc) rc = gemm(f, f->k, f->xb, &L->wk, T, err);
        if (!rc) rc = gemm(f, f->v, f->xb, &L->wv, T, err);
        if (rc) break;
        k_rope_store<<<T, 128, 0, st>>>(f->q, f->k, f->v, L->bq, L->bk, L->bv, f->pos, f->seq, f->tables, mb,
                                        layer, f->n_head, f->n_kv, f->hd, s->rope_theta, s->rope_freq_scale,
                                        f->rope_freqs, s->rope_type == TD_ROPE_NEOX, f->block_size,
                                        f->token_bytes, f->block_bytes, f->kv_type);
        dim3 grid((unsigned)T, (unsigned)f->n_kv);
        k_attention<<<grid, ATT_THREADS, f->att_smem, st>>>(
            f->q, f->att, f->pos, f->seq, f->tables, mb, layer, f->n_head, f->n_kv, f->hd, f->block_size,
            f->token_bytes, f->block_bytes, esize, f->kv_type, f->max_ctx);
        rc = gemm(f, f->xb2, f->att, &L->wo, T, err);
        if (rc) break;
        k_norm<<<T, 256, 0, st>>>(f->x, f->xb2, L->ffn_norm, f->xb, nullptr, d, eps);
        if (!rc) rc = gemm(f, f->hb, f->xb, &L->gate, T, err);
        if (!rc) rc = gemm(f, f->hb2, f->xb, &L->up, T, err);
        if (rc) break;
        size_t n = (size_t)T * f->ff;
        k_silu_mul<<<(unsigned)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096), 256, 0, st>>>(f->hb, f->hb2, n);
        rc = gemm(f, f->xb2, f->hb, &L->down, T, err);
        if (rc) break;
        const float *next = l + 1 < f->n_layer ? f->layers[l + 1].attn_norm : nullptr;
        k_norm<<<T, 256, 0, st>>>(f->x, f->xb2, next, f->xb, nullptr, d, eps);
    }
    if (!rc && n_logits > 0) {
        k_norm<<<n_logits, 256, 0, st>>>(f->x, nullptr, f->output_norm, f->xo, f->rows, d, eps);
        rc = gemm(f, f->logits, f->xo, &f->output, n_logits, err);
        if (!rc)
            CK(cudaMemcpyAsync(f->h_logits, f->logits, (size_t)n_logits * f->vocab * 4, cudaMemcpyDeviceToHost, st));
    }
    return rc;
}


int td_cuda_fwd_run(td_cuda_fwd *f, int n_tokens, const int32_t *tokens, const int32_t *pos,
                    const int32_t *seq, const int32_t *const *block_tables, int n_seqs, int n_logits,
                    const int32_t *logit_rows, float *logits, td_err *err)
{
    int T = n_tokens, mb = f->max_blocks;
    if (T < 1 || T > f->max_tokens || n_logits > f->max_logits || n_seqs > f->max_logits ||
        n_seqs > 1024)
        return td_err_set(err, TD_EINVAL, "cuda: batch of %d tokens, %d logits, %d sequences exceeds the plan", T,
                          n_logits, n_seqs);
    /* Stage the integers: tokens, pos, seq, logit rows, then each sequence's block table
     * (as many blocks as its furthest position needs). */
    int32_t *h = f->h_ints;
    memcpy(h, tokens, (size_t)T * 4);
    memcpy(h + T, pos, (size_t)T * 4);
    memcpy(h + 2 * T, seq, (size_t)T * 4);
    memcpy(h + 3 * T, logit_rows, (size_t)n_logits * 4);
    int32_t *tab = h + 3 * T + f->max_logits;
    int need[1024];
    int ns = n_seqs;
    for (int i = 0; i < ns; i++) need[i] = 0;
    for (int t = 0; t < T; t++) {
        int b = pos[t] / f->block_size + 1;
        if (seq[t] < ns && b > need[seq[t]]) need[seq[t]] = b;
    }
    for (int i = 0; i < ns; i++) memcpy(tab + (size_t)i * mb, block_tables[i], (size_t)need[i] * 4);
    /* A decode step (row i is sequence i's next token, and samples) replays a graph. */
    bool decode = n_logits == T && ns == T;
    for (int i = 0; decode && i < T; i++) decode = logit_rows[i] == i && seq[i] == i;
    int rc = 0;
    cudaStream_t st = f->stream;
    if (decode && f->use_graphs && !f->graph_bad[T]) {
        if (!f->graphs[T]) {
            cudaGraph_t g = nullptr;
            bool ok = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
            td_err ce;
            td_err_clear(&ce);
            if (ok) ok = enqueue(f, T, ns, n_logits, &ce) == 0;
            if (cudaStreamEndCapture(st, &g) != cudaSuccess) ok = false;
            if (ok && cudaGraphInstantiate(&f->graphs[T], g, 0) != cudaSuccess) {
                f->graphs[T] = nullptr;
                ok = false;
            }
            if (g) cudaGraphDestroy(g);
            if (!ok) {
                (void)cudaGetLastError(); /* clear it: run this step, and later ones, without */
                f->graph_bad[T] = true;
                fprintf(stderr, "cuda: decode steps of %d rows run without a CUDA graph (capture failed%s%s)\n",
                        T, ce.msg[0] ? ": " : "", ce.msg);
            }
        }
        if (f->graphs[T]) CK(cudaGraphLaunch(f->graphs[T], st));
        else rc = enqueue(f, T, ns, n_logits, err);
    } else {
        rc = enqueue(f, T, ns, n_logits, err);
    }
    if (rc) return rc;
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    if (n_logits) memcpy(logits, f->h_logits, (size_t)n_logits * f->vocab * 4);
    return 0;
}

int td_cuda_probe(double *copy_gbs, double *gemm_tflops, td_err *err)
{
    *copy_gbs = *gemm_tflops = 0;
    char why[256];
    if (!td_cuda_available(why, sizeof(why))) return td_err_set(err, TD_EUNSUPPORTED, "%s", why);
    const size_t bytes = (size_t)1 << 30;
    const int n = 8192;
    void *a = nullptr, *b = nullptr, *c = nullptr;
    cublasHandle_t h = nullptr;
    cudaEvent_t e0, e1;
    int rc = 0;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess ||
        cudaMalloc(&c, (size_t)n * n * 4) != cudaSuccess || cublasCreate(&h) != CUBLAS_STATUS_SUCCESS)
        rc = td_err_set(err, TD_ENOMEM, "cuda: probe: cannot allocate");
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    if (!rc) {
        cudaMemset(a, 1, bytes);
        float best = 1e30f, ms;
        for (int i = 0; i < 12; i++) {
            cudaEventRecord(e0);
            cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&ms, e0, e1);
            if (i >= 2 && ms < best) best = ms;
        }
        *copy_gbs = 2.0 * (double)bytes / (best * 1e-3) / 1e9;
        /* a and b hold 8192 x 8192 bf16 (128 MiB) each, c the f32 result. */
        const float one = 1.0f, zero = 0.0f;
        best = 1e30f;
        for (int i = 0; i < 8 && !rc; i++) {
            cudaEventRecord(e0);
            cublasStatus_t st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n,
                                             b, CUDA_R_16BF, n, &zero, c, CUDA_R_32F, n,
                                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            cudaEventElapsedTime(&ms, e0, e1);
            if (st != CUBLAS_STATUS_SUCCESS) rc = td_err_set(err, TD_EIO, "cuda: probe GEMM failed");
            if (i >= 2 && ms < best) best = ms;
        }
        if (!rc) *gemm_tflops = 2.0 * n * (double)n * n / (best * 1e-3) / 1e12;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (h) cublasDestroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    return rc;
}
