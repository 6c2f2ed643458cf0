/*
 * util/reply_flush.h - let replies already handed to evhttp reach the wire before exit.
 *
 * evhttp_send_reply and evhttp_send_reply_end only queue a reply's last bytes; the event
 * loop writes them on a later pass. A process that leaves its loop as soon as its last
 * request is answered, and then frees the evhttp, closes those connections with the tail
 * unsent: a stream loses its final chunk and the client sees a truncated response. So each
 * reply is counted when it is queued (td_replies_track, just before the send call) and
 * uncounted when evhttp has written it; at exit the loop runs on until the count is zero,
 * for at most a bound (a client that stopped reading must not hold the exit).
 */
#ifndef TD_UTIL_REPLY_FLUSH_H
#define TD_UTIL_REPLY_FLUSH_H

struct event_base;
struct evhttp_request;

typedef struct td_replies {
    int unsent; /* queued with evhttp and not yet written out */
} td_replies;

/** Count req's reply until evhttp has written it. Call just before evhttp_send_reply or
 * evhttp_send_reply_end, on the loop's thread. A reply whose connection dies first stays
 * counted, which only shortens the next flush to its bound. */
void td_replies_track(td_replies *t, struct evhttp_request *req);

/** Run base's loop until every tracked reply is written or max_ms pass. Returns how many
 * are still unsent. Stop accepting connections first. */
int td_replies_flush(struct event_base *base, td_replies *t, int max_ms);

#endif
