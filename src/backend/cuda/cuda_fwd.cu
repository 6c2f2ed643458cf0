/*
 * backend/cuda/cuda_fwd.cu - the forward pass on the GPU (cuda_fwd.h).
 *
 * A layer is nine launches: RMSNorm, one GEMM for Q, K and V together (the three
 * matrices are stored as one), RoPE plus the K/V store into the paged pool, attention,
 * the output GEMM, residual add plus RMSNorm, one GEMM for gate and up together, SiLU
 * times up, and the down GEMM. With bf16 weights the norms, the attention and the SiLU
 * write the next GEMM's bf16 input themselves; the GEMM results and the residual stream
 * stay f32. With f32 weights everything stays f32 (cuBLAS SGEMM, no TF32).
 *
 * Attention has two kernels:
 * - split-K (flash-decoding): every row that is not in a prefill tile, on any KV type.
 *   Each (row, KV head) is split into up to 32 ranges of positions so that a batch of one
 *   still fills the GPU; a merge kernel combines the ranges' partial softmaxes.
 * - a tensor-core tile kernel (flash-attention 2 style, mma.sync m16n8k16) for runs of
 *   prefill rows with a bf16 or f16 KV cache and bf16 weights: 16 rows of a sequence
 *   times the query heads of one KV head, against 64-key tiles of the paged K and V in
 *   shared memory, online softmax in registers.
 * Decode steps (every row a sequence's next token) replay a CUDA graph per batch size. A
 * decode step of one row is instead one persistent kernel where the model allows it
 * (k_mega, mega.cuh).
 */
extern "C" {
#include "backend/cuda/cuda_fwd.h"
#include "backend/cpu/cpu.h"
}

#include <cub/device/device_radix_sort.cuh>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
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

/* qkv holds wq, wk, wv as one matrix (rows qd + 2 kd); gu holds gate then up (2 ff). */
struct dev_layer {
    dev_mat qkv, wo, gu, down;
    float *attn_norm = nullptr, *ffn_norm = nullptr, *bq = nullptr, *bk = nullptr, *bv = nullptr;
};

enum { PROF_GEMM, PROF_ATT, PROF_OTHER, PROF_STEP, PROF_N };
#define PROF_MARKS 2048

} // namespace

struct td_cuda_fwd {
    const td_model *m;
    int n_layer, d, qd, kd, hd, n_head, n_kv, ff, vocab, n_sm;
    int dev; /* the CUDA device it was made on */
    int block_size, n_blocks, max_tokens, max_logits, max_ctx, max_blocks;
    int kv_type;     /* 0 f32, 1 f16, 2 bf16, 3 fp8 e4m3 */
    bool bf;         /* bf16 weights and GEMM inputs (else all f32) */
    bool tiles_ok;   /* prefill rows may use the tensor-core tile kernel */
    bool dec_ok;     /* and single rows the tensor-core decode kernel */
    bool use_gemv;   /* batches of <= GEMV_MAX_T rows use k_gemv (TD_CUDA_GEMV=0: cuBLAS) */
    /* Decode steps of one row run as one kernel, k_mega (mega.cuh), where the model allows
     * (TD_CUDA_MEGA=0: never): its kernel, grid, shared memory, per-layer weights on the
     * device, residual buffers and barrier, and how much of each next row to prefetch. */
    const void *mk_fn; /* a k_mega instance, or NULL */
    int mk_blocks;
    size_t mk_smem;
    void *mk_layers; /* mk_layer[n_layer] */
    unsigned long long *mk_times, *mk_h_times; /* TD_CUDA_MEGA_TIMES=1: phase clocks */
    double mk_phase_us[6];
    long mk_steps;
    float *mk_x;
    unsigned long long *mk_bar; /* mk_sync's counter; the attention counters follow */
    /* TD_CUDA_MEGA_PLAIN=1: the first version's step (no early K/V loads, a fence by every
     * thread at the end of an attention item, k_argmax after the kernel, the staged
     * integers in several copies), for A/B. */
    bool mk_plain;
    unsigned long long *mk_am, *mk_h_am; /* the packed greedy token, on the device and pinned */
    int32_t *mk_in, *mk_h_in; /* token, position, 0, 0, then the block table: one copy */
    bool tile_attr;  /* the tile kernels' shared-memory limit has been raised */
    size_t token_bytes, block_bytes, layer_bytes, device_bytes;
    cudaStream_t stream;
    cublasHandle_t blas;
    dev_mat embd, output;
    float *output_norm, *rope_freqs;
    float2 *rope_cs; /* [max_ctx][head_dim / 2] RoPE (cos, sin) */
    dev_layer *layers;
    uint8_t *pool;
    /* workspace: f32 residual x, GEMM outputs, and the GEMM input `in` (bf16 or f32) */
    float *x, *qkv, *o, *gu, *logits, *part;
    void *in;
    int32_t *dints; /* the staged integers on the device (layout in stage_layout) */
    int32_t *h_ints; /* pinned staging for the batch's integers */
    float *h_logits; /* pinned: the logits come back here, then to the caller */
    int32_t *d_argmax, *h_argmax; /* each logit row's greedy token, on the device and pinned */
    /* Sampling on the device (sample.cuh), made on first use: the rows' parameters (pinned
     * and on the device), their tokens, and a group's (p, id) pairs before and after the
     * sort, and the sort's scratch. */
    struct samp_row *h_samp, *d_samp;
    int32_t *d_samp_out, *h_samp_out;
    float *samp_keys, *samp_keys2;
    int32_t *samp_vals, *samp_vals2;
    void *samp_tmp;
    size_t samp_tmp_bytes;
    void *blas_ws;   /* cuBLAS's workspace, fixed so that GEMMs can be captured in graphs */
    /* Decode steps (every row a sequence's next token) of T rows replay a CUDA graph made
     * on the first such step: graphs[T], or graph_bad[T] if capturing failed. */
    cudaGraphExec_t *graphs;
    bool *graph_bad, use_graphs;
    /* TD_CUDA_PROFILE=1: time each launch by category (graphs off); =2: time whole steps
     * on the GPU (graphs on); reported at free. */
    bool prof, prof_steps_only;
    cudaEvent_t step_ev[2];
    int n_marks, mark_cat[PROF_MARKS];
    cudaEvent_t marks[PROF_MARKS];
    double prof_ms[2][PROF_N];
    long prof_steps[2], prof_tokens[2];
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

/* ---------------------------------------------------------------- device helpers */

/* KV element types: 0 f32, 1 f16, 2 bf16, 3 fp8 e4m3 (round to nearest even, saturating
 * at 448, as td_f32_to_fp8e4m3 on the CPU). */
__device__ inline float load_kv(const uint8_t *p, int i, int t)
{
    if (t == 0) return ((const float *)p)[i];
    if (t == 1) return __half2float(((const __half *)p)[i]);
    if (t == 2) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    return (float)(((const __nv_fp8_e4m3 *)p)[i]);
}

__device__ inline void store_kv(uint8_t *p, int i, int t, float v)
{
    if (t == 0) ((float *)p)[i] = v;
    else if (t == 1) ((__half *)p)[i] = __float2half_rn(v);
    else if (t == 2) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
    else ((__nv_fp8_e4m3 *)p)[i] = __nv_fp8_e4m3(v);
}

__host__ __device__ inline int kv_esize(int t)
{
    return t == 0 ? 4 : t == 3 ? 1 : 2;
}

/* An activation that feeds a GEMM: bf16 or f32. */
__device__ inline void store_act(void *p, size_t i, bool bf, float v)
{
    if (bf) ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
    else ((float *)p)[i] = v;
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

/* ---------------------------------------------------------------- deferred weights */

/* The host's generator (util/td.c, model.c gen_row), bit for bit. */
__device__ inline uint64_t d_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

__device__ inline uint64_t d_splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ inline uint64_t d_rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* Row r of a tensor whose seed is `seed`, into dst row r (f32 or bf16). */
__global__ void k_gen_rows(void *dst, bool bf, int64_t rows, int64_t cols, uint64_t seed, float scale)
{
    int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (r >= rows) return;
    uint64_t h = 0xcbf29ce484222325ull ^ d_mix64(seed + 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < 8; i++) {
        h ^= ((uint64_t)r >> (8 * i)) & 0xffu;
        h *= 0x100000001b3ull;
    }
    uint64_t x = d_mix64(h ^ 8u), s[4];
    for (int i = 0; i < 4; i++) s[i] = d_splitmix(&x);
    for (int64_t i = 0; i < cols; i++) {
        uint64_t v = d_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = d_rotl(s[3], 45);
        float u = (float)(v >> 40) * (1.0f / 16777216.0f);
        float w = __fmul_rn(scale, __fsub_rn(__fmul_rn(2.0f, u), 1.0f));
        if (bf) ((__nv_bfloat16 *)dst)[r * cols + i] = __float2bfloat16_rn(w);
        else ((float *)dst)[r * cols + i] = w;
    }
}

/* ---------------------------------------------------------------- element-wise kernels */

/* x[t] = embedding(token[t]) */
__global__ void k_embed(const void *emb, bool f32, const int32_t *tok, float *x, int d)
{
    int t = blockIdx.x;
    size_t base = (size_t)tok[t] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        x[(size_t)t * d + i] = f32 ? ((const float *)emb)[base + i]
                                   : __bfloat162float(((const __nv_bfloat16 *)emb)[base + i]);
}

/* out[r] = rmsnorm(x[src(r)]) * w (bf16 or f32), src(r) = rows ? rows[r] : r; optionally
 * x += add first (the residual). */
__global__ void k_norm(float *x, const float *add, const float *w, void *out, bool obf,
                       const int32_t *rows, int d, float eps)
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
        store_act(out, (size_t)r * d + i, obf, x[src + i] * scale * w[i]);
}

/* out[t][c] = silu(gate[t][c]) * up[t][c], gu's row t being gate then up (ff each). Rows
 * on grid y, four columns per thread (16-byte loads) where ff allows, else one. */
__global__ void k_silu_mul(const float *gu, void *out, bool obf, int ff, int T)
{
    const bool vec = ff % 4 == 0;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * (vec ? 4 : 1);
    if (c >= ff) return;
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        const float *gr = gu + (size_t)t * 2 * ff;
        const size_t o = (size_t)t * ff + c;
        if (!vec) {
            const float g = gr[c], u = gr[ff + c];
            store_act(out, o, obf, g / (1.0f + expf(-g)) * u);
            continue;
        }
        const float4 g = *(const float4 *)(gr + c), u = *(const float4 *)(gr + ff + c);
        const float r0 = g.x / (1.0f + expf(-g.x)) * u.x, r1 = g.y / (1.0f + expf(-g.y)) * u.y,
                    r2 = g.z / (1.0f + expf(-g.z)) * u.z, r3 = g.w / (1.0f + expf(-g.w)) * u.w;
        if (obf) {
            __nv_bfloat162 a = __floats2bfloat162_rn(r0, r1), b = __floats2bfloat162_rn(r2, r3);
            uint2 v;
            memcpy(&v.x, &a, 4);
            memcpy(&v.y, &b, 4);
            *(uint2 *)((__nv_bfloat16 *)out + o) = v;
        } else {
            *(float4 *)((float *)out + o) = make_float4(r0, r1, r2, r3);
        }
    }
}

/* RoPE's (cos, sin) for every position and rotation pair, made once at create with the
 * CPU's arithmetic (angles in double). */
__global__ void k_rope_table(float2 *cs, int max_ctx, int hd, float base, float freq_scale, const float *ff)
{
    int half = hd / 2;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < (size_t)max_ctx * half;
         e += (size_t)gridDim.x * blockDim.x) {
        int p = (int)(e / half), i = (int)(e % half);
        double inv = pow((double)base, -2.0 * i / hd);
        double th = (double)p * (double)freq_scale * inv;
        if (ff) th /= (double)ff[i];
        cs[e] = make_float2((float)cos(th), (float)sin(th));
    }
}

/*
 * Biases, RoPE on q and k, and K/V into the pool: one block per token, one thread per
 * rotation pair of any head (q heads first, then k heads), then V. Row t of qkv holds q
 * (qd), k (kd), v (kd); q is rotated in place.
 */
__global__ void k_rope_store(float *qkv, const float *bq, const float *bk, const float *bv,
                             const int32_t *pos, const int32_t *seq, const int32_t *tables,
                             int max_blocks, uint8_t *layer, int n_head, int n_kv, int hd,
                             const float2 *rope_cs, int neox, int block_size, size_t token_bytes,
                             size_t block_bytes, int kv_type)
{
    int t = blockIdx.x, half = hd / 2, qd = n_head * hd, kd = n_kv * hd;
    int p = pos[t];
    int block = tables[(size_t)seq[t] * max_blocks + p / block_size];
    uint8_t *kb = layer + (size_t)block * block_bytes + (size_t)(p % block_size) * token_bytes;
    uint8_t *vb = kb + (size_t)block_size * token_bytes;
    float *qt = qkv + (size_t)t * (qd + 2 * kd), *kt = qt + qd, *vt = kt + kd;
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
        float2 cs = rope_cs[(size_t)p * half + i];
        float c = cs.x, s = cs.y;
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

/* ---------------------------------------------------------------- split-K attention */

/*
 * One block per (listed row, KV head, split): the query heads of the KV head against the
 * split's range of the row's positions [0, pos], in sub-tiles of SPLIT_SUB positions with
 * an online softmax. Scores: each warp takes positions, its lanes split the head
 * dimension, a shuffle reduction gives each head's dot product. Output: each thread owns
 * head dimensions (for every query head of the group) and sums over the sub-tile's V rows,
 * read coalesced. Writes the un-normalised partial output and (max, sum) per query head.
 */
#define SPLIT_THREADS 128
#define SPLIT_SUB 32
#define SPLIT_MAX 32
#define ATT_MAX_GROUP 16
#define ATT_MAX_PER_LANE 8 /* head_dim <= 256 */
#define ATT_MAX_PER_THREAD (256 / SPLIT_THREADS)

__global__ void __launch_bounds__(SPLIT_THREADS)
k_attn_split(const float *qkv, int qstride, const int32_t *list, const int32_t *pos, const int32_t *seq,
             const int32_t *tables, int max_blocks, const uint8_t *layer, int n_head, int n_kv, int hd,
             int block_size, size_t token_bytes, size_t block_bytes, int kv_type, int splits,
             float *part)
{
    extern __shared__ float sm[];
    const int group = n_head / n_kv;
    float *qs = sm;                        /* [group][hd], pre-scaled */
    float *ss = qs + group * hd;           /* [group][SPLIT_SUB] scores, then weights */
    float *ml = ss + group * SPLIT_SUB;    /* [group][2] running max and sum */
    float *resc = ml + 2 * group;          /* [group] this sub-tile's rescale */
    const uint8_t **kp = (const uint8_t **)(resc + group + (group & 1)); /* [SPLIT_SUB] */
    const int i = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z;
    const int t = list[i], p = pos[t], lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n = p + 1, chunk = (n + splits - 1) / splits;
    const int j0 = sp * chunk, j1 = min(n, j0 + chunk);
    const int esize = kv_esize(kv_type);
    const int32_t *table = tables + (size_t)seq[t] * max_blocks;
    const float scale = 1.0f / sqrtf((float)hd);
    const float *qt = qkv + (size_t)t * qstride + (size_t)kh * group * hd;
    for (int c = threadIdx.x; c < group * hd; c += blockDim.x) qs[c] = qt[c] * scale;
    if (threadIdx.x < group) {
        ml[2 * threadIdx.x] = -INFINITY;
        ml[2 * threadIdx.x + 1] = 0.0f;
    }
    float acc[ATT_MAX_GROUP][ATT_MAX_PER_THREAD];
#pragma unroll
    for (int g = 0; g < ATT_MAX_GROUP; g++)
#pragma unroll
        for (int c = 0; c < ATT_MAX_PER_THREAD; c++) acc[g][c] = 0.0f;
    for (int jb = j0; jb < j1; jb += SPLIT_SUB) {
        const int nb = min(SPLIT_SUB, j1 - jb);
        __syncthreads(); /* the previous sub-tile is done with ss and kp */
        if (threadIdx.x < nb) {
            int j = jb + threadIdx.x;
            kp[threadIdx.x] = layer + (size_t)table[j / block_size] * block_bytes +
                              (size_t)(j % block_size) * token_bytes + (size_t)kh * hd * esize;
        }
        __syncthreads();
#pragma unroll 2
        for (int jj = warp; jj < nb; jj += SPLIT_THREADS / 32) {
            const uint8_t *kr = kp[jj];
            float kv[ATT_MAX_PER_LANE];
#pragma unroll
            for (int k = 0; k < ATT_MAX_PER_LANE; k++) {
                int d = lane + 32 * k;
                kv[k] = d < hd ? load_kv(kr, d, kv_type) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < ATT_MAX_GROUP; g++) {
                if (g >= group) break;
                float s = 0.0f;
#pragma unroll
                for (int k = 0; k < ATT_MAX_PER_LANE; k++) {
                    int d = lane + 32 * k;
                    if (d < hd) s += qs[g * hd + d] * kv[k];
                }
                for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (lane == 0) ss[g * SPLIT_SUB + jj] = s;
            }
        }
        __syncthreads();
        if (threadIdx.x < group) {
            int g = threadIdx.x;
            float *row = ss + g * SPLIT_SUB, mx = ml[2 * g];
            for (int jj = 0; jj < nb; jj++) mx = fmaxf(mx, row[jj]);
            float r = expf(ml[2 * g] - mx), sum = 0.0f;
            for (int jj = 0; jj < nb; jj++) {
                float e = expf(row[jj] - mx);
                row[jj] = e;
                sum += e;
            }
            ml[2 * g] = mx;
            ml[2 * g + 1] = ml[2 * g + 1] * r + sum;
            resc[g] = r;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < ATT_MAX_PER_THREAD; c++) {
            int d = threadIdx.x + c * SPLIT_THREADS;
            if (d >= hd) break;
#pragma unroll
            for (int g = 0; g < ATT_MAX_GROUP; g++) {
                if (g >= group) break;
                acc[g][c] *= resc[g];
            }
            /* eight V loads in flight, then their sums */
            for (int j8 = 0; j8 < nb; j8 += 8) {
                float v[8];
#pragma unroll
                for (int u = 0; u < 8; u++)
                    v[u] = j8 + u < nb ? load_kv(kp[j8 + u] + (size_t)block_size * token_bytes, d, kv_type) : 0.0f;
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    if (j8 + u >= nb) break;
#pragma unroll
                    for (int g = 0; g < ATT_MAX_GROUP; g++) {
                        if (g >= group) break;
                        acc[g][c] += ss[g * SPLIT_SUB + j8 + u] * v[u];
                    }
                }
            }
        }
    }
    __syncthreads();
    /* part: per (listed row, query head, split): hd outputs, then max and sum */
#pragma unroll
    for (int g = 0; g < ATT_MAX_GROUP; g++) {
        if (g >= group) break;
        float *o = part + (((size_t)i * n_head + (size_t)kh * group + g) * splits + sp) * (hd + 2);
#pragma unroll
        for (int c = 0; c < ATT_MAX_PER_THREAD; c++) {
            int d = threadIdx.x + c * SPLIT_THREADS;
            if (d < hd) o[d] = acc[g][c];
        }
        if (threadIdx.x == 0) {
            o[hd] = ml[2 * g];
            o[hd + 1] = ml[2 * g + 1];
        }
    }
}

/* Combine the splits of each (listed row, query head) into the attention output. */
__global__ void k_attn_merge(const float *part, const int32_t *list, int n_head, int hd, int splits,
                             void *out, bool obf)
{
    const int i = blockIdx.x, h = blockIdx.y, t = list[i];
    const float *b = part + ((size_t)i * n_head + h) * splits * (hd + 2);
    float mx = -INFINITY;
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, b[(size_t)s * (hd + 2) + hd]);
    float den = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float *o = b + (size_t)s * (hd + 2);
        if (o[hd + 1] > 0.0f) den += expf(o[hd] - mx) * o[hd + 1];
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float *o = b + (size_t)s * (hd + 2);
            if (o[hd + 1] > 0.0f) num += expf(o[hd] - mx) * o[d];
        }
        store_act(out, (size_t)t * n_head * hd + (size_t)h * hd + d, obf, num / den);
    }
}

/* ---------------------------------------------------------------- tensor-core prefill */

/*
 * mma.sync.m16n8k16 with f32 accumulation. Fragments (PTX ISA, per lane, g = lane / 4,
 * c = lane % 4): A (16x16, row-major) a0 = (g, 2c..2c+1), a1 = (g+8, 2c..), a2 = (g,
 * 2c+8..), a3 = (g+8, 2c+8..); B (16x8, k x n) b0 = (k 2c..2c+1, n g), b1 = (k 2c+8.., n g);
 * C (16x8) c0,c1 = (g, 2c..2c+1), c2,c3 = (g+8, 2c..2c+1).
 */
template <bool F16> __device__ inline void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    if (F16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats as a packed pair of 16-bit values (lo first). */
template <bool F16> __device__ inline uint32_t pack2(float lo, float hi)
{
    uint16_t a, b;
    if (F16) {
        __half x = __float2half_rn(lo), y = __float2half_rn(hi);
        a = *(uint16_t *)&x;
        b = *(uint16_t *)&y;
    } else {
        __nv_bfloat16 x = __float2bfloat16_rn(lo), y = __float2bfloat16_rn(hi);
        a = *(uint16_t *)&x;
        b = *(uint16_t *)&y;
    }
    return (uint32_t)a | ((uint32_t)b << 16);
}

/* Shared-memory helpers: cp.async (16 bytes, zero-filled when !valid) and ldmatrix. */
__device__ inline uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ inline void cp_async16(void *smem, const void *gmem, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(valid ? 16 : 0));
}

__device__ inline void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ inline void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Four 8x8 matrices of 16-bit values: lane l gives the address of row l % 8 of matrix
 * l / 8; r[i] is matrix i's fragment (lane t: row t / 4, columns 2 (t % 4) and + 1, or with
 * .trans rows 2 (t % 4) and + 1 of column t / 4). */
__device__ inline void ldsm_x4(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ inline void ldsm_x4_t(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

#define TILE_ROWS 16
#define TILE_KEYS 64
#define TILE_PAD 8 /* 16-bit elements of padding per shared row: conflict-free fragments */

/*
 * One block per (tile, KV head), one warp per query head of the group. A tile is up to 16
 * consecutive rows of one sequence at consecutive positions (tiles[2i] = first row,
 * tiles[2i+1] = rows). Each warp keeps its head's 16 x HD queries as A fragments, loops
 * over 64-key tiles of K and V staged in shared memory (shared by the group's heads; two
 * stages, the next tile's cp.async in flight while this one is computed; fragments read
 * with ldmatrix), and keeps O (16 x HD) and the softmax state in registers. Keys past a
 * row's position are masked. Scores use exp2 with log2(e) folded into the query scale.
 */
template <int HD, bool F16>
__global__ void k_attn_tiles(const float *qkv, int qstride, const int32_t *tiles, const int32_t *pos,
                             const int32_t *seq, const int32_t *tables, int max_blocks,
                             const uint8_t *layer, int n_head, int n_kv, int block_size,
                             size_t token_bytes, size_t block_bytes, void *out, bool obf)
{
    extern __shared__ uint16_t kvs[]; /* 2 stages x (K, V) x [TILE_KEYS][HD + TILE_PAD] */
    constexpr int LD = HD + TILE_PAD, STAGE = 2 * TILE_KEYS * LD, VEC = HD / 8;
    const int group = n_head / n_kv, kh = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, c = lane % 4, head = kh * group + warp;
    /* the last tiles first: they have the most keys (causal), so the long blocks start in
     * the first wave and the short ones fill the tail */
    const int ti = gridDim.x - 1 - blockIdx.x;
    const int r0 = tiles[2 * ti], nr = tiles[2 * ti + 1];
    const int32_t *table = tables + (size_t)seq[r0] * max_blocks;
    const bool bs_pow2 = (block_size & (block_size - 1)) == 0;
    const int bs_shift = __ffs(block_size) - 1;
    /* this lane's two rows (g and g + 8) and their positions; rows past nr see no key */
    const int pa = g < nr ? pos[r0 + g] : -1, pb = g + 8 < nr ? pos[r0 + g + 8] : -1;
    const int n_keys = pos[r0 + nr - 1] + 1;
    const float qscale = 1.4426950408889634f / sqrtf((float)HD);

    /* K and V rows [kt, kt + TILE_KEYS) into stage `buf`, zeros past n_keys */
    auto stage_load = [&](int kt, int buf) {
        uint16_t *kd = kvs + buf * STAGE, *vd = kd + TILE_KEYS * LD;
        for (int e = threadIdx.x; e < TILE_KEYS * VEC; e += blockDim.x) {
            int j = e / VEC, v = e % VEC, key = kt + j;
            bool ok = key < n_keys;
            int kk = ok ? key : 0;
            const int blk = bs_pow2 ? kk >> bs_shift : kk / block_size;
            const int in_blk = bs_pow2 ? kk & (block_size - 1) : kk % block_size;
            const uint8_t *kr = layer + (size_t)table[blk] * block_bytes + (size_t)in_blk * token_bytes +
                                (size_t)kh * HD * 2;
            cp_async16(kd + j * LD + v * 8, (const uint4 *)kr + v, ok);
            cp_async16(vd + j * LD + v * 8, (const uint4 *)(kr + (size_t)block_size * token_bytes) + v, ok);
        }
        cp_async_commit();
    };
    stage_load(0, 0);

    uint32_t qa[HD / 16][4];
    {
        const float *qa_row = qkv + (size_t)(r0 + (g < nr ? g : 0)) * qstride + (size_t)head * HD;
        const float *qb_row = qkv + (size_t)(r0 + (g + 8 < nr ? g + 8 : 0)) * qstride + (size_t)head * HD;
#pragma unroll
        for (int k = 0; k < HD / 16; k++) {
            int c0 = k * 16 + 2 * c;
            qa[k][0] = pack2<F16>(qa_row[c0] * qscale, qa_row[c0 + 1] * qscale);
            qa[k][1] = pack2<F16>(qb_row[c0] * qscale, qb_row[c0 + 1] * qscale);
            qa[k][2] = pack2<F16>(qa_row[c0 + 8] * qscale, qa_row[c0 + 9] * qscale);
            qa[k][3] = pack2<F16>(qb_row[c0 + 8] * qscale, qb_row[c0 + 9] * qscale);
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;

    for (int kt = 0, it = 0; kt < n_keys; kt += TILE_KEYS, it++) {
        const int buf = it & 1;
        if (kt + TILE_KEYS < n_keys) {
            stage_load(kt + TILE_KEYS, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t *ks = kvs + buf * STAGE, *vs = ks + TILE_KEYS * LD;
        /* S = Q K^T for 64 keys: 8 n-tiles of 8 keys; ldmatrix gives two k-steps' B */
        float s[TILE_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < TILE_KEYS / 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const uint16_t *kr = ks + (n * 8 + (lane & 7)) * LD + (lane >> 3) * 8;
#pragma unroll
            for (int kk = 0; kk < HD / 32; kk++) {
                uint32_t b[4];
                ldsm_x4(b, kr + kk * 32);
                mma16816<F16>(s[n], qa[2 * kk], b[0], b[1]);
                mma16816<F16>(s[n], qa[2 * kk + 1], b[2], b[3]);
            }
        }
        /* mask, row maxima (rows g and g + 8; the 4 lanes of a row hold 2 keys per n-tile) */
        float xa = -INFINITY, xb = -INFINITY;
#pragma unroll
        for (int n = 0; n < TILE_KEYS / 8; n++) {
            int key = kt + n * 8 + 2 * c;
            if (key > pa) s[n][0] = -INFINITY;
            if (key + 1 > pa) s[n][1] = -INFINITY;
            if (key > pb) s[n][2] = -INFINITY;
            if (key + 1 > pb) s[n][3] = -INFINITY;
            xa = fmaxf(xa, fmaxf(s[n][0], s[n][1]));
            xb = fmaxf(xb, fmaxf(s[n][2], s[n][3]));
        }
        for (int off = 1; off < 4; off <<= 1) {
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, off));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, off));
        }
        float na = fmaxf(ma, xa), nb = fmaxf(mb, xb);
        /* a row with no key yet keeps exponent base 0 (everything it has is masked) */
        float ba = na == -INFINITY ? 0.0f : na, bb = nb == -INFINITY ? 0.0f : nb;
        float ra = exp2f(ma - ba), rb = exp2f(mb - bb);
        ma = na;
        mb = nb;
        float sa = 0.0f, sb = 0.0f;
#pragma unroll
        for (int n = 0; n < TILE_KEYS / 8; n++) {
            s[n][0] = exp2f(s[n][0] - ba);
            s[n][1] = exp2f(s[n][1] - ba);
            s[n][2] = exp2f(s[n][2] - bb);
            s[n][3] = exp2f(s[n][3] - bb);
            sa += s[n][0] + s[n][1];
            sb += s[n][2] + s[n][3];
        }
        la = la * ra + sa;
        lb = lb * rb + sb;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            o[n][0] *= ra;
            o[n][1] *= ra;
            o[n][2] *= rb;
            o[n][3] *= rb;
        }
        /* O += P V: P's accumulators become A fragments (keys 16k..16k+15); ldmatrix.trans
         * gives the B fragments of two 8-dim n-tiles at once */
#pragma unroll
        for (int k = 0; k < TILE_KEYS / 16; k++) {
            uint32_t pa4[4] = {pack2<F16>(s[2 * k][0], s[2 * k][1]), pack2<F16>(s[2 * k][2], s[2 * k][3]),
                               pack2<F16>(s[2 * k + 1][0], s[2 * k + 1][1]),
                               pack2<F16>(s[2 * k + 1][2], s[2 * k + 1][3])};
            const uint16_t *vr = vs + (k * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
#pragma unroll
            for (int n = 0; n < HD / 8; n += 2) {
                uint32_t b[4];
                ldsm_x4_t(b, vr + n * 8);
                mma16816<F16>(o[n], pa4, b[0], b[1]);
                mma16816<F16>(o[n + 1], pa4, b[2], b[3]);
            }
        }
        __syncthreads(); /* this stage is consumed before the next prefetch overwrites it */
    }
    for (int off = 1; off < 4; off <<= 1) {
        la += __shfl_xor_sync(0xffffffffu, la, off);
        lb += __shfl_xor_sync(0xffffffffu, lb, off);
    }
    const int qd = n_head * HD;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        int d = n * 8 + 2 * c;
        if (g < nr) {
            size_t at = (size_t)(r0 + g) * qd + (size_t)head * HD + d;
            store_act(out, at, obf, o[n][0] / la);
            store_act(out, at + 1, obf, o[n][1] / la);
        }
        if (g + 8 < nr) {
            size_t at = (size_t)(r0 + g + 8) * qd + (size_t)head * HD + d;
            store_act(out, at, obf, o[n][2] / lb);
            store_act(out, at + 1, obf, o[n][3] / lb);
        }
    }
}

/* ---------------------------------------------------------------- tensor-core decode */

/*
 * Decode attention (one query row per sequence) on tensor cores, for bf16/f16 KV. One
 * block per (listed row, KV head, split), DEC_WARPS warps; the split's keys are cut into
 * one contiguous range per warp, walked 16 keys (one mma k-step of P V) at a time. The
 * group's query heads are the mma's M rows (head g and g + 8 per lane), so K and V are
 * read once per KV head.
 *
 * Nothing goes through shared memory in the loop: each lane loads K and V straight into
 * registers with 16-byte loads, and the fragments' index maps are chosen so that those
 * loads are the fragments. A dot product does not care about the order of the head
 * dimension, so lane (g, c) takes dims 32k + 8c .. + 7 of key g as the B fragments of two
 * k-steps of S = Q K^T, and Q's A fragments use the same order. For O += P V the B
 * fragment pairs two keys at one dim: lane (g, c) loads dims 64h + 8g .. + 7 of keys 2c,
 * 2c + 1, 2c + 8, 2c + 9 and byte-permutes them into the fragments of eight n-tiles,
 * n-tile (h, k) holding dim 64h + 8g + k at column g; the output columns are mapped back
 * when stored. Loads of keys past the range are zero-filled, and their scores masked.
 *
 * The block's warps merge through shared memory at the end and write one partial (natural
 * log max, sum, unnormalised output) per query head, as k_attn_split does, for
 * k_attn_merge. A split's range is ceil(n / splits) keys rounded up to 16 (at least
 * DEC_MIN_KEYS), cut into per-warp ranges of a multiple of 16 keys, computed from the
 * row's position on the device, so a captured graph stays right as contexts grow.
 *
 * Latency is hidden by running ahead: a tile of 16 keys starts at a multiple of 16, so
 * with block_size a multiple of 16 it lies in one block; the block table is read two
 * tiles ahead and the next tile's K and V are loaded before this tile's arithmetic
 * (registers that cost no occupancy: two blocks per SM either way). Each step took from
 * 4.5 to 3.1 ms of attention per decode step at batch 64 (BENCHMARKS.md).
 */
#define DEC_WARPS 4
#define DEC_MIN_KEYS 64

template <int HD, bool F16>
__global__ void __launch_bounds__(DEC_WARPS * 32)
k_attn_dec(const float *qkv, int qstride, const int32_t *list, const int32_t *pos, const int32_t *seq,
           const int32_t *tables, int max_blocks, const uint8_t *layer, int n_head, int n_kv, int block_size,
           size_t token_bytes, size_t block_bytes, int splits, float *part)
{
    __shared__ float wm[DEC_WARPS][16], wl[DEC_WARPS][16];
    extern __shared__ float wo[]; /* [DEC_WARPS][group][HD] */
    const int group = n_head / n_kv, i = blockIdx.x, kh = blockIdx.y, sp = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int t = list[i], n = pos[t] + 1;
    int chunk = (n + splits - 1) / splits;
    chunk = chunk < DEC_MIN_KEYS ? DEC_MIN_KEYS : (chunk + 15) & ~15;
    const int per = ((chunk + DEC_WARPS - 1) / DEC_WARPS + 15) & ~15;
    const int j0 = sp * chunk + warp * per;
    const int j1 = min(min(n, (sp + 1) * chunk), j0 + per);
    const int32_t *table = tables + (size_t)seq[t] * max_blocks;
    const size_t kv_off = (size_t)kh * HD * 2, v_off = (size_t)block_size * token_bytes;
    /* Tiles start at multiples of 16 keys and block_size is a multiple of 16, so a tile
     * lies in one block, whose id is looked up two tiles ahead. */
    auto blk_of = [&](int kb) -> int { return kb < j1 ? table[kb / block_size] : 0; };

    /* Q (heads g and g + 8 of the group, pre-scaled by log2(e) / sqrt(HD)) in the K order */
    uint32_t qa[HD / 16][4];
    {
        const float qscale = 1.4426950408889634f / sqrtf((float)HD);
        const float *qh = qkv + (size_t)t * qstride + (size_t)kh * group * HD;
        const bool va = g < group, vb = g + 8 < group;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            const int d = 32 * (ks / 2) + 8 * c + 4 * (ks % 2);
            const float *a = qh + (size_t)g * HD + d, *b = qh + (size_t)(g + 8) * HD + d;
            qa[ks][0] = va ? pack2<F16>(a[0] * qscale, a[1] * qscale) : 0u;
            qa[ks][2] = va ? pack2<F16>(a[2] * qscale, a[3] * qscale) : 0u;
            qa[ks][1] = vb ? pack2<F16>(b[0] * qscale, b[1] * qscale) : 0u;
            qa[ks][3] = vb ? pack2<F16>(b[2] * qscale, b[3] * qscale) : 0u;
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int k = 0; k < HD / 8; k++) o[k][0] = o[k][1] = o[k][2] = o[k][3] = 0.0f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    /* K rows kb + g and kb + 8 + g; V rows kb + 2c, + 1, + 8, + 9. The next tile's loads
     * are issued before this tile's arithmetic (its registers cost no occupancy: the
     * block count per SM is already bound by the registers), so a warp always has one
     * tile, and the table lookups in front of it, in flight. */
    auto load = [&](int kb, int blk, uint4 (&kr)[2][HD / 32], uint4 (&vr)[4][HD / 64]) {
        const uint8_t *base = layer + (size_t)blk * block_bytes + (size_t)(kb % block_size) * token_bytes + kv_off;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int at = 8 * h + g;
            const uint4 *p = kb + at < j1 ? (const uint4 *)(base + (size_t)at * token_bytes) : nullptr;
#pragma unroll
            for (int k = 0; k < HD / 32; k++) kr[h][k] = p ? p[4 * k + c] : zero;
        }
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int at = 2 * c + (r & 1) + 8 * (r >> 1);
            const uint4 *p = kb + at < j1 ? (const uint4 *)(base + v_off + (size_t)at * token_bytes) : nullptr;
#pragma unroll
            for (int h = 0; h < HD / 64; h++) vr[r][h] = p ? p[8 * h + g] : zero;
        }
    };
    uint4 kr[2][HD / 32], vr[4][HD / 64];
    if (j0 < j1) load(j0, blk_of(j0), kr, vr);
    int b_next = blk_of(j0 + 16);
    for (int kb = j0; kb < j1; kb += 16) {
        uint4 nk[2][HD / 32], nv[4][HD / 64];
        const int b_after = blk_of(kb + 32);
        if (kb + 16 < j1) load(kb + 16, b_next, nk, nv);
        b_next = b_after;
        /* S for keys kb .. kb + 15: two n-tiles */
        float s[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.0f;
#pragma unroll
            for (int k = 0; k < HD / 32; k++) {
                mma16816<F16>(s[h], qa[2 * k], kr[h][k].x, kr[h][k].y);
                mma16816<F16>(s[h], qa[2 * k + 1], kr[h][k].z, kr[h][k].w);
            }
        }
        float xa = -INFINITY, xb = -INFINITY;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int key = kb + 8 * h + 2 * c;
            if (key >= j1) s[h][0] = s[h][2] = -INFINITY;
            if (key + 1 >= j1) s[h][1] = s[h][3] = -INFINITY;
            xa = fmaxf(xa, fmaxf(s[h][0], s[h][1]));
            xb = fmaxf(xb, fmaxf(s[h][2], s[h][3]));
        }
        for (int off = 1; off < 4; off <<= 1) {
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, off));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, off));
        }
        /* the first key of a warp's range is always valid, so the maxima are finite */
        const float na = fmaxf(ma, xa), nb = fmaxf(mb, xb);
        const float ra = exp2f(ma - na), rb = exp2f(mb - nb);
        ma = na;
        mb = nb;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            s[h][0] = exp2f(s[h][0] - na);
            s[h][1] = exp2f(s[h][1] - na);
            s[h][2] = exp2f(s[h][2] - nb);
            s[h][3] = exp2f(s[h][3] - nb);
        }
        la = la * ra + s[0][0] + s[0][1] + s[1][0] + s[1][1];
        lb = lb * rb + s[0][2] + s[0][3] + s[1][2] + s[1][3];
        const uint32_t pa[4] = {pack2<F16>(s[0][0], s[0][1]), pack2<F16>(s[0][2], s[0][3]),
                                pack2<F16>(s[1][0], s[1][1]), pack2<F16>(s[1][2], s[1][3])};
#pragma unroll
        for (int h = 0; h < HD / 64; h++) {
            const uint32_t w0[4] = {vr[0][h].x, vr[0][h].y, vr[0][h].z, vr[0][h].w};
            const uint32_t w1[4] = {vr[1][h].x, vr[1][h].y, vr[1][h].z, vr[1][h].w};
            const uint32_t w2[4] = {vr[2][h].x, vr[2][h].y, vr[2][h].z, vr[2][h].w};
            const uint32_t w3[4] = {vr[3][h].x, vr[3][h].y, vr[3][h].z, vr[3][h].w};
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const uint32_t sel = k & 1 ? 0x7632u : 0x5410u;
                float *acc = o[8 * h + k];
                acc[0] *= ra;
                acc[1] *= ra;
                acc[2] *= rb;
                acc[3] *= rb;
                mma16816<F16>(acc, pa, __byte_perm(w0[k / 2], w1[k / 2], sel), __byte_perm(w2[k / 2], w3[k / 2], sel));
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int k = 0; k < HD / 32; k++) kr[h][k] = nk[h][k];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int h = 0; h < HD / 64; h++) vr[r][h] = nv[r][h];
    }
    for (int off = 1; off < 4; off <<= 1) {
        la += __shfl_xor_sync(0xffffffffu, la, off);
        lb += __shfl_xor_sync(0xffffffffu, lb, off);
    }
    /* the warps' partials into shared memory (n-tile (h, k) column 2c + e is dim
     * 64h + 8(2c + e) + k), then one per query head into part */
    float *mine = wo + (size_t)warp * group * HD;
    if (c == 0) {
        if (g < group) wm[warp][g] = ma, wl[warp][g] = la;
        if (g + 8 < group) wm[warp][g + 8] = mb, wl[warp][g + 8] = lb;
    }
#pragma unroll
    for (int h = 0; h < HD / 64; h++)
#pragma unroll
        for (int k = 0; k < 8; k++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int d = 64 * h + 8 * (2 * c + e) + k;
                if (g < group) mine[g * HD + d] = o[8 * h + k][e];
                if (g + 8 < group) mine[(g + 8) * HD + d] = o[8 * h + k][2 + e];
            }
    __syncthreads();
    for (int e = threadIdx.x; e < group * (HD + 2); e += blockDim.x) {
        const int hg = e / (HD + 2), d = e % (HD + 2);
        float mx = -INFINITY;
        for (int w = 0; w < DEC_WARPS; w++)
            if (wl[w][hg] > 0.0f) mx = fmaxf(mx, wm[w][hg]);
        float v = 0.0f;
        for (int w = 0; w < DEC_WARPS; w++) {
            if (!(wl[w][hg] > 0.0f)) continue;
            const float sc = exp2f(wm[w][hg] - mx);
            v += sc * (d < HD ? wo[((size_t)w * group + hg) * HD + d] : d == HD ? 0.0f : wl[w][hg]);
        }
        if (d == HD) v = mx * 0.6931471805599453f; /* the merge works in natural log */
        part[(((size_t)i * n_head + (size_t)kh * group + hg) * splits + sp) * (HD + 2) + d] = v;
    }
}

/* ---------------------------------------------------------------- small-batch GEMV */

/*
 * y[t][r] = W[r] . x[t] for NT <= 8 rows of bf16 input: the weights stream through once
 * (16-byte loads, one warp per output row, several loads in flight per lane), x stays in
 * L1. cuBLAS's GEMM reaches about two thirds of the copy bandwidth at these shapes; this
 * is what a decode step of a small batch is bound by.
 */
__device__ inline void bf16x8(uint4 v, float f[8])
{
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

#define GEMV_THREADS 256
#define GEMV_MAX_T 8

template <int NT>
__global__ void __launch_bounds__(GEMV_THREADS)
k_gemv(const __nv_bfloat16 *__restrict__ W, const __nv_bfloat16 *__restrict__ x, float *__restrict__ y, int rows,
       int cols)
{
    const int lane = threadIdx.x % 32;
    const int r = (int)((blockIdx.x * (unsigned)GEMV_THREADS + threadIdx.x) / 32);
    if (r >= rows) return;
    const uint4 *wr = (const uint4 *)(W + (size_t)r * cols);
    const int nv = cols / 8;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
#pragma unroll 4
    for (int v = lane; v < nv; v += 32) {
        float wf[8];
        bf16x8(__ldg(wr + v), wf);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float xf[8];
            bf16x8(__ldg((const uint4 *)(x + (size_t)t * cols) + v), xf);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[t] = fmaf(wf[i], xf[i], acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float a = acc[t];
        for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == 0) y[(size_t)t * rows + r] = a;
    }
}

/* ---------------------------------------------------------------- batch-1 decode as one kernel */

#include "backend/cuda/mega.cuh"
#include "backend/cuda/sample.cuh"

/* ---------------------------------------------------------------- greedy sampling */

/* The warp's best (value, index): the largest value, the lowest index among equals. */
__device__ inline void warp_argmax(float *best, int *idx)
{
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, *best, o);
        int oi = __shfl_xor_sync(0xffffffffu, *idx, o);
        if (ov > *best || (ov == *best && oi < *idx)) {
            *best = ov;
            *idx = oi;
        }
    }
}

/* out[r] = the lowest index of row r's largest logit (as sampler_argmax on the host). */
__global__ void k_argmax(const float *logits, int n, int32_t *out)
{
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float *row = logits + (size_t)blockIdx.x * n;
    float best = -INFINITY;
    int idx = n;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (row[i] > best) {
            best = row[i];
            idx = i;
        }
    warp_argmax(&best, &idx);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    if (l == 0) {
        bv[w] = best;
        bi[w] = idx;
    }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x / 32;
        best = l < nw ? bv[l] : -INFINITY;
        idx = l < nw ? bi[l] : n;
        warp_argmax(&best, &idx);
        if (l == 0) out[blockIdx.x] = idx < n ? idx : 0;
    }
}

/* ---------------------------------------------------------------- host side */

static uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static int alloc_mat(td_cuda_fwd *f, dev_mat *dm, int64_t rows, int64_t cols, td_err *err)
{
    dm->rows = rows;
    dm->cols = cols;
    dm->f32 = !f->bf;
    size_t bytes = (size_t)rows * (size_t)cols * (dm->f32 ? 4 : 2);
    CK(cudaMalloc(&dm->p, bytes));
    f->device_bytes += bytes;
    return 0;
}

/*
 * Weights into rows [row0, row0 + w->rows) of dm: f32 and bf16 are copied as they are,
 * other types are dequantised on the host and rounded to bf16, and deferred random
 * weights (td_weight.gen) are made on the device.
 */
static int upload_into(td_cuda_fwd *f, dev_mat *dm, int64_t row0, const td_weight *w, td_err *err)
{
    if (w->cols != dm->cols || row0 + w->rows > dm->rows)
        return td_err_set(err, TD_EINVAL, "cuda: a %lld x %lld matrix does not fit its device matrix",
                          (long long)w->rows, (long long)w->cols);
    size_t esz = dm->f32 ? 4 : 2;
    uint8_t *dst = (uint8_t *)dm->p + (size_t)row0 * (size_t)dm->cols * esz;
    if (!w->data) {
        if (!w->gen.on) return td_err_set(err, TD_EINVAL, "cuda: a weight matrix has no data");
        k_gen_rows<<<(unsigned)((w->rows + 127) / 128), 128, 0, f->stream>>>(dst, !dm->f32, w->rows, w->cols,
                                                                           w->gen.seed, w->gen.scale);
        CK(cudaGetLastError());
        return 0;
    }
    if (dm->f32 != (w->type == TD_TYPE_F32) && dm->f32)
        return td_err_set(err, TD_EINVAL, "cuda: an f32 device matrix from %s weights", td_type_name(w->type));
    if ((dm->f32 && w->type == TD_TYPE_F32) || (!dm->f32 && w->type == TD_TYPE_BF16)) {
        CK(cudaMemcpy(dst, w->data, (size_t)w->rows * (size_t)w->cols * esz, cudaMemcpyHostToDevice));
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
        cudaError_t e = cudaMemcpy(dst + (size_t)r0 * w->cols * 2, stage, (size_t)nr * w->cols * 2,
                                   cudaMemcpyHostToDevice);
        if (e != cudaSuccess) rc = td_err_set(err, TD_EIO, "cuda: weight upload: %s", cudaGetErrorString(e));
    }
    free(row);
    free(stage);
    return rc;
}

/* One device matrix made of the given weights stacked by rows (wq wk wv; gate up). */
static int upload_stack(td_cuda_fwd *f, dev_mat *dm, const td_weight *const *ws, int n, td_err *err)
{
    int64_t rows = 0;
    for (int i = 0; i < n; i++) rows += ws[i]->rows;
    int rc = alloc_mat(f, dm, rows, ws[0]->cols, err);
    for (int64_t i = 0, r = 0; i < n && !rc; r += ws[i]->rows, i++) rc = upload_into(f, dm, r, ws[i], err);
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

/* TD_CUDA_PROFILE: an event before each launch, tagged with its category. */
static void mark(td_cuda_fwd *f, int cat)
{
    if (!f->prof || f->prof_steps_only || f->n_marks >= PROF_MARKS) return;
    cudaEventRecord(f->marks[f->n_marks], f->stream);
    f->mark_cat[f->n_marks++] = cat;
}

/* y[T][rows] = x[T][cols] W^T; x is bf16 for a bf16 matrix, else f32. */
static int gemm(td_cuda_fwd *f, float *y, const void *x, const dev_mat *w, int T, td_err *err)
{
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st;
    mark(f, PROF_GEMM);
    if (!w->f32 && T <= GEMV_MAX_T && w->cols % 8 == 0 && f->use_gemv) {
        unsigned blocks = (unsigned)((w->rows * 32 + GEMV_THREADS - 1) / GEMV_THREADS);
        const __nv_bfloat16 *W = (const __nv_bfloat16 *)w->p, *xb = (const __nv_bfloat16 *)x;
        int R = (int)w->rows, C = (int)w->cols;
        switch (T) {
        case 1: k_gemv<1><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        case 2: k_gemv<2><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        case 3: k_gemv<3><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        case 4: k_gemv<4><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        case 5: k_gemv<5><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        case 6: k_gemv<6><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        case 7: k_gemv<7><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        default: k_gemv<8><<<blocks, GEMV_THREADS, 0, f->stream>>>(W, xb, y, R, C); break;
        }
        return 0;
    }
    if (w->f32)
        st = cublasSgemm(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, T, (int)w->cols, &one,
                         (const float *)w->p, (int)w->cols, (const float *)x, (int)w->cols, &zero, y,
                         (int)w->rows);
    else
        st = cublasGemmEx(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)w->rows, T, (int)w->cols, &one, w->p,
                          CUDA_R_16BF, (int)w->cols, x, CUDA_R_16BF, (int)w->cols, &zero, y, CUDA_R_32F,
                          (int)w->rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) return td_err_set(err, TD_EIO, "cuda: cuBLAS GEMM failed (%d)", (int)st);
    return 0;
}

static void free_mat(dev_mat *m)
{
    if (m->p) cudaFree(m->p);
    m->p = nullptr;
}

static void prof_report(const td_cuda_fwd *f)
{
    static const char *kind[2] = {"decode steps", "steps with prefill rows"};
    for (int k = 0; k < 2; k++) {
        if (!f->prof_steps[k]) continue;
        double n = (double)f->prof_steps[k];
        if (f->prof_steps_only)
            fprintf(stderr, "cuda profile: %ld %s (%.1f rows each): %.3f ms per step on the GPU\n",
                    f->prof_steps[k], kind[k], (double)f->prof_tokens[k] / n, f->prof_ms[k][PROF_STEP] / n);
        else
            fprintf(stderr,
                    "cuda profile: %ld %s (%.1f rows each): per step gemm %.3f ms, attention %.3f ms, "
                    "other %.3f ms\n",
                    f->prof_steps[k], kind[k], (double)f->prof_tokens[k] / n, f->prof_ms[k][PROF_GEMM] / n,
                    f->prof_ms[k][PROF_ATT] / n, f->prof_ms[k][PROF_OTHER] / n);
    }
}

static void mk_times_report(const td_cuda_fwd *f);

void td_cuda_fwd_free(td_cuda_fwd *f)
{
    if (f) cudaSetDevice(f->dev); /* the calling thread's current device may be another */
    if (!f) return;
    if (f->prof) prof_report(f);
    mk_times_report(f);
    if (f->mk_times) cudaFree(f->mk_times);
    if (f->mk_h_times) cudaFreeHost(f->mk_h_times);
    if (f->mk_h_am) cudaFreeHost(f->mk_h_am);
    if (f->mk_h_in) cudaFreeHost(f->mk_h_in);
    if (f->layers)
        for (int l = 0; l < f->n_layer; l++) {
            dev_layer *L = &f->layers[l];
            dev_mat *ms[] = {&L->qkv, &L->wo, &L->gu, &L->down};
            for (dev_mat *m : ms) free_mat(m);
            float *vs[] = {L->attn_norm, L->ffn_norm, L->bq, L->bk, L->bv};
            for (float *v : vs)
                if (v) cudaFree(v);
        }
    delete[] f->layers;
    if (f->output.p != f->embd.p) free_mat(&f->output);
    free_mat(&f->embd);
    void *bufs[] = {f->output_norm, f->rope_freqs, f->rope_cs, f->pool, f->x, f->qkv, f->o, f->gu,
                    f->logits, f->part, f->in, f->dints, f->d_argmax, f->mk_layers, f->mk_x};
    for (void *b : bufs)
        if (b) cudaFree(b);
    if (f->h_ints) cudaFreeHost(f->h_ints);
    if (f->h_logits) cudaFreeHost(f->h_logits);
    if (f->h_argmax) cudaFreeHost(f->h_argmax);
    if (f->h_samp) cudaFreeHost(f->h_samp);
    if (f->h_samp_out) cudaFreeHost(f->h_samp_out);
    void *samp[] = {f->d_samp, f->d_samp_out, f->samp_keys, f->samp_keys2, f->samp_vals, f->samp_vals2,
                    f->samp_tmp};
    for (void *v : samp)
        if (v) cudaFree(v);
    for (int i = 0; f->graphs && i <= f->max_logits; i++)
        if (f->graphs[i]) cudaGraphExecDestroy(f->graphs[i]);
    free(f->graphs);
    free(f->graph_bad);
    for (int i = 0; f->prof && i < PROF_MARKS; i++) cudaEventDestroy(f->marks[i]);
    for (int i = 0; f->prof && i < 2; i++) cudaEventDestroy(f->step_ev[i]);
    if (f->blas_ws) cudaFree(f->blas_ws);
    if (f->blas) cublasDestroy(f->blas);
    if (f->stream) cudaStreamDestroy(f->stream);
    free(f);
}

size_t td_cuda_fwd_device_bytes(const td_cuda_fwd *f)
{
    return f->device_bytes;
}

bool td_cuda_fwd_one_kernel(const td_cuda_fwd *f)
{
    return f->mk_fn != nullptr;
}

int td_cuda_fwd_kv_export(td_cuda_fwd *f, void **base, uint8_t handle[64], int *device,
                          uint8_t uuid[16], td_err *err)
{
    static_assert(sizeof(cudaIpcMemHandle_t) == 64, "cudaIpcMemHandle_t is 64 bytes");
    cudaIpcMemHandle_t h;
    cudaDeviceProp prop;
    cudaError_t e = cudaSetDevice(f->dev);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&h, f->pool);
    if (e == cudaSuccess) e = cudaGetDeviceProperties(&prop, f->dev);
    if (e != cudaSuccess)
        return td_err_set(err, TD_EIO, "cuda: cannot export the KV pool for cuda_ipc: %s",
                          cudaGetErrorString(e));
    *base = f->pool;
    memcpy(handle, &h, 64);
    *device = f->dev;
    memcpy(uuid, prop.uuid.bytes, 16);
    return 0;
}

/* The staged integers: offsets (in int32) into h_ints and dints. */
enum { ST_TOK, ST_POS, ST_SEQ, ST_ROWS, ST_TAB, ST_LIST, ST_TILES, ST_END };
static size_t stage_off(const td_cuda_fwd *f, int which)
{
    size_t MT = (size_t)f->max_tokens, ML = (size_t)f->max_logits, mb = (size_t)f->max_blocks;
    size_t off[ST_END + 1];
    off[ST_TOK] = 0;
    off[ST_POS] = MT;
    off[ST_SEQ] = 2 * MT;
    off[ST_ROWS] = 3 * MT;
    off[ST_TAB] = 3 * MT + ML;
    off[ST_LIST] = off[ST_TAB] + ML * mb;
    off[ST_TILES] = off[ST_LIST] + MT;
    off[ST_END] = off[ST_TILES] + 2 * MT;
    return off[which];
}

/* Splits per (row, KV head) for n listed rows: enough blocks for two waves of the SMs. */
static int n_splits(const td_cuda_fwd *f, int n)
{
    int want = (2 * f->n_sm + n * f->n_kv - 1) / (n * f->n_kv);
    return want < 1 ? 1 : want > SPLIT_MAX ? SPLIT_MAX : want;
}

/* Splits for k_attn_dec: about two blocks per SM (as many as fit at once: a second wave
 * of shorter splits measured slower, BENCHMARKS.md), within the partials buffer (sized for
 * max_tokens + 2 n_sm rows); each split takes at least DEC_MIN_KEYS keys on the device. */
static int dec_splits(const td_cuda_fwd *f, int n)
{
    int want = (2 * f->n_sm + n * f->n_kv - 1) / (n * f->n_kv);
    int room = (f->max_tokens + 2 * f->n_sm) / n;
    if (want > room) want = room;
    return want < 1 ? 1 : want > 64 ? 64 : want;
}

static size_t split_smem(const td_cuda_fwd *f)
{
    int group = f->n_head / f->n_kv;
    return (size_t)(group * f->hd + group * SPLIT_SUB + 3 * group + 1 + (group & 1)) * 4 + SPLIT_SUB * sizeof(void *);
}

/* k_mega for this head_dim and group, or NULL. */
static const void *mk_kernel(int hd, int group)
{
    switch (hd * 16 + group) {
    case 64 * 16 + 1: return (const void *)k_mega<2, 1>;
    case 64 * 16 + 2: return (const void *)k_mega<2, 2>;
    case 64 * 16 + 4: return (const void *)k_mega<2, 4>;
    case 64 * 16 + 8: return (const void *)k_mega<2, 8>;
    case 128 * 16 + 1: return (const void *)k_mega<4, 1>;
    case 128 * 16 + 2: return (const void *)k_mega<4, 2>;
    case 128 * 16 + 4: return (const void *)k_mega<4, 4>;
    case 128 * 16 + 8: return (const void *)k_mega<4, 8>;
    }
    return nullptr;
}

/* Whether decode steps of one row can run as k_mega, and what it needs (mega.cuh). A model
 * it cannot run keeps the separate kernels; only a failing CUDA call is an error. */
static int mk_setup(td_cuda_fwd *f, td_err *err)
{
    const char *env = getenv("TD_CUDA_MEGA");
    if (env && !strcmp(env, "0")) return 0;
    bool ok = f->bf && !f->embd.f32 && !f->output.f32 && (f->kv_type == 1 || f->kv_type == 2) &&
              f->d % 8 == 0 && f->qd % 8 == 0 && f->ff % 8 == 0 && f->n_head % f->n_kv == 0 &&
              (size_t)f->max_tokens + 2 * (size_t)f->n_sm >= MK_SPLITS;
    for (int l = 0; ok && l < f->n_layer; l++) {
        const dev_layer *L = &f->layers[l];
        ok = !L->qkv.f32 && !L->wo.f32 && !L->gu.f32 && !L->down.f32 && !L->bq && !L->bk && !L->bv;
    }
    const void *fn = ok ? mk_kernel(f->hd, f->n_head / f->n_kv) : nullptr;
    if (!fn) return 0;
    size_t smem = mk_smem_bytes(f->d, f->qd, f->ff, f->hd, f->n_head / f->n_kv, f->max_blocks);
    if (smem > 48 * 1024 &&
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, MK_THREADS, smem) != cudaSuccess ||
        per_sm < 1) {
        (void)cudaGetLastError();
        return 0;
    }
    if (per_sm * f->n_sm < f->n_kv) return 0; /* k_mega runs one attention item per block, and
                                                 needs a block per KV head at least */
    mk_layer *h = (mk_layer *)calloc((size_t)f->n_layer, sizeof(mk_layer));
    if (!h) return td_err_set(err, TD_ENOMEM, "cuda: out of memory");
    for (int l = 0; l < f->n_layer; l++) {
        const dev_layer *L = &f->layers[l];
        h[l] = mk_layer{(const __nv_bfloat16 *)L->qkv.p, (const __nv_bfloat16 *)L->wo.p,
                        (const __nv_bfloat16 *)L->gu.p, (const __nv_bfloat16 *)L->down.p, L->attn_norm,
                        L->ffn_norm};
    }
    /* mk_x: the residual's two buffers (xa, xb), the barrier count, the attention item
     * counters, then the packed greedy token and the staged integers */
    const size_t off_bar = 2 * (size_t)f->d * 4, off_am = (off_bar + 8 + (size_t)f->n_kv * 4 + 7) / 8 * 8,
                 off_in = (off_am + 8 + 15) / 16 * 16;
    size_t lb = (size_t)f->n_layer * sizeof(mk_layer), xb = off_in + (4 + (size_t)f->max_blocks) * 4;
    cudaError_t e = cudaMalloc(&f->mk_layers, lb);
    if (e == cudaSuccess) e = cudaMemcpy(f->mk_layers, h, lb, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMalloc((void **)&f->mk_x, xb);
    if (e == cudaSuccess) e = cudaMemset(f->mk_x, 0, xb);
    free(h);
    if (e != cudaSuccess) return td_err_set(err, TD_EIO, "cuda: one-kernel decode setup: %s", cudaGetErrorString(e));
    f->device_bytes += lb + xb;
    f->mk_bar = (unsigned long long *)((uint8_t *)f->mk_x + off_bar);
    f->mk_am = (unsigned long long *)((uint8_t *)f->mk_x + off_am);
    f->mk_in = (int32_t *)((uint8_t *)f->mk_x + off_in);
    if (cudaMallocHost((void **)&f->mk_h_am, 8) != cudaSuccess ||
        cudaMallocHost((void **)&f->mk_h_in, (4 + (size_t)f->max_blocks) * 4) != cudaSuccess)
        return td_err_set(err, TD_ENOMEM, "cuda: cannot allocate the one-kernel decode's pinned staging");
    memset(f->mk_h_in, 0, (4 + (size_t)f->max_blocks) * 4);
    const char *plain = getenv("TD_CUDA_MEGA_PLAIN");
    f->mk_plain = plain && !strcmp(plain, "1");
    f->mk_fn = fn;
    f->mk_blocks = per_sm * f->n_sm;
    f->mk_smem = smem;
    const char *tm = getenv("TD_CUDA_MEGA_TIMES");
    if (tm && !strcmp(tm, "1")) {
        size_t n = (size_t)f->n_layer * 5 + 2;
        if (cudaMalloc((void **)&f->mk_times, n * 8) != cudaSuccess ||
            cudaMallocHost((void **)&f->mk_h_times, n * 8) != cudaSuccess)
            return td_err_set(err, TD_ENOMEM, "cuda: cannot allocate the phase clocks");
    }
    return 0;
}

/* TD_CUDA_MEGA_TIMES=1: where the one-kernel decode steps' time went. */
static void mk_times_report(const td_cuda_fwd *f)
{
    if (!f->mk_steps) return;
    static const char *name[6] = {"QKV", "attention", "output proj", "gate-up", "down", "output matrix"};
    double total = 0;
    for (int k = 0; k < 6; k++) total += f->mk_phase_us[k];
    fprintf(stderr, "cuda one-kernel decode: %ld steps, %.1f us each on the GPU clock:", f->mk_steps,
            total / (double)f->mk_steps);
    for (int k = 0; k < 6; k++) fprintf(stderr, " %s %.1f", name[k], f->mk_phase_us[k] / (double)f->mk_steps);
    fprintf(stderr, " (us per step, barriers included)\n");
}

int td_cuda_fwd_create(td_cuda_fwd **out, const td_model *m, int gpu, td_type kv_dtype, int block_size,
                       int n_blocks, int max_tokens, int max_logits, int max_ctx, td_err *err)
{
    *out = nullptr;
    char why[256];
    if (!td_cuda_available(why, sizeof(why))) return td_err_set(err, TD_EUNSUPPORTED, "%s", why);
    int n_gpus = 0;
    cudaGetDeviceCount(&n_gpus);
    if (gpu < 0 || gpu >= n_gpus)
        return td_err_set(err, TD_EINVAL, "--device cuda:%d: this process sees %d GPU%s (cuda:0..cuda:%d)", gpu,
                          n_gpus, n_gpus == 1 ? "" : "s", n_gpus - 1);
    if (cudaSetDevice(gpu) != cudaSuccess)
        return td_err_set(err, TD_EIO, "cuda: cannot use GPU %d: %s", gpu, cudaGetErrorString(cudaGetLastError()));
    int kv_type = kv_dtype == TD_TYPE_F32    ? 0
                  : kv_dtype == TD_TYPE_F16  ? 1
                  : kv_dtype == TD_TYPE_BF16 ? 2
                  : kv_dtype == TD_TYPE_FP8_E4M3 ? 3
                                                 : -1;
    if (kv_type < 0)
        return td_err_set(err, TD_EUNSUPPORTED, "cuda: KV cache dtype %s is not supported on the GPU (f32, f16, bf16, fp8)",
                          td_type_name(kv_dtype));
    const td_model_shape *s = &m->shape;
    int group = s->n_head / s->n_head_kv;
    if (group > ATT_MAX_GROUP || s->head_dim > 256)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "cuda: %d query heads per KV head or head_dim %d exceed the attention kernels (%d, 256)",
                          group, s->head_dim, ATT_MAX_GROUP);
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
    f->token_bytes = (size_t)f->kd * kv_esize(kv_type);
    f->block_bytes = 2 * (size_t)block_size * f->token_bytes;
    f->layer_bytes = (size_t)n_blocks * f->block_bytes;
    /* bf16 mode unless every matrix is f32 */
    f->bf = m->tok_embd.type != TD_TYPE_F32 || m->output.type != TD_TYPE_F32;
    for (int l = 0; l < s->n_layer; l++) {
        const td_layer *L = &m->layers[l];
        const td_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (const td_weight *w : ws) f->bf = f->bf || w->type != TD_TYPE_F32;
    }
    const char *te = getenv("TD_CUDA_TILES"), *tg = getenv("TD_CUDA_GEMV"), *td = getenv("TD_CUDA_DEC");
    f->use_gemv = !(tg && !strcmp(tg, "0"));
    f->tiles_ok = f->bf && (kv_type == 1 || kv_type == 2) && (f->hd == 64 || f->hd == 128) && group <= 8 && !(te && !strcmp(te, "0"));
    f->dec_ok = f->bf && (kv_type == 1 || kv_type == 2) && (f->hd == 64 || f->hd == 128) && group <= 16 &&
                block_size % 16 == 0 &&
                !(td && !strcmp(td, "0"));
    int dev = 0;
    cudaGetDevice(&dev);
    f->dev = dev;
    cudaDeviceGetAttribute(&f->n_sm, cudaDevAttrMultiProcessorCount, dev);
    if (f->n_sm < 1) f->n_sm = 1;
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
    TRY(alloc_mat(f, &f->embd, m->tok_embd.rows, m->tok_embd.cols, err));
    TRY(upload_into(f, &f->embd, 0, &m->tok_embd, err));
    if (s->tied_output || (m->output.data && m->output.data == m->tok_embd.data)) {
        f->output = f->embd;
    } else {
        TRY(alloc_mat(f, &f->output, m->output.rows, m->output.cols, err));
        TRY(upload_into(f, &f->output, 0, &m->output, err));
    }
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
        const td_weight *qkv[] = {&L->wq, &L->wk, &L->wv}, *gu[] = {&L->w_gate, &L->w_up};
        TRY(upload_stack(f, &D->qkv, qkv, 3, err));
        TRY(upload_stack(f, &D->gu, gu, 2, err));
        const td_weight *wo[] = {&L->wo}, *down[] = {&L->w_down};
        TRY(upload_stack(f, &D->wo, wo, 1, err));
        TRY(upload_stack(f, &D->down, down, 1, err));
        TRY(upload_vec(f, &D->attn_norm, &L->attn_norm, err));
        TRY(upload_vec(f, &D->ffn_norm, &L->ffn_norm, err));
        TRY(upload_vec(f, &D->bq, &L->bq, err));
        TRY(upload_vec(f, &D->bk, &L->bk, err));
        TRY(upload_vec(f, &D->bv, &L->bv, err));
    }
    if (!rc && cudaStreamSynchronize(f->stream) != cudaSuccess)
        rc = td_err_set(err, TD_EIO, "cuda: making the weights failed: %s", cudaGetErrorString(cudaGetLastError()));
    size_t T = (size_t)max_tokens, widest = (size_t)(f->ff > f->d ? f->ff : f->d);
    if ((size_t)f->qd > widest) widest = (size_t)f->qd;
    DMALLOC(f->rope_cs, (size_t)max_ctx * (size_t)(f->hd / 2) * sizeof(float2));
    if (!rc) {
        k_rope_table<<<1024, 256, 0, f->stream>>>(f->rope_cs, max_ctx, f->hd, s->rope_theta, s->rope_freq_scale,
                                                  f->rope_freqs);
        if (cudaStreamSynchronize(f->stream) != cudaSuccess)
            rc = td_err_set(err, TD_EIO, "cuda: the RoPE table: %s", cudaGetErrorString(cudaGetLastError()));
    }
    DMALLOC(f->pool, (size_t)f->n_layer * f->layer_bytes);
    DMALLOC(f->x, T * f->d * 4);
    DMALLOC(f->qkv, T * (size_t)(f->qd + 2 * f->kd) * 4);
    DMALLOC(f->o, T * f->d * 4);
    DMALLOC(f->gu, T * 2 * (size_t)f->ff * 4);
    DMALLOC(f->in, T * widest * (f->bf ? 2 : 4));
    DMALLOC(f->part, (T + 2 * (size_t)f->n_sm) * (size_t)f->n_head * (size_t)(f->hd + 2) * 4);
    DMALLOC(f->logits, (size_t)max_logits * f->vocab * 4);
    DMALLOC(f->dints, stage_off(f, ST_END) * 4);
    DMALLOC(f->d_argmax, (size_t)max_logits * 4);
    if (!rc && cudaMallocHost((void **)&f->h_argmax, (size_t)max_logits * 4) != cudaSuccess)
        rc = td_err_set(err, TD_ENOMEM, "cuda: cannot allocate pinned argmax");
    if (!rc && cudaMallocHost((void **)&f->h_logits, (size_t)max_logits * f->vocab * 4) != cudaSuccess)
        rc = td_err_set(err, TD_ENOMEM, "cuda: cannot allocate pinned logits");
    if (!rc && cudaMallocHost((void **)&f->h_ints, stage_off(f, ST_END) * 4) != cudaSuccess)
        rc = td_err_set(err, TD_ENOMEM, "cuda: cannot allocate pinned staging");
    DMALLOC(f->blas_ws, (size_t)32 << 20);
    if (!rc && cublasSetWorkspace(f->blas, f->blas_ws, (size_t)32 << 20) != CUBLAS_STATUS_SUCCESS)
        rc = td_err_set(err, TD_EIO, "cuda: cannot give cuBLAS its workspace");
    f->graphs = (cudaGraphExec_t *)calloc((size_t)max_logits + 1, sizeof(cudaGraphExec_t));
    f->graph_bad = (bool *)calloc((size_t)max_logits + 1, sizeof(bool));
    if (!rc && (!f->graphs || !f->graph_bad)) rc = td_err_set(err, TD_ENOMEM, "cuda: out of memory");
    {
        const char *g = getenv("TD_CUDA_GRAPHS"), *p = getenv("TD_CUDA_PROFILE");
        f->prof = p && strcmp(p, "0") && *p;
        f->prof_steps_only = p && !strcmp(p, "2");
        /* a full profile times every launch, which a graph would hide */
        f->use_graphs = !(g && !strcmp(g, "0")) && !(f->prof && !f->prof_steps_only);
        for (int i = 0; f->prof && i < PROF_MARKS; i++) cudaEventCreate(&f->marks[i]);
        for (int i = 0; f->prof && i < 2; i++) cudaEventCreate(&f->step_ev[i]);
    }
    if (!rc) rc = mk_setup(f, err);
#undef TRY
#undef DMALLOC
    if (rc) {
        td_cuda_fwd_free(f);
        return rc;
    }
    *out = f;
    return 0;
}

/* Shared memory of k_attn_tiles<HD>: two stages of K and V tiles. */
static size_t tile_smem(int hd)
{
    return 2 * 2 * (size_t)TILE_KEYS * (size_t)(hd + TILE_PAD) * 2;
}

template <int HD, bool F16> static bool tile_smem_ok()
{
    return cudaFuncSetAttribute(k_attn_tiles<HD, F16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)tile_smem(HD)) == cudaSuccess;
}

/* The attention of one layer: tiles (tensor cores) and listed rows (split-K). */
template <int HD, bool F16>
static void launch_tiles(td_cuda_fwd *f, int n_tiles, const uint8_t *layer)
{
    int group = f->n_head / f->n_kv;
    size_t smem = tile_smem(HD);
    const int32_t *di = f->dints;
    k_attn_tiles<HD, F16><<<dim3((unsigned)n_tiles, (unsigned)f->n_kv), 32 * group, smem, f->stream>>>(
        f->qkv, f->qd + 2 * f->kd, di + stage_off(f, ST_TILES), di + stage_off(f, ST_POS),
        di + stage_off(f, ST_SEQ), di + stage_off(f, ST_TAB), f->max_blocks, layer, f->n_head, f->n_kv,
        f->block_size, f->token_bytes, f->block_bytes, f->in, f->bf);
}

static void attention(td_cuda_fwd *f, int n_list, int n_tiles, const uint8_t *layer)
{
    cudaStream_t st = f->stream;
    const int32_t *di = f->dints;
    mark(f, PROF_ATT);
    if (n_tiles) {
        bool f16 = f->kv_type == 1;
        if (!f->tile_attr) { /* once: the tile kernels' shared memory beyond 48 KiB */
            f->tile_attr = tile_smem_ok<64, false>() && tile_smem_ok<64, true>() && tile_smem_ok<128, false>() &&
                           tile_smem_ok<128, true>();
        }
        if (f->hd == 64) f16 ? launch_tiles<64, true>(f, n_tiles, layer) : launch_tiles<64, false>(f, n_tiles, layer);
        else f16 ? launch_tiles<128, true>(f, n_tiles, layer) : launch_tiles<128, false>(f, n_tiles, layer);
    }
    if (n_list && f->dec_ok) {
        int splits = dec_splits(f, n_list), group = f->n_head / f->n_kv;
        size_t smem = (size_t)DEC_WARPS * group * f->hd * 4;
        dim3 grid((unsigned)n_list, (unsigned)f->n_kv, (unsigned)splits);
        bool f16 = f->kv_type == 1;
#define DEC_ARGS                                                                                   \
    f->qkv, f->qd + 2 * f->kd, di + stage_off(f, ST_LIST), di + stage_off(f, ST_POS), di + stage_off(f, ST_SEQ), \
        di + stage_off(f, ST_TAB), f->max_blocks, layer, f->n_head, f->n_kv, f->block_size, f->token_bytes,    \
        f->block_bytes, splits, f->part
        if (f->hd == 64) {
            if (f16) k_attn_dec<64, true><<<grid, DEC_WARPS * 32, smem, st>>>(DEC_ARGS);
            else k_attn_dec<64, false><<<grid, DEC_WARPS * 32, smem, st>>>(DEC_ARGS);
        } else {
            if (f16) k_attn_dec<128, true><<<grid, DEC_WARPS * 32, smem, st>>>(DEC_ARGS);
            else k_attn_dec<128, false><<<grid, DEC_WARPS * 32, smem, st>>>(DEC_ARGS);
        }
#undef DEC_ARGS
        k_attn_merge<<<dim3((unsigned)n_list, (unsigned)f->n_head), f->hd < 128 ? f->hd : 128, 0, st>>>(
            f->part, di + stage_off(f, ST_LIST), f->n_head, f->hd, splits, f->in, f->bf);
    } else if (n_list) {
        int splits = n_splits(f, n_list);
        k_attn_split<<<dim3((unsigned)n_list, (unsigned)f->n_kv, (unsigned)splits), SPLIT_THREADS, split_smem(f), st>>>(
            f->qkv, f->qd + 2 * f->kd, di + stage_off(f, ST_LIST), di + stage_off(f, ST_POS),
            di + stage_off(f, ST_SEQ), di + stage_off(f, ST_TAB), f->max_blocks, layer, f->n_head, f->n_kv,
            f->hd, f->block_size, f->token_bytes, f->block_bytes, f->kv_type, splits, f->part);
        k_attn_merge<<<dim3((unsigned)n_list, (unsigned)f->n_head), f->hd < 128 ? f->hd : 128, 0, st>>>(
            f->part, di + stage_off(f, ST_LIST), f->n_head, f->hd, splits, f->in, f->bf);
    }
}

/*
 * Queue one step on the stream: the staged integers to the device (f->h_ints, filled by
 * td_cuda_fwd_run), every layer, and the logits back to f->h_logits. Nothing here reads
 * the host otherwise, so a decode step can be captured as a graph and replayed.
 */
static int enqueue(td_cuda_fwd *f, int T, int ns, int n_logits, int n_list, int n_tiles, td_err *err)
{
    const td_model_shape *s = &f->m->shape;
    cudaStream_t st = f->stream;
    struct {
        int which;
        size_t n;
    } parts[] = {{ST_TOK, (size_t)T},       {ST_POS, (size_t)T},
                 {ST_SEQ, (size_t)T},       {ST_ROWS, (size_t)n_logits},
                 {ST_TAB, (size_t)ns * f->max_blocks}, {ST_LIST, (size_t)n_list},
                 {ST_TILES, 2 * (size_t)n_tiles}};
    const bool mega = f->mk_fn && T == 1 && n_logits == 1, mk_fast = mega && !f->mk_plain;
    if (mk_fast) /* k_mega's integers, staged together by td_cuda_fwd_run */
        CK(cudaMemcpyAsync(f->mk_in, f->mk_h_in, (4 + (size_t)f->max_blocks) * 4, cudaMemcpyHostToDevice, st));
    else
        for (auto &p : parts)
            if (p.n)
                CK(cudaMemcpyAsync(f->dints + stage_off(f, p.which), f->h_ints + stage_off(f, p.which), p.n * 4,
                                   cudaMemcpyHostToDevice, st));
    const int32_t *di = f->dints;
    const int32_t *d_tok = di + stage_off(f, ST_TOK), *d_pos = di + stage_off(f, ST_POS),
                  *d_seq = di + stage_off(f, ST_SEQ), *d_tab = di + stage_off(f, ST_TAB),
                  *d_rows = di + stage_off(f, ST_ROWS);
    int d = f->d;
    float eps = s->rms_eps;
    if (mega) { /* one decode row: one kernel (mega.cuh) */
        mk_args A;
        A.layers = (const mk_layer *)f->mk_layers;
        A.n_layer = f->n_layer;
        A.d = d;
        A.qd = f->qd;
        A.kd = f->kd;
        A.hd = f->hd;
        A.n_head = f->n_head;
        A.n_kv = f->n_kv;
        A.ff = f->ff;
        A.vocab = f->vocab;
        A.eps = eps;
        A.embd = (const __nv_bfloat16 *)f->embd.p;
        A.out_w = (const __nv_bfloat16 *)f->output.p;
        A.out_norm = f->output_norm;
        A.tok = mk_fast ? f->mk_in : d_tok;
        A.pos = mk_fast ? f->mk_in + 1 : d_pos;
        A.seq = mk_fast ? f->mk_in + 2 : d_seq;
        A.tables = mk_fast ? f->mk_in + 4 : d_tab;
        A.max_blocks = f->max_blocks;
        A.block_size = f->block_size;
        A.kv_type = f->kv_type;
        A.neox = s->rope_type == TD_ROPE_NEOX;
        A.pool = f->pool;
        A.layer_bytes = f->layer_bytes;
        A.token_bytes = f->token_bytes;
        A.block_bytes = f->block_bytes;
        A.rope_cs = f->rope_cs;
        A.xa = f->mk_x;
        A.xb = f->mk_x + d;
        A.qkv = f->qkv;
        A.o = f->o;
        A.dn = f->gu;
        A.part = f->part;
        A.logits = f->logits;
        A.att = A.ffa = (__nv_bfloat16 *)f->in;
        A.bar = f->mk_bar;
        A.cnt = (unsigned *)(f->mk_bar + 1);
        A.times = f->mk_times;
        A.am = mk_fast ? f->mk_am : nullptr;
        A.preload = mk_fast;
        A.full_fence = !mk_fast;
        void *args[] = {&A};
        mark(f, PROF_GEMM);
        CK(cudaLaunchKernel(f->mk_fn, dim3((unsigned)f->mk_blocks), dim3(MK_THREADS), args, f->mk_smem, st));
        mark(f, PROF_OTHER);
        if (mk_fast) {
            CK(cudaMemcpyAsync(f->mk_h_am, f->mk_am, 8, cudaMemcpyDeviceToHost, st));
        } else {
            k_argmax<<<1, 1024, 0, st>>>(f->logits, f->vocab, f->d_argmax);
            CK(cudaMemcpyAsync(f->h_argmax, f->d_argmax, 4, cudaMemcpyDeviceToHost, st));
        }
        if (f->mk_times)
            CK(cudaMemcpyAsync(f->mk_h_times, f->mk_times, ((size_t)f->n_layer * 5 + 2) * 8, cudaMemcpyDeviceToHost,
                               st));
        mark(f, -1);
        return 0;
    }
    mark(f, PROF_OTHER);
    k_embed<<<T, 256, 0, st>>>(f->embd.p, f->embd.f32, d_tok, f->x, d);
    k_norm<<<T, 256, 0, st>>>(f->x, nullptr, f->layers[0].attn_norm, f->in, f->bf, nullptr, d, eps);
    int rc = 0;
    for (int l = 0; l < f->n_layer && !rc; l++) {
        dev_layer *L = &f->layers[l];
        uint8_t *layer = f->pool + (size_t)l * f->layer_bytes;
        if ((rc = gemm(f, f->qkv, f->in, &L->qkv, T, err))) break;
        mark(f, PROF_OTHER);
        k_rope_store<<<T, 128, 0, st>>>(f->qkv, L->bq, L->bk, L->bv, d_pos, d_seq, d_tab, f->max_blocks, layer,
                                        f->n_head, f->n_kv, f->hd, f->rope_cs, s->rope_type == TD_ROPE_NEOX,
                                        f->block_size, f->token_bytes, f->block_bytes, f->kv_type);
        attention(f, n_list, n_tiles, layer);
        if ((rc = gemm(f, f->o, f->in, &L->wo, T, err))) break;
        mark(f, PROF_OTHER);
        k_norm<<<T, 256, 0, st>>>(f->x, f->o, L->ffn_norm, f->in, f->bf, nullptr, d, eps);
        if ((rc = gemm(f, f->gu, f->in, &L->gu, T, err))) break;
        mark(f, PROF_OTHER);
        {
            unsigned per = (unsigned)(f->ff % 4 == 0 ? f->ff / 4 : f->ff);
            dim3 grid((per + 255) / 256, (unsigned)(T < 65535 ? T : 65535));
            k_silu_mul<<<grid, 256, 0, st>>>(f->gu, f->in, f->bf, f->ff, T);
        }
        if ((rc = gemm(f, f->o, f->in, &L->down, T, err))) break;
        mark(f, PROF_OTHER);
        const float *next = l + 1 < f->n_layer ? f->layers[l + 1].attn_norm : nullptr;
        k_norm<<<T, 256, 0, st>>>(f->x, f->o, next, f->in, f->bf, nullptr, d, eps);
    }
    if (!rc && n_logits > 0) {
        mark(f, PROF_OTHER);
        k_norm<<<n_logits, 256, 0, st>>>(f->x, nullptr, f->output_norm, f->in, f->bf, d_rows, d, eps);
        rc = gemm(f, f->logits, f->in, &f->output, n_logits, err);
        mark(f, PROF_OTHER);
        if (!rc) {
            k_argmax<<<n_logits, 1024, 0, st>>>(f->logits, f->vocab, f->d_argmax);
            CK(cudaMemcpyAsync(f->h_argmax, f->d_argmax, (size_t)n_logits * 4, cudaMemcpyDeviceToHost, st));
        }
    }
    mark(f, -1);
    return rc;
}

/* Rows prepared per group: the (p, id) buffers hold this many rows of the vocabulary. */
#define SAMP_GROUP 8

/* The sampling buffers, on first use. */
static int samp_setup(td_cuda_fwd *f, td_err *err)
{
    if (f->d_samp) return 0;
    size_t items = (size_t)SAMP_GROUP * f->vocab;
    cudaError_t e = cudaMallocHost((void **)&f->h_samp, (size_t)f->max_logits * sizeof(samp_row));
    if (e == cudaSuccess) e = cudaMallocHost((void **)&f->h_samp_out, (size_t)f->max_logits * 4);
    if (e == cudaSuccess) e = cudaMalloc((void **)&f->d_samp, (size_t)f->max_logits * sizeof(samp_row));
    if (e == cudaSuccess) e = cudaMalloc((void **)&f->d_samp_out, (size_t)f->max_logits * 4);
    if (e == cudaSuccess) e = cudaMalloc((void **)&f->samp_keys, items * 4);
    if (e == cudaSuccess) e = cudaMalloc((void **)&f->samp_keys2, items * 4);
    if (e == cudaSuccess) e = cudaMalloc((void **)&f->samp_vals, items * 4);
    if (e == cudaSuccess) e = cudaMalloc((void **)&f->samp_vals2, items * 4);
    if (e == cudaSuccess)
        e = cub::DeviceRadixSort::SortPairsDescending(nullptr, f->samp_tmp_bytes, f->samp_keys, f->samp_keys2,
                                                      f->samp_vals, f->samp_vals2, f->vocab, 0, 32, f->stream);
    if (e == cudaSuccess) e = cudaMalloc(&f->samp_tmp, f->samp_tmp_bytes ? f->samp_tmp_bytes : 16);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return td_err_set(err, TD_ENOMEM, "cuda: cannot allocate the sampling buffers: %s", cudaGetErrorString(e));
    }
    f->device_bytes += 4 * items * 4 + f->samp_tmp_bytes;
    return 0;
}

/* Queue the sampling of the n rows in f->h_samp (after samp_setup, and after the step that
 * wrote f->logits): their tokens end in f->h_samp_out once the stream is synchronised. */
static int samp_enqueue(td_cuda_fwd *f, int n, td_err *err)
{
    cudaStream_t st = f->stream;
    CK(cudaMemcpyAsync(f->d_samp, f->h_samp, (size_t)n * sizeof(samp_row), cudaMemcpyHostToDevice, st));
    for (int g = 0; g < n; g += SAMP_GROUP) {
        int m = n - g < SAMP_GROUP ? n - g : SAMP_GROUP;
        bool sort = false;
        for (int j = g; j < g + m; j++) sort |= f->h_samp[j].top_k > 0 || f->h_samp[j].top_p < 1.0f;
        k_samp_prep<<<m, SAMP_THREADS, 0, st>>>(f->logits, f->vocab, f->d_samp + g, f->samp_keys, f->samp_vals);
        /* a device-wide sort per row (a segmented sort gives each row one block: ~1 ms for a
         * 128k vocabulary, against tens of µs) */
        for (int j = 0; sort && j < m; j++) {
            size_t o = (size_t)j * f->vocab;
            CK(cub::DeviceRadixSort::SortPairsDescending(f->samp_tmp, f->samp_tmp_bytes, f->samp_keys + o,
                                                         f->samp_keys2 + o, f->samp_vals + o, f->samp_vals2 + o,
                                                         f->vocab, 0, 32, st));
        }
        k_samp_pick<<<m, SAMP_THREADS, 0, st>>>(f->vocab, f->d_samp + g, f->samp_keys2, f->samp_vals2,
                                                f->samp_keys, f->d_samp_out + g);
    }
    CK(cudaMemcpyAsync(f->h_samp_out, f->d_samp_out, (size_t)n * 4, cudaMemcpyDeviceToHost, st));
    return 0;
}

static void samp_row_set(samp_row *r, const td_cuda_sample *s, int row)
{
    *r = samp_row{s->temperature, s->top_p, s->min_p, s->u, s->top_k, row};
}

int td_cuda_sample_logits(td_cuda_fwd *f, const float *logits, int n_rows, const td_cuda_sample *sample,
                          int32_t *out, td_err *err)
{
    CK(cudaSetDevice(f->dev));
    if (n_rows < 1 || n_rows > f->max_logits)
        return td_err_set(err, TD_EINVAL, "cuda: %d rows to sample (1..%d)", n_rows, f->max_logits);
    int rc = samp_setup(f, err);
    if (rc) return rc;
    for (int i = 0; i < n_rows; i++) samp_row_set(&f->h_samp[i], &sample[i], i);
    CK(cudaMemcpyAsync(f->logits, logits, (size_t)n_rows * f->vocab * 4, cudaMemcpyHostToDevice, f->stream));
    if ((rc = samp_enqueue(f, n_rows, err))) return rc;
    CK(cudaStreamSynchronize(f->stream));
    CK(cudaGetLastError());
    memcpy(out, f->h_samp_out, (size_t)n_rows * 4);
    return 0;
}

int td_cuda_fwd_run(td_cuda_fwd *f, int n_tokens, const int32_t *tokens, const int32_t *pos,
                    const int32_t *seq, const int32_t *const *block_tables, int n_seqs, int n_logits,
                    const int32_t *logit_rows, float *logits, const uint8_t *need_logits,
                    const td_cuda_sample *sample, int32_t *argmax, td_err *err)
{
    CK(cudaSetDevice(f->dev)); /* the engine's thread need not be the one that made it */
    int T = n_tokens, mb = f->max_blocks;
    if (T < 1 || T > f->max_tokens || n_logits > f->max_logits || n_seqs > f->max_logits ||
        n_seqs > 1024)
        return td_err_set(err, TD_EINVAL, "cuda: batch of %d tokens, %d logits, %d sequences exceeds the plan", T,
                          n_logits, n_seqs);
    /* Stage the integers: tokens, pos, seq, logit rows, each sequence's block table (as
     * many blocks as its furthest position needs), and the attention plan. */
    int32_t *h = f->h_ints;
    memcpy(h + stage_off(f, ST_TOK), tokens, (size_t)T * 4);
    memcpy(h + stage_off(f, ST_POS), pos, (size_t)T * 4);
    memcpy(h + stage_off(f, ST_SEQ), seq, (size_t)T * 4);
    memcpy(h + stage_off(f, ST_ROWS), logit_rows, (size_t)n_logits * 4);
    int32_t *tab = h + stage_off(f, ST_TAB);
    int need[1024];
    int ns = n_seqs;
    for (int i = 0; i < ns; i++) need[i] = 0;
    for (int t = 0; t < T; t++) {
        if (seq[t] < 0 || seq[t] >= ns || pos[t] < 0 || pos[t] >= f->max_ctx)
            return td_err_set(err, TD_EINVAL, "cuda: row %d: sequence %d, position %d out of range", t, seq[t], pos[t]);
        int b = pos[t] / f->block_size + 1;
        if (b > need[seq[t]]) need[seq[t]] = b;
    }
    for (int i = 0; i < ns; i++) memcpy(tab + (size_t)i * mb, block_tables[i], (size_t)need[i] * 4);
    const bool mk_fast = f->mk_fn && !f->mk_plain && T == 1 && n_logits == 1;
    if (mk_fast) { /* k_mega's own copy: token, position, sequence 0, its block table */
        f->mk_h_in[0] = tokens[0];
        f->mk_h_in[1] = pos[0];
        f->mk_h_in[2] = 0;
        memcpy(f->mk_h_in + 4, block_tables[seq[0]], (size_t)need[seq[0]] * 4);
    }
    /* Attention plan: runs of >= 2 rows of one sequence at consecutive positions go to the
     * tile kernel in tiles of 16 (where it applies); every other row to split-K. */
    int32_t *list = h + stage_off(f, ST_LIST), *tiles = h + stage_off(f, ST_TILES);
    int n_list = 0, n_tiles = 0;
    for (int t = 0; t < T;) {
        int e = t + 1;
        while (f->tiles_ok && e < T && seq[e] == seq[t] && pos[e] == pos[e - 1] + 1) e++;
        if (e - t >= 2) {
            for (int r = t; r < e; r += TILE_ROWS) {
                tiles[2 * n_tiles] = r;
                tiles[2 * n_tiles + 1] = e - r < TILE_ROWS ? e - r : TILE_ROWS;
                n_tiles++;
            }
        } else {
            list[n_list++] = t;
        }
        t = e;
    }
    /* A decode step (row i is sequence i's next token, and samples) replays a graph. */
    bool decode = n_logits == T && ns == T && n_tiles == 0;
    for (int i = 0; decode && i < T; i++) decode = logit_rows[i] == i && seq[i] == i;
    int rc = 0;
    cudaStream_t st = f->stream;
    f->n_marks = 0;
    if (f->prof_steps_only) cudaEventRecord(f->step_ev[0], st);
    if (decode && f->use_graphs && !f->graph_bad[T]) {
        if (!f->graphs[T]) {
            cudaGraph_t g = nullptr;
            bool ok = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
            td_err ce;
            td_err_clear(&ce);
            if (ok) ok = enqueue(f, T, ns, n_logits, n_list, n_tiles, &ce) == 0;
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
        else rc = enqueue(f, T, ns, n_logits, n_list, n_tiles, err);
    } else {
        rc = enqueue(f, T, ns, n_logits, n_list, n_tiles, err);
    }
    if (rc) return rc;
    /* Rows sampled here (not greedy, their logits not wanted on the host). */
    int n_samp = 0;
    for (int i = 0; sample && need_logits && i < n_logits; i++)
        if (!need_logits[i] && sample[i].temperature > 0.0f && sample[i].top_k != 1) {
            if (!f->h_samp && (rc = samp_setup(f, err))) return rc;
            samp_row_set(&f->h_samp[n_samp++], &sample[i], i);
        }
    if (n_samp && (rc = samp_enqueue(f, n_samp, err))) return rc;
    if (f->prof_steps_only) cudaEventRecord(f->step_ev[1], st);
    /* The logit rows the host samples from itself: runs of needed rows, one copy each. */
    for (int i = 0; i < n_logits;) {
        if (need_logits && !need_logits[i]) {
            i++;
            continue;
        }
        int j = i + 1;
        while (j < n_logits && (!need_logits || need_logits[j])) j++;
        size_t row = (size_t)f->vocab * 4;
        CK(cudaMemcpyAsync((uint8_t *)f->h_logits + i * row, (uint8_t *)f->logits + i * row, (size_t)(j - i) * row,
                           cudaMemcpyDeviceToHost, st));
        i = j;
    }
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    if (mk_fast) { /* mk_am_pack: the row in the low half, inverted; 0 when none */
        unsigned long long v = *f->mk_h_am;
        f->h_argmax[0] = v ? (int32_t)(0xffffffffu - (uint32_t)v) : 0;
    }
    if (f->mk_times && T == 1 && n_logits == 1) {
        const unsigned long long *t = f->mk_h_times;
        for (int l = 0; l < f->n_layer; l++)
            for (int k = 0; k < 5; k++) f->mk_phase_us[k] += (double)(t[l * 5 + k + 1] - t[l * 5 + k]) * 1e-3;
        f->mk_phase_us[5] += (double)(t[f->n_layer * 5 + 1] - t[f->n_layer * 5]) * 1e-3;
        f->mk_steps++;
    }
    if (f->prof_steps_only) {
        float ms = 0.0f;
        int k = decode ? 0 : 1;
        cudaEventElapsedTime(&ms, f->step_ev[0], f->step_ev[1]);
        f->prof_ms[k][PROF_STEP] += ms;
        f->prof_steps[k]++;
        f->prof_tokens[k] += T;
    } else if (f->prof && f->n_marks > 1) {
        int k = decode ? 0 : 1;
        for (int i = 0; i + 1 < f->n_marks; i++) {
            float ms = 0.0f;
            cudaEventElapsedTime(&ms, f->marks[i], f->marks[i + 1]);
            if (f->mark_cat[i] >= 0) f->prof_ms[k][f->mark_cat[i]] += ms;
        }
        f->prof_steps[k]++;
        f->prof_tokens[k] += T;
    }
    for (int i = 0; i < n_logits; i++) {
        if (argmax) argmax[i] = f->h_argmax[i];
        if (!need_logits || need_logits[i])
            memcpy(logits + (size_t)i * f->vocab, f->h_logits + (size_t)i * f->vocab, (size_t)f->vocab * 4);
    }
    for (int j = 0; argmax && j < n_samp; j++) argmax[f->h_samp[j].row] = f->h_samp_out[j];
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
