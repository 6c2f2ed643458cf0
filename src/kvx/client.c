/*
 * kvx/client.c - the consumer side: the session cache, transfers cut into pieces, and
 * the worker threads that run them.
 *
 * A session is one producer incarnation (host, port, engine id) and a pool of at most
 * qp_per_transfer connections to it, each greeted by its own HELLO. A transfer's block
 * runs are cut into pieces (kvx_piece_count: up to qp_per_transfer of equal size, at least
 * 512 KiB where the transfer allows, at most 8 MiB), queued FIFO; every worker takes the next piece of any transfer and moves it on
 * a free connection of that transfer's session. So one transfer uses several connections
 * at once, and independent transfers proceed side by side.
 *
 * A transfer completes when its last piece finishes; the first failing piece decides its
 * error, and its remaining pieces are skipped. Every wait is bounded by the transfer's
 * deadline. A connection that saw any I/O error or timeout is closed, never reused.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

#define MAX_PIECE_BYTES KVX__MAX_PIECE_BYTES
#define BATCH_BYTES (256u << 10) /* bytes received between checksum passes */
#define BOUNCE_KEEP 8            /* group receive buffers a client keeps for reuse */
/* Pipelined groups (group_take): at most PIPE_MAX pieces of at most PIPE_PIECE_BYTES each,
 * PIPE_BYTES in all. */
#define PIPE_MAX 8
#define PIPE_PIECE_BYTES (128u << 10)
#define PIPE_BYTES (1u << 20)

typedef struct kvx__session {
    struct kvx_client *client;
    char host[256];
    uint16_t port;
    /* A rail's data session (rail >= 0: the index of this consumer's rail): connections go
     * from that rail to the producer's endpoint for it, learned with RAIL on first use
     * (data_port 0 until then, under mu). rail -1: the handshake address itself. */
    int rail;
    char data_host[KVX_MAX_RAIL + 1];
    uint16_t data_port;
    /* Striping, under client->mu: this rail's measured throughput (bytes per ns, EWMA; 0
     * until measured), the bytes of pieces running on it, and until when it is left out
     * after a failure. */
    double rate;
    uint64_t inflight, down_until_ns, rated_ns;
    uint8_t engine_id[KVX_ID_BYTES];
    char engine_hex[KVX_ID_HEX];
    int refs;              /* under client->mu: the cache's and each user's */
    _Atomic bool replaced; /* a newer incarnation took this address */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int *idle;
    int n_idle, n_open, max_open;
    void *transport_state; /* a transport other than tcp keeps its connections here */
    struct kvx__session *next;
} kvx__session;

typedef struct piece_desc {
    uint32_t seg, src, dst, n;
} piece_desc;

typedef struct kvx__piece {
    struct kvx_xfer *x;
    uint32_t tag;          /* tcp: its READ's tag, unique in the client (next_tag) */
    uint32_t first, count; /* descriptors x->pd[first .. first + count) */
    uint64_t bytes, blocks;
    struct kvx__piece *next;
    int tries;   /* striping: rails this piece failed on */
    bool resent; /* tcp: sent again once after its group's connection went out of step */
} kvx__piece;

struct kvx_xfer {
    struct kvx_client *c;
    kvx__session *s;
    uint8_t transfer_id[KVX_ID_BYTES];
    piece_desc *pd;
    uint32_t n_pd;
    kvx__piece *pieces;
    int n_pieces, pending;
    /* Striping: the data session of every rail (NULL where not used), rail index order. */
    bool stripe;
    struct kvx__session *rs[KVX_MAX_RAILS];
    uint64_t start_ns, deadline_ns;
    int code;
    td_err result;
    bool done, detached;
    bool held; /* will_wait: one piece was queued without a worker signalled for it */
    kvx_done_fn cb;
    void *user;
    kvx_xfer_info info;
    /* A push transfer (kvx_write_start): its thread, the reads it started and not yet
     * finished, the first of their errors, the producer's note. Under client->mu. */
    bool push;
    int32_t *dst;
    int n_blocks, skip;
    uint32_t timeout_ms;
    int fd; /* the push connection, -1 when none (kvx_client_destroy shuts it down) */
    bool cancelled; /* kvx_client_cancel: a push ends with TD_ECANCELED */
    int outstanding, sub_code;
    td_err sub_err;
    struct kvx__session *ds; /* a push's data session when reads go over a rail, else NULL */
    uint8_t note[KVX_MAX_NOTE];
    uint32_t note_len;
    uint64_t done_ns; /* when PUSH_DONE arrived */
    struct kvx_xfer *next_push;
};

struct kvx_client {
    kvx_client_opts opts;
    kvx_hello hello;
    const kvx__transport *transport;
    void *transport_state; /* the ucx transport's context and registration */
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    pthread_cond_t watch_cv; /* CLOCK_MONOTONIC; wakes the watchdog */
    uint64_t watch_next;     /* when the watchdog plans to wake (UINT64_MAX: not planned) */
    kvx__piece *qhead, *qtail;
    _Atomic uint32_t next_tag; /* tcp: the tag of the next request (never 0) */
    int n_waiting; /* workers waiting for a piece (under mu) */
    int n_wake_pending; /* of those, woken and not yet back from the wait (under mu) */
    int wake_debt; /* queued pieces held back for callers that will wait (under mu) */
    bool stopping;
    pthread_t watchdog;
    bool has_watchdog;
    pthread_t *workers;
    int n_workers;
    kvx__session *sessions;
    char token[256]; /* auth_token ("" = none), wiped at destroy */
    struct kvx_xfer *pushes; /* push transfers whose thread runs */
    kvx_rails rails;          /* n == 0: no rails */
    bool striping;            /* opts.rail_striping with matched rails */
    char rail_addr[KVX_MAX_RAILS][64]; /* each rail's local address ("" = not resolved) */
    bool rail_addr_given;     /* opts.rail_addrs: no device binding */
    void *rail_ucx[KVX_MAX_RAILS]; /* protocol ucx: each used rail's UCX context (its own
                                      registration of the region), else NULL */
    /* Receive buffers of pipelined groups (bounce_get), kept for reuse; under mu. */
    struct {
        uint8_t *buf;
        size_t cap;
    } spare_bounce[BOUNCE_KEEP];
    int n_spare_bounce;
};

static const kvx__transport tcp_transport;

/* The rail this consumer's transfers use (its primary), or -1 without rails. */
static int data_rail(const kvx_client *c)
{
    return c->rails.n > 0 ? c->rails.primary : -1;
}

void kvx_client_opts_default(kvx_client_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->num_worker_threads = 4;
    o->qp_per_transfer = 4;
    o->transfer_timeout_ms = 30000;
    o->verify_checksums = true;
}

/* ---------------------------------------------------------------- sessions */

static void session_free(kvx__session *s)
{
    if (s->transport_state && s->client->transport->session_free)
        s->client->transport->session_free(s->transport_state);
    for (int i = 0; i < s->n_idle; i++)
        close(s->idle[i]);
    free(s->idle);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

static void session_put(kvx__session *s)
{
    kvx_client *c = s->client;
    pthread_mutex_lock(&c->mu);
    bool last = --s->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) session_free(s);
}

/*
 * The session for (host, port, engine id), created if needed. A cached session for the
 * same address but another engine id belongs to a dead incarnation: it is dropped.
 */
static int session_get(kvx_client *c, const char *host, uint16_t port, const char *engine_hex,
                       int rail, kvx__session **out, td_err *err)
{
    uint8_t id[KVX_ID_BYTES];
    if (!host || strlen(host) >= sizeof(((kvx__session *)0)->host))
        return td_err_set(err, TD_EINVAL, "kvx: bad producer host");
    if (kvx_id_from_hex(engine_hex, id))
        return td_err_set(err, TD_EINVAL, "kvx: engine id must be 32 hex digits");
    kvx__session *drop = NULL;
    pthread_mutex_lock(&c->mu);
    for (kvx__session **pp = &c->sessions; *pp; pp = &(*pp)->next) {
        kvx__session *s = *pp;
        if (s->port != port || strcmp(s->host, host) || s->rail != rail) continue;
        if (!memcmp(s->engine_id, id, KVX_ID_BYTES)) {
            s->refs++;
            pthread_mutex_unlock(&c->mu);
            *out = s;
            return 0;
        }
        *pp = s->next;
        atomic_store(&s->replaced, true);
        if (--s->refs == 0) drop = s;
        break;
    }
    kvx__session *s = calloc(1, sizeof(*s));
    int *idle = calloc((size_t)c->opts.qp_per_transfer, sizeof(int));
    if (!s || !idle) {
        pthread_mutex_unlock(&c->mu);
        free(s);
        free(idle);
        if (drop) session_free(drop);
        return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    }
    s->client = c;
    snprintf(s->host, sizeof(s->host), "%s", host);
    s->port = port;
    s->rail = rail;
    memcpy(s->engine_id, id, KVX_ID_BYTES);
    kvx_id_to_hex(id, s->engine_hex);
    s->refs = 2;
    s->idle = idle;
    s->max_open = c->opts.qp_per_transfer;
    pthread_mutex_init(&s->mu, NULL);
    kvx__cond_init_monotonic(&s->cv);
    s->next = c->sessions;
    c->sessions = s;
    pthread_mutex_unlock(&c->mu);
    if (drop) session_free(drop);
    *out = s;
    return 0;
}

int kvx_client_n_sessions(kvx_client *c)
{
    int n = 0;
    pthread_mutex_lock(&c->mu);
    for (kvx__session *s = c->sessions; s; s = s->next)
        n++;
    pthread_mutex_unlock(&c->mu);
    return n;
}

/* The challenge-response after HELLO_ACK (kvx_auth.c): prove we know the token, and
 * check the producer's proof. A token on one side only is an error on both. */
static int authenticate(kvx__session *s, int fd, const uint8_t nc[KVX_ID_BYTES],
                        const kvx_hello *ack, uint64_t deadline_ns, td_err *err)
{
    kvx_client *c = s->client;
    bool required = ack->features & KVX_ACK_FEAT_AUTH;
    if (!c->token[0]) {
        if (!required) return 0;
        TD_WARN("kvx: producer %s:%u requires authentication; this consumer has no auth_token",
                s->host, s->port);
        /* Tell the producer why we hang up, so its log names the cause too (best effort). */
        uint8_t buf[320];
        size_t n = kvx_wire_encode_error(buf, sizeof(buf), 2, TD_EPROTO,
                                         "kvx auth: this consumer has no auth_token");
        td_err ignored;
        kvx__send_all(fd, buf, n, deadline_ns, &ignored);
        return td_err_set(err, TD_EPROTO,
                          "kvx auth: producer %s:%u requires authentication; set the same "
                          "auth_token (or TANDEM_KV_TOKEN) on this consumer",
                          s->host, s->port);
    }
    uint8_t mac[KVX_AUTH_MAC_BYTES], buf[512];
    kvx__auth_mac(c->token, false, nc, ack->nonce, c->hello.engine_id, ack->engine_id, mac);
    size_t n = kvx_wire_encode_auth(buf, sizeof(buf), 2, mac);
    kvx_msg m;
    int rc = kvx__send_all(fd, buf, n, deadline_ns, err);
    if (!rc) rc = kvx__recv_frame(fd, buf, sizeof(buf), &m, deadline_ns, err);
    if (rc) return rc;
    if (m.hdr.type == KVX_MSG_ERROR)
        return td_err_set(err, TD_EPROTO, "kvx: producer %s:%u: %s", s->host, s->port,
                          m.u.error.msg);
    if (m.hdr.type != KVX_MSG_AUTH)
        return td_err_set(err, TD_EPROTO, "kvx: producer %s:%u answered AUTH with %s", s->host,
                          s->port, kvx_wire_type_name(m.hdr.type));
    kvx__auth_mac(c->token, true, nc, ack->nonce, c->hello.engine_id, ack->engine_id, mac);
    if (!kvx__auth_equal(mac, m.u.auth.mac)) {
        TD_WARN("kvx: producer %s:%u failed authentication", s->host, s->port);
        return td_err_set(err, TD_EPROTO,
                          "kvx auth failed: producer %s:%u does not know the token", s->host,
                          s->port);
    }
    return 0;
}

/* Greet a fresh connection: our HELLO, then the producer's HELLO_ACK or its refusal. */
static int handshake(kvx__session *s, int fd, const char *rail, uint64_t deadline_ns, td_err *err)
{
    kvx_client *c = s->client;
    kvx_hello h = c->hello;
    memcpy(h.expect_engine_id, s->engine_id, KVX_ID_BYTES);
    snprintf(h.rail, sizeof(h.rail), "%s", rail);
    h.features = c->opts.verify_checksums ? KVX_FEAT_CHECKSUMS : 0;
    if (kvx__random_id(h.nonce)) return td_err_set(err, TD_EIO, "kvx: getrandom failed");
    uint8_t buf[512];
    size_t n = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO, 1, &h);
    int rc = kvx__send_all(fd, buf, n, deadline_ns, err);
    kvx_msg m;
    if (!rc) rc = kvx__recv_frame(fd, buf, sizeof(buf), &m, deadline_ns, err);
    if (rc) return rc;
    if (m.hdr.type == KVX_MSG_ERROR)
        return td_err_set(err, m.u.error.code, "kvx: producer %s:%u: %s", s->host, s->port,
                          m.u.error.msg);
    if (m.hdr.type != KVX_MSG_HELLO_ACK)
        return td_err_set(err, TD_EPROTO, "kvx: producer %s:%u answered HELLO with %s", s->host,
                          s->port, kvx_wire_type_name(m.hdr.type));
    if (memcmp(m.u.hello.engine_id, s->engine_id, KVX_ID_BYTES)) {
        char got[KVX_ID_HEX];
        kvx_id_to_hex(m.u.hello.engine_id, got);
        return td_err_set(err, TD_ECONN, "kvx: producer %s:%u is engine %s, not %s (it restarted)",
                          s->host, s->port, got, s->engine_hex);
    }
    td_err e;
    if ((rc = kvx__hello_compare(&c->hello, &m.u.hello, &e))) {
        TD_WARN("kvx: refusing producer %s:%u: %s", s->host, s->port, e.msg);
        return td_err_set(err, rc, "kvx: producer %s:%u: %s", s->host, s->port, e.msg);
    }
    return authenticate(s, fd, h.nonce, &m.u.hello, deadline_ns, err);
}

/*
 * Whether a handshake the producer refused for now (TD_EBUSY: at its connection limit, or
 * too many connections still authenticating) is tried again: after a pause of *pause_ms
 * (doubling up to 200 ms, and at most until the deadline), unless the deadline has passed,
 * the client is shutting down, or x (the transfer the connection is for, where known) was
 * cancelled or failed. A producer's overload then delays a transfer rather than failing it
 * (its request would recompute the prompt).
 */
static bool busy_retry(kvx_client *c, const struct kvx_xfer *x, int rc, uint32_t *pause_ms,
                       uint64_t deadline_ns)
{
    if (rc != TD_EBUSY) return false;
    uint64_t now = td_now_ns();
    if (now >= deadline_ns) return false;
    pthread_mutex_lock(&c->mu);
    bool stop = c->stopping || (x && (x->cancelled || x->code));
    pthread_mutex_unlock(&c->mu);
    if (stop) return false;
    uint64_t pause = TD_MIN((uint64_t)*pause_ms * 1000000ull, deadline_ns - now);
    struct timespec ts = {(time_t)(pause / 1000000000ull), (long)(pause % 1000000000ull)};
    nanosleep(&ts, NULL);
    *pause_ms = TD_MIN(*pause_ms * 2, 200u);
    atomic_fetch_add(&kvx__test_busy_retries, 1);
    return true;
}

static int session_dial(kvx__session *s, uint64_t deadline_ns, int *fd, td_err *err);

/*
 * A connection greeted by the producer: dialled (`control`: to the handshake address, else
 * session_dial's), then HELLO (and AUTH) on it. With `retry`, refusals for now are tried
 * again (busy_retry; x as there): a transfer's connections. Control messages (RELEASE,
 * HEARTBEAT) are not: one thread sends them all, and one busy producer would hold up every
 * other producer's heartbeats. A refusal that lasts until the deadline ends with the
 * refusal's message, not the timeout's.
 */
static int connect_greeted(kvx__session *s, bool control, bool retry, const struct kvx_xfer *x,
                           uint64_t deadline_ns, int *fd, td_err *err)
{
    int rc;
    uint32_t pause_ms = 10;
    bool refused = false;
    td_err why;
    for (;;) {
        rc = control ? kvx__connect(s->host, s->port, deadline_ns, fd, err)
                     : session_dial(s, deadline_ns, fd, err);
        if (!rc) {
            rc = handshake(s, *fd, !control && s->rail >= 0 ? s->client->rails.name[s->rail] : "",
                           deadline_ns, err);
            if (rc) close(*fd);
        }
        if (rc == TD_EBUSY) {
            refused = true;
            why = *err;
        } else if (rc == TD_ETIMEDOUT && refused) {
            return td_err_set(err, TD_EBUSY, "%s, until the transfer's deadline", why.msg);
        }
        if (!retry || !busy_retry(s->client, x, rc, &pause_ms, deadline_ns)) return rc;
    }
}

/*
 * Where the producer serves our rail: ask over a connection to its handshake address
 * (RAIL; matched rails name ours, a single device asks for the producer's own). Refusals
 * (no such rail, a failed rail, no rails there) end the transfer: no other rail is tried.
 */
static int rail_resolve(kvx__session *s, uint64_t deadline_ns, char *host, uint16_t *port,
                        td_err *err)
{
    kvx_client *c = s->client;
    int fd;
    /* a control connection; a refusal goes up to session_dial's caller, which retries */
    int rc = connect_greeted(s, true, false, NULL, deadline_ns, &fd, err);
    if (rc) return rc;
    int rail = s->rail;
    uint8_t buf[512];
    kvx_msg m;
    size_t n =
        kvx_wire_encode_rail(buf, sizeof(buf), 1, c->opts.matched_rails ? c->rails.name[rail] : "");
    rc = kvx__send_all(fd, buf, n, deadline_ns, err);
    if (!rc) rc = kvx__recv_frame(fd, buf, sizeof(buf), &m, deadline_ns, err);
    close(fd);
    if (rc) return rc;
    if (m.hdr.type == KVX_MSG_ERROR)
        return td_err_set(err, m.u.error.code ? m.u.error.code : TD_EPROTO,
                          "kvx: producer %s:%u refused rail %s: %s", s->host, s->port,
                          c->rails.name[rail], m.u.error.msg);
    if (m.hdr.type != KVX_MSG_RAIL_ACK)
        return td_err_set(err, TD_EPROTO, "kvx: producer %s:%u answered RAIL with %s", s->host,
                          s->port, kvx_wire_type_name(m.hdr.type));
    if (c->opts.matched_rails && strcmp(m.u.rail.name, c->rails.name[rail]))
        return td_err_set(err, TD_EPROTO,
                          "kvx: producer %s:%u offered rail %s for rail %s (matched rails pair "
                          "rails of the same name only)",
                          s->host, s->port, m.u.rail.name, c->rails.name[rail]);
    snprintf(host, KVX_MAX_RAIL + 1, "%s", m.u.rail.addr);
    *port = m.u.rail.port;
    return 0;
}

/* A new connection of a session: to the handshake address, or over our rail. */
static int session_dial(kvx__session *s, uint64_t deadline_ns, int *fd, td_err *err)
{
    if (s->rail < 0) return kvx__connect(s->host, s->port, deadline_ns, fd, err);
    kvx_client *c = s->client;
    pthread_mutex_lock(&s->mu);
    char host[KVX_MAX_RAIL + 1];
    snprintf(host, sizeof(host), "%s", s->data_host);
    uint16_t port = s->data_port;
    pthread_mutex_unlock(&s->mu);
    if (!port) {
        int rc = rail_resolve(s, deadline_ns, host, &port, err);
        if (rc) return rc;
        pthread_mutex_lock(&s->mu);
        snprintf(s->data_host, sizeof(s->data_host), "%s", host);
        s->data_port = port;
        pthread_mutex_unlock(&s->mu);
    }
    if (c->rails.kind == KVX_RAIL_RDMA) /* control over the control network, data over UCX */
        return kvx__connect(host, port, deadline_ns, fd, err);
    return kvx__connect_from(host, port, c->rail_addr[s->rail],
                             c->rail_addr_given ? NULL : c->rails.name[s->rail], deadline_ns, fd,
                             err);
}

/*
 * A connection to the session's producer: an idle one, a new one (*fresh), or wait for one.
 * An idle connection is checked (`check`: readable means the producer hung up) only where
 * the caller has no retry: requests retry once on a fresh connection when a reused one
 * turns out dead (conn_drop_stale), which saves the check's system call on every request.
 */
static int conn_get(kvx__session *s, const struct kvx_xfer *x, uint64_t deadline_ns, bool check,
                    bool control, int *fd, bool *fresh, td_err *err)
{
    /* A control message (HEARTBEAT, RELEASE) may open one connection past the limit: with
     * every connection inside a slow read, a heartbeat that waited for one would let the
     * leases of the reads queued behind them lapse. */
    int cap = s->max_open + (control ? 1 : 0);
    pthread_mutex_lock(&s->mu);
    for (;;) {
        if (s->n_idle > 0) {
            *fd = s->idle[--s->n_idle];
            /* An idle connection has nothing to read; readable means the producer hung up
             * (it restarted or died): drop it instead of failing a request on it. */
            struct pollfd pf = {.fd = *fd, .events = POLLIN};
            if (check && poll(&pf, 1, 0) != 0) {
                close(*fd);
                s->n_open--;
                continue;
            }
            *fresh = false;
            pthread_mutex_unlock(&s->mu);
            return 0;
        }
        if (s->n_open < cap) {
            s->n_open++;
            pthread_mutex_unlock(&s->mu);
            int rc = connect_greeted(s, false, !control, x, deadline_ns, fd, err);
            if (rc) {
                pthread_mutex_lock(&s->mu);
                s->n_open--;
                pthread_cond_signal(&s->cv);
                pthread_mutex_unlock(&s->mu);
                return rc;
            }
            *fresh = true;
            return 0;
        }
        uint64_t now = td_now_ns();
        if (now >= deadline_ns) {
            pthread_mutex_unlock(&s->mu);
            return td_err_set(err, TD_ETIMEDOUT,
                              "kvx: deadline passed waiting for a connection to %s:%u", s->host,
                              s->port);
        }
        kvx__cond_wait_until(&s->cv, &s->mu, now + TD_MIN(deadline_ns - now, 1000000000ull));
    }
}

/* A reused connection broke before its answer: the producer hung up (it restarted or
 * died), so the other idle ones are as dead. Close them all, so that the retry dials. */
static void conn_drop_stale(kvx__session *s, int fd)
{
    pthread_mutex_lock(&s->mu);
    close(fd);
    s->n_open--;
    while (s->n_idle > 0) {
        close(s->idle[--s->n_idle]);
        s->n_open--;
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void conn_put(kvx__session *s, int fd, bool ok)
{
    pthread_mutex_lock(&s->mu);
    if (ok && !atomic_load(&s->replaced) && s->n_idle < s->max_open) {
        s->idle[s->n_idle++] = fd;
    } else {
        close(fd);
        s->n_open--;
    }
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------- the tcp transport */

/* A tag for the next request on one of c's connections: unique among those in flight, and
 * never 0, which a producer gives the ERROR it sends before hanging up. */
static uint32_t next_tag(kvx_client *c)
{
    uint32_t t;
    while ((t = atomic_fetch_add(&c->next_tag, 1)) == 0) {
    }
    return t;
}

/*
 * Check the first frame of piece p's answer (decoded into m): 0 for DATA of the size asked
 * for, else the error that ends the piece. A frame with another tag is no answer to p's
 * READ (one left over on a reused connection, or a producer's ERROR before it hangs up):
 * *before_answer stays true, so that a reused connection is replaced once. An ERROR for p
 * leaves the connection in step (*conn_ok).
 */
static int answer_check(kvx__session *s, const kvx__piece *p, const kvx_msg *m, bool *conn_ok,
                        bool *before_answer, td_err *err)
{
    if (m->hdr.tag != p->tag) {
        /* An ERROR with tag 0 is the producer's word before it hangs up; with another
         * request's tag it is a stray answer, whatever its code says. */
        if (m->hdr.type == KVX_MSG_ERROR && m->hdr.tag == 0)
            return td_err_set(err, m->u.error.code, "kvx: producer %s:%u: %s", s->host, s->port,
                              m->u.error.msg);
        return td_err_set(err, TD_EPROTO,
                          "kvx: producer %s:%u answered READ %u with %s for request %u", s->host,
                          s->port, p->tag, kvx_wire_type_name(m->hdr.type), m->hdr.tag);
    }
    *before_answer = false;
    if (m->hdr.type == KVX_MSG_ERROR) {
        *conn_ok = true;
        return td_err_set(err, m->u.error.code, "kvx: producer %s:%u: %s", s->host, s->port,
                          m->u.error.msg);
    }
    if (m->hdr.type != KVX_MSG_DATA)
        return td_err_set(err, TD_EPROTO, "kvx: producer %s:%u answered READ with %s", s->host,
                          s->port, kvx_wire_type_name(m->hdr.type));
    uint32_t want_n_crc = s->client->opts.verify_checksums ? (uint32_t)p->blocks : 0;
    if (m->u.data.data_len != p->bytes || m->u.data.n_crc != want_n_crc)
        return td_err_set(err, TD_EPROTO,
                          "kvx: producer %s:%u answered READ with DATA of %llu bytes and %u "
                          "checksums (expected %llu bytes and %u)",
                          s->host, s->port, (unsigned long long)m->u.data.data_len, m->u.data.n_crc,
                          (unsigned long long)p->bytes, want_n_crc);
    return 0;
}

/*
 * Piece p's answer on fd, whose READ was sent: the DATA frame into p's blocks, in batches
 * of about BATCH_BYTES, each checksummed while it is in cache. *conn_ok says whether fd may
 * carry more (false after any I/O or protocol error; true after a producer's ERROR, which
 * leaves the connection in step); *before_answer whether it failed before any byte of the
 * answer came.
 */
static int tcp_recv_piece(kvx__session *s, kvx__piece *p, int fd, bool *conn_ok,
                          bool *before_answer, td_err *err)
{
    kvx_client *c = s->client;
    struct kvx_xfer *x = p->x;
    const kvx_region *r = &c->opts.region;
    bool want_crc = c->opts.verify_checksums;
    size_t in_cap = 4 * (size_t)(want_crc ? p->blocks : 0) + 512;
    uint8_t *in = malloc(in_cap);
    struct iovec *iov = malloc((2 * p->count + 1) * sizeof(*iov)), *todo = iov + p->count;
    uint32_t *crc = want_crc ? malloc(p->blocks * sizeof(uint32_t)) : NULL;
    uint8_t **dev = NULL; /* GPU memory: each iovec's destination on the device */
    uint8_t *stage = NULL; /* GPU memory: the pinned host staging, in two halves */
    int half = 0;          /* the half (and copy slot) the next batch uses */
    int rc = 0;
    *conn_ok = false;
    *before_answer = true;
    if (!in || !iov || (want_crc && !crc)) {
        rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        goto out;
    }
    kvx_msg m;
    /* Header and payload in two reads. One readv of both saved a system call on a small
     * piece but cost 16-64 MiB transfers 12-37% at 16 at once (BENCHMARKS.md, kvx). */
    rc = kvx__recv_frame(fd, in, in_cap, &m, x->deadline_ns, err);
    if (rc) goto out;
    if ((rc = answer_check(s, p, &m, conn_ok, before_answer, err))) goto out;
    uint32_t want_n_crc = want_crc ? (uint32_t)p->blocks : 0;
    bool corrupt = atomic_load(&kvx__test_corrupt_pieces) > 0 &&
                   atomic_fetch_sub(&kvx__test_corrupt_pieces, 1) > 0;
    atomic_fetch_add(&kvx__test_answers_taken, 1);
    uint32_t per_chunk = kvx__batch_blocks(r->block_bytes, BATCH_BYTES), at = 0;
    int n_iov = 0;
    uint64_t batch = 0;
    /* GPU memory comes in through pinned host staging in two halves: a batch is received
     * into one (as the producer's batches, under 2 per_chunk blocks), checksummed there,
     * and its copies to its blocks on the device (dev[v]: where iov[v] goes) start in that
     * half's slot while the next batch is received into the other half. */
    if (r->device) {
        dev = malloc(p->count * sizeof(*dev));
        if (!dev) rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        if (!rc)
            rc = kvx__stage_buf(r->device_id, 4 * (size_t)per_chunk * r->block_bytes, &stage, err);
    }
    const size_t half_bytes = 2 * (size_t)per_chunk * r->block_bytes;
    for (uint32_t k = 0; k < p->count && !rc; k++) {
        const piece_desc *d = &x->pd[p->first + k];
        uint8_t *base = (uint8_t *)r->base + kvx__offset(r, d->seg, d->dst);
        for (uint32_t j = 0; j < d->n && !rc;) {
            uint32_t cb = TD_MIN(d->n - j, per_chunk);
            uint8_t *to = base + (uint64_t)j * r->block_bytes;
            if (stage) {
                dev[n_iov] = to;
                to = stage + (size_t)half * half_bytes + batch;
            }
            iov[n_iov++] = (struct iovec){to, (size_t)cb * r->block_bytes};
            batch += (uint64_t)cb * r->block_bytes;
            j += cb;
            bool last = k + 1 == p->count && j == d->n;
            /* Batches end at per_chunk blocks: at most one iovec per descriptor each. */
            if (batch < (uint64_t)per_chunk * r->block_bytes && !last) continue;
            memcpy(todo, iov, (size_t)n_iov * sizeof(*todo)); /* readv consumes its iovecs */
            int n_todo = n_iov;
            if (last && want_n_crc) /* the checksum trailer arrives with the last batch */
                todo[n_todo++] = (struct iovec){in, (size_t)want_n_crc * 4};
            if (stage) rc = kvx__stage_wait(r->device_id, half, err); /* its last copies */
            if (!rc) rc = kvx__readv_all(fd, todo, n_todo, x->deadline_ns, err);
            if (!rc && corrupt) {
                ((uint8_t *)iov[0].iov_base)[r->block_bytes / 2] ^= 0x40;
                corrupt = false;
            }
            for (int v = 0; v < n_iov && !rc && want_crc; v++) {
                uint32_t nb = (uint32_t)(iov[v].iov_len / r->block_bytes);
                td_crc32c_blocks(iov[v].iov_base, r->block_bytes, nb, crc + at);
                at += nb;
            }
            for (int v = 0; v < n_iov && !rc && stage; v++)
                rc = kvx__stage_copy_start(r->device_id, half, dev[v], iov[v].iov_base,
                                           iov[v].iov_len, true, err);
            half = !half;
            n_iov = 0;
            batch = 0;
        }
    }
    if (rc) goto out;
    *conn_ok = true; /* the whole answer was read */
    at = 0;
    for (uint32_t k = 0; k < p->count && want_crc && !rc; k++) {
        const piece_desc *d = &x->pd[p->first + k];
        for (uint32_t j = 0; j < d->n; j++, at++)
            if (crc[at] != kvx_wire_trailer_get(in, at)) {
                rc = td_err_set(err, TD_EPROTO,
                                "kvx: checksum mismatch in segment %u, block %u (producer block "
                                "%u) from %s:%u",
                                d->seg, d->dst + j, d->src + j, s->host, s->port);
                break;
            }
    }
out:
    if (stage) { /* the blocks are on the device (or the piece failed) before it ends */
        td_err e2;
        for (int slot = 0; slot < 2; slot++)
            if (kvx__stage_wait(r->device_id, slot, &e2) && !rc) {
                rc = e2.code;
                *err = e2;
            }
    }
    free(in);
    free(iov);
    free(crc);
    free(dev);
    return rc;
}

/*
 * The answers to small pieces (a pipelined group's, or one piece of at most
 * PIPE_PIECE_BYTES) come in through one receive buffer (bounce): each recv takes all that
 * has arrived, however many frames that is, and each piece's blocks are then copied out of
 * it with their checksums in one pass (td_crc32c_copy_blocks). This costs a recv and a
 * poll per arrival instead of three or four reads per answer (its header, payload, and data
 * with the trailer, and a read that finds nothing yet), and the copy rides on the checksum
 * pass that runs anyway. The buffer holds all of the group's answers, so it is never moved.
 */
typedef struct bounce {
    uint8_t *buf;
    size_t cap, lo, hi; /* buf[lo, hi): received, not yet taken */
} bounce;

/* The most bytes the answers to pieces ps[0..n) can take: DATA with its trailer, or ERROR. */
static size_t bounce_need(const kvx_client *c, kvx__piece **ps, int n)
{
    size_t need = 0;
    for (int i = 0; i < n; i++) {
        size_t data =
            12 + (c->opts.verify_checksums ? 4 * (size_t)ps[i]->blocks : 0) + (size_t)ps[i]->bytes;
        need += KVX_HDR_BYTES + TD_MAX(data, (size_t)6 + KVX_MAX_ERRMSG);
    }
    return need;
}

static int bounce_get(kvx_client *c, size_t need, bounce *b)
{
    memset(b, 0, sizeof(*b));
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n_spare_bounce; i++)
        if (c->spare_bounce[i].cap >= need) {
            b->buf = c->spare_bounce[i].buf;
            b->cap = c->spare_bounce[i].cap;
            c->spare_bounce[i] = c->spare_bounce[--c->n_spare_bounce];
            break;
        }
    pthread_mutex_unlock(&c->mu);
    if (b->buf) return 0;
    size_t cap = TD_MAX(need, (size_t)PIPE_BYTES + PIPE_BYTES / 8);
    b->buf = malloc(cap);
    b->cap = cap;
    return b->buf ? 0 : TD_ENOMEM;
}

static void bounce_put(kvx_client *c, bounce *b)
{
    if (!b->buf) return;
    pthread_mutex_lock(&c->mu);
    if (c->n_spare_bounce < BOUNCE_KEEP) {
        c->spare_bounce[c->n_spare_bounce].buf = b->buf;
        c->spare_bounce[c->n_spare_bounce++].cap = b->cap;
        b->buf = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    free(b->buf);
    b->buf = NULL;
}

/* Until b holds `need` bytes from lo. The first recv of a group waits first: its answer
 * cannot have come yet. */
static int bounce_fill(int fd, bounce *b, size_t need, uint64_t deadline_ns, td_err *err)
{
    if (need > b->cap - b->lo)
        return td_err_set(err, TD_EPROTO, "kvx: the producer's answer is larger than asked for");
    while (b->hi - b->lo < need) {
        size_t got;
        int rc =
            kvx__recv_some(fd, b->buf + b->hi, b->cap - b->hi, b->hi == 0, deadline_ns, &got, err);
        if (rc) return rc;
        b->hi += got;
    }
    return 0;
}

/* tcp_recv_piece for a piece of a pipelined group, whose answer comes through b. */
static int bounce_recv_piece(kvx__session *s, kvx__piece *p, int fd, bounce *b, bool *conn_ok,
                             bool *before_answer, td_err *err)
{
    kvx_client *c = s->client;
    struct kvx_xfer *x = p->x;
    const kvx_region *r = &c->opts.region;
    bool want_crc = c->opts.verify_checksums;
    *conn_ok = false;
    *before_answer = true;
    int rc = bounce_fill(fd, b, KVX_HDR_BYTES, x->deadline_ns, err);
    if (rc) return rc;
    kvx_hdr h;
    if ((rc = kvx_wire_decode_hdr(b->buf + b->lo, &h, err))) return rc;
    /* A READ is answered by DATA (a 12-byte payload) or ERROR: anything else fails here,
     * before its payload is waited for. */
    if (!(h.type == KVX_MSG_DATA && h.payload_len == 12) &&
        !(h.type == KVX_MSG_ERROR && h.payload_len <= 6 + KVX_MAX_ERRMSG))
        return td_err_set(err, TD_EFORMAT,
                          "kvx: producer %s:%u answered READ with %s of a %u-byte payload", s->host,
                          s->port, kvx_wire_type_name(h.type), h.payload_len);
    /* A frame that has started must finish soon (as kvx__recv_frame). */
    uint64_t frame_deadline = TD_MIN(x->deadline_ns, td_now_ns() + 30ull * 1000000000ull);
    if ((rc = bounce_fill(fd, b, KVX_HDR_BYTES + (size_t)h.payload_len, frame_deadline, err)))
        return rc;
    kvx_msg m;
    rc = kvx_wire_decode(&h, b->buf + b->lo + KVX_HDR_BYTES, h.payload_len, &m, err);
    if (rc) return rc;
    size_t frame = KVX_HDR_BYTES + (size_t)h.payload_len;
    if ((rc = answer_check(s, p, &m, conn_ok, before_answer, err))) {
        if (*conn_ok) b->lo += frame; /* p's ERROR: the next answer follows */
        return rc;
    }
    uint32_t want_n_crc = want_crc ? (uint32_t)p->blocks : 0;
    bool corrupt = atomic_load(&kvx__test_corrupt_pieces) > 0 &&
                   atomic_fetch_sub(&kvx__test_corrupt_pieces, 1) > 0;
    atomic_fetch_add(&kvx__test_answers_taken, 1);
    size_t whole = frame + (size_t)p->bytes + 4 * (size_t)want_n_crc;
    if ((rc = bounce_fill(fd, b, whole, x->deadline_ns, err))) return rc;
    uint8_t *src = b->buf + b->lo + frame;
    const uint8_t *trailer = src + p->bytes;
    b->lo += whole;
    *conn_ok = true; /* the whole answer was read */
    if (corrupt) src[r->block_bytes / 2] ^= 0x40;
    uint32_t at = 0;
    for (uint32_t k = 0; k < p->count; k++) {
        const piece_desc *d = &x->pd[p->first + k];
        uint8_t *to = (uint8_t *)r->base + kvx__offset(r, d->seg, d->dst);
        if (!want_crc) {
            memcpy(to, src, (size_t)d->n * r->block_bytes);
            src += (size_t)d->n * r->block_bytes;
            continue;
        }
        uint32_t crc[64];
        for (uint32_t j = 0; j < d->n;) {
            uint32_t cb = TD_MIN(d->n - j, 64u);
            td_crc32c_copy_blocks(to, src, r->block_bytes, cb, crc);
            for (uint32_t i = 0; i < cb && !rc; i++)
                if (crc[i] != kvx_wire_trailer_get(trailer, at + i))
                    rc = td_err_set(err, TD_EPROTO,
                                    "kvx: checksum mismatch in segment %u, block %u (producer "
                                    "block %u) from %s:%u",
                                    d->seg, d->dst + j + i, d->src + j + i, s->host, s->port);
            to += (size_t)cb * r->block_bytes;
            src += (size_t)cb * r->block_bytes;
            at += cb;
            j += cb;
        }
    }
    return rc;
}

static void piece_finish(kvx_client *c, kvx__piece *p, int rc, const td_err *e);

/* Piece i of a group has its outcome: kept in rcs/errs, or the piece finished at once,
 * except the last, which the caller finishes after its last use of the session (finishing
 * may end the last transfer that holds it). */
static void group_outcome(kvx__session *s, kvx__piece **ps, int i, int n, int rc,
                          const td_err *e, int *rcs, td_err *errs, int *last_rc, td_err *last_e)
{
    if (i == n - 1 && !rcs) {
        *last_rc = rc;
        *last_e = *e;
    } else if (rcs) {
        rcs[i] = rc;
        errs[i] = *e;
    } else {
        piece_finish(s->client, ps[i], rc, e);
    }
}

/*
 * Run n pieces of one session on one connection, pipelined: every READ goes out in one
 * send, then the answers are read in order (the producer answers a connection's requests
 * in turn; an ERROR for one leaves the rest in step). Each piece's outcome goes to rcs[i]
 * and errs[i], or, with rcs NULL, finishes the piece as soon as it is known. A connection
 * error fails the pieces not yet read; a reused connection that fails before the first
 * answer (the producer restarted, or an idle timeout) is replaced once by a fresh one,
 * whose handshake tells what really happened.
 */
static bool pipelinable(const kvx_client *c, const kvx__piece *p);
static void pieces_requeue(kvx_client *c, kvx__piece **ps, int n);
static void tcp_run_group(kvx__session *s, kvx__piece **ps, int n, int *rcs, td_err *errs)
{
    kvx_client *c = s->client; /* s may be gone once the last piece is finished */
    bool want_crc = c->opts.verify_checksums;
    size_t req_cap = 0;
    uint32_t max_count = 0;
    for (int i = 0; i < n; i++) {
        req_cap += KVX_HDR_BYTES + 24 + (size_t)ps[i]->count * KVX_DESC_BYTES;
        max_count = TD_MAX(max_count, ps[i]->count);
    }
    uint8_t *req = malloc(req_cap);
    kvx_wire_desc *wd = malloc(max_count * sizeof(*wd));
    int done = 0, rc = 0, last_rc = 0; /* pieces with an outcome; the last failure */
    td_err e, last_e;
    bounce bb = {0};
    bool bounced = false;
    kvx__piece *again[PIPE_MAX]; /* pieces that go back to the queue (fail_rest) */
    int n_again = 0;
    bool last_again = false, out_of_step = false;
    td_err_clear(&e);
    if (!req || !wd) {
        rc = td_err_set(&e, TD_ENOMEM, "kvx: out of memory");
        goto fail_rest;
    }
    size_t req_n = 0;
    uint64_t deadline = UINT64_MAX; /* the earliest of the pieces' transfers */
    for (int i = 0; i < n; i++) {
        kvx__piece *p = ps[i];
        struct kvx_xfer *x = p->x;
        for (uint32_t k = 0; k < p->count; k++) {
            const piece_desc *d = &x->pd[p->first + k];
            wd[k] = (kvx_wire_desc){d->seg, d->src, d->n};
        }
        p->tag = next_tag(s->client);
        size_t w = kvx_wire_encode_read(req + req_n, req_cap - req_n, p->tag, x->transfer_id,
                                        want_crc ? KVX_READ_CHECKSUMS : 0, wd, p->count);
        TD_ASSERT(w > 0);
        req_n += w;
        deadline = TD_MIN(deadline, x->deadline_ns);
    }
    /* Small pieces come in through a receive buffer (bounce_recv_piece); larger ones, or
     * without a buffer (out of memory), each is read straight into its blocks. */
    bounced = pipelinable(s->client, ps[0]) && !atomic_load(&kvx__test_no_bounce) &&
              bounce_get(s->client, bounce_need(s->client, ps, n), &bb) == 0;
    if (bounced) atomic_fetch_add(&kvx__test_pieces_bounced, n);
    int fd = -1;
    bool conn_ok = false;
    for (int attempt = 0;; attempt++) {
        bool fresh, before = true;
        rc = conn_get(s, ps[0]->x, deadline, false, false, &fd, &fresh, &e);
        if (rc) goto fail_rest;
        rc = kvx__send_all(fd, req, req_n, deadline, &e);
        bb.lo = bb.hi = 0;
        if (bounced) {
            if (!rc) rc = bounce_recv_piece(s, ps[0], fd, &bb, &conn_ok, &before, &e);
        } else {
            /* the answer cannot be there yet: wait for it rather than try a read first */
            if (!rc) rc = kvx__wait_readable(fd, deadline, &e);
            if (!rc) rc = tcp_recv_piece(s, ps[0], fd, &conn_ok, &before, &e);
        }
        /* A reused connection that broke, or brought something other than this answer
         * (left over from an earlier exchange), before the answer began: once more on a
         * fresh one. */
        bool stale = rc == TD_ECONN || rc == TD_EPROTO || rc == TD_EFORMAT;
        if (!rc || conn_ok || !stale || !before || fresh || attempt > 0) break;
        conn_drop_stale(s, fd);
    }
    /* The connection broke under an answer, or brought one that was not the piece's own:
     * the pieces behind it had no answers. */
    out_of_step = rc && !conn_ok && (rc == TD_ECONN || rc == TD_EPROTO || rc == TD_EFORMAT);
    group_outcome(s, ps, done++, n, rc, &e, rcs, errs, &last_rc, &last_e);
    while (done < n && conn_ok) {
        bool before;
        td_err pe;
        td_err_clear(&pe);
        int prc = bounced ? bounce_recv_piece(s, ps[done], fd, &bb, &conn_ok, &before, &pe)
                          : tcp_recv_piece(s, ps[done], fd, &conn_ok, &before, &pe);
        if (prc) {
            rc = prc;
            e = pe;
        }
        if (prc && !conn_ok && (prc == TD_ECONN || prc == TD_EPROTO || prc == TD_EFORMAT)) {
            /* The pieces behind it never had their answers, nor this one if nothing of
             * its own came (fail_rest sends them again). */
            out_of_step = true;
            if (before) break;
        }
        group_outcome(s, ps, done++, n, prc, &pe, rcs, errs, &last_rc, &last_e);
    }
    /* Bytes past the last answer: the producer is out of step, the connection is not reused. */
    if (bounced && bb.hi != bb.lo) conn_ok = false;
    conn_put(s, fd, conn_ok);
fail_rest: /* the connection broke under an earlier answer, or there was none */
    /* Pieces come in deadline order (group_run), so a piece that ran out of time fails the
     * pieces behind it only by its own deadline, which is not theirs: those with time left
     * go back to the queue, to run again on another connection. So do, once, the pieces
     * behind an answer that broke or was not theirs (a READ only reads: sending it again
     * is safe), rather than fail with another piece's error. */
    while (done < n) {
        kvx__piece *p = ps[done];
        bool late = rc == TD_ETIMEDOUT || rc == TD_EBUSY; /* by the group's first deadline */
        bool again_ok = late || (out_of_step && !p->resent);
        if (!rcs && again_ok && n_again < PIPE_MAX && td_now_ns() < p->x->deadline_ns) {
            if (!late) {
                p->resent = true;
                atomic_fetch_add(&kvx__test_pieces_resent, 1);
            }
            last_again = done == n - 1;
            again[n_again++] = ps[done++];
            continue;
        }
        group_outcome(s, ps, done++, n, rc, &e, rcs, errs, &last_rc, &last_e);
    }
    bounce_put(c, &bb);
    free(req);
    free(wd);
    if (!rcs && !last_again) piece_finish(c, ps[n - 1], last_rc, &last_e);
    if (n_again) pieces_requeue(c, again, n_again);
}

static int tcp_run_piece(kvx__session *s, kvx__piece *p, td_err *err)
{
    int rc;
    tcp_run_group(s, &p, 1, &rc, err);
    return rc;
}

static int tcp_control(kvx__session *s, uint8_t type, const uint8_t id[KVX_ID_BYTES],
                       uint64_t deadline_ns, td_err *err)
{
    uint8_t buf[512];
    kvx_msg m;
    int fd, rc;
    for (int attempt = 0;; attempt++) {
        uint32_t tag = next_tag(s->client);
        size_t n = type == KVX_MSG_RELEASE
                       ? kvx_wire_encode_release(buf, sizeof(buf), tag, id)
                       : kvx_wire_encode_heartbeat(buf, sizeof(buf), tag, id, 1);
        bool fresh;
        rc = conn_get(s, NULL, deadline_ns, false, true, &fd, &fresh, err);
        if (rc) return rc;
        rc = kvx__send_all(fd, buf, n, deadline_ns, err);
        /* The answer in one recv (after a poll: it cannot be there yet); anything after it
         * would put the connection out of step. */
        uint8_t in[512];
        kvx__rbuf rb = {.buf = in, .cap = sizeof(in)};
        if (!rc) rc = kvx__rbuf_frame(fd, &rb, &m, deadline_ns, err);
        /* Nothing of the answer came (the connection broke first), or what came answered
         * something else (left over on a reused connection): a reused connection is tried
         * once more on a fresh one. Once the answer has begun the request took effect, and
         * is not sent again (a RELEASE sent twice would find its lease gone). */
        bool stale = false;
        if (!rc && m.hdr.tag != tag && !(m.hdr.type == KVX_MSG_ERROR && m.hdr.tag == 0)) {
            rc =
                td_err_set(err, TD_EPROTO, "kvx: producer %s:%u answered request %u with %s for %u",
                           s->host, s->port, tag, kvx_wire_type_name(m.hdr.type), m.hdr.tag);
            stale = true;
        } else if (!rc && rb.lo != rb.hi) {
            rc = td_err_set(err, TD_EPROTO, "kvx: producer %s:%u sent more than its answer",
                            s->host, s->port);
        } else if (rc) {
            stale = rc == TD_ECONN && rb.hi == 0;
        }
        if (!rc) break;
        if (!stale || fresh || attempt > 0) {
            conn_put(s, fd, false);
            return rc;
        }
        conn_drop_stale(s, fd);
    }
    conn_put(s, fd, m.hdr.type == KVX_MSG_ACK || (m.hdr.type == KVX_MSG_ERROR && m.hdr.tag != 0));
    if (m.hdr.type == KVX_MSG_ERROR)
        return td_err_set(err, m.u.error.code, "kvx: producer %s:%u: %s", s->host, s->port,
                          m.u.error.msg);
    if (m.hdr.type != KVX_MSG_ACK)
        return td_err_set(err, TD_EPROTO, "kvx: producer %s:%u answered with %s", s->host, s->port,
                          kvx_wire_type_name(m.hdr.type));
    if (m.u.ack.value == 0)
        return td_err_set(err, TD_ENOTFOUND, "kvx: producer %s:%u: unknown or expired transfer id",
                          s->host, s->port);
    return 0;
}

static const kvx__transport tcp_transport = {"tcp", tcp_run_piece, tcp_control, NULL};

/* ---------------------------------------------------------------- for other transports */

void kvx__piece_get_info(const kvx__piece *p, kvx__piece_info *out)
{
    *out = (kvx__piece_info){.transfer_id = p->x->transfer_id,
                             .deadline_ns = p->x->deadline_ns,
                             .tag = p->tag,
                             .count = p->count,
                             .bytes = p->bytes,
                             .blocks = p->blocks};
}

kvx__piece_range kvx__piece_get_range(const kvx__piece *p, uint32_t k)
{
    const piece_desc *d = &p->x->pd[p->first + k];
    return (kvx__piece_range){d->seg, d->src, d->dst, d->n};
}

const kvx_client_opts *kvx__session_opts(const kvx__session *s)
{
    return &s->client->opts;
}

const char *kvx__session_host(const kvx__session *s)
{
    return s->host;
}

uint16_t kvx__session_port(const kvx__session *s)
{
    return s->port;
}

void **kvx__session_transport_state(kvx__session *s)
{
    return &s->transport_state;
}

void *kvx__session_client_state(const kvx__session *s)
{
    const kvx_client *c = s->client;
    return s->rail >= 0 && c->rail_ucx[s->rail] ? c->rail_ucx[s->rail] : c->transport_state;
}

int kvx__session_connect(kvx__session *s, uint64_t deadline_ns, int *fd, td_err *err)
{
    return connect_greeted(s, false, true, NULL, deadline_ns, fd, err);
}

int kvx__session_control(kvx__session *s, uint8_t type, const uint8_t id[KVX_ID_BYTES],
                         uint64_t deadline_ns, td_err *err)
{
    return tcp_control(s, type, id, deadline_ns, err);
}

/* ---------------------------------------------------------------- transfers */

static void xfer_free_mem(struct kvx_xfer *x)
{
    free(x->dst);
    free(x->pd);
    free(x->pieces);
    free(x);
}

static void xfer_complete(struct kvx_xfer *x)
{
    kvx_client *c = x->c;
    uint64_t now = td_now_ns();
    x->info.seconds = (double)(now - x->start_ns) * 1e-9;
    x->info.tail_seconds = x->push ? (x->done_ns ? (double)(now - x->done_ns) * 1e-9 : 0)
                                   : x->info.seconds;
    if (x->code == 0) td_err_clear(&x->result);
    session_put(x->s);
    x->s = NULL;
    if (x->ds) session_put(x->ds);
    x->ds = NULL;
    for (int i = 0; i < KVX_MAX_RAILS; i++)
        if (x->rs[i]) {
            session_put(x->rs[i]);
            x->rs[i] = NULL;
        }
    if (x->cb) x->cb(x->user, x, &x->result);
    pthread_mutex_lock(&c->mu);
    x->done = true;
    for (struct kvx_xfer **pp = &c->pushes; x->push && *pp; pp = &(*pp)->next_push)
        if (*pp == x) { /* kvx_client_destroy waits for this */
            *pp = x->next_push;
            break;
        }
    bool free_now = x->detached;
    pthread_cond_broadcast(&c->done_cv);
    pthread_mutex_unlock(&c->mu);
    if (free_now) xfer_free_mem(x);
}

/*
 * Under c->mu: wake workers for n new pieces (or groups of pieces: the caller counts a
 * pipelined group as one), as many as are asleep and not already woken (n_wake_pending,
 * which a woken worker counts down and group_take leaves pieces for). Two or more with one
 * broadcast: a futex wake-up of a thread asleep on the other vCPU costs the caller ~28 us
 * in this VM, and one call wakes them all for about the price of one. A piece queued with
 * no worker asleep is taken by the next worker that finishes its own.
 */
static void wake_workers(kvx_client *c, int n)
{
    int k = TD_MIN(n, c->n_waiting - c->n_wake_pending);
    if (k >= 2 && c->n_workers >= 2) {
        pthread_cond_broadcast(&c->work_cv);
        c->n_wake_pending = c->n_waiting;
    } else if (k >= 1) {
        pthread_cond_signal(&c->work_cv);
        c->n_wake_pending++;
    }
}

/* Put pieces that did not run back at the head of the queue, in order (they are late
 * already), and wake workers for them; at shutdown they end instead. */
static void pieces_requeue(kvx_client *c, kvx__piece **ps, int n)
{
    pthread_mutex_lock(&c->mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->mu);
        td_err e;
        td_err_set(&e, TD_ECANCELED, "kvx: the consumer shut down");
        for (int i = 0; i < n; i++)
            piece_finish(c, ps[i], TD_ECANCELED, &e);
        return;
    }
    uint64_t earliest = UINT64_MAX;
    for (int i = n - 1; i >= 0; i--) {
        ps[i]->next = c->qhead;
        c->qhead = ps[i];
        if (!c->qtail) c->qtail = ps[i];
        earliest = TD_MIN(earliest, ps[i]->x->deadline_ns);
    }
    wake_workers(c, n);
    if (earliest < c->watch_next) pthread_cond_signal(&c->watch_cv);
    pthread_mutex_unlock(&c->mu);
}

static void piece_finish(kvx_client *c, kvx__piece *p, int rc, const td_err *e)
{
    struct kvx_xfer *x = p->x;
    pthread_mutex_lock(&c->mu);
    if (rc && !x->code) {
        x->code = rc;
        x->result = *e;
        x->result.code = rc;
    } else if (!rc) {
        x->info.bytes += p->bytes;
    }
    bool last = --x->pending == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) xfer_complete(x);
}

/*
 * Striping: run piece p on the rail expected to finish it first, (bytes running there +
 * p's bytes) / its measured rate, among rails not left out; an unmeasured rail is assumed
 * as fast as the fastest measured one, so every rail gets tried. A failure that a rail
 * may cause (connection, refusal, timeout before the deadline) leaves that rail out for
 * 10 s and puts the piece back at the head of the queue for another rail (TD_EAGAIN);
 * when no rail is left, the piece fails with the last error.
 */
#define STRIPE_DOWN_NS (10ull * 1000000000ull)
#define STRIPE_STALE_NS (500ull * 1000000ull)

static int stripe_run(kvx_client *c, struct kvx_xfer *x, kvx__piece *p, td_err *e)
{
    pthread_mutex_lock(&c->mu);
    uint64_t now = td_now_ns();
    double fastest = 0;
    for (int r = 0; r < c->rails.n; r++)
        if (x->rs[r] && x->rs[r]->rate > fastest) fastest = x->rs[r]->rate;
    kvx__session *s = NULL;
    double best = 0;
    for (int r = 0; r < c->rails.n; r++) {
        kvx__session *q = x->rs[r];
        if (!q || q->down_until_ns > now) continue;
        bool fresh = q->rate > 0 && now - q->rated_ns < STRIPE_STALE_NS;
        double rate = fresh ? q->rate : fastest > 0 ? fastest : 1.0;
        double t = (double)(q->inflight + p->bytes) / rate;
        if (!s || t < best) s = q, best = t;
    }
    if (!s) {
        pthread_mutex_unlock(&c->mu);
        if (!e->code)
            td_err_set(e, TD_ECONN, "kvx: no rail to the producer is usable (all failed)");
        return e->code;
    }
    s->inflight += p->bytes;
    pthread_mutex_unlock(&c->mu);

    uint64_t t0 = td_now_ns();
    int rc = c->transport->run_piece(s, p, e);
    uint64_t t1 = td_now_ns();

    pthread_mutex_lock(&c->mu);
    s->inflight -= p->bytes;
    if (!rc) {
        double r = (double)p->bytes / (double)TD_MAX(t1 - t0, 1000);
        s->rate = s->rate > 0 && t1 - s->rated_ns < STRIPE_STALE_NS ? 0.7 * s->rate + 0.3 * r : r;
        s->rated_ns = t1;
    }
    bool rail_fault = rc == TD_ECONN || rc == TD_EIO || rc == TD_EINVAL || rc == TD_EUNSUPPORTED ||
                      (rc == TD_ETIMEDOUT && t1 < x->deadline_ns);
    bool retry = rail_fault && !x->code && t1 < x->deadline_ns && ++p->tries < c->rails.n;
    if (rail_fault) {
        s->down_until_ns = t1 + STRIPE_DOWN_NS;
        s->rate = 0;
        TD_WARN("kvx: rail %s to %s:%u failed (%s); its share goes to the other rails for 10 s",
                c->rails.name[s->rail], s->host, s->port, e->msg);
    }
    if (retry) { /* to the head of the queue: it is late already */
        p->next = c->qhead;
        c->qhead = p;
        if (!c->qtail) c->qtail = p;
        wake_workers(c, 1);
        rc = TD_EAGAIN;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/*
 * Small pieces of one session go out together: a worker that takes one also takes queued
 * pieces of the same session that no sleeping worker is left for, up to PIPE_MAX pieces
 * and PIPE_BYTES, and sends all their READs on one connection before reading the answers
 * (tcp_run_group). Many concurrent small transfers then cost a wake-up per group on each
 * side instead of one per piece. Only the plain tcp transport, host memory, no striping.
 */

static bool pipelinable(const kvx_client *c, const kvx__piece *p)
{
    return c->transport == &tcp_transport && !c->opts.region.device && !p->x->stripe &&
           p->bytes <= PIPE_PIECE_BYTES;
}

static bool unhold(kvx_client *c, struct kvx_xfer *x);

/*
 * Under c->mu, p just taken: unlink and add to group[] the queued pieces that go with it
 * (same session, pipelinable, their transfer not failed), up to PIPE_MAX pieces and
 * PIPE_BYTES. A worker (held_only false) leaves pieces for the workers already woken
 * (n_wake_pending); a waiting caller (held_only true, wait_group_take) takes only held
 * pieces, for which no worker was woken, and unholds them.
 */
static int group_take_from(kvx_client *c, kvx__piece *p, kvx__piece **group, bool held_only)
{
    int n = 1;
    group[0] = p;
    if (!pipelinable(c, p) || (held_only && c->wake_debt == 0)) return 1;
    int spare = PIPE_MAX - 1;
    if (!held_only) {
        int queued = 0;
        for (kvx__piece *q = c->qhead; q; q = q->next)
            queued++;
        spare = TD_MIN(queued - c->n_wake_pending, spare);
    }
    uint64_t bytes = p->bytes;
    kvx__piece *prev = NULL;
    for (kvx__piece **pp = &c->qhead; *pp && spare > 0;) {
        kvx__piece *q = *pp;
        if ((!held_only || q->x->held) && q->x->s == p->x->s && pipelinable(c, q) && !q->x->code &&
            bytes + q->bytes <= PIPE_BYTES) {
            *pp = q->next;
            if (c->qtail == q) c->qtail = prev;
            if (held_only) unhold(c, q->x);
            group[n++] = q;
            bytes += q->bytes;
            spare--;
        } else {
            prev = q;
            pp = &q->next;
        }
    }
    return n;
}

static int group_take(kvx_client *c, kvx__piece *p, kvx__piece **group)
{
    return group_take_from(c, p, group, false);
}

/* Run one piece taken off the queue (`failed`: its transfer's code when taken) and finish
 * it, unless it was put back for another rail. */
static void piece_run(kvx_client *c, kvx__piece *p, int failed)
{
    struct kvx_xfer *x = p->x;
    td_err e;
    td_err_clear(&e);
    int rc;
    p->tag = next_tag(c); /* its requests' tag (tcp_run_group gives its own) */
    if (failed)
        rc = failed; /* another piece already decided the outcome */
    else if (td_now_ns() >= x->deadline_ns)
        rc = td_err_set(&e, TD_ETIMEDOUT, "kvx: transfer deadline passed before it could run");
    else if (x->stripe)
        rc = stripe_run(c, x, p, &e);
    else
        rc = c->transport->run_piece(x->s, p, &e);
    if (rc == TD_EAGAIN) return; /* requeued for another rail */
    piece_finish(c, p, rc, &e);
}

/* Run a group taken off the queue (group_take, wait_group_take): pieces whose transfer
 * already failed (failed[i], its code when taken) or ran out of time end here; the rest go
 * out together on one connection. */
static void group_run(kvx_client *c, kvx__piece **group, const int *failed, int n)
{
    if (n == 1) {
        piece_run(c, group[0], failed[0]);
        return;
    }
    kvx__piece *run[PIPE_MAX];
    int n_run = 0;
    uint64_t now = td_now_ns();
    for (int i = 0; i < n; i++) {
        td_err e;
        td_err_clear(&e);
        if (failed[i])
            piece_finish(c, group[i], failed[i], &e);
        else if (now >= group[i]->x->deadline_ns)
            piece_finish(
                c, group[i],
                td_err_set(&e, TD_ETIMEDOUT, "kvx: transfer deadline passed before it could run"),
                &e);
        else
            run[n_run++] = group[i];
    }
    /* In deadline order: the answers come back in the order asked, so no piece then waits
     * behind one that may take longer than its own deadline allows (tcp_run_group). */
    for (int i = 1; i < n_run; i++)
        for (int j = i; j > 0 && run[j]->x->deadline_ns < run[j - 1]->x->deadline_ns; j--) {
            kvx__piece *t = run[j];
            run[j] = run[j - 1];
            run[j - 1] = t;
        }
    if (n_run > 1) atomic_fetch_add(&kvx__test_pieces_grouped, n_run);
    if (n_run) tcp_run_group(run[0]->x->s, run, n_run, NULL, NULL);
}

static void *worker_main(void *arg)
{
    kvx_client *c = arg;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        c->n_waiting++;
        while (!c->qhead && !c->stopping) {
            pthread_cond_wait(&c->work_cv, &c->mu);
            /* A wake-up with nothing left to take counts too; a spurious one may count
             * another's, which only costs a wake-up more later. */
            if (c->n_wake_pending > 0) c->n_wake_pending--;
        }
        c->n_waiting--;
        kvx__piece *p = c->qhead;
        if (!p) {
            pthread_mutex_unlock(&c->mu);
            return NULL;
        }
        c->qhead = p->next;
        if (!c->qhead) c->qtail = NULL;
        kvx__piece *group[PIPE_MAX];
        int failed[PIPE_MAX];
        int n = group_take(c, p, group);
        for (int i = 0; i < n; i++)
            failed[i] = group[i]->x->code;
        pthread_mutex_unlock(&c->mu);

        group_run(c, group, failed, n);
    }
}

/*
 * The watchdog fails pieces that are still queued when their transfer's deadline passes,
 * so a transfer queued behind busy workers still ends on time. (A piece that is running
 * is bounded by the same deadline inside the transport.) It sleeps until the earliest
 * deadline in the queue, and at most WATCH_IDLE_NS: a transfer whose deadline is later
 * than the watchdog's next wake-up queues without waking it (a wake-up per transfer cost
 * small transfers a context switch on another CPU).
 */
#define WATCH_IDLE_NS (250ull * 1000000ull)

static void *watchdog_main(void *arg)
{
    kvx_client *c = arg;
    pthread_mutex_lock(&c->mu);
    while (!c->stopping) {
        uint64_t now = td_now_ns(), next = UINT64_MAX;
        kvx__piece *expired = NULL, *kept_last = NULL;
        for (kvx__piece **pp = &c->qhead; *pp;) {
            kvx__piece *p = *pp;
            if (p->x->deadline_ns <= now) {
                *pp = p->next;
                p->next = expired;
                expired = p;
            } else {
                next = TD_MIN(next, p->x->deadline_ns);
                kept_last = p;
                pp = &p->next;
            }
        }
        c->qtail = kept_last;
        if (expired) {
            pthread_mutex_unlock(&c->mu);
            while (expired) {
                kvx__piece *n = expired->next;
                td_err e;
                td_err_set(&e, TD_ETIMEDOUT,
                           "kvx: transfer deadline passed while waiting for a worker");
                piece_finish(c, expired, TD_ETIMEDOUT, &e);
                expired = n;
            }
            pthread_mutex_lock(&c->mu);
            continue;
        }
        next = TD_MIN(next, now + WATCH_IDLE_NS);
        c->watch_next = next;
        kvx__cond_wait_until(&c->watch_cv, &c->mu, next);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int kvx_client_create(kvx_client **out, const kvx_client_opts *opts, td_err *err)
{
    *out = NULL;
    int rc = kvx_region_check(&opts->region, err);
    if (rc) return rc;
    kvx_client *c = calloc(1, sizeof(*c));
    if (!c) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    c->opts = *opts;
    if (opts->auth_token && opts->auth_token[0]) {
        if (strlen(opts->auth_token) >= sizeof(c->token)) {
            free(c);
            return td_err_set(err, TD_EINVAL, "kvx: auth_token is longer than %zu bytes",
                              sizeof(c->token) - 1);
        }
        snprintf(c->token, sizeof(c->token), "%s", opts->auth_token);
    }
    c->opts.auth_token = NULL; /* the copy above is the only one kept */
    if (c->opts.num_worker_threads <= 0) c->opts.num_worker_threads = 4;
    if (c->opts.qp_per_transfer <= 0) c->opts.qp_per_transfer = 4;
    if (!c->opts.transfer_timeout_ms) c->opts.transfer_timeout_ms = 30000;
    if (c->opts.num_worker_threads > 256 || c->opts.qp_per_transfer > 256) {
        free(c);
        return td_err_set(err, TD_EINVAL, "kvx: at most 256 worker threads and connections");
    }
    if (opts->rails && opts->rails->n > 0) {
        if (opts->protocol == KVX_PROTO_SHM || opts->protocol == KVX_PROTO_CUDA_IPC ||
            (opts->protocol == KVX_PROTO_TCP && opts->rails->kind == KVX_RAIL_RDMA)) {
            free(c);
            return td_err_set(err, TD_EUNSUPPORTED,
                              "kvx: rails carry tcp over network interfaces, or ucx over "
                              "network interfaces or RDMA devices (not %s over %s)",
                              kvx_protocol_name(opts->protocol),
                              opts->rails->kind == KVX_RAIL_RDMA ? "RDMA devices" : "rails");
        }
        c->rails = *opts->rails;
        c->rail_addr_given = opts->rail_addrs != NULL;
        int p = c->rails.primary;
        bool rdma = c->rails.kind == KVX_RAIL_RDMA; /* no address on the device */
        if (opts->rail_addrs)
            for (int i = 0; i < c->rails.n; i++)
                snprintf(c->rail_addr[i], sizeof(c->rail_addr[i]), "%s", opts->rail_addrs[i]);
        else if (!rdma && (rc = kvx__iface_addr(c->rails.name[p], c->rail_addr[p],
                                                sizeof(c->rail_addr[p]), err))) {
            free(c);
            return rc;
        }
        c->striping = opts->rail_striping && opts->matched_rails && c->rails.n > 1;
        /* Striping reads over every rail: each needs its local address now. */
        for (int i = 0; c->striping && !opts->rail_addrs && !rdma && i < c->rails.n; i++)
            if (i != p && (rc = kvx__iface_addr(c->rails.name[i], c->rail_addr[i],
                                                sizeof(c->rail_addr[i]), err))) {
                free(c);
                return rc;
            }
        TD_INFO("kvx client: transfers go over rail %s (%s)%s%s", c->rails.name[p], c->rail_addr[p],
                opts->matched_rails ? ", matched" : "",
                c->striping ? ", striped over every matched rail" : "");
    }
    c->opts.rails = NULL; /* copied above */
    c->opts.rail_addrs = NULL;
    uint8_t id[KVX_ID_BYTES];
    if (kvx__random_id(id)) {
        free(c);
        return td_err_set(err, TD_EIO, "kvx: getrandom failed");
    }
    kvx__hello_fill(&c->hello, id, &c->opts.layout, &c->opts.region);
    c->transport = &tcp_transport;
    if (c->opts.protocol == KVX_PROTO_SHM) c->transport = &kvx__shm_transport;
    /* GPU memory moves by cuda_ipc, or by tcp or ucx through pinned host staging (CUDA
     * builds) */
    bool dev_ok = c->opts.protocol == KVX_PROTO_CUDA_IPC ||
                  ((c->opts.protocol == KVX_PROTO_TCP || c->opts.protocol == KVX_PROTO_UCX) &&
                   kvx_protocol_available(KVX_PROTO_CUDA_IPC));
    if (c->opts.region.device ? !dev_ok : c->opts.protocol == KVX_PROTO_CUDA_IPC) {
        bool dev = c->opts.region.device;
        free(c);
        return td_err_set(err, TD_EUNSUPPORTED,
                          dev ? "kvx: this consumer's KV lives in GPU memory: use protocol "
                                "cuda_ipc (same host), tcp or ucx, in a build with CUDA"
                              : "kvx: protocol cuda_ipc moves GPU memory, and this consumer's KV "
                                "lives in host memory");
    }
    if (c->opts.protocol == KVX_PROTO_CUDA_IPC) {
#ifdef TD_HAVE_CUDA
        c->transport = &kvx__cuda_transport;
#else
        free(c);
        return td_err_set(err, TD_EUNSUPPORTED,
                          "kvx: protocol cuda_ipc needs the CUDA backend (-DTANDEM_CUDA=ON)");
#endif
    }
    if (c->opts.protocol == KVX_PROTO_UCX) {
#ifdef TD_HAVE_UCX
        struct kvx__ucx_client *u;
        if ((rc = kvx__ucx_client_create(&u, &c->opts, NULL, err))) {
            free(c);
            return rc;
        }
        c->transport_state = u;
        c->transport = &kvx__ucx_transport;
        /* Rails: a context per rail this consumer reads over, restricted to its device. */
        for (int i = 0; i < c->rails.n && !rc; i++) {
            if (i != c->rails.primary && !c->striping) continue;
            char dev[KVX_RAIL_NAME + 4];
            kvx__rail_ucx_device(&c->rails, i, dev, sizeof(dev));
            rc = kvx__ucx_client_create((struct kvx__ucx_client **)&c->rail_ucx[i], &c->opts,
                                        c->rail_addr_given ? NULL : dev, err);
        }
        if (rc) {
            for (int i = 0; i < c->rails.n; i++) kvx__ucx_client_destroy(c->rail_ucx[i]);
            kvx__ucx_client_destroy(u);
            free(c);
            return rc;
        }
#else
        free(c);
        return td_err_set(err, TD_EUNSUPPORTED,
                          "kvx: protocol ucx is not built in (install libucx-dev and rebuild)");
#endif
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work_cv, NULL);
    pthread_cond_init(&c->done_cv, NULL);
    kvx__cond_init_monotonic(&c->watch_cv);
    c->watch_next = UINT64_MAX;
    c->has_watchdog = pthread_create(&c->watchdog, NULL, watchdog_main, c) == 0;
    c->workers = calloc((size_t)c->opts.num_worker_threads, sizeof(pthread_t));
    for (int i = 0; c->workers && i < c->opts.num_worker_threads; i++) {
        if (pthread_create(&c->workers[i], NULL, worker_main, c)) break;
        c->n_workers++;
    }
    if (!c->has_watchdog || c->n_workers < c->opts.num_worker_threads) {
        kvx_client_destroy(c);
        return td_err_set(err, TD_ENOMEM, "kvx: cannot start worker threads");
    }
    *out = c;
    return 0;
}

void kvx_client_destroy(kvx_client *c)
{
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    for (struct kvx_xfer *x = c->pushes; x; x = x->next_push)
        if (x->fd >= 0) shutdown(x->fd, SHUT_RDWR); /* its thread ends the push */
    kvx__piece *q = c->qhead;
    c->qhead = c->qtail = NULL;
    pthread_cond_broadcast(&c->work_cv);
    pthread_cond_signal(&c->watch_cv);
    pthread_mutex_unlock(&c->mu);
    if (c->has_watchdog) pthread_join(c->watchdog, NULL);
    while (q) {
        kvx__piece *next = q->next;
        td_err e;
        td_err_set(&e, TD_ECANCELED, "kvx: the consumer shut down");
        piece_finish(c, q, TD_ECANCELED, &e);
        q = next;
    }
    for (int i = 0; i < c->n_workers; i++)
        pthread_join(c->workers[i], NULL);
    free(c->workers);
    pthread_mutex_lock(&c->mu);
    while (c->pushes)
        pthread_cond_wait(&c->done_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    while (c->sessions) {
        kvx__session *s = c->sessions;
        c->sessions = s->next;
        session_put(s);
    }
#ifdef TD_HAVE_UCX
    if (c->transport == &kvx__ucx_transport) {
        kvx__ucx_client_destroy(c->transport_state);
        for (int i = 0; i < KVX_MAX_RAILS; i++) kvx__ucx_client_destroy(c->rail_ucx[i]);
    }
#endif
    for (int i = 0; i < c->n_spare_bounce; i++)
        free(c->spare_bounce[i].buf);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->work_cv);
    pthread_cond_destroy(&c->done_cv);
    pthread_cond_destroy(&c->watch_cv);
    kvx__auth_wipe(c->token, sizeof(c->token));
    free(c);
}

/* Append a descriptor, growing the array. */
static int pd_push(struct kvx_xfer *x, uint32_t *cap, piece_desc d)
{
    if (x->n_pd == *cap) {
        uint32_t nc = *cap ? 2 * *cap : 64;
        piece_desc *np = realloc(x->pd, nc * sizeof(*np));
        if (!np) return TD_ENOMEM;
        x->pd = np;
        *cap = nc;
    }
    x->pd[x->n_pd++] = d;
    return 0;
}

static int piece_push(struct kvx_xfer *x, int *cap, kvx__piece p)
{
    if (x->n_pieces == *cap) {
        int nc = *cap ? 2 * *cap : 8;
        kvx__piece *np = realloc(x->pieces, (size_t)nc * sizeof(*np));
        if (!np) return TD_ENOMEM;
        x->pieces = np;
        *cap = nc;
    }
    x->pieces[x->n_pieces++] = p;
    return 0;
}

/*
 * Cut the runs into kvx_piece_count pieces of equal block counts (and at most KVX_MAX_DESC
 * ranges each). Pieces of at least 512 KiB: every extra piece of a small transfer is a
 * hand-off between threads, which on a small host costs more than the parallel stream
 * saves (BENCHMARKS.md, "Fewer, larger pieces"). Striped transfers keep pieces down to
 * 64 KiB, so that even a small one spreads over the rails.
 */
static int xfer_plan(struct kvx_xfer *x, const kvx_run *runs, int n_runs, const kvx_region *r,
                     uint32_t qp, uint32_t seg0, uint32_t seg1, uint64_t max_piece)
{
    uint64_t total_blocks = 0;
    for (int i = 0; i < n_runs; i++)
        total_blocks += runs[i].n_blocks;
    total_blocks *= seg1 - seg0;
    uint64_t total = total_blocks * r->block_bytes;
    uint64_t n = kvx_piece_count(total, qp, x->stripe ? KVX_MIN_STRIPE_BYTES : KVX_MIN_PIECE_BYTES,
                                 max_piece);
    uint64_t piece_blocks = (total_blocks + n - 1) / n;
    /* an even share may round past max_piece by part of a block */
    if (max_piece != UINT64_MAX)
        piece_blocks = TD_MIN(piece_blocks, TD_MAX(max_piece / r->block_bytes, 1));
    piece_blocks = TD_MIN(TD_MAX(piece_blocks, 1), (uint64_t)KVX_MAX_CRC);
    uint32_t pd_cap = 0;
    int pc_cap = 0;
    kvx__piece cur = {.x = x};
    for (uint32_t seg = seg0; seg < seg1; seg++)
        for (int i = 0; i < n_runs; i++)
            for (uint32_t off = 0; off < runs[i].n_blocks;) {
                uint32_t take =
                    (uint32_t)TD_MIN((uint64_t)(runs[i].n_blocks - off), piece_blocks - cur.blocks);
                if (pd_push(
                        x, &pd_cap,
                        (piece_desc){seg, runs[i].src_block + off, runs[i].dst_block + off, take}))
                    return TD_ENOMEM;
                cur.count++;
                cur.blocks += take;
                cur.bytes += take * r->block_bytes;
                off += take;
                if (cur.blocks == piece_blocks || cur.count == KVX_MAX_DESC) {
                    if (piece_push(x, &pc_cap, cur)) return TD_ENOMEM;
                    cur = (kvx__piece){.x = x, .first = x->n_pd};
                }
            }
    if (cur.count && piece_push(x, &pc_cap, cur)) return TD_ENOMEM;
    return 0;
}

/* Striping: a session per rail for x (the primary's is x->s); 0 or TD_ENOMEM. */
static int stripe_sessions(kvx_client *c, struct kvx_xfer *x, td_err *err)
{
    x->stripe = true;
    for (int r = 0; r < c->rails.n; r++) {
        if (r == x->s->rail) {
            pthread_mutex_lock(&c->mu);
            x->s->refs++;
            pthread_mutex_unlock(&c->mu);
            x->rs[r] = x->s;
            continue;
        }
        int rc = session_get(c, x->s->host, x->s->port, x->s->engine_hex, r, &x->rs[r], err);
        if (rc) return rc;
    }
    return 0;
}

static bool wait_helps(const kvx_client *c);

/*
 * Start a read of src[i] -> dst[i] (i < n) in segments [seg0, seg1) on session s, whose
 * reference the transfer takes over (it is dropped here on failure). With will_wait, one
 * piece is held for the caller's kvx_xfer_wait (kvx_read_req.will_wait).
 */
static int read_begin(kvx_client *c, kvx__session *s, const uint8_t id[KVX_ID_BYTES],
                      const int32_t *src, const int32_t *dst, int n, uint32_t seg0, uint32_t seg1,
                      uint32_t timeout_ms, bool will_wait, kvx_done_fn done, void *user,
                      kvx_xfer **out, td_err *err)
{
    *out = NULL;
    struct kvx_xfer *x = calloc(1, sizeof(*x));
    kvx_run *runs = malloc((size_t)n * sizeof(*runs));
    int rc = 0;
    if (!x || !runs) {
        rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        goto fail;
    }
    memcpy(x->transfer_id, id, KVX_ID_BYTES);
    x->fd = -1;
    int n_runs = kvx_coalesce(src, dst, n, INT32_MAX, c->opts.region.n_blocks, runs);
    if (n_runs < 0) {
        rc = td_err_set(err, TD_EINVAL,
                        "kvx: a block id is negative or outside the local region "
                        "(%u blocks)",
                        c->opts.region.n_blocks);
        goto fail;
    }
    x->c = c;
    x->cb = done;
    x->user = user;
    x->info.n_runs = (uint32_t)n_runs;
    x->info.n_descriptors = (uint32_t)n_runs * (seg1 - seg0);
    x->s = s;
    if (c->striping && s->rail >= 0 && (rc = stripe_sessions(c, x, err))) goto fail;
    uint32_t qp = (uint32_t)c->opts.qp_per_transfer * (x->stripe ? (uint32_t)c->rails.n : 1);
    /* Host transports pipeline pieces of at most 8 MiB; cuda_ipc pays a grant round trip
     * per piece for copies that take microseconds, so its pieces have no maximum. */
    uint64_t max_piece = c->opts.protocol == KVX_PROTO_CUDA_IPC ? UINT64_MAX : MAX_PIECE_BYTES;
    if (xfer_plan(x, runs, n_runs, &c->opts.region, qp, seg0, seg1, max_piece)) {
        rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        goto fail;
    }
    free(runs);
    runs = NULL;
    x->s = s;
    x->start_ns = td_now_ns();
    uint32_t timeout = timeout_ms ? timeout_ms : c->opts.transfer_timeout_ms;
    x->deadline_ns = x->start_ns + (uint64_t)timeout * 1000000ull;
    x->pending = x->n_pieces;

    pthread_mutex_lock(&c->mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->mu);
        x->s = NULL;
        rc = td_err_set(err, TD_ESTATE, "kvx: the consumer is shutting down");
        goto fail;
    }
    for (int i = 0; i < x->n_pieces; i++) {
        kvx__piece *p = &x->pieces[i];
        p->next = NULL;
        if (c->qtail)
            c->qtail->next = p;
        else
            c->qhead = p;
        c->qtail = p;
    }
    /* One worker per piece: waking them all for a one-piece transfer costs each of the
     * others a futex wake-up, a trip through the lock and a futex wait, for nothing. A
     * caller that will wait runs one piece itself: no worker is woken for it (wake_debt). */
    int wake = x->n_pieces;
    if (will_wait && wait_helps(c)) {
        x->held = true;
        c->wake_debt++;
        wake--;
    }
    wake_workers(c, wake);
    if (x->deadline_ns < c->watch_next) pthread_cond_signal(&c->watch_cv);
    pthread_mutex_unlock(&c->mu);
    *out = x;
    return 0;
fail:
    for (int i = 0; x && i < KVX_MAX_RAILS; i++)
        if (x->rs[i]) session_put(x->rs[i]);
    session_put(s);
    free(runs);
    if (x) xfer_free_mem(x);
    return rc;
}

int kvx_read_start(kvx_client *c, const kvx_read_req *req, kvx_xfer **out, td_err *err)
{
    *out = NULL;
    if (!req->src_blocks || !req->dst_blocks || req->n_blocks < 1)
        return td_err_set(err, TD_EINVAL, "kvx: a read needs at least one block");
    uint8_t id[KVX_ID_BYTES];
    if (kvx_id_from_hex(req->transfer_id, id))
        return td_err_set(err, TD_EINVAL, "kvx: transfer id must be 32 hex digits");
    kvx__session *s;
    int rc = session_get(c, req->host, req->port, req->engine_id, data_rail(c), &s, err);
    if (rc) return rc;
    return read_begin(c, s, id, req->src_blocks, req->dst_blocks, req->n_blocks, 0,
                      c->opts.region.n_segments, req->timeout_ms, req->will_wait, req->done,
                      req->user, out, err);
}

/* ---------------------------------------------------------------- push (kvx_write_start) */

/* A read that a push started has ended. */
static void push_sub_done(void *user, kvx_xfer *sub, const td_err *result)
{
    struct kvx_xfer *x = user;
    kvx_client *c = x->c;
    pthread_mutex_lock(&c->mu);
    if (result->code && !x->sub_code) {
        x->sub_code = result->code;
        x->sub_err = *result;
    }
    x->info.bytes += sub->info.bytes;
    x->info.n_descriptors += sub->info.n_descriptors;
    x->outstanding--;
    pthread_cond_broadcast(&c->done_cv);
    pthread_mutex_unlock(&c->mu);
}

/* PUSH_READY: read the announced blocks that are wanted. */
static int push_read(struct kvx_xfer *x, const kvx_msg *m, int32_t *src, int32_t *dst, td_err *err)
{
    kvx_client *c = x->c;
    uint32_t seg = m->u.push_ready.seg, n_seg = m->u.push_ready.n_seg;
    uint32_t index = m->u.push_ready.index, n = m->u.push_ready.n;
    if (seg >= c->opts.region.n_segments || n_seg > c->opts.region.n_segments - seg ||
        index > (uint32_t)x->n_blocks || n > (uint32_t)x->n_blocks - index)
        return td_err_set(err, TD_EPROTO,
                          "kvx: producer announced blocks %u+%u of segments %u+%u, outside "
                          "the transfer (%d blocks, %u segments)",
                          index, n, seg, n_seg, x->n_blocks, c->opts.region.n_segments);
    int k = 0;
    for (uint32_t i = 0; i < n; i++) {
        if ((int)(index + i) < x->skip) continue;
        src[k] = (int32_t)kvx_wire_push_id(m, i);
        dst[k] = x->dst[index + i];
        k++;
    }
    if (k == 0) return 0;
    kvx__session *ds = x->ds ? x->ds : x->s;
    pthread_mutex_lock(&c->mu);
    ds->refs++;
    x->outstanding++;
    x->info.n_runs++;
    pthread_mutex_unlock(&c->mu);
    kvx_xfer *sub;
    int rc = read_begin(c, ds, x->transfer_id, src, dst, k, seg, seg + n_seg, x->timeout_ms, false,
                        push_sub_done, x, &sub, err);
    if (rc) {
        pthread_mutex_lock(&c->mu);
        x->outstanding--;
        x->info.n_runs--;
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
    kvx_xfer_free(sub); /* freed when it ends */
    return 0;
}

static void *push_main(void *arg)
{
    struct kvx_xfer *x = arg;
    kvx_client *c = x->c;
    kvx__session *s = x->s;
    uint64_t idle_ns = (uint64_t)x->timeout_ms * 1000000ull;
    td_err e;
    td_err_clear(&e);
    int fd = -1;
    uint8_t *buf = malloc(KVX_HDR_BYTES + 16 + 4 * (size_t)KVX_MAX_DESC + KVX_MAX_NOTE);
    int32_t *src = malloc(2 * sizeof(int32_t) * KVX_MAX_DESC);
    size_t cap = KVX_HDR_BYTES + 16 + 4 * (size_t)KVX_MAX_DESC + KVX_MAX_NOTE;
    int rc = buf && src ? 0 : td_err_set(&e, TD_ENOMEM, "kvx: out of memory");
    /* A connection of its own: it stays busy for the whole prefill, and the session's
     * pool serves the reads meanwhile. */
    if (!rc) rc = connect_greeted(s, false, true, x, td_now_ns() + idle_ns, &fd, &e);
    if (!rc) {
        pthread_mutex_lock(&c->mu);
        if (c->stopping) rc = td_err_set(&e, TD_ECANCELED, "kvx: the consumer shut down");
        else if (x->cancelled)
            rc = td_err_set(&e, TD_ECANCELED, "kvx: the transfer was cancelled");
        else x->fd = fd;
        pthread_mutex_unlock(&c->mu);
    }
    if (!rc) {
        size_t n = kvx_wire_encode_write(buf, cap, 1, x->transfer_id, (uint32_t)x->skip,
                                         (uint32_t)x->n_blocks, x->timeout_ms);
        rc = kvx__send_all(fd, buf, n, td_now_ns() + idle_ns, &e);
    }
    bool done = false;
    while (!rc && !done) {
        kvx_msg m;
        rc = kvx__recv_frame(fd, buf, cap, &m, td_now_ns() + idle_ns, &e);
        if (rc) {
            if (rc == TD_ETIMEDOUT)
                td_err_set(&e, TD_ETIMEDOUT,
                           "kvx: producer %s:%u said nothing for %u ms during a push",
                           kvx__session_host(s), kvx__session_port(s), x->timeout_ms);
            break;
        }
        switch (m.hdr.type) {
        case KVX_MSG_PUSH_READY:
            rc = push_read(x, &m, src, src + KVX_MAX_DESC, &e);
            break;
        case KVX_MSG_PUSH_DONE:
            memcpy(x->note, m.u.push_done.note, m.u.push_done.note_len);
            x->note_len = m.u.push_done.note_len;
            x->done_ns = td_now_ns();
            done = true;
            break;
        case KVX_MSG_ERROR:
            rc = td_err_set(&e, m.u.error.code, "kvx: producer %s:%u: %s", kvx__session_host(s),
                            kvx__session_port(s), m.u.error.msg);
            break;
        default:
            rc = td_err_set(&e, TD_EPROTO, "kvx: producer answered WRITE with %s",
                            kvx_wire_type_name(m.hdr.type));
        }
        pthread_mutex_lock(&c->mu);
        if (!rc && x->sub_code) rc = x->sub_code; /* a read failed: stop listening */
        pthread_mutex_unlock(&c->mu);
    }
    pthread_mutex_lock(&c->mu);
    x->fd = -1;
    if (rc && x->cancelled) /* the shut-down connection failed the read: say why */
        rc = td_err_set(&e, TD_ECANCELED, "kvx: the transfer was cancelled");
    while (x->outstanding > 0) /* every read ends by its deadline */
        pthread_cond_wait(&c->done_cv, &c->mu);
    if (x->sub_code) {
        x->code = x->sub_code;
        x->result = x->sub_err;
    } else if (rc) {
        x->code = rc;
        x->result = e;
        x->result.code = rc;
    }
    pthread_mutex_unlock(&c->mu);
    if (fd >= 0) close(fd);
    free(buf);
    free(src);
    xfer_complete(x); /* unlinks x from c->pushes: kvx_client_destroy waits for that */
    return NULL;
}

/* A push that did not start: both of its sessions back (the data rail's too), then its
 * memory. */
static void push_sessions_put(struct kvx_xfer *x)
{
    session_put(x->s);
    if (x->ds) session_put(x->ds);
    xfer_free_mem(x);
}

int kvx_write_start(kvx_client *c, const kvx_write_req *req, kvx_xfer **out, td_err *err)
{
    *out = NULL;
    if (!req->dst_blocks || req->n_blocks < 1 || req->skip < 0 || req->skip >= req->n_blocks)
        return td_err_set(err, TD_EINVAL, "kvx: a push needs blocks past the skipped ones");
    for (int i = 0; i < req->n_blocks; i++)
        if (req->dst_blocks[i] < 0 || (uint32_t)req->dst_blocks[i] >= c->opts.region.n_blocks)
            return td_err_set(err, TD_EINVAL, "kvx: block id %d outside the local region",
                              req->dst_blocks[i]);
    uint8_t id[KVX_ID_BYTES];
    if (kvx_id_from_hex(req->transfer_id, id))
        return td_err_set(err, TD_EINVAL, "kvx: transfer id must be 32 hex digits");
    struct kvx_xfer *x = calloc(1, sizeof(*x));
    if (x) x->dst = malloc((size_t)req->n_blocks * sizeof(int32_t));
    if (!x || !x->dst) {
        if (x) xfer_free_mem(x);
        return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    }
    memcpy(x->dst, req->dst_blocks, (size_t)req->n_blocks * sizeof(int32_t));
    memcpy(x->transfer_id, id, KVX_ID_BYTES);
    x->c = c;
    x->push = true;
    x->fd = -1;
    x->n_blocks = req->n_blocks;
    x->skip = req->skip;
    x->timeout_ms = req->timeout_ms ? req->timeout_ms : c->opts.transfer_timeout_ms;
    x->cb = req->done;
    x->user = req->user;
    int rc = session_get(c, req->host, req->port, req->engine_id, -1, &x->s, err);
    if (!rc && data_rail(c) >= 0) {
        rc = session_get(c, req->host, req->port, req->engine_id, data_rail(c), &x->ds, err);
        if (rc) session_put(x->s);
    }
    if (rc) {
        xfer_free_mem(x);
        return rc;
    }
    x->start_ns = td_now_ns();
    x->deadline_ns = UINT64_MAX; /* bounded by timeout_ms of silence instead */
    pthread_mutex_lock(&c->mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->mu);
        push_sessions_put(x);
        return td_err_set(err, TD_ESTATE, "kvx: the consumer is shutting down");
    }
    x->next_push = c->pushes;
    c->pushes = x;
    pthread_mutex_unlock(&c->mu);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&t, &attr, push_main, x);
    pthread_attr_destroy(&attr);
    if (rc) {
        pthread_mutex_lock(&c->mu);
        for (struct kvx_xfer **pp = &c->pushes; *pp; pp = &(*pp)->next_push)
            if (*pp == x) {
                *pp = x->next_push;
                break;
            }
        pthread_mutex_unlock(&c->mu);
        push_sessions_put(x);
        return td_err_set(err, TD_ENOMEM, "kvx: cannot start a push thread");
    }
    *out = x;
    return 0;
}

int kvx_client_cancel(kvx_client *c, const char *transfer_id)
{
    uint8_t id[KVX_ID_BYTES];
    if (kvx_id_from_hex(transfer_id, id)) return TD_EINVAL;
    int rc = TD_ENOTFOUND;
    pthread_mutex_lock(&c->mu);
    for (struct kvx_xfer *x = c->pushes; x; x = x->next_push)
        if (!memcmp(x->transfer_id, id, KVX_ID_BYTES) && !x->done) {
            x->cancelled = true;
            if (x->fd >= 0) shutdown(x->fd, SHUT_RDWR); /* its thread ends the push */
            rc = 0;
        }
    /* Reads (a push's own reads among them): queued pieces of a failed transfer end
     * without running. */
    for (kvx__piece *p = c->qhead; p; p = p->next) {
        struct kvx_xfer *x = p->x;
        if (memcmp(x->transfer_id, id, KVX_ID_BYTES)) continue;
        rc = 0;
        if (x->code) continue;
        x->code = TD_ECANCELED;
        td_err_set(&x->result, TD_ECANCELED, "kvx: the transfer was cancelled");
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

size_t kvx_xfer_note(kvx_xfer *x, void *buf, size_t cap)
{
    /* Written by the push thread before the transfer completes, never after. */
    size_t n = x->note_len;
    memcpy(buf, x->note, TD_MIN(n, cap));
    return n;
}

/* Under c->mu: x's piece is no longer held for its caller; whether it was. */
static bool unhold(kvx_client *c, struct kvx_xfer *x)
{
    if (!x->held) return false;
    x->held = false;
    c->wake_debt--;
    return true;
}

/* Under c->mu: x's caller will not run its held piece (it polls or frees the handle): a
 * worker is signalled for it after all. */
static void release_held(kvx_client *c, struct kvx_xfer *x)
{
    if (unhold(c, x)) wake_workers(c, 1);
}

int kvx_xfer_poll(kvx_xfer *x, td_err *result)
{
    pthread_mutex_lock(&x->c->mu);
    release_held(x->c, x);
    bool done = x->done;
    pthread_mutex_unlock(&x->c->mu);
    if (!done) return TD_EAGAIN;
    if (result) *result = x->result;
    return x->code;
}

/*
 * A thread that waits for a transfer runs the transfer's pieces that no worker has taken
 * yet, as a worker would. A caller that starts a transfer and waits for it then pays no
 * hand-off: on a small machine, waking a worker and being woken by it cost more than a
 * 64 KiB piece's round trip. Workers were signalled for the other pieces (and for all of
 * them unless the read was started with will_wait) and take what the waiter leaves. Host
 * transports only (tcp, shm): a GPU region's copies and UCX's workers
 * stay on the client's own threads.
 */
static bool wait_helps(const kvx_client *c)
{
    bool host = c->transport == &tcp_transport || c->transport == &kvx__shm_transport;
    return host && !c->opts.region.device && atomic_load(&kvx__test_no_wait_help) == 0;
}

/* Under c->mu: unlink and return a queued piece of x, or NULL. */
static kvx__piece *take_own(kvx_client *c, struct kvx_xfer *x)
{
    kvx__piece *prev = NULL;
    for (kvx__piece **pp = &c->qhead; *pp; prev = *pp, pp = &(*pp)->next) {
        kvx__piece *p = *pp;
        if (p->x != x) continue;
        *pp = p->next;
        if (c->qtail == p) c->qtail = prev;
        return p;
    }
    return NULL;
}

/*
 * Under c->mu, p (x's own piece) just taken by its waiting caller: also take the held
 * pieces of other transfers on the same session (their callers will wait too, and no
 * worker was signalled for them), up to PIPE_MAX pieces and PIPE_BYTES, so that the READs
 * of transfers started together go out in one send and their answers come back on one
 * connection with no hand-off to a worker.
 */
static int wait_group_take(kvx_client *c, kvx__piece *p, kvx__piece **group)
{
    return group_take_from(c, p, group, true);
}

int kvx_xfer_wait(kvx_xfer *x, td_err *result)
{
    kvx_client *c = x->c;
    bool help = wait_helps(c);
    pthread_mutex_lock(&c->mu);
    unhold(c, x); /* its piece is this thread's to run */
    kvx__piece *group[PIPE_MAX];
    int failed[PIPE_MAX], n = 0;
    kvx__piece *own = help ? take_own(c, x) : NULL;
    if (own) n = wait_group_take(c, own, group);
    /* Other transfers' held pieces get their workers now: a caller that starts several
     * and waits for each in turn keeps them running together. */
    int n_released = 0, n_piped = 0; /* pieces released: alone, and to be pipelined */
    kvx__session *piped_s = NULL;    /* the session of those, NULL if several */
    for (kvx__piece *q = c->wake_debt > 0 ? c->qhead : NULL; q; q = q->next)
        if (unhold(c, q->x)) {
            if (pipelinable(c, q)) {
                piped_s = n_piped++ == 0 || piped_s == q->x->s ? q->x->s : NULL;
            } else {
                n_released++;
            }
        }
    /* Pieces of one session go out in groups of PIPE_MAX, a worker each; of several
     * sessions, a worker per piece as before. */
    wake_workers(c, n_released + (piped_s ? (n_piped + PIPE_MAX - 1) / PIPE_MAX : n_piped));
    while (n > 0 || !x->done) {
        if (n == 0) {
            kvx__piece *p = help ? take_own(c, x) : NULL;
            if (!p) {
                pthread_cond_wait(&c->done_cv, &c->mu);
                continue;
            }
            group[0] = p;
            n = 1;
        }
        for (int i = 0; i < n; i++)
            failed[i] = group[i]->x->code;
        pthread_mutex_unlock(&c->mu);
        atomic_fetch_add(&kvx__test_pieces_helped, n);
        group_run(c, group, failed, n);
        n = 0;
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    if (result) *result = x->result;
    return x->code;
}

void kvx_xfer_free(kvx_xfer *x)
{
    if (!x) return;
    kvx_client *c = x->c;
    pthread_mutex_lock(&c->mu);
    release_held(c, x);
    bool now = x->done;
    x->detached = true;
    pthread_mutex_unlock(&c->mu);
    if (now) xfer_free_mem(x);
}

void kvx_xfer_get_info(kvx_xfer *x, kvx_xfer_info *out)
{
    pthread_mutex_lock(&x->c->mu);
    *out = x->info;
    pthread_mutex_unlock(&x->c->mu);
}

static int control(kvx_client *c, uint8_t type, const char *host, uint16_t port,
                   const char *engine_id, const char *transfer_id, td_err *err)
{
    uint8_t id[KVX_ID_BYTES];
    if (kvx_id_from_hex(transfer_id, id))
        return td_err_set(err, TD_EINVAL, "kvx: transfer id must be 32 hex digits");
    kvx__session *s;
    int rc = session_get(c, host, port, engine_id, -1, &s, err);
    if (rc) return rc;
    uint64_t deadline = td_now_ns() + (uint64_t)c->opts.transfer_timeout_ms * 1000000ull;
    rc = c->transport->control(s, type, id, deadline, err);
    session_put(s);
    return rc;
}

int kvx_release(kvx_client *c, const char *host, uint16_t port, const char *engine_id,
                const char *transfer_id, td_err *err)
{
    return control(c, KVX_MSG_RELEASE, host, port, engine_id, transfer_id, err);
}

int kvx_heartbeat(kvx_client *c, const char *host, uint16_t port, const char *engine_id,
                  const char *transfer_id, td_err *err)
{
    return control(c, KVX_MSG_HEARTBEAT, host, port, engine_id, transfer_id, err);
}

int kvx_session_check(kvx_client *c, const char *host, uint16_t port, const char *engine_id,
                      td_err *err)
{
    kvx__session *s;
    int rc = session_get(c, host, port, engine_id, data_rail(c), &s, err);
    if (rc) return rc;
    int fd;
    bool fresh;
    uint64_t deadline = td_now_ns() + (uint64_t)c->opts.transfer_timeout_ms * 1000000ull;
    rc = conn_get(s, NULL, deadline, true, false, &fd, &fresh, err);
    if (!rc) conn_put(s, fd, true);
    session_put(s);
    return rc;
}
