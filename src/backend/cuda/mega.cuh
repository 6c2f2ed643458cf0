/*
 * backend/cuda/mega.cuh - a decode step of one sequence as one kernel (included by
 * cuda_fwd.cu, after its device helpers).
 *
 * A batch-1 decode step reads every weight once and does little else, so its floor is the
 * weights over the memory bandwidth. Launched as ~290 kernels (nine a layer), each GEMV
 * ramps up and drains, and the gaps between kernels leave the memory idle: the step took
 * 1.6x its floor. Here one persistent kernel (one 512-thread block per SM, every block
 * resident) runs the whole step in phases separated by grid barriers:
 *
 *   per layer: RMSNorm (in every block) and QKV           | barrier
 *              attention: (KV head, key range) items, one per block, RoPE on the fly, the
 *              new K/V stored; the block that ends a KV head's last item merges its items
 *                                                          | barrier
 *              output projection                           | barrier
 *              residual + RMSNorm, gate and up with SiLU    | barrier
 *              down projection                             | barrier
 *   then the final RMSNorm and the output matrix, whose warps also keep their best logit:
 *   one atomic max per block gives the greedy token (no second kernel).
 *
 * Each block's attention item is fixed for the step, so its first K/V loads (they read
 * only the cache) go out before the barrier after QKV.
 *
 * A GEMV phase deals whole rows to warps (the k_gemv loop, two rows at a time), the warps
 * spread over all blocks, each warp the same number of rows: no atomics, so the sums are
 * the same in every run. The residual stream alternates between two f32 buffers so that
 * the block that writes the new one never races the blocks that still read the old. Data
 * written in the kernel is read with __ldcg (the L1 is not coherent across SMs).
 *
 * Measured on the H200 (BENCHMARKS.md): 1.19-1.22x the floor per token; the large GEMV
 * phases at 1.07x the copy-rate floor; what is left is attention (latency chains: queries,
 * merge), the barriers (five a layer) and the small QKV and output GEMVs. Tried and
 * dropped: L2 prefetch of the next rows before a barrier, and of the output projection
 * during attention (also once a block's attention item is done: the merges slow down);
 * the next rows' first loads held in registers across a barrier; per-KV-head counts of
 * the QKV rows written instead of the barrier after QKV (within 0.02 ms); the next phase's
 * rows copied ahead into shared memory (cp.async) before a barrier (the copies only slow
 * the phase before, and the carve-out takes the L1 that the loads in flight need); a warp's
 * next rows' first 2 KiB prefetched to the L2 while it reads the current ones (gate-up +8%);
 * attention's first K/V loads issued between the barrier's arrival and its wait (the same
 * GPU clock: their latency moved into attention); the weights marked L2 evict_first (no
 * change); the blocks without an attention item pulling the output projection into the L2
 * during attention (attention +117 us, the projection -17 us).
 *
 * Limits (else the step runs as separate kernels): bf16 weights without biases, a bf16 or
 * f16 KV cache, head_dim 64 or 128, 1, 2, 4 or 8 query heads per KV head, at least as many
 * resident blocks (SMs) as KV heads.
 */

#define MK_THREADS 512 /* one block per SM: 128 registers a thread (2 x 512, 4 x 256 and
                          1 x 1024 measured slower) */
#define MK_WARPS (MK_THREADS / 32)
#define MK_SPLITS 32   /* most key ranges per KV head (the merge holds one per lane) */
#define MK_MIN_KEYS 16 /* fewest keys per range */

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
    unsigned long long *bar;                       /* arrivals at barriers, ever (mk_sync) */
    unsigned *cnt;                                 /* per KV head: its attention items done */
    unsigned long long *times; /* TD_CUDA_MEGA_TIMES: the GPU clock after each phase, or NULL */
    /* The greedy token, packed (mk_am_pack) and maxed by every block; NULL: k_argmax after
     * the kernel (TD_CUDA_MEGA_PLAIN). */
    unsigned long long *am;
    int preload; /* attention's first K/V loads issued before the barrier after QKV */
    int full_fence; /* attention items end with every thread's fence (the first version) */
};

/* A logit and its row as one 64-bit key whose maximum is the largest logit at its lowest
 * row (k_argmax's choice); NaN and -inf rows are never chosen, -0 counts as +0. 0: none. */
__device__ inline unsigned long long mk_am_pack(float v, int row)
{
    if (!(v > -INFINITY)) return 0ull;
    unsigned u = __float_as_uint(v + 0.0f);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xffffffffu - (unsigned)row);
}

/*
 * All blocks meet. Data written before it by any block is visible after it (activations
 * are read with __ldcg, past the incoherent L1). One 64-bit counter that only grows: a
 * block adds one (a release) and polls (acquire loads) until it reaches `*next` (thread
 * 0's register), the count at which every block has arrived, then moves `*next` on by a
 * grid. No reset, no second variable, no full fence: one atomic and a poll per block.
 */
__device__ inline void mk_sync(unsigned long long *count, unsigned long long *next,
                               unsigned long long *times = nullptr, int phase = 0)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        /* release: the block's writes (ordered before by __syncthreads) before the arrival;
         * acquire: the other blocks' writes after it */
        asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(count) : "memory");
        unsigned long long v;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(count) : "memory");
        } while (v < *next);
        *next += gridDim.x;
        if (times && blockIdx.x == 0) {
            unsigned long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            times[phase] = t;
        }
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

/* A weight load: read once per step, so it is not kept in the L1 (no_allocate), where it
 * only pushed out what is read there more than once, such as the norm weights and RoPE's
 * table (1.5-1.8% per step). */
__device__ inline uint4 mk_ldw(const uint4 *p)
{
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
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
        bf16x8(mk_ldw(wr + v), wf);
        bf16x8(xr[v], xf);
#pragma unroll
        for (int i = 0; i < 8; i++) acc = fmaf(wf[i], xf[i], acc);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

/* Two rows together (twice the loads in flight). mk_dot, mk_dot2 and mk_dot3 stay three
 * loops: one template over the row count measured 0.5-0.8% slower on the Llama-3-8B shape
 * (attention's registers again; BENCHMARKS.md), though faster on llama-1b. */
__device__ inline void mk_dot2(const __nv_bfloat16 *w0, const __nv_bfloat16 *w1, const __nv_bfloat16 *xs, int nv,
                               float *a0, float *a1)
{
    const int lane = threadIdx.x % 32;
    const uint4 *r0 = (const uint4 *)w0, *r1 = (const uint4 *)w1, *xr = (const uint4 *)xs;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 4
    for (int v = lane; v < nv; v += 32) {
        float f0[8], f1[8], xf[8];
        bf16x8(mk_ldw(r0 + v), f0);
        bf16x8(mk_ldw(r1 + v), f1);
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

/* Three rows together, for a matrix whose rows in threes fit the warps in one round. */
__device__ inline void mk_dot3(const __nv_bfloat16 *w, int cols, const __nv_bfloat16 *xs, float a[3])
{
    const int lane = threadIdx.x % 32, nv = cols / 8;
    const uint4 *r0 = (const uint4 *)w, *r1 = (const uint4 *)(w + cols), *r2 = (const uint4 *)(w + 2 * (size_t)cols);
    const uint4 *xr = (const uint4 *)xs;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f;
#pragma unroll 4
    for (int v = lane; v < nv; v += 32) {
        float f0[8], f1[8], f2[8], xf[8];
        bf16x8(mk_ldw(r0 + v), f0);
        bf16x8(mk_ldw(r1 + v), f1);
        bf16x8(mk_ldw(r2 + v), f2);
        bf16x8(xr[v], xf);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            s0 = fmaf(f0[i], xf[i], s0);
            s1 = fmaf(f1[i], xf[i], s1);
            s2 = fmaf(f2[i], xf[i], s2);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, o);
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        s2 += __shfl_xor_sync(0xffffffffu, s2, o);
    }
    a[0] = s0;
    a[1] = s1;
    a[2] = s2;
}

/* out[r] = W[r] . xs for r < rows (cols each): rows 2i and 2i + 1 go together (twice the
 * loads in flight), the pairs dealt to the warps; or rows in threes where the pairs would
 * take two rounds of the warps and the threes one (the QKV projection on 132 SMs). With
 * am, *am is maxed with the warp's rows (mk_am_pack). */
__device__ inline void mk_gemv(const __nv_bfloat16 *W, const __nv_bfloat16 *xs, int cols, int rows, float *out,
                               unsigned long long *am = nullptr)
{
    const int nw = gridDim.x * MK_WARPS;
    if (rows % 3 == 0 && rows / 3 <= nw && rows / 2 > nw) {
        mk_deal dl = mk_deal_for(rows / 3);
        if (dl.slot < dl.n_slots) {
            float a[3];
            const int r = 3 * dl.slot;
            mk_dot3(W + (size_t)r * cols, cols, xs, a);
            if (threadIdx.x % 32 == 0) {
                out[r] = a[0];
                out[r + 1] = a[1];
                out[r + 2] = a[2];
            }
            if (am)
                for (int k = 0; k < 3; k++) *am = max(*am, mk_am_pack(a[k], r + k));
        }
        return;
    }
    const int lane = threadIdx.x % 32, pairs = (rows + 1) / 2;
    mk_deal dl = mk_deal_for(pairs);
    if (dl.slot >= dl.n_slots) return;
    for (int i = 0; i < dl.per; i++) {
        int pr = dl.slot + i * dl.n_slots, r0 = 2 * pr, r1 = r0 + 1;
        if (pr >= pairs) break;
        if (r1 < rows) {
            float a0, a1;
            mk_dot2(W + (size_t)r0 * cols, W + (size_t)r1 * cols, xs, cols / 8, &a0, &a1);
            if (lane == 0) {
                out[r0] = a0;
                out[r1] = a1;
            }
            if (am) *am = max(*am, max(mk_am_pack(a0, r0), mk_am_pack(a1, r1)));
        } else {
            float a0 = mk_dot(W + (size_t)r0 * cols, xs, cols / 8);
            if (lane == 0) out[r0] = a0;
            if (am) *am = max(*am, mk_am_pack(a0, r0));
        }
    }
}

/* The sum of v over the block: block_sum for k_mega's fixed block, with two __syncthreads
 * instead of three (every thread adds the MK_WARPS warps' sums itself). */
__device__ inline float mk_block_sum(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* red's last readers are done */
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < MK_WARPS; w++) s += red[w];
    return s;
}

/*
 * The block's copy of a GEMV input: v = a + b (f32; b may be null; `emb` instead: the
 * token's embedding row), RMS-normed with weight w, as bf16 into s_in. Block 0 also keeps
 * v in `keep` (the residual stream's next buffer) when it is given. It opens the QKV and
 * gate-up phases, so its latency is the phase's: the sum takes two __syncthreads instead
 * of three, and the norm weights are prefetched into the L1 while it is made (-1.0 to
 * -2.3% per step on the Llama-3-8B shape; keeping the elements and weights in registers
 * instead made ptxas spill).
 */
__device__ void mk_norm_in(const float *a, const float *b, const __nv_bfloat16 *emb, const float *w, float *keep,
                           __nv_bfloat16 *s_in, float *s_v, float *s_red, int d, float eps)
{
    /* four elements per load, every load of a thread issued before the first is used */
    float ss = 0.0f;
#pragma unroll 4
    for (int i = 4 * threadIdx.x; i < d; i += 4 * blockDim.x) {
        float4 v;
        if (emb) {
            uint2 r = *(const uint2 *)(emb + i);
            v = make_float4(__uint_as_float(r.x << 16), __uint_as_float(r.x & 0xffff0000u),
                            __uint_as_float(r.y << 16), __uint_as_float(r.y & 0xffff0000u));
        } else {
            v = __ldcg((const float4 *)(a + i));
            if (b) {
                float4 u = __ldcg((const float4 *)(b + i));
                v = make_float4(v.x + u.x, v.y + u.y, v.z + u.z, v.w + u.w);
            }
        }
        *(float4 *)(s_v + i) = v;
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        /* the norm weights this thread reads below, into the L1 while the sum is made */
        asm volatile("prefetch.global.L1 [%0];" ::"l"(w + (i & ~31)));
    }
    ss = mk_block_sum(ss, s_red);
    float scale = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll 4
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
#pragma unroll 4
    for (int i = threadIdx.x; i < n / 8; i += blockDim.x) dst[i] = __ldcg(src + i);
    __syncthreads();
}

/* DPL consecutive 16-bit KV elements, raw (DPL / 2 words), and as f32 (kv_type 2 bf16, 1 f16). */
template <int DPL>
__device__ inline void mk_load_raw(const uint8_t *p, uint32_t u[DPL / 2])
{
    if (DPL == 4) {
        uint2 r = __ldcg((const uint2 *)p);
        u[0] = r.x;
        u[DPL / 2 - 1] = r.y;
    } else {
        u[0] = __ldcg((const unsigned int *)p);
    }
}

template <int DPL>
__device__ inline void mk_unpack(const uint32_t u[DPL / 2], int kv_type, float v[DPL])
{
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
 * Attention for one (KV head, key range) item, on a whole block: the group's query heads
 * (RoPE'd and scaled into shared memory) against keys [t0, t1) of the sequence, position p
 * being the new token (its K and V from qkv, RoPE'd here). The warps take the keys in turn,
 * MK_KPW at a time with all their K and V loads issued together (lanes over the head's
 * dims), each keeping an online softmax per query head; the block then combines its warps
 * into the item's partial: unnormalised output, max (natural log), sum. The block that
 * completes a KV head's last item merges that head's items into `att` (bf16), so no
 * barrier is spent on the merge. The block of the last item also stores the new K and V.
 */
#define MK_KPW 5

/* This warp's keys of an item: a contiguous share of [t0, t1), MK_KPW per pass. */
__device__ inline void mk_warp_keys(int t0, int t1, int *w0, int *w1)
{
    const int share = (t1 - t0 + MK_WARPS - 1) / MK_WARPS;
    *w0 = t0 + (int)(threadIdx.x / 32) * share;
    *w1 = *w0 + share < t1 ? *w0 + share : t1;
}

/* One pass's K and V loads (keys [tb, tb + MK_KPW) of [.., w1), the new token p's skipped),
 * raw into kr and vr: they need only the block table. */
template <int DPL>
__device__ inline void mk_kv_pass(const mk_args &A, const uint8_t *layer, const int32_t *tab, int p, int h, int tb,
                                  int w1, uint32_t (&kr)[MK_KPW][DPL / 2], uint32_t (&vr)[MK_KPW][DPL / 2])
{
    const int lane = threadIdx.x % 32, hd = 32 * DPL;
    const size_t vhalf = (size_t)A.block_size * A.token_bytes, lane_off = ((size_t)h * hd + lane * DPL) * 2;
#pragma unroll
    for (int k = 0; k < MK_KPW; k++) {
        const int t = tb + k;
        if (t < w1 && t != p) {
            const uint8_t *kb = layer + (size_t)tab[t / A.block_size] * A.block_bytes +
                                (size_t)(t % A.block_size) * A.token_bytes + lane_off;
            mk_load_raw<DPL>(kb, kr[k]);
            mk_load_raw<DPL>(kb + vhalf, vr[k]);
        }
    }
}

/* kr and vr hold the first pass's loads (mk_kv_pass at the warp's first key), which the
 * caller may issue before the barrier after QKV. */
template <int DPL, int GROUP>
__device__ void mk_attn_item(const mk_args &A, const uint8_t *layer, const int32_t *tab, int p, int h, int s,
                             int S, int t0, int t1, float *s_q, float *s_w, unsigned *cnt,
                             uint32_t (&kr)[MK_KPW][DPL / 2], uint32_t (&vr)[MK_KPW][DPL / 2])
{
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, hd = 32 * DPL;
    const float2 *cs_p = A.rope_cs + (size_t)p * (hd / 2);
    const float scale = 1.0f / sqrtf((float)hd);
    const size_t vhalf = (size_t)A.block_size * A.token_bytes;
    int w0, w1;
    mk_warp_keys(t0, t1, &w0, &w1);
    if (warp < GROUP) { /* query head h * GROUP + warp */
        float q[DPL];
#pragma unroll
        for (int j = 0; j < DPL; j++) q[j] = __ldcg(A.qkv + (size_t)(h * GROUP + warp) * hd + lane * DPL + j);
        mk_rope<DPL>(q, cs_p, A.neox);
#pragma unroll
        for (int j = 0; j < DPL; j++) s_q[warp * hd + lane * DPL + j] = q[j] * scale;
    }
    /* the new token's K (RoPE'd) and V, this lane's dims */
    float kc[DPL], vc[DPL];
#pragma unroll
    for (int j = 0; j < DPL; j++) {
        kc[j] = __ldcg(A.qkv + A.qd + (size_t)h * hd + lane * DPL + j);
        vc[j] = __ldcg(A.qkv + A.qd + A.kd + (size_t)h * hd + lane * DPL + j);
    }
    mk_rope<DPL>(kc, cs_p, A.neox);
    __syncthreads();
    float q[GROUP][DPL];
#pragma unroll
    for (int g = 0; g < GROUP; g++)
#pragma unroll
        for (int j = 0; j < DPL; j++) q[g][j] = s_q[g * hd + lane * DPL + j];
    float m[GROUP], l[GROUP], o[GROUP][DPL];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < DPL; j++) o[g][j] = 0.0f;
    }
    for (int tb = w0; tb < w1; tb += MK_KPW) {
        if (tb != w0) mk_kv_pass<DPL>(A, layer, tab, p, h, tb, w1, kr, vr);
#pragma unroll
        for (int k = 0; k < MK_KPW; k++) {
            const int t = tb + k;
            if (t >= w1) break; /* warp-uniform */
            float kk[DPL], vv[DPL];
            if (t == p) {
#pragma unroll
                for (int j = 0; j < DPL; j++) {
                    kk[j] = kc[j];
                    vv[j] = vc[j];
                }
            } else {
                mk_unpack<DPL>(kr[k], A.kv_type, kk);
                mk_unpack<DPL>(vr[k], A.kv_type, vv);
            }
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                float sc = 0.0f;
#pragma unroll
                for (int j = 0; j < DPL; j++) sc = fmaf(q[g][j], kk[j], sc);
                for (int off = 16; off > 0; off >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, off);
                const float mn = fmaxf(m[g], sc), alpha = expf(m[g] - mn), pw = expf(sc - mn);
                l[g] = l[g] * alpha + pw;
                m[g] = mn;
#pragma unroll
                for (int j = 0; j < DPL; j++) o[g][j] = fmaf(pw, vv[j], o[g][j] * alpha);
            }
        }
    }
    /* the block's warps into the item's partial */
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        float *w = s_w + ((size_t)warp * GROUP + g) * (hd + 2);
#pragma unroll
        for (int j = 0; j < DPL; j++) w[lane * DPL + j] = o[g][j];
        if (lane == 0) {
            w[hd] = m[g];
            w[hd + 1] = l[g];
        }
    }
    __syncthreads();
    if (warp < GROUP) {
        const int g = warp;
        float mx = -INFINITY;
        for (int ww = 0; ww < MK_WARPS; ww++) mx = fmaxf(mx, s_w[((size_t)ww * GROUP + g) * (hd + 2) + hd]);
        float acc[DPL], sum = 0.0f;
#pragma unroll
        for (int j = 0; j < DPL; j++) acc[j] = 0.0f;
        for (int ww = 0; ww < MK_WARPS; ww++) {
            const float *w = s_w + ((size_t)ww * GROUP + g) * (hd + 2);
            const float f = w[hd] == -INFINITY ? 0.0f : expf(w[hd] - mx);
            sum += f * w[hd + 1];
#pragma unroll
            for (int j = 0; j < DPL; j++) acc[j] = fmaf(f, w[lane * DPL + j], acc[j]);
        }
        float *pp = A.part + ((size_t)(h * GROUP + g) * S + s) * (hd + 2);
#pragma unroll
        for (int j = 0; j < DPL; j++) pp[lane * DPL + j] = acc[j];
        if (lane == 0) {
            pp[hd] = mx;
            pp[hd + 1] = sum;
        }
    }
    if (s == S - 1 && warp == MK_WARPS - 1) { /* the new token's K and V into the pool */
        const int blk = tab[p / A.block_size];
        uint8_t *kb = (uint8_t *)layer + (size_t)blk * A.block_bytes + (size_t)(p % A.block_size) * A.token_bytes;
#pragma unroll
        for (int j = 0; j < DPL; j++) {
            store_kv(kb, h * hd + lane * DPL + j, A.kv_type, kc[j]);
            store_kv(kb + vhalf, h * hd + lane * DPL + j, A.kv_type, vc[j]);
        }
    }
    /* the last of the KV head's items merges them */
    /* Thread 0's count is a release (the block's partials, ordered before it by the
     * __syncthreads, go with it) and an acquire (the other items' partials, for the
     * merge), as mk_sync's arrival and poll are: no fence by every thread. */
    __shared__ unsigned s_last;
    if (A.full_fence) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned old;
        if (A.full_fence)
            old = atomicAdd(cnt + h, 1u);
        else
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(cnt + h) : "memory");
        s_last = old == (unsigned)S - 1;
        if (s_last) atomicExch(cnt + h, 0u);
    }
    __syncthreads();
    if (!s_last) return;
    if (A.full_fence) __threadfence();
    if (warp < GROUP) { /* lane i holds item i's max and sum (S <= 32) */
        const int hq = h * GROUP + warp;
        const float *pp = A.part + (size_t)hq * S * (hd + 2);
        const float mi = lane < S ? __ldcg(pp + (size_t)lane * (hd + 2) + hd) : -INFINITY;
        const float li = lane < S ? __ldcg(pp + (size_t)lane * (hd + 2) + hd + 1) : 0.0f;
        float mx = mi;
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float fi = mi == -INFINITY ? 0.0f : expf(mi - mx);
        float sum = fi * li;
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        float acc[DPL];
#pragma unroll
        for (int j = 0; j < DPL; j++) acc[j] = 0.0f;
#pragma unroll 16
        for (int i = 0; i < S; i++) {
            const float f = __shfl_sync(0xffffffffu, fi, i);
            const float *ps = pp + (size_t)i * (hd + 2) + lane * DPL;
#pragma unroll
            for (int j = 0; j < DPL; j++) acc[j] = fmaf(f, __ldcg(ps + j), acc[j]);
        }
#pragma unroll
        for (int j = 0; j < DPL; j++) A.att[(size_t)hq * hd + lane * DPL + j] = __float2bfloat16_rn(acc[j] / sum);
    }
}

/* Shared memory of k_mega: the widest GEMV input (bf16) and the residual (f32), or the
 * attention's queries and its warps' partials; then the block table (max_blocks ints). */
__host__ __device__ inline size_t mk_smem_main(int d, int qd, int ff, int hd, int group)
{
    int widest = ff > qd ? (ff > d ? ff : d) : (qd > d ? qd : d);
    size_t norm = (size_t)((widest + 7) / 8) * 16 + (size_t)d * 4 + 32 * 4;
    size_t att = ((size_t)group * hd + (size_t)MK_WARPS * group * (hd + 2)) * 4;
    return ((norm > att ? norm : att) + 15) / 16 * 16;
}

/* This block's attention item for the step (one at most: n_kv * S <= blocks; it < 0:
 * none): its KV head h, key range s of S, keys t0..t1 and the warp's w0..w1. Computed where
 * it is used, each layer, rather than held in registers across the whole step (the
 * registers are the kernel's limit: 128 a thread). */
struct mk_item {
    int it, h, s, S, t0, t1, w0, w1;
};

__device__ inline mk_item mk_item_for(const mk_args &A)
{
    const int L = A.pos[0] + 1;
    /* key ranges: one item per block at most, at least MK_MIN_KEYS keys each */
    int S = (int)gridDim.x / A.n_kv;
    if (S > MK_SPLITS) S = MK_SPLITS;
    if (S > (L + MK_MIN_KEYS - 1) / MK_MIN_KEYS) S = (L + MK_MIN_KEYS - 1) / MK_MIN_KEYS;
    if (S < 1) S = 1;
    const int chunk = (L + S - 1) / S;
    mk_item m;
    m.S = S;
    m.it = blockIdx.x < A.n_kv * S ? (int)blockIdx.x : -1;
    m.h = m.it / S;
    m.s = m.it % S;
    m.t0 = m.s * chunk;
    m.t1 = m.t0 + chunk < L ? m.t0 + chunk : L;
    if (m.t1 < m.t0) m.t1 = m.t0;
    m.w0 = m.w1 = 0;
    mk_warp_keys(m.t0, m.t1, &m.w0, &m.w1);
    return m;
}

static size_t mk_smem_bytes(int d, int qd, int ff, int hd, int group, int max_blocks)
{
    return mk_smem_main(d, qd, ff, hd, group) + (size_t)max_blocks * 4;
}

template <int DPL, int GROUP>
__global__ void __launch_bounds__(MK_THREADS, 1) k_mega(mk_args A)
{
    extern __shared__ __align__(16) uint8_t mk_smem[];
    const int d = A.d, hd = 32 * DPL;
    const int widest = A.ff > A.qd ? (A.ff > d ? A.ff : d) : (A.qd > d ? A.qd : d);
    __nv_bfloat16 *s_in = (__nv_bfloat16 *)mk_smem;                       /* widest bf16 */
    float *s_v = (float *)(mk_smem + (size_t)((widest + 7) / 8) * 16);    /* d f32 */
    float *s_red = s_v + d;                                                /* 32 */
    /* attention, over the same bytes: the group's queries, then each warp's partials */
    float *s_q = (float *)mk_smem, *s_w = s_q + GROUP * hd;
    int32_t *s_tab = (int32_t *)(mk_smem + mk_smem_main(d, A.qd, A.ff, hd, GROUP)); /* max_blocks */
    const int lane = threadIdx.x % 32;
    const int p = A.pos[0];
    const int32_t *tab = A.tables + (size_t)A.seq[0] * A.max_blocks;
    const int rows_qkv = A.qd + 2 * A.kd;
    if (A.times && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        A.times[0] = t;
    }
    /* Every launch passes the same number of barriers, so the count at this launch's start
     * is the count now rounded down to a multiple of a launch's arrivals (no block can have
     * passed this launch's first barrier before this block arrives at it). */
    unsigned long long bar_next = 0;
    if (threadIdx.x == 0) {
        const unsigned long long per = (unsigned long long)(A.n_layer * 5 + (A.times ? 1 : 0)) * gridDim.x;
        const unsigned long long now = *(volatile unsigned long long *)A.bar;
        bar_next = now - now % per + gridDim.x;
        if (A.am && blockIdx.x == 0) *A.am = 0ull; /* before this block's first arrival */
    }
    /* the sequence's block table, for attention's lookups */
    for (int i = threadIdx.x; i <= p / A.block_size; i += blockDim.x) s_tab[i] = tab[i];
    __syncthreads();
    for (int li = 0; li < A.n_layer; li++) {
        const mk_layer *Ly = &A.layers[li];
        const uint8_t *layer = A.pool + (size_t)li * A.layer_bytes;
        /* QKV: x = the embedding (first layer) or xb + the last down projection */
        if (li == 0)
            mk_norm_in(nullptr, nullptr, A.embd + (size_t)A.tok[0] * d, Ly->attn_norm, A.xa, s_in, s_v, s_red, d,
                       A.eps);
        else
            mk_norm_in(A.xb, A.dn, nullptr, Ly->attn_norm, A.xa, s_in, s_v, s_red, d, A.eps);
        mk_gemv(Ly->qkv, s_in, d, rows_qkv, A.qkv);
        /* attention, each KV head's items merged by the block that ends them; the item's
         * first K/V loads go out before the barrier (they read only the cache) */
        uint32_t kr[MK_KPW][DPL / 2], vr[MK_KPW][DPL / 2];
        const mk_item I = mk_item_for(A);
        if (I.it >= 0 && A.preload) mk_kv_pass<DPL>(A, layer, s_tab, p, I.h, I.w0, I.w1, kr, vr);
        mk_sync(A.bar, &bar_next, A.times, li * 5 + 1);
        if (I.it >= 0) {
            if (!A.preload) mk_kv_pass<DPL>(A, layer, s_tab, p, I.h, I.w0, I.w1, kr, vr);
            mk_attn_item<DPL, GROUP>(A, layer, s_tab, p, I.h, I.s, I.S, I.t0, I.t1, s_q, s_w, A.cnt, kr, vr);
            __syncthreads();
        }
        mk_sync(A.bar, &bar_next, A.times, li * 5 + 2);
        /* output projection */
        mk_load_vec(A.att, s_in, A.qd);
        mk_gemv(Ly->wo, s_in, A.qd, d, A.o);
        mk_sync(A.bar, &bar_next, A.times, li * 5 + 3);
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
        mk_sync(A.bar, &bar_next, A.times, li * 5 + 4);
        /* down projection */
        mk_load_vec(A.ffa, s_in, A.ff);
        mk_gemv(Ly->down, s_in, A.ff, d, A.dn);
        mk_sync(A.bar, &bar_next, A.times, li * 5 + 5);
    }
    /* the final RMSNorm and the output matrix, and the greedy token: each warp's best row,
     * the block's best of those, one atomic max per block into *am (reset at the start) */
    mk_norm_in(A.xb, A.dn, nullptr, A.out_norm, nullptr, s_in, s_v, s_red, d, A.eps);
    unsigned long long best = 0ull;
    mk_gemv(A.out_w, s_in, d, A.vocab, A.logits, A.am ? &best : nullptr);
    if (A.am) {
        unsigned long long *s_best = (unsigned long long *)s_red; /* MK_WARPS of them: 128 bytes */
        __syncthreads();
        if (lane == 0) s_best[threadIdx.x / 32] = best;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < MK_WARPS; w++) best = max(best, s_best[w]);
            if (best) atomicMax(A.am, best);
        }
    }
    if (A.times) mk_sync(A.bar, &bar_next, A.times, A.n_layer * 5 + 1);
}
