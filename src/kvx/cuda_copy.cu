/*
 * kvx/cuda_copy.cu - the cuda_ipc transport's copy kernel (built with -DTANDEM_CUDA=ON).
 *
 * A piece's ranges (rows of len bytes, one per segment, at two pitches) are copied by one
 * launch on the SMs, 16 bytes per thread per step, four steps in flight: a strided copy
 * through cudaMemcpy2DAsync goes to the copy engines, which move about 1.5 TB/s on an
 * H200 against about 2 TB/s for an SM copy (BENCHMARKS.md), and one cudaMemcpyAsync per
 * row costs a launch each.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kvx/cuda_copy.h"

namespace {

struct copy_params {
    const uint8_t *src;
    uint8_t *dst;
    int n;
    uint64_t total; /* 16-byte chunks over every group */
    kvx_copy_group g[KVX_COPY_MAX_GROUPS];
};

__global__ void __launch_bounds__(256) k_copy(const __grid_constant__ copy_params p)
{
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    int gi = 0;
    for (uint64_t c0 = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; c0 < p.total; c0 += 4 * stride) {
        uint4 v[4];
        uint8_t *to[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            uint64_t c = c0 + u * stride;
            to[u] = nullptr;
            if (c >= p.total) continue;
            while (gi + 1 < p.n && p.g[gi + 1].first_chunk <= c) gi++; /* c only grows */
            const kvx_copy_group &g = p.g[gi];
            uint32_t local = (uint32_t)(c - g.first_chunk), per_row = g.row_chunks;
            uint32_t row = local / per_row, col = local - row * per_row;
            v[u] = *(const uint4 *)(p.src + g.src_off + (uint64_t)row * g.spitch + (uint64_t)col * 16);
            to[u] = p.dst + g.dst_off + (uint64_t)row * g.dpitch + (uint64_t)col * 16;
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (to[u]) *(uint4 *)to[u] = v[u];
    }
}

} // namespace

extern "C" int kvx__cuda_copy_groups(uint8_t *dst, const uint8_t *src, kvx_copy_group *g, int n,
                                     int n_sm, void *stream)
{
    if (n < 1 || n > KVX_COPY_MAX_GROUPS) return -1;
    copy_params p;
    p.src = src;
    p.dst = dst;
    p.n = n;
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        g[i].first_chunk = total;
        total += (uint64_t)g[i].row_chunks * g[i].rows;
        p.g[i] = g[i];
    }
    p.total = total;
    uint64_t want = (total + 1023) / 1024; /* four chunks per thread per pass at least */
    int blocks = (int)(want < (uint64_t)n_sm * 8 ? want : (uint64_t)n_sm * 8);
    if (blocks < 1) blocks = 1;
    k_copy<<<blocks, 256, 0, (cudaStream_t)stream>>>(p);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
