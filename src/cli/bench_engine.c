/*
 * cli/bench_engine.c - `tandem bench-engine`: prefill and decode speed of the
 * engine on one machine, measured through the public engine API.
 *
 *   prefill: one request of --prompt-len random tokens, max_tokens 1, prefix cache off;
 *            tokens/s = prompt tokens / time to the first token (mean over --reps after a
 *            warm-up)
 *   decode:  B requests of one token each generate --gen-len tokens together;
 *            tokens/s = decoded tokens / time of the decode steps (the first step,
 *            which prefills, is excluded), for each B in --batch
 *   floors:  a decode step must read every weight it uses once: all of a dense model's
 *            (but the embedding table, which is only indexed), and for a model with
 *            experts its active weights: everything but the experts, plus the distinct
 *            experts the step's tokens were routed to (counted by the engine during the
 *            timed steps); over the measured read bandwidth
 *
 * The figures are printed, never asserted: speed is a benchmark's job, not a test's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/engine_opts.h"
#include "backend/cpu/probe.h"
#ifdef TD_HAVE_CUDA
#include "backend/cuda/cuda_fwd.h"
#endif
#include "model/model.h"

/* One engine step; a failed step (a device error) ends the benchmark. */
static int step_or_die(td_engine *e)
{
    td_err err = {0};
    int n = td_engine_step(e, &err);
    if (n < 0) {
        fprintf(stderr, "error: engine step failed: %s\n", err.msg);
        exit(1);
    }
    return n;
}

static double run_prefill(td_engine *e, int prompt_len, td_rng *rng)
{
    int n_vocab = td_engine_model(e)->shape.n_vocab;
    int32_t *ids = malloc((size_t)prompt_len * sizeof(int32_t));
    for (int i = 0; i < prompt_len; i++) ids[i] = 3 + (int32_t)(td_rng_next(rng) % (uint64_t)(n_vocab - 3));
    td_sampling sp;
    td_sampling_default(&sp);
    sp.temperature = 0;
    sp.max_tokens = 1;
    sp.ignore_eos = true;
    td_err err;
    double t0 = td_now_s();
    if (td_engine_add_request(e, NULL, ids, prompt_len, &sp, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        exit(1);
    }
    td_output o;
    while (td_engine_has_work(e)) {
        step_or_die(e);
        while (td_engine_poll(e, &o)) {}
    }
    free(ids);
    return td_now_s() - t0;
}

/*
 * Decode throughput of `batch` sequences, each after its own random prompt of `context`
 * tokens. The prompts are prefilled before the clock starts; the sequences whose prompts
 * finish first keep decoding meanwhile (they may generate up to the context limit), so
 * that every timed step decodes the whole batch. The clock then runs for gen_len - 1
 * steps, after which the sequences are aborted. *mean_ctx is the sequences' mean context
 * at the middle of the timed steps.
 */
static double run_decode(td_engine *e, int batch, int gen_len, int context, int max_len,
                         const td_sampling *sampling, td_rng *rng, double *mean_ctx,
                         double *experts_per_step)
{
    int n_vocab = td_engine_model(e)->shape.n_vocab;
    td_sampling sp = *sampling;
    sp.max_tokens = max_len - context;
    sp.ignore_eos = true;
    td_err err;
    int32_t *ids = malloc((size_t)context * sizeof(int32_t));
    uint64_t *rid = malloc((size_t)batch * sizeof(uint64_t));
    int *gen = calloc((size_t)batch, sizeof(int));
    if (!ids || !rid || !gen) {
        fprintf(stderr, "error: out of memory\n");
        exit(1);
    }
    for (int b = 0; b < batch; b++) {
        for (int i = 0; i < context; i++) ids[i] = 3 + (int32_t)(td_rng_next(rng) % (uint64_t)(n_vocab - 3));
        if (td_engine_add_request(e, &rid[b], ids, context, &sp, &err)) {
            fprintf(stderr, "error: %s\n", err.msg);
            exit(1);
        }
    }
    free(ids);
    td_output o;
    int started = 0;
    bool ended = false; /* a sequence reached the context limit: the batch is not whole */
    while (started < batch && td_engine_has_work(e)) {
        step_or_die(e);
        while (td_engine_poll(e, &o)) {
            for (int b = 0; b < batch; b++)
                if (rid[b] == o.id && o.token >= 0 && gen[b]++ == 0) started++;
            ended = ended || o.finish != TD_FINISH_NONE;
        }
    }
    double ctx_sum = 0;
    for (int b = 0; b < batch; b++) ctx_sum += context + gen[b];
    *mean_ctx = ctx_sum / batch + (gen_len - 1) / 2.0;
    td_engine_stats st0, st1;
    td_engine_get_stats(e, &st0);
    double t0 = td_now_s();
    long decoded = 0;
    for (int st = 0; st < gen_len - 1 && !ended && td_engine_has_work(e); st++) {
        decoded += step_or_die(e);
        while (td_engine_poll(e, &o)) ended = ended || o.finish != TD_FINISH_NONE;
    }
    double dt = td_now_s() - t0;
    td_engine_get_stats(e, &st1);
    /* experts run per step, all layers together (0 for a dense model) */
    *experts_per_step =
        st1.steps > st0.steps
            ? (double)(st1.moe_expert_runs - st0.moe_expert_runs) / (double)(st1.steps - st0.steps)
            : 0;
    /* every timed step decoded the whole batch (a sequence may end on the last one) */
    if (decoded != (long)batch * (gen_len - 1)) {
        fprintf(stderr, "error: decode at batch %d: a sequence ended before the timed steps did (raise "
                        "--max-model-len or lower --context)\n", batch);
        exit(1);
    }
    for (int b = 0; b < batch; b++) td_engine_abort(e, rid[b]);
    while (td_engine_has_work(e)) {
        step_or_die(e);
        while (td_engine_poll(e, &o)) {}
    }
    while (td_engine_poll(e, &o)) {}
    free(rid);
    free(gen);
    return (double)decoded / dt;
}

static size_t weight_bytes(const td_weight *w)
{
    return w->data || w->gen.on ? w->row_bytes * (size_t)w->rows : 0;
}

/*
 * What a decode step must read and a prefill must compute. base_bytes: every matrix and
 * vector except the embedding table (only indexed) and the routed experts: attention,
 * norms, biases, the router, a shared expert, the output. expert_bytes: one routed
 * expert's gate, up and down matrices in one layer (every layer's are the same size), so
 * a step that runs X experts over all layers reads base_bytes + X * expert_bytes. FLOPs of
 * a P-token prefill: every matrix a token uses once per token (k experts of a model with
 * experts), attention over the causal triangle, the output matrix once.
 */
static void model_costs(const td_model *m, int P, double *base_bytes, double *expert_bytes,
                        double *prefill_flops)
{
    const td_model_shape *s = &m->shape;
    double bytes = weight_bytes(&m->output) + weight_bytes(&m->output_norm), flops = 0;
    double per_expert = 0;
    for (int l = 0; l < s->n_layer; l++) {
        const td_layer *L = &m->layers[l];
        const td_weight *mats[] = {&L->wq,           &L->wk,         &L->wv,          &L->wo,
                                   &L->w_gate,       &L->w_up,       &L->w_down,      &L->router,
                                   &L->w_gate_shexp, &L->w_up_shexp, &L->w_down_shexp};
        for (size_t i = 0; i < TD_ARRAY_LEN(mats); i++) {
            bytes += weight_bytes(mats[i]);
            flops += 2.0 * (double)mats[i]->rows * (double)mats[i]->cols * P;
        }
        const td_weight *vecs[] = {&L->attn_norm, &L->ffn_norm, &L->bq,
                                   &L->bk,        &L->bv,       &L->shexp_gate};
        for (size_t i = 0; i < TD_ARRAY_LEN(vecs); i++)
            bytes += weight_bytes(vecs[i]);
        if (s->n_expert) {
            const td_weight *exps[] = {&L->w_gate_exps, &L->w_up_exps, &L->w_down_exps};
            for (size_t i = 0; i < TD_ARRAY_LEN(exps); i++) {
                double rows = (double)exps[i]->rows / s->n_expert; /* one expert's */
                if (l == 0) per_expert += weight_bytes(exps[i]) / (double)s->n_expert;
                flops += 2.0 * rows * (double)exps[i]->cols * s->n_expert_used * P;
            }
        }
    }
    flops += 2.0 * (double)m->output.rows * (double)m->output.cols;
    flops += 4.0 * s->n_layer * s->n_head * s->head_dim * (double)P * (P + 1) / 2;
    *base_bytes = bytes;
    *expert_bytes = per_expert;
    *prefill_flops = flops;
}

/* KV bytes one token keeps (K and V, every layer). */
static double kv_token_bytes(const td_model *m, const char *kv_dtype)
{
    td_type t = td_type_parse(kv_dtype);
    const td_model_shape *s = &m->shape;
    return 2.0 * s->n_layer * (double)td_row_bytes(t, (int64_t)s->n_head_kv * s->head_dim);
}

int cli_bench_engine(int argc, char **argv)
{
    engine_opts eo;
    cli_flag flags[ENGINE_OPTS_MAX_FLAGS + 8];
    int nf = engine_opts_register(&eo, flags);
    int64_t prompt_len = 512, gen_len = 128, reps = 3, context = 1;
    const char *batches = "1,32";
    flags[nf++] = CLI_FLAG("prompt-len", CLI_FLAG_INT, &prompt_len,
                             "prefill prompt tokens (512; capped to the context)");
    flags[nf++] = CLI_FLAG("gen-len", CLI_FLAG_INT, &gen_len,
                             "tokens generated per sequence in the decode test (128)");
    flags[nf++] = CLI_FLAG("batch", CLI_FLAG_STR, &batches, "decode batch sizes (1,32)");
    flags[nf++] = CLI_FLAG("context", CLI_FLAG_INT, &context,
                           "prompt tokens before each decode sequence, its starting context (1)");
    flags[nf++] = CLI_FLAG("reps", CLI_FLAG_INT, &reps, "repetitions per test (3)");
    double temperature = 0, top_p = 1;
    int64_t top_k = 0;
    flags[nf++] = CLI_FLAG("temperature", CLI_FLAG_FLOAT, &temperature,
                           "decode sampling temperature (0: greedy)");
    flags[nf++] = CLI_FLAG("top-p", CLI_FLAG_FLOAT, &top_p, "decode nucleus sampling (1: off)");
    flags[nf++] = CLI_FLAG("top-k", CLI_FLAG_INT, &top_k, "decode top-k sampling (0: off)");
    bool no_floor = false;
    flags[nf++] = CLI_FLAG("no-floor", CLI_FLAG_BOOL, &no_floor,
                           "skip measuring the machine's read bandwidth and FMA peak");
    bool kv_checksums = false;
    flags[nf++] = CLI_FLAG("kv-checksums", CLI_FLAG_BOOL, &kv_checksums,
                           "keep block checksums as a KV producer does (to time their cost)");
    int rc = cli_flags_parse(flags, nf, argc, argv, "tandem bench-engine --model M [options]");
    if (rc) return rc == 1 ? 0 : 2;
    if (prompt_len < 1 || gen_len < 2 || reps < 1 || reps > 100 || context < 1) {
        fprintf(stderr, "error: --prompt-len >= 1, --gen-len >= 2, --reps in [1, 100], --context >= 1\n");
        return 2;
    }
    td_sampling dec_sp;
    td_sampling_default(&dec_sp);
    dec_sp.temperature = (float)temperature;
    dec_sp.top_p = (float)top_p;
    dec_sp.top_k = (int)top_k;
    dec_sp.has_seed = true;
    dec_sp.seed = 1;
    if (!(temperature >= 0 && temperature <= 100) || !(top_p > 0 && top_p <= 1) || top_k < 0 ||
        top_k > 1000000) {
        fprintf(stderr, "error: --temperature in [0, 100], --top-p in (0, 1], --top-k >= 0\n");
        return 2;
    }
    eo.no_prefix_caching = true; /* every repetition must really prefill */
    td_engine_config cfg;
    if (engine_opts_apply(&eo, &cfg)) return 2;
    int max_batch = 1;
    for (const char *p = batches; *p;) {
        char *end;
        long b = strtol(p, &end, 10);
        if (end == p || b < 1 || b > 4096 || (*end && *end != ',')) {
            fprintf(stderr, "error: --batch must be comma-separated sizes in [1, 4096]\n");
            return 2;
        }
        max_batch = TD_MAX(max_batch, (int)b);
        p = *end ? end + 1 : end;
    }
    cfg.kv_checksums = kv_checksums;
    cfg.max_num_seqs = TD_MAX(cfg.max_num_seqs, max_batch);
    cfg.max_num_batched_tokens = TD_MAX(cfg.max_num_batched_tokens, (int)prompt_len);
    td_err err = {0};
    td_engine *e;
    if (td_engine_create(&e, &cfg, &err)) {
        fprintf(stderr, "error: %s\n", err.msg);
        return err.code == TD_EINVAL ? 2 : 1; /* a bad setting is a usage error */
    }
    const td_model *m = td_engine_model(e);
    int ctx = td_engine_max_model_len(e);
    if (prompt_len > ctx - 1) prompt_len = ctx - 1;
    if (gen_len > ctx - 1) gen_len = ctx - 1;
    if (context + gen_len > ctx) context = TD_MAX(1, ctx - gen_len);
    char desc[256];
    td_model_describe(m, desc, sizeof(desc));
    printf("model: %s\n", desc);
    printf("threads: %d, kv: %s%s\n", cfg.n_threads, cfg.kv_cache_dtype,
           kv_checksums ? ", block checksums kept" : "");
    double base_bytes, expert_bytes, pf_flops, bw = 0, peak = 0, rate_gbs = 0;
    model_costs(m, (int)prompt_len, &base_bytes, &expert_bytes, &pf_flops);
    /* Batch 1 reads the experts its one token is routed to: n_expert_used per layer. */
    const td_model_shape *ms = &m->shape;
    double dec_bytes = base_bytes + expert_bytes * ms->n_expert_used * ms->n_layer;
    if (ms->n_expert)
        printf("experts: %d per layer, top-%d; one expert is %.2f MB per layer; everything else "
               "a step reads is %.1f MB\n",
               ms->n_expert, ms->n_expert_used, expert_bytes / 1e6, base_bytes / 1e6);
    bool gpu = td_device_gpu(cfg.device) >= 0;
#ifdef TD_HAVE_CUDA
    if (!no_floor && gpu) {
        double copy = 0, tflops = 0;
        if (td_cuda_probe(&copy, &tflops, &err) == 0) {
            rate_gbs = copy;
            printf("machine: GPU copy %.0f GB/s (read + write), bf16 GEMM 8192^3 %.0f TFLOP/s\n",
                   copy, tflops);
            printf("floor: decode reads %.2f GB/token -> %.3f ms/token at batch 1; pp%lld needs "
                   "%.1f TFLOP -> %.0f tok/s at the GEMM rate\n",
                   dec_bytes / 1e9, dec_bytes / (copy * 1e9) * 1e3, (long long)prompt_len,
                   pf_flops / 1e12, tflops * 1e12 / pf_flops * (double)prompt_len);
        } else {
            fprintf(stderr, "warning: GPU probe: %s\n", err.msg);
        }
    }
#endif
    if (!no_floor && !gpu) {
        td_pool *pool;
        if (td_pool_create(&pool, cfg.n_threads > 0 ? cfg.n_threads : 1, cfg.pin_threads, &err) == 0) {
            bw = cpu_probe_read_gbs(pool, 1ull << 30, 3);
            rate_gbs = bw;
            peak = cpu_probe_peak_gflops(pool);
            td_pool_free(pool);
        }
        printf("machine: read %.1f GB/s, f32 FMA peak %.0f GFLOP/s (%lld threads)\n", bw, peak,
               (long long)cfg.n_threads);
        printf("floor: decode reads %.1f MB/token -> %.1f tok/s at batch 1; pp%lld needs %.1f "
               "GFLOP -> %.0f tok/s at peak\n",
               dec_bytes / 1e6, bw * 1e9 / dec_bytes, (long long)prompt_len, pf_flops / 1e9,
               peak * 1e9 / pf_flops * (double)prompt_len);
    }
    if (temperature > 0)
        printf("decode samples: temperature %g, top-p %g, top-k %lld (seed 1)\n", temperature, top_p,
               (long long)top_k);
    printf("%-12s %-8s %10s %12s\n", "test", "tokens", "tok/s", "ms/token");
    td_rng rng;
    td_rng_seed(&rng, 42);
    run_prefill(e, (int)prompt_len, &rng); /* warm-up: page in the weights */
    double sum = 0;
    for (int r = 0; r < reps; r++) sum += run_prefill(e, (int)prompt_len, &rng);
    double pp = (double)prompt_len * (double)reps / sum;
    char name[32];
    snprintf(name, sizeof(name), "pp%lld", (long long)prompt_len);
    printf("%-12s %-8lld %10.1f %12.3f\n", name, (long long)prompt_len, pp, 1e3 / pp);
    for (const char *p = batches; *p;) {
        char *end;
        int b = (int)strtol(p, &end, 10);
        p = *end ? end + 1 : end;
        double tsum = 0, mean_ctx = 0, experts = 0, experts_sum = 0;
        for (int r = 0; r < reps; r++) {
            tsum += run_decode(e, b, (int)gen_len, (int)context, ctx, &dec_sp, &rng, &mean_ctx, &experts);
            experts_sum += experts;
        }
        snprintf(name, sizeof(name), "tg%lld@b%d", (long long)gen_len, b);
        printf("%-12s %-8lld %10.1f %12.3f\n", name, (long long)gen_len * b, tsum / reps,
               1e3 * reps / tsum);
        if (rate_gbs > 0) {
            /* a step reads the weights it uses once and each sequence's KV at its mean
             * context; with experts, the ones the engine ran in the timed steps */
            double kv = (double)b * mean_ctx * kv_token_bytes(m, cfg.kv_cache_dtype);
            double w = ms->n_expert ? base_bytes + expert_bytes * experts_sum / reps : dec_bytes;
            char note[96] = "";
            if (ms->n_expert)
                snprintf(note, sizeof(note), ", %.2f of %d experts per layer",
                         experts_sum / reps / ms->n_layer, ms->n_expert);
            printf("  floor at b%d, mean context %.0f%s: %.4g GB/step -> %.0f tok/s\n", b, mean_ctx,
                   note, (w + kv) / 1e9, b * rate_gbs * 1e9 / (w + kv));
        }
        fflush(stdout);
    }
    td_engine_free(e);
    return 0;
}
