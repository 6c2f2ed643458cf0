/*
 * util/cpuboard.h - CPUs lent between the engines of one host while they are idle.
 *
 * `tandem up` splits the machine's CPUs between its engines so that a busy prefill
 * never slows a decode. When one engine has nothing to run, though, its CPUs sit idle
 * while the other may be decoding alone (one request at a time, say). The board is a
 * small shared file, one 64-byte slot per CPU: the engine that owns a CPU says whether it
 * is busy, and an engine with work may borrow the CPUs of idle owners (a guest thread of
 * its pool runs there) until the owner wants them back.
 *
 * Protocol, per CPU (sequentially consistent atomics on both sides, Dekker-style):
 *  - the owner, starting work, stores busy = 1 and then waits until no borrower is left;
 *  - a borrower claims the CPU (borrower: 0 -> its id) and then reads busy; if it is
 *    set, it gives the CPU back at once. So either the owner sees the borrower and waits,
 *    or the borrower sees busy and leaves: they never both compute there.
 *  - a borrower checks busy before each parallel run (util/pool.h's hook) and gives the
 *    CPU back when its owner wants it, so the owner waits at most one run.
 * Each open of the board is a user with an id of its own (its process's pid and the open's
 * number there), so the engines of one process (data-parallel ranks) exclude each other as
 * engines of two processes do. A borrower that died holding a CPU is found by its pid and
 * cleared; an owner that died busy only stops its CPUs from being lent until it comes back.
 */
#ifndef TD_UTIL_CPUBOARD_H
#define TD_UTIL_CPUBOARD_H

#include <sched.h>
#include <stdint.h>

#include "util/td.h"

typedef struct td_cpuboard td_cpuboard;

/* The longest an owner waits for its CPUs back; then it runs anyway (and shares). */
#define TD_CPUBOARD_WAIT_NS 100000000ull

/**
 * Open (creating it if missing) the board at path, and register this open as the owner of
 * the CPUs in `home` (idle). A file that is not a board, or a home CPU that another live
 * open owns (in this process or another), is an error.
 */
int td_cpuboard_open(td_cpuboard **out, const char *path, const cpu_set_t *home, td_err *err);
/** Give back every borrowed CPU, mark the home CPUs idle and unowned, and unmap. */
void td_cpuboard_close(td_cpuboard *b);

/**
 * Owner: say whether this engine has work. Turning busy waits (at most
 * TD_CPUBOARD_WAIT_NS) until no other engine runs on a home CPU; returns the
 * nanoseconds it waited.
 */
uint64_t td_cpuboard_set_busy(td_cpuboard *b, bool busy);

/** Borrower: claim CPU cpu if its owner is idle and nobody else has it. */
bool td_cpuboard_borrow(td_cpuboard *b, int cpu);
/** Borrower: whether the owner of a CPU this open holds wants it back. */
bool td_cpuboard_wanted(const td_cpuboard *b, int cpu);
/** Borrower: give CPU cpu back. */
void td_cpuboard_give_back(td_cpuboard *b, int cpu);

#endif
