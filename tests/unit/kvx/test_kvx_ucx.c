/*
 * Tests of the kvx ucx transport: a producer agent and a consumer client (protocol ucx) in
 * one process, over real loopback, moving random bytes between two separately allocated
 * pools with one-sided UCX gets. The whole group runs twice: with UCX_TLS=tcp (gets
 * emulated over TCP, progressed by the producer's thread) and with UCX_TLS=sm (shared
 * memory: gets by cross-memory attach). Covers: data equal at several sizes and at 16
 * concurrent transfers, checksum corruption, an unknown transfer id, an expired lease, a
 * lease that expires while a grant is pinned, deadlines, the producer destroyed mid-way,
 * and a consumer whose UCX shares no transport with the producer. A third run takes the
 * staged path of GPU memory (kvx__test_ucx_stage) over host pools.
 *
 * Built without UCX, only the check that a ucx consumer is refused at creation runs.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"
#include "kvx_req.h"

#define N_SEG 4
#define N_BLOCKS 256
#define BLOCK_BYTES 2048
#define STRIDE (N_BLOCKS * BLOCK_BYTES + 4096) /* padding between segments */

typedef struct pool {
    uint8_t *mem;
    kvx_region region;
} pool;

static void pool_init(pool *p, uint64_t seed)
{
    p->mem = malloc((size_t)N_SEG * STRIDE);
    if (seed) {
        td_rng rng;
        td_rng_seed(&rng, seed);
        for (size_t i = 0; i < (size_t)N_SEG * STRIDE; i += 8) {
            uint64_t v = td_rng_next(&rng);
            memcpy(p->mem + i, &v, 8);
        }
    } else {
        memset(p->mem, 0, (size_t)N_SEG * STRIDE);
    }
    p->region = (kvx_region){.base = p->mem,
                             .n_segments = N_SEG,
                             .segment_stride = STRIDE,
                             .block_bytes = BLOCK_BYTES,
                             .n_blocks = N_BLOCKS};
}

static uint8_t *blk(pool *p, int seg, int b)
{
    return p->mem + (size_t)seg * STRIDE + (size_t)b * BLOCK_BYTES;
}

static kvx_layout layout(void)
{
    return (kvx_layout){.model_fingerprint = 42,
                        .n_layers = N_SEG,
                        .n_kv_heads = 2,
                        .head_dim = 16,
                        .block_size = 16,
                        .kv_dtype = 1,
                        .tp_rank = 0,
                        .tp_size = 1};
}

typedef struct fixture {
    pool prod, cons;
    kvx_agent *agent;
    kvx_client *client;
    _Atomic int released, reason;
    _Atomic bool scribble; /* release_cb overwrites the blocks, as an engine reusing them */
} fixture;

static void on_release(void *user, const char *id, const int32_t *blocks, int n,
                       kvx_release_reason reason, void *tu)
{
    (void)id;
    (void)tu;
    fixture *f = user;
    if (atomic_load(&f->scribble))
        for (int s = 0; s < N_SEG; s++)
            for (int i = 0; i < n; i++)
                memset(blk(&f->prod, s, blocks[i]), 0xEE, BLOCK_BYTES);
    atomic_store(&f->reason, (int)reason);
    atomic_fetch_add(&f->released, 1);
}

static kvx_agent *make_agent(fixture *f)
{
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = f->prod.region;
    o.release_cb = on_release;
    o.release_user = f;
    kvx_agent *a;
    td_err err;
    int rc = kvx_agent_create(&a, &o, &err);
    if (rc) fprintf(stderr, "agent: %s\n", err.msg);
    assert_int_equal(rc, 0);
    return a;
}

static int make_client(fixture *f, kvx_client **c, td_err *err)
{
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = f->cons.region;
    o.transfer_timeout_ms = 5000;
    o.protocol = KVX_PROTO_UCX;
    return kvx_client_create(c, &o, err);
}

static int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    pool_init(&f->prod, 1234);
    pool_init(&f->cons, 0);
    f->agent = make_agent(f);
    td_err err;
    int rc = make_client(f, &f->client, &err);
    if (rc) fprintf(stderr, "client: %s\n", err.msg);
    assert_int_equal(rc, 0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fixture *f = *state;
    atomic_store(&kvx__test_send_delay_ms, 0);
    atomic_store(&kvx__test_corrupt_pieces, 0);
    kvx_client_destroy(f->client);
    kvx_agent_destroy(f->agent);
    free(f->prod.mem);
    free(f->cons.mem);
    free(f);
    return 0;
}

static int wait_released(fixture *f, int n)
{
    for (int i = 0; i < 400 && atomic_load(&f->released) < n; i++)
        usleep(5 * 1000);
    return atomic_load(&f->released);
}

static int read_blocks(fixture *f, const char *tid, const int32_t *src, const int32_t *dst, int n,
                       uint32_t timeout_ms, td_err *res)
{
    kvx_read_req rq = req_for(f->agent, tid, src, dst, n, timeout_ms);
    kvx_xfer *x;
    int rc = kvx_read_start(f->client, &rq, &x, res);
    if (rc) return rc;
    rc = kvx_xfer_wait(x, res);
    kvx_xfer_free(x);
    return rc;
}

static void expect_copied(fixture *f, const int32_t *src, const int32_t *dst, int n)
{
    for (int s = 0; s < N_SEG; s++)
        for (int i = 0; i < n; i++)
            assert_memory_equal(blk(&f->cons, s, dst[i]), blk(&f->prod, s, src[i]), BLOCK_BYTES);
}

static int release(fixture *f, const char *tid, td_err *err)
{
    return kvx_release(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                       kvx_agent_engine_id(f->agent), tid, err);
}

/* Several sizes: one block, coalesced runs, and the whole pool (several pieces). */
static void test_ucx_sizes(void **state)
{
    fixture *f = *state;
    int32_t src[N_BLOCKS], dst[N_BLOCKS];
    int sizes[] = {1, 9, 64, N_BLOCKS};
    int staged0 = atomic_load(&kvx__test_ucx_grants_staged);
    int unstaged0 = atomic_load(&kvx__test_ucx_pieces_unstaged);
    for (size_t t = 0; t < TD_ARRAY_LEN(sizes); t++) {
        int n = sizes[t];
        for (int i = 0; i < n; i++) {
            src[i] = n == 9 ? (int32_t)(10 + i + (i >= 4) * 30 + (i >= 6) * 150) : i;
            dst[i] = (int32_t)((N_BLOCKS - n + i * 7) % N_BLOCKS); /* scattered, distinct */
        }
        if (n == N_BLOCKS)
            for (int i = 0; i < n; i++)
                dst[i] = i;
        memset(f->cons.mem, 0, (size_t)N_SEG * STRIDE);
        char tid[KVX_ID_HEX];
        td_err err;
        assert_int_equal(kvx_agent_register(f->agent, src, n, 0, NULL, tid, &err), 0);
        int rc = read_blocks(f, tid, src, dst, n, 0, &err);
        if (rc) fprintf(stderr, "%s\n", err.msg);
        assert_int_equal(rc, 0);
        expect_copied(f, src, dst, n);
        /* The lease is held until the consumer releases it. */
        assert_int_equal(atomic_load(&f->released), (int)t);
        assert_int_equal(release(f, tid, &err), 0);
        assert_int_equal(wait_released(f, (int)t + 1), (int)t + 1);
        assert_int_equal(atomic_load(&f->reason), KVX_RELEASED_BY_CONSUMER);
    }
    kvx_agent_stats st;
    kvx_agent_get_stats(f->agent, &st);
    assert_true(st.reads >= TD_ARRAY_LEN(sizes));
    /* Staged: every grant went through a staging slot, every piece through the consumer's
     * staging buffer (at least one each per transfer); else neither. */
    int staged = atomic_load(&kvx__test_ucx_grants_staged) - staged0;
    int unstaged = atomic_load(&kvx__test_ucx_pieces_unstaged) - unstaged0;
    if (atomic_load(&kvx__test_ucx_stage)) {
        assert_true(staged >= (int)TD_ARRAY_LEN(sizes));
        assert_int_equal(unstaged, staged);
    } else {
        assert_int_equal(staged, 0);
        assert_int_equal(unstaged, 0);
    }
}

/* 16 transfers at once, of different sizes, into disjoint consumer blocks. */
static void test_ucx_16_concurrent(void **state)
{
    fixture *f = *state;
    enum { N = 16, PER = 16 };
    int32_t src[N][PER], dst[N][PER];
    char tid[N][KVX_ID_HEX];
    kvx_xfer *x[N];
    td_err err;
    for (int t = 0; t < N; t++) {
        int n = 1 + t % PER;
        for (int i = 0; i < n; i++) {
            src[t][i] = (int32_t)((t * 37 + i) % N_BLOCKS);
            dst[t][i] = (int32_t)(t * PER + i);
        }
        assert_int_equal(kvx_agent_register(f->agent, src[t], n, 0, NULL, tid[t], &err), 0);
    }
    for (int t = 0; t < N; t++) {
        kvx_read_req rq = req_for(f->agent, tid[t], src[t], dst[t], 1 + t % PER, 0);
        assert_int_equal(kvx_read_start(f->client, &rq, &x[t], &err), 0);
    }
    for (int t = 0; t < N; t++) {
        td_err res;
        int rc = kvx_xfer_wait(x[t], &res);
        if (rc) fprintf(stderr, "%s\n", res.msg);
        assert_int_equal(rc, 0);
        kvx_xfer_free(x[t]);
        expect_copied(f, src[t], dst[t], 1 + t % PER);
    }
    for (int t = 0; t < N; t++)
        assert_int_equal(release(f, tid[t], &err), 0);
    assert_int_equal(wait_released(f, N), N);
}

/* A flipped byte is caught by the per-block CRC32C and named. */
static void test_ucx_checksum_corruption(void **state)
{
    fixture *f = *state;
    int32_t b[] = {5, 6, 7};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 3, 0, NULL, tid, &err), 0);
    atomic_store(&kvx__test_corrupt_pieces, 1);
    assert_int_equal(read_blocks(f, tid, b, b, 3, 0, &err), TD_EPROTO);
    assert_non_null(strstr(err.msg, "checksum mismatch"));
    /* The next read of the same transfer is clean. */
    assert_int_equal(read_blocks(f, tid, b, b, 3, 0, &err), 0);
    expect_copied(f, b, b, 3);
}

/* A transfer id the producer never handed out reads nothing. */
static void test_ucx_unknown_id(void **state)
{
    fixture *f = *state;
    int32_t b[] = {1, 2, 3};
    char real[KVX_ID_HEX], guess[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 3, 0, NULL, real, &err), 0);
    uint8_t id[KVX_ID_BYTES];
    assert_int_equal(kvx__random_id(id), 0);
    kvx_id_to_hex(id, guess);
    assert_int_equal(read_blocks(f, guess, b, b, 3, 0, &err), TD_ENOTFOUND);
    /* Blocks outside the lease are refused too. */
    int32_t other[] = {1, 2, 99};
    assert_int_equal(read_blocks(f, real, other, other, 3, 0, &err), TD_ERANGE);
    uint8_t zero[BLOCK_BYTES] = {0};
    for (int s = 0; s < N_SEG; s++)
        for (int i = 0; i < 3; i++) {
            assert_memory_equal(blk(&f->cons, s, b[i]), zero, BLOCK_BYTES);
            assert_memory_equal(blk(&f->cons, s, other[i]), zero, BLOCK_BYTES);
        }
    kvx_agent_stats st;
    kvx_agent_get_stats(f->agent, &st);
    assert_true(st.unknown_transfer >= 1);
}

/* A lease that expired is gone: TD_ENOTFOUND, and its blocks went back once. */
static void test_ucx_expired_lease(void **state)
{
    fixture *f = *state;
    int32_t b[] = {20, 21};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 2, 100, NULL, tid, &err), 0);
    assert_int_equal(wait_released(f, 1), 1);
    assert_int_equal(atomic_load(&f->reason), KVX_RELEASED_EXPIRED);
    assert_int_equal(read_blocks(f, tid, b, b, 2, 0, &err), TD_ENOTFOUND);
}

/*
 * The lease expires while a grant holds its pin (the producer waits 400 ms before it
 * answers, the lease lasts 150 ms): the blocks must not go back (release_cb overwrites
 * them here) until the consumer's gets are done, so the read still succeeds, intact.
 */
static void test_ucx_pin_outlives_lease(void **state)
{
    fixture *f = *state;
    int32_t b[] = {50, 51, 52, 53};
    uint8_t orig[N_SEG][4][BLOCK_BYTES];
    for (int s = 0; s < N_SEG; s++)
        for (int i = 0; i < 4; i++)
            memcpy(orig[s][i], blk(&f->prod, s, b[i]), BLOCK_BYTES);
    atomic_store(&f->scribble, true);
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 4, 150, NULL, tid, &err), 0);
    atomic_store(&kvx__test_send_delay_ms, 400);
    int rc = read_blocks(f, tid, b, b, 4, 3000, &err);
    if (rc) fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(rc, 0);
    for (int s = 0; s < N_SEG; s++)
        for (int i = 0; i < 4; i++)
            assert_memory_equal(blk(&f->cons, s, b[i]), orig[s][i], BLOCK_BYTES);
    assert_int_equal(wait_released(f, 1), 1);
    assert_int_equal(atomic_load(&f->reason), KVX_RELEASED_EXPIRED);
}

/* A producer slower than the deadline: TD_ETIMEDOUT on time. */
static void test_ucx_deadline(void **state)
{
    fixture *f = *state;
    int32_t b[] = {8};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 1, 0, NULL, tid, &err), 0);
    atomic_store(&kvx__test_send_delay_ms, 1500);
    uint64_t t0 = td_now_ns();
    assert_int_equal(read_blocks(f, tid, b, b, 1, 300, &err), TD_ETIMEDOUT);
    double s = (double)(td_now_ns() - t0) * 1e-9;
    assert_true(s < 1.0);
    atomic_store(&kvx__test_send_delay_ms, 0);
    /* The session still works afterwards. */
    assert_int_equal(read_blocks(f, tid, b, b, 1, 0, &err), 0);
    expect_copied(f, b, b, 1);
}

/* The producer is destroyed while a read waits for its grant: a clear error, no hang. */
static void test_ucx_producer_destroyed(void **state)
{
    fixture *f = *state;
    int32_t b[] = {30, 31, 32};
    char tid[KVX_ID_HEX];
    td_err err;
    /* A first read sets up the channel and the UCX endpoints. */
    assert_int_equal(kvx_agent_register(f->agent, b, 3, 0, NULL, tid, &err), 0);
    assert_int_equal(read_blocks(f, tid, b, b, 3, 0, &err), 0);
    atomic_store(&kvx__test_send_delay_ms, 400);
    kvx_read_req rq = req_for(f->agent, tid, b, b, 3, 3000);
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), 0);
    usleep(100 * 1000);
    uint64_t t0 = td_now_ns();
    kvx_agent_destroy(f->agent);
    f->agent = NULL;
    td_err res;
    int rc = kvx_xfer_wait(x, &res);
    double s = (double)(td_now_ns() - t0) * 1e-9;
    if (rc != TD_ECONN) fprintf(stderr, "rc %d: %s\n", rc, res.msg);
    assert_int_equal(rc, TD_ECONN);
    assert_true(res.msg[0] != 0);
    assert_true(s < 2.0);
    kvx_xfer_free(x);
    assert_int_equal(atomic_load(&f->reason), KVX_RELEASED_SHUTDOWN);
    atomic_store(&kvx__test_send_delay_ms, 0);
    f->agent = make_agent(f); /* for teardown */
}

/*
 * A consumer whose UCX may only use a transport that does not reach the producer gets a
 * clear error, at creation or on the read, and never hangs.
 */
static void test_ucx_no_common_transport(void **state)
{
    fixture *f = *state;
    char *saved = getenv("UCX_TLS") ? strdup(getenv("UCX_TLS")) : NULL;
    setenv("UCX_TLS", "self", 1); /* only to this very worker: never to the producer */
    kvx_client *c = NULL;
    td_err err;
    int rc = make_client(f, &c, &err);
    if (saved) {
        setenv("UCX_TLS", saved, 1);
        free(saved);
    }
    if (rc == 0) {
        int32_t b[] = {3};
        char tid[KVX_ID_HEX];
        assert_int_equal(kvx_agent_register(f->agent, b, 1, 0, NULL, tid, &err), 0);
        kvx_read_req rq = req_for(f->agent, tid, b, b, 1, 2000);
        kvx_xfer *x;
        assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
        uint64_t t0 = td_now_ns();
        rc = kvx_xfer_wait(x, &err);
        assert_true((double)(td_now_ns() - t0) * 1e-9 < 3.0);
        kvx_xfer_free(x);
        kvx_client_destroy(c);
    }
    fprintf(stderr, "  (no common transport: %s)\n", err.msg);
    assert_true(rc != 0);
    assert_non_null(strstr(err.msg, "ucx"));
}

/* Without UCX in the build, a consumer that asks for it is refused at creation. */
static void test_ucx_unavailable(void **state)
{
    (void)state;
    if (kvx_protocol_available(KVX_PROTO_UCX)) skip();
    pool p;
    pool_init(&p, 0);
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = p.region;
    o.protocol = KVX_PROTO_UCX;
    kvx_client *c = NULL;
    td_err err;
    assert_int_equal(kvx_client_create(&c, &o, &err), TD_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "ucx"));
    assert_null(c);
    free(p.mem);
}

/* The ucx frames (wire.c is built with or without UCX): round trips and strict decoding. */
static void test_ucx_frames(void **state)
{
    (void)state;
    static uint8_t buf[KVX_HDR_BYTES + 40 + 2 * KVX_MAX_UCX_BLOB + 16];
    kvx_msg m;
    td_err err;
    size_t n = kvx_wire_encode_empty(buf, sizeof(buf), KVX_MSG_UCX_INFO, 3);
    assert_int_equal(n, KVX_HDR_BYTES);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_UCX_INFO);
    assert_int_equal(kvx_wire_encode_empty(buf, sizeof(buf), KVX_MSG_READ, 3), 0);
    n = kvx_wire_encode_empty(buf, sizeof(buf), KVX_MSG_UCX_DONE, 4);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_UCX_DONE);
    assert_string_equal(kvx_wire_type_name(KVX_MSG_UCX_GRANTED), "UCX_GRANTED");

    uint8_t addr[300], rkey[40];
    for (size_t i = 0; i < sizeof(addr); i++)
        addr[i] = (uint8_t)i;
    for (size_t i = 0; i < sizeof(rkey); i++)
        rkey[i] = (uint8_t)(200 - i);
    n = kvx_wire_encode_ucx_info(buf, sizeof(buf), 5, 0x7f0000001000ull, 4096, 1 << 20, 1 << 18,
                                 addr, sizeof(addr), rkey, sizeof(rkey));
    assert_int_equal(n, KVX_HDR_BYTES + 40 + sizeof(addr) + sizeof(rkey));
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.ucx_info.base, 0x7f0000001000ull);
    assert_int_equal(m.u.ucx_info.segment_stride, 4096);
    assert_int_equal(m.u.ucx_info.bytes, 1 << 20);
    assert_int_equal(m.u.ucx_info.stage_slot, 1 << 18);
    assert_int_equal(m.u.ucx_info.addr_len, sizeof(addr));
    assert_memory_equal(m.u.ucx_info.addr, addr, sizeof(addr));
    assert_memory_equal(m.u.ucx_info.rkey, rkey, sizeof(rkey));
    /* Truncated, a trailing byte, an empty rkey, a blob over the limit: refused. */
    assert_int_equal(kvx_wire_decode_frame(buf, n - 1, &m, &err), TD_EFORMAT);
    buf[8]++; /* payload_len one larger than what follows */
    assert_int_equal(kvx_wire_decode_frame(buf, n + 1, &m, &err), TD_EFORMAT);
    buf[8]--;
    assert_int_equal(kvx_wire_encode_ucx_info(buf, sizeof(buf), 5, 1, 1, 1, 0, addr, 1, rkey, 0),
                     0);
    assert_int_equal(kvx_wire_encode_ucx_info(buf, sizeof(buf), 5, 1, 1, 1, 0, addr,
                                              KVX_MAX_UCX_BLOB + 1, rkey, 1),
                     0);
    /* a staging slot larger than the area */
    assert_int_equal(
        kvx_wire_encode_ucx_info(buf, sizeof(buf), 5, 1, 1, 100, 101, addr, 8, rkey, 8), 0);
    n = kvx_wire_encode_ucx_info(buf, sizeof(buf), 5, 1, 1, 1, 0, addr, 8, rkey, 8);
    buf[KVX_HDR_BYTES + 36] = 0; /* rkey_len 0 */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    n = kvx_wire_encode_ucx_info(buf, sizeof(buf), 5, 1, 1, 100, 100, addr, 8, rkey, 8);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    buf[KVX_HDR_BYTES + 24] = 101; /* stage_slot 101 > bytes 100 */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "staging slots"));
    n = kvx_wire_encode_ucx_info(buf, sizeof(buf), 5, UINT64_MAX - 10, 1, 100, 0, addr, 8, rkey, 8);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT); /* wraps */

    uint8_t id[KVX_ID_BYTES] = {1, 2, 3};
    kvx_wire_desc d[2] = {{0, 5, 3}, {2, 9, 1}};
    n = kvx_wire_encode_grant(buf, sizeof(buf), 6, id, KVX_READ_CHECKSUMS, d, 2);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_UCX_GRANT);
    assert_int_equal(m.u.read.n_desc, 2);
    assert_int_equal(kvx_wire_get_desc(&m, 1).block, 9);
    assert_memory_equal(m.u.read.transfer_id, id, KVX_ID_BYTES);
    assert_int_equal(kvx_wire_encode_grant(buf, sizeof(buf), 6, id, 0, d, 0), 0);

    uint32_t crc[4] = {0xdeadbeef, 1, 2, 0xffffffff};
    n = kvx_wire_encode_ucx_granted(buf, sizeof(buf), 7, 30000, 3u << 20, crc, 4);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.ucx_granted.valid_ms, 30000);
    assert_int_equal(m.u.ucx_granted.n_crc, 4);
    assert_int_equal(m.u.ucx_granted.stage_off, 3u << 20);
    assert_int_equal(kvx_wire_trailer_get(m.u.ucx_granted.crc, 3), 0xffffffff);
    n = kvx_wire_encode_ucx_granted(buf, sizeof(buf), 7, 30000, KVX_NOT_STAGED, crc, 0);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_true(m.u.ucx_granted.stage_off == KVX_NOT_STAGED);
    assert_int_equal(kvx_wire_encode_ucx_granted(buf, sizeof(buf), 7, 0, 0, crc, 4), 0);
    assert_int_equal(
        kvx_wire_encode_ucx_granted(buf, sizeof(buf), 7, 1, 0, crc, KVX_MAX_CRC + 1), 0);
    n = kvx_wire_encode_ucx_granted(buf, sizeof(buf), 7, 30000, 0, crc, 4);
    assert_int_equal(kvx_wire_decode_frame(buf, n - 4, &m, &err), TD_EFORMAT);
    /* UCX_INFO with a payload; an unknown type between the ranges. */
    n = kvx_wire_encode_ucx_granted(buf, sizeof(buf), 7, 30000, 0, crc, 1);
    buf[6] = KVX_MSG_UCX_INFO;
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    buf[6] = 19;
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "unknown message type"));
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    if (!kvx_protocol_available(KVX_PROTO_UCX)) {
        fprintf(stderr, "test_kvx_ucx: built without UCX (libucx-dev): only the refusal is "
                        "tested\n");
        const struct CMUnitTest none[] = {cmocka_unit_test(test_ucx_frames),
                                          cmocka_unit_test(test_ucx_unavailable)};
        return cmocka_run_group_tests_name("kvx_ucx_unavailable", none, NULL, NULL);
    }
    const struct CMUnitTest frames[] = {cmocka_unit_test(test_ucx_frames)};
    int failed = cmocka_run_group_tests_name("kvx_ucx_frames", frames, NULL, NULL);
    const struct CMUnitTest tests[] = {
        T(test_ucx_sizes),      T(test_ucx_16_concurrent),      T(test_ucx_checksum_corruption),
        T(test_ucx_unknown_id), T(test_ucx_expired_lease),      T(test_ucx_pin_outlives_lease),
        T(test_ucx_deadline),   T(test_ucx_producer_destroyed), T(test_ucx_no_common_transport),
    };
    /* UCX reads its configuration when a context is created, i.e. in each setup. */
    setenv("UCX_TLS", "tcp", 1);
    failed += cmocka_run_group_tests_name("kvx_ucx_over_tcp", tests, NULL, NULL);
    setenv("UCX_TLS", "sm", 1);
    failed += cmocka_run_group_tests_name("kvx_ucx_over_sm", tests, NULL, NULL);
    /* The staged path that GPU memory takes, over host pools: the producer copies each
     * grant into a registered staging slot, the consumer gets into its channel's staging
     * buffer and copies to its blocks. One slot only: the 16 concurrent transfers queue
     * for it, and a slot that a failed grant (the deadline test) did not give back would
     * fail every later read. */
    setenv("UCX_TLS", "tcp", 1);
    atomic_store(&kvx__test_ucx_stage, 1);
    failed += cmocka_run_group_tests_name("kvx_ucx_staged_over_tcp", tests, NULL, NULL);
    atomic_store(&kvx__test_ucx_stage, 0);
    return failed;
}
