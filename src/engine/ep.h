/*
 * engine/ep.h - the forward pass's side of an expert-parallel group (tandem/ep.h).
 *
 * Each rank registers its MoE buffers once (ep__attach). In a MoE layer every rank routes
 * its rows and gathers them grouped by expert into its own xg (start[e] .. start[e + 1]
 * are expert e's rows, experts ascending, so the rows for each owner are contiguous);
 * ep__barrier; each rank runs the experts it holds on the rows of every rank (read
 * straight from their xg) and writes the results into their yg at the same rows;
 * ep__barrier; each rank sums its own rows' results from its yg. A rank's xg and start are
 * read by others only between the two barriers, and each yg row is written by exactly one
 * owner in that window, so no lock is needed.
 */
#ifndef TD_ENGINE_EP_H
#define TD_ENGINE_EP_H

#include <stdint.h>

#include "tandem/ep.h"

void ep__attach(td_ep_group *g, int rank, const float *xg, const int32_t *start, float *yg);

/** Rank `rank`'s registered buffers. */
void ep__peer(const td_ep_group *g, int rank, const float **xg, const int32_t **start, float **yg);

/** Wait until every rank has reached the same point; -1 once the group is broken. */
int ep__barrier(td_ep_group *g);

#endif
