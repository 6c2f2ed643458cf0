/* Unit tests for util/pool.c: every thread runs once per run, many tiny runs in a row,
 * the barrier, sleeping workers waking up, pinning, guest threads switched on and off,
 * and CPU lists. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "util/pool.h"

typedef struct {
    _Atomic int hits[16];
    _Atomic int64_t sum;
    int nth_seen[16];
    int64_t n;
} count_job;

static void count_fn(void *ctx, int ith, int nth)
{
    count_job *job = ctx;
    atomic_fetch_add(&job->hits[ith], 1);
    job->nth_seen[ith] = nth;
    int64_t b, e, s = 0;
    td_split_range(job->n, ith, nth, &b, &e);
    for (int64_t i = b; i < e; i++)
        s += i;
    atomic_fetch_add(&job->sum, s);
}

static void check_runs(int n_threads, bool pin, int runs)
{
    td_pool *pool;
    td_err err;
    assert_int_equal(td_pool_create(&pool, n_threads, pin, &err), 0);
    assert_int_equal(td_pool_size(pool), n_threads);
    for (int r = 0; r < runs; r++) {
        count_job job;
        memset(&job, 0, sizeof(job));
        job.n = 1000 + r % 7;
        td_pool_run(pool, count_fn, &job);
        for (int i = 0; i < n_threads; i++) {
            if (atomic_load(&job.hits[i]) != 1)
                fail_msg("run %d: thread %d ran %d times", r, i, job.hits[i]);
            assert_int_equal(job.nth_seen[i], n_threads);
        }
        for (int i = n_threads; i < 16; i++)
            assert_int_equal(atomic_load(&job.hits[i]), 0);
        assert_true(atomic_load(&job.sum) == job.n * (job.n - 1) / 2);
    }
    td_pool_free(pool);
}

static void test_many_tiny_runs(void **state)
{
    (void)state;
    for (int n = 1; n <= 4; n++)
        check_runs(n, false, 20000 / n);
    check_runs(2, true, 2000);
    check_runs(3, true, 500); /* more threads than CPUs on small machines: must still work */
}

static void test_sleep_and_wake(void **state)
{
    (void)state;
    td_pool *pool;
    assert_int_equal(td_pool_create(&pool, 3, false, NULL), 0);
    for (int round = 0; round < 3; round++) {
        usleep(300 * 1000); /* longer than the spin: workers are asleep on the futex */
        count_job job;
        memset(&job, 0, sizeof(job));
        job.n = 10;
        td_pool_run(pool, count_fn, &job);
        for (int i = 0; i < 3; i++)
            assert_int_equal(atomic_load(&job.hits[i]), 1);
    }
    td_pool_free(pool);
}

typedef struct {
    td_pool *pool;
    _Atomic int phase_count[8];
    _Atomic int errors;
} barrier_job;

static void barrier_fn(void *ctx, int ith, int nth)
{
    barrier_job *job = ctx;
    (void)ith;
    for (int p = 0; p < 8; p++) {
        atomic_fetch_add(&job->phase_count[p], 1);
        td_pool_barrier(job->pool);
        if (atomic_load(&job->phase_count[p]) != nth) atomic_fetch_add(&job->errors, 1);
    }
}

static void check_barrier_runs(td_pool *pool, int runs)
{
    for (int r = 0; r < runs; r++) {
        barrier_job job;
        memset(&job, 0, sizeof(job));
        job.pool = pool;
        td_pool_run(pool, barrier_fn, &job);
        assert_int_equal(atomic_load(&job.errors), 0);
    }
}

static void test_barrier(void **state)
{
    (void)state;
    for (int n = 1; n <= 3; n++) {
        td_pool *pool;
        assert_int_equal(td_pool_create(&pool, n, false, NULL), 0);
        check_barrier_runs(pool, 300);
        td_pool_free(pool);
    }
}

static void test_null_pool_and_errors(void **state)
{
    (void)state;
    count_job job;
    memset(&job, 0, sizeof(job));
    job.n = 5;
    td_pool_run(NULL, count_fn, &job);
    assert_int_equal(atomic_load(&job.hits[0]), 1);
    assert_int_equal(job.nth_seen[0], 1);
    td_pool *pool = (td_pool *)1;
    td_err err;
    assert_int_equal(td_pool_create(&pool, 0, false, &err), TD_EINVAL);
    assert_null(pool);
    td_pool_free(NULL);
}

/* Pinning follows the thread that runs the pool, not the one that made it: a server makes
 * its engines on the I/O thread and steps them on an engine thread. */
typedef struct {
    td_pool *pool;
    int cpus_while_running; /* CPUs the running thread may use after its first run */
} pin_job;

static void noop_fn(void *ctx, int ith, int nth)
{
    (void)ctx, (void)ith, (void)nth;
}

static int my_cpu_count(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof(set), &set), 0);
    return CPU_COUNT(&set);
}

static void *run_elsewhere(void *arg)
{
    pin_job *j = arg;
    td_pool_run(j->pool, noop_fn, NULL);
    j->cpus_while_running = my_cpu_count();
    return NULL;
}

static void test_pins_the_running_thread(void **state)
{
    (void)state;
    int before = my_cpu_count();
    cpu_set_t orig;
    CPU_ZERO(&orig);
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof(orig), &orig), 0);
    for (int n = 1; n <= 2; n++) {
        td_pool *pool;
        assert_int_equal(td_pool_create(&pool, n, true, NULL), 0);
        assert_int_equal(my_cpu_count(), before); /* making the pool pins nothing */
        pin_job j = {pool, 0};
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, run_elsewhere, &j), 0);
        pthread_join(t, NULL);
        assert_int_equal(j.cpus_while_running, 1); /* the runner: the pool's first CPU */
        assert_int_equal(my_cpu_count(), before);  /* the maker is left as it was */
        td_pool_run(pool, noop_fn, NULL);          /* now this thread runs it: pinned */
        assert_int_equal(my_cpu_count(), 1);
        td_pool_free(pool); /* not the first runner: stays pinned until set back below */
        assert_int_equal(pthread_setaffinity_np(pthread_self(), sizeof(orig), &orig), 0);
        assert_int_equal(my_cpu_count(), before);
    }
    /* the first runner gets its affinity back at free */
    td_pool *pool;
    assert_int_equal(td_pool_create(&pool, 2, true, NULL), 0);
    td_pool_run(pool, noop_fn, NULL);
    assert_int_equal(my_cpu_count(), 1);
    td_pool_free(pool);
    assert_int_equal(my_cpu_count(), before);
}

/* Each new thread that runs the pool is pinned, though glibc gives a new thread the
 * pthread_t of one that has exited: successive threads, each started on another CPU than
 * the pool's, each end on the pool's CPU (a benchmark that steps an engine on a new thread
 * every round ran its later rounds unpinned, on whatever CPU its maker had). */
static void *run_and_report(void *arg)
{
    pin_job *j = arg;
    td_pool_run(j->pool, noop_fn, NULL);
    cpu_set_t set;
    CPU_ZERO(&set);
    pthread_getaffinity_np(pthread_self(), sizeof(set), &set);
    j->cpus_while_running = CPU_COUNT(&set) == 1 ? -1 : 0;
    for (int c = 0; c < CPU_SETSIZE && j->cpus_while_running == -1; c++)
        if (CPU_ISSET(c, &set)) j->cpus_while_running = c; /* the one CPU, by number */
    return NULL;
}

static void test_pins_each_new_runner(void **state)
{
    (void)state;
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed), 0);
    if (CPU_COUNT(&allowed) < 2) skip(); /* no other CPU to start the threads on */
    td_pool *pool;
    assert_int_equal(td_pool_create(&pool, 1, true, NULL), 0);
    cpu_set_t mine;
    assert_int_equal(td_pool_cpus(pool, &mine), 1);
    int pool_cpu = -1, other = -1;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (CPU_ISSET(c, &mine) && pool_cpu < 0) pool_cpu = c;
        else if (CPU_ISSET(c, &allowed) && other < 0) other = c;
    }
    assert_true(pool_cpu >= 0 && other >= 0);
    cpu_set_t start;
    CPU_ZERO(&start);
    CPU_SET(other, &start);
    for (int i = 0; i < 5; i++) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setaffinity_np(&attr, sizeof(start), &start);
        pin_job j = {pool, -2};
        pthread_t t;
        assert_int_equal(pthread_create(&t, &attr, run_and_report, &j), 0);
        pthread_join(t, NULL);
        pthread_attr_destroy(&attr);
        assert_int_equal(j.cpus_while_running, pool_cpu);
    }
    td_pool_free(pool);
}

/* Guests: a run sees only the active threads, numbered 0..nth-1, each once. */
typedef struct {
    td_pool *pool;
    bool on[4];
    int n_guests;
    uint32_t rng;
    int toggles;
} guest_hook;

static void toggle_hook(void *ctx)
{
    guest_hook *h = ctx;
    h->rng = h->rng * 1664525u + 1013904223u;
    if ((h->rng >> 28) < 6) return; /* most runs keep the set */
    int k = (int)(h->rng >> 8) % h->n_guests;
    h->on[k] = !h->on[k];
    h->toggles++;
    td_pool_set_guests(h->pool, h->on);
}

static int allowed_cpus(int *cpus, int n)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    assert_int_equal(sched_getaffinity(0, sizeof(set), &set), 0);
    int k = 0, all[CPU_SETSIZE];
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) all[k++] = c;
    for (int i = 0; i < n; i++)
        cpus[i] = all[i % k]; /* wraps: shares CPUs when few */
    return k;
}

static void check_active_run(td_pool *pool, int expect_nth, int r)
{
    count_job job;
    memset(&job, 0, sizeof(job));
    job.n = 777 + r % 5;
    for (int i = 0; i < 16; i++)
        job.nth_seen[i] = -1;
    td_pool_run(pool, count_fn, &job);
    int nth = td_pool_active(pool);
    if (expect_nth > 0) assert_int_equal(nth, expect_nth);
    for (int i = 0; i < 16; i++) {
        int want = i < nth ? 1 : 0;
        if (atomic_load(&job.hits[i]) != want)
            fail_msg("run %d (%d active): rank %d ran %d times", r, nth, i, job.hits[i]);
        if (want) assert_int_equal(job.nth_seen[i], nth);
    }
    assert_true(atomic_load(&job.sum) == job.n * (job.n - 1) / 2);
}

static void test_guests(void **state)
{
    (void)state;
    int cpus[5];
    allowed_cpus(cpus, 5);
    td_pool *pool;
    td_err err;
    assert_int_equal(td_pool_create_on(&pool, cpus, 5, 2, &err), 0);
    assert_int_equal(td_pool_size(pool), 5);
    assert_int_equal(td_pool_guests(pool), 3);
    assert_int_equal(td_pool_guest_cpu(pool, 0), cpus[2]);
    cpu_set_t home;
    assert_int_equal(td_pool_cpus(pool, &home) > 0, true); /* the home threads' CPUs only */
    assert_true(CPU_ISSET(cpus[0], &home) && CPU_ISSET(cpus[1], &home));
    /* guests start off */
    for (int r = 0; r < 200; r++)
        check_active_run(pool, 2, r);
    bool on[3] = {false, true, true};
    td_pool_set_guests(pool, on);
    for (int r = 0; r < 200; r++)
        check_active_run(pool, 4, r);
    /* off, then on again after they went to sleep */
    bool off[3] = {false, false, false};
    td_pool_set_guests(pool, off);
    check_active_run(pool, 2, 0);
    usleep(300 * 1000);
    bool all[3] = {true, true, true};
    td_pool_set_guests(pool, all);
    check_active_run(pool, 5, 0);
    /* on and off again with no run between */
    td_pool_set_guests(pool, off);
    td_pool_set_guests(pool, all);
    td_pool_set_guests(pool, on);
    for (int r = 0; r < 50; r++)
        check_active_run(pool, 4, r);
    /* switched from the before-run hook, at random, over many tiny runs */
    guest_hook h = {.pool = pool, .n_guests = 3, .rng = 12345};
    memcpy(h.on, on, sizeof(on));
    td_pool_set_hook(pool, toggle_hook, &h);
    for (int r = 0; r < 20000; r++)
        check_active_run(pool, 0, r);
    assert_true(h.toggles > 1000);
    check_barrier_runs(pool, 300); /* the barrier counts the active threads */
    td_pool_free(pool); /* sleeping and spinning guests alike must stop */

    assert_int_equal(td_pool_create_on(&pool, cpus, 2, 0, &err), TD_EINVAL);
    assert_int_equal(td_pool_create_on(&pool, cpus, 2, 3, &err), TD_EINVAL);
    int bad[2] = {0, -1};
    assert_int_equal(td_pool_create_on(&pool, bad, 2, 1, &err), TD_EINVAL);
    assert_null(pool);
}

static void test_cpu_list(void **state)
{
    (void)state;
    cpu_set_t s;
    assert_int_equal(td_parse_cpu_list("0-3,8,10-11", &s), 0);
    assert_int_equal(CPU_COUNT(&s), 7);
    assert_true(CPU_ISSET(3, &s) && CPU_ISSET(8, &s) && CPU_ISSET(11, &s) && !CPU_ISSET(9, &s));
    assert_int_equal(td_parse_cpu_list("5", &s), 0);
    assert_int_equal(CPU_COUNT(&s), 1);
    const char *bad[] = {"", "a", "1-", "-1", "3-1", "1,,2", "1,", "0-99999", "1 2", "2-x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        if (td_parse_cpu_list(bad[i], &s) != TD_EINVAL) fail_msg("accepted '%s'", bad[i]);
    assert_int_equal(td_parse_cpu_list(NULL, &s), TD_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_tiny_runs),
        cmocka_unit_test(test_sleep_and_wake),
        cmocka_unit_test(test_barrier),
        cmocka_unit_test(test_null_pool_and_errors),
        cmocka_unit_test(test_pins_the_running_thread),
        cmocka_unit_test(test_pins_each_new_runner),
        cmocka_unit_test(test_guests),
        cmocka_unit_test(test_cpu_list),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
