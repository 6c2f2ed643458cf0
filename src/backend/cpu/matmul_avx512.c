/*
 * backend/cpu/matmul_avx512.c - cpu_matmul for AVX-512 (F, BW, VL, DQ, VNNI).
 *
 * Float weights (f32, f16, bf16): dot-product layout. Each output (m, n) owns one
 * zmm accumulator over k (lane l takes k = l mod 16, fused multiply-add in k order,
 * the K tail through zero-masked loads), reduced at the end by reduce16, which
 * applies the fixed tree cpu__tree16 to 16 accumulators at once. A register tile
 * is MR x-rows by NR w-rows; GEMV uses 1 x 16 straight from the weight rows; larger
 * M widens a panel of NR weight rows to f32 once (exact) into an aligned buffer and
 * runs MR x NR tiles over a block of x rows that stays in L2. Both are the same
 * per-element arithmetic, so any M, tile position or thread split gives equal bits.
 *
 * Quantized weights (q8_0, q4_0): x rows are quantized to q8_0 by cpu.c. The block
 * dot products are exact integers (vpdpbusd with the weight as the unsigned operand:
 * q8_0 as q + 128, q4_0 nibbles as they are, corrected by -offset * sum(q_x)), and
 * each output accumulates fma((float)S_b, dx_b * dw_b, acc) in block order.
 *   - small M: per 16 weight rows and 2 blocks, one vpdpbusd per row on the native
 *     layout, then a transposing integer reduction to one vector of 16 rows.
 *   - large M: a panel of 32 weight rows is repacked so that lane j of a zmm holds
 *     4 consecutive k of row j (u8); x is broadcast 4 bytes at a time, and 8 vpdpbusd
 *     give a whole block for 16 rows without any horizontal reduction.
 */
#include "backend/cpu/cpu_impl.h"

#include <immintrin.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* ---- the fixed reduction tree, 16 accumulators at a time ------------------------ */

/*
 * out lane j = tree16(v[j]) with tree16 as in cpu_impl.h: a[i] + a[i+8], then + 4,
 * + 2, + 1. Each step adds lanes of one source only, so which other vectors share
 * the reduction (or are zero padding) cannot change a result.
 */
INLINE __m512 reduce16(const __m512 *v)
{
    __m512 s[16], c[8], g[4], h[2];
    /* Slot i takes source 4 * (i % 4) + i / 4, so that the result comes out in order. */
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) s[i] = v[4 * (i & 3) + (i >> 2)];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xee));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        g[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        h[i] = _mm512_add_ps(_mm512_shuffle_ps(g[2 * i], g[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(g[2 * i], g[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* ---- float weights ------------------------------------------------------------- */

enum { WK_F32, WK_F16, WK_BF16 };

INLINE __m512 wload(int kind, const void *p, int k)
{
    if (kind == WK_F32) return _mm512_loadu_ps((const float *)p + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k));
    if (kind == WK_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE __m512 wloadz(int kind, const void *p, int k, __mmask16 mask)
{
    if (kind == WK_F32) return _mm512_maskz_loadu_ps(mask, (const float *)p + k);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + k);
    if (kind == WK_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define FT_MAXM 6
#define FT_MAXN 16

/*
 * One register tile: out[m * NR + n] = dot(x row m, w row n) for m < MR, n < NR.
 * MR, NR and kind are compile-time constants at every call site.
 */
INLINE void ftile_pf(int MR, int NR, int kind, const float *const *xr, const void *const *wr, int K,
                     float *out, const uint8_t *const *pf)
{
    __m512 acc[FT_MAXM][FT_MAXN];
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 16
        for (int n = 0; n < NR; n++) acc[m][n] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[FT_MAXM];
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) xv[m] = _mm512_loadu_ps(xr[m] + k);
#pragma GCC unroll 16
        for (int n = 0; n < NR; n++) {
            __m512 wv = wload(kind, wr[n], k);
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++) acc[m][n] = _mm512_fmadd_ps(xv[m], wv, acc[m][n]);
            /* One line of the next rows per step (f16/bf16 steps are half a line). */
            if (pf) _mm_prefetch((const char *)pf[n] + (size_t)k * (kind == WK_F32 ? 4 : 2), _MM_HINT_T0);
        }
    }
    if (k < K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[FT_MAXM];
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) xv[m] = _mm512_maskz_loadu_ps(mask, xr[m] + k);
#pragma GCC unroll 16
        for (int n = 0; n < NR; n++) {
            __m512 wv = wloadz(kind, wr[n], k, mask);
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++) acc[m][n] = _mm512_fmadd_ps(xv[m], wv, acc[m][n]);
        }
    }
    const int total = MR * NR;
#pragma GCC unroll 2
    for (int base = 0; base < total; base += 16) {
        __m512 grp[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            grp[i] = base + i < total ? acc[(base + i) / NR][(base + i) % NR] : _mm512_setzero_ps();
        _mm512_storeu_ps(out + base, reduce16(grp));
    }
}

INLINE void ftile(int MR, int NR, int kind, const float *const *xr, const void *const *wr, int K,
                  float *out)
{
    ftile_pf(MR, NR, kind, xr, wr, K, out, NULL);
}

/* Copy an mr x nr corner of a tile's outputs (row stride NR) into y. */
static void store_tile(float *y, int64_t ldy, const float *out, int NR, int mr, int nr)
{
    for (int m = 0; m < mr; m++) memcpy(y + m * ldy, out + m * NR, sizeof(float) * (size_t)nr);
}

#define FDIRECT_MAXM 3

/* Small M: tiles straight from the weight rows, widening each load. */
INLINE void fdirect(const cpu__mm *mm, int kind, int n0, int n1)
{
    const int K = mm->K;
    float out[32] __attribute__((aligned(64)));
    for (int m = 0; m < mm->M;) {
        int mr = TD_MIN(mm->M - m, FDIRECT_MAXM);
        const float *xr[FDIRECT_MAXM];
        for (int i = 0; i < mr; i++) xr[i] = mm->x + (m + i) * mm->ldx;
        int NR = mr == 1 ? 16 : mr == 2 ? 8 : 5;
        for (int n = n0; n < n1; n += NR) {
            const void *wr[16];
            const uint8_t *pf[16];
            int nr = TD_MIN(NR, n1 - n);
            for (int j = 0; j < NR; j++) {
                wr[j] = mm->w + (size_t)(n + TD_MIN(j, nr - 1)) * mm->w_row_bytes;
                pf[j] = mm->w + (size_t)TD_MIN(n + NR + j, n1 - 1) * mm->w_row_bytes;
            }
            if (mr == 1) {
                /* GEMV streams the weights: fetch the next group's rows while this one runs. */
                ftile_pf(1, 16, kind, xr, wr, K, out, pf);
            } else if (mr == 2) {
                ftile(2, 8, kind, xr, wr, K, out);
            } else {
                ftile(3, 5, kind, xr, wr, K, out);
            }
            store_tile(mm->y + m * mm->ldy + n, mm->ldy, out, NR, mr, nr);
        }
        m += mr;
    }
}

#define FP_MR 4
#define FP_NR 6

/* Widen rows [n, n + nr) to f32 in an aligned panel of FP_NR rows of Kp floats. */
INLINE void fpack(int kind, const cpu__mm *mm, int n, int nr, float *panel, int Kp)
{
    const int K = mm->K;
    for (int j = 0; j < FP_NR; j++) {
        float *dst = panel + (size_t)j * Kp;
        if (j >= nr) {
            memset(dst, 0, sizeof(float) * (size_t)Kp);
            continue;
        }
        const uint8_t *src = mm->w + (size_t)(n + j) * mm->w_row_bytes;
        int k = 0;
        for (; k + 16 <= K; k += 16) _mm512_store_ps(dst + k, wload(kind, src, k));
        if (k < K) _mm512_store_ps(dst + k, wloadz(kind, src, k, (__mmask16)((1u << (K - k)) - 1)));
    }
}

INLINE void fpacked(const cpu__mm *mm, int kind, int n0, int n1, float *panel)
{
    const int K = mm->K, M = mm->M, Kp = TD_ALIGN_UP(K, 16);
    /* Rows of x per block: as many as fit in ~384 KiB of L2, a multiple of FP_MR. */
    int mb_rows = (int)TD_MAX((size_t)FP_MR, (384u << 10) / ((size_t)K * 4) / FP_MR * FP_MR);
    float out[TD_ALIGN_UP(FP_MR * FP_NR, 16)] __attribute__((aligned(64)));
    const void *wr[FP_NR];
    for (int j = 0; j < FP_NR; j++) wr[j] = panel + (size_t)j * Kp;
    for (int mb = 0; mb < M; mb += mb_rows) {
        int me = TD_MIN(M, mb + mb_rows);
        for (int n = n0; n < n1; n += FP_NR) {
            int nr = TD_MIN(FP_NR, n1 - n);
            fpack(kind, mm, n, nr, panel, Kp);
            for (int m = mb; m < me; m += FP_MR) {
                int mr = TD_MIN(FP_MR, me - m);
                const float *xr[FP_MR];
                for (int i = 0; i < FP_MR; i++) xr[i] = mm->x + (m + TD_MIN(i, mr - 1)) * mm->ldx;
                switch (mr) {
                case 4: ftile(4, FP_NR, WK_F32, xr, wr, K, out); break;
                case 3: ftile(3, FP_NR, WK_F32, xr, wr, K, out); break;
                case 2: ftile(2, FP_NR, WK_F32, xr, wr, K, out); break;
                default: ftile(1, FP_NR, WK_F32, xr, wr, K, out); break;
                }
                store_tile(mm->y + m * mm->ldy + n, mm->ldy, out, FP_NR, mr, nr);
            }
        }
    }
}

/* From this M on, widening a panel once beats widening each load per x row. */
#define FPACK_MIN_M 4

static void matmul_f32(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < FPACK_MIN_M)
        fdirect(mm, WK_F32, n0, n1);
    else
        fpacked(mm, WK_F32, n0, n1, scratch);
}

static void matmul_f16(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < FPACK_MIN_M)
        fdirect(mm, WK_F16, n0, n1);
    else
        fpacked(mm, WK_F16, n0, n1, scratch);
}

static void matmul_bf16(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < FPACK_MIN_M)
        fdirect(mm, WK_BF16, n0, n1);
    else
        fpacked(mm, WK_BF16, n0, n1, scratch);
}

/* ---- quantized weights: small M ------------------------------------------------ */

/* The 32 weights of block b of a row as unsigned bytes (q8_0: q + 128; q4_0: nibbles). */
INLINE __m256i qw_block(td_type t, const uint8_t *row, int b)
{
    if (t == TD_TYPE_Q8_0) {
        const uint8_t *p = row + (size_t)b * sizeof(td_block_q8_0) + 2;
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8(-128));
    }
    const uint8_t *p = row + (size_t)b * sizeof(td_block_q4_0) + 2;
    __m128i v = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

INLINE __m512i qw_pair(td_type t, const uint8_t *row, int b)
{
    if (t == TD_TYPE_Q8_0) {
        const uint8_t *p = row + (size_t)b * sizeof(td_block_q8_0) + 2;
        __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
            _mm256_loadu_si256((const __m256i *)(p + sizeof(td_block_q8_0))), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8(-128));
    }
    const uint8_t *p = row + (size_t)b * sizeof(td_block_q4_0) + 2;
    __m256i v = _mm256_loadu2_m128i((const __m128i *)(p + sizeof(td_block_q4_0)),
                                    (const __m128i *)p);
    __m256i m4 = _mm256_set1_epi8(0x0f);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
    /* [b lo, b+1 lo, b hi, b+1 hi] -> [b lo, b hi, b+1 lo, b+1 hi] */
    return _mm512_shuffle_i32x4(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

/*
 * r[j] holds, for weight row j, 8 partial sums of block b (lanes 0-7) and of block
 * b + 1 (lanes 8-15). Returns the block totals for the 16 rows: *v0 for b, *v1 for b + 1.
 */
INLINE void reduce_q16(const __m512i *r, __m512i *v0, __m512i *v1)
{
    __m512i c[8], d[4], e[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(r[2 * i], r[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(r[2 * i], r[2 * i + 1], 0xdd));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        d[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(c[2 * i], c[2 * i + 1]),
                                _mm512_unpackhi_epi32(c[2 * i], c[2 * i + 1]));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(d[2 * i], d[2 * i + 1]),
                                _mm512_unpackhi_epi64(d[2 * i], d[2 * i + 1]));
    /* e[i] lane 4q + t = item q of c[4i + t]; c's items: row 2c b, row 2c b+1, row 2c+1 b,
     * row 2c+1 b+1. */
    const __m512i idx0 = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27);
    const __m512i idx1 = _mm512_setr_epi32(4, 12, 5, 13, 6, 14, 7, 15, 20, 28, 21, 29, 22, 30, 23, 31);
    *v0 = _mm512_permutex2var_epi32(e[0], idx0, e[1]);
    *v1 = _mm512_permutex2var_epi32(e[0], idx1, e[1]);
}

/* The f32 values of the fp16 scales of block b of 16 rows (row offsets in vidx). */
INLINE __m512 q_scales(const uint8_t *row0, __m512i vidx, size_t block_bytes, int b)
{
    __m512i g = _mm512_i32gather_epi32(vidx, row0 + (size_t)b * block_bytes, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

INLINE void qdirect(const cpu__mm *mm, td_type t, int n0, int n1)
{
    const int K = mm->K, nb = K / 32;
    const size_t bb = t == TD_TYPE_Q8_0 ? sizeof(td_block_q8_0) : sizeof(td_block_q4_0);
    const size_t rb = mm->w_row_bytes;
    for (int m = 0; m < mm->M; m++) {
        const int8_t *xq = mm->xq + (size_t)m * mm->xq_stride;
        const float *xd = mm->xd + (size_t)m * mm->xs_stride;
        const int32_t *xc = mm->xc + (size_t)m * mm->xs_stride;
        float *y = mm->y + (size_t)m * mm->ldy;
        for (int n = n0; n < n1; n += 16) {
            int nr = TD_MIN(16, n1 - n);
            const uint8_t *row0 = mm->w + (size_t)n * rb, *rows[16];
            int32_t off[16];
            for (int j = 0; j < 16; j++) {
                off[j] = (int32_t)((size_t)TD_MIN(j, nr - 1) * rb);
                rows[j] = row0 + off[j];
            }
            __m512i vidx = _mm512_loadu_si512(off);
            __m512 acc = _mm512_setzero_ps();
            /* Fetch the next 16 rows while these stream: a share of their lines per step. */
            const uint8_t *next = mm->w + (size_t)TD_MIN(n + 16, n1 - 1) * rb;
            size_t pf_lines = (TD_MIN((size_t)16, (size_t)(n1 - TD_MIN(n + 16, n1 - 1))) * rb + 63) / 64;
            size_t pf_per_step = (pf_lines + (size_t)nb / 2) / (size_t)(nb / 2 + 1) + 1, pf_at = 0;
            int b = 0;
            for (; b + 2 <= nb; b += 2) {
                for (size_t i = 0; i < pf_per_step && pf_at < pf_lines; i++, pf_at++)
                    _mm_prefetch((const char *)next + pf_at * 64, _MM_HINT_T0);
                __m512i xv = _mm512_load_si512(xq + b * 32), r[16], v0, v1;
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++)
                    r[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw_pair(t, rows[j], b), xv);
                reduce_q16(r, &v0, &v1);
                v0 = _mm512_add_epi32(v0, _mm512_set1_epi32(xc[b]));
                v1 = _mm512_add_epi32(v1, _mm512_set1_epi32(xc[b + 1]));
                __m512 d0 = _mm512_mul_ps(q_scales(row0, vidx, bb, b), _mm512_set1_ps(xd[b]));
                __m512 d1 = _mm512_mul_ps(q_scales(row0, vidx, bb, b + 1), _mm512_set1_ps(xd[b + 1]));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), d0, acc);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), d1, acc);
            }
            if (b < nb) {
                __m512i xv = _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)(xq + b * 32)));
                xv = _mm512_inserti64x4(xv, _mm256_setzero_si256(), 1);
                __m512i r[16], v0, v1;
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++) {
                    __m512i w = _mm512_inserti64x4(_mm512_setzero_si512(), qw_block(t, rows[j], b), 0);
                    r[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
                }
                reduce_q16(r, &v0, &v1);
                v0 = _mm512_add_epi32(v0, _mm512_set1_epi32(xc[b]));
                __m512 d0 = _mm512_mul_ps(q_scales(row0, vidx, bb, b), _mm512_set1_ps(xd[b]));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), d0, acc);
            }
            _mm512_mask_storeu_ps(y + n, (__mmask16)((1u << nr) - 1), acc);
        }
    }
}

/* ---- quantized weights: large M ------------------------------------------------ */

/*
 * Panel layout, 32 weight rows: for block b, 1024 bytes = 8 groups g of 128 bytes:
 * rows 0-15 then rows 16-31, lane j holding bytes 4g..4g+3 of the block (u8) of that
 * row; then, after all blocks, nb * 32 f32 scales (block-major). Padding rows are 0.
 */
#define QP_ROWS 32

/* 16 rows of 8 dwords -> 8 vectors of 16 rows (dword g of each). */
INLINE void transpose16x8(const __m256i *y, __m512i *p)
{
    __m512i z[8], t[8], u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(y[i]), y[i + 8], 1);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        p[g] = _mm512_permutex2var_epi64(u[g], lo, u[g + 4]);
        p[g + 4] = _mm512_permutex2var_epi64(u[g], hi, u[g + 4]);
    }
}

INLINE void qpack(td_type t, const cpu__mm *mm, int n, int nr, uint8_t *panel)
{
    const int nb = mm->K / 32;
    const size_t bb = t == TD_TYPE_Q8_0 ? sizeof(td_block_q8_0) : sizeof(td_block_q4_0);
    float *pd = (float *)(void *)(panel + (size_t)nb * 1024);
    const uint8_t *rows[QP_ROWS];
    for (int j = 0; j < QP_ROWS; j++) rows[j] = mm->w + (size_t)(n + TD_MIN(j, nr - 1)) * mm->w_row_bytes;
    for (int b = 0; b < nb; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i y[16];
            __m512i p[8];
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) y[j] = qw_block(t, rows[16 * h + j], b);
            transpose16x8(y, p);
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++)
                _mm512_store_si512(panel + (size_t)b * 1024 + g * 128 + h * 64, p[g]);
        }
        for (int j = 0; j < QP_ROWS; j++) {
            uint16_t d;
            memcpy(&d, rows[j] + (size_t)b * bb, 2);
            pd[b * QP_ROWS + j] = j < nr ? _cvtsh_ss(d) : 0.0f;
        }
    }
}

#define QT_MAXM 6

/* MR rows of x against a 32-row panel: out[m][v] = y[m][16v .. 16v + 15]. */
INLINE void qtile(int MR, const cpu__mm *mm, int m0, const uint8_t *panel, __m512 out[][2])
{
    const int nb = mm->K / 32;
    const float *pd = (const float *)(const void *)(panel + (size_t)nb * 1024);
    const int8_t *xq[QT_MAXM];
    const float *xd[QT_MAXM];
    const int32_t *xc[QT_MAXM];
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++) {
        xq[m] = mm->xq + (size_t)(m0 + m) * mm->xq_stride;
        xd[m] = mm->xd + (size_t)(m0 + m) * mm->xs_stride;
        xc[m] = mm->xc + (size_t)(m0 + m) * mm->xs_stride;
    }
    __m512 facc[QT_MAXM][2];
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++) facc[m][0] = facc[m][1] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *pb = panel + (size_t)b * 1024;
        __m512i iacc[QT_MAXM][2];
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) iacc[m][0] = iacc[m][1] = _mm512_set1_epi32(xc[m][b]);
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m512i w0 = _mm512_load_si512(pb + g * 128), w1 = _mm512_load_si512(pb + g * 128 + 64);
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++) {
                int32_t x4;
                memcpy(&x4, xq[m] + b * 32 + g * 4, 4);
                __m512i xb = _mm512_set1_epi32(x4);
                iacc[m][0] = _mm512_dpbusd_epi32(iacc[m][0], w0, xb);
                iacc[m][1] = _mm512_dpbusd_epi32(iacc[m][1], w1, xb);
            }
        }
        __m512 dw0 = _mm512_load_ps(pd + b * QP_ROWS), dw1 = _mm512_load_ps(pd + b * QP_ROWS + 16);
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            __m512 dx = _mm512_set1_ps(xd[m][b]);
            facc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][0]), _mm512_mul_ps(dw0, dx), facc[m][0]);
            facc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][1]), _mm512_mul_ps(dw1, dx), facc[m][1]);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++) {
        out[m][0] = facc[m][0];
        out[m][1] = facc[m][1];
    }
}

INLINE void qpacked(const cpu__mm *mm, td_type t, int n0, int n1, uint8_t *panel)
{
    const int K = mm->K, M = mm->M;
    int mb_rows = (int)TD_MAX((size_t)QT_MAXM, (512u << 10) / (size_t)K / QT_MAXM * QT_MAXM);
    for (int mb = 0; mb < M; mb += mb_rows) {
        int me = TD_MIN(M, mb + mb_rows);
        for (int n = n0; n < n1; n += QP_ROWS) {
            int nr = TD_MIN(QP_ROWS, n1 - n);
            qpack(t, mm, n, nr, panel);
            __mmask16 k0 = (__mmask16)(nr >= 16 ? 0xffff : (1u << nr) - 1);
            __mmask16 k1 = (__mmask16)(nr >= 32 ? 0xffff : nr <= 16 ? 0 : (1u << (nr - 16)) - 1);
            for (int m = mb; m < me; m += QT_MAXM) {
                int mr = TD_MIN(QT_MAXM, me - m);
                __m512 out[QT_MAXM][2];
                switch (mr) {
                case 6: qtile(6, mm, m, panel, out); break;
                case 5: qtile(5, mm, m, panel, out); break;
                case 4: qtile(4, mm, m, panel, out); break;
                case 3: qtile(3, mm, m, panel, out); break;
                case 2: qtile(2, mm, m, panel, out); break;
                default: qtile(1, mm, m, panel, out); break;
                }
                for (int i = 0; i < mr; i++) {
                    float *y = mm->y + (size_t)(m + i) * mm->ldy + n;
                    _mm512_mask_storeu_ps(y, k0, out[i][0]);
                    _mm512_mask_storeu_ps(y + 16, k1, out[i][1]);
                }
            }
        }
    }
}

#define QPACK_MIN_M 4

static void matmul_q8_0(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < QPACK_MIN_M)
        qdirect(mm, TD_TYPE_Q8_0, n0, n1);
    else
        qpacked(mm, TD_TYPE_Q8_0, n0, n1, scratch);
}

static void matmul_q4_0(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < QPACK_MIN_M)
        qdirect(mm, TD_TYPE_Q4_0, n0, n1);
    else
        qpacked(mm, TD_TYPE_Q4_0, n0, n1, scratch);
}

void cpu__avx512_matmul(const cpu__mm *mm, int n0, int n1, void *scratch);
size_t cpu__avx512_matmul_scratch(td_type wtype, int M, int K);

void cpu__avx512_matmul(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    switch (mm->wtype) {
    case TD_TYPE_F32: matmul_f32(mm, n0, n1, scratch); break;
    case TD_TYPE_F16: matmul_f16(mm, n0, n1, scratch); break;
    case TD_TYPE_BF16: matmul_bf16(mm, n0, n1, scratch); break;
    case TD_TYPE_Q8_0: matmul_q8_0(mm, n0, n1, scratch); break;
    case TD_TYPE_Q4_0: matmul_q4_0(mm, n0, n1, scratch); break;
    default: TD_ASSERT(!"unsupported weight type");
    }
}

size_t cpu__avx512_matmul_scratch(td_type wtype, int M, int K)
{
    (void)M;
    if (cpu__is_quantized(wtype)) return (size_t)(K / 32) * (1024 + QP_ROWS * 4);
    return (size_t)FP_NR * TD_ALIGN_UP((size_t)K, 16) * 4;
}
