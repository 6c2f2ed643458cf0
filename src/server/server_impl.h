/*
 * server/server_impl.h - what the server's files share: the engine thread's inbox
 * and outbox, and the metrics. Not a public header.
 */
#ifndef TD_SERVER_IMPL_H
#define TD_SERVER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "pd/pd.h"
#include "tandem/ep.h"
#include "server/server.h"
#include "util/accept_guard.h"
#include "util/reply_flush.h"

/* ---- engine thread (engine_thread.c) ---- */

/** One engine output, copied out of the engine so that it outlives the step. */
typedef struct srv__out {
    void *user;    /* the I/O thread's request object; never dereferenced here */
    int choice;    /* index of the choice within that request */
    bool rejected; /* td_engine_add_request failed: `error` says why */
    int32_t token;
    char *text; /* malloc'd, NUL-terminated */
    int text_len;
    int text_flush_len; /* td_output.text_flush_len */
    td_finish finish;
    char *error; /* malloc'd or NULL */
    int num_prompt_tokens, num_cached_tokens, num_generated;
    float logprob;
    int n_top;
    int32_t top_ids[TD_MAX_LOGPROBS];
    float top_logprobs[TD_MAX_LOGPROBS];
    double t_arrival, t_first_scheduled, t_first_token;
    /* Producer (final output of a held request): the transfer id ("" when nothing is
     * held) and the held blocks (malloc'd). */
    char transfer_id[KVX_ID_HEX];
    int32_t *kv_blocks;
    int n_kv_blocks;
    /* Consumer: how the prompt's KV arrived (SRV__KV_*), with the load's figures. */
    int kv_state;
    char kv_note[160];
    double t_kv_loaded;
    pd_load_info kv_info;
    int kv_blocks_cached;
} srv__out;

enum { SRV__KV_NONE = 0, SRV__KV_LOADED = 1, SRV__KV_RECOMPUTED = 2, SRV__KV_FAILED = 3 };

/** A snapshot of engine counters, published once per loop iteration. */
typedef struct srv__snapshot {
    int num_running, num_waiting;
    td_engine_stats stats;
} srv__snapshot;

typedef struct srv__cmd srv__cmd;

typedef struct srv__engine {
    td_engine *engine;
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* under mu: */
    srv__cmd *inbox_head, *inbox_tail;
    srv__out *outbox;
    int n_out, cap_out;
    srv__snapshot snap;
    bool stop_requested; /* the loop should exit (shutdown or debug hook) */
    bool stopped;        /* the loop has seen the stop: no more requests are taken (a KV
                            load's end still is, until `exited`) */
    bool exited;         /* the loop has returned: no command is taken */
    bool stop_final;     /* srv__engine_stop (teardown): no waiting for KV loads */
    char stop_reason[128];
    /* written by the engine thread, read anywhere */
    _Atomic uint64_t last_progress_ns;
    _Atomic int outstanding; /* requests added but not finished (engine thread's view) */
    int wake_fd;             /* eventfd: the engine thread writes, the I/O loop reads */
    int step_delay_ms;
    /* engine-thread private: engine id -> (user, choice) */
    struct srv__active *active;
    int n_active, cap_active;
    pd_connector *pd;     /* NULL without --kv-transfer-config */
    bool kv_recompute;    /* kv_load_failure_policy */
    td_ep_group *ep;      /* expert parallelism: the group this rank steps with, or NULL */
    int ep_rank;
} srv__engine;

/** pd: the transfer connector (NULL without a KV role), created with this srv__engine as
 *  the user of its callbacks. */
int srv__engine_start(srv__engine *x, td_engine *e, int step_delay_ms, pd_connector *pd,
                      bool kv_recompute, td_ep_group *ep, int ep_rank, td_err *err);
/** pd callbacks (user = the srv__engine): they post to the engine thread's inbox. */
void srv__engine_on_release(void *user, uint64_t req_id);
void srv__engine_on_loaded(void *user, uint64_t req_id, int status, const char *msg,
                           const pd_load_info *info);
/** Stop the loop (aborting everything in flight) and join; the engine stays alive. */
void srv__engine_stop(srv__engine *x, const char *reason);
/** Ask the loop to stop without waiting (for the debug hook). */
void srv__engine_request_stop(srv__engine *x, const char *reason);
void srv__engine_free(srv__engine *x);
/**
 * Queue a request (the ids and stop strings are copied; kv may be NULL; remote, when not
 * NULL, is moved into the command and emptied). Returns TD_ESTATE when the
 * loop has stopped. The result, accepted or not, arrives as outputs for (user, choice).
 */
int srv__engine_add(srv__engine *x, void *user, int choice, const char *push_id,
                    const int32_t *ids, int n_ids,
                    const td_sampling *sp, const td_request_kv *kv, pd_remote *remote);
/** Abort every request of `user`. */
void srv__engine_abort(srv__engine *x, void *user);
/** Take the outbox (the caller frees each output with srv__out_free, then the array). */
void srv__engine_take(srv__engine *x, srv__out **outs, int *n, srv__snapshot *snap);
void srv__out_free(srv__out *o);
bool srv__engine_stopped(srv__engine *x, char *reason, size_t cap);

/* ---- metrics (metrics.c) ---- */

#define SRV__HIST_BUCKETS 16

typedef struct srv__hist {
    const double *bounds; /* [SRV__HIST_BUCKETS] upper bounds, seconds */
    uint64_t counts[SRV__HIST_BUCKETS + 1];
    double sum; /* the count is the counts' total */
} srv__hist;

typedef struct srv__metrics {
    uint64_t http_requests[6]; /* by status class: 1xx..5xx, index = status / 100 */
    uint64_t prompt_tokens, generation_tokens;
    uint64_t finished[5]; /* by td_finish */
    uint64_t rejected_queue_full;
    srv__hist ttft, tpot, e2e, queue;
} srv__metrics;

void srv__metrics_init(srv__metrics *m);
void srv__hist_observe(srv__hist *h, double v);
/** Prometheus text exposition. Returns a malloc'd string. */
char *srv__metrics_render(const srv__metrics *m, const srv__snapshot *snap, const char *model);

/* ---- the server object (http.c, completion.c) ---- */

struct event_base;
struct evhttp;
struct evhttp_request;
struct event;
struct evbuffer;

/*
 * One data-parallel rank (--data-parallel-size): an engine with its own thread,
 * scheduler and KV pool, and its own transfer connector (kvx agent and handshake port).
 * Requests are bound to one rank for their whole life.
 */
typedef struct srv__rank {
    srv_server *s;
    int index;
    srv__engine eng;
    pd_connector *pd;       /* NULL without --kv-transfer-config */
    struct event *wake_ev;  /* eng.wake_fd */
    srv__snapshot snap;     /* the latest one taken from its engine thread */
    int outstanding;        /* I/O side: its engine requests posted and not finished */
} srv__rank;

struct srv_server {
    srv_config cfg;
    char model_name[256];
    char model_path[1024];
    char kv_dtype[16];
    struct event_base *base;
    struct evhttp *http;
    struct event *wake_ev, *sigint_ev, *sigterm_ev;
    struct evhttp_bound_socket *listener;
    td_accept_guard *accept_guard; /* the listener pauses when out of descriptors */
    td_replies replies;            /* replies queued and not yet written (flushed at exit) */
    int port;
    srv__rank *ranks; /* [n_ranks] */
    int n_ranks;
    const td_tokenizer *tok; /* read-only, safe on the I/O thread */
    int max_model_len, n_vocab, max_num_seqs;
    uint64_t model_fingerprint;
    srv_chat_family chat;
    srv_chat_extras chat_extras; /* what the GGUF's template adds (none with --chat-template) */
    srv__metrics metrics;
    bool kv_producer, kv_consumer, kv_recompute;
    int outstanding;    /* I/O side: engine requests posted and not finished */
    uint64_t next_id;
    long started_at;       /* unix seconds */
    char instance_id[17];  /* random at start, in /health and /kv_transfer_info: a router
                              sees a restart at the same URL by it changing */
    struct srv__req *live; /* every request object alive (for shutdown) */
    struct srv__registrar *registrar; /* registration with a router (register.c), or NULL */
    /* graceful shutdown (http.c): after the first SIGTERM/SIGINT, new requests get 503 and
     * /health says "draining" until nothing is in flight or held, or the deadline */
    bool draining, drain_cut, exit_now; /* exit_now: a second signal; no flush */
    uint64_t drain_deadline_ns;
    struct event *drain_ev;
};

typedef struct srv__registrar srv__registrar;
/** Start registering with the router the kv-transfer config names (none: nothing). */
int srv__register_start(srv_server *s, const srv_kv_config *kv, td_err *err);
void srv__register_stop(srv_server *s);

/** Every rank's snapshot summed (counts and counters; the server-wide view). */
void srv__snapshot_sum(const srv_server *s, srv__snapshot *out);

/** Send an OpenAI error response and count it. */
void srv__send_error(srv_server *s, struct evhttp_request *req, const srv_error *e);
void srv__send_json(srv_server *s, struct evhttp_request *req, int status, const char *json);
/** POST /v1/completions and /v1/chat/completions (completion.c). */
void srv__handle_generate(srv_server *s, struct evhttp_request *req, srv_endpoint ep);
/** Outputs from the engine thread (completion.c). */
void srv__handle_outputs(srv_server *s, srv__out *outs, int n);
/** Request objects alive: in flight, or answered with a choice still in the engine
 *  (completion.c). */
int srv__live_count(const srv_server *s);
/** At shutdown: free every request object (completion.c). */
void srv__free_all_requests(srv_server *s);
/** JSON-escape bytes into an evbuffer (quotes included); invalid UTF-8 becomes U+FFFD. */
void srv__json_str(struct evbuffer *b, const char *s, size_t len);
/** Bytes of the whole UTF-8 character that starts s (n bytes left), 0 where none does:
 *  srv__json_str writes U+FFFD for each such byte. */
size_t srv__utf8_char(const char *s, size_t n);

#endif
