/*
 * util/pool.h - a fork/join thread pool for the compute kernels.
 *
 * td_pool_run(pool, fn, ctx) runs fn(ctx, ith, nth) once on every thread of the
 * pool (the calling thread is thread 0) and returns when all are done. Workers
 * spin briefly between runs, because a decode step issues ~100 runs a few
 * microseconds apart, then sleep on a futex so an idle server burns no CPU.
 * Threads can be pinned to cores (one per core, in order).
 *
 * A pool can also hold guest threads, pinned to CPUs that belong to another process
 * and are borrowed only while it has nothing to run (util/cpuboard.h). Guests sleep
 * until switched on; a run sees its active threads as an ordinary pool of
 * td_pool_active() threads, numbered from 0.
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
/**
 * A pool of n_threads threads, thread i pinned to cpus[i]: threads 0..n_home-1 take part
 * in every run, the other n_threads - n_home are guests, off until td_pool_set_guests.
 */
int td_pool_create_on(td_pool **out, const int *cpus, int n_threads, int n_home, td_err *err);
/** Guest threads in the pool (0 for td_pool_create's pools). */
int td_pool_guests(const td_pool *pool);
/** The CPU guest k is pinned to. */
int td_pool_guest_cpu(const td_pool *pool, int k);
/**
 * Switch guests on or off (on[k] for guest k): from the thread that runs the pool,
 * between runs, or from the before-run hook. Which threads run does not change what a
 * run computes, as long as its function splits its work by (ith, nth).
 */
void td_pool_set_guests(td_pool *pool, const bool *on);
/**
 * Call before_run(ctx) at the start of every td_pool_run, on the running thread, before
 * the run is announced: it may switch guests (a lender wants its CPU back).
 */
void td_pool_set_hook(td_pool *pool, void (*before_run)(void *ctx), void *ctx);
/** Threads the next run uses: the home threads and the guests switched on. */
int td_pool_active(const td_pool *pool);
void td_pool_free(td_pool *pool);
/** All threads, guests included (size per-thread scratch by it). */
int td_pool_size(const td_pool *pool);
/**
 * The CPUs the pool's home threads are pinned to (thread i on the i-th allowed CPU, or
 * cpus[i]); returns their count, 0 when the pool does not pin (set is then empty).
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
 * Inside a run: wait until every thread of the run has reached the barrier. Every
 * thread must call it the same number of times in a run. No-op for NULL or a run of 1 thread.
 */
void td_pool_barrier(td_pool *pool);

/**
 * Parse a CPU list such as "0-3,8,10-11" into set (CPUs 0..CPU_SETSIZE-1, at least one,
 * ranges ascending); returns 0 or TD_EINVAL.
 */
int td_parse_cpu_list(const char *s, cpu_set_t *set);
/** Write set as a CPU list ("0-3,8") into buf (cap bytes, NUL-terminated, cut if short). */
void td_format_cpu_list(const cpu_set_t *set, char *buf, size_t cap);

/** Split [0, n) into nth nearly equal contiguous parts; part ith is [*begin, *end). */
static inline void td_split_range(int64_t n, int ith, int nth, int64_t *begin, int64_t *end)
{
    int64_t per = n / nth, rem = n % nth;
    *begin = ith * per + (ith < rem ? ith : rem);
    *end = *begin + per + (ith < rem ? 1 : 0);
}

#endif
