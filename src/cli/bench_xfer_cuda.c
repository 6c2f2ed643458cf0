/*
 * cli/bench_xfer_cuda.c - `tandem bench-xfer-cuda`: the kvx cuda_ipc transport between two
 * processes on one GPU, next to the device-to-device copy rate measured in the same run.
 *
 * A producer process (forked before any CUDA call) holds a KV pool in device memory shaped
 * like one prompt's KV (--tokens of a model with --layers, --kv-heads, --head-dim, 2-byte
 * elements, --block-size tokens per block) and leases it out many times; this process is
 * the consumer, with room for --concurrency transfers side by side. For each concurrency
 * C, C transfers start together (each its own lease, each into its own blocks) and the
 * cell's GB/s is the payload moved over the wall time from the first start to the last
 * completion, best and median of --reps. The floor is cudaMemcpy device to device of a
 * 1 GiB buffer, counted the same way (payload bytes per second, not read plus written).
 * With --protocol tcp the same transfers go over loopback TCP through pinned host staging
 * on both sides (the cross-host path), and with --protocol ucx by UCX gets between the two
 * sides' registered pinned staging (UCX's own transports: UCX_TLS); the D2D floor is then
 * only a reference.
 * The figures are printed, never asserted.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "kvx/kvx.h"

#ifndef TD_HAVE_CUDA
int cli_bench_xfer_cuda(int argc, char **argv)
{
    (void)argc, (void)argv;
    fprintf(stderr, "bench-xfer-cuda: this build has no CUDA backend (configure with "
                    "-DTANDEM_CUDA=ON where nvcc is installed)\n");
    return 2;
}
#else
#include <cuda_runtime_api.h>

#define MAX_LEASES 4096

typedef struct geom {
    int layers, blocks; /* blocks per transfer, per layer */
    uint64_t block_bytes;
} geom;

static kvx_layout bench_layout(const geom *g, int kv_heads, int head_dim, int block_size)
{
    return (kvx_layout){.model_fingerprint = 0xb5,
                        .n_layers = (uint32_t)g->layers,
                        .n_kv_heads = (uint32_t)kv_heads,
                        .head_dim = (uint32_t)head_dim,
                        .block_size = (uint32_t)block_size,
                        .kv_dtype = 2,
                        .tp_size = 1};
}

static void no_release(void *u, const char *id, const int32_t *b, int n, kvx_release_reason r,
                       void *tu)
{
    (void)u, (void)id, (void)b, (void)n, (void)r, (void)tu;
}

/* The producer: a device pool of one transfer's blocks, n_leases leases over them. */
static void producer_main(const geom *g, kvx_layout lay, int n_leases, int wfd, int rfd)
{
    uint64_t bytes = (uint64_t)g->layers * g->blocks * g->block_bytes;
    void *pool = NULL;
    cudaIpcMemHandle_t h;
    struct cudaDeviceProp prop;
    uint16_t port = 0;
    if (cudaMalloc(&pool, bytes) != cudaSuccess || cudaMemset(pool, 0x5a, bytes) != cudaSuccess ||
        cudaIpcGetMemHandle(&h, pool) != cudaSuccess ||
        cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        fprintf(stderr, "bench-xfer-cuda: the producer cannot allocate %.1f MiB on the GPU: %s\n",
                (double)bytes / (1 << 20), cudaGetErrorString(cudaGetLastError()));
        (void)!write(wfd, &port, sizeof(port));
        _exit(1);
    }
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = lay;
    o.region = (kvx_region){.base = pool,
                            .n_segments = (uint32_t)g->layers,
                            .segment_stride = (uint64_t)g->blocks * g->block_bytes,
                            .block_bytes = g->block_bytes,
                            .n_blocks = (uint32_t)g->blocks,
                            .device = true};
    memcpy(o.region.ipc_handle, &h, 64);
    memcpy(o.region.device_uuid, prop.uuid.bytes, 16);
    o.release_cb = no_release;
    kvx_agent *a;
    td_err err;
    if (kvx_agent_create(&a, &o, &err)) {
        fprintf(stderr, "bench-xfer-cuda: producer: %s\n", err.msg);
        (void)!write(wfd, &port, sizeof(port));
        _exit(1);
    }
    int32_t *blocks = malloc((size_t)g->blocks * sizeof(int32_t));
    for (int i = 0; i < g->blocks; i++)
        blocks[i] = i;
    char(*tids)[KVX_ID_HEX] = calloc((size_t)n_leases, KVX_ID_HEX);
    for (int k = 0; k < n_leases; k++)
        if (kvx_agent_register(a, blocks, g->blocks, 3600000, NULL, tids[k], &err)) _exit(1);
    port = kvx_agent_port(a);
    (void)!write(wfd, &port, sizeof(port));
    (void)!write(wfd, kvx_agent_engine_id(a), KVX_ID_HEX);
    (void)!write(wfd, tids, (size_t)n_leases * KVX_ID_HEX);
    char c;
    (void)!read(rfd, &c, 1);
    kvx_agent_destroy(a);
    _exit(0);
}

static bool read_full(int fd, void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r <= 0) return false;
        p += r;
        n -= (size_t)r;
    }
    return true;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Device-to-device copy of 1 GiB, best of 5: payload GB/s. */
static double d2d_gbs(void)
{
    size_t n = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) return 0;
    cudaMemset(a, 1, n);
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    double best = 0;
    for (int i = 0; i < 5; i++) {
        cudaDeviceSynchronize();
        uint64_t t0 = td_now_ns();
        cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
        cudaDeviceSynchronize();
        double gbs = (double)n / (double)(td_now_ns() - t0);
        if (gbs > best) best = gbs;
    }
    cudaFree(a);
    cudaFree(b);
    return best;
}

int cli_bench_xfer_cuda(int argc, char **argv)
{
    int64_t tokens = 2048, layers = 32, kv_heads = 8, head_dim = 128, block_size = 16, reps = 5;
    int64_t threads = 16, qp = 4;
    const char *conc_s = "1,4,16", *proto_s = "cuda_ipc";
    cli_flag flags[] = {
        CLI_FLAG("protocol", CLI_FLAG_STR, &proto_s,
                 "cuda_ipc, or tcp or ucx (GPU memory through pinned host staging on both "
                 "sides)"),
        CLI_FLAG("tokens", CLI_FLAG_INT, &tokens, "prompt tokens per transfer (2048)"),
        CLI_FLAG("layers", CLI_FLAG_INT, &layers, "layers (32: the Llama-3-8B shape)"),
        CLI_FLAG("kv-heads", CLI_FLAG_INT, &kv_heads, "KV heads (8)"),
        CLI_FLAG("head-dim", CLI_FLAG_INT, &head_dim, "head dimension (128)"),
        CLI_FLAG("block-size", CLI_FLAG_INT, &block_size, "tokens per block (16)"),
        CLI_FLAG("concurrency", CLI_FLAG_STR, &conc_s, "concurrent transfers (1,4,16)"),
        CLI_FLAG("reps", CLI_FLAG_INT, &reps, "repetitions per cell (5)"),
        CLI_FLAG("num-worker-threads", CLI_FLAG_INT, &threads, "consumer worker threads (16)"),
        CLI_FLAG("qp-per-transfer", CLI_FLAG_INT, &qp, "pieces per transfer (4)"),
    };
    int prc = cli_flags_parse(flags, (int)TD_ARRAY_LEN(flags), argc, argv,
                              "tandem bench-xfer-cuda [options]");
    if (prc) return prc == 1 ? 0 : 2;
    bool ucx = !strcmp(proto_s, "ucx");
    bool tcp = !strcmp(proto_s, "tcp") || ucx; /* staged: no ratio to the D2D floor */
    if (!tcp && strcmp(proto_s, "cuda_ipc")) {
        fprintf(stderr, "bench-xfer-cuda: --protocol must be cuda_ipc, tcp or ucx, got '%s'\n",
                proto_s);
        return 2;
    }
    int concs[16], n_conc = 0, max_conc = 0;
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", conc_s);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && n_conc < 16;
         t = strtok_r(NULL, ",", &save)) {
        int64_t v;
        if (td_parse_i64(t, &v) || v < 1 || v > 64) {
            fprintf(stderr, "bench-xfer-cuda: --concurrency takes numbers in [1, 64]\n");
            return 2;
        }
        concs[n_conc++] = (int)v;
        if (v > max_conc) max_conc = (int)v;
    }
    if (n_conc < 1 || tokens < 1 || tokens > (1 << 20) || layers < 1 || layers > 1024 ||
        kv_heads < 1 || kv_heads > 1024 || head_dim < 1 || head_dim > 1024 || block_size < 1 ||
        block_size > 1024 || reps < 1 || reps > 1000 || threads < 1 || threads > 256 || qp < 1 ||
        qp > 256) {
        fprintf(stderr, "bench-xfer-cuda: a flag is out of range (see --help)\n");
        return 2;
    }
    geom g = {.layers = (int)layers,
              .blocks = (int)((tokens + block_size - 1) / block_size),
              .block_bytes =
                  (uint64_t)block_size * (uint64_t)kv_heads * (uint64_t)head_dim * 2 * 2};
    kvx_layout lay = bench_layout(&g, (int)kv_heads, (int)head_dim, (int)block_size);
    int n_leases = 1 + max_conc * (int)reps * n_conc;
    if (n_leases > MAX_LEASES) n_leases = MAX_LEASES;
    int up[2], down[2];
    if (pipe(up) || pipe(down)) return 1;
    pid_t child = fork(); /* before this process touches CUDA */
    if (child == 0) {
        close(up[0]);
        close(down[1]);
        producer_main(&g, lay, n_leases, up[1], down[0]);
    }
    close(up[1]);
    close(down[0]);
    uint16_t port = 0;
    char engine[KVX_ID_HEX];
    char(*tids)[KVX_ID_HEX] = calloc((size_t)n_leases, KVX_ID_HEX);
    int rc = 1;
    kvx_client *k = NULL;
    void *pool = NULL;
    if (!read_full(up[0], &port, sizeof(port)) || !port || !read_full(up[0], engine, KVX_ID_HEX) ||
        !read_full(up[0], tids, (size_t)n_leases * KVX_ID_HEX)) {
        fprintf(stderr, "bench-xfer-cuda: the producer process did not start\n");
        goto out;
    }
    uint64_t xfer_bytes = (uint64_t)g.layers * g.blocks * g.block_bytes;
    uint64_t seg = (uint64_t)max_conc * g.blocks * g.block_bytes;
    if (cudaMalloc(&pool, seg * g.layers) != cudaSuccess) {
        fprintf(stderr, "bench-xfer-cuda: cannot allocate the consumer's %.1f GiB\n",
                (double)seg * g.layers / (1 << 30));
        goto out;
    }
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = lay;
    o.region = (kvx_region){.base = pool,
                            .n_segments = (uint32_t)g.layers,
                            .segment_stride = seg,
                            .block_bytes = g.block_bytes,
                            .n_blocks = (uint32_t)(max_conc * g.blocks),
                            .device = true};
    o.protocol = ucx ? KVX_PROTO_UCX : tcp ? KVX_PROTO_TCP : KVX_PROTO_CUDA_IPC;
    o.num_worker_threads = (int)threads;
    o.qp_per_transfer = (int)qp;
    o.transfer_timeout_ms = 60000;
    td_err err;
    if (kvx_client_create(&k, &o, &err)) {
        fprintf(stderr, "bench-xfer-cuda: %s\n", err.msg);
        goto out;
    }
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    double floor_gbs = d2d_gbs();
    printf("bench-xfer-cuda: %s over %s; a transfer is %lld tokens x %d layers (%d blocks of %.0f "
           "KiB per layer) = %.1f MiB; %lld worker threads, %lld pieces per transfer%s\n",
           prop.name, proto_s, (long long)tokens, g.layers, g.blocks, (double)g.block_bytes / 1024,
           (double)xfer_bytes / (1 << 20), (long long)threads, (long long)qp,
           ucx ? "; staged through registered pinned host memory"
           : tcp ? (getenv("TD_KVX_STAGE_OVERLAP") && !strcmp(getenv("TD_KVX_STAGE_OVERLAP"), "0")
                      ? "; staging copies synchronous (TD_KVX_STAGE_OVERLAP=0)"
                      : "; staging copies overlapped")
               : "");
    printf("floor: cudaMemcpy device to device, 1 GiB: %.0f GB/s of payload (%.0f GB/s read + "
           "written)\n",
           floor_gbs, 2 * floor_gbs);
    int32_t *src = malloc((size_t)g.blocks * sizeof(int32_t)),
            *dst = malloc((size_t)g.blocks * sizeof(int32_t));
    kvx_xfer **xs = calloc((size_t)max_conc, sizeof(*xs));
    double *cell = calloc((size_t)reps, sizeof(double));
    int next = 0;
    for (int i = 0; i < g.blocks; i++)
        src[i] = i;
    printf("%-12s %12s %12s %12s %10s\n", "concurrency", "best GB/s", "median GB/s", "ms (median)",
           "x floor");
    for (int ci = -1; ci < n_conc; ci++) {
        int C = ci < 0 ? 1 : concs[ci]; /* ci -1: warm-up (opens the handle, makes the streams) */
        for (int r = 0; r < (ci < 0 ? 1 : reps); r++) {
            if (next + C > n_leases) next = 0; /* leases may be read again */
            uint64_t t0 = td_now_ns();
            for (int j = 0; j < C; j++) {
                for (int i = 0; i < g.blocks; i++)
                    dst[i] = j * g.blocks + i;
                kvx_read_req rq = {.host = "127.0.0.1",
                                   .port = port,
                                   .engine_id = engine,
                                   .transfer_id = tids[next++],
                                   .src_blocks = src,
                                   .dst_blocks = dst,
                                   .n_blocks = g.blocks};
                if (kvx_read_start(k, &rq, &xs[j], &err)) {
                    fprintf(stderr, "bench-xfer-cuda: %s\n", err.msg);
                    goto out;
                }
            }
            int bad = 0;
            for (int j = 0; j < C; j++) {
                td_err res;
                if (kvx_xfer_wait(xs[j], &res)) {
                    fprintf(stderr, "bench-xfer-cuda: transfer failed: %s\n", res.msg);
                    bad = 1;
                }
                kvx_xfer_free(xs[j]);
            }
            if (bad) goto out;
            if (ci >= 0) cell[r] = (double)(td_now_ns() - t0) / 1e9;
        }
        if (ci < 0) continue;
        qsort(cell, (size_t)reps, sizeof(double), cmp_double);
        double bytes = (double)xfer_bytes * C, best = bytes / cell[0] / 1e9,
               med = bytes / cell[reps / 2] / 1e9;
        if (tcp) /* the D2D floor is not this path's: no ratio */
            printf("%-12d %12.1f %12.1f %12.3f %10s\n", C, best, med, cell[reps / 2] * 1e3, "-");
        else
            printf("%-12d %12.0f %12.0f %12.3f %9.2fx\n", C, best, med, cell[reps / 2] * 1e3,
                   floor_gbs > 0 ? med / floor_gbs : 0);
    }
    rc = 0;
out:
    if (k) kvx_client_destroy(k);
    if (pool) cudaFree(pool);
    close(down[1]); /* the producer exits */
    waitpid(child, NULL, 0);
    return rc;
}
#endif
