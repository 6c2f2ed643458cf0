/*
 * backend/cpu/cpu.c - ISA dispatch, the threaded matmul driver, the row-kernel entry
 * points, rotary embedding and the plain-C matmul reference.
 */
#include "backend/cpu/cpu_impl.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;
static cpu_isa cpu_best = CPU_ISA_GENERIC;   /* the best ISA this CPU runs */
static cpu_isa cpu_active = CPU_ISA_GENERIC; /* the one in use */
static const cpu__kernels *cpu_kern = &cpu__generic;

static const cpu__kernels *kernels_for(cpu_isa isa)
{
#if defined(__x86_64__)
    if (isa == CPU_ISA_AVX512) return &cpu__avx512;
    if (isa == CPU_ISA_AVX2) return &cpu__avx2;
#endif
    (void)isa;
    return &cpu__generic;
}

#if defined(__x86_64__)
static uint64_t xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* The features each kernel file is compiled for (CMakeLists.txt) must all be present,
 * since the compiler may use any of them anywhere in that file. */
static cpu_isa detect_isa(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return CPU_ISA_GENERIC;
    bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28),
         f16c = c & (1u << 29);
    if (!osxsave || !avx) return CPU_ISA_GENERIC;
    uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return CPU_ISA_GENERIC; /* the OS saves xmm and ymm */
    if (__get_cpuid_max(0, NULL) < 7) return CPU_ISA_GENERIC;
    __cpuid_count(7, 0, a, b, c, d);
    bool avx2 = b & (1u << 5), bmi2 = b & (1u << 8), avx512f = b & (1u << 16),
         avx512dq = b & (1u << 17), avx512bw = b & (1u << 30), avx512vl = b & (1u << 31),
         vnni = c & (1u << 11);
    unsigned max_sub = a;
    bool bf16 = false;
    if (max_sub >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        bf16 = a & (1u << 5);
    }
    if (!(avx2 && fma && f16c && bmi2)) return CPU_ISA_GENERIC;
    bool zmm_state = (xcr0 & 0xe0) == 0xe0; /* opmask, zmm0-15 upper, zmm16-31 */
    if (zmm_state && avx512f && avx512dq && avx512bw && avx512vl && vnni && bf16)
        return CPU_ISA_AVX512;
    return CPU_ISA_AVX2;
}
#else
static cpu_isa detect_isa(void)
{
    return CPU_ISA_GENERIC;
}
#endif

static void cpu_init_once(void)
{
    for (int i = 0; i < 256; i++)
        cpu__fp8_table[i] = td_fp8e4m3_to_f32((uint8_t)i);
    cpu_best = detect_isa();
    cpu_active = cpu_best;
    const char *env = getenv("TD_CPU_ISA");
    if (env && *env && strcmp(env, "auto") != 0) {
        cpu_isa want = CPU_ISA_GENERIC;
        bool known = true;
        if (strcmp(env, "generic") == 0)
            want = CPU_ISA_GENERIC;
        else if (strcmp(env, "avx2") == 0)
            want = CPU_ISA_AVX2;
        else if (strcmp(env, "avx512") == 0)
            want = CPU_ISA_AVX512;
        else
            known = false;
        if (!known)
            TD_WARN("TD_CPU_ISA=%s is not one of generic, avx2, avx512; using %s", env,
                    cpu_isa_name(cpu_best));
        else if (want > cpu_best)
            TD_WARN("TD_CPU_ISA=%s: this CPU lacks it; using %s", env, cpu_isa_name(cpu_best));
        else
            cpu_active = want;
    }
    cpu_kern = kernels_for(cpu_active);
}

void cpu_init(void)
{
    pthread_once(&cpu_once, cpu_init_once);
}

cpu_isa cpu_get_isa(void)
{
    cpu_init();
    return cpu_active;
}

int cpu_set_isa(cpu_isa isa)
{
    cpu_init();
    if (isa < CPU_ISA_GENERIC || isa > cpu_best) return TD_EUNSUPPORTED;
    cpu_active = isa;
    cpu_kern = kernels_for(isa);
    return 0;
}

const char *cpu_isa_name(cpu_isa isa)
{
    switch (isa) {
    case CPU_ISA_GENERIC:
        return "generic";
    case CPU_ISA_AVX2:
        return "avx2";
    case CPU_ISA_AVX512:
        return "avx512";
    default:
        return "unknown";
    }
}

static inline const cpu__kernels *active(void)
{
    cpu_init();
    return cpu_kern;
}

/* ---- matmul driver --------------------------------------------------------------- */

/* Scratch layout: quantized activations (q8/q4 weights only), then one area per thread. */
typedef struct {
    size_t xq_stride, xs_stride; /* bytes per row of xq; elements per row of xd/xc */
    size_t xq_off, xd_off, xc_off, thread_off, thread_bytes, total;
} mm_layout;

static size_t max_thread_scratch(td_type wtype, int M, int K)
{
    /* The largest over every ISA this CPU may switch to, so that tests may change ISA. */
    size_t n = cpu__generic.matmul_scratch(wtype, M, K);
#if defined(__x86_64__)
    n = TD_MAX(n, cpu__avx2.matmul_scratch(wtype, M, K));
    n = TD_MAX(n, cpu__avx512.matmul_scratch(wtype, M, K));
#endif
    return TD_ALIGN_UP(n, 64);
}

static mm_layout mm_layout_for(td_type wtype, int M, int K, int n_threads)
{
    mm_layout l = {0};
    size_t off = 0;
    if (cpu__is_quantized(wtype)) {
        size_t nb = (size_t)K / 32;
        l.xq_stride = TD_ALIGN_UP((size_t)K, 64);
        l.xs_stride = TD_ALIGN_UP(nb, 16);
        l.xq_off = 0;
        off = l.xq_stride * (size_t)M;
        l.xd_off = off;
        off += TD_ALIGN_UP(l.xs_stride * 4 * (size_t)M, 64);
        l.xc_off = off;
        off += TD_ALIGN_UP(l.xs_stride * 4 * (size_t)M, 64);
    }
    l.thread_off = off;
    l.thread_bytes = max_thread_scratch(wtype, M, K);
    l.total = off + l.thread_bytes * (size_t)TD_MAX(n_threads, 1);
    return l;
}

size_t cpu_matmul_scratch_size(td_type wtype, int M, int K, int n_threads)
{
    return mm_layout_for(wtype, TD_MAX(M, 1), K, n_threads).total;
}

/*
 * From MM_GUIDED_MIN_M x rows on (compute-bound calls), weight rows are handed out
 * dynamically, in chunks that shrink towards the end (guided scheduling): a thread
 * that finishes early, or that another process delayed, does not leave the other
 * threads waiting at the join. Which thread computes a row does not change its
 * arithmetic. MM_GRAIN is a multiple of CPU__N_ALIGN and of every
 * kernel's panel width (6, 16, 32 rows), so a chunk never ends in a part-empty panel.
 */
#define MM_GRAIN 96
/* Calls with fewer x rows than this split the rows statically (see mm_worker). */
#define MM_GUIDED_MIN_M 4

typedef struct {
    cpu__mm mm[CPU_MM_MAX_OUT]; /* one per output; x and the quantized x are shared */
    int64_t base[CPU_MM_MAX_OUT + 1]; /* output i owns rows [base[i], base[i] + N) of the
                                       * combined row space; base[i] % MM_GRAIN == 0 */
    int n_out;
    const cpu__kernels *kern;
    td_pool *pool;
    uint8_t *thread_scratch;
    size_t thread_bytes;
    int offset;
    _Alignas(64) int64_t next; /* the first row not yet handed out (atomic) */
} mm_job;

/* Take the next chunk of rows [*r0, *r1); false when none are left. */
static bool mm_grab(mm_job *job, int nth, int64_t *r0, int64_t *r1)
{
    int64_t total = job->base[job->n_out];
    int64_t cur = __atomic_load_n(&job->next, __ATOMIC_RELAXED);
    for (;;) {
        if (cur >= total) return false;
        /* A single thread takes everything: each chunk start costs a weight prefetch. */
        int64_t size = nth == 1 ? total : TD_ALIGN_UP((total - cur) / (2 * nth), MM_GRAIN);
        size = TD_MAX(size, MM_GRAIN);
        int64_t end = TD_MIN(total, cur + size);
        if (__atomic_compare_exchange_n(&job->next, &cur, end, true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            *r0 = cur;
            *r1 = end;
            return true;
        }
    }
}

/* Rows [r0, r1) of the combined row space; they may cover the ends of several outputs
 * (the padding between outputs holds no rows). */
static void mm_rows(const mm_job *job, int64_t r0, int64_t r1, void *scratch)
{
    for (int i = 0; i < job->n_out; i++) {
        int64_t n0 = TD_MAX(r0, job->base[i]) - job->base[i];
        int64_t n1 = TD_MIN(r1, job->base[i] + job->mm[i].N) - job->base[i];
        if (n0 < n1) job->kern->matmul(&job->mm[i], (int)n0, (int)n1, scratch);
    }
}

static void mm_worker(void *arg, int ith, int nth)
{
    mm_job *job = arg;
    const cpu__mm *mm0 = &job->mm[0];
    if (cpu__is_quantized(mm0->wtype)) {
        /* Each row's quantization depends only on that row: split rows, then wait. */
        int64_t m0, m1;
        td_split_range(mm0->M, ith, nth, &m0, &m1);
        for (int64_t m = m0; m < m1; m++)
            job->kern->quant_x(mm0->x + m * mm0->ldx, mm0->K, job->offset,
                               (int8_t *)mm0->xq + m * (int64_t)mm0->xq_stride,
                               (float *)mm0->xd + m * (int64_t)mm0->xs_stride,
                               (int32_t *)mm0->xc + m * (int64_t)mm0->xs_stride);
        td_pool_barrier(job->pool);
    }
    void *scratch = job->thread_scratch + (size_t)ith * job->thread_bytes;
    int64_t r0, r1;
    if (mm0->M < MM_GUIDED_MIN_M) {
        /* GEMV-like calls stream the weights at the memory's pace, which is even across
         * threads; one contiguous range each keeps the weight prefetch running, which
         * every chunk start would interrupt. */
        int64_t c0, c1;
        td_split_range(job->base[job->n_out] / CPU__N_ALIGN, ith, nth, &c0, &c1);
        mm_rows(job, c0 * CPU__N_ALIGN, c1 * CPU__N_ALIGN, scratch);
        return;
    }
    while (mm_grab(job, nth, &r0, &r1)) mm_rows(job, r0, r1, scratch);
}

void cpu_matmul_multi(td_pool *pool, const cpu_mm_out *outs, int n_out, const float *x,
                      int64_t ldx, td_type wtype, int M, int K, void *scratch)
{
    TD_ASSERT(n_out >= 1 && n_out <= CPU_MM_MAX_OUT);
    if (M <= 0) return;
    TD_ASSERT(K > 0 && td_type_block_elems(wtype) > 0 && wtype != TD_TYPE_FP8_E4M3);
    TD_ASSERT(td_row_bytes(wtype, K) > 0 && ldx >= K);
    TD_ASSERT(scratch && ((uintptr_t)scratch & 63) == 0);
    mm_layout l = mm_layout_for(wtype, M, K, td_pool_size(pool));
    uint8_t *s = scratch;
    mm_job job = {
        .n_out = n_out,
        .kern = active(),
        .pool = pool,
        .thread_scratch = s + l.thread_off,
        .thread_bytes = l.thread_bytes,
        .offset = cpu__q_offset(wtype),
    };
    int64_t base = 0;
    for (int i = 0; i < n_out; i++) {
        const cpu_mm_out *o = &outs[i];
        TD_ASSERT(o->N >= 0 && o->ldy >= o->N && o->w_row_bytes >= td_row_bytes(wtype, K));
        TD_ASSERT(!o->packed ||
                  (cpu_pack_supported(wtype) && o->w_row_bytes == td_row_bytes(wtype, K)));
        job.mm[i] = (cpu__mm){.y = o->y,
                              .ldy = o->ldy,
                              .x = x,
                              .ldx = ldx,
                              .w = o->w,
                              .w_row_bytes = o->w_row_bytes,
                              .wtype = wtype,
                              .M = M,
                              .N = o->N,
                              .K = K,
                              .xq = (const int8_t *)(s + l.xq_off),
                              .xd = (const float *)(void *)(s + l.xd_off),
                              .xc = (const int32_t *)(void *)(s + l.xc_off),
                              .xq_stride = l.xq_stride,
                              .xs_stride = l.xs_stride,
                              .packed = o->packed};
        job.base[i] = base;
        base += TD_ALIGN_UP((int64_t)o->N, MM_GRAIN);
    }
    job.base[n_out] = base;
    if (base == 0) return;
    td_pool_run(pool, mm_worker, &job);
}

void cpu_matmul(td_pool *pool, float *y, int64_t ldy, const float *x, int64_t ldx, const void *w,
                size_t w_row_bytes, td_type wtype, int M, int N, int K, void *scratch)
{
    if (M <= 0 || N <= 0) return;
    cpu_mm_out o = {.y = y, .ldy = ldy, .w = w, .w_row_bytes = w_row_bytes, .N = N};
    cpu_matmul_multi(pool, &o, 1, x, ldx, wtype, M, K, scratch);
}

bool cpu_pack_supported(td_type wtype)
{
    return wtype == TD_TYPE_Q8_0;
}

size_t cpu_pack_bytes(td_type wtype, int64_t N, int K)
{
    return (size_t)TD_ALIGN_UP(N, CPU__PANEL_ROWS) * td_row_bytes(wtype, K);
}

void cpu_pack_rows(td_type wtype, void *dst, const void *w, size_t w_row_bytes, int64_t N, int K,
                   int64_t r0, int64_t r1)
{
    TD_ASSERT(cpu_pack_supported(wtype) && K > 0 && K % 32 == 0);
    TD_ASSERT(r0 % CPU__PANEL_ROWS == 0 && (r1 % CPU__PANEL_ROWS == 0 || r1 == N) && r1 <= N);
    const int nb = K / 32;
    const size_t rb = td_row_bytes(wtype, K);
    for (int64_t p0 = r0; p0 < r1; p0 += CPU__PANEL_ROWS) {
        uint8_t *panel = (uint8_t *)dst + (size_t)p0 * rb;
        memset(panel, 0, CPU__PANEL_ROWS * rb);
        int rows = (int)TD_MIN(CPU__PANEL_ROWS, N - p0);
        for (int j = 0; j < rows; j++) {
            const uint8_t *src = (const uint8_t *)w + (size_t)(p0 + j) * w_row_bytes;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = src + (size_t)b * sizeof(td_block_q8_0);
                uint8_t *pb = panel + (size_t)b * CPU__PANEL_BLOCK_BYTES;
                for (int g = 0; g < 8; g++) {
                    uint32_t q4;
                    memcpy(&q4, blk + 2 + 4 * g, 4);
                    q4 ^= 0x80808080u; /* q + 128 as unsigned bytes */
                    memcpy(pb + 128 * g + 4 * j, &q4, 4);
                }
                memcpy(pb + CPU__PANEL_SCALES + 2 * j, blk, 2);
            }
        }
    }
}

void cpu_matmul_ref(float *y, int64_t ldy, const float *x, int64_t ldx, const void *w,
                    size_t w_row_bytes, td_type wtype, int M, int N, int K)
{
    const uint8_t *wb = w;
    if (cpu__is_quantized(wtype)) {
        /* Quantize x as the kernels do (td_quant_row_ref); integer block dot products
         * scaled by dx * dw and summed in block order. */
        int nb = K / 32;
        int8_t *wq = td_xmalloc((size_t)K);
        float *wd = td_xmalloc(sizeof(float) * (size_t)nb);
        td_block_q8_0 *xq = td_xmalloc(sizeof(td_block_q8_0) * (size_t)nb);
        for (int m = 0; m < M; m++) {
            td_quant_row_ref(TD_TYPE_Q8_0, x + m * ldx, xq, K);
            for (int n = 0; n < N; n++) {
                const uint8_t *row = wb + (size_t)n * w_row_bytes;
                for (int b = 0; b < nb; b++) {
                    uint16_t h;
                    memcpy(&h, row + (size_t)b * (size_t)td_type_block_bytes(wtype), 2);
                    wd[b] = td_fp16_to_f32(h);
                    const uint8_t *qs = row + (size_t)b * (size_t)td_type_block_bytes(wtype) + 2;
                    for (int j = 0; j < 32; j++)
                        wq[b * 32 + j] =
                            wtype == TD_TYPE_Q8_0
                                ? (int8_t)qs[j]
                                : (int8_t)((j < 16 ? qs[j] & 0xf : qs[j - 16] >> 4) - 8);
                }
                float acc = 0;
                for (int b = 0; b < nb; b++) {
                    int32_t s = 0;
                    for (int j = 0; j < 32; j++)
                        s += (int32_t)xq[b].qs[j] * wq[b * 32 + j];
                    acc += (float)s * (td_fp16_to_f32(xq[b].d) * wd[b]);
                }
                y[m * ldy + n] = acc;
            }
        }
        free(wq);
        free(wd);
        free(xq);
        return;
    }
    float *wf = td_xmalloc(sizeof(float) * (size_t)K);
    for (int n = 0; n < N; n++) {
        td_dequant_row_ref(wtype, wb + (size_t)n * w_row_bytes, wf, K);
        for (int m = 0; m < M; m++) {
            float acc = 0;
            for (int k = 0; k < K; k++)
                acc += x[m * ldx + k] * wf[k];
            y[m * ldy + n] = acc;
        }
    }
    free(wf);
}

/* ---- row kernels ----------------------------------------------------------------- */

void cpu_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    active()->rmsnorm(out, x, w, n, eps);
}

void cpu_silu_mul(float *out, const float *gate, const float *up, int n)
{
    active()->silu_mul(out, gate, up, n);
}

void cpu_add(float *y, const float *x, int n)
{
    active()->add(y, x, n);
}

float cpu_dot_f32(const float *a, const float *b, int n)
{
    return active()->dot_f32(a, b, n);
}

void cpu_softmax(float *x, int n)
{
    active()->softmax(x, n);
}

void cpu_quant_row(td_type t, const float *src, void *dst, int64_t n)
{
    const cpu__kernels *k = active();
    if (!k->quant_row || !k->quant_row(t, src, dst, n)) cpu__generic.quant_row(t, src, dst, n);
}

void cpu_dequant_row(td_type t, const void *src, float *dst, int64_t n)
{
    const cpu__kernels *k = active();
    if (!k->dequant_row || !k->dequant_row(t, src, dst, n))
        cpu__generic.dequant_row(t, src, dst, n);
}

float cpu_dot_kv(const float *q, const void *k, td_type t, int n)
{
    float out;
    active()->dot_kv_multi(&out, q, k, 0, t, n, 1);
    return out;
}

void cpu_axpy_kv(float *y, float a, const void *v, td_type t, int n)
{
    active()->axpy_kv_multi(y, &a, v, 0, t, n, 1);
}

void cpu_dot_kv_multi(float *out, const float *q, const void *k, size_t k_stride, td_type t, int n,
                      int count)
{
    active()->dot_kv_multi(out, q, k, k_stride, t, n, count);
}

void cpu_axpy_kv_multi(float *y, const float *a, const void *v, size_t v_stride, td_type t, int n,
                       int count)
{
    active()->axpy_kv_multi(y, a, v, v_stride, t, n, count);
}

void cpu_dot_kv_rows(float *out, size_t out_stride, const float *q, size_t q_stride, int n_rows,
                     const void *k, size_t k_stride, td_type t, int n, int count)
{
    const cpu__kernels *kt = active();
    if (kt->dot_kv_rows) {
        kt->dot_kv_rows(out, out_stride, q, q_stride, n_rows, k, k_stride, t, n, count);
        return;
    }
    for (int r = 0; r < n_rows; r++)
        kt->dot_kv_multi(out + (size_t)r * out_stride, q + (size_t)r * q_stride, k, k_stride, t,
                         n, count);
}

void cpu_axpy_kv_rows(float *y, size_t y_stride, const float *a, size_t a_stride, int n_rows,
                      const void *v, size_t v_stride, td_type t, int n, int count)
{
    const cpu__kernels *kt = active();
    if (kt->axpy_kv_rows) {
        kt->axpy_kv_rows(y, y_stride, a, a_stride, n_rows, v, v_stride, t, n, count);
        return;
    }
    for (int r = 0; r < n_rows; r++)
        kt->axpy_kv_multi(y + (size_t)r * y_stride, a + (size_t)r * a_stride, v, v_stride, t, n,
                          count);
}

void cpu_dot_kv_heads(float *out, size_t out_stride, const float *q, const void *k,
                      size_t head_bytes, td_type t, int n, int h0, int n_heads, int group)
{
    active()->dot_kv_heads(out, out_stride, q, k, head_bytes, t, n, h0, n_heads, group);
}

void cpu_axpy_kv_heads(float *y, const float *a, size_t a_stride, const void *v, size_t head_bytes,
                       td_type t, int n, int h0, int n_heads, int group)
{
    active()->axpy_kv_heads(y, a, a_stride, v, head_bytes, t, n, h0, n_heads, group);
}

/* ---- rotary embedding -------------------------------------------------------------- */

/*
 * theta_i = pos * freq_scale * base^(-2i/head_dim) / freq_factors[i], evaluated in
 * double and rounded once to float for cos and sin. The table for the last position
 * is kept per thread, since a token's heads (and often its layers) share it.
 */
#define ROPE_MAX_PAIRS 512

typedef struct {
    int64_t pos;
    int head_dim;
    float base, freq_scale;
    const float *freq_factors;
    bool valid;
    float cos[ROPE_MAX_PAIRS], sin[ROPE_MAX_PAIRS];
} rope_table;

static _Thread_local rope_table rope_cache;

static const rope_table *rope_table_for(int head_dim, int64_t pos, float base, float freq_scale,
                                        const float *freq_factors)
{
    rope_table *t = &rope_cache;
    if (t->valid && t->pos == pos && t->head_dim == head_dim && t->base == base &&
        t->freq_scale == freq_scale && t->freq_factors == freq_factors)
        return t;
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        double inv = pow((double)base, -2.0 * i / head_dim);
        double theta = (double)pos * (double)freq_scale * inv;
        if (freq_factors) theta /= (double)freq_factors[i];
        t->cos[i] = (float)cos(theta);
        t->sin[i] = (float)sin(theta);
    }
    t->pos = pos;
    t->head_dim = head_dim;
    t->base = base;
    t->freq_scale = freq_scale;
    t->freq_factors = freq_factors;
    /* freq_factors are compared by address: they are model weights and do not change. */
    t->valid = true;
    return t;
}

static void rope_apply(float *x, const rope_table *t, int head_dim, int neox)
{
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = x[i0], x1 = x[i1], c = t->cos[i], s = t->sin[i];
        x[i0] = x0 * c - x1 * s;
        x[i1] = x0 * s + x1 * c;
    }
}

void cpu_rope(float *x, int head_dim, int64_t pos, float base, float freq_scale,
              const float *freq_factors, int neox)
{
    cpu_rope_heads(x, 1, head_dim, head_dim, pos, base, freq_scale, freq_factors, neox);
}

void cpu_rope_heads(float *x, int n_heads, int64_t head_stride, int head_dim, int64_t pos,
                    float base, float freq_scale, const float *freq_factors, int neox)
{
    TD_ASSERT(head_dim > 0 && head_dim % 2 == 0 && head_dim / 2 <= ROPE_MAX_PAIRS);
    const rope_table *t = rope_table_for(head_dim, pos, base, freq_scale, freq_factors);
    for (int h = 0; h < n_heads; h++)
        rope_apply(x + h * head_stride, t, head_dim, neox);
}
