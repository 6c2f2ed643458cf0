/*
 * kvx/kvx.h - the KV transfer engine: moves byte ranges between memory regions that two
 * processes registered, and knows nothing of models or HTTP.
 *
 * Two objects:
 *  - kvx_agent (producer side): registers one region (its KV pool), listens on a TCP
 *    handshake port bound to one address, holds registered transfers under leases, and
 *    serves reads of them. A transfer_id is an unguessable capability (128 random bits).
 *  - kvx_client (consumer side): owns its own region, caches one session per producer
 *    incarnation (host, port, engine id), and runs reads asynchronously on its worker
 *    threads over several connections per peer.
 *
 * A region is generic: n_segments segments (one per layer for a KV pool) of
 * segment_stride bytes each; in every segment, block b occupies
 * [b * block_bytes, (b + 1) * block_bytes). Blocks with consecutive ids are contiguous,
 * so a transfer moves a few (segment, offset, length) ranges per run of consecutive ids.
 *
 * Threading contract:
 *  - every function here is thread safe, except *_destroy, which must not race with any
 *    other call on the same object;
 *  - callbacks (kvx_release_fn, kvx_done_fn) run on a kvx thread (or in the caller of
 *    kvx_agent_cancel / kvx_agent_destroy / kvx_client_destroy, or of kvx_xfer_wait,
 *    which runs the transfer's not yet started pieces itself, and the small held pieces
 *    of other will_wait transfers with them), with no kvx lock held;
 *    they must be short and must not call *_destroy of the object that invoked them.
 *    They may call kvx_agent_register / kvx_read_start etc.
 *  - the consumer's region memory of a transfer is written by kvx threads until the
 *    transfer completes (kvx_xfer_poll returns something other than TD_EAGAIN, or the
 *    done callback has run); only then may the caller read or reuse those blocks.
 *
 * Failure contract: every transfer ends, within its deadline plus a small slack, with 0
 * or a clear error: TD_ETIMEDOUT (deadline), TD_ECONN (connection refused or broken,
 * peer closed, producer restarted), TD_EPROTO (checksum mismatch, malformed frame,
 * layout mismatch), TD_ENOTFOUND (unknown or expired transfer id), TD_ECANCELED
 * (client destroyed). Never a hang.
 */
#ifndef TD_KVX_KVX_H
#define TD_KVX_KVX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/td.h"

/** 128-bit ids (engine ids, transfer ids) as 32 lowercase hex digits plus NUL. */
#define KVX_ID_BYTES 16
#define KVX_ID_HEX 33
/** The most bytes of a push transfer's note (kvx_agent_push_finish). */
#define KVX_MAX_NOTE 1024

/**
 * What both sides must agree on before any byte moves. Opaque integers to kvx: they are
 * only compared field by field, and a mismatch names the field and both values.
 */
typedef struct kvx_layout {
    uint64_t model_fingerprint;
    uint32_t n_layers;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t block_size; /* tokens per block */
    uint32_t kv_dtype;
    uint32_t tp_rank;
    uint32_t tp_size;
} kvx_layout;

/** A registered memory region (see the top of this file). Not owned by kvx. */
typedef struct kvx_region {
    void *base;
    uint32_t n_segments;     /* layers */
    uint64_t segment_stride; /* bytes from one segment to the next */
    uint64_t block_bytes;    /* bytes of one block in one segment */
    uint32_t n_blocks;       /* blocks per segment; n_blocks * block_bytes <= stride */
    /* Producer side, for the shm transport: the region lives in a memfd (shm_fd) at
     * shm_offset, so same-host consumers can map it. shm false: not shareable. */
    bool shm;
    int shm_fd;
    uint64_t shm_offset;
    /* Producer side, optional: checksums the region's owner keeps as it writes blocks.
     * block_crc[s * n_blocks + b] is the CRC32C of block b of segment s where
     * block_crc_ok[...] is 1; the agent sends those instead of reading the block again,
     * and computes the others. The owner may change an entry only while no transfer holds
     * that block. NULL: always computed when a consumer asks for checksums. */
    const uint32_t *block_crc;
    const uint8_t *block_crc_ok;
    /* The region is GPU memory (the CUDA backend's pool; base is a device pointer): the
     * host never reads it directly. cuda_ipc copies it device to device (no checksums:
     * the bytes never leave the GPUs' ECC-protected memory and links), and tcp stages it
     * through pinned host memory (checksummed there; CUDA builds). device_id is its CUDA
     * device. Producer side: ipc_handle is the cudaIpcMemHandle_t of the allocation
     * that starts at base (made by its owner), device_uuid the device's UUID, which a
     * consumer compares with the devices it can see. */
    bool device;
    int device_id;
    uint8_t ipc_handle[64];
    uint8_t device_uuid[16];
} kvx_region;

/** How a consumer moves bytes. The producer's agent serves every protocol it can. */
typedef enum kvx_protocol {
    KVX_PROTO_TCP = 0, /* several TCP connections per peer, scatter-gather */
    KVX_PROTO_SHM = 1, /* same host: copy out of the producer's memfd mapping */
    KVX_PROTO_UCX = 2, /* UCX get (RDMA where present; tcp/sm in tests); built with UCX */
    KVX_PROTO_CUDA_IPC = 3, /* same host, GPU memory: device-to-device copies out of the
                               producer's pool opened by CUDA IPC handle; built with CUDA */
} kvx_protocol;

/** "tcp", "shm", "ucx", "cuda_ipc". */
const char *kvx_protocol_name(kvx_protocol p);
/** Whether this build (and, for shm, this OS) supports a protocol. */
bool kvx_protocol_available(kvx_protocol p);

/**
 * Compare two layouts. Returns 0 when equal, else TD_EPROTO with a message naming the
 * first differing field and both values ("block_size: local 16, peer 32").
 */
int kvx_layout_compare(const kvx_layout *local, const kvx_layout *peer, td_err *err);

/** Check a region's geometry (non-NULL base, blocks fit in the stride, no overflow). */
int kvx_region_check(const kvx_region *r, td_err *err);

/** Hex-encode a 16-byte id into out[KVX_ID_HEX]; parse one back (0 or TD_EINVAL). */
void kvx_id_to_hex(const uint8_t id[KVX_ID_BYTES], char out[KVX_ID_HEX]);
int kvx_id_from_hex(const char *hex, uint8_t id[KVX_ID_BYTES]);

/* ---------------------------------------------------------------- descriptors */

/**
 * A run of consecutive blocks on both sides: producer blocks [src, src + n) go to consumer
 * blocks [dst, dst + n) in every segment.
 */
typedef struct kvx_run {
    uint32_t src_block, dst_block, n_blocks;
} kvx_run;

/**
 * Coalesce a block mapping (src[i] -> dst[i], i < n) into runs where both sides are
 * consecutive. `runs` must hold n entries. Returns the number of runs (>= 0), or TD_EINVAL
 * if an id is negative or >= the side's n_blocks (src_limit, dst_limit).
 */
int kvx_coalesce(const int32_t *src, const int32_t *dst, int n, uint32_t src_limit,
                 uint32_t dst_limit, kvx_run *runs);

/** A transfer's pieces are at least this large where its size allows (see kvx_piece_count);
 *  striped transfers, whose pieces spread over several links, at least KVX_MIN_STRIPE_BYTES. */
#define KVX_MIN_PIECE_BYTES (512u << 10)
#define KVX_MIN_STRIPE_BYTES (64u << 10)

/**
 * How many pieces a consumer cuts a transfer of total_bytes into, with qp pieces per
 * transfer and pieces of at most max_piece bytes (UINT64_MAX: no limit): up to qp, none
 * below min_piece unless the whole transfer is, and as many as max_piece needs. The blocks
 * are then dealt evenly over the pieces. (bench-xfer's raw-TCP floor cuts its transfers the
 * same way.)
 */
uint64_t kvx_piece_count(uint64_t total_bytes, uint32_t qp, uint64_t min_piece, uint64_t max_piece);

/* ---------------------------------------------------------------- producer */

typedef enum kvx_release_reason {
    KVX_RELEASED_BY_CONSUMER = 0, /* the consumer sent RELEASE */
    KVX_RELEASED_EXPIRED = 1,     /* lease_ms passed with no read or heartbeat */
    KVX_RELEASED_CANCELED = 2,    /* kvx_agent_cancel */
    KVX_RELEASED_SHUTDOWN = 3,    /* kvx_agent_destroy */
} kvx_release_reason;

/**
 * Gives a transfer's blocks back to their owner. Called exactly once per registered
 * transfer, from a kvx thread (or from kvx_agent_cancel / kvx_agent_destroy in the
 * caller's thread), after any read of those blocks has finished.
 */
typedef void (*kvx_release_fn)(void *user, const char *transfer_id, const int32_t *blocks,
                               int n_blocks, kvx_release_reason reason, void *transfer_user);

typedef struct kvx_agent_opts {
    const char *host; /* address to bind, e.g. "127.0.0.1"; never all interfaces by default */
    uint16_t port;    /* handshake port; 0 picks a free one (kvx_agent_port says which) */
    kvx_layout layout;
    kvx_region region;
    uint32_t lease_ms;   /* default lease (0 = 30000) */
    bool checksums;      /* send per-block CRC32C when the consumer asks (default on) */
    int max_connections; /* 0 = 256 */
    kvx_release_fn release_cb;
    void *release_user;
    /* Shared secret: when set (non-empty), every connection must pass the challenge-
     * response before anything else; NULL or "" = no authentication. Copied. */
    const char *auth_token;
    /* Rails (docs/ARCHITECTURE.md "Matched rails"; tcp only). NULL or n == 0: transfers
     * are served on the handshake listener, as always. Otherwise they are served only on
     * a listener per rail (its "engine", bound to that network device), the primary's made
     * at create and the others on first use, and a consumer asks for its rail's endpoint
     * with RAIL. matched_rails: a consumer must name one of these rails and gets exactly
     * it (no fallback); false: rails holds this producer's single device, which serves
     * every consumer. rail_addrs (optional, tests): each rail's address, instead of the
     * device's own; then no socket is bound to a device. Copied. */
    const struct kvx_rails *rails;
    bool matched_rails;
    const char (*rail_addrs)[64];
} kvx_agent_opts;

typedef struct kvx_agent kvx_agent;

/** Defaults: host 127.0.0.1, lease 30 s, checksums on, 256 connections. */
void kvx_agent_opts_default(kvx_agent_opts *o);

/**
 * Bind, listen and start the accept and lease threads. A port already in use is
 * TD_EIO with a message naming host:port. The engine id is drawn from getrandom.
 */
int kvx_agent_create(kvx_agent **out, const kvx_agent_opts *opts, td_err *err);

/** Close every connection, release every remaining lease (KVX_RELEASED_SHUTDOWN), free. */
void kvx_agent_destroy(kvx_agent *a);

uint16_t kvx_agent_port(const kvx_agent *a);
/** This incarnation's engine id, hex. */
const char *kvx_agent_engine_id(const kvx_agent *a);

/**
 * Hold `blocks` (copied) for a consumer; writes the transfer id (capability) to id_out.
 * lease_ms 0 takes the agent's default. transfer_user is passed back to release_cb.
 * Errors: TD_EINVAL (bad block id, n < 1).
 */
int kvx_agent_register(kvx_agent *a, const int32_t *blocks, int n_blocks, uint32_t lease_ms,
                       void *transfer_user, char id_out[KVX_ID_HEX], td_err *err);

/** Drop a transfer from the producer side; TD_ENOTFOUND if it is already gone. */
int kvx_agent_cancel(kvx_agent *a, const char *transfer_id);

/** Transfers currently held (for tests and metrics). */
int kvx_agent_n_leases(kvx_agent *a);

/*
 * Push (transfer_mode write). The router hands the producer and the consumer the same
 * transfer id (a capability it drew) at once. The producer opens the transfer before its
 * prefill runs and reports each segment's progress as it is computed; the consumer's WRITE
 * (kvx_write_start) may come before or after the open. The agent announces every range
 * the moment it is final and wanted, and the consumer reads it at once through its own
 * transport, so the copy overlaps the prefill. After kvx_agent_push_finish and the last
 * announcement, the consumer gets the producer's note (the first token, timings) and
 * releases the transfer as after a read; the lease runs from the finish.
 */

/**
 * Open a push transfer of n_blocks prompt blocks under transfer_id (32 hex digits, drawn
 * by the router). Errors: TD_EINVAL (bad id or count), TD_ESTATE (the id is in use).
 */
int kvx_agent_push_open(kvx_agent *a, const char *transfer_id, int n_blocks, void *transfer_user,
                        td_err *err);
/**
 * Prompt blocks [0, n_ready) of the transfer (ids blocks[0 .. n_ready)) are final in
 * segment seg. Progress only grows; a smaller n_ready is ignored. TD_ENOTFOUND if the
 * transfer is gone (cancelled, expired).
 */
int kvx_agent_push_ready(kvx_agent *a, const char *transfer_id, uint32_t seg, int n_ready,
                         const int32_t *blocks);
/**
 * The prefill is done: every block is final in every segment (blocks[0 .. n_blocks) are
 * their ids), and note (at most KVX_MAX_NOTE bytes) goes to the consumer with the last
 * announcement. The lease starts now. TD_ENOTFOUND if the transfer is gone.
 */
int kvx_agent_push_finish(kvx_agent *a, const char *transfer_id, const int32_t *blocks,
                          const void *note, size_t note_len);
/* kvx_agent_cancel ends a push transfer too; its consumer gets an error. */

typedef struct kvx_agent_stats {
    uint64_t bytes_sent, reads, leases_expired, leases_released, handshakes_refused,
        unknown_transfer, pushes;
    uint64_t rail_reads[32]; /* READs (and grants) served on each rail's engine */
    uint64_t rails_refused;  /* RAIL requests refused (no such rail, failed rail) */
} kvx_agent_stats;
/** A rail engine's state: 0 not made yet, 1 ready, 2 failed (until restart); -1 no rail. */
int kvx_agent_rail_state(kvx_agent *a, int rail);
void kvx_agent_get_stats(kvx_agent *a, kvx_agent_stats *out);

/** The last handshake refusal or protocol error the agent saw ("" if none). */
void kvx_agent_last_error(kvx_agent *a, char *buf, size_t cap);

/* ---------------------------------------------------------------- consumer */

typedef struct kvx_client_opts {
    kvx_layout layout;
    kvx_region region;
    int num_worker_threads;       /* 0 = 4 */
    int qp_per_transfer;          /* connections per peer and pieces per transfer; 0 = 4 */
    uint32_t transfer_timeout_ms; /* default deadline; 0 = 30000 */
    bool verify_checksums;        /* default on */
    kvx_protocol protocol;        /* default tcp */
    const char *auth_token;       /* shared secret for the challenge-response; NULL = none */
    /* Rails (see kvx_agent_opts; tcp only). NULL or n == 0: data moves over connections to
     * the producer's handshake address. Otherwise over connections from this consumer's
     * primary rail (its address, bound to its device) to the producer's endpoint for that
     * rail, which a RAIL request names: with matched_rails the rail of the same name, else
     * the producer's own device. rail_addrs as in kvx_agent_opts. Copied. */
    const struct kvx_rails *rails;
    bool matched_rails;
    const char (*rail_addrs)[64];
    /* With matched rails: cut each read into pieces over every rail the producer also has
     * (qp_per_transfer pieces per rail), each piece to the rail expected to finish it
     * first by its measured throughput; a rail that fails is left out for 10 s and its
     * pieces go to the others. */
    bool rail_striping;
} kvx_client_opts;

typedef struct kvx_client kvx_client;
typedef struct kvx_xfer kvx_xfer;

/** Called once when a transfer ends, on a kvx thread; `result` is the outcome. */
typedef void (*kvx_done_fn)(void *user, kvx_xfer *x, const td_err *result);

void kvx_client_opts_default(kvx_client_opts *o);
int kvx_client_create(kvx_client **out, const kvx_client_opts *opts, td_err *err);

/**
 * Fail queued transfers with TD_ECANCELED, wait for running pieces (bounded by their
 * deadlines), close every session and free. Every transfer has completed (its done
 * callback has run) when this returns. Call kvx_xfer_free on every handle first (a
 * running transfer is then freed when it ends): no handle may be used afterwards.
 */
void kvx_client_destroy(kvx_client *c);

typedef struct kvx_read_req {
    const char *host;
    uint16_t port;
    const char *engine_id;   /* the producer incarnation (hex) the blocks belong to */
    const char *transfer_id; /* capability (hex) from the producer */
    const int32_t *src_blocks, *dst_blocks; /* producer ids -> consumer ids, n_blocks each */
    int n_blocks;
    uint32_t timeout_ms; /* 0 = the client's transfer_timeout_ms */
    kvx_done_fn done;    /* may be NULL: then poll or wait */
    void *user;
    /* The caller will call kvx_xfer_wait on this transfer (host regions over tcp or shm):
     * one piece is left for the waiting thread to run and no worker is woken for it, so a
     * one-piece read costs no thread hand-off. A wait for another will_wait transfer may
     * run this one's small piece with its own (one pipelined group over tcp), and then this
     * transfer's done callback runs on that thread. Polling or freeing the handle instead
     * hands the piece to a worker; a piece left unclaimed still ends by the deadline. */
    bool will_wait;
} kvx_read_req;

/**
 * Start a read: validates the arguments, coalesces the blocks and queues the pieces;
 * returns at once. On success *out is a handle the caller owns (free with kvx_xfer_free
 * after completion). Argument errors are returned here and no transfer starts.
 */
int kvx_read_start(kvx_client *c, const kvx_read_req *req, kvx_xfer **out, td_err *err);

/** TD_EAGAIN while running; else the final code, with the message in *result. */
int kvx_xfer_poll(kvx_xfer *x, td_err *result);
/** Block until the transfer ends (it always does, by its deadline); returns its code.
 *  Pieces of the transfer that no worker has taken yet run on the calling thread (host
 *  regions over tcp or shm), which saves two thread hand-offs per small transfer. */
int kvx_xfer_wait(kvx_xfer *x, td_err *result);
/** Free a handle. If the transfer is still running it is freed when it ends. */
void kvx_xfer_free(kvx_xfer *x);
/**
 * End this consumer's transfers of transfer_id (hex) early, with TD_ECANCELED: a push's
 * connection is shut down (its thread ends at once rather than when the producer's
 * silence times out), and pieces not yet running are dropped; pieces under way finish.
 * Completion callbacks run as for any failure. TD_ENOTFOUND when none is running.
 */
int kvx_client_cancel(kvx_client *c, const char *transfer_id);

typedef struct kvx_xfer_info {
    uint64_t bytes;         /* bytes moved */
    uint32_t n_runs;        /* coalesced runs */
    uint32_t n_descriptors; /* byte ranges: runs x segments */
    double seconds;         /* start to completion */
    double tail_seconds;    /* push: from the producer's last word (PUSH_DONE, sent when
                               its prefill finished) to completion; read: = seconds */
} kvx_xfer_info;
void kvx_xfer_get_info(kvx_xfer *x, kvx_xfer_info *out);

typedef struct kvx_write_req {
    const char *host;
    uint16_t port;
    const char *engine_id;   /* the producer incarnation (hex), from its discovery endpoint */
    const char *transfer_id; /* the capability both sides were given (hex) */
    const int32_t *dst_blocks; /* consumer blocks for prompt blocks 0 .. n_blocks */
    int n_blocks;
    int skip;            /* prompt blocks [0, skip) are already here (prefix cache) */
    uint32_t timeout_ms; /* longest wait with no sign of progress (0 = transfer_timeout_ms):
                            for the producer to start the prefill, then between
                            announcements (the producer sends keep-alives every second) */
    kvx_done_fn done;
    void *user;
} kvx_write_req;

/**
 * Start a push transfer (see kvx_agent_push_open): ask the producer for the blocks as it
 * computes them, read each announced range at once (protocol as configured), and end
 * when the producer's note has come and every read has finished. Same handle and failure
 * contract as kvx_read_start; the note is read with kvx_xfer_note.
 */
int kvx_write_start(kvx_client *c, const kvx_write_req *req, kvx_xfer **out, td_err *err);

/** A finished push transfer's note from the producer (from its done callback on, or after
 *  kvx_xfer_poll/wait saw the end): copies at most cap bytes, returns its length (0 for a
 *  read, or when the push failed). */
size_t kvx_xfer_note(kvx_xfer *x, void *buf, size_t cap);

/**
 * Synchronous control messages over the session (blocking, bounded by the client's
 * transfer_timeout_ms): tell the producer to give a transfer's blocks back, or extend
 * its lease. TD_ENOTFOUND if the producer no longer holds it.
 */
int kvx_release(kvx_client *c, const char *host, uint16_t port, const char *engine_id,
                const char *transfer_id, td_err *err);
int kvx_heartbeat(kvx_client *c, const char *host, uint16_t port, const char *engine_id,
                  const char *transfer_id, td_err *err);

/**
 * Open (or reuse) the session to a producer and run the handshake now; the same errors
 * that a read would meet (refused, layout mismatch, different engine id).
 */
int kvx_session_check(kvx_client *c, const char *host, uint16_t port, const char *engine_id,
                      td_err *err);

/**
 * Fault injection for tests of the processes above kvx (tandem serve's debug flags):
 * the producer sleeps send_delay_ms between a DATA header and its bytes, and the consumer
 * flips one received byte of the next corrupt_pieces pieces. Process-wide; 0 = off.
 */
void kvx_debug_hooks(int send_delay_ms, int corrupt_pieces);

/** Sessions currently cached (for tests). */
int kvx_client_n_sessions(kvx_client *c);

#endif
