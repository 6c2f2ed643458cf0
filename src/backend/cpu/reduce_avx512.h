/*
 * backend/cpu/reduce_avx512.h - reduce16 (sixteen vectors to one vector of their
 * reductions), shared by the AVX-512 kernel files (included only by files compiled for
 * AVX-512).
 */
#ifndef TD_BACKEND_CPU_REDUCE_AVX512_H
#define TD_BACKEND_CPU_REDUCE_AVX512_H

#include <immintrin.h>

/* What reduce16_op reduces with: float add, float max, or int32 add (on vectors cast to
 * __m512, shuffled as bits). */
enum { R16_ADD, R16_MAX, R16_ADD_I32 };

static inline __attribute__((always_inline)) __m512 r16_op(int op, __m512 a, __m512 b)
{
    if (op == R16_MAX) return _mm512_max_ps(a, b);
    if (op == R16_ADD_I32)
        return _mm512_castsi512_ps(
            _mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    return _mm512_add_ps(a, b);
}

/*
 * out lane j = tree16(v[j]) with tree16 as in cpu_impl.h: a[i] op a[i+8], then + 4,
 * + 2, + 1. Each step combines lanes of one source only, so which other vectors share
 * the reduction (or are zero padding) cannot change a result.
 */
static inline __attribute__((always_inline)) __m512 reduce16_op(int op, const __m512 *v)
{
    __m512 s[16], c[8], g[4], h[2];
    /* Slot i takes source 4 * (i % 4) + i / 4, so that the result comes out in order. */
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        s[i] = v[4 * (i & 3) + (i >> 2)];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        c[i] = r16_op(op, _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44),
                      _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xee));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        g[i] = r16_op(op, _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                      _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        h[i] = r16_op(op, _mm512_shuffle_ps(g[2 * i], g[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(g[2 * i], g[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return r16_op(op, _mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(2, 0, 2, 0)),
                  _mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Sixteen float sums at once (reduce16_op with R16_ADD). */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512 *v)
{
    return reduce16_op(R16_ADD, v);
}

#endif
