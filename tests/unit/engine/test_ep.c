/*
 * The expert-parallel group (engine/ep.c) with real threads: the expert split, rounds
 * that every rank joins when one asks, the exchange barrier (each rank sees the others'
 * writes from before it), and a broken group ending every wait.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "engine/ep.h"

#define N 3

static void test_create_and_split(void **state)
{
    (void)state;
    td_ep_group *g = NULL;
    td_err err = {0};
    assert_int_equal(td_ep_group_create(&g, 1, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "2 to 64 ranks, not 1"));
    assert_int_equal(td_ep_group_create(&g, 65, &err), TD_EINVAL);
    assert_int_equal(td_ep_group_create(&g, N, &err), 0);
    assert_int_equal(td_ep_size(g), N);
    /* 8 experts over 3 ranks: [0, 2), [2, 5), [5, 8): contiguous, covering, disjoint */
    int want[N][2] = {{0, 2}, {2, 5}, {5, 8}}, lo, hi;
    for (int r = 0; r < N; r++) {
        td_ep_experts(g, r, 8, &lo, &hi);
        assert_int_equal(lo, want[r][0]);
        assert_int_equal(hi, want[r][1]);
    }
    td_ep_experts(g, 0, 2, &lo, &hi); /* fewer experts than ranks: some hold none */
    assert_int_equal(hi - lo, 0);
    td_ep_group_free(g);
}

/* ---- rounds: rank 0 has work for ROUNDS rounds; the others only join when asked ---- */

#define ROUNDS 200

typedef struct loop {
    td_ep_group *g;
    int rank;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool kicked;
    int steps, empty;
} loop;

static void wake(void *user)
{
    loop *l = user;
    pthread_mutex_lock(&l->mu);
    l->kicked = true;
    pthread_cond_signal(&l->cv);
    pthread_mutex_unlock(&l->mu);
}

static void *round_main(void *arg)
{
    loop *l = arg;
    int left = l->rank == 0 ? ROUNDS : 0;
    for (;;) {
        bool mine = left > 0;
        if (mine) {
            td_ep_request(l->g, l->rank);
        } else {
            /* idle: wait until asked (or until the group breaks, which ends the test) */
            pthread_mutex_lock(&l->mu);
            while (!l->kicked && !td_ep_requested(l->g) && !td_ep_broken(l->g, NULL, 0))
                pthread_cond_wait(&l->cv, &l->mu);
            l->kicked = false;
            pthread_mutex_unlock(&l->mu);
            if (td_ep_broken(l->g, NULL, 0)) return NULL;
            if (!td_ep_requested(l->g)) continue; /* a stale wake: back to sleep */
        }
        int rc = td_ep_join(l->g, l->rank, mine);
        if (rc < 0) return NULL;
        if (rc == 1) l->steps++;
        else l->empty++;
        if (mine && --left == 0) td_ep_break(l->g, l->rank, "done"); /* ends the others */
    }
}

static void test_rounds(void **state)
{
    (void)state;
    td_ep_group *g = NULL;
    td_err err = {0};
    assert_int_equal(td_ep_group_create(&g, N, &err), 0);
    loop l[N];
    pthread_t th[N];
    for (int r = 0; r < N; r++) {
        memset(&l[r], 0, sizeof(l[r]));
        l[r].g = g;
        l[r].rank = r;
        pthread_mutex_init(&l[r].mu, NULL);
        pthread_cond_init(&l[r].cv, NULL);
        td_ep_set_wake(g, r, wake, &l[r]);
    }
    for (int r = 0; r < N; r++) pthread_create(&th[r], NULL, round_main, &l[r]);
    for (int r = 0; r < N; r++) pthread_join(th[r], NULL);
    /* every rank stepped in every round rank 0 asked for, and in no other */
    for (int r = 0; r < N; r++) {
        assert_int_equal(l[r].steps, ROUNDS);
        assert_int_equal(l[r].empty, 0);
    }
    char why[256];
    assert_true(td_ep_broken(g, why, sizeof(why)));
    assert_non_null(strstr(why, "expert-parallel rank 0 stopped (done)"));
    assert_int_equal(td_ep_join(g, 1, true), -1);
    td_ep_group_free(g);
}

/* ---- the exchange barrier ---- */

#define ITERS 2000

typedef struct bar {
    td_ep_group *g;
    int rank;
    int *slots; /* [N] */
    int bad, rc;
} bar;

static void *barrier_main(void *arg)
{
    bar *b = arg;
    for (int it = 1; it <= ITERS; it++) {
        b->slots[b->rank] = it * 10 + b->rank; /* plain writes, published by the barrier */
        if (ep__barrier(b->g)) {
            b->rc = -1;
            return NULL;
        }
        for (int r = 0; r < N; r++) b->bad += b->slots[r] != it * 10 + r;
        if (ep__barrier(b->g)) { /* nobody writes the next value before all have read */
            b->rc = -1;
            return NULL;
        }
    }
    return NULL;
}

static void test_barrier(void **state)
{
    (void)state;
    td_ep_group *g = NULL;
    td_err err = {0};
    assert_int_equal(td_ep_group_create(&g, N, &err), 0);
    int slots[N] = {0};
    bar b[N];
    pthread_t th[N];
    for (int r = 0; r < N; r++) {
        b[r] = (bar){.g = g, .rank = r, .slots = slots};
        pthread_create(&th[r], NULL, barrier_main, &b[r]);
    }
    for (int r = 0; r < N; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < N; r++) {
        assert_int_equal(b[r].rc, 0);
        assert_int_equal(b[r].bad, 0);
    }
    td_ep_group_free(g);
}

static void *wait_once(void *arg)
{
    bar *b = arg;
    b->rc = ep__barrier(b->g);
    return NULL;
}

static void test_break_ends_waits(void **state)
{
    (void)state;
    td_ep_group *g = NULL;
    td_err err = {0};
    assert_int_equal(td_ep_group_create(&g, N, &err), 0);
    bar b[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) { /* two of three ranks wait for the third, which stops */
        b[i] = (bar){.g = g, .rank = i, .rc = 1};
        pthread_create(&th[i], NULL, wait_once, &b[i]);
    }
    td_ep_break(g, 2, "shutting down");
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(b[i].rc, -1);
    }
    assert_int_equal(ep__barrier(g), -1);
    char why[256];
    assert_true(td_ep_broken(g, why, sizeof(why)));
    assert_non_null(strstr(why, "rank 2 stopped (shutting down)"));
    td_ep_group_free(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_and_split),
        cmocka_unit_test(test_rounds),
        cmocka_unit_test(test_barrier),
        cmocka_unit_test(test_break_ends_waits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
