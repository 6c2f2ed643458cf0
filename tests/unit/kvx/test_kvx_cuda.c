/*
 * The kvx cuda_ipc transport on a real GPU (built with -DTANDEM_CUDA=ON; skipped, ctest
 * code 77, where no GPU answers). The producer is another process, forked before any CUDA
 * call (CUDA does not survive a fork): its KV pool is device memory filled with a known
 * pattern, served by an agent that requires a token, with leases it reports through a
 * pipe. The consumer copies out of it device to device, by several transfers at once,
 * and the bytes are checked on the host. Then: a guessed transfer id copies nothing, a
 * wrong token is refused, tcp between the two GPU pools through pinned host staging (with
 * checksums, a corrupted byte caught), the same over ucx (staged on both sides: Debian's
 * UCX cannot touch GPU memory), and a producer killed mid-session ends the next
 * transfer with an error (never a hang). Last, a consumer in the producer's own process (the pointer
 * path: a process cannot open its own IPC handle).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvx/kvx.h"
#include "kvx/kvx_internal.h"

#define N_SEG 6
#define N_BLOCKS 256
#define BLOCK_BYTES 8192
#define STRIDE ((size_t)N_BLOCKS * BLOCK_BYTES + 65536) /* padding between segments */
#define POOL_BYTES (N_SEG * STRIDE)
#define TOKEN "cuda-test-token"
#define N_LEASES 4

static kvx_layout layout(void)
{
    return (kvx_layout){.model_fingerprint = 77,
                        .n_layers = N_SEG,
                        .n_kv_heads = 4,
                        .head_dim = 64,
                        .block_size = 16,
                        .kv_dtype = 1,
                        .tp_size = 1};
}

/* The producer pool's byte at offset i (both processes compute it). */
static uint8_t pattern(size_t i, uint32_t seed)
{
    uint32_t v = (uint32_t)(i / 4) * 2654435761u + seed;
    return (uint8_t)(v >> (8 * (i % 4)));
}

static uint8_t *make_device_pool(uint32_t seed, kvx_region *r)
{
    uint8_t *host = malloc(POOL_BYTES), *dev = NULL;
    for (size_t i = 0; i < POOL_BYTES; i++)
        host[i] = seed ? pattern(i, seed) : 0;
    if (cudaMalloc((void **)&dev, POOL_BYTES) != cudaSuccess ||
        cudaMemcpy(dev, host, POOL_BYTES, cudaMemcpyHostToDevice) != cudaSuccess) {
        free(host);
        return NULL;
    }
    free(host);
    *r = (kvx_region){.base = dev,
                      .n_segments = N_SEG,
                      .segment_stride = STRIDE,
                      .block_bytes = BLOCK_BYTES,
                      .n_blocks = N_BLOCKS,
                      .device = true};
    cudaIpcMemHandle_t h;
    struct cudaDeviceProp prop;
    if (cudaIpcGetMemHandle(&h, dev) != cudaSuccess ||
        cudaGetDeviceProperties(&prop, 0) != cudaSuccess)
        return NULL;
    memcpy(r->ipc_handle, &h, 64);
    memcpy(r->device_uuid, prop.uuid.bytes, 16);
    return dev;
}

/* What the producer child tells the parent. */
typedef struct child_info {
    int ok; /* 1, or 0: no GPU (skip) */
    uint16_t port;
    char engine_id[KVX_ID_HEX];
    char tid[N_LEASES][KVX_ID_HEX]; /* lease k: producer blocks [40k, 40k + 40) */
} child_info;

static pid_t g_child = -1;
static child_info g_info;

static void on_release(void *u, const char *id, const int32_t *b, int n, kvx_release_reason r,
                       void *tu)
{
    (void)u, (void)id, (void)b, (void)n, (void)r, (void)tu;
}

/* The producer process: never returns. */
static void producer_main(int wfd, int rfd)
{
    child_info ci = {0};
    int n_dev = 0;
    kvx_region r;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1 || !make_device_pool(11, &r)) {
        (void)!write(wfd, &ci, sizeof(ci));
        _exit(0);
    }
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = r;
    o.release_cb = on_release;
    o.auth_token = TOKEN;
    kvx_agent *a;
    td_err err;
    if (kvx_agent_create(&a, &o, &err)) {
        fprintf(stderr, "producer: %s\n", err.msg);
        _exit(1);
    }
    for (int k = 0; k < N_LEASES; k++) {
        int32_t blocks[40];
        for (int i = 0; i < 40; i++)
            blocks[i] = 40 * k + i;
        if (kvx_agent_register(a, blocks, 40, 600000, NULL, ci.tid[k], &err)) _exit(1);
    }
    ci.ok = 1;
    ci.port = kvx_agent_port(a);
    snprintf(ci.engine_id, sizeof(ci.engine_id), "%s", kvx_agent_engine_id(a));
    (void)!write(wfd, &ci, sizeof(ci));
    char c;
    (void)!read(rfd, &c, 1); /* until the parent says so, or kills us */
    kvx_agent_destroy(a);
    _exit(0);
}

static kvx_client *consumer_proto(const char *token, uint8_t **pool, kvx_region *r,
                                  kvx_protocol proto)
{
    *pool = make_device_pool(0, r);
    assert_non_null(*pool);
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = *r;
    o.protocol = proto;
    o.transfer_timeout_ms = 5000;
    o.auth_token = token;
    kvx_client *k;
    td_err err;
    int rc = kvx_client_create(&k, &o, &err);
    if (rc) fprintf(stderr, "client: %s\n", err.msg);
    assert_int_equal(rc, 0);
    return k;
}

static kvx_client *consumer(const char *token, uint8_t **pool, kvx_region *r)
{
    return consumer_proto(token, pool, r, KVX_PROTO_CUDA_IPC);
}

static kvx_xfer *read_start(kvx_client *k, uint16_t port, const char *engine, const char *tid,
                            int src, int dst, int n)
{
    int32_t s[256], d[256];
    for (int i = 0; i < n; i++)
        s[i] = src + i, d[i] = dst + i;
    kvx_read_req rq = {.host = "127.0.0.1",
                       .port = port,
                       .engine_id = engine,
                       .transfer_id = tid,
                       .src_blocks = s,
                       .dst_blocks = d,
                       .n_blocks = n};
    kvx_xfer *x;
    td_err err;
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    return x;
}

/* Consumer blocks [dst, dst + n) hold the producer's (seed) blocks [src, src + n). */
static bool holds(const uint8_t *pool, int src, int dst, int n, uint32_t seed)
{
    uint8_t *host = malloc(POOL_BYTES);
    assert_int_equal(cudaMemcpy(host, pool, POOL_BYTES, cudaMemcpyDeviceToHost), cudaSuccess);
    bool ok = true;
    for (int s = 0; s < N_SEG && ok; s++)
        for (size_t j = 0; j < (size_t)n * BLOCK_BYTES && ok; j++) {
            size_t at = s * STRIDE + (size_t)dst * BLOCK_BYTES + j;
            ok = host[at] == (seed ? pattern(s * STRIDE + (size_t)src * BLOCK_BYTES + j, seed) : 0);
        }
    free(host);
    return ok;
}

static void test_cross_process(void **state)
{
    (void)state;
    uint8_t *pool;
    kvx_region r;
    kvx_client *k = consumer(TOKEN, &pool, &r);
    td_err res;
    /* One, then three at once (lease 0 twice, into other blocks: a lease may be read again). */
    kvx_xfer *x = read_start(k, g_info.port, g_info.engine_id, g_info.tid[0], 0, 10, 40);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    assert_true(holds(pool, 0, 10, 40, 11));
    kvx_xfer *xs[3];
    for (int i = 0; i < 3; i++)
        xs[i] = read_start(k, g_info.port, g_info.engine_id, g_info.tid[i + 1], 40 * (i + 1),
                           60 + 50 * i, 40);
    for (int i = 0; i < 3; i++) {
        int rc = kvx_xfer_wait(xs[i], &res);
        if (rc) fprintf(stderr, "transfer %d: %s\n", i, res.msg);
        assert_int_equal(rc, 0);
        kvx_xfer_info info;
        kvx_xfer_get_info(xs[i], &info);
        assert_true(info.bytes == (uint64_t)40 * BLOCK_BYTES * N_SEG);
        kvx_xfer_free(xs[i]);
        assert_true(holds(pool, 40 * (i + 1), 60 + 50 * i, 40, 11));
    }
    /* Blocks outside the lease: refused, nothing copied. */
    cudaMemset(pool, 0, POOL_BYTES);
    x = read_start(k, g_info.port, g_info.engine_id, g_info.tid[0], 41, 0, 40);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ERANGE);
    kvx_xfer_free(x);
    /* A guessed transfer id: refused, nothing copied. */
    x = read_start(k, g_info.port, g_info.engine_id, "0123456789abcdef0123456789abcdef", 0, 0, 8);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ENOTFOUND);
    kvx_xfer_free(x);
    assert_true(holds(pool, 0, 0, N_BLOCKS, 0));
    kvx_client_destroy(k);
    cudaFree(pool);

    /* The wrong token. */
    k = consumer("not-the-token", &pool, &r);
    x = read_start(k, g_info.port, g_info.engine_id, g_info.tid[0], 0, 0, 8);
    int rc = kvx_xfer_wait(x, &res);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(res.msg, "auth"));
    kvx_xfer_free(x);
    assert_true(holds(pool, 0, 0, N_BLOCKS, 0));
    kvx_client_destroy(k);
    cudaFree(pool);
}

/* Three concurrent transfers of n blocks between the two GPU pools by a staging protocol
 * (tcp or ucx), with checksums computed on the staged bytes: equal bytes; then a corrupted
 * byte caught. Returns after the client is gone. */
static void staged_transfers(int proto, int dst0, int n)
{
    uint8_t *pool;
    kvx_region r;
    kvx_client *k = consumer_proto(TOKEN, &pool, &r, proto);
    td_err res;
    kvx_xfer *xs[3];
    for (int i = 0; i < 3; i++)
        xs[i] = read_start(k, g_info.port, g_info.engine_id, g_info.tid[i], 40 * i,
                           dst0 - 60 * i, n);
    for (int i = 0; i < 3; i++) {
        int rc = kvx_xfer_wait(xs[i], &res);
        if (rc) fprintf(stderr, "transfer %d: %s\n", i, res.msg);
        assert_int_equal(rc, 0);
        kvx_xfer_free(xs[i]);
        assert_true(holds(pool, 40 * i, dst0 - 60 * i, n, 11));
    }
    atomic_store(&kvx__test_corrupt_pieces, 1);
    kvx_xfer *x = read_start(k, g_info.port, g_info.engine_id, g_info.tid[3], 120, 0, 40);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_EPROTO);
    assert_non_null(strstr(res.msg, "checksum mismatch"));
    kvx_xfer_free(x);
    atomic_store(&kvx__test_corrupt_pieces, 0);
    kvx_client_destroy(k);
    cudaFree(pool);
}

/* tcp between two GPU pools, through pinned host staging on both sides. */
static void test_tcp_staging(void **state)
{
    (void)state;
    staged_transfers(KVX_PROTO_TCP, 200, 40);
}

/* ucx between the two GPU pools (UCX_TLS=tcp, set in main): the producer copies each grant
 * into a registered pinned staging slot, the consumer gets it into its channel's pinned
 * staging and copies it up. */
static void test_ucx_staging(void **state)
{
    (void)state;
    if (!kvx_protocol_available(KVX_PROTO_UCX)) {
        printf("  (built without UCX: ucx from GPU memory not tested here)\n");
        skip();
    }
    int unstaged0 = atomic_load(&kvx__test_ucx_pieces_unstaged);
    staged_transfers(KVX_PROTO_UCX, 230, 20);
    assert_true(atomic_load(&kvx__test_ucx_pieces_unstaged) >= unstaged0 + 3);
}

/* The producer dies between two transfers of one session: the second ends, with an error. */
static void test_producer_dies(void **state)
{
    (void)state;
    uint8_t *pool;
    kvx_region r;
    kvx_client *k = consumer(TOKEN, &pool, &r);
    td_err res;
    kvx_xfer *x = read_start(k, g_info.port, g_info.engine_id, g_info.tid[1], 40, 0, 40);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    kill(g_child, SIGKILL);
    waitpid(g_child, NULL, 0);
    g_child = -1;
    uint64_t t0 = td_now_ns();
    x = read_start(k, g_info.port, g_info.engine_id, g_info.tid[2], 80, 100, 40);
    int rc = kvx_xfer_wait(x, &res);
    fprintf(stderr, "after the producer died: %s (%.2f s)\n", res.msg,
            (double)(td_now_ns() - t0) / 1e9);
    assert_int_not_equal(rc, 0);
    assert_true(td_now_ns() - t0 < 6000000000ull); /* the transfer's own deadline bounds it */
    kvx_xfer_free(x);
    kvx_client_destroy(k);
    cudaFree(pool);
}

/* Producer and consumer in one process: the consumer copies from the agent's pointer. */
static void test_same_process(void **state)
{
    (void)state;
    kvx_region pr;
    uint8_t *ppool = make_device_pool(5, &pr);
    assert_non_null(ppool);
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = pr;
    o.release_cb = on_release;
    kvx_agent *a;
    td_err err;
    assert_int_equal(kvx_agent_create(&a, &o, &err), 0);
    uint8_t *pool;
    kvx_region r;
    kvx_client *k = consumer(NULL, &pool, &r);
    int32_t blocks[100];
    for (int i = 0; i < 100; i++)
        blocks[i] = 100 + i;
    char tid[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(a, blocks, 100, 0, NULL, tid, &err), 0);
    kvx_xfer *x = read_start(k, kvx_agent_port(a), kvx_agent_engine_id(a), tid, 100, 3, 100);
    td_err res;
    int rc = kvx_xfer_wait(x, &res);
    if (rc) fprintf(stderr, "same process: %s\n", res.msg);
    assert_int_equal(rc, 0);
    kvx_xfer_free(x);
    assert_true(holds(pool, 100, 3, 100, 5));
    /* Scattered consumer blocks (runs of one block: no strided copies). */
    int32_t src[100], dst[100];
    for (int i = 0; i < 100; i++)
        src[i] = 100 + i, dst[i] = 255 - 2 * i;
    kvx_read_req rq = {.host = "127.0.0.1",
                       .port = kvx_agent_port(a),
                       .engine_id = kvx_agent_engine_id(a),
                       .transfer_id = tid,
                       .src_blocks = src,
                       .dst_blocks = dst,
                       .n_blocks = 100};
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    for (int i = 0; i < 100; i += 9)
        assert_true(holds(pool, 100 + i, 255 - 2 * i, 1, 5));
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    cudaFree(pool);
    cudaFree(ppool);
}

int main(void)
{
    /* Fork the producer before this process touches CUDA. ucx (where built) runs over TCP
     * here, on both sides: a GPU machine need not have RDMA devices. */
    setenv("UCX_TLS", "tcp", 1);
    int up[2], down[2];
    if (pipe(up) || pipe(down)) return 1;
    g_child = fork();
    if (g_child == 0) {
        close(up[0]);
        close(down[1]);
        producer_main(up[1], down[0]);
    }
    close(up[1]);
    close(down[0]);
    if (read(up[0], &g_info, sizeof(g_info)) != (ssize_t)sizeof(g_info)) {
        fprintf(stderr, "the producer process failed to start\n");
        return 1;
    }
    if (!g_info.ok) {
        printf("SKIP: no CUDA device here (cudaGetDeviceCount): the cuda_ipc tests need a GPU\n");
        waitpid(g_child, NULL, 0);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cross_process),
        cmocka_unit_test(test_tcp_staging),
        cmocka_unit_test(test_ucx_staging),
        cmocka_unit_test(test_producer_dies),
        cmocka_unit_test(test_same_process),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (g_child > 0) {
        kill(g_child, SIGKILL);
        waitpid(g_child, NULL, 0);
    }
    return rc;
}
