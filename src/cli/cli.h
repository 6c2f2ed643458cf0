/* cli/cli.h - subcommand entry points. Each parses its own flags and returns an exit code
 * (0 success, 1 runtime failure, 2 bad usage). */
#ifndef TD_CLI_CLI_H
#define TD_CLI_CLI_H

int cli_generate(int argc, char **argv);
int cli_mkmodel(int argc, char **argv);
int cli_bench_engine(int argc, char **argv);
int cli_serve(int argc, char **argv);
int cli_bench_serve(int argc, char **argv);
int cli_bench_xfer(int argc, char **argv);
int cli_bench_xfer_cuda(int argc, char **argv);
int cli_bench_pd(int argc, char **argv);
int cli_router(int argc, char **argv);
int cli_up(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_bench_router(int argc, char **argv);

#endif
