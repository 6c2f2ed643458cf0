/*
 * kvx/cuda_copy.h - the cuda_ipc transport's copy kernel (cuda_copy.cu; CUDA builds only).
 * Plain C: cuda_ipc.c includes it.
 */
#ifndef TD_KVX_CUDA_COPY_H
#define TD_KVX_CUDA_COPY_H

#include <stdint.h>

#define KVX_COPY_MAX_GROUPS 48

/** rows rows of row_chunks x 16 bytes: row j from src + src_off + j * spitch to
 *  dst + dst_off + j * dpitch. Every offset, pitch and row is a multiple of 16 bytes. */
typedef struct kvx_copy_group {
    uint64_t src_off, dst_off, spitch, dpitch;
    uint32_t row_chunks, rows; /* row_chunks x rows < 2^32 */
    uint64_t first_chunk;      /* set by the launcher */
} kvx_copy_group;

#ifdef __cplusplus
extern "C" {
#endif
/** Launch the copy of groups g[0..n) (n <= KVX_COPY_MAX_GROUPS) on stream (a
 *  cudaStream_t); 0, or -1 when the launch failed (cudaGetLastError says why). */
int kvx__cuda_copy_groups(uint8_t *dst, const uint8_t *src, kvx_copy_group *g, int n, int n_sm,
                          void *stream);
#ifdef __cplusplus
}
#endif

#endif
