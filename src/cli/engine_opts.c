/* cli/engine_opts.c - see engine_opts.h. */
#include "cli/engine_opts.h"

#include <stdio.h>
#include <string.h>

int engine_opts_register(engine_opts *o, cli_flag *f)
{
    td_engine_config d;
    td_engine_config_default(&d);
    memset(o, 0, sizeof(*o));
    o->load_format = d.load_format;
    o->dtype = d.dummy_type;
    o->kv_cache_dtype = d.kv_cache_dtype;
    o->threads = d.n_threads;
    o->block_size = d.block_size;
    o->max_num_seqs = d.max_num_seqs;
    o->max_num_batched_tokens = d.max_num_batched_tokens;
    o->max_model_len = d.max_model_len;
    o->seed = (int64_t)d.seed;
    o->log_level = "info";
    o->device = d.device;
    int n = 0;
    f[n++] = CLI_FLAG("model", CLI_FLAG_STR, &o->model,
                        "GGUF file, or a preset (tiny, llama-134m, llama-1b, llama3-8b) with "
                        "--load-format dummy");
    f[n++] = CLI_FLAG("load-format", CLI_FLAG_STR, &o->load_format,
                        "auto | gguf | dummy (random weights)");
    f[n++] = CLI_FLAG("dtype", CLI_FLAG_STR, &o->dtype,
                        "weight type for dummy weights: f32, f16, bf16, q8_0, q4_0");
    f[n++] = CLI_FLAG("threads", CLI_FLAG_INT, &o->threads, "compute threads (0 = all CPUs)");
    f[n++] = CLI_FLAG("no-pin-threads", CLI_FLAG_BOOL, &o->no_pin_threads,
                        "do not pin compute threads to CPUs");
    f[n++] = CLI_FLAG("cpus", CLI_FLAG_STR, &o->cpus,
                        "CPUs for the compute threads, one each, e.g. 0-3,8 (default: the "
                        "first --threads CPUs this process may use)");
    f[n++] = CLI_FLAG("cpu-board", CLI_FLAG_STR, &o->cpu_board,
                        "a file shared with the other engines of this host: lend this "
                        "engine's CPUs while it is idle, and borrow theirs (tandem up sets it)");
    f[n++] = CLI_FLAG("block-size", CLI_FLAG_INT, &o->block_size, "tokens per KV block (16)");
    f[n++] = CLI_FLAG("kv-cache-dtype", CLI_FLAG_STR, &o->kv_cache_dtype,
                        "f32 | f16 | bf16 | fp8 (default f16)");
    f[n++] = CLI_FLAG("kv-cache-memory", CLI_FLAG_SIZE, &o->kv_cache_memory,
                        "bytes for KV blocks, e.g. 2G (default: all sequences at full length, "
                        "at most 4 GiB and a quarter of RAM)");
    f[n++] = CLI_FLAG("max-num-seqs", CLI_FLAG_INT, &o->max_num_seqs,
                        "sequences per step (64)");
    f[n++] = CLI_FLAG("max-num-batched-tokens", CLI_FLAG_INT, &o->max_num_batched_tokens,
                        "tokens per step; longer prompts are prefilled in chunks (512)");
    f[n++] = CLI_FLAG("max-model-len", CLI_FLAG_INT, &o->max_model_len,
                        "context limit (0 = the model's)");
    f[n++] = CLI_FLAG("no-prefix-caching", CLI_FLAG_BOOL, &o->no_prefix_caching,
                        "disable the prefix cache");
    f[n++] = CLI_FLAG("seed", CLI_FLAG_INT, &o->seed,
                        "seed for dummy weights and unseeded sampling (0)");
    f[n++] = CLI_FLAG("log-level", CLI_FLAG_STR, &o->log_level, "debug | info | warn | error");
    f[n++] = CLI_FLAG("device", CLI_FLAG_STR, &o->device,
                        "cpu | cuda (the GPU backend, in builds with -DTANDEM_CUDA=ON)");
    return n;
}

static int int_in(const char *name, int64_t v, int64_t lo, int64_t hi)
{
    if (v < lo || v > hi) {
        fprintf(stderr, "error: --%s must be in [%lld, %lld], got %lld\n", name, (long long)lo,
                (long long)hi, (long long)v);
        return 2;
    }
    return 0;
}

int engine_opts_apply(const engine_opts *o, td_engine_config *c)
{
    td_log_level lvl;
    if (td_log_parse_level(o->log_level, &lvl) != 0) {
        fprintf(stderr, "error: --log-level must be debug, info, warn or error, got '%s'\n",
                o->log_level);
        return 2;
    }
    td_log_set_level(lvl);
    if (int_in("threads", o->threads, 0, 1024) || int_in("block-size", o->block_size, 1, 1024) ||
        int_in("max-num-seqs", o->max_num_seqs, 1, 4096) ||
        int_in("max-num-batched-tokens", o->max_num_batched_tokens, 1, 1 << 20) ||
        int_in("max-model-len", o->max_model_len, 0, 1 << 24) ||
        int_in("seed", o->seed, 0, INT64_MAX))
        return 2;
    td_engine_config_default(c);
    c->model_path = o->model;
    c->load_format = o->load_format;
    c->dummy_type = o->dtype;
    c->seed = (uint64_t)o->seed;
    c->n_threads = (int)o->threads;
    c->pin_threads = !o->no_pin_threads;
    c->cpus = o->cpus;
    c->cpu_board = o->cpu_board;
    c->block_size = (int)o->block_size;
    c->kv_cache_dtype = o->kv_cache_dtype;
    c->kv_cache_memory = o->kv_cache_memory;
    c->max_num_seqs = (int)o->max_num_seqs;
    c->max_num_batched_tokens = (int)o->max_num_batched_tokens;
    c->max_model_len = (int)o->max_model_len;
    c->enable_prefix_caching = !o->no_prefix_caching;
    c->device = o->device;
    if (!o->model && strcmp(o->load_format, "dummy") != 0) {
        fprintf(stderr, "error: --model is required\n");
        return 2;
    }
    return 0;
}
