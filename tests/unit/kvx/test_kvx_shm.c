/*
 * The kvx shm transport over real sockets and a real memfd: a consumer maps the
 * producer's pool and copies granted blocks out of it. Data equal at several sizes and 16
 * transfers at once; corruption caught by the checksums; an unknown transfer id copies
 * nothing; a producer whose pool is not shareable is a clear error; a restarted producer
 * gets a new session (and mapping).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvx/kvx.h"
#include "kvx/kvx_internal.h"

#define N_SEG 6
#define N_BLOCKS 256
#define BLOCK_BYTES 4096
#define STRIDE ((size_t)N_BLOCKS * BLOCK_BYTES)

typedef struct side {
    uint8_t *mem;
    int fd;
    kvx_region region;
} side;

static void producer_side(side *s, bool shareable, uint32_t seed)
{
    size_t len = N_SEG * STRIDE;
    s->fd = -1;
    if (shareable) {
        s->fd = memfd_create("test-kv", MFD_CLOEXEC);
        assert_true(s->fd >= 0);
        assert_int_equal(ftruncate(s->fd, (off_t)len), 0);
        s->mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    } else {
        s->mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    assert_true(s->mem != MAP_FAILED);
    for (size_t i = 0; i < len; i += 4) {
        uint32_t v = (uint32_t)i * 2654435761u + seed;
        memcpy(s->mem + i, &v, 4);
    }
    s->region = (kvx_region){.base = s->mem, .n_segments = N_SEG, .segment_stride = STRIDE,
                             .block_bytes = BLOCK_BYTES, .n_blocks = N_BLOCKS,
                             .shm = shareable, .shm_fd = s->fd};
}

static void consumer_side(side *s)
{
    s->fd = -1;
    s->mem = mmap(NULL, N_SEG * STRIDE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(s->mem != MAP_FAILED);
    s->region = (kvx_region){.base = s->mem, .n_segments = N_SEG, .segment_stride = STRIDE,
                             .block_bytes = BLOCK_BYTES, .n_blocks = N_BLOCKS};
}

static void side_free(side *s)
{
    munmap(s->mem, N_SEG * STRIDE);
    if (s->fd >= 0) close(s->fd);
}

static kvx_layout layout(void)
{
    return (kvx_layout){.model_fingerprint = 9, .n_layers = N_SEG, .n_kv_heads = 2,
                        .head_dim = 64, .block_size = 16, .kv_dtype = 1, .tp_size = 1};
}

static _Atomic int g_released;
static void on_release(void *u, const char *id, const int32_t *b, int n, kvx_release_reason r,
                       void *tu)
{
    (void)u, (void)id, (void)b, (void)n, (void)r, (void)tu;
    atomic_fetch_add(&g_released, 1);
}

static kvx_agent *agent(side *p)
{
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = p->region;
    o.release_cb = on_release;
    kvx_agent *a;
    td_err err;
    assert_int_equal(kvx_agent_create(&a, &o, &err), 0);
    return a;
}

static kvx_client *client(side *c)
{
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = c->region;
    o.transfer_timeout_ms = 5000;
    o.protocol = KVX_PROTO_SHM;
    kvx_client *k;
    td_err err;
    assert_int_equal(kvx_client_create(&k, &o, &err), 0);
    return k;
}

/* Start a read of producer blocks [src, src + n) into consumer blocks [dst, dst + n). */
static kvx_xfer *start(kvx_agent *a, kvx_client *k, int src, int dst, int n, char tid[KVX_ID_HEX],
                       const char *force_tid)
{
    int32_t *s = malloc((size_t)n * sizeof(int32_t)), *d = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) s[i] = src + i, d[i] = dst + i;
    td_err err;
    assert_int_equal(kvx_agent_register(a, s, n, 0, NULL, tid, &err), 0);
    kvx_read_req rq = {.host = "127.0.0.1", .port = kvx_agent_port(a),
                       .engine_id = kvx_agent_engine_id(a), .transfer_id = force_tid ? force_tid : tid,
                       .src_blocks = s, .dst_blocks = d, .n_blocks = n};
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    free(s);
    free(d);
    return x;
}

static bool same(side *p, side *c, int src, int dst, int n)
{
    for (int s = 0; s < N_SEG; s++)
        if (memcmp(c->mem + s * STRIDE + (size_t)dst * BLOCK_BYTES,
                   p->mem + s * STRIDE + (size_t)src * BLOCK_BYTES, (size_t)n * BLOCK_BYTES))
            return false;
    return true;
}

static void test_shm_reads(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 1);
    consumer_side(&c);
    kvx_agent *a = agent(&p);
    kvx_client *k = client(&c);
    const int sizes[] = {1, 7, 64, 200};
    for (size_t i = 0; i < 4; i++) {
        char tid[KVX_ID_HEX];
        td_err res;
        kvx_xfer *x = start(a, k, 3, 40, sizes[i], tid, NULL);
        assert_int_equal(kvx_xfer_wait(x, &res), 0);
        kvx_xfer_free(x);
        assert_true(same(&p, &c, 3, 40, sizes[i]));
        kvx_agent_cancel(a, tid);
    }
    /* 16 at once, each to its own consumer blocks. */
    kvx_xfer *xs[16];
    char tids[16][KVX_ID_HEX];
    for (int i = 0; i < 16; i++) xs[i] = start(a, k, i * 16, 255 - (i + 1) * 15, 15, tids[i], NULL);
    for (int i = 0; i < 16; i++) {
        td_err res;
        assert_int_equal(kvx_xfer_wait(xs[i], &res), 0);
        kvx_xfer_free(xs[i]);
        assert_true(same(&p, &c, i * 16, 255 - (i + 1) * 15, 15));
        kvx_agent_cancel(a, tids[i]);
    }
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    side_free(&p);
    side_free(&c);
}

static void test_shm_failures(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 2);
    consumer_side(&c);
    kvx_agent *a = agent(&p);
    kvx_client *k = client(&c);
    char tid[KVX_ID_HEX];
    td_err res;
    /* Corruption: the checksum catches it. */
    atomic_store(&kvx__test_corrupt_pieces, 1);
    kvx_xfer *x = start(a, k, 0, 0, 8, tid, NULL);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_EPROTO);
    assert_non_null(strstr(res.msg, "checksum mismatch"));
    kvx_xfer_free(x);
    atomic_store(&kvx__test_corrupt_pieces, 0);
    kvx_agent_cancel(a, tid);
    /* A guessed transfer id copies nothing. */
    memset(c.mem, 0, N_SEG * STRIDE);
    x = start(a, k, 0, 100, 8, tid, "0123456789abcdef0123456789abcdef");
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ENOTFOUND);
    kvx_xfer_free(x);
    for (size_t i = 0; i < N_SEG * STRIDE; i++) assert_int_equal(c.mem[i], 0);
    kvx_agent_cancel(a, tid);
    /* A restarted producer: a new engine id and mapping; the old id fails clearly. */
    char old_id[KVX_ID_HEX];
    snprintf(old_id, sizeof(old_id), "%s", kvx_agent_engine_id(a));
    kvx_agent_destroy(a);
    side_free(&p);
    producer_side(&p, true, 3);
    a = agent(&p);
    x = start(a, k, 5, 5, 4, tid, NULL);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    assert_true(same(&p, &c, 5, 5, 4));
    kvx_agent_cancel(a, tid);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    side_free(&p);

    /* A producer whose pool is private memory. */
    producer_side(&p, false, 4);
    a = agent(&p);
    k = client(&c);
    x = start(a, k, 0, 0, 2, tid, NULL);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_EUNSUPPORTED);
    assert_non_null(strstr(res.msg, "not shareable"));
    kvx_xfer_free(x);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    side_free(&p);
    side_free(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shm_reads),
        cmocka_unit_test(test_shm_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
