/* cli/generate.c - placeholder while the engine lands (replaced in this series). */
#include <stdio.h>
#include "cli/cli.h"
int cli_generate(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "generate: engine pending\n");
    return 1;
}
int cli_bench_engine(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "bench-engine: engine pending\n");
    return 1;
}
