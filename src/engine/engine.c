/*
 * engine/engine.c - engine lifecycle, memory plan, and the request API.
 * Scheduling and the step loop live in sched.c.
 *
 * Memory is planned once, at creation, in this order: weights (mapped), the
 * activation workspace for a step of max_num_batched_tokens tokens and
 * max_num_seqs logit rows, then the KV block pool from the KV budget. The step
 * allocates nothing for compute or KV; only a request's generated text and the
 * output queue (reused every step) can grow, so a step never runs out of KV or
 * workspace memory.
 */
#include "engine/engine_internal.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "backend/cpu/cpu.h"
#ifdef TD_HAVE_CUDA
#include "backend/cuda/cuda_fwd.h"
#endif

#define DEFAULT_KV_CAP (4ull << 30)

void td_engine_config_default(td_engine_config *c)
{
    memset(c, 0, sizeof(*c));
    c->load_format = "auto";
    c->dummy_type = "f32";
    c->seed = 0;
    c->n_threads = 0;
    c->pin_threads = true;
    c->block_size = 16;
    c->kv_cache_dtype = "f16";
    c->kv_cache_memory = 0;
    c->max_num_seqs = 64;
    c->max_num_batched_tokens = 512;
    c->max_model_len = 0;
    c->enable_prefix_caching = true;
    c->device = "cpu";
}

int td_device_gpu(const char *device)
{
    if (!device || !strcmp(device, "cpu")) return -1;
    if (!strcmp(device, "cuda")) return 0;
    if (strncmp(device, "cuda:", 5) || !device[5]) return -2;
    int n = 0;
    for (const char *p = device + 5; *p; p++) {
        if (*p < '0' || *p > '9' || (p > device + 5 && device[5] == '0')) return -2;
        n = n * 10 + (*p - '0');
        if (n > 63) return -2;
    }
    return n;
}

void td_sampling_default(td_sampling *sp)
{
    memset(sp, 0, sizeof(*sp));
    sp->temperature = 1.0f;
    sp->top_p = 1.0f;
    sp->max_tokens = 16;
    sp->skip_special_tokens = true;
    sp->repetition_penalty = 1.0f;
}

const char *td_finish_name(td_finish f)
{
    switch (f) {
    case TD_FINISH_STOP: return "stop";
    case TD_FINISH_LENGTH: return "length";
    case TD_FINISH_ABORT: return "abort";
    case TD_FINISH_ERROR: return "error";
    default: return "none";
    }
}

static int available_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int check_config(const td_engine_config *c, td_err *err)
{
    if (c->block_size < 1 || c->block_size > 1024)
        return td_err_set(err, TD_EINVAL, "--block-size must be in [1, 1024], got %d",
                          c->block_size);
    if (c->max_num_seqs < 1 || c->max_num_seqs > 4096)
        return td_err_set(err, TD_EINVAL, "--max-num-seqs must be in [1, 4096], got %d",
                          c->max_num_seqs);
    if (c->max_num_batched_tokens < 1 || c->max_num_batched_tokens > 1 << 20)
        return td_err_set(err, TD_EINVAL, "--max-num-batched-tokens must be in [1, 1048576], got %d",
                          c->max_num_batched_tokens);
    if (c->n_threads < 0 || c->n_threads > 1024)
        return td_err_set(err, TD_EINVAL, "--threads must be in [0, 1024], got %d", c->n_threads);
    if (c->max_model_len < 0)
        return td_err_set(err, TD_EINVAL, "--max-model-len must be >= 0, got %d", c->max_model_len);
    td_type kt = td_type_parse(c->kv_cache_dtype ? c->kv_cache_dtype : "");
    if (kt != TD_TYPE_F32 && kt != TD_TYPE_F16 && kt != TD_TYPE_BF16 && kt != TD_TYPE_FP8_E4M3)
        return td_err_set(err, TD_EINVAL,
                          "--kv-cache-dtype must be f32, f16, bf16 or fp8 (fp8_e4m3), got '%s'",
                          c->kv_cache_dtype ? c->kv_cache_dtype : "");
    const char *dev = c->device ? c->device : "cpu";
    if (td_device_gpu(dev) == -2)
        return td_err_set(err, TD_EINVAL, "--device must be cpu, cuda or cuda:N (GPU N, 0..63), got '%s'", dev);
    if (td_device_gpu(dev) >= 0) {
#ifndef TD_HAVE_CUDA
        return td_err_set(err, TD_EUNSUPPORTED,
                          "--device cuda: this build has no CUDA backend (configure with "
                          "-DTANDEM_CUDA=ON where nvcc is installed)");
#endif
        /* The pool's bytes live on the GPU: a peer opens them by CUDA IPC handle (kvx
         * cuda_ipc) or reads them through host staging (tcp), never through a memfd, and
         * the engine keeps no checksums of them. */
        if (c->kv_shareable || c->kv_checksums)
            return td_err_set(err, TD_EUNSUPPORTED,
                              "--device cuda: the KV pool is in GPU memory, so it is neither "
                              "shared through a memfd (protocol shm) nor checksummed by the "
                              "host; KV transfers use protocol cuda_ipc, tcp or ucx");
    }
    const char *lf = c->load_format ? c->load_format : "auto";
    if (strcmp(lf, "auto") && strcmp(lf, "gguf") && strcmp(lf, "dummy"))
        return td_err_set(err, TD_EINVAL, "--load-format must be auto, gguf or dummy, got '%s'", lf);
    return 0;
}

int td__engine_load_model(const td_engine_config *c, td_model **model, td_tokenizer **tok,
                          td_err *err);

int td_engine_create(td_engine **out, const td_engine_config *cfg, td_err *err)
{
    *out = NULL;
    int rc = check_config(cfg, err);
    if (rc) return rc;
    cpu_init();
    td_engine *e = calloc(1, sizeof(*e));
    if (!e) return td_err_set(err, TD_ENOMEM, "engine: out of memory");
    e->cfg = *cfg;
    td_rng_seed(&e->rng, cfg->seed ^ 0x7465616d64656d31ull);

    rc = td__engine_load_model(cfg, &e->model, &e->tok, err);
    if (rc) goto fail;
    /* Not with expert parallelism: the other ranks' experts must never be read in. */
    if (cfg->weights_prefault && !cfg->ep && td_device_gpu(cfg->device) < 0)
        td_model_prefault(e->model);
    const td_model_shape *s = &e->model->shape;
    if (tok_n_vocab(e->tok) > s->n_vocab) {
        rc = td_err_set(err, TD_EFORMAT, "model: tokenizer has %d tokens but the output has %d rows",
                        tok_n_vocab(e->tok), s->n_vocab);
        goto fail;
    }
    /* Experts run on the CPU forward pass only; the GPU backend would otherwise look for the
     * dense FFN matrices that an MoE model does not have. */
    if (s->n_expert && td_device_gpu(cfg->device) >= 0) {
        rc = td_err_set(err, TD_EUNSUPPORTED,
                        "--device cuda: the GPU backend does not run mixture-of-experts models "
                        "yet (%s with %d experts); use --device cpu",
                        td_arch_name(s->arch), s->n_expert);
        goto fail;
    }

    e->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : s->n_ctx_train;
    if (e->max_model_len > s->n_ctx_train)
        TD_WARN("--max-model-len %d exceeds the model's trained context %d", e->max_model_len,
                s->n_ctx_train);
    if (!cfg->max_model_len && !cfg->kv_cache_memory) {
        /* Neither given: a model whose trained context needs more KV for one sequence than
         * the default budget (4 GiB, a quarter of RAM) gets the context that budget holds,
         * rather than a pool and a workspace sized for a context nobody asked for (a file's
         * context_length can be anything up to 2^24). */
        struct sysinfo si;
        uint64_t ram = sysinfo(&si) == 0 ? (uint64_t)si.totalram * si.mem_unit : (8ull << 30);
        uint64_t cap = TD_MIN(DEFAULT_KV_CAP, ram / 4);
        size_t bb = kv_pool_bytes(s->n_layer, s->n_head_kv * s->head_dim, cfg->block_size,
                                  td_type_parse(cfg->kv_cache_dtype), 1);
        uint64_t fit = cap / bb * (uint64_t)cfg->block_size;
        if ((uint64_t)e->max_model_len > fit && fit >= (uint64_t)cfg->block_size) {
            TD_WARN("the model's context of %d tokens needs %.1f GiB of KV for one sequence, "
                    "more than the default budget of %.1f GiB: max_model_len is %d (choose "
                    "with --max-model-len and --kv-cache-memory)",
                    e->max_model_len,
                    (double)bb * (double)((e->max_model_len + cfg->block_size - 1) / cfg->block_size) /
                        (double)(1ull << 30),
                    (double)cap / (double)(1ull << 30), (int)fit);
            e->max_model_len = (int)fit;
        }
    }
    e->max_num_seqs = cfg->max_num_seqs;
    e->max_batched = cfg->max_num_batched_tokens;

    int n_threads = cfg->n_threads > 0 ? cfg->n_threads : available_cpus();
    rc = lend__create_pool(e, cfg, n_threads, err);
    if (rc) goto fail;

    /* Activation workspace first: a step of max_batched tokens must always fit. It is
     * planned before any of it is taken (each buffer is zeroed, so it is all resident): a
     * setting this machine cannot hold is refused here, not found by the OOM killer. */
    {
        size_t ws = fwd_workspace_bytes(e->model, e->max_batched, e->max_num_seqs, e->max_model_len,
                                        td_pool_size(e->pool)) +
                    (size_t)e->max_num_seqs * (size_t)s->n_vocab * sizeof(float);
        struct sysinfo si;
        uint64_t ram = sysinfo(&si) == 0 ? (uint64_t)si.totalram * si.mem_unit : 0;
        if (ram && (uint64_t)ws > ram / 2) {
            rc = td_err_set(err, TD_ETOOLARGE,
                            "the activation workspace for --max-num-batched-tokens %d and "
                            "--max-num-seqs %d (with --max-model-len %d) needs %.1f GiB, more "
                            "than half of this machine's %.1f GiB of RAM; lower them",
                            e->max_batched, e->max_num_seqs, e->max_model_len,
                            (double)ws / (double)(1ull << 30), (double)ram / (double)(1ull << 30));
            goto fail;
        }
    }
    rc = fwd_init(&e->fwd, e->model, &e->kv, e->pool, e->max_batched, e->max_num_seqs,
                  e->max_model_len, err);
    if (rc) goto fail;
    if (cfg->ep) {
        /* Expert parallelism: its exchange buffers are part of the workspace, planned here
         * and never taken from the KV budget below (nor the KV pool from them). */
        if (!s->n_expert) {
            rc = td_err_set(err, TD_EINVAL,
                            "expert parallelism needs a mixture-of-experts model (%s has no experts)",
                            td_arch_name(s->arch));
            goto fail;
        }
        if (cfg->ep_rank < 0 || cfg->ep_rank >= td_ep_size(cfg->ep)) {
            rc = td_err_set(err, TD_EINVAL, "expert-parallel rank %d of a group of %d", cfg->ep_rank,
                            td_ep_size(cfg->ep));
            goto fail;
        }
        if ((rc = fwd_enable_ep(&e->fwd, cfg->ep, cfg->ep_rank, err))) goto fail;
        /* The experts the other ranks hold are never read here: their pages go back. */
        int lo, hi;
        td_ep_experts(cfg->ep, cfg->ep_rank, s->n_expert, &lo, &hi);
        e->ep_dropped = td_model_drop_experts(e->model, lo, hi);
    }

    /* Then the KV pool from what the budget leaves. */
    td_type kv_type = td_type_parse(cfg->kv_cache_dtype);
    int kvd = s->n_head_kv * s->head_dim;
    size_t block_bytes = kv_pool_bytes(s->n_layer, kvd, cfg->block_size, kv_type, 1);
    int64_t blocks_per_seq = (e->max_model_len + cfg->block_size - 1) / cfg->block_size;
    uint64_t budget = cfg->kv_cache_memory;
    if (budget == 0) {
        /* Default: room for every sequence at full length, within 4 GiB and a quarter of RAM. */
        struct sysinfo si;
        uint64_t ram = sysinfo(&si) == 0 ? (uint64_t)si.totalram * si.mem_unit : (8ull << 30);
        uint64_t want = (uint64_t)block_bytes * (uint64_t)blocks_per_seq * (uint64_t)e->max_num_seqs;
        budget = TD_MIN(want, TD_MIN(DEFAULT_KV_CAP, ram / 4));
        budget = TD_MAX(budget, (uint64_t)block_bytes * (uint64_t)blocks_per_seq);
    }
    int64_t n_blocks = (int64_t)(budget / block_bytes);
    if (n_blocks < blocks_per_seq) {
        rc = td_err_set(err, TD_ETOOLARGE,
                        "--kv-cache-memory %llu bytes holds %lld blocks of %d tokens, fewer than "
                        "one sequence of --max-model-len %d needs (%lld); raise the budget or "
                        "lower --max-model-len",
                        (unsigned long long)budget, (long long)n_blocks, cfg->block_size,
                        e->max_model_len, (long long)blocks_per_seq);
        goto fail;
    }
    if (n_blocks > INT32_MAX / 2) n_blocks = INT32_MAX / 2;
    rc = kv_pool_init(&e->kv, s->n_layer, kvd, cfg->block_size, kv_type, (int)n_blocks,
                      cfg->kv_shareable, err);
    if (rc) goto fail;
    if (cfg->kv_prefault) kv_pool_prefault(&e->kv);
    if (cfg->kv_checksums && (rc = kv_pool_keep_checksums(&e->kv, err))) goto fail;
    e->root_hash = td_hash64(&e->model->fingerprint, sizeof(uint64_t), (uint64_t)kv_type);
#ifdef TD_HAVE_CUDA
    /* The GPU holds the weights and the KV bytes; the pool above keeps only the block
     * bookkeeping (its host mapping is never touched, so it costs no memory). */
    if (td_device_gpu(cfg->device) >= 0 &&
        (rc = td_cuda_fwd_create(&e->cuda, e->model, td_device_gpu(cfg->device), kv_type, cfg->block_size,
                                 (int)n_blocks, e->max_batched, e->max_num_seqs, e->max_model_len, err)))
        goto fail;
    /* What a cuda_ipc transfer peer needs to open the pool (td_engine_kv_info). */
    if (e->cuda && (rc = td_cuda_fwd_kv_export(e->cuda, &e->kv_dev.base, e->kv_dev.ipc_handle,
                                               &e->kv_dev.id, e->kv_dev.uuid, err)))
        goto fail;
#endif

    e->n_samp = td_pool_size(e->pool);
    e->samp = calloc((size_t)e->n_samp, sizeof(*e->samp));
    rc = e->samp ? 0 : TD_ENOMEM;
    for (int i = 0; i < e->n_samp && !rc; i++) rc = sampler_scratch_init(&e->samp[i], s->n_vocab);
    if (rc) {
        td_err_set(err, rc, "engine: out of memory for the sampler");
        goto fail;
    }
    int B = e->max_batched, S = e->max_num_seqs;
    e->b_tokens = malloc((size_t)B * sizeof(int32_t));
    e->b_pos = malloc((size_t)B * sizeof(int32_t));
    e->b_seq = malloc((size_t)B * sizeof(int32_t));
    e->b_logit_rows = malloc((size_t)S * sizeof(int32_t));
    e->b_tables = malloc((size_t)S * sizeof(*e->b_tables));
    e->b_reqs = malloc((size_t)S * sizeof(*e->b_reqs));
    e->b_n = malloc((size_t)S * sizeof(int));
    e->lp = malloc((size_t)S * sizeof(*e->lp));
    e->logits = td_aligned_alloc((size_t)S * (size_t)s->n_vocab * sizeof(float));
    e->b_need = malloc((size_t)S);
    e->b_argmax = malloc((size_t)S * sizeof(int32_t));
    e->b_tok = malloc((size_t)S * sizeof(int32_t));
    e->b_samp_s = malloc((size_t)S * sizeof(int));
    bool samp_ok = true;
#ifdef TD_HAVE_CUDA
    e->b_samp = malloc((size_t)S * sizeof(td_cuda_sample));
    samp_ok = e->b_samp != NULL;
#endif
    if (!e->b_tokens || !e->b_pos || !e->b_seq || !e->b_logit_rows || !e->b_tables ||
        !e->b_reqs || !e->b_n || !e->lp || !e->logits || !e->b_need || !e->b_argmax || !samp_ok ||
        !e->b_tok || !e->b_samp_s) {
        rc = td_err_set(err, TD_ENOMEM, "engine: out of memory for batch buffers");
        goto fail;
    }
    e->stats.num_blocks_total = e->kv.n_blocks;
    char desc[512];
    td_engine_describe(e, desc, sizeof(desc));
    TD_INFO("%s", desc);
    *out = e;
    return 0;
fail:
    td_engine_free(e);
    return rc;
}

void req__free(req *r)
{
    if (!r) return;
    free(r->tokens);
    free(r->blocks);
    free(r->block_hash);
    free(r->stop_ids);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->text);
    free(r->bias_ids);
    free(r->bias);
    free(r);
}

void td_engine_free(td_engine *e)
{
    if (!e) return;
    for (int i = 0; i < e->n_waiting; i++) req__free(e->waiting[i]);
    for (int i = 0; i < e->n_running; i++) req__free(e->running[i]);
    free(e->waiting);
    free(e->running);
    for (int i = 0; i < e->n_holds; i++) free(e->holds[i].blocks);
    free(e->holds);
    fwd_free(&e->fwd);
#ifdef TD_HAVE_CUDA
    td_cuda_fwd_free(e->cuda);
#endif
    kv_pool_free(&e->kv);
    for (int i = 0; e->samp && i < e->n_samp; i++) sampler_scratch_free(&e->samp[i]);
    free(e->samp);
    free(e->b_tok);
    free(e->b_samp_s);
    lend__free(e);
    td_pool_free(e->pool);
    tok_free(e->tok);
    td_model_free(e->model);
    free(e->b_tokens);
    free(e->b_pos);
    free(e->b_seq);
    free(e->b_logit_rows);
    free(e->b_need);
    free(e->b_argmax);
    free(e->b_samp);
    free(e->b_tables);
    free(e->b_reqs);
    free(e->b_n);
    free(e->lp);
    td_aligned_free(e->logits);
    free(e->outs);
    free(e->arena);
    free(e);
}

const td_model *td_engine_model(const td_engine *e)
{
    return e->model;
}

int td_engine_cpus(const td_engine *e, cpu_set_t *set)
{
    if (td_device_gpu(e->cfg.device) >= 0) { /* the GPU computes; the CPU pool never runs */
        CPU_ZERO(set);
        return 0;
    }
    return td_pool_cpus(e->pool, set);
}

const td_tokenizer *td_engine_tokenizer(const td_engine *e)
{
    return e->tok;
}

int td_engine_max_model_len(const td_engine *e)
{
    return e->max_model_len;
}

void td_engine_describe(const td_engine *e, char *buf, size_t cap)
{
    char mdesc[256];
    td_model_describe(e->model, mdesc, sizeof(mdesc));
    snprintf(buf, cap,
             "%s; %d threads (%s); memory plan: weights %.1f MiB, workspace %.1f MiB for %d "
             "tokens/step and logits of %d sequences, KV %.1f MiB = %d blocks x %d tokens (%s, "
             "%d tokens); max_model_len %d",
             mdesc, td_pool_size(e->pool) - td_pool_guests(e->pool), cpu_isa_name(cpu_get_isa()),
             (double)e->model->weight_bytes / 1048576.0,
             (double)(e->fwd.workspace_bytes +
                      (size_t)e->max_num_seqs * (size_t)e->model->shape.n_vocab * sizeof(float)) /
                 1048576.0,
             e->max_batched, e->max_num_seqs, (double)e->kv.total_bytes / 1048576.0, e->kv.n_blocks,
             e->kv.block_size, td_type_name(e->kv.dtype), e->kv.n_blocks * e->kv.block_size,
             e->max_model_len);
    if (e->lend.board) {
        size_t n = strlen(buf);
        snprintf(buf + n, cap > n ? cap - n : 0,
                 "; lends its CPUs while idle and may borrow %d idle CPU%s (--cpu-board)",
                 e->lend.n_guests, e->lend.n_guests == 1 ? "" : "s");
    }
    if (e->fwd.ep) {
        int lo, hi;
        td_ep_experts(e->fwd.ep, e->fwd.ep_rank, e->model->shape.n_expert, &lo, &hi);
        size_t n = strlen(buf);
        snprintf(buf + n, cap > n ? cap - n : 0,
                 "; expert parallelism: rank %d of %d holds experts %d..%d (the others' %.1f MiB given "
                 "back), exchange %.1f MiB (in the workspace)",
                 e->fwd.ep_rank, td_ep_size(e->fwd.ep), lo, hi - 1, (double)e->ep_dropped / 1048576.0,
                 (double)e->fwd.moe.ep_bytes / 1048576.0);
    }
}

bool td_engine_has_work(const td_engine *e)
{
    return e->n_waiting > 0 || e->n_running > e->n_loading;
}

int td_engine_kv_loaded(td_engine *e, uint64_t id, int status, bool recompute, const char *msg,
                        int32_t first_token)
{
    return sched__kv_loaded(e, id, status, recompute, msg, first_token);
}

void td_engine_set_load_fn(td_engine *e, td_load_fn fn, void *user)
{
    e->load_fn = fn;
    e->load_user = user;
}

void td_engine_set_layer_fn(td_engine *e, td_layer_fn fn, void *user)
{
    e->layer_fn = fn;
    e->layer_user = user;
}

void td_engine_idle(td_engine *e)
{
    lend__end(e, true);
}

int td_engine_kv_release(td_engine *e, uint64_t id)
{
    return sched__kv_release(e, id);
}

void td_engine_kv_info(const td_engine *e, td_kv_info *out)
{
    const td_model_shape *s = &e->model->shape;
    memset(out, 0, sizeof(*out));
    out->model_fingerprint = e->model->fingerprint;
    out->n_layers = e->kv.n_layers;
    out->n_kv_heads = s->n_head_kv;
    out->head_dim = e->kv.kv_dim / (s->n_head_kv ? s->n_head_kv : 1);
    out->block_size = e->kv.block_size;
    out->kv_dtype = (int)e->kv.dtype;
    out->kv_dtype_name = td_type_name(e->kv.dtype);
    out->base = e->kv.base;
    out->layer_bytes = e->kv.layer_bytes;
    out->block_bytes = e->kv.block_bytes;
    out->n_blocks = e->kv.n_blocks;
    out->shm_fd = e->kv.fd;
    out->block_crc = e->kv.crc;
    out->block_crc_ok = e->kv.crc_ok;
    if (e->cuda) {
        out->base = e->kv_dev.base;
        out->shm_fd = -1;
        out->block_crc = NULL;
        out->block_crc_ok = NULL;
        out->device = true;
        out->device_id = e->kv_dev.id;
        memcpy(out->ipc_handle, e->kv_dev.ipc_handle, 64);
        memcpy(out->device_uuid, e->kv_dev.uuid, 16);
    }
}

int td_engine_num_running(const td_engine *e)
{
    return e->n_running;
}

int td_engine_num_waiting(const td_engine *e)
{
    return e->n_waiting;
}

void td_engine_get_stats(const td_engine *e, td_engine_stats *st)
{
    *st = e->stats;
    st->num_blocks_total = e->kv.n_blocks;
    st->num_blocks_free = e->kv.n_free;
    st->num_blocks_cached = e->kv.n_cached;
    st->num_loading = e->n_loading;
    st->moe_expert_runs = e->fwd.moe_expert_runs;
    st->ep_exchange_bytes = e->fwd.moe.ep_bytes;
}

static char *xstrdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/*
 * A live request is always in exactly one of the two lists, so giving both room for every
 * live request here, when one is added, means the step can move requests between them
 * (admission, preemption) without ever allocating.
 */
static int reserve_lists(td_engine *e, int n)
{
    if (n <= e->cap_waiting && n <= e->cap_running) return 0;
    int cap = TD_MAX(16, TD_MAX(e->cap_waiting, e->cap_running) * 2);
    while (cap < n) cap *= 2;
    req **w = realloc(e->waiting, (size_t)cap * sizeof(req *));
    if (!w) return TD_ENOMEM;
    e->waiting = w;
    e->cap_waiting = cap;
    req **r = realloc(e->running, (size_t)cap * sizeof(req *));
    if (!r) return TD_ENOMEM;
    e->running = r;
    e->cap_running = cap;
    return 0;
}

int td_engine_add_request(td_engine *e, uint64_t *out_id, const int32_t *prompt, int n_prompt,
                          const td_sampling *sp, td_err *err)
{
    return td_engine_add_request_kv(e, out_id, prompt, n_prompt, sp, NULL, err);
}

int td_engine_add_request_kv(td_engine *e, uint64_t *out_id, const int32_t *prompt, int n_prompt,
                             const td_sampling *sp, const td_request_kv *kv, td_err *err)
{
    const int n_vocab = e->model->shape.n_vocab;
    if (kv && kv->hold && kv->remote)
        return td_err_set(err, TD_EINVAL, "a request cannot both hold its KV and load it remotely");
    if (kv && kv->remote && (kv->first_token < -1 || kv->first_token >= n_vocab))
        return td_err_set(err, TD_EINVAL, "the remote first token %d is outside the vocabulary [0, %d)",
                          kv->first_token, n_vocab);
    if (n_prompt < 1) return td_err_set(err, TD_EINVAL, "the prompt is empty");
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= n_vocab)
            return td_err_set(err, TD_EINVAL, "prompt token %d is %d, outside the vocabulary [0, %d)",
                              i, prompt[i], n_vocab);
    if (sp->max_tokens < 1)
        return td_err_set(err, TD_EINVAL, "max_tokens must be >= 1, got %d", sp->max_tokens);
    if (n_prompt >= e->max_model_len)
        return td_err_set(err, TD_ETOOLARGE,
                          "the prompt has %d tokens; this model's maximum context length is %d "
                          "tokens, and at least one must be left to generate",
                          n_prompt, e->max_model_len);
    int64_t total = (int64_t)n_prompt + sp->max_tokens;
    if (total > e->max_model_len)
        return td_err_set(err, TD_ETOOLARGE,
                          "this model's maximum context length is %d tokens; the request asks for "
                          "%d prompt + %d completion tokens",
                          e->max_model_len, n_prompt, sp->max_tokens);
    int64_t blocks = (total + e->kv.block_size - 1) / e->kv.block_size;
    if (blocks > e->kv.n_blocks)
        return td_err_set(err, TD_ETOOLARGE,
                          "the request needs up to %lld KV blocks but the whole cache has %d; "
                          "lower max_tokens or raise --kv-cache-memory",
                          (long long)blocks, e->kv.n_blocks);
    sampler_params spp = {sp->temperature, sp->top_k, sp->top_p, sp->min_p};
    int rc = sampler_check(&spp, err);
    if (rc) return rc;
    if (sp->logprobs < 0 || sp->logprobs > TD_MAX_LOGPROBS)
        return td_err_set(err, TD_EINVAL, "logprobs must be in [0, %d], got %d", TD_MAX_LOGPROBS,
                          sp->logprobs);
    for (int i = 0; i < sp->n_stop_token_ids; i++)
        if (sp->stop_token_ids[i] < 0 || sp->stop_token_ids[i] >= n_vocab)
            return td_err_set(err, TD_EINVAL, "stop_token_ids[%d] = %d is outside the vocabulary", i,
                              sp->stop_token_ids[i]);
    for (int i = 0; i < sp->n_stop; i++)
        if (!sp->stop[i] || !sp->stop[i][0] || strlen(sp->stop[i]) > 256)
            return td_err_set(err, TD_EINVAL, "stop[%d] must be a non-empty string of at most 256 bytes", i);

    if (!(sp->presence_penalty >= -2 && sp->presence_penalty <= 2) ||
        !(sp->frequency_penalty >= -2 && sp->frequency_penalty <= 2))
        return td_err_set(err, TD_EINVAL,
                          "presence_penalty and frequency_penalty must be in "
                          "[-2, 2]");
    if (!(sp->repetition_penalty >= 0 && sp->repetition_penalty <= 10))
        return td_err_set(err, TD_EINVAL, "repetition_penalty must be in (0, 10], got %g",
                          (double)sp->repetition_penalty);
    if (sp->n_logit_bias < 0 || sp->n_logit_bias > TD_MAX_LOGIT_BIAS ||
        (sp->n_logit_bias && (!sp->logit_bias_ids || !sp->logit_bias)))
        return td_err_set(err, TD_EINVAL, "logit_bias may hold at most %d tokens",
                          TD_MAX_LOGIT_BIAS);
    for (int i = 0; i < sp->n_logit_bias; i++) {
        if (sp->logit_bias_ids[i] < 0 || sp->logit_bias_ids[i] >= n_vocab)
            return td_err_set(err, TD_EINVAL,
                              "logit_bias: token %d is outside the vocabulary "
                              "(%d tokens)",
                              sp->logit_bias_ids[i], n_vocab);
        if (!(sp->logit_bias[i] >= -100 && sp->logit_bias[i] <= 100))
            return td_err_set(err, TD_EINVAL, "logit_bias values must be in [-100, 100]");
    }
    req *r = calloc(1, sizeof(*r));
    if (!r) return td_err_set(err, TD_ENOMEM, "out of memory");
    r->id = ++e->next_id;
    r->cap_tokens = (int)total;
    r->tokens = malloc((size_t)total * sizeof(int32_t));
    r->cap_blocks = (int)blocks;
    r->blocks = malloc((size_t)blocks * sizeof(int32_t));
    r->block_hash = calloc((size_t)blocks, sizeof(uint64_t));
    r->n_stop_ids = sp->n_stop_token_ids;
    r->stop_ids = malloc((size_t)(sp->n_stop_token_ids + 1) * sizeof(int32_t));
    r->n_stop = sp->n_stop;
    r->stop = calloc((size_t)sp->n_stop + 1, sizeof(char *));
    if (!r->tokens || !r->blocks || !r->block_hash || !r->stop_ids || !r->stop) goto oom;
    memcpy(r->tokens, prompt, (size_t)n_prompt * sizeof(int32_t));
    if (sp->n_stop_token_ids)
        memcpy(r->stop_ids, sp->stop_token_ids, (size_t)sp->n_stop_token_ids * sizeof(int32_t));
    for (int i = 0; i < sp->n_stop; i++) {
        if (!(r->stop[i] = xstrdup(sp->stop[i]))) goto oom;
        r->max_stop_len = TD_MAX(r->max_stop_len, (int)strlen(sp->stop[i]));
    }
    r->n_tokens = r->n_prompt = n_prompt;
    r->sp = spp;
    r->max_tokens = sp->max_tokens;
    r->ignore_eos = sp->ignore_eos;
    r->include_stop_str = sp->include_stop_str_in_output;
    r->skip_special = sp->skip_special_tokens;
    r->logprobs = sp->logprobs;
    /* A temperature too small to divide by is greedy (vLLM's 1e-5), on every device. */
    if (r->sp.temperature < 1e-5f) r->sp.temperature = 0;
    r->repetition = sp->repetition_penalty > 0 ? sp->repetition_penalty : 1.0f;
    r->frequency = sp->frequency_penalty;
    r->presence = sp->presence_penalty;
    if (sp->n_logit_bias) {
        r->bias_ids = malloc((size_t)sp->n_logit_bias * sizeof(int32_t));
        r->bias = malloc((size_t)sp->n_logit_bias * sizeof(float));
        if (!r->bias_ids || !r->bias) goto oom;
        memcpy(r->bias_ids, sp->logit_bias_ids, (size_t)sp->n_logit_bias * sizeof(int32_t));
        memcpy(r->bias, sp->logit_bias, (size_t)sp->n_logit_bias * sizeof(float));
        r->n_bias = sp->n_logit_bias;
    }
    r->penalized = r->n_bias || r->repetition != 1.0f || r->frequency != 0 || r->presence != 0;
    r->forced_token = -1;
    if (kv) {
        r->hold = kv->hold;
        r->remote = kv->remote;
        r->first_token = kv->first_token;
        r->stream_layers = kv->stream_layers && kv->hold;
    }
    r->t_arrival = td_now_s();
    td_rng_seed(&r->rng, sp->has_seed ? sp->seed : td_rng_next(&e->rng));
    tok_stream_init(&r->ts, e->tok, sp->skip_special_tokens);
    if (reserve_lists(e, e->n_waiting + e->n_running + 1) != 0) goto oom;
    e->waiting[e->n_waiting++] = r;
    if (out_id) *out_id = r->id;
    return 0;
oom:
    req__free(r);
    return td_err_set(err, TD_ENOMEM, "out of memory");
}

static int find_in(req **list, int n, uint64_t id)
{
    for (int i = 0; i < n; i++)
        if (list[i]->id == id) return i;
    return -1;
}

int td_engine_abort(td_engine *e, uint64_t id)
{
    int i = find_in(e->waiting, e->n_waiting, id);
    if (i >= 0) {
        req *r = e->waiting[i];
        memmove(&e->waiting[i], &e->waiting[i + 1], (size_t)(e->n_waiting - i - 1) * sizeof(req *));
        e->n_waiting--;
        sched__finish(e, r, TD_FINISH_ABORT, NULL);
        return 0;
    }
    i = find_in(e->running, e->n_running, id);
    if (i >= 0) {
        req *r = e->running[i];
        if (r->state == REQ_LOADING) { /* its blocks are being written: end it after the copy */
            r->abort_pending = true;
            return 0;
        }
        memmove(&e->running[i], &e->running[i + 1], (size_t)(e->n_running - i - 1) * sizeof(req *));
        e->n_running--;
        sched__finish(e, r, TD_FINISH_ABORT, NULL);
        return 0;
    }
    return TD_ENOTFOUND;
}

bool td_engine_poll(td_engine *e, td_output *out)
{
    if (e->next_out >= e->n_outs) return false;
    out_rec *o = &e->outs[e->next_out++];
    *out = o->out;
    out->text = e->arena ? e->arena + o->text_off : "";
    out->error = o->out.finish == TD_FINISH_ERROR ? o->error : NULL;
    out->top_ids = o->top_ids;
    out->top_logprobs = o->top_logprobs;
    return true;
}
