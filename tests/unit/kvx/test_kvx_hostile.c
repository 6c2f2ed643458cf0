/*
 * test_kvx_hostile.c - the tcp consumer against a producer that misbehaves: a real agent
 * behind a proxy on loopback that passes the handshake through and then rewrites the
 * agent's answers (duplicates one, swallows one, replaces one by an ERROR or by a header
 * that promises a payload it never sends, sends bytes after one, cuts one short). Every
 * transfer must end
 * at once with a clear error or with the right bytes, never with another transfer's bytes,
 * and the client must stay usable. Also: the pieces of a pipelined group run in deadline
 * order, and a piece that times out sends the others of its group back to the queue.
 */
#include "kvx_fixture.h"
#include "kvx_req.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>

#include "util/td.h"

/* ------------------------------------------------------------------ the proxy */

enum { P_PASS, P_DUP, P_SWALLOW, P_ERROR_EAGAIN, P_HUGE, P_EXTRA_LATE, P_CUT };

#define MAX_LINKS 64

typedef struct proxy {
    int lfd;
    uint16_t port, agent_port;
    pthread_t accept_thread;
    _Atomic int mode, count; /* the next `count` answers get `mode` */
    _Atomic bool stop;
    pthread_mutex_t mu;
    int fds[2 * MAX_LINKS]; /* the live links' sockets (-1: none); under mu */
    int n_links;            /* links not yet freed; under mu */
} proxy;

typedef struct plink {
    proxy *px;
    int cfd, afd;
    _Atomic int refs; /* its two threads; the last one out frees it */
} plink;

static void link_put(plink *l)
{
    if (atomic_fetch_sub(&l->refs, 1) != 1) return;
    proxy *px = l->px;
    pthread_mutex_lock(&px->mu);
    for (int i = 0; i < 2 * MAX_LINKS; i++)
        if (px->fds[i] == l->cfd || px->fds[i] == l->afd) px->fds[i] = -1;
    close(l->cfd);
    close(l->afd);
    px->n_links--;
    pthread_mutex_unlock(&px->mu);
    free(l);
}

static int read_n(int fd, uint8_t *b, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t r = recv(fd, b + got, n - got, 0);
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

static void write_n(int fd, const uint8_t *b, size_t n)
{
    for (size_t off = 0; off < n;) {
        ssize_t r = send(fd, b + off, n - off, MSG_NOSIGNAL);
        if (r <= 0) return;
        off += (size_t)r;
    }
}

static void *to_agent(void *arg)
{
    plink *l = arg;
    uint8_t b[65536];
    for (ssize_t r; (r = recv(l->cfd, b, sizeof(b), 0)) > 0;)
        write_n(l->afd, b, (size_t)r);
    shutdown(l->afd, SHUT_RDWR);
    shutdown(l->cfd, SHUT_RDWR);
    link_put(l);
    return NULL;
}

/* The agent's frames, one whole frame (a DATA frame with its bytes and trailer) at a time;
 * answers after the handshake go through the mode. */
static void *to_client(void *arg)
{
    plink *l = arg;
    size_t cap = 1 << 20;
    uint8_t *f = malloc(cap);
    for (;;) {
        if (read_n(l->afd, f, KVX_HDR_BYTES)) break;
        kvx_hdr h;
        td_err e;
        if (kvx_wire_decode_hdr(f, &h, &e)) break;
        size_t len = KVX_HDR_BYTES + h.payload_len;
        if (len > cap || read_n(l->afd, f + KVX_HDR_BYTES, h.payload_len)) break;
        if (h.type == KVX_MSG_DATA) {
            kvx_msg m;
            if (kvx_wire_decode(&h, f + KVX_HDR_BYTES, h.payload_len, &m, &e)) break;
            size_t more = (size_t)m.u.data.data_len + 4 * (size_t)m.u.data.n_crc;
            if (len + more > cap || read_n(l->afd, f + len, more)) break;
            len += more;
        }
        bool answer = h.type == KVX_MSG_DATA || h.type == KVX_MSG_ERROR || h.type == KVX_MSG_ACK;
        int mode = P_PASS;
        if (answer && atomic_load(&l->px->count) > 0 && atomic_fetch_sub(&l->px->count, 1) > 0)
            mode = atomic_load(&l->px->mode);
        switch (mode) {
        case P_DUP:
            write_n(l->cfd, f, len);
            write_n(l->cfd, f, len);
            break;
        case P_SWALLOW:
            break;
        case P_ERROR_EAGAIN: {
            uint8_t out[256];
            size_t n = kvx_wire_encode_error(out, sizeof(out), h.tag, TD_EAGAIN, "call again");
            write_n(l->cfd, out, n);
            break;
        }
        case P_HUGE: { /* a header that promises 600 bytes of payload, then silence */
            uint32_t pl = 600;
            memcpy(f + 8, &pl, 4);
            write_n(l->cfd, f, KVX_HDR_BYTES);
            while (!atomic_load(&l->px->stop))
                usleep(10 * 1000);
            goto out;
        }
        case P_CUT: /* the answer's first bytes, then the link hangs up */
            write_n(l->cfd, f, KVX_HDR_BYTES / 2);
            goto out;
        case P_EXTRA_LATE: { /* the answer, then a copy of it 50 ms later */
            write_n(l->cfd, f, len);
            usleep(50 * 1000);
            write_n(l->cfd, f, len);
            break;
        }
        default:
            write_n(l->cfd, f, len);
        }
    }
out:
    free(f);
    shutdown(l->cfd, SHUT_RDWR);
    shutdown(l->afd, SHUT_RDWR);
    link_put(l);
    return NULL;
}

static void *accept_main(void *arg)
{
    proxy *px = arg;
    for (;;) {
        int cfd = accept(px->lfd, NULL, NULL);
        if (cfd < 0 || atomic_load(&px->stop)) {
            if (cfd >= 0) close(cfd);
            return NULL;
        }
        int afd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons(px->agent_port),
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        if (connect(afd, (struct sockaddr *)&sa, sizeof(sa))) {
            close(cfd);
            close(afd);
            continue;
        }
        plink *l = malloc(sizeof(*l));
        *l = (plink){px, cfd, afd, 2};
        pthread_mutex_lock(&px->mu);
        px->n_links++;
        for (int i = 0, put = 0; i < 2 * MAX_LINKS && put < 2; i++)
            if (px->fds[i] < 0) px->fds[i] = put++ ? afd : cfd;
        pthread_mutex_unlock(&px->mu);
        pthread_t a, b;
        pthread_create(&a, NULL, to_agent, l);
        pthread_create(&b, NULL, to_client, l);
        pthread_detach(a);
        pthread_detach(b);
    }
}

static void proxy_start(proxy *px, uint16_t agent_port)
{
    memset(px, 0, sizeof(*px));
    pthread_mutex_init(&px->mu, NULL);
    for (int i = 0; i < 2 * MAX_LINKS; i++)
        px->fds[i] = -1;
    px->agent_port = agent_port;
    px->lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(px->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(px->lfd, 64), 0);
    assert_int_equal(getsockname(px->lfd, (struct sockaddr *)&sa, &sl), 0);
    px->port = ntohs(sa.sin_port);
    pthread_create(&px->accept_thread, NULL, accept_main, px);
}

/* Stop accepting, hang up every link, and wait until their threads are gone (they use px). */
static void proxy_stop(proxy *px)
{
    atomic_store(&px->stop, true);
    shutdown(px->lfd, SHUT_RDWR);
    pthread_join(px->accept_thread, NULL);
    close(px->lfd);
    for (;;) {
        pthread_mutex_lock(&px->mu);
        for (int i = 0; i < 2 * MAX_LINKS; i++)
            if (px->fds[i] >= 0) shutdown(px->fds[i], SHUT_RDWR);
        int left = px->n_links;
        pthread_mutex_unlock(&px->mu);
        if (left == 0) break;
        usleep(2000);
    }
    pthread_mutex_destroy(&px->mu);
}

static void proxy_mode(proxy *px, int mode, int count)
{
    atomic_store(&px->mode, mode);
    atomic_store(&px->count, count);
}

/* ------------------------------------------------------------------ helpers */

typedef struct xf {
    int32_t src[2], dst[2];
    char tid[KVX_ID_HEX];
    kvx_xfer *x;
} xf;

/* n one-piece transfers of 2 blocks each (distinct sources and destinations), started with
 * will_wait through the proxy; then a wait for the first groups them all. */
static void start_group(fixture *f, kvx_client *c, proxy *px, xf *t, int n, int base)
{
    td_err err;
    for (int i = 0; i < n; i++) {
        t[i].src[0] = base + 4 * i;
        t[i].src[1] = base + 4 * i + 1;
        t[i].dst[0] = 2 * i;
        t[i].dst[1] = 2 * i + 1;
        assert_int_equal(kvx_agent_register(f->agent, t[i].src, 2, 0, NULL, t[i].tid, &err), 0);
        kvx_read_req rq = req_for(f->agent, t[i].tid, t[i].src, t[i].dst, 2, 0);
        rq.port = px->port;
        rq.will_wait = true;
        assert_int_equal(kvx_read_start(c, &rq, &t[i].x, &err), 0);
    }
}

/* Each transfer of the group ends with its own bytes or an error; returns how many failed. */
static int end_group(fixture *f, xf *t, int n)
{
    int failed = 0;
    for (int i = 0; i < n; i++) {
        td_err res;
        int rc = kvx_xfer_wait(t[i].x, &res);
        if (rc == 0)
            assert_true(blocks_copied(f, t[i].src, t[i].dst, 2));
        else
            failed++;
        kvx_xfer_free(t[i].x);
        kvx_agent_cancel(f->agent, t[i].tid);
    }
    return failed;
}

static void clear_dst(fixture *f)
{
    memset(f->cons.mem, 0, (size_t)N_SEG * STRIDE);
}

/* A single transfer through the proxy; returns its code, *secs its duration. */
static int one(fixture *f, kvx_client *c, proxy *px, int32_t src, int32_t dst, double *secs,
               td_err *res)
{
    td_err err;
    char tid[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, &src, 1, 0, NULL, tid, &err), 0);
    kvx_read_req rq = req_for(f->agent, tid, &src, &dst, 1, 0);
    rq.port = px->port;
    kvx_xfer *x;
    uint64_t t0 = td_now_ns();
    assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
    int rc = kvx_xfer_wait(x, res);
    if (secs) *secs = (double)(td_now_ns() - t0) * 1e-9;
    kvx_xfer_free(x);
    if (rc == 0) assert_true(blocks_copied(f, &src, &dst, 1));
    kvx_agent_cancel(f->agent, tid);
    return rc;
}

/* ------------------------------------------------------------------ tests */

/* An answer sent twice (DATA or ERROR), or an answer swallowed, inside a group of four: no
 * transfer of the group takes another's bytes or error (every READ carries its own tag);
 * the pieces behind the stray answer are sent again, once, on another connection, and
 * arrive whole; a producer that
 * keeps sending stray answers fails them the second time, by their deadline at the latest;
 * and the client goes on. */
static void test_group_answers_out_of_step(void **state)
{
    fixture *f = *state;
    proxy px;
    proxy_start(&px, kvx_agent_port(f->agent));
    kvx_client *c = client_with(f, 1, 1, 2000);
    xf t[4];
    td_err res;
    /* warm up: the one connection exists and is reused below */
    assert_int_equal(one(f, c, &px, 200, 100, NULL, &res), 0);

    clear_dst(f);
    proxy_mode(&px, P_DUP, 1);
    int resent0 = atomic_load(&kvx__test_pieces_resent);
    start_group(f, c, &px, t, 4, 0);
    assert_int_equal(end_group(f, t, 4), 0); /* the first whole, the rest sent again */
    assert_int_equal(atomic_load(&kvx__test_pieces_resent) - resent0, 3);

    /* an ERROR sent twice (the first transfer's lease is gone): the copy is a stray answer
     * to the second READ, whatever its code says, and the pieces behind it go again */
    clear_dst(f);
    proxy_mode(&px, P_DUP, 1);
    resent0 = atomic_load(&kvx__test_pieces_resent);
    start_group(f, c, &px, t, 4, 60);
    kvx_agent_cancel(f->agent, t[0].tid);
    td_err r0;
    assert_int_equal(kvx_xfer_wait(t[0].x, &r0), TD_ENOTFOUND);
    assert_int_equal(end_group(f, t, 4), 1);
    assert_int_equal(atomic_load(&kvx__test_pieces_resent) - resent0, 3);

    /* every answer sent twice: every piece is sent again at most once, and all end */
    clear_dst(f);
    proxy_mode(&px, P_DUP, 1000);
    uint64_t t0 = td_now_ns();
    resent0 = atomic_load(&kvx__test_pieces_resent);
    start_group(f, c, &px, t, 4, 20);
    end_group(f, t, 4); /* whatever failed, failed; what arrived is whole */
    assert_true(td_now_ns() - t0 < 3000000000ull);
    assert_true(atomic_load(&kvx__test_pieces_resent) - resent0 <= 3);
    proxy_mode(&px, P_PASS, 0);

    /* The first answer swallowed: the second answer arrives first, is no answer to the
     * first READ, and the group is sent again on a fresh connection, where all is well. */
    clear_dst(f);
    assert_int_equal(one(f, c, &px, 201, 101, NULL, &res), 0);
    proxy_mode(&px, P_SWALLOW, 1);
    start_group(f, c, &px, t, 4, 40);
    assert_int_equal(end_group(f, t, 4), 0);

    /* still usable */
    assert_int_equal(one(f, c, &px, 202, 102, NULL, &res), 0);
    kvx_client_destroy(c);
    proxy_stop(&px);
}

/* A producer's ERROR with the code that means "call again" here ends the transfer at once
 * as a protocol error: it must not leave it running forever. */
static void test_error_code_eagain(void **state)
{
    fixture *f = *state;
    proxy px;
    proxy_start(&px, kvx_agent_port(f->agent));
    kvx_client *c = client_with(f, 1, 1, 2000);
    td_err res;
    double secs;
    proxy_mode(&px, P_ERROR_EAGAIN, 1);
    assert_int_equal(one(f, c, &px, 203, 103, &secs, &res), TD_EPROTO);
    assert_non_null(strstr(res.msg, "call again"));
    assert_true(secs < 1.0);
    /* in a group, likewise */
    xf t[3];
    assert_int_equal(one(f, c, &px, 204, 104, NULL, &res), 0);
    proxy_mode(&px, P_ERROR_EAGAIN, 1);
    start_group(f, c, &px, t, 3, 80);
    uint64_t t0 = td_now_ns();
    td_err r0;
    assert_int_equal(kvx_xfer_wait(t[0].x, &r0), TD_EPROTO);
    assert_true((double)(td_now_ns() - t0) * 1e-9 < 1.0);
    assert_int_equal(end_group(f, t, 3), 1);
    kvx_client_destroy(c);
    proxy_stop(&px);
}

/* A header that promises more payload than any answer to a READ has fails at once, on a
 * fresh connection, rather than waiting for that payload until the deadline. */
static void test_oversized_answer_header(void **state)
{
    fixture *f = *state;
    proxy px;
    proxy_start(&px, kvx_agent_port(f->agent));
    kvx_client *c = client_with(f, 1, 1, 3000);
    td_err res;
    double secs;
    proxy_mode(&px, P_HUGE, 1);
    assert_int_equal(one(f, c, &px, 205, 105, &secs, &res), TD_EFORMAT);
    assert_true(secs < 1.0);
    assert_int_equal(one(f, c, &px, 206, 106, NULL, &res), 0);
    kvx_client_destroy(c);
    proxy_stop(&px);
}

/* A copy of a RELEASE's answer arriving after it sits on the idle connection; the next
 * request on that connection sees an answer that is not its own and is sent again on a
 * fresh connection, and succeeds. */
static void test_late_stray_answer(void **state)
{
    fixture *f = *state;
    proxy px;
    proxy_start(&px, kvx_agent_port(f->agent));
    kvx_client *c = client_with(f, 1, 1, 2000);
    td_err err, res;
    int32_t src = 207, dst = 107;
    char tid[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, &src, 1, 0, NULL, tid, &err), 0);
    kvx_read_req rq = req_for(f->agent, tid, &src, &dst, 1, 0);
    rq.port = px.port;
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x);
    proxy_mode(&px, P_EXTRA_LATE, 1);
    assert_int_equal(kvx_release(c, "127.0.0.1", px.port, kvx_agent_engine_id(f->agent), tid, &err),
                     0);
    usleep(150 * 1000); /* the stray copy has arrived */
    assert_int_equal(one(f, c, &px, 208, 108, NULL, &res), 0);
    char tid2[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, &src, 1, 0, NULL, tid2, &err), 0);
    proxy_mode(&px, P_EXTRA_LATE, 1);
    assert_int_equal(
        kvx_heartbeat(c, "127.0.0.1", px.port, kvx_agent_engine_id(f->agent), tid2, &err), 0);
    usleep(150 * 1000);
    assert_int_equal(
        kvx_heartbeat(c, "127.0.0.1", px.port, kvx_agent_engine_id(f->agent), tid2, &err), 0);
    kvx_agent_cancel(f->agent, tid2);
    kvx_client_destroy(c);
    proxy_stop(&px);
}

/* Two will_wait transfers, Y (5 s) and X (100 ms), grouped by the wait for Y while every
 * answer takes 600 ms: X runs first (deadline order) and ends by its own deadline, not
 * behind Y's answer; its timeout sends Y back to the queue, and Y arrives whole. */
static void test_group_deadline_order(void **state)
{
    fixture *f = *state;
    kvx_client *c = client_with(f, 1, 2, 5000);
    td_err err, res;
    int32_t ys[2] = {220, 221}, yd[2] = {120, 121}, xs[2] = {222, 223}, xd[2] = {122, 123};
    char ty[KVX_ID_HEX], tx[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, ys, 2, 0, NULL, ty, &err), 0);
    assert_int_equal(kvx_agent_register(f->agent, xs, 2, 0, NULL, tx, &err), 0);
    usleep(100 * 1000); /* the worker sleeps */
    atomic_store(&kvx__test_send_delay_ms, 600);
    kvx_read_req ry = req_for(f->agent, ty, ys, yd, 2, 5000);
    ry.will_wait = true;
    kvx_read_req rx = req_for(f->agent, tx, xs, xd, 2, 100);
    rx.will_wait = true;
    kvx_xfer *y, *x;
    uint64_t t0 = td_now_ns();
    assert_int_equal(kvx_read_start(c, &ry, &y, &err), 0);
    assert_int_equal(kvx_read_start(c, &rx, &x, &err), 0);
    int grouped0 = atomic_load(&kvx__test_pieces_grouped);
    assert_int_equal(kvx_xfer_wait(y, &res), 0);
    assert_true(blocks_copied(f, ys, yd, 2));
    assert_int_equal(atomic_load(&kvx__test_pieces_grouped) - grouped0, 2);
    assert_int_equal(kvx_xfer_wait(x, &res), TD_ETIMEDOUT);
    kvx_xfer_info xi;
    kvx_xfer_get_info(x, &xi);
    assert_true(xi.seconds < 0.4); /* by its deadline, not after Y's 600 ms answer */
    assert_true((double)(td_now_ns() - t0) * 1e-9 < 4.0);
    atomic_store(&kvx__test_send_delay_ms, 0);
    kvx_xfer_free(y);
    kvx_xfer_free(x);
    kvx_agent_cancel(f->agent, ty);
    kvx_agent_cancel(f->agent, tx);
    kvx_client_destroy(c);
}

/* A RELEASE whose answer breaks off after it began took effect at the producer: it is not
 * sent again (a second RELEASE finds its lease gone and says "not found"), and it ends with
 * the broken connection's error. */
static void test_release_answer_cut(void **state)
{
    fixture *f = *state;
    proxy px;
    proxy_start(&px, kvx_agent_port(f->agent));
    kvx_client *c = client_with(f, 1, 1, 2000);
    td_err err, res;
    int32_t src = 209, dst = 109;
    char tid[KVX_ID_HEX];
    assert_int_equal(kvx_agent_register(f->agent, &src, 1, 0, NULL, tid, &err), 0);
    kvx_read_req rq = req_for(f->agent, tid, &src, &dst, 1, 0);
    rq.port = px.port;
    kvx_xfer *x;
    assert_int_equal(kvx_read_start(c, &rq, &x, &err), 0);
    assert_int_equal(kvx_xfer_wait(x, &res), 0);
    kvx_xfer_free(x); /* its connection stays open, and the RELEASE reuses it */
    const char *eng = kvx_agent_engine_id(f->agent);
    proxy_mode(&px, P_CUT, 1);
    assert_int_equal(kvx_release(c, "127.0.0.1", px.port, eng, tid, &err), TD_ECONN);
    assert_int_equal(kvx_agent_n_leases(f->agent), 0); /* released, once */
    assert_int_equal(kvx_release(c, "127.0.0.1", px.port, eng, tid, &err), TD_ENOTFOUND);
    assert_int_equal(one(f, c, &px, 210, 110, NULL, &res), 0); /* still usable */
    kvx_client_destroy(c);
    proxy_stop(&px);
}

/*
 * Held pieces of two producers, released together when their caller waits for a third
 * transfer: each gets a worker of its own, so the piece of a healthy producer does not wait
 * behind the piece of a producer that never answers its handshake (one wake-up for both
 * made it wait out that producer's deadline).
 */
static void test_released_pieces_of_two_producers(void **state)
{
    fixture *f = *state;
    proxy px; /* the healthy producer again, under another address: another session */
    proxy_start(&px, kvx_agent_port(f->agent));
    int mute = socket(AF_INET, SOCK_STREAM, 0); /* listens, never accepts or answers */
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(mute, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(mute, 8), 0);
    assert_int_equal(getsockname(mute, (struct sockaddr *)&sa, &sl), 0);
    kvx_client *c = client_with(f, 2, 1, 3000);
    usleep(100 * 1000); /* the workers sleep */
    td_err err, res;
    int32_t src[3] = {230, 231, 232}, dst[3] = {130, 131, 132};
    char tid[3][KVX_ID_HEX];
    kvx_xfer *x[3];
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvx_agent_register(f->agent, &src[i], 1, 0, NULL, tid[i], &err), 0);
        kvx_read_req rq = req_for(f->agent, tid[i], &src[i], &dst[i], 1, 0);
        if (i == 0) rq.port = ntohs(sa.sin_port); /* A: the mute producer, first in line */
        if (i == 1) rq.port = px.port;            /* B: the healthy one through the proxy */
        rq.will_wait = true;
        assert_int_equal(kvx_read_start(c, &rq, &x[i], &err), 0);
    }
    assert_int_equal(kvx_xfer_wait(x[2], &res), 0); /* W, direct: releases A and B */
    uint64_t t0 = td_now_ns();
    while (kvx_xfer_poll(x[1], &res) == TD_EAGAIN && td_now_ns() - t0 < 2000000000ull)
        usleep(2000);
    assert_int_equal(kvx_xfer_poll(x[1], &res), 0);
    assert_true(td_now_ns() - t0 < 1000000000ull); /* not after A's 3 s deadline */
    assert_true(blocks_copied(f, &src[1], &dst[1], 1));
    assert_int_equal(kvx_xfer_poll(x[0], &res), TD_EAGAIN); /* A still waits for its answer */
    assert_int_not_equal(kvx_xfer_wait(x[0], &res), 0);
    for (int i = 0; i < 3; i++) {
        kvx_xfer_free(x[i]);
        kvx_agent_cancel(f->agent, tid[i]);
    }
    kvx_client_destroy(c);
    close(mute);
    proxy_stop(&px);
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_group_answers_out_of_step),
        T(test_error_code_eagain),
        T(test_oversized_answer_header),
        T(test_late_stray_answer),
        T(test_group_deadline_order),
        T(test_release_answer_cut),
        T(test_released_pieces_of_two_producers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
