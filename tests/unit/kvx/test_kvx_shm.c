/*
 * The kvx shm transport over real sockets and a real memfd: a consumer maps the
 * producer's pool and copies granted blocks out of it. Data equal at several sizes and 16
 * transfers at once; corruption caught by the checksums; an unknown transfer id copies
 * nothing; a producer whose pool is not shareable is a clear error; a restarted producer
 * gets a new session (and mapping). Then the pins: a lease that expires, and a producer
 * destroyed, while a consumer copies must not hand the blocks back before the copy ends
 * (release_cb scribbles over them here); expired leases, deadlines, a producer destroyed
 * before it grants, the old engine id after a restart (whose mapping goes away), and the
 * SHM_INFO_ACK frame's strict decoding; and the checksums a producer keeps as it writes
 * (sent instead of computed, over shm and tcp).
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
#include "kvx/wire.h"

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
        char name[32];
        snprintf(name, sizeof(name), "test-kv-%u", seed);
        s->fd = memfd_create(name, MFD_CLOEXEC);
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
static _Atomic int g_reason;
/* When set, release_cb overwrites the blocks it gets back, as an engine reusing them would. */
static uint8_t *_Atomic g_scribble;
static void on_release(void *u, const char *id, const int32_t *b, int n, kvx_release_reason r,
                       void *tu)
{
    (void)u, (void)id, (void)tu;
    uint8_t *mem = atomic_load(&g_scribble);
    for (int i = 0; mem && i < n; i++)
        for (int s = 0; s < N_SEG; s++)
            memset(mem + s * STRIDE + (size_t)b[i] * BLOCK_BYTES, 0xee, BLOCK_BYTES);
    atomic_store(&g_reason, (int)r);
    atomic_fetch_add(&g_released, 1);
}

/* Wait until a consumer holds a grant and has begun its (delayed) copy. */
static void wait_copy_started(void)
{
    for (int i = 0; i < 500 && atomic_load(&kvx__test_copies_delayed) < 1; i++)
        usleep(2000);
    assert_true(atomic_load(&kvx__test_copies_delayed) >= 1);
}

static int wait_released(int n)
{
    for (int i = 0; i < 300 && atomic_load(&g_released) < n; i++)
        usleep(10 * 1000);
    return atomic_load(&g_released);
}

/* Mappings of the memfd named test-kv-<seed> in this process (both sides live here). */
static int count_maps(uint32_t seed)
{
    char want[48], line[512];
    snprintf(want, sizeof(want), "/memfd:test-kv-%u ", seed);
    FILE *f = fopen("/proc/self/maps", "r");
    assert_non_null(f);
    int n = 0;
    while (fgets(line, sizeof(line), f))
        if (strstr(line, want)) n++;
    fclose(f);
    return n;
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

static kvx_client *client_proto(side *c, kvx_protocol proto)
{
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = c->region;
    o.transfer_timeout_ms = 5000;
    o.protocol = proto;
    kvx_client *k;
    td_err err;
    assert_int_equal(kvx_client_create(&k, &o, &err), 0);
    return k;
}

static kvx_client *client(side *c)
{
    return client_proto(c, KVX_PROTO_SHM);
}

/* Start a read of producer blocks [src, src + n) into consumer blocks [dst, dst + n). */
static kvx_xfer *start_lease(kvx_agent *a, kvx_client *k, int src, int dst, int n,
                             char tid[KVX_ID_HEX], const char *force_tid, uint32_t lease_ms,
                             uint32_t timeout_ms)
{
    int32_t *s = malloc((size_t)n * sizeof(int32_t)), *d = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) s[i] = src + i, d[i] = dst + i;
    td_err err;
    assert_int_equal(kvx_agent_register(a, s, n, lease_ms, NULL, tid, &err), 0);
    kvx_read_req rq = {.host = "127.0.0.1",
                       .port = kvx_agent_port(a),
                       .engine_id = kvx_agent_engine_id(a),
                       .transfer_id = force_tid ? force_tid : tid,
                       .src_blocks = s,
                       .dst_blocks = d,
                       .n_blocks = n,
                       .timeout_ms = timeout_ms};
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    free(s);
    free(d);
    return x;
}

static kvx_xfer *start(kvx_agent *a, kvx_client *k, int src, int dst, int n, char tid[KVX_ID_HEX],
                       const char *force_tid)
{
    return start_lease(a, k, src, dst, n, tid, force_tid, 0, 0);
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

/* A lease that expired is gone: TD_ENOTFOUND, nothing copied, its blocks went back once. */
static void test_shm_expired_lease(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 5);
    consumer_side(&c);
    memset(c.mem, 0, N_SEG * STRIDE);
    kvx_agent *a = agent(&p);
    kvx_client *k = client(&c);
    atomic_store(&g_released, 0);
    int32_t b[] = {20, 21};
    char tid[KVX_ID_HEX];
    td_err err, res;
    assert_int_equal(kvx_agent_register(a, b, 2, 100, NULL, tid, &err), 0);
    assert_int_equal(wait_released(1), 1);
    assert_int_equal(atomic_load(&g_reason), KVX_RELEASED_EXPIRED);
    kvx_read_req rq = {.host = "127.0.0.1",
                       .port = kvx_agent_port(a),
                       .engine_id = kvx_agent_engine_id(a),
                       .transfer_id = tid,
                       .src_blocks = b,
                       .dst_blocks = b,
                       .n_blocks = 2};
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ENOTFOUND);
    kvx_xfer_free(x);
    for (size_t i = 0; i < N_SEG * STRIDE; i++)
        assert_int_equal(c.mem[i], 0);
    assert_int_equal(atomic_load(&g_released), 1);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    side_free(&p);
    side_free(&c);
}

/*
 * The lease expires (250 ms) while the consumer holds a grant and has not copied yet (it
 * waits 700 ms): release_cb, which overwrites the blocks, must wait for the copy, so the
 * read succeeds with the original bytes and the blocks go back once, afterwards.
 */
static void test_shm_pin_outlives_lease(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 6);
    consumer_side(&c);
    kvx_agent *a = agent(&p);
    kvx_client *k = client(&c);
    side orig;
    producer_side(&orig, false, 6); /* the same bytes, private */
    atomic_store(&g_released, 0);
    atomic_store(&g_scribble, p.mem);
    atomic_store(&kvx__test_copies_delayed, 0);
    atomic_store(&kvx__test_copy_delay_ms, 700);
    char tid[KVX_ID_HEX];
    td_err res;
    /* 2 blocks x 6 segments x 4 KiB: one piece, so one grant. */
    kvx_xfer *x = start_lease(a, k, 50, 60, 2, tid, NULL, 250, 3000);
    wait_copy_started();
    usleep(450 * 1000);
    assert_int_equal(atomic_load(&g_released), 0); /* expired, but pinned */
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    assert_int_equal(st.leases_expired, 1);
    int rc = kvx_xfer_wait(x, &res);
    if (rc) fprintf(stderr, "%s\n", res.msg);
    assert_int_equal(rc, 0);
    kvx_xfer_free(x);
    assert_true(same(&orig, &c, 50, 60, 2));
    assert_int_equal(wait_released(1), 1);
    assert_int_equal(atomic_load(&g_reason), KVX_RELEASED_EXPIRED);
    assert_int_equal(p.mem[50 * BLOCK_BYTES], 0xee); /* the scribble came after the copy */
    atomic_store(&kvx__test_copy_delay_ms, 0);
    atomic_store(&g_scribble, NULL);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    side_free(&p);
    side_free(&orig);
    side_free(&c);
}

/*
 * The producer is destroyed while a consumer copies a granted piece: kvx_agent_destroy
 * waits for the copy's UCX_DONE before the blocks go back (release_cb scribbles), so the
 * read succeeds intact; destroy takes about the rest of the copy, not the pin's 30 s.
 */
static void test_shm_destroy_during_copy(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 7);
    consumer_side(&c);
    kvx_agent *a = agent(&p);
    kvx_client *k = client(&c);
    side orig;
    producer_side(&orig, false, 7);
    /* A first read leaves an idle pooled connection too: destroy must hang up on it. */
    char tid[KVX_ID_HEX];
    td_err res;
    kvx_xfer *x = start(a, k, 0, 0, 2, tid, NULL);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    atomic_store(&g_released, 0);
    atomic_store(&g_scribble, p.mem);
    atomic_store(&kvx__test_copies_delayed, 0);
    atomic_store(&kvx__test_copy_delay_ms, 400);
    x = start_lease(a, k, 70, 80, 2, tid, NULL, 0, 3000); /* one piece */
    wait_copy_started();
    uint64_t t0 = td_now_ns();
    kvx_agent_destroy(a);
    double s = (double)(td_now_ns() - t0) * 1e-9;
    int rc = kvx_xfer_wait(x, &res);
    if (rc) fprintf(stderr, "%s\n", res.msg);
    assert_int_equal(rc, 0);
    kvx_xfer_free(x);
    assert_true(same(&orig, &c, 70, 80, 2));
    assert_true(s > 0.1 && s < 2.0);
    assert_int_equal(atomic_load(&g_released), 2); /* both leases, at shutdown */
    assert_int_equal(atomic_load(&g_reason), KVX_RELEASED_SHUTDOWN);
    atomic_store(&kvx__test_copy_delay_ms, 0);
    atomic_store(&g_scribble, NULL);
    kvx_client_destroy(k);
    side_free(&p);
    side_free(&orig);
    side_free(&c);
}

/* Deadlines and a producer that goes away before it grants: clear errors, on time. */
static void test_shm_deadline_and_death(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 8);
    consumer_side(&c);
    kvx_agent *a = agent(&p);
    kvx_client *k = client(&c);
    char tid[KVX_ID_HEX];
    td_err res;
    /* The producer grants after 1.5 s; the transfer may take 300 ms. */
    atomic_store(&kvx__test_send_delay_ms, 1500);
    uint64_t t0 = td_now_ns();
    kvx_xfer *x = start_lease(a, k, 1, 1, 1, tid, NULL, 0, 300);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ETIMEDOUT);
    assert_true((double)(td_now_ns() - t0) * 1e-9 < 1.0);
    kvx_xfer_free(x);
    /* The consumer's copy outlasts the deadline: the same. */
    atomic_store(&kvx__test_send_delay_ms, 0);
    atomic_store(&kvx__test_copy_delay_ms, 500);
    x = start_lease(a, k, 1, 1, 1, tid, NULL, 0, 300);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ETIMEDOUT);
    kvx_xfer_free(x);
    atomic_store(&kvx__test_copy_delay_ms, 0);
    /* The session still works afterwards. */
    x = start(a, k, 9, 9, 3, tid, NULL);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    assert_true(same(&p, &c, 9, 9, 3));
    /* Destroyed while a grant is on its way: TD_ECONN, nothing pinned, no hang. */
    atomic_store(&kvx__test_send_delay_ms, 400);
    x = start_lease(a, k, 30, 30, 3, tid, NULL, 0, 3000);
    usleep(100 * 1000);
    t0 = td_now_ns();
    kvx_agent_destroy(a);
    int rc = kvx_xfer_wait(x, &res);
    if (rc != TD_ECONN) fprintf(stderr, "rc %d: %s\n", rc, res.msg);
    assert_int_equal(rc, TD_ECONN);
    assert_true(res.msg[0] != 0);
    assert_true((double)(td_now_ns() - t0) * 1e-9 < 2.0);
    kvx_xfer_free(x);
    atomic_store(&kvx__test_send_delay_ms, 0);
    kvx_client_destroy(k);
    side_free(&p);
    side_free(&c);
}

/*
 * A producer restarts: a read naming the old engine id fails clearly ("it restarted"); the
 * first read of the new incarnation drops the old session, and with it the mapping of the
 * old pool (the memfd of seed 9 is then mapped nowhere in this process).
 */
static void test_shm_restart_drops_mapping(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 9);
    consumer_side(&c);
    kvx_agent *a = agent(&p);
    kvx_client *k = client(&c);
    char tid[KVX_ID_HEX], old_id[KVX_ID_HEX];
    td_err err, res;
    kvx_xfer *x = start(a, k, 0, 0, 4, tid, NULL);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    assert_int_equal(count_maps(9), 2); /* the producer's and the consumer's */
    snprintf(old_id, sizeof(old_id), "%s", kvx_agent_engine_id(a));
    uint16_t port = kvx_agent_port(a);
    kvx_agent_destroy(a);
    side_free(&p);
    assert_int_equal(count_maps(9), 1); /* the consumer's session still holds it */

    producer_side(&p, true, 10);
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = p.region;
    o.port = port; /* the same address, a new incarnation */
    o.release_cb = on_release;
    assert_int_equal(kvx_agent_create(&a, &o, &err), 0);
    int32_t b[] = {3};
    assert_int_equal(kvx_agent_register(a, b, 1, 0, NULL, tid, &err), 0);
    kvx_read_req rq = {.host = "127.0.0.1",
                       .port = port,
                       .engine_id = old_id,
                       .transfer_id = tid,
                       .src_blocks = b,
                       .dst_blocks = b,
                       .n_blocks = 1};
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    int rc = kvx_xfer_wait(x, &res);
    if (!strstr(res.msg, "restarted")) fprintf(stderr, "rc %d: %s\n", rc, res.msg);
    assert_true(rc != 0);
    assert_non_null(strstr(res.msg, "restarted"));
    kvx_xfer_free(x);
    kvx_agent_cancel(a, tid);
    x = start(a, k, 6, 6, 2, tid, NULL);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    assert_true(same(&p, &c, 6, 6, 2));
    assert_int_equal(count_maps(9), 0);
    assert_int_equal(count_maps(10), 2);
    kvx_client_destroy(k);
    assert_int_equal(count_maps(10), 1);
    kvx_agent_destroy(a);
    side_free(&p);
    side_free(&c);
}

/* SHM_INFO_ACK: round trip, and the strict decoder's refusals. */
static void test_shm_info_frame(void **state)
{
    (void)state;
    uint8_t buf[128];
    kvx_msg m;
    td_err err;
    size_t n = kvx_wire_encode_shm_info(buf, sizeof(buf), 5, 1234, 7, 4096, 1 << 20, 1 << 16, 0x22,
                                        0x1234567890ull);
    assert_int_equal(n, KVX_HDR_BYTES + 48);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_SHM_INFO_ACK);
    assert_int_equal(m.u.shm_info.pid, 1234);
    assert_int_equal(m.u.shm_info.fd, 7);
    assert_int_equal(m.u.shm_info.offset, 4096);
    assert_int_equal(m.u.shm_info.bytes, 1 << 20);
    assert_int_equal(m.u.shm_info.segment_stride, 1 << 16);
    assert_int_equal(m.u.shm_info.dev, 0x22);
    assert_int_equal(m.u.shm_info.ino, 0x1234567890ull);
    /* pid 0, an empty region, a stride past the region, a wrapping region. */
    const struct {
        uint32_t pid;
        uint64_t offset, bytes, stride;
    } bad[] = {{0, 0, 100, 10}, {1, 0, 0, 1}, {1, 0, 100, 101}, {1, UINT64_MAX - 5, 100, 10}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        n = kvx_wire_encode_shm_info(buf, sizeof(buf), 1, bad[i].pid, 3, bad[i].offset,
                                     bad[i].bytes, bad[i].stride, 1, 1);
        assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    }
    /* A payload of the old 32 bytes is refused. */
    n = kvx_wire_encode_shm_info(buf, sizeof(buf), 1, 1, 3, 0, 100, 10, 1, 1);
    buf[8] = 32;
    assert_int_equal(kvx_wire_decode_frame(buf, KVX_HDR_BYTES + 32, &m, &err), TD_EFORMAT);
    /* SHM_INFO is empty. */
    n = kvx_wire_encode_empty(buf, sizeof(buf), KVX_MSG_SHM_INFO, 9);
    assert_int_equal(n, KVX_HDR_BYTES);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_SHM_INFO);
}

/*
 * A pool flagged as GPU memory (kvx_region.device) moves only by cuda_ipc, or by tcp
 * through host staging in CUDA builds: shm consumers (and tcp ones without CUDA) get a
 * clear error and no bytes (the host memory behind the flag here is never read), a
 * consumer's protocol must fit where its own pool lives, and a host pool's producer
 * refuses CUDA_INFO. (The copies themselves are tested on a GPU:
 * tests/unit/kvx/test_kvx_cuda.c.)
 */
static void test_device_region_guards(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 8);
    consumer_side(&c);
    memset(c.mem, 0, N_SEG * STRIDE);
    p.region.device = true;
    for (int i = 0; i < 64; i++) p.region.ipc_handle[i] = (uint8_t)(i + 1);
    kvx_agent *a = agent(&p);
    /* (With CUDA built, tcp stages GPU memory through pinned host memory: test_kvx_cuda.) */
    const kvx_protocol host_protos[] = {KVX_PROTO_SHM, KVX_PROTO_TCP};
    for (int i = 0; i < (kvx_protocol_available(KVX_PROTO_CUDA_IPC) ? 1 : 2); i++) {
        kvx_client *k = client_proto(&c, host_protos[i]);
        char tid[KVX_ID_HEX];
        td_err res;
        kvx_xfer *x = start(a, k, 0, 0, 4, tid, NULL);
        assert_int_equal(kvx_xfer_wait(x, &res), TD_EUNSUPPORTED);
        assert_non_null(strstr(res.msg, "GPU memory: use protocol cuda_ipc"));
        kvx_xfer_free(x);
        kvx_agent_cancel(a, tid);
        kvx_client_destroy(k);
    }
    for (size_t i = 0; i < N_SEG * STRIDE; i++) assert_int_equal(c.mem[i], 0);
    kvx_agent_destroy(a);

    /* The consumer's protocol and its own pool must agree. */
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = c.region;
    o.protocol = KVX_PROTO_CUDA_IPC;
    kvx_client *k;
    td_err err;
    assert_int_equal(kvx_client_create(&k, &o, &err), TD_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "host memory"));
    o.region.device = true;
    o.protocol = KVX_PROTO_SHM;
    assert_int_equal(kvx_client_create(&k, &o, &err), TD_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "use protocol cuda_ipc"));
#ifndef TD_HAVE_CUDA
    o.protocol = KVX_PROTO_CUDA_IPC;
    assert_int_equal(kvx_client_create(&k, &o, &err), TD_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "CUDA backend"));
    assert_false(kvx_protocol_available(KVX_PROTO_CUDA_IPC));
#endif
    assert_string_equal(kvx_protocol_name(KVX_PROTO_CUDA_IPC), "cuda_ipc");

    /* A host pool's producer refuses CUDA_INFO (a cuda_ipc consumer's first question). */
    p.region.device = false;
    a = agent(&p);
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = c.region;
    /* Greet it as a client would, then ask. */
    int fd = -1;
    assert_int_equal(kvx__connect("127.0.0.1", kvx_agent_port(a), td_now_ns() + 2000000000ull, &fd, &err), 0);
    kvx_hello h;
    uint8_t id[KVX_ID_BYTES] = {1, 2, 3};
    kvx__hello_fill(&h, id, &o.layout, &o.region);
    uint8_t buf[1024];
    size_t n = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO, 1, &h);
    kvx_msg m;
    uint64_t dl = td_now_ns() + 2000000000ull;
    assert_int_equal(kvx__send_all(fd, buf, n, dl, &err), 0);
    assert_int_equal(kvx__recv_frame(fd, buf, sizeof(buf), &m, dl, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_HELLO_ACK);
    n = kvx_wire_encode_empty(buf, sizeof(buf), KVX_MSG_CUDA_INFO, 2);
    assert_int_equal(kvx__send_all(fd, buf, n, dl, &err), 0);
    assert_int_equal(kvx__recv_frame(fd, buf, sizeof(buf), &m, dl, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_ERROR);
    assert_non_null(strstr(m.u.error.msg, "host memory"));
    close(fd);
    kvx_agent_destroy(a);
    side_free(&p);
    side_free(&c);
}

/* Every CRC32C implementation this CPU has gives the portable one's values. */
/*
 * Checksums the producer kept as it wrote its blocks (kvx_region.block_crc) are the ones
 * sent, over shm (grant) and tcp (read trailer): the blocks without one are checksummed
 * at grant time and arrive intact, and a kept checksum that is wrong (as if the block
 * changed after it was computed) fails the transfer with a checksum mismatch.
 */
static void test_kept_checksums(void **state)
{
    (void)state;
    side p, c;
    producer_side(&p, true, 7);
    uint32_t *crc = calloc((size_t)N_SEG * N_BLOCKS, sizeof(uint32_t));
    uint8_t *ok = calloc((size_t)N_SEG * N_BLOCKS, 1);
    for (int s = 0; s < N_SEG; s++)
        for (int b = 0; b < 30; b++) {
            if (b >= 10 && b < 20) continue; /* not kept: computed at grant */
            size_t i = (size_t)s * N_BLOCKS + (size_t)b;
            crc[i] = td_crc32c(0, p.mem + s * STRIDE + (size_t)b * BLOCK_BYTES, BLOCK_BYTES);
            ok[i] = 1;
        }
    crc[2 * N_BLOCKS + 25] ^= 1; /* kept, and wrong */
    p.region.block_crc = crc;
    p.region.block_crc_ok = ok;
    kvx_agent *a = agent(&p);
    const kvx_protocol protos[] = {KVX_PROTO_SHM, KVX_PROTO_TCP};
    for (int pi = 0; pi < 2; pi++) {
        consumer_side(&c);
        kvx_client *k = client_proto(&c, protos[pi]);
        char tid[KVX_ID_HEX];
        td_err res;
        kvx_xfer *x = start(a, k, 0, 100, 20, tid, NULL);
        assert_int_equal(kvx_xfer_wait(x, &res), 0);
        kvx_xfer_free(x);
        assert_true(same(&p, &c, 0, 100, 20));
        kvx_agent_cancel(a, tid);
        x = start(a, k, 20, 100, 10, tid, NULL);
        assert_int_equal(kvx_xfer_wait(x, &res), TD_EPROTO);
        assert_non_null(strstr(res.msg, "checksum"));
        kvx_xfer_free(x);
        kvx_agent_cancel(a, tid);
        kvx_client_destroy(k);
        side_free(&c);
    }
    kvx_agent_destroy(a);
    side_free(&p);
    free(crc);
    free(ok);
}

static void test_crc32c_impls(void **state)
{
    (void)state;
    size_t cap = 13 * 8192 + 64;
    uint8_t *data = malloc(cap), *copy = malloc(cap + 8);
    for (size_t i = 0; i < cap; i++)
        data[i] = (uint8_t)((i * 2654435761u) >> 11);
    int was = td_crc32c_use(0);
    assert_true(was >= 0);
    for (int impl = 0; impl <= 3; impl++) {
        if (td_crc32c_use(impl) < 0) continue;
        assert_int_equal(td_crc32c(0, "123456789", 9), 0xE3069283u);
        for (size_t len = 0; len < 1100; len++) /* every path: < 64, < 256, and the tails */
            for (size_t off = 0; off < 3; off++)
                assert_int_equal(td_crc32c(7, data + off, len),
                                 td_crc32c_portable(7, data + off, len));
        assert_int_equal(td_crc32c(td_crc32c(0, data, 100), data + 100, 5000),
                         td_crc32c_portable(0, data, 5100));
        const uint64_t sizes[] = {1000, 1027, 4096, 8192}; /* 1000: 16-byte pieces at the end */
        for (size_t s = 0; s < 4; s++)
            for (uint32_t count = 1; count <= 13; count++) {
                uint32_t out[13], out2[13];
                td_crc32c_blocks(data + 1, sizes[s], count, out);
                memset(copy, 0, cap);
                td_crc32c_copy_blocks(copy + 3, data + 1, sizes[s], count, out2);
                assert_memory_equal(copy + 3, data + 1, count * sizes[s]);
                assert_int_equal(copy[2], 0);
                assert_int_equal(copy[3 + count * sizes[s]], 0);
                for (uint32_t i = 0; i < count; i++) {
                    uint32_t want = td_crc32c_portable(0, data + 1 + i * sizes[s], sizes[s]);
                    assert_int_equal(out[i], want);
                    assert_int_equal(out2[i], want);
                }
            }
    }
    td_crc32c_use(was);
    free(data);
    free(copy);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shm_reads),
        cmocka_unit_test(test_shm_failures),
        cmocka_unit_test(test_shm_expired_lease),
        cmocka_unit_test(test_shm_pin_outlives_lease),
        cmocka_unit_test(test_shm_destroy_during_copy),
        cmocka_unit_test(test_shm_deadline_and_death),
        cmocka_unit_test(test_shm_restart_drops_mapping),
        cmocka_unit_test(test_shm_info_frame),
        cmocka_unit_test(test_device_region_guards),
        cmocka_unit_test(test_kept_checksums),
        cmocka_unit_test(test_crc32c_impls),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
