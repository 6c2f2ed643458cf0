/*
 * backend/cpu/cpu.h - CPU compute kernels.
 *
 * Each kernel has a portable C version and SIMD versions (AVX2+FMA+F16C,
 * AVX-512 with VNNI/BF16), chosen once at start-up by cpu_init() from CPUID, or
 * forced by the TD_CPU_ISA environment variable ("generic", "avx2", "avx512")
 * so tests can compare each against the plain C reference.
 *
 * Batch invariance (the engine's determinism contract): every output element is
 * computed with the same sequence of floating-point operations whatever the batch
 * size M, the other rows of the batch, the thread count, or the row's position in
 * the batch. In particular cpu_matmul with M = 1 and with M = 512 give bit-identical
 * rows. (Different ISAs may differ from each other; one process uses one ISA.)
 */
#ifndef TD_BACKEND_CPU_H
#define TD_BACKEND_CPU_H

#include "model/types.h"
#include "util/pool.h"
#include "util/td.h"

typedef enum cpu_isa { CPU_ISA_GENERIC = 0, CPU_ISA_AVX2 = 1, CPU_ISA_AVX512 = 2 } cpu_isa;

/** Detect the CPU (idempotent, thread-safe to call first from main). */
void cpu_init(void);
cpu_isa cpu_get_isa(void);
/** Force an ISA (tests); returns TD_EUNSUPPORTED if the CPU lacks it. */
int cpu_set_isa(cpu_isa isa);
const char *cpu_isa_name(cpu_isa isa);

/**
 * Bytes of scratch that cpu_matmul needs for an M x K activation against a weight
 * of type wtype (quantized activations for q8_0/q4_0, packed panels, ...). The
 * engine reserves this at start-up for its largest batch. The size grows with M, K
 * and n_threads (never with N), so the value for the largest M and K, and at least
 * the pool's thread count, covers every smaller call; it is valid on every ISA.
 */
size_t cpu_matmul_scratch_size(td_type wtype, int M, int K, int n_threads);

/**
 * y[m*ldy + n] = sum_k x[m*ldx + k] * W[n][k]   for m < M, n < N  (y = x W^T).
 * W: N rows of K elements of type wtype, row r at (char*)w + r * w_row_bytes.
 * x, y: f32. Runs on all threads of the pool (call from the pool's owner thread).
 * Batch invariant (see above). scratch: cpu_matmul_scratch_size bytes, 64-aligned.
 */
void cpu_matmul(td_pool *pool, float *y, int64_t ldy, const float *x, int64_t ldx, const void *w,
                size_t w_row_bytes, td_type wtype, int M, int N, int K, void *scratch);

/** One output of cpu_matmul_multi: y = x W^T with W of N rows (as for cpu_matmul). */
typedef struct cpu_mm_out {
    float *y;
    int64_t ldy;
    const void *w;
    size_t w_row_bytes;
    int N;
    /* w is in cpu_pack's panel layout (w_row_bytes must then be td_row_bytes(wtype, K)). */
    bool packed;
} cpu_mm_out;

#define CPU_MM_MAX_OUT 4

/**
 * Several matmuls of the same x against weights of one type and width K (e.g. the
 * Q, K and V projections), in one pool run: x is quantized once (q8_0/q4_0) and the
 * threads share out the rows of all the weights together, so there is one join
 * instead of n_out. Each output is bit-identical to its own cpu_matmul call.
 * n_out <= CPU_MM_MAX_OUT; scratch as for cpu_matmul.
 */
void cpu_matmul_multi(td_pool *pool, const cpu_mm_out *outs, int n_out, const float *x,
                      int64_t ldx, td_type wtype, int M, int K, void *scratch);

/*
 * Weights repacked once (at model load) into the layout the quantized kernels read
 * directly, so that no call repacks them. Supported for q8_0 only. The layout is the
 * same for every ISA (a process may switch ISA, tests do) and holds exactly the bytes of
 * the native rows, reordered: rows go in panels of 32, and panel p takes the bytes that
 * rows 32p .. 32p + 31 take natively. Per block b of 32 elements, a panel holds 1088
 * bytes: 8 groups g of 128 bytes (row j's q[4g .. 4g + 3] as unsigned bytes q + 128 at
 * 128g + 4j), then the 32 rows' fp16 scales. Rows past N are zero. With this layout an
 * int8 dot-product instruction gives 16 (AVX-512) or 8 (AVX2) rows' partial sums per
 * vector with no horizontal reduction, for one x row as for many.
 */
bool cpu_pack_supported(td_type wtype);
/** Bytes of a packed N x K weight: N rounded up to 32 rows of td_row_bytes(wtype, K). */
size_t cpu_pack_bytes(td_type wtype, int64_t N, int K);
/**
 * Pack rows [r0, r1) of a weight (r0, r1 multiples of 32, or r1 = N) from the native
 * layout (row r at (char*)w + r * w_row_bytes) into dst, which holds cpu_pack_bytes
 * bytes (64-aligned). Calls for disjoint row ranges may run on different threads.
 */
void cpu_pack_rows(td_type wtype, void *dst, const void *w, size_t w_row_bytes, int64_t N, int K,
                   int64_t r0, int64_t r1);

/** Plain-C reference of cpu_matmul (double accumulation is NOT used: f32, for tests). */
void cpu_matmul_ref(float *y, int64_t ldy, const float *x, int64_t ldx, const void *w,
                    size_t w_row_bytes, td_type wtype, int M, int N, int K);

/* ---- row kernels: single-threaded, vectorized ----------------------------- */

/** out = x / rms(x) * w   (n elements; out may equal x). */
void cpu_rmsnorm(float *out, const float *x, const float *w, int n, float eps);
/** out = silu(gate) * up  (out may equal gate). */
void cpu_silu_mul(float *out, const float *gate, const float *up, int n);
/** y += x */
void cpu_add(float *y, const float *x, int n);
/** dot product of f32 vectors. */
float cpu_dot_f32(const float *a, const float *b, int n);
/** In-place softmax over n elements; returns nothing. */
void cpu_softmax(float *x, int n);

/** Convert n f32 values to type t (f32, f16, bf16, fp8_e4m3, q8_0) and back. */
void cpu_quant_row(td_type t, const float *src, void *dst, int64_t n);
void cpu_dequant_row(td_type t, const void *src, float *dst, int64_t n);

/**
 * Attention helpers over KV stored as type t (f32, f16, bf16, fp8_e4m3):
 *   cpu_dot_kv:  returns dot(q[0..n), k[0..n))
 *   cpu_axpy_kv: y[0..n) += a * v[0..n)
 */
float cpu_dot_kv(const float *q, const void *k, td_type t, int n);
void cpu_axpy_kv(float *y, float a, const void *v, td_type t, int n);

/**
 * Batched forms for attention over a run of positions (e.g. one KV block), much
 * faster than one call per position and bit-identical to it:
 *   cpu_dot_kv_multi:  out[j] = cpu_dot_kv(q, k + j * k_stride, t, n)    for j < count
 *   cpu_axpy_kv_multi: for j = 0 .. count-1 in order: cpu_axpy_kv(y, a[j], v + j * v_stride, t, n)
 * Strides are in bytes.
 */
void cpu_dot_kv_multi(float *out, const float *q, const void *k, size_t k_stride, td_type t, int n,
                      int count);
void cpu_axpy_kv_multi(float *y, const float *a, const void *v, size_t v_stride, td_type t, int n,
                       int count);

/**
 * The batched forms for several query rows over the same run of positions (the rows of a
 * prefill chunk share their sequence's KV), each KV vector read once for all the rows;
 * bit-identical to one _multi call per row:
 *   cpu_dot_kv_rows:  cpu_dot_kv_multi(out + r * out_stride, q + r * q_stride, k, ...)
 *   cpu_axpy_kv_rows: cpu_axpy_kv_multi(y + r * y_stride, a + r * a_stride, v, ...)
 * for r < n_rows. Strides of out, q, y and a are in floats, of k and v in bytes.
 */
void cpu_dot_kv_rows(float *out, size_t out_stride, const float *q, size_t q_stride, int n_rows,
                     const void *k, size_t k_stride, td_type t, int n, int count);
void cpu_axpy_kv_rows(float *y, size_t y_stride, const float *a, size_t a_stride, int n_rows,
                      const void *v, size_t v_stride, td_type t, int n, int count);

/**
 * One KV position (one token's row, every KV head side by side, head_bytes apart)
 * against a run of query heads h0 .. h0 + n_heads - 1, where query head h reads KV
 * head h / group. Bit-identical to one cpu_dot_kv / cpu_axpy_kv call per head:
 *   cpu_dot_kv_heads:  out[i * out_stride] = cpu_dot_kv(q + i * n, k + kv_i, t, n)
 *   cpu_axpy_kv_heads: cpu_axpy_kv(y + i * n, a[i * a_stride], v + kv_i, t, n)
 * for i < n_heads, with kv_i = ((h0 + i) / group) * head_bytes.
 * (q and y point at head h0's vector.) Walking the KV cache one whole row at a time
 * reads it in address order, which the hardware prefetchers follow; one head across
 * many rows is a strided walk that they do not.
 */
void cpu_dot_kv_heads(float *out, size_t out_stride, const float *q, const void *k,
                      size_t head_bytes, td_type t, int n, int h0, int n_heads, int group);
void cpu_axpy_kv_heads(float *y, const float *a, size_t a_stride, const void *v, size_t head_bytes,
                       td_type t, int n, int h0, int n_heads, int group);

/**
 * Rotary embedding for one head vector of head_dim elements at position pos.
 * NORM rotates pairs (2i, 2i+1); NEOX rotates (i, i + head_dim/2). theta_i =
 * pos * freq_scale * base^(-2i/head_dim) / (freq_factors ? freq_factors[i] : 1).
 */
void cpu_rope(float *x, int head_dim, int64_t pos, float base, float freq_scale,
              const float *freq_factors, int neox);
/**
 * cpu_rope on n_heads head vectors at x + h * head_stride (floats), computing the
 * cos/sin table once. Identical results to n_heads cpu_rope calls.
 */
void cpu_rope_heads(float *x, int n_heads, int64_t head_stride, int head_dim, int64_t pos,
                    float base, float freq_scale, const float *freq_factors, int neox);

#endif
