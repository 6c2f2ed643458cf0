/*
 * cli/engine_opts.h - the engine flags that every engine-running subcommand
 * (generate, bench-engine, serve) shares, so they are spelled and checked once.
 */
#ifndef TD_CLI_ENGINE_OPTS_H
#define TD_CLI_ENGINE_OPTS_H

#include "cli/flags.h"
#include "tandem/engine.h"

#define ENGINE_OPTS_MAX_FLAGS 21

typedef struct engine_opts {
    const char *model, *load_format, *dtype, *kv_cache_dtype, *log_level, *device;
    const char *cpus, *cpu_board;
    int64_t threads, block_size, max_num_seqs, max_num_batched_tokens, max_model_len, seed;
    uint64_t kv_cache_memory;
    bool no_prefix_caching, no_pin_threads;
} engine_opts;

/** Set defaults and append the engine flags to `flags` (at most ENGINE_OPTS_MAX_FLAGS);
 *  returns how many were appended. */
int engine_opts_register(engine_opts *o, cli_flag *flags);
/** After parsing: fill an engine config (and the log level). Returns 0 or 2 (usage error,
 *  printed). */
int engine_opts_apply(const engine_opts *o, td_engine_config *cfg);

#endif
