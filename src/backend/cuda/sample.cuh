/*
 * backend/cuda/sample.cuh - temperature / top-k / top-p / min-p sampling of logit rows on
 * the GPU (included by cuda_fwd.cu, after its device helpers), with the host sampler's
 * semantics (engine/sampler.c), so that a sampled row's logits never leave the device:
 *
 *   p_i = exp((l_i - max l) / T); keep p_i >= min_p and > 0; with top_k or top_p, order the
 *   kept tokens by p descending (ties: lower id first), keep the first top_k, then the
 *   shortest prefix whose mass reaches top_p of what is kept; draw r = u * (kept mass) and
 *   return the first token (in that order, or in id order when nothing asked for one)
 *   whose cumulative mass exceeds r.
 *
 * Per group of rows: k_samp_prep (max, p, min-p: an excluded token's p is 0, so it sorts
 * last and adds no mass), a device-wide radix sort of each row's (p, id) pairs by p
 * descending where an order is needed (CUB's sort is stable: equal p keep id order), and
 * k_samp_pick (one block per row: prefix sums in double over contiguous per-thread chunks,
 * the top-p cut and the draw as the first index whose running sum crosses a limit). The
 * sums are in double, as the host's; they are summed in another order (chunks, then the
 * chunks' totals), so a draw within ~1e-15 of a boundary may pick the neighbour.
 */

#define SAMP_THREADS 1024

struct samp_row {
    float temperature, top_p, min_p, u;
    int32_t top_k, row; /* row: the logits row */
};

__device__ inline bool samp_sorted(const samp_row &r)
{
    return r.top_k > 0 || r.top_p < 1.0f;
}

__device__ inline float samp_block_max(float v, float *s_red)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads();
    if (l == 0) s_red[w] = v;
    __syncthreads();
    v = l < nw ? s_red[l] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Block j of the group: row rows[j]'s kept probabilities into keys[j], ids into vals[j]. */
__global__ void __launch_bounds__(SAMP_THREADS) k_samp_prep(const float *logits, int vocab, const samp_row *rows,
                                                            float *keys, int32_t *vals)
{
    __shared__ float s_red[32];
    const samp_row r = rows[blockIdx.x];
    const float *lg = logits + (size_t)r.row * vocab;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, lg[i]);
    mx = samp_block_max(mx, s_red);
    const float inv_t = 1.0f / r.temperature, thresh = r.min_p > 0.0f ? r.min_p : 0.0f;
    float *k = keys + (size_t)blockIdx.x * vocab;
    int32_t *v = vals + (size_t)blockIdx.x * vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float p = expf((lg[i] - mx) * inv_t);
        k[i] = p >= thresh && p > 0.0f ? p : 0.0f; /* NaN too */
        v[i] = i;
    }
}

/* Block-wide exclusive scan of one double per thread; *total gets the sum. */
__device__ inline double samp_scan(double x, double *s_sum, double *total)
{
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, nw = blockDim.x / 32;
    double inc = x;
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, inc, o);
        if (l >= o) inc += y;
    }
    __syncthreads();
    if (l == 31) s_sum[w] = inc;
    __syncthreads();
    if (w == 0) {
        double s = l < nw ? s_sum[l] : 0.0;
        for (int o = 1; o < 32; o <<= 1) {
            const double y = __shfl_up_sync(0xffffffffu, s, o);
            if (l >= o) s += y;
        }
        if (l < nw) s_sum[l] = s; /* inclusive, per warp */
    }
    __syncthreads();
    *total = s_sum[nw - 1];
    return (w > 0 ? s_sum[w - 1] : 0.0) + inc - x;
}

/*
 * Block j: pick row rows[j]'s token from keys/vals (sorted: p descending, ids along; or
 * as k_samp_prep left them, in id order) into out[j].
 */
__global__ void __launch_bounds__(SAMP_THREADS) k_samp_pick(int vocab, const samp_row *rows, const float *sorted_keys,
                                                            const int32_t *sorted_vals, const float *keys,
                                                            int32_t *out)
{
    __shared__ double s_sum[32];
    __shared__ int s_first, s_count;
    const samp_row r = rows[blockIdx.x];
    const bool sorted = samp_sorted(r);
    const float *k = (sorted ? sorted_keys : keys) + (size_t)blockIdx.x * vocab;
    const int32_t *v = sorted ? sorted_vals + (size_t)blockIdx.x * vocab : nullptr;
    /* the kept tokens: a prefix when sorted (excluded ones are 0 and sort last) */
    int n = vocab;
    if (sorted) {
        if (threadIdx.x == 0) s_count = 0;
        __syncthreads();
        int c = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) c += k[i] > 0.0f;
        atomicAdd(&s_count, c);
        __syncthreads();
        n = s_count;
        if (r.top_k > 0 && n > r.top_k) n = r.top_k;
    }
    if (n < 1) {
        if (threadIdx.x == 0) out[blockIdx.x] = sorted ? v[0] : 0;
        return;
    }
    /* each thread a contiguous chunk of the first n, in order */
    const int per = (n + blockDim.x - 1) / blockDim.x;
    const int c0 = (int)threadIdx.x * per < n ? (int)threadIdx.x * per : n;
    const int c1 = c0 + per < n ? c0 + per : n;
    double local = 0.0, total;
    for (int i = c0; i < c1; i++) local += (double)k[i];
    const double before = samp_scan(local, s_sum, &total);
    /* the first index whose running sum, from `before`, reaches (>= limit, or > limit) */
    auto first_crossing = [&](double limit, bool strict, int end) -> int {
        __syncthreads();
        if (threadIdx.x == 0) s_first = end;
        __syncthreads();
        double acc = before;
        for (int i = c0; i < c1 && i < end; i++) {
            acc += (double)k[i];
            if (strict ? limit < acc : acc >= limit) {
                atomicMin(&s_first, i);
                break;
            }
        }
        __syncthreads();
        return s_first;
    };
    /* the running sum through index i (the thread that holds it says) */
    auto sum_through = [&](int i) -> double {
        __syncthreads();
        if (i >= c0 && i < c1) {
            double acc = before;
            for (int j = c0; j <= i; j++) acc += (double)k[j];
            s_sum[0] = acc;
        }
        __syncthreads();
        return s_sum[0];
    };
    int keep = n;
    if (sorted && r.top_p < 1.0f) {
        const int f = first_crossing((double)r.top_p * total, false, n);
        keep = f < n ? f + 1 : n;
        total = sum_through(keep - 1);
    }
    const int f = first_crossing((double)r.u * total, true, keep);
    if (threadIdx.x == 0) {
        int i = f < keep ? f : keep - 1;
        if (!sorted && f >= keep) /* past the end by rounding: the last kept id */
            for (i = keep - 1; i > 0 && !(k[i] > 0.0f); i--) {
            }
        out[blockIdx.x] = sorted ? v[i] : i;
    }
}
