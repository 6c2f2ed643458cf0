/*
 * pd/pd.c - the prefill/decode connector (see pd.h).
 *
 * Threads: kvx runs the transfers and calls back on its own threads. Releasing a
 * producer's lease is a round trip that may wait on a dead peer until the deadline, so
 * it never runs on a kvx worker or the engine thread: a small release thread takes them
 * from a queue.
 */
#include "pd/pd.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvx/rails.h"
#include "util/td.h"

enum { FAIL_TIMEOUT, FAIL_CONN, FAIL_CHECKSUM, FAIL_PROTOCOL, FAIL_NOT_FOUND, FAIL_CANCELED,
       FAIL_OTHER, FAIL_N };
static const char *const FAIL_NAMES[FAIL_N] = {"timeout",   "connection", "checksum", "protocol",
                                               "not_found", "canceled",   "other"};

#define N_BUCKETS 12
static const double BUCKETS[N_BUCKETS] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                          0.05,   0.1,   0.25,   0.5,   1.0,  5.0};

typedef struct rel_item {
    char host[256];
    uint16_t port;
    char engine_id[KVX_ID_HEX], transfer_id[KVX_ID_HEX];
    struct rel_item *next;
} rel_item;

/* A remote lease kept alive while its request waits here. */
typedef struct watch_item {
    uint64_t req_id;
    rel_item where;
    uint64_t period_ns, next_ns;
    struct watch_item *next;
} watch_item;

struct pd_connector {
    pd_config cfg;
    kvx_rails rails; /* n 0: none (cfg.rails points here after pd_create) */
    char host[256];
    char token[256];
    td_kv_info kv;
    kvx_agent *agent;
    kvx_client *client;
    pd_release_fn release_cb;
    pd_loaded_fn loaded_cb;
    void *user;

    pthread_t rel_thread;
    bool rel_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rel_item *rel_head, *rel_tail;
    watch_item *watches;
    bool stopping;

    /* producer pushes under way (engine thread only): request id -> transfer id */
    struct push_item {
        uint64_t req_id;
        char transfer_id[KVX_ID_HEX];
        bool dropped; /* preempted: the transfer was cancelled */
    } *pushes;
    int n_pushes, cap_pushes;

    /* metrics, under mu */
    uint64_t loads_ok, failures[FAIL_N], bytes, descriptors, blocks, holds, heartbeats,
        heartbeat_failures, push_loads, push_opened;
    uint64_t hist[N_BUCKETS + 1];
    double hist_sum;
};

typedef struct load_ctx {
    pd_connector *pd;
    uint64_t req_id;
    rel_item rel;
    uint32_t n_blocks;
    bool push;
} load_ctx;

/* The note a push's producer sends with its last announcement: the first token and the
 * producer's timing, little-endian (i32, f64, f64). */
#define NOTE_BYTES 20

static void note_encode(uint8_t out[NOTE_BYTES], int32_t first_token, double queue_ms,
                        double compute_ms)
{
    uint32_t t = (uint32_t)first_token;
    uint64_t q, c;
    memcpy(&q, &queue_ms, 8);
    memcpy(&c, &compute_ms, 8);
    for (int i = 0; i < 4; i++)
        out[i] = (uint8_t)(t >> (8 * i));
    for (int i = 0; i < 8; i++) {
        out[4 + i] = (uint8_t)(q >> (8 * i));
        out[12 + i] = (uint8_t)(c >> (8 * i));
    }
}

static void note_decode(const uint8_t *p, size_t n, pd_load_info *info)
{
    info->first_token = -1;
    if (n != NOTE_BYTES) return;
    uint32_t t = 0;
    uint64_t q = 0, c = 0;
    for (int i = 0; i < 4; i++)
        t |= (uint32_t)p[i] << (8 * i);
    for (int i = 0; i < 8; i++) {
        q |= (uint64_t)p[4 + i] << (8 * i);
        c |= (uint64_t)p[12 + i] << (8 * i);
    }
    info->first_token = (int32_t)t;
    memcpy(&info->prod_queue_ms, &q, 8);
    memcpy(&info->prod_compute_ms, &c, 8);
    if (!(info->prod_queue_ms >= 0 && info->prod_queue_ms < 1e9)) info->prod_queue_ms = 0;
    if (!(info->prod_compute_ms >= 0 && info->prod_compute_ms < 1e9)) info->prod_compute_ms = 0;
}

void pd_remote_free(pd_remote *r)
{
    free(r->blocks);
    r->blocks = NULL;
    r->n_blocks = 0;
}

/* ---- the release thread ---- */

/* Send the heartbeats that are due (mu held on entry and exit). Returns when the next
 * one is due (0: none watched). */
static uint64_t beat_due(pd_connector *pd)
{
    uint64_t now = td_now_ns(), next = 0;
    for (watch_item *w = pd->watches; w; w = w->next) {
        if (w->next_ns <= now) {
            rel_item where = w->where;
            uint64_t id = w->req_id;
            w->next_ns = now + w->period_ns;
            pthread_mutex_unlock(&pd->mu);
            td_err err = {0};
            int rc = kvx_heartbeat(pd->client, where.host, where.port, where.engine_id,
                                   where.transfer_id, &err);
            pthread_mutex_lock(&pd->mu);
            pd->heartbeats++;
            if (rc) {
                pd->heartbeat_failures++;
                TD_DEBUG("kv heartbeat for request %llu: %s", (unsigned long long)id, err.msg);
            }
            return beat_due(pd); /* the list may have changed while unlocked */
        }
        if (!next || w->next_ns < next) next = w->next_ns;
    }
    return next;
}

static void *rel_main(void *arg)
{
    pd_connector *pd = arg;
    pthread_mutex_lock(&pd->mu);
    for (;;) {
        while (!pd->rel_head && !pd->stopping) {
            uint64_t next = beat_due(pd);
            if (pd->rel_head || pd->stopping) break;
            if (!next) {
                pthread_cond_wait(&pd->cv, &pd->mu);
            } else {
                /* the condition variable uses CLOCK_REALTIME; heartbeats are not exact */
                uint64_t wait = next > td_now_ns() ? next - td_now_ns() : 0;
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                uint64_t t = (uint64_t)ts.tv_nsec + wait;
                ts.tv_sec += (time_t)(t / 1000000000ull);
                ts.tv_nsec = (long)(t % 1000000000ull);
                pthread_cond_timedwait(&pd->cv, &pd->mu, &ts);
            }
        }
        rel_item *it = pd->rel_head;
        if (!it) break; /* stopping and nothing left */
        pd->rel_head = it->next;
        if (!pd->rel_head) pd->rel_tail = NULL;
        pthread_mutex_unlock(&pd->mu);
        td_err err = {0};
        int rc = kvx_release(pd->client, it->host, it->port, it->engine_id, it->transfer_id, &err);
        if (rc && rc != TD_ENOTFOUND)
            TD_DEBUG("kv release of %.8s at %s:%u: %s", it->transfer_id, it->host, it->port,
                     err.msg);
        free(it);
        pthread_mutex_lock(&pd->mu);
    }
    pthread_mutex_unlock(&pd->mu);
    return NULL;
}

static void rel_push(pd_connector *pd, const rel_item *src)
{
    rel_item *it = malloc(sizeof(*it));
    if (!it) return; /* the producer's lease expires instead */
    *it = *src;
    it->next = NULL;
    pthread_mutex_lock(&pd->mu);
    if (pd->stopping) {
        pthread_mutex_unlock(&pd->mu);
        free(it);
        return;
    }
    if (pd->rel_tail)
        pd->rel_tail->next = it;
    else
        pd->rel_head = it;
    pd->rel_tail = it;
    pthread_cond_signal(&pd->cv);
    pthread_mutex_unlock(&pd->mu);
}

/* ---- producer ---- */

static void on_lease_end(void *user, const char *transfer_id, const int32_t *blocks, int n_blocks,
                         kvx_release_reason reason, void *transfer_user)
{
    (void)blocks;
    (void)n_blocks;
    pd_connector *pd = user;
    TD_DEBUG("kv lease %.8s ended (%s)", transfer_id,
             reason == KVX_RELEASED_BY_CONSUMER ? "released"
             : reason == KVX_RELEASED_EXPIRED  ? "expired"
                                               : "canceled");
    pd->release_cb(pd->user, (uint64_t)(uintptr_t)transfer_user);
}

int pd_hold(pd_connector *pd, uint64_t req_id, const int32_t *blocks, int n_blocks,
            char transfer_id[KVX_ID_HEX], td_err *err)
{
    if (!pd->agent) return td_err_set(err, TD_ESTATE, "this engine is not a KV producer");
    int rc = kvx_agent_register(pd->agent, blocks, n_blocks, 0, (void *)(uintptr_t)req_id,
                                transfer_id, err);
    if (rc == 0) {
        pthread_mutex_lock(&pd->mu);
        pd->holds++;
        pthread_mutex_unlock(&pd->mu);
    }
    return rc;
}

int pd_cancel(pd_connector *pd, const char *transfer_id)
{
    return pd->agent ? kvx_agent_cancel(pd->agent, transfer_id) : TD_ENOTFOUND;
}

/* ---- producer: push ---- */

static struct push_item *push_find(pd_connector *pd, uint64_t req_id)
{
    for (int i = 0; i < pd->n_pushes; i++)
        if (pd->pushes[i].req_id == req_id) return &pd->pushes[i];
    return NULL;
}

static void push_forget(pd_connector *pd, struct push_item *it)
{
    *it = pd->pushes[--pd->n_pushes];
}

int pd_push_open(pd_connector *pd, uint64_t req_id, const char *transfer_id, int n_blocks,
                 td_err *err)
{
    if (!pd->agent) return td_err_set(err, TD_ESTATE, "this engine is not a KV producer");
    if (pd->n_pushes == pd->cap_pushes) {
        int cap = pd->cap_pushes ? 2 * pd->cap_pushes : 16;
        struct push_item *np = realloc(pd->pushes, (size_t)cap * sizeof(*np));
        if (!np) return td_err_set(err, TD_ENOMEM, "out of memory");
        pd->pushes = np;
        pd->cap_pushes = cap;
    }
    int rc = kvx_agent_push_open(pd->agent, transfer_id, n_blocks, (void *)(uintptr_t)req_id, err);
    if (rc) return rc;
    struct push_item *it = &pd->pushes[pd->n_pushes++];
    it->req_id = req_id;
    snprintf(it->transfer_id, sizeof(it->transfer_id), "%s", transfer_id);
    it->dropped = false;
    /* A push is a lease from its opening: it is in the agent's table (active) from now,
     * and its end, finished or cancelled, counts as released or expired. */
    pthread_mutex_lock(&pd->mu);
    pd->push_opened++;
    pd->holds++;
    pthread_mutex_unlock(&pd->mu);
    return 0;
}

void pd_push_progress(void *user, int layer, const td_layer_progress *p, int n)
{
    pd_connector *pd = user;
    int bs = pd->kv.block_size;
    for (int i = 0; i < n; i++) {
        struct push_item *it = push_find(pd, p[i].id);
        if (!it || it->dropped) continue;
        if (layer < 0) { /* preempted: its blocks are gone; the consumer recomputes */
            it->dropped = true;
            (void)kvx_agent_cancel(pd->agent, it->transfer_id);
            continue;
        }
        int ready = p[i].n_done == p[i].n_prompt ? (p[i].n_done + bs - 1) / bs : p[i].n_done / bs;
        if (ready > 0)
            (void)kvx_agent_push_ready(pd->agent, it->transfer_id, (uint32_t)layer, ready,
                                       p[i].blocks);
    }
}

int pd_push_finish(pd_connector *pd, uint64_t req_id, const int32_t *blocks, int n_blocks,
                   int32_t first_token, double queue_ms, double compute_ms,
                   char transfer_id[KVX_ID_HEX])
{
    struct push_item *it = push_find(pd, req_id);
    if (!it) return TD_ENOTFOUND;
    bool dropped = it->dropped;
    memcpy(transfer_id, it->transfer_id, KVX_ID_HEX);
    push_forget(pd, it);
    if (dropped) return TD_ENOTFOUND;
    (void)n_blocks; /* the transfer was opened with this count */
    uint8_t note[NOTE_BYTES];
    note_encode(note, first_token, queue_ms, compute_ms);
    /* (counted as a lease when it opened: it has been in the agent's table since) */
    return kvx_agent_push_finish(pd->agent, transfer_id, blocks, note, sizeof(note));
}

void pd_push_abort(pd_connector *pd, uint64_t req_id)
{
    struct push_item *it = push_find(pd, req_id);
    if (!it) return;
    char id[KVX_ID_HEX];
    memcpy(id, it->transfer_id, KVX_ID_HEX);
    bool dropped = it->dropped;
    push_forget(pd, it);
    if (!dropped) (void)kvx_agent_cancel(pd->agent, id);
}

const char *pd_engine_id(const pd_connector *pd)
{
    return pd->agent ? kvx_agent_engine_id(pd->agent) : "";
}

const char *pd_host(const pd_connector *pd)
{
    return pd->host;
}

int pd_port(const pd_connector *pd)
{
    return pd->agent ? kvx_agent_port(pd->agent) : 0;
}

uint32_t pd_lease_ms(const pd_connector *pd)
{
    return pd->cfg.lease_ms;
}

/* ---- consumer ---- */

static int fail_reason(int code, const char *msg)
{
    switch (code) {
    case TD_ETIMEDOUT: return FAIL_TIMEOUT;
    case TD_ECONN:
    case TD_EBUSY:
        return FAIL_CONN;
    case TD_ENOTFOUND: return FAIL_NOT_FOUND;
    case TD_ECANCELED: return FAIL_CANCELED;
    case TD_EPROTO:
    case TD_EFORMAT: return msg && strstr(msg, "checksum") ? FAIL_CHECKSUM : FAIL_PROTOCOL;
    default: return FAIL_OTHER;
    }
}

static void on_load_done(void *user, kvx_xfer *x, const td_err *result)
{
    load_ctx *lc = user;
    pd_connector *pd = lc->pd;
    pd_unwatch(pd, lc->req_id); /* its lease needs no more heartbeats */
    kvx_xfer_info xi;
    kvx_xfer_get_info(x, &xi);
    pd_load_info info = {xi.bytes, xi.n_descriptors, lc->n_blocks, xi.seconds, xi.tail_seconds,
                         -1, 0, 0};
    int code = result ? result->code : 0;
    td_err bad;
    if (lc->push && code == 0) {
        uint8_t note[KVX_MAX_NOTE];
        size_t n = kvx_xfer_note(x, note, sizeof(note));
        note_decode(note, TD_MIN(n, sizeof(note)), &info);
        if (info.first_token < 0) {
            code = td_err_set(&bad, TD_EPROTO, "the producer's push ended without its first token");
            result = &bad;
        }
    }
    pthread_mutex_lock(&pd->mu);
    if (code == 0) {
        pd->loads_ok++;
        if (lc->push) pd->push_loads++;
        pd->bytes += xi.bytes;
        pd->descriptors += xi.n_descriptors;
        pd->blocks += lc->n_blocks;
        int b = 0;
        while (b < N_BUCKETS && xi.seconds > BUCKETS[b]) b++;
        pd->hist[b]++;
        pd->hist_sum += xi.seconds;
    } else {
        pd->failures[fail_reason(code, result->msg)]++;
    }
    pthread_mutex_unlock(&pd->mu);
    /* Done or not, the producer may let the blocks go (a dead one does not answer). */
    rel_push(pd, &lc->rel);
    pd->loaded_cb(pd->user, lc->req_id, code, code ? result->msg : NULL, &info);
    kvx_xfer_free(x);
    free(lc);
}

/* What a load's completion needs: the request, and where to send the release. */
static load_ctx *load_ctx_new(pd_connector *pd, uint64_t req_id, const pd_remote *src,
                              int n_blocks, bool push)
{
    load_ctx *lc = calloc(1, sizeof(*lc));
    if (!lc) return NULL;
    lc->pd = pd;
    lc->req_id = req_id;
    lc->push = push;
    lc->n_blocks = (uint32_t)n_blocks;
    snprintf(lc->rel.host, sizeof(lc->rel.host), "%s", src->host);
    lc->rel.port = src->port;
    memcpy(lc->rel.engine_id, src->engine_id, KVX_ID_HEX);
    memcpy(lc->rel.transfer_id, src->transfer_id, KVX_ID_HEX);
    return lc;
}

int pd_load(pd_connector *pd, uint64_t req_id, const pd_remote *src, const int32_t *dst, int n_dst,
            int skip, td_err *err)
{
    if (!pd->client) return td_err_set(err, TD_ESTATE, "this engine is not a KV consumer");
    if (src->n_blocks != n_dst || skip < 0 || skip >= n_dst)
        return td_err_set(err, TD_EINVAL,
                          "the producer sent %d block ids; this prompt needs %d (%d cached here)",
                          src->n_blocks, n_dst, skip);
    load_ctx *lc = load_ctx_new(pd, req_id, src, n_dst - skip, false);
    if (!lc) return td_err_set(err, TD_ENOMEM, "out of memory");
    kvx_read_req rq = {
        .host = src->host,
        .port = src->port,
        .engine_id = src->engine_id,
        .transfer_id = src->transfer_id,
        .src_blocks = src->blocks + skip,
        .dst_blocks = dst + skip,
        .n_blocks = n_dst - skip,
        .done = on_load_done,
        .user = lc,
    };
    kvx_xfer *x = NULL;
    int rc = kvx_read_start(pd->client, &rq, &x, err);
    if (rc) free(lc);
    return rc;
}

int pd_load_push(pd_connector *pd, uint64_t req_id, const pd_remote *src, const int32_t *dst,
                 int n_dst, int skip, td_err *err)
{
    if (!pd->client) return td_err_set(err, TD_ESTATE, "this engine is not a KV consumer");
    if (skip < 0 || skip >= n_dst)
        return td_err_set(err, TD_EINVAL, "a push of %d blocks with %d cached", n_dst, skip);
    load_ctx *lc = load_ctx_new(pd, req_id, src, n_dst - skip, true);
    if (!lc) return td_err_set(err, TD_ENOMEM, "out of memory");
    kvx_write_req rq = {
        .host = src->host,
        .port = src->port,
        .engine_id = src->engine_id,
        .transfer_id = src->transfer_id,
        .dst_blocks = dst,
        .n_blocks = n_dst,
        .skip = skip,
        .done = on_load_done,
        .user = lc,
    };
    kvx_xfer *x = NULL;
    int rc = kvx_write_start(pd->client, &rq, &x, err);
    if (rc) free(lc);
    return rc;
}

void pd_watch(pd_connector *pd, uint64_t req_id, const pd_remote *src)
{
    if (!pd->client) return;
    watch_item *w = calloc(1, sizeof(*w));
    if (!w) return; /* the lease may then expire: the request recomputes */
    w->req_id = req_id;
    snprintf(w->where.host, sizeof(w->where.host), "%s", src->host);
    w->where.port = src->port;
    memcpy(w->where.engine_id, src->engine_id, KVX_ID_HEX);
    memcpy(w->where.transfer_id, src->transfer_id, KVX_ID_HEX);
    uint32_t lease = src->lease_ms ? src->lease_ms : 30000;
    w->period_ns = TD_MAX((uint64_t)lease * 1000000ull / 3, 20000000ull);
    pthread_mutex_lock(&pd->mu);
    w->next_ns = td_now_ns() + w->period_ns;
    w->next = pd->watches;
    pd->watches = w;
    pthread_cond_signal(&pd->cv);
    pthread_mutex_unlock(&pd->mu);
}

void pd_unwatch(pd_connector *pd, uint64_t req_id)
{
    pthread_mutex_lock(&pd->mu);
    for (watch_item **p = &pd->watches; *p; p = &(*p)->next) {
        if ((*p)->req_id != req_id) continue;
        watch_item *w = *p;
        *p = w->next;
        free(w);
        break;
    }
    pthread_mutex_unlock(&pd->mu);
}

int pd_load_cancel(pd_connector *pd, const char *transfer_id)
{
    return pd->client ? kvx_client_cancel(pd->client, transfer_id) : TD_ENOTFOUND;
}

void pd_release_remote(pd_connector *pd, const pd_remote *src)
{
    if (!pd->client) return;
    rel_item it = {.port = src->port};
    snprintf(it.host, sizeof(it.host), "%s", src->host);
    memcpy(it.engine_id, src->engine_id, KVX_ID_HEX);
    memcpy(it.transfer_id, src->transfer_id, KVX_ID_HEX);
    rel_push(pd, &it);
}

/* ---- lifecycle ---- */

int pd_create(pd_connector **out, const pd_config *cfg, const td_kv_info *kv,
              pd_release_fn release_cb, pd_loaded_fn loaded_cb, void *user, td_err *err)
{
    *out = NULL;
    if (cfg->consumer && !kvx_protocol_available(cfg->protocol))
        return td_err_set(err, TD_EUNSUPPORTED,
                          "kv transfer protocol %s is not available in this build",
                          kvx_protocol_name(cfg->protocol));
    pd_connector *pd = calloc(1, sizeof(*pd));
    if (!pd) return td_err_set(err, TD_ENOMEM, "out of memory");
    pd->cfg = *cfg;
    if (cfg->rails && cfg->rails->n > 0) pd->rails = *cfg->rails;
    pd->cfg.rails = pd->rails.n > 0 ? &pd->rails : NULL;
    snprintf(pd->host, sizeof(pd->host), "%s", cfg->host && cfg->host[0] ? cfg->host : "127.0.0.1");
    pd->cfg.host = pd->host;
    snprintf(pd->token, sizeof(pd->token), "%s", cfg->auth_token ? cfg->auth_token : "");
    pd->cfg.auth_token = pd->token;
    pd->kv = *kv;
    pd->release_cb = release_cb;
    pd->loaded_cb = loaded_cb;
    pd->user = user;
    pthread_mutex_init(&pd->mu, NULL);
    pthread_cond_init(&pd->cv, NULL);

    kvx_layout layout = {
        .model_fingerprint = kv->model_fingerprint,
        .n_layers = (uint32_t)kv->n_layers,
        .n_kv_heads = (uint32_t)kv->n_kv_heads,
        .head_dim = (uint32_t)kv->head_dim,
        .block_size = (uint32_t)kv->block_size,
        .kv_dtype = (uint32_t)kv->kv_dtype,
        .tp_rank = (uint32_t)cfg->tp_rank,
        .tp_size = (uint32_t)(cfg->tp_size > 0 ? cfg->tp_size : 1),
    };
    kvx_region region = {
        .base = kv->base,
        .n_segments = (uint32_t)kv->n_layers,
        .segment_stride = kv->layer_bytes,
        .block_bytes = kv->block_bytes,
        .n_blocks = (uint32_t)kv->n_blocks,
        .shm = kv->shm_fd >= 0,
        .shm_fd = kv->shm_fd,
        .shm_offset = 0,
        .block_crc = kv->block_crc,
        .block_crc_ok = kv->block_crc_ok,
        .device = kv->device,
        .device_id = kv->device_id,
    };
    memcpy(region.ipc_handle, kv->ipc_handle, sizeof(region.ipc_handle));
    memcpy(region.device_uuid, kv->device_uuid, sizeof(region.device_uuid));
    int rc = 0;
    if (cfg->producer) {
        kvx_agent_opts ao;
        kvx_agent_opts_default(&ao);
        ao.host = pd->host;
        ao.port = (uint16_t)cfg->handshake_port;
        ao.layout = layout;
        ao.region = region;
        ao.lease_ms = cfg->lease_ms;
        ao.release_cb = on_lease_end;
        ao.release_user = pd;
        ao.auth_token = pd->token[0] ? pd->token : NULL;
        ao.rails = cfg->rails;
        ao.matched_rails = cfg->matched_rails;
        rc = kvx_agent_create(&pd->agent, &ao, err);
        if (rc) goto fail;
    }
    if (cfg->consumer) {
        kvx_client_opts co;
        kvx_client_opts_default(&co);
        co.layout = layout;
        co.region = region;
        co.num_worker_threads = cfg->num_worker_threads;
        co.qp_per_transfer = cfg->qp_per_transfer;
        co.transfer_timeout_ms = cfg->transfer_timeout_ms;
        co.verify_checksums = cfg->verify_checksums;
        co.protocol = cfg->protocol;
        co.auth_token = pd->token[0] ? pd->token : NULL;
        co.rails = cfg->rails;
        co.matched_rails = cfg->matched_rails;
        co.rail_striping = cfg->rail_striping;
        rc = kvx_client_create(&pd->client, &co, err);
        if (rc) goto fail;
        if (pthread_create(&pd->rel_thread, NULL, rel_main, pd) != 0) {
            rc = td_err_set(err, TD_EIO, "cannot start the kv release thread");
            goto fail;
        }
        pd->rel_started = true;
    }
    *out = pd;
    return 0;
fail:
    pd_destroy(pd);
    return rc;
}

void pd_destroy(pd_connector *pd)
{
    if (!pd) return;
    /* The release thread drains the releases queued so far, then the client goes (and
     * with it any load still running: a release its callback queues now is dropped, and
     * that producer's lease expires instead; the server drains its requests before it
     * gets here), then the agent gives every lease back. */
    if (pd->rel_started) {
        pthread_mutex_lock(&pd->mu);
        pd->stopping = true;
        pthread_cond_signal(&pd->cv);
        pthread_mutex_unlock(&pd->mu);
        pthread_join(pd->rel_thread, NULL);
    }
    if (pd->client) kvx_client_destroy(pd->client);
    for (rel_item *it = pd->rel_head, *next; it; it = next) {
        next = it->next;
        free(it);
    }
    for (watch_item *w = pd->watches, *next; w; w = next) {
        next = w->next;
        free(w);
    }
    if (pd->agent) kvx_agent_destroy(pd->agent);
    explicit_bzero(pd->token, sizeof(pd->token));
    pthread_mutex_destroy(&pd->mu);
    pthread_cond_destroy(&pd->cv);
    free(pd->pushes);
    free(pd);
}

/* ---- metrics ---- */

char *pd_metrics_render(pd_connector *pd)
{
    td_sbuf b = {0};
    pthread_mutex_lock(&pd->mu);
    uint64_t ok = pd->loads_ok, fails[FAIL_N], hist[N_BUCKETS + 1];
    memcpy(fails, pd->failures, sizeof(fails));
    memcpy(hist, pd->hist, sizeof(hist));
    uint64_t bytes = pd->bytes, desc = pd->descriptors, blocks = pd->blocks, holds = pd->holds;
    uint64_t beats = pd->heartbeats, beat_fails = pd->heartbeat_failures;
    uint64_t push_loads = pd->push_loads, push_opened = pd->push_opened;
    double sum = pd->hist_sum;
    pthread_mutex_unlock(&pd->mu);
    if (pd->client) {
        td_sbuf_printf(&b,
                       "# HELP tandem_kv_transfers_total KV transfers into this engine that "
                       "completed.\n# TYPE tandem_kv_transfers_total counter\n"
                       "tandem_kv_transfers_total %llu\n",
                       (unsigned long long)ok);
        td_sbuf_printf(
            &b, "# HELP tandem_kv_transfer_failures_total KV transfers into this engine that "
                "failed, by reason.\n# TYPE tandem_kv_transfer_failures_total counter\n");
        for (int i = 0; i < FAIL_N; i++)
            td_sbuf_printf(&b, "tandem_kv_transfer_failures_total{reason=\"%s\"} %llu\n",
                           FAIL_NAMES[i], (unsigned long long)fails[i]);
        td_sbuf_printf(&b,
                       "# HELP tandem_kv_transfer_bytes_total KV bytes received.\n"
                       "# TYPE tandem_kv_transfer_bytes_total counter\n"
                       "tandem_kv_transfer_bytes_total %llu\n"
                       "# HELP tandem_kv_transfer_blocks_total KV blocks received.\n"
                       "# TYPE tandem_kv_transfer_blocks_total counter\n"
                       "tandem_kv_transfer_blocks_total %llu\n"
                       "# HELP tandem_kv_transfer_descriptors_total Byte ranges moved (coalesced "
                       "runs x layers).\n# TYPE tandem_kv_transfer_descriptors_total counter\n"
                       "tandem_kv_transfer_descriptors_total %llu\n",
                       (unsigned long long)bytes, (unsigned long long)blocks,
                       (unsigned long long)desc);
        td_sbuf_printf(&b,
                       "# HELP tandem_kv_push_transfers_total Completed KV transfers in write "
                       "(push) mode, included in tandem_kv_transfers_total.\n"
                       "# TYPE tandem_kv_push_transfers_total counter\n"
                       "tandem_kv_push_transfers_total %llu\n",
                       (unsigned long long)push_loads);
        td_sbuf_printf(
            &b,
            "# HELP tandem_kv_heartbeats_total Lease heartbeats sent for requests waiting "
            "here.\n# TYPE tandem_kv_heartbeats_total counter\ntandem_kv_heartbeats_total "
            "%llu\n# HELP tandem_kv_heartbeat_failures_total Heartbeats that failed.\n"
            "# TYPE tandem_kv_heartbeat_failures_total counter\n"
            "tandem_kv_heartbeat_failures_total %llu\n",
            (unsigned long long)beats, (unsigned long long)beat_fails);
        td_sbuf_printf(&b, "# HELP tandem_kv_transfer_duration_seconds Time of a completed KV "
                           "transfer.\n# TYPE tandem_kv_transfer_duration_seconds histogram\n");
        uint64_t cum = 0;
        for (int i = 0; i < N_BUCKETS; i++) {
            cum += hist[i];
            td_sbuf_printf(&b, "tandem_kv_transfer_duration_seconds_bucket{le=\"%g\"} %llu\n",
                           BUCKETS[i], (unsigned long long)cum);
        }
        cum += hist[N_BUCKETS];
        td_sbuf_printf(&b,
                       "tandem_kv_transfer_duration_seconds_bucket{le=\"+Inf\"} %llu\n"
                       "tandem_kv_transfer_duration_seconds_sum %.6f\n"
                       "tandem_kv_transfer_duration_seconds_count %llu\n",
                       (unsigned long long)cum, sum, (unsigned long long)cum);
    }
    if (pd->agent) {
        kvx_agent_stats st;
        kvx_agent_get_stats(pd->agent, &st);
        td_sbuf_printf(
            &b,
            "# HELP tandem_kv_leases_total Prompt KV handed to consumers under a lease (a push "
            "from its opening): active + released + expired.\n"
            "# TYPE tandem_kv_leases_total counter\ntandem_kv_leases_total %llu\n"
            "# HELP tandem_kv_leases_active Leases held now.\n"
            "# TYPE tandem_kv_leases_active gauge\ntandem_kv_leases_active %d\n"
            "# HELP tandem_kv_leases_expired_total Leases that ended without a release "
            "(consumer gone).\n# TYPE tandem_kv_leases_expired_total counter\n"
            "tandem_kv_leases_expired_total %llu\n"
            "# HELP tandem_kv_leases_released_total Leases released by their consumer.\n"
            "# TYPE tandem_kv_leases_released_total counter\n"
            "tandem_kv_leases_released_total %llu\n"
            "# HELP tandem_kv_sent_bytes_total KV bytes served to consumers.\n"
            "# TYPE tandem_kv_sent_bytes_total counter\ntandem_kv_sent_bytes_total %llu\n"
            "# HELP tandem_kv_reads_total Read requests served.\n"
            "# TYPE tandem_kv_reads_total counter\ntandem_kv_reads_total %llu\n"
            "# HELP tandem_kv_handshakes_refused_total Sessions refused (layout, identity or "
            "authentication).\n# TYPE tandem_kv_handshakes_refused_total counter\n"
            "tandem_kv_handshakes_refused_total %llu\n"
            "# HELP tandem_kv_unknown_transfer_total Requests naming a transfer id this "
            "producer does not hold.\n# TYPE tandem_kv_unknown_transfer_total counter\n"
            "tandem_kv_unknown_transfer_total %llu\n"
            "# HELP tandem_kv_pushes_opened_total Prefills that streamed their KV to a "
            "consumer layer by layer (write mode).\n"
            "# TYPE tandem_kv_pushes_opened_total counter\ntandem_kv_pushes_opened_total "
            "%llu\n"
            "# HELP tandem_kv_pushes_claimed_total Push transfers a consumer claimed.\n"
            "# TYPE tandem_kv_pushes_claimed_total counter\ntandem_kv_pushes_claimed_total "
            "%llu\n",
            (unsigned long long)holds, kvx_agent_n_leases(pd->agent),
            (unsigned long long)st.leases_expired, (unsigned long long)st.leases_released,
            (unsigned long long)st.bytes_sent, (unsigned long long)st.reads,
            (unsigned long long)st.handshakes_refused, (unsigned long long)st.unknown_transfer,
            (unsigned long long)push_opened, (unsigned long long)st.pushes);
        if (pd->rails.n > 0) {
            td_sbuf_printf(&b, "%s",
                           "# HELP tandem_kv_rail_reads_total Reads served on each rail's engine.\n"
                           "# TYPE tandem_kv_rail_reads_total counter\n");
            for (int i = 0; i < pd->rails.n; i++)
                td_sbuf_printf(&b, "tandem_kv_rail_reads_total{rail=\"%s\"} %llu\n",
                               pd->rails.name[i], (unsigned long long)st.rail_reads[i]);
            td_sbuf_printf(
                &b, "%s",
                "# HELP tandem_kv_rail_state Each rail's engine: 0 not made yet, 1 ready, "
                "2 failed (until restart).\n# TYPE tandem_kv_rail_state gauge\n");
            for (int i = 0; i < pd->rails.n; i++)
                td_sbuf_printf(&b, "tandem_kv_rail_state{rail=\"%s\"} %d\n", pd->rails.name[i],
                               kvx_agent_rail_state(pd->agent, i));
            td_sbuf_printf(
                &b,
                "# HELP tandem_kv_rails_refused_total Consumers' rail requests refused (a "
                "rail this producer does not have, or a failed one).\n"
                "# TYPE tandem_kv_rails_refused_total counter\ntandem_kv_rails_refused_total "
                "%llu\n",
                (unsigned long long)st.rails_refused);
        }
    }
    if (!b.p) td_sbuf_add(&b, "", 0); /* an empty page, not NULL */
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

int pd_leases_active(pd_connector *pd)
{
    return pd && pd->agent ? kvx_agent_n_leases(pd->agent) : 0;
}
