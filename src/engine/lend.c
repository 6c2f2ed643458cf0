/*
 * engine/lend.c - the engine's compute threads, and the CPUs it lends and borrows.
 *
 * Without --cpus or --cpu-board, the pool is td_pool_create's: --threads threads on the
 * first CPUs this process may use. With --cpus, one thread on each listed CPU. With
 * --cpu-board, those are the engine's own (home) CPUs, and every other CPU it may use
 * gets a guest thread that runs only while the CPU is borrowed (util/cpuboard.h):
 *  - a step that has work marks the home CPUs busy (waiting, at most one of the
 *    borrower's parallel runs, for any guest there to leave), then borrows whatever
 *    CPUs of idle owners it can;
 *  - before each parallel run (the pool's hook) it gives back the CPUs whose owners
 *    have started work;
 *  - a step after which nothing is left to compute gives everything back and marks the
 *    home CPUs idle.
 * Which threads compute a run does not change a bit of its result (every kernel splits
 * its work by (ith, nth), and each output element is computed whole by one thread), so
 * borrowing changes speed only.
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine_internal.h"
#include "util/cpuboard.h"

static void lend_hook(void *ctx)
{
    td_engine *e = ctx;
    if (e->lend.n_on == 0) return;
    bool changed = false;
    for (int k = 0; k < e->lend.n_guests; k++) {
        int cpu = td_pool_guest_cpu(e->pool, k);
        if (!e->lend.on[k] || !td_cpuboard_wanted(e->lend.board, cpu)) continue;
        td_cpuboard_give_back(e->lend.board, cpu);
        e->lend.on[k] = false;
        e->lend.n_on--;
        changed = true;
    }
    if (changed) td_pool_set_guests(e->pool, e->lend.on);
    if (e->lend.n_on) e->stats.cpu_borrowed_runs++;
}

static int first_cpus(const cpu_set_t *allowed, int n, int *out)
{
    int k = 0;
    for (int c = 0; c < CPU_SETSIZE && k < n; c++)
        if (CPU_ISSET(c, allowed)) out[k++] = c;
    return k;
}

int lend__create_pool(td_engine *e, const td_engine_config *cfg, int n_threads, td_err *err)
{
    if (!cfg->cpus && !cfg->cpu_board)
        return td_pool_create(&e->pool, n_threads, cfg->pin_threads, err);
    const char *what = cfg->cpus ? "--cpus" : "--cpu-board";
    if (!cfg->pin_threads)
        return td_err_set(err, TD_EINVAL,
                          "%s places the compute threads on CPUs; it cannot be "
                          "combined with --no-pin-threads",
                          what);
    if (cfg->cpu_board && td_device_gpu(cfg->device) >= 0)
        return td_err_set(err, TD_EINVAL,
                          "--cpu-board lends the CPUs of the CPU forward pass; "
                          "with --device cuda the engine has none to lend");
    cpu_set_t allowed, home;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
        return td_err_set(err, TD_EIO, "%s: cannot read this process's CPUs", what);
    int n_allowed = CPU_COUNT(&allowed);
    int *cpus = td_xcalloc((size_t)n_allowed + (size_t)n_threads, sizeof(int));
    int n_home;
    if (cfg->cpus) {
        if (td_parse_cpu_list(cfg->cpus, &home)) {
            free(cpus);
            return td_err_set(err, TD_EINVAL, "--cpus: bad CPU list '%s' (e.g. 0-3,8)", cfg->cpus);
        }
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &home) && !CPU_ISSET(c, &allowed)) {
                free(cpus);
                return td_err_set(err, TD_EINVAL,
                                  "--cpus: CPU %d is not one this process may "
                                  "use (see taskset -p)",
                                  c);
            }
        n_home = CPU_COUNT(&home);
        if (cfg->n_threads > 0 && cfg->n_threads != n_home) {
            free(cpus);
            return td_err_set(err, TD_EINVAL,
                              "--threads %d and --cpus %s (%d CPUs) disagree: "
                              "one thread runs on each listed CPU",
                              cfg->n_threads, cfg->cpus, n_home);
        }
        first_cpus(&home, n_home, cpus);
    } else {
        n_home = first_cpus(&allowed, TD_MIN(n_threads, n_allowed), cpus);
        CPU_ZERO(&home);
        for (int i = 0; i < n_home; i++)
            CPU_SET(cpus[i], &home);
    }
    int n = n_home;
    if (cfg->cpu_board)
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &allowed) && !CPU_ISSET(c, &home)) cpus[n++] = c;
    int rc = td_pool_create_on(&e->pool, cpus, n, n_home, err);
    free(cpus);
    if (rc) return rc;
    if (!cfg->cpu_board) return 0;
    rc = td_cpuboard_open(&e->lend.board, cfg->cpu_board, &home, err);
    if (rc) return rc;
    e->lend.n_guests = n - n_home;
    e->lend.on = td_xcalloc((size_t)TD_MAX(e->lend.n_guests, 1), sizeof(bool));
    td_pool_set_hook(e->pool, lend_hook, e);
    return 0;
}

void lend__begin(td_engine *e)
{
    if (!e->lend.board) return;
    if (!e->lend.busy) {
        uint64_t ns = td_cpuboard_set_busy(e->lend.board, true);
        e->lend.busy = true;
        if (ns) {
            e->stats.cpu_reclaims++;
            e->stats.cpu_reclaim_ns += ns;
        }
    }
    bool changed = false;
    for (int k = 0; k < e->lend.n_guests; k++) {
        if (e->lend.on[k] || !td_cpuboard_borrow(e->lend.board, td_pool_guest_cpu(e->pool, k)))
            continue;
        e->lend.on[k] = true;
        e->lend.n_on++;
        changed = true;
    }
    if (changed) td_pool_set_guests(e->pool, e->lend.on);
}

void lend__end(td_engine *e, bool idle)
{
    if (!e->lend.board || !idle) return;
    if (e->lend.n_on) {
        for (int k = 0; k < e->lend.n_guests; k++) {
            if (!e->lend.on[k]) continue;
            td_cpuboard_give_back(e->lend.board, td_pool_guest_cpu(e->pool, k));
            e->lend.on[k] = false;
        }
        e->lend.n_on = 0;
        td_pool_set_guests(e->pool, e->lend.on);
    }
    if (e->lend.busy) {
        td_cpuboard_set_busy(e->lend.board, false);
        e->lend.busy = false;
    }
}

void lend__free(td_engine *e)
{
    td_cpuboard_close(e->lend.board); /* gives back what it holds, marks the home CPUs idle */
    e->lend.board = NULL;
    free(e->lend.on);
    e->lend.on = NULL;
}
