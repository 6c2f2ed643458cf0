/*
 * backend/cpu/ops_avx512.c - AVX-512 row kernels (norms, activations, softmax,
 * conversions, attention helpers), the activation quantizer of the int8 matmul,
 * and the AVX-512 kernel table.
 *
 * Sums use one 16-lane accumulator in index order and the tree of cpu__tree16, so
 * results are fixed for a given n. Conversions reproduce model/types.c bit for bit,
 * NaN payloads included (the hardware converters differ there, so NaNs are patched).
 */
#include "backend/cpu/cpu_impl.h"
#include "backend/cpu/reduce_avx512.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

void cpu__avx512_matmul(const cpu__mm *mm, int n0, int n1, void *scratch);
size_t cpu__avx512_matmul_scratch(td_type wtype, int M, int K);

INLINE __mmask16 tail_mask(int n)
{
    return (__mmask16)((1u << n) - 1);
}

/* cpu__tree16 of one vector's lanes. */
INLINE float hsum16(__m512 v)
{
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
}

/* exp(x): Cody-Waite reduction and the Cephes expf polynomial, about 1 ulp. Inputs
 * below -110 give exactly 0 (so masked attention scores vanish). */
INLINE __m512 exp512(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-110.0f)), _mm512_set1_ps(88.72283f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* ---- element conversions ------------------------------------------------------- */

INLINE __m512 f16_to_f32(__m256i h)
{
    __m512 f = _mm512_cvtph_ps(h);
    __m512i h32 = _mm512_cvtepu16_epi32(h);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(h32, _mm512_set1_epi32(0x7fff)),
                                            _mm512_set1_epi32(0x7c00));
    if (__builtin_expect(nan != 0, 0)) {
        /* types.c keeps a signaling NaN's payload as is; the hardware quiets it. */
        __m512i bits = _mm512_or_si512(
            _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h32, _mm512_set1_epi32(0x8000)), 16),
                            _mm512_set1_epi32(0x7f800000)),
            _mm512_slli_epi32(_mm512_and_si512(h32, _mm512_set1_epi32(0x3ff)), 13));
        f = _mm512_mask_mov_ps(f, nan, _mm512_castsi512_ps(bits));
    }
    return f;
}

INLINE __m256i f32_to_f16(__m512 x)
{
    __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    if (__builtin_expect(nan != 0, 0)) {
        __m512i s = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16),
                                                     _mm512_set1_epi32(0x8000)),
                                    _mm512_set1_epi32(0x7e00));
        h = _mm256_mask_mov_epi16(h, nan, _mm512_cvtepi32_epi16(s));
    }
    return h;
}

INLINE __m512 bf16_to_f32(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Integer rounding as in types.c (vcvtneps2bf16 would flush subnormals). */
INLINE __m256i f32_to_bf16(__m512 x)
{
    __m512i b = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(
        b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                            _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan,
                              _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

INLINE __m512 fp8_to_f32(__m128i v8)
{
    __m512i v = _mm512_cvtepu8_epi32(v8);
    __m512i em = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
    __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f));
    __mmask16 is_sub = _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8));
    __m512i r = _mm512_mask_mov_epi32(normal, is_sub, _mm512_castps_si512(sub));
    r = _mm512_or_si512(r, _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24));
    __mmask16 nan = _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

INLINE __m128i f32_to_fp8(__m512 x)
{
    __m512i b = _mm512_castps_si512(x);
    __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
    __m512i ax = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
    __m512i r = _mm512_add_epi32(
        ax, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff),
                             _mm512_and_si512(_mm512_srli_epi32(ax, 20), _mm512_set1_epi32(1))));
    r = _mm512_sub_epi32(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(120 << 3));
    __m512i sub =
        _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(ax), _mm512_set1_ps(512.0f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epi32_mask(ax, _mm512_set1_epi32(0x3c800000)), sub);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epi32_mask(ax, _mm512_set1_epi32(0x43e00000)),
                              _mm512_set1_epi32(0x7e));
    r = _mm512_or_si512(r, sign);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(ax, _mm512_set1_epi32(0x7f800000)),
                              _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(r);
}

/* roundf(): to nearest, halfway cases away from zero. */
INLINE __m512 round_away(__m512 v)
{
    __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m512 frac = _mm512_abs_ps(_mm512_sub_ps(v, t));
    __mmask16 up = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512 one = _mm512_or_ps(_mm512_and_ps(v, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(1.0f));
    return _mm512_mask_add_ps(t, up, t, one);
}

/* One q8_0 block exactly as td_quant_row_ref: q, the fp16 scale, and sum(q). */
INLINE int32_t quant_block(const float *x, int8_t *q, uint16_t *dh)
{
    __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    /* max(|x|, amax) returns amax for a NaN x, as fmaxf does. */
    __m512 amax = _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps());
    amax = _mm512_max_ps(_mm512_abs_ps(b), amax);
    float am = _mm512_reduce_max_ps(amax);
    float d = am / 127.0f;
    float id = d ? 1.0f / d : 0.0f;
    *dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    __m512 vid = _mm512_set1_ps(id);
    __m512i qa = _mm512_cvttps_epi32(round_away(_mm512_mul_ps(a, vid)));
    __m512i qb = _mm512_cvttps_epi32(round_away(_mm512_mul_ps(b, vid)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

/* Sixteen q8_0 blocks at once, exactly as quant_block does each: the scales' division
 * and the reductions run on vectors rather than once per block. */
INLINE void quant_x16(const float *x, int offset, int8_t *xq, float *xd, int32_t *xc)
{
    __m512 am[16];
#pragma GCC unroll 16
    for (int b = 0; b < 16; b++) {
        __m512 a = _mm512_loadu_ps(x + 32 * b), c = _mm512_loadu_ps(x + 32 * b + 16);
        __m512 m = _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps());
        am[b] = _mm512_max_ps(_mm512_abs_ps(c), m);
    }
    __m512 amax = reduce16_op(R16_MAX, am);
    __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
    __mmask16 nz = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    __m512 id = _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0f), d);
    __m256i dh = _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_storeu_ps(xd, _mm512_cvtph_ps(dh));
    float ids[16];
    _mm512_storeu_ps(ids, id);
    __m512 sums[16];
#pragma GCC unroll 16
    for (int b = 0; b < 16; b++) {
        __m512 vid = _mm512_set1_ps(ids[b]);
        __m512i qa =
            _mm512_cvttps_epi32(round_away(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b), vid)));
        __m512i qb =
            _mm512_cvttps_epi32(round_away(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b + 16), vid)));
        _mm_storeu_si128((__m128i *)(xq + 32 * b), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + 32 * b + 16), _mm512_cvtepi32_epi8(qb));
        sums[b] = _mm512_castsi512_ps(_mm512_add_epi32(qa, qb));
    }
    __m512i sum = _mm512_castps_si512(reduce16_op(R16_ADD_I32, sums));
    _mm512_storeu_si512(xc, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-offset)));
}

static void quant_x(const float *x, int K, int offset, int8_t *xq, float *xd, int32_t *xc)
{
    int b = 0;
    for (; b + 16 <= K / 32; b += 16)
        quant_x16(x + b * 32, offset, xq + b * 32, xd + b, xc + b);
    for (; b < K / 32; b++) {
        uint16_t dh;
        int32_t sum = quant_block(x + b * 32, xq + b * 32, &dh);
        xd[b] = _cvtsh_ss(dh);
        xc[b] = -offset * sum;
    }
}

/* ---- row kernels --------------------------------------------------------------- */

static float sum_squares(const float *x, int n)
{
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (i < n) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return hsum16(acc);
}

static void rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    float scale = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    __m512 s = _mm512_set1_ps(scale);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), s),
                                                _mm512_loadu_ps(w + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(out + i, m,
                              _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), s),
                                            _mm512_maskz_loadu_ps(m, w + i)));
    }
}

INLINE __m512 silu_mul16(__m512 g, __m512 u)
{
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

static void silu_mul(float *out, const float *gate, const float *up, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, silu_mul16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(
            out + i, m,
            silu_mul16(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, up + i)));
    }
}

static void add(float *y, const float *x, int n)
{
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_add_ps(_mm512_loadu_ps(y + i), _mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(
            y + i, m,
            _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i), _mm512_maskz_loadu_ps(m, x + i)));
    }
}

static float dot_f32(const float *a, const float *b, int n)
{
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        acc =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return hsum16(acc);
}

static void softmax(float *x, int n)
{
    if (n <= 0) return;
    __m512 vmax = _mm512_set1_ps(-__builtin_inff());
    int i = 0;
    for (; i + 16 <= n; i += 16)
        vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(x + i));
    if (i < n)
        vmax = _mm512_mask_max_ps(vmax, tail_mask(n - i), vmax,
                                  _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
    __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 sum = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mx));
        _mm512_storeu_ps(x + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 e =
            _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mx)));
        _mm512_mask_storeu_ps(x + i, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / hsum16(sum));
    for (i = 0; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
    }
}

/* ---- row conversions ----------------------------------------------------------- */

static bool quant_row(td_type t, const float *src, void *dst, int64_t n)
{
    int64_t i = 0;
    switch (t) {
    case TD_TYPE_F32:
        memcpy(dst, src, (size_t)n * 4);
        return true;
    case TD_TYPE_F16:
    case TD_TYPE_BF16: {
        uint16_t *d = dst;
        for (; i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(src + i);
            _mm256_storeu_si256((__m256i *)(d + i),
                                t == TD_TYPE_F16 ? f32_to_f16(v) : f32_to_bf16(v));
        }
        if (i < n) {
            __mmask16 m = tail_mask((int)(n - i));
            __m512 v = _mm512_maskz_loadu_ps(m, src + i);
            _mm256_mask_storeu_epi16(d + i, m, t == TD_TYPE_F16 ? f32_to_f16(v) : f32_to_bf16(v));
        }
        return true;
    }
    case TD_TYPE_FP8_E4M3: {
        uint8_t *d = dst;
        for (; i + 16 <= n; i += 16)
            _mm_storeu_si128((__m128i *)(d + i), f32_to_fp8(_mm512_loadu_ps(src + i)));
        if (i < n) {
            __mmask16 m = tail_mask((int)(n - i));
            _mm_mask_storeu_epi8(d + i, m, f32_to_fp8(_mm512_maskz_loadu_ps(m, src + i)));
        }
        return true;
    }
    case TD_TYPE_Q8_0: {
        td_block_q8_0 *b = dst;
        for (int64_t k = 0; k < n / TD_QK8_0; k++) {
            uint16_t dh;
            quant_block(src + k * 32, b[k].qs, &dh);
            b[k].d = dh;
        }
        return true;
    }
    default:
        return false;
    }
}

static bool dequant_row(td_type t, const void *src, float *dst, int64_t n)
{
    int64_t i = 0;
    switch (t) {
    case TD_TYPE_F32:
        memcpy(dst, src, (size_t)n * 4);
        return true;
    case TD_TYPE_F16:
    case TD_TYPE_BF16: {
        const uint16_t *s = src;
        for (; i + 16 <= n; i += 16) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
            _mm512_storeu_ps(dst + i, t == TD_TYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h));
        }
        if (i < n) {
            __mmask16 m = tail_mask((int)(n - i));
            __m256i h = _mm256_maskz_loadu_epi16(m, s + i);
            _mm512_mask_storeu_ps(dst + i, m, t == TD_TYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h));
        }
        return true;
    }
    case TD_TYPE_FP8_E4M3: {
        const uint8_t *s = src;
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, fp8_to_f32(_mm_loadu_si128((const __m128i *)(s + i))));
        if (i < n) {
            __mmask16 m = tail_mask((int)(n - i));
            _mm512_mask_storeu_ps(dst + i, m, fp8_to_f32(_mm_maskz_loadu_epi8(m, s + i)));
        }
        return true;
    }
    case TD_TYPE_Q8_0: {
        const td_block_q8_0 *b = src;
        for (int64_t k = 0; k < n / TD_QK8_0; k++) {
            __m512 d = _mm512_set1_ps(_cvtsh_ss(b[k].d));
            __m128i q0 = _mm_loadu_si128((const __m128i *)b[k].qs);
            __m128i q1 = _mm_loadu_si128((const __m128i *)(b[k].qs + 16));
            _mm512_storeu_ps(dst + k * 32,
                             _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0))));
            _mm512_storeu_ps(dst + k * 32 + 16,
                             _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1))));
        }
        return true;
    }
    case TD_TYPE_Q4_0: {
        const td_block_q4_0 *b = src;
        for (int64_t k = 0; k < n / TD_QK4_0; k++) {
            __m512 d = _mm512_set1_ps(_cvtsh_ss(b[k].d));
            __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b[k].qs));
            __m512i lo =
                _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0xf)), _mm512_set1_epi32(8));
            __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), _mm512_set1_epi32(8));
            _mm512_storeu_ps(dst + k * 32, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
            _mm512_storeu_ps(dst + k * 32 + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
        }
        return true;
    }
    default:
        return false;
    }
}

/* ---- attention helpers --------------------------------------------------------- */

/* 16 KV elements from i (full, or zero-masked), widened to f32. NaN payloads do not
 * matter here, so f16 uses the plain hardware conversion. */
INLINE __m512 kv_load(td_type t, const void *p, int i)
{
    switch (t) {
    case TD_TYPE_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    case TD_TYPE_BF16:
        return bf16_to_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    case TD_TYPE_FP8_E4M3:
        return fp8_to_f32(_mm_loadu_si128((const __m128i *)((const uint8_t *)p + i)));
    default:
        return _mm512_loadu_ps((const float *)p + i);
    }
}

INLINE __m512 kv_loadz(td_type t, const void *p, int i, __mmask16 m)
{
    switch (t) {
    case TD_TYPE_F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    case TD_TYPE_BF16:
        return bf16_to_f32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    case TD_TYPE_FP8_E4M3:
        return _mm512_maskz_mov_ps(m, fp8_to_f32(_mm_maskz_loadu_epi8(m, (const uint8_t *)p + i)));
    default:
        return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    }
}

/* Up to 8 keys at a time (dot_kv_multi), each with its own accumulator, summed by hsum16
 * (tree16). */
INLINE void dot_kv_group(float *out, const float *q, const uint8_t *k, size_t stride, td_type t,
                         int n, int count)
{
    __m512 acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 qv = _mm512_loadu_ps(q + i);
        for (int j = 0; j < count; j++)
            acc[j] = _mm512_fmadd_ps(qv, kv_load(t, k + j * stride, i), acc[j]);
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 qv = _mm512_maskz_loadu_ps(m, q + i);
        for (int j = 0; j < count; j++)
            acc[j] = _mm512_fmadd_ps(qv, kv_loadz(t, k + j * stride, i, m), acc[j]);
    }
    for (int j = 0; j < count; j++)
        out[j] = hsum16(acc[j]);
}

static void dot_kv_multi(float *out, const float *q, const void *k, size_t k_stride, td_type t,
                         int n, int count)
{
    const uint8_t *kb = k;
    for (int j = 0; j < count; j += 8) {
        int c = TD_MIN(8, count - j);
        if (c == 8) {
            const uint8_t *kj = kb + j * k_stride;
            CPU__KV_TYPE_SWITCH(t, T, dot_kv_group(out + j, q, kj, k_stride, T, n, 8))
        } else {
            dot_kv_group(out + j, q, kb + j * k_stride, k_stride, t, n, c);
        }
    }
}

/* y[0 .. 16 C) += a[j] * v_j for j in order, with y in C registers throughout. */
INLINE void axpy_fixed(int C, float *y, const float *a, const uint8_t *v, size_t stride, td_type t,
                       int count)
{
    __m512 acc[8];
#pragma GCC unroll 8
    for (int c = 0; c < C; c++)
        acc[c] = _mm512_loadu_ps(y + c * 16);
    for (int j = 0; j < count; j++) {
        const uint8_t *vj = v + j * stride;
        __m512 aj = _mm512_set1_ps(a[j]);
#pragma GCC unroll 8
        for (int c = 0; c < C; c++)
            acc[c] = _mm512_fmadd_ps(aj, kv_load(t, vj, c * 16), acc[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; c++)
        _mm512_storeu_ps(y + c * 16, acc[c]);
}

INLINE void axpy_fixed_t(int C, float *y, const float *a, const uint8_t *v, size_t stride,
                         td_type t, int count)
{
    CPU__KV_TYPE_SWITCH(t, T, axpy_fixed(C, y, a, v, stride, T, count))
}

static void axpy_kv_multi(float *y, const float *a, const void *v, size_t v_stride, td_type t,
                          int n, int count)
{
    const uint8_t *vb = v;
    /* Common head sizes: everything in registers, with the type resolved at compile time. */
    if (n % 16 == 0 && n <= 128) {
        switch (n / 16) {
        case 4:
            axpy_fixed_t(4, y, a, vb, v_stride, t, count);
            return;
        case 8:
            axpy_fixed_t(8, y, a, vb, v_stride, t, count);
            return;
        default:
            break;
        }
    }
    /* 128 elements of y stay in registers across all positions. */
    for (int i0 = 0; i0 < n; i0 += 128) {
        int len = TD_MIN(128, n - i0);
        int full = len / 16, rem = len % 16;
        __m512 acc[8];
        for (int c = 0; c < full; c++)
            acc[c] = _mm512_loadu_ps(y + i0 + c * 16);
        if (rem) acc[full] = _mm512_maskz_loadu_ps(tail_mask(rem), y + i0 + full * 16);
        for (int j = 0; j < count; j++) {
            const uint8_t *vj = vb + j * v_stride;
            __m512 aj = _mm512_set1_ps(a[j]);
            for (int c = 0; c < full; c++)
                acc[c] = _mm512_fmadd_ps(aj, kv_load(t, vj, i0 + c * 16), acc[c]);
            if (rem)
                acc[full] =
                    _mm512_fmadd_ps(aj, kv_loadz(t, vj, i0 + full * 16, tail_mask(rem)), acc[full]);
        }
        for (int c = 0; c < full; c++)
            _mm512_storeu_ps(y + i0 + c * 16, acc[c]);
        if (rem) _mm512_mask_storeu_ps(y + i0 + full * 16, tail_mask(rem), acc[full]);
    }
}

/*
 * Several query rows over the same keys (a prefill chunk's rows share their sequence's KV):
 * tiles of 4 rows x 4 keys, 16 accumulators each built exactly as dot_kv_group builds one
 * (multiply-adds in index order, the tail through the same masked loads) and reduced
 * together by reduce16 (tree16 each), so every score has the bits of a per-row call, while
 * each key vector is loaded (and widened) once for 4 rows instead of once per row. Rows and
 * keys past the ends repeat the last one and are not stored.
 */
INLINE void dot_rows_tile(td_type t, float *out, size_t os, const float *q, size_t qs, int nr,
                          const uint8_t *k, size_t ks, int n, int nk)
{
    const float *qr[4];
    const uint8_t *kr[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        qr[r] = q + (size_t)TD_MIN(r, nr - 1) * qs;
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        kr[j] = k + (size_t)TD_MIN(j, nk - 1) * ks;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int a = 0; a < 16; a++)
        acc[a] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 kv[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            kv[j] = kv_load(t, kr[j], i);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m512 qv = _mm512_loadu_ps(qr[r] + i);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                acc[4 * r + j] = _mm512_fmadd_ps(qv, kv[j], acc[4 * r + j]);
        }
    }
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        __m512 kv[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            kv[j] = kv_loadz(t, kr[j], i, m);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            __m512 qv = _mm512_maskz_loadu_ps(m, qr[r] + i);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++)
                acc[4 * r + j] = _mm512_fmadd_ps(qv, kv[j], acc[4 * r + j]);
        }
    }
    float sums[16] __attribute__((aligned(64)));
    _mm512_store_ps(sums, reduce16(acc));
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < nk; j++)
            out[(size_t)r * os + j] = sums[4 * r + j];
}

static void dot_kv_rows(float *out, size_t out_stride, const float *q, size_t q_stride, int n_rows,
                        const void *k, size_t k_stride, td_type t, int n, int count)
{
    const uint8_t *kb = k;
    for (int r0 = 0; r0 < n_rows; r0 += 4) {
        int nr = TD_MIN(4, n_rows - r0);
        for (int j0 = 0; j0 < count; j0 += 4) {
            float *o = out + (size_t)r0 * out_stride + j0;
            const float *qq = q + (size_t)r0 * q_stride;
            const uint8_t *kk = kb + (size_t)j0 * k_stride;
            int nk = TD_MIN(4, count - j0);
            CPU__KV_TYPE_SWITCH(
                t, T, dot_rows_tile(T, o, out_stride, qq, q_stride, nr, kk, k_stride, n, nk))
        }
    }
}

/*
 * y_r += a[r][j] * v_j for j in order, for up to 4 rows at once: a 64-float slice of each
 * row's y stays in registers (16 vectors) while each v_j slice is loaded (and widened) once
 * for all the rows; per lane the multiply-adds are axpy_kv_multi's, in the same order.
 */
INLINE void axpy_rows_tile(td_type t, float *y, size_t ys, const float *a, size_t as, int nr,
                           const uint8_t *v, size_t vs, int c0, int count)
{
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            acc[r][c] =
                r < nr ? _mm512_loadu_ps(y + (size_t)r * ys + c0 + 16 * c) : _mm512_setzero_ps();
    for (int j = 0; j < count; j++) {
        const uint8_t *vj = v + (size_t)j * vs;
        __m512 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            vv[c] = kv_load(t, vj, c0 + 16 * c);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            if (r >= nr) break;
            __m512 aj = _mm512_set1_ps(a[(size_t)r * as + j]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_fmadd_ps(aj, vv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
        if (r < nr)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(y + (size_t)r * ys + c0 + 16 * c, acc[r][c]);
}

static void axpy_kv_rows(float *y, size_t y_stride, const float *a, size_t a_stride, int n_rows,
                         const void *v, size_t v_stride, td_type t, int n, int count)
{
    if (n % 64) { /* head sizes other than multiples of 64: one row at a time */
        for (int r = 0; r < n_rows; r++)
            axpy_kv_multi(y + (size_t)r * y_stride, a + (size_t)r * a_stride, v, v_stride, t, n,
                          count);
        return;
    }
    for (int r0 = 0; r0 < n_rows; r0 += 4) {
        int nr = TD_MIN(4, n_rows - r0);
        float *yy = y + (size_t)r0 * y_stride;
        const float *aa = a + (size_t)r0 * a_stride;
        for (int c0 = 0; c0 < n; c0 += 64)
            CPU__KV_TYPE_SWITCH(
                t, T, axpy_rows_tile(T, yy, y_stride, aa, a_stride, nr, v, v_stride, c0, count))
    }
}

/* One position and one head: the arithmetic of dot_kv_group with count 1. */
INLINE float dot_kv1(td_type t, const float *q, const uint8_t *k, int n)
{
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), kv_load(t, k, i), acc);
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), kv_loadz(t, k, i, m), acc);
    }
    return hsum16(acc);
}

/* y += a * v for one position and one head, lane by lane as axpy_kv_multi does. */
INLINE void axpy_kv1(td_type t, float *y, float a, const uint8_t *v, int n)
{
    __m512 av = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, kv_load(t, v, i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(
            y + i, m, _mm512_fmadd_ps(av, kv_loadz(t, v, i, m), _mm512_maskz_loadu_ps(m, y + i)));
    }
}

CPU__KV_HEADS_KERNELS(dot_kv1, axpy_kv1)

const cpu__kernels cpu__avx512 = {
    .name = "avx512",
    .matmul = cpu__avx512_matmul,
    .matmul_scratch = cpu__avx512_matmul_scratch,
    .quant_x = quant_x,
    .rmsnorm = rmsnorm,
    .silu_mul = silu_mul,
    .add = add,
    .dot_f32 = dot_f32,
    .softmax = softmax,
    .quant_row = quant_row,
    .dequant_row = dequant_row,
    .dot_kv_multi = dot_kv_multi,
    .axpy_kv_multi = axpy_kv_multi,
    .dot_kv_rows = dot_kv_rows,
    .axpy_kv_rows = axpy_kv_rows,
    .dot_kv_heads = dot_kv_heads,
    .axpy_kv_heads = axpy_kv_heads,
};
