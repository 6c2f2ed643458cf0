/*
 * Transfer tests for kvx: a producer agent and a consumer client in one process (and one
 * forked producer) over real loopback sockets, moving random bytes between two separately
 * allocated pools. Covers: correctness with coalesced runs, 16 concurrent transfers,
 * layout mismatch on both sides, guessed transfer ids, leases (release, expiry,
 * heartbeats), a producer dying mid-transfer, deadlines, checksum corruption, a producer
 * restart (new engine id at the same port), idle connections the producer hung up on,
 * port collisions, and pipelined pieces (an
 * unknown id and a corrupted piece inside a group, the producer leaving mid-group).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

#include "kvx_fixture.h"
#include "kvx_req.h"

/* A read of n blocks of transfer tid from the fixture's agent (src -> dst). */
static int read_blocks(fixture *f, const char *tid, const int32_t *src, const int32_t *dst, int n,
                       uint32_t timeout_ms, td_err *res, kvx_xfer_info *info)
{
    kvx_read_req rq = req_for(f->agent, tid, src, dst, n, timeout_ms);
    kvx_xfer *x;
    td_err err;
    int rc = kvx_read_start(f->client, &rq, &x, &err);
    if (rc) {
        *res = err;
        return rc;
    }
    rc = kvx_xfer_wait(x, res);
    if (info) kvx_xfer_get_info(x, info);
    kvx_xfer_free(x);
    return rc;
}

static void expect_copied(fixture *f, const int32_t *src, const int32_t *dst, int n)
{
    assert_true(blocks_copied(f, src, dst, n));
}

static void test_basic_read_and_release(void **state)
{
    fixture *f = *state;
    /* Three runs on the producer side, mapped to two runs on the consumer side. */
    int32_t src[] = {10, 11, 12, 13, 40, 41, 200, 201, 202};
    int32_t dst[] = {0, 1, 2, 3, 4, 5, 100, 101, 102};
    int n = TD_ARRAY_LEN(src);
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, src, n, 0, NULL, tid, &err), 0);
    assert_int_equal(kvx_agent_n_leases(f->agent), 1);
    kvx_xfer_info info;
    int rc = read_blocks(f, tid, src, dst, n, 0, &err, &info);
    if (rc) fprintf(stderr, "%s\n", err.msg);
    assert_int_equal(rc, 0);
    expect_copied(f, src, dst, n);
    assert_int_equal(info.bytes, (uint64_t)n * N_SEG * BLOCK_BYTES);
    assert_int_equal(info.n_runs, 3);
    assert_int_equal(info.n_descriptors, 3 * N_SEG);
    /* Blocks the transfer did not name stay untouched. */
    uint8_t zero[BLOCK_BYTES] = {0};
    assert_memory_equal(blk(&f->cons, 0, 6), zero, BLOCK_BYTES);
    assert_memory_equal(blk(&f->cons, 3, 99), zero, BLOCK_BYTES);

    /* Reading twice is fine while the lease lives. */
    memset(f->cons.mem, 0, (size_t)N_SEG * STRIDE);
    assert_int_equal(read_blocks(f, tid, src, dst, n, 0, &err, NULL), 0);
    expect_copied(f, src, dst, n);

    assert_int_equal(kvx_heartbeat(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                   kvx_agent_engine_id(f->agent), tid, &err),
                     0);
    assert_int_equal(kvx_release(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                 kvx_agent_engine_id(f->agent), tid, &err),
                     0);
    assert_int_equal(wait_released(f, 1), 1);
    assert_int_equal(atomic_load(&f->rel.reason), KVX_RELEASED_BY_CONSUMER);
    assert_int_equal(atomic_load(&f->rel.blocks), n);
    assert_int_equal(kvx_agent_n_leases(f->agent), 0);
    /* After release the id is dead: reads, heartbeats and releases are refused. */
    assert_int_equal(read_blocks(f, tid, src, dst, n, 0, &err, NULL), TD_ENOTFOUND);
    assert_int_equal(kvx_release(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                 kvx_agent_engine_id(f->agent), tid, &err),
                     TD_ENOTFOUND);
    assert_int_equal(kvx_heartbeat(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                   kvx_agent_engine_id(f->agent), tid, &err),
                     TD_ENOTFOUND);
    assert_int_equal(kvx_client_n_sessions(f->client), 1);
}

/* A large transfer: every block, one run, cut into pieces across the connections. */
static void test_whole_pool(void **state)
{
    fixture *f = *state;
    int32_t src[N_BLOCKS], dst[N_BLOCKS];
    for (int i = 0; i < N_BLOCKS; i++)
        src[i] = i, dst[i] = i;
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, src, N_BLOCKS, 0, NULL, tid, &err), 0);
    kvx_xfer_info info;
    assert_int_equal(read_blocks(f, tid, src, dst, N_BLOCKS, 0, &err, &info), 0);
    expect_copied(f, src, dst, N_BLOCKS);
    assert_int_equal(info.n_runs, 1);
    assert_int_equal(info.n_descriptors, N_SEG);
    /* 2 MiB over 4 connections: the transfer was cut into (at least) 4 pieces, each its own
     * READ, which the 4 workers ran side by side. */
    /* The producer's threads count a READ after its last byte is on the wire, so the
     * consumer can finish first: give the counters a moment to settle. */
    kvx_agent_stats st;
    const uint64_t total = (uint64_t)N_BLOCKS * N_SEG * BLOCK_BYTES;
    for (int tries = 0; tries < 500; tries++) {
        kvx_agent_get_stats(f->agent, &st);
        if (st.reads >= 4 && st.bytes_sent == total) break;
        usleep(2000);
    }
    assert_true(st.reads >= 4);
    assert_int_equal(st.bytes_sent, total);
}

/* Reads as many READs as kvx_piece_count says: one for 512 KiB (64 blocks x 4 segments x
 * 2 KiB), two for 1 MiB, each piece at least 512 KiB. */
static void test_small_transfers_few_pieces(void **state)
{
    fixture *f = *state;
    const int sizes[] = {64, 128, 8};
    const uint64_t want[] = {1, 2, 1};
    for (int t = 0; t < 3; t++) {
        int n = sizes[t];
        int32_t src[N_BLOCKS], dst[N_BLOCKS];
        for (int i = 0; i < n; i++)
            src[i] = i, dst[i] = N_BLOCKS - n + i;
        const uint64_t bytes = (uint64_t)n * N_SEG * BLOCK_BYTES;
        assert_int_equal(kvx_piece_count(bytes, 4, KVX_MIN_PIECE_BYTES, 8u << 20), want[t]);
        kvx_agent_stats st0, st;
        kvx_agent_get_stats(f->agent, &st0);
        char tid[KVX_ID_HEX];
        td_err err;
        assert_int_equal(kvx_agent_register(f->agent, src, n, 0, NULL, tid, &err), 0);
        assert_int_equal(read_blocks(f, tid, src, dst, n, 0, &err, NULL), 0);
        expect_copied(f, src, dst, n);
        /* the producer counts a READ once its bytes are out: let the counters settle */
        for (int tries = 0; tries < 500; tries++) {
            kvx_agent_get_stats(f->agent, &st);
            if (st.bytes_sent - st0.bytes_sent == bytes) break;
            usleep(2000);
        }
        assert_int_equal(st.bytes_sent - st0.bytes_sent, bytes);
        assert_int_equal(st.reads - st0.reads, want[t]);
    }
}

typedef struct done_count {
    _Atomic int n;
    _Atomic int failed;
} done_count;

static void on_done(void *user, kvx_xfer *x, const td_err *res)
{
    (void)x;
    done_count *d = user;
    if (res->code) atomic_fetch_add(&d->failed, 1);
    atomic_fetch_add(&d->n, 1);
}

static void test_16_concurrent(void **state)
{
    fixture *f = *state;
    enum { N = 16, PER = 12 };
    int32_t src[N][PER], dst[N][PER];
    char tid[N][KVX_ID_HEX];
    kvx_xfer *x[N];
    done_count dc = {0};
    td_err err;
    for (int t = 0; t < N; t++) {
        for (int i = 0; i < PER; i++) {
            src[t][i] = (t * 7 + i * 3) % N_BLOCKS; /* scattered and shared between transfers */
            dst[t][i] = t * PER + i;                /* disjoint on the consumer */
        }
        assert_int_equal(kvx_agent_register(f->agent, src[t], PER, 0, NULL, tid[t], &err), 0);
    }
    for (int t = 0; t < N; t++) {
        kvx_read_req rq = req_for(f->agent, tid[t], src[t], dst[t], PER, 0);
        rq.done = on_done;
        rq.user = &dc;
        assert_int_equal(kvx_read_start(f->client, &rq, &x[t], &err), 0);
    }
    for (int t = 0; t < N; t++) {
        td_err res;
        int rc = kvx_xfer_wait(x[t], &res);
        if (rc) fprintf(stderr, "transfer %d: %s\n", t, res.msg);
        assert_int_equal(rc, 0);
        kvx_xfer_free(x[t]);
    }
    assert_int_equal(atomic_load(&dc.n), N);
    assert_int_equal(atomic_load(&dc.failed), 0);
    for (int t = 0; t < N; t++)
        expect_copied(f, src[t], dst[t], PER);
    for (int t = 0; t < N; t++)
        assert_int_equal(kvx_release(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                     kvx_agent_engine_id(f->agent), tid[t], &err),
                         0);
    assert_int_equal(wait_released(f, N), N);
}

static void test_layout_mismatch(void **state)
{
    fixture *f = *state;
    struct {
        const char *field;
        kvx_layout l;
    } cases[3];
    cases[0].field = "block_size";
    cases[0].l = layout();
    cases[0].l.block_size = 32;
    cases[1].field = "kv_dtype";
    cases[1].l = layout();
    cases[1].l.kv_dtype = 9;
    cases[2].field = "tp_size";
    cases[2].l = layout();
    cases[2].l.tp_size = 2;
    for (int i = 0; i < 3; i++) {
        kvx_client *c = make_client(f, cases[i].l);
        td_err err;
        int rc = kvx_session_check(c, "127.0.0.1", kvx_agent_port(f->agent),
                                   kvx_agent_engine_id(f->agent), &err);
        assert_int_equal(rc, TD_EPROTO);
        assert_non_null(strstr(err.msg, cases[i].field)); /* consumer side */
        char last[320];
        kvx_agent_last_error(f->agent, last, sizeof(last));
        assert_non_null(strstr(last, cases[i].field)); /* producer side */
        kvx_client_destroy(c);
    }
    kvx_agent_stats st;
    kvx_agent_get_stats(f->agent, &st);
    assert_int_equal(st.handshakes_refused, 3);
    /* The matching client still works. */
    td_err err;
    assert_int_equal(kvx_session_check(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                       kvx_agent_engine_id(f->agent), &err),
                     0);
}

static void test_guessed_transfer_id(void **state)
{
    fixture *f = *state;
    int32_t src[] = {1, 2, 3}, dst[] = {1, 2, 3};
    char tid[KVX_ID_HEX], guess[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, src, 3, 0, NULL, tid, &err), 0);
    uint8_t g[16];
    assert_int_equal(kvx__random_id(g), 0);
    kvx_id_to_hex(g, guess);
    assert_int_equal(read_blocks(f, guess, src, dst, 3, 0, &err, NULL), TD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "unknown"));
    /* A valid id with a block it does not cover reads nothing either. */
    int32_t other[] = {1, 2, 4};
    assert_int_equal(read_blocks(f, tid, other, dst, 3, 0, &err, NULL), TD_ERANGE);
    uint8_t zero[BLOCK_BYTES] = {0};
    for (int s = 0; s < N_SEG; s++)
        for (int b = 0; b < 5; b++)
            assert_memory_equal(blk(&f->cons, s, b), zero, BLOCK_BYTES);
    kvx_agent_stats st;
    kvx_agent_get_stats(f->agent, &st);
    assert_int_equal(st.unknown_transfer, 1);
    assert_int_equal(st.bytes_sent, 0);
    /* Malformed ids are argument errors. */
    assert_int_equal(read_blocks(f, "xyz", src, dst, 3, 0, &err, NULL), TD_EINVAL);
    /* The real id still works after all that. */
    assert_int_equal(read_blocks(f, tid, src, dst, 3, 0, &err, NULL), 0);
    expect_copied(f, src, dst, 3);
}

static void test_lease_expiry(void **state)
{
    fixture *f = *state;
    int32_t b[] = {5, 6};
    char tid[KVX_ID_HEX], tid2[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 2, 100, NULL, tid, &err), 0);
    assert_int_equal(kvx_agent_register(f->agent, b, 2, 300, NULL, tid2, &err), 0);
    /* Heartbeats keep the second alive well past its lease. */
    for (int i = 0; i < 6; i++) {
        usleep(100 * 1000);
        assert_int_equal(kvx_heartbeat(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                       kvx_agent_engine_id(f->agent), tid2, &err),
                         0);
    }
    assert_int_equal(atomic_load(&f->rel.count), 1); /* only the first expired */
    assert_int_equal(atomic_load(&f->rel.reason), KVX_RELEASED_EXPIRED);
    assert_int_equal(kvx_agent_n_leases(f->agent), 1);
    for (int i = 0; i < 200 && atomic_load(&f->rel.count) < 2; i++)
        usleep(10 * 1000);
    assert_int_equal(atomic_load(&f->rel.count), 2);
    assert_int_equal(atomic_load(&f->rel.blocks), 4);
    kvx_agent_stats st;
    kvx_agent_get_stats(f->agent, &st);
    assert_int_equal(st.leases_expired, 2);
    assert_int_equal(read_blocks(f, tid, b, b, 2, 0, &err, NULL), TD_ENOTFOUND);
}

static void test_checksum_corruption(void **state)
{
    fixture *f = *state;
    int32_t src[] = {20, 21, 22, 23}, dst[] = {50, 51, 52, 53};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, src, 4, 0, NULL, tid, &err), 0);
    atomic_store(&kvx__test_corrupt_pieces, 1);
    assert_int_equal(read_blocks(f, tid, src, dst, 4, 0, &err, NULL), TD_EPROTO);
    assert_non_null(strstr(err.msg, "checksum mismatch"));
    /* A retry gets clean data. */
    assert_int_equal(read_blocks(f, tid, src, dst, 4, 0, &err, NULL), 0);
    expect_copied(f, src, dst, 4);
}

static void test_deadline(void **state)
{
    fixture *f = *state;
    int32_t b[] = {7, 8};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 2, 0, NULL, tid, &err), 0);
    atomic_store(&kvx__test_send_delay_ms, 1500);
    uint64_t t0 = td_now_ns();
    assert_int_equal(read_blocks(f, tid, b, b, 2, 300, &err, NULL), TD_ETIMEDOUT);
    double s = (double)(td_now_ns() - t0) * 1e-9;
    assert_true(s >= 0.29 && s < 1.0);
    atomic_store(&kvx__test_send_delay_ms, 0);
    /* The connection that timed out was dropped; the next read uses a clean one. */
    assert_int_equal(read_blocks(f, tid, b, b, 2, 0, &err, NULL), 0);
    expect_copied(f, b, b, 2);
}

/* A client with one worker (and qp connections per peer, 0 = the default), so that
 * transfers queue behind a slow one: to test deadlines while queued, and pipelining (their
 * READs in one send on one connection, the answers read in turn). */
static kvx_client *one_worker_client(fixture *f, int qp)
{
    return client_with(f, 1, qp, 5000);
}

/* A transfer queued behind a busy worker still ends by its own deadline (the watchdog's
 * doing: the waiting thread is kept from running the piece itself). */
static void test_deadline_while_queued(void **state)
{
    fixture *f = *state;
    kvx_client *c = one_worker_client(f, 1);
    atomic_store(&kvx__test_no_wait_help, 1);
    td_err err;
    int32_t a[] = {1}, b[] = {2};
    char ta[KVX_ID_HEX], tb[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, a, 1, 0, NULL, ta, &err), 0);
    assert_int_equal(kvx_agent_register(f->agent, b, 1, 0, NULL, tb, &err), 0);
    atomic_store(&kvx__test_send_delay_ms, 1000);
    kvx_read_req rq = req_for(f->agent, ta, a, a, 1, 5000);
    kvx_xfer *xa, *xb;
    assert_int_equal(kvx_read_start(c, &rq, &xa, &err), 0);
    usleep(50 * 1000); /* the only worker is now inside A */
    rq.transfer_id = tb;
    rq.src_blocks = rq.dst_blocks = b;
    rq.timeout_ms = 200;
    uint64_t t0 = td_now_ns();
    assert_int_equal(kvx_read_start(c, &rq, &xb, &err), 0);
    td_err res;
    assert_int_equal(kvx_xfer_wait(xb, &res), TD_ETIMEDOUT);
    double s = (double)(td_now_ns() - t0) * 1e-9;
    assert_true(s >= 0.19 && s < 0.6);
    assert_int_equal(kvx_xfer_poll(xa, &res), TD_EAGAIN); /* A is still running */
    assert_int_equal(kvx_xfer_wait(xa, &res), 0);
    atomic_store(&kvx__test_send_delay_ms, 0);
    atomic_store(&kvx__test_no_wait_help, 0);
    kvx_xfer_free(xa);
    kvx_xfer_free(xb);
    kvx_client_destroy(c);
}

/* An odd geometry: blocks of 1000 bytes (not a multiple of 8), 3 segments, runs of every
 * length from 1 to 12, checksummed batches that do not divide the runs. */
enum { ODD_SEGS = 3, ODD_NB = 300, ODD_BB = 1000, ODD_STR = ODD_NB * ODD_BB + 8 };

/* Blocks src[i] of a's region into dst[i] of c's, in n_runs runs; checks the bytes that
 * arrived. */
static void odd_read(kvx_agent *a, kvx_client *c, const int32_t *src, const int32_t *dst, int n,
                     int n_runs, const uint8_t *pm, const uint8_t *cm)
{
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(a, src, n, 0, NULL, tid, &err), 0);
    kvx_read_req rq = req_for(a, tid, src, dst, n, 0);
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
    td_err res;
    int rc = kvx_xfer_wait(x, &res);
    if (rc) fprintf(stderr, "%s\n", res.msg);
    assert_int_equal(rc, 0);
    kvx_xfer_info info;
    kvx_xfer_get_info(x, &info);
    assert_int_equal(info.n_runs, n_runs);
    kvx_xfer_free(x);
    for (int sgm = 0; sgm < ODD_SEGS; sgm++)
        for (int i = 0; i < n; i++)
            assert_memory_equal(cm + (size_t)sgm * ODD_STR + (size_t)dst[i] * ODD_BB,
                                pm + (size_t)sgm * ODD_STR + (size_t)src[i] * ODD_BB, ODD_BB);
}

/* 78 blocks in runs of 1..12 with gaps between. */
static void odd_runs(kvx_agent *a, kvx_client *c, const uint8_t *pm, const uint8_t *cm)
{
    int32_t src[ODD_NB], dst[ODD_NB];
    int n = 0, next_src = 0, next_dst = 5;
    for (int run = 1; run <= 12; run++) {
        for (int j = 0; j < run; j++)
            src[n] = next_src + j, dst[n++] = next_dst + j;
        next_src += run + 3;
        next_dst += run + (run % 2); /* some consumer runs touch, some do not */
    }
    odd_read(a, c, src, dst, n, 12, pm, cm);
}

static void test_odd_geometry(void **state)
{
    (void)state;
    enum { SEGS = ODD_SEGS, NB = ODD_NB, BB = ODD_BB, STR = ODD_STR };
    uint8_t *pm = malloc(SEGS * STR), *cm = calloc(SEGS, STR);
    td_rng rng;
    td_rng_seed(&rng, 99);
    for (int i = 0; i < SEGS * STR; i++)
        pm[i] = (uint8_t)td_rng_next(&rng);
    kvx_layout l = layout();
    kvx_agent_opts ao;
    kvx_agent_opts_default(&ao);
    ao.layout = l;
    ao.region = (kvx_region){.base = pm, .n_segments = SEGS, .segment_stride = STR, .block_bytes = BB, .n_blocks = NB};
    kvx_client_opts co;
    kvx_client_opts_default(&co);
    co.layout = l;
    co.region = (kvx_region){.base = cm, .n_segments = SEGS, .segment_stride = STR, .block_bytes = BB, .n_blocks = NB};
    co.qp_per_transfer = 3;
    kvx_agent *a;
    kvx_client *c;
    td_err err;
    assert_int_equal(kvx_agent_create(&a, &ao, &err), 0);
    assert_int_equal(kvx_client_create(&c, &co, &err), 0);
    odd_runs(a, c, pm, cm);
    /* Again with the producer's writes cut short (6 blocks each, against runs of up to 12
     * blocks), so that longer runs are split over writes, and a write ends inside a run. */
    memset(cm, 0, SEGS * STR);
    atomic_store(&kvx__test_send_bytes, 6 * BB);
    odd_runs(a, c, pm, cm);
    atomic_store(&kvx__test_send_bytes, 0);
    /* Pieces of exactly one checksum batch of the consumer each (258 blocks of 1000 bytes:
     * a segment's run per piece), so every answer's last batch is full and carries the
     * trailer. */
    enum { WHOLE = 258 };
    int32_t src[WHOLE], dst[WHOLE];
    for (int i = 0; i < WHOLE; i++)
        src[i] = i, dst[i] = NB - WHOLE + i;
    odd_read(a, c, src, dst, WHOLE, 1, pm, cm);
    kvx_client_destroy(c);
    kvx_agent_destroy(a);
    free(pm);
    free(cm);
}

/* A lease that expires while its blocks are being sent leaves the table at once, but its
 * blocks go back only after the send has finished. */
static void test_expiry_waits_for_inflight_read(void **state)
{
    fixture *f = *state;
    int32_t b[] = {60, 61};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 2, 150, NULL, tid, &err), 0);
    atomic_store(&kvx__test_send_delay_ms, 700);
    kvx_read_req rq = req_for(f->agent, tid, b, b, 2, 5000);
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), 0);
    usleep(450 * 1000); /* the lease (renewed when the READ arrived) has expired by now */
    assert_int_equal(kvx_agent_n_leases(f->agent), 0);
    assert_int_equal(atomic_load(&f->rel.count), 0); /* but the blocks are still on the wire */
    td_err res;
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    expect_copied(f, b, b, 2);
    assert_int_equal(wait_released(f, 1), 1);
    assert_int_equal(atomic_load(&f->rel.reason), KVX_RELEASED_EXPIRED);
    atomic_store(&kvx__test_send_delay_ms, 0);
}

/* The producer agent closes while the data is on its way. */
static void test_producer_closes_mid_transfer(void **state)
{
    fixture *f = *state;
    int32_t b[] = {30, 31, 32};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(f->agent, b, 3, 0, NULL, tid, &err), 0);
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
    assert_int_equal(rc, TD_ECONN);
    assert_true(s < 2.0);
    kvx_xfer_free(x);
    assert_int_equal(atomic_load(&f->rel.reason), KVX_RELEASED_SHUTDOWN);
    atomic_store(&kvx__test_send_delay_ms, 0);
    f->agent = make_agent(f, 0, layout()); /* for teardown */
}

/* A forked producer is SIGKILLed while the consumer waits for its data. */
static void test_producer_killed(void **state)
{
    fixture *f = *state;
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(pfd[0]);
        atomic_store(&kvx__test_send_delay_ms, 10000);
        kvx_agent_opts o;
        kvx_agent_opts_default(&o);
        o.layout = layout();
        o.region = f->prod.region;
        kvx_agent *a;
        td_err err;
        if (kvx_agent_create(&a, &o, &err)) _exit(1);
        int32_t b[] = {1, 2};
        char line[128], tid[KVX_ID_HEX];
        if (kvx_agent_register(a, b, 2, 0, NULL, tid, &err)) _exit(1);
        int n = snprintf(line, sizeof(line), "%u %s %s\n", kvx_agent_port(a),
                         kvx_agent_engine_id(a), tid);
        if (write(pfd[1], line, (size_t)n) != n) _exit(1);
        for (;;)
            pause();
    }
    close(pfd[1]);
    char line[128] = {0};
    size_t got = 0;
    while (got < sizeof(line) - 1 && !strchr(line, '\n')) {
        ssize_t r = read(pfd[0], line + got, sizeof(line) - 1 - got);
        assert_true(r > 0);
        got += (size_t)r;
    }
    close(pfd[0]);
    unsigned port;
    char eid[KVX_ID_HEX], tid[KVX_ID_HEX];
    assert_int_equal(sscanf(line, "%u %32s %32s", &port, eid, tid), 3);
    int32_t b[] = {1, 2};
    kvx_read_req rq = {.host = "127.0.0.1",
                       .port = (uint16_t)port,
                       .engine_id = eid,
                       .transfer_id = tid,
                       .src_blocks = b,
                       .dst_blocks = b,
                       .n_blocks = 2,
                       .timeout_ms = 4000};
    kvx_xfer *x;
    td_err err;
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), 0);
    usleep(200 * 1000);
    uint64_t t0 = td_now_ns();
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    td_err res;
    int rc = kvx_xfer_wait(x, &res);
    double s = (double)(td_now_ns() - t0) * 1e-9;
    assert_int_equal(rc, TD_ECONN);
    assert_true(s < 1.0);
    kvx_xfer_free(x);
    /* Nothing listens there now: a new read fails fast and clearly. */
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), 0);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ECONN);
    assert_non_null(strstr(res.msg, "connect"));
    kvx_xfer_free(x);
}

/* A new incarnation at the same address: the cached session is replaced. */
static void test_producer_restart(void **state)
{
    fixture *f = *state;
    td_err err;
    uint16_t port = kvx_agent_port(f->agent);
    char old_id[KVX_ID_HEX];
    snprintf(old_id, sizeof(old_id), "%s", kvx_agent_engine_id(f->agent));
    assert_int_equal(kvx_session_check(f->client, "127.0.0.1", port, old_id, &err), 0);
    kvx_agent_destroy(f->agent);
    f->agent = make_agent(f, port, layout());
    assert_string_not_equal(old_id, kvx_agent_engine_id(f->agent));
    /* The old incarnation's blocks are gone: a clear error, not a read from the new one. */
    assert_int_equal(kvx_session_check(f->client, "127.0.0.1", port, old_id, &err), TD_ECONN);
    assert_non_null(strstr(err.msg, "restarted"));
    int32_t b[] = {3, 4};
    char tid[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, b, 2, 0, NULL, tid, &err), 0);
    assert_int_equal(read_blocks(f, tid, b, b, 2, 0, &err, NULL), 0);
    expect_copied(f, b, b, 2);
    assert_int_equal(kvx_client_n_sessions(f->client), 1);
}

/*
 * The producer hangs up on every idle connection while the session lives (as a producer
 * behind the same listener would after a restart of its connection threads). Requests do
 * not check an idle connection before using it: the first one on a dead connection fails
 * before its answer, the session's other idle connections are dropped with it, and the
 * request is retried once on a new connection. Transfers and releases still succeed.
 */
static void test_idle_connections_hung_up(void **state)
{
    fixture *f = *state;
    enum { N = 8, PER = 12 };
    int32_t src[2 * N][PER], dst[2 * N][PER];
    char tid[2 * N][KVX_ID_HEX];
    td_err err;
    for (int t = 0; t < 2 * N; t++) {
        for (int i = 0; i < PER; i++) {
            src[t][i] = (t * 5 + i * 7) % N_BLOCKS;
            dst[t][i] = (t % N) * PER + i;
        }
        assert_int_equal(kvx_agent_register(f->agent, src[t], PER, 0, NULL, tid[t], &err), 0);
    }
    for (int half = 0; half < 2; half++) {
        /* the first half's answers are slow, so that the workers open several connections */
        atomic_store(&kvx__test_send_delay_ms, half == 0 ? 30 : 0);
        atomic_store(&kvx__test_no_wait_help, half == 0);
        kvx_xfer *x[N];
        for (int t = 0; t < N; t++) {
            int k = half * N + t;
            kvx_read_req rq = req_for(f->agent, tid[k], src[k], dst[k], PER, 0);
            assert_int_equal(kvx_read_start(f->client, &rq, &x[t], &err), 0);
        }
        for (int t = 0; t < N; t++) {
            td_err res;
            int rc = kvx_xfer_wait(x[t], &res);
            if (rc) fprintf(stderr, "half %d, transfer %d: %s\n", half, t, res.msg);
            assert_int_equal(rc, 0);
            kvx_xfer_free(x[t]);
            expect_copied(f, src[half * N + t], dst[half * N + t], PER);
        }
        atomic_store(&kvx__test_send_delay_ms, 0);
        atomic_store(&kvx__test_no_wait_help, 0);
        /* every connection is idle on the consumer's side: hang up on all of them */
        kvx__test_agent_hangup(f->agent);
    }
    for (int t = 0; t < 2 * N; t++)
        assert_int_equal(kvx_release(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                     kvx_agent_engine_id(f->agent), tid[t], &err),
                         0);
    assert_int_equal(wait_released(f, 2 * N), 2 * N);
    assert_int_equal(kvx_client_n_sessions(f->client), 1);
}

static void test_port_collision(void **state)
{
    fixture *f = *state;
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.port = kvx_agent_port(f->agent);
    o.layout = layout();
    o.region = f->prod.region;
    kvx_agent *a = NULL;
    td_err err;
    assert_int_equal(kvx_agent_create(&a, &o, &err), TD_EIO);
    assert_null(a);
    char port[16];
    snprintf(port, sizeof(port), ":%u", o.port);
    assert_non_null(strstr(err.msg, port));
    assert_non_null(strstr(err.msg, "in use"));
}

/* Hostile or confused peers on the producer's port get an ERROR and a hang-up, and the
 * agent keeps serving everyone else. */
static int raw_exchange(fixture *f, const uint8_t *frame, size_t n, kvx_msg *m, uint8_t *buf,
                        td_err *err)
{
    int fd;
    uint64_t deadline = td_now_ns() + 2000000000ull;
    int rc = kvx__connect("127.0.0.1", kvx_agent_port(f->agent), deadline, &fd, err);
    if (!rc) rc = kvx__send_all(fd, frame, n, deadline, err);
    if (!rc) rc = kvx__recv_frame(fd, buf, 4096, m, deadline, err);
    if (!rc) { /* then the producer hangs up */
        uint8_t extra;
        int rc2 = kvx__recv_all(fd, &extra, 1, deadline, err);
        assert_int_equal(rc2, TD_ECONN);
    }
    close(fd);
    return rc;
}

static void test_hostile_peers(void **state)
{
    fixture *f = *state;
    uint8_t frame[256], buf[4096];
    kvx_msg m;
    td_err err;

    memcpy(frame, "GET / HTTP/1.1\r\n\r\n", 18); /* not a kvx peer */
    assert_int_equal(raw_exchange(f, frame, 18, &m, buf, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_ERROR);
    assert_int_equal(m.u.error.code, TD_EFORMAT);
    assert_non_null(strstr(m.u.error.msg, "magic"));

    size_t n = kvx_wire_encode_ack(frame, sizeof(frame), 1, 0);
    frame[4] = 9; /* a future version */
    assert_int_equal(raw_exchange(f, frame, n, &m, buf, &err), 0);
    assert_int_equal(m.u.error.code, TD_EUNSUPPORTED);

    uint8_t id[16] = {0};
    kvx_wire_desc d = {0, 0, 1};
    n = kvx_wire_encode_read(frame, sizeof(frame), 1, id, 0, &d, 1); /* READ before HELLO */
    assert_int_equal(raw_exchange(f, frame, n, &m, buf, &err), 0);
    assert_int_equal(m.u.error.code, TD_EPROTO);
    assert_non_null(strstr(m.u.error.msg, "HELLO"));

    n = kvx_wire_encode_ack(frame, sizeof(frame), 1, 0);
    frame[8] = 0xff; /* absurd length */
    frame[9] = 0xff;
    frame[10] = 0xff;
    frame[11] = 0x7f;
    assert_int_equal(raw_exchange(f, frame, n, &m, buf, &err), 0);
    assert_int_equal(m.u.error.code, TD_EFORMAT);

    kvx_agent_stats st;
    kvx_agent_get_stats(f->agent, &st);
    assert_int_equal(st.reads, 0);
    /* The agent still serves a well-behaved consumer. */
    assert_int_equal(kvx_session_check(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                       kvx_agent_engine_id(f->agent), &err),
                     0);
}

static void test_bad_requests(void **state)
{
    fixture *f = *state;
    td_err err;
    int32_t b[] = {1}, bad[] = {N_BLOCKS};
    kvx_xfer *x;
    kvx_read_req rq = req_for(f->agent, "00000000000000000000000000000000", b, bad, 1, 0);
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), TD_EINVAL);
    rq.dst_blocks = b;
    rq.n_blocks = 0;
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), TD_EINVAL);
    rq.n_blocks = 1;
    rq.engine_id = "nothex";
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), TD_EINVAL);
    char tid[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, bad, 1, 0, NULL, tid, &err), TD_EINVAL);
    assert_int_equal(kvx_agent_register(f->agent, b, 0, 0, NULL, tid, &err), TD_EINVAL);
    assert_int_equal(kvx_agent_cancel(f->agent, "00000000000000000000000000000000"), TD_ENOTFOUND);
    assert_int_equal(kvx_agent_register(f->agent, b, 1, 0, NULL, tid, &err), 0);
    assert_int_equal(kvx_agent_cancel(f->agent, tid), 0);
    assert_int_equal(atomic_load(&f->rel.reason), KVX_RELEASED_CANCELED);
}

/* Wait until the producer has begun its n-th delayed send since `from`. */
static void wait_delayed_sends(int from, int n)
{
    for (int i = 0; i < 5000 && atomic_load(&kvx__test_sends_delayed) - from < n; i++)
        usleep(1000);
    assert_true(atomic_load(&kvx__test_sends_delayed) - from >= n);
}

static kvx_xfer *start_read(fixture *f, kvx_client *c, const char *tid, const int32_t *src,
                            const int32_t *dst, int n)
{
    kvx_read_req rq = req_for(f->agent, tid, src, dst, n, 0);
    kvx_xfer *x = NULL;
    td_err err;
    assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
    return x;
}

/* A thread that waits for a transfer runs its queued pieces itself: B completes, whole,
 * while the only worker is still inside A's answer. */
static void test_waiter_runs_its_pieces(void **state)
{
    fixture *f = *state;
    kvx_client *c = one_worker_client(f, 2); /* a second connection for the waiter */
    td_err err;
    int32_t a[] = {3}, b[] = {4, 5, 6};
    char ta[KVX_ID_HEX], tb[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, a, 1, 0, NULL, ta, &err), 0);
    assert_int_equal(kvx_agent_register(f->agent, b, 3, 0, NULL, tb, &err), 0);
    int delayed0 = atomic_load(&kvx__test_sends_delayed);
    int helped0 = atomic_load(&kvx__test_pieces_helped);
    atomic_store(&kvx__test_send_delay_ms, 500);
    kvx_xfer *xa = start_read(f, c, ta, a, a, 1);
    for (int i = 0; i < 5000 && atomic_load(&kvx__test_sends_delayed) == delayed0; i++)
        usleep(1000); /* the only worker is now inside A's answer */
    assert_true(atomic_load(&kvx__test_sends_delayed) > delayed0);
    atomic_store(&kvx__test_send_delay_ms, 0);
    kvx_xfer *xb = start_read(f, c, tb, b, b, 3);
    td_err res;
    assert_int_equal(kvx_xfer_wait(xb, &res), 0);
    assert_int_equal(kvx_xfer_poll(xa, &res), TD_EAGAIN);
    assert_int_equal(atomic_load(&kvx__test_pieces_helped) - helped0, 1);
    expect_copied(f, b, b, 3);
    assert_int_equal(kvx_xfer_wait(xa, &res), 0);
    expect_copied(f, a, a, 1);
    kvx_xfer_free(xa);
    kvx_xfer_free(xb);
    kvx_client_destroy(c);
}

/* A read started with will_wait leaves its one piece to the caller's wait: no worker takes
 * it meanwhile. Polling or freeing the handle hands the piece to a worker instead, and a
 * wait runs the other will_wait transfers' small pieces with its own (up to a group) and
 * hands the rest to the workers, so that a caller that waits for several in turn does not
 * run them one after another (test_waiter_groups). */
static kvx_xfer *start_will_wait(fixture *f, kvx_client *c, const char *tid, const int32_t *b,
                                 int n, done_count *dc)
{
    kvx_read_req rq = req_for(f->agent, tid, b, b, n, 0);
    rq.will_wait = true;
    rq.done = dc ? on_done : NULL;
    rq.user = dc;
    kvx_xfer *x = NULL;
    td_err err;
    assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
    return x;
}

static bool wait_done(done_count *dc, int n)
{
    for (int i = 0; i < 3000 && atomic_load(&dc->n) < n; i++)
        usleep(1000);
    return atomic_load(&dc->n) >= n;
}

static void test_will_wait(void **state)
{
    fixture *f = *state;
    kvx_client *c = one_worker_client(f, 2);
    td_err err, res;
    int32_t b[5][1] = {{7}, {8}, {9}, {10}, {11}};
    char tid[5][KVX_ID_HEX];
    for (int i = 0; i < 5; i++)
        assert_int_equal(kvx_agent_register(f->agent, b[i], 1, 0, NULL, tid[i], &err), 0);
    usleep(100 * 1000); /* the worker has started and sleeps */
    /* 1: the sleeping worker is not woken for it; the waiter runs the piece */
    int helped0 = atomic_load(&kvx__test_pieces_helped);
    kvx_xfer *x = start_will_wait(f, c, tid[0], b[0], 1, NULL);
    usleep(200 * 1000);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    assert_int_equal(atomic_load(&kvx__test_pieces_helped) - helped0, 1);
    expect_copied(f, b[0], b[0], 1);
    kvx_xfer_free(x);
    /* 2: polling instead of waiting hands the piece to the worker */
    x = start_will_wait(f, c, tid[1], b[1], 1, NULL);
    int rc;
    for (int i = 0; i < 3000 && (rc = kvx_xfer_poll(x, &res)) == TD_EAGAIN; i++)
        usleep(1000);
    assert_int_equal(rc, 0);
    expect_copied(f, b[1], b[1], 1);
    kvx_xfer_free(x);
    /* 3: freeing the handle without a wait: the transfer still runs, and ends */
    done_count dc = {0};
    x = start_will_wait(f, c, tid[2], b[2], 1, &dc);
    kvx_xfer_free(x);
    assert_true(wait_done(&dc, 1));
    assert_int_equal(atomic_load(&dc.failed), 0);
    /* 4: two small will_wait reads; waiting for the first runs the second with it, one
     * group on one connection, and the worker is not woken */
    done_count dd = {0};
    helped0 = atomic_load(&kvx__test_pieces_helped);
    int grouped0 = atomic_load(&kvx__test_pieces_grouped);
    kvx_xfer *x3 = start_will_wait(f, c, tid[3], b[3], 1, &dd);
    kvx_xfer *x4 = start_will_wait(f, c, tid[4], b[4], 1, &dd);
    assert_int_equal(kvx_xfer_wait(x3, &res), 0);
    assert_true(wait_done(&dd, 2));
    assert_int_equal(atomic_load(&dd.failed), 0);
    assert_int_equal(atomic_load(&kvx__test_pieces_helped) - helped0, 2);
    assert_int_equal(atomic_load(&kvx__test_pieces_grouped) - grouped0, 2);
    expect_copied(f, b[3], b[3], 1);
    expect_copied(f, b[4], b[4], 1);
    kvx_xfer_free(x3);
    kvx_xfer_free(x4);
    kvx_client_destroy(c);
}

/* Twelve small transfers started with will_wait, then a wait for the first: the waiter runs
 * eight of them as one group (its own and seven held ones), and the one worker is woken
 * once for the other four, which it takes as one group too. Every transfer arrives whole,
 * through the receive buffer of pipelined groups or, with that off, straight into the
 * blocks. */
static void waiter_groups(fixture *f, bool bounce)
{
    kvx_client *c = one_worker_client(f, 2);
    atomic_store(&kvx__test_no_bounce, bounce ? 0 : 1);
    enum { N = 12 };
    int32_t src[N][2], dst[N][2];
    char tid[N][KVX_ID_HEX];
    kvx_xfer *x[N];
    td_err err, res;
    for (int t = 0; t < N; t++) {
        for (int i = 0; i < 2; i++) {
            src[t][i] = 150 + (t * 7 + i * 13) % 90;
            dst[t][i] = 60 + t * 2 + i;
        }
        assert_int_equal(kvx_agent_register(f->agent, src[t], 2, 0, NULL, tid[t], &err), 0);
    }
    usleep(100 * 1000); /* the worker has started and sleeps */
    int helped0 = atomic_load(&kvx__test_pieces_helped);
    int grouped0 = atomic_load(&kvx__test_pieces_grouped);
    int bounced0 = atomic_load(&kvx__test_pieces_bounced);
    done_count dc = {0};
    for (int t = 0; t < N; t++) {
        kvx_read_req rq = req_for(f->agent, tid[t], src[t], dst[t], 2, 0);
        rq.will_wait = true;
        rq.done = on_done;
        rq.user = &dc;
        assert_int_equal(kvx_read_start(c, &rq, &x[t], &err), 0);
    }
    assert_int_equal(kvx_xfer_wait(x[0], &res), 0);
    assert_true(wait_done(&dc, N));
    assert_int_equal(atomic_load(&dc.failed), 0);
    for (int t = 0; t < N; t++) {
        assert_int_equal(kvx_xfer_wait(x[t], &res), 0);
        expect_copied(f, src[t], dst[t], 2);
        kvx_xfer_free(x[t]);
    }
    assert_int_equal(atomic_load(&kvx__test_pieces_helped) - helped0, 8);
    assert_int_equal(atomic_load(&kvx__test_pieces_grouped) - grouped0, N);
    assert_int_equal(atomic_load(&kvx__test_pieces_bounced) - bounced0, bounce ? N : 0);
    for (int t = 0; t < N; t++)
        assert_int_equal(kvx_release(c, "127.0.0.1", kvx_agent_port(f->agent),
                                     kvx_agent_engine_id(f->agent), tid[t], &err),
                         0);
    assert_int_equal(wait_released(f, N), N);
    atomic_store(&kvx__test_no_bounce, 0);
    kvx_client_destroy(c);
}

static void test_waiter_groups(void **state)
{
    waiter_groups(*state, true);
}

static void test_waiter_groups_direct(void **state)
{
    waiter_groups(*state, false);
}

/* Eleven transfers queue behind a slow one and go out in two pipelined groups. In the
 * first group one names a transfer id the producer never gave and one arrives corrupted:
 * those two fail alone, with their own errors, and every other transfer arrives whole. */
static void pipelined_pieces(fixture *f, bool bounce)
{
    kvx_client *c = one_worker_client(f, 0);
    atomic_store(&kvx__test_no_wait_help, 1); /* the groups are the worker's */
    atomic_store(&kvx__test_no_bounce, bounce ? 0 : 1);
    int bounced0 = atomic_load(&kvx__test_pieces_bounced);
    enum { N = 12, PER = 2, GUESSED = 5, CORRUPT = 1 };
    int32_t src[N][PER], dst[N][PER];
    char tid[N][KVX_ID_HEX];
    kvx_xfer *x[N];
    td_err err;
    for (int t = 0; t < N; t++) {
        for (int i = 0; i < PER; i++) {
            src[t][i] = 100 + (t * 5 + i * 11) % 100;
            dst[t][i] = t * PER + i;
        }
        if (t == GUESSED)
            snprintf(tid[t], KVX_ID_HEX, "0123456789abcdef0123456789abcdef");
        else
            assert_int_equal(kvx_agent_register(f->agent, src[t], PER, 0, NULL, tid[t], &err), 0);
    }
    int grouped0 = atomic_load(&kvx__test_pieces_grouped);
    int delayed0 = atomic_load(&kvx__test_sends_delayed);
    int taken0 = atomic_load(&kvx__test_answers_taken);
    atomic_store(&kvx__test_send_delay_ms, 300);
    x[0] = start_read(f, c, tid[0], src[0], dst[0], PER);
    wait_delayed_sends(delayed0, 1); /* the only worker waits inside transfer 0's answer */
    atomic_store(&kvx__test_send_delay_ms, 0);
    /* ... past its header, so that the corruption below cannot be transfer 0's */
    for (int i = 0; i < 5000 && atomic_load(&kvx__test_answers_taken) == taken0; i++)
        usleep(1000);
    assert_true(atomic_load(&kvx__test_answers_taken) > taken0);
    for (int t = 1; t < N; t++)
        x[t] = start_read(f, c, tid[t], src[t], dst[t], PER);
    atomic_store(&kvx__test_corrupt_pieces, 1); /* the first piece of the first group */
    for (int t = 0; t < N; t++) {
        td_err res;
        int rc = kvx_xfer_wait(x[t], &res);
        if (t == GUESSED) {
            assert_int_equal(rc, TD_ENOTFOUND);
        } else if (t == CORRUPT) {
            assert_int_equal(rc, TD_EPROTO);
            assert_non_null(strstr(res.msg, "checksum mismatch"));
        } else {
            if (rc) fprintf(stderr, "transfer %d: %s\n", t, res.msg);
            assert_int_equal(rc, 0);
            expect_copied(f, src[t], dst[t], PER);
        }
        kvx_xfer_free(x[t]);
    }
    assert_int_equal(atomic_load(&kvx__test_pieces_grouped) - grouped0, N - 1);
    /* The connection stayed in step: a transfer after the groups works on it. */
    x[CORRUPT] = start_read(f, c, tid[CORRUPT], src[CORRUPT], dst[CORRUPT], PER);
    assert_int_equal(kvx_xfer_wait(x[CORRUPT], &err), 0);
    expect_copied(f, src[CORRUPT], dst[CORRUPT], PER);
    kvx_xfer_free(x[CORRUPT]);
    for (int t = 0; t < N; t++)
        if (t != GUESSED)
            assert_int_equal(kvx_release(c, "127.0.0.1", kvx_agent_port(f->agent),
                                         kvx_agent_engine_id(f->agent), tid[t], &err),
                             0);
    assert_int_equal(wait_released(f, N - 1), N - 1);
    assert_int_equal(atomic_load(&kvx__test_pieces_bounced) - bounced0, bounce ? N + 1 : 0);
    atomic_store(&kvx__test_no_wait_help, 0);
    atomic_store(&kvx__test_no_bounce, 0);
    kvx_client_destroy(c);
}

/* Through the receive buffer of pipelined groups (bounce_recv_piece), and straight into
 * the blocks (tcp_recv_piece). */
static void test_pipelined_pieces(void **state)
{
    pipelined_pieces(*state, true);
}

static void test_pipelined_pieces_direct(void **state)
{
    pipelined_pieces(*state, false);
}

/* The producer goes away while a pipelined group is in flight (its first answer has begun):
 * every transfer of the group ends at once with a connection error, none waits for its
 * deadline, and the transfer before the group is whole. */
static void test_pipelined_producer_closes(void **state)
{
    fixture *f = *state;
    kvx_client *c = one_worker_client(f, 0);
    atomic_store(&kvx__test_no_wait_help, 1); /* the group is the worker's */
    enum { N = 6 };
    int32_t b[N][1];
    char tid[N][KVX_ID_HEX];
    kvx_xfer *x[N];
    td_err err;
    for (int t = 0; t < N; t++) {
        b[t][0] = 40 + t;
        assert_int_equal(kvx_agent_register(f->agent, b[t], 1, 0, NULL, tid[t], &err), 0);
    }
    int grouped0 = atomic_load(&kvx__test_pieces_grouped);
    int delayed0 = atomic_load(&kvx__test_sends_delayed);
    atomic_store(&kvx__test_send_delay_ms, 300);
    x[0] = start_read(f, c, tid[0], b[0], b[0], 1);
    wait_delayed_sends(delayed0, 1);
    for (int t = 1; t < N; t++)
        x[t] = start_read(f, c, tid[t], b[t], b[t], 1);
    /* Transfer 0 ends; the group's READs go out and its first answer sleeps. */
    wait_delayed_sends(delayed0, 2);
    usleep(20 * 1000);
    uint64_t t0 = td_now_ns();
    kvx_agent_destroy(f->agent);
    f->agent = NULL;
    td_err res;
    assert_int_equal(kvx_xfer_wait(x[0], &res), 0);
    for (int t = 1; t < N; t++) {
        assert_int_equal(kvx_xfer_wait(x[t], &res), TD_ECONN);
        kvx_xfer_free(x[t]);
    }
    kvx_xfer_free(x[0]);
    assert_true((double)(td_now_ns() - t0) * 1e-9 < 2.0);
    /* the group of N - 1 went out together (its pieces, sent again once after the broken
     * answer, may have gone out as a group again) */
    assert_true(atomic_load(&kvx__test_pieces_grouped) - grouped0 >= N - 1);
    atomic_store(&kvx__test_send_delay_ms, 0);
    atomic_store(&kvx__test_no_wait_help, 0);
    kvx_client_destroy(c);
    f->agent = make_agent(f, 0, layout()); /* for teardown */
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_basic_read_and_release),
        T(test_whole_pool),
        T(test_small_transfers_few_pieces),
        T(test_16_concurrent),
        T(test_layout_mismatch),
        T(test_guessed_transfer_id),
        T(test_lease_expiry),
        T(test_checksum_corruption),
        T(test_deadline),
        T(test_deadline_while_queued),
        T(test_producer_closes_mid_transfer),
        T(test_producer_killed),
        T(test_producer_restart),
        T(test_idle_connections_hung_up),
        T(test_port_collision),
        T(test_hostile_peers),
        T(test_bad_requests),
        T(test_odd_geometry),
        T(test_expiry_waits_for_inflight_read),
        T(test_waiter_runs_its_pieces),
        T(test_will_wait),
        T(test_waiter_groups),
        T(test_waiter_groups_direct),
        T(test_pipelined_pieces),
        T(test_pipelined_pieces_direct),
        T(test_pipelined_producer_closes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
