/*
 * util/pool.c - the fork/join pool behind td_pool_run.
 *
 * A run is announced by bumping a generation counter. Workers spin on it for a
 * short while after each run (a decode step issues ~100 runs a few microseconds
 * apart, and waking a sleeping vCPU costs ~60 us in this VM), then sleep on a
 * futex keyed on the same counter. The caller is thread 0: it bumps the counter,
 * wakes sleepers only if some thread announced that it sleeps, runs its own share
 * and then spins until the workers have counted themselves done.
 *
 * The sleep handshake is Dekker-style and uses sequentially consistent atomics on
 * both sides: a worker increments n_sleeping and then re-reads the generation;
 * the caller bumps the generation and then reads n_sleeping. One of the two must
 * see the other's write, so a run is never missed, and the common case (all
 * workers spinning) costs no system call.
 *
 * Guest threads (td_pool_create_on) are pinned to CPUs that another process owns and
 * lends while it is idle. An inactive one sleeps on a second futex word (act_word), so
 * the runs it sits out neither wake it nor cost the caller a system call. The caller
 * switches guests on and off between runs (td_pool_set_guests, usually from the
 * before-run hook); the active threads are numbered 0..n_active-1 for each run, so the
 * kernels see an ordinary pool of n_active threads. A guest switched on joins the first
 * run whose generation is past join_gen, the generation when it was switched on.
 */
#include "util/pool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

/* How long a worker spins after a run before it goes to sleep. */
#define POOL_SPIN_NS 200000ull
/* Pause instructions between two reads of the clock while spinning. */
#define POOL_SPIN_BATCH 64

typedef struct pool_worker {
    td_pool *pool;
    pthread_t thread;
    int ith;
    bool started;
    /* Set by the caller between runs, read by this worker after it sees a run. */
    _Atomic bool on;   /* takes part in runs */
    _Atomic int rank;  /* its ith in the runs it takes part in */
    uint32_t join_gen; /* the generation when it was last switched on */
} pool_worker;

struct td_pool {
    /* Written by the caller once per run, read by every worker: one cache line. */
    _Alignas(64) _Atomic uint32_t gen; /* the futex word */
    td_pool_fn fn;
    void *ctx;
    _Atomic bool stop;
    _Atomic int n_active; /* threads taking part in runs (thread 0 always does) */

    /* Inactive guests sleep on this word; bumped when one is switched on, and at the end. */
    _Alignas(64) _Atomic uint32_t act_word;

    /* Written by workers. */
    _Alignas(64) _Atomic int n_done;
    _Alignas(64) _Atomic int n_sleeping;
    /* td_pool_barrier: arrival count and a sense flag that flips per barrier. */
    _Alignas(64) _Atomic int bar_count;
    _Atomic uint32_t bar_sense;

    _Alignas(64) int n_threads;
    int n_home;          /* threads 0..n_home-1 always take part; the rest are guests */
    bool oversubscribed; /* more threads than allowed CPUs: yield instead of pausing */
    bool pin;            /* pin thread i to CPU cpu_of[i] */
    int *cpu_of;         /* n_threads CPUs (pin) */
    cpu_set_t allowed;         /* the creating thread's allowed CPUs */
    void (*before_run)(void *); /* td_pool_set_hook */
    void *hook_ctx;
    bool caller_pinned;        /* a thread that ran the pool was pinned (thread 0) */
    pthread_t first_runner;    /* the first one, whose old affinity td_pool_free restores */
    cpu_set_t caller_affinity; /* first_runner's affinity before pinning */
    uint64_t id;               /* unique per pool (pin_runner) */
    pool_worker *workers;      /* n_threads - 1 of them; thread 0 is the caller */
};

static _Atomic uint64_t pool_ids;          /* the last id given (pin_runner) */
static _Thread_local uint64_t pinned_for; /* the id of the pool this thread is pinned for */

static long futex(_Atomic uint32_t *addr, int op, uint32_t val)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

/* The i-th CPU of the process's allowed set (wrapping around), or -1. */
static int allowed_cpu(const cpu_set_t *set, int i)
{
    int count = CPU_COUNT(set);
    if (count <= 0) return -1;
    i %= count;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, set) && i-- == 0) return cpu;
    return -1;
}

static void pin_self(int cpu, int ith)
{
    if (cpu < 0) return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    int rc = pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
    if (rc != 0) TD_DEBUG("pool: pinning thread %d to cpu %d failed: %s", ith, cpu, strerror(rc));
}

typedef struct {
    pool_worker *w;
    int cpu; /* -1: not pinned */
} worker_start;

/* Wait until the generation differs from `seen`, or (returning `seen`) until this
 * worker is switched off; spin first, then sleep. */
static uint32_t wait_for_run(td_pool *pool, pool_worker *w, uint32_t seen)
{
    uint64_t spin_start = 0;
    for (;;) {
        for (int i = 0; i < POOL_SPIN_BATCH; i++) {
            uint32_t g = atomic_load_explicit(&pool->gen, memory_order_acquire);
            if (g != seen) return g;
            if (!atomic_load_explicit(&w->on, memory_order_relaxed)) return seen;
            if (pool->oversubscribed)
                sched_yield();
            else
                cpu_relax();
        }
        uint64_t now = td_now_ns();
        if (spin_start == 0) {
            spin_start = now;
        } else if (now - spin_start > POOL_SPIN_NS) {
            atomic_fetch_add(&pool->n_sleeping, 1);
            if (atomic_load(&pool->gen) == seen) futex(&pool->gen, FUTEX_WAIT_PRIVATE, seen);
            atomic_fetch_sub(&pool->n_sleeping, 1);
            spin_start = 0;
        }
    }
}

static void *worker_main(void *arg)
{
    worker_start *start = arg;
    pool_worker *w = start->w;
    td_pool *pool = w->pool;
    pin_self(start->cpu, w->ith);
    free(start);

    uint32_t seen = 0; /* the generation at creation */
    for (;;) {
        if (!atomic_load_explicit(&w->on, memory_order_acquire)) {
            /* A guest switched off: sleep until switched on (or the end). */
            uint32_t a = atomic_load(&pool->act_word);
            if (atomic_load(&pool->stop)) break;
            if (!atomic_load(&w->on)) {
                futex(&pool->act_word, FUTEX_WAIT_PRIVATE, a);
                continue;
            }
            seen = w->join_gen; /* written before `on` (release) */
        }
        uint32_t g = wait_for_run(pool, w, seen);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) break;
        if (g == seen) continue; /* switched off while waiting */
        seen = g;
        /* Switched off before this run was announced (the caller stores `on` first). */
        if (!atomic_load_explicit(&w->on, memory_order_acquire)) continue;
        /* Switched off and on again since it last looked: only runs after join_gen
         * count it (an earlier one has ended, or runs without it). */
        if ((int32_t)(g - w->join_gen) <= 0) {
            seen = w->join_gen;
            continue;
        }
        pool->fn(pool->ctx, atomic_load_explicit(&w->rank, memory_order_relaxed),
                 atomic_load_explicit(&pool->n_active, memory_order_relaxed));
        atomic_fetch_add_explicit(&pool->n_done, 1, memory_order_release);
    }
    return NULL;
}

/* cpus: n_threads CPUs to pin to, or NULL (pin: the allowed set in order, wrapping). */
static int pool_create(td_pool **out, int n_threads, int n_home, bool pin, const int *cpus,
                       td_err *err)
{
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return td_err_set(err, TD_EINVAL, "thread pool: bad thread count %d", n_threads);
    td_pool *pool = td_aligned_alloc(sizeof(*pool));
    if (!pool) return td_err_set(err, TD_ENOMEM, "thread pool: out of memory");
    pool->n_threads = n_threads;
    pool->n_home = n_home;
    atomic_store(&pool->n_active, n_home);
    pool->id = atomic_fetch_add(&pool_ids, 1) + 1;

    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
        pin = pin && cpus;
        pool->oversubscribed = n_threads > (int)sysconf(_SC_NPROCESSORS_ONLN);
    } else {
        pool->oversubscribed = n_threads > CPU_COUNT(&allowed);
    }
    pool->pin = pin;
    pool->allowed = allowed;
    pool->cpu_of = td_xcalloc((size_t)n_threads, sizeof(int));
    cpu_set_t used;
    CPU_ZERO(&used);
    for (int i = 0; i < n_threads; i++) {
        pool->cpu_of[i] = !pin ? -1 : cpus ? cpus[i] : allowed_cpu(&allowed, i);
        if (pool->cpu_of[i] >= 0 && pool->cpu_of[i] < CPU_SETSIZE) {
            if (CPU_ISSET(pool->cpu_of[i], &used)) pool->oversubscribed = true;
            CPU_SET(pool->cpu_of[i], &used);
        }
    }

    pool->workers = n_threads > 1 ? td_xcalloc((size_t)n_threads - 1, sizeof(pool_worker)) : NULL;
    for (int i = 1; i < n_threads; i++) {
        pool_worker *w = &pool->workers[i - 1];
        w->pool = pool;
        w->ith = i;
        atomic_store(&w->on, i < n_home);
        atomic_store(&w->rank, i);
        worker_start *start = td_xmalloc(sizeof(*start));
        start->w = w;
        start->cpu = pool->cpu_of[i];
        int rc = pthread_create(&w->thread, NULL, worker_main, start);
        if (rc != 0) {
            free(start);
            td_pool_free(pool);
            return td_err_set(err, TD_ENOMEM, "thread pool: cannot start thread %d: %s", i,
                              strerror(rc));
        }
        w->started = true;
    }
    *out = pool;
    return 0;
}

int td_pool_create(td_pool **out, int n_threads, bool pin, td_err *err)
{
    return pool_create(out, n_threads, n_threads, pin, NULL, err);
}

int td_pool_create_on(td_pool **out, const int *cpus, int n_threads, int n_home, td_err *err)
{
    *out = NULL;
    if (n_home < 1 || n_home > n_threads)
        return td_err_set(err, TD_EINVAL, "thread pool: bad home thread count %d of %d", n_home,
                          n_threads);
    for (int i = 0; i < n_threads && n_threads <= 1024; i++)
        if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE)
            return td_err_set(err, TD_EINVAL, "thread pool: bad CPU %d", cpus[i]);
    return pool_create(out, n_threads, n_home, true, cpus, err);
}

void td_pool_set_hook(td_pool *pool, void (*before_run)(void *ctx), void *ctx)
{
    pool->before_run = before_run;
    pool->hook_ctx = ctx;
}

int td_pool_guests(const td_pool *pool)
{
    return pool ? pool->n_threads - pool->n_home : 0;
}

int td_pool_guest_cpu(const td_pool *pool, int k)
{
    return pool->pin ? pool->cpu_of[pool->n_home + k] : -1;
}

int td_pool_active(const td_pool *pool)
{
    return pool ? atomic_load_explicit(&pool->n_active, memory_order_relaxed) : 1;
}

void td_pool_set_guests(td_pool *pool, const bool *on)
{
    uint32_t g = atomic_load_explicit(&pool->gen, memory_order_relaxed); /* ours to write */
    int rank = pool->n_home;
    bool woke = false;
    for (int i = pool->n_home; i < pool->n_threads; i++) {
        pool_worker *w = &pool->workers[i - 1];
        bool was = atomic_load_explicit(&w->on, memory_order_relaxed);
        bool now = on[i - pool->n_home];
        if (now) atomic_store_explicit(&w->rank, rank++, memory_order_relaxed);
        if (now && !was) {
            w->join_gen = g;
            woke = true;
        }
        if (now != was) atomic_store_explicit(&w->on, now, memory_order_release);
    }
    atomic_store_explicit(&pool->n_active, rank, memory_order_relaxed);
    if (woke) {
        atomic_fetch_add(&pool->act_word, 1);
        futex(&pool->act_word, FUTEX_WAKE_PRIVATE, INT_MAX);
    }
}

void td_pool_free(td_pool *pool)
{
    if (!pool) return;
    atomic_store(&pool->stop, true);
    atomic_fetch_add(&pool->gen, 1);
    futex(&pool->gen, FUTEX_WAKE_PRIVATE, INT_MAX);
    atomic_fetch_add(&pool->act_word, 1);
    futex(&pool->act_word, FUTEX_WAKE_PRIVATE, INT_MAX);
    for (int i = 1; i < pool->n_threads; i++)
        if (pool->workers[i - 1].started) pthread_join(pool->workers[i - 1].thread, NULL);
    if (pool->caller_pinned && pthread_equal(pool->first_runner, pthread_self()))
        pthread_setaffinity_np(pthread_self(), sizeof(pool->caller_affinity),
                               &pool->caller_affinity);
    free(pool->workers);
    free(pool->cpu_of);
    td_aligned_free(pool);
}

int td_pool_size(const td_pool *pool)
{
    return pool ? pool->n_threads : 1;
}

int td_pool_cpus(const td_pool *pool, cpu_set_t *set)
{
    CPU_ZERO(set);
    if (!pool || !pool->pin) return 0;
    for (int i = 0; i < pool->n_home; i++)
        if (pool->cpu_of[i] >= 0) CPU_SET(pool->cpu_of[i], set);
    return CPU_COUNT(set);
}

bool td_thread_avoid_cpus(const cpu_set_t *busy)
{
    cpu_set_t mine;
    if (pthread_getaffinity_np(pthread_self(), sizeof(mine), &mine) != 0) return false;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, busy)) CPU_CLR(c, &mine);
    return CPU_COUNT(&mine) > 0 && pthread_setaffinity_np(pthread_self(), sizeof(mine), &mine) == 0;
}

/*
 * Thread 0 is whichever thread runs the pool, and it is pinned when it first does: the
 * thread that created the pool (a server's I/O thread, say) may never run it, and must
 * not be left sharing the first CPU with the one that does. Which pool a thread was last
 * pinned for is thread-local, by the pool's id: a pthread_t is no test, since glibc hands
 * a new thread the descriptor (and so the pthread_t) of one that has exited, and a thread
 * taking over from an exited runner would then run unpinned.
 */
static void pin_runner(td_pool *pool)
{
    pthread_t self = pthread_self();
    if (pinned_for == pool->id) return;
    pinned_for = pool->id;
    cpu_set_t mine;
    if (pthread_getaffinity_np(self, sizeof(mine), &mine) != 0) return;
    if (!pool->caller_pinned) {
        pool->caller_affinity = mine;
        pool->first_runner = self;
    }
    pool->caller_pinned = true;
    pin_self(pool->cpu_of[0], 0);
}

void td_pool_run(td_pool *pool, td_pool_fn fn, void *ctx)
{
    if (pool && pool->pin) pin_runner(pool);
    if (pool && pool->before_run) pool->before_run(pool->hook_ctx);
    int n_active = pool ? atomic_load_explicit(&pool->n_active, memory_order_relaxed) : 1;
    if (n_active == 1) {
        fn(ctx, 0, 1);
        return;
    }
    int n_workers = n_active - 1;
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->n_done, 0, memory_order_relaxed);
    atomic_fetch_add(&pool->gen, 1); /* seq_cst: publishes fn/ctx, pairs with n_sleeping */
    if (atomic_load(&pool->n_sleeping) > 0) futex(&pool->gen, FUTEX_WAKE_PRIVATE, INT_MAX);

    fn(ctx, 0, n_active);

    while (atomic_load_explicit(&pool->n_done, memory_order_acquire) != n_workers) {
        if (pool->oversubscribed)
            sched_yield();
        else
            cpu_relax();
    }
}

void td_pool_barrier(td_pool *pool)
{
    int n_active = pool ? atomic_load_explicit(&pool->n_active, memory_order_relaxed) : 1;
    if (n_active == 1) return;
    uint32_t sense = atomic_load_explicit(&pool->bar_sense, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool->bar_count, 1, memory_order_acq_rel) == n_active - 1) {
        atomic_store_explicit(&pool->bar_count, 0, memory_order_relaxed);
        atomic_store_explicit(&pool->bar_sense, sense + 1, memory_order_release);
        return;
    }
    while (atomic_load_explicit(&pool->bar_sense, memory_order_acquire) == sense) {
        if (pool->oversubscribed)
            sched_yield();
        else
            cpu_relax();
    }
}

int td_parse_cpu_list(const char *s, cpu_set_t *set)
{
    CPU_ZERO(set);
    if (!s || !*s) return TD_EINVAL;
    const char *p = s;
    for (;;) {
        if (*p < '0' || *p > '9') return TD_EINVAL;
        char *end;
        long a = strtol(p, &end, 10), b = a;
        p = end;
        if (*p == '-') {
            p++;
            if (*p < '0' || *p > '9') return TD_EINVAL;
            b = strtol(p, &end, 10);
            p = end;
        }
        if (a < 0 || b < a || b >= CPU_SETSIZE) return TD_EINVAL;
        for (long c = a; c <= b; c++)
            CPU_SET((int)c, set);
        if (*p == 0) break;
        if (*p++ != ',') return TD_EINVAL;
    }
    return CPU_COUNT(set) > 0 ? 0 : TD_EINVAL;
}

void td_format_cpu_list(const cpu_set_t *set, char *buf, size_t cap)
{
    size_t len = 0;
    if (cap) buf[0] = 0;
    for (int c = 0; c < CPU_SETSIZE && len + 1 < cap; c++) {
        if (!CPU_ISSET(c, set)) continue;
        int d = c;
        while (d + 1 < CPU_SETSIZE && CPU_ISSET(d + 1, set))
            d++;
        int w = d > c ? snprintf(buf + len, cap - len, "%s%d-%d", len ? "," : "", c, d)
                      : snprintf(buf + len, cap - len, "%s%d", len ? "," : "", c);
        if (w < 0 || (size_t)w >= cap - len) break; /* cut: keep what fitted */
        len += (size_t)w;
        c = d;
    }
}
