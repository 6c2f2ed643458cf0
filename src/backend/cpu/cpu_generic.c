/*
 * backend/cpu/cpu_generic.c - the portable C kernels: the fallback for CPUs without
 * AVX2, the reference layout that the SIMD files mirror, and the exact scalar
 * conversions they share. Arithmetic follows the contract in cpu_impl.h with a
 * multiply and an add where SIMD code uses a fused multiply-add.
 */
#include "backend/cpu/cpu_impl.h"

#include <math.h>
#include <string.h>

float cpu__fp8_table[256]; /* filled by cpu_init from td_fp8e4m3_to_f32 */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/*
 * td_f32_to_fp8e4m3 without frexpf: in the normal range, rounding the f32 mantissa
 * to 3 bits (nearest even, carrying into the exponent) and rebiasing the exponent
 * from 127 to 7 gives the same byte. Verified against types.c over all 2^32 inputs.
 */
uint8_t cpu__f32_to_fp8(float f)
{
    uint32_t x = f32_bits(f);
    uint8_t sign = (uint8_t)((x >> 24) & 0x80);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7f;         /* nan */
    if (ax >= 0x43e00000u) return sign | 0x7e; /* >= 448: saturate */
    if (ax < 0x3c800000u) {                    /* < 2^-6: multiples of 2^-9 */
        float q = nearbyintf(bits_f32(ax) * 512.0f);
        return sign | (uint8_t)q;
    }
    uint32_t r = ax + 0x7ffffu + ((ax >> 20) & 1);
    return sign | (uint8_t)((r >> 20) - (120u << 3));
}

void cpu__quant_x_ref(const float *x, int K, int offset, int8_t *xq, float *xd, int32_t *xc)
{
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0;
        for (int j = 0; j < 32; j++)
            amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f;
        float id = d ? 1.0f / d : 0.0f;
        xd[b] = td_fp16_to_f32(td_f32_to_fp16(d));
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)roundf(xb[j] * id);
            xq[b * 32 + j] = (int8_t)q;
            sum += q;
        }
        xc[b] = -offset * sum;
    }
}

/* ---- matmul ------------------------------------------------------------------ */

#define GEN_LANES 16

static float dot_lanes(const float *x, const float *w, int K)
{
    float acc[GEN_LANES] = {0};
    int k = 0;
    for (; k + GEN_LANES <= K; k += GEN_LANES)
        for (int l = 0; l < GEN_LANES; l++)
            acc[l] += x[k + l] * w[k + l];
    if (k < K) {
        for (int l = 0; l < GEN_LANES; l++) {
            float xv = k + l < K ? x[k + l] : 0.0f, wv = k + l < K ? w[k + l] : 0.0f;
            acc[l] += xv * wv;
        }
    }
    return cpu__tree16(acc);
}

/* Unpack one quantized weight row to int8 values and f32 block scales. */
static void unpack_q_row(td_type t, const uint8_t *row, int K, int8_t *q, float *d)
{
    for (int b = 0; b < K / 32; b++) {
        if (t == TD_TYPE_Q8_0) {
            const td_block_q8_0 *blk = (const td_block_q8_0 *)(const void *)row + b;
            uint16_t h;
            memcpy(&h, row + (size_t)b * sizeof(td_block_q8_0), 2);
            d[b] = td_fp16_to_f32(h);
            memcpy(q + b * 32, blk->qs, 32);
        } else {
            const uint8_t *blk = row + (size_t)b * sizeof(td_block_q4_0);
            uint16_t h;
            memcpy(&h, blk, 2);
            d[b] = td_fp16_to_f32(h);
            for (int j = 0; j < 16; j++) {
                q[b * 32 + j] = (int8_t)((blk[2 + j] & 0xf) - 8);
                q[b * 32 + j + 16] = (int8_t)((blk[2 + j] >> 4) - 8);
            }
        }
    }
}

/* The same for row n of a weight in cpu_pack's panel layout. */
static void unpack_q_row_packed(const cpu__mm *mm, int n, int8_t *q, float *d)
{
    const uint8_t *panel = mm->w + (size_t)(n - n % CPU__PANEL_ROWS) * mm->w_row_bytes;
    const int j = n % CPU__PANEL_ROWS;
    for (int b = 0; b < mm->K / 32; b++) {
        const uint8_t *pb = panel + (size_t)b * CPU__PANEL_BLOCK_BYTES;
        for (int g = 0; g < 8; g++)
            for (int i = 0; i < 4; i++)
                q[b * 32 + 4 * g + i] = (int8_t)(pb[128 * g + 4 * j + i] ^ 0x80);
        uint16_t h;
        memcpy(&h, pb + CPU__PANEL_SCALES + 2 * j, 2);
        d[b] = td_fp16_to_f32(h);
    }
}

static void gen_matmul(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    const int K = mm->K;
    if (cpu__is_quantized(mm->wtype)) {
        int8_t *wq = scratch;
        float *wd = (float *)(void *)((uint8_t *)scratch + TD_ALIGN_UP((size_t)K, 64));
        const int nb = K / 32;
        for (int n = n0; n < n1; n++) {
            if (mm->packed)
                unpack_q_row_packed(mm, n, wq, wd);
            else
                unpack_q_row(mm->wtype, mm->w + (size_t)n * mm->w_row_bytes, K, wq, wd);
            for (int m = 0; m < mm->M; m++) {
                const int8_t *xq = mm->xq + (size_t)m * mm->xq_stride;
                const float *xd = mm->xd + (size_t)m * mm->xs_stride;
                float acc = 0.0f;
                for (int b = 0; b < nb; b++) {
                    int32_t s = 0;
                    for (int j = 0; j < 32; j++)
                        s += (int32_t)xq[b * 32 + j] * wq[b * 32 + j];
                    acc += (float)s * (xd[b] * wd[b]);
                }
                mm->y[(size_t)m * mm->ldy + n] = acc;
            }
        }
        return;
    }
    float *wrow = scratch;
    for (int n = n0; n < n1; n++) {
        const uint8_t *src = mm->w + (size_t)n * mm->w_row_bytes;
        const float *wf = (const float *)(const void *)src;
        if (mm->wtype != TD_TYPE_F32) {
            td_dequant_row_ref(mm->wtype, src, wrow, K);
            wf = wrow;
        }
        for (int m = 0; m < mm->M; m++)
            mm->y[(size_t)m * mm->ldy + n] = dot_lanes(mm->x + (size_t)m * mm->ldx, wf, K);
    }
}

static size_t gen_matmul_scratch(td_type wtype, int M, int K)
{
    (void)M;
    if (cpu__is_quantized(wtype)) return TD_ALIGN_UP((size_t)K, 64) + (size_t)K / 32 * 4 + 64;
    return (size_t)K * 4 + 64;
}

/* ---- row kernels --------------------------------------------------------------- */

static float sum_lanes(const float *x, const float *y, int n, bool square)
{
    float acc[GEN_LANES] = {0};
    int i = 0;
    for (; i + GEN_LANES <= n; i += GEN_LANES)
        for (int l = 0; l < GEN_LANES; l++)
            acc[l] += square ? x[i + l] * x[i + l] : x[i + l] * y[i + l];
    for (int l = 0; i + l < n; l++)
        acc[l] += square ? x[i + l] * x[i + l] : x[i + l] * y[i + l];
    return cpu__tree16(acc);
}

static void gen_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    float ss = sum_lanes(x, NULL, n, true);
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

static void gen_silu_mul(float *out, const float *gate, const float *up, int n)
{
    for (int i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static void gen_add(float *y, const float *x, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += x[i];
}

static float gen_dot_f32(const float *a, const float *b, int n)
{
    return sum_lanes(a, b, n, false);
}

static void gen_softmax(float *x, int n)
{
    if (n <= 0) return;
    float max = x[0];
    for (int i = 1; i < n; i++)
        max = fmaxf(max, x[i]);
    float acc[GEN_LANES] = {0};
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        acc[i % GEN_LANES] += x[i];
    }
    float inv = 1.0f / cpu__tree16(acc);
    for (int i = 0; i < n; i++)
        x[i] *= inv;
}

static bool gen_quant_row(td_type t, const float *src, void *dst, int64_t n)
{
    switch (t) {
    case TD_TYPE_FP8_E4M3: {
        uint8_t *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = cpu__f32_to_fp8(src[i]);
        return true;
    }
    default:
        td_quant_row_ref(t, src, dst, n);
        return true;
    }
}

static bool gen_dequant_row(td_type t, const void *src, float *dst, int64_t n)
{
    if (t == TD_TYPE_FP8_E4M3) {
        const uint8_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = cpu__fp8_table[s[i]];
        return true;
    }
    td_dequant_row_ref(t, src, dst, n);
    return true;
}

static inline float kv_elem(const void *p, td_type t, int i)
{
    switch (t) {
    case TD_TYPE_F16:
        return td_fp16_to_f32(((const uint16_t *)p)[i]);
    case TD_TYPE_BF16:
        return td_bf16_to_f32(((const uint16_t *)p)[i]);
    case TD_TYPE_FP8_E4M3:
        return cpu__fp8_table[((const uint8_t *)p)[i]];
    default:
        return ((const float *)p)[i];
    }
}

static void gen_dot_kv_multi(float *out, const float *q, const void *k, size_t k_stride, td_type t,
                             int n, int count)
{
    for (int j = 0; j < count; j++) {
        const void *kj = (const uint8_t *)k + (size_t)j * k_stride;
        float acc[GEN_LANES] = {0};
        for (int i = 0; i < n; i++)
            acc[i % GEN_LANES] += q[i] * kv_elem(kj, t, i);
        out[j] = cpu__tree16(acc);
    }
}

static void gen_axpy_kv_multi(float *y, const float *a, const void *v, size_t v_stride, td_type t,
                              int n, int count)
{
    for (int j = 0; j < count; j++) {
        const void *vj = (const uint8_t *)v + (size_t)j * v_stride;
        for (int i = 0; i < n; i++)
            y[i] += a[j] * kv_elem(vj, t, i);
    }
}

static void gen_dot_kv_heads(float *out, size_t out_stride, const float *q, const void *k,
                             size_t head_bytes, td_type t, int n, int h0, int n_heads, int group)
{
    for (int i = 0; i < n_heads; i++)
        gen_dot_kv_multi(out + (size_t)i * out_stride, q + (size_t)i * n,
                         (const uint8_t *)k + (size_t)((h0 + i) / group) * head_bytes, 0, t, n, 1);
}

static void gen_axpy_kv_heads(float *y, const float *a, size_t a_stride, const void *v,
                              size_t head_bytes, td_type t, int n, int h0, int n_heads, int group)
{
    for (int i = 0; i < n_heads; i++)
        gen_axpy_kv_multi(y + (size_t)i * n, a + (size_t)i * a_stride,
                          (const uint8_t *)v + (size_t)((h0 + i) / group) * head_bytes, 0, t, n, 1);
}

const cpu__kernels cpu__generic = {
    .name = "generic",
    .matmul = gen_matmul,
    .matmul_scratch = gen_matmul_scratch,
    .quant_x = cpu__quant_x_ref,
    .rmsnorm = gen_rmsnorm,
    .silu_mul = gen_silu_mul,
    .add = gen_add,
    .dot_f32 = gen_dot_f32,
    .softmax = gen_softmax,
    .quant_row = gen_quant_row,
    .dequant_row = gen_dequant_row,
    .dot_kv_multi = gen_dot_kv_multi,
    .axpy_kv_multi = gen_axpy_kv_multi,
    .dot_kv_heads = gen_dot_kv_heads,
    .axpy_kv_heads = gen_axpy_kv_heads,
};
