/*
 * tandem/engine.h - the inference engine's public C API.
 *
 * An engine owns a model, a paged KV cache and a scheduler. The caller adds
 * requests (prompt token ids + sampling parameters), calls td_engine_step() in a
 * loop, and drains outputs with td_engine_poll() after each step. Every request
 * ends with exactly one output whose `finish` is not TD_FINISH_NONE: a stop, a
 * length limit, an abort or an error. After that output its id is forgotten and
 * every KV block it held has been returned.
 *
 * Threading: an engine belongs to one thread at a time; the server runs it on
 * its own thread and talks to it through queues. The engine knows nothing of
 * HTTP or sockets.
 */
#ifndef TANDEM_ENGINE_H
#define TANDEM_ENGINE_H

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/td.h"

typedef struct td_engine td_engine;
typedef struct td_model td_model;
typedef struct td_tokenizer td_tokenizer;

typedef struct td_engine_config {
    const char *model_path;      /* GGUF file (NULL allowed with load_format "dummy") */
    const char *load_format;     /* "auto" (default), "gguf", "dummy" */
    const char *dummy_preset;    /* shape for "dummy" without a file: tiny, llama-134m, ... */
    const char *dummy_type;      /* weight type for "dummy": f32 (default), f16, bf16, q8_0, q4_0 */
    uint64_t seed;               /* dummy weights and requests without their own seed */
    int n_threads;               /* compute threads, 0 = all available CPUs */
    bool pin_threads;            /* pin compute threads to CPUs (default true) */
    const char *cpus;            /* the compute threads' CPUs, e.g. "0-3,8" (one thread each;
                                    NULL: the first n_threads CPUs this process may use) */
    const char *cpu_board;       /* a CPU board file (util/cpuboard.h) shared with the other
                                    engines of this host: this engine lends its CPUs while it
                                    is idle, and borrows the idle ones of the others among the
                                    CPUs it may use; NULL: off */
    int block_size;              /* tokens per KV block (default 16) */
    const char *kv_cache_dtype;  /* "f32", "f16" (default), "bf16", "fp8" ("fp8_e4m3") */
    uint64_t kv_cache_memory;    /* bytes for KV blocks; 0 = default (see engine.c) */
    int max_num_seqs;            /* running sequences per step (default 64) */
    int max_num_batched_tokens;  /* tokens per step, prefill chunks + decodes (default 512) */
    int max_model_len;           /* context limit; 0 = the model's trained context */
    bool enable_prefix_caching;  /* default true */
    bool kv_shareable;           /* put the KV pool in a memfd (td_kv_info.shm_fd) so that a
                                    same-host transfer peer can map it */
    bool kv_prefault;            /* commit the whole KV pool at start-up (KV transfer roles:
                                    copies into fresh blocks then pay no page faults) */
    bool weights_prefault;       /* map every page of a memory-mapped model at start-up (a
                                    server: the first request would otherwise fault them in,
                                    ~150 ms for llama-134m f16); ignored with expert
                                    parallelism */
    bool kv_checksums;           /* keep a CRC32C of every full block as it is written
                                    (td_kv_info.block_crc), for a KV producer's transfers */
    const char *device;          /* "cpu" (default), "cuda" or "cuda:N": where the forward pass, the
                                    weights and the KV pool live (cuda: built with
                                    -DTANDEM_CUDA=ON, and a GPU present) */
    struct td_ep_group *ep;      /* expert parallelism (tandem/ep.h): the group this engine is
                                    rank ep_rank of; NULL: it runs every expert itself */
    int ep_rank;
} td_engine_config;

/** Fill defaults. */
void td_engine_config_default(td_engine_config *cfg);

/**
 * The GPU a --device string names: "cuda" is GPU 0, "cuda:N" GPU N (0..63); -1 for "cpu"
 * (or NULL), -2 for anything else.
 */
int td_device_gpu(const char *device);

/** Load the model, plan memory (weights, workspace, KV pool) and start threads. */
int td_engine_create(td_engine **out, const td_engine_config *cfg, td_err *err);
void td_engine_free(td_engine *e);

const td_model *td_engine_model(const td_engine *e);
const td_tokenizer *td_engine_tokenizer(const td_engine *e);
/**
 * The CPUs the engine's compute threads are pinned to (the thread that steps the engine
 * takes the first when it first steps); returns their count, 0 when it does not pin or
 * computes on a GPU.
 * Other threads of the process (HTTP I/O, transfers) are best kept off them.
 */
int td_engine_cpus(const td_engine *e, cpu_set_t *set);
int td_engine_max_model_len(const td_engine *e);
/** A one-paragraph description of the memory plan (for logs and /v1/models). */
void td_engine_describe(const td_engine *e, char *buf, size_t cap);

typedef struct td_sampling {
    float temperature; /* 0 (or below 1e-5) = greedy (default 1.0 via td_sampling_default) */
    int top_k;                  /* 0 = off */
    float top_p;                /* 1 = off */
    float min_p;                /* 0 = off */
    bool has_seed;
    uint64_t seed;              /* with has_seed: same seed, same output */
    int max_tokens;             /* tokens to generate (>= 1) */
    bool ignore_eos;            /* keep generating past EOS / end-of-generation tokens */
    const int32_t *stop_token_ids; /* copied at add time */
    int n_stop_token_ids;
    const char *const *stop;    /* stop strings, matched on the decoded text; copied */
    int n_stop;
    bool include_stop_str_in_output;
    bool skip_special_tokens;   /* default true: control tokens add no text */
    int logprobs;               /* 0: none; N in [1, TD_MAX_LOGPROBS]: log-probability of the
                                   sampled token and the N most likely tokens at each step */
    /* Changes to the logits before sampling, with OpenAI's and vLLM's meaning (0, 0, 1 and
     * no bias are off; 0 for repetition_penalty is off too). logit_bias adds to the given
     * tokens' logits (copied at add time; at most TD_MAX_LOGIT_BIAS, each in [-100, 100]);
     * repetition_penalty (in (0, 10]) divides a positive logit and multiplies a negative
     * one, once for each distinct token of the prompt and the output; frequency_penalty
     * subtracts its value once per occurrence in the output, presence_penalty once per
     * distinct token of the output (both in [-2, 2]). Log-probabilities are reported from
     * the logits before all of these, as vLLM reports them by default. */
    const int32_t *logit_bias_ids;
    const float *logit_bias;
    int n_logit_bias;
    float repetition_penalty, frequency_penalty, presence_penalty;
} td_sampling;

#define TD_MAX_LOGPROBS 20
#define TD_MAX_LOGIT_BIAS 1024

void td_sampling_default(td_sampling *sp);

/**
 * Queue a request. The prompt ids are copied. Fails at once (with a message
 * for the user) when the request can never run: empty prompt, ids outside the
 * vocabulary, prompt + max_tokens beyond max_model_len, more KV than the whole
 * pool, or bad sampling parameters.
 */
int td_engine_add_request(td_engine *e, uint64_t *out_id, const int32_t *prompt, int n_prompt,
                          const td_sampling *sp, td_err *err);

/* ---- prefill/decode disaggregation ---------------------------------------------
 * The engine moves no bytes itself. A producer (prefill) keeps a finished request's
 * prompt KV for someone else to read; a consumer (decode) lets the caller copy a prompt's
 * KV into blocks it allocated, then continues from the producer's first token. */

typedef struct td_request_kv {
    bool hold;           /* producer: at a normal end (stop or length) keep the prompt's KV
                            blocks until td_engine_kv_release(id) */
    bool remote;         /* consumer: the prompt's KV is loaded by the caller (kv_load) */
    int32_t first_token; /* with remote: the token the producer sampled; it is appended as
                            the first generated token, not sampled again. -1: not known
                            yet (push mode): td_engine_kv_loaded gives it */
    bool stream_layers;  /* producer, push mode: report the prompt's KV layer by layer as
                            it is computed (td_engine_set_layer_fn) */
} td_request_kv;

/**
 * Progress of one streaming request (td_request_kv.stream_layers) after one layer of one
 * step: its prompt's KV in that layer is final for tokens [0, n_done), held in blocks[0 ..
 * ceil(n_done / block_size)). A block past the last full one is final only once n_done ==
 * n_prompt. n_done 0 (layer -1): the request was preempted, its blocks went back to the
 * pool, and everything reported before is void.
 */
typedef struct td_layer_progress {
    uint64_t id;
    int n_done, n_prompt;
    const int32_t *blocks;
} td_layer_progress;

/**
 * Called on the engine's thread inside td_engine_step, right after layer `layer` stored
 * the K and V of a step that prefilled streaming requests (those listed), while the rest
 * of the step still runs: keep it short (queue the note, do not copy). NULL turns it off.
 */
typedef void (*td_layer_fn)(void *user, int layer, const td_layer_progress *p, int n);
void td_engine_set_layer_fn(td_engine *e, td_layer_fn fn, void *user);

/**
 * Called on the engine's thread inside td_engine_step, the moment a remote request gets
 * its blocks (the same facts as its kv_load output, which still follows at the next
 * poll), before the step's forward pass runs: a copy started here overlaps the step
 * instead of waiting for it. It must not call back into the engine. NULL turns it off.
 */
typedef void (*td_load_fn)(void *user, uint64_t id, const int32_t *blocks, int n_blocks,
                           int skip);
void td_engine_set_load_fn(td_engine *e, td_load_fn fn, void *user);

/** td_engine_add_request with a KV role; kv may be NULL (a plain request). */
int td_engine_add_request_kv(td_engine *e, uint64_t *out_id, const int32_t *prompt, int n_prompt,
                             const td_sampling *sp, const td_request_kv *kv, td_err *err);

/**
 * A remote request's copy ended. status 0: the KV is in place; the first token (the one
 * given at add time, or first_token here when that was -1) is emitted now and decoding
 * continues; first_token -1 keeps the one given at add time. Otherwise, with recompute the request computes its prompt
 * locally (still emitting the producer's first token), else it ends with TD_FINISH_ERROR
 * and msg. An abort that arrived during the copy takes effect here. TD_ENOTFOUND if id is
 * not loading.
 */
int td_engine_kv_loaded(td_engine *e, uint64_t id, int status, bool recompute, const char *msg,
                        int32_t first_token);

/** The caller's loop will not step this engine again (it stopped): give back the CPUs it
 *  borrowed and mark its own idle on the CPU board (--cpu-board), so that the other
 *  engines of the host use them and do not wait for them. */
void td_engine_idle(td_engine *e);
/** Give back the blocks that a held request kept. TD_ENOTFOUND if it holds none. */
int td_engine_kv_release(td_engine *e, uint64_t id);

/** What a transfer engine needs to know about the KV pool. */
typedef struct td_kv_info {
    uint64_t model_fingerprint;
    int n_layers, n_kv_heads, head_dim, block_size;
    int kv_dtype;              /* td_type of the elements */
    const char *kv_dtype_name; /* "f16", ... */
    void *base;                /* block b of layer l: base + l * layer_bytes + b * block_bytes */
    size_t layer_bytes, block_bytes;
    int n_blocks;
    int shm_fd;                /* the memfd of the pool (kv_shareable), else -1 */
    /* With kv_checksums: CRC32C of block b of layer l is block_crc[l * n_blocks + b], valid
     * while block_crc_ok[...] is 1 (the block is full and unchanged since). Written by the
     * engine thread; read them only for blocks that a request holds. Else both NULL. */
    const uint32_t *block_crc;
    const uint8_t *block_crc_ok;
    /* --device cuda (device true): base is the pool's device address, and a same-host
     * peer opens it by ipc_handle (a cudaIpcMemHandle_t) on the GPU with device_uuid
     * (ordinal device_id here); shm_fd is -1 and block_crc NULL. */
    bool device;
    int device_id;
    uint8_t ipc_handle[64];
    uint8_t device_uuid[16];
} td_kv_info;
void td_engine_kv_info(const td_engine *e, td_kv_info *out);

/** Abort a request; its final output (TD_FINISH_ABORT) appears at the next poll (for a
 *  remote request whose KV is being copied: after td_engine_kv_loaded).
 *  Returns TD_ENOTFOUND for an unknown or already finished id. */
int td_engine_abort(td_engine *e, uint64_t id);

/** True while any request is waiting or running. */
bool td_engine_has_work(const td_engine *e);
int td_engine_num_running(const td_engine *e);
int td_engine_num_waiting(const td_engine *e);

/**
 * Run one scheduler step: pick a batch (decodes first, then prefill chunks),
 * run the forward pass once over the whole flat batch, sample, and queue the
 * outputs. Returns the number of tokens processed (0 when idle), or a negative
 * error for a failure of the engine itself (requests then end with errors).
 */
int td_engine_step(td_engine *e, td_err *err);

typedef enum td_finish {
    TD_FINISH_NONE = 0,  /* not finished */
    TD_FINISH_STOP = 1,  /* EOS, a stop token or a stop string */
    TD_FINISH_LENGTH = 2,/* max_tokens or max_model_len */
    TD_FINISH_ABORT = 3, /* td_engine_abort */
    TD_FINISH_ERROR = 4, /* see `error` */
} td_finish;

const char *td_finish_name(td_finish f); /* "stop", "length", "abort", "error" */

typedef struct td_output {
    uint64_t id;
    int32_t token;        /* the new token, or -1 when this output only finishes */
    const char *text;     /* new text (complete UTF-8), valid until the next step */
    int text_len;
    /* Of text_len, the bytes at the end that come out only because the sequence ended
     * here: text held back as the start of a stop string, and U+FFFD for the bytes of an
     * unfinished character. A stream that goes on elsewhere (a KV producer's first token,
     * continued by a decode instance) has emitted text_len - text_flush_len bytes. */
    int text_flush_len;
    td_finish finish;
    const char *error;    /* message when finish == TD_FINISH_ERROR */
    int num_prompt_tokens;
    int num_cached_tokens;/* prompt tokens served from the prefix cache */
    int num_generated;    /* tokens generated so far, including this one */
    int num_preemptions;
    /* With td_sampling.logprobs = N > 0 and token >= 0: the sampled token's log-probability
     * under the model's distribution (temperature 1, before any filter), and the N most
     * likely tokens, best first. Valid until the next step. */
    float logprob;
    int n_top;
    const int32_t *top_ids;
    const float *top_logprobs;
    /* Timing (seconds, monotonic clock): when the request was added, first scheduled, and
     * produced its first token; 0 when not yet. t_kv_loaded: when a remote request's KV
     * arrived (td_engine_kv_loaded), 0 otherwise. */
    double t_arrival, t_first_scheduled, t_first_token, t_kv_loaded;
    /* Prefill/decode disaggregation (see td_request_kv):
     *  - kv_load (token -1, finish NONE): a remote request has its blocks. Copy the prompt's
     *    KV into kv_blocks[kv_skip .. n_kv_blocks) (the first kv_skip blocks are prefix-cache
     *    hits that already hold it), then call td_engine_kv_loaded exactly once.
     *  - the final output of a request added with hold: kv_blocks[0 .. n_kv_blocks) are the
     *    blocks that hold its prompt's KV, in order, kept until td_engine_kv_release
     *    (n_kv_blocks is 0 when nothing is held: the request ended by abort or error).
     * kv_blocks stays valid until the next step (load) or the release (hold). */
    bool kv_load;
    const int32_t *kv_blocks;
    int n_kv_blocks;
    int kv_skip;
} td_output;

/** Next queued output; returns false when none is left. Its pointers (text, top_ids,
 *  top_logprobs, kv_blocks) stay valid until the next td_engine_step, and also until the
 *  next td_engine_abort, which queues an output of its own: copy what you keep first. */
bool td_engine_poll(td_engine *e, td_output *out);

/* Steps by the tokens they computed: upper bounds 1, 2, 4, ..., 2^(TD_STEP_TOKEN_BUCKETS-1),
 * then one counter for more; and by their duration: td_step_seconds_bounds, then more. */
#define TD_STEP_TOKEN_BUCKETS 14
#define TD_STEP_TIME_BUCKETS 14
extern const double td_step_seconds_bounds[TD_STEP_TIME_BUCKETS];

/** Counters for metrics and tests. */
typedef struct td_engine_stats {
    int num_blocks_total;
    int num_blocks_free;     /* free or evictable (cached but unreferenced) */
    int num_blocks_cached;   /* blocks in the prefix cache index */
    uint64_t prefix_hits_tokens;
    uint64_t prefix_queries_tokens;
    uint64_t num_preemptions;
    uint64_t steps;
    uint64_t tokens_prefilled;
    uint64_t tokens_decoded;
    int num_loading;         /* remote requests whose KV is being copied in */
    int num_held;            /* finished requests whose KV is held for a consumer */
    int num_blocks_held;     /* blocks those hold */
    uint64_t kv_loads;       /* remote loads completed */
    uint64_t kv_load_failures;
    uint64_t kv_tokens_loaded;   /* prompt tokens whose KV was copied in */
    uint64_t kv_tokens_skipped;  /* remote prompt tokens found in the local prefix cache */
    uint64_t moe_expert_runs;    /* models with experts: experts run, summed over the layers of
                                    every step (each run reads that expert's weights once) */
    uint64_t ep_exchange_bytes;  /* expert parallelism: the exchange's buffers (apart from the
                                    KV pool and counted in the workspace) */
    uint64_t cpu_borrowed_runs;  /* cpu_board: parallel runs that had borrowed CPUs */
    uint64_t cpu_reclaims;       /* cpu_board: times this engine waited for its CPUs back */
    uint64_t cpu_reclaim_ns;     /* ... and for how long in all */
    /* Steps: each one's forward pass and sampling, timed. A prefill step computed prompt
     * tokens (with or without decode rows beside them); a decode step only decode rows. */
    uint64_t steps_prefill;
    uint64_t step_ns_prefill, step_ns_decode;
    uint64_t step_tokens_hist[TD_STEP_TOKEN_BUCKETS + 1];
    uint64_t step_time_hist[TD_STEP_TIME_BUCKETS + 1];
} td_engine_stats;

void td_engine_get_stats(const td_engine *e, td_engine_stats *st);

#endif
