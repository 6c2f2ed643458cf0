/*
 * cli/generate.c - `tandem generate`: offline generation through the engine API.
 *
 *   tandem generate --model M --prompt "Once upon a time" -n 32
 *   tandem generate --model M --prompt-ids 1,306,434 -n 24 --print-ids
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/engine_opts.h"
#include "model/tok.h"

/* Parse "1,306,434" strictly: decimal ids separated by commas, nothing else. */
static int parse_ids(const char *s, int32_t **out, int *n_out)
{
    int cap = 16, n = 0;
    int32_t *ids = malloc((size_t)cap * sizeof(int32_t));
    if (!ids) return TD_ENOMEM;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(ids);
            return TD_EINVAL;
        }
        if (n == cap) {
            cap *= 2;
            int32_t *g = realloc(ids, (size_t)cap * sizeof(int32_t));
            if (!g) {
                free(ids);
                return TD_ENOMEM;
            }
            ids = g;
        }
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
        if (*end == ',' && !*p) {
            free(ids);
            return TD_EINVAL;
        }
    }
    *out = ids;
    *n_out = n;
    return n ? 0 : TD_EINVAL;
}

int cli_generate(int argc, char **argv)
{
    engine_opts eo;
    cli_flag flags[ENGINE_OPTS_MAX_FLAGS + 16];
    int nf = engine_opts_register(&eo, flags);
    const char *prompt = NULL, *prompt_ids = NULL, *stop = NULL;
    int64_t n_predict = 32, top_k = 0, req_seed = INT64_MIN; /* MIN: not given */
    double temperature = 0.0, top_p = 1.0, min_p = 0.0;
    bool print_ids = false, ignore_eos = false;
    flags[nf++] = CLI_FLAG("prompt", CLI_FLAG_STR, &prompt, "prompt text (BOS added as the "
                             "model's metadata says)");
    flags[nf++] = CLI_FLAG("prompt-ids", CLI_FLAG_STR, &prompt_ids,
                             "prompt as comma-separated token ids, used exactly as given");
    flags[nf++] = CLI_FLAG("n", CLI_FLAG_INT, &n_predict, "tokens to generate (32)");
    flags[nf++] = CLI_FLAG("temperature", CLI_FLAG_FLOAT, &temperature, "0 = greedy (default)");
    flags[nf++] = CLI_FLAG("top-k", CLI_FLAG_INT, &top_k, "0 = off");
    flags[nf++] = CLI_FLAG("top-p", CLI_FLAG_FLOAT, &top_p, "1 = off");
    flags[nf++] = CLI_FLAG("min-p", CLI_FLAG_FLOAT, &min_p, "0 = off");
    flags[nf++] = CLI_FLAG("sampling-seed", CLI_FLAG_INT, &req_seed,
                             "seed for this request's sampling (same seed, same output)");
    flags[nf++] = CLI_FLAG("stop", CLI_FLAG_STR, &stop, "stop string");
    flags[nf++] = CLI_FLAG("ignore-eos", CLI_FLAG_BOOL, &ignore_eos, "generate past EOS");
    flags[nf++] = CLI_FLAG("print-ids", CLI_FLAG_BOOL, &print_ids,
                             "print generated token ids (space separated) instead of text");
    int rc = cli_flags_parse(flags, nf, argc, argv,
                             "tandem generate --model M (--prompt TEXT | --prompt-ids IDS) [-n N]");
    if (rc) return rc == 1 ? 0 : 2;
    if (!prompt == !prompt_ids) {
        fprintf(stderr, "error: give exactly one of --prompt and --prompt-ids\n");
        return 2;
    }
    if (n_predict < 1 || n_predict > 1 << 20) {
        fprintf(stderr, "error: -n must be in [1, 1048576], got %lld\n", (long long)n_predict);
        return 2;
    }
    if (top_k < 0 || top_k > 1 << 20) {
        fprintf(stderr, "error: --top-k must be in [0, 1048576] (0: off), got %lld\n",
                (long long)top_k);
        return 2;
    }
    td_engine_config cfg;
    if (engine_opts_apply(&eo, &cfg)) return 2;
    td_err err = {0};
    td_engine *e = NULL;
    if (td_engine_create(&e, &cfg, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return err.code == TD_EINVAL ? 2 : 1; /* a bad setting is a usage error */
    }
    int32_t *ids = NULL;
    int n_ids = 0;
    if (prompt_ids) {
        if (parse_ids(prompt_ids, &ids, &n_ids)) {
            fprintf(stderr, "error: --prompt-ids must be comma-separated token ids, got '%s'\n",
                    prompt_ids);
            td_engine_free(e);
            return 2;
        }
    } else {
        const td_tokenizer *tok = td_engine_tokenizer(e);
        size_t len = strlen(prompt);
        int cap = (int)len + 8;
        ids = malloc((size_t)cap * sizeof(int32_t));
        n_ids = ids ? tok_encode(tok, prompt, len, true, true, ids, cap, &err) : TD_ENOMEM;
        if (n_ids > cap) { /* byte fallback can need more tokens than bytes: retry */
            int32_t *more = realloc(ids, (size_t)n_ids * sizeof(int32_t));
            cap = n_ids;
            n_ids = more ? tok_encode(tok, prompt, len, true, true, more, cap, &err) : TD_ENOMEM;
            if (more) ids = more;
        }
        if (n_ids < 0) {
            fprintf(stderr, "error: cannot tokenize the prompt: %s\n", err.msg[0] ? err.msg : td_strerror(n_ids));
            free(ids);
            td_engine_free(e);
            return 2;
        }
    }
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = (float)temperature;
    sp.top_k = (int)top_k;
    sp.top_p = (float)top_p;
    sp.min_p = (float)min_p;
    sp.max_tokens = (int)n_predict;
    sp.ignore_eos = ignore_eos;
    if (req_seed != INT64_MIN) { /* any seed, negative ones too, as the API takes them */
        sp.has_seed = true;
        sp.seed = (uint64_t)req_seed;
    }
    const char *stops[1] = {stop};
    if (stop) {
        sp.stop = stops;
        sp.n_stop = 1;
    }
    uint64_t id;
    if (td_engine_add_request(e, &id, ids, n_ids, &sp, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        free(ids);
        td_engine_free(e);
        return 2;
    }
    double t0 = td_now_s(), t_first = 0;
    int n_gen = 0;
    const char *finish = "none";
    bool first_id = true;
    while (td_engine_has_work(e)) {
        if (td_engine_step(e, &err) < 0) {
            fprintf(stderr, "error: %s\n", err.msg);
            break;
        }
        td_output o;
        while (td_engine_poll(e, &o)) {
            if (o.token >= 0) {
                if (!n_gen++) t_first = td_now_s();
                if (print_ids) {
                    printf(first_id ? "%d" : " %d", o.token);
                    first_id = false;
                } else {
                    fwrite(o.text, 1, (size_t)o.text_len, stdout);
                }
                fflush(stdout);
            }
            if (o.finish != TD_FINISH_NONE) {
                finish = td_finish_name(o.finish);
                if (o.error) fprintf(stderr, "error: %s\n", o.error);
            }
        }
    }
    double t1 = td_now_s();
    printf("\n");
    fflush(stdout);
    fprintf(stderr, "[%d prompt tokens, %d generated, finish=%s; prefill %.1f ms, decode %.1f tok/s]\n",
            n_ids, n_gen, finish, (t_first - t0) * 1e3,
            n_gen > 1 ? (n_gen - 1) / (t1 - t_first) : 0.0);
    free(ids);
    td_engine_free(e);
    return 0;
}
