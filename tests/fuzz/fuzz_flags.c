/*
 * libFuzzer target for the command line: the strict flag parser every subcommand uses
 * (cli/flags.c) and the value parsers behind it (util/td.h numbers and sizes,
 * util/pool.h CPU lists). The input is split at NUL bytes into argv. Nothing may crash;
 * the parser returns 0, 1 (--help) or 2; a CPU list that parses has at least one CPU and
 * survives being written out and parsed again.
 *
 *   build-fuzz/fuzz_flags -max_total_time=60 tests/fuzz/corpus_flags
 */
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/flags.h"
#include "util/pool.h"
#include "util/td.h"

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_flags: invariant broken: %s\n", what);
        abort();
    }
}

static void cpu_list_roundtrip(const char *s)
{
    cpu_set_t set, again;
    if (td_parse_cpu_list(s, &set) != 0) return;
    check(CPU_COUNT(&set) > 0, "a parsed CPU list has a CPU");
    char buf[CPU_SETSIZE * 6];
    size_t len = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &set)) len += (size_t)snprintf(buf + len, sizeof(buf) - len, "%s%d", len ? "," : "", c);
    check(td_parse_cpu_list(buf, &again) == 0 && CPU_EQUAL(&set, &again), "CPU list round trip");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 4096) return 0;
    char *copy = malloc(size + 1);
    memcpy(copy, data, size);
    copy[size] = 0;
    char *argv[34] = {"fuzz"};
    int argc = 1;
    for (char *p = copy; argc < 33 && p <= copy + size; p += strlen(p) + 1) argv[argc++] = p;

    for (int i = 1; i < argc; i++) {
        int64_t v;
        double d;
        uint64_t u;
        (void)td_parse_i64(argv[i], &v);
        (void)td_parse_f64(argv[i], &d);
        (void)td_parse_size(argv[i], &u);
        cpu_list_roundtrip(argv[i]);
    }

    const char *s = NULL;
    int64_t n = 0;
    double x = 0;
    bool b = false;
    uint64_t sz = 0;
    cli_str_list list = {0};
    cli_flag flags[] = {
        CLI_FLAG("model", CLI_FLAG_STR, &s, "a string"),
        CLI_FLAG("threads", CLI_FLAG_INT, &n, "an integer"),
        CLI_FLAG("temperature", CLI_FLAG_FLOAT, &x, "a number"),
        CLI_FLAG("no-pin-threads", CLI_FLAG_BOOL, &b, "a switch"),
        CLI_FLAG("kv-cache-memory", CLI_FLAG_SIZE, &sz, "bytes"),
        CLI_FLAG("worker", CLI_FLAG_LIST, &list, "repeated"),
        CLI_FLAG("n", CLI_FLAG_INT, &n, "a one-letter flag"),
    };
    /* The parser prints its errors and the usage; keep them out of the fuzzer's log. */
    FILE *out = stdout, *err = stderr, *null = fopen("/dev/null", "w");
    if (null) stdout = stderr = null;
    int rc = cli_flags_parse(flags, (int)(sizeof(flags) / sizeof(flags[0])), argc, argv, "fuzz");
    stdout = out;
    stderr = err;
    if (null) fclose(null);
    check(rc == 0 || rc == 1 || rc == 2, "the parser returns 0, 1 or 2");
    check(list.n >= 0 && list.n <= CLI_LIST_MAX, "a list stays within its bound");
    free(copy);
    return 0;
}
