/*
 * util/accept_guard.h - keep an evhttp listener from spinning when accept() fails.
 *
 * When a process is out of file descriptors (EMFILE, ENFILE) or kernel memory, accept()
 * fails and the listening socket stays readable: libevent calls the listener again at
 * once, logging each time, so the I/O thread spins at full speed and writes a warning per
 * call (about 400,000 a second here) until a descriptor frees. A guarded listener instead
 * stops accepting for TD_ACCEPT_PAUSE_MS and logs one warning per episode (with how often
 * it paused); pending connections wait in the kernel's backlog meanwhile.
 */
#ifndef TD_UTIL_ACCEPT_GUARD_H
#define TD_UTIL_ACCEPT_GUARD_H

#include <stdint.h>

struct event_base;
struct evhttp_bound_socket;

#define TD_ACCEPT_PAUSE_MS 100

typedef struct td_accept_guard td_accept_guard;

/** Guard sock's listener (timers on base); `who` names it in the log. NULL if out of memory. */
td_accept_guard *td_accept_guard_new(struct event_base *base, struct evhttp_bound_socket *sock,
                                     const char *who);
/** Pauses so far. */
uint64_t td_accept_guard_pauses(const td_accept_guard *g);
/** Before the listener and the base are freed. NULL is fine. */
void td_accept_guard_free(td_accept_guard *g);

#endif
