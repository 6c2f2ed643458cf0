/*
 * kvx_fixture.h - what the kvx transfer tests share (test_kvx_xfer.c, test_kvx_push.c): two
 * pools (producer, consumer) with padding between segments, the layout both sides agree
 * on, a producer agent and a consumer client over loopback, and the release callback's
 * bookkeeping. Included by the test files, never compiled alone.
 */
#ifndef TD_TESTS_KVX_FIXTURE_H
#define TD_TESTS_KVX_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

#define N_SEG 4
#define N_BLOCKS 256
#define BLOCK_BYTES 2048
#define STRIDE (N_BLOCKS * BLOCK_BYTES + 4096) /* padding between segments */

typedef struct pool {
    uint8_t *mem;
    kvx_region region;
} pool;

static inline void pool_init(pool *p, uint64_t seed)
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

static inline uint8_t *blk(pool *p, int seg, int b)
{
    return p->mem + (size_t)seg * STRIDE + (size_t)b * BLOCK_BYTES;
}

static inline kvx_layout layout(void)
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

/* Release callback bookkeeping. */
typedef struct released {
    _Atomic int count;
    _Atomic int reason;
    _Atomic int blocks;
} released;

static inline void on_release(void *user, const char *id, const int32_t *blocks, int n,
                              kvx_release_reason reason, void *tu)
{
    (void)id;
    (void)blocks;
    (void)tu;
    released *r = user;
    atomic_store(&r->reason, (int)reason);
    atomic_fetch_add(&r->blocks, n);
    atomic_fetch_add(&r->count, 1);
}

typedef struct fixture {
    pool prod, cons;
    kvx_agent *agent;
    kvx_client *client;
    released rel;
} fixture;

static inline kvx_agent *make_agent(fixture *f, uint16_t port, kvx_layout l)
{
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.port = port;
    o.layout = l;
    o.region = f->prod.region;
    o.release_cb = on_release;
    o.release_user = &f->rel;
    kvx_agent *a;
    td_err err;
    int rc = kvx_agent_create(&a, &o, &err);
    if (rc) fprintf(stderr, "agent: %s\n", err.msg);
    assert_int_equal(rc, 0);
    return a;
}

static inline kvx_client *make_client(fixture *f, kvx_layout l)
{
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = l;
    o.region = f->cons.region;
    o.transfer_timeout_ms = 5000;
    kvx_client *c;
    td_err err;
    assert_int_equal(kvx_client_create(&c, &o, &err), 0);
    return c;
}

static inline int setup(void **state)
{
    fixture *f = calloc(1, sizeof(*f));
    pool_init(&f->prod, 1234);
    pool_init(&f->cons, 0);
    f->agent = make_agent(f, 0, layout());
    f->client = make_client(f, layout());
    *state = f;
    return 0;
}

/* Stops the fixture's client and agent (either may have been replaced by NULL) and clears
 * the test hooks a test may have left set. */
static inline int teardown(void **state)
{
    fixture *f = *state;
    atomic_store(&kvx__test_send_delay_ms, 0);
    atomic_store(&kvx__test_corrupt_pieces, 0);
    if (f->client) kvx_client_destroy(f->client);
    if (f->agent) kvx_agent_destroy(f->agent);
    free(f->prod.mem);
    free(f->cons.mem);
    free(f);
    return 0;
}

/* A consumer of the fixture's layout and pool with these workers, connections per peer
 * and transfer timeout. */
static inline kvx_client *client_with(fixture *f, int workers, int qp, uint32_t timeout_ms)
{
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = f->cons.region;
    o.num_worker_threads = workers;
    o.qp_per_transfer = qp;
    o.transfer_timeout_ms = timeout_ms;
    kvx_client *c;
    td_err err;
    assert_int_equal(kvx_client_create(&c, &o, &err), 0);
    return c;
}

/* Whether consumer blocks dst[i] hold producer blocks src[i] in every segment. */
static inline bool blocks_copied(fixture *f, const int32_t *src, const int32_t *dst, int n)
{
    for (int s = 0; s < N_SEG; s++)
        for (int i = 0; i < n; i++)
            if (memcmp(blk(&f->cons, s, dst[i]), blk(&f->prod, s, src[i]), BLOCK_BYTES))
                return false;
    return true;
}

/* A release callback may run a moment after RELEASE is acknowledged: the producer's
 * connection thread that sent the last bytes gives the blocks back once its writev returns. */
static inline int wait_released(fixture *f, int n)
{
    for (int i = 0; i < 200 && atomic_load(&f->rel.count) < n; i++)
        usleep(5 * 1000);
    return atomic_load(&f->rel.count);
}

#endif
