/* bench/report.c - see report.h. */
#include "bench/report.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

/* ---- the summary table ---- */

#define TABLE_WIDTH 50

static void rule(FILE *out, const char *title, char fill)
{
    char line[TABLE_WIDTH + 1];
    size_t len = title ? strlen(title) : 0;
    if (len > TABLE_WIDTH) len = TABLE_WIDTH;
    size_t left = (TABLE_WIDTH - len) / 2;
    memset(line, fill, TABLE_WIDTH);
    if (len) memcpy(line + left, title, len);
    line[TABLE_WIDTH] = '\0';
    fprintf(out, "%s\n", line);
}

static void row_num(FILE *out, const char *name, double v, int decimals)
{
    if (isnan(v))
        fprintf(out, "%-40s %-10s\n", name, "n/a");
    else if (isinf(v))
        fprintf(out, "%-40s %-10s\n", name, "inf");
    else
        fprintf(out, "%-40s %-10.*f\n", name, decimals, v);
}

static void row_int(FILE *out, const char *name, long v)
{
    fprintf(out, "%-40s %-10ld\n", name, v);
}

static void metric_rows(FILE *out, const char *title, const char *abbr, const bench_summary *s,
                        const bench_run_info *info)
{
    rule(out, title, '-');
    char name[64];
    snprintf(name, sizeof(name), "Mean %s (ms):", abbr);
    row_num(out, name, s->mean, 2);
    snprintf(name, sizeof(name), "Median %s (ms):", abbr);
    row_num(out, name, s->median, 2);
    for (int i = 0; i < info->num_percentiles; i++) {
        snprintf(name, sizeof(name), "P%g %s (ms):", info->percentiles[i], abbr);
        row_num(out, name, s->pct[i], 2);
    }
}

void bench_report_print(FILE *out, const bench_run_info *info, const bench_results *res)
{
    rule(out, " Serving Benchmark Result ", '=');
    if (info->label) fprintf(out, "%-40s %-10s\n", "Label:", info->label);
    row_int(out, "Successful requests:", res->completed);
    row_int(out, "Failed requests:", res->failed);
    if (info->max_concurrency > 0)
        row_int(out, "Maximum request concurrency:", info->max_concurrency);
    row_num(out, "Request rate configured (RPS):", info->request_rate, 2);
    row_num(out, "Benchmark duration (s):", res->duration_s, 2);
    row_int(out, "Total input tokens:", res->total_input_tokens);
    row_int(out, "Total generated tokens:", res->total_output_tokens);
    if (res->cached_reported > 0)
        row_int(out, "Prompt tokens from the prefix cache:", res->total_cached_tokens);
    row_num(out, "Request throughput (req/s):", res->request_throughput, 2);
    if (bench_slo_any(info->slo)) row_num(out, "Request goodput (req/s):", res->goodput, 2);
    row_num(out, "Output token throughput (tok/s):", res->output_throughput, 2);
    row_num(out, "Total token throughput (tok/s):", res->total_token_throughput, 2);
    metric_rows(out, "Time to First Token", "TTFT", &res->ttft, info);
    metric_rows(out, "Time per Output Token (excl. 1st token)", "TPOT", &res->tpot, info);
    metric_rows(out, "Inter-token Latency", "ITL", &res->itl, info);
    metric_rows(out, "End-to-end Latency", "E2EL", &res->e2el, info);
    bool any_timing = false;
    for (int f = 0; f < BENCH_T_COUNT; f++)
        any_timing |= res->timing[f].count > 0;
    if (any_timing) {
        rule(out, "Server-reported breakdown (mean / median ms)", '-');
        for (int f = 0; f < BENCH_T_COUNT; f++) {
            const bench_summary *s = &res->timing[f];
            if (!s->count) continue;
            char value[48];
            snprintf(value, sizeof(value), "%.2f / %.2f", s->mean, s->median);
            fprintf(out, "%-40s %-10s\n", bench_timing_result_name((bench_timing_field)f), value);
        }
        if (!isnan(res->transfer_share_of_ttft))
            row_num(out, "Transfer share of TTFT:", res->transfer_share_of_ttft, 3);
    }
    if (info->num_failures > 0) {
        rule(out, "Failures", '-');
        for (int i = 0; i < info->num_failures; i++) {
            char name[128];
            snprintf(name, sizeof(name), "%.90s:", info->failures[i].reason);
            row_int(out, name, info->failures[i].count);
        }
    }
    rule(out, NULL, '=');
}

/* ---- the result JSON ---- */

/* Adds a number; NaN and infinities (which JSON lacks) become null. */
static void add_num(cJSON *o, const char *name, double v)
{
    if (isnan(v) || isinf(v))
        cJSON_AddNullToObject(o, name);
    else
        cJSON_AddNumberToObject(o, name, v);
}

static void add_summary(cJSON *o, const char *metric, const bench_summary *s,
                        const bench_run_info *info)
{
    char name[64];
    snprintf(name, sizeof(name), "mean_%s_ms", metric);
    add_num(o, name, s->mean);
    snprintf(name, sizeof(name), "median_%s_ms", metric);
    add_num(o, name, s->median);
    snprintf(name, sizeof(name), "std_%s_ms", metric);
    add_num(o, name, s->std);
    for (int i = 0; i < info->num_percentiles; i++) {
        /* every digit the percentile has: 99.9999999 is not p100 */
        snprintf(name, sizeof(name), "p%.15g_%s_ms", info->percentiles[i], metric);
        add_num(o, name, s->pct[i]);
    }
}

static cJSON *result_json(const bench_run_info *info, const bench_results *res)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    char date[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(date, sizeof(date), "%Y%m%d-%H%M%S", localtime_r(&now, &tm));
    cJSON_AddStringToObject(o, "date", date);
    if (info->label)
        cJSON_AddStringToObject(o, "label", info->label);
    else
        cJSON_AddNullToObject(o, "label");
    cJSON_AddStringToObject(o, "base_url", info->base_url ? info->base_url : "");
    cJSON_AddStringToObject(o, "endpoint", info->endpoint ? info->endpoint : "");
    if (info->model)
        cJSON_AddStringToObject(o, "model_id", info->model);
    else
        cJSON_AddNullToObject(o, "model_id");
    cJSON_AddStringToObject(o, "dataset", info->dataset ? info->dataset : "");
    cJSON_AddNumberToObject(o, "num_prompts", (double)info->num_prompts);
    cJSON_AddNumberToObject(o, "max_concurrency", (double)info->max_concurrency);
    if (isinf(info->request_rate))
        cJSON_AddStringToObject(o, "request_rate", "inf");
    else
        cJSON_AddNumberToObject(o, "request_rate", info->request_rate);
    cJSON_AddNumberToObject(o, "burstiness", info->burstiness);
    cJSON_AddNumberToObject(o, "input_len", (double)info->input_len);
    cJSON_AddNumberToObject(o, "output_len", (double)info->output_len);
    cJSON_AddNumberToObject(o, "prefix_len", (double)info->prefix_len);
    cJSON_AddNumberToObject(o, "range_ratio", info->range_ratio);
    cJSON_AddNumberToObject(o, "completed", (double)res->completed);
    cJSON_AddNumberToObject(o, "failed", (double)res->failed);
    add_num(o, "duration", res->duration_s);
    cJSON_AddNumberToObject(o, "total_input_tokens", (double)res->total_input_tokens);
    cJSON_AddNumberToObject(o, "total_output_tokens", (double)res->total_output_tokens);
    if (res->cached_reported > 0)
        cJSON_AddNumberToObject(o, "total_cached_tokens", (double)res->total_cached_tokens);
    add_num(o, "request_throughput", res->request_throughput);
    add_num(o, "output_throughput", res->output_throughput);
    add_num(o, "total_token_throughput", res->total_token_throughput);
    add_num(o, "goodput", res->goodput);
    if (bench_slo_any(info->slo)) {
        cJSON *slo = cJSON_AddObjectToObject(o, "goodput_slo_ms");
        if (info->slo->ttft_ms > 0) cJSON_AddNumberToObject(slo, "ttft", info->slo->ttft_ms);
        if (info->slo->tpot_ms > 0) cJSON_AddNumberToObject(slo, "tpot", info->slo->tpot_ms);
        if (info->slo->e2el_ms > 0) cJSON_AddNumberToObject(slo, "e2el", info->slo->e2el_ms);
    }
    add_summary(o, "ttft", &res->ttft, info);
    add_summary(o, "tpot", &res->tpot, info);
    add_summary(o, "itl", &res->itl, info);
    add_summary(o, "e2el", &res->e2el, info);
    for (int f = 0; f < BENCH_T_COUNT; f++) {
        const bench_summary *s = &res->timing[f];
        if (!s->count) continue;
        char name[80];
        const char *field = bench_timing_result_name((bench_timing_field)f);
        snprintf(name, sizeof(name), "mean_%s", field);
        add_num(o, name, s->mean);
        snprintf(name, sizeof(name), "median_%s", field);
        add_num(o, name, s->median);
    }
    if (!isnan(res->transfer_share_of_ttft))
        add_num(o, "transfer_share_of_ttft", res->transfer_share_of_ttft);
    cJSON *errors = cJSON_AddObjectToObject(o, "errors");
    for (int i = 0; i < info->num_failures; i++)
        cJSON_AddNumberToObject(errors, info->failures[i].reason, (double)info->failures[i].count);
    return o;
}

int bench_report_save(const char *path, const bench_run_info *info, const bench_results *res,
                      td_err *err)
{
    cJSON *o = result_json(info, res);
    char *text = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    if (!text) return td_err_set(err, TD_ENOMEM, "out of memory writing the result JSON");
    FILE *f = fopen(path, "w");
    if (!f) {
        free(text);
        return td_err_set(err, TD_EIO, "cannot write '%s': %s", path, strerror(errno));
    }
    bool ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    ok = (fclose(f) == 0) && ok;
    free(text);
    if (!ok) return td_err_set(err, TD_EIO, "cannot write '%s': %s", path, strerror(errno));
    return 0;
}

/* ---- --compare ---- */

typedef struct compare_file {
    cJSON *json;
    const char *path;
    char label[64];
    double concurrency; /* max_concurrency; num_prompts for an unlimited run */
} compare_file;

/* A number field of a result, NAN when missing or null; "inf" strings are infinity. */
static double json_num(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (cJSON_IsNumber(v)) return v->valuedouble;
    if (cJSON_IsString(v) && !strcmp(v->valuestring, "inf")) return INFINITY;
    return NAN;
}

static char *read_text(const char *path, td_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        td_err_set(err, TD_EIO, "cannot open '%s': %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) break;
        len += fread(buf + len, 1, cap - len - 1, f);
        if (len < cap - 1) break;
        if (cap >= (size_t)1 << 30) { /* a result file is kilobytes; refuse a gigabyte */
            free(buf);
            buf = NULL;
            break;
        }
        char *grown = realloc(buf, cap * 2);
        if (!grown) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = grown;
        cap *= 2;
    }
    bool read_error = ferror(f);
    fclose(f);
    if (!buf || read_error) {
        free(buf);
        td_err_set(err, TD_EIO, "cannot read '%s'", path);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

typedef struct compare_row {
    const char *title, *key;
    int decimals;
} compare_row;

static const compare_row compare_rows[] = {
    {"max concurrency", "max_concurrency", 0},
    {"request rate (req/s)", "request_rate", 2},
    {"completed", "completed", 0},
    {"failed", "failed", 0},
    {"duration (s)", "duration", 2},
    {"request throughput (req/s)", "request_throughput", 2},
    {"goodput (req/s)", "goodput", 2},
    {"output throughput (tok/s)", "output_throughput", 2},
    {"total throughput (tok/s)", "total_token_throughput", 2},
    {"mean TTFT (ms)", "mean_ttft_ms", 2},
    {"median TTFT (ms)", "median_ttft_ms", 2},
    {"p99 TTFT (ms)", "p99_ttft_ms", 2},
    {"mean TPOT (ms)", "mean_tpot_ms", 2},
    {"median TPOT (ms)", "median_tpot_ms", 2},
    {"p99 TPOT (ms)", "p99_tpot_ms", 2},
    {"median ITL (ms)", "median_itl_ms", 2},
    {"p99 ITL (ms)", "p99_itl_ms", 2},
    {"median E2EL (ms)", "median_e2el_ms", 2},
    {"p99 E2EL (ms)", "p99_e2el_ms", 2},
    {"mean transfer (ms)", "mean_transfer_ms", 2},
    {"transfer on the wire (ms)", "mean_transfer_wire_ms", 2},
    {"transfer after prefill (ms)", "mean_transfer_after_prefill_ms", 2},
    {"transfer share of TTFT", "transfer_share_of_ttft", 3},
};

static void print_compare_table(FILE *out, const compare_file *files, int n)
{
    int width = 12;
    for (int i = 0; i < n; i++)
        width = TD_MAX(width, (int)strlen(files[i].label) + 2);
    fprintf(out, "%-28s", "metric");
    for (int i = 0; i < n; i++)
        fprintf(out, "%*s", width, files[i].label);
    fputc('\n', out);
    for (size_t r = 0; r < TD_ARRAY_LEN(compare_rows); r++) {
        /* A row no file has (a breakdown field, a percentile not asked for) is left out. */
        bool any = false;
        for (int i = 0; i < n; i++)
            any |= cJSON_GetObjectItemCaseSensitive(files[i].json, compare_rows[r].key) != NULL;
        if (!any) continue;
        fprintf(out, "%-28s", compare_rows[r].title);
        for (int i = 0; i < n; i++) {
            double v = json_num(files[i].json, compare_rows[r].key);
            if (isnan(v))
                fprintf(out, "%*s", width, "-");
            else if (isinf(v))
                fprintf(out, "%*s", width, "inf");
            else if (!strcmp(compare_rows[r].key, "max_concurrency") && v == 0)
                fprintf(out, "%*s", width, "unlimited");
            else
                fprintf(out, "%*.*f", width, compare_rows[r].decimals, v);
        }
        fputc('\n', out);
    }
}

/* Writes s with the five XML special characters escaped. */
/* Bytes of a whole UTF-8 character at s (1 to 4), 0 where none starts. */
static int utf8_char_len(const unsigned char *s)
{
    int n = s[0] < 0x80             ? 1
            : (s[0] & 0xE0) == 0xC0 ? 2
            : (s[0] & 0xF0) == 0xE0 ? 3
            : (s[0] & 0xF8) == 0xF0 ? 4
                                    : 0;
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return n;
}

/* Text XML may hold: escaped, whole UTF-8 characters only, no control characters but tab
 * and newlines (a label is any string a result file carries). */
static void svg_text(FILE *f, const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x80) {
            int n = utf8_char_len((const unsigned char *)s);
            if (n) fwrite(s, 1, (size_t)n, f);
            s += n ? n - 1 : 0;
            continue;
        }
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') continue;
        switch (*s) {
        case '<':
            fputs("&lt;", f);
            break;
        case '>':
            fputs("&gt;", f);
            break;
        case '&':
            fputs("&amp;", f);
            break;
        case '"':
            fputs("&quot;", f);
            break;
        case '\'':
            fputs("&apos;", f);
            break;
        default:
            fputc(*s, f);
        }
    }
}

/* A "nice" step (1, 2 or 5 times a power of ten) that splits [0, max] into about 5. */
static double nice_step(double max)
{
    if (!(max > 0)) return 1;
    double raw = max / 5, mag = pow(10, floor(log10(raw)));
    double m = raw / mag;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * mag;
}

static const char *const palette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                      "#9467bd", "#8c564b", "#e377c2", "#17becf"};

#define PANEL_W 460
#define PANEL_H 340
#define MARGIN_L 70
#define MARGIN_R 20
#define MARGIN_T 40
#define MARGIN_B 50
#define LEGEND_H 30

static int cmp_file_concurrency(const void *a, const void *b)
{
    const compare_file *x = *(const compare_file *const *)a, *y = *(const compare_file *const *)b;
    return x->concurrency < y->concurrency ? -1 : x->concurrency > y->concurrency;
}

/* key's value for the plot: NAN (left out, as a missing one) past 1e12 ms, 31 years,
 * which no run measures and whose axis would not fit a double. */
static double plot_num(const cJSON *o, const char *key)
{
    double v = json_num(o, key);
    return isfinite(v) && fabs(v) <= 1e12 ? v : NAN;
}

/* One panel at x offset ox: key's value against concurrency, one line per label. */
static void svg_panel(FILE *f, int ox, const char *title, const char *key, compare_file *files,
                      int n, const int *group, int num_groups, bool log_x, double x_min,
                      double x_max)
{
    double y_max = 0;
    for (int i = 0; i < n; i++) {
        double v = plot_num(files[i].json, key);
        if (isfinite(v)) y_max = TD_MAX(y_max, v);
    }
    double step = nice_step(y_max);
    double y_top = y_max > 0 ? ceil(y_max * 1.05 / step) * step : 1;
    int plot_w = PANEL_W - MARGIN_L - MARGIN_R, plot_h = PANEL_H - MARGIN_T - MARGIN_B;
    int x0 = ox + MARGIN_L, y0 = MARGIN_T + plot_h;
#define SX(c)                                                                                      \
    (x0 + (x_max > x_min ? (log_x ? (log(c) - log(x_min)) / (log(x_max) - log(x_min))              \
                                  : ((c)-x_min) / (x_max - x_min))                                 \
                         : 0.5) *                                                                  \
              plot_w)
#define SY(v) (y0 - (v) / y_top * plot_h)
    fprintf(f, "<text x=\"%d\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">%s</text>\n",
            ox + MARGIN_L + plot_w / 2, title);
    fprintf(f,
            "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#444\"/>\n",
            x0, MARGIN_T, plot_w, plot_h);
    for (int t = 0; t <= 100; t++) { /* about 5 ticks; bounded whatever the values */
        double v = t * step;
        if (v > y_top + step / 2) break;
        double y = SY(v);
        fprintf(f,
                "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
                "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\" font-size=\"11\">%g</text>\n",
                x0, y, x0 + plot_w, y, x0 - 6, y + 4, v);
    }
    /* x ticks at every concurrency that a file has */
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int k = 0; k < i; k++)
            seen |= files[k].concurrency == files[i].concurrency;
        if (seen) continue;
        double x = SX(files[i].concurrency);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#444\"/>\n"
                "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\" font-size=\"11\">%g</text>\n",
                x, y0, x, y0 + 5, x, y0 + 18, files[i].concurrency);
    }
    fprintf(f,
            "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" font-size=\"12\">max concurrency%s"
            "</text>\n",
            x0 + plot_w / 2, y0 + 38, log_x ? " (log scale)" : "");
    fprintf(f,
            "<text transform=\"translate(%d,%d) rotate(-90)\" text-anchor=\"middle\" "
            "font-size=\"12\">ms</text>\n",
            ox + 16, MARGIN_T + plot_h / 2);
    compare_file **pts = malloc((size_t)n * sizeof(*pts));
    if (!pts) return;
    for (int g = 0; g < num_groups; g++) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (group[i] == g && isfinite(plot_num(files[i].json, key))) pts[k++] = &files[i];
        qsort(pts, (size_t)k, sizeof(*pts), cmp_file_concurrency);
        const char *color = palette[g % TD_ARRAY_LEN(palette)];
        if (k > 1) {
            fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", color);
            for (int i = 0; i < k; i++)
                fprintf(f, "%s%.1f,%.1f", i ? " " : "", SX(pts[i]->concurrency),
                        SY(plot_num(pts[i]->json, key)));
            fputs("\"/>\n", f);
        }
        for (int i = 0; i < k; i++)
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
                    SX(pts[i]->concurrency), SY(plot_num(pts[i]->json, key)), color);
    }
    free(pts);
#undef SX
#undef SY
}

static int write_svg(const char *path, compare_file *files, int n, td_err *err)
{
    /* Group by label, in order of first appearance. */
    int *group = malloc((size_t)n * sizeof(int));
    if (!group) return td_err_set(err, TD_ENOMEM, "out of memory");
    int num_groups = 0;
    for (int i = 0; i < n; i++) {
        group[i] = -1;
        for (int k = 0; k < i; k++)
            if (!strcmp(files[k].label, files[i].label)) group[i] = group[k];
        if (group[i] < 0) group[i] = num_groups++;
    }
    double x_min = INFINITY, x_max = 0;
    for (int i = 0; i < n; i++) {
        x_min = TD_MIN(x_min, files[i].concurrency);
        x_max = TD_MAX(x_max, files[i].concurrency);
    }
    /* Concurrency sweeps are usually powers of two: a log axis spaces them evenly. */
    bool log_x = x_min > 0 && x_max / x_min >= 8;
    FILE *f = fopen(path, "w");
    if (!f) {
        free(group);
        return td_err_set(err, TD_EIO, "cannot write '%s': %s", path, strerror(errno));
    }
    int width = 2 * PANEL_W, height = PANEL_H + LEGEND_H * ((num_groups + 3) / 4);
    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            width, height, width, height);
    svg_panel(f, 0, "median TTFT (ms)", "median_ttft_ms", files, n, group, num_groups, log_x, x_min,
              x_max);
    svg_panel(f, PANEL_W, "median TPOT (ms)", "median_tpot_ms", files, n, group, num_groups, log_x,
              x_min, x_max);
    for (int g = 0; g < num_groups; g++) {
        const char *label = "";
        for (int i = 0; i < n; i++)
            if (group[i] == g) {
                label = files[i].label;
                break;
            }
        int lx = MARGIN_L + (g % 4) * 200, ly = PANEL_H + (g / 4) * LEGEND_H + 10;
        const char *color = palette[g % TD_ARRAY_LEN(palette)];
        fprintf(f,
                "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"3\"/>\n"
                "<text x=\"%d\" y=\"%d\" font-size=\"12\">",
                lx, ly, lx + 24, ly, color, lx + 30, ly + 4);
        svg_text(f, label);
        fputs("</text>\n", f);
    }
    fputs("</svg>\n", f);
    free(group);
    if (fclose(f)) return td_err_set(err, TD_EIO, "cannot write '%s': %s", path, strerror(errno));
    return 0;
}

int bench_compare(const char *const *paths, int num_paths, const char *svg_path, FILE *out,
                  td_err *err)
{
    compare_file *files = calloc((size_t)TD_MAX(num_paths, 1), sizeof(compare_file));
    if (!files) return td_err_set(err, TD_ENOMEM, "out of memory");
    int rc = 0, n = 0;
    for (; n < num_paths; n++) {
        compare_file *cf = &files[n];
        cf->path = paths[n];
        char *text = read_text(paths[n], err);
        if (!text) {
            rc = err ? err->code : TD_EIO;
            goto out;
        }
        cf->json = cJSON_Parse(text);
        free(text);
        if (!cJSON_IsObject(cf->json)) {
            cJSON_Delete(cf->json);
            cf->json = NULL;
            rc = td_err_set(err, TD_EFORMAT, "'%s' is not a result JSON object", paths[n]);
            goto out;
        }
        if (!cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(cf->json, "completed")) ||
            !cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(cf->json, "duration"))) {
            rc = td_err_set(err, TD_EFORMAT,
                            "'%s' is not a tandem bench result (no 'completed' and 'duration'; "
                            "write one with --save-result)",
                            paths[n]);
            goto out;
        }
        const cJSON *label = cJSON_GetObjectItemCaseSensitive(cf->json, "label");
        if (cJSON_IsString(label) && label->valuestring[0]) {
            snprintf(cf->label, sizeof(cf->label), "%s", label->valuestring);
        } else {
            const char *base = strrchr(paths[n], '/');
            snprintf(cf->label, sizeof(cf->label), "%s", base ? base + 1 : paths[n]);
        }
        /* a long label is cut between characters, not inside one */
        size_t len = strlen(cf->label), at = 0;
        while (at < len) {
            int k = utf8_char_len((const unsigned char *)cf->label + at);
            if (!k || at + (size_t)k > len) break;
            at += (size_t)k;
        }
        if (at < len && len == sizeof(cf->label) - 1) cf->label[at] = 0;
        double c = json_num(cf->json, "max_concurrency");
        if (!(c > 0)) c = json_num(cf->json, "num_prompts");
        cf->concurrency = c > 0 && c <= 1e12 ? c : 1;
    }
    print_compare_table(out, files, n);
    rc = write_svg(svg_path, files, n, err);
    if (!rc) fprintf(out, "plot: %s\n", svg_path);
out:
    for (int i = 0; i < num_paths; i++)
        cJSON_Delete(files[i].json);
    free(files);
    return rc;
}
