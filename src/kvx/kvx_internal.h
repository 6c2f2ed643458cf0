/*
 * kvx/kvx_internal.h - helpers shared inside the kvx module: CRC32C, random ids, socket
 * I/O with deadlines, the consumer's transport interface, test hooks.
 */
#ifndef TD_KVX_INTERNAL_H
#define TD_KVX_INTERNAL_H

#include <stdatomic.h>
#include <sys/uio.h>

#include "kvx/kvx.h"
#include "kvx/wire.h"

/** CRC32C (Castagnoli) of n bytes, continuing from crc (start with 0). */
uint32_t kvx__crc32c(uint32_t crc, const void *data, size_t n);
/** The portable version (used where SSE4.2 is missing, and by tests to cross-check). */
uint32_t kvx__crc32c_portable(uint32_t crc, const void *data, size_t n);
/** CRC32C of `count` consecutive blocks of `block_bytes` each at p: one CRC per block. */
void kvx__crc32c_blocks(const uint8_t *p, uint64_t block_bytes, uint32_t count, uint32_t *out);

/**
 * Blocks per checksum batch: about batch_bytes, and a multiple of 6 where possible, since
 * kvx__crc32c_blocks is fastest on groups of six blocks.
 */
static inline uint32_t kvx__batch_blocks(uint64_t block_bytes, uint64_t batch_bytes)
{
    uint64_t n = batch_bytes / block_bytes;
    if (n >= 6) n -= n % 6;
    return n ? (uint32_t)n : 1;
}

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
void kvx__set_sock_opts(int fd);

/**
 * Receive one frame: header then payload into buf (cap >= KVX_MAX_PAYLOAD is always
 * enough). Strictly decoded into *m, whose arrays point into buf.
 */
int kvx__recv_frame(int fd, uint8_t *buf, size_t cap, kvx_msg *m, uint64_t deadline_ns,
                    td_err *err);

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
 * checksums if asked) before the deadline. tcp is the only one so far; shm and ucx will
 * implement the same two calls.
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
} kvx__transport;

/* Test hooks (tests only; zero in production). */
/* When > 0, the consumer flips one received byte of the next that many pieces. */
extern _Atomic int kvx__test_corrupt_pieces;
/* When > 0, the producer sleeps this many ms between sending the header and the data. */
extern _Atomic int kvx__test_send_delay_ms;

#endif
