/*
 * backend/cpu/probe.h - measure this machine's limits, so benchmarks can report
 * how far a figure is from the floor: the read bandwidth that bounds decode
 * (every weight byte read once per step) and the FMA peak that bounds prefill.
 */
#ifndef TD_BACKEND_PROBE_H
#define TD_BACKEND_PROBE_H

#include "util/pool.h"

/** Read-only bandwidth in GB/s (1e9 bytes/s) of all pool threads summing `bytes` of
 *  memory (each thread its own slice, pre-faulted), best of `reps`. */
double cpu_probe_read_gbs(td_pool *pool, size_t bytes, int reps);

/** Peak f32 FMA rate in GFLOP/s of all pool threads, register-only loops with the widest
 *  vectors this CPU has (best of 3). */
double cpu_probe_peak_gflops(td_pool *pool);

#endif
