/*
 * backend/cuda/mega.cuh - a decode step of one sequence as one kernel (included by
 * cuda_fwd.cu, after its device helpers).
 *
 * A batch-1 decode step reads every weight once and does little else, so its floor is the
 * weights over the memory bandwidth. Launched as ~290 kernels (nine a layer), each GEMV
 * ramps up and drains, and the gaps between kernels leave the memory idle: the step took
 * 1.6x its floor. Here one persistent kernel (as many blocks as fit on the GPU at once,
 * every one resident) runs the whole step in phases separated by grid barriers:
 *
 *   per layer: QKV (RMSNorm in each block, then the rows)  | barrier
 *              attention: (KV head, key range) items, RoPE on the fly, the new K/V stored
 *                                                          | barrier
 *              merge of the ranges' partial softmaxes       | barrier
 *              output projection                           | barrier
 *              residual + RMSNorm, gate and up with SiLU    | barrier
 *              down projection                             | barrier
 *   then the final RMSNorm and the output matrix.
 *
 * Weights never depend on a barrier, so before waiting at one every warp asks the L2 for
 * the start of the rows it reads next (`prefetch`); the memory keeps streaming through the
 * barrier. A GEMV phase deals whole rows to warps (one warp per row, the k_gemv loop), the
 * warps spread over all blocks, each warp the same number of rows: the sums are the same
 * in every run. The residual stream alternates between two f32 buffers so that the block
 * that writes the new one never races the blocks that still read the old.
 *
 * Limits (else the step runs as separate kernels): bf16 weights without biases, a bf16 or
 * f16 KV cache, head_dim 64 or 128, at most MK_MAX_GROUP query heads per KV head.
 */

#define MK_THREADS 512
#define MK_WARPS (MK_THREADS / 32)
#define MK_SPLITS 32    /* most key ranges per KV head */
#define MK_MIN_KEYS 16  /* fewest keys per range */
#define MK_MAX_GROUP 8  /* query heads per KV head (1, 2, 4 or 8) */
#define MK_MAX_DPL 4    /* head dims per lane (head_dim 128) */

struct mk_layer {
    const __nv_bfloat16 *qkv, *wo, *gu, *down;
    const float *attn_norm, *ffn_norm;
};

struct mk_args {
    const mk_layer *layers;
    int n_layer, d, qd, kd, hd, n_head, n_kv, ff, vocab;
    float eps;
    const __nv_bfloat16 *embd, *out_w;
    const float *out_norm;
    const int32_t *tok, *pos, *seq, *tables;
    int max_blocks, block_size, kv_type, neox;
    uint8_t *pool;
    size_t layer_bytes, token_bytes, block_bytes;
    const float2 *rope_cs;
    float *xa, *xb, *qkv, *o, *dn, *part, *logits; /* f32 */
    __nv_bfloat16 *att, *ffa;                      /* bf16 inputs of the output and down GEMVs */
    unsigned *bar;                                 /* [0] arrivals, [1] generation */
    int prefetch; /* bytes of each warp's next row asked of the L2 before a barrier */
};

/* All blocks meet. Data written before it by any block is visible after it (activations
 * are read with __ldcg, past the incoherent L1). */
__device__ inline void mk_sync(unsigned *bar)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned *gen = bar + 1;
        unsigned g = *gen;
        __threadfence();
        if (atomicAdd(bar, 1u) == gridDim.x - 1) {
            atomicExch(bar, 0u);
            __threadfence();
            atomicAdd(bar + 1, 1u);
        } else {
            while (*gen == g) __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}

/* A phase of n items (rows): this warp's slot, and how the items are dealt. Slots run
 * across blocks first, so that a phase with fewer items than warps still uses every SM. */
struct mk_deal {
    int slot, n_slots, per; /* item i of this warp: slot + i * n_slots, i < per */
};

__device__ inline mk_deal mk_deal_for(int n)
{
    int nw = gridDim.x * MK_WARPS;
    int per = (n + nw - 1) / nw;
    mk_deal d;
    d.slot = (int)(threadIdx.x / 32) * gridDim.x + blockIdx.x;
    d.per = per;
    d.n_slots = (n + per - 1) / per;
    return d;
}

/* Ask the L2 for the first `bytes` of this warp's first row of a phase with n rows of
 * `row_bytes` each (rows_of: 1, or 2 for gate-up pairs whose second row is `second` rows
 * on). */
__device__ inline void mk_prefetch_rows(const __nv_bfloat16 *w, int n, size_t row_bytes, size_t second,
                                        int bytes)
{
    if (bytes <= 0) return;
    mk_deal dl = mk_deal_for(n);
    if (dl.slot >= dl.n_slots) return;
    const int lane = threadIdx.x % 32;
    int lim = (int)(row_bytes < (size_t)bytes ? row_bytes : (size_t)bytes);
    const char *p = (const char *)w + (size_t)dl.slot * row_bytes;
    for (int o = lane * 128; o < lim; o += 32 * 128) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
        if (second) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + second * row_bytes + o));
    }
}

/* One warp's dot product of a bf16 weight row with the bf16 vector in shared memory: the
 * k_gemv loop. */
__device__ inline float mk_dot(const __nv_bfloat16 *w, const __nv_bfloat16 *xs, int nv)
{
    const int lane = threadIdx.x % 32;
    const uint4 *wr = (const uint4 *)w, *xr = (const uint4 *)xs;
    float acc = 0.0f;
#pragma unroll 8
    for (int v = lane; v < nv; v += 32) {
        float wf[8], xf[8];
        bf16x8(__ldg(wr + v), wf);
        bf16x8(xr[v], xf);
#pragma unroll
        for (int i = 0; i < 8; i++) acc = fmaf(wf[i], xf[i], acc);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

/* Gate and up rows together (twice the loads in flight). */
__device__ inline void mk_dot2(const __nv_bfloat16 *w0, const __nv_bfloat16 *w1, const __nv_bfloat16 *xs, int nv,
                               float *a0, float *a1)
{
    const int lane = threadIdx.x % 32;
    const uint4 *r0 = (const uint4 *)w0, *r1 = (const uint4 *)w1, *xr = (const uint4 *)xs;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 4
    for (int v = lane; v < nv; v += 32) {
        float f0[8], f1[8], xf[8];
        bf16x8(__ldg(r0 + v), f0);
        bf16x8(__ldg(r1 + v), f1);
        bf16x8(xr[v], xf);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            s0 = fmaf(f0[i], xf[i], s0);
            s1 = fmaf(f1[i], xf[i], s1);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, o);
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    *a0 = s0;
    *a1 = s1;
}

/*
 * The block's copy of a GEMV input: v = a + b (f32; b may be null; `emb` instead: the
 * token's embedding row), RMS-normed with weight w, as bf16 into s_in. Block 0 also keeps
 * v in `keep` (the residual stream's next buffer) when it is given.
 */
__device__ void mk_norm_in(const float *a, const float *b, const __nv_bfloat16 *emb, const float *w, float *keep,
                           __nv_bfloat16 *s_in, float *s_v, float *s_red, int d, float eps)
{
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = emb ? __bfloat162float(emb[i]) : __ldcg(a + i) + (b ? __ldcg(b + i) : 0.0f);
        s_v[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, s_red);
    float scale = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = s_v[i];
        s_in[i] = __float2bfloat16_rn(v * scale * w[i]);
        if (keep && blockIdx.x == 0) keep[i] = v;
    }
    __syncthreads();
}

/* A bf16 vector of n from global memory into shared memory. */
__device__ inline void mk_load_vec(const __nv_bfloat16 *g, __nv_bfloat16 *s, int n)
{
    const uint4 *src = (const uint4 *)g;
    uint4 *dst = (uint4 *)s;
    for (int i = threadIdx.x; i < n / 8; i += blockDim.x) dst[i] = __ldcg(src + i);
    __syncthreads();
}

/* DPL consecutive bf16 or f16 KV elements (kv_type 2 or 1) at p, as f32. */
template <int DPL>
__device__ inline void mk_load_kv(const uint8_t *p, int kv_type, float v[DPL])
{
    uint32_t u[DPL / 2];
    if (DPL == 4) {
        uint2 r = __ldcg((const uint2 *)p);
        u[0] = r.x;
        u[DPL / 2 - 1] = r.y;
    } else {
        u[0] = __ldcg((const unsigned int *)p);
    }
#pragma unroll
    for (int i = 0; i < DPL / 2; i++) {
        if (kv_type == 2) {
            v[2 * i] = __uint_as_float(u[i] << 16);
            v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        } else {
            __half2 h2;
            memcpy(&h2, &u[i], 4);
            float2 f2 = __half22float2(h2);
            v[2 * i] = f2.x;
            v[2 * i + 1] = f2.y;
        }
    }
}

/* RoPE on this lane's DPL dims of one head (v), at position p. Pairs are (2i, 2i+1) in a
 * lane, or (i, i + hd/2) across lanes l and l ^ 16 (NeoX). */
template <int DPL>
__device__ inline void mk_rope(float v[DPL], const float2 *cs_p, bool neox)
{
    const int lane = threadIdx.x % 32, half = 16 * DPL;
    if (!neox) {
#pragma unroll
        for (int j = 0; j < DPL / 2; j++) {
            float2 cs = cs_p[(lane * DPL) / 2 + j];
            float x0 = v[2 * j], x1 = v[2 * j + 1];
            v[2 * j] = x0 * cs.x - x1 * cs.y;
            v[2 * j + 1] = x0 * cs.y + x1 * cs.x;
        }
    } else {
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            float other = __shfl_xor_sync(0xffffffffu, v[j], 16);
            float2 cs = cs_p[(lane * DPL + j) % half];
            v[j] = lane < 16 ? v[j] * cs.x - other * cs.y : other * cs.y + v[j] * cs.x;
        }
    }
}

/*
 * Attention for one (KV head, key range) item: the group's query heads against keys
 * [t0, t1) of the sequence, position p being the new token (its K and V from qkv, RoPE'd
 * here). Keys go 32 at a time, one per lane (its whole K row against every query head in
 * shared memory), then V with the lanes over the head's dims. Writes the range's
 * unnormalised output, its max and its sum, as k_attn_split's partials.
 */
template <int DPL, int GROUP>
__device__ void mk_attn_item(const mk_args &A, const uint8_t *layer, const int32_t *tab, int p, int h, int s,
                             int S, int t0, int t1, float *s_q)
{
    const int lane = threadIdx.x % 32, hd = 32 * DPL, group = GROUP;
    const float *qkv = A.qkv;
    const float2 *cs_p = A.rope_cs + (size_t)p * (hd / 2);
    /* the group's queries, RoPE'd and scaled by 1/sqrt(hd), into this warp's shared slot */
    const float scale = 1.0f / sqrtf((float)hd);
    __syncwarp(); /* the warp's previous item has finished reading s_q */
    for (int g = 0; g < group; g++) {
        float q[DPL];
#pragma unroll
        for (int j = 0; j < DPL; j++) q[j] = __ldcg(qkv + (size_t)(h * group + g) * hd + lane * DPL + j);
        mk_rope<DPL>(q, cs_p, A.neox);
#pragma unroll
        for (int j = 0; j < DPL; j++) s_q[g * hd + lane * DPL + j] = q[j] * scale;
    }
    /* the new token's K (RoPE'd) and V, this lane's dims */
    float kc[DPL], vc[DPL];
#pragma unroll
    for (int j = 0; j < DPL; j++) {
        kc[j] = __ldcg(qkv + A.qd + (size_t)h * hd + lane * DPL + j);
        vc[j] = __ldcg(qkv + A.qd + A.kd + (size_t)h * hd + lane * DPL + j);
    }
    mk_rope<DPL>(kc, cs_p, A.neox);
    __syncwarp();
    const int esz = A.kv_type == 1 || A.kv_type == 2 ? 2 : 4;
    float m[GROUP], l[GROUP], o[GROUP][DPL];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < DPL; j++) o[g][j] = 0.0f;
    }
    for (int tb = t0; tb < t1; tb += 32) {
        const int t = tb + lane;
        const bool have = t < t1;
        /* this lane's key: its scores against every query head */
        float sc[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; g++) sc[g] = 0.0f;
        if (have && t < p) {
            const uint8_t *kb = layer + (size_t)tab[t / A.block_size] * A.block_bytes +
                                (size_t)(t % A.block_size) * A.token_bytes + (size_t)h * hd * esz;
            for (int c = 0; c < hd; c += 8) {
                float kf[8];
                uint4 raw = __ldcg((const uint4 *)(kb + (size_t)c * esz));
                if (A.kv_type == 2) {
                    bf16x8(raw, kf);
                } else {
                    const __half *hh = (const __half *)&raw;
#pragma unroll
                    for (int i = 0; i < 8; i++) kf[i] = __half2float(hh[i]);
                }
#pragma unroll
                for (int g = 0; g < GROUP; g++)
#pragma unroll
                    for (int i = 0; i < 8; i++) sc[g] = fmaf(s_q[g * hd + c + i], kf[i], sc[g]);
            }
        }
        /* the new token's key is spread over the lanes: its scores by reduction */
        const bool cur = p >= tb && p < tb + 32 && p < t1;
        if (cur) {
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < DPL; j++) d = fmaf(s_q[g * hd + lane * DPL + j], kc[j], d);
                for (int off = 16; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
                if (t == p) sc[g] = d;
            }
        }
        /* online softmax over the 32 keys, per query head */
        float pw[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float mx = have ? sc[g] : -INFINITY;
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            float mn = fmaxf(m[g], mx);
            float alpha = expf(m[g] - mn);
            pw[g] = have ? expf(sc[g] - mn) : 0.0f;
            float sum = pw[g];
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            l[g] = l[g] * alpha + sum;
            m[g] = mn;
#pragma unroll
            for (int j = 0; j < DPL; j++) o[g][j] *= alpha;
        }
        /* V: every key of the batch, this lane's dims */
        const int nk = t1 - tb < 32 ? t1 - tb : 32;
        for (int k = 0; k < nk; k++) {
            const int tk = tb + k;
            float vv[DPL];
            if (tk == p) {
#pragma unroll
                for (int j = 0; j < DPL; j++) vv[j] = vc[j];
            } else {
                const uint8_t *vb = layer + (size_t)tab[tk / A.block_size] * A.block_bytes +
                                    (size_t)A.block_size * A.token_bytes + (size_t)(tk % A.block_size) * A.token_bytes +
                                    ((size_t)h * hd + lane * DPL) * esz;
                mk_load_kv<DPL>(vb, A.kv_type, vv);
            }
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                float w = __shfl_sync(0xffffffffu, pw[g], k);
#pragma unroll
                for (int j = 0; j < DPL; j++) o[g][j] = fmaf(w, vv[j], o[g][j]);
            }
        }
    }
    /* partials as k_attn_split writes them: [head][split][hd + 2] = output, max (natural
     * log units), sum */
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        float *pp = A.part + ((size_t)(h * group + g) * S + s) * (hd + 2);
#pragma unroll
        for (int j = 0; j < DPL; j++) pp[lane * DPL + j] = o[g][j];
        if (lane == 0) {
            pp[hd] = m[g];
            pp[hd + 1] = l[g];
        }
    }
    /* the new token's K and V into the pool, once per KV head */
    if (s == S - 1) {
        const int blk = tab[p / A.block_size];
        uint8_t *kb = (uint8_t *)layer + (size_t)blk * A.block_bytes + (size_t)(p % A.block_size) * A.token_bytes;
        uint8_t *vb = kb + (size_t)A.block_size * A.token_bytes;
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            store_kv(kb, h * hd + lane * DPL + j, A.kv_type, kc[j]);
            store_kv(vb, h * hd + lane * DPL + j, A.kv_type, vc[j]);
        }
    }
}

template <int DPL, int GROUP>
__global__ void __launch_bounds__(MK_THREADS, 1) k_mega(mk_args A)
{
    extern __shared__ __align__(16) uint8_t mk_smem[];
    const int d = A.d, hd = 32 * DPL, group = GROUP;
    const int widest = A.ff > A.qd ? (A.ff > d ? A.ff : d) : (A.qd > d ? A.qd : d);
    __nv_bfloat16 *s_in = (__nv_bfloat16 *)mk_smem;                       /* widest bf16 */
    float *s_v = (float *)(mk_smem + (size_t)((widest + 7) / 8) * 16);    /* d f32 */
    float *s_red = s_v + d;                                                /* 32 */
    float *s_q = (float *)mk_smem; /* attention: MK_WARPS x group x hd f32 (over s_in, s_v) */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int p = A.pos[0];
    const int32_t *tab = A.tables + (size_t)A.seq[0] * A.max_blocks;
    const int L = p + 1;
    int S = (L + MK_MIN_KEYS - 1) / MK_MIN_KEYS;
    if (S > MK_SPLITS) S = MK_SPLITS;
    const int chunk = (L + S - 1) / S;
    const int pf = A.prefetch;
    const int rows_qkv = A.qd + 2 * A.kd;
    for (int li = 0; li < A.n_layer; li++) {
        const mk_layer *Ly = &A.layers[li];
        const uint8_t *layer = A.pool + (size_t)li * A.layer_bytes;
        /* QKV: x = the embedding (first layer) or xb + the last down projection */
        if (li == 0)
            mk_norm_in(nullptr, nullptr, A.embd + (size_t)A.tok[0] * d, Ly->attn_norm, A.xa, s_in, s_v, s_red, d,
                       A.eps);
        else
            mk_norm_in(A.xb, A.dn, nullptr, Ly->attn_norm, A.xa, s_in, s_v, s_red, d, A.eps);
        {
            mk_deal dl = mk_deal_for(rows_qkv);
            for (int i = 0; i < dl.per; i++) {
                int r = dl.slot + i * dl.n_slots;
                if (dl.slot >= dl.n_slots || r >= rows_qkv) break;
                float acc = mk_dot(Ly->qkv + (size_t)r * d, s_in, d / 8);
                if (lane == 0) A.qkv[r] = acc;
            }
        }
        mk_prefetch_rows(Ly->wo, d, (size_t)A.qd * 2, 0, pf);
        mk_sync(A.bar);
        /* attention items */
        {
            mk_deal dl = mk_deal_for(A.n_kv * S);
            for (int i = 0; i < dl.per; i++) {
                int it = dl.slot + i * dl.n_slots;
                if (dl.slot >= dl.n_slots || it >= A.n_kv * S) break;
                int h = it / S, s = it % S, t0 = s * chunk, t1 = t0 + chunk < L ? t0 + chunk : L;
                mk_attn_item<DPL, GROUP>(A, layer, tab, p, h, s, S, t0, t1 < t0 ? t0 : t1,
                                  s_q + (size_t)warp * group * hd);
            }
        }
        mk_sync(A.bar);
        /* merge: one warp per query head, this lane's dims */
        {
            mk_deal dl = mk_deal_for(A.n_head);
            if (dl.slot < dl.n_slots && dl.slot < A.n_head) {
                const int hq = dl.slot;
                const float *pp = A.part + (size_t)hq * S * (hd + 2);
                float mx = -INFINITY;
                for (int s = 0; s < S; s++) mx = fmaxf(mx, __ldcg(pp + (size_t)s * (hd + 2) + hd));
                float acc[DPL], sum = 0.0f;
#pragma unroll
                for (int j = 0; j < DPL; j++) acc[j] = 0.0f;
                for (int s = 0; s < S; s++) {
                    const float *ps = pp + (size_t)s * (hd + 2);
                    float ms = __ldcg(ps + hd);
                    float w = ms == -INFINITY ? 0.0f : expf(ms - mx);
                    sum += w * __ldcg(ps + hd + 1);
#pragma unroll
                    for (int j = 0; j < DPL; j++) acc[j] = fmaf(w, __ldcg(ps + lane * DPL + j), acc[j]);
                }
#pragma unroll
                for (int j = 0; j < DPL; j++) A.att[(size_t)hq * hd + lane * DPL + j] = __float2bfloat16_rn(acc[j] / sum);
            }
        }
        mk_sync(A.bar);
        /* output projection */
        mk_load_vec(A.att, s_in, A.qd);
        {
            mk_deal dl = mk_deal_for(d);
            for (int i = 0; i < dl.per; i++) {
                int r = dl.slot + i * dl.n_slots;
                if (dl.slot >= dl.n_slots || r >= d) break;
                float acc = mk_dot(Ly->wo + (size_t)r * A.qd, s_in, A.qd / 8);
                if (lane == 0) A.o[r] = acc;
            }
        }
        mk_prefetch_rows(Ly->gu, A.ff, (size_t)d * 2, (size_t)A.ff, pf);
        mk_sync(A.bar);
        /* residual, RMSNorm, gate and up, SiLU */
        mk_norm_in(A.xa, A.o, nullptr, Ly->ffn_norm, A.xb, s_in, s_v, s_red, d, A.eps);
        {
            mk_deal dl = mk_deal_for(A.ff);
            for (int i = 0; i < dl.per; i++) {
                int r = dl.slot + i * dl.n_slots;
                if (dl.slot >= dl.n_slots || r >= A.ff) break;
                float g, u;
                mk_dot2(Ly->gu + (size_t)r * d, Ly->gu + (size_t)(A.ff + r) * d, s_in, d / 8, &g, &u);
                if (lane == 0) A.ffa[r] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
            }
        }
        mk_prefetch_rows(Ly->down, d, (size_t)A.ff * 2, 0, pf);
        mk_sync(A.bar);
        /* down projection */
        mk_load_vec(A.ffa, s_in, A.ff);
        {
            mk_deal dl = mk_deal_for(d);
            for (int i = 0; i < dl.per; i++) {
                int r = dl.slot + i * dl.n_slots;
                if (dl.slot >= dl.n_slots || r >= d) break;
                float acc = mk_dot(Ly->down + (size_t)r * A.ff, s_in, A.ff / 8);
                if (lane == 0) A.dn[r] = acc;
            }
        }
        if (li + 1 < A.n_layer) mk_prefetch_rows(A.layers[li + 1].qkv, rows_qkv, (size_t)d * 2, 0, pf);
        else mk_prefetch_rows(A.out_w, A.vocab, (size_t)d * 2, 0, pf);
        mk_sync(A.bar);
    }
    /* the final RMSNorm and the output matrix */
    mk_norm_in(A.xb, A.dn, nullptr, A.out_norm, nullptr, s_in, s_v, s_red, d, A.eps);
    {
        mk_deal dl = mk_deal_for(A.vocab);
        for (int i = 0; i < dl.per; i++) {
            int r = dl.slot + i * dl.n_slots;
            if (dl.slot >= dl.n_slots || r >= A.vocab) break;
            float acc = mk_dot(A.out_w + (size_t)r * d, s_in, d / 8);
            if (lane == 0) A.logits[r] = acc;
        }
    }
}

/* Shared memory of k_mega: the widest GEMV input (bf16) and the residual (f32), or the
 * attention's queries. */
static size_t mk_smem_bytes(int d, int qd, int ff, int hd, int group)
{
    int widest = ff > qd ? (ff > d ? ff : d) : (qd > d ? qd : d);
    size_t norm = (size_t)((widest + 7) / 8) * 16 + (size_t)d * 4 + 32 * 4;
    size_t att = (size_t)MK_WARPS * group * hd * 4;
    return norm > att ? norm : att;
}
