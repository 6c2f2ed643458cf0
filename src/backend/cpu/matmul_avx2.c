/*
 * backend/cpu/matmul_avx2.c - cpu_matmul for AVX2 + FMA + F16C (machines without
 * AVX-512). Same design as matmul_avx512.c with 8 lanes:
 *
 * Float weights: dot-product layout, one ymm accumulator per output (lane l takes
 * k = l mod 8), reduced by reduce8 = cpu__tree8. Small M tiles straight from the
 * weight rows; larger M widens panels of FP_NR rows once and runs FP_MR x FP_NR tiles.
 *
 * Quantized weights: per 8 weight rows and one block, exact integer dot products
 * (q8_0: maddubs with the sign trick, |w| * sign(x, w); q4_0: the nibbles as the
 * unsigned operand, corrected by -8 * sum(q_x)), reduced across lanes with hadd,
 * then acc = fma((float)S_b, dx_b * dw_b, acc) for 8 rows at once, in block order.
 * q8_0 weights packed at load time (cpu_pack's panels) are read in place by q8p_matmul:
 * the same sign trick on 4 bytes per lane gives 8 rows' sums per vector with no
 * horizontal reduction, in 1 x 32 tiles for M < 4 and up to 4 x 16 otherwise.
 */
#include "backend/cpu/cpu_impl.h"

#include <immintrin.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* out lane j = tree8(v[j]): a[i] + a[i+4], then + 2, + 1. */
INLINE __m256 reduce8(const __m256 *v)
{
    __m256 s[8], c[4], g[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        s[i] = v[4 * (i & 1) + (i >> 1)];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        c[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        g[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

enum { WK_F32, WK_F16, WK_BF16 };

INLINE __m256i tail_mask8(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

INLINE __m256 wload(int kind, const void *p, int k)
{
    if (kind == WK_F32) return _mm256_loadu_ps((const float *)p + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
    if (kind == WK_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Elements k .. k + n - 1 (n < 8), zeros after. */
INLINE __m256 wloadz(int kind, const void *p, int k, int n)
{
    if (kind == WK_F32) return _mm256_maskload_ps((const float *)p + k, tail_mask8(n));
    uint16_t tmp[8] = {0};
    memcpy(tmp, (const uint16_t *)p + k, sizeof(uint16_t) * (size_t)n);
    __m128i h = _mm_loadu_si128((const __m128i *)tmp);
    if (kind == WK_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#define FT_MAXM 4
#define FT_MAXN 8

INLINE void ftile(int MR, int NR, int kind, const float *const *xr, const void *const *wr, int K,
                  float *out)
{
    __m256 acc[FT_MAXM][FT_MAXN];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 8
        for (int n = 0; n < NR; n++)
            acc[m][n] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[FT_MAXM];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
            xv[m] = _mm256_loadu_ps(xr[m] + k);
#pragma GCC unroll 8
        for (int n = 0; n < NR; n++) {
            __m256 wv = wload(kind, wr[n], k);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++)
                acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
        }
    }
    if (k < K) {
        __m256 xv[FT_MAXM];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
            xv[m] = _mm256_maskload_ps(xr[m] + k, tail_mask8(K - k));
#pragma GCC unroll 8
        for (int n = 0; n < NR; n++) {
            __m256 wv = wloadz(kind, wr[n], k, K - k);
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++)
                acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
        }
    }
    const int total = MR * NR;
#pragma GCC unroll 2
    for (int base = 0; base < total; base += 8) {
        __m256 grp[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            grp[i] = base + i < total ? acc[(base + i) / NR][(base + i) % NR] : _mm256_setzero_ps();
        _mm256_storeu_ps(out + base, reduce8(grp));
    }
}

static void store_tile(float *y, int64_t ldy, const float *out, int NR, int mr, int nr)
{
    for (int m = 0; m < mr; m++)
        memcpy(y + m * ldy, out + m * NR, sizeof(float) * (size_t)nr);
}

INLINE void fdirect(const cpu__mm *mm, int kind, int n0, int n1)
{
    float out[16];
    for (int m = 0; m < mm->M;) {
        int mr = TD_MIN(mm->M - m, 2);
        const float *xr[2];
        for (int i = 0; i < mr; i++)
            xr[i] = mm->x + (m + i) * mm->ldx;
        int NR = mr == 1 ? 8 : 4;
        for (int n = n0; n < n1; n += NR) {
            const void *wr[8];
            int nr = TD_MIN(NR, n1 - n);
            for (int j = 0; j < NR; j++)
                wr[j] = mm->w + (size_t)(n + TD_MIN(j, nr - 1)) * mm->w_row_bytes;
            if (mr == 1)
                ftile(1, 8, kind, xr, wr, mm->K, out);
            else
                ftile(2, 4, kind, xr, wr, mm->K, out);
            store_tile(mm->y + m * mm->ldy + n, mm->ldy, out, NR, mr, nr);
        }
        m += mr;
    }
}

#define FP_MR 3
#define FP_NR 4

INLINE void fpacked(const cpu__mm *mm, int kind, int n0, int n1, float *panel)
{
    const int K = mm->K, M = mm->M, Kp = TD_ALIGN_UP(K, 8);
    int mb_rows = (int)TD_MAX((size_t)FP_MR, (256u << 10) / ((size_t)K * 4) / FP_MR * FP_MR);
    float out[TD_ALIGN_UP(FP_MR * FP_NR, 8)];
    const void *wr[FP_NR];
    for (int j = 0; j < FP_NR; j++)
        wr[j] = panel + (size_t)j * Kp;
    for (int mb = 0; mb < M; mb += mb_rows) {
        int me = TD_MIN(M, mb + mb_rows);
        for (int n = n0; n < n1; n += FP_NR) {
            int nr = TD_MIN(FP_NR, n1 - n);
            for (int j = 0; j < FP_NR; j++) {
                float *dst = panel + (size_t)j * Kp;
                if (j >= nr) {
                    memset(dst, 0, sizeof(float) * (size_t)Kp);
                    continue;
                }
                const uint8_t *src = mm->w + (size_t)(n + j) * mm->w_row_bytes;
                int k = 0;
                for (; k + 8 <= K; k += 8)
                    _mm256_storeu_ps(dst + k, wload(kind, src, k));
                if (k < K) _mm256_storeu_ps(dst + k, wloadz(kind, src, k, K - k));
            }
            for (int m = mb; m < me; m += FP_MR) {
                int mr = TD_MIN(FP_MR, me - m);
                const float *xr[FP_MR];
                for (int i = 0; i < FP_MR; i++)
                    xr[i] = mm->x + (m + TD_MIN(i, mr - 1)) * mm->ldx;
                switch (mr) {
                case 3:
                    ftile(3, FP_NR, WK_F32, xr, wr, K, out);
                    break;
                case 2:
                    ftile(2, FP_NR, WK_F32, xr, wr, K, out);
                    break;
                default:
                    ftile(1, FP_NR, WK_F32, xr, wr, K, out);
                    break;
                }
                store_tile(mm->y + m * mm->ldy + n, mm->ldy, out, FP_NR, mr, nr);
            }
        }
    }
}

#define FPACK_MIN_M 3

/* ---- quantized ------------------------------------------------------------------ */

/* Exact per-lane partial sums of block b of one row against x's block (8 int32 lanes). */
INLINE __m256i qdot_block(td_type t, const uint8_t *row, int b, __m256i xv)
{
    if (t == TD_TYPE_Q8_0) {
        __m256i w =
            _mm256_loadu_si256((const __m256i *)(row + (size_t)b * sizeof(td_block_q8_0) + 2));
        __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
        return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    }
    const uint8_t *q = row + (size_t)b * sizeof(td_block_q4_0) + 2;
    __m128i v = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(0x0f);
    __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
}

/* Totals of 8 rows' lane sums, in row order. */
INLINE __m256i reduce_q8(const __m256i *r)
{
    __m256i h01 = _mm256_hadd_epi32(r[0], r[1]), h23 = _mm256_hadd_epi32(r[2], r[3]);
    __m256i h45 = _mm256_hadd_epi32(r[4], r[5]), h67 = _mm256_hadd_epi32(r[6], r[7]);
    __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* 8 weight rows at a time, for each x row while they are in L1; the next 8 rows are
 * prefetched during the first x row. */
INLINE void qdirect(const cpu__mm *mm, td_type t, int n0, int n1)
{
    const int nb = mm->K / 32;
    const size_t bb = t == TD_TYPE_Q8_0 ? sizeof(td_block_q8_0) : sizeof(td_block_q4_0);
    const size_t rb = mm->w_row_bytes;
    /* q8_0 uses the sign trick (exact S directly); q4_0 needs the -8 * sum(q) correction. */
    const bool corr = t == TD_TYPE_Q4_0;
    for (int n = n0; n < n1; n += 8) {
        int nr = TD_MIN(8, n1 - n);
        const uint8_t *rows[8];
        for (int j = 0; j < 8; j++)
            rows[j] = mm->w + (size_t)(n + TD_MIN(j, nr - 1)) * rb;
        const uint8_t *next = mm->w + (size_t)TD_MIN(n + 8, n1 - 1) * rb;
        size_t pf_lines = n + 8 < n1 ? ((size_t)TD_MIN(8, n1 - n - 8) * rb + 63) / 64 : 0;
        size_t pf_step = pf_lines / (size_t)nb + 1, pf_at = 0;
        for (int m = 0; m < mm->M; m++) {
            const int8_t *xq = mm->xq + (size_t)m * mm->xq_stride;
            const float *xd = mm->xd + (size_t)m * mm->xs_stride;
            const int32_t *xc = mm->xc + (size_t)m * mm->xs_stride;
            __m256 acc = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                for (size_t i = 0; i < pf_step && pf_at < pf_lines; i++, pf_at++)
                    _mm_prefetch((const char *)next + pf_at * 64, _MM_HINT_T0);
                __m256i xv = _mm256_load_si256((const __m256i *)(xq + b * 32)), r[8];
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    r[j] = qdot_block(t, rows[j], b, xv);
                __m256i s = reduce_q8(r);
                if (corr) s = _mm256_add_epi32(s, _mm256_set1_epi32(xc[b]));
                uint16_t h[8];
                for (int j = 0; j < 8; j++)
                    memcpy(&h[j], rows[j] + (size_t)b * bb, 2);
                __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
                __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(xd[b]));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc);
            }
            float out[8];
            _mm256_storeu_ps(out, acc);
            memcpy(mm->y + (size_t)m * mm->ldy + n, out, sizeof(float) * (size_t)nr);
        }
    }
}

/* ---- q8_0 in cpu_pack's panel layout ------------------------------------------- */

/*
 * In a panel, vector v (32 bytes at 128g + 32v of a block) holds 8 rows, 8v .. 8v + 7,
 * with lane j taking 4 consecutive q of row 8v + j (as q + 128). For each x row the 4
 * matching x bytes are broadcast, and the sign trick (maddubs of |w| with sign(x, w),
 * then madd to 32 bits) gives 8 rows' exact partial sums per instruction chain with no
 * horizontal reduction; |w| and w are made once per vector for all the tile's x rows.
 */
#define QP_MAXM 4
/* From this many x rows on, tiles of up to QP_MAXM x rows run against half a panel. */
#define QP_TILE_MIN_M 4

/*
 * MR x rows (from m0) against the NV vectors v0 .. v0 + NV - 1 of a panel:
 * out[m][v] = y[m0 + m][rows of vector v0 + v]. pf: the next panel, prefetched one
 * block's worth of lines per block, or NULL.
 */
INLINE void q8p_tile(int MR, int NV, const cpu__mm *mm, int m0, const uint8_t *panel, int v0,
                     __m256 out[][4], const uint8_t *pf)
{
    const int nb = mm->K / 32;
    const int8_t *xq[QP_MAXM];
    const float *xd[QP_MAXM];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++) {
        xq[m] = mm->xq + (size_t)(m0 + m) * mm->xq_stride;
        xd[m] = mm->xd + (size_t)(m0 + m) * mm->xs_stride;
    }
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8(-128);
    __m256 facc[QP_MAXM][4];
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            facc[m][v] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *pb = panel + (size_t)b * CPU__PANEL_BLOCK_BYTES;
        /* the next panel's block, into the L2: 17 lines at once into the L1 would hold its
         * miss buffers (q8_0 batch 1 on one thread +29-41%, batch 8 +20-23%; BENCHMARKS.md) */
        if (pf)
            for (int i = 0; i < CPU__PANEL_BLOCK_BYTES / 64; i++)
                _mm_prefetch((const char *)pf + (size_t)b * CPU__PANEL_BLOCK_BYTES + i * 64,
                             _MM_HINT_T1);
        __m256i iacc[QP_MAXM][4];
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                iacc[m][v] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m256i ws[4], wa[4];
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) {
                ws[v] = _mm256_xor_si256(
                    _mm256_load_si256((const __m256i *)(pb + 128 * g + 32 * (v0 + v))), bias);
                wa[v] = _mm256_abs_epi8(ws[v]);
            }
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
                int32_t x4;
                memcpy(&x4, xq[m] + b * 32 + 4 * g, 4);
                __m256i xb = _mm256_set1_epi32(x4);
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) {
                    __m256i p = _mm256_maddubs_epi16(wa[v], _mm256_sign_epi8(xb, ws[v]));
                    iacc[m][v] = _mm256_add_epi32(iacc[m][v], _mm256_madd_epi16(p, ones));
                }
            }
        }
        __m256 dw[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            dw[v] = _mm256_cvtph_ps(
                _mm_load_si128((const __m128i *)(pb + CPU__PANEL_SCALES + 16 * (v0 + v))));
#pragma GCC unroll 4
        for (int m = 0; m < MR; m++) {
            __m256 dx = _mm256_set1_ps(xd[m][b]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++)
                facc[m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[m][v]),
                                             _mm256_mul_ps(dw[v], dx), facc[m][v]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++)
            out[m][v] = facc[m][v];
}

/* Store out[i][v] (rows n + 8 * (v0 + v) ..) for x rows m .. m + mr - 1, only the first
 * nr rows of the panel. */
static void q8p_store(const cpu__mm *mm, int m, int mr, int n, int nr, int v0, int NV,
                      __m256 out[][4])
{
    for (int i = 0; i < mr; i++) {
        float *y = mm->y + (size_t)(m + i) * mm->ldy + n;
        for (int v = 0; v < NV; v++) {
            int r = 8 * (v0 + v), cnt = TD_MIN(8, nr - r);
            if (cnt <= 0) break;
            if (cnt == 8) {
                _mm256_storeu_ps(y + r, out[i][v]);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, out[i][v]);
                memcpy(y + r, tmp, sizeof(float) * (size_t)cnt);
            }
        }
    }
}

static void q8p_matmul(const cpu__mm *mm, int n0, int n1)
{
    const int M = mm->M, K = mm->K;
    const size_t panel_bytes = (size_t)CPU__PANEL_ROWS * mm->w_row_bytes;
    /* Rows of x per block: their quantized K bytes stay in L2 across all the panels. */
    const int mb_rows = (int)TD_MAX((size_t)QP_MAXM, (256u << 10) / (size_t)K / QP_MAXM * QP_MAXM);
    for (int mb = 0; mb < M; mb += mb_rows) {
        int me = TD_MIN(M, mb + mb_rows);
        for (int n = n0; n < n1; n += CPU__PANEL_ROWS) {
            int nr = TD_MIN(CPU__PANEL_ROWS, n1 - n);
            const uint8_t *panel = mm->w + (size_t)n * mm->w_row_bytes;
            const uint8_t *pf = n + CPU__PANEL_ROWS < n1 ? panel + panel_bytes : NULL;
            __m256 out[QP_MAXM][4];
            if (M < QP_TILE_MIN_M) {
                /* Few x rows: the whole panel per x row; it stays in L1 for the next. */
                for (int m = mb; m < me; m++) {
                    q8p_tile(1, 4, mm, m, panel, 0, out, m == mb ? pf : NULL);
                    q8p_store(mm, m, 1, n, nr, 0, 4, out);
                }
                continue;
            }
            /* Tiles of at most QP_MAXM rows, sized evenly, against each half panel. */
            int n_tiles = (me - mb + QP_MAXM - 1) / QP_MAXM;
            for (int h = 0; h < 2 && 16 * h < nr; h++) {
                for (int m = mb, ti = 0; m < me; ti++) {
                    int mr = (me - m + (n_tiles - ti) - 1) / (n_tiles - ti);
                    const uint8_t *p = h == 0 && ti == 0 ? pf : NULL;
                    switch (mr) {
                    case 4:
                        q8p_tile(4, 2, mm, m, panel, 2 * h, out, p);
                        break;
                    case 3:
                        q8p_tile(3, 2, mm, m, panel, 2 * h, out, p);
                        break;
                    case 2:
                        q8p_tile(2, 2, mm, m, panel, 2 * h, out, p);
                        break;
                    default:
                        q8p_tile(1, 2, mm, m, panel, 2 * h, out, p);
                        break;
                    }
                    q8p_store(mm, m, mr, n, nr, 2 * h, 2, out);
                    m += mr;
                }
            }
        }
    }
}

void cpu__avx2_matmul(const cpu__mm *mm, int n0, int n1, void *scratch);
size_t cpu__avx2_matmul_scratch(td_type wtype, int M, int K);

void cpu__avx2_matmul(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    bool packed = mm->M >= FPACK_MIN_M;
    switch (mm->wtype) {
    case TD_TYPE_F32:
        if (packed)
            fpacked(mm, WK_F32, n0, n1, scratch);
        else
            fdirect(mm, WK_F32, n0, n1);
        break;
    case TD_TYPE_F16:
        if (packed)
            fpacked(mm, WK_F16, n0, n1, scratch);
        else
            fdirect(mm, WK_F16, n0, n1);
        break;
    case TD_TYPE_BF16:
        if (packed)
            fpacked(mm, WK_BF16, n0, n1, scratch);
        else
            fdirect(mm, WK_BF16, n0, n1);
        break;
    case TD_TYPE_Q8_0:
        if (mm->packed)
            q8p_matmul(mm, n0, n1);
        else
            qdirect(mm, TD_TYPE_Q8_0, n0, n1);
        break;
    case TD_TYPE_Q4_0:
        qdirect(mm, TD_TYPE_Q4_0, n0, n1);
        break;
    default:
        TD_ASSERT(!"unsupported weight type");
    }
}

size_t cpu__avx2_matmul_scratch(td_type wtype, int M, int K)
{
    (void)M;
    if (cpu__is_quantized(wtype)) return 64;
    return (size_t)FP_NR * TD_ALIGN_UP((size_t)K, 8) * 4;
}
