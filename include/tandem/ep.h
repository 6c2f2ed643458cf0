/*
 * tandem/ep.h - expert parallelism between the data-parallel ranks of one process.
 *
 * An expert-parallel group joins N engines (one per data-parallel rank, each with its own
 * scheduler and KV pool) that run a mixture-of-experts model with its experts split
 * between them: rank r holds experts [r E / N, (r + 1) E / N). Each MoE layer of a step
 * is an exchange: every rank routes its own rows, every rank runs the experts it holds
 * for the rows of every rank, and every rank sums its rows' results (engine/moe.c).
 *
 * So the ranks step together. The engine loops ask for a round when they have work
 * (td_ep_request), every rank joins it (td_ep_join), and each then runs exactly one
 * engine step; a rank with nothing to do runs an empty step that only serves its experts.
 * A rank that stops breaks the group (td_ep_break): every wait in it returns at once with
 * an error, and no step of any rank can complete after that.
 */
#ifndef TANDEM_EP_H
#define TANDEM_EP_H

#include <stdbool.h>

#include <stddef.h>

#include "util/td.h"

typedef struct td_ep_group td_ep_group;

/** A group of n_ranks (2..64) ranks. */
int td_ep_group_create(td_ep_group **out, int n_ranks, td_err *err);
void td_ep_group_free(td_ep_group *g);
int td_ep_size(const td_ep_group *g);

/** The experts rank r holds, of n_expert: [*lo, *hi). */
void td_ep_experts(const td_ep_group *g, int rank, int n_expert, int *lo, int *hi);

/**
 * How the group wakes rank r's loop when another rank asks for a round (called with no
 * lock of the group held; the callback takes the loop's own lock to signal it).
 */
void td_ep_set_wake(td_ep_group *g, int rank, void (*wake)(void *user), void *user);

/** Rank `rank` has work: ask every rank to join the next round (wakes them). */
void td_ep_request(td_ep_group *g, int rank);

/** Whether a round is asked for that this loop has not joined yet. */
bool td_ep_requested(td_ep_group *g);

/**
 * Join the round (every rank must): returns 1 when some rank has work (then every rank
 * runs one engine step), 0 when none has, or -1 once the group is broken.
 */
int td_ep_join(td_ep_group *g, int rank, bool have_work);

/** Break the group: rank `rank` stops (why says how); every wait returns -1 from now on. */
void td_ep_break(td_ep_group *g, int rank, const char *why);

/** The reason the group broke ("" while it is whole), copied into buf. */
bool td_ep_broken(td_ep_group *g, char *buf, size_t cap);

#endif
