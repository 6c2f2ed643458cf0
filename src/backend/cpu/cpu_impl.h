/*
 * backend/cpu/cpu_impl.h - what cpu.c shares with the per-ISA kernel files.
 *
 * cpu.c owns dispatch, threading and scratch layout; each ISA's files (cpu_generic.c,
 * *_avx2.c, *_avx512.c) fill one cpu__kernels table. Every entry is set; quant_row and
 * dequant_row may decline a type, and cpu.c then uses the generic (exact) one.
 *
 * The arithmetic contract shared by every ISA's matmul (cpu.h asks for batch
 * invariance; this is how it is met):
 *
 *  - Float weights (f32, f16, bf16) use the dot-product layout. y[m][n] has its own
 *    accumulator of L lanes (L = 16 for AVX-512, 8 for AVX2, 16 for generic); lane l
 *    sums x[k] * w[k] for k = l, l + L, l + 2L, ... in increasing k with one fused
 *    multiply-add per term (generic: multiply then add), starting from +0. Elements
 *    past K contribute fma(0, 0, acc). The lanes are then summed by the fixed tree
 *    cpu__tree16 / cpu__tree8 below. f16 and bf16 weights are widened to f32 first,
 *    which is exact, so widening once per panel or once per load is the same.
 *
 *  - Quantized weights (q8_0, q4_0): each x row is quantized to q8_0 exactly as
 *    td_quant_row_ref does (int8 q, fp16 scale, kept as f32 dx). Per 32-element
 *    block b the integer dot product S_b = sum q_x * q_w is exact (any order), and
 *        acc = fma((float)S_b, dx_b * dw_b, acc)      for b = 0, 1, ... (from +0)
 *    gives y (generic: acc += (float)S_b * (dx_b * dw_b)). So the SIMD layout of the
 *    integer part is free, and the float part is one chain per output.
 *
 * Every path (GEMV, GEMM tiles, edges, any thread split) performs exactly these
 * operations per output element, so M = 1 and M = 512 agree bit for bit.
 */
#ifndef TD_BACKEND_CPU_IMPL_H
#define TD_BACKEND_CPU_IMPL_H

#include "backend/cpu/cpu.h"

/* N is split across threads in multiples of this many weight rows (cpu.c's MM_GRAIN
 * is a multiple of it). */
#define CPU__N_ALIGN 32

/* cpu_pack's panels: rows per panel, and bytes per block of a panel (8 groups of 32
 * rows x 4 bytes, then 32 fp16 scales). */
#define CPU__PANEL_ROWS 32
#define CPU__PANEL_BLOCK_BYTES 1088
#define CPU__PANEL_SCALES 1024

/** One matmul call, as seen by an ISA's kernel (see cpu_matmul). */
typedef struct cpu__mm {
    float *y;
    int64_t ldy;
    const float *x;
    int64_t ldx;
    const uint8_t *w;
    size_t w_row_bytes;
    td_type wtype;
    int M, N, K;
    /* w is in cpu_pack's layout: rows [n, n + 32) (n % 32 == 0) are the panel at
     * w + n * w_row_bytes, of CPU__PANEL_BLOCK_BYTES per block (see cpu.h). */
    bool packed;
    /* Quantized activations, only for q8_0/q4_0 weights; row m of each at m * stride. */
    const int8_t *xq;  /* K int8 per row, row stride xq_stride bytes (64-aligned) */
    const float *xd;   /* K/32 block scales per row (f32 value of the fp16 scale) */
    const int32_t *xc; /* K/32 block corrections per row: -cpu__q_offset(wtype) * sum(q) */
    size_t xq_stride;  /* bytes */
    size_t xs_stride;  /* elements, for xd and xc */
} cpu__mm;

typedef struct cpu__kernels {
    const char *name;
    /**
     * y[m][n] for all m < M and n0 <= n < n1 (n0 a multiple of CPU__N_ALIGN).
     * scratch: this thread's matmul_scratch(wtype, M, K) bytes, 64-aligned.
     */
    void (*matmul)(const cpu__mm *mm, int n0, int n1, void *scratch);
    size_t (*matmul_scratch)(td_type wtype, int M, int K);
    /**
     * Quantize one row of K floats (K % 32 == 0) to q8_0 exactly as td_quant_row_ref:
     * q into xq, the block scales' f32 values into xd, and -offset * sum(q) into xc.
     */
    void (*quant_x)(const float *x, int K, int offset, int8_t *xq, float *xd, int32_t *xc);

    void (*rmsnorm)(float *out, const float *x, const float *w, int n, float eps);
    void (*silu_mul)(float *out, const float *gate, const float *up, int n);
    void (*add)(float *y, const float *x, int n);
    float (*dot_f32)(const float *a, const float *b, int n);
    void (*softmax)(float *x, int n);
    /* Return false when the type is not handled here (cpu.c then uses the generic one). */
    bool (*quant_row)(td_type t, const float *src, void *dst, int64_t n);
    bool (*dequant_row)(td_type t, const void *src, float *dst, int64_t n);
    void (*dot_kv_multi)(float *out, const float *q, const void *k, size_t k_stride, td_type t,
                         int n, int count);
    void (*axpy_kv_multi)(float *y, const float *a, const void *v, size_t v_stride, td_type t,
                          int n, int count);
    /* Optional (NULL: one _multi call per row). */
    void (*dot_kv_rows)(float *out, size_t out_stride, const float *q, size_t q_stride,
                        int n_rows, const void *k, size_t k_stride, td_type t, int n, int count);
    void (*axpy_kv_rows)(float *y, size_t y_stride, const float *a, size_t a_stride, int n_rows,
                         const void *v, size_t v_stride, td_type t, int n, int count);
    void (*dot_kv_heads)(float *out, size_t out_stride, const float *q, const void *k,
                         size_t head_bytes, td_type t, int n, int h0, int n_heads, int group);
    void (*axpy_kv_heads)(float *y, const float *a, size_t a_stride, const void *v,
                          size_t head_bytes, td_type t, int n, int h0, int n_heads, int group);
} cpu__kernels;

extern const cpu__kernels cpu__generic;
#if defined(__x86_64__)
extern const cpu__kernels cpu__avx2;
extern const cpu__kernels cpu__avx512;
#endif

/* The offset that turns one operand of the int8 dot product unsigned: q8_0 weights
 * are used as (q + 128), q4_0 nibbles are (q + 8) already; S = S' - offset * sum(q_x). */
static inline int cpu__q_offset(td_type wtype)
{
    return wtype == TD_TYPE_Q4_0 ? 8 : 128;
}

static inline bool cpu__is_quantized(td_type t)
{
    return t == TD_TYPE_Q8_0 || t == TD_TYPE_Q4_0;
}

/* The fixed reduction trees, as plain C (the SIMD versions compute exactly these). */
static inline float cpu__tree16(const float a[16])
{
    float t[8], u[4], v[2];
    for (int i = 0; i < 8; i++)
        t[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++)
        u[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++)
        v[i] = u[i] + u[i + 2];
    return v[0] + v[1];
}

static inline float cpu__tree8(const float a[8])
{
    float t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = a[i] + a[i + 4];
    for (int i = 0; i < 2; i++)
        u[i] = t[i] + t[i + 2];
    return u[0] + u[1];
}

/* Exact scalar helpers shared by the kernel files (bit-identical to model/types.c). */
uint8_t cpu__f32_to_fp8(float f);
extern float cpu__fp8_table[256];
void cpu__quant_x_ref(const float *x, int K, int offset, int8_t *xq, float *xd, int32_t *xc);

/*
 * The loops over a run of heads of cpu_dot_kv_heads and cpu_axpy_kv_heads, for one
 * ISA's one-position kernels DOT1(t, q, k, n) -> float and AXPY1(t, y, a, v, n): defines
 * the static functions dot_kv_heads and axpy_kv_heads. The KV type is resolved once per
 * call, and each branch inlines the kernels with a constant type.
 */
#define CPU__KV_HEADS_KERNELS(DOT1, AXPY1)                                                         \
    static inline __attribute__((always_inline)) void dot_heads_t(                                \
        td_type t, float *out, size_t os, const float *q, const uint8_t *k, size_t hb, int n,     \
        int h0, int nh, int group)                                                                 \
    {                                                                                              \
        for (int i = 0; i < nh; i++)                                                               \
            out[(size_t)i * os] =                                                                  \
                DOT1(t, q + (size_t)i * n, k + (size_t)((h0 + i) / group) * hb, n);                \
    }                                                                                              \
    static inline __attribute__((always_inline)) void axpy_heads_t(                               \
        td_type t, float *y, const float *a, size_t as, const uint8_t *v, size_t hb, int n,       \
        int h0, int nh, int group)                                                                 \
    {                                                                                              \
        for (int i = 0; i < nh; i++)                                                               \
            AXPY1(t, y + (size_t)i * n, a[(size_t)i * as], v + (size_t)((h0 + i) / group) * hb,   \
                  n);                                                                              \
    }                                                                                              \
    static void dot_kv_heads(float *out, size_t out_stride, const float *q, const void *k,         \
                             size_t head_bytes, td_type t, int n, int h0, int n_heads, int group)  \
    {                                                                                              \
        CPU__KV_TYPE_SWITCH(t, T, dot_heads_t(T, out, out_stride, q, (const uint8_t *)k,           \
                                               head_bytes, n, h0, n_heads, group))                 \
    }                                                                                              \
    static void axpy_kv_heads(float *y, const float *a, size_t a_stride, const void *v,            \
                              size_t head_bytes, td_type t, int n, int h0, int n_heads, int group) \
    {                                                                                              \
        CPU__KV_TYPE_SWITCH(t, T, axpy_heads_t(T, y, a, a_stride, (const uint8_t *)v, head_bytes,  \
                                                n, h0, n_heads, group))                            \
    }

/* Run STMT with the KV type T bound to t as a constant (f32 for any other type), so
 * that kernels inlined in STMT are compiled once per KV type. */
#define CPU__KV_TYPE_SWITCH(t, T, STMT)                                                            \
    switch (t) {                                                                                   \
    case TD_TYPE_F16: {                                                                            \
        const td_type T = TD_TYPE_F16;                                                             \
        STMT;                                                                                      \
        break;                                                                                     \
    }                                                                                              \
    case TD_TYPE_BF16: {                                                                           \
        const td_type T = TD_TYPE_BF16;                                                            \
        STMT;                                                                                      \
        break;                                                                                     \
    }                                                                                              \
    case TD_TYPE_FP8_E4M3: {                                                                       \
        const td_type T = TD_TYPE_FP8_E4M3;                                                        \
        STMT;                                                                                      \
        break;                                                                                     \
    }                                                                                              \
    default: {                                                                                     \
        const td_type T = TD_TYPE_F32;                                                             \
        STMT;                                                                                      \
        break;                                                                                     \
    }                                                                                              \
    }

#endif
