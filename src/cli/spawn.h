/* cli/spawn.h - start a `tandem serve` child for the server benchmarks. */
#ifndef TD_CLI_SPAWN_H
#define TD_CLI_SPAWN_H

#include <stddef.h>
#include <sys/types.h>

#include "cli/engine_opts.h"

/**
 * Start `tandem serve` on a free 127.0.0.1 port with eo's engine flags plus `extra`
 * (NULL-terminated, may be NULL); its stderr is relayed. Returns the pid and writes
 * "http://127.0.0.1:PORT" to url, or -1. Stop it with kill(pid, SIGTERM) + waitpid.
 */
pid_t cli_spawn_serve(const engine_opts *eo, const char *const *extra, char *url, size_t cap);

#endif
