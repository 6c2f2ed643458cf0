/*
 * Push-mode tests for kvx (transfer_mode write): a producer agent and a consumer client in
 * one process over real loopback sockets. The test plays the engine: it opens a push,
 * reports segment progress as a prefill would, and finishes with a note. Covers: blocks
 * move before the prefill finishes, a WRITE that comes before the open, skipped (cached)
 * blocks, keep-alives through a slow prefill, a WRITE nobody opens, a cancelled push, a
 * second claim, a block-count mismatch, reads of blocks not computed yet, the producer
 * shutting down mid-push, and the consumer cancelling a push that waits.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

#include "kvx_fixture.h"

#define TID "0123456789abcdef0123456789abcdef"

static kvx_xfer *start_write(fixture *f, const int32_t *dst, int n, int skip, uint32_t timeout_ms)
{
    kvx_write_req rq = {.host = "127.0.0.1",
                        .port = kvx_agent_port(f->agent),
                        .engine_id = kvx_agent_engine_id(f->agent),
                        .transfer_id = TID,
                        .dst_blocks = dst,
                        .n_blocks = n,
                        .skip = skip,
                        .timeout_ms = timeout_ms};
    kvx_xfer *x = NULL;
    td_err err;
    int rc = kvx_write_start(f->client, &rq, &x, &err);
    if (rc) fprintf(stderr, "write_start: %s\n", err.msg);
    assert_int_equal(rc, 0);
    return x;
}

/* Producer blocks 100.. (two runs), consumer blocks in another order. */
static void make_blocks(int32_t *src, int32_t *dst, int n)
{
    for (int i = 0; i < n; i++) {
        src[i] = i < n / 2 ? 100 + i : 180 + i;
        dst[i] = 5 + (i * 7) % n;
    }
}

static bool copied(fixture *f, const int32_t *src, const int32_t *dst, int from, int to, int seg0,
                   int seg1)
{
    for (int s = seg0; s < seg1; s++)
        for (int i = from; i < to; i++)
            if (memcmp(blk(&f->cons, s, dst[i]), blk(&f->prod, s, src[i]), BLOCK_BYTES))
                return false;
    return true;
}

static bool wait_copied(fixture *f, const int32_t *src, const int32_t *dst, int from, int to,
                        int seg0, int seg1)
{
    for (int i = 0; i < 400; i++) {
        if (copied(f, src, dst, from, to, seg0, seg1)) return true;
        usleep(5000);
    }
    return false;
}

static void test_push_moves_blocks_before_the_prefill_ends(void **state)
{
    fixture *f = *state;
    enum { N = 40, SKIP = 3 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    td_err err;
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    kvx_xfer *x = start_write(f, dst, N, SKIP, 0);
    /* Chunk 1 (blocks 0..16) of every segment, as a prefill's layers would report it. */
    for (uint32_t s = 0; s < N_SEG; s++)
        assert_int_equal(kvx_agent_push_ready(f->agent, TID, s, 16, src), 0);
    /* The consumer has it before the prefill goes on: the copy overlaps the compute. */
    assert_true(wait_copied(f, src, dst, SKIP, 16, 0, N_SEG));
    assert_int_equal(kvx_xfer_poll(x, &err), TD_EAGAIN);
    /* Chunk 2, layer by layer; a smaller count is ignored. */
    for (uint32_t s = 0; s < N_SEG; s++) {
        assert_int_equal(kvx_agent_push_ready(f->agent, TID, s, 32, src), 0);
        assert_int_equal(kvx_agent_push_ready(f->agent, TID, s, 8, src), 0);
    }
    assert_true(wait_copied(f, src, dst, SKIP, 32, 0, N_SEG));
    const char note[] = "first token 42";
    assert_int_equal(kvx_agent_push_finish(f->agent, TID, src, note, sizeof(note)), 0);
    assert_int_equal(kvx_xfer_wait(x, &err), 0);
    assert_true(copied(f, src, dst, SKIP, N, 0, N_SEG));
    /* Skipped blocks were not written. */
    for (int i = 0; i < SKIP; i++)
        for (int s = 0; s < N_SEG; s++)
            for (int b = 0; b < BLOCK_BYTES; b++)
                assert_int_equal(blk(&f->cons, s, dst[i])[b], 0);
    char got[64] = "";
    assert_int_equal(kvx_xfer_note(x, got, sizeof(got)), sizeof(note));
    assert_string_equal(got, note);
    kvx_xfer_info info;
    kvx_xfer_get_info(x, &info);
    assert_int_equal(info.bytes, (uint64_t)(N - SKIP) * N_SEG * BLOCK_BYTES);
    kvx_xfer_free(x);
    /* The lease runs from the finish; the consumer releases it as after a read. */
    assert_int_equal(kvx_agent_n_leases(f->agent), 1);
    assert_int_equal(kvx_release(f->client, "127.0.0.1", kvx_agent_port(f->agent),
                                 kvx_agent_engine_id(f->agent), TID, &err),
                     0);
    assert_int_equal(wait_released(f, 1), 1);
    kvx_agent_stats st;
    kvx_agent_get_stats(f->agent, &st);
    assert_int_equal(st.pushes, 1);
}

static void test_push_write_before_open(void **state)
{
    fixture *f = *state;
    enum { N = 10 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    kvx_xfer *x = start_write(f, dst, N, 0, 0); /* the router dispatched to both at once */
    usleep(150 * 1000);
    td_err err;
    assert_int_equal(kvx_xfer_poll(x, &err), TD_EAGAIN);
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    assert_int_equal(kvx_agent_push_finish(f->agent, TID, src, "x", 1), 0);
    assert_int_equal(kvx_xfer_wait(x, &err), 0);
    assert_true(copied(f, src, dst, 0, N, 0, N_SEG));
    kvx_xfer_free(x);
}

static void test_push_keepalives_cover_a_slow_prefill(void **state)
{
    fixture *f = *state;
    enum { N = 4 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    td_err err;
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    kvx_xfer *x = start_write(f, dst, N, 0, 1500);
    usleep(2600 * 1000); /* longer than the consumer's 1.5 s of allowed silence */
    assert_int_equal(kvx_xfer_poll(x, &err), TD_EAGAIN);
    assert_int_equal(kvx_agent_push_finish(f->agent, TID, src, NULL, 0), 0);
    assert_int_equal(kvx_xfer_wait(x, &err), 0);
    assert_true(copied(f, src, dst, 0, N, 0, N_SEG));
    kvx_xfer_free(x);
}

static void test_push_nobody_opens(void **state)
{
    fixture *f = *state;
    int32_t dst[4] = {1, 2, 3, 4};
    kvx_xfer *x = start_write(f, dst, 4, 0, 300);
    td_err err;
    uint64_t t0 = td_now_ns();
    assert_int_equal(kvx_xfer_wait(x, &err), TD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "no prefill with this transfer id"));
    assert_true(td_now_ns() - t0 < 3000000000ull);
    kvx_xfer_free(x);
}

static void test_push_cancelled_midway(void **state)
{
    fixture *f = *state;
    enum { N = 12 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    td_err err;
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    kvx_xfer *x = start_write(f, dst, N, 0, 0);
    assert_int_equal(kvx_agent_push_ready(f->agent, TID, 0, 4, src), 0);
    assert_true(wait_copied(f, src, dst, 0, 4, 0, 1));
    assert_int_equal(kvx_agent_cancel(f->agent, TID), 0); /* the request was aborted */
    assert_int_equal(kvx_xfer_wait(x, &err), TD_ECANCELED);
    assert_non_null(strstr(err.msg, "dropped this transfer"));
    kvx_xfer_free(x);
    assert_int_equal(wait_released(f, 1), 1);
    assert_int_equal(atomic_load(&f->rel.reason), KVX_RELEASED_CANCELED);
    assert_int_equal(kvx_agent_n_leases(f->agent), 0);
    /* Progress for a transfer that is gone is refused, not a crash. */
    assert_int_equal(kvx_agent_push_ready(f->agent, TID, 1, 4, src), TD_ENOTFOUND);
    assert_int_equal(kvx_agent_push_finish(f->agent, TID, src, NULL, 0), TD_ENOTFOUND);
}

static void test_push_claimed_once_and_counts_checked(void **state)
{
    fixture *f = *state;
    enum { N = 6 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    td_err err;
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), TD_ESTATE);
    kvx_xfer *wrong = start_write(f, dst, N - 1, 0, 0); /* tokenized differently */
    assert_int_equal(kvx_xfer_wait(wrong, &err), TD_EPROTO);
    assert_non_null(strstr(err.msg, "blocks"));
    kvx_xfer_free(wrong);
    kvx_xfer *x = start_write(f, dst, N, 0, 0);
    usleep(100 * 1000);
    kvx_xfer *second = start_write(f, dst, N, 0, 0);
    assert_int_equal(kvx_xfer_wait(second, &err), TD_ESTATE);
    assert_non_null(strstr(err.msg, "already claimed"));
    kvx_xfer_free(second);
    assert_int_equal(kvx_agent_push_finish(f->agent, TID, src, NULL, 0), 0);
    assert_int_equal(kvx_xfer_wait(x, &err), 0);
    kvx_xfer_free(x);
}

static void test_push_reads_only_computed_blocks(void **state)
{
    fixture *f = *state;
    enum { N = 8 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    td_err err;
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    assert_int_equal(kvx_agent_push_ready(f->agent, TID, 0, 2, src), 0);
    /* A plain READ of blocks that no layer has computed yet is refused... */
    kvx_read_req rq = {.host = "127.0.0.1",
                       .port = kvx_agent_port(f->agent),
                       .engine_id = kvx_agent_engine_id(f->agent),
                       .transfer_id = TID,
                       .src_blocks = src,
                       .dst_blocks = dst,
                       .n_blocks = 4};
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(f->client, &rq, &x, &err), 0);
    assert_int_equal(kvx_xfer_wait(x, &err), TD_ERANGE);
    assert_non_null(strstr(err.msg, "not computed yet"));
    kvx_xfer_free(x);
    /* ... and bad progress reports are refused. */
    assert_int_equal(kvx_agent_push_ready(f->agent, TID, N_SEG, 2, src), TD_EINVAL);
    int32_t bad[N] = {1, 2, -5, 4, 5, 6, 7, 8};
    assert_int_equal(kvx_agent_push_ready(f->agent, TID, 0, 4, bad), TD_EINVAL);
    assert_int_equal(kvx_agent_push_open(f->agent, "not-hex", 4, NULL, &err), TD_EINVAL);
    assert_int_equal(kvx_agent_cancel(f->agent, TID), 0);
}

static void test_push_producer_shuts_down(void **state)
{
    fixture *f = *state;
    enum { N = 8 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    td_err err;
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    kvx_xfer *x = start_write(f, dst, N, 0, 0);
    assert_int_equal(kvx_agent_push_ready(f->agent, TID, 0, 3, src), 0);
    assert_true(wait_copied(f, src, dst, 0, 3, 0, 1));
    uint64_t t0 = td_now_ns();
    kvx_agent_destroy(f->agent); /* the producer goes away mid-prefill */
    f->agent = NULL;
    int rc = kvx_xfer_wait(x, &err);
    assert_true(rc == TD_ECONN || rc == TD_ECANCELED);
    assert_true(td_now_ns() - t0 < 3000000000ull); /* promptly, not at a deadline */
    kvx_xfer_free(x);
    assert_int_equal(wait_released(f, 1), 1);
    assert_int_equal(atomic_load(&f->rel.reason), KVX_RELEASED_SHUTDOWN);
}

static void test_push_consumer_shuts_down(void **state)
{
    fixture *f = *state;
    enum { N = 8 };
    int32_t src[N], dst[N];
    make_blocks(src, dst, N);
    td_err err;
    assert_int_equal(kvx_agent_push_open(f->agent, TID, N, NULL, &err), 0);
    kvx_xfer *x = start_write(f, dst, N, 0, 0);
    assert_int_equal(kvx_agent_push_ready(f->agent, TID, 0, 3, src), 0);
    kvx_xfer_free(x); /* freed when it ends */
    uint64_t t0 = td_now_ns();
    kvx_client_destroy(f->client); /* ends the push at once */
    f->client = NULL;
    assert_true(td_now_ns() - t0 < 3000000000ull);
    /* The producer's push stays until finish + lease; then it is given back. */
    assert_int_equal(kvx_agent_push_finish(f->agent, TID, src, NULL, 0), 0);
    assert_int_equal(kvx_agent_n_leases(f->agent), 1);
}

/* The consumer's request was aborted while its push waits for a prefill that will never
 * run (the router cancelled it too): kvx_client_cancel ends the push at once, with
 * TD_ECANCELED, rather than after the producer's silence times out; the producer's side of
 * it ends too, and leaves the transfer id to a later WRITE. */
static void test_push_cancelled_by_consumer(void **state)
{
    fixture *f = *state;
    int32_t dst[4] = {1, 2, 3, 4};
    td_err err;
    assert_int_equal(kvx_client_cancel(f->client, TID), TD_ENOTFOUND); /* nothing yet */
    assert_int_equal(kvx_client_cancel(f->client, "not hex"), TD_EINVAL);
    /* cancelled before its thread even connects, and while it waits */
    for (int round = 0; round < 2; round++) {
        kvx_xfer *x = start_write(f, dst, 4, 0, 60000);
        if (round) usleep(100000); /* its WRITE is at the producer, waiting for an open */
        uint64_t t0 = td_now_ns();
        assert_int_equal(kvx_client_cancel(f->client, TID), 0);
        assert_int_equal(kvx_xfer_wait(x, &err), TD_ECANCELED);
        assert_non_null(strstr(err.msg, "cancelled"));
        assert_true(td_now_ns() - t0 < 3000000000ull);
        kvx_xfer_free(x);
    }
    /* the client works on, with the same transfer id opened now: the producer's cancelled
     * WRITE, which waited for it, left when its consumer hung up rather than claiming it
     * (the new WRITE was refused as a second claim) */
    enum { N = 4 };
    static const char tid2[] = TID;
    int32_t src[N], d2[N];
    make_blocks(src, d2, N);
    assert_int_equal(kvx_agent_push_open(f->agent, tid2, N, NULL, &err), 0);
    kvx_write_req rq = {.host = "127.0.0.1",
                        .port = kvx_agent_port(f->agent),
                        .engine_id = kvx_agent_engine_id(f->agent),
                        .transfer_id = tid2,
                        .dst_blocks = d2,
                        .n_blocks = N};
    kvx_xfer *x = NULL;
    assert_int_equal(kvx_write_start(f->client, &rq, &x, &err), 0);
    for (uint32_t s = 0; s < N_SEG; s++)
        assert_int_equal(kvx_agent_push_ready(f->agent, tid2, s, N, src), 0);
    assert_int_equal(kvx_agent_push_finish(f->agent, tid2, src, "n", 2), 0);
    assert_int_equal(kvx_xfer_wait(x, &err), 0);
    assert_true(copied(f, src, d2, 0, N, 0, N_SEG));
    kvx_xfer_free(x);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_push_moves_blocks_before_the_prefill_ends),
        T(test_push_write_before_open),
        T(test_push_keepalives_cover_a_slow_prefill),
        T(test_push_nobody_opens),
        T(test_push_cancelled_midway),
        T(test_push_claimed_once_and_counts_checked),
        T(test_push_reads_only_computed_blocks),
        T(test_push_producer_shuts_down),
        T(test_push_consumer_shuts_down),
        T(test_push_cancelled_by_consumer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
