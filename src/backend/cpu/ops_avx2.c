/*
 * backend/cpu/ops_avx2.c - AVX2 row kernels, the activation quantizer and the AVX2
 * kernel table. Sums use one 8-lane accumulator in index order and cpu__tree8.
 * Conversions match model/types.c bit for bit (fp8 goes through the exact table).
 */
#include "backend/cpu/cpu_impl.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

void cpu__avx2_matmul(const cpu__mm *mm, int n0, int n1, void *scratch);
size_t cpu__avx2_matmul_scratch(td_type wtype, int M, int K);

INLINE __m256i tail_mask8(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INLINE float hsum8(__m256 v)
{
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

/* exp as in ops_avx512.c; 2^n is built in the exponent field, so results below
 * 2^-126 are flushed to 0 here. */
INLINE __m256 exp256(__m256 x)
{
    __m256 zero_mask = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33f)), _mm256_set1_ps(88.72283f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* n in [-126, 128]: split 2^n = 2^(n/2) * 2^(n - n/2) so that 128 does not overflow. */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 s2 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(_mm256_mul_ps(p, s1), s2));
}

INLINE __m256 f16_to_f32(__m128i h)
{
    __m256 f = _mm256_cvtph_ps(h);
    __m256i h32 = _mm256_cvtepu16_epi32(h);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x7fff)),
                                     _mm256_set1_epi32(0x7c00));
    if (__builtin_expect(!_mm256_testz_si256(nan, nan), 0)) {
        __m256i bits = _mm256_or_si256(
            _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x8000)), 16),
                            _mm256_set1_epi32(0x7f800000)),
            _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x3ff)), 13));
        f = _mm256_blendv_ps(f, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(nan));
    }
    return f;
}

/* 8 u32 lanes (each < 65536) to 8 u16. */
INLINE __m128i pack_u16(__m256i v)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

INLINE __m128i f32_to_f16(__m256 x)
{
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (__builtin_expect(!_mm256_testz_ps(nan, nan), 0)) {
        __m256i s = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16),
                                                     _mm256_set1_epi32(0x8000)),
                                    _mm256_set1_epi32(0x7e00));
        __m128i n16 = pack_u16(_mm256_srli_epi32(_mm256_castps_si256(nan), 16));
        h = _mm_blendv_epi8(h, pack_u16(s), n16);
    }
    return h;
}

INLINE __m256 bf16_to_f32(__m128i h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE __m128i f32_to_bf16(__m256 x)
{
    __m256i b = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(
        b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                            _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)),
                           nan);
    return pack_u16(r);
}

INLINE __m256 fp8_to_f32(const uint8_t *p)
{
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_i32gather_ps(cpu__fp8_table, _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v)), 4);
}

INLINE __m256 round_away(__m256 v)
{
    __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 frac = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_sub_ps(v, t));
    __m256 up = _mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 one = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
    return _mm256_add_ps(t, _mm256_and_ps(up, one));
}

INLINE __m128i pack_i8(__m256i a, __m256i b)
{
    /* 16 int32 in [-127, 127] to 16 int8, in order. */
    __m256i w = _mm256_packs_epi32(a, b);                     /* a0-3 b0-3 | a4-7 b4-7 */
    w = _mm256_permute4x64_epi64(w, _MM_SHUFFLE(3, 1, 2, 0)); /* a0-7 b0-7 */
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

INLINE int32_t quant_block(const float *x, int8_t *q, uint16_t *dh)
{
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]), amax);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    float d = _mm_cvtss_f32(m) / 127.0f;
    float id = d ? 1.0f / d : 0.0f;
    *dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    __m256 vid = _mm256_set1_ps(id);
    __m256i qi[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        qi[i] = _mm256_cvttps_epi32(round_away(_mm256_mul_ps(v[i], vid)));
        sum = _mm256_add_epi32(sum, qi[i]);
    }
    _mm_storeu_si128((__m128i *)q, pack_i8(qi[0], qi[1]));
    _mm_storeu_si128((__m128i *)(q + 16), pack_i8(qi[2], qi[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static void quant_x(const float *x, int K, int offset, int8_t *xq, float *xd, int32_t *xc)
{
    for (int b = 0; b < K / 32; b++) {
        uint16_t dh;
        int32_t sum = quant_block(x + b * 32, xq + b * 32, &dh);
        xd[b] = _cvtsh_ss(dh);
        xc[b] = -offset * sum;
    }
}

/* ---- row kernels ---------------------------------------------------------------- */

static float dot_f32(const float *a, const float *b, int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    if (i < n) {
        __m256i m = tail_mask8(n - i);
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), acc);
    }
    return hsum8(acc);
}

static void rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    float scale = 1.0f / sqrtf(dot_f32(x, x, n) / (float)n + eps);
    __m256 s = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s),
                                                _mm256_loadu_ps(w + i)));
    for (; i < n; i++)
        out[i] = x[i] * scale * w[i];
}

INLINE __m256 silu_mul8(__m256 g, __m256 u)
{
    __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

static void silu_mul(float *out, const float *gate, const float *up, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0}, u[8] = {0}, o[8];
        memcpy(g, gate + i, sizeof(float) * (size_t)(n - i));
        memcpy(u, up + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(o, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        memcpy(out + i, o, sizeof(float) * (size_t)(n - i));
    }
}

static void add(float *y, const float *x, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (; i < n; i++)
        y[i] += x[i];
}

static void softmax(float *x, int n)
{
    if (n <= 0) return;
    float mx = x[0];
    for (int i = 1; i < n; i++)
        mx = fmaxf(mx, x[i]);
    __m256 vmx = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmx));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (i < n) {
        float t[8] = {0};
        for (int j = 0; j < n - i; j++)
            t[j] = x[i + j] - mx;
        __m256 e =
            _mm256_and_ps(exp256(_mm256_loadu_ps(t)), _mm256_castsi256_ps(tail_mask8(n - i)));
        _mm256_storeu_ps(t, e);
        memcpy(x + i, t, sizeof(float) * (size_t)(n - i));
        sum = _mm256_add_ps(sum, e);
    }
    __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    float s = _mm256_cvtss_f32(inv);
    for (; i < n; i++)
        x[i] *= s;
}

static bool quant_row(td_type t, const float *src, void *dst, int64_t n)
{
    int64_t i = 0;
    switch (t) {
    case TD_TYPE_F16:
    case TD_TYPE_BF16: {
        uint16_t *d = dst;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(src + i);
            _mm_storeu_si128((__m128i *)(d + i), t == TD_TYPE_F16 ? f32_to_f16(v) : f32_to_bf16(v));
        }
        for (; i < n; i++)
            d[i] = t == TD_TYPE_F16 ? td_f32_to_fp16(src[i]) : td_f32_to_bf16(src[i]);
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
    case TD_TYPE_F16:
    case TD_TYPE_BF16: {
        const uint16_t *s = src;
        for (; i + 8 <= n; i += 8) {
            __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
            _mm256_storeu_ps(dst + i, t == TD_TYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h));
        }
        for (; i < n; i++)
            dst[i] = t == TD_TYPE_F16 ? td_fp16_to_f32(s[i]) : td_bf16_to_f32(s[i]);
        return true;
    }
    case TD_TYPE_FP8_E4M3: {
        const uint8_t *s = src;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, fp8_to_f32(s + i));
        for (; i < n; i++)
            dst[i] = cpu__fp8_table[s[i]];
        return true;
    }
    default:
        return false;
    }
}

/* ---- attention helpers ---------------------------------------------------------- */

INLINE __m256 kv_load(td_type t, const void *p, int i)
{
    switch (t) {
    case TD_TYPE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    case TD_TYPE_BF16:
        return bf16_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    case TD_TYPE_FP8_E4M3:
        return fp8_to_f32((const uint8_t *)p + i);
    default:
        return _mm256_loadu_ps((const float *)p + i);
    }
}

/* Elements i .. i + len - 1 (len < 8), zeros after. */
INLINE __m256 kv_loadz(td_type t, const void *p, int i, int len)
{
    float tmp[8] = {0};
    for (int j = 0; j < len; j++) {
        switch (t) {
        case TD_TYPE_F16:
            tmp[j] = td_fp16_to_f32(((const uint16_t *)p)[i + j]);
            break;
        case TD_TYPE_BF16:
            tmp[j] = td_bf16_to_f32(((const uint16_t *)p)[i + j]);
            break;
        case TD_TYPE_FP8_E4M3:
            tmp[j] = cpu__fp8_table[((const uint8_t *)p)[i + j]];
            break;
        default:
            tmp[j] = ((const float *)p)[i + j];
            break;
        }
    }
    return _mm256_loadu_ps(tmp);
}

INLINE float dot_kv1(td_type t, const float *q, const uint8_t *k, int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load(t, k, i), acc);
    if (i < n)
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(q + i, tail_mask8(n - i)),
                              kv_loadz(t, k, i, n - i), acc);
    return hsum8(acc);
}

INLINE void axpy_kv1(td_type t, float *y, float a, const uint8_t *v, int n)
{
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, kv_load(t, v, i), _mm256_loadu_ps(y + i)));
    if (i < n) {
        float tmp[8] = {0}, o[8];
        memcpy(tmp, y + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(o, _mm256_fmadd_ps(av, kv_loadz(t, v, i, n - i), _mm256_loadu_ps(tmp)));
        memcpy(y + i, o, sizeof(float) * (size_t)(n - i));
    }
}

static void dot_kv_multi(float *out, const float *q, const void *k, size_t k_stride, td_type t,
                         int n, int count)
{
    const uint8_t *kb = k;
    for (int j = 0; j < count; j++)
        out[j] = dot_kv1(t, q, kb + j * k_stride, n);
}

static void axpy_kv_multi(float *y, const float *a, const void *v, size_t v_stride, td_type t,
                          int n, int count)
{
    const uint8_t *vb = v;
    for (int j = 0; j < count; j++)
        axpy_kv1(t, y, a[j], vb + j * v_stride, n);
}

CPU__KV_HEADS_KERNELS(dot_kv1, axpy_kv1)

const cpu__kernels cpu__avx2 = {
    .name = "avx2",
    .matmul = cpu__avx2_matmul,
    .matmul_scratch = cpu__avx2_matmul_scratch,
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
    .dot_kv_heads = dot_kv_heads,
    .axpy_kv_heads = axpy_kv_heads,
};
