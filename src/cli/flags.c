/* cli/flags.c - see flags.h. */
#include "cli/flags.h"

#include <stdio.h>
#include <string.h>

#include "util/td.h"

void cli_flags_usage(const cli_flag *flags, int n_flags, const char *usage_line, void *file)
{
    FILE *out = file;
    fprintf(out, "usage: %s\n\noptions:\n", usage_line);
    for (int i = 0; i < n_flags; i++) {
        const char *arg = "";
        switch (flags[i].kind) {
        case CLI_FLAG_STR: arg = " S"; break;
        case CLI_FLAG_INT: arg = " N"; break;
        case CLI_FLAG_FLOAT: arg = " X"; break;
        case CLI_FLAG_SIZE: arg = " BYTES"; break;
        case CLI_FLAG_LIST: arg = " S ..."; break;
        case CLI_FLAG_BOOL: break;
        }
        char left[64];
        snprintf(left, sizeof(left), "%s%s%s", strlen(flags[i].name) > 2 ? "--" : "-",
                 flags[i].name, arg);
        fprintf(out, "  %-30s %s\n", left, flags[i].help);
    }
}

static bool same_name(const char *flag, const char *given, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        char g = given[i] == '_' ? '-' : given[i];
        if (flag[i] != g) return false;
    }
    return true;
}

static int set_value(cli_flag *f, const char *v)
{
    switch (f->kind) {
    case CLI_FLAG_STR: *(const char **)f->dst = v; return 0;
    case CLI_FLAG_INT: return td_parse_i64(v, f->dst);
    case CLI_FLAG_FLOAT: return td_parse_f64(v, f->dst);
    case CLI_FLAG_SIZE: return td_parse_size(v, f->dst);
    case CLI_FLAG_LIST: {
        cli_str_list *l = f->dst;
        if (l->n >= CLI_LIST_MAX) return TD_EINVAL;
        l->v[l->n++] = v;
        return 0;
    }
    case CLI_FLAG_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1")) *(bool *)f->dst = true;
        else if (!strcmp(v, "false") || !strcmp(v, "0")) *(bool *)f->dst = false;
        else return TD_EINVAL;
        return 0;
    }
    return TD_EINVAL;
}

int cli_flags_parse(cli_flag *flags, int n_flags, int argc, char **argv, const char *usage_line)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            cli_flags_usage(flags, n_flags, usage_line, stdout);
            return 1;
        }
        /* "--name" for every flag; "-x" also for names of one or two letters such as -n and
         * -tp. Underscores match dashes (--kv_cache_dtype is --kv-cache-dtype), as the
         * recipes of vLLM-style systems spell them both ways. */
        bool short_form = a[0] == '-' && a[1] && a[1] != '-' && strlen(a) <= 3 && !strchr(a, '=');
        if (strncmp(a, "--", 2) != 0 && !short_form) {
            fprintf(stderr, "error: unexpected argument '%s' (options start with --)\n\n", a);
            cli_flags_usage(flags, n_flags, usage_line, stderr);
            return 2;
        }
        const char *name = short_form ? a + 1 : a + 2;
        const char *eq = strchr(name, '=');
        size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
        cli_flag *f = NULL;
        for (int k = 0; k < n_flags; k++)
            if (strlen(flags[k].name) == name_len && same_name(flags[k].name, name, name_len) &&
                (!short_form || name_len <= 2))
                f = &flags[k];
        if (!f) {
            fprintf(stderr, "error: unknown option '%s%.*s'\n\n", short_form ? "-" : "--",
                    (int)name_len, name);
            cli_flags_usage(flags, n_flags, usage_line, stderr);
            return 2;
        }
        const char *value = NULL;
        if (eq) {
            value = eq + 1;
        } else if (f->kind != CLI_FLAG_BOOL) {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: option '%s%s' needs a value\n",
                        strlen(f->name) > 2 ? "--" : "-", f->name);
                return 2;
            }
            value = argv[++i];
        }
        int rc = value ? set_value(f, value) : (*(bool *)f->dst = true, 0);
        if (rc != 0) {
            fprintf(stderr, "error: invalid value '%s' for option '%s%s'\n", value,
                    strlen(f->name) > 2 ? "--" : "-", f->name);
            return 2;
        }
        f->seen = true;
    }
    return 0;
}
