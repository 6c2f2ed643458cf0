/*
 * kvx/ucx.c - the ucx transport: the consumer reads the producer's blocks with one-sided
 * UCX gets (RDMA reads where the hardware has them; UCX's tcp and shared-memory
 * transports in tests), while every decision stays on the kvx TCP control connection.
 *
 * Built only where libucx-dev is installed (TD_HAVE_UCX). The protocol, per channel:
 *
 *   consumer                                   producer
 *   connect, HELLO             ------------>   (checks as for tcp)
 *                              <------------   HELLO_ACK
 *   UCX_INFO                   ------------>
 *                              <------------   UCX_INFO_ACK: worker address, region
 *                                              base / stride / length, packed rkey
 *   ucp endpoint to that address, unpack the rkey
 *   then per piece:
 *   UCX_GRANT (READ's payload) ------------>   check every range against the lease and
 *                                              the region, pin the lease, CRC32C per block
 *                              <------------   UCX_GRANTED: pin time limit, the CRCs
 *   ucp_get_nbx per range into the consumer's (registered) region, progress bounded by
 *   the piece's deadline and the pin limit; verify the CRCs
 *   UCX_DONE                   ------------>   unpin (no answer)
 *
 * So a consumer only ever reads ranges the producer has just checked against the
 * transfer's lease, and the lease cannot give its blocks back (release_cb) while the pin
 * is held. A consumer that fails (deadline, peer error, bad answer) force-closes its
 * endpoint, which stops its gets, before it closes the control connection, whose close
 * unpins. The producer also drops a pin whose time limit passed.
 *
 * Threads. Producer: one UCX context and worker per agent, the whole region registered
 * once (ucp_mem_map) and its rkey packed once; one thread progresses the worker, which
 * UCX's tcp transport needs (gets are emulated by messages there) and RDMA does not. It
 * sleeps on the worker's event fd when idle. Consumer: one context per client with the
 * whole consumer region registered once, shared by several workers (mt_workers_shared).
 * A *channel* is a control connection plus its own UCX worker, endpoint and rkey, and is
 * used by one kvx worker thread at a time (checked out of the session's pool under a
 * mutex, like tcp's connections), so workers run in UCS_THREAD_MODE_SERIALIZED without
 * locks on the data path, and a session's pieces run in parallel on up to
 * qp_per_transfer channels. A mutex around one shared worker would serialize every
 * progress loop of a session; a worker per kvx thread would need an endpoint per thread
 * and session. A channel per connection keeps tcp's pool logic and its failure rule: a
 * channel that saw any error is closed, never reused.
 *
 * GPU memory (region->device) is never registered with UCX: it moves through registered
 * pinned host staging on whichever side has it (see "Staging" below). UCX_INFO_ACK's
 * stage_slot tells a consumer that the producer stages, UCX_GRANTED's stage_off where.
 *
 * Configuration is UCX's own (UCX_TLS, UCX_NET_DEVICES, ...), read when the context is
 * created; a consumer that shares no transport with the producer gets a clear error.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "kvx/kvx_internal.h"

/* How long closing an endpoint may take (bounded progress after the deadline). */
#define CLOSE_TIMEOUT_NS (1000ull * 1000000ull)

static uint64_t region_bytes(const kvx_region *r)
{
    return (uint64_t)(r->n_segments - 1) * r->segment_stride +
           (uint64_t)r->n_blocks * r->block_bytes;
}

static int ucx_fail(td_err *err, int code, const char *what, ucs_status_t st)
{
    return td_err_set(err, code, "kvx: ucx: %s: %s (check UCX_TLS and UCX_NET_DEVICES)", what,
                      ucs_status_string(st));
}

/* device: NULL, or the one network device this context may use (a rail: UCX_NET_DEVICES
 * for this context only, e.g. "tdr2" or "mlx5_2:1"). */
static int context_create(ucp_context_h *out, bool shared, const char *device, td_err *err)
{
    ucp_config_t *cfg;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) return ucx_fail(err, TD_EIO, "cannot read the configuration", st);
    if (device && (st = ucp_config_modify(cfg, "NET_DEVICES", device)) != UCS_OK) {
        ucp_config_release(cfg);
        return td_err_set(err, TD_EIO, "kvx: ucx: cannot restrict a context to device %s: %s",
                          device, ucs_status_string(st));
    }
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                      .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
                      .mt_workers_shared = shared ? 1 : 0};
    st = ucp_init(&p, cfg, out);
    ucp_config_release(cfg);
    if (st != UCS_OK) return ucx_fail(err, TD_EIO, "cannot create a context", st);
    return 0;
}

static int worker_create(ucp_context_h ctx, ucp_worker_h *w, int *efd, td_err *err)
{
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t st = ucp_worker_create(ctx, &wp, w);
    if (st != UCS_OK) return ucx_fail(err, TD_EIO, "cannot create a worker", st);
    /* Some transports cannot wake a sleeper; then waits poll with short sleeps. */
    if (ucp_worker_get_efd(*w, efd) != UCS_OK) *efd = -1;
    return 0;
}

static int map_mem(ucp_context_h ctx, void *addr, size_t len, ucp_mem_h *memh, td_err *err)
{
    ucp_mem_map_params_t mp = {.field_mask =
                                   UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = addr,
                               .length = len};
    ucs_status_t st = ucp_mem_map(ctx, &mp, memh);
    if (st != UCS_OK) return ucx_fail(err, TD_EIO, "cannot register memory", st);
    return 0;
}

/*
 * Staging. The UCX this is built with (Debian's) cannot read or write GPU memory, so a
 * region on the GPU is never registered: its bytes go through page-locked host memory
 * that is. On the producer a grant's ranges are copied off the device into one slot of a
 * registered staging area (packed in request order) before UCX_GRANTED, which says where;
 * the consumer gets them from there and, if its own region is on the GPU too, into its
 * channel's registered staging buffer, then copies them up. The checksums are computed on
 * the staged bytes, as tcp's staging does. kvx__test_ucx_stage runs the same path over host
 * regions (memcpy for the device copies), so CI without a GPU tests the protocol.
 */
#define STAGE_SLOTS 8
#define STAGE_WAIT_NS (5000ull * 1000000ull) /* for a free slot, before the grant fails */

static bool region_staged(const kvx_region *r)
{
    return r->device || atomic_load(&kvx__test_ucx_stage) > 0;
}

/* Page-locked where the region is on a GPU, plain (page-aligned) for the test hook. */
static int stage_alloc(const kvx_region *r, size_t bytes, uint8_t **out, td_err *err)
{
    *out = NULL;
    if (r->device) return kvx__pinned_alloc(r->device_id, bytes, (void **)out, err);
    if (posix_memalign((void **)out, 4096, bytes)) {
        *out = NULL;
        return td_err_set(err, TD_ENOMEM, "kvx: ucx: out of memory for %zu bytes of staging",
                          bytes);
    }
    return 0;
}

static void stage_free(const kvx_region *r, uint8_t *p)
{
    if (r->device) kvx__pinned_free(p);
    else free(p);
}

/* Copy n ranges between the region (on the GPU, or host memory under the test hook) and
 * packed staging at stage: to_region says which way. Returns once every copy is done. */
static int stage_copy(const kvx_region *r, uint8_t *stage, const kvx__piece_range *rg, uint32_t n,
                      bool to_region, td_err *err)
{
    int rc = 0;
    uint64_t at = 0;
    for (uint32_t k = 0; k < n && !rc; k++) {
        uint8_t *dev = (uint8_t *)r->base +
                       kvx__offset(r, rg[k].seg, to_region ? rg[k].dst : rg[k].src);
        size_t len = (size_t)rg[k].n * r->block_bytes;
        if (!r->device)
            memcpy(to_region ? dev : stage + at, to_region ? stage + at : dev, len);
        else
            rc = kvx__stage_copy_start(r->device_id, 0, to_region ? (void *)dev : stage + at,
                                       to_region ? stage + at : dev, len, to_region, err);
        at += len;
    }
    if (r->device) {
        td_err e2;
        int w = kvx__stage_wait(r->device_id, 0, rc ? &e2 : err);
        if (!rc) rc = w;
    }
    return rc;
}

/*
 * Sleep until the worker has events or `max_ns` pass. Progress must have returned 0
 * just before; ucp_worker_arm says UCS_ERR_BUSY when events are already pending.
 */
static void worker_sleep(ucp_worker_h w, int efd, int other_fd, uint64_t max_ns)
{
    int ms = (int)TD_MIN(max_ns / 1000000ull + 1, 100ull);
    if (efd < 0) {
        struct timespec ts = {0, 20000}; /* no event fd: a short nap */
        nanosleep(&ts, NULL);
        return;
    }
    if (ucp_worker_arm(w) != UCS_OK) return;
    struct pollfd pf[2] = {{.fd = efd, .events = POLLIN}, {.fd = other_fd, .events = POLLIN}};
    poll(pf, other_fd >= 0 ? 2 : 1, ms);
}

/* ---------------------------------------------------------------- producer */

struct kvx__ucx_agent {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;
    ucp_mem_h memh; /* the region, or the staging area */
    void *rkey;
    size_t rkey_len;
    ucp_address_t *addr;
    size_t addr_len;
    kvx_region region;
    /* Staging (region_staged): n_slots slots of KVX__MAX_PIECE_BYTES, busy ones in
     * slot_busy (under smu); a grant waits up to STAGE_WAIT_NS for one. */
    uint8_t *stage;
    int n_slots;
    uint64_t slot_busy;
    pthread_mutex_t smu;
    pthread_cond_t scv;
    int wake[2]; /* a pipe: destroy wakes the progress thread */
    _Atomic bool stop;
    pthread_t thread;
    bool has_thread;
};

static void *agent_progress(void *arg)
{
    struct kvx__ucx_agent *u = arg;
    while (!atomic_load(&u->stop)) {
        if (ucp_worker_progress(u->worker)) continue;
        worker_sleep(u->worker, u->efd, u->wake[0], 100000000ull);
    }
    return NULL;
}

void kvx__ucx_agent_destroy(struct kvx__ucx_agent *u)
{
    if (!u) return;
    if (u->has_thread) {
        atomic_store(&u->stop, true);
        ssize_t w = write(u->wake[1], "x", 1);
        (void)w;
        pthread_join(u->thread, NULL);
    }
    if (u->wake[0] >= 0) close(u->wake[0]);
    if (u->wake[1] >= 0) close(u->wake[1]);
    if (u->rkey) ucp_rkey_buffer_release(u->rkey);
    if (u->addr) ucp_worker_release_address(u->worker, u->addr);
    if (u->worker) ucp_worker_destroy(u->worker);
    if (u->memh) ucp_mem_unmap(u->ctx, u->memh);
    if (u->ctx) ucp_cleanup(u->ctx);
    if (u->stage) stage_free(&u->region, u->stage);
    pthread_mutex_destroy(&u->smu);
    pthread_cond_destroy(&u->scv);
    free(u);
}

int kvx__ucx_agent_create(struct kvx__ucx_agent **out, const kvx_region *r, const char *device,
                          td_err *err)
{
    *out = NULL;
    struct kvx__ucx_agent *u = calloc(1, sizeof(*u));
    if (!u) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    u->region = *r;
    u->wake[0] = u->wake[1] = -1;
    pthread_mutex_init(&u->smu, NULL);
    kvx__cond_init_monotonic(&u->scv);
    int hook = atomic_load(&kvx__test_ucx_stage);
    if (region_staged(r)) u->n_slots = hook > 0 ? TD_MIN(hook, 64) : STAGE_SLOTS;
    int rc = context_create(&u->ctx, false, device, err);
    if (!rc) rc = worker_create(u->ctx, &u->worker, &u->efd, err);
    if (!rc && u->n_slots) {
        size_t bytes = (size_t)u->n_slots * KVX__MAX_PIECE_BYTES;
        rc = stage_alloc(r, bytes, &u->stage, err);
        if (!rc) rc = map_mem(u->ctx, u->stage, bytes, &u->memh, err);
    } else if (!rc) {
        rc = map_mem(u->ctx, r->base, region_bytes(r), &u->memh, err);
    }
    ucs_status_t st;
    if (!rc && (st = ucp_rkey_pack(u->ctx, u->memh, &u->rkey, &u->rkey_len)) != UCS_OK)
        rc = ucx_fail(err, TD_EIO, "cannot pack the region's rkey", st);
    if (!rc && (st = ucp_worker_get_address(u->worker, &u->addr, &u->addr_len)) != UCS_OK)
        rc = ucx_fail(err, TD_EIO, "cannot get the worker address", st);
    if (!rc && pipe2(u->wake, O_CLOEXEC | O_NONBLOCK))
        rc = td_err_set(err, TD_EIO, "kvx: ucx: pipe: %s", strerror(errno));
    if (!rc) {
        u->has_thread = pthread_create(&u->thread, NULL, agent_progress, u) == 0;
        if (!u->has_thread) rc = td_err_set(err, TD_ENOMEM, "kvx: ucx: cannot start a thread");
    }
    if (rc) {
        kvx__ucx_agent_destroy(u);
        return rc;
    }
    *out = u;
    return 0;
}

size_t kvx__ucx_agent_info(struct kvx__ucx_agent *u, uint8_t *buf, size_t cap, uint32_t tag)
{
    if (u->addr_len > KVX_MAX_UCX_BLOB || u->rkey_len > KVX_MAX_UCX_BLOB) return 0;
    if (u->stage)
        return kvx_wire_encode_ucx_info(buf, cap, tag, (uint64_t)(uintptr_t)u->stage,
                                        KVX__MAX_PIECE_BYTES,
                                        (uint64_t)u->n_slots * KVX__MAX_PIECE_BYTES,
                                        KVX__MAX_PIECE_BYTES, u->addr, (uint32_t)u->addr_len,
                                        u->rkey, (uint32_t)u->rkey_len);
    return kvx_wire_encode_ucx_info(buf, cap, tag, (uint64_t)(uintptr_t)u->region.base,
                                    u->region.segment_stride, region_bytes(&u->region), 0, u->addr,
                                    (uint32_t)u->addr_len, u->rkey, (uint32_t)u->rkey_len);
}

bool kvx__ucx_agent_staged(const struct kvx__ucx_agent *u)
{
    return u->stage != NULL;
}

int kvx__ucx_agent_stage(struct kvx__ucx_agent *u, const kvx_msg *grant, uint64_t bytes,
                         uint32_t *crc, uint64_t *off, td_err *err)
{
    const kvx_region *r = &u->region;
    if (bytes > KVX__MAX_PIECE_BYTES)
        return td_err_set(err, TD_ERANGE,
                          "kvx: ucx: a grant of %llu bytes is larger than a staging slot (%u)",
                          (unsigned long long)bytes, KVX__MAX_PIECE_BYTES);
    uint32_t n = grant->u.read.n_desc;
    kvx__piece_range *rg = malloc((n ? n : 1) * sizeof(*rg));
    if (!rg) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    for (uint32_t k = 0; k < n; k++) {
        kvx_wire_desc d = kvx_wire_get_desc(grant, k);
        rg[k] = (kvx__piece_range){d.segment, d.block, 0, d.n_blocks};
    }
    /* a free slot, waiting a bounded time for one */
    int slot = -1;
    const uint64_t until = td_now_ns() + STAGE_WAIT_NS;
    pthread_mutex_lock(&u->smu);
    for (;;) {
        for (int i = 0; i < u->n_slots && slot < 0; i++)
            if (!(u->slot_busy >> i & 1)) slot = i;
        if (slot >= 0 || kvx__cond_wait_until(&u->scv, &u->smu, until) == ETIMEDOUT) break;
    }
    if (slot >= 0) u->slot_busy |= 1ull << slot;
    pthread_mutex_unlock(&u->smu);
    int rc = 0;
    if (slot < 0) {
        rc = td_err_set(err, TD_ETIMEDOUT,
                        "kvx: ucx: all %d staging slots stayed busy for %llu ms", u->n_slots,
                        (unsigned long long)(STAGE_WAIT_NS / 1000000ull));
    } else {
        uint8_t *at = u->stage + (size_t)slot * KVX__MAX_PIECE_BYTES;
        rc = stage_copy(r, at, rg, n, false, err);
        for (uint32_t k = 0; k < n && !rc && crc; k++) {
            td_crc32c_blocks(at, r->block_bytes, rg[k].n, crc);
            at += (size_t)rg[k].n * r->block_bytes;
            crc += rg[k].n;
        }
        if (rc) {
            kvx__ucx_agent_unstage(u, (uint64_t)slot * KVX__MAX_PIECE_BYTES);
        } else {
            *off = (uint64_t)slot * KVX__MAX_PIECE_BYTES;
            atomic_fetch_add(&kvx__test_ucx_grants_staged, 1);
        }
    }
    free(rg);
    return rc;
}

void kvx__ucx_agent_unstage(struct kvx__ucx_agent *u, uint64_t off)
{
    pthread_mutex_lock(&u->smu);
    u->slot_busy &= ~(1ull << (off / KVX__MAX_PIECE_BYTES));
    pthread_cond_signal(&u->scv);
    pthread_mutex_unlock(&u->smu);
}

/* ---------------------------------------------------------------- consumer */

struct kvx__ucx_client {
    ucp_context_h ctx;
    ucp_mem_h memh;     /* the consumer's whole region; NULL when it is staged */
    bool staged;        /* region_staged: gets land in each channel's staging buffer */
    pthread_mutex_t mu; /* creates sessions' channel pools */
    /* Set once an endpoint with peer failure detection was unreachable (UCX's
     * shared-memory transports lack it): later endpoints go without. */
    _Atomic bool no_peer_mode;
};

/* A control connection with its own UCX worker, endpoint to the producer and rkey. */
typedef struct chan {
    int fd;
    ucp_worker_h worker;
    int efd;
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    bool peer_mode;         /* UCP_ERR_HANDLING_MODE_PEER: errors reported, force close */
    ucs_status_t ep_status; /* set by the error handler (on this channel's thread) */
    uint64_t base, stride, bytes;
    uint64_t stage_slot; /* the producer's staging slot size (0: it is read in place) */
    /* A staged consumer's buffer, registered with the client's context, grown on use. */
    uint8_t *stage;
    size_t stage_cap;
    ucp_mem_h stage_memh;
    ucp_context_h ctx;
    const kvx_region *region;
} chan;

typedef struct chan_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    chan **idle;
    int n_idle, n_open, max_open;
} chan_pool;

int kvx__ucx_client_create(struct kvx__ucx_client **out, const kvx_client_opts *opts,
                           const char *device, td_err *err)
{
    *out = NULL;
    struct kvx__ucx_client *u = calloc(1, sizeof(*u));
    if (!u) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    int rc = context_create(&u->ctx, true, device, err);
    u->staged = region_staged(&opts->region);
    if (!rc && !u->staged &&
        (rc = map_mem(u->ctx, opts->region.base, region_bytes(&opts->region), &u->memh, err)))
        ucp_cleanup(u->ctx);
    if (rc) {
        free(u);
        return rc;
    }
    pthread_mutex_init(&u->mu, NULL);
    *out = u;
    return 0;
}

void kvx__ucx_client_destroy(struct kvx__ucx_client *u)
{
    if (!u) return;
    if (u->memh) ucp_mem_unmap(u->ctx, u->memh);
    ucp_cleanup(u->ctx);
    pthread_mutex_destroy(&u->mu);
    free(u);
}

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    ((chan *)arg)->ep_status = status;
}

/*
 * Close a channel (its requests in flight already released with gets_drop). The endpoint
 * is force-closed first, which stops its gets, and only then the control connection,
 * whose close lets the producer unpin.
 */
static void chan_close(chan *ch)
{
    if (ch->ep) {
        /* Without peer failure handling UCX allows no forced close: flush, bounded. */
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                   .flags = ch->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0};
        ucs_status_ptr_t req = ucp_ep_close_nbx(ch->ep, &prm);
        if (UCS_PTR_IS_PTR(req)) {
            uint64_t until = td_now_ns() + CLOSE_TIMEOUT_NS;
            while (ucp_request_check_status(req) == UCS_INPROGRESS && td_now_ns() < until)
                if (!ucp_worker_progress(ch->worker))
                    worker_sleep(ch->worker, ch->efd, -1, 1000000);
            ucp_request_free(req);
        }
    }
    if (ch->rkey) ucp_rkey_destroy(ch->rkey);
    if (ch->worker) ucp_worker_destroy(ch->worker);
    if (ch->stage_memh) ucp_mem_unmap(ch->ctx, ch->stage_memh);
    if (ch->stage) stage_free(ch->region, ch->stage);
    if (ch->fd >= 0) close(ch->fd);
    free(ch);
}

/* A staged consumer's channel buffer of at least `bytes`, registered. */
static int chan_stage(chan *ch, size_t bytes, td_err *err)
{
    if (ch->stage_cap >= bytes) return 0;
    if (ch->stage_memh) ucp_mem_unmap(ch->ctx, ch->stage_memh);
    if (ch->stage) stage_free(ch->region, ch->stage);
    ch->stage_memh = NULL;
    ch->stage_cap = 0;
    bytes = TD_MAX(bytes, (size_t)KVX__MAX_PIECE_BYTES);
    int rc = stage_alloc(ch->region, bytes, &ch->stage, err);
    if (!rc && (rc = map_mem(ch->ctx, ch->stage, bytes, &ch->stage_memh, err))) {
        stage_free(ch->region, ch->stage);
        ch->stage = NULL;
    }
    if (!rc) ch->stage_cap = bytes;
    return rc;
}

static void pool_free(void *state)
{
    chan_pool *p = state;
    for (int i = 0; i < p->n_idle; i++)
        chan_close(p->idle[i]);
    free(p->idle);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

static chan_pool *pool_of(struct kvx__session *s)
{
    struct kvx__ucx_client *u = kvx__session_client_state(s);
    void **slot = kvx__session_transport_state(s);
    pthread_mutex_lock(&u->mu);
    chan_pool *p = *slot;
    if (!p && (p = calloc(1, sizeof(*p)))) {
        p->max_open = kvx__session_opts(s)->qp_per_transfer;
        p->idle = calloc((size_t)p->max_open, sizeof(chan *));
        if (!p->idle) {
            free(p);
            p = NULL;
        } else {
            pthread_mutex_init(&p->mu, NULL);
            kvx__cond_init_monotonic(&p->cv);
            *slot = p;
        }
    }
    pthread_mutex_unlock(&u->mu);
    return p;
}

/* Open a channel: control connection, HELLO, UCX_INFO, then the endpoint and rkey. */
static int chan_open(struct kvx__session *s, uint64_t deadline_ns, chan **out, td_err *err)
{
    struct kvx__ucx_client *u = kvx__session_client_state(s);
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    chan *ch = calloc(1, sizeof(*ch));
    size_t cap = 32 + 2 * (size_t)KVX_MAX_UCX_BLOB;
    uint8_t *buf = malloc(cap);
    if (!ch || !buf) {
        free(ch);
        free(buf);
        return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    }
    ch->fd = -1;
    ch->efd = -1;
    ch->ctx = u->ctx;
    ch->region = &kvx__session_opts(s)->region;
    int rc = kvx__session_connect(s, deadline_ns, &ch->fd, err);
    if (rc) ch->fd = -1;
    kvx_msg m;
    if (!rc) {
        size_t n = kvx_wire_encode_empty(buf, cap, KVX_MSG_UCX_INFO, 1);
        rc = kvx__send_all(ch->fd, buf, n, deadline_ns, err);
    }
    if (!rc) rc = kvx__recv_frame(ch->fd, buf, cap, &m, deadline_ns, err);
    if (!rc && m.hdr.type == KVX_MSG_ERROR)
        rc = td_err_set(err, m.u.error.code, "kvx: producer %s:%u: %s", host, port, m.u.error.msg);
    else if (!rc && m.hdr.type != KVX_MSG_UCX_INFO_ACK)
        rc = td_err_set(err, TD_EPROTO, "kvx: producer %s:%u answered UCX_INFO with %s", host, port,
                        kvx_wire_type_name(m.hdr.type));
    if (!rc) rc = worker_create(u->ctx, &ch->worker, &ch->efd, err);
    ucs_status_t st = UCS_OK;
    if (!rc) {
        ch->base = m.u.ucx_info.base;
        ch->stride = m.u.ucx_info.segment_stride;
        ch->bytes = m.u.ucx_info.bytes;
        ch->stage_slot = m.u.ucx_info.stage_slot;
        ch->ep_status = UCS_OK;
        /* Peer failure detection where the transports have it (tcp, RDMA): a dead
         * producer then fails the gets at once instead of at the deadline. */
        ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLER,
                              .address = (const ucp_address_t *)m.u.ucx_info.addr,
                              .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                              .err_handler = {.cb = ep_error, .arg = ch}};
        ch->peer_mode = !atomic_load(&u->no_peer_mode);
        if (!ch->peer_mode) ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        st = ucp_ep_create(ch->worker, &ep, &ch->ep);
        if (st == UCS_ERR_UNREACHABLE && ch->peer_mode) {
            ch->peer_mode = false;
            ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
            if ((st = ucp_ep_create(ch->worker, &ep, &ch->ep)) == UCS_OK)
                atomic_store(&u->no_peer_mode, true);
        }
        if (st != UCS_OK) {
            ch->ep = NULL;
            rc = td_err_set(err, TD_ECONN,
                            "kvx: ucx: cannot reach producer %s:%u's worker: %s (no transport "
                            "in common? check UCX_TLS and UCX_NET_DEVICES on both sides)",
                            host, port, ucs_status_string(st));
        }
    }
    if (!rc && (st = ucp_ep_rkey_unpack(ch->ep, m.u.ucx_info.rkey, &ch->rkey)) != UCS_OK) {
        ch->rkey = NULL;
        rc = ucx_fail(err, TD_EPROTO, "cannot unpack the producer's rkey", st);
    }
    free(buf);
    if (rc) {
        chan_close(ch);
        return rc;
    }
    *out = ch;
    return 0;
}

/* A channel of the session: an idle one, a new one, or wait for one (tcp's conn_get). */
static int chan_get(struct kvx__session *s, chan_pool *p, uint64_t deadline_ns, chan **out,
                    bool *fresh, td_err *err)
{
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (p->n_idle > 0) {
            chan *ch = p->idle[--p->n_idle];
            /* An idle control connection has nothing to read: readable means the producer
             * hung up. Drop it instead of failing a request on it. */
            struct pollfd pf = {.fd = ch->fd, .events = POLLIN};
            if (poll(&pf, 1, 0) != 0 || ch->ep_status != UCS_OK) {
                p->n_open--;
                pthread_mutex_unlock(&p->mu);
                chan_close(ch);
                pthread_mutex_lock(&p->mu);
                continue;
            }
            pthread_mutex_unlock(&p->mu);
            *out = ch;
            *fresh = false;
            return 0;
        }
        if (p->n_open < p->max_open) {
            p->n_open++;
            pthread_mutex_unlock(&p->mu);
            int rc = chan_open(s, deadline_ns, out, err);
            if (rc) {
                pthread_mutex_lock(&p->mu);
                p->n_open--;
                pthread_cond_signal(&p->cv);
                pthread_mutex_unlock(&p->mu);
                return rc;
            }
            *fresh = true;
            return 0;
        }
        uint64_t now = td_now_ns();
        if (now >= deadline_ns) {
            pthread_mutex_unlock(&p->mu);
            return td_err_set(err, TD_ETIMEDOUT,
                              "kvx: deadline passed waiting for a ucx channel to %s:%u",
                              kvx__session_host(s), kvx__session_port(s));
        }
        kvx__cond_wait_until(&p->cv, &p->mu, now + TD_MIN(deadline_ns - now, 1000000000ull));
    }
}

static void chan_put(chan_pool *p, chan *ch, bool ok)
{
    pthread_mutex_lock(&p->mu);
    bool keep = ok && p->n_idle < p->max_open;
    if (keep)
        p->idle[p->n_idle++] = ch;
    else
        p->n_open--;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (!keep) chan_close(ch);
}

/*
 * Gets are cut into chunks of about BATCH_BYTES of one range, issued a window at a time,
 * and each chunk's blocks are checksummed as soon as it lands, while they are in cache
 * (the tcp transport does the same with its receive batches). Shared memory (cma) gets
 * complete inside ucp_get_nbx; tcp and RDMA ones keep up to WINDOW chunks in flight.
 */
#define BATCH_BYTES (256u << 10)
#define WINDOW 16

typedef struct get_chunk {
    void *req; /* the UCX request while in flight */
    uint8_t *dst;
    uint64_t remote;
    uint32_t seg, dst_block, src_block, n, crc_at;
} get_chunk;

typedef struct gets {
    get_chunk *c;
    uint32_t n, issued, done;
} gets;

/* Release the requests still in flight (before the channel's endpoint is closed). */
static void gets_drop(gets *g)
{
    for (uint32_t i = g->done; i < g->issued; i++)
        if (g->c[i].req) {
            ucp_request_free(g->c[i].req);
            g->c[i].req = NULL;
        }
}

/*
 * A piece that gave up (its deadline) with gets in flight lets them finish before its
 * endpoint closes, for at most DRAIN_NS: over UCX's tcp transport the producer's worker
 * answers gets in software, and answering one for an endpoint force-closed under it
 * aborts the producer's process (UCX 1.13, ucp_get_req_handler: "Endpoint timeout").
 */
#define DRAIN_NS (5ull * 1000000000ull)

static void gets_drain(chan *ch, gets *g)
{
    uint64_t until = td_now_ns() + DRAIN_NS;
    while (ch->ep_status == UCS_OK && td_now_ns() < until) {
        bool busy = false;
        for (uint32_t i = g->done; i < g->issued; i++) {
            if (!g->c[i].req) continue;
            if (ucp_request_check_status(g->c[i].req) == UCS_INPROGRESS) {
                busy = true;
                continue;
            }
            ucp_request_free(g->c[i].req);
            g->c[i].req = NULL;
        }
        if (!busy) return;
        if (!ucp_worker_progress(ch->worker)) worker_sleep(ch->worker, ch->efd, -1, 1000000);
    }
}

/*
 * Run the gets until all are in and checked, or until until_ns. A checksum mismatch is
 * returned only after every get has finished (so the channel stays clean); an I/O error
 * or the deadline returns at once with gets still in flight (the caller closes).
 */
static int gets_run(struct kvx__session *s, chan *ch, struct kvx__ucx_client *u, gets *g,
                    uint64_t block_bytes, const uint8_t *want_crc, uint32_t *crc, uint64_t until_ns,
                    td_err *err)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH,
                               .memh = u->staged ? ch->stage_memh : u->memh};
    bool corrupt = atomic_load(&kvx__test_corrupt_pieces) > 0 &&
                   atomic_fetch_sub(&kvx__test_corrupt_pieces, 1) > 0;
    int mismatch = 0;
    for (;;) {
        while (g->issued < g->n && g->issued - g->done < WINDOW) {
            get_chunk *c = &g->c[g->issued++];
            ucs_status_ptr_t sp =
                ucp_get_nbx(ch->ep, c->dst, (size_t)c->n * block_bytes, c->remote, ch->rkey, &prm);
            if (UCS_PTR_IS_ERR(sp))
                return td_err_set(err, TD_ECONN, "kvx: ucx get from %s:%u failed: %s",
                                  kvx__session_host(s), kvx__session_port(s),
                                  ucs_status_string(UCS_PTR_STATUS(sp)));
            c->req = sp;
            if (sp) break; /* in flight: look at the completions first */
        }
        while (g->done < g->issued) {
            get_chunk *c = &g->c[g->done];
            if (c->req) {
                ucs_status_t st = ucp_request_check_status(c->req);
                if (st == UCS_INPROGRESS) break;
                ucp_request_free(c->req);
                c->req = NULL;
                if (st != UCS_OK)
                    return td_err_set(err, TD_ECONN, "kvx: ucx get from %s:%u failed: %s",
                                      kvx__session_host(s), kvx__session_port(s),
                                      ucs_status_string(st));
            }
            g->done++;
            if (corrupt) {
                c->dst[block_bytes / 2] ^= 0x40;
                corrupt = false;
            }
            if (!want_crc || mismatch) continue;
            td_crc32c_blocks(c->dst, block_bytes, c->n, crc + c->crc_at);
            for (uint32_t j = 0; j < c->n; j++)
                if (crc[c->crc_at + j] != kvx_wire_trailer_get(want_crc, c->crc_at + j)) {
                    mismatch = td_err_set(err, TD_EPROTO,
                                          "kvx: checksum mismatch in segment %u, block %u "
                                          "(producer block %u) from %s:%u",
                                          c->seg, c->dst_block + j, c->src_block + j,
                                          kvx__session_host(s), kvx__session_port(s));
                    break;
                }
        }
        if (g->done == g->n) return mismatch;
        if (ch->ep_status != UCS_OK)
            return td_err_set(err, TD_ECONN, "kvx: ucx endpoint to %s:%u failed: %s",
                              kvx__session_host(s), kvx__session_port(s),
                              ucs_status_string(ch->ep_status));
        uint64_t now = td_now_ns();
        if (now >= until_ns)
            return td_err_set(err, TD_ETIMEDOUT,
                              "kvx: deadline passed during ucx gets from %s:%u (%u of %u "
                              "chunks in)",
                              kvx__session_host(s), kvx__session_port(s), g->done, g->n);
        if (g->issued < g->n && g->issued - g->done < WINDOW) continue; /* room to issue */
        if (!ucp_worker_progress(ch->worker)) worker_sleep(ch->worker, ch->efd, -1, until_ns - now);
    }
}

static int ucx_run_piece(struct kvx__session *s, struct kvx__piece *p, td_err *err)
{
    const kvx_client_opts *o = kvx__session_opts(s);
    struct kvx__ucx_client *u = kvx__session_client_state(s);
    const kvx_region *r = &o->region;
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    kvx__piece_info pi;
    kvx__piece_get_info(p, &pi);
    bool want_crc = o->verify_checksums;
    chan_pool *pool = pool_of(s);
    uint32_t per_chunk = kvx__batch_blocks(r->block_bytes, BATCH_BYTES);
    size_t max_chunks = pi.count + pi.blocks / per_chunk + 1;
    size_t in_cap = 8 + 4 * (size_t)(want_crc ? pi.blocks : 0) + 512;
    size_t req_n = 0;
    uint8_t *req = kvx__grant_request(p, want_crc, &req_n), *in = malloc(in_cap);
    gets g = {.c = calloc(max_chunks, sizeof(get_chunk))};
    uint32_t *crc = want_crc ? malloc(pi.blocks * sizeof(uint32_t)) : NULL;
    chan *ch = NULL;
    int rc = 0;
    if (!pool || !req || !in || !g.c || (want_crc && !crc)) {
        rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        goto out;
    }

    /* Ask the producer to check and pin the ranges. */
    kvx_msg m;
    for (int attempt = 0;; attempt++) {
        bool fresh;
        rc = chan_get(s, pool, pi.deadline_ns, &ch, &fresh, err);
        if (rc) {
            ch = NULL;
            goto out;
        }
        rc = kvx__send_all(ch->fd, req, req_n, pi.deadline_ns, err);
        if (!rc) rc = kvx__recv_frame(ch->fd, in, in_cap, &m, pi.deadline_ns, err);
        if (!rc) break;
        chan_put(pool, ch, false);
        ch = NULL;
        /* A reused channel may have died with its producer's previous life: retry once on
         * a fresh one, whose handshake tells what really happened. */
        if (rc != TD_ECONN || fresh || attempt > 0) goto out;
    }
    if (m.hdr.type == KVX_MSG_ERROR) {
        chan_put(pool, ch, true);
        ch = NULL;
        rc = td_err_set(err, m.u.error.code, "kvx: producer %s:%u: %s", host, port, m.u.error.msg);
        goto out;
    }
    uint32_t want_n_crc = want_crc ? (uint32_t)pi.blocks : 0;
    if (m.hdr.type != KVX_MSG_UCX_GRANTED || m.hdr.tag != pi.tag ||
        m.u.ucx_granted.n_crc != want_n_crc) {
        rc = td_err_set(err, TD_EPROTO,
                        "kvx: producer %s:%u answered UCX_GRANT with %s (tag %u, %u checksums; "
                        "expected UCX_GRANTED, tag %u, %u checksums)",
                        host, port, kvx_wire_type_name(m.hdr.type), m.hdr.tag,
                        m.u.ucx_granted.n_crc, pi.tag, want_n_crc);
        goto out; /* closes the channel: nothing was read */
    }
    /* The pin lasts valid_ms from the producer's send: stop well before it ends. */
    uint64_t until =
        TD_MIN(pi.deadline_ns, td_now_ns() + (uint64_t)m.u.ucx_granted.valid_ms * 750000ull);
    /* A staging producer says where in its area the ranges lie (packed, in order). */
    uint64_t soff = m.u.ucx_granted.stage_off;
    bool from_stage = ch->stage_slot != 0;
    if (from_stage ? soff == KVX_NOT_STAGED || pi.bytes > ch->stage_slot || soff > ch->bytes ||
                         pi.bytes > ch->bytes - soff
                   : soff != KVX_NOT_STAGED) {
        rc = td_err_set(err, TD_EPROTO,
                        "kvx: producer %s:%u staged a %llu-byte grant at offset %lld of a "
                        "%llu-byte area with %llu-byte slots",
                        host, port, (unsigned long long)pi.bytes,
                        soff == KVX_NOT_STAGED ? -1ll : (long long)soff,
                        (unsigned long long)ch->bytes, (unsigned long long)ch->stage_slot);
        goto out; /* closes the channel: nothing was read */
    }
    if (u->staged && (rc = chan_stage(ch, pi.bytes, err))) goto out;

    /* The gets go straight into the registered consumer region (or its staging), in
     * chunks. */
    uint32_t crc_at = 0;
    uint64_t packed = 0; /* where range k starts in packed (staged) order */
    for (uint32_t k = 0; k < pi.count && !rc; k++) {
        kvx__piece_range d = kvx__piece_get_range(p, k);
        uint64_t len = (uint64_t)d.n * r->block_bytes;
        uint64_t off = from_stage ? soff + packed
                                  : (uint64_t)d.seg * ch->stride + (uint64_t)d.src * r->block_bytes;
        if (!from_stage && (off > ch->bytes || len > ch->bytes - off)) {
            rc = td_err_set(err, TD_EPROTO,
                            "kvx: producer %s:%u's region (%llu bytes) does not hold segment "
                            "%u, blocks %u+%u",
                            host, port, (unsigned long long)ch->bytes, d.seg, d.src, d.n);
            break;
        }
        uint8_t *dst =
            u->staged ? ch->stage + packed : (uint8_t *)r->base + kvx__offset(r, d.seg, d.dst);
        for (uint32_t j = 0; j < d.n; j += per_chunk) {
            uint32_t cn = TD_MIN(d.n - j, per_chunk);
            g.c[g.n++] = (get_chunk){.dst = dst + (uint64_t)j * r->block_bytes,
                                     .remote = ch->base + off + (uint64_t)j * r->block_bytes,
                                     .seg = d.seg,
                                     .dst_block = d.dst + j,
                                     .src_block = d.src + j,
                                     .n = cn,
                                     .crc_at = crc_at};
            crc_at += cn;
        }
        packed += len;
    }
    if (rc) goto out; /* closes the channel: nothing was read */
    rc = gets_run(s, ch, u, &g, r->block_bytes, want_crc ? m.u.ucx_granted.crc : NULL, crc, until,
                  err);
    if (rc && g.done < g.n) { /* the channel closes, once the gets issued are over */
        gets_drain(ch, &g);
        goto out;
    }
    if (!rc && u->staged) { /* checked in staging: now up to the blocks */
        kvx__piece_range *rg = malloc(pi.count * sizeof(*rg));
        if (!rg) rc = td_err_set(err, TD_ENOMEM, "kvx: out of memory");
        for (uint32_t k = 0; rg && k < pi.count; k++)
            rg[k] = kvx__piece_get_range(p, k);
        if (rg) rc = stage_copy(r, ch->stage, rg, pi.count, true, err);
        if (!rc) atomic_fetch_add(&kvx__test_ucx_pieces_unstaged, 1);
        free(rg);
    }

    /* The gets are over: unpin. The channel stays usable after a checksum mismatch. If
     * UCX_DONE cannot be sent, the channel closes, which unpins too; the bytes are in. */
    size_t n = kvx_wire_encode_empty(req, KVX_HDR_BYTES, KVX_MSG_UCX_DONE, pi.tag);
    td_err e;
    bool sent = kvx__send_all(ch->fd, req, n, pi.deadline_ns, &e) == 0;
    chan_put(pool, ch, sent);
    ch = NULL;
out:
    if (ch) {
        gets_drop(&g);
        chan_put(pool, ch, false);
    }
    free(req);
    free(in);
    free(g.c);
    free(crc);
    return rc;
}


const kvx__transport kvx__ucx_transport = {"ucx", ucx_run_piece, kvx__session_control, pool_free};
