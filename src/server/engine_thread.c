/*
 * server/engine_thread.c - the thread that owns the engine.
 *
 * The I/O thread posts add and abort commands to an inbox under a mutex and signals
 * a condition variable; the engine thread sleeps on it only when the engine is idle.
 * Each loop iteration takes the whole inbox, applies it, runs one step, copies the
 * step's outputs (text and logprobs live only until the next step) into the outbox
 * and writes the eventfd once, so the I/O loop wakes once per step however many
 * streams produced a token. The engine thread never sees HTTP objects: a request is
 * an opaque (user, choice) pair to it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "server/server_impl.h"

/* ADD and ABORT come from the I/O thread; KV_LOADED and KV_RELEASE from the transfer
 * connector's threads. */
enum { CMD_ADD, CMD_ABORT, CMD_KV_LOADED, CMD_KV_RELEASE };

struct srv__cmd {
    int kind;
    void *user;
    int choice;
    int32_t *ids;
    int n_ids;
    td_sampling sp;
    char **stop; /* owned copies; sp.stop points here */
    int32_t *stop_ids;
    int32_t *bias_ids; /* owned copies; sp.logit_bias_ids and sp.logit_bias point here */
    float *bias;
    td_request_kv kv;
    pd_remote remote; /* owned; remote.blocks NULL when none */
    char push_id[KVX_ID_HEX]; /* producer in write mode: the transfer id ("" otherwise) */
    /* KV_LOADED / KV_RELEASE */
    uint64_t engine_id;
    int status;
    char msg[200];
    pd_load_info info;
    srv__cmd *next;
};

typedef struct srv__active {
    uint64_t engine_id;
    void *user;
    int choice;
    pd_remote remote;  /* consumer: where the prompt's KV is (has_remote) */
    bool push;         /* producer in write mode: the prefill streams to a consumer */
    bool load_started; /* consumer: pd_load ran, so pd releases the producer's lease */
    int kv_state;      /* SRV__KV_* */
    char kv_note[160];
    double t_kv_loaded;
    pd_load_info kv_info;
    int kv_blocks_cached;
} srv__active;

static void cmd_free(srv__cmd *c)
{
    for (int i = 0; c->stop && i < c->sp.n_stop; i++)
        free(c->stop[i]);
    free(c->stop);
    free(c->stop_ids);
    free(c->bias_ids);
    free(c->bias);
    free(c->ids);
    pd_remote_free(&c->remote);
    free(c);
}

void srv__out_free(srv__out *o)
{
    free(o->text);
    free(o->error);
    free(o->kv_blocks);
}

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (!d) return NULL;
    if (n) memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

/* Append to a local batch (engine thread only). */
typedef struct batch {
    srv__out *v;
    int n, cap;
} batch;

static srv__out *batch_push(batch *b)
{
    if (b->n == b->cap) {
        int cap = b->cap ? b->cap * 2 : 64;
        srv__out *g = realloc(b->v, (size_t)cap * sizeof(*g));
        TD_ASSERT(g); /* the server cannot report tokens it cannot store */
        b->v = g;
        b->cap = cap;
    }
    srv__out *o = &b->v[b->n++];
    memset(o, 0, sizeof(*o));
    return o;
}

/* A request's final output, an error: one the engine could not end (a stop while its KV
 * load would not end in time), so that its client is answered. */
static srv__out *push_failed(batch *b, void *user, int choice, const char *msg)
{
    srv__out *o = batch_push(b);
    o->user = user;
    o->choice = choice;
    o->token = -1;
    o->finish = TD_FINISH_ERROR;
    o->error = dup_n(msg, strlen(msg));
    o->text = dup_n("", 0);
    return o;
}

/* A request the engine never took (a 400 with msg). */
static void push_reject(batch *b, void *user, int choice, const char *msg)
{
    push_failed(b, user, choice, msg)->rejected = true;
}

static srv__active *active_add(srv__engine *x, uint64_t id, void *user, int choice)
{
    if (x->n_active == x->cap_active) {
        int cap = x->cap_active ? x->cap_active * 2 : 128;
        srv__active *g = realloc(x->active, (size_t)cap * sizeof(*g));
        TD_ASSERT(g);
        x->active = g;
        x->cap_active = cap;
    }
    srv__active *a = &x->active[x->n_active++];
    memset(a, 0, sizeof(*a));
    a->engine_id = id;
    a->user = user;
    a->choice = choice;
    return a;
}

static int active_find(const srv__engine *x, uint64_t id)
{
    for (int i = 0; i < x->n_active; i++)
        if (x->active[i].engine_id == id) return i;
    return -1;
}

/* A consumer request whose KV comes from a producer (read: block ids; write: push). */
static bool has_remote(const pd_remote *r)
{
    return r->blocks || r->push;
}

static void apply(srv__engine *x, srv__cmd *c, batch *b)
{
    switch (c->kind) {
    case CMD_ADD: {
        uint64_t id;
        td_err err = {0};
        if (td_engine_add_request_kv(x->engine, &id, c->ids, c->n_ids, &c->sp, &c->kv, &err)) {
            push_reject(b, c->user, c->choice, err.msg[0] ? err.msg : td_strerror(err.code));
            if (has_remote(&c->remote) && x->pd) pd_release_remote(x->pd, &c->remote);
            break;
        }
        if (c->push_id[0]) { /* open the push before the prefill can run */
            td_kv_info ki;
            td_engine_kv_info(x->engine, &ki);
            int n_blocks = (c->n_ids + ki.block_size - 1) / ki.block_size;
            if (!x->pd || pd_push_open(x->pd, id, c->push_id, n_blocks, &err)) {
                td_engine_abort(x->engine, id); /* its final output finds no active entry */
                push_reject(b, c->user, c->choice, err.msg[0] ? err.msg : "no KV connector");
                break;
            }
        }
        srv__active *a = active_add(x, id, c->user, c->choice);
        a->push = c->push_id[0] != 0;
        a->remote = c->remote; /* moved */
        memset(&c->remote, 0, sizeof(c->remote));
        if (a->remote.blocks && x->pd) pd_watch(x->pd, id, &a->remote);
        break;
    }
    case CMD_ABORT:
        for (int i = 0; i < x->n_active; i++) {
            srv__active *a = &x->active[i];
            if (a->user != c->user) continue;
            td_engine_abort(x->engine, a->engine_id);
            /* A request whose KV is being loaded ends when the load does: end the load now
             * (a push whose prefill was cancelled too would wait out its timeout). */
            if (a->load_started && has_remote(&a->remote) && x->pd)
                pd_load_cancel(x->pd, a->remote.transfer_id);
        }
        break;
    case CMD_KV_LOADED: {
        int k = active_find(x, c->engine_id);
        if (k >= 0) {
            srv__active *a = &x->active[k];
            a->kv_info = c->info;
            a->kv_state = c->status == 0      ? SRV__KV_LOADED
                          : x->kv_recompute ? SRV__KV_RECOMPUTED
                                            : SRV__KV_FAILED;
            if (c->status) snprintf(a->kv_note, sizeof(a->kv_note), "%.150s", c->msg);
        }
        char msg[240];
        snprintf(msg, sizeof(msg), "kv transfer failed: %s", c->msg);
        td_engine_kv_loaded(x->engine, c->engine_id, c->status, x->kv_recompute, msg,
                            c->info.first_token);
        break;
    }
    case CMD_KV_RELEASE:
        td_engine_kv_release(x->engine, c->engine_id);
        break;
    }
}

/* A remote request has its blocks: start copying the prompt's KV into them. */
/* Start copying a remote request's KV into its blocks (read or push); 0 or an error. */
static int begin_load(srv__engine *x, srv__active *a, uint64_t id, const int32_t *blocks,
                      int n_blocks, int skip, td_err *err)
{
    if (!x->pd || !has_remote(&a->remote))
        return td_err_set(err, TD_ESTATE, "no transfer connector");
    int rc = a->remote.push ? pd_load_push(x->pd, id, &a->remote, blocks, n_blocks, skip, err)
                            : pd_load(x->pd, id, &a->remote, blocks, n_blocks, skip, err);
    if (rc) return rc;
    /* The heartbeats go on until the load ends (pd's on_load_done): a read renews the
     * lease only once its first piece reaches the producer, and one queued behind others
     * in the consumer's transfer engine would let it lapse meanwhile. */
    a->kv_blocks_cached = skip;
    a->load_started = true;
    return 0;
}

/* A remote request's kv_load output, when admission did not start its copy already. */
static void start_load(srv__engine *x, srv__active *a, const td_output *o)
{
    td_err err = {0};
    int rc = begin_load(x, a, o->id, o->kv_blocks, o->n_kv_blocks, o->kv_skip, &err);
    if (rc == 0) return;
    a->kv_blocks_cached = o->kv_skip;
    if (x->pd) pd_unwatch(x->pd, o->id);
    if (x->pd && has_remote(&a->remote)) pd_release_remote(x->pd, &a->remote);
    a->kv_state = x->kv_recompute ? SRV__KV_RECOMPUTED : SRV__KV_FAILED;
    snprintf(a->kv_note, sizeof(a->kv_note), "%.150s", err.msg);
    char msg[240];
    snprintf(msg, sizeof(msg), "kv transfer failed: %.200s", err.msg);
    td_engine_kv_loaded(x->engine, o->id, rc, x->kv_recompute, msg, -1);
}

/*
 * The engine's admission callback (td_engine_set_load_fn): start the copy now, so that it
 * runs while the engine's step computes, instead of after it. Nothing here may call the
 * engine; if the copy cannot start, start_load deals with it when the kv_load output is
 * drained after the step.
 */
static void on_admit_load(void *user, uint64_t id, const int32_t *blocks, int n_blocks, int skip)
{
    srv__engine *x = user;
    int k = active_find(x, id);
    if (k < 0 || x->active[k].load_started) return;
    td_err err = {0};
    (void)begin_load(x, &x->active[k], id, blocks, n_blocks, skip, &err);
}

/* A held request ended: hand its blocks to the transfer agent under a lease (in write
 * mode: finish the push that its prefill streamed). */
static void hold(srv__engine *x, srv__out *d, const td_output *o, bool push)
{
    td_err err = {0};
    if (push) {
        double q = o->t_first_scheduled > o->t_arrival ? o->t_first_scheduled - o->t_arrival : 0;
        double c = o->t_first_token > o->t_first_scheduled ? o->t_first_token - o->t_first_scheduled
                                                            : 0;
        int rc = x->pd ? pd_push_finish(x->pd, o->id, o->kv_blocks, o->n_kv_blocks, o->token,
                                        q * 1e3, c * 1e3, d->transfer_id)
                       : TD_ESTATE;
        if (rc == 0) {
            d->kv_blocks = malloc((size_t)o->n_kv_blocks * sizeof(int32_t));
            if (d->kv_blocks) {
                memcpy(d->kv_blocks, o->kv_blocks, (size_t)o->n_kv_blocks * sizeof(int32_t));
                d->n_kv_blocks = o->n_kv_blocks;
            }
            return; /* the lease ends through the release callback, as for a read */
        }
        /* The push was dropped (the request was preempted, or the consumer released it
         * early): nobody will read these blocks. */
        d->transfer_id[0] = '\0';
        td_engine_kv_release(x->engine, o->id);
        return;
    }
    if (x->pd && pd_hold(x->pd, o->id, o->kv_blocks, o->n_kv_blocks, d->transfer_id, &err) == 0) {
        d->kv_blocks = malloc((size_t)o->n_kv_blocks * sizeof(int32_t));
        if (d->kv_blocks) {
            memcpy(d->kv_blocks, o->kv_blocks, (size_t)o->n_kv_blocks * sizeof(int32_t));
            d->n_kv_blocks = o->n_kv_blocks;
            return;
        }
        /* cannot describe the blocks to the client: end the lease (its callback queues a
         * release that finds nothing left) and give them back now */
        pd_cancel(x->pd, d->transfer_id);
    }
    TD_WARN("cannot hand request %llu's KV to the transfer agent: %s; the consumer will "
            "recompute", (unsigned long long)o->id, err.msg[0] ? err.msg : "out of memory");
    d->transfer_id[0] = '\0';
    td_engine_kv_release(x->engine, o->id);
}

static void drain_outputs(srv__engine *x, batch *b)
{
    td_output o;
    while (td_engine_poll(x->engine, &o)) {
        int k = active_find(x, o.id);
        if (k < 0) continue; /* cannot happen: every id we see was added here */
        if (o.kv_load) {
            /* started at admission already (on_admit_load), unless that failed */
            if (!x->active[k].load_started) start_load(x, &x->active[k], &o);
            continue;
        }
        srv__active *a = &x->active[k];
        srv__out *d = batch_push(b);
        d->user = x->active[k].user;
        d->choice = x->active[k].choice;
        d->token = o.token;
        d->text = dup_n(o.text ? o.text : "", o.text ? (size_t)o.text_len : 0);
        d->text_len = o.text ? o.text_len : 0;
        d->text_flush_len = TD_MIN(d->text_len, TD_MAX(0, o.text_flush_len));
        d->finish = o.finish;
        d->error = o.error ? dup_n(o.error, strlen(o.error)) : NULL;
        d->num_prompt_tokens = o.num_prompt_tokens;
        d->num_cached_tokens = o.num_cached_tokens;
        d->num_generated = o.num_generated;
        d->logprob = o.logprob;
        d->n_top = o.top_ids && o.top_logprobs ? TD_MIN(o.n_top, TD_MAX_LOGPROBS) : 0;
        for (int i = 0; i < d->n_top; i++) {
            d->top_ids[i] = o.top_ids[i];
            d->top_logprobs[i] = o.top_logprobs[i];
        }
        d->t_arrival = o.t_arrival;
        d->t_first_scheduled = o.t_first_scheduled;
        d->t_first_token = o.t_first_token;
        d->kv_state = a->kv_state;
        snprintf(d->kv_note, sizeof(d->kv_note), "%s", a->kv_note);
        d->t_kv_loaded = o.t_kv_loaded;
        d->kv_info = a->kv_info;
        d->kv_blocks_cached = a->kv_blocks_cached;
        if (o.finish != TD_FINISH_NONE) {
            if (o.n_kv_blocks > 0) hold(x, d, &o, a->push);
            else if (a->push && x->pd) pd_push_abort(x->pd, o.id); /* ended without its KV */
            /* a remote request that never started its load: the producer may let go */
            if (has_remote(&a->remote) && !a->load_started && x->pd) {
                pd_unwatch(x->pd, o.id);
                pd_release_remote(x->pd, &a->remote);
            }
            pd_remote_free(&a->remote);
            x->active[k] = x->active[--x->n_active];
        }
    }
}

/* Hand a batch to the I/O thread and wake it once. */
static void publish(srv__engine *x, batch *b)
{
    pthread_mutex_lock(&x->mu);
    if (b->n) {
        if (x->n_out + b->n > x->cap_out) {
            int cap = x->cap_out ? x->cap_out : 64;
            while (cap < x->n_out + b->n)
                cap *= 2;
            srv__out *g = realloc(x->outbox, (size_t)cap * sizeof(*g));
            TD_ASSERT(g);
            x->outbox = g;
            x->cap_out = cap;
        }
        memcpy(x->outbox + x->n_out, b->v, (size_t)b->n * sizeof(srv__out));
        x->n_out += b->n;
    }
    x->snap.num_running = td_engine_num_running(x->engine);
    x->snap.num_waiting = td_engine_num_waiting(x->engine);
    td_engine_get_stats(x->engine, &x->snap.stats);
    pthread_mutex_unlock(&x->mu);
    atomic_store(&x->outstanding, x->n_active);
    b->n = 0;
    uint64_t one = 1;
    ssize_t w = write(x->wake_fd, &one, sizeof(one));
    (void)w; /* EAGAIN means the counter is already non-zero: the loop will wake anyway */
}

/* Expert parallelism: another rank asks for a round this rank must join, or the group broke. */
static bool ep_asked(srv__engine *x)
{
    return x->ep && (td_ep_requested(x->ep) || td_ep_broken(x->ep, NULL, 0));
}

/* The group's wake-up: another rank asked for a round (or the group broke). */
static void ep_wake(void *user)
{
    srv__engine *x = user;
    pthread_mutex_lock(&x->mu);
    pthread_cond_signal(&x->cv);
    pthread_mutex_unlock(&x->mu);
}

/*
 * One engine step. With expert parallelism every rank of the group steps together (each
 * MoE layer exchanges rows with every rank): a rank with work asks for a round, every rank
 * joins it, and each runs one step (empty where it has nothing: it still runs its experts
 * for the others). A broken group stops this loop with the group's reason.
 */
static int step(srv__engine *x)
{
    td_err err = {0};
    bool mine = td_engine_has_work(x->engine);
    int did = 0;
    if (!x->ep) {
        if (mine) did = td_engine_step(x->engine, &err);
    } else {
        char why[sizeof(x->stop_reason)];
        if (td_ep_broken(x->ep, why, sizeof(why))) { /* another rank stopped: so does this one */
            srv__engine_request_stop(x, why);
            return 0;
        }
        if (mine) td_ep_request(x->ep, x->ep_rank);
        if (!mine && !td_ep_requested(x->ep)) return 0;
        int j = td_ep_join(x->ep, x->ep_rank, mine);
        if (j < 0) {
            td_ep_broken(x->ep, why, sizeof(why));
            srv__engine_request_stop(x, why);
            return 0;
        }
        if (j > 0) did = td_engine_step(x->engine, &err);
    }
    if (did < 0) TD_ERROR("engine step failed: %s", err.msg);
    return did;
}

/* Under x->mu: wait for a command, at most 100 ms. */
static void wait_tick(srv__engine *x)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 100 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&x->cv, &x->mu, &ts);
}

/*
 * After a stop: a request whose KV is being copied in cannot end before the copy does (its
 * blocks are being written), so its abort waits for the load's end. Take those ends (the
 * loads are bounded by their transfer deadline) and the releases of held blocks, until no
 * request is left or STOP_LOAD_WAIT_NS passed; a request still left then ends with an
 * error, so that its client is answered.
 */
#define STOP_LOAD_WAIT_NS (35ull * 1000000000ull)

static void stop_drain_loads(srv__engine *x, batch *b)
{
    pthread_mutex_lock(&x->mu);
    bool final = x->stop_final; /* teardown: pd_destroy cancels the loads next */
    pthread_mutex_unlock(&x->mu);
    uint64_t until = final ? 0 : td_now_ns() + STOP_LOAD_WAIT_NS;
    while (x->n_active > 0 && td_now_ns() < until) {
        pthread_mutex_lock(&x->mu);
        if (!x->inbox_head) wait_tick(x);
        srv__cmd *cmds = x->inbox_head;
        x->inbox_head = x->inbox_tail = NULL;
        pthread_mutex_unlock(&x->mu);
        for (srv__cmd *c = cmds, *next; c; c = next) {
            next = c->next;
            if (c->kind == CMD_ADD)
                push_reject(b, c->user, c->choice, "the engine loop has stopped");
            else
                apply(x, c, b);
            cmd_free(c);
        }
        drain_outputs(x, b);
        publish(x, b);
    }
    for (int i = 0; i < x->n_active; i++)
        push_failed(b, x->active[i].user, x->active[i].choice,
                    "the engine loop stopped while this request's KV was being transferred");
    if (x->n_active) publish(x, b);
}

static void *engine_main(void *arg)
{
    srv__engine *x = arg;
    batch b = {0};
    bool blocked = false; /* the last step could do nothing although work waits */
    for (;;) {
        pthread_mutex_lock(&x->mu);
        /* Requests in flight but nothing to step (their KV is being copied in): wait with
         * a timeout below, so that the loop still shows progress to /health. */
        bool idle = false;
        while (!x->inbox_head && !x->stop_requested && !td_engine_has_work(x->engine) &&
               x->n_active == 0 && !ep_asked(x)) {
            idle = true;
            pthread_cond_wait(&x->cv, &x->mu);
        }
        /* Work after idleness: the stall clock of /health starts now, not at the last step
         * (which may be long ago: the first request after a quiet minute read as stalled). */
        if (idle) atomic_store(&x->last_progress_ns, td_now_ns());
        if ((blocked || !td_engine_has_work(x->engine)) && !x->inbox_head && !x->stop_requested &&
            !ep_asked(x)) {
            /* Waiting requests that cannot get blocks yet (held for consumers, or being
             * loaded): what frees them arrives as a command. Wait for one, waking now and
             * then so that /health sees a live loop. */
            wait_tick(x);
        }
        srv__cmd *cmds = x->inbox_head;
        x->inbox_head = x->inbox_tail = NULL;
        bool stop = x->stop_requested;
        if (stop) x->stopped = true; /* no command is accepted after this point */
        pthread_mutex_unlock(&x->mu);

        for (srv__cmd *c = cmds, *next; c; c = next) {
            next = c->next;
            if (stop && c->kind == CMD_ADD)
                push_reject(&b, c->user, c->choice, "the engine loop has stopped");
            else
                apply(x, c, &b);
            cmd_free(c);
        }
        if (stop) {
            /* The other ranks cannot step without this rank's experts: they stop too. */
            if (x->ep) td_ep_break(x->ep, x->ep_rank, x->stop_reason);
            /* Finish every request so that each gets its final output and frees its KV. */
            for (int i = 0; i < x->n_active; i++)
                td_engine_abort(x->engine, x->active[i].engine_id);
            drain_outputs(x, &b);
            publish(x, &b);
            stop_drain_loads(x, &b);
            td_engine_idle(x->engine); /* its CPUs (and borrowed ones) back to the host */
            break;
        }
        int did = step(x);
        /* The test hook makes a step slow: its outputs come out after the sleep, so that
         * what arrives meanwhile (an abort, a stop) meets a step already under way. */
        if (did > 0 && x->step_delay_ms > 0) {
            struct timespec ts = {x->step_delay_ms / 1000,
                                  (long)(x->step_delay_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        int before = b.n;
        drain_outputs(x, &b);
        blocked = did == 0 && b.n == before && td_engine_has_work(x->engine);
        atomic_store(&x->last_progress_ns, td_now_ns());
        publish(x, &b);
    }
    free(b.v);
    pthread_mutex_lock(&x->mu);
    x->exited = true;
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

int srv__engine_start(srv__engine *x, td_engine *e, int step_delay_ms, pd_connector *pd,
                      bool kv_recompute, td_ep_group *ep, int ep_rank, td_err *err)
{
    memset(x, 0, sizeof(*x));
    x->engine = e;
    x->ep = ep;
    x->ep_rank = ep_rank;
    x->pd = pd;
    x->kv_recompute = kv_recompute;
    x->step_delay_ms = step_delay_ms;
    if (pd) td_engine_set_layer_fn(e, pd_push_progress, pd); /* write mode's producers */
    if (pd) td_engine_set_load_fn(e, on_admit_load, x);      /* consumers: copy at once */
    x->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (x->wake_fd < 0) return td_err_set(err, TD_EIO, "eventfd: %s", strerror(errno));
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cv, NULL);
    atomic_store(&x->last_progress_ns, td_now_ns());
    pthread_mutex_lock(&x->mu);
    x->snap.num_running = 0;
    td_engine_get_stats(e, &x->snap.stats);
    pthread_mutex_unlock(&x->mu);
    if (ep) td_ep_set_wake(ep, ep_rank, ep_wake, x);
    if (pthread_create(&x->thread, NULL, engine_main, x) != 0) {
        close(x->wake_fd);
        return td_err_set(err, TD_EIO, "cannot start the engine thread");
    }
    x->thread_started = true;
    return 0;
}

void srv__engine_request_stop(srv__engine *x, const char *reason)
{
    pthread_mutex_lock(&x->mu);
    if (!x->stop_requested) snprintf(x->stop_reason, sizeof(x->stop_reason), "%s", reason);
    x->stop_requested = true;
    pthread_cond_signal(&x->cv);
    pthread_mutex_unlock(&x->mu);
}

void srv__engine_stop(srv__engine *x, const char *reason)
{
    if (!x->thread_started) return;
    pthread_mutex_lock(&x->mu);
    x->stop_final = true;
    pthread_mutex_unlock(&x->mu);
    srv__engine_request_stop(x, reason);
    /* A loop waiting in its group (for a rank that will not come) must not hold up the join:
     * the group ends here, as it would when the loop saw the request. */
    if (x->ep) td_ep_break(x->ep, x->ep_rank, reason);
    pthread_join(x->thread, NULL);
    x->thread_started = false;
}

bool srv__engine_stopped(srv__engine *x, char *reason, size_t cap)
{
    pthread_mutex_lock(&x->mu);
    bool s = x->stopped || x->stop_requested;
    if (s && reason) snprintf(reason, cap, "%s", x->stop_reason);
    pthread_mutex_unlock(&x->mu);
    return s;
}

static int post(srv__engine *x, srv__cmd *c)
{
    pthread_mutex_lock(&x->mu);
    /* A load's end and a release are taken while a stopping loop still drains its loads. */
    bool late_ok = (c->kind == CMD_KV_LOADED || c->kind == CMD_KV_RELEASE) && !x->exited;
    if ((x->stopped || x->stop_requested) && !late_ok) {
        pthread_mutex_unlock(&x->mu);
        return TD_ESTATE;
    }
    if (x->inbox_tail)
        x->inbox_tail->next = c;
    else
        x->inbox_head = c;
    x->inbox_tail = c;
    pthread_cond_signal(&x->cv);
    pthread_mutex_unlock(&x->mu);
    return 0;
}

int srv__engine_add(srv__engine *x, void *user, int choice, const char *push_id,
                    const int32_t *ids, int n_ids,
                    const td_sampling *sp, const td_request_kv *kv, pd_remote *remote)
{
    srv__cmd *c = calloc(1, sizeof(*c));
    if (!c) {
        if (remote) pd_remote_free(remote);
        return TD_ENOMEM;
    }
    c->kind = CMD_ADD;
    if (kv) c->kv = *kv;
    if (push_id) snprintf(c->push_id, sizeof(c->push_id), "%s", push_id);
    if (remote) { /* moved */
        c->remote = *remote;
        memset(remote, 0, sizeof(*remote));
    }
    c->user = user;
    c->choice = choice;
    c->sp = *sp;
    c->ids = malloc((size_t)(n_ids ? n_ids : 1) * sizeof(int32_t));
    if (c->ids && n_ids) memcpy(c->ids, ids, (size_t)n_ids * sizeof(int32_t));
    c->n_ids = n_ids;
    c->sp.n_stop = 0;
    c->sp.stop = NULL;
    c->sp.stop_token_ids = NULL;
    c->sp.n_stop_token_ids = 0;
    c->sp.logit_bias_ids = NULL;
    c->sp.logit_bias = NULL;
    c->sp.n_logit_bias = 0;
    bool oom = !c->ids;
    if (sp->n_logit_bias > 0) {
        c->bias_ids = malloc((size_t)sp->n_logit_bias * sizeof(int32_t));
        c->bias = malloc((size_t)sp->n_logit_bias * sizeof(float));
        oom |= !c->bias_ids || !c->bias;
        if (c->bias_ids && c->bias) {
            memcpy(c->bias_ids, sp->logit_bias_ids, (size_t)sp->n_logit_bias * sizeof(int32_t));
            memcpy(c->bias, sp->logit_bias, (size_t)sp->n_logit_bias * sizeof(float));
            c->sp.logit_bias_ids = c->bias_ids;
            c->sp.logit_bias = c->bias;
            c->sp.n_logit_bias = sp->n_logit_bias;
        }
    }
    if (sp->n_stop > 0) {
        c->stop = calloc((size_t)sp->n_stop, sizeof(char *));
        oom |= !c->stop;
        for (int i = 0; c->stop && i < sp->n_stop; i++) {
            c->stop[i] = dup_n(sp->stop[i], strlen(sp->stop[i]));
            oom |= !c->stop[i];
            c->sp.n_stop = i + 1;
        }
        c->sp.stop = (const char *const *)c->stop;
    }
    if (sp->n_stop_token_ids > 0) {
        c->stop_ids = malloc((size_t)sp->n_stop_token_ids * sizeof(int32_t));
        oom |= !c->stop_ids;
        if (c->stop_ids) {
            memcpy(c->stop_ids, sp->stop_token_ids, (size_t)sp->n_stop_token_ids * sizeof(int32_t));
            c->sp.stop_token_ids = c->stop_ids;
            c->sp.n_stop_token_ids = sp->n_stop_token_ids;
        }
    }
    int rc = oom ? TD_ENOMEM : post(x, c);
    if (rc) cmd_free(c);
    return rc;
}

void srv__engine_on_release(void *user, uint64_t req_id)
{
    srv__engine *x = user;
    srv__cmd *c = calloc(1, sizeof(*c));
    if (!c) return; /* the blocks stay held until shutdown: logged by the caller's metrics */
    c->kind = CMD_KV_RELEASE;
    c->engine_id = req_id;
    if (post(x, c)) cmd_free(c);
}

void srv__engine_on_loaded(void *user, uint64_t req_id, int status, const char *msg,
                           const pd_load_info *info)
{
    srv__engine *x = user;
    srv__cmd *c = calloc(1, sizeof(*c));
    TD_ASSERT(c); /* a load that cannot report its end would leave its request waiting */
    c->kind = CMD_KV_LOADED;
    c->engine_id = req_id;
    c->status = status;
    snprintf(c->msg, sizeof(c->msg), "%s", msg ? msg : "");
    if (info) c->info = *info;
    if (post(x, c)) cmd_free(c);
}

void srv__engine_abort(srv__engine *x, void *user)
{
    srv__cmd *c = calloc(1, sizeof(*c));
    if (!c) return; /* the request then runs to its end; its blocks are freed there */
    c->kind = CMD_ABORT;
    c->user = user;
    if (post(x, c)) cmd_free(c);
}

void srv__engine_take(srv__engine *x, srv__out **outs, int *n, srv__snapshot *snap)
{
    pthread_mutex_lock(&x->mu);
    *outs = x->outbox;
    *n = x->n_out;
    x->outbox = NULL;
    x->n_out = x->cap_out = 0;
    if (snap) *snap = x->snap;
    pthread_mutex_unlock(&x->mu);
}

void srv__engine_free(srv__engine *x)
{
    srv__engine_stop(x, "shutting down");
    for (srv__cmd *c = x->inbox_head, *next; c; c = next) {
        next = c->next;
        cmd_free(c);
    }
    for (int i = 0; i < x->n_out; i++)
        srv__out_free(&x->outbox[i]);
    free(x->outbox);
    for (int i = 0; i < x->n_active; i++)
        pd_remote_free(&x->active[i].remote);
    free(x->active);
    if (x->wake_fd > 0) close(x->wake_fd);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
}
