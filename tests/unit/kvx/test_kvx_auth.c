/*
 * kvx session authentication over real loopback sockets: the same token on both sides
 * reads; a wrong token, a token on one side only, or a raw peer that skips AUTH is
 * refused with a clear error on both sides, and reads nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>

#include "kvx/kvx.h"
#include "kvx/kvx_internal.h"

#define N_SEG 4
#define N_BLOCKS 32
#define BLOCK_BYTES 1024
#define STRIDE (N_BLOCKS * BLOCK_BYTES)

typedef struct side {
    uint8_t *mem;
    kvx_region region;
} side;

static void side_init(side *s, int fill)
{
    s->mem = malloc((size_t)N_SEG * STRIDE);
    for (size_t i = 0; i < (size_t)N_SEG * STRIDE; i++) s->mem[i] = fill ? (uint8_t)(i * 7 + 3) : 0;
    s->region = (kvx_region){.base = s->mem, .n_segments = N_SEG, .segment_stride = STRIDE,
                             .block_bytes = BLOCK_BYTES, .n_blocks = N_BLOCKS};
}

static kvx_layout layout(void)
{
    return (kvx_layout){.model_fingerprint = 7, .n_layers = N_SEG, .n_kv_heads = 1,
                        .head_dim = 8, .block_size = 16, .kv_dtype = 1, .tp_size = 1};
}

static void on_release(void *u, const char *id, const int32_t *b, int n, kvx_release_reason r,
                       void *tu)
{
    (void)u, (void)id, (void)b, (void)n, (void)r, (void)tu;
}

/* An agent over p's blocks; max_connections 0: the default. */
static kvx_agent *agent_with(side *p, const char *token, int max_connections)
{
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = p->region;
    o.release_cb = on_release;
    o.auth_token = token;
    if (max_connections) o.max_connections = max_connections;
    kvx_agent *a;
    td_err err;
    assert_int_equal(kvx_agent_create(&a, &o, &err), 0);
    return a;
}

static kvx_agent *agent(side *p, const char *token)
{
    return agent_with(p, token, 0);
}

static kvx_client *client(side *c, const char *token)
{
    kvx_client_opts o;
    kvx_client_opts_default(&o);
    o.layout = layout();
    o.region = c->region;
    o.transfer_timeout_ms = 3000;
    o.auth_token = token;
    kvx_client *k;
    td_err err;
    assert_int_equal(kvx_client_create(&k, &o, &err), 0);
    return k;
}

/* Register blocks 0..3 on the producer and read them into 4..7; returns the code. */
static int read_once(kvx_agent *a, kvx_client *c, td_err *res)
{
    int32_t src[4] = {0, 1, 2, 3}, dst[4] = {4, 5, 6, 7};
    char tid[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(a, src, 4, 0, NULL, tid, &err), 0);
    kvx_read_req rq = {.host = "127.0.0.1", .port = kvx_agent_port(a),
                       .engine_id = kvx_agent_engine_id(a), .transfer_id = tid,
                       .src_blocks = src, .dst_blocks = dst, .n_blocks = 4};
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
    int rc = kvx_xfer_wait(x, res);
    kvx_xfer_free(x);
    kvx_agent_cancel(a, tid);
    return rc;
}

static bool received(side *p, side *c)
{
    for (int s = 0; s < N_SEG; s++)
        if (memcmp(c->mem + (size_t)s * STRIDE + 4 * BLOCK_BYTES, p->mem + (size_t)s * STRIDE,
                   4 * BLOCK_BYTES))
            return false;
    return true;
}

static bool untouched(side *c)
{
    for (size_t i = 0; i < (size_t)N_SEG * STRIDE; i++)
        if (c->mem[i]) return false;
    return true;
}

static void test_same_token_reads(void **state)
{
    (void)state;
    side p, c;
    side_init(&p, 1);
    side_init(&c, 0);
    kvx_agent *a = agent(&p, "correct horse battery staple");
    kvx_client *k = client(&c, "correct horse battery staple");
    td_err res = {0};
    assert_int_equal(read_once(a, k, &res), 0);
    assert_true(received(&p, &c));
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    assert_int_equal(st.handshakes_refused, 0);
    kvx_client_destroy(k);
    kvx_agent_destroy(a);
    free(p.mem);
    free(c.mem);
}

typedef struct mismatch {
    const char *producer, *consumer;
    const char *consumer_says, *producer_says; /* producer_says NULL: nothing to report */
} mismatch;

static void test_mismatches_are_refused(void **state)
{
    (void)state;
    const mismatch cases[] = {
        {"token-a", "token-b", "kvx auth failed", "does not know the token"},
        {"token-a", NULL, "requires authentication", "requires authentication"},
        {NULL, "token-b", "has no auth_token", "has no auth_token"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        side p, c;
        side_init(&p, 1);
        side_init(&c, 0);
        kvx_agent *a = agent(&p, cases[i].producer);
        kvx_client *k = client(&c, cases[i].consumer);
        td_err res = {0};
        int rc = read_once(a, k, &res);
        assert_int_equal(rc, TD_EPROTO);
        if (!strstr(res.msg, cases[i].consumer_says))
            fail_msg("case %zu: consumer error '%s' lacks '%s'", i, res.msg, cases[i].consumer_says);
        assert_true(untouched(&c));
        kvx_agent_stats st;
        kvx_agent_get_stats(a, &st);
        assert_int_equal(st.bytes_sent, 0);
        if (cases[i].producer_says) {
            /* A consumer without a token hangs up with an ERROR of its own; the producer
             * may read it a moment after the consumer's read has failed. */
            for (int ms = 0; ms < 3000; ms += 10) {
                kvx_agent_get_stats(a, &st);
                if (st.handshakes_refused >= 1) break;
                usleep(10000);
            }
            char last[320];
            kvx_agent_last_error(a, last, sizeof(last));
            if (!strstr(last, cases[i].producer_says))
                fail_msg("case %zu: producer error '%s' lacks '%s'", i, last, cases[i].producer_says);
            assert_true(st.handshakes_refused >= 1);
        }
        kvx_client_destroy(k);
        kvx_agent_destroy(a);
        free(p.mem);
        free(c.mem);
    }
}

/* A raw peer that says HELLO and then READs a real transfer id without AUTH. */
static void test_skipping_auth_reads_nothing(void **state)
{
    (void)state;
    side p;
    side_init(&p, 1);
    kvx_agent *a = agent(&p, "secret");
    int32_t src[2] = {0, 1};
    char tid_hex[KVX_ID_HEX];
    td_err err;
    assert_int_equal(kvx_agent_register(a, src, 2, 0, NULL, tid_hex, &err), 0);
    int fd;
    uint64_t dl = td_now_ns() + 3000000000ull;
    assert_int_equal(kvx__connect("127.0.0.1", kvx_agent_port(a), dl, &fd, &err), 0);
    kvx_hello h;
    uint8_t id[KVX_ID_BYTES] = {1, 2, 3};
    kvx_layout l = layout();
    kvx__hello_fill(&h, id, &l, &p.region);
    static uint8_t buf[KVX_HDR_BYTES + KVX_MAX_PAYLOAD];
    size_t n = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO, 1, &h);
    assert_int_equal(kvx__send_all(fd, buf, n, dl, &err), 0);
    kvx_msg m;
    assert_int_equal(kvx__recv_frame(fd, buf, sizeof(buf), &m, dl, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_HELLO_ACK);
    assert_true(m.u.hello.features & KVX_ACK_FEAT_AUTH);
    uint8_t tid[KVX_ID_BYTES];
    assert_int_equal(kvx_id_from_hex(tid_hex, tid), 0);
    kvx_wire_desc d = {.segment = 0, .block = 0, .n_blocks = 2};
    n = kvx_wire_encode_read(buf, sizeof(buf), 2, tid, 0, &d, 1);
    assert_true(n > 0);
    assert_int_equal(kvx__send_all(fd, buf, n, dl, &err), 0);
    assert_int_equal(kvx__recv_frame(fd, buf, sizeof(buf), &m, dl, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_ERROR);
    assert_non_null(strstr(m.u.error.msg, "requires authentication"));
    /* ... and the producer hung up. */
    char c;
    assert_int_equal(kvx__recv_all(fd, &c, 1, dl, &err), TD_ECONN);
    close(fd);
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    assert_int_equal(st.bytes_sent, 0);
    assert_int_equal(st.reads, 0);
    assert_int_equal(kvx_agent_n_leases(a), 1); /* the lease is untouched */
    kvx_agent_destroy(a);
    free(p.mem);
}

/* ---- raw peers: a test socket that speaks the handshake frame by frame ---- */

#define RAW_DEADLINE_NS 3000000000ull
static uint8_t raw_buf[KVX_HDR_BYTES + KVX_MAX_PAYLOAD];

/* Connect to the agent and say HELLO as consumer `id` with nonce nc; returns the fd and
 * the HELLO_ACK. */
static int raw_hello(kvx_agent *a, side *p, const uint8_t id[KVX_ID_BYTES],
                     const uint8_t nc[KVX_ID_BYTES], kvx_hello *ack)
{
    int fd;
    td_err err;
    uint64_t dl = td_now_ns() + RAW_DEADLINE_NS;
    assert_int_equal(kvx__connect("127.0.0.1", kvx_agent_port(a), dl, &fd, &err), 0);
    kvx_hello h;
    kvx_layout l = layout();
    kvx__hello_fill(&h, id, &l, &p->region);
    memcpy(h.nonce, nc, KVX_ID_BYTES);
    size_t n = kvx_wire_encode_hello(raw_buf, sizeof(raw_buf), KVX_MSG_HELLO, 1, &h);
    assert_int_equal(kvx__send_all(fd, raw_buf, n, dl, &err), 0);
    kvx_msg m;
    assert_int_equal(kvx__recv_frame(fd, raw_buf, sizeof(raw_buf), &m, dl, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_HELLO_ACK);
    *ack = m.u.hello;
    return fd;
}

static void raw_send(int fd, const uint8_t *frame, size_t n)
{
    td_err err;
    assert_true(n > 0);
    assert_int_equal(kvx__send_all(fd, frame, n, td_now_ns() + RAW_DEADLINE_NS, &err), 0);
}

/* A thread's job: close fd once ms have passed. */
typedef struct delayed_close {
    int fd, ms;
} delayed_close;

static void *close_later(void *arg)
{
    const delayed_close *d = arg;
    usleep((useconds_t)d->ms * 1000);
    close(d->fd);
    return NULL;
}

static int raw_last_code; /* the code of the last refusal */

/* Expect an ERROR containing `says`, then the producer's hang-up. */

static void raw_expect_refusal(int fd, const char *says)
{
    td_err err;
    kvx_msg m;
    uint64_t dl = td_now_ns() + RAW_DEADLINE_NS;
    assert_int_equal(kvx__recv_frame(fd, raw_buf, sizeof(raw_buf), &m, dl, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_ERROR);
    raw_last_code = m.u.error.code;
    if (!strstr(m.u.error.msg, says)) fail_msg("ERROR '%s' lacks '%s'", m.u.error.msg, says);
    char c;
    assert_int_equal(kvx__recv_all(fd, &c, 1, dl, &err), TD_ECONN);
}

static uint64_t refused(kvx_agent *a)
{
    kvx_agent_stats st;
    kvx_agent_get_stats(a, &st);
    return st.handshakes_refused;
}

/* The proof of one connection does not open another: each binds both nonces. */
static void test_replayed_proof_is_refused(void **state)
{
    (void)state;
    side p;
    side_init(&p, 1);
    kvx_agent *a = agent(&p, "secret");
    uint8_t id_c[KVX_ID_BYTES] = {9, 8, 7}, nc[KVX_ID_BYTES] = {1, 1, 2, 3, 5, 8};
    uint8_t engine[KVX_ID_BYTES];
    assert_int_equal(kvx_id_from_hex(kvx_agent_engine_id(a), engine), 0);

    /* A consumer that knows the token: the producer answers with its own valid proof. */
    kvx_hello ack;
    int fd = raw_hello(a, &p, id_c, nc, &ack);
    assert_true(ack.features & KVX_ACK_FEAT_AUTH);
    uint8_t mac[KVX_AUTH_MAC_BYTES], want[KVX_AUTH_MAC_BYTES];
    kvx__auth_mac("secret", false, nc, ack.nonce, id_c, engine, mac);
    raw_send(fd, raw_buf, kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 2, mac));
    kvx_msg m;
    td_err err;
    assert_int_equal(
        kvx__recv_frame(fd, raw_buf, sizeof(raw_buf), &m, td_now_ns() + RAW_DEADLINE_NS, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_AUTH);
    kvx__auth_mac("secret", true, nc, ack.nonce, id_c, engine, want);
    assert_true(kvx__auth_equal(want, m.u.auth.mac));
    /* ... which is not the consumer's proof sent back (the labels differ). */
    assert_false(kvx__auth_equal(mac, m.u.auth.mac));
    /* A second AUTH on an authenticated connection is a protocol error. */
    raw_send(fd, raw_buf, kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 3, mac));
    raw_expect_refusal(fd, "second AUTH");
    close(fd);
    assert_int_equal(refused(a), 0);

    /* The same HELLO and the recorded proof on a new connection: the producer's nonce is
     * fresh, so the proof is wrong. */
    kvx_hello ack2;
    fd = raw_hello(a, &p, id_c, nc, &ack2);
    assert_memory_not_equal(ack.nonce, ack2.nonce, KVX_ID_BYTES);
    raw_send(fd, raw_buf, kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 2, mac));
    raw_expect_refusal(fd, "does not know the token");
    close(fd);
    assert_int_equal(refused(a), 1);
    char last[320];
    kvx_agent_last_error(a, last, sizeof(last));
    assert_non_null(strstr(last, "kvx auth failed: consumer 090807"));
    kvx_agent_destroy(a);
    free(p.mem);
}

/* Bad input around the handshake: each is refused with ERROR and a hang-up, never served. */
static void test_bad_handshake_frames(void **state)
{
    (void)state;
    side p;
    side_init(&p, 1);
    kvx_agent *a = agent(&p, "secret");
    uint8_t id_c[KVX_ID_BYTES] = {4}, nc[KVX_ID_BYTES] = {5}, mac[KVX_AUTH_MAC_BYTES] = {0};
    td_err err;
    kvx_hello ack;

    /* AUTH before HELLO. */
    int fd;
    assert_int_equal(
        kvx__connect("127.0.0.1", kvx_agent_port(a), td_now_ns() + RAW_DEADLINE_NS, &fd, &err), 0);
    raw_send(fd, raw_buf, kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 1, mac));
    raw_expect_refusal(fd, "expected HELLO first");
    close(fd);

    /* An AUTH frame one byte short (a 31-byte MAC): a format error, counted as a refusal. */
    fd = raw_hello(a, &p, id_c, nc, &ack);
    size_t n = kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 2, mac);
    raw_buf[8] = 31; /* payload length */
    raw_send(fd, raw_buf, n - 1);
    raw_expect_refusal(fd, "AUTH");
    close(fd);
    assert_int_equal(refused(a), 1);

    /* A zero MAC. */
    fd = raw_hello(a, &p, id_c, nc, &ack);
    raw_send(fd, raw_buf, kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 2, mac));
    raw_expect_refusal(fd, "does not know the token");
    close(fd);
    assert_int_equal(refused(a), 2);

    /* HEARTBEAT and RELEASE instead of AUTH, even with a real transfer id. */
    int32_t src[1] = {3};
    char tid_hex[KVX_ID_HEX];
    uint8_t tid[KVX_ID_BYTES];
    assert_int_equal(kvx_agent_register(a, src, 1, 0, NULL, tid_hex, &err), 0);
    assert_int_equal(kvx_id_from_hex(tid_hex, tid), 0);
    fd = raw_hello(a, &p, id_c, nc, &ack);
    raw_send(fd, raw_buf, kvx_wire_encode_heartbeat(raw_buf, sizeof(raw_buf), 2, tid, 1));
    raw_expect_refusal(fd, "requires authentication");
    close(fd);
    fd = raw_hello(a, &p, id_c, nc, &ack);
    raw_send(fd, raw_buf, kvx_wire_encode_release(raw_buf, sizeof(raw_buf), 2, tid));
    raw_expect_refusal(fd, "requires authentication");
    close(fd);
    assert_int_equal(kvx_agent_n_leases(a), 1); /* RELEASE did nothing */
    assert_int_equal(refused(a), 4);

    /* A peer that says HELLO and hangs up without AUTH is counted and named too. */
    fd = raw_hello(a, &p, id_c, nc, &ack);
    close(fd);
    for (int ms = 0; ms < 3000 && refused(a) < 5; ms += 10)
        usleep(10000);
    assert_int_equal(refused(a), 5);
    char last[320];
    kvx_agent_last_error(a, last, sizeof(last));
    assert_non_null(strstr(last, "hung up before authenticating"));

    /* A second HELLO is answered and hung up on, authenticated or not. */
    fd = raw_hello(a, &p, id_c, nc, &ack);
    uint8_t engine[KVX_ID_BYTES];
    assert_int_equal(kvx_id_from_hex(kvx_agent_engine_id(a), engine), 0);
    kvx__auth_mac("secret", false, nc, ack.nonce, id_c, engine, mac);
    raw_send(fd, raw_buf, kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 2, mac));
    kvx_msg m;
    assert_int_equal(
        kvx__recv_frame(fd, raw_buf, sizeof(raw_buf), &m, td_now_ns() + RAW_DEADLINE_NS, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_AUTH);
    kvx_hello h;
    kvx_layout l = layout();
    kvx__hello_fill(&h, id_c, &l, &p.region);
    raw_send(fd, raw_buf, kvx_wire_encode_hello(raw_buf, sizeof(raw_buf), KVX_MSG_HELLO, 3, &h));
    raw_expect_refusal(fd, "second HELLO");
    close(fd);

    /* A producer that serves no transport reading its pool directly (no shm, no UCX) pins
     * nothing for a grant. */
    fd = raw_hello(a, &p, id_c, nc, &ack);
    kvx__auth_mac("secret", false, nc, ack.nonce, id_c, engine, mac);
    raw_send(fd, raw_buf, kvx_wire_encode_auth(raw_buf, sizeof(raw_buf), 2, mac));
    assert_int_equal(
        kvx__recv_frame(fd, raw_buf, sizeof(raw_buf), &m, td_now_ns() + RAW_DEADLINE_NS, &err), 0);
    kvx_wire_desc d = {0, 3, 1};
    n = kvx_wire_encode_read(raw_buf, sizeof(raw_buf), 4, tid, KVX_READ_CHECKSUMS, &d, 1);
    raw_buf[6] = KVX_MSG_UCX_GRANT; /* a READ's payload under the grant's type */
    raw_send(fd, raw_buf, n);
    assert_int_equal(
        kvx__recv_frame(fd, raw_buf, sizeof(raw_buf), &m, td_now_ns() + RAW_DEADLINE_NS, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_ERROR);
    assert_non_null(strstr(m.u.error.msg, "use READ"));
    close(fd);
    kvx_agent_destroy(a);
    free(p.mem);
}

/* Connections that have not proved themselves are limited (half the table, a quarter
 * from one address): a flood of them is turned away with an ERROR saying why (TD_EBUSY),
 * and a consumer refused meanwhile tries again a little later, within its deadline, and
 * gets in once a slot frees. */
static void test_unauthenticated_flood_is_bounded(void **state)
{
    (void)state;
    side p;
    side_init(&p, 1);
    kvx_agent *a = agent_with(&p, "secret", 16); /* 8 unproved at most, 4 from one address */
    td_err err;
    int fds[4];
    for (int i = 0; i < 4; i++) /* connected, silent */
        assert_int_equal(kvx__connect("127.0.0.1", kvx_agent_port(a), td_now_ns() + RAW_DEADLINE_NS,
                                      &fds[i], &err),
                         0);
    usleep(100000); /* accepted */
    int fd;
    assert_int_equal(
        kvx__connect("127.0.0.1", kvx_agent_port(a), td_now_ns() + RAW_DEADLINE_NS, &fd, &err), 0);
    raw_expect_refusal(fd, "too many connections from this address are still authenticating");
    assert_int_equal(raw_last_code, TD_EBUSY);
    close(fd);
    /* a consumer that knows the token is refused while the flood lasts, and gets in once a
     * slot frees (300 ms on), with no retry of its caller's */
    side c;
    side_init(&c, 2);
    kvx_client *cl = client(&c, "secret");
    pthread_t closer;
    delayed_close dc = {fds[0], 300};
    pthread_create(&closer, NULL, close_later, &dc);
    int retries0 = atomic_load(&kvx__test_busy_retries);
    uint64_t t0 = td_now_ns();
    assert_int_equal(
        kvx_session_check(cl, "127.0.0.1", kvx_agent_port(a), kvx_agent_engine_id(a), &err), 0);
    assert_true(td_now_ns() - t0 >= 250000000ull);
    assert_true(atomic_load(&kvx__test_busy_retries) > retries0);
    pthread_join(closer, NULL);
    /* a flood that outlasts the deadline: the check ends then, saying why (the first
     * client is gone first: its AUTH may still be unproved at the agent when the check
     * returns, and would count against the flood) */
    kvx_client_destroy(cl);
    usleep(100000);
    int more[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(kvx__connect("127.0.0.1", kvx_agent_port(a), td_now_ns() + RAW_DEADLINE_NS,
                                      &more[i], &err),
                         0);
    usleep(100000);
    cl = client(&c, "secret");
    t0 = td_now_ns();
    assert_int_equal(
        kvx_session_check(cl, "127.0.0.1", kvx_agent_port(a), kvx_agent_engine_id(a), &err),
        TD_EBUSY);
    assert_non_null(strstr(err.msg, "still authenticating"));
    assert_true(td_now_ns() - t0 < 4000000000ull); /* the client's 3 s deadline */
    for (int i = 0; i < 2; i++)
        close(more[i]);
    for (int i = 1; i < 4; i++)
        close(fds[i]);
    kvx_client_destroy(cl);
    kvx_agent_destroy(a);
    free(p.mem);
    free(c.mem);
}

/*
 * A producer at its connection limit (two, both held by silent peers) refuses with
 * TD_EBUSY, and:
 *  - a HEARTBEAT is not retried (one thread sends every producer's control messages): it
 *    fails at once;
 *  - a push cancelled while it retries ends at once, not at its deadline;
 *  - in a group of two reads (deadlines 150 ms and 3 s), the first gives up at its own
 *    deadline with the refusal's message, and the second goes back to the queue rather
 *    than failing with it, and arrives whole once a slot frees (500 ms on).
 */
static void test_connection_limit(void **state)
{
    (void)state;
    side p, c;
    side_init(&p, 1);
    side_init(&c, 0);
    kvx_agent *a = agent_with(&p, NULL, 2);
    td_err err;
    int fds[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(kvx__connect("127.0.0.1", kvx_agent_port(a), td_now_ns() + RAW_DEADLINE_NS,
                                      &fds[i], &err),
                         0);
    usleep(100000); /* accepted: the table is full */
    kvx_client *cl = client(&c, NULL);
    const char *eng = kvx_agent_engine_id(a);
    static const char tid0[] = "0123456789abcdef0123456789abcdef";

    uint64_t t0 = td_now_ns();
    assert_int_equal(kvx_heartbeat(cl, "127.0.0.1", kvx_agent_port(a), eng, tid0, &err), TD_EBUSY);
    assert_non_null(strstr(err.msg, "connection limit"));
    assert_true(td_now_ns() - t0 < 500000000ull);

    int32_t dst[4] = {4, 5, 6, 7};
    kvx_write_req wq = {.host = "127.0.0.1",
                        .port = kvx_agent_port(a),
                        .engine_id = eng,
                        .transfer_id = tid0,
                        .dst_blocks = dst,
                        .n_blocks = 4,
                        .timeout_ms = 3000};
    kvx_xfer *w;
    assert_int_equal(kvx_write_start(cl, &wq, &w, &err), 0);
    usleep(100000); /* retrying */
    t0 = td_now_ns();
    assert_int_equal(kvx_client_cancel(cl, tid0), 0);
    assert_int_equal(kvx_xfer_wait(w, &err), TD_ECANCELED);
    assert_true(td_now_ns() - t0 < 500000000ull);
    kvx_xfer_free(w);

    int32_t src[2][2] = {{0, 1}, {2, 3}}, dd[2][2] = {{4, 5}, {6, 7}};
    uint32_t timeout[2] = {150, 3000};
    char tid[2][KVX_ID_HEX];
    kvx_xfer *x[2];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(kvx_agent_register(a, src[i], 2, 0, NULL, tid[i], &err), 0);
        kvx_read_req rq = {.host = "127.0.0.1",
                           .port = kvx_agent_port(a),
                           .engine_id = eng,
                           .transfer_id = tid[i],
                           .src_blocks = src[i],
                           .dst_blocks = dd[i],
                           .n_blocks = 2,
                           .timeout_ms = timeout[i],
                           .will_wait = true};
        assert_int_equal(kvx_read_start(cl, &rq, &x[i], &err), 0);
    }
    pthread_t closer;
    delayed_close dc = {fds[1], 500};
    pthread_create(&closer, NULL, close_later, &dc);
    int grouped0 = atomic_load(&kvx__test_pieces_grouped);
    assert_int_equal(kvx_xfer_wait(x[1], &err), 0); /* runs both, x[0] first */
    assert_int_equal(atomic_load(&kvx__test_pieces_grouped) - grouped0, 2);
    for (int sg = 0; sg < N_SEG; sg++) /* producer blocks 2, 3 in consumer blocks 6, 7 */
        assert_memory_equal(c.mem + (size_t)sg * STRIDE + 6 * BLOCK_BYTES,
                            p.mem + (size_t)sg * STRIDE + 2 * BLOCK_BYTES, 2 * BLOCK_BYTES);
    td_err e0;
    assert_int_equal(kvx_xfer_wait(x[0], &e0), TD_EBUSY);
    assert_non_null(strstr(e0.msg, "until the transfer's deadline"));
    pthread_join(closer, NULL);
    for (int i = 0; i < 2; i++) {
        kvx_xfer_free(x[i]);
        kvx_agent_cancel(a, tid[i]);
    }
    kvx_client_destroy(cl);
    close(fds[0]);
    kvx_agent_destroy(a);
    free(p.mem);
    free(c.mem);
}

/* The MAC covers the role, both nonces and both engine ids, under the token. */
static void test_mac_binds_everything(void **state)
{
    (void)state;
    uint8_t v[4][KVX_ID_BYTES], base[KVX_AUTH_MAC_BYTES], other[KVX_AUTH_MAC_BYTES];
    for (int i = 0; i < 4; i++)
        memset(v[i], 0x10 * (i + 1), KVX_ID_BYTES);
    kvx__auth_mac("k", false, v[0], v[1], v[2], v[3], base);
    kvx__auth_mac("k", false, v[0], v[1], v[2], v[3], other);
    assert_true(kvx__auth_equal(base, other)); /* deterministic */
    kvx__auth_mac("k", true, v[0], v[1], v[2], v[3], other);
    assert_false(kvx__auth_equal(base, other));
    kvx__auth_mac("K", false, v[0], v[1], v[2], v[3], other);
    assert_false(kvx__auth_equal(base, other));
    kvx__auth_mac("k", false, v[1], v[0], v[2], v[3], other); /* nonces swapped */
    assert_false(kvx__auth_equal(base, other));
    kvx__auth_mac("k", false, v[0], v[1], v[3], v[2], other); /* ids swapped */
    assert_false(kvx__auth_equal(base, other));
    for (int i = 0; i < 4; i++) { /* one bit of any input */
        uint8_t w[4][KVX_ID_BYTES];
        memcpy(w, v, sizeof(w));
        w[i][15] ^= 1;
        kvx__auth_mac("k", false, w[0], w[1], w[2], w[3], other);
        assert_false(kvx__auth_equal(base, other));
    }
}

/* ---- an impostor producer: it greets like an agent but does not know the token ---- */

typedef struct impostor {
    int listen_fd;
    uint16_t port;
    uint8_t engine_id[KVX_ID_BYTES];
    _Atomic int stop;
    _Atomic int auths; /* AUTH frames received */
} impostor;

static void *impostor_main(void *arg)
{
    impostor *f = arg;
    static uint8_t buf[KVX_HDR_BYTES + KVX_MAX_PAYLOAD];
    while (!f->stop) {
        struct pollfd pf = {.fd = f->listen_fd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0) continue;
        int fd = accept(f->listen_fd, NULL, NULL);
        if (fd < 0) continue;
        td_err err;
        kvx_msg m;
        uint64_t dl = td_now_ns() + RAW_DEADLINE_NS;
        if (!kvx__recv_frame(fd, buf, sizeof(buf), &m, dl, &err) && m.hdr.type == KVX_MSG_HELLO) {
            kvx_hello ack = m.u.hello;
            uint8_t nc[KVX_ID_BYTES], id_c[KVX_ID_BYTES];
            memcpy(nc, m.u.hello.nonce, KVX_ID_BYTES);
            memcpy(id_c, m.u.hello.engine_id, KVX_ID_BYTES);
            memcpy(ack.engine_id, f->engine_id, KVX_ID_BYTES);
            memset(ack.expect_engine_id, 0, KVX_ID_BYTES);
            memset(ack.nonce, 0x42, KVX_ID_BYTES);
            ack.features = KVX_ACK_FEAT_AUTH;
            size_t n = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO_ACK, m.hdr.tag, &ack);
            if (!kvx__send_all(fd, buf, n, dl, &err) &&
                !kvx__recv_frame(fd, buf, sizeof(buf), &m, dl, &err) &&
                m.hdr.type == KVX_MSG_AUTH) {
                f->auths++;
                uint8_t mac[KVX_AUTH_MAC_BYTES];
                kvx__auth_mac("a guess", true, nc, ack.nonce, id_c, f->engine_id, mac);
                n = kvx_wire_encode_auth(buf, sizeof(buf), m.hdr.tag, mac);
                if (!kvx__send_all(fd, buf, n, dl, &err)) {
                    char c;
                    kvx__recv_all(fd, &c, 1, dl, &err); /* until the consumer hangs up */
                }
            }
        }
        close(fd);
    }
    return NULL;
}

/* Mutual: a consumer refuses a producer that cannot prove the token, and reads nothing. */
static void test_impostor_producer_is_refused(void **state)
{
    (void)state;
    impostor f = {0};
    f.listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(f.listen_fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(f.listen_fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(f.listen_fd, 8), 0);
    assert_int_equal(getsockname(f.listen_fd, (struct sockaddr *)&sa, &sl), 0);
    f.port = ntohs(sa.sin_port);
    assert_int_equal(kvx__random_id(f.engine_id), 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, impostor_main, &f), 0);

    side c;
    side_init(&c, 0);
    kvx_client *k = client(&c, "secret");
    char engine_hex[KVX_ID_HEX], tid[KVX_ID_HEX];
    uint8_t tid_raw[KVX_ID_BYTES];
    kvx_id_to_hex(f.engine_id, engine_hex);
    assert_int_equal(kvx__random_id(tid_raw), 0);
    kvx_id_to_hex(tid_raw, tid);
    int32_t src[4] = {0, 1, 2, 3}, dst[4] = {4, 5, 6, 7};
    kvx_read_req rq = {.host = "127.0.0.1", .port = f.port, .engine_id = engine_hex,
                       .transfer_id = tid, .src_blocks = src, .dst_blocks = dst, .n_blocks = 4};
    kvx_xfer *x;
    td_err err, res = {0};
    assert_int_equal(kvx_read_start(k, &rq, &x, &err), 0);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_EPROTO);
    kvx_xfer_free(x);
    if (!strstr(res.msg, "kvx auth failed: producer 127.0.0.1") ||
        !strstr(res.msg, "does not know the token"))
        fail_msg("consumer error '%s'", res.msg);
    assert_true(f.auths >= 1);
    assert_true(untouched(&c));
    kvx_client_destroy(k);
    f.stop = 1;
    pthread_join(t, NULL);
    close(f.listen_fd);
    free(c.mem);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_token_reads),
        cmocka_unit_test(test_mismatches_are_refused),
        cmocka_unit_test(test_skipping_auth_reads_nothing),
        cmocka_unit_test(test_replayed_proof_is_refused),
        cmocka_unit_test(test_bad_handshake_frames),
        cmocka_unit_test(test_unauthenticated_flood_is_bounded),
        cmocka_unit_test(test_connection_limit),
        cmocka_unit_test(test_mac_binds_everything),
        cmocka_unit_test(test_impostor_producer_is_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
