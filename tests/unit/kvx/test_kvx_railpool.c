/*
 * Rail engines: the pool (railpool.c) with a recording engine, then a producer and
 * consumers on four loopback "rails" (127.0.0.11-14, addresses given, so no device
 * binding or namespaces are needed; the rail-isolated fabric is tests/integration/
 * test_rails.sh):
 *  - concurrent first use of a rail makes exactly one engine; ranges are registered once;
 *  - a registration that fails is rolled back in reverse, the engine closed, and the rail
 *    stays failed (no second attempt); an engine that fails to open likewise; the primary
 *    failing fails the pool;
 *  - matched rails: each consumer's transfers run on the producer's engine of the rail of
 *    the same name, every piece of them, with four consumers on four rails at once, and
 *    the engines of unused rails are never made;
 *  - a consumer's rail that is not the producer's, a consumer without rails at a producer
 *    with rails, and a producer without rails each fail the transfer with a clear error
 *    (no fallback to another rail); a rail whose engine fails stays failed;
 *  - without matched rails (one device each), the consumer gets the producer's device;
 *  - striping: a transfer's pieces go over every rail, fewer to a slow one, none to a
 *    failed one, and the transfers still succeed.
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

/* ---------------------------------------------------------------- the pool */

typedef struct rec {
    pthread_mutex_t mu;
    int opens[8], closes[8];
    int log[64]; /* registrations: +(range + 1), unregistrations: -(range + 1) */
    int n_log;
    int fail_open_rail;   /* -1: none */
    int fail_reg_rail, fail_reg_range;
    int engines[8];
} rec;

static int rec_open(void *user, int rail, const char *name, void **eng, td_err *err)
{
    rec *r = user;
    (void)name;
    usleep(2000); /* widen the window for concurrent first uses */
    pthread_mutex_lock(&r->mu);
    r->opens[rail]++;
    pthread_mutex_unlock(&r->mu);
    if (rail == r->fail_open_rail) return td_err_set(err, TD_EIO, "device %d is gone", rail);
    *eng = &r->engines[rail];
    return 0;
}

static int rec_reg(void *user, void *eng, int range, td_err *err)
{
    rec *r = user;
    int rail = (int)((int *)eng - r->engines);
    pthread_mutex_lock(&r->mu);
    r->log[r->n_log++] = range + 1;
    pthread_mutex_unlock(&r->mu);
    if (rail == r->fail_reg_rail && range == r->fail_reg_range)
        return td_err_set(err, TD_EIO, "registration %d refused", range);
    return 0;
}

static void rec_unreg(void *user, void *eng, int range)
{
    rec *r = user;
    (void)eng;
    pthread_mutex_lock(&r->mu);
    r->log[r->n_log++] = -(range + 1);
    pthread_mutex_unlock(&r->mu);
}

static void rec_close(void *user, void *eng)
{
    rec *r = user;
    r->closes[(int *)eng - r->engines]++;
}

static const kvx__rail_ops rec_ops = {rec_open, rec_reg, rec_unreg, rec_close};

static kvx_rails four_rails(int primary)
{
    kvx_rails r;
    memset(&r, 0, sizeof(r));
    r.n = 4;
    for (int i = 0; i < 4; i++) snprintf(r.name[i], sizeof(r.name[i]), "tdr%d", i);
    r.primary = primary;
    r.kind = KVX_RAIL_NET;
    return r;
}

static void rec_init(rec *r)
{
    memset(r, 0, sizeof(*r));
    pthread_mutex_init(&r->mu, NULL);
    r->fail_open_rail = r->fail_reg_rail = -1;
}

typedef struct getter {
    kvx__railpool *p;
    int rail;
    void *eng;
    int rc;
} getter;

static void *get_main(void *arg)
{
    getter *g = arg;
    td_err err;
    g->rc = kvx__railpool_get(g->p, g->rail, &g->eng, &err);
    return NULL;
}

static void test_pool_concurrent_first_use(void **state)
{
    (void)state;
    rec r;
    rec_init(&r);
    kvx_rails rails = four_rails(1);
    kvx__railpool *p;
    td_err err;
    assert_int_equal(kvx__railpool_create(&p, &rails, 3, &rec_ops, &r, &err), 0);
    assert_int_equal(r.opens[1], 1); /* the primary, at once */
    assert_int_equal(kvx__railpool_state(p, 1), KVX__RAIL_READY);
    assert_int_equal(kvx__railpool_state(p, 2), KVX__RAIL_NONE);
    getter g[16];
    pthread_t t[16];
    for (int i = 0; i < 16; i++) {
        g[i] = (getter){.p = p, .rail = i % 2 ? 2 : 3};
        assert_int_equal(pthread_create(&t[i], NULL, get_main, &g[i]), 0);
    }
    for (int i = 0; i < 16; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(g[i].rc, 0);
        assert_ptr_equal(g[i].eng, &r.engines[g[i].rail]);
    }
    assert_int_equal(r.opens[2], 1);
    assert_int_equal(r.opens[3], 1);
    assert_int_equal(r.opens[0], 0);
    assert_int_equal(r.n_log, 9); /* three ranges on each of three engines */
    void *eng;
    assert_int_equal(kvx__railpool_get(p, 1, &eng, &err), 0); /* the primary is reused */
    assert_int_equal(r.opens[1], 1);
    assert_int_equal(kvx__railpool_get(p, 4, &eng, &err), TD_EINVAL);
    kvx__railpool_destroy(p);
    assert_int_equal(r.closes[1] + r.closes[2] + r.closes[3], 3);
    assert_int_equal(r.closes[0], 0);
    assert_int_equal(r.n_log, 18); /* every registration undone */
}

static void test_pool_rollback_and_stays_failed(void **state)
{
    (void)state;
    rec r;
    rec_init(&r);
    r.fail_reg_rail = 2;
    r.fail_reg_range = 3;
    r.fail_open_rail = 3;
    kvx_rails rails = four_rails(0);
    kvx__railpool *p;
    td_err err;
    assert_int_equal(kvx__railpool_create(&p, &rails, 5, &rec_ops, &r, &err), 0);
    r.n_log = 0;
    void *eng = (void *)1;
    assert_int_equal(kvx__railpool_get(p, 2, &eng, &err), TD_EIO);
    assert_null(eng);
    assert_non_null(strstr(err.msg, "registration 3 refused"));
    /* Registered 0, 1, 2, the fourth refused, then undone in reverse: 2, 1, 0. */
    const int want[] = {1, 2, 3, 4, -3, -2, -1};
    assert_int_equal(r.n_log, 7);
    for (int i = 0; i < 7; i++) assert_int_equal(r.log[i], want[i]);
    assert_int_equal(r.closes[2], 1);
    assert_int_equal(kvx__railpool_state(p, 2), KVX__RAIL_FAILED);
    /* No second attempt: the error is remembered. */
    assert_int_equal(kvx__railpool_get(p, 2, &eng, &err), TD_EIO);
    assert_non_null(strstr(err.msg, "stays failed until restart"));
    assert_non_null(strstr(err.msg, "registration 3 refused"));
    assert_int_equal(r.opens[2], 1);
    assert_int_equal(r.n_log, 7);
    /* An engine that cannot open: nothing to undo, and the rail stays failed too. */
    assert_int_equal(kvx__railpool_get(p, 3, &eng, &err), TD_EIO);
    assert_int_equal(kvx__railpool_get(p, 3, &eng, &err), TD_EIO);
    assert_int_equal(r.opens[3], 1);
    assert_int_equal(r.closes[3], 0);
    /* The other rails are unaffected. */
    assert_int_equal(kvx__railpool_get(p, 1, &eng, &err), 0);
    kvx__railpool_destroy(p);
    assert_int_equal(r.closes[2], 1); /* not closed twice */
}

static void test_pool_primary_failure(void **state)
{
    (void)state;
    rec r;
    rec_init(&r);
    r.fail_reg_rail = 1;
    r.fail_reg_range = 0;
    kvx_rails rails = four_rails(1);
    kvx__railpool *p = (kvx__railpool *)1;
    td_err err;
    assert_int_equal(kvx__railpool_create(&p, &rails, 2, &rec_ops, &r, &err), TD_EIO);
    assert_null(p);
    assert_non_null(strstr(err.msg, "primary rail tdr1"));
    assert_int_equal(r.closes[1], 1);
    rails.primary = 4;
    assert_int_equal(kvx__railpool_create(&p, &rails, 2, &rec_ops, &r, &err), TD_EINVAL);
}

/* ---------------------------------------------------------------- over loopback rails */

#define N_SEG 4
#define N_BLOCKS 64
#define BLOCK_BYTES 4096
#define STRIDE ((size_t)N_BLOCKS * BLOCK_BYTES)

static const char rail_addrs[4][64] = {"127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"};

static kvx_layout layout(void)
{
    return (kvx_layout){.model_fingerprint = 5, .n_layers = N_SEG, .n_kv_heads = 1,
                        .head_dim = 64, .block_size = 16, .kv_dtype = 1, .tp_size = 1};
}

static kvx_region region(uint8_t *mem)
{
    return (kvx_region){.base = mem, .n_segments = N_SEG, .segment_stride = STRIDE,
                        .block_bytes = BLOCK_BYTES, .n_blocks = N_BLOCKS};
}

static void on_release(void *u, const char *id, const int32_t *b, int n, kvx_release_reason r,
                       void *tu)
{
    (void)u, (void)id, (void)b, (void)n, (void)r, (void)tu;
}

static kvx_agent *agent(uint8_t *mem, const kvx_rails *rails, bool matched)
{
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = region(mem);
    o.release_cb = on_release;
    o.rails = rails;
    o.matched_rails = matched;
    o.rail_addrs = rails ? rail_addrs : NULL;
    kvx_agent *a;
    td_err err;
    int rc = kvx_agent_create(&a, &o, &err);
    if (rc) fprintf(stderr, "agent: %s\n", err.msg);
    assert_int_equal(rc, 0);
    return a;
}

static kvx_client *client_proto(uint8_t *mem, const kvx_rails *rails, bool matched,
                                bool striping, kvx_protocol proto)
{
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = region(mem);
    o.transfer_timeout_ms = 5000;
    o.rails = rails;
    o.matched_rails = matched;
    o.rail_addrs = rails ? rail_addrs : NULL;
    o.rail_striping = striping;
    o.protocol = proto;
    kvx_client *k;
    td_err err;
    assert_int_equal(kvx_client_create(&k, &o, &err), 0);
    return k;
}

static kvx_client *client_striped(uint8_t *mem, const kvx_rails *rails, bool matched,
                                  bool striping)
{
    return client_proto(mem, rails, matched, striping, KVX_PROTO_TCP);
}

static kvx_client *client(uint8_t *mem, const kvx_rails *rails, bool matched)
{
    return client_striped(mem, rails, matched, false);
}

static uint8_t *pool_mem(uint32_t seed)
{
    uint8_t *m = malloc((size_t)N_SEG * STRIDE);
    for (size_t i = 0; i < (size_t)N_SEG * STRIDE; i++) m[i] = (uint8_t)(i * 131 + seed);
    return m;
}

/* Read producer blocks [src, src + n) into consumer blocks [dst, dst + n); the result. */
static int transfer(kvx_agent *a, kvx_client *k, int src, int dst, int n, td_err *res)
{
    int32_t s[N_BLOCKS], d[N_BLOCKS];
    for (int i = 0; i < n; i++) s[i] = src + i, d[i] = dst + i;
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(a, s, n, 0, NULL, tid, &err), 0);
    kvx_read_req rq = {.host = "127.0.0.1", .port = kvx_agent_port(a),
                       .engine_id = kvx_agent_engine_id(a), .transfer_id = tid,
                       .src_blocks = s, .dst_blocks = d, .n_blocks = n};
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    int rc = kvx_xfer_wait(x, res);
    kvx_xfer_free(x);
    kvx_agent_cancel(a, tid);
    return rc;
}

static bool same(const uint8_t *p, const uint8_t *c, int src, int dst, int n)
{
    for (int s = 0; s < N_SEG; s++)
        if (memcmp(c + s * STRIDE + (size_t)dst * BLOCK_BYTES, p + s * STRIDE + (size_t)src * BLOCK_BYTES,
                   (size_t)n * BLOCK_BYTES))
            return false;
    return true;
}

typedef struct consumer_job {
    kvx_agent *a;
    kvx_client *k;
    const uint8_t *pmem;
    uint8_t *cmem;
    int rail, ok;
} consumer_job;

static void *consumer_main(void *arg)
{
    consumer_job *j = arg;
    for (int i = 0; i < 4; i++) {
        td_err res;
        int src = 4 * j->rail + i, dst = 8 * i;
        if (transfer(j->a, j->k, src, dst, 16, &res) == 0 && same(j->pmem, j->cmem, src, dst, 16))
            j->ok++;
    }
    return NULL;
}

static void test_matched_rails_loopback(void **state)
{
    (void)state;
    uint8_t *pmem = pool_mem(1);
    kvx_rails prails = four_rails(1);
    kvx_agent *a = agent(pmem, &prails, true);
    assert_int_equal(kvx_agent_rail_state(a, 1), KVX__RAIL_READY);
    for (int r = 0; r < 4; r++)
        if (r != 1) assert_int_equal(kvx_agent_rail_state(a, r), KVX__RAIL_NONE);

    /* One consumer on rail 3: its transfer runs on the producer's tdr3 engine only. */
    uint8_t *cmem = pool_mem(2);
    kvx_rails c3 = four_rails(3);
    kvx_client *k = client(cmem, &c3, true);
    td_err res;
    assert_int_equal(transfer(a, k, 0, 10, 20, &res), 0);
    assert_true(same(pmem, cmem, 0, 10, 20));
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    assert_int_equal(st.rail_reads[0] + st.rail_reads[1] + st.rail_reads[2], 0);
    assert_true(st.rail_reads[3] >= 1); /* every piece (the count of reads lags the data) */
    assert_int_equal(kvx_agent_rail_state(a, 3), KVX__RAIL_READY);
    assert_int_equal(kvx_agent_rail_state(a, 0), KVX__RAIL_NONE);
    kvx_client_destroy(k);

    /* Four consumers on four rails at once: each keeps its rail. */
    consumer_job jobs[4];
    pthread_t t[4];
    kvx_rails cr[4];
    uint8_t *cm[4];
    uint64_t before[4];
    kvx_agent_get_stats(a, &st);
    for (int r = 0; r < 4; r++) before[r] = st.rail_reads[r];
    for (int r = 0; r < 4; r++) {
        cr[r] = four_rails(r);
        cm[r] = pool_mem(10 + (uint32_t)r);
        jobs[r] = (consumer_job){.a = a, .k = client(cm[r], &cr[r], true), .pmem = pmem,
                                 .cmem = cm[r], .rail = r};
        assert_int_equal(pthread_create(&t[r], NULL, consumer_main, &jobs[r]), 0);
    }
    for (int r = 0; r < 4; r++) {
        pthread_join(t[r], NULL);
        assert_int_equal(jobs[r].ok, 4);
        kvx_client_destroy(jobs[r].k);
        free(cm[r]);
    }
    kvx_agent_get_stats(a, &st);
    for (int r = 0; r < 4; r++) {
        assert_true(st.rail_reads[r] - before[r] >= 4); /* at least one READ per transfer */
        assert_int_equal(kvx_agent_rail_state(a, r), KVX__RAIL_READY);
    }
    kvx_agent_destroy(a);
    free(pmem);
    free(cmem);
}

static void test_rail_refusals(void **state)
{
    (void)state;
    uint8_t *pmem = pool_mem(3), *cmem = pool_mem(4);
    kvx_rails prails = four_rails(0);
    prails.n = 3; /* the producer has tdr0..tdr2 */
    kvx_agent *a = agent(pmem, &prails, true);
    td_err res;

    /* A consumer on a rail the producer does not have: refused, nothing moves. */
    kvx_rails c3 = four_rails(3);
    kvx_client *k = client(cmem, &c3, true);
    assert_int_not_equal(transfer(a, k, 0, 0, 4, &res), 0);
    assert_non_null(strstr(res.msg, "tdr3"));
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    assert_int_equal(st.reads, 0);
    assert_true(st.rails_refused >= 1);
    kvx_client_destroy(k);

    /* A consumer without rails at a producer with rails. */
    k = client(cmem, NULL, false);
    assert_int_not_equal(transfer(a, k, 0, 0, 4, &res), 0);
    assert_non_null(strstr(res.msg, "only on its rails"));
    kvx_client_destroy(k);

    /* A rail whose engine fails to come up stays failed. */
    atomic_store(&kvx__test_rail_fail, 3); /* rail index 2 */
    kvx_rails c2 = four_rails(2);
    k = client(cmem, &c2, true);
    assert_int_not_equal(transfer(a, k, 0, 0, 4, &res), 0);
    assert_non_null(strstr(res.msg, "injected"));
    atomic_store(&kvx__test_rail_fail, 0);
    assert_int_not_equal(transfer(a, k, 0, 0, 4, &res), 0);
    assert_non_null(strstr(res.msg, "stays failed until restart"));
    assert_int_equal(kvx_agent_rail_state(a, 2), KVX__RAIL_FAILED);
    kvx_client_destroy(k);
    /* Another rail still works. */
    kvx_rails c1 = four_rails(1);
    k = client(cmem, &c1, true);
    assert_int_equal(transfer(a, k, 0, 0, 4, &res), 0);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);

    /* A producer without rails, a consumer with them. */
    a = agent(pmem, NULL, false);
    k = client(cmem, &c1, true);
    assert_int_not_equal(transfer(a, k, 0, 0, 4, &res), 0);
    assert_non_null(strstr(res.msg, "no rails"));
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    free(pmem);
    free(cmem);
}

/* One device each, not matched: the consumer is sent to the producer's device. */
static void test_single_device(void **state)
{
    (void)state;
    uint8_t *pmem = pool_mem(5), *cmem = pool_mem(6);
    kvx_rails p1 = four_rails(1), c3 = four_rails(3);
    kvx_agent *a = agent(pmem, &p1, false);
    kvx_client *k = client(cmem, &c3, false);
    td_err res;
    assert_int_equal(transfer(a, k, 5, 9, 7, &res), 0);
    assert_true(same(pmem, cmem, 5, 9, 7));
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    assert_true(st.rail_reads[1] >= 1);
    assert_int_equal(st.rail_reads[0] + st.rail_reads[2] + st.rail_reads[3], 0);
    assert_int_equal(kvx_agent_rail_state(a, 3), KVX__RAIL_NONE);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    free(pmem);
    free(cmem);
}

/*
 * Striping: one 1 MiB transfer is cut into 16 pieces over the four rails; every rail
 * serves some. A rail that is slow (20 ms per read) gets a smaller share; a rail whose
 * engine fails is left out and the transfers still succeed on the others.
 */
static void test_striping(void **state)
{
    (void)state;
    uint8_t *pmem = pool_mem(7), *cmem = pool_mem(8);
    kvx_rails prails = four_rails(0), crails = four_rails(0);
    kvx_agent *a = agent(pmem, &prails, true);
    kvx_client *k = client_striped(cmem, &crails, true, true);
    td_err res;
    kvx_agent_stats st;
    for (int i = 0; i < 4; i++) {
        assert_int_equal(transfer(a, k, 0, 0, N_BLOCKS, &res), 0);
        assert_true(same(pmem, cmem, 0, 0, N_BLOCKS));
    }
    kvx_agent_get_stats(a, &st);
    for (int r = 0; r < 4; r++) assert_true(st.rail_reads[r] >= 1);

    /* Rail 1 slow: after a few transfers it serves less than the others. */
    uint64_t before[4];
    for (int r = 0; r < 4; r++) before[r] = st.rail_reads[r];
    atomic_store(&kvx__test_slow_rail, 2);
    for (int i = 0; i < 12; i++) {
        memset(cmem, 0, (size_t)N_SEG * STRIDE);
        assert_int_equal(transfer(a, k, 0, 0, N_BLOCKS, &res), 0);
        assert_true(same(pmem, cmem, 0, 0, N_BLOCKS));
    }
    atomic_store(&kvx__test_slow_rail, 0);
    kvx_agent_get_stats(a, &st);
    uint64_t slow = st.rail_reads[1] - before[1], others = 0;
    for (int r = 0; r < 4; r++)
        if (r != 1) others += st.rail_reads[r] - before[r];
    fprintf(stderr, "striping with rail tdr1 slow: %llu reads on it, %llu on the other three\n",
            (unsigned long long)slow, (unsigned long long)others);
    assert_true(slow * 3 * 2 < others); /* under half of an even share */
    kvx_client_destroy(k);
    kvx_agent_destroy(a);

    /* Rail 3's engine fails: its pieces go to the others, every transfer succeeds. */
    a = agent(pmem, &prails, true);
    k = client_striped(cmem, &crails, true, true);
    atomic_store(&kvx__test_rail_fail, 4);
    for (int i = 0; i < 4; i++) {
        memset(cmem, 0, (size_t)N_SEG * STRIDE);
        assert_int_equal(transfer(a, k, 0, 0, N_BLOCKS, &res), 0);
        assert_true(same(pmem, cmem, 0, 0, N_BLOCKS));
    }
    atomic_store(&kvx__test_rail_fail, 0);
    kvx_agent_get_stats(a, &st);
    assert_int_equal(st.rail_reads[3], 0);
    assert_int_equal(kvx_agent_rail_state(a, 3), KVX__RAIL_FAILED);
    for (int r = 0; r < 3; r++) assert_true(st.rail_reads[r] >= 1);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    free(pmem);
    free(cmem);
}

#ifdef TD_HAVE_UCX
/* Rails with protocol ucx (over UCX's tcp): the consumer's grants go to the producer's
 * engine of its rail, which made a UCX context of its own for it (here on loopback, so
 * not restricted to a device); every rail's bytes arrive intact, striped or not. */
static void test_ucx_rails(void **state)
{
    (void)state;
    setenv("UCX_TLS", "tcp", 1);
    uint8_t *pmem = pool_mem(9), *cmem = pool_mem(10);
    kvx_rails prails = four_rails(0), c2 = four_rails(2);
    kvx_agent *a = agent(pmem, &prails, true);
    kvx_client *k = client_proto(cmem, &c2, true, false, KVX_PROTO_UCX);
    td_err res;
    int rc = transfer(a, k, 3, 20, 30, &res);
    if (rc) fprintf(stderr, "ucx over rails: %s\n", res.msg);
    assert_int_equal(rc, 0);
    assert_true(same(pmem, cmem, 3, 20, 30));
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    assert_true(st.rail_reads[2] >= 1);
    assert_int_equal(st.rail_reads[0] + st.rail_reads[1] + st.rail_reads[3], 0);
    kvx_client_destroy(k);
    kvx_rails c0 = four_rails(0);
    k = client_proto(cmem, &c0, true, true, KVX_PROTO_UCX); /* striped */
    memset(cmem, 0, (size_t)N_SEG * STRIDE);
    assert_int_equal(transfer(a, k, 0, 0, N_BLOCKS, &res), 0);
    assert_true(same(pmem, cmem, 0, 0, N_BLOCKS));
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    free(pmem);
    free(cmem);
    unsetenv("UCX_TLS");
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_concurrent_first_use),
        cmocka_unit_test(test_pool_rollback_and_stays_failed),
        cmocka_unit_test(test_pool_primary_failure),
        cmocka_unit_test(test_matched_rails_loopback),
        cmocka_unit_test(test_rail_refusals),
        cmocka_unit_test(test_single_device),
        cmocka_unit_test(test_striping),
#ifdef TD_HAVE_UCX
        cmocka_unit_test(test_ucx_rails),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
