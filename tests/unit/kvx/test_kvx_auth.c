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

static kvx_agent *agent(side *p, const char *token)
{
    kvx_agent_opts o;
    kvx_agent_opts_default(&o);
    o.layout = layout();
    o.region = p->region;
    o.release_cb = on_release;
    o.auth_token = token;
    kvx_agent *a;
    td_err err;
    assert_int_equal(kvx_agent_create(&a, &o, &err), 0);
    return a;
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
        {"token-a", NULL, "requires authentication", NULL},
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_token_reads),
        cmocka_unit_test(test_mismatches_are_refused),
        cmocka_unit_test(test_skipping_auth_reads_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
