/*
 * kvx/agent.c - the producer side: the handshake listener, leases on registered
 * transfers, and serving READs straight from the registered region.
 *
 * Threads: one accept thread, one lease thread (expiry), and one thread per accepted
 * connection. Connections are few (consumers x qp_per_transfer) and each serves one
 * request at a time with blocking-style I/O bounded by a send deadline, so a thread per
 * connection is the simplest design that never lets one slow consumer stall another.
 *
 * Lease lifetime: a lease is in `leases` while it can be read. Release, expiry or cancel
 * removes it from the table at once (no new read can find it); its blocks go back through
 * release_cb only when the reads already under way on it (`inflight`) have finished, so
 * the owner never reuses a block that is still being sent.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

#define SEND_TIMEOUT_NS (30ull * 1000000000ull)
#define HELLO_TIMEOUT_NS (10ull * 1000000000ull)

typedef struct lease {
    uint8_t id[KVX_ID_BYTES];
    char hex[KVX_ID_HEX];
    int32_t *blocks; /* in the caller's order, for release_cb */
    int32_t *sorted; /* for membership checks */
    int n_blocks;
    uint64_t lease_ns, expires_ns;
    int inflight;
    bool dead;
    kvx_release_reason reason;
    void *user;
    /* Push transfers (kvx_agent_push_open): blocks[0 .. n_known) are known; in segment s,
     * prompt blocks [0, ready[s]) are final. index holds (block id << 32 | prompt index)
     * of the known blocks, sorted, for checking reads. All under agent->mu. */
    bool push, finished, claimed;
    uint32_t *ready;
    uint64_t *index;
    uint32_t n_known;
    uint8_t note[KVX_MAX_NOTE];
    uint32_t note_len;
} lease;

typedef struct conn {
    int fd;
    struct kvx_agent *agent;
    struct conn *next;
    /* Under agent->mu: it has not proved itself yet (HELLO, and AUTH where a token is set);
     * such connections have limits of their own (accept_main). peer: its address. */
    bool preauth;
    struct sockaddr_storage peer;
    bool pinned; /* holds a grant's pin (under agent->mu): kvx_agent_destroy waits for it */
    int rail;    /* the rail engine that accepted it, -1 for the handshake listener */
    struct listener *listener; /* that engine */
    /* A ucx channel to a staging UCX engine (its UCX_INFO was answered with a staging
     * area): its grants are copied into a staging slot (ucx.c). */
    struct kvx__ucx_agent *ucx_stage;
} conn;

/* A listening socket and its accept thread: the handshake listener (rail -1), or a rail's
 * engine on the tcp transport (bound to the rail's address and device). */
typedef struct listener {
    struct kvx_agent *agent;
    int fd, rail;
    uint16_t port;
    char addr[64];
    _Atomic bool stop;
    pthread_t thread;
    /* A rail's UCX engine (protocol ucx): a context restricted to the rail's device, with
     * the region registered under its own keys; made on the rail's first UCX_INFO, under
     * agent->mu, and kept (or its error) until the agent goes. */
    struct kvx__ucx_agent *ucx;
    bool ucx_tried;
    char ucx_error[256];
} listener;

struct kvx_agent {
    kvx_agent_opts opts;
    uint8_t engine_id[KVX_ID_BYTES];
    char engine_hex[KVX_ID_HEX];
    kvx_hello hello;
    int listen_fd;
    uint16_t port;
    pthread_t accept_thread, lease_thread;
    listener main_listener;
    /* Rails (opts.rails): a copy of the list, each rail's engine (a listener), reads per
     * rail. railpool is NULL without rails. */
    kvx_rails rails;
    kvx__railpool *railpool;
    char rail_addr[KVX_MAX_RAILS][64];

    pthread_mutex_t mu;
    pthread_cond_t cv;   /* lease thread wake-ups; connection exits */
    uint64_t lease_next; /* when the lease thread plans to wake (0: it is not asleep) */
    int n_write_waiting; /* WRITEs waiting for their transfer id to be registered */
    bool stopping;
    lease **leases;
    int n_leases, cap_leases;
    conn *conns;
    int n_conns, n_preauth;
    uint64_t warn_ns; /* warn_peer: when the last warning was logged, and those held back */
    int warn_held;
    kvx_agent_stats stats;
    char last_error[320];
    char token[256]; /* auth_token ("" = no authentication), wiped at destroy */
    /* The ucx transport (ucx.c): created on the first UCX_INFO, under mu. */
    struct kvx__ucx_agent *ucx;
    bool ucx_tried;
    char ucx_error[256];
};

void kvx_agent_opts_default(kvx_agent_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->host = "127.0.0.1";
    o->lease_ms = 30000;
    o->checksums = true;
    o->max_connections = 256;
}

static void set_last_error(kvx_agent *a, const char *msg)
{
    pthread_mutex_lock(&a->mu);
    snprintf(a->last_error, sizeof(a->last_error), "%s", msg);
    pthread_mutex_unlock(&a->mu);
}

void kvx_agent_last_error(kvx_agent *a, char *buf, size_t cap)
{
    pthread_mutex_lock(&a->mu);
    snprintf(buf, cap, "%s", a->last_error);
    pthread_mutex_unlock(&a->mu);
}

uint16_t kvx_agent_port(const kvx_agent *a)
{
    return a->port;
}

const char *kvx_agent_engine_id(const kvx_agent *a)
{
    return a->engine_hex;
}

_Static_assert(KVX_MAX_RAILS == sizeof(((kvx_agent_stats *)0)->rail_reads) / sizeof(uint64_t),
               "kvx_agent_stats.rail_reads holds one counter per rail");

static void lease_free(lease *l)
{
    free(l->blocks);
    free(l->sorted);
    free(l->ready);
    free(l->index);
    free(l);
}

static void lease_give_back(kvx_agent *a, lease *l)
{
    if (a->opts.release_cb)
        a->opts.release_cb(a->opts.release_user, l->hex, l->blocks, l->n_blocks, l->reason,
                           l->user);
    lease_free(l);
}

/* Under a->mu: index of the lease with this id, or -1. */
static int lease_find(kvx_agent *a, const uint8_t id[KVX_ID_BYTES])
{
    for (int i = 0; i < a->n_leases; i++)
        if (!memcmp(a->leases[i]->id, id, KVX_ID_BYTES)) return i;
    return -1;
}

/*
 * Under a->mu: take lease i out of the table with `reason`. Returns the lease if the
 * caller must give it back now (after unlocking), NULL if a read in flight will.
 */
static lease *lease_remove(kvx_agent *a, int i, kvx_release_reason reason)
{
    lease *l = a->leases[i];
    a->leases[i] = a->leases[--a->n_leases];
    l->dead = true;
    l->reason = reason;
    if (reason == KVX_RELEASED_EXPIRED)
        a->stats.leases_expired++;
    else
        a->stats.leases_released++;
    return l->inflight == 0 ? l : NULL;
}

static int cmp_i32(const void *x, const void *y)
{
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

int kvx_agent_register(kvx_agent *a, const int32_t *blocks, int n_blocks, uint32_t lease_ms,
                       void *transfer_user, char id_out[KVX_ID_HEX], td_err *err)
{
    if (n_blocks < 1) return td_err_set(err, TD_EINVAL, "kvx: a transfer needs blocks");
    for (int i = 0; i < n_blocks; i++)
        if (blocks[i] < 0 || (uint32_t)blocks[i] >= a->opts.region.n_blocks)
            return td_err_set(err, TD_EINVAL, "kvx: block id %d outside the region (0..%u)",
                              blocks[i], a->opts.region.n_blocks - 1);
    lease *l = calloc(1, sizeof(*l));
    if (!l) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    l->blocks = malloc((size_t)n_blocks * sizeof(int32_t));
    l->sorted = malloc((size_t)n_blocks * sizeof(int32_t));
    if (!l->blocks || !l->sorted || kvx__random_id(l->id)) {
        lease_free(l);
        return td_err_set(err, TD_ENOMEM, "kvx: cannot allocate a transfer");
    }
    memcpy(l->blocks, blocks, (size_t)n_blocks * sizeof(int32_t));
    memcpy(l->sorted, blocks, (size_t)n_blocks * sizeof(int32_t));
    qsort(l->sorted, (size_t)n_blocks, sizeof(int32_t), cmp_i32);
    l->n_blocks = n_blocks;
    kvx_id_to_hex(l->id, l->hex);
    l->lease_ns = (uint64_t)(lease_ms ? lease_ms : a->opts.lease_ms) * 1000000ull;
    l->expires_ns = td_now_ns() + l->lease_ns;
    l->user = transfer_user;

    pthread_mutex_lock(&a->mu);
    if (a->n_leases == a->cap_leases) {
        int cap = a->cap_leases ? 2 * a->cap_leases : 64;
        lease **nl = realloc(a->leases, (size_t)cap * sizeof(*nl));
        if (!nl) {
            pthread_mutex_unlock(&a->mu);
            lease_free(l);
            return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        }
        a->leases = nl;
        a->cap_leases = cap;
    }
    a->leases[a->n_leases++] = l;
    /* Wake the lease thread only when this lease expires before it would wake anyway (a
     * wake-up per registration cost each prefill a context switch), and WRITEs waiting for
     * an id (so that one for this id hears at once that it is not a push transfer). */
    if (l->expires_ns < a->lease_next || a->n_write_waiting > 0) pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    memcpy(id_out, l->hex, KVX_ID_HEX);
    return 0;
}

int kvx_agent_cancel(kvx_agent *a, const char *transfer_id)
{
    uint8_t id[KVX_ID_BYTES];
    if (kvx_id_from_hex(transfer_id, id)) return TD_ENOTFOUND;
    pthread_mutex_lock(&a->mu);
    int i = lease_find(a, id);
    lease *now = i >= 0 ? lease_remove(a, i, KVX_RELEASED_CANCELED) : NULL;
    pthread_mutex_unlock(&a->mu);
    if (now) lease_give_back(a, now);
    return i >= 0 ? 0 : TD_ENOTFOUND;
}

int kvx_agent_n_leases(kvx_agent *a)
{
    pthread_mutex_lock(&a->mu);
    int n = a->n_leases;
    pthread_mutex_unlock(&a->mu);
    return n;
}

void kvx_agent_get_stats(kvx_agent *a, kvx_agent_stats *out)
{
    pthread_mutex_lock(&a->mu);
    *out = a->stats;
    pthread_mutex_unlock(&a->mu);
}

/* The lease thread: expires leases whose deadline passed without a read or heartbeat. */
static void *lease_main(void *arg)
{
    kvx_agent *a = arg;
    pthread_mutex_lock(&a->mu);
    while (!a->stopping) {
        uint64_t now = td_now_ns(), next = now + 1000000000ull;
        for (int i = 0; i < a->n_leases;) {
            lease *l = a->leases[i];
            if (l->expires_ns <= now) {
                lease *give = lease_remove(a, i, KVX_RELEASED_EXPIRED);
                if (give) {
                    pthread_mutex_unlock(&a->mu);
                    lease_give_back(a, give);
                    pthread_mutex_lock(&a->mu);
                }
                i = 0; /* the table changed while unlocked */
                now = td_now_ns();
                continue;
            }
            if (l->expires_ns < next) next = l->expires_ns;
            i++;
        }
        a->lease_next = next;
        kvx__cond_wait_until(&a->cv, &a->mu, next);
        a->lease_next = 0;
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

/* ---------------------------------------------------------------- serving a connection */

typedef struct conn_bufs {
    uint8_t *in;  /* the connection's frames, read ahead (kvx__rbuf) */
    uint8_t *out; /* a checksum trailer or a small answer */
    size_t out_cap;
    struct iovec *iov; /* 1 + KVX_MAX_DESC */
    uint32_t *crc;     /* KVX_MAX_CRC */
} conn_bufs;

static int send_error(int fd, conn_bufs *b, uint32_t tag, int code, const char *msg)
{
    td_err e;
    size_t n = kvx_wire_encode_error(b->out, b->out_cap, tag, code, msg);
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a > b) - (a < b);
}

/* Under a->mu: whether block b of a push transfer is final in segment seg. */
static bool push_block_ready(const lease *l, uint32_t seg, uint32_t b)
{
    size_t lo = 0, hi = l->n_known;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((l->index[mid] >> 32) < b) lo = mid + 1;
        else hi = mid;
    }
    if (lo == l->n_known || (l->index[lo] >> 32) != b) return false;
    return (uint32_t)l->index[lo] < l->ready[seg];
}

static bool lease_has_block(const lease *l, uint32_t b)
{
    int32_t key = (int32_t)b;
    return bsearch(&key, l->sorted, (size_t)l->n_blocks, sizeof(int32_t), cmp_i32) != NULL;
}

/*
 * Host memory goes out in writes of up to SEND_BYTES, as large as the largest piece a
 * consumer asks for (client.c), so a piece is usually one sendmsg. Where the producer has
 * no kept checksum for a block (--producer-checksums grant, a partial last block), the
 * write's blocks are checksummed just before it is handed to the kernel, so that the copy
 * into the socket finds them in cache (at most 8 MiB a connection). Writes of 256 KiB, as
 * before, cost 16-64 MiB transfers a quarter to a third of their CPU per byte over loopback
 * TCP (BENCHMARKS.md, kvx). The checksums follow the data (the trailer).
 *
 * GPU memory goes through pinned host staging in batches of about STAGE_BYTES
 * (send_staged).
 */
#define SEND_BYTES KVX__MAX_PIECE_BYTES
#define STAGE_BYTES (256u << 10)

/* Find a lease and pin it (inflight) so that it cannot be given back; NULL if unknown. */
static lease *lease_pin(kvx_agent *a, const uint8_t id[KVX_ID_BYTES])
{
    pthread_mutex_lock(&a->mu);
    int i = lease_find(a, id);
    lease *l = i >= 0 ? a->leases[i] : NULL;
    if (l) {
        l->inflight++;
        if (!l->push || l->finished) /* an unfinished push has no lease yet */
            l->expires_ns = td_now_ns() + l->lease_ns; /* a read is a sign of life */
    } else {
        a->stats.unknown_transfer++;
    }
    pthread_mutex_unlock(&a->mu);
    return l;
}

/* Undo lease_pin; a lease that was removed meanwhile goes back to its owner now. */
static void lease_unpin(kvx_agent *a, lease *l, uint64_t bytes_read)
{
    pthread_mutex_lock(&a->mu);
    lease *give = --l->inflight == 0 && l->dead ? l : NULL;
    if (bytes_read) {
        a->stats.bytes_sent += bytes_read;
        a->stats.reads++;
    }
    pthread_mutex_unlock(&a->mu);
    if (give) lease_give_back(a, give);
}

/*
 * Check a READ's (or UCX_GRANT's) ranges against the region and the lease: on success
 * *total and *n_blocks say what it covers; else msg says why (TD_ERANGE).
 */
static bool ranges_ok(kvx_agent *a, const lease *l, const kvx_msg *m, bool want_crc,
                      uint64_t *total_out, uint64_t *n_blocks_out, char *msg, size_t cap)
{
    const kvx_region *r = &a->opts.region;
    uint64_t total = 0, n_blocks = 0;
    msg[0] = 0;
    if (l->push) pthread_mutex_lock(&a->mu); /* its progress moves under the lock */
    for (uint32_t k = 0; k < m->u.read.n_desc && !msg[0]; k++) {
        kvx_wire_desc d = kvx_wire_get_desc(m, k);
        if (d.segment >= r->n_segments || d.block >= r->n_blocks ||
            d.n_blocks > r->n_blocks - d.block) {
            snprintf(msg, cap,
                     "descriptor %u (segment %u, blocks %u+%u) is outside the "
                     "region",
                     k, d.segment, d.block, d.n_blocks);
            break;
        }
        for (uint32_t j = 0; j < d.n_blocks; j++)
            if (l->push ? !push_block_ready(l, d.segment, d.block + j)
                        : !lease_has_block(l, d.block + j)) {
                snprintf(msg, cap, "block %u is not part of this transfer%s", d.block + j,
                         l->push ? " or not computed yet in that segment" : "");
                break;
            }
        n_blocks += d.n_blocks;
        total += (uint64_t)d.n_blocks * r->block_bytes;
    }
    if (l->push) pthread_mutex_unlock(&a->mu);
    if (!msg[0] && want_crc && n_blocks > KVX_MAX_CRC)
        snprintf(msg, cap, "%s covers more than %u blocks", kvx_wire_type_name(m->hdr.type),
                 KVX_MAX_CRC);
    *total_out = total;
    *n_blocks_out = n_blocks;
    return msg[0] == 0;
}

/*
 * The checksums of n consecutive blocks of one segment: the ones the region's owner kept
 * as it wrote them, and the others computed here (runs of them at once).
 */
static void region_crcs(const kvx_region *r, uint32_t seg, uint32_t block, uint32_t n,
                        uint32_t *out)
{
    const uint8_t *p = (const uint8_t *)r->base + kvx__offset(r, seg, block);
    if (!r->block_crc || !r->block_crc_ok) {
        td_crc32c_blocks(p, r->block_bytes, n, out);
        return;
    }
    size_t i0 = (size_t)seg * r->n_blocks + block;
    for (uint32_t j = 0; j < n;) {
        if (r->block_crc_ok[i0 + j]) {
            out[j] = r->block_crc[i0 + j];
            j++;
            continue;
        }
        uint32_t e = j + 1;
        while (e < n && !r->block_crc_ok[i0 + e]) e++;
        td_crc32c_blocks(p + (uint64_t)j * r->block_bytes, r->block_bytes, e - j, out + j);
        j = e;
    }
}

/*
 * READ out of GPU memory, through pinned host staging in two halves, so that the copy of
 * one batch off the device overlaps the send of the one before: a batch's copies are
 * started into a half (its slot), then the other half's batch is waited for, checksummed
 * there and sent. A batch holds under 2 per_chunk blocks (STAGE_BYTES each) and at most
 * one entry per descriptor. hdr (hn bytes, or none) goes before the first batch,
 * the checksum trailer after the last.
 */
typedef struct staged_batch {
    struct iovec *iov; /* KVX_MAX_DESC + 2: header, entries, trailer */
    int n_iov, first; /* first: the index of its first block entry (1 after the header) */
    uint32_t crc_at;  /* its first block's index among the READ's blocks */
    bool live;
} staged_batch;

static int staged_send(int fd, conn_bufs *b, const kvx_region *r, staged_batch *sb, int slot,
                       bool want_crc, uint32_t n_crc, bool last, uint64_t deadline, td_err *e)
{
    int rc = kvx__stage_wait(r->device_id, slot, e);
    uint32_t at = sb->crc_at;
    for (int v = sb->first; v < sb->n_iov && !rc && want_crc; v++) {
        uint32_t nb = (uint32_t)(sb->iov[v].iov_len / r->block_bytes);
        td_crc32c_blocks(sb->iov[v].iov_base, r->block_bytes, nb, b->crc + at);
        at += nb;
    }
    if (!rc && last && n_crc) {
        kvx_wire_trailer_put(b->out, b->crc, n_crc);
        sb->iov[sb->n_iov++] = (struct iovec){b->out, (size_t)n_crc * 4};
    }
    if (!rc && sb->n_iov) rc = kvx__writev_all(fd, sb->iov, sb->n_iov, deadline, e);
    sb->live = false;
    sb->n_iov = 0;
    return rc;
}

static int send_staged(int fd, conn_bufs *b, const kvx_region *r, const kvx_msg *m, uint8_t *stage,
                       bool want_crc, uint32_t n_crc, uint8_t *hdr, size_t hn, uint64_t deadline,
                       td_err *e)
{
    const uint32_t per_chunk = kvx__batch_blocks(r->block_bytes, STAGE_BYTES);
    const size_t half = 2 * (size_t)per_chunk * r->block_bytes;
    struct iovec *iovs = malloc(2 * (KVX_MAX_DESC + 2) * sizeof(*iovs));
    if (!iovs) return td_err_set(e, TD_ENOMEM, "kvx: out of memory");
    staged_batch sb[2] = {{iovs, 0, 0, 0, false}, {iovs + KVX_MAX_DESC + 2, 0, 0, 0, false}};
    int cur = 0, rc = 0;
    uint64_t fill = 0;
    uint32_t blocks = 0;
    if (hn) sb[0].iov[sb[0].n_iov++] = (struct iovec){hdr, hn};
    sb[0].first = sb[0].n_iov;
    for (uint32_t k = 0; k < m->u.read.n_desc && !rc; k++) {
        kvx_wire_desc d = kvx_wire_get_desc(m, k);
        const uint8_t *p = (const uint8_t *)r->base + kvx__offset(r, d.segment, d.block);
        for (uint32_t j = 0; j < d.n_blocks && !rc;) {
            uint32_t cb = TD_MIN(d.n_blocks - j, per_chunk);
            size_t n = (size_t)cb * r->block_bytes;
            uint8_t *to = stage + (size_t)cur * half + fill;
            rc = kvx__stage_copy_start(r->device_id, cur, to, p + (uint64_t)j * r->block_bytes, n,
                                       false, e);
            if (rc) break;
            sb[cur].iov[sb[cur].n_iov++] = (struct iovec){to, n};
            fill += n;
            blocks += cb;
            j += cb;
            if (fill < (uint64_t)per_chunk * r->block_bytes) continue;
            /* this batch is full: send the one before (its copies started earlier) */
            sb[cur].live = true;
            if (sb[!cur].live)
                rc = staged_send(fd, b, r, &sb[!cur], !cur, want_crc, n_crc, false, deadline, e);
            cur = !cur;
            fill = 0;
            sb[cur].n_iov = sb[cur].first = 0;
            sb[cur].crc_at = blocks;
        }
    }
    if (!rc && sb[cur].n_iov > 0) sb[cur].live = true;
    /* in order: the older batch, then the newer, which carries the trailer */
    if (!rc && sb[!cur].live)
        rc = staged_send(fd, b, r, &sb[!cur], !cur, want_crc, n_crc, !sb[cur].live, deadline, e);
    if (!rc && sb[cur].live)
        rc = staged_send(fd, b, r, &sb[cur], cur, want_crc, n_crc, true, deadline, e);
    /* never leave a copy running into a buffer the next READ reuses */
    td_err ignore;
    kvx__stage_wait(r->device_id, 0, &ignore);
    kvx__stage_wait(r->device_id, 1, &ignore);
    free(iovs);
    return rc;
}

/* READ: validate against the lease, then stream header, data and checksum trailer. */
static int serve_read(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m)
{
    uint32_t tag = m->hdr.tag;
    lease *l = lease_pin(a, m->u.read.transfer_id);
    if (!l) return send_error(fd, b, tag, TD_ENOTFOUND, "unknown or expired transfer id");

    const kvx_region *r = &a->opts.region;
    bool want_crc = (m->u.read.flags & KVX_READ_CHECKSUMS) && a->opts.checksums;
    uint64_t total = 0, n_blocks = 0;
    int rc = 0;
    char msg[200] = "";
    ranges_ok(a, l, m, want_crc, &total, &n_blocks, msg, sizeof(msg));
    /* GPU memory goes out through pinned host staging (send_staged): two halves of twice
     * a batch each. */
    int test_send = atomic_load(&kvx__test_send_bytes);
    uint32_t at = 0, per_chunk = kvx__batch_blocks(
                         r->block_bytes, test_send > 0 ? (uint64_t)test_send : SEND_BYTES);
    uint8_t *stage = NULL;
    td_err se;
    if (!msg[0] && r->device &&
        kvx__stage_buf(r->device_id,
                       4 * (size_t)kvx__batch_blocks(r->block_bytes, STAGE_BYTES) * r->block_bytes,
                       &stage, &se))
        snprintf(msg, sizeof(msg), "%.190s", se.msg);
    if (msg[0]) {
        rc = send_error(fd, b, tag, stage || !r->device ? TD_ERANGE : TD_ENOMEM, msg);
    } else {
        uint32_t n_crc = want_crc ? (uint32_t)n_blocks : 0;
        uint8_t hdr[KVX_HDR_BYTES + 12];
        size_t hn = kvx_wire_encode_data(hdr, sizeof(hdr), tag, total, n_crc);
        td_err e;
        uint64_t deadline = td_now_ns() + SEND_TIMEOUT_NS;
        int n_iov = 0, delay = atomic_load(&kvx__test_send_delay_ms);
        if (delay > 0) {
            rc = kvx__send_all(fd, hdr, hn, deadline, &e);
            atomic_fetch_add(&kvx__test_sends_delayed, 1);
            usleep((useconds_t)delay * 1000);
            hn = 0;
        } else {
            b->iov[n_iov++] = (struct iovec){hdr, hn};
        }
        if (stage) {
            if (!rc) rc = send_staged(fd, b, r, m, stage, want_crc, n_crc, hdr, hn, deadline, &e);
            lease_unpin(a, l, !rc ? total : 0);
            return rc;
        }
        uint64_t batch = 0;
        for (uint32_t k = 0; k < m->u.read.n_desc && !rc; k++) {
            kvx_wire_desc d = kvx_wire_get_desc(m, k);
            uint8_t *p = (uint8_t *)r->base + kvx__offset(r, d.segment, d.block);
            for (uint32_t j = 0; j < d.n_blocks && !rc;) {
                uint32_t cb = TD_MIN(d.n_blocks - j, per_chunk);
                uint8_t *q = p + (uint64_t)j * r->block_bytes;
                if (want_crc) region_crcs(r, d.segment, d.block + j, cb, b->crc + at);
                at += cb;
                b->iov[n_iov++] = (struct iovec){q, (size_t)cb * r->block_bytes};
                batch += (uint64_t)cb * r->block_bytes;
                j += cb;
                /* A batch ends at per_chunk blocks, so it holds at most one entry per
                 * descriptor and b->iov (1 + KVX_MAX_DESC + trailer) always suffices. The
                 * last batch waits for the trailer below, whether full or not. */
                bool last = k + 1 == m->u.read.n_desc && j == d.n_blocks;
                if (batch >= (uint64_t)per_chunk * r->block_bytes && !last) {
                    rc = kvx__writev_all(fd, b->iov, n_iov, deadline, &e);
                    n_iov = 0;
                    batch = 0;
                }
            }
        }
        /* The trailer rides with the last batch: one send, and one wake-up on the consumer. */
        if (!rc && n_crc) {
            kvx_wire_trailer_put(b->out, b->crc, n_crc);
            b->iov[n_iov++] = (struct iovec){b->out, (size_t)n_crc * 4};
        }
        if (!rc && n_iov) rc = kvx__writev_all(fd, b->iov, n_iov, deadline, &e);
    }

    lease_unpin(a, l, !rc && !msg[0] ? total : 0);
    return rc;
}

/*
 * UCX_GRANT: the consumer will read these ranges itself with one-sided UCX gets. Check
 * them like a READ, pin the lease (so its blocks cannot be given back while the gets may
 * run) and answer with the blocks' checksums. The pin lasts until this connection's
 * UCX_DONE, until it closes, or until UCX_PIN_MS pass (then the connection is closed);
 * the consumer bounds its gets by the same limit, which UCX_GRANTED carries.
 */
#define UCX_PIN_MS 30000u
#define PIN_GRACE_NS (2ull * 1000000000ull) /* kvx_agent_destroy's wait for pinned ones */

typedef struct ucx_pin {
    lease *l;
    uint64_t bytes, until_ns;
    struct kvx__ucx_agent *su; /* a staged grant: its slot, at stage_off */
    uint64_t stage_off;
} ucx_pin;

/* End a pin: the lease (counting bytes as read), and a staged grant's slot. */
static void pin_end(kvx_agent *a, ucx_pin *pin, uint64_t bytes)
{
#ifdef TD_HAVE_UCX
    if (pin->su) kvx__ucx_agent_unstage(pin->su, pin->stage_off);
#endif
    lease_unpin(a, pin->l, bytes);
    *pin = (ucx_pin){0};
}

static int serve_ucx_grant(kvx_agent *a, conn *c, int fd, conn_bufs *b, const kvx_msg *m,
                           ucx_pin *pin)
{
    uint32_t tag = m->hdr.tag;
    const kvx_region *r = &a->opts.region;
    /* A pin is for a consumer that reads the pool itself: through the shared memfd (shm),
     * CUDA IPC, or UCX once this producer serves it. A producer that serves none of them
     * grants nothing (a pin there would only hold blocks, and its shutdown, for nobody). */
    pthread_mutex_lock(&a->mu);
    bool ucx_up = a->ucx != NULL || (c->rail >= 0 && c->listener && c->listener->ucx);
    pthread_mutex_unlock(&a->mu);
    if (!(r->shm && r->shm_fd >= 0) && !r->device && !ucx_up)
        return send_error(fd, b, tag, TD_EUNSUPPORTED,
                          "this producer serves no transport that reads its pool directly "
                          "(shm, ucx or cuda_ipc): use READ");
    lease *l = lease_pin(a, m->u.read.transfer_id);
    if (!l) return send_error(fd, b, tag, TD_ENOTFOUND, "unknown or expired transfer id");
    /* GPU memory is never read here except through ucx's staging, whose staged bytes get
     * checksums; a cuda_ipc grant gets none (the consumer then expects none). */
    struct kvx__ucx_agent *su = c->ucx_stage;
    bool want_crc =
        (m->u.read.flags & KVX_READ_CHECKSUMS) && a->opts.checksums && (!r->device || su);
    uint64_t total, n_blocks, off = KVX_NOT_STAGED;
    char msg[200];
    if (!ranges_ok(a, l, m, want_crc, &total, &n_blocks, msg, sizeof(msg))) {
        lease_unpin(a, l, 0);
        return send_error(fd, b, tag, TD_ERANGE, msg);
    }
    uint32_t n_crc = want_crc ? (uint32_t)n_blocks : 0, at = 0;
    if (su) {
#ifdef TD_HAVE_UCX
        td_err se;
        int rc = kvx__ucx_agent_stage(su, m, total, want_crc ? b->crc : NULL, &off, &se);
        if (rc) {
            lease_unpin(a, l, 0);
            return send_error(fd, b, tag, rc, se.msg);
        }
#endif
    } else {
        for (uint32_t k = 0; k < m->u.read.n_desc && want_crc; k++) {
            kvx_wire_desc d = kvx_wire_get_desc(m, k);
            region_crcs(r, d.segment, d.block, d.n_blocks, b->crc + at);
            at += d.n_blocks;
        }
    }
    int delay = atomic_load(&kvx__test_send_delay_ms);
    if (delay > 0) usleep((useconds_t)delay * 1000);
    /* kvx_agent_destroy lets pinned connections finish (a shm consumer copies out of the
     * pool with no further word to us, so only its UCX_DONE says the blocks are free) and
     * hangs up on the others: once it has begun, grant nothing new. */
    pthread_mutex_lock(&a->mu);
    bool stopping = a->stopping;
    if (!stopping) c->pinned = true;
    pthread_mutex_unlock(&a->mu);
    *pin = (ucx_pin){l, total, td_now_ns() + UCX_PIN_MS * 1000000ull,
                     off != KVX_NOT_STAGED ? su : NULL, off};
    if (stopping) {
        pin_end(a, pin, 0);
        send_error(fd, b, tag, TD_ECONN, "producer is shutting down");
        return -1;
    }
    td_err e;
    size_t n =
        kvx_wire_encode_ucx_granted(b->out, b->out_cap, tag, UCX_PIN_MS, off, b->crc, n_crc);
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

/* SHM_INFO: where a same-host consumer finds the memfd that holds the region (shm.c). */
static int serve_shm_info(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m)
{
    const kvx_region *r = &a->opts.region;
    if (!r->shm || r->shm_fd < 0)
        return send_error(fd, b, m->hdr.tag, TD_EUNSUPPORTED,
                          "this producer's KV pool is not shareable: start it with protocol shm");
    uint64_t bytes = (uint64_t)r->n_segments * r->segment_stride;
    /* The memfd's identity, so that a consumer can tell our /proc/<pid>/fd/<fd> from
     * another process's (one in another PID namespace sees other pids). */
    struct stat st;
    if (fstat(r->shm_fd, &st) != 0)
        return send_error(fd, b, m->hdr.tag, TD_EIO, "producer: cannot fstat its KV pool's memfd");
    size_t n = kvx_wire_encode_shm_info(
        b->out, b->out_cap, m->hdr.tag, (uint32_t)getpid(), (uint32_t)r->shm_fd, r->shm_offset,
        bytes, r->segment_stride, (uint64_t)st.st_dev, (uint64_t)st.st_ino);
    td_err e;
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

/* CUDA_INFO: the pool's CUDA IPC handle, for a same-host consumer (cuda_ipc.c). */
static int serve_cuda_info(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m)
{
    const kvx_region *r = &a->opts.region;
    uint64_t bytes = (uint64_t)r->n_segments * r->segment_stride;
    size_t n = kvx_wire_encode_cuda_info(b->out, b->out_cap, m->hdr.tag, (uint32_t)getpid(),
                                         (uint64_t)(uintptr_t)r->base, bytes, r->segment_stride,
                                         r->device_uuid, r->ipc_handle);
    td_err e;
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

/* UCX_INFO: the producer's UCX worker address, region and packed rkey (ucx.c). */
static int serve_ucx_info(kvx_agent *a, conn *c, int fd, conn_bufs *b, const kvx_msg *m)
{
#ifdef TD_HAVE_UCX
    /* The agent's own UCX engine, or on a rail's connection that rail's. */
    listener *L = c->rail >= 0 ? c->listener : NULL;
    struct kvx__ucx_agent **slot = L ? &L->ucx : &a->ucx;
    bool *tried = L ? &L->ucx_tried : &a->ucx_tried;
    char *error = L ? L->ucx_error : a->ucx_error;
    pthread_mutex_lock(&a->mu);
    if (!*slot && !*tried) {
        /* Once per agent (or rail): a producer whose UCX cannot start keeps serving tcp; a
         * rail whose UCX engine cannot start stays failed for ucx until restart. */
        td_err e;
        char dev[KVX_RAIL_NAME + 4];
        if (L) kvx__rail_ucx_device(&a->rails, L->rail, dev, sizeof(dev));
        *tried = true;
        /* Rails with given addresses (tests on loopback) have no device to restrict to. */
        bool restrict_dev = L && !a->rail_addr[L->rail][0];
        if (kvx__ucx_agent_create(slot, &a->opts.region, restrict_dev ? dev : NULL, &e)) {
            snprintf(error, 256, "%s%s%s", L ? "rail " : "", L ? a->rails.name[L->rail] : "",
                     L ? " (stays failed until restart): " : "");
            snprintf(error + strlen(error), 256 - strlen(error), "%s", e.msg);
            TD_WARN("kvx agent %s:%u: %s", a->opts.host, a->port, error);
        } else if (L) {
            TD_INFO("kvx agent: rail %s's UCX engine is up (device %s, region registered)",
                    a->rails.name[L->rail], dev);
        }
    }
    struct kvx__ucx_agent *u = *slot;
    char why[256];
    snprintf(why, sizeof(why), "%s", error);
    pthread_mutex_unlock(&a->mu);
    if (!u) return send_error(fd, b, m->hdr.tag, TD_EUNSUPPORTED, why);
    c->ucx_stage = kvx__ucx_agent_staged(u) ? u : NULL;
    size_t n = kvx__ucx_agent_info(u, b->out, b->out_cap, m->hdr.tag);
    if (!n)
        return send_error(fd, b, m->hdr.tag, TD_EUNSUPPORTED,
                          "producer's ucx worker address or rkey is too large");
    td_err e;
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
#else
    (void)a, (void)c;
    return send_error(fd, b, m->hdr.tag, TD_EUNSUPPORTED,
                      "this producer was built without ucx (libucx-dev)");
#endif
}

static int serve_release(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m)
{
    pthread_mutex_lock(&a->mu);
    int i = lease_find(a, m->u.release.transfer_id);
    lease *now = i >= 0 ? lease_remove(a, i, KVX_RELEASED_BY_CONSUMER) : NULL;
    if (i < 0) a->stats.unknown_transfer++;
    pthread_mutex_unlock(&a->mu);
    if (now) lease_give_back(a, now);
    if (i < 0) return send_error(fd, b, m->hdr.tag, TD_ENOTFOUND, "unknown or expired transfer id");
    td_err e;
    size_t n = kvx_wire_encode_ack(b->out, b->out_cap, m->hdr.tag, 1);
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

static int serve_heartbeat(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m)
{
    uint32_t found = 0;
    pthread_mutex_lock(&a->mu);
    uint64_t now = td_now_ns();
    for (uint32_t k = 0; k < m->u.heartbeat.n_ids; k++) {
        int i = lease_find(a, kvx_wire_get_id(m, k));
        if (i >= 0) {
            if (!a->leases[i]->push || a->leases[i]->finished)
                a->leases[i]->expires_ns = now + a->leases[i]->lease_ns;
            found++;
        }
    }
    pthread_mutex_unlock(&a->mu);
    td_err e;
    size_t n = kvx_wire_encode_ack(b->out, b->out_cap, m->hdr.tag, found);
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

/* A warning about a peer, at most one a second: a flood of bad connections must not fill
 * the log (the counters in /metrics count every one). */
static void warn_peer(kvx_agent *a, const char *msg)
{
    uint64_t now = td_now_ns();
    pthread_mutex_lock(&a->mu);
    bool say = a->warn_ns == 0 || now - a->warn_ns >= 1000000000ull;
    int held = 0;
    if (say) {
        a->warn_ns = now;
        held = a->warn_held;
        a->warn_held = 0;
    } else {
        a->warn_held++;
    }
    pthread_mutex_unlock(&a->mu);
    if (!say) return;
    if (held)
        TD_WARN("kvx agent %s:%u: %s (and %d more warnings about peers in the last second, "
                "not shown)",
                a->opts.host, a->port, msg, held);
    else
        TD_WARN("kvx agent %s:%u: %s", a->opts.host, a->port, msg);
}

/* A refused session: count it, keep the reason, tell the peer, log. */
static int refuse(kvx_agent *a, int fd, conn_bufs *b, uint32_t tag, int code, const char *msg)
{
    warn_peer(a, msg);
    set_last_error(a, msg);
    pthread_mutex_lock(&a->mu);
    a->stats.handshakes_refused++;
    pthread_mutex_unlock(&a->mu);
    send_error(fd, b, tag, code, msg);
    return code;
}

/* A refusal before AUTH succeeded, naming the consumer by its engine id. */
static void refuse_unauthed(kvx_agent *a, int fd, conn_bufs *b, uint32_t tag, int code,
                            const uint8_t id_c[KVX_ID_BYTES], const char *why)
{
    char hex[KVX_ID_HEX], msg[300];
    kvx_id_to_hex(id_c, hex);
    snprintf(msg, sizeof(msg), "kvx auth failed: consumer %.12s %s", hex, why);
    refuse(a, fd, b, tag, code, msg);
}

/* AUTH from a consumer: check its proof, answer with ours (see kvx_auth.c). */
static int serve_auth(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m,
                      const uint8_t nc[KVX_ID_BYTES], const uint8_t np[KVX_ID_BYTES],
                      const uint8_t id_c[KVX_ID_BYTES])
{
    char hex[KVX_ID_HEX], msg[200];
    kvx_id_to_hex(id_c, hex);
    if (!a->token[0]) {
        snprintf(msg, sizeof(msg),
                 "kvx auth failed: consumer %.12s sent a token but this producer has no auth_token "
                 "(set the same token on both)",
                 hex);
        return refuse(a, fd, b, m->hdr.tag, TD_EPROTO, msg);
    }
    uint8_t want[KVX_AUTH_MAC_BYTES];
    kvx__auth_mac(a->token, false, nc, np, id_c, a->engine_id, want);
    if (!kvx__auth_equal(want, m->u.auth.mac)) {
        snprintf(msg, sizeof(msg), "kvx auth failed: consumer %.12s does not know the token", hex);
        return refuse(a, fd, b, m->hdr.tag, TD_EPROTO, msg);
    }
    kvx__auth_mac(a->token, true, nc, np, id_c, a->engine_id, want);
    size_t n = kvx_wire_encode_auth(b->out, b->out_cap, m->hdr.tag, want);
    td_err e;
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}


/* ---------------------------------------------------------------- push (transfer_mode write) */

int kvx_agent_push_open(kvx_agent *a, const char *transfer_id, int n_blocks, void *transfer_user,
                        td_err *err)
{
    uint8_t id[KVX_ID_BYTES];
    if (!transfer_id || kvx_id_from_hex(transfer_id, id))
        return td_err_set(err, TD_EINVAL, "kvx: a push transfer id must be 32 hex digits");
    if (n_blocks < 1 || (uint32_t)n_blocks > a->opts.region.n_blocks)
        return td_err_set(err, TD_EINVAL, "kvx: a push transfer of %d blocks (region: %u)",
                          n_blocks, a->opts.region.n_blocks);
    lease *l = calloc(1, sizeof(*l));
    if (l) {
        l->blocks = malloc((size_t)n_blocks * sizeof(int32_t));
        l->index = malloc((size_t)n_blocks * sizeof(uint64_t));
        l->ready = calloc(a->opts.region.n_segments, sizeof(uint32_t));
    }
    if (!l || !l->blocks || !l->index || !l->ready) {
        if (l) lease_free(l);
        return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    }
    memcpy(l->id, id, KVX_ID_BYTES);
    kvx_id_to_hex(l->id, l->hex);
    l->n_blocks = n_blocks;
    l->push = true;
    l->lease_ns = (uint64_t)a->opts.lease_ms * 1000000ull;
    l->expires_ns = UINT64_MAX; /* the lease starts at kvx_agent_push_finish */
    l->user = transfer_user;
    pthread_mutex_lock(&a->mu);
    int rc = 0;
    if (lease_find(a, id) >= 0) {
        rc = td_err_set(err, TD_ESTATE, "kvx: transfer id %s is already in use", l->hex);
    } else if (a->n_leases == a->cap_leases) {
        int cap = a->cap_leases ? 2 * a->cap_leases : 64;
        lease **nl = realloc(a->leases, (size_t)cap * sizeof(*nl));
        if (!nl) rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        else {
            a->leases = nl;
            a->cap_leases = cap;
        }
    }
    if (!rc) {
        a->leases[a->n_leases++] = l;
        pthread_cond_broadcast(&a->cv); /* a WRITE may be waiting for this id */
    }
    pthread_mutex_unlock(&a->mu);
    if (rc) lease_free(l);
    return rc;
}

/* Under a->mu: learn blocks[n_known .. n) of a push transfer. 0, or TD_EINVAL for an id
 * outside the region. */
static int push_learn(kvx_agent *a, lease *l, const int32_t *blocks, uint32_t n)
{
    if (n <= l->n_known) return 0;
    for (uint32_t i = l->n_known; i < n; i++)
        if (blocks[i] < 0 || (uint32_t)blocks[i] >= a->opts.region.n_blocks) return TD_EINVAL;
    for (uint32_t i = l->n_known; i < n; i++) {
        l->blocks[i] = blocks[i];
        l->index[i] = (uint64_t)(uint32_t)blocks[i] << 32 | i;
    }
    l->n_known = n;
    qsort(l->index, n, sizeof(uint64_t), cmp_u64);
    return 0;
}

/* Under a->mu: the push transfer with this id, or NULL. */
static lease *push_find(kvx_agent *a, const char *transfer_id)
{
    uint8_t id[KVX_ID_BYTES];
    if (!transfer_id || kvx_id_from_hex(transfer_id, id)) return NULL;
    int i = lease_find(a, id);
    return i >= 0 && a->leases[i]->push ? a->leases[i] : NULL;
}

int kvx_agent_push_ready(kvx_agent *a, const char *transfer_id, uint32_t seg, int n_ready,
                         const int32_t *blocks)
{
    pthread_mutex_lock(&a->mu);
    lease *l = push_find(a, transfer_id);
    int rc = l ? 0 : TD_ENOTFOUND;
    if (l && (seg >= a->opts.region.n_segments || n_ready < 0)) rc = TD_EINVAL;
    if (!rc) {
        uint32_t n = TD_MIN((uint32_t)n_ready, (uint32_t)l->n_blocks);
        rc = push_learn(a, l, blocks, n);
        if (!rc && n > l->ready[seg]) {
            l->ready[seg] = n;
            pthread_cond_broadcast(&a->cv);
        }
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

int kvx_agent_push_finish(kvx_agent *a, const char *transfer_id, const int32_t *blocks,
                          const void *note, size_t note_len)
{
    if (note_len > KVX_MAX_NOTE) return TD_EINVAL;
    pthread_mutex_lock(&a->mu);
    lease *l = push_find(a, transfer_id);
    int rc = l ? push_learn(a, l, blocks, (uint32_t)l->n_blocks) : TD_ENOTFOUND;
    if (!rc) {
        for (uint32_t s = 0; s < a->opts.region.n_segments; s++)
            l->ready[s] = (uint32_t)l->n_blocks;
        if (note_len) memcpy(l->note, note, note_len);
        l->note_len = (uint32_t)note_len;
        l->finished = true;
        l->expires_ns = td_now_ns() + l->lease_ns;
        pthread_cond_broadcast(&a->cv);
    }
    pthread_mutex_unlock(&a->mu);
    return rc;
}

/* A push connection says something at least this often (and at least 4 times per the
 * consumer's allowed silence) while it waits, so that the consumer can tell a slow prefill
 * from a dead producer. */
#define PUSH_KEEPALIVE_NS 1000000000ull

/* Under a->mu: wait for a change until the next keep-alive is due; send it if it is. */
static int push_wait(kvx_agent *a, int fd, conn_bufs *b, uint32_t tag, uint64_t *next_keepalive,
                     uint64_t period_ns)
{
    uint64_t now = td_now_ns();
    if (now < *next_keepalive) {
        kvx__cond_wait_until(&a->cv, &a->mu, *next_keepalive);
        return 0;
    }
    size_t n = kvx_wire_encode_push_ready(b->out, b->out_cap, tag, 0, 0, 0, NULL, 0);
    pthread_mutex_unlock(&a->mu);
    td_err e;
    int rc = kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
    pthread_mutex_lock(&a->mu);
    *next_keepalive = td_now_ns() + period_ns;
    return rc;
}

/* Whether the consumer hung up a connection that owes us nothing (it sends nothing while
 * its WRITE waits): a cancelled push shuts its connection down. */
static bool peer_gone(int fd)
{
    char c;
    ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/*
 * WRITE: wait (up to the consumer's timeout) for the producer to open this push transfer,
 * claim it, then announce each segment's newly final blocks as the prefill reports them,
 * and end with PUSH_DONE and the producer's note. The transfer stays pinned meanwhile, so
 * its blocks cannot go back to the engine under the consumer's reads.
 */
static int serve_write(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m)
{
    uint32_t tag = m->hdr.tag;
    uint32_t n_seg = a->opts.region.n_segments;
    uint32_t *sent = malloc(n_seg * sizeof(uint32_t));
    if (!sent) return send_error(fd, b, tag, TD_ENOMEM, "producer: out of memory");
    uint64_t silence_ns =
        (uint64_t)(m->u.write.timeout_ms ? m->u.write.timeout_ms : 30000) * 1000000ull;
    uint64_t give_up = td_now_ns() + silence_ns;
    uint64_t period = TD_MIN(PUSH_KEEPALIVE_NS, silence_ns / 4);
    uint64_t keepalive = td_now_ns() + period;
    int rc = 0, code = 0;
    char msg[240] = "";
    lease *l = NULL;
    pthread_mutex_lock(&a->mu);
    while (!rc) {
        /* A consumer that gave up (kvx_client_cancel) leaves now: still waiting, its WRITE
         * would claim the transfer id if it were opened later, and a WRITE that came for
         * it then would be refused as a second claim. Checked at each wake-up, so before an
         * open of the id that wakes it. */
        if (peer_gone(fd)) {
            rc = TD_ECONN;
            break;
        }
        int i = lease_find(a, m->u.write.transfer_id);
        if (i >= 0) {
            l = a->leases[i];
            break;
        }
        if (a->stopping) {
            code = TD_ECONN;
            snprintf(msg, sizeof(msg), "producer is shutting down");
            break;
        }
        if (td_now_ns() >= give_up) {
            code = TD_ENOTFOUND;
            snprintf(msg, sizeof(msg),
                     "no prefill with this transfer id came to the producer within %llu ms",
                     (unsigned long long)(silence_ns / 1000000ull));
            a->stats.unknown_transfer++;
            break;
        }
        a->n_write_waiting++;
        rc = push_wait(a, fd, b, tag, &keepalive, period);
        a->n_write_waiting--;
    }
    if (l && !l->push) {
        code = TD_EPROTO;
        snprintf(msg, sizeof(msg), "transfer %s is not a push transfer", l->hex);
    } else if (l && l->claimed) {
        code = TD_ESTATE;
        snprintf(msg, sizeof(msg), "transfer %s was already claimed by a consumer", l->hex);
    } else if (l && m->u.write.n_blocks != (uint32_t)l->n_blocks) {
        code = TD_EPROTO;
        snprintf(msg, sizeof(msg),
                 "the prompt takes %d blocks here and %u at the consumer (tokenized "
                 "differently?)",
                 l->n_blocks, m->u.write.n_blocks);
    }
    if (code || rc || !l) {
        pthread_mutex_unlock(&a->mu);
        free(sent);
        if (code) set_last_error(a, msg);
        return rc ? rc : send_error(fd, b, tag, code ? code : TD_ENOTFOUND, msg);
    }
    l->claimed = true;
    l->inflight++; /* pinned until the last announcement is out */
    a->stats.pushes++;
    for (uint32_t s = 0; s < n_seg; s++)
        sent[s] = m->u.write.skip;
    bool done = false;
    while (!rc) {
        if (l->dead || a->stopping) {
            code = a->stopping ? TD_ECONN : TD_ECANCELED;
            snprintf(msg, sizeof(msg), "%s",
                     a->stopping ? "producer is shutting down"
                                 : "the producer dropped this transfer (its request was "
                                   "aborted or preempted, or the lease expired)");
            break;
        }
        uint32_t s0 = 0;
        while (s0 < n_seg && l->ready[s0] <= sent[s0])
            s0++;
        if (s0 < n_seg) {
            /* One announcement for the run of segments with the same new range. */
            uint32_t from = sent[s0], to = TD_MIN(l->ready[s0], from + KVX_MAX_DESC);
            uint32_t s1 = s0 + 1;
            while (s1 < n_seg && sent[s1] == from && TD_MIN(l->ready[s1], from + KVX_MAX_DESC) == to)
                s1++;
            size_t n = kvx_wire_encode_push_ready(b->out, b->out_cap, tag, s0, s1 - s0, from,
                                                  l->blocks + from, to - from);
            for (uint32_t s = s0; s < s1; s++)
                sent[s] = to;
            pthread_mutex_unlock(&a->mu);
            td_err e;
            rc = kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
            pthread_mutex_lock(&a->mu);
            keepalive = td_now_ns() + period;
            continue;
        }
        if (l->finished) {
            done = true;
            break;
        }
        rc = push_wait(a, fd, b, tag, &keepalive, period);
    }
    size_t n = done ? kvx_wire_encode_push_done(b->out, b->out_cap, tag, l->note, l->note_len)
                    : 0;
    if (done) l->expires_ns = td_now_ns() + l->lease_ns; /* the consumer's reads follow */
    pthread_mutex_unlock(&a->mu);
    td_err e;
    if (done) rc = kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
    else if (!rc) rc = send_error(fd, b, tag, code, msg);
    lease_unpin(a, l, 0);
    free(sent);
    return rc;
}

static int serve_hello(kvx_agent *a, conn *c, conn_bufs *b, const kvx_msg *m,
                       const uint8_t np[KVX_ID_BYTES])
{
    static const uint8_t zero[KVX_ID_BYTES];
    int fd = c->fd;
    td_err e;
    char msg[300];
    int code = 0;
    const char *mine = c->rail >= 0 ? a->rails.name[c->rail] : "";
    if (c->rail >= 0 && !m->u.hello.rail[0]) {
        snprintf(msg, sizeof(msg),
                 "this is the endpoint of rail %s: a consumer connecting here must name its rail",
                 mine);
        code = TD_EPROTO;
    } else if (c->rail >= 0 && a->opts.matched_rails && strcmp(m->u.hello.rail, mine)) {
        snprintf(msg, sizeof(msg),
                 "this is the endpoint of rail %s, and the consumer is on rail %.63s: matched "
                 "rails pair a rail only with the rail of the same name",
                 mine, m->u.hello.rail);
        code = TD_EPROTO;
    } else if (memcmp(m->u.hello.expect_engine_id, zero, KVX_ID_BYTES) &&
        memcmp(m->u.hello.expect_engine_id, a->engine_id, KVX_ID_BYTES)) {
        char want[KVX_ID_HEX];
        kvx_id_to_hex(m->u.hello.expect_engine_id, want);
        snprintf(msg, sizeof(msg), "this producer is engine %s, not %s (it restarted)",
                 a->engine_hex, want);
        code = TD_ECONN;
    } else if (kvx__hello_compare(&a->hello, &m->u.hello, &e)) {
        snprintf(msg, sizeof(msg), "producer refused the handshake: %s", e.msg);
        code = e.code;
    }
    if (code) return refuse(a, fd, b, m->hdr.tag, code, msg);
    kvx_hello ack = a->hello;
    memcpy(ack.nonce, np, KVX_ID_BYTES);
    ack.features = a->token[0] ? KVX_ACK_FEAT_AUTH : 0;
    size_t n = kvx_wire_encode_hello(b->out, b->out_cap, KVX_MSG_HELLO_ACK, m->hdr.tag, &ack);
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

/*
 * RAIL: where this producer serves transfers for the consumer's rail. Matched rails: the
 * rail of that name, its engine made now if this is its first use; a name that is empty,
 * a list, or not one of ours is refused (no fallback to another rail). One device only:
 * that device, whatever the consumer's rail.
 */
static int serve_rail(kvx_agent *a, int fd, conn_bufs *b, const kvx_msg *m)
{
    td_err e = {0};
    int rail = -1, rc = 0;
    if (!a->railpool) {
        rc = td_err_set(&e, TD_EUNSUPPORTED,
                        "this producer has no rails: configure rail_device (and matched_rails) "
                        "on both sides, or on neither");
    } else if (a->opts.matched_rails) {
        rc = kvx_rails_check_peer(&a->rails, m->u.rail.name, &rail, &e);
    } else {
        rail = a->rails.primary;
    }
    void *eng = NULL;
    if (!rc) rc = kvx__railpool_get(a->railpool, rail, &eng, &e);
    if (rc) {
        pthread_mutex_lock(&a->mu);
        a->stats.rails_refused++;
        pthread_mutex_unlock(&a->mu);
        TD_WARN("kvx agent %s:%u: refusing rail %s: %s", a->opts.host, a->port,
                m->u.rail.name[0] ? m->u.rail.name : "(none named)", e.msg);
        set_last_error(a, e.msg);
        return send_error(fd, b, m->hdr.tag, rc, e.msg);
    }
    listener *L = eng;
    size_t n = kvx_wire_encode_rail_ack(b->out, b->out_cap, m->hdr.tag, L->addr, L->port,
                                        a->rails.name[rail]);
    return kvx__send_all(fd, b->out, n, td_now_ns() + SEND_TIMEOUT_NS, &e);
}

/* Whether two peers share an address (port aside). */
static bool same_addr(const struct sockaddr_storage *x, const struct sockaddr_storage *y)
{
    if (x->ss_family != y->ss_family) return false;
    if (x->ss_family == AF_INET)
        return ((const struct sockaddr_in *)x)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)y)->sin_addr.s_addr;
    if (x->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)x)->sin6_addr,
                       &((const struct sockaddr_in6 *)y)->sin6_addr, sizeof(struct in6_addr));
    return true; /* unknown: one bucket */
}

/* c has said HELLO (and AUTH where a token is set): out of the unproved connections. */
static void conn_proved(kvx_agent *a, conn *c)
{
    pthread_mutex_lock(&a->mu);
    if (c->preauth) {
        c->preauth = false;
        a->n_preauth--;
    }
    pthread_mutex_unlock(&a->mu);
}

static void *conn_main(void *arg)
{
    conn *c = arg;
    kvx_agent *a = c->agent;
    conn_bufs b = {0};
    /* The largest frame a consumer may send is a READ of KVX_MAX_DESC ranges; frames are
     * read ahead (kvx__rbuf), so pipelined READs come in with one recv. */
    kvx__rbuf rb = {.cap = KVX_HDR_BYTES + 24 + (size_t)KVX_MAX_DESC * KVX_DESC_BYTES};
    b.in = rb.buf = malloc(rb.cap);
    b.out_cap = KVX_HDR_BYTES + 4 * (size_t)KVX_MAX_CRC + 64; /* + UCX_GRANTED's header */
    b.out = malloc(b.out_cap);
    b.iov = malloc((2 + (size_t)KVX_MAX_DESC) * sizeof(struct iovec));
    b.crc = malloc(4 * (size_t)KVX_MAX_CRC);
    bool greeted = false, authed = false;
    uint8_t nc[KVX_ID_BYTES] = {0}, np[KVX_ID_BYTES] = {0}, id_c[KVX_ID_BYTES] = {0};
    ucx_pin pin = {0}; /* a UCX_GRANT waiting for its UCX_DONE */
    while (b.in && b.out && b.iov && b.crc) {
        kvx_msg m;
        td_err e;
        /* A new connection must say HELLO, and then AUTH where a token is set, within
         * HELLO_TIMEOUT_NS each, so an unauthenticated peer cannot hold a connection thread;
         * after that, idle connections wait without a deadline (kvx_agent_destroy wakes
         * them), except that a pin ends by its time limit. */
        uint64_t deadline = greeted && authed ? UINT64_MAX : td_now_ns() + HELLO_TIMEOUT_NS;
        if (pin.l) deadline = pin.until_ns;
        int rc = kvx__rbuf_frame(c->fd, &rb, &m, deadline, &e);
        if (!rc && pin.l && m.hdr.type != KVX_MSG_UCX_DONE) {
            send_error(c->fd, &b, m.hdr.tag, TD_EPROTO, "expected UCX_DONE after UCX_GRANT");
            break;
        }
        if (rc) {
            bool net = rc == TD_ECONN || rc == TD_ETIMEDOUT;
            pthread_mutex_lock(&a->mu);
            bool stopping = a->stopping;
            pthread_mutex_unlock(&a->mu);
            if (greeted && !authed && !stopping) { /* a token is set and was never proved */
                const char *how = rc == TD_ECONN ? "hung up" : "timed out";
                char why[200];
                if (net)
                    snprintf(why, sizeof(why),
                             "%s before authenticating (does it have the same auth_token?)", how);
                else
                    snprintf(why, sizeof(why), "broke the protocol before authenticating: %.120s",
                             e.msg);
                refuse_unauthed(a, c->fd, &b, 0, net ? TD_EPROTO : rc, id_c, why);
            } else if (!net) { /* a protocol error: say so */
                set_last_error(a, e.msg);
                send_error(c->fd, &b, 0, rc, e.msg);
            }
            break;
        }
        if (!greeted && m.hdr.type != KVX_MSG_HELLO) {
            send_error(c->fd, &b, m.hdr.tag, TD_EPROTO, "expected HELLO first");
            break;
        }
        if (greeted && !authed && m.hdr.type != KVX_MSG_AUTH) {
            char why[200];
            snprintf(why, sizeof(why),
                     "sent %s instead of AUTH: this producer requires authentication (set the "
                     "same auth_token, or TANDEM_KV_TOKEN, on the consumer)",
                     kvx_wire_type_name(m.hdr.type));
            refuse_unauthed(a, c->fd, &b, m.hdr.tag, TD_EPROTO, id_c, why);
            break;
        }
        switch (m.hdr.type) {
        case KVX_MSG_HELLO:
            if (greeted) { /* a protocol error like any other: answered, then hung up */
                send_error(c->fd, &b, m.hdr.tag, TD_EPROTO, "second HELLO");
                rc = -1;
                break;
            }
            memcpy(nc, m.u.hello.nonce, KVX_ID_BYTES);
            memcpy(id_c, m.u.hello.engine_id, KVX_ID_BYTES);
            if (kvx__random_id(np)) {
                send_error(c->fd, &b, m.hdr.tag, TD_EIO, "producer: getrandom failed");
                rc = -1;
                break;
            }
            rc = serve_hello(a, c, &b, &m, np) ? -1 : 0;
            if (!rc) {
                greeted = true;
                authed = !a->token[0]; /* without a token, AUTH is refused below */
                if (authed) conn_proved(a, c);
            }
            break;
        case KVX_MSG_AUTH:
            if (authed && a->token[0]) {
                send_error(c->fd, &b, m.hdr.tag, TD_EPROTO, "second AUTH");
                rc = -1;
                break;
            }
            rc = serve_auth(a, c->fd, &b, &m, nc, np, id_c) ? -1 : 0;
            if (!rc) {
                authed = true;
                conn_proved(a, c);
            }
            break;
        case KVX_MSG_READ:
        case KVX_MSG_UCX_GRANT:
        case KVX_MSG_SHM_INFO:
        case KVX_MSG_UCX_INFO:
        case KVX_MSG_CUDA_INFO:
            /* GPU memory moves by cuda_ipc, or by tcp or ucx through host staging where
             * CUDA is built; host memory never by cuda_ipc */
            if (a->opts.region.device != (m.hdr.type == KVX_MSG_CUDA_INFO) &&
                m.hdr.type != KVX_MSG_UCX_GRANT &&
                !((m.hdr.type == KVX_MSG_READ || m.hdr.type == KVX_MSG_UCX_INFO) &&
                  kvx_protocol_available(KVX_PROTO_CUDA_IPC))) {
                send_error(c->fd, &b, m.hdr.tag, TD_EUNSUPPORTED,
                           a->opts.region.device
                               ? "this producer's KV lives in GPU memory: use protocol cuda_ipc "
                                 "(same host), tcp or ucx"
                               : "this producer's KV lives in host memory: use protocol tcp, shm "
                                 "or ucx");
                rc = -1;
                break;
            }
            if (a->railpool && c->rail < 0) { /* rails: data moves only on a rail's engine */
                char why[200];
                snprintf(why, sizeof(why),
                         "this producer serves transfers only on its rails (%s): the consumer "
                         "must use a rail (rail_device / matched_rails)",
                         a->rails.name[a->rails.primary]);
                send_error(c->fd, &b, m.hdr.tag, TD_EPROTO, why);
                rc = -1;
                break;
            }
            if (c->rail >= 0 && m.hdr.type != KVX_MSG_SHM_INFO && m.hdr.type != KVX_MSG_UCX_INFO &&
                m.hdr.type != KVX_MSG_CUDA_INFO) {
                pthread_mutex_lock(&a->mu);
                a->stats.rail_reads[c->rail]++;
                pthread_mutex_unlock(&a->mu);
            }
            if (c->rail >= 0 && atomic_load(&kvx__test_slow_rail) == c->rail + 1) usleep(20000);
            if (m.hdr.type == KVX_MSG_READ) rc = serve_read(a, c->fd, &b, &m);
            else if (m.hdr.type == KVX_MSG_UCX_GRANT) rc = serve_ucx_grant(a, c, c->fd, &b, &m, &pin);
            else if (m.hdr.type == KVX_MSG_SHM_INFO) rc = serve_shm_info(a, c->fd, &b, &m);
            else if (m.hdr.type == KVX_MSG_CUDA_INFO) rc = serve_cuda_info(a, c->fd, &b, &m);
            else rc = serve_ucx_info(a, c, c->fd, &b, &m);
            break;
        case KVX_MSG_RAIL:
            rc = serve_rail(a, c->fd, &b, &m);
            break;
        case KVX_MSG_WRITE:
            if (a->opts.region.device) {
                send_error(c->fd, &b, m.hdr.tag, TD_EUNSUPPORTED,
                           "this producer's KV lives in GPU memory: push (write) mode is not served "
                           "from it; use read mode with protocol cuda_ipc");
                rc = -1;
                break;
            }
            rc = serve_write(a, c->fd, &b, &m);
            break;
        case KVX_MSG_RELEASE:
            rc = serve_release(a, c->fd, &b, &m);
            break;
        case KVX_MSG_HEARTBEAT:
            rc = serve_heartbeat(a, c->fd, &b, &m);
            break;
        case KVX_MSG_UCX_DONE: /* no answer: the next request follows on this connection */
            if (!pin.l) {
                send_error(c->fd, &b, m.hdr.tag, TD_EPROTO, "UCX_DONE without a UCX_GRANT");
                rc = -1;
                break;
            }
            pin_end(a, &pin, pin.bytes);
            pthread_mutex_lock(&a->mu);
            c->pinned = false;
            if (a->stopping) rc = -1; /* kvx_agent_destroy waited for this copy: hang up */
            pthread_mutex_unlock(&a->mu);
            break;
        default:
            send_error(c->fd, &b, m.hdr.tag, TD_EPROTO, "unexpected message from a consumer");
            rc = -1;
        }
        if (rc) break;
    }
    /* A consumer that closed, timed out or broke the protocol holding a pin has stopped
     * its gets first (it closes its UCX endpoint before this connection). */
    if (pin.l) pin_end(a, &pin, 0);
    free(b.in);
    free(b.out);
    free(b.iov);
    free(b.crc);
    pthread_mutex_lock(&a->mu);
    for (conn **pp = &a->conns; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    a->n_conns--;
    if (c->preauth) a->n_preauth--;
    close(c->fd);
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    free(c);
    return NULL;
}

static void *accept_main(void *arg)
{
    listener *L = arg;
    kvx_agent *a = L->agent;
    for (;;) {
        int fd = accept4(L->fd, NULL, NULL, SOCK_CLOEXEC);
        pthread_mutex_lock(&a->mu);
        bool stop = a->stopping || atomic_load(&L->stop);
        pthread_mutex_unlock(&a->mu);
        if (stop) {
            if (fd >= 0) close(fd);
            return NULL;
        }
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                usleep(10000); /* out of descriptors: wait, do not spin */
                continue;
            }
            return NULL;
        }
        kvx__set_sock_opts(fd);
        conn *c = calloc(1, sizeof(*c));
        socklen_t plen = sizeof(struct sockaddr_storage);
        if (c && getpeername(fd, (struct sockaddr *)&c->peer, &plen))
            memset(&c->peer, 0, sizeof(c->peer));
        /* Connections that have not proved themselves yet (HELLO, and AUTH where a token is
         * set; each has 10 s a frame) may take half the table, and those of one address a
         * quarter: a flood of them cannot keep consumers that authenticate out (and a host
         * whose engines open many connections at once, a push each, stays well inside). */
        pthread_mutex_lock(&a->mu);
        const char *why = NULL;
        if (!c) {
            why = "out of memory";
        } else if (a->n_conns >= a->opts.max_connections) {
            why = "the producer's connection limit is reached";
        } else if (a->n_preauth >= TD_MAX(a->opts.max_connections / 2, 4)) {
            why = "too many connections are still authenticating";
        } else {
            int same = 0;
            for (conn *o = a->conns; o; o = o->next)
                same += o->preauth && same_addr(&o->peer, &c->peer);
            if (same >= TD_MAX(a->opts.max_connections / 4, 2))
                why = "too many connections from this address are still authenticating";
        }
        bool full = why != NULL;
        if (!full) {
            c->fd = fd;
            c->agent = a;
            c->rail = L->rail;
            c->listener = L;
            c->preauth = true;
            c->next = a->conns;
            a->conns = c;
            a->n_conns++;
            a->n_preauth++;
        }
        pthread_mutex_unlock(&a->mu);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (full || pthread_create(&t, &attr, conn_main, c)) {
            if (!full) {
                pthread_mutex_lock(&a->mu);
                for (conn **pp = &a->conns; *pp; pp = &(*pp)->next)
                    if (*pp == c) {
                        *pp = c->next;
                        break;
                    }
                a->n_conns--;
                a->n_preauth--;
                pthread_mutex_unlock(&a->mu);
                why = "cannot start a connection thread";
            }
            char msg[200];
            snprintf(msg, sizeof(msg), "refusing a connection: %s (limit %d)", why,
                     a->opts.max_connections);
            /* said to the peer too, so that a consumer reports why (it reads this instead of
             * its HELLO's answer) and tries again a little later (TD_EBUSY: every reason here
             * passes); never blocking: the socket is new and its buffer empty */
            uint8_t frame[KVX_HDR_BYTES + 256];
            size_t n = kvx_wire_encode_error(frame, sizeof(frame), 0, TD_EBUSY, msg);
            if (n) (void)send(fd, frame, n, MSG_NOSIGNAL | MSG_DONTWAIT);
            warn_peer(a, msg);
            close(fd);
            free(c);
        }
        pthread_attr_destroy(&attr);
    }
}

/* ---------------------------------------------------------------- rail engines (tcp) */

/* Rail i's engine on the tcp transport: a listener on the rail's address, bound to its
 * network device, with its own accept thread; connections it accepts serve transfers. */
static int rail_open(void *user, int rail, const char *name, void **eng, td_err *err)
{
    kvx_agent *a = user;
    listener *L = calloc(1, sizeof(*L));
    if (!L) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    L->agent = a;
    L->rail = rail;
    L->fd = -1;
    /* A network interface's engine listens on its address; an RDMA device has none, so its
     * engine's control connections use the producer's control address (the data moves by
     * UCX over the device). */
    bool rdma = a->rails.kind == KVX_RAIL_RDMA;
    bool given = a->rail_addr[rail][0] != 0 || rdma;
    int rc = a->rail_addr[rail][0] ? (snprintf(L->addr, sizeof(L->addr), "%s", a->rail_addr[rail]), 0)
             : rdma ? (snprintf(L->addr, sizeof(L->addr), "%s", a->opts.host), 0)
                    : kvx__iface_addr(name, L->addr, sizeof(L->addr), err);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST | AI_PASSIVE};
    struct addrinfo *res = NULL;
    if (!rc && getaddrinfo(L->addr, "0", &hints, &res))
        rc = td_err_set(err, TD_EINVAL, "kvx: rail %s: bad address %s", name, L->addr);
    if (!rc) {
        L->fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (L->fd < 0) rc = td_err_set(err, TD_EIO, "kvx: rail %s: socket: %s", name, strerror(errno));
    }
    if (!rc && !given) kvx__bind_device(L->fd, name);
    if (!rc && (bind(L->fd, res->ai_addr, res->ai_addrlen) < 0 || listen(L->fd, 128) < 0))
        rc = td_err_set(err, TD_EIO, "kvx: rail %s: cannot listen on %s: %s", name, L->addr,
                        strerror(errno));
    if (res) freeaddrinfo(res);
    if (!rc) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof(ss);
        getsockname(L->fd, (struct sockaddr *)&ss, &sl);
        L->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
        if (atomic_load(&kvx__test_rail_fail) == rail + 1)
            rc = td_err_set(err, TD_EIO, "kvx: rail %s: failure injected by a test", name);
    }
    if (!rc && pthread_create(&L->thread, NULL, accept_main, L))
        rc = td_err_set(err, TD_ENOMEM, "kvx: rail %s: cannot start its accept thread", name);
    if (rc) {
        if (L->fd >= 0) close(L->fd);
        free(L);
        return rc;
    }
    TD_INFO("kvx agent: rail %s serves transfers on %s:%u", name, L->addr, L->port);
    *eng = L;
    return 0;
}

static int rail_reg(void *user, void *eng, int range, td_err *err)
{
    (void)user, (void)eng, (void)range, (void)err;
    return 0; /* not called: tcp registers nothing (n_ranges 0) */
}

static void rail_unreg(void *user, void *eng, int range)
{
    (void)user, (void)eng, (void)range;
}

/* Agent shutdown, first step: no rail engine accepts any more (a->stopping is set). */
static void rail_stop_accepting(void *eng, void *user)
{
    (void)user;
    shutdown(((listener *)eng)->fd, SHUT_RDWR);
}

static void rail_close(void *user, void *eng)
{
    (void)user;
    listener *L = eng;
    atomic_store(&L->stop, true);
    shutdown(L->fd, SHUT_RDWR); /* wakes accept() */
    pthread_join(L->thread, NULL);
    close(L->fd);
#ifdef TD_HAVE_UCX
    kvx__ucx_agent_destroy(L->ucx);
#endif
    free(L);
}

int kvx_agent_create(kvx_agent **out, const kvx_agent_opts *opts, td_err *err)
{
    *out = NULL;
    int rc = kvx_region_check(&opts->region, err);
    if (rc) return rc;
    if (opts->rails && opts->rails->n > 0 && opts->region.device)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "kvx: rails carry host memory; a KV pool in GPU memory moves by cuda_ipc");
    kvx_agent *a = calloc(1, sizeof(*a));
    if (!a) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    a->opts = *opts;
    if (!a->opts.host) a->opts.host = "127.0.0.1";
    if (opts->auth_token && opts->auth_token[0]) {
        if (strlen(opts->auth_token) >= sizeof(a->token)) {
            free(a);
            return td_err_set(err, TD_EINVAL, "kvx: auth_token is longer than %zu bytes",
                              sizeof(a->token) - 1);
        }
        snprintf(a->token, sizeof(a->token), "%s", opts->auth_token);
    }
    a->opts.auth_token = NULL; /* the copy above is the only one kept */
    if (!a->opts.lease_ms) a->opts.lease_ms = 30000;
    if (a->opts.max_connections <= 0) a->opts.max_connections = 256;
    a->listen_fd = -1;
    if (kvx__random_id(a->engine_id)) {
        free(a);
        return td_err_set(err, TD_EIO, "kvx: getrandom failed: %s", strerror(errno));
    }
    kvx_id_to_hex(a->engine_id, a->engine_hex);
    kvx__hello_fill(&a->hello, a->engine_id, &a->opts.layout, &a->opts.region);

    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char ports[8];
    snprintf(ports, sizeof(ports), "%u", opts->port);
    int g = getaddrinfo(a->opts.host, ports, &hints, &res);
    if (g) {
        free(a);
        return td_err_set(err, TD_EINVAL, "kvx: cannot resolve listen address %s: %s", opts->host,
                          gai_strerror(g));
    }
    rc = td_err_set(err, TD_EIO, "kvx: no address to listen on for %s", a->opts.host);
    for (struct addrinfo *ai = res; ai && a->listen_fd < 0; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 128) < 0) {
            int e = errno;
            rc = td_err_set(err, TD_EIO, "kvx: cannot listen on %s:%u: %s%s", a->opts.host,
                            opts->port, strerror(e),
                            e == EADDRINUSE ? " (another engine uses this handshake port: "
                                              "give each engine its own)"
                                            : "");
            close(fd);
            continue;
        }
        a->listen_fd = fd;
        rc = 0;
    }
    freeaddrinfo(res);
    if (rc) {
        free(a);
        return rc;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    getsockname(a->listen_fd, (struct sockaddr *)&ss, &sl);
    a->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);

    pthread_mutex_init(&a->mu, NULL);
    kvx__cond_init_monotonic(&a->cv);
    if (pthread_create(&a->lease_thread, NULL, lease_main, a)) {
        close(a->listen_fd);
        free(a);
        return td_err_set(err, TD_ENOMEM, "kvx: cannot start the lease thread");
    }
    a->main_listener = (listener){.agent = a, .fd = a->listen_fd, .rail = -1, .port = a->port};
    if (pthread_create(&a->accept_thread, NULL, accept_main, &a->main_listener)) {
        pthread_mutex_lock(&a->mu);
        a->stopping = true;
        pthread_cond_broadcast(&a->cv);
        pthread_mutex_unlock(&a->mu);
        pthread_join(a->lease_thread, NULL);
        close(a->listen_fd);
        free(a);
        return td_err_set(err, TD_ENOMEM, "kvx: cannot start the accept thread");
    }
    if (opts->rails && opts->rails->n > 0) {
        a->rails = *opts->rails;
        for (int i = 0; i < a->rails.n && opts->rail_addrs; i++)
            snprintf(a->rail_addr[i], sizeof(a->rail_addr[i]), "%s", opts->rail_addrs[i]);
        static const kvx__rail_ops tcp_rail_ops = {rail_open, rail_reg, rail_unreg, rail_close};
        /* tcp sends straight from this process's memory: nothing to register per rail. */
        rc = kvx__railpool_create(&a->railpool, &a->rails, 0, &tcp_rail_ops, a, err);
        if (rc) {
            kvx_agent_destroy(a);
            return rc;
        }
    }
    a->opts.rails = NULL; /* copied above */
    a->opts.rail_addrs = NULL;
    if (a->opts.region.device) kvx__cuda_local_add(&a->opts.region); /* for same-process consumers */
    *out = a;
    return 0;
}

int kvx_agent_rail_state(kvx_agent *a, int rail)
{
    return a->railpool ? kvx__railpool_state(a->railpool, rail) : -1;
}

void kvx__test_agent_hangup(kvx_agent *a)
{
    pthread_mutex_lock(&a->mu);
    for (conn *c = a->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    while (a->n_conns > 0)
        pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
}

void kvx_agent_destroy(kvx_agent *a)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->stopping = true;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    shutdown(a->listen_fd, SHUT_RDWR); /* wakes accept() */
    pthread_join(a->accept_thread, NULL);
    pthread_join(a->lease_thread, NULL);
    close(a->listen_fd);
    kvx__railpool_each(a->railpool, rail_stop_accepting, NULL); /* the rails' listeners too */

    /* Hang up on every consumer and wait for the connection threads to leave. A connection
     * holding a pin is given PIN_GRACE_NS to finish it (its UCX_DONE or its hang-up: a shm
     * consumer may still be copying those blocks out of the pool, which takes milliseconds,
     * and they go back to the engine below), then hung up on too: the process is going,
     * and a consumer that holds a pin and says nothing must not keep it 30 s. */
    pthread_mutex_lock(&a->mu);
    for (conn *c = a->conns; c; c = c->next)
        if (!c->pinned) shutdown(c->fd, SHUT_RDWR);
    uint64_t grace = td_now_ns() + PIN_GRACE_NS;
    while (a->n_conns > 0 && td_now_ns() < grace)
        kvx__cond_wait_until(&a->cv, &a->mu, grace);
    for (conn *c = a->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    while (a->n_conns > 0)
        pthread_cond_wait(&a->cv, &a->mu);
    pthread_mutex_unlock(&a->mu);
#ifdef TD_HAVE_UCX
    /* No pin is left: stop UCX (its progress thread, the region's registration) before
     * the blocks go back, so no get can be served from them afterwards. */
    kvx__ucx_agent_destroy(a->ucx);
#endif
    kvx__railpool_destroy(a->railpool); /* the rails' engines, UCX ones included */
    if (a->opts.region.device) kvx__cuda_local_remove(&a->opts.region);

    for (int i = 0; i < a->n_leases; i++) {
        a->leases[i]->reason = KVX_RELEASED_SHUTDOWN;
        lease_give_back(a, a->leases[i]);
    }
    free(a->leases);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    kvx__auth_wipe(a->token, sizeof(a->token));
    free(a);
}
