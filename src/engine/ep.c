/*
 * engine/ep.c - an expert-parallel group of data-parallel ranks in one process
 * (tandem/ep.h, engine/ep.h).
 *
 * Two kinds of synchronisation, both under one mutex with a broken flag that ends every
 * wait:
 * - rounds (td_ep_request / td_ep_join): the engine loops' agreement to step together. A
 *   rank with work sets `requested` and wakes the others through their loops' own
 *   callbacks; every rank joins; the last to arrive closes the round (requested cleared),
 *   so a loop that wakes later sees no stale request and goes back to sleep.
 * - the exchange barrier (ep__barrier), twice per MoE layer inside a step. It spins for a
 *   short while before sleeping: the ranks reach it within microseconds of each other, and
 *   waking a sleeping thread costs tens of microseconds.
 */
#include "engine/ep.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EP_MAX_RANKS 64
#define EP_SPIN_NS 200000 /* how long a barrier spins before it sleeps */

typedef struct ep_rank {
    void (*wake)(void *user);
    void *user;
    const float *xg;
    const int32_t *start;
    float *yg;
} ep_rank;

struct td_ep_group {
    int n;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* rounds, under mu */
    bool requested;
    int round_arrived;
    bool round_any;
    uint64_t round; /* rounds closed */
    bool last_any;  /* the last closed round's answer (stable until every rank joins again) */
    /* the exchange barrier: arrivals under mu; the generation is read while spinning */
    int bar_arrived;
    _Atomic uint64_t bar_gen;
    _Atomic bool broken;
    char why[200];
    ep_rank ranks[EP_MAX_RANKS];
};

int td_ep_group_create(td_ep_group **out, int n_ranks, td_err *err)
{
    *out = NULL;
    if (n_ranks < 2 || n_ranks > EP_MAX_RANKS)
        return td_err_set(err, TD_EINVAL, "an expert-parallel group has 2 to %d ranks, not %d", EP_MAX_RANKS,
                          n_ranks);
    td_ep_group *g = calloc(1, sizeof(*g));
    if (!g) return td_err_set(err, TD_ENOMEM, "out of memory");
    g->n = n_ranks;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    *out = g;
    return 0;
}

void td_ep_group_free(td_ep_group *g)
{
    if (!g) return;
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

int td_ep_size(const td_ep_group *g)
{
    return g->n;
}

void td_ep_experts(const td_ep_group *g, int rank, int n_expert, int *lo, int *hi)
{
    *lo = (int)((int64_t)rank * n_expert / g->n);
    *hi = (int)((int64_t)(rank + 1) * n_expert / g->n);
}

void td_ep_set_wake(td_ep_group *g, int rank, void (*wake)(void *user), void *user)
{
    pthread_mutex_lock(&g->mu);
    g->ranks[rank].wake = wake;
    g->ranks[rank].user = user;
    pthread_mutex_unlock(&g->mu);
}

/* Every rank's loop but `except`'s (-1: all), woken through its callback, no lock held. */
static void wake_all(td_ep_group *g, int except)
{
    ep_rank r[EP_MAX_RANKS];
    pthread_mutex_lock(&g->mu);
    memcpy(r, g->ranks, sizeof(ep_rank) * (size_t)g->n);
    pthread_mutex_unlock(&g->mu);
    for (int i = 0; i < g->n; i++)
        if (i != except && r[i].wake) r[i].wake(r[i].user);
}

void td_ep_request(td_ep_group *g, int rank)
{
    pthread_mutex_lock(&g->mu);
    bool was = g->requested;
    g->requested = true;
    pthread_mutex_unlock(&g->mu);
    if (!was) wake_all(g, rank);
}

bool td_ep_requested(td_ep_group *g)
{
    pthread_mutex_lock(&g->mu);
    bool r = g->requested;
    pthread_mutex_unlock(&g->mu);
    return r;
}

int td_ep_join(td_ep_group *g, int rank, bool have_work)
{
    (void)rank;
    pthread_mutex_lock(&g->mu);
    if (atomic_load(&g->broken)) {
        pthread_mutex_unlock(&g->mu);
        return -1;
    }
    uint64_t mine = g->round;
    g->round_any = g->round_any || have_work;
    if (++g->round_arrived == g->n) {
        bool any = g->round_any;
        g->round_arrived = 0;
        g->round_any = false;
        g->requested = false;
        g->round++;
        g->last_any = any;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return any ? 1 : 0;
    }
    while (g->round == mine && !atomic_load(&g->broken))
        pthread_cond_wait(&g->cv, &g->mu);
    int rc = g->round == mine ? -1 : g->last_any ? 1 : 0;
    pthread_mutex_unlock(&g->mu);
    return rc;
}

void td_ep_break(td_ep_group *g, int rank, const char *why)
{
    pthread_mutex_lock(&g->mu);
    if (!atomic_load(&g->broken))
        snprintf(g->why, sizeof(g->why), "expert-parallel rank %d stopped (%s): the experts it holds are gone", rank,
                 why && why[0] ? why : "no reason given");
    atomic_store(&g->broken, true);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    wake_all(g, rank);
}

bool td_ep_broken(td_ep_group *g, char *buf, size_t cap)
{
    pthread_mutex_lock(&g->mu);
    bool b = atomic_load(&g->broken);
    if (buf && cap) snprintf(buf, cap, "%s", b ? g->why : "");
    pthread_mutex_unlock(&g->mu);
    return b;
}

void ep__attach(td_ep_group *g, int rank, const float *xg, const int32_t *start, float *yg)
{
    pthread_mutex_lock(&g->mu);
    g->ranks[rank].xg = xg;
    g->ranks[rank].start = start;
    g->ranks[rank].yg = yg;
    pthread_mutex_unlock(&g->mu);
}

void ep__peer(const td_ep_group *g, int rank, const float **xg, const int32_t **start, float **yg)
{
    *xg = g->ranks[rank].xg;
    *start = g->ranks[rank].start;
    *yg = g->ranks[rank].yg;
}

int ep__barrier(td_ep_group *g)
{
    pthread_mutex_lock(&g->mu);
    if (atomic_load(&g->broken)) {
        pthread_mutex_unlock(&g->mu);
        return -1;
    }
    uint64_t gen = atomic_load(&g->bar_gen);
    if (++g->bar_arrived == g->n) {
        g->bar_arrived = 0;
        atomic_store(&g->bar_gen, gen + 1); /* releases every rank's writes before it */
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return 0;
    }
    pthread_mutex_unlock(&g->mu);
    uint64_t t0 = td_now_ns();
    while (atomic_load(&g->bar_gen) == gen && !atomic_load(&g->broken) && td_now_ns() - t0 < EP_SPIN_NS)
        sched_yield();
    pthread_mutex_lock(&g->mu);
    while (atomic_load(&g->bar_gen) == gen && !atomic_load(&g->broken))
        pthread_cond_wait(&g->cv, &g->mu);
    bool ok = atomic_load(&g->bar_gen) != gen;
    pthread_mutex_unlock(&g->mu);
    return ok ? 0 : -1;
}
