/* backend/cpu/probe.c - machine limits for benchmark reports (see probe.h). */
#include "backend/cpu/probe.h"

#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"

float cpu__probe_sum_avx512(const float *x, size_t n);
float cpu__probe_sum_avx2(const float *x, size_t n);
double cpu__probe_fma_avx512(int64_t iters, float *sink);
double cpu__probe_fma_avx2(int64_t iters, float *sink);

static float sum_generic(const float *x, size_t n)
{
    float a[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) a[k] += x[i + k];
    float s = 0;
    for (int k = 0; k < 8; k++) s += a[k];
    for (; i < n; i++) s += x[i];
    return s;
}

static float probe_sum(const float *x, size_t n)
{
#if defined(__x86_64__)
    switch (cpu_get_isa()) {
    case CPU_ISA_AVX512: return cpu__probe_sum_avx512(x, n);
    case CPU_ISA_AVX2: return cpu__probe_sum_avx2(x, n);
    default: break;
    }
#endif
    return sum_generic(x, n);
}

typedef struct bw_task {
    float *buf;
    size_t n;
    volatile float sink[64];
    bool touch;
} bw_task;

static void bw_run(void *ctx, int ith, int nth)
{
    bw_task *t = ctx;
    int64_t b, e;
    td_split_range((int64_t)t->n, ith, nth, &b, &e);
    if (t->touch) {
        for (int64_t i = b; i < e; i++) t->buf[i] = (float)(i & 7);
        return;
    }
    t->sink[ith % 64] = probe_sum(t->buf + b, (size_t)(e - b));
}

double cpu_probe_read_gbs(td_pool *pool, size_t bytes, int reps)
{
    bw_task t = {.n = bytes / sizeof(float), .touch = true};
    t.buf = td_aligned_alloc(t.n * sizeof(float));
    if (!t.buf) return 0;
    td_pool_run(pool, bw_run, &t); /* fault the pages in from the threads that read them */
    t.touch = false;
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = td_now_s();
        td_pool_run(pool, bw_run, &t);
        double gbs = (double)bytes / (td_now_s() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    td_aligned_free(t.buf);
    return best;
}

typedef struct fma_task {
    double flops[256];
    double secs[256];
    volatile float sink;
} fma_task;

static void fma_run(void *ctx, int ith, int nth)
{
    (void)nth;
    fma_task *t = ctx;
    const int64_t iters = 20 * 1000 * 1000;
    float sink = 0;
    double t0 = td_now_s(), f = 0;
#if defined(__x86_64__)
    if (cpu_get_isa() == CPU_ISA_AVX512) f = cpu__probe_fma_avx512(iters, &sink);
    else if (cpu_get_isa() == CPU_ISA_AVX2) f = cpu__probe_fma_avx2(iters, &sink);
#endif
    if (f == 0) {
        float a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        for (int64_t i = 0; i < iters / 8; i++)
            for (int k = 0; k < 8; k++) a[k] = a[k] * 0.999999f + 1e-7f;
        sink = a[0] + a[7];
        f = (double)(iters / 8) * 8 * 2;
    }
    if (ith < 256) {
        t->flops[ith] = f;
        t->secs[ith] = td_now_s() - t0;
    }
    t->sink = sink;
}

double cpu_probe_peak_gflops(td_pool *pool)
{
    fma_task t;
    memset(&t, 0, sizeof(t));
    double best = 0;
    int n = td_pool_size(pool);
    for (int r = 0; r < 3; r++) {
        td_pool_run(pool, fma_run, &t);
        double total = 0;
        for (int i = 0; i < n && i < 256; i++) total += t.flops[i] / t.secs[i];
        if (total > best) best = total;
    }
    return best / 1e9;
}
