/*
 * cli/spawn.c - start a `tandem serve` child with the same engine flags as the calling
 * benchmark, on a free loopback port, for the benchmarks that measure servers.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/spawn.h"

/* Start `tandem serve` with the same engine flags on a free loopback port. */
static pid_t spawn_server(char **args, char *url, size_t cap)
{
    int fds[2];
    if (pipe(fds)) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    close(fds[1]);
    FILE *f = fdopen(fds[0], "r");
    char line[1024];
    int port = 0;
    while (fgets(line, sizeof(line), f)) {
        const char *p = strstr(line, "listening on ");
        if (p && (p = strrchr(p, ':'))) {
            port = atoi(p + 1);
            break;
        }
        fputs(line, stderr);
    }
    /* Keep draining the server's stderr so that it never blocks on a full pipe. */
    if (port > 0 && fork() == 0) {
        while (fgets(line, sizeof(line), f))
            fputs(line, stderr);
        _exit(0);
    }
    fclose(f);
    if (port <= 0) {
        kill(pid, SIGTERM);
        waitpid(pid, NULL, 0);
        return -1;
    }
    snprintf(url, cap, "http://127.0.0.1:%d", port);
    return pid;
}

pid_t cli_spawn_serve(const engine_opts *eo, const char *const *extra, char *url, size_t cap)
{
    char num[8][32];
    char *args[64];
    int n = 0;
    args[n++] = "tandem";
    args[n++] = "serve";
    args[n++] = "--host";
    args[n++] = "127.0.0.1";
    args[n++] = "--server-port";
    args[n++] = "0";
    args[n++] = "--log-level";
    args[n++] = "warn";
    if (eo->model) {
        args[n++] = "--model";
        args[n++] = (char *)eo->model;
    }
    args[n++] = "--load-format";
    args[n++] = (char *)eo->load_format;
    args[n++] = "--dtype";
    args[n++] = (char *)eo->dtype;
    args[n++] = "--kv-cache-dtype";
    args[n++] = (char *)eo->kv_cache_dtype;
    const struct {
        const char *name;
        long long v;
    } ints[] = {{"--threads", eo->threads},
                {"--block-size", eo->block_size},
                {"--max-num-seqs", eo->max_num_seqs},
                {"--max-num-batched-tokens", eo->max_num_batched_tokens},
                {"--max-model-len", eo->max_model_len},
                {"--seed", eo->seed}};
    for (int i = 0; i < 6; i++) {
        snprintf(num[i], sizeof(num[i]), "%lld", ints[i].v);
        args[n++] = (char *)ints[i].name;
        args[n++] = num[i];
    }
    if (eo->kv_cache_memory) {
        snprintf(num[6], sizeof(num[6]), "%llu", (unsigned long long)eo->kv_cache_memory);
        args[n++] = "--kv-cache-memory";
        args[n++] = num[6];
    }
    if (eo->no_prefix_caching) args[n++] = "--no-prefix-caching";
    if (eo->no_pin_threads) args[n++] = "--no-pin-threads";
    for (int i = 0; extra && extra[i] && n < 62; i++)
        args[n++] = (char *)extra[i];
    args[n] = NULL;
    return spawn_server(args, url, cap);
}
