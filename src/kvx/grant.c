/*
 * kvx/grant.c - the pin exchange that the copy-out-of-the-producer transports (shm,
 * cuda_ipc) share: a session's pool of idle control connections, and per piece
 * UCX_GRANT -> UCX_GRANTED ... copy ... UCX_DONE (see shm.c for the protocol's reasons).
 */
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

void kvx__grant_pool_init(kvx__grant_pool *gp)
{
    memset(gp, 0, sizeof(*gp));
    pthread_mutex_init(&gp->mu, NULL);
}

void kvx__grant_pool_fini(kvx__grant_pool *gp)
{
    for (int i = 0; i < gp->n_idle; i++)
        close(gp->idle[i]);
    gp->n_idle = 0;
    pthread_mutex_destroy(&gp->mu);
}

static int conn_take(struct kvx__session *s, kvx__grant_pool *gp, uint64_t deadline,
                     bool want_fresh, int *fd, bool *fresh, td_err *err)
{
    pthread_mutex_lock(&gp->mu);
    while (gp->n_idle > 0 && !want_fresh) {
        *fd = gp->idle[--gp->n_idle];
        /* An idle connection has nothing to read: readable means the producer hung up
         * (it restarted or went away), so drop it and let a fresh handshake say why. */
        struct pollfd pf = {.fd = *fd, .events = POLLIN};
        if (poll(&pf, 1, 0) != 0) {
            close(*fd);
            continue;
        }
        pthread_mutex_unlock(&gp->mu);
        *fresh = false;
        return 0;
    }
    pthread_mutex_unlock(&gp->mu);
    *fresh = true;
    return kvx__session_connect(s, deadline, fd, err);
}

static void conn_give(kvx__grant_pool *gp, int fd, bool ok)
{
    pthread_mutex_lock(&gp->mu);
    if (ok && gp->n_idle < KVX__GRANT_MAX_IDLE) {
        gp->idle[gp->n_idle++] = fd;
        fd = -1;
    }
    pthread_mutex_unlock(&gp->mu);
    if (fd >= 0) close(fd);
}

uint8_t *kvx__grant_request(struct kvx__piece *p, bool want_crc, size_t *n)
{
    kvx__piece_info pi;
    kvx__piece_get_info(p, &pi);
    size_t cap = KVX_HDR_BYTES + 24 + (size_t)pi.count * KVX_DESC_BYTES;
    uint8_t *req = malloc(cap);
    kvx_wire_desc *wd = malloc((pi.count ? pi.count : 1) * sizeof(*wd));
    if (!req || !wd) {
        free(req);
        free(wd);
        return NULL;
    }
    for (uint32_t k = 0; k < pi.count; k++) {
        kvx__piece_range d = kvx__piece_get_range(p, k);
        wd[k] = (kvx_wire_desc){d.seg, d.src, d.n};
    }
    *n = kvx_wire_encode_grant(req, cap, pi.tag, pi.transfer_id, want_crc ? KVX_READ_CHECKSUMS : 0,
                               wd, pi.count);
    TD_ASSERT(*n > 0);
    free(wd);
    return req;
}

int kvx__grant_pin(struct kvx__session *s, kvx__grant_pool *gp, struct kvx__piece *p, bool want_crc,
                   const char *what, kvx__grant_setup_fn setup, void *user, kvx__grant *g,
                   td_err *err)
{
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    kvx__piece_info pi;
    kvx__piece_get_info(p, &pi);
    memset(g, 0, sizeof(*g));
    g->fd = -1;
    g->tag = pi.tag;
    g->deadline_ns = pi.deadline_ns;
    g->in_cap = 8 + 4 * (size_t)(want_crc ? pi.blocks : 0) + 512;
    size_t req_n = 0;
    uint8_t *req = kvx__grant_request(p, want_crc, &req_n);
    g->in = malloc(g->in_cap);
    int rc = 0, fd = -1;
    if (!req || !g->in) {
        rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        goto out;
    }
    for (int attempt = 0;; attempt++) {
        bool fresh;
        rc = conn_take(s, gp, pi.deadline_ns, attempt > 0, &fd, &fresh, err);
        if (rc) {
            fd = -1;
            goto out;
        }
        if (setup) {
            pthread_mutex_lock(&gp->mu);
            rc = setup(s, user, fd, pi.deadline_ns, err);
            pthread_mutex_unlock(&gp->mu);
            if (rc) goto out;
        }
        rc = kvx__send_all(fd, req, req_n, pi.deadline_ns, err);
        if (!rc) rc = kvx__recv_frame(fd, g->in, g->in_cap, &g->m, pi.deadline_ns, err);
        if (!rc) break;
        close(fd);
        fd = -1;
        /* A pooled connection may have died with its producer's previous life: retry once
         * on a fresh one, whose handshake says what really happened. */
        if (rc != TD_ECONN || fresh || attempt > 0) goto out;
    }
    if (g->m.hdr.type == KVX_MSG_ERROR) {
        conn_give(gp, fd, true);
        fd = -1;
        rc = td_err_set(err, g->m.u.error.code, "kvx: producer %s:%u: %s", host, port,
                        g->m.u.error.msg);
        goto out;
    }
    uint32_t want_n_crc = want_crc ? (uint32_t)pi.blocks : 0;
    if (g->m.hdr.type != KVX_MSG_UCX_GRANTED || g->m.hdr.tag != pi.tag ||
        g->m.u.ucx_granted.n_crc != want_n_crc ||
        g->m.u.ucx_granted.stage_off != KVX_NOT_STAGED) { /* these copy in place */
        rc = td_err_set(err, TD_EPROTO,
                        "kvx %s: producer %s:%u answered the grant with %s (tag %u, %u "
                        "checksums; expected UCX_GRANTED in place, tag %u, %u checksums)",
                        what, host, port, kvx_wire_type_name(g->m.hdr.type), g->m.hdr.tag,
                        g->m.u.ucx_granted.n_crc, pi.tag, want_n_crc);
        goto out;
    }
    g->fd = fd;
    fd = -1;
out:
    if (fd >= 0) close(fd); /* closing also unpins */
    free(req);
    if (rc) {
        free(g->in);
        g->in = NULL;
    }
    return rc;
}

void kvx__grant_done(kvx__grant_pool *gp, kvx__grant *g)
{
    if (g->fd >= 0) {
        /* Unpin. The connection stays usable after a checksum mismatch or a bad range. */
        uint8_t buf[KVX_HDR_BYTES];
        size_t n = kvx_wire_encode_empty(buf, sizeof(buf), KVX_MSG_UCX_DONE, g->tag);
        td_err e;
        bool sent = kvx__send_all(g->fd, buf, n, g->deadline_ns, &e) == 0;
        conn_give(gp, g->fd, sent);
        g->fd = -1;
    }
    free(g->in);
    g->in = NULL;
}

void *kvx__session_state_get(struct kvx__session *s, size_t size, void (*drop)(void *))
{
    void **slot = kvx__session_transport_state(s);
    /* Sessions are created under the client's lock in client.c, but their state on first
     * use: two workers racing on a fresh session settle it by compare-and-swap. */
    void *st = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (st) return st;
    /* every such state begins with its grant pool */
    kvx__grant_pool *fresh = calloc(1, size);
    if (!fresh) return NULL;
    kvx__grant_pool_init(fresh);
    void *expected = NULL;
    if (__atomic_compare_exchange_n(slot, &expected, (void *)fresh, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE))
        return fresh;
    drop(fresh);
    return expected;
}

int kvx__info_ask(struct kvx__session *s, int fd, uint8_t ask, uint8_t answer, const char *what,
                  uint8_t *buf, size_t cap, kvx_msg *m, uint64_t deadline_ns, td_err *err)
{
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    size_t n = kvx_wire_encode_empty(buf, cap, ask, 7);
    int rc = kvx__send_all(fd, buf, n, deadline_ns, err);
    if (!rc) rc = kvx__recv_frame(fd, buf, cap, m, deadline_ns, err);
    if (rc) return rc;
    if (m->hdr.type == KVX_MSG_ERROR)
        return td_err_set(err, m->u.error.code == TD_EUNSUPPORTED ? TD_EUNSUPPORTED : TD_EPROTO,
                          "kvx %s: producer %s:%u: %s", what, host, port, m->u.error.msg);
    if (m->hdr.type != answer)
        return td_err_set(err, TD_EPROTO, "kvx %s: producer %s:%u answered %s with %s", what, host,
                          port, kvx_wire_type_name(ask), kvx_wire_type_name(m->hdr.type));
    return 0;
}
