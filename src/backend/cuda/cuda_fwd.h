/*
 * backend/cuda/cuda_fwd.h - the transformer forward pass on an NVIDIA GPU (built with
 * -DTANDEM_CUDA=ON; TD_HAVE_CUDA is then defined).
 *
 * The same contract as engine/forward.h, on the device: the weights and the paged KV pool
 * live in device memory, one call runs a flat batch of tokens from many sequences
 * (prefill chunks and decodes together) through every layer, stores every token's K and V
 * in its sequence's blocks first, and returns the logits of the requested rows to the host.
 * The pool has the CPU pool's layout (per layer: block b holds K[block_size][kv_dim], then
 * V), so the engine's block bookkeeping is unchanged.
 *
 * Numerics: matrices of an f32 model stay f32 (cuBLAS SGEMM, no TF32), so greedy output
 * matches the CPU engine; other weight types are converted to bf16 at load, multiplied
 * with bf16 activations and f32 accumulation. Norms, RoPE (angles in double, as on the
 * CPU), softmax and the residual stream are f32.
 *
 * This header has no CUDA types: the engine (C) includes it.
 */
#ifndef TD_BACKEND_CUDA_FWD_H
#define TD_BACKEND_CUDA_FWD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"
#include "util/td.h"

typedef struct td_cuda_fwd td_cuda_fwd;

/** Whether a CUDA device can be used; if not, why (no driver, no device). */
bool td_cuda_available(char *why, size_t cap);

/**
 * On GPU `gpu` (of those this process sees; every later call makes it the calling
 * thread's current device, so the engine may run on any thread): upload the model's weights and allocate the device KV pool (n_layers x n_blocks blocks
 * of block_size tokens in kv_dtype: f32, f16, bf16 or fp8_e4m3) and the workspace for max_tokens
 * tokens, max_logits logit rows and max_ctx positions per sequence.
 */
int td_cuda_fwd_create(td_cuda_fwd **out, const td_model *m, int gpu, td_type kv_dtype, int block_size,
                       int n_blocks, int max_tokens, int max_logits, int max_ctx, td_err *err);
void td_cuda_fwd_free(td_cuda_fwd *f);

/**
 * Measure the device's limits, for benchmark floors: a device-to-device copy of 1 GiB
 * (bytes read plus written per second, as the anchors count it) and a bf16 GEMM of
 * 8192^3 with f32 accumulation (TFLOP/s); best of several runs each.
 */
int td_cuda_probe(double *copy_gbs, double *gemm_tflops, td_err *err);

/**
 * The KV pool for a same-host transfer peer (kvx cuda_ipc): its device address, its CUDA
 * IPC handle (64 bytes, a cudaIpcMemHandle_t), the device's ordinal and UUID.
 */
int td_cuda_fwd_kv_export(td_cuda_fwd *f, void **base, uint8_t handle[64], int *device,
                          uint8_t uuid[16], td_err *err);

/** Bytes of device memory the pool and the weights took (for the memory plan's log). */
size_t td_cuda_fwd_device_bytes(const td_cuda_fwd *f);

/* Whether decode steps of one row run as one kernel (mega.cuh): bf16 weights without
 * biases, a bf16 or f16 KV cache, head_dim 64 or 128, 1, 2, 4 or 8 query heads per KV
 * head, and TD_CUDA_MEGA not 0. */
bool td_cuda_fwd_one_kernel(const td_cuda_fwd *f);

/**
 * How a logit row is sampled on the GPU: as sampler_sample (engine/sampler.c) with these
 * parameters, drawing u (in [0, 1): the request's next td_rng_float) where it draws.
 * temperature <= 0 or top_k == 1 is greedy.
 */
typedef struct td_cuda_sample {
    float temperature, top_p, min_p, u;
    int32_t top_k;
} td_cuda_sample;

/**
 * Run a batch: token t is tokens[t] at position pos[t] of sequence seq[t], whose block ids
 * are block_tables[seq[t]] (n_seqs tables). For the n_logits batch rows logit_rows[]:
 * argmax[i] (when argmax is not NULL) receives row i's greedy token, computed on the GPU
 * (the lowest id of the largest logit, as sampler_argmax), or, where sample is given,
 * need_logits[i] is not set and sample[i] is not greedy, the token sampled on the GPU
 * with sample[i]; logits row i (n_vocab f32) is filled where need_logits[i] is set, or for
 * every row when need_logits is NULL; the other rows' logits never leave the GPU. Returns
 * 0, or TD_EIO with a message for a device failure.
 */
int td_cuda_fwd_run(td_cuda_fwd *f, int n_tokens, const int32_t *tokens, const int32_t *pos,
                    const int32_t *seq, const int32_t *const *block_tables, int n_seqs,
                    int n_logits, const int32_t *logit_rows, float *logits,
                    const uint8_t *need_logits, const td_cuda_sample *sample, int32_t *argmax,
                    td_err *err);

/**
 * Sample n_rows host logit rows (n_vocab f32 each, n_rows <= the plan's logit rows) on the
 * GPU as td_cuda_fwd_run does, tokens into out: the device sampler alone, for tests.
 */
int td_cuda_sample_logits(td_cuda_fwd *f, const float *logits, int n_rows,
                          const td_cuda_sample *sample, int32_t *out, td_err *err);

#endif
