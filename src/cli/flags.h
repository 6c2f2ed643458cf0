/*
 * cli/flags.h - a strict, table-driven command-line parser shared by all
 * subcommands. `--name value` and `--name=value` are accepted; an unknown flag,
 * a missing value or a value that does not parse completely is an error that
 * names the flag. Nothing is silently ignored.
 */
#ifndef TD_CLI_FLAGS_H
#define TD_CLI_FLAGS_H

#include <stdbool.h>
#include <stdint.h>

typedef enum cli_flag_kind {
    CLI_FLAG_STR,   /* const char ** */
    CLI_FLAG_INT,   /* int64_t * */
    CLI_FLAG_FLOAT, /* double * */
    CLI_FLAG_BOOL,  /* bool *, takes no value: presence sets true */
    CLI_FLAG_SIZE,  /* uint64_t *, with K/M/G suffixes */
    CLI_FLAG_LIST,  /* cli_str_list *: every occurrence appends its value */
} cli_flag_kind;

#define CLI_LIST_MAX 64
typedef struct cli_str_list {
    const char *v[CLI_LIST_MAX];
    int n;
} cli_str_list;

typedef struct cli_flag {
    const char *name;  /* without the leading "--" */
    cli_flag_kind kind;
    void *dst;
    const char *help;
    bool seen;         /* set by the parser */
} cli_flag;

#define CLI_FLAG(name, kind, dst, help) ((cli_flag){(name), (kind), (dst), (help), false})

/**
 * Parse argv[1..argc) (argv[0] is the subcommand name). Returns 0 on success,
 * 1 when --help was given (usage printed to stdout), 2 on a usage error (printed
 * to stderr with the usage).
 */
int cli_flags_parse(cli_flag *flags, int n_flags, int argc, char **argv, const char *usage_line);
void cli_flags_usage(const cli_flag *flags, int n_flags, const char *usage_line, void *file);

#endif
