/* cli/main.c - the `tandem` executable: dispatches to subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "util/td.h"

static const struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} commands[] = {
    {"generate", cli_generate, "offline generation from a prompt"},
    {"mkmodel", cli_mkmodel, "write a GGUF with random weights at a chosen shape"},
    {"bench-engine", cli_bench_engine, "measure prefill and decode speed of the engine"},
    {"serve", cli_serve, "the OpenAI-compatible engine server"},
    {"bench-serve", cli_bench_serve, "the server's overhead: HTTP streams vs the C API"},
    {"bench-pd", cli_bench_pd, "KV transfer between a prefill and a decode server under concurrency"},
    {"router", cli_router, "the OpenAI-compatible prefill/decode router (atomesh's flags)"},
    {"up", cli_up, "a whole local cluster (router + prefill and decode engines) from one command"},
    {"bench", cli_bench, "the serving benchmark against any OpenAI-compatible server"},
    {"bench-router", cli_bench_router, "the router's own overhead against a stub upstream"},
    {"bench-xfer", cli_bench_xfer, "KV transfer throughput (kvx tcp, shm, ucx) against the machine's limits"},
    {"bench-xfer-cuda", cli_bench_xfer_cuda, "kvx cuda_ipc between two processes on a GPU, against D2D copies"},
};

static void usage(FILE *out)
{
    fprintf(out, "usage: tandem <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        fprintf(out, "  %-14s %s\n", commands[i].name, commands[i].help);
    fprintf(out, "\n`tandem <command> --help` describes each command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    td_raise_fd_limit(); /* servers, the router and the bench clients hold many sockets */
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "tandem: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
