/*
 * util/accept_guard.c - see accept_guard.h.
 *
 * libevent hands a listener's error callback the listener's own user data, which evhttp
 * keeps for itself, so guards are found by their listener in a small registry.
 */
#include "util/accept_guard.h"

#include <errno.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/listener.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/td.h"

struct td_accept_guard {
    struct evconnlistener *lev;
    struct event *resume;
    char who[32];
    uint64_t pauses, pauses_logged, last_log_ns;
    td_accept_guard *next;
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static td_accept_guard *reg;

static td_accept_guard *find(struct evconnlistener *lev)
{
    pthread_mutex_lock(&reg_mu);
    td_accept_guard *g = reg;
    while (g && g->lev != lev)
        g = g->next;
    pthread_mutex_unlock(&reg_mu);
    return g;
}

static void on_resume(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    td_accept_guard *g = arg;
    evconnlistener_enable(g->lev);
}

static void on_accept_error(struct evconnlistener *lev, void *user)
{
    (void)user;
    int e = EVUTIL_SOCKET_ERROR();
    td_accept_guard *g = find(lev);
    if (!g) return;
    /* Whatever the error (EMFILE and ENFILE are the usual ones), the listener would be
     * called again at once: pause it. */
    evconnlistener_disable(lev);
    struct timeval tv = {0, TD_ACCEPT_PAUSE_MS * 1000};
    event_add(g->resume, &tv);
    g->pauses++;
    uint64_t now = td_now_ns();
    if (!g->last_log_ns || now - g->last_log_ns >= 10000000000ull) { /* 10 s */
        TD_WARN("%s: cannot accept connections (%s): pausing %d ms at a time until it can "
                "(%llu pauses since the last warning)",
                g->who, strerror(e), TD_ACCEPT_PAUSE_MS,
                (unsigned long long)(g->pauses - g->pauses_logged));
        g->pauses_logged = g->pauses;
        g->last_log_ns = now;
    }
}

td_accept_guard *td_accept_guard_new(struct event_base *base, struct evhttp_bound_socket *sock,
                                     const char *who)
{
    td_accept_guard *g = calloc(1, sizeof(*g));
    if (!g) return NULL;
    g->lev = evhttp_bound_socket_get_listener(sock);
    g->resume = evtimer_new(base, on_resume, g);
    if (!g->lev || !g->resume) {
        if (g->resume) event_free(g->resume);
        free(g);
        return NULL;
    }
    snprintf(g->who, sizeof(g->who), "%s", who);
    pthread_mutex_lock(&reg_mu);
    g->next = reg;
    reg = g;
    pthread_mutex_unlock(&reg_mu);
    evconnlistener_set_error_cb(g->lev, on_accept_error);
    return g;
}

uint64_t td_accept_guard_pauses(const td_accept_guard *g)
{
    return g ? g->pauses : 0;
}

void td_accept_guard_free(td_accept_guard *g)
{
    if (!g) return;
    pthread_mutex_lock(&reg_mu);
    for (td_accept_guard **pp = &reg; *pp; pp = &(*pp)->next)
        if (*pp == g) {
            *pp = g->next;
            break;
        }
    pthread_mutex_unlock(&reg_mu);
    evconnlistener_set_error_cb(g->lev, NULL);
    event_free(g->resume);
    free(g);
}
