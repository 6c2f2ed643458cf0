/*
 * kvx/kvx_internal.h - helpers shared inside the kvx module: CRC32C, random ids, socket
 * I/O with deadlines, the consumer's transport interface, test hooks.
 */
#ifndef TD_KVX_INTERNAL_H
#define TD_KVX_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/uio.h>

#include "kvx/kvx.h"
#include "kvx/rails.h"
#include "kvx/wire.h"
#include "util/crc32c.h"

/**
 * Blocks per checksum batch: about batch_bytes, and a multiple of 6 where possible, since
 * td_crc32c_blocks is fastest on groups of six blocks.
 */
static inline uint32_t kvx__batch_blocks(uint64_t block_bytes, uint64_t batch_bytes)
{
    uint64_t n = batch_bytes / block_bytes;
    if (n >= 6) n -= n % 6;
    return n ? (uint32_t)n : 1;
}

/** The largest piece a consumer asks for at once (client.c cuts transfers into pieces of
 *  at most this many bytes, or one block where a block is larger); the ucx transport's
 *  staging slots are this large. */
#define KVX__MAX_PIECE_BYTES (8u << 20)

/* ---- authentication (kvx_auth.c) ---- */
#define KVX_AUTH_MAC_BYTES 32
/** HELLO_ACK features: the producer requires the challenge-response. */
#define KVX_ACK_FEAT_AUTH 1u
/** The proof of one side (producer or consumer) for a connection's nonces and ids. */
void kvx__auth_mac(const char *token, bool producer, const uint8_t nc[KVX_ID_BYTES],
                   const uint8_t np[KVX_ID_BYTES], const uint8_t id_c[KVX_ID_BYTES],
                   const uint8_t id_p[KVX_ID_BYTES], uint8_t out[KVX_AUTH_MAC_BYTES]);
/** Constant-time comparison. */
bool kvx__auth_equal(const uint8_t a[KVX_AUTH_MAC_BYTES], const uint8_t b[KVX_AUTH_MAC_BYTES]);
/** Wipe a secret. */
void kvx__auth_wipe(void *p, size_t n);

/** A condition variable whose timed waits take CLOCK_MONOTONIC deadlines. */
void kvx__cond_init_monotonic(pthread_cond_t *cv);
/** Under mu: wait on cv (made by kvx__cond_init_monotonic) until it is signalled or
 *  td_now_ns() reaches deadline_ns; pthread_cond_timedwait's result (ETIMEDOUT). */
int kvx__cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t deadline_ns);

/** 16 random bytes from getrandom(2); 0 or TD_EIO. */
int kvx__random_id(uint8_t out[KVX_ID_BYTES]);

/* ---- blocking socket I/O bounded by an absolute deadline (td_now_ns clock) ----
 * Sockets are non-blocking; every wait is a poll() with the time left. Return 0,
 * TD_ETIMEDOUT, or TD_ECONN (peer closed, reset, broken pipe); err says which. */
int kvx__connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_out, td_err *err);
int kvx__send_all(int fd, const void *buf, size_t n, uint64_t deadline_ns, td_err *err);
int kvx__recv_all(int fd, void *buf, size_t n, uint64_t deadline_ns, td_err *err);
/** Vectored forms; iov is modified (consumed) as bytes move. */
int kvx__writev_all(int fd, struct iovec *iov, int n_iov, uint64_t deadline_ns, td_err *err);
int kvx__readv_all(int fd, struct iovec *iov, int n_iov, uint64_t deadline_ns, td_err *err);
/* Wait until fd is readable (or fails), at most until the deadline. */
int kvx__wait_readable(int fd, uint64_t deadline_ns, td_err *err);
/** One recv of whatever has arrived on fd (at most cap bytes, at least one: *got), waiting
 * for it until the deadline (wait_first: poll before the first try, which would fail). */
int kvx__recv_some(int fd, uint8_t *buf, size_t cap, bool wait_first, uint64_t deadline_ns,
                   size_t *got, td_err *err);
void kvx__set_sock_opts(int fd);
/**
 * kvx__connect from a given local address, and where device is set, through that network
 * device only (SO_BINDTODEVICE; without the privilege for it, the source address alone
 * is bound, logged once): a rail's connections must not take another rail's route.
 */
int kvx__connect_from(const char *host, uint16_t port, const char *local_addr, const char *device,
                      uint64_t deadline_ns, int *fd_out, td_err *err);
/** Bind fd to a network device (SO_BINDTODEVICE); 0, or -1 when not permitted (logged once). */
int kvx__bind_device(int fd, const char *device);
/** The numeric address (IPv4 first, else global IPv6) of network interface ifname. */
int kvx__iface_addr(const char *ifname, char *out, size_t cap, td_err *err);

/*
 * Rail engines (railpool.c): one per matched rail, the primary's made at once, the others
 * on first use (see railpool.c). ops are what an engine is for a transport: open it on a
 * rail, register range k of the region with it (its own keys), undo both.
 */
enum { KVX__RAIL_NONE = 0, KVX__RAIL_READY = 1, KVX__RAIL_FAILED = 2 };
typedef struct kvx__rail_ops {
    int (*open)(void *user, int rail, const char *name, void **eng, td_err *err);
    int (*reg)(void *user, void *eng, int range, td_err *err);
    void (*unreg)(void *user, void *eng, int range);
    void (*close)(void *user, void *eng);
} kvx__rail_ops;
typedef struct kvx__railpool kvx__railpool;
int kvx__railpool_create(kvx__railpool **out, const kvx_rails *rails, int n_ranges,
                         const kvx__rail_ops *ops, void *user, td_err *err);
/** Rail `rail`'s engine, made now if this is its first use; TD_EIO if it failed (ever). */
int kvx__railpool_get(kvx__railpool *p, int rail, void **eng, td_err *err);
int kvx__railpool_state(kvx__railpool *p, int rail);
/** Call fn on every ready engine (agent shutdown: stop their listeners first). */
void kvx__railpool_each(kvx__railpool *p, void (*fn)(void *eng, void *user), void *user);
/** UCX's name for a rail device: "tdr2" for a network interface, "mlx5_2:1" for port 1 of
 *  an RDMA device. */
void kvx__rail_ucx_device(const kvx_rails *r, int rail, char *out, size_t cap);
void kvx__railpool_destroy(kvx__railpool *p);

/**
 * Receive one frame: header then payload into buf (cap >= KVX_MAX_PAYLOAD is always
 * enough). Strictly decoded into *m, whose arrays point into buf.
 */
int kvx__recv_frame(int fd, uint8_t *buf, size_t cap, kvx_msg *m, uint64_t deadline_ns,
                    td_err *err);

/**
 * A frame reader that reads ahead, for a connection on which only frames arrive (no raw
 * bytes follow any of them: the producer's side). One recv takes every frame that has
 * arrived, so pipelined READs cost no system call after the first, and a frame costs a
 * poll and one recv instead of a failed read, a poll and a read each for header and
 * payload. buf holds cap bytes (>= KVX_HDR_BYTES + the largest payload accepted).
 */
typedef struct kvx__rbuf {
    uint8_t *buf;
    size_t cap, lo, hi; /* buf[lo, hi): received, not yet returned */
} kvx__rbuf;

/**
 * The next frame, strictly decoded into *m, whose arrays point into rb->buf until the next
 * call. Waiting for a frame's first byte is bounded by deadline_ns; a frame that has
 * started must finish within 30 s (as kvx__recv_frame).
 */
int kvx__rbuf_frame(int fd, kvx__rbuf *rb, kvx_msg *m, uint64_t deadline_ns, td_err *err);

/** Build the HELLO that describes one side. */
void kvx__hello_fill(kvx_hello *h, const uint8_t engine_id[KVX_ID_BYTES], const kvx_layout *layout,
                     const kvx_region *region);
/** Compare a peer's HELLO(_ACK) with ours: layout, then region geometry. */
int kvx__hello_compare(const kvx_hello *local, const kvx_hello *peer, td_err *err);

/** Byte offset of block b of segment s in region r. */
static inline uint64_t kvx__offset(const kvx_region *r, uint32_t seg, uint32_t block)
{
    return (uint64_t)seg * r->segment_stride + (uint64_t)block * r->block_bytes;
}

/*
 * The consumer's transport seam. A transfer is cut into pieces; a worker thread hands a
 * piece to its transport, which moves its bytes into the consumer's region (verifying
 * checksums if asked) before the deadline. tcp (client.c), shm (shm.c), ucx (ucx.c, with
 * TD_HAVE_UCX) and cuda_ipc (cuda_ipc.c, with TD_HAVE_CUDA) implement it; all but tcp
 * send their RELEASEs and HEARTBEATs through kvx__session_control.
 */
struct kvx__piece;
struct kvx__session;
typedef struct kvx__transport {
    const char *name;
    /** Move one piece. Called on a worker thread; must respect piece->deadline_ns. */
    int (*run_piece)(struct kvx__session *s, struct kvx__piece *p, td_err *err);
    /** Send a RELEASE or HEARTBEAT for one transfer id and wait for the answer. */
    int (*control)(struct kvx__session *s, uint8_t type, const uint8_t id[KVX_ID_BYTES],
                   uint64_t deadline_ns, td_err *err);
    /** Free what the transport keeps in *kvx__session_transport_state(s); may be NULL. */
    void (*session_free)(void *state);
} kvx__transport;

/* The shm transport (shm.c): copies out of the producer's memfd, mapped per session. */
extern const kvx__transport kvx__shm_transport;

#ifdef TD_HAVE_UCX
/*
 * The ucx transport (ucx.c). Producer side: a UCX context and worker with the whole
 * region registered, a thread that progresses the worker, and the UCX_INFO_ACK frame that
 * advertises them. Consumer side: kvx__ucx_transport, with per-client state made by
 * kvx__ucx_client_create (the consumer region's registration) and per-session state
 * (pooled channels) freed through the transport's session_free.
 */
struct kvx__ucx_agent;
/* device: NULL, or the one network device the context may use (a rail). */
int kvx__ucx_agent_create(struct kvx__ucx_agent **out, const kvx_region *r, const char *device,
                          td_err *err);
void kvx__ucx_agent_destroy(struct kvx__ucx_agent *u); /* NULL is fine */
/** Encode UCX_INFO_ACK into buf; 0 if it does not fit. */
size_t kvx__ucx_agent_info(struct kvx__ucx_agent *u, uint8_t *buf, size_t cap, uint32_t tag);
/** Whether grants read from its staging area (a region in GPU memory; kvx__test_ucx_stage). */
bool kvx__ucx_agent_staged(const struct kvx__ucx_agent *u);
/**
 * Copy a UCX_GRANT's ranges (bytes in all, at most KVX__MAX_PIECE_BYTES) into a free
 * staging slot, packed in request order, with their checksums into crc when it is not
 * NULL; *off says where in the area. Hold the slot until kvx__ucx_agent_unstage(off).
 */
int kvx__ucx_agent_stage(struct kvx__ucx_agent *u, const kvx_msg *grant, uint64_t bytes,
                         uint32_t *crc, uint64_t *off, td_err *err);
void kvx__ucx_agent_unstage(struct kvx__ucx_agent *u, uint64_t off);

struct kvx__ucx_client;
int kvx__ucx_client_create(struct kvx__ucx_client **out, const kvx_client_opts *opts,
                           const char *device, td_err *err);
void kvx__ucx_client_destroy(struct kvx__ucx_client *u); /* after every session is freed */
extern const kvx__transport kvx__ucx_transport;
#endif

/*
 * What a transport in another file needs of client.c's sessions and pieces (the structs
 * are private to client.c).
 */
typedef struct kvx__piece_info {
    const uint8_t *transfer_id; /* KVX_ID_BYTES */
    uint64_t deadline_ns;
    uint32_t tag;   /* echoed by the producer's answer */
    uint32_t count; /* descriptors */
    uint64_t bytes, blocks;
} kvx__piece_info;
typedef struct kvx__piece_range {
    uint32_t seg, src, dst, n; /* producer blocks src.., consumer blocks dst.., of one segment */
} kvx__piece_range;
void kvx__piece_get_info(const struct kvx__piece *p, kvx__piece_info *out);
kvx__piece_range kvx__piece_get_range(const struct kvx__piece *p, uint32_t k);
const kvx_client_opts *kvx__session_opts(const struct kvx__session *s);
const char *kvx__session_host(const struct kvx__session *s);
uint16_t kvx__session_port(const struct kvx__session *s);
/** The session's slot for its transport's state (freed by the transport's session_free). */
void **kvx__session_transport_state(struct kvx__session *s);
/** The client's transport state (kvx__ucx_client for ucx). */
void *kvx__session_client_state(const struct kvx__session *s);
/** Connect to the session's producer and greet it (HELLO / HELLO_ACK); 0 or an error. */
int kvx__session_connect(struct kvx__session *s, uint64_t deadline_ns, int *fd, td_err *err);
/** RELEASE or HEARTBEAT over the session's plain tcp connections (tcp's control). */
int kvx__session_control(struct kvx__session *s, uint8_t type, const uint8_t id[KVX_ID_BYTES],
                         uint64_t deadline_ns, td_err *err);

/*
 * The pin exchange of the transports that copy straight out of the producer's memory
 * (shm.c, cuda_ipc.c; grant.c): per piece, UCX_GRANT with the piece's ranges makes the
 * producer check them against the lease and pin it until UCX_DONE (or the pin limit),
 * on a control connection from the session's pool.
 */
#define KVX__GRANT_MAX_IDLE 64
typedef struct kvx__grant_pool {
    pthread_mutex_t mu; /* also held around the transport's setup callback */
    int idle[KVX__GRANT_MAX_IDLE];
    int n_idle;
} kvx__grant_pool;
void kvx__grant_pool_init(kvx__grant_pool *gp);
void kvx__grant_pool_fini(kvx__grant_pool *gp);
/** Called with gp->mu held and a greeted connection before every grant: the transport's
 *  once-per-session work (map the pool, open the IPC handle), a no-op once done. */
typedef int (*kvx__grant_setup_fn)(struct kvx__session *s, void *user, int fd, uint64_t deadline_ns,
                                   td_err *err);
typedef struct kvx__grant {
    int fd;           /* the pinned connection */
    kvx_msg m;        /* UCX_GRANTED: valid_ms, and one CRC per block when asked for */
    uint8_t *in;      /* m's arrays point here */
    size_t in_cap;
    uint32_t tag;
    uint64_t deadline_ns;
} kvx__grant;
/** The UCX_GRANT frame for piece p (malloc'd, at least KVX_HDR_BYTES + 24 bytes), its size
 *  in *n; NULL when out of memory. */
uint8_t *kvx__grant_request(struct kvx__piece *p, bool want_crc, size_t *n);
/** Pin piece p (asking for checksums or not). 0: g is pinned, end it with kvx__grant_done;
 *  else an error naming the producer (what: the transport's name, for messages). */
int kvx__grant_pin(struct kvx__session *s, kvx__grant_pool *gp, struct kvx__piece *p, bool want_crc,
                   const char *what, kvx__grant_setup_fn setup, void *user, kvx__grant *g,
                   td_err *err);
/** Unpin (UCX_DONE) and give the connection back to the pool. */
void kvx__grant_done(kvx__grant_pool *gp, kvx__grant *g);
/** Send the empty frame `ask` (SHM_INFO, CUDA_INFO) on a greeted connection and receive
 *  `answer` into *m (its arrays in buf, cap >= 512); the producer's ERROR or another frame
 *  is an error naming the transport (what). */
int kvx__info_ask(struct kvx__session *s, int fd, uint8_t ask, uint8_t answer, const char *what,
                  uint8_t *buf, size_t cap, kvx_msg *m, uint64_t deadline_ns, td_err *err);
/** The session's transport state (a struct of `size` bytes whose first member is its
 *  kvx__grant_pool), made zeroed with the pool initialised on first use; drop frees one
 *  that lost a race. NULL when out of memory. */
void *kvx__session_state_get(struct kvx__session *s, size_t size, void (*drop)(void *));

#ifdef TD_HAVE_CUDA
/* The cuda_ipc transport (cuda_ipc.c): device-to-device copies out of the producer's pool,
 * opened by its CUDA IPC handle once per session. */
extern const kvx__transport kvx__cuda_transport;
#endif
/* Device regions that an agent of this process serves (cuda_ipc.c): a consumer in the
 * same process cannot open its own IPC handle, and copies from the pointer instead. */
void kvx__cuda_local_add(const kvx_region *r);
void kvx__cuda_local_remove(const kvx_region *r);
/** The base of this process's region with that IPC handle, or NULL. */
void *kvx__cuda_local_find(const uint8_t handle[64]);
/*
 * Host staging for tcp out of or into GPU memory (cuda_ipc.c): the calling thread's pinned
 * buffer of at least `bytes` (kept for the thread's life), and a synchronous copy between
 * it and the device on the thread's stream. Without CUDA both are TD_EUNSUPPORTED.
 */
int kvx__stage_buf(int device, size_t bytes, uint8_t **buf, td_err *err);
int kvx__stage_copy(int device, void *dst, const void *src, size_t n, bool to_device, td_err *err);
/*
 * The same copy started asynchronously on the thread's stream, in one of two slots (0, 1):
 * every copy started in a slot is complete once kvx__stage_wait on that slot returns (a
 * slot with nothing started returns at once). A thread stages one batch while it sends or
 * receives the other.
 */
int kvx__stage_copy_start(int device, int slot, void *dst, const void *src, size_t n, bool to_device,
                          td_err *err);
int kvx__stage_wait(int device, int slot, td_err *err);
/** Page-locked host memory that GPU `device` copies to and from at full speed (the ucx
 *  transport's registered staging areas); TD_EUNSUPPORTED without CUDA. */
int kvx__pinned_alloc(int device, size_t bytes, void **out, td_err *err);
void kvx__pinned_free(void *p); /* NULL is fine */

/* Test hooks (tests only; zero in production). */
/* When > 0, the consumer flips one received byte of the next that many pieces. */
extern _Atomic int kvx__test_corrupt_pieces;
/* DATA answers the tcp consumer has taken up (each after its kvx__test_corrupt_pieces
 * decision): a test knows from it that a piece can no longer take the corruption. */
extern _Atomic int kvx__test_answers_taken;
/* When > 0, the producer sleeps this many ms between sending the header and the data,
 * counting each such sleep that begins in kvx__test_sends_delayed. */
extern _Atomic int kvx__test_send_delay_ms;
extern _Atomic int kvx__test_sends_delayed;
/* When above 0, the size of the tcp producer's writes from host memory (SEND_BYTES). */
extern _Atomic int kvx__test_send_bytes;
/* When > 0, ucx producers and consumers made from now on stage host regions as they do
 * GPU memory (ucx.c: copied through a registered staging area, memcpy for cudaMemcpy),
 * and a producer's area has this many slots: the staged path without a GPU. */
extern _Atomic int kvx__test_ucx_stage;
/* Grants a ucx producer staged, and pieces a ucx consumer copied out of its staging. */
extern _Atomic int kvx__test_ucx_grants_staged;
extern _Atomic int kvx__test_ucx_pieces_unstaged;
/* Pieces the consumer sent pipelined, in groups of two or more on one connection. */
extern _Atomic int kvx__test_pieces_grouped;
/* Pieces that a thread waiting in kvx_xfer_wait ran itself; when kvx__test_no_wait_help is
 * not 0, waiting threads leave every piece to the workers (tests of the workers' own
 * paths, such as grouping). */
extern _Atomic int kvx__test_pieces_helped;
extern _Atomic int kvx__test_no_wait_help;
/* Nonzero: small pieces are read straight into their blocks, as large ones are, not
 * through a receive buffer (bounce_recv_piece); the pieces that were read through one. */
extern _Atomic int kvx__test_no_bounce;
extern _Atomic int kvx__test_pieces_bounced;
/* Pieces sent again after their group's connection went out of step (tcp_run_group). */
extern _Atomic int kvx__test_pieces_resent;
/* Handshakes a consumer tried again after the producer refused them for now (TD_EBUSY). */
extern _Atomic int kvx__test_busy_retries;
/* When > 0, the shm consumer sleeps this many ms between a grant and its copy (shm.c),
 * counting each such sleep that begins in kvx__test_copies_delayed. */
extern _Atomic int kvx__test_copy_delay_ms;
extern _Atomic int kvx__test_copies_delayed;
/* When > 0, opening the engine of rail (value - 1) fails after its listener is made
 * (agent.c), as a registration failure would: tests of the rollback. */
extern _Atomic int kvx__test_rail_fail;
/* When > 0, the agent sleeps 20 ms before serving each READ on rail (value - 1): a slow
 * rail, for tests of striping. */
extern _Atomic int kvx__test_slow_rail;
/* Hang up on every consumer connection of agent a (as a producer restarting behind the same
 * listener would leave them) and wait until their threads have left; the agent goes on. */
void kvx__test_agent_hangup(struct kvx_agent *a);

#endif
