/* model/types.c - type traits and exact scalar conversions (the reference for SIMD code). */
#include "model/types.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

bool td_type_supported(td_type t)
{
    switch (t) {
    case TD_TYPE_F32: case TD_TYPE_F16: case TD_TYPE_BF16: case TD_TYPE_Q8_0: case TD_TYPE_Q4_0:
    case TD_TYPE_FP8_E4M3:
        return true;
    default:
        return false;
    }
}

const char *td_type_name(td_type t)
{
    switch (t) {
    case TD_TYPE_F32: return "f32";
    case TD_TYPE_F16: return "f16";
    case TD_TYPE_BF16: return "bf16";
    case TD_TYPE_Q8_0: return "q8_0";
    case TD_TYPE_Q4_0: return "q4_0";
    case TD_TYPE_FP8_E4M3: return "fp8_e4m3";
    default: return "unknown";
    }
}

td_type td_type_parse(const char *name)
{
    static const struct { const char *name; td_type t; } names[] = {
        {"f32", TD_TYPE_F32},   {"float32", TD_TYPE_F32}, {"f16", TD_TYPE_F16},
        {"float16", TD_TYPE_F16}, {"half", TD_TYPE_F16},  {"bf16", TD_TYPE_BF16},
        {"bfloat16", TD_TYPE_BF16}, {"q8_0", TD_TYPE_Q8_0}, {"q4_0", TD_TYPE_Q4_0},
        {"fp8_e4m3", TD_TYPE_FP8_E4M3}, {"fp8", TD_TYPE_FP8_E4M3},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcmp(names[i].name, name) == 0) return names[i].t;
    return TD_TYPE_INVALID;
}

int td_type_block_elems(td_type t)
{
    switch (t) {
    case TD_TYPE_Q8_0: return TD_QK8_0;
    case TD_TYPE_Q4_0: return TD_QK4_0;
    default: return td_type_supported(t) ? 1 : 0;
    }
}

int td_type_block_bytes(td_type t)
{
    switch (t) {
    case TD_TYPE_F32: return 4;
    case TD_TYPE_F16: case TD_TYPE_BF16: return 2;
    case TD_TYPE_FP8_E4M3: return 1;
    case TD_TYPE_Q8_0: return (int)sizeof(td_block_q8_0);
    case TD_TYPE_Q4_0: return (int)sizeof(td_block_q4_0);
    default: return 0;
    }
}

size_t td_row_bytes(td_type t, int64_t n)
{
    int be = td_type_block_elems(t);
    if (be <= 0 || n < 0 || n % be) return 0;
    return (size_t)(n / be) * (size_t)td_type_block_bytes(t);
}

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

float td_fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 */
        float v = (float)mant * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t td_f32_to_fp16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or nan */
        return sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0);
    if (ax >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return sign | 0x7c00;
    if (ax < 0x38800000u) {
        /* result is subnormal (or zero): value / 2^-24, rounded to nearest even */
        float v = bits_f32(ax) * 16777216.0f;
        float r = nearbyintf(v); /* default rounding mode: nearest even */
        return sign | (uint16_t)r;
    }
    uint32_t mant = ax & 0x7fffff;
    uint32_t exp = (ax >> 23) - 112;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
}

float td_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t td_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet nan */
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

/* fp8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities; 0x7f/0xff are NaN;
 * largest finite 448. */
float td_fp8e4m3_to_f32(uint8_t v)
{
    uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, mant = v & 7;
    float r;
    if (exp == 0xf && mant == 7) return NAN;
    if (exp == 0)
        r = ldexpf((float)mant, -9); /* subnormal: mant/8 * 2^-6 */
    else
        r = ldexpf(1.0f + (float)mant / 8.0f, (int)exp - 7);
    return sign ? -r : r;
}

uint8_t td_f32_to_fp8e4m3(float f)
{
    uint8_t sign = signbit(f) ? 0x80 : 0;
    if (isnan(f)) return 0x7f;
    float a = fabsf(f);
    if (a >= 448.0f) return sign | 0x7e; /* saturate */
    if (a < ldexpf(1.0f, -6)) {
        /* subnormal range: multiples of 2^-9 */
        float q = nearbyintf(a * 512.0f);
        return sign | (uint8_t)q; /* q <= 8 ; 8 means the smallest normal, which encodes as 0x08 */
    }
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int exp = e - 1 + 7;     /* a = (2m) * 2^(e-1) */
    float mant = nearbyintf((2.0f * m - 1.0f) * 8.0f);
    if (mant >= 8.0f) {
        mant = 0;
        exp++;
    }
    if (exp > 15 || (exp == 15 && mant > 6)) return sign | 0x7e;
    return sign | (uint8_t)((exp << 3) | (int)mant);
}

void td_dequant_row_ref(td_type t, const void *src, float *dst, int64_t n)
{
    switch (t) {
    case TD_TYPE_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case TD_TYPE_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = td_fp16_to_f32(s[i]);
        break;
    }
    case TD_TYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = td_bf16_to_f32(s[i]);
        break;
    }
    case TD_TYPE_FP8_E4M3: {
        const uint8_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = td_fp8e4m3_to_f32(s[i]);
        break;
    }
    case TD_TYPE_Q8_0: {
        const td_block_q8_0 *b = src;
        for (int64_t i = 0; i < n / TD_QK8_0; i++) {
            float d = td_fp16_to_f32(b[i].d);
            for (int j = 0; j < TD_QK8_0; j++) dst[i * TD_QK8_0 + j] = d * (float)b[i].qs[j];
        }
        break;
    }
    case TD_TYPE_Q4_0: {
        const td_block_q4_0 *b = src;
        for (int64_t i = 0; i < n / TD_QK4_0; i++) {
            float d = td_fp16_to_f32(b[i].d);
            for (int j = 0; j < TD_QK4_0 / 2; j++) {
                dst[i * TD_QK4_0 + j] = d * (float)((b[i].qs[j] & 0xf) - 8);
                dst[i * TD_QK4_0 + j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
            }
        }
        break;
    }
    default:
        break;
    }
}

void td_quant_row_ref(td_type t, const float *src, void *dst, int64_t n)
{
    switch (t) {
    case TD_TYPE_F32:
        memcpy(dst, src, (size_t)n * 4);
        break;
    case TD_TYPE_F16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = td_f32_to_fp16(src[i]);
        break;
    }
    case TD_TYPE_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = td_f32_to_bf16(src[i]);
        break;
    }
    case TD_TYPE_FP8_E4M3: {
        uint8_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = td_f32_to_fp8e4m3(src[i]);
        break;
    }
    case TD_TYPE_Q8_0: {
        td_block_q8_0 *b = dst;
        for (int64_t i = 0; i < n / TD_QK8_0; i++) {
            const float *x = src + i * TD_QK8_0;
            float amax = 0;
            for (int j = 0; j < TD_QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
            float d = amax / 127.0f;
            float id = d ? 1.0f / d : 0.0f;
            b[i].d = td_f32_to_fp16(d);
            for (int j = 0; j < TD_QK8_0; j++) b[i].qs[j] = (int8_t)roundf(x[j] * id);
        }
        break;
    }
    case TD_TYPE_Q4_0: {
        td_block_q4_0 *b = dst;
        for (int64_t i = 0; i < n / TD_QK4_0; i++) {
            const float *x = src + i * TD_QK4_0;
            float amax = 0, max = 0;
            for (int j = 0; j < TD_QK4_0; j++)
                if (fabsf(x[j]) > amax) {
                    amax = fabsf(x[j]);
                    max = x[j];
                }
            float d = max / -8.0f;
            float id = d ? 1.0f / d : 0.0f;
            b[i].d = td_f32_to_fp16(d);
            for (int j = 0; j < TD_QK4_0 / 2; j++) {
                int q0 = (int)fminf(15.0f, x[j] * id + 8.5f);
                int q1 = (int)fminf(15.0f, x[j + 16] * id + 8.5f);
                b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
        break;
    }
    default:
        break;
    }
}
