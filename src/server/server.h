/*
 * server/server.h - `tandem serve`: the OpenAI-compatible engine server.
 *
 * Two threads. The I/O thread runs one libevent loop (evhttp): it parses and
 * validates requests, tokenizes prompts, renders chat templates, and writes
 * responses and SSE chunks. The engine thread owns the td_engine: it takes
 * add/abort commands from an inbox (mutex + condition variable), runs steps,
 * copies each step's outputs into an outbox and wakes the I/O loop once per step
 * through an eventfd. Neither thread ever touches the other's objects: the engine
 * thread knows nothing of HTTP, and the I/O thread never calls an engine function
 * except the read-only tokenizer.
 *
 * The request parser (srv_request_parse) is a pure function from bytes to a
 * parsed request or an OpenAI-style error, so it is unit-tested and fuzzed
 * without a server.
 */
#ifndef TD_SERVER_SERVER_H
#define TD_SERVER_SERVER_H

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvx/rails.h"
#include "tandem/engine.h"
#include "tandem/ep.h"

/* ---- request parsing (request.c) ---- */

typedef enum srv_endpoint {
    SRV_EP_COMPLETIONS = 0, /* POST /v1/completions */
    SRV_EP_CHAT = 1,        /* POST /v1/chat/completions */
} srv_endpoint;

/* Hard limits of the parser; anything beyond them is a 400 naming the field. */
#define SRV_MAX_JSON_DEPTH 32
#define SRV_MAX_PROMPTS 256   /* prompts in one batched request */
#define SRV_MAX_N 64          /* `n` */
#define SRV_MAX_CHOICES 256   /* prompts x n */
#define SRV_MAX_STOP 16       /* stop strings */
#define SRV_MAX_STOP_LEN 256  /* bytes per stop string */
#define SRV_MAX_MESSAGES 1024 /* chat messages */
#define SRV_MAX_DP 64         /* data-parallel ranks in one server */

/** One prompt: text (`text` non-NULL, NUL-terminated, valid UTF-8) or token ids. */
typedef struct srv_prompt {
    char *text;
    size_t text_len;
    int32_t *ids;
    int n_ids;
} srv_prompt;

typedef struct srv_chat_msg {
    char *role;    /* system | user | assistant ("developer" is read as system) */
    char *content; /* text parts joined; "" for null content */
} srv_chat_msg;

/** A parsed request. Every pointer is owned by the struct (srv_request_free). */
typedef struct srv_request {
    srv_endpoint endpoint;
    srv_prompt *prompts; /* completions: [n_prompts] */
    int n_prompts;
    srv_chat_msg *messages; /* chat: [n_messages] */
    int n_messages;
    char *model;        /* NULL when absent */
    int max_tokens;     /* -1 when absent (the server picks the default) */
    double temperature; /* default 1 */
    double top_p;       /* default 1 */
    int top_k;          /* 0 (or -1 in the request) = off */
    double min_p;       /* default 0 */
    bool has_seed;
    uint64_t seed;
    char **stop;
    int n_stop;
    bool stream, include_usage, ignore_eos, echo;
    int n;        /* choices per prompt, default 1 */
    int logprobs; /* -1: none; else top-N alternatives (0..TD_MAX_LOGPROBS) */
    /* Logit changes (td_sampling's): 0, 0, 1 and no bias when absent */
    double presence_penalty, frequency_penalty, repetition_penalty;
    int32_t *logit_bias_ids; /* [n_logit_bias], malloc'd */
    float *logit_bias;
    int n_logit_bias;
    char *user;
    int dp_rank; /* data_parallel_rank: the rank that must serve it, -1 when absent */
    void *kv_transfer_params; /* a cJSON object (owned) or NULL, echoed back as given */
} srv_request;

/** An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}. */
typedef struct srv_error {
    int status;       /* HTTP status */
    const char *type; /* "invalid_request_error", ... (static string) */
    char param[64];   /* the offending field, or "" */
    char message[320];
} srv_error;

/**
 * Parse and validate a request body. Pure: no I/O, no globals. Checks valid UTF-8,
 * JSON nesting depth, that the body is an object, every known field's type and
 * range (unknown fields are ignored). Returns 0 and fills `out`, or a negative
 * code and fills `err` (status 400). On error `out` holds nothing to free.
 */
int srv_request_parse(srv_request *out, srv_endpoint ep, const char *body, size_t len,
                      srv_error *err);
void srv_request_free(srv_request *r);

/**
 * kv_transfer_params of a request, as the PD contract (docs/ARCHITECTURE.md) defines
 * them. decode: do_remote_decode (this server is the producer); prefill:
 * do_remote_prefill (this server is the consumer; the remaining fields are then
 * required and checked). Optional fields are -1 or "" when absent.
 */
typedef struct srv_kv_params {
    bool decode, prefill;
    bool write; /* transfer_mode "write" (push): decode gets host, port, engine id and
                   transfer_id only; prefill gets transfer_id (required) */
    bool first_token_streamed; /* decode: the router already streamed the first token's
                                  text (and the chat role): the stream starts after it */
    char host[256];
    int port;
    char engine_id[33], transfer_id[33];
    int32_t *blocks; /* malloc'd (srv_kv_params_free) */
    int n_blocks;
    int first_token;
    int num_prompt_tokens;
    int block_size;      /* -1 when absent */
    char kv_dtype[24];   /* "" when absent */
    char fingerprint[24];/* "" when absent */
    int lease_ms;        /* -1 when absent */
    double prod_queue_ms, prod_compute_ms; /* producer_timing, 0 when absent */
    /* The first token's log-probability and its alternatives, as the producer computed
     * them (first_token_logprob, first_token_top_logprobs: [[id, logprob], ...]); read
     * mode only, when the request asked for logprobs. */
    bool has_first_logprob;
    float first_logprob;
    int n_first_top;
    int32_t first_top_ids[TD_MAX_LOGPROBS];
    float first_top_logprobs[TD_MAX_LOGPROBS];
} srv_kv_params;

/**
 * Parse kv_transfer_params (a cJSON object from srv_request). Pure. Returns 0, or a
 * negative code with err filled (400, naming the field) for malformed fields. n_vocab
 * bounds first_token_id. Parameters asking for neither role parse to decode = prefill =
 * false.
 */
int srv_kv_params_parse(srv_kv_params *out, const void *kv_transfer_params, int n_vocab,
                        srv_error *err);
void srv_kv_params_free(srv_kv_params *p);

/** Fill an error record; returns TD_EINVAL. */
int srv_error_set(srv_error *err, int status, const char *type, const char *param, const char *fmt,
                  ...) __attribute__((format(printf, 5, 6)));

/* ---- KV transfer configuration (kvconfig.c) ---- */

typedef enum srv_kv_role {
    SRV_KV_NONE = 0,
    SRV_KV_PRODUCER,
    SRV_KV_CONSUMER,
    SRV_KV_BOTH,
} srv_kv_role;

typedef enum srv_kv_protocol {
    SRV_KV_TCP = 0,
    SRV_KV_SHM,
    SRV_KV_UCX,
    SRV_KV_CUDA_IPC,
} srv_kv_protocol;

typedef struct srv_kv_config {
    srv_kv_role role;
    char connector[64];     /* tandem (default), mooncake, moriio */
    srv_kv_protocol protocol; /* default tcp */
    bool write_mode;        /* transfer_mode: write (push); default read (pull) */
    int handshake_port;     /* -1 when not set */
    char ip[64];            /* kv_ip: the address the transfer agent binds and advertises */
    int port;               /* kv_port, -1 when not set */
    int rank, parallel_size;
    char buffer_device[32];
    uint64_t buffer_size;
    int num_worker_threads; /* default 4 */
    int qp_per_transfer;    /* default 4 */
    int lease_ms;           /* default 30000 */
    int transfer_timeout_ms;/* default 30000 */
    bool recompute;         /* kv_load_failure_policy: recompute (default) or fail */
    bool verify_checksums;  /* default true */
    char proxy_ip[64];      /* router registration (used by the router issue) */
    int proxy_ping_port, http_port; /* -1 when not set */
    char auth_token[256];   /* "" = none (TANDEM_KV_TOKEN is read by the caller) */
    /* MORI-IO tuning keys, accepted for the seed recipes; -1 when not set */
    int post_batch_size, max_send_wr, max_cqe_num, max_msg_sge;
    int enable_notification; /* -1 unset, 0, 1 */
    char notes[320];        /* what the parser accepted but will not use, for the startup log */
    char rail_device[64];   /* rail_device (alias ib_device): this engine's own transfer device */
    char matched_rails[1024]; /* matched_rails: "auto" or a comma list ("" = off) */
    bool rail_striping;       /* rail_striping: one transfer over every matched rail */
    kvx_rails rails;          /* resolved by srv_kv_rails (n 0: none) */
    bool rails_matched;
    void *extra; /* kv_connector_extra_config (cJSON object, owned) or NULL */
} srv_kv_config;

/**
 * Parse --kv-transfer-config. Unknown keys, wrong types, bad values and a missing
 * kv_role are errors written to err (one line naming the key).
 */
int srv_kv_config_parse(srv_kv_config *out, const char *json, char *err, size_t err_cap);
void srv_kv_config_free(srv_kv_config *c);

/**
 * Resolve the rails this engine's transfers use (c->rails, c->rails_matched) from the
 * config and the environment
 * (TANDEM_MATCHED_RAILS or ATOM_MOONCAKE_MATCHED_RAILS, TANDEM_RAIL_DEVICE or
 * ATOM_MOONCAKE_IB_DEVICE, TANDEM_RDMA_DEVICES or MORI_RDMA_DEVICES, and TANDEM_SYSFS_ROOT
 * for tests), against sysfs. rails.n 0: no rails; rails_matched: matched rails (else one
 * device). Conflicting settings, a missing or inactive device and a protocol other
 * than tcp are errors. Also applies the RDMA service level and traffic class variables
 * (TANDEM_RDMA_SL / MORI_RDMA_SL, TANDEM_RDMA_TC / MORI_RDMA_TC) to UCX's.
 */
int srv_kv_rails(srv_kv_config *c, char *err, size_t cap);
/** TANDEM_HOST_IP (or ATOM_HOST_IP): the control address to use when kv_ip is not set. */
const char *srv_kv_host_ip(void);
const char *srv_kv_role_name(srv_kv_role r);
const char *srv_kv_protocol_name(srv_kv_protocol p);

/* ---- chat templates (chat.c) ---- */

typedef enum srv_chat_family {
    SRV_CHAT_NONE = 0, /* no template: chat requests get a 400 */
    SRV_CHAT_UNKNOWN,  /* a template we cannot render: chat requests get a 400 */
    SRV_CHAT_CHATML,
    SRV_CHAT_LLAMA2,
    SRV_CHAT_LLAMA3,
    SRV_CHAT_ZEPHYR,
    SRV_CHAT_MISTRAL,
} srv_chat_family;

/** Family by name (chatml, llama-2, llama-3, zephyr, mistral); -1 when unknown. */
int srv_chat_family_by_name(const char *name);
const char *srv_chat_family_name(srv_chat_family f);
/** What a family's template adds beyond the messages (srv_chat_detect_ex reads it). */
typedef struct srv_chat_extras {
    char default_system[512]; /* chatml: the system turn written when the messages have
                                 none (Qwen2.5's "You are Qwen, ..."); "" for none */
    char date[32];            /* llama-3.1 and later: the system turn's "Cutting Knowledge
                                 Date" header, with this "Today Date"; "" for none */
} srv_chat_extras;

/** Detect the family from a Jinja template's text by its markers. */
srv_chat_family srv_chat_detect(const char *tmpl, size_t len);
/** The same, with what the template adds (x zeroed first). A chatml template whose
 *  generation prompt opens a reasoning block (<think>) or whose default system turn is
 *  not plain text is UNKNOWN: rendered as plain chatml, its prompt would be wrong. */
srv_chat_family srv_chat_detect_ex(const char *tmpl, size_t len, srv_chat_extras *x);
/**
 * Render messages as a prompt ending with the assistant's turn opened. The result
 * is malloc'd (caller frees) and carries no BOS: the tokenizer adds it. Returns
 * NULL with err filled for an unsupported role or family.
 */
char *srv_chat_render(srv_chat_family f, const srv_chat_msg *msgs, int n, srv_error *err);
/** The same, with the template's extras (NULL: none). */
char *srv_chat_render_ex(srv_chat_family f, const srv_chat_extras *x, const srv_chat_msg *msgs,
                         int n, srv_error *err);

/* ---- the server (http.c, engine_thread.c, metrics.c) ---- */

typedef struct srv_config {
    const char *host;              /* default 0.0.0.0 */
    int port;                      /* 0 = an ephemeral port */
    const char *served_model_name; /* default: the model's name */
    const char *model_path;        /* reported by /server_info */
    const char *chat_template;     /* a family name, or NULL to detect from the GGUF */
    int max_queue;                 /* waiting requests beyond max_num_seqs; then 429 */
    size_t max_body_size;          /* bytes; larger bodies get 413 */
    bool enable_debug_endpoints;   /* POST /debug/stop_engine */
    int debug_step_delay_ms;       /* sleep after each step (tests of disconnects) */
    double health_stall_s;         /* /health is 503 when work waits this long without a step */
    double shutdown_timeout_s;     /* on SIGTERM/SIGINT, drain this long at most (0: exit now) */
    int tp_size, dp_size;
    int block_size;
    int max_num_seqs; /* the engine's, for the queue limit */
    const char *kv_cache_dtype;
    const srv_kv_config *kv; /* may be NULL */
    /* Data-parallel ranks: the CPUs each rank's engine thread may run on ([n_ranks]), or
     * NULL to inherit the caller's. */
    const cpu_set_t *rank_cpus;
    /* Expert parallelism: the group the ranks' engines were created in (the caller's; it
     * outlives the server), or NULL. */
    td_ep_group *ep;
} srv_config;

void srv_config_default(srv_config *c);

typedef struct srv_server srv_server;

/**
 * Start serving n_ranks engines that the caller created, one per data-parallel rank (1:
 * an ordinary server), all of the same model and settings. The server takes ownership of
 * the engines, whether it starts or not (each moves to its own engine thread and is freed
 * by srv_server_free). Binds and prints "listening on HOST:PORT" to stderr.
 */
int srv_server_create(srv_server **out, td_engine *const *engines, int n_ranks, const srv_config *cfg,
                      td_err *err);
/** Run the I/O loop until SIGINT/SIGTERM or srv_server_stop. */
int srv_server_run(srv_server *s);
/** Thread-safe: make srv_server_run return. */
void srv_server_stop(srv_server *s);
void srv_server_free(srv_server *s);
int srv_server_port(const srv_server *s);

#endif
