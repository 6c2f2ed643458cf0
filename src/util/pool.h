/*
 * util/pool.h - a fork/join thread pool for the compute kernels.
 *
 * td_pool_run(pool, fn, ctx) runs fn(ctx, ith, nth) once on every thread of the
 * pool (the calling thread is thread 0) and returns when all are done. Workers
 * spin briefly between runs, because a decode step issues ~100 runs a few
 * microseconds apart, then sleep on a futex so an idle server burns no CPU.
 * Threads can be pinned to cores (one per core, in order).
 */
#ifndef TD_UTIL_POOL_H
#define TD_UTIL_POOL_H

#include <sched.h>

#include "util/td.h"

typedef struct td_pool td_pool;
typedef void (*td_pool_fn)(void *ctx, int ith, int nth);

/**
 * n_threads >= 1 (including the caller). pin: pin thread i to CPU i of the allowed set
 * (wrapping around). Thread 0 is the thread that calls td_pool_run: it is pinned to the
 * first CPU when it first runs the pool (not when the pool is made), and td_pool_free,
 * called from the first such thread, restores its affinity. Pinning that fails is
 * skipped silently.
 */
int td_pool_create(td_pool **out, int n_threads, bool pin, td_err *err);
void td_pool_free(td_pool *pool);
int td_pool_size(const td_pool *pool);
/**
 * The CPUs the pool's threads are pinned to (thread i on the i-th allowed CPU); returns
 * their count, 0 when the pool does not pin (set is then empty).
 */
int td_pool_cpus(const td_pool *pool, cpu_set_t *set);
/**
 * Move the calling thread off the CPUs in `busy` (those compute threads are pinned to), if
 * any other CPU of its allowed set is left; returns whether it moved. Threads it starts
 * afterwards inherit the new set.
 */
bool td_thread_avoid_cpus(const cpu_set_t *busy);
/**
 * Run fn on all threads; not reentrant (one run at a time, from one thread).
 * pool may be NULL: fn(ctx, 0, 1) runs on the caller.
 */
void td_pool_run(td_pool *pool, td_pool_fn fn, void *ctx);
/**
 * Inside a run: wait until every thread of the pool has reached the barrier. Every
 * thread must call it the same number of times in a run. No-op for NULL or 1 thread.
 */
void td_pool_barrier(td_pool *pool);

/** Split [0, n) into nth nearly equal contiguous parts; part ith is [*begin, *end). */
static inline void td_split_range(int64_t n, int ith, int nth, int64_t *begin, int64_t *end)
{
    int64_t per = n / nth, rem = n % nth;
    *begin = ith * per + (ith < rem ? ith : rem);
    *end = *begin + per + (ith < rem ? 1 : 0);
}

#endif
