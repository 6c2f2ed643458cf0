/*
 * kvx/wire.h - the kvx wire protocol: length-prefixed binary frames, little-endian.
 *
 * Every frame is a 16-byte header and a payload of payload_len bytes:
 *
 *   off  size  field
 *     0     4  magic "KVX1" (0x3158564B read as little-endian u32)
 *     4     2  version (KVX_VERSION)
 *     6     1  type (kvx_msg_type)
 *     7     1  flags (must be 0: no flag is defined in version 1)
 *     8     4  payload_len (<= KVX_MAX_PAYLOAD)
 *    12     4  tag: chosen by the requester, echoed in the answer
 *
 * A DATA frame is followed by data_len raw bytes that are not part of its payload (the
 * requested ranges in request order, sent straight from the producer's region), then by
 * a trailer of n_crc little-endian u32 CRC32C values, one per block in the same order.
 * The checksums trail the data so that each is computed just before its block is sent,
 * while the block is in cache, and verified just after it arrives.
 *
 * Decoding is strict: a wrong magic, version, type, flag, a payload length that is not
 * exactly what the type needs, or a count beyond its limit is TD_EFORMAT (TD_EUNSUPPORTED
 * for a version this build does not speak) with a message. Decoded arrays point into the
 * caller's buffer (no allocation); read them with kvx_wire_get_*.
 */
#ifndef TD_KVX_WIRE_H
#define TD_KVX_WIRE_H

#include "kvx/kvx.h"

#define KVX_MAGIC 0x3158564Bu
#define KVX_VERSION 2 /* 2: UCX_INFO_ACK's stage_slot, UCX_GRANTED's stage_off */
#define KVX_HDR_BYTES 16
#define KVX_MAX_PAYLOAD (1u << 20)
#define KVX_MAX_DESC 16384
#define KVX_MAX_CRC 65536
#define KVX_MAX_HEARTBEAT_IDS 1024
#define KVX_MAX_ERRMSG 255
#define KVX_DESC_BYTES 12
#define KVX_DATA_PAYLOAD 12       /* DATA: data_len u64, n_crc u32 */
#define KVX_MAX_UCX_BLOB 65536    /* a UCX worker address or packed rkey, bytes */
#define KVX_NOT_STAGED UINT64_MAX /* UCX_GRANTED: the ranges are read in place */
#define KVX_MAX_RAIL 63           /* bytes of a rail (device) name or a rail's address */

typedef enum kvx_msg_type {
    KVX_MSG_HELLO = 1,     /* consumer -> producer: who I am, what I expect */
    KVX_MSG_HELLO_ACK = 2, /* producer -> consumer: who I am */
    KVX_MSG_AUTH = 3,      /* both ways after HELLO_ACK: HMAC-SHA256 proof of the token (kvx_auth.c) */
    KVX_MSG_READ = 4,      /* consumer -> producer: send these block runs of a transfer */
    KVX_MSG_DATA = 5,      /* producer -> consumer: checksums, then the bytes */
    KVX_MSG_RELEASE = 6,   /* consumer -> producer: done with a transfer */
    KVX_MSG_HEARTBEAT = 7, /* consumer -> producer: extend these leases */
    KVX_MSG_ACK = 8,       /* answer to RELEASE / HEARTBEAT */
    KVX_MSG_ERROR = 9,     /* answer to anything: code and message */
    /* Push (transfer_mode write), agent.c / client.c: the consumer asks for a transfer's
     * blocks as the producer computes them; the producer announces each layer's blocks
     * the moment they are final, and the consumer reads them at once. Numbers from 10. */
    KVX_MSG_WRITE = 10,      /* consumer -> producer: send me this transfer from block skip */
    KVX_MSG_PUSH_READY = 11, /* producer -> consumer: these blocks are final in these segments */
    KVX_MSG_PUSH_DONE = 12,  /* producer -> consumer: all announced; the producer's note */
    /* Rails (kvx_rails, docs/ARCHITECTURE.md "Matched rails"): where a producer serves
     * transfers on a given rail. */
    KVX_MSG_RAIL = 13,     /* consumer -> producer: your endpoint on rail <name> ("" = yours) */
    KVX_MSG_RAIL_ACK = 14, /* producer -> consumer: address, port and name of that rail */
    /* The ucx transport (ucx.c): the data moves by one-sided UCX get, these frames only
     * advertise the producer's memory and validate and pin ranges. Numbers from 20. */
    KVX_MSG_UCX_INFO = 20,    /* consumer -> producer: send me your worker address and rkey */
    KVX_MSG_UCX_INFO_ACK = 21, /* producer -> consumer: region base and size, address, rkey */
    KVX_MSG_UCX_GRANT = 22,   /* consumer -> producer: validate and pin ranges (READ payload) */
    KVX_MSG_UCX_GRANTED = 23, /* producer -> consumer: pin time limit, per-block CRC32C */
    KVX_MSG_UCX_DONE = 24,    /* consumer -> producer: gets finished, unpin (no answer) */
    /* The shm transport (shm.c) reuses UCX_GRANT / UCX_GRANTED / UCX_DONE for its pins. */
    KVX_MSG_SHM_INFO = 25,     /* consumer -> producer: where is your pool's memfd */
    KVX_MSG_SHM_INFO_ACK = 26, /* producer -> consumer: pid, fd, offset, bytes, dev/ino */
    /* The cuda_ipc transport (cuda_ipc.c) reuses them too. */
    KVX_MSG_CUDA_INFO = 27,     /* consumer -> producer: your pool's CUDA IPC handle */
    KVX_MSG_CUDA_INFO_ACK = 28, /* producer -> consumer: pid, base, bytes, stride, uuid, handle */
} kvx_msg_type;

/* HELLO features */
#define KVX_FEAT_CHECKSUMS 1u
/* READ flags */
#define KVX_READ_CHECKSUMS 1u

typedef struct kvx_hdr {
    uint16_t version;
    uint8_t type, flags;
    uint32_t payload_len, tag;
} kvx_hdr;

/* A READ descriptor: blocks [block, block + n_blocks) of one segment. */
typedef struct kvx_wire_desc {
    uint32_t segment, block, n_blocks;
} kvx_wire_desc;

typedef struct kvx_hello {
    uint8_t engine_id[KVX_ID_BYTES];
    uint8_t expect_engine_id[KVX_ID_BYTES]; /* all zero in HELLO_ACK, or "any" in HELLO */
    kvx_layout layout;
    uint32_t n_segments;
    uint64_t block_bytes;
    uint8_t nonce[KVX_ID_BYTES]; /* the sender's fresh challenge for AUTH */
    uint32_t features;           /* HELLO: KVX_FEAT_*; HELLO_ACK: KVX_ACK_FEAT_AUTH (1) if AUTH is required */
    /* Optional, after the fixed fields (u8 length, then the bytes): the rail this
     * connection runs on; "" = none, and then the field is not sent, so a consumer without
     * rails greets any producer as before. */
    char rail[KVX_MAX_RAIL + 1];
} kvx_hello;

typedef struct kvx_msg {
    kvx_hdr hdr;
    union {
        kvx_hello hello; /* HELLO and HELLO_ACK */
        struct {
            uint8_t mac[32];
        } auth;
        struct {
            uint8_t transfer_id[KVX_ID_BYTES];
            uint32_t flags, n_desc;
            const uint8_t *desc; /* n_desc * KVX_DESC_BYTES, inside the decoded buffer */
        } read; /* READ and UCX_GRANT */
        struct {
            uint64_t data_len;
            uint32_t n_crc; /* trailer entries after the data: 0, or one per block */
        } data;
        struct {
            uint8_t transfer_id[KVX_ID_BYTES];
        } release;
        struct {
            uint32_t n_ids;
            const uint8_t *ids; /* n_ids * KVX_ID_BYTES */
        } heartbeat;
        struct {
            uint32_t value;
        } ack;
        struct {
            uint64_t base, segment_stride, bytes; /* the producer's region (addresses) */
            /* 0: base..bytes is the region itself, read in place. Else the producer's KV
             * is in GPU memory and base..bytes is its pinned host staging area, in slots
             * of stage_slot bytes: a grant of at most stage_slot bytes is copied into a
             * slot and read from there (UCX_GRANTED's stage_off). */
            uint64_t stage_slot;
            uint32_t addr_len, rkey_len;
            const uint8_t *addr, *rkey; /* inside the decoded buffer */
        } ucx_info;
        struct {
            uint32_t pid, fd;      /* /proc/<pid>/fd/<fd> is the producer's memfd */
            uint64_t offset, bytes; /* the region starts at offset; map offset + bytes */
            uint64_t segment_stride; /* the producer's, which may differ from ours */
            uint64_t dev, ino;       /* the memfd's st_dev and st_ino: the consumer checks
                                        that /proc/<pid>/fd/<fd> is this file (a consumer in
                                        another PID namespace would open another process's) */
        } shm_info;
        struct {
            uint32_t pid;            /* the producer's (a consumer in the same process uses base) */
            uint64_t base;           /* the pool's device address in the producer */
            uint64_t bytes;          /* segments x stride */
            uint64_t segment_stride; /* the producer's, which may differ from ours */
            const uint8_t *uuid;     /* 16 bytes: the producer's GPU */
            const uint8_t *handle;   /* 64 bytes: cudaIpcMemHandle_t of the pool */
        } cuda_info;
        struct {
            uint32_t valid_ms; /* the pin ends this long after the answer was sent */
            uint32_t n_crc;    /* 0, or one per block of the GRANT, in request order */
            /* KVX_NOT_STAGED, or where in the staging area (UCX_INFO_ACK) the granted
             * ranges lie, packed in request order */
            uint64_t stage_off;
            const uint8_t *crc; /* n_crc little-endian u32, inside the decoded buffer */
        } ucx_granted;
        struct {
            int32_t code;
            char msg[KVX_MAX_ERRMSG + 1]; /* NUL-terminated copy */
        } error;
        struct {
            uint8_t transfer_id[KVX_ID_BYTES];
            uint32_t skip;       /* prompt blocks [0, skip) are not wanted */
            uint32_t n_blocks;   /* the consumer's count of prompt blocks (checked) */
            uint32_t timeout_ms; /* how long the producer may wait for the prefill to appear */
        } write;
        struct {
            uint32_t seg, n_seg; /* segments [seg, seg + n_seg) */
            uint32_t index, n;   /* prompt blocks [index, index + n); n 0 = keep-alive */
            const uint8_t *ids;  /* n producer block ids (u32), inside the decoded buffer */
        } push_ready;
        struct {
            uint32_t note_len;
            const uint8_t *note; /* inside the decoded buffer */
        } push_done;
        struct {
            char name[KVX_MAX_RAIL + 1]; /* RAIL: the consumer's rail ("" = the producer's
                                            own primary); RAIL_ACK: the producer's rail */
            char addr[KVX_MAX_RAIL + 1]; /* RAIL_ACK: numeric address of its listener */
            uint16_t port;               /* RAIL_ACK */
        } rail;
    } u;
} kvx_msg;

/** Decode a header from 16 bytes. */
int kvx_wire_decode_hdr(const uint8_t buf[KVX_HDR_BYTES], kvx_hdr *out, td_err *err);

/** Decode a payload of hdr->payload_len bytes (len must equal it) into *out. */
int kvx_wire_decode(const kvx_hdr *hdr, const uint8_t *payload, size_t len, kvx_msg *out,
                    td_err *err);

/** Decode a whole frame (header + payload) from buf; trailing bytes are an error. */
int kvx_wire_decode_frame(const uint8_t *buf, size_t len, kvx_msg *out, td_err *err);

kvx_wire_desc kvx_wire_get_desc(const kvx_msg *m, uint32_t i);
/** Entry i of a DATA trailer (n_crc little-endian u32 values); and the writer. */
uint32_t kvx_wire_trailer_get(const uint8_t *trailer, uint32_t i);
void kvx_wire_trailer_put(uint8_t *trailer, const uint32_t *crcs, uint32_t n_crc);
const uint8_t *kvx_wire_get_id(const kvx_msg *m, uint32_t i);

/*
 * Encoders write header + payload into buf and return the frame's size, or 0 when cap is
 * too small or a count exceeds its limit.
 */
size_t kvx_wire_encode_hello(uint8_t *buf, size_t cap, uint8_t type, uint32_t tag,
                             const kvx_hello *h);
size_t kvx_wire_encode_auth(uint8_t *buf, size_t cap, uint32_t tag, const uint8_t mac[32]);
size_t kvx_wire_encode_read(uint8_t *buf, size_t cap, uint32_t tag,
                            const uint8_t transfer_id[KVX_ID_BYTES], uint32_t flags,
                            const kvx_wire_desc *descs, uint32_t n_desc);
size_t kvx_wire_encode_data(uint8_t *buf, size_t cap, uint32_t tag, uint64_t data_len,
                            uint32_t n_crc);
size_t kvx_wire_encode_release(uint8_t *buf, size_t cap, uint32_t tag,
                               const uint8_t transfer_id[KVX_ID_BYTES]);
size_t kvx_wire_encode_heartbeat(uint8_t *buf, size_t cap, uint32_t tag, const uint8_t *ids,
                                 uint32_t n_ids);
size_t kvx_wire_encode_ack(uint8_t *buf, size_t cap, uint32_t tag, uint32_t value);
size_t kvx_wire_encode_error(uint8_t *buf, size_t cap, uint32_t tag, int32_t code, const char *msg);

/* The ucx transport's frames. UCX_GRANT has READ's payload and limits; UCX_INFO and
 * UCX_DONE have none (kvx_wire_encode_empty). */
size_t kvx_wire_encode_empty(uint8_t *buf, size_t cap, uint8_t type, uint32_t tag);
size_t kvx_wire_encode_grant(uint8_t *buf, size_t cap, uint32_t tag,
                             const uint8_t transfer_id[KVX_ID_BYTES], uint32_t flags,
                             const kvx_wire_desc *descs, uint32_t n_desc);
size_t kvx_wire_encode_ucx_info(uint8_t *buf, size_t cap, uint32_t tag, uint64_t base,
                                uint64_t segment_stride, uint64_t bytes, uint64_t stage_slot,
                                const void *addr,
                                uint32_t addr_len, const void *rkey, uint32_t rkey_len);
size_t kvx_wire_encode_shm_info(uint8_t *buf, size_t cap, uint32_t tag, uint32_t pid, uint32_t fd,
                                uint64_t offset, uint64_t bytes, uint64_t segment_stride,
                                uint64_t dev, uint64_t ino);
size_t kvx_wire_encode_cuda_info(uint8_t *buf, size_t cap, uint32_t tag, uint32_t pid, uint64_t base,
                                 uint64_t bytes, uint64_t segment_stride, const uint8_t uuid[16],
                                 const uint8_t handle[64]);
size_t kvx_wire_encode_ucx_granted(uint8_t *buf, size_t cap, uint32_t tag, uint32_t valid_ms,
                                   uint64_t stage_off, const uint32_t *crcs, uint32_t n_crc);

/* Push frames (see KVX_MSG_WRITE). PUSH_READY carries at most KVX_MAX_DESC ids. */
size_t kvx_wire_encode_write(uint8_t *buf, size_t cap, uint32_t tag,
                             const uint8_t transfer_id[KVX_ID_BYTES], uint32_t skip,
                             uint32_t n_blocks, uint32_t timeout_ms);
size_t kvx_wire_encode_push_ready(uint8_t *buf, size_t cap, uint32_t tag, uint32_t seg,
                                  uint32_t n_seg, uint32_t index, const int32_t *ids, uint32_t n);
size_t kvx_wire_encode_push_done(uint8_t *buf, size_t cap, uint32_t tag, const void *note,
                                 uint32_t note_len);
/* RAIL: u8 length + name (0..KVX_MAX_RAIL printable bytes). RAIL_ACK: u16 port (> 0),
 * u8 length + address (1..KVX_MAX_RAIL), u8 length + name (1..KVX_MAX_RAIL). */
size_t kvx_wire_encode_rail(uint8_t *buf, size_t cap, uint32_t tag, const char *name);
size_t kvx_wire_encode_rail_ack(uint8_t *buf, size_t cap, uint32_t tag, const char *addr,
                                uint16_t port, const char *name);
/** Entry i of a PUSH_READY's ids. */
uint32_t kvx_wire_push_id(const kvx_msg *m, uint32_t i);

/** Name of a message type ("READ"), "unknown" otherwise. */
const char *kvx_wire_type_name(int type);

#endif
