/*
 * router/rt_impl.h - what the router's files share: the worker registry (workers.c),
 * the relay of one client request (relay.c) and the server around them (router.c).
 * Everything here lives on the router's one event-loop thread.
 */
#ifndef TD_ROUTER_RT_IMPL_H
#define TD_ROUTER_RT_IMPL_H

#include <event2/event.h>
#include <event2/http.h>

#include <cjson/cJSON.h>

#include "router/router.h"
#include "util/accept_guard.h"
#include "util/reply_flush.h"

typedef enum rt_role { RT_ROLE_WORKER = 0, RT_ROLE_PREFILL = 1, RT_ROLE_DECODE = 2 } rt_role;
#define RT_N_ROLES 3
const char *rt_role_name(rt_role r);

typedef enum rt_cb_state { RT_CB_CLOSED = 0, RT_CB_OPEN = 1, RT_CB_HALF_OPEN = 2 } rt_cb_state;
const char *rt_cb_name(rt_cb_state s);

#define RT_LAT_BUCKETS 12
#define RT_MAX_WORKERS 256 /* registered workers, data-parallel ranks included */

typedef struct rt_worker {
    uint64_t id;
    char url[256];  /* "http://host:port" */
    char host[200];
    int port;
    rt_role role;
    /* health (active checks): healthy until failure_threshold checks fail in a row */
    bool healthy;
    /* the worker has answered this router once (any HTTP answer: a probe, a check or a
     * relayed request). Until then it takes no requests, and the router's /health does not
     * count it: a worker whose engine is still starting is not "healthy" by default. */
    bool reachable;
    int health_fail, health_ok;
    bool check_in_flight;
    /* circuit breaker (relayed requests): open after cb_failure_threshold failures in a
     * row, half-open after cb_timeout, closed again after cb_success_threshold successes */
    rt_cb_state cb;
    int cb_fail, cb_ok;
    uint64_t cb_opened_ns;
    int in_flight;
    int reported_load; /* the engine's last /health "load" (running + waiting); -1 unknown */
    int external_load; /* reported_load less our in_flight at that moment, >= 0; -1 unknown */
    /* /kv_transfer_info (PD roles) */
    bool info_ok;
    /* discovery: until info_ok, /kv_transfer_info is read again at next_probe_ns, the gap
     * doubling from 0.25 s up to the health interval (an engine still starting) */
    uint64_t next_probe_ns;
    double probe_gap_s;
    char engine_id[40], kv_host[200], kv_role[24], model[200];
    char instance[24]; /* the engine's instance_id (/health): a new one is a restart */
    int kv_port;
    bool write_mode;
    /* --dp-aware: an engine with dp_size > 1 is dp_size workers, one per rank, that share
     * its URL; requests name their rank (data_parallel_rank). -1: the engine as a whole */
    int dp_rank, dp_size;
    /* pooled keep-alive connections */
    struct evhttp_connection **idle;
    int n_idle, cap_idle, n_conns;
    /* dynamic registration */
    bool dynamic;
    uint64_t last_seen_ns;
    bool removed; /* out of the registry: freed when nothing uses it */
    int refs;     /* legs and checks using this struct */
    /* metrics */
    uint64_t requests, failures;
    uint64_t lat_hist[RT_LAT_BUCKETS + 1];
    double lat_sum;
    struct rt_worker *next;
} rt_worker;

typedef struct rt_req rt_req;

typedef struct rt_router {
    rt_config cfg;
    struct event_base *base;
    struct evhttp *http;
    struct evhttp_bound_socket *sock;
    td_accept_guard *accept_guard; /* the listener pauses when out of descriptors */
    char bound[300];
    rt_worker *workers;
    uint64_t next_worker_id;
    rt_policy *policy[RT_N_ROLES];
    struct event *health_timer, *discovery_timer, *sig_int, *sig_term;
    td_rng rng;
    /* admission */
    int active;
    rt_req *queue_head, *queue_tail;
    int queued;
    bool admitting; /* admit_next is running: a request it frees does not re-enter it */
    rt_req *reqs; /* every live request (for shutdown) */
    struct rt_check *checks; /* health checks and info reads in flight (for shutdown) */
    bool shutting_down;
    /* graceful shutdown (router.c): after the first SIGTERM/SIGINT */
    bool draining, exit_now; /* exit_now: a second signal; no flush */
    uint64_t drain_deadline_ns;
    td_replies replies; /* replies queued and not yet written (flushed at exit) */
    struct event *drain_ev;
    uint64_t next_req;
    /* metrics */
    uint64_t requests_total, responses_by_class[6], retries, breaker_transitions, rejected_429,
        timed_out_408, timeouts_504, bad_gateway_502, client_disconnects, evictions,
        registrations, kv_releases;
} rt_router;

/* ---- workers.c ---- */
/** "http://host:port": 0, or TD_EINVAL with a message. */
int rt_url_check(const char *url, td_err *err);
/** Whether two worker URLs name the same host and port ("http://h:1/" is "http://h:1"). */
bool rt_url_same(const char *a, const char *b);
/** Add a worker (URL checked); *out may be NULL. TD_EINVAL for a bad URL. */
int rt_worker_add(rt_router *r, const char *url, rt_role role, bool dynamic, rt_worker **out,
                  td_err *err);
rt_worker *rt_worker_find_url(rt_router *r, const char *url);
/** Ask the prefill instance at url to give back the KV it holds for transfer_id (a
 *  request whose decode failed for good); fire and forget. */
void rt_worker_release_kv(rt_router *r, const char *url, const char *transfer_id);
rt_worker *rt_worker_find_id(rt_router *r, uint64_t id);
/** Take a worker out of the registry (its requests in flight finish). */
void rt_worker_remove(rt_router *r, rt_worker *w);
void rt_worker_ref(rt_worker *w);
void rt_worker_unref(rt_router *r, rt_worker *w);
/** A connection to w, idle or new, with a read/write timeout of timeout_s. */
struct evhttp_connection *rt_conn_get(rt_router *r, rt_worker *w, double timeout_s);
void rt_conn_put(rt_worker *w, struct evhttp_connection *c);
/** Workers a request of this role may go to now (healthy, breaker not open). */
int rt_eligible(rt_router *r, rt_role role, rt_worker **out, int cap, const rt_worker *exclude);
/** Choose one with the role's policy; NULL when none is eligible. */
rt_worker *rt_pick(rt_router *r, rt_role role, const char *text, size_t len,
                   const rt_worker *exclude);
/** The outcome of a relayed request, for the breaker and the metrics. */
void rt_worker_result(rt_router *r, rt_worker *w, bool ok, double seconds);
/** Start health checks and /kv_transfer_info reads (timer). */
void rt_health_start(rt_router *r);
/** Read a worker's /kv_transfer_info now (at registration). */
void rt_worker_probe(rt_router *r, rt_worker *w);
/** w's URL is served by a new incarnation of its engine (a new instance or engine id):
 * forget the old one's health and breaker state and its transfer endpoint, and read
 * /kv_transfer_info again. */
void rt_worker_reincarnated(rt_router *r, rt_worker *w);
/** Apply a worker's /kv_transfer_info (its kv_role, engine id, transfer agent, data-parallel
 *  ranks): it is ready when the role fits its own and the report is well formed, refused
 *  (not ready, logged) otherwise. Under --dp-aware a first report with ranks adds a worker
 *  per rank. */
void rt_worker_info_apply(rt_router *r, rt_worker *w, const cJSON *j);
/** Apply a worker's /health body (its "load", when that is an integer >= 0, and its
 *  "instance_id"); j may be NULL. True when the instance id changed: the engine at this URL
 *  was restarted, and what /kv_transfer_info said of it (agent port, engine id) is stale. */
bool rt_worker_health_apply(rt_worker *w, const cJSON *j);
void rt_workers_free(rt_router *r);
/** JSON of every worker (GET /workers). */
cJSON *rt_workers_json(rt_router *r);
/** Prometheus text (appended to b). */
void rt_workers_metrics(rt_router *r, struct evbuffer *b);

/* ---- relay.c ---- */
/** A client request to /v1/completions or /v1/chat/completions. */
void rt_relay_start(rt_router *r, struct evhttp_request *req, int endpoint);
/** Shutdown: end every live request with a 503. */
void rt_relay_shutdown(rt_router *r);
/** Requests alive (queued, or relaying). */
int rt_relay_count(const rt_router *r);

/* ---- router.c ---- */
/* Count a client response by its status class (tandem_router_responses_total). */
void rt_count_status(rt_router *r, int status);
void rt_send_error(rt_router *r, struct evhttp_request *req, int status, const char *type,
                   const char *msg);
void rt_send_json(rt_router *r, struct evhttp_request *req, int status, const char *json);

#endif
