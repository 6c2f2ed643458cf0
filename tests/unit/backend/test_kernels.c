/*
 * Unit tests for backend/cpu: every kernel on every ISA this CPU supports, against
 * plain C references (double precision where a bound is stated), the exact scalar
 * conversions of model/types.c, and the batch-invariance contract of cpu_matmul.
 *
 * Error bounds (u = 2^-24):
 *  - float matmul, dot products: |y - exact| <= (K/4 + 8) u sum_k |x_k w_k|. A lane
 *    layout of L lanes with fused multiply-adds has error below (K/L + 4) u sum|x w|;
 *    the bound covers L = 8 and the generic code's separate multiply and add.
 *  - quantized matmul: x is quantized exactly as td_quant_row_ref (checked by
 *    equality of the integer results), so |y - exact| <= (nb + 4) u sum_b |S_b dx_b dw_b|
 *    over the nb blocks, exact being the double sum of the exact integer block sums.
 *  - rmsnorm, softmax, silu: relative 1e-5 against double references.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_impl.h"
#include "util/pool.h"

static const double U = 1.0 / 16777216.0;

static float *rand_floats(td_rng *rng, size_t n, float scale)
{
    float *v = td_xmalloc(n * sizeof(float) + 64);
    for (size_t i = 0; i < n; i++)
        v[i] = (2.0f * td_rng_float(rng) - 1.0f) * scale;
    return v;
}

static cpu_isa best_isa;

/* Run the body once per ISA the CPU supports; the last pass leaves the best one set. */
#define FOR_EACH_ISA(isa)                                                                          \
    for (int isa = 0; isa <= (int)best_isa && cpu_set_isa((cpu_isa)isa) == 0; isa++)

/* The kernel tables of the ISAs this CPU runs (the generic one first). */
static int isa_tables(const cpu__kernels **out)
{
    int n = 0;
    out[n++] = &cpu__generic;
#if defined(__x86_64__)
    if (best_isa >= CPU_ISA_AVX2) out[n++] = &cpu__avx2;
    if (best_isa >= CPU_ISA_AVX512) out[n++] = &cpu__avx512;
#endif
    return n;
}

/* ---- conversions ------------------------------------------------------------------ */

static void test_f16_bf16_exhaustive(void **state)
{
    (void)state;
    uint16_t *h = td_xmalloc(65536 * 2), *back = td_xmalloc(65536 * 2);
    float *f = td_xmalloc(65536 * 4);
    for (int i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    FOR_EACH_ISA(isa)
    {
        cpu_dequant_row(TD_TYPE_F16, h, f, 65536);
        for (int i = 0; i < 65536; i++) {
            float r = td_fp16_to_f32((uint16_t)i);
            if (memcmp(&r, &f[i], 4) != 0)
                fail_msg("isa %d f16 %04x -> %08x", isa, i, *(uint32_t *)&f[i]);
        }
        cpu_quant_row(TD_TYPE_F16, f, back, 65536);
        for (int i = 0; i < 65536; i++)
            if (back[i] != td_f32_to_fp16(f[i])) fail_msg("isa %d f16 round trip %04x", isa, i);
        cpu_dequant_row(TD_TYPE_BF16, h, f, 65536);
        for (int i = 0; i < 65536; i++) {
            float r = td_bf16_to_f32((uint16_t)i);
            if (memcmp(&r, &f[i], 4) != 0) fail_msg("isa %d bf16 %04x", isa, i);
        }
        cpu_quant_row(TD_TYPE_BF16, f, back, 65536);
        for (int i = 0; i < 65536; i++)
            if (back[i] != td_f32_to_bf16(f[i])) fail_msg("isa %d bf16 round trip %04x", isa, i);
        /* Odd lengths exercise the tails. */
        cpu_dequant_row(TD_TYPE_F16, h + 31744, f, 37);
        for (int i = 0; i < 37; i++) {
            float r = td_fp16_to_f32(h[31744 + i]);
            assert_memory_equal(&r, &f[i], 4);
        }
    }
    free(h);
    free(back);
    free(f);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f32 -> f16, bf16, fp8 on a spread of bit patterns (every exponent, random and
 * halfway mantissas, NaNs, infinities, subnormals), all compared with types.c. */
static void test_narrowing_patterns(void **state)
{
    (void)state;
    enum { N = 1 << 18 };
    float *src = td_xmalloc(N * 4);
    uint16_t *h = td_xmalloc(N * 2);
    uint8_t *q = td_xmalloc(N);
    td_rng rng;
    td_rng_seed(&rng, 11);
    for (int i = 0; i < N; i++) {
        uint32_t r = (uint32_t)td_rng_next(&rng);
        uint32_t exp = (uint32_t)(i >> 8) & 0xff, low;
        switch (i & 7) {
        case 0:
            low = r & 0x7fffff;
            break;
        case 1:
            low = (r & 0x7fe000) | 0x1000;
            break; /* f16 halfway */
        case 2:
            low = (r & 0x7f0000) | 0x8000;
            break; /* bf16 halfway */
        case 3:
            low = (r & 0x700000) | 0x80000;
            break; /* fp8 halfway */
        case 4:
            low = (r & 0x700000) | 0x7ffff;
            break;
        case 5:
            low = 0;
            break;
        default:
            low = r & 0x7fffff;
            exp = (r >> 23) & 0xff;
            break;
        }
        src[i] = bits_f32((r & 0x80000000u) | (exp << 23) | low);
    }
    FOR_EACH_ISA(isa)
    {
        cpu_quant_row(TD_TYPE_F16, src, h, N);
        for (int i = 0; i < N; i++)
            if (h[i] != td_f32_to_fp16(src[i]))
                fail_msg("isa %d f16(%08x) = %04x want %04x", isa, f32_bits(src[i]), h[i],
                         td_f32_to_fp16(src[i]));
        cpu_quant_row(TD_TYPE_BF16, src, h, N);
        for (int i = 0; i < N; i++)
            if (h[i] != td_f32_to_bf16(src[i]))
                fail_msg("isa %d bf16(%08x)", isa, f32_bits(src[i]));
        cpu_quant_row(TD_TYPE_FP8_E4M3, src, q, N - 3);
        for (int i = 0; i < N - 3; i++)
            if (q[i] != td_f32_to_fp8e4m3(src[i]))
                fail_msg("isa %d fp8(%08x) = %02x want %02x", isa, f32_bits(src[i]), q[i],
                         td_f32_to_fp8e4m3(src[i]));
    }
    free(src);
    free(h);
    free(q);
}

static void test_fp8_exhaustive(void **state)
{
    (void)state;
    uint8_t b[256], back[256];
    float f[256];
    for (int i = 0; i < 256; i++)
        b[i] = (uint8_t)i;
    FOR_EACH_ISA(isa)
    {
        cpu_dequant_row(TD_TYPE_FP8_E4M3, b, f, 256);
        for (int i = 0; i < 256; i++) {
            float r = td_fp8e4m3_to_f32((uint8_t)i);
            if (memcmp(&r, &f[i], 4) != 0) fail_msg("isa %d fp8 %02x", isa, i);
        }
        cpu_quant_row(TD_TYPE_FP8_E4M3, f, back, 256);
        for (int i = 0; i < 256; i++)
            if (back[i] != td_f32_to_fp8e4m3(f[i])) fail_msg("isa %d fp8 round trip %02x", isa, i);
        /* Every value between two neighbours, and the midpoints themselves. */
        for (int i = 0; i < 0x7e; i++) {
            float lo = td_fp8e4m3_to_f32((uint8_t)i), hi = td_fp8e4m3_to_f32((uint8_t)(i + 1));
            float v[4] = {lo + (hi - lo) * 0.5f, -(lo + (hi - lo) * 0.5f),
                          nextafterf(lo + (hi - lo) * 0.5f, 0),
                          nextafterf(lo + (hi - lo) * 0.5f, 1000)};
            uint8_t o[4];
            cpu_quant_row(TD_TYPE_FP8_E4M3, v, o, 4);
            for (int j = 0; j < 4; j++)
                assert_int_equal(o[j], td_f32_to_fp8e4m3(v[j]));
        }
    }
}

static void test_block_quant(void **state)
{
    (void)state;
    enum { N = 32 * 40 };
    td_rng rng;
    td_rng_seed(&rng, 5);
    float *x = rand_floats(&rng, N, 3.0f);
    /* Halfway cases: amax 127 makes the scale 1, so x.5 must round away from zero. */
    for (int j = 0; j < 32; j++)
        x[j] = (j == 0) ? 127.0f : (float)(j - 16) + 0.5f;
    for (int j = 32; j < 64; j++)
        x[j] = 0.0f;
    x[64] = -1e-30f;
    float *back = td_xmalloc(N * 4), *ref = td_xmalloc(N * 4);
    td_block_q8_0 q[N / 32], qr[N / 32];
    td_block_q4_0 q4[N / 32];
    td_quant_row_ref(TD_TYPE_Q8_0, x, qr, N);
    td_quant_row_ref(TD_TYPE_Q4_0, x, q4, N);
    FOR_EACH_ISA(isa)
    {
        cpu_quant_row(TD_TYPE_Q8_0, x, q, N);
        assert_memory_equal(q, qr, sizeof(q));
        cpu_dequant_row(TD_TYPE_Q8_0, q, back, N);
        td_dequant_row_ref(TD_TYPE_Q8_0, q, ref, N);
        assert_memory_equal(back, ref, N * 4);
        cpu_dequant_row(TD_TYPE_Q4_0, q4, back, N);
        td_dequant_row_ref(TD_TYPE_Q4_0, q4, ref, N);
        assert_memory_equal(back, ref, N * 4);
        cpu_quant_row(TD_TYPE_F32, x, back, N);
        assert_memory_equal(back, x, N * 4);
    }
    free(x);
    free(back);
    free(ref);
}

/* ---- matmul ------------------------------------------------------------------------ */

typedef struct {
    td_type t;
    int N, K;
    size_t row_bytes;
    uint8_t *w;
} weights;

static weights make_weights(td_rng *rng, td_type t, int N, int K)
{
    weights w = {.t = t, .N = N, .K = K};
    /* Rows padded by 4 bytes, so that rows are not 64-byte aligned (as in GGUF files). */
    w.row_bytes = td_row_bytes(t, K) + 4;
    w.w = td_xcalloc((size_t)N, w.row_bytes);
    float *row = td_xmalloc((size_t)K * 4);
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++)
            row[k] = (2.0f * td_rng_float(rng) - 1.0f) * (n % 3 ? 1.0f : 0.01f);
        td_quant_row_ref(t, row, w.w + (size_t)n * w.row_bytes, K);
    }
    free(row);
    return w;
}

/* y - exact and the bound, for one output. */
static void check_output(const weights *w, const float *x, float y, int m, int n, const char *what)
{
    const int K = w->K;
    const uint8_t *row = w->w + (size_t)n * w->row_bytes;
    double exact = 0, mag = 0, bound;
    if (w->t == TD_TYPE_Q8_0 || w->t == TD_TYPE_Q4_0) {
        int nb = K / 32;
        td_block_q8_0 *xq = td_xmalloc(sizeof(td_block_q8_0) * (size_t)nb);
        float *wf = td_xmalloc((size_t)K * 4);
        td_quant_row_ref(TD_TYPE_Q8_0, x, xq, K);
        td_dequant_row_ref(w->t, row, wf, K);
        size_t bb = (size_t)td_type_block_bytes(w->t);
        for (int b = 0; b < nb; b++) {
            uint16_t dh;
            memcpy(&dh, row + b * bb, 2);
            double dw = td_fp16_to_f32(dh), dx = td_fp16_to_f32(xq[b].d);
            double s = 0;
            /* wf = dw * q exactly, so q = wf / dw. */
            for (int j = 0; j < 32; j++)
                s += (double)xq[b].qs[j] * (dw != 0 ? (double)wf[b * 32 + j] / dw : 0);
            exact += s * dx * dw;
            mag += fabs(s * dx * dw);
        }
        bound = (nb + 4) * U * mag + 1e-30;
        free(xq);
        free(wf);
    } else {
        float *wf = td_xmalloc((size_t)K * 4);
        td_dequant_row_ref(w->t, row, wf, K);
        for (int k = 0; k < K; k++) {
            exact += (double)x[k] * wf[k];
            mag += fabs((double)x[k] * wf[k]);
        }
        bound = (K / 4.0 + 8) * U * mag + 1e-30;
        free(wf);
    }
    if (!(fabs((double)y - exact) <= bound))
        fail_msg("%s %s m=%d n=%d K=%d: y=%.9g exact=%.9g bound=%.3g isa=%s", what,
                 td_type_name(w->t), m, n, K, y, exact, bound, cpu_isa_name(cpu_get_isa()));
}

/*
 * cpu_matmul; for types with a packed layout, also the same product from the packed
 * weight (packed in two row ranges, as threads would), which must match bit for bit.
 */
static void run_matmul(td_pool *pool, const weights *w, float *y, int64_t ldy, const float *x,
                       int64_t ldx, int M)
{
    size_t sz = cpu_matmul_scratch_size(w->t, M, w->K, td_pool_size(pool));
    void *scratch = td_aligned_alloc(sz);
    cpu_matmul(pool, y, ldy, x, ldx, w->w, w->row_bytes, w->t, M, w->N, w->K, scratch);
    if (cpu_pack_supported(w->t) && w->N > 0) {
        size_t rb = td_row_bytes(w->t, w->K);
        uint8_t *p = td_aligned_alloc(cpu_pack_bytes(w->t, w->N, w->K));
        memset(p, 0xa5, cpu_pack_bytes(w->t, w->N, w->K));
        int64_t mid = TD_MIN((int64_t)w->N, 32);
        cpu_pack_rows(w->t, p, w->w, w->row_bytes, w->N, w->K, 0, mid);
        if (mid < w->N) cpu_pack_rows(w->t, p, w->w, w->row_bytes, w->N, w->K, mid, w->N);
        float *yp = td_xmalloc(sizeof(float) * (size_t)M * (size_t)ldy);
        memset(yp, 0xff, sizeof(float) * (size_t)M * (size_t)ldy);
        cpu_mm_out o = {.y = yp, .ldy = ldy, .w = p, .w_row_bytes = rb, .N = w->N, .packed = true};
        cpu_matmul_multi(pool, &o, 1, x, ldx, w->t, M, w->K, scratch);
        for (int m = 0; m < M; m++)
            if (memcmp(yp + m * ldy, y + m * ldy, sizeof(float) * (size_t)w->N) != 0)
                fail_msg("%s packed differs: M=%d N=%d K=%d row %d isa=%s", td_type_name(w->t), M,
                         w->N, w->K, m, cpu_isa_name(cpu_get_isa()));
        free(yp);
        td_aligned_free(p);
    }
    td_aligned_free(scratch);
}

static const td_type all_types[] = {TD_TYPE_F32, TD_TYPE_F16, TD_TYPE_BF16, TD_TYPE_Q8_0,
                                    TD_TYPE_Q4_0};

/*
 * The activations' q8_0 quantization of every ISA (the int8 matmuls' x) equals the plain
 * C one bit for bit: quantized values, fp16 scales and the offset sums, for row lengths
 * around the 16-block groups of the AVX-512 version, with an all-zero block, subnormal
 * and huge values, and halfway cases (x * 127 / amax landing on k + 0.5).
 */
static void test_quant_x_exact(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 11);
    const cpu__kernels *k[3];
    int nk = isa_tables(k);
    static const int Ks[] = {32, 64, 480, 512, 544, 768, 1056, 2048};
    enum { KMAX = 2048 };
    float *x = td_xmalloc(sizeof(float) * KMAX);
    int8_t q0[KMAX], q1[KMAX];
    float d0[KMAX / 32], d1[KMAX / 32];
    int32_t c0[KMAX / 32], c1[KMAX / 32];
    for (size_t ki = 0; ki < TD_ARRAY_LEN(Ks); ki++) {
        int K = Ks[ki];
        for (int round = 0; round < 40; round++) {
            for (int i = 0; i < K; i++)
                x[i] = (2.0f * td_rng_float(&rng) - 1.0f) * 4.0f;
            int b = (int)(td_rng_float(&rng) * (float)(K / 32));
            switch (round % 5) {
            case 1:
                memset(x + b * 32, 0, 32 * sizeof(float));
                break;
            case 2: /* tiny, some subnormal (1/d stays finite: the reference casts it) */
                for (int j = 0; j < 32; j++)
                    x[b * 32 + j] *= j % 4 ? 1e-30f : 1e-40f;
                break;
            case 3:
                for (int j = 0; j < 32; j++)
                    x[b * 32 + j] *= 1e30f;
                break;
            case 4: /* amax 127: x * id = x, so these are exact halves */
                for (int j = 0; j < 32; j++)
                    x[b * 32 + j] = (float)(j - 16) + 0.5f;
                x[b * 32 + 31] = -127.0f;
                break;
            }
            for (int offset = 0; offset <= 128; offset += 120) {
                cpu__quant_x_ref(x, K, offset, q0, d0, c0);
                for (int t = 1; t < nk; t++) {
                    memset(q1, 0x55, sizeof(q1));
                    k[t]->quant_x(x, K, offset, q1, d1, c1);
                    if (memcmp(q0, q1, (size_t)K) || memcmp(d0, d1, sizeof(float) * (K / 32)) ||
                        memcmp(c0, c1, sizeof(int32_t) * (K / 32)))
                        fail_msg("quant_x of table %d differs from the reference: K=%d round %d", t,
                                 K, round);
                }
            }
        }
    }
    free(x);
}

static void test_matmul_accuracy(void **state)
{
    td_pool *pool = *state;
    td_rng rng;
    td_rng_seed(&rng, 1);
    static const int Ms[] = {1, 2, 3, 5, 17, 33};
    static const int Ns[] = {1, 13, 33, 70};
    static const int Kf[] = {1, 15, 17, 64, 100, 800, 2100, 4096};
    static const int Kq[] = {32, 64, 96, 800, 4096};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(all_types); ti++) {
        td_type t = all_types[ti];
        bool q = t == TD_TYPE_Q8_0 || t == TD_TYPE_Q4_0;
        const int *Ks = q ? Kq : Kf;
        size_t nK = q ? TD_ARRAY_LEN(Kq) : TD_ARRAY_LEN(Kf);
        for (size_t ki = 0; ki < nK; ki++) {
            int K = Ks[ki];
            weights w = make_weights(&rng, t, 70, K);
            float *x = rand_floats(&rng, (size_t)33 * (K + 3), 1.0f);
            float *y = td_xmalloc(sizeof(float) * 33 * 75);
            for (size_t mi = 0; mi < TD_ARRAY_LEN(Ms); mi++) {
                for (size_t ni = 0; ni < TD_ARRAY_LEN(Ns); ni++) {
                    int M = Ms[mi], N = Ns[ni];
                    /* Long rows: fewer shapes, but both the direct and the (K-chunked) packed
                     * paths. */
                    if (K >= 2048 && (M == 2 || M == 3 || M == 17 || N == 1 || N == 70)) continue;
                    weights wn = w;
                    wn.N = N;
                    FOR_EACH_ISA(isa)
                    {
                        memset(y, 0xff, sizeof(float) * 33 * 75);
                        run_matmul(pool, &wn, y, 75, x, K + 3, M);
                        for (int m = 0; m < M; m++) {
                            for (int n = 0; n < N; n++)
                                check_output(&wn, x + m * (K + 3), y[m * 75 + n], m, n, "matmul");
                            for (int n = N; n < 75; n++)
                                assert_true(isnan(y[m * 75 + n])); /* untouched */
                        }
                    }
                }
            }
            /* The plain-C reference obeys the same bounds. */
            cpu_matmul_ref(y, 75, x, K + 3, w.w, w.row_bytes, t, 3, 13, K);
            for (int m = 0; m < 3; m++)
                for (int n = 0; n < 13; n++)
                    check_output(&w, x + m * (K + 3), y[m * 75 + n], m, n, "ref");
            free(w.w);
            free(x);
            free(y);
        }
    }
}

/* Rows of one M = 37 call equal M = 1 calls and other batch shapes bit for bit, for
 * 1, 2 and 3 threads. */
static void test_matmul_batch_invariance(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 2);
    td_pool *pools[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(td_pool_create(&pools[i], i + 1, false, NULL), 0);
    enum { M = 37, N = 101 };
    for (size_t ti = 0; ti < 2 * TD_ARRAY_LEN(all_types); ti++) {
        td_type t = all_types[ti % TD_ARRAY_LEN(all_types)];
        bool q = t == TD_TYPE_Q8_0 || t == TD_TYPE_Q4_0;
        /* Second pass: an odd number of blocks (q), a K tail and K chunking (float). */
        const int K = ti < TD_ARRAY_LEN(all_types) ? 800 : q ? 96 : 2100;
        weights w = make_weights(&rng, t, N, K);
        float *x = rand_floats(&rng, (size_t)M * K, 2.0f);
        float *big = td_xmalloc(sizeof(float) * M * N), *other = td_xmalloc(sizeof(float) * M * N);
        FOR_EACH_ISA(isa)
        {
            run_matmul(pools[0], &w, big, N, x, K, M);
            for (int p = 0; p < 3; p++) {
                /* Same batch, other thread counts. */
                run_matmul(pools[p], &w, other, N, x, K, M);
                if (memcmp(big, other, sizeof(float) * M * N) != 0)
                    fail_msg("%s isa %d: M=%d differs with %d threads", td_type_name(t), isa, M,
                             p + 1);
                /* Each row alone. */
                for (int m = 0; m < M; m += 1 + p) {
                    float row[N];
                    run_matmul(pools[p], &w, row, N, x + (size_t)m * K, K, 1);
                    if (memcmp(row, big + m * N, sizeof(row)) != 0)
                        fail_msg("%s isa %d: row %d differs at M=1, %d threads", td_type_name(t),
                                 isa, m, p + 1);
                }
                /* Sub-batches at other offsets and sizes (tile edges move). */
                static const int sub[][2] = {{3, 2}, {5, 5}, {0, 17}, {11, 26}, {4, 33}};
                for (size_t s = 0; s < TD_ARRAY_LEN(sub); s++) {
                    int off = sub[s][0], cnt = sub[s][1];
                    run_matmul(pools[p], &w, other, N, x + (size_t)off * K, K, cnt);
                    if (memcmp(other, big + off * N, sizeof(float) * (size_t)cnt * N) != 0)
                        fail_msg("%s isa %d: rows %d..%d differ in a batch of %d", td_type_name(t),
                                 isa, off, off + cnt, cnt);
                }
            }
        }
        free(w.w);
        free(x);
        free(big);
        free(other);
    }
    for (int i = 0; i < 3; i++)
        td_pool_free(pools[i]);
}

/* cpu_matmul_multi: each output equals its own cpu_matmul call bit for bit, whatever
 * the thread count, with output sizes that do not fill the scheduling grain. */
static void test_matmul_multi(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 3);
    td_pool *pools[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(td_pool_create(&pools[i], i + 1, false, NULL), 0);
    enum { MMAX = 37, NOUT = 3 };
    static const int Ns[NOUT] = {101, 40, 230};
    static const int Ms[] = {1, 5, MMAX};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(all_types); ti++) {
        td_type t = all_types[ti];
        const int K = 96;
        weights w[NOUT];
        float *want[NOUT], *got[NOUT];
        cpu_mm_out outs[NOUT];
        for (int i = 0; i < NOUT; i++) {
            w[i] = make_weights(&rng, t, Ns[i], K);
            want[i] = td_xmalloc(sizeof(float) * MMAX * Ns[i]);
            got[i] = td_xmalloc(sizeof(float) * MMAX * Ns[i]);
            outs[i] = (cpu_mm_out){.y = got[i], .ldy = Ns[i], .w = w[i].w,
                                   .w_row_bytes = w[i].row_bytes, .N = Ns[i]};
        }
        float *x = rand_floats(&rng, (size_t)MMAX * K, 2.0f);
        FOR_EACH_ISA(isa)
        {
            for (size_t mi = 0; mi < TD_ARRAY_LEN(Ms); mi++) {
                int M = Ms[mi];
                for (int i = 0; i < NOUT; i++) run_matmul(pools[0], &w[i], want[i], Ns[i], x, K, M);
                for (int p = 0; p < 3; p++) {
                    size_t sz = cpu_matmul_scratch_size(t, M, K, p + 1);
                    void *scratch = td_aligned_alloc(sz);
                    for (int i = 0; i < NOUT; i++)
                        memset(got[i], 0xff, sizeof(float) * MMAX * Ns[i]);
                    cpu_matmul_multi(pools[p], outs, NOUT, x, K, t, M, K, scratch);
                    td_aligned_free(scratch);
                    for (int i = 0; i < NOUT; i++)
                        if (memcmp(want[i], got[i], sizeof(float) * (size_t)M * Ns[i]) != 0)
                            fail_msg("%s isa %d: output %d of a multi matmul differs (M=%d, %d "
                                     "threads)", td_type_name(t), isa, i, M, p + 1);
                }
            }
        }
        for (int i = 0; i < NOUT; i++) {
            free(w[i].w);
            free(want[i]);
            free(got[i]);
        }
        free(x);
    }
    for (int i = 0; i < 3; i++)
        td_pool_free(pools[i]);
}

/* ---- row kernels ------------------------------------------------------------------- */

static void test_row_kernels(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 3);
    static const int ns[] = {1, 7, 16, 31, 64, 100, 768, 2049};
    for (size_t ni = 0; ni < TD_ARRAY_LEN(ns); ni++) {
        int n = ns[ni];
        float *x = rand_floats(&rng, (size_t)n, 4.0f), *w = rand_floats(&rng, (size_t)n, 1.0f);
        float *up = rand_floats(&rng, (size_t)n, 1.0f),
              *out = td_xmalloc(sizeof(float) * (size_t)n + 64);
        FOR_EACH_ISA(isa)
        {
            double ss = 0;
            for (int i = 0; i < n; i++)
                ss += (double)x[i] * x[i];
            double scale = 1.0 / sqrt(ss / n + 1e-5);
            cpu_rmsnorm(out, x, w, n, 1e-5f);
            for (int i = 0; i < n; i++)
                assert_true(fabs(out[i] - x[i] * scale * w[i]) <=
                            1e-5 * fabs(x[i] * scale * w[i]) + 1e-30);
            memcpy(out, x, sizeof(float) * (size_t)n);
            cpu_rmsnorm(out, out, w, n, 1e-5f); /* in place */
            for (int i = 0; i < n; i++)
                assert_true(fabs(out[i] - x[i] * scale * w[i]) <=
                            1e-5 * fabs(x[i] * scale * w[i]) + 1e-30);

            cpu_silu_mul(out, x, up, n);
            for (int i = 0; i < n; i++) {
                double r = x[i] / (1.0 + exp(-(double)x[i])) * up[i];
                if (!(fabs(out[i] - r) <= 1e-5 * fabs(r) + 1e-30))
                    fail_msg("isa %d silu(%g) = %g want %g", isa, x[i], out[i], r);
            }

            memcpy(out, w, sizeof(float) * (size_t)n);
            cpu_add(out, x, n);
            for (int i = 0; i < n; i++)
                assert_true(out[i] == w[i] + x[i]);

            double dot = 0, mag = 0;
            for (int i = 0; i < n; i++) {
                dot += (double)x[i] * w[i];
                mag += fabs((double)x[i] * w[i]);
            }
            assert_true(fabs(cpu_dot_f32(x, w, n) - dot) <= (n / 4.0 + 8) * U * mag);

            memcpy(out, x, sizeof(float) * (size_t)n);
            if (n > 3) out[3] = -INFINITY;
            cpu_softmax(out, n);
            double mx = -INFINITY, sum = 0;
            for (int i = 0; i < n; i++)
                if (!(n > 3 && i == 3)) mx = fmax(mx, x[i]);
            for (int i = 0; i < n; i++)
                if (!(n > 3 && i == 3)) sum += exp(x[i] - mx);
            for (int i = 0; i < n; i++) {
                double r = (n > 3 && i == 3) ? 0.0 : exp(x[i] - mx) / sum;
                if (!(fabs(out[i] - r) <= 1e-5 * r + 1e-30))
                    fail_msg("isa %d softmax n=%d [%d] %g want %g", isa, n, i, out[i], r);
            }
        }
        free(x);
        free(w);
        free(up);
        free(out);
    }
}

static void test_kv_kernels(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 4);
    static const td_type kv_types[] = {TD_TYPE_F32, TD_TYPE_F16, TD_TYPE_BF16, TD_TYPE_FP8_E4M3};
    static const int dims[] = {5, 16, 64, 80, 128, 200};
    enum { CNT = 21 };
    for (size_t ti = 0; ti < TD_ARRAY_LEN(kv_types); ti++) {
        td_type t = kv_types[ti];
        for (size_t di = 0; di < TD_ARRAY_LEN(dims); di++) {
            int n = dims[di];
            size_t stride = td_row_bytes(t, n) + 8; /* KV rows with a gap between them */
            float *q = rand_floats(&rng, (size_t)n, 1.0f),
                  *src = rand_floats(&rng, (size_t)n * CNT, 2.0f);
            float *kf = td_xmalloc(sizeof(float) * (size_t)n * CNT),
                  *a = rand_floats(&rng, CNT, 1.0f);
            uint8_t *kv = td_xcalloc(CNT, stride);
            for (int j = 0; j < CNT; j++) {
                td_quant_row_ref(t, src + j * n, kv + j * stride, n);
                td_dequant_row_ref(t, kv + j * stride, kf + j * n, n);
            }
            float *y0 = rand_floats(&rng, (size_t)n, 1.0f),
                  *y1 = td_xmalloc(sizeof(float) * (size_t)n),
                  *y2 = td_xmalloc(sizeof(float) * (size_t)n);
            FOR_EACH_ISA(isa)
            {
                float out[CNT];
                cpu_dot_kv_multi(out, q, kv, stride, t, n, CNT);
                for (int j = 0; j < CNT; j++) {
                    float single = cpu_dot_kv(q, kv + j * stride, t, n);
                    assert_memory_equal(&single, &out[j], 4);
                    double dot = 0, mag = 0;
                    for (int i = 0; i < n; i++) {
                        dot += (double)q[i] * kf[j * n + i];
                        mag += fabs((double)q[i] * kf[j * n + i]);
                    }
                    if (!(fabs(out[j] - dot) <= (n / 4.0 + 8) * U * mag + 1e-30))
                        fail_msg("isa %d dot_kv %s n=%d: %g vs %g", isa, td_type_name(t), n, out[j],
                                 dot);
                }
                memcpy(y1, y0, sizeof(float) * (size_t)n);
                memcpy(y2, y0, sizeof(float) * (size_t)n);
                cpu_axpy_kv_multi(y1, a, kv, stride, t, n, CNT);
                for (int j = 0; j < CNT; j++)
                    cpu_axpy_kv(y2, a[j], kv + j * stride, t, n);
                assert_memory_equal(y1, y2, sizeof(float) * (size_t)n);
                for (int i = 0; i < n; i++) {
                    double r = y0[i], mag = fabs(y0[i]);
                    for (int j = 0; j < CNT; j++) {
                        r += (double)a[j] * kf[j * n + i];
                        mag += fabs((double)a[j] * kf[j * n + i]);
                    }
                    assert_true(fabs(y1[i] - r) <= 2.0 * (CNT + 1) * U * mag + 1e-30);
                }
            }
            free(q);
            free(src);
            free(kf);
            free(a);
            free(kv);
            free(y0);
            free(y1);
            free(y2);
        }
    }
}

/* One KV row against a run of query heads (GQA groups, a first head that is not the
 * group's first, head sizes with a tail) equals one single-position call per head. */
static void test_kv_heads(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 5);
    static const td_type kv_types[] = {TD_TYPE_F32, TD_TYPE_F16, TD_TYPE_BF16, TD_TYPE_FP8_E4M3};
    static const int dims[] = {5, 64, 80, 128};
    static const struct { int n_head, group, h0, nh; } runs[] = {
        {12, 1, 0, 12}, {12, 1, 6, 6}, {8, 4, 1, 6}, {6, 3, 0, 6}, {4, 2, 3, 1},
    };
    enum { LD = 37 };
    for (size_t ti = 0; ti < TD_ARRAY_LEN(kv_types); ti++) {
        td_type t = kv_types[ti];
        for (size_t di = 0; di < TD_ARRAY_LEN(dims); di++) {
            int n = dims[di];
            size_t head_bytes = td_row_bytes(t, n);
            for (size_t ri = 0; ri < TD_ARRAY_LEN(runs); ri++) {
                int n_head = runs[ri].n_head, group = runs[ri].group;
                int h0 = runs[ri].h0, nh = runs[ri].nh, n_kv = n_head / group;
                float *q = rand_floats(&rng, (size_t)n_head * n, 1.0f),
                      *src = rand_floats(&rng, (size_t)n_kv * n, 2.0f),
                      *a = rand_floats(&rng, (size_t)nh * LD, 1.0f),
                      *y0 = rand_floats(&rng, (size_t)n_head * n, 1.0f);
                uint8_t *row = td_xcalloc((size_t)n_kv, head_bytes);
                for (int kh = 0; kh < n_kv; kh++)
                    td_quant_row_ref(t, src + (size_t)kh * n, row + (size_t)kh * head_bytes, n);
                float *y1 = td_xmalloc(sizeof(float) * (size_t)n_head * n),
                      *y2 = td_xmalloc(sizeof(float) * (size_t)n_head * n);
                FOR_EACH_ISA(isa)
                {
                    float out[16 * LD], want[16];
                    memset(out, 0, sizeof(out));
                    cpu_dot_kv_heads(out, LD, q + (size_t)h0 * n, row, head_bytes, t, n, h0, nh,
                                     group);
                    for (int i = 0; i < nh; i++) {
                        int kh = (h0 + i) / group;
                        want[i] = cpu_dot_kv(q + (size_t)(h0 + i) * n,
                                             row + (size_t)kh * head_bytes, t, n);
                        if (memcmp(&want[i], &out[(size_t)i * LD], 4) != 0)
                            fail_msg("isa %d dot_kv_heads %s n=%d run %zu head %d: %g vs %g", isa,
                                     td_type_name(t), n, ri, h0 + i, out[(size_t)i * LD], want[i]);
                    }
                    memcpy(y1, y0, sizeof(float) * (size_t)n_head * n);
                    memcpy(y2, y0, sizeof(float) * (size_t)n_head * n);
                    cpu_axpy_kv_heads(y1 + (size_t)h0 * n, a, LD, row, head_bytes, t, n, h0, nh,
                                      group);
                    for (int i = 0; i < nh; i++)
                        cpu_axpy_kv(y2 + (size_t)(h0 + i) * n, a[(size_t)i * LD],
                                    row + (size_t)((h0 + i) / group) * head_bytes, t, n);
                    /* Equal bits, and the heads outside the run untouched. */
                    assert_memory_equal(y1, y2, sizeof(float) * (size_t)n_head * n);
                    assert_memory_equal(y1, y0, sizeof(float) * (size_t)h0 * n);
                }
                free(q);
                free(src);
                free(a);
                free(y0);
                free(y1);
                free(y2);
                free(row);
            }
        }
    }
}

/* Several query rows over one run of keys: the same bits as one _multi call per row, for
 * every ISA, KV type, head size, row count and key count (tiles of 4 x 4 and their edges). */
static void test_kv_rows(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 11);
    static const td_type kv_types[] = {TD_TYPE_F32, TD_TYPE_F16, TD_TYPE_BF16, TD_TYPE_FP8_E4M3};
    static const int dims[] = {5, 48, 64, 80, 128};
    enum { MAXR = 7, MAXK = 37, QS = 131, YS = 133, AS = 41 };
    for (size_t ti = 0; ti < TD_ARRAY_LEN(kv_types); ti++) {
        td_type t = kv_types[ti];
        for (size_t di = 0; di < TD_ARRAY_LEN(dims); di++) {
            int n = dims[di];
            size_t kb = td_row_bytes(t, n) + 16; /* a stride that is not the row's size */
            float *q = rand_floats(&rng, (size_t)MAXR * QS, 1.0f),
                  *src = rand_floats(&rng, (size_t)MAXK * n, 2.0f),
                  *a = rand_floats(&rng, (size_t)MAXR * AS, 1.0f),
                  *y0 = rand_floats(&rng, (size_t)MAXR * YS, 1.0f);
            uint8_t *k = td_xcalloc((size_t)MAXK, kb);
            for (int j = 0; j < MAXK; j++)
                td_quant_row_ref(t, src + (size_t)j * n, k + (size_t)j * kb, n);
            float *y1 = td_xmalloc(sizeof(float) * MAXR * YS),
                  *y2 = td_xmalloc(sizeof(float) * MAXR * YS);
            float out[MAXR * AS], want[MAXK];
            FOR_EACH_ISA(isa)
            {
                for (int nr = 1; nr <= MAXR; nr++)
                    for (int count = 1; count <= MAXK; count += (count < 9 ? 1 : 7)) {
                        memset(out, 0, sizeof(out));
                        cpu_dot_kv_rows(out, AS, q, QS, nr, k, kb, t, n, count);
                        for (int r = 0; r < nr; r++) {
                            cpu_dot_kv_multi(want, q + (size_t)r * QS, k, kb, t, n, count);
                            if (memcmp(want, out + (size_t)r * AS, sizeof(float) * (size_t)count))
                                fail_msg(
                                    "isa %d dot_kv_rows %s n=%d rows %d keys %d: row %d differs",
                                    isa, td_type_name(t), n, nr, count, r);
                        }
                        memcpy(y1, y0, sizeof(float) * MAXR * YS);
                        memcpy(y2, y0, sizeof(float) * MAXR * YS);
                        cpu_axpy_kv_rows(y1, YS, a, AS, nr, k, kb, t, n, count);
                        for (int r = 0; r < nr; r++)
                            cpu_axpy_kv_multi(y2 + (size_t)r * YS, a + (size_t)r * AS, k, kb, t, n,
                                              count);
                        /* Equal bits, and nothing written outside the rows' n values. */
                        if (memcmp(y1, y2, sizeof(float) * MAXR * YS))
                            fail_msg("isa %d axpy_kv_rows %s n=%d rows %d keys %d differs", isa,
                                     td_type_name(t), n, nr, count);
                    }
            }
            free(q);
            free(src);
            free(a);
            free(y0);
            free(y1);
            free(y2);
            free(k);
        }
    }
}

static void test_rope(void **state)
{
    (void)state;
    td_rng rng;
    td_rng_seed(&rng, 6);
    static const int dims[] = {64, 128};
    static const int64_t positions[] = {0, 1, 7, 513, 4095, 100000};
    for (size_t di = 0; di < TD_ARRAY_LEN(dims); di++) {
        int hd = dims[di];
        float *ff = rand_floats(&rng, (size_t)hd / 2, 0.5f);
        for (int i = 0; i < hd / 2; i++)
            ff[i] += 1.0f;
        for (size_t pi = 0; pi < TD_ARRAY_LEN(positions); pi++) {
            for (int neox = 0; neox < 2; neox++) {
                for (int use_ff = 0; use_ff < 2; use_ff++) {
                    int64_t pos = positions[pi];
                    float *x = rand_floats(&rng, (size_t)hd * 3, 1.0f),
                          *r = td_xmalloc(sizeof(float) * (size_t)hd * 3);
                    memcpy(r, x, sizeof(float) * (size_t)hd * 3);
                    cpu_rope(x, hd, pos, 10000.0f, 0.5f, use_ff ? ff : NULL, neox);
                    for (int i = 0; i < hd / 2; i++) {
                        double theta = (double)pos * 0.5 * pow(10000.0, -2.0 * i / hd) /
                                       (use_ff ? ff[i] : 1.0);
                        int i0 = neox ? i : 2 * i, i1 = neox ? i + hd / 2 : 2 * i + 1;
                        double e0 = r[i0] * cos(theta) - r[i1] * sin(theta),
                               e1 = r[i0] * sin(theta) + r[i1] * cos(theta);
                        assert_true(fabs(x[i0] - e0) <= 1e-6 && fabs(x[i1] - e1) <= 1e-6);
                    }
                    /* Three heads at once equal three single calls. */
                    memcpy(x, r, sizeof(float) * (size_t)hd * 3);
                    cpu_rope_heads(x, 3, hd, hd, pos, 10000.0f, 0.5f, use_ff ? ff : NULL, neox);
                    for (int h = 0; h < 3; h++)
                        cpu_rope(r + h * hd, hd, pos, 10000.0f, 0.5f, use_ff ? ff : NULL, neox);
                    assert_memory_equal(x, r, sizeof(float) * (size_t)hd * 3);
                    free(x);
                    free(r);
                }
            }
        }
        free(ff);
    }
}

static void test_isa_selection(void **state)
{
    (void)state;
    cpu_isa best = cpu_get_isa();
    assert_int_equal(cpu_set_isa(CPU_ISA_GENERIC), 0);
    assert_int_equal(cpu_get_isa(), CPU_ISA_GENERIC);
    if (best < CPU_ISA_AVX512) assert_int_equal(cpu_set_isa(CPU_ISA_AVX512), TD_EUNSUPPORTED);
    assert_int_equal(cpu_set_isa(best), 0);
    assert_string_equal(cpu_isa_name(CPU_ISA_AVX2), "avx2");
    print_message("cpu isa: %s (%d tested)\n", cpu_isa_name(best), (int)best + 1);
}

static int setup(void **state)
{
    cpu_init();
    best_isa = cpu_get_isa();
    td_pool *pool;
    if (td_pool_create(&pool, 2, false, NULL) != 0) return -1;
    *state = pool;
    return 0;
}

static int teardown(void **state)
{
    td_pool_free(*state);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_isa_selection),
        cmocka_unit_test(test_f16_bf16_exhaustive),
        cmocka_unit_test(test_narrowing_patterns),
        cmocka_unit_test(test_fp8_exhaustive),
        cmocka_unit_test(test_block_quant),
        cmocka_unit_test(test_quant_x_exact),
        cmocka_unit_test(test_matmul_accuracy),
        cmocka_unit_test(test_matmul_batch_invariance),
        cmocka_unit_test(test_matmul_multi),
        cmocka_unit_test(test_row_kernels),
        cmocka_unit_test(test_kv_kernels),
        cmocka_unit_test(test_kv_heads),
        cmocka_unit_test(test_kv_rows),
        cmocka_unit_test(test_rope),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
