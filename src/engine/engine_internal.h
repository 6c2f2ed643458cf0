/*
 * engine/engine_internal.h - the engine's private state, shared by engine.c
 * (lifecycle, API) and sched.c (scheduling, outputs). Nothing outside
 * src/engine/ includes this.
 */
#ifndef TD_ENGINE_INTERNAL_H
#define TD_ENGINE_INTERNAL_H

#include "engine/forward.h"
#include "engine/kvcache.h"
#include "engine/sampler.h"
#include "model/model.h"
#include "model/tok.h"
#include "tandem/engine.h"

/* LOADING: a remote request that has its blocks and waits for td_engine_kv_loaded; it
 * is in the running list (it holds blocks) but is never scheduled or preempted. */
typedef enum req_state { REQ_WAITING = 0, REQ_RUNNING = 1, REQ_LOADING = 2 } req_state;

typedef struct req {
    uint64_t id;
    req_state state;
    int32_t *tokens;    /* prompt then generated tokens [cap_tokens] */
    int n_tokens, n_prompt, cap_tokens;
    int n_computed;     /* tokens whose K/V are in the cache */
    int32_t *blocks;    /* block table [cap_blocks] */
    int n_blocks, cap_blocks;
    uint64_t *block_hash; /* chain hash of each full block [cap_blocks], 0 = not yet */
    int n_hashed;       /* blocks whose hash has been computed */
    int n_cached_prompt;/* prompt tokens found in the prefix cache at first admission */
    int n_preemptions;
    bool admitted_once;
    bool finished;      /* ended during this step; freed at the end of the step */

    sampler_params sp;
    td_rng rng;
    int max_tokens;
    bool ignore_eos, include_stop_str, skip_special;
    int32_t *stop_ids;
    int n_stop_ids;
    char **stop;
    int n_stop;
    int max_stop_len;

    tok_stream ts;
    char *text;         /* all generated text, for stop-string matching */
    size_t text_len, text_cap;
    size_t emitted;     /* bytes of text already given to the caller */
    int n_generated;
    int logprobs;       /* top-N log-probabilities wanted per step (0 = none) */
    /* td_sampling's logit changes; `penalized` when any is on (sched.c: penalize) */
    bool penalized;
    int32_t *bias_ids;
    float *bias;
    int n_bias;
    float repetition, frequency, presence;
    double t_arrival, t_first_scheduled, t_first_token, t_kv_loaded;

    /* disaggregation (td_request_kv) */
    bool hold;           /* producer: keep the prompt's blocks at a normal end */
    bool remote;         /* consumer: KV comes from the caller, until loaded */
    bool abort_pending;  /* aborted while LOADING: ends when the copy ends */
    int32_t first_token; /* remote: the producer's token */
    int32_t forced_token;/* recompute after a failed load: emit this instead of sampling */
    bool stream_layers;  /* producer, push mode: layer progress goes to layer_fn */
    int kv_skip;         /* remote: blocks found in the local prefix cache */
} req;

/* A finished request's prompt blocks kept for a consumer (td_request_kv.hold). */
typedef struct kv_hold {
    uint64_t id;
    int32_t *blocks;
    int n_blocks;
} kv_hold;

/* One queued output: text lives in the engine's output arena at text_off. */
typedef struct out_rec {
    td_output out;
    size_t text_off;
    char error[160];
    int32_t top_ids[TD_MAX_LOGPROBS];
    float top_logprobs[TD_MAX_LOGPROBS];
} out_rec;

struct td_engine {
    td_engine_config cfg;
    td_model *model;
    td_tokenizer *tok;
    td_pool *pool;
    kv_pool kv;
    size_t ep_dropped; /* expert parallelism: bytes of the other ranks' experts given back */
    fwd_ctx fwd;
    struct td_cuda_fwd *cuda; /* --device cuda: the forward pass on the GPU, else NULL */
    struct { /* with cuda: the device pool's export for KV transfers (td_engine_kv_info) */
        void *base;
        int id;
        uint8_t ipc_handle[64], uuid[16];
    } kv_dev;
    sampler_scratch *samp; /* one per pool thread: rows are sampled in parallel */
    int n_samp;
    int32_t *b_tok;        /* [max_num_seqs] the host-sampled rows' tokens of a step */
    int *b_samp_s;         /* [max_num_seqs] which scheduled request each such row is */
    td_rng rng;
    int max_model_len;
    int max_num_seqs, max_batched;
    uint64_t root_hash;  /* seeds the prefix-hash chain: model fingerprint + kv dtype */
    uint64_t next_id;

    req **waiting;       /* FIFO; preempted requests go back to the front */
    int n_waiting, cap_waiting;
    req **running;       /* in admission order */
    int n_running, cap_running;

    /* Per-step batch buffers, sized at start-up for max_batched tokens. */
    int32_t *b_tokens, *b_pos, *b_seq, *b_logit_rows;
    const int32_t **b_tables;
    req **b_reqs;        /* [max_num_seqs] scheduled requests */
    int *b_n;            /* [max_num_seqs] tokens scheduled for each */
    float *logits;       /* [max_num_seqs][n_vocab] */
    uint8_t *b_need;     /* [max_num_seqs] GPU: the host samples this logit row itself */
    int32_t *b_argmax;   /* [max_num_seqs] GPU: each logit row's token (greedy or sampled) */
    /* [max_num_seqs] GPU: how each logit row is sampled there (a td_cuda_sample) */
    struct td_cuda_sample *b_samp;

    out_rec *outs;
    int n_outs, cap_outs, next_out;
    char *arena;
    size_t arena_len, arena_cap;

    kv_hold *holds;
    int n_holds, cap_holds;
    int n_loading;       /* running requests in REQ_LOADING */

    td_load_fn load_fn;   /* td_engine_set_load_fn */
    void *load_user;
    td_layer_fn layer_fn; /* td_engine_set_layer_fn */
    void *layer_user;
    td_layer_progress *lp; /* [max_num_seqs] this step's streaming requests */
    int n_lp;

    struct { /* lend.c: CPUs lent and borrowed through a CPU board (cfg.cpu_board) */
        struct td_cpuboard *board;
        bool busy;    /* the home CPUs are marked busy */
        int n_guests; /* the pool's guest threads, one per CPU that may be borrowed */
        bool *on;     /* [n_guests] borrowed now */
        int n_on;
    } lend;

    td_engine_stats stats;
};

/* lend.c */
int lend__create_pool(td_engine *e, const td_engine_config *cfg, int n_threads, td_err *err);
void lend__begin(td_engine *e);
void lend__end(td_engine *e, bool idle);
void lend__free(td_engine *e);

/* sched.c */
void sched__release_blocks(td_engine *e, req *r);
void sched__finish(td_engine *e, req *r, td_finish why, const char *error);
int sched__step(td_engine *e, td_err *err);
int sched__kv_loaded(td_engine *e, uint64_t id, int status, bool recompute, const char *msg,
                     int32_t first_token);
int sched__kv_release(td_engine *e, uint64_t id);
void req__free(req *r);

#endif
