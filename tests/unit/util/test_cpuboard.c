/* Unit tests for util/cpuboard.c: two real processes share a board file. The owner lends
 * its CPU while idle and gets it back when it turns busy; a borrower that dies holding a
 * CPU does not keep it; the engines of one process exclude each other as processes do; a
 * file that is not a board is refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util/cpuboard.h"

static char board_path[64];

static int setup(void **state)
{
    (void)state;
    snprintf(board_path, sizeof(board_path), "/tmp/td-cpuboard-test-%d", (int)getpid());
    unlink(board_path);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    unlink(board_path);
    return 0;
}

static cpu_set_t one_cpu(int c)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(c, &s);
    return s;
}

static void send_byte(int fd, char c)
{
    assert_int_equal(write(fd, &c, 1), 1);
}

static char recv_byte(int fd)
{
    char c = 0;
    assert_int_equal(read(fd, &c, 1), 1);
    return c;
}

/*
 * The child owns CPU 7 and the parent borrows it. Steps (the pipes keep them in order):
 * busy owner: no borrowing; idle owner: borrowed; the owner turns busy: it waits until the
 * parent, seeing it wanted, gives it back.
 */
static void test_lend_and_reclaim(void **state)
{
    (void)state;
    int to_child[2], to_parent[2];
    assert_int_equal(pipe(to_child), 0);
    assert_int_equal(pipe(to_parent), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        cpu_set_t home = one_cpu(7);
        td_cpuboard *b;
        td_err err;
        if (td_cpuboard_open(&b, board_path, &home, &err)) _exit(10);
        td_cpuboard_set_busy(b, true);
        send_byte(to_parent[1], 'B'); /* busy */
        recv_byte(to_child[0]);
        td_cpuboard_set_busy(b, false);
        send_byte(to_parent[1], 'I'); /* idle */
        recv_byte(to_child[0]);       /* the parent holds the CPU now */
        uint64_t t0 = td_now_ns();
        uint64_t waited = td_cpuboard_set_busy(b, true); /* until the parent gives it back */
        uint64_t took = td_now_ns() - t0;
        send_byte(to_parent[1], 'R');
        /* the parent gives it back 50 ms after it sees the owner busy */
        if (waited < 30000000ull || took < 30000000ull || took >= TD_CPUBOARD_WAIT_NS) _exit(11);
        td_cpuboard_close(b);
        _exit(0);
    }
    cpu_set_t mine = one_cpu(3);
    td_cpuboard *b;
    td_err err;
    assert_int_equal(recv_byte(to_parent[0]), 'B');
    assert_int_equal(td_cpuboard_open(&b, board_path, &mine, &err), 0);
    assert_false(td_cpuboard_borrow(b, 7)); /* its owner is busy */
    assert_false(td_cpuboard_borrow(b, 3)); /* one's own CPU is never borrowed */
    send_byte(to_child[1], 'g');
    assert_int_equal(recv_byte(to_parent[0]), 'I');
    assert_true(td_cpuboard_borrow(b, 7));
    assert_false(td_cpuboard_wanted(b, 7));
    send_byte(to_child[1], 'g');
    while (!td_cpuboard_wanted(b, 7))
        usleep(1000); /* the owner wants it back */
    usleep(50 * 1000);
    td_cpuboard_give_back(b, 7);
    assert_int_equal(recv_byte(to_parent[0]), 'R');
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    /* the owner closed: the CPU is unowned and idle, so free to borrow */
    assert_true(td_cpuboard_borrow(b, 7));
    td_cpuboard_close(b);
    close(to_child[0]), close(to_child[1]), close(to_parent[0]), close(to_parent[1]);
}

/* Open the board as the owner of CPU `own`, then fork a process that borrows it and then
 * waits to be killed; returns the child's pid once it holds the CPU. */
static pid_t own_and_lend(int own, td_cpuboard **b)
{
    cpu_set_t home = one_cpu(own);
    td_err err;
    assert_int_equal(td_cpuboard_open(b, board_path, &home, &err), 0);
    int p[2];
    assert_int_equal(pipe(p), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        cpu_set_t other = one_cpu(own + 1);
        td_cpuboard *c;
        if (td_cpuboard_open(&c, board_path, &other, &err) || !td_cpuboard_borrow(c, own))
            _exit(10);
        send_byte(p[1], 'H');
        pause(); /* killed holding the CPU */
        _exit(0);
    }
    assert_int_equal(recv_byte(p[0]), 'H');
    close(p[0]), close(p[1]);
    return pid;
}

/* A borrower killed while it holds the CPU: the owner turning busy finds it gone and does
 * not wait out the bound. */
static void test_dead_borrower(void **state)
{
    (void)state;
    td_cpuboard *b;
    pid_t pid = own_and_lend(5, &b);
    kill(pid, SIGKILL);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    uint64_t t0 = td_now_ns();
    td_cpuboard_set_busy(b, true);
    assert_true(td_now_ns() - t0 < TD_CPUBOARD_WAIT_NS / 2);
    td_cpuboard_close(b);
}

/* Two live processes may not both call a CPU home on one board; a dead owner's CPU may be
 * taken again. */
static void test_home_taken(void **state)
{
    (void)state;
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    pid_t pid = fork();
    if (pid == 0) {
        td_cpuboard *c;
        td_err e;
        cpu_set_t h = one_cpu(3);
        if (td_cpuboard_open(&c, board_path, &h, &e)) _exit(1);
        send_byte(up[1], 'o');
        recv_byte(down[0]);
        _exit(0); /* without closing: as a killed engine leaves it */
    }
    assert_int_equal(recv_byte(up[0]), 'o');
    td_cpuboard *b;
    td_err err;
    cpu_set_t h = one_cpu(3);
    assert_int_equal(td_cpuboard_open(&b, board_path, &h, &err), TD_EINVAL);
    assert_non_null(strstr(err.msg, "CPU 3 is already the home of pid"));
    cpu_set_t other = one_cpu(4);
    assert_int_equal(td_cpuboard_open(&b, board_path, &other, &err), 0); /* another CPU: fine */
    td_cpuboard_close(b);
    send_byte(down[1], 'x');
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_int_equal(td_cpuboard_open(&b, board_path, &h, &err), 0); /* its owner is gone */
    td_cpuboard_close(b);
}

/* A borrower that never gives the CPU back (alive, but stuck): the owner runs anyway
 * after the bound. */
static void test_wait_is_bounded(void **state)
{
    (void)state;
    td_cpuboard *b;
    pid_t pid = own_and_lend(9, &b);
    uint64_t waited = td_cpuboard_set_busy(b, true);
    assert_true(waited >= TD_CPUBOARD_WAIT_NS);
    assert_true(waited < 3 * TD_CPUBOARD_WAIT_NS);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    td_cpuboard_close(b);
}

/*
 * Three engines of one process (data-parallel ranks), each its own open of the board: only
 * one may borrow an idle rank's CPU, an owner waits for a guest of its own process, and a
 * rank may not take another rank's home CPU. (By pid alone, two ranks held CPU 2 together,
 * and the owner ran beside its guest at once.)
 */
static void test_ranks_of_one_process(void **state)
{
    (void)state;
    cpu_set_t h0 = one_cpu(0), h1 = one_cpu(1), h2 = one_cpu(2);
    td_cpuboard *r0, *r1, *r2, *dup = (td_cpuboard *)1;
    td_err err;
    assert_int_equal(td_cpuboard_open(&r0, board_path, &h0, &err), 0);
    assert_int_equal(td_cpuboard_open(&r1, board_path, &h1, &err), 0);
    assert_int_equal(td_cpuboard_open(&r2, board_path, &h2, &err), 0);
    assert_int_equal(td_cpuboard_open(&dup, board_path, &h1, &err), TD_EINVAL);
    assert_null(dup);
    assert_non_null(strstr(err.msg, "CPU 1 is already the home of pid"));
    assert_non_null(strstr(err.msg, "this process"));

    assert_true(td_cpuboard_borrow(r0, 2));
    assert_false(td_cpuboard_borrow(r1, 2));          /* r0 holds it */
    assert_true(td_cpuboard_borrow(r0, 2));           /* already its own */
    uint64_t waited = td_cpuboard_set_busy(r2, true); /* r0 never gives it back */
    assert_true(waited >= TD_CPUBOARD_WAIT_NS);
    td_cpuboard_set_busy(r2, false);
    td_cpuboard_give_back(r0, 2);
    assert_true(td_cpuboard_borrow(r1, 2)); /* free again */
    td_cpuboard_close(r1);                  /* gives it back */
    assert_true(td_cpuboard_borrow(r0, 2));
    td_cpuboard_close(r0);
    td_cpuboard_close(r2);
    assert_int_equal(td_cpuboard_open(&r1, board_path, &h2, &err), 0); /* a closed owner's CPU */
    td_cpuboard_close(r1);
}

static void test_not_a_board(void **state)
{
    (void)state;
    cpu_set_t home = one_cpu(0);
    td_cpuboard *b = (td_cpuboard *)1;
    td_err err;
    int fd = open(board_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "garbage\n", 8), 8);
    close(fd);
    assert_int_equal(td_cpuboard_open(&b, board_path, &home, &err), TD_EFORMAT);
    assert_null(b);
    assert_non_null(strstr(err.msg, "not a tandem CPU board"));
    /* the right size, the wrong header */
    assert_int_equal(truncate(board_path, 64 + CPU_SETSIZE * 64), 0);
    assert_int_equal(td_cpuboard_open(&b, board_path, &home, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "bad header"));
    assert_int_equal(td_cpuboard_open(&b, "/nonexistent-dir/board", &home, &err), TD_EIO);
    unlink(board_path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_lend_and_reclaim, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dead_borrower, setup, teardown),
        cmocka_unit_test_setup_teardown(test_home_taken, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wait_is_bounded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ranks_of_one_process, setup, teardown),
        cmocka_unit_test_setup_teardown(test_not_a_board, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
