/*
 * pd/pd.h - the prefill/decode connector: joins an engine's KV pool to the transfer
 * engine (kvx). It knows the engine only through td_kv_info (a pool's geometry) and
 * request ids, and knows nothing of HTTP; the server calls it from its engine thread and
 * gets its callbacks on kvx threads, which it forwards to the engine thread.
 *
 * Producer: pd_hold registers a finished request's prompt blocks with the kvx agent and
 * returns the transfer id (a capability) that goes into kv_transfer_params; when the lease
 * ends (released by the consumer, expired, agent shut down) release_cb says which request's
 * blocks the engine may take back.
 *
 * Consumer: pd_load copies a producer's blocks into the blocks the engine allocated (only
 * those past the local prefix-cache hits), then tells the producer to release its lease
 * (in the background) and reports the outcome through loaded_cb. Every load ends, by
 * its deadline at the latest.
 */
#ifndef TD_PD_PD_H
#define TD_PD_PD_H

#include <stdbool.h>
#include <stdint.h>

#include "kvx/kvx.h"
#include "tandem/engine.h"

typedef struct pd_config {
    bool producer, consumer; /* kv_both: both */
    kvx_protocol protocol;   /* how this consumer reads; a producer serves every protocol */
    const char *host;        /* the agent binds to and advertises this address */
    int handshake_port;      /* 0 = an ephemeral port */
    int num_worker_threads, qp_per_transfer;
    uint32_t lease_ms, transfer_timeout_ms;
    bool verify_checksums;
    const char *auth_token; /* NULL or "" = none */
    int tp_rank, tp_size;
    const struct kvx_rails *rails; /* NULL or n 0: no rails (kvx_agent_opts.rails) */
    bool matched_rails;
    bool rail_striping; /* a consumer's reads over every matched rail */
} pd_config;

/** Where a consumer finds a prompt's KV (from kv_transfer_params). */
typedef struct pd_remote {
    char host[256];
    uint16_t port;
    char engine_id[KVX_ID_HEX];
    char transfer_id[KVX_ID_HEX];
    int32_t *blocks; /* producer block ids (malloc'd; pd_remote_free) */
    int n_blocks;
    uint32_t lease_ms; /* the producer's lease (kv_transfer_params.lease_ms), 0 = unknown */
    bool push;         /* transfer_mode write: no block ids; pd_load_push */
} pd_remote;

void pd_remote_free(pd_remote *r);

/** The outcome of one load, for the response's timing breakdown and the metrics. */
typedef struct pd_load_info {
    uint64_t bytes;
    uint32_t n_descriptors, n_blocks;
    double seconds;
    double tail_seconds; /* push: the part after the producer's prefill ended (= seconds for a read) */
    /* push: what the producer's note said (first_token -1 otherwise, or when missing) */
    int32_t first_token;
    double prod_queue_ms, prod_compute_ms;
} pd_load_info;

/** Producer: the lease on req_id's blocks ended; the engine may reuse them. */
typedef void (*pd_release_fn)(void *user, uint64_t req_id);
/** Consumer: req_id's load ended (status 0 or a TD_E* code with msg). */
typedef void (*pd_loaded_fn)(void *user, uint64_t req_id, int status, const char *msg,
                             const pd_load_info *info);

typedef struct pd_connector pd_connector;

int pd_create(pd_connector **out, const pd_config *cfg, const td_kv_info *kv,
              pd_release_fn release_cb, pd_loaded_fn loaded_cb, void *user, td_err *err);
/**
 * Ends everything: loads in flight finish (their loaded_cb runs), every lease is released
 * (release_cb runs), threads are joined. Call before the engine's pool goes away.
 */
void pd_destroy(pd_connector *pd);

/* ---- producer ---- */
int pd_hold(pd_connector *pd, uint64_t req_id, const int32_t *blocks, int n_blocks,
            char transfer_id[KVX_ID_HEX], td_err *err);
/** End a lease now (release_cb runs): 0, or TD_ENOTFOUND when none has this id.
 *  Thread-safe. */
int pd_cancel(pd_connector *pd, const char *transfer_id);

/*
 * Push (transfer_mode write), producer side. pd_push_open before the request's prefill can
 * run (the request is added with td_request_kv.stream_layers); pd_push_progress is the
 * engine's td_layer_fn (user = the connector); at the request's end pd_push_finish (its KV
 * is held) or pd_push_abort (it ended without). All on the engine thread.
 */
int pd_push_open(pd_connector *pd, uint64_t req_id, const char *transfer_id, int n_blocks,
                 td_err *err);
void pd_push_progress(void *pd, int layer, const td_layer_progress *p, int n);
/** TD_ENOTFOUND: the push was dropped meanwhile (preempted, released): give the blocks
 *  back now. On success the lease ends through release_cb as after pd_hold. */
int pd_push_finish(pd_connector *pd, uint64_t req_id, const int32_t *blocks, int n_blocks,
                   int32_t first_token, double queue_ms, double compute_ms,
                   char transfer_id[KVX_ID_HEX]);
void pd_push_abort(pd_connector *pd, uint64_t req_id);
const char *pd_engine_id(const pd_connector *pd);
const char *pd_host(const pd_connector *pd);
int pd_port(const pd_connector *pd);
uint32_t pd_lease_ms(const pd_connector *pd);

/* ---- consumer ---- */
/**
 * Copy src->blocks[skip..n) into dst[skip..n) (n = src->n_blocks = n_dst) asynchronously;
 * loaded_cb reports the end. Errors here (bad arguments) mean no load started and no
 * callback will come.
 */
int pd_load(pd_connector *pd, uint64_t req_id, const pd_remote *src, const int32_t *dst, int n_dst,
            int skip, td_err *err);
/**
 * Push mode: ask the producer src (src->push, no block ids) for the prompt's KV as it is
 * computed, into dst[skip..n_dst); loaded_cb reports the end, with the producer's first
 * token and timing in its info.
 */
int pd_load_push(pd_connector *pd, uint64_t req_id, const pd_remote *src, const int32_t *dst,
                 int n_dst, int skip, td_err *err);

/**
 * Keep a producer's lease alive while req_id waits for blocks here: a heartbeat every
 * third of the lease, from the connector's own thread, until pd_unwatch (at the start of
 * the load, or when the request ends). A waiting queue longer than the lease then costs
 * no recompute.
 */
void pd_watch(pd_connector *pd, uint64_t req_id, const pd_remote *src);
void pd_unwatch(pd_connector *pd, uint64_t req_id);

/** Tell a producer (in the background) that a transfer it holds is not needed. */
void pd_release_remote(pd_connector *pd, const pd_remote *src);
/** End this consumer's load of transfer_id early (its request was aborted): the load
 *  completes at once with an error, as loaded_cb reports. TD_ENOTFOUND when none runs. */
int pd_load_cancel(pd_connector *pd, const char *transfer_id);

/** Prometheus text for the transfer metrics (malloc'd). */
char *pd_metrics_render(pd_connector *pd);
/** Prompt KV held for consumers now (leases not yet released or expired); 0 for a
 *  connector that holds none (a consumer) or NULL. Thread-safe. */
int pd_leases_active(pd_connector *pd);

#endif
