/*
 * backend/cpu/matmul_avx512.c - cpu_matmul for AVX-512 (F, BW, VL, DQ, VNNI).
 *
 * Float weights (f32, f16, bf16): dot-product layout. Each output (m, n) owns one
 * zmm accumulator over k (lane l takes k = l mod 16, fused multiply-add in k order,
 * the K tail through zero-masked loads), reduced at the end by reduce16, which
 * applies the fixed tree cpu__tree16 to 16 accumulators at once.
 *   - small M (< FPACK_MIN_M_*): register tiles straight from the weight rows, widening
 *     each load (1 x 4 or 1 x 16 for GEMV, up to 4 x 6 otherwise), prefetching the next
 *     rows, so that the weights stream from DRAM at full speed;
 *   - larger M: a panel of 6 weight rows is widened to f32 once into an aligned buffer
 *     and 4 x 6 tiles run over a block of x rows that stays in L2; K > 1024 is cut into
 *     chunks of 1024 with the accumulators stored between chunks.
 * Widening is exact and storing an accumulator is exact, so all of these perform the
 * same per-element arithmetic: any M, tile position or thread split gives equal bits.
 *
 * Quantized weights (q8_0, q4_0): x rows are quantized to q8_0 by cpu.c. The block
 * dot products are exact integers (vpdpbusd with the weight as the unsigned operand:
 * q8_0 as q + 128, q4_0 nibbles as they are, corrected by -offset * sum(q_x)), and
 * each output accumulates fma((float)S_b, dx_b * dw_b, acc) in block order.
 *   - weights packed at load time (q8_0, cpu_pack's panels: lane j of a zmm holds 4
 *     consecutive k of row j as u8): the panel tiles below run on them in place, for
 *     every M (1 x 32 tiles for batch 1, up to 6 x 32 otherwise);
 *   - native layout, small M (< QPACK_MIN_M): per 16 weight rows and 2 blocks, one
 *     vpdpbusd per row, then a transposing integer reduction to one vector of 16 rows;
 *   - native layout, larger M: each panel of 32 weight rows is repacked into the same
 *     layout in scratch; x is broadcast 4 bytes at a time, and 8 vpdpbusd give a whole
 *     block for 16 rows without any horizontal reduction (6 x 32 tiles).
 * Every path prefetches the next weight rows or panel in small steps: with few x rows
 * the weights are consumed fast, and DRAM latency would otherwise dominate.
 */
#include "backend/cpu/cpu_impl.h"
#include "backend/cpu/reduce_avx512.h"

#include <immintrin.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

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

/*
 * Software prefetch of the next weight panel (rows [n, n + rows) of the weight) into
 * L2, a share at a time, while the current panel is being used: with few x rows the
 * panel is consumed quickly and DRAM latency would otherwise show.
 */
typedef struct {
    const uint8_t *base;
    size_t lines, at, per_step;
} panel_prefetch;

static inline void panel_prefetch_init(panel_prefetch *pp, const cpu__mm *mm, int n, int rows,
                                       int steps)
{
    pp->base = mm->w + (size_t)n * mm->w_row_bytes;
    pp->lines = rows > 0 ? ((size_t)rows * mm->w_row_bytes + 63) / 64 : 0;
    pp->at = 0;
    pp->per_step = pp->lines / (size_t)TD_MAX(steps, 1) + 1;
    if (!pp->lines) pp->per_step = 0;
}

/* l2 (a constant at every call site): into the L2 rather than the L1. */
INLINE void panel_prefetch_step_to(panel_prefetch *pp, bool l2)
{
    if (!pp) return;
    for (size_t i = 0; i < pp->per_step && pp->at < pp->lines; i++, pp->at++) {
        if (l2)
            _mm_prefetch((const char *)pp->base + pp->at * 64, _MM_HINT_T1);
        else
            _mm_prefetch((const char *)pp->base + pp->at * 64, _MM_HINT_T0);
    }
}

static inline void panel_prefetch_step(panel_prefetch *pp)
{
    panel_prefetch_step_to(pp, false);
}

#define FT_MAXM 6
#define FT_MAXN 16

/*
 * The k loop of one register tile over [k0, k1): acc[m][n] += x row m . w row n, in
 * 16-lane steps; when k1 == K a partial last step goes through zero-masked loads.
 * MR, NR and kind are compile-time constants at every call site. pf: NR rows to
 * prefetch at the same offsets (GEMV), or NULL.
 */
INLINE void ftile_run(int MR, int NR, int kind, const float *const *xr, const void *const *wr,
                      int k0, int k1, int K, __m512 acc[FT_MAXM][FT_MAXN], const uint8_t *const *pf,
                      panel_prefetch *pp)
{
    int k = k0;
    for (; k + 16 <= k1; k += 16) {
        panel_prefetch_step(pp);
        __m512 xv[FT_MAXM];
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++)
            xv[m] = _mm512_loadu_ps(xr[m] + k);
#pragma GCC unroll 16
        for (int n = 0; n < NR; n++) {
            __m512 wv = wload(kind, wr[n], k);
            /* Keep wv in a register: GCC would otherwise fold the load into each of the
             * MR multiply-adds, and the tile would be bound by loads, not FMAs. */
            if (MR > 1) __asm__("" : "+v"(wv));
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++)
                acc[m][n] = _mm512_fmadd_ps(xv[m], wv, acc[m][n]);
            /* One line of the next rows per step (f16/bf16 steps are half a line), into
             * the L2: a prefetch into the L1 holds one of the L1's few miss buffers until
             * its line arrives, and those, not DRAM, then set the rate (llama-134m f16 at
             * batch 1 on one thread: 19.5 -> 9.6 ms per token; BENCHMARKS.md). */
            if (pf)
                _mm_prefetch((const char *)pf[n] + (size_t)k * (kind == WK_F32 ? 4 : 2),
                             _MM_HINT_T1);
        }
    }
    if (k < k1 && k1 == K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 xv[FT_MAXM];
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++)
            xv[m] = _mm512_maskz_loadu_ps(mask, xr[m] + k);
#pragma GCC unroll 16
        for (int n = 0; n < NR; n++) {
            __m512 wv = wloadz(kind, wr[n], k, mask);
#pragma GCC unroll 6
            for (int m = 0; m < MR; m++)
                acc[m][n] = _mm512_fmadd_ps(xv[m], wv, acc[m][n]);
        }
    }
}

INLINE void ftile_zero(int MR, int NR, __m512 acc[FT_MAXM][FT_MAXN])
{
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 16
        for (int n = 0; n < NR; n++)
            acc[m][n] = _mm512_setzero_ps();
}

/* out[m * NR + n] = tree16(acc[m][n]); out has room for a multiple of 16 floats. */
INLINE void ftile_reduce(int MR, int NR, __m512 acc[FT_MAXM][FT_MAXN], float *out)
{
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

/* A whole tile: out[m * NR + n] = dot(x row m, w row n) for m < MR, n < NR. */
INLINE void ftile_pf(int MR, int NR, int kind, const float *const *xr, const void *const *wr, int K,
                     float *out, const uint8_t *const *pf)
{
    __m512 acc[FT_MAXM][FT_MAXN];
    ftile_zero(MR, NR, acc);
    ftile_run(MR, NR, kind, xr, wr, 0, K, K, acc, pf, NULL);
    ftile_reduce(MR, NR, acc, out);
}

/*
 * One k-chunk [k0, k1) of a tile whose accumulators live in memory between chunks
 * (storing and reloading a vector is exact, so chunking changes no result): start
 * from zero on the first chunk, reduce into out on the last.
 */
INLINE void ftile_chunk(int MR, int NR, const float *const *xr, const void *const *wr, int k0,
                        int k1, int K, __m512 *save, float *out, panel_prefetch *pp)
{
    __m512 acc[FT_MAXM][FT_MAXN];
    if (k0 == 0) {
        ftile_zero(MR, NR, acc);
    } else {
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 16
            for (int n = 0; n < NR; n++)
                acc[m][n] = _mm512_load_ps((const float *)&save[m * NR + n]);
    }
    ftile_run(MR, NR, WK_F32, xr, wr, k0, k1, K, acc, NULL, pp);
    if (k1 == K) {
        ftile_reduce(MR, NR, acc, out);
    } else {
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++)
#pragma GCC unroll 16
            for (int n = 0; n < NR; n++)
                _mm512_store_ps((float *)&save[m * NR + n], acc[m][n]);
    }
}

/* Copy an mr x nr corner of a tile's outputs (row stride NR) into y. */
static void store_tile(float *y, int64_t ldy, const float *out, int NR, int mr, int nr)
{
    for (int m = 0; m < mr; m++)
        memcpy(y + m * ldy, out + m * NR, sizeof(float) * (size_t)nr);
}

/*
 * Small M: tiles straight from the weight rows (widening each load), so that the
 * weights stream from DRAM at full speed while the next rows are prefetched.
 *   - M = 1, rows of at least GEMV_NARROW_K: 1 x 4 tiles. Four rows read side by side
 *     (and the next four prefetched) are streams the hardware prefetchers keep up with,
 *     better than 16 rows a whole row apart: llama-134m decodes 1.10-1.27x faster than
 *     with 1 x 16 tiles (f16 and f32, BENCHMARKS.md). Fewer than 4 rows leave too few
 *     multiply-add chains.
 *   - M = 1, shorter rows: 1 x 16 tiles, whose one reduction serves 16 outputs (with 1 x 4
 *     it cost stories260K's 64-wide rows 11%).
 *   - otherwise x rows go in balanced tiles of at most 4 against 6 weight rows (4 x 4
 *     tiles were 12% slower at M = 8), and the first tile of each group prefetches the
 *     next group.
 */
#define GEMV_NARROW_K 256

INLINE void fdirect(const cpu__mm *mm, int kind, int n0, int n1)
{
    const int K = mm->K, M = mm->M;
    const int NR = M > 1 ? 6 : K >= GEMV_NARROW_K ? 4 : 16;
    float out[32] __attribute__((aligned(64)));
    for (int n = n0; n < n1; n += NR) {
        const void *wr[16];
        const uint8_t *pf[16];
        int nr = TD_MIN(NR, n1 - n);
        for (int j = 0; j < NR; j++) {
            wr[j] = mm->w + (size_t)(n + TD_MIN(j, nr - 1)) * mm->w_row_bytes;
            pf[j] = mm->w + (size_t)TD_MIN(n + NR + j, n1 - 1) * mm->w_row_bytes;
        }
        int n_tiles = (M + 3) / 4;
        for (int m = 0, ti = 0; m < M; ti++) {
            int mr = M == 1 ? 1 : (M - m + (n_tiles - ti) - 1) / (n_tiles - ti);
            const float *xr[4] = {0};
            for (int i = 0; i < mr; i++)
                xr[i] = mm->x + (m + i) * mm->ldx;
            const uint8_t *const *p = ti == 0 ? pf : NULL;
            switch (mr) {
            case 1:
                if (M == 1 && NR == 4)
                    ftile_pf(1, 4, kind, xr, wr, K, out, p);
                else if (M == 1)
                    ftile_pf(1, 16, kind, xr, wr, K, out, p);
                else
                    ftile_pf(1, 6, kind, xr, wr, K, out, p);
                break;
            case 2:
                ftile_pf(2, 6, kind, xr, wr, K, out, p);
                break;
            case 3:
                ftile_pf(3, 6, kind, xr, wr, K, out, p);
                break;
            default:
                ftile_pf(4, 6, kind, xr, wr, K, out, p);
                break;
            }
            store_tile(mm->y + m * mm->ldy + n, mm->ldy, out, NR, mr, nr);
            m += mr;
        }
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
        for (; k + 16 <= K; k += 16)
            _mm512_store_ps(dst + k, wload(kind, src, k));
        if (k < K) _mm512_store_ps(dst + k, wloadz(kind, src, k, (__mmask16)((1u << (K - k)) - 1)));
    }
}

/* K above this is processed in chunks of FP_KC, so that a panel chunk and the x rows
 * of a tile stay in L1 (48 KiB on Zen 5). */
#define FP_KC 1024
#define FP_KBLOCK_MIN 1024
/* x rows per block when K is chunked; the saved accumulators take FP_MB_CHUNKED * FP_NR
 * vectors. */
#define FP_MB_CHUNKED 96

INLINE void fpacked(const cpu__mm *mm, int kind, int n0, int n1, float *panel)
{
    /* Panel rows one cache line longer than needed, so that they do not all map to the
     * same L1 sets when K is a power of two. */
    const int K = mm->K, M = mm->M, Kp = TD_ALIGN_UP(K, 16) + 16;
    const bool chunked = K > FP_KBLOCK_MIN;
    const int kc = chunked ? FP_KC : K;
    /* Rows of x per block: the block's whole K stays in ~512 KiB of L2 across all the
     * panels (every chunk of K is used for each panel). */
    int mb_rows = (int)TD_MAX((size_t)FP_MR, (512u << 10) / ((size_t)K * 4) / FP_MR * FP_MR);
    if (chunked) mb_rows = TD_MIN(mb_rows, FP_MB_CHUNKED);
    __m512 *save = (__m512 *)(void *)(panel + (size_t)FP_NR * Kp);
    float out[TD_ALIGN_UP(FP_MR * FP_NR, 16)] __attribute__((aligned(64)));
    const void *wr[FP_NR];
    for (int j = 0; j < FP_NR; j++)
        wr[j] = panel + (size_t)j * Kp;
    for (int mb = 0; mb < M; mb += mb_rows) {
        int me = TD_MIN(M, mb + mb_rows);
        for (int n = n0; n < n1; n += FP_NR) {
            int nr = TD_MIN(FP_NR, n1 - n);
            fpack(kind, mm, n, nr, panel, Kp);
            /* Spread over every k step of every tile of this panel. */
            panel_prefetch pp;
            panel_prefetch_init(&pp, mm, n + FP_NR, TD_MIN(FP_NR, n1 - n - FP_NR),
                                (me - mb + FP_MR - 1) / FP_MR * (K / 16 + 1));
            for (int k0 = 0; k0 < K; k0 += kc) {
                int k1 = TD_MIN(K, k0 + kc);
                for (int m = mb; m < me; m += FP_MR) {
                    int mr = TD_MIN(FP_MR, me - m);
                    const float *xr[FP_MR] = {0};
                    for (int i = 0; i < FP_MR; i++)
                        xr[i] = mm->x + (m + TD_MIN(i, mr - 1)) * mm->ldx;
                    __m512 *sv = save + (size_t)(m - mb) * FP_NR;
                    switch (mr) {
                    case 4:
                        ftile_chunk(4, FP_NR, xr, wr, k0, k1, K, sv, out, &pp);
                        break;
                    case 3:
                        ftile_chunk(3, FP_NR, xr, wr, k0, k1, K, sv, out, &pp);
                        break;
                    case 2:
                        ftile_chunk(2, FP_NR, xr, wr, k0, k1, K, sv, out, &pp);
                        break;
                    default:
                        ftile_chunk(1, FP_NR, xr, wr, k0, k1, K, sv, out, &pp);
                        break;
                    }
                    if (k1 == K) store_tile(mm->y + m * mm->ldy + n, mm->ldy, out, FP_NR, mr, nr);
                }
            }
        }
    }
}

/* From this M on, a packed panel (aligned, widened once, reused by every x tile from
 * L1) beats streaming the weight rows through direct tiles. Measured on Zen 5: f32 ~8;
 * f16/bf16 later, since the direct tiles read half the bytes. */
#define FPACK_MIN_M_F32 8
#define FPACK_MIN_M_F16 12

static void matmul_f32(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < FPACK_MIN_M_F32)
        fdirect(mm, WK_F32, n0, n1);
    else
        fpacked(mm, WK_F32, n0, n1, scratch);
}

static void matmul_f16(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < FPACK_MIN_M_F16)
        fdirect(mm, WK_F16, n0, n1);
    else
        fpacked(mm, WK_F16, n0, n1, scratch);
}

static void matmul_bf16(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    if (mm->M < FPACK_MIN_M_F16)
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
        __m512i v =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                               _mm256_loadu_si256((const __m256i *)(p + sizeof(td_block_q8_0))), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8(-128));
    }
    const uint8_t *p = row + (size_t)b * sizeof(td_block_q4_0) + 2;
    __m256i v =
        _mm256_loadu2_m128i((const __m128i *)(p + sizeof(td_block_q4_0)), (const __m128i *)p);
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
    const __m512i idx0 =
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27);
    const __m512i idx1 =
        _mm512_setr_epi32(4, 12, 5, 13, 6, 14, 7, 15, 20, 28, 21, 29, 22, 30, 23, 31);
    *v0 = _mm512_permutex2var_epi32(e[0], idx0, e[1]);
    *v1 = _mm512_permutex2var_epi32(e[0], idx1, e[1]);
}

/* The f32 values of the fp16 scales of block b of 16 rows (row offsets in vidx). */
INLINE __m512 q_scales(const uint8_t *row0, __m512i vidx, size_t block_bytes, int b)
{
    __m512i g = _mm512_i32gather_epi32(vidx, row0 + (size_t)b * block_bytes, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
}

/* Rows [n, n + 16) (clamped to n1) against x row m: y[m][n .. n + nr). */
INLINE void qdirect_group(const cpu__mm *mm, td_type t, int m, int n, int nr,
                          const uint8_t *const *rows, __m512i vidx, panel_prefetch *pp)
{
    const int nb = mm->K / 32;
    const size_t bb = t == TD_TYPE_Q8_0 ? sizeof(td_block_q8_0) : sizeof(td_block_q4_0);
    const int8_t *xq = mm->xq + (size_t)m * mm->xq_stride;
    const float *xd = mm->xd + (size_t)m * mm->xs_stride;
    const int32_t *xc = mm->xc + (size_t)m * mm->xs_stride;
    __m512 acc = _mm512_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        panel_prefetch_step(pp);
        __m512i xv = _mm512_load_si512(xq + b * 32), r[16], v0, v1;
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            r[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw_pair(t, rows[j], b), xv);
        reduce_q16(r, &v0, &v1);
        v0 = _mm512_add_epi32(v0, _mm512_set1_epi32(xc[b]));
        v1 = _mm512_add_epi32(v1, _mm512_set1_epi32(xc[b + 1]));
        __m512 d0 = _mm512_mul_ps(q_scales(rows[0], vidx, bb, b), _mm512_set1_ps(xd[b]));
        __m512 d1 = _mm512_mul_ps(q_scales(rows[0], vidx, bb, b + 1), _mm512_set1_ps(xd[b + 1]));
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
        __m512 d0 = _mm512_mul_ps(q_scales(rows[0], vidx, bb, b), _mm512_set1_ps(xd[b]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), d0, acc);
    }
    _mm512_mask_storeu_ps(mm->y + (size_t)m * mm->ldy + n, (__mmask16)((1u << nr) - 1), acc);
}

/* Small M: 16 weight rows at a time straight from their blocks, for each x row while
 * they are in L1, fetching the next 16 rows meanwhile. */
INLINE void qdirect(const cpu__mm *mm, td_type t, int n0, int n1)
{
    const size_t rb = mm->w_row_bytes;
    for (int n = n0; n < n1; n += 16) {
        int nr = TD_MIN(16, n1 - n);
        const uint8_t *rows[16];
        int32_t off[16];
        for (int j = 0; j < 16; j++) {
            off[j] = (int32_t)((size_t)TD_MIN(j, nr - 1) * rb);
            rows[j] = mm->w + (size_t)n * rb + off[j];
        }
        __m512i vidx = _mm512_loadu_si512(off);
        panel_prefetch pp;
        panel_prefetch_init(&pp, mm, n + 16, TD_MIN(16, n1 - n - 16), mm->K / 64 + 1);
        for (int m = 0; m < mm->M; m++)
            qdirect_group(mm, t, m, n, nr, rows, vidx, m == 0 ? &pp : NULL);
    }
}

/* ---- quantized weights: large M ------------------------------------------------ */

/*
 * Panel layout, 32 weight rows: cpu_pack's (cpu.h). For block b, CPU__PANEL_BLOCK_BYTES
 * = 8 groups g of 128 bytes: rows 0-15 then rows 16-31, lane j holding bytes 4g..4g+3 of
 * the block (u8) of that row; then the 32 rows' fp16 scales. Weights packed at load time
 * are read in place; others (q4_0, or q8_0 not packed) are repacked here per panel.
 */
#define QP_ROWS CPU__PANEL_ROWS
#define QP_BB CPU__PANEL_BLOCK_BYTES

/* 16 rows of 8 dwords -> 8 vectors of 16 rows (dword g of each). */
INLINE void transpose16x8(const __m256i *y, __m512i *p)
{
    __m512i z[8], t[8], u[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(y[i]), y[i + 8], 1);
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
    const uint8_t *rows[QP_ROWS];
    int32_t off[QP_ROWS];
    for (int j = 0; j < QP_ROWS; j++) {
        off[j] = (int32_t)((size_t)TD_MIN(j, nr - 1) * mm->w_row_bytes);
        rows[j] = mm->w + (size_t)n * mm->w_row_bytes + off[j];
    }
    /* Padding rows repeat the last row; their outputs are never stored. */
    const __m512i vidx0 = _mm512_loadu_si512(off), vidx1 = _mm512_loadu_si512(off + 16);
    for (int b = 0; b < nb; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i y[16];
            __m512i p[8];
            if (t == TD_TYPE_Q8_0) {
                /* Raw loads (folded into the transpose's inserts), then q + 128 on 8 vectors
                 * instead of 16. */
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++)
                    y[j] = _mm256_loadu_si256(
                        (const __m256i *)(rows[16 * h + j] + (size_t)b * bb + 2));
                transpose16x8(y, p);
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++)
                    p[g] = _mm512_xor_si512(p[g], _mm512_set1_epi8(-128));
            } else {
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++)
                    y[j] = qw_block(t, rows[16 * h + j], b);
                transpose16x8(y, p);
            }
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++)
                _mm512_store_si512(panel + (size_t)b * QP_BB + g * 128 + h * 64, p[g]);
        }
        /* The fp16 scales as they are (gathered 32 bits per row, low half kept). */
        uint8_t *ps = panel + (size_t)b * QP_BB + CPU__PANEL_SCALES;
        _mm256_store_si256((__m256i *)ps, _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(
                                              vidx0, rows[0] + (size_t)b * bb, 1)));
        _mm256_store_si256((__m256i *)(ps + 32), _mm512_cvtepi32_epi16(_mm512_i32gather_epi32(
                                                     vidx1, rows[0] + (size_t)b * bb, 1)));
    }
}

#define QT_MAXM 6

/* MR rows of x against a 32-row panel: out[m][v] = y[m][16v .. 16v + 15]. */
INLINE void qtile(int MR, const cpu__mm *mm, int m0, const uint8_t *panel, __m512 out[][2],
                  panel_prefetch *pp, bool l2)
{
    const int nb = mm->K / 32;
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
    for (int m = 0; m < MR; m++)
        facc[m][0] = facc[m][1] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *pb = panel + (size_t)b * QP_BB;
        __m512i iacc[QT_MAXM][2];
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++)
            iacc[m][0] = iacc[m][1] = _mm512_set1_epi32(xc[m][b]);
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            panel_prefetch_step_to(pp, l2);
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
        /* fp16 -> f32 is exact, so these are the same values the direct path uses. */
        __m512 dw0 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(pb + CPU__PANEL_SCALES)));
        __m512 dw1 =
            _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(pb + CPU__PANEL_SCALES + 32)));
#pragma GCC unroll 6
        for (int m = 0; m < MR; m++) {
            __m512 dx = _mm512_set1_ps(xd[m][b]);
            facc[m][0] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][0]), _mm512_mul_ps(dw0, dx), facc[m][0]);
            facc[m][1] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m][1]), _mm512_mul_ps(dw1, dx), facc[m][1]);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MR; m++) {
        out[m][0] = facc[m][0];
        out[m][1] = facc[m][1];
    }
}

/* qtile for mr rows (1 to QT_MAXM); l2 a constant at each call (panel_prefetch_step_to). */
INLINE void qtile_mr(int mr, const cpu__mm *mm, int m0, const uint8_t *panel, __m512 out[][2],
                     panel_prefetch *pp, bool l2)
{
    switch (mr) {
    case 6:
        qtile(6, mm, m0, panel, out, pp, l2);
        break;
    case 5:
        qtile(5, mm, m0, panel, out, pp, l2);
        break;
    case 4:
        qtile(4, mm, m0, panel, out, pp, l2);
        break;
    case 3:
        qtile(3, mm, m0, panel, out, pp, l2);
        break;
    case 2:
        qtile(2, mm, m0, panel, out, pp, l2);
        break;
    default:
        qtile(1, mm, m0, panel, out, pp, l2);
        break;
    }
}

/* scratch: room for one panel; unused when the weight is packed already. */
INLINE void qpacked(const cpu__mm *mm, td_type t, int n0, int n1, uint8_t *scratch)
{
    const int K = mm->K, M = mm->M;
    int mb_rows = (int)TD_MAX((size_t)QT_MAXM, (512u << 10) / (size_t)K / QT_MAXM * QT_MAXM);
    /* The next panel into the L2 for decode batches of 2 to 64 rows (q8_0, one thread:
     * batch 4 +8-16%, batch 8 +22-26%), into the L1 at batch 1 (-7% with the L2) and for
     * prefill chunks (pp512 -3 to -8% with the L2). BENCHMARKS.md. */
    const bool l2 = M >= 2 && M <= 64;
    for (int mb = 0; mb < M; mb += mb_rows) {
        int me = TD_MIN(M, mb + mb_rows);
        for (int n = n0; n < n1; n += QP_ROWS) {
            int nr = TD_MIN(QP_ROWS, n1 - n);
            const uint8_t *panel = scratch;
            if (mm->packed)
                panel = mm->w + (size_t)n * mm->w_row_bytes;
            else
                qpack(t, mm, n, nr, scratch);
            __mmask16 k0 = (__mmask16)(nr >= 16 ? 0xffff : (1u << nr) - 1);
            __mmask16 k1 = (__mmask16)(nr >= 32 ? 0xffff : nr <= 16 ? 0 : (1u << (nr - 16)) - 1);
            /* Tiles of at most QT_MAXM rows, sized evenly (32 rows: 6,6,5,5,5,5). */
            int n_tiles = (me - mb + QT_MAXM - 1) / QT_MAXM;
            panel_prefetch pp;
            panel_prefetch_init(&pp, mm, n + QP_ROWS, TD_MIN(QP_ROWS, n1 - n - QP_ROWS),
                                n_tiles * (mm->K / 32) * 8);
            for (int m = mb, ti = 0; m < me; ti++) {
                int mr = (me - m + (n_tiles - ti) - 1) / (n_tiles - ti);
                __m512 out[QT_MAXM][2];
                if (l2)
                    qtile_mr(mr, mm, m, panel, out, &pp, true);
                else
                    qtile_mr(mr, mm, m, panel, out, &pp, false);
                for (int i = 0; i < mr; i++) {
                    float *y = mm->y + (size_t)(m + i) * mm->ldy + n;
                    _mm512_mask_storeu_ps(y, k0, out[i][0]);
                    _mm512_mask_storeu_ps(y + 16, k1, out[i][1]);
                }
                m += mr;
            }
        }
    }
}

#define QPACK_MIN_M 4

static void matmul_q8_0(const cpu__mm *mm, int n0, int n1, void *scratch)
{
    /* Packed at load time: the panel tiles serve every M (for M = 1 they need no
     * horizontal reduction, unlike the direct path). */
    if (mm->M < QPACK_MIN_M && !mm->packed)
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
    case TD_TYPE_F32:
        matmul_f32(mm, n0, n1, scratch);
        break;
    case TD_TYPE_F16:
        matmul_f16(mm, n0, n1, scratch);
        break;
    case TD_TYPE_BF16:
        matmul_bf16(mm, n0, n1, scratch);
        break;
    case TD_TYPE_Q8_0:
        matmul_q8_0(mm, n0, n1, scratch);
        break;
    case TD_TYPE_Q4_0:
        matmul_q4_0(mm, n0, n1, scratch);
        break;
    default:
        TD_ASSERT(!"unsupported weight type");
    }
}

size_t cpu__avx512_matmul_scratch(td_type wtype, int M, int K)
{
    (void)M;
    if (cpu__is_quantized(wtype)) return (size_t)(K / 32) * QP_BB;
    return (size_t)FP_NR * (TD_ALIGN_UP((size_t)K, 16) + 16) * 4 +
           (size_t)FP_MB_CHUNKED * FP_NR * 64;
}
