/*
 * kvx/railpool.c - one transfer engine per matched rail, made on first use.
 *
 * The primary rail's engine is made when the pool is (a failure there is a start-up
 * error). Every other rail's engine is made the first time a transfer needs that rail:
 * under the pool's lock, so concurrent first uses make exactly one; it then registers
 * the same ranges as the primary (its own registrations, no new memory). If opening or
 * a registration fails, what was registered is undone in reverse order, the engine is
 * closed, and the rail stays failed, with its error, until the process restarts: a rail
 * that failed once is not retried under load. An engine, once ready, is kept until the
 * pool is destroyed; nothing replaces it or its registrations.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvx/kvx_internal.h"

typedef struct rail_slot {
    int state; /* KVX__RAIL_NONE, _READY, _FAILED */
    void *eng;
    char error[256];
} rail_slot;

struct kvx__railpool {
    kvx_rails rails;
    int n_ranges;
    kvx__rail_ops ops;
    void *user;
    pthread_mutex_t mu;
    rail_slot slot[KVX_MAX_RAILS];
};

/* Open rail i's engine and register every range; on failure undo and remember why.
 * Called with p->mu held. */
static int make_engine(kvx__railpool *p, int i, td_err *err)
{
    rail_slot *s = &p->slot[i];
    const char *name = p->rails.name[i];
    void *eng = NULL;
    int rc = p->ops.open(p->user, i, name, &eng, err);
    int k = 0;
    for (; !rc && k < p->n_ranges; k++)
        rc = p->ops.reg(p->user, eng, k, err);
    if (!rc) {
        s->state = KVX__RAIL_READY;
        s->eng = eng;
        if (p->n_ranges) TD_INFO("kvx: rail %s ready (%d ranges registered)", name, p->n_ranges);
        return 0;
    }
    if (eng) {
        for (int j = k - 2; j >= 0; j--) /* k - 1 is the registration that failed */
            p->ops.unreg(p->user, eng, j);
        p->ops.close(p->user, eng);
    }
    s->state = KVX__RAIL_FAILED;
    snprintf(s->error, sizeof(s->error), "%s", err->msg);
    TD_WARN("kvx: rail %s failed and stays failed until restart: %s", name, err->msg);
    return rc;
}

int kvx__railpool_create(kvx__railpool **out, const kvx_rails *rails, int n_ranges,
                         const kvx__rail_ops *ops, void *user, td_err *err)
{
    *out = NULL;
    if (!rails || rails->n < 1 || rails->n > KVX_MAX_RAILS || rails->primary < 0 ||
        rails->primary >= rails->n || n_ranges < 0)
        return td_err_set(err, TD_EINVAL, "kvx: a rail pool needs rails and a primary among them");
    kvx__railpool *p = calloc(1, sizeof(*p));
    if (!p) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    p->rails = *rails;
    p->n_ranges = n_ranges;
    p->ops = *ops;
    p->user = user;
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_lock(&p->mu);
    int rc = make_engine(p, rails->primary, err);
    pthread_mutex_unlock(&p->mu);
    if (rc) {
        td_err e2 = *err;
        td_err_set(err, rc, "kvx: the primary rail %s: %s", rails->name[rails->primary], e2.msg);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return rc;
    }
    *out = p;
    return 0;
}

int kvx__railpool_get(kvx__railpool *p, int rail, void **eng, td_err *err)
{
    *eng = NULL;
    if (rail < 0 || rail >= p->rails.n)
        return td_err_set(err, TD_EINVAL, "kvx: no rail %d (%d rails)", rail, p->rails.n);
    pthread_mutex_lock(&p->mu);
    rail_slot *s = &p->slot[rail];
    int rc = 0;
    if (s->state == KVX__RAIL_NONE) rc = make_engine(p, rail, err);
    else if (s->state == KVX__RAIL_FAILED)
        rc = td_err_set(err, TD_EIO, "kvx: rail %s failed earlier and stays failed until restart: %s",
                        p->rails.name[rail], s->error);
    if (!rc) *eng = s->eng;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

int kvx__railpool_state(kvx__railpool *p, int rail)
{
    if (rail < 0 || rail >= p->rails.n) return -1;
    pthread_mutex_lock(&p->mu);
    int st = p->slot[rail].state;
    pthread_mutex_unlock(&p->mu);
    return st;
}

void kvx__railpool_destroy(kvx__railpool *p)
{
    if (!p) return;
    for (int i = 0; i < p->rails.n; i++) {
        rail_slot *s = &p->slot[i];
        if (s->state != KVX__RAIL_READY) continue;
        for (int k = p->n_ranges - 1; k >= 0; k--)
            p->ops.unreg(p->user, s->eng, k);
        p->ops.close(p->user, s->eng);
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
}

void kvx__railpool_each(kvx__railpool *p, void (*fn)(void *eng, void *user), void *user)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->rails.n; i++)
        if (p->slot[i].state == KVX__RAIL_READY) fn(p->slot[i].eng, user);
    pthread_mutex_unlock(&p->mu);
}

void kvx__rail_ucx_device(const kvx_rails *r, int rail, char *out, size_t cap)
{
    snprintf(out, cap, "%s%s", r->name[rail], r->kind == KVX_RAIL_RDMA ? ":1" : "");
}
