/*
 * cli/bench_pd.c - `tandem bench-pd`: KV transfer between a prefill and a decode server
 * under concurrency, end to end.
 *
 * The reference systems' failure: over TCP, transfers serialise, and time to first token
 * grew from 0.23 s at 1 concurrent request to 56 s at 16. This starts a kv_producer and a
 * kv_consumer (`tandem serve`, same engine flags, loopback), and for each concurrency C
 * prefills C distinct prompts (do_remote_decode), then sends the C decode requests at
 * once so that their transfers overlap, and prints from the consumers' timing breakdown:
 * the transfer time per request (median, max), the aggregate transfer rate, and the
 * decode requests' time to first token. Transfers that do not serialise keep the
 * aggregate rate at C = 16 at or above the rate at C = 1.
 *
 *   tandem bench-pd --model llama-134m --load-format dummy --dtype f16 --threads 2
 */
#include <curl/curl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>

#include "cli/cli.h"
#include "cli/engine_opts.h"
#include "cli/flags.h"
#include "cli/spawn.h"

static size_t on_body(char *p, size_t size, size_t n, void *arg)
{
    return td_sbuf_add(arg, p, size * n) ? 0 : size * n;
}

/* POST every body to url at once; out[i] gets response i's parsed JSON (NULL on failure). */
/* POST bodies[i] to urls[i] (or all to urls[0] when one_url), all at once. */
static int post_all_to(const char *const *urls, bool one_url, char **bodies, int n, cJSON **out)
{
    CURLM *multi = curl_multi_init();
    CURL **easy = calloc((size_t)n, sizeof(CURL *));
    td_sbuf *bufs = calloc((size_t)n, sizeof(td_sbuf));
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    curl_multi_setopt(multi, CURLMOPT_MAX_TOTAL_CONNECTIONS, (long)n);
    for (int i = 0; i < n; i++) {
        easy[i] = curl_easy_init();
        curl_easy_setopt(easy[i], CURLOPT_URL, urls[one_url ? 0 : i]);
        curl_easy_setopt(easy[i], CURLOPT_POSTFIELDS, bodies[i]);
        curl_easy_setopt(easy[i], CURLOPT_HTTPHEADER, hdr);
        curl_easy_setopt(easy[i], CURLOPT_WRITEFUNCTION, on_body);
        curl_easy_setopt(easy[i], CURLOPT_WRITEDATA, &bufs[i]);
        curl_easy_setopt(easy[i], CURLOPT_TCP_NODELAY, 1L);
        curl_multi_add_handle(multi, easy[i]);
    }
    int running = 1;
    while (running) {
        curl_multi_perform(multi, &running);
        if (running) curl_multi_poll(multi, NULL, 0, 100, NULL);
    }
    int failed = 0;
    for (int i = 0; i < n; i++) {
        long code = 0;
        curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &code);
        out[i] = code == 200 && bufs[i].p ? cJSON_Parse(bufs[i].p) : NULL;
        if (!out[i] && !failed++)
            fprintf(stderr, "request %d to %s failed: HTTP %ld: %.300s\n", i, urls[one_url ? 0 : i],
                    code, bufs[i].p ? bufs[i].p : "(no body)");
        curl_multi_remove_handle(multi, easy[i]);
        curl_easy_cleanup(easy[i]);
        free(bufs[i].p);
    }
    curl_multi_cleanup(multi);
    curl_slist_free_all(hdr);
    free(easy);
    free(bufs);
    return failed;
}

static int post_all(const char *url, char **bodies, int n, cJSON **out)
{
    return post_all_to(&url, true, bodies, n, out);
}

/* GET a JSON document (the producer's /kv_transfer_info). */
static cJSON *get_json(const char *url)
{
    CURL *e = curl_easy_init();
    td_sbuf b = {0};
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &b);
    cJSON *j = curl_easy_perform(e) == CURLE_OK && b.p ? cJSON_Parse(b.p) : NULL;
    curl_easy_cleanup(e);
    free(b.p);
    return j;
}

/* Write mode: the router's part, drawing one transfer id per request. */
static void random_hex(char out[33])
{
    uint8_t r[16] = {0};
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(r, 1, sizeof(r), f) != sizeof(r)) {
        for (int i = 0; i < 16; i++)
            r[i] = (uint8_t)(td_now_ns() >> (i % 8 * 8)) ^ (uint8_t)(i * 37);
    }
    if (f) fclose(f);
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", r[i]);
}

static double num_at(const cJSON *o, const char *a, const char *b)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, a);
    if (b) x = cJSON_GetObjectItemCaseSensitive(x, b);
    return cJSON_IsNumber(x) ? x->valuedouble : -1;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* A prompt body: BOS then ids unique to (round, i), so no prefix is shared. */
static char *prompt_json(int len, int n_vocab, int salt)
{
    size_t cap = (size_t)len * 8 + 64;
    char *s = malloc(cap);
    size_t off = (size_t)snprintf(s, cap, "[1");
    for (int k = 1; k < len; k++)
        off += (size_t)snprintf(s + off, cap - off, ",%u",
                                3u + (uint32_t)(salt * 7919 + k * 31 + salt * k) % (uint32_t)(n_vocab - 3));
    snprintf(s + off, cap - off, "]");
    return s;
}

static int run_level(const char *prod, const char *cons, const cJSON *pinfo, int c, int prompt_len,
                     int max_tokens, int n_vocab, int salt)
{
    char **pre = calloc((size_t)c, sizeof(char *)), **dec = calloc((size_t)c, sizeof(char *));
    char **prompts = calloc((size_t)c, sizeof(char *));
    cJSON **pr = calloc((size_t)c, sizeof(cJSON *)), **dr = calloc((size_t)c, sizeof(cJSON *));
    double *xfer = calloc((size_t)c, sizeof(double)), *wire = calloc((size_t)c, sizeof(double));
    double *ttft = calloc((size_t)c, sizeof(double)), *tail = calloc((size_t)c, sizeof(double));
    int rc = 1;
    double e2e;
    if (pinfo) { /* write mode: prefill and decode dispatched at once, one id each */
        const cJSON *eid = cJSON_GetObjectItemCaseSensitive(pinfo, "engine_id");
        const cJSON *host = cJSON_GetObjectItemCaseSensitive(pinfo, "kv_host");
        double port = num_at(pinfo, "handshake_port", NULL);
        char **all = calloc(2 * (size_t)c, sizeof(char *));
        cJSON **res = calloc(2 * (size_t)c, sizeof(cJSON *));
        const char **urls = calloc(2 * (size_t)c, sizeof(char *));
        char pu[512], cu[512];
        snprintf(pu, sizeof(pu), "%s/v1/completions", prod);
        snprintf(cu, sizeof(cu), "%s/v1/completions", cons);
        for (int i = 0; i < c; i++) {
            char tid[33];
            random_hex(tid);
            prompts[i] = prompt_json(prompt_len, n_vocab, salt + i);
            size_t cap = strlen(prompts[i]) + 512;
            all[2 * i] = malloc(cap);
            all[2 * i + 1] = malloc(cap);
            snprintf(all[2 * i], cap,
                     "{\"prompt\":%s,\"max_tokens\":1,\"temperature\":0,\"kv_transfer_params\":"
                     "{\"do_remote_decode\":true,\"transfer_mode\":\"write\",\"transfer_id\":\"%s\"}}",
                     prompts[i], tid);
            snprintf(all[2 * i + 1], cap,
                     "{\"prompt\":%s,\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                     "\"kv_transfer_params\":{\"do_remote_prefill\":true,\"transfer_mode\":\"write\","
                     "\"transfer_id\":\"%s\",\"remote_engine_id\":\"%s\",\"remote_host\":\"%s\","
                     "\"remote_handshake_port\":%d}}",
                     prompts[i], max_tokens, tid, cJSON_IsString(eid) ? eid->valuestring : "",
                     cJSON_IsString(host) ? host->valuestring : "127.0.0.1", (int)port);
            urls[2 * i] = pu;
            urls[2 * i + 1] = cu;
        }
        double t0 = td_now_s();
        int failed = post_all_to(urls, false, all, 2 * c, res);
        e2e = td_now_s() - t0;
        for (int i = 0; i < c; i++) {
            pr[i] = res[2 * i];
            dr[i] = res[2 * i + 1];
            free(all[2 * i]);
            free(all[2 * i + 1]);
        }
        free(all);
        free(res);
        free(urls);
        if (failed) goto out;
    } else {
    for (int i = 0; i < c; i++) {
        prompts[i] = prompt_json(prompt_len, n_vocab, salt + i);
        size_t cap = strlen(prompts[i]) + 256;
        pre[i] = malloc(cap);
        snprintf(pre[i], cap,
                 "{\"prompt\":%s,\"max_tokens\":1,\"temperature\":0,\"kv_transfer_params\":"
                 "{\"do_remote_decode\":true,\"do_remote_prefill\":false}}",
                 prompts[i]);
    }
    char url[512];
    snprintf(url, sizeof(url), "%s/v1/completions", prod);
    double t_pre = td_now_s();
    if (post_all(url, pre, c, pr)) goto out;
    t_pre = td_now_s() - t_pre;
    for (int i = 0; i < c; i++) {
        char *kv = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(pr[i], "kv_transfer_params"));
        size_t cap = strlen(prompts[i]) + (kv ? strlen(kv) : 0) + 256;
        dec[i] = malloc(cap);
        snprintf(dec[i], cap,
                 "{\"prompt\":%s,\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
                 "\"kv_transfer_params\":%s}",
                 prompts[i], max_tokens, kv ? kv : "{}");
        free(kv);
    }
    snprintf(url, sizeof(url), "%s/v1/completions", cons);
    double t0 = td_now_s();
    if (post_all(url, dec, c, dr)) goto out;
    e2e = t_pre + (td_now_s() - t0); /* a router's sequence: all prefills, then the decodes */
    }
    double bytes = 0;
    for (int i = 0; i < c; i++) {
        const cJSON *kv = cJSON_GetObjectItemCaseSensitive(dr[i], "kv_transfer_params");
        const cJSON *how = cJSON_GetObjectItemCaseSensitive(kv, "kv_load");
        if (!cJSON_IsString(how) || strcmp(how->valuestring, "transferred")) {
            char *t = cJSON_PrintUnformatted(kv);
            fprintf(stderr, "decode %d did not transfer: %.300s\n", i, t ? t : "?");
            free(t);
            goto out;
        }
        xfer[i] = num_at(kv, "timing", "transfer_ms");
        wire[i] = num_at(kv, "timing", "transfer_wire_ms");
        tail[i] = num_at(kv, "timing", "transfer_after_prefill_ms");
        ttft[i] = num_at(cJSON_GetObjectItemCaseSensitive(dr[i], "usage"), "timings", "ttft_ms");
        bytes += num_at(kv, "transferred_bytes", NULL);
    }
    qsort(xfer, (size_t)c, sizeof(double), cmp_d);
    qsort(wire, (size_t)c, sizeof(double), cmp_d);
    qsort(ttft, (size_t)c, sizeof(double), cmp_d);
    qsort(tail, (size_t)c, sizeof(double), cmp_d);
    /* The transfers start together; the last one ends the span. */
    double span = wire[c - 1] / 1e3;
    printf("%4d  %9.2f  %9.2f %9.2f  %9.2f %9.2f  %9.2f %9.2f  %9.2f  %9.2f %9.2f  %9.1f\n", c,
           bytes / c / 1e6, xfer[c / 2], xfer[c - 1], wire[c / 2], wire[c - 1], tail[c / 2],
           tail[c - 1], span > 0 ? bytes / span / 1e9 : 0.0, ttft[c / 2], ttft[c - 1], e2e * 1e3);
    fflush(stdout);
    rc = 0;
out:
    for (int i = 0; i < c; i++) {
        free(pre[i]);
        free(dec[i]);
        free(prompts[i]);
        cJSON_Delete(pr[i]);
        cJSON_Delete(dr[i]);
    }
    free(pre);
    free(dec);
    free(prompts);
    free(pr);
    free(dr);
    free(xfer);
    free(wire);
    free(ttft);
    free(tail);
    return rc;
}

int cli_bench_pd(int argc, char **argv)
{
    engine_opts eo;
    cli_flag flags[ENGINE_OPTS_MAX_FLAGS + 8];
    int nf = engine_opts_register(&eo, flags);
    int64_t prompt_len = 512, max_tokens = 4, vocab = 32000;
    const char *levels = "1,4,16", *protocol = "tcp", *mode = "read";
    flags[nf++] = CLI_FLAG("prompt-len", CLI_FLAG_INT, &prompt_len, "prompt tokens (512)");
    flags[nf++] = CLI_FLAG("max-tokens", CLI_FLAG_INT, &max_tokens, "tokens decoded each (4)");
    flags[nf++] = CLI_FLAG("concurrency", CLI_FLAG_STR, &levels, "comma-separated levels (1,4,16)");
    flags[nf++] = CLI_FLAG("protocol", CLI_FLAG_STR, &protocol, "kv transfer protocol (tcp)");
    flags[nf++] = CLI_FLAG("transfer-mode", CLI_FLAG_STR, &mode,
                           "read (prefill, then decode) or write (both at once, push) (read)");
    flags[nf++] = CLI_FLAG("vocab", CLI_FLAG_INT, &vocab,
                           "prompt ids are drawn below this (32000; lower it for small vocabularies)");
    int rc = cli_flags_parse(flags, nf, argc, argv, "tandem bench-pd --model M [options]");
    if (rc) return rc == 1 ? 0 : 2;
    int lv[16], n_lv = 0;
    for (const char *p = levels; *p && n_lv < 16;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 256 || (*end && *end != ',')) {
            fprintf(stderr, "error: --concurrency must be a list of integers in [1, 256], got '%s'\n",
                    levels);
            return 2;
        }
        lv[n_lv++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (prompt_len < 1 || prompt_len > 1 << 16 || max_tokens < 1 || vocab < 8 || !n_lv) {
        fprintf(stderr, "error: --prompt-len, --max-tokens and --vocab must be positive\n");
        return 2;
    }
    bool write = !strcmp(mode, "write");
    if (!write && strcmp(mode, "read")) {
        fprintf(stderr, "error: --transfer-mode must be read or write, got '%s'\n", mode);
        return 2;
    }
    char pcfg[200], ccfg[200];
    /* All C prefills finish before the decodes start: the lease must outlast them. */
    snprintf(pcfg, sizeof(pcfg),
             "{\"kv_role\":\"kv_producer\",\"protocol\":\"%s\",\"lease_ms\":3600000,"
             "\"transfer_mode\":\"%s\"}",
             protocol, mode);
    snprintf(ccfg, sizeof(ccfg), "{\"kv_role\":\"kv_consumer\",\"protocol\":\"%s\",\"transfer_mode\":\"%s\"}",
             protocol, mode);
    const char *pex[] = {"--kv-transfer-config", pcfg, NULL};
    const char *cex[] = {"--kv-transfer-config", ccfg, NULL};
    char purl[256], curl_[256];
    pid_t prod = cli_spawn_serve(&eo, pex, purl, sizeof(purl));
    pid_t cons = prod > 0 ? cli_spawn_serve(&eo, cex, curl_, sizeof(curl_)) : -1;
    if (prod < 0 || cons < 0) {
        fprintf(stderr, "error: could not start the producer and consumer servers\n");
        if (prod > 0) kill(prod, SIGTERM), waitpid(prod, NULL, 0);
        return 1;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    cJSON *pinfo = NULL;
    if (write) {
        char iu[300];
        snprintf(iu, sizeof(iu), "%s/kv_transfer_info", purl);
        pinfo = get_json(iu);
    }
    printf("bench-pd: %s, prompt %lld tokens, protocol %s, transfer mode %s; producer %s, "
           "consumer %s\n",
           eo.model ? eo.model : "?", (long long)prompt_len, protocol, mode, purl, curl_);
    printf("   C   MB/req   xfer p50   xfer max  wire p50  wire max  after p50 after max   agg GB/s   TTFT p50  TTFT max   e2e ms\n");
    rc = write && !pinfo ? 1 : 0;
    if (rc) fprintf(stderr, "error: no /kv_transfer_info from the producer\n");
    /* A warm-up request opens the transfer session (connections, handshake). */
    if (!rc) rc = run_level(purl, curl_, pinfo, 1, (int)prompt_len, (int)max_tokens, (int)vocab, 1 << 20);
    int salt = 0;
    for (int i = 0; i < n_lv && rc == 0; i++) {
        rc = run_level(purl, curl_, pinfo, lv[i], (int)prompt_len, (int)max_tokens, (int)vocab, salt);
        salt += lv[i];
    }
    cJSON_Delete(pinfo);
    printf("(times in ms; xfer: consumer-side time from blocks allocated to KV in place (in write "
           "mode it includes waiting for the prefill); wire: the transfer engine's own time; after: the part of the transfer after the "
           "prefill ended, which push mode hides the rest of; TTFT: "
           "the decode server's; e2e: a router's view, from dispatch to the last decode's end "
           "(read: all prefills, then all decodes; write: both at once); the first row is a "
           "warm-up)\n");
    curl_global_cleanup();
    kill(prod, SIGTERM);
    kill(cons, SIGTERM);
    waitpid(prod, NULL, 0);
    waitpid(cons, NULL, 0);
    return rc ? 1 : 0;
}
