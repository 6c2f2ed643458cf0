/*
 * util/reply_flush.c - see reply_flush.h.
 */
#include "util/reply_flush.h"

#include <event2/event.h>
#include <event2/http.h>

#include "util/td.h"

static void on_written(struct evhttp_request *req, void *arg)
{
    (void)req;
    td_replies *t = arg;
    if (t->unsent > 0) t->unsent--;
}

void td_replies_track(td_replies *t, struct evhttp_request *req)
{
    t->unsent++;
    evhttp_request_set_on_complete_cb(req, on_written, t);
}

int td_replies_flush(struct event_base *base, td_replies *t, int max_ms)
{
    uint64_t end = td_now_ns() + (uint64_t)max_ms * 1000000ull;
    while (t->unsent > 0 && td_now_ns() < end) {
        /* One pass, or 10 ms of nothing happening: then look at the count and the clock. */
        struct timeval tv = {0, 10000};
        event_base_loopexit(base, &tv);
        event_base_loop(base, EVLOOP_ONCE);
    }
    return t->unsent;
}
