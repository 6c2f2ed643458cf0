/*
 * bench/bench_kernels.c - throughput of cpu_matmul on the llama-134m shapes.
 *
 *   bench_kernels [-t threads] [-r seconds] [-n] [-m M,...] [type ...]
 *   (types: f32 f16 bf16 q8_0 q4_0; -m: the x rows of the decode passes, default 1,32)
 *
 * For each weight type it builds 12 "layers" of distinct matrices (q/k/v/o 768x768,
 * gate/up 2048x768, down 768x2048) plus the 32000x768 output matrix, so that
 * the weights of a pass do not fit in any cache, and times:
 *   - one matrix shape at a time over the 12 layers, for M = 1, 32 and 512;
 *   - a whole decode pass (every matrix once, M = 1 and M = 32), as weight GB/s and
 *     tokens/s, the figure that sets decode speed.
 * GB/s counts the weight bytes read once per call; GFLOP/s is 2*M*N*K per second.
 * Each figure is the median of several timed repetitions. -n: do not pin threads.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "util/pool.h"

#define N_LAYERS 12
#define DIM 768
#define FFN 2048
#define VOCAB 32000

typedef struct {
    const char *name;
    int N, K;
    int per_layer; /* matrices of this shape per layer */
    uint8_t *w[N_LAYERS * 4];
    int count;
    size_t row_bytes;
} shape;

static double median(double *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void fill_matrix(td_rng *rng, td_type t, int N, int K, uint8_t *dst, size_t row_bytes)
{
    float *row = td_xmalloc(sizeof(float) * (size_t)K);
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++)
            row[k] = (td_rng_float(rng) * 2.0f - 1.0f) * 0.05f;
        cpu_quant_row(t, row, dst + (size_t)n * row_bytes, K);
    }
    free(row);
}

static void init_shape(shape *s, td_rng *rng, td_type t, const char *name, int N, int K,
                       int per_layer, int count)
{
    s->name = name;
    s->N = N;
    s->K = K;
    s->per_layer = per_layer;
    s->count = count;
    s->row_bytes = td_row_bytes(t, K);
    for (int i = 0; i < count; i++) {
        s->w[i] = td_aligned_alloc(s->row_bytes * (size_t)N);
        TD_ASSERT(s->w[i]);
        fill_matrix(rng, t, N, K, s->w[i], s->row_bytes);
    }
}

static void free_shape(shape *s)
{
    for (int i = 0; i < s->count; i++)
        td_aligned_free(s->w[i]);
}

/* Seconds per call of shape s at batch M (median over repetitions, rotating matrices). */
static double time_shape(td_pool *pool, td_type t, shape *s, int M, const float *x, float *y,
                         void *scratch, double budget_s)
{
    int calls_per_rep = s->count;
    /* Aim for about 7 repetitions within the budget, at least 1 call each. */
    double t0 = td_now_s();
    cpu_matmul(pool, y, s->N, x, s->K, s->w[0], s->row_bytes, t, M, s->N, s->K, scratch);
    double one = td_now_s() - t0;
    int reps = 7;
    if (one * calls_per_rep * reps > budget_s)
        calls_per_rep = (int)TD_MAX(1.0, budget_s / reps / one);
    if (calls_per_rep > s->count) calls_per_rep = s->count;
    double times[7];
    for (int r = 0; r < reps; r++) {
        t0 = td_now_s();
        for (int c = 0; c < calls_per_rep; c++)
            cpu_matmul(pool, y, s->N, x, s->K, s->w[(r * calls_per_rep + c) % s->count],
                       s->row_bytes, t, M, s->N, s->K, scratch);
        times[r] = (td_now_s() - t0) / calls_per_rep;
    }
    return median(times, reps);
}

/* One decode pass: every layer's 7 matrices, then the output matrix. */
static double time_pass(td_pool *pool, td_type t, shape *shapes, int n_shapes, int M,
                        const float *x, float *y, void *scratch, int reps)
{
    double times[16];
    reps = TD_MIN(reps, 16);
    for (int r = 0; r < reps; r++) {
        double t0 = td_now_s();
        for (int l = 0; l < N_LAYERS; l++)
            for (int si = 0; si < n_shapes; si++) {
                shape *s = &shapes[si];
                if (s->count < N_LAYERS) continue;
                for (int j = 0; j < s->per_layer; j++)
                    cpu_matmul(pool, y, s->N, x, s->K, s->w[(l * s->per_layer + j) % s->count],
                               s->row_bytes, t, M, s->N, s->K, scratch);
            }
        for (int si = 0; si < n_shapes; si++) {
            shape *s = &shapes[si];
            if (s->count == 1)
                cpu_matmul(pool, y, s->N, x, s->K, s->w[0], s->row_bytes, t, M, s->N, s->K,
                           scratch);
        }
        times[r] = td_now_s() - t0;
    }
    return median(times, reps);
}

int main(int argc, char **argv)
{
    int threads = 2;
    double budget = 0.25;
    bool pin = true;
    td_type types[8];
    int n_types = 0;
    int pass_m[16] = {1, 32}, n_pass_m = 2;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-t") == 0 && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (strcmp(argv[i], "-r") == 0 && i + 1 < argc) {
            budget = atof(argv[++i]);
        } else if (strcmp(argv[i], "-n") == 0) {
            pin = false;
        } else if (strcmp(argv[i], "-m") == 0 && i + 1 < argc) {
            n_pass_m = 0;
            for (char *tok = strtok(argv[++i], ","); tok && n_pass_m < 16; tok = strtok(NULL, ",")) {
                int m = atoi(tok);
                if (m < 1 || m > 512) {
                    fprintf(stderr, "bench_kernels: -m takes rows from 1 to 512\n");
                    return 2;
                }
                pass_m[n_pass_m++] = m;
            }
            if (n_pass_m == 0) {
                fprintf(stderr, "bench_kernels: -m needs a list of rows, e.g. 1,4,32\n");
                return 2;
            }
        } else {
            td_type t = td_type_parse(argv[i]);
            if (t == TD_TYPE_INVALID || t == TD_TYPE_FP8_E4M3 || n_types == 8) {
                fprintf(stderr, "usage: bench_kernels [-t threads] [-r seconds] [-n] [-m M,...] "
                                "[f32|f16|bf16|q8_0|q4_0 ...]\n");
                return 2;
            }
            types[n_types++] = t;
        }
    }
    if (n_types == 0) {
        types[n_types++] = TD_TYPE_F32;
        types[n_types++] = TD_TYPE_F16;
        types[n_types++] = TD_TYPE_Q8_0;
    }
    cpu_init();
    td_pool *pool;
    td_err err;
    if (td_pool_create(&pool, threads, pin, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    printf("isa %s, %d threads%s\n", cpu_isa_name(cpu_get_isa()), threads, pin ? " (pinned)" : "");

    enum { MAX_M = 512 };
    td_rng rng;
    td_rng_seed(&rng, 42);
    float *x = td_aligned_alloc(sizeof(float) * MAX_M * FFN);
    float *y = td_aligned_alloc(sizeof(float) * MAX_M * VOCAB);
    for (size_t i = 0; i < (size_t)MAX_M * FFN; i++)
        x[i] = td_rng_float(&rng) * 2.0f - 1.0f;

    for (int ti = 0; ti < n_types; ti++) {
        td_type t = types[ti];
        shape shapes[4];
        init_shape(&shapes[0], &rng, t, "attn 768x768", DIM, DIM, 4, N_LAYERS * 4);
        init_shape(&shapes[1], &rng, t, "up   2048x768", FFN, DIM, 2, N_LAYERS * 2);
        init_shape(&shapes[2], &rng, t, "down 768x2048", DIM, FFN, 1, N_LAYERS);
        init_shape(&shapes[3], &rng, t, "out  32000x768", VOCAB, DIM, 1, 1);
        size_t scratch_bytes = 0;
        for (int si = 0; si < 4; si++)
            scratch_bytes =
                TD_MAX(scratch_bytes, cpu_matmul_scratch_size(t, MAX_M, shapes[si].K, threads));
        void *scratch = td_aligned_alloc(scratch_bytes);

        printf("\n== %s ==\n", td_type_name(t));
        printf("%-15s %5s %10s %9s %9s %9s\n", "shape", "M", "us/call", "GB/s", "GFLOP/s", "xM=1");
        for (int si = 0; si < 4; si++) {
            shape *s = &shapes[si];
            double bytes = (double)s->row_bytes * s->N;
            double t1 = 0;
            static const int Ms[] = {1, 32, 512};
            for (int mi = 0; mi < 3; mi++) {
                int M = Ms[mi];
                double sec = time_shape(pool, t, s, M, x, y, scratch, budget);
                if (M == 1) t1 = sec;
                printf("%-15s %5d %10.1f %9.2f %9.1f %9.2f\n", s->name, M, sec * 1e6,
                       bytes / sec / 1e9, 2.0 * M * s->N * s->K / sec / 1e9, sec / t1);
            }
        }
        double pass_bytes = 0, pass_flops = 0;
        for (int si = 0; si < 4; si++) {
            shape *s = &shapes[si];
            int n = s->count == 1 ? 1 : N_LAYERS * s->per_layer;
            pass_bytes += (double)s->row_bytes * s->N * n;
            pass_flops += 2.0 * s->N * s->K * n;
        }
        double p1 = time_pass(pool, t, shapes, 4, 1, x, y, scratch, 9);
        for (int mi = 0; mi < n_pass_m; mi++) {
            int M = pass_m[mi];
            double p = M == 1 ? p1 : time_pass(pool, t, shapes, 4, M, x, y, scratch, 5);
            printf("decode pass M=%-3d: %7.2f ms  %6.2f GB/s  %7.1f tok/s  (%.2fx the M=1 time, "
                   "%.1f GFLOP/s)\n",
                   M, p * 1e3, pass_bytes / p / 1e9, M / p, p / p1, M * pass_flops / p / 1e9);
        }
        td_aligned_free(scratch);
        for (int si = 0; si < 4; si++)
            free_shape(&shapes[si]);
    }
    td_aligned_free(x);
    td_aligned_free(y);
    td_pool_free(pool);
    return 0;
}
