/* kvx/wire.c - encoding and strict decoding of kvx frames (format in wire.h). */
#include "kvx/wire.h"

#include <string.h>

#define HELLO_PAYLOAD (16 + 16 + 36 + 4 + 8 + 16 + 4)

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

const char *kvx_wire_type_name(int type)
{
    static const char *names[] = {"?",    "HELLO",   "HELLO_ACK", "AUTH", "READ",
                                  "DATA", "RELEASE", "HEARTBEAT", "ACK",  "ERROR"};
    if (type >= KVX_MSG_HELLO && type <= KVX_MSG_ERROR) return names[type];
    switch (type) {
    case KVX_MSG_UCX_INFO: return "UCX_INFO";
    case KVX_MSG_UCX_INFO_ACK: return "UCX_INFO_ACK";
    case KVX_MSG_UCX_GRANT: return "UCX_GRANT";
    case KVX_MSG_UCX_GRANTED: return "UCX_GRANTED";
    case KVX_MSG_UCX_DONE: return "UCX_DONE";
    case KVX_MSG_SHM_INFO: return "SHM_INFO";
    case KVX_MSG_SHM_INFO_ACK: return "SHM_INFO_ACK";
    case KVX_MSG_CUDA_INFO: return "CUDA_INFO";
    case KVX_MSG_CUDA_INFO_ACK: return "CUDA_INFO_ACK";
    case KVX_MSG_WRITE: return "WRITE";
    case KVX_MSG_PUSH_READY: return "PUSH_READY";
    case KVX_MSG_PUSH_DONE: return "PUSH_DONE";
    case KVX_MSG_RAIL: return "RAIL";
    case KVX_MSG_RAIL_ACK: return "RAIL_ACK";
    }
    return "unknown";
}

static size_t put_hdr(uint8_t *buf, size_t cap, uint8_t type, uint32_t tag, size_t payload)
{
    if (payload > KVX_MAX_PAYLOAD || cap < KVX_HDR_BYTES + payload) return 0;
    put32(buf, KVX_MAGIC);
    put16(buf + 4, KVX_VERSION);
    buf[6] = type;
    buf[7] = 0;
    put32(buf + 8, (uint32_t)payload);
    put32(buf + 12, tag);
    return KVX_HDR_BYTES + payload;
}

int kvx_wire_decode_hdr(const uint8_t buf[KVX_HDR_BYTES], kvx_hdr *out, td_err *err)
{
    uint32_t magic = get32(buf);
    if (magic != KVX_MAGIC)
        return td_err_set(err, TD_EFORMAT, "kvx: bad frame magic 0x%08x (not a kvx peer?)", magic);
    out->version = get16(buf + 4);
    out->type = buf[6];
    out->flags = buf[7];
    out->payload_len = get32(buf + 8);
    out->tag = get32(buf + 12);
    if (out->version != KVX_VERSION)
        return td_err_set(err, TD_EUNSUPPORTED, "kvx: peer speaks protocol version %u, this is %u",
                          out->version, KVX_VERSION);
    if (!strcmp(kvx_wire_type_name(out->type), "unknown"))
        return td_err_set(err, TD_EFORMAT, "kvx: unknown message type %u", out->type);
    if (out->flags != 0)
        return td_err_set(err, TD_EFORMAT, "kvx: %s frame with unknown flags 0x%02x",
                          kvx_wire_type_name(out->type), out->flags);
    if (out->payload_len > KVX_MAX_PAYLOAD)
        return td_err_set(err, TD_EFORMAT, "kvx: %s payload of %u bytes exceeds the limit %u",
                          kvx_wire_type_name(out->type), out->payload_len, KVX_MAX_PAYLOAD);
    return 0;
}

static int bad_len(td_err *err, const kvx_hdr *h, size_t want)
{
    return td_err_set(err, TD_EFORMAT, "kvx: %s payload is %u bytes, expected %zu",
                      kvx_wire_type_name(h->type), h->payload_len, want);
}

/*
 * A short string field at p (u8 length, then the bytes), within len bytes: copied to out
 * (KVX_MAX_RAIL + 1 bytes). Length in [min, KVX_MAX_RAIL], printable ASCII only. Returns
 * the bytes it took, or 0 with err set.
 */
static size_t get_str(const kvx_hdr *h, const char *what, const uint8_t *p, size_t len,
                      size_t min, char *out, td_err *err)
{
    if (len < 1 || len < 1u + p[0]) {
        td_err_set(err, TD_EFORMAT, "kvx: %s %s runs past the payload", kvx_wire_type_name(h->type),
                   what);
        return 0;
    }
    size_t n = p[0];
    if (n < min || n > KVX_MAX_RAIL) {
        td_err_set(err, TD_EFORMAT, "kvx: %s %s of %zu bytes (limit %zu..%d)",
                   kvx_wire_type_name(h->type), what, n, min, KVX_MAX_RAIL);
        return 0;
    }
    for (size_t i = 0; i < n; i++)
        if (p[1 + i] < 0x21 || p[1 + i] > 0x7e) {
            td_err_set(err, TD_EFORMAT, "kvx: %s %s has a byte 0x%02x that is not printable",
                       kvx_wire_type_name(h->type), what, p[1 + i]);
            return 0;
        }
    memcpy(out, p + 1, n);
    out[n] = 0;
    return 1 + n;
}

static size_t put_str(uint8_t *p, const char *s)
{
    size_t n = strlen(s);
    p[0] = (uint8_t)n;
    memcpy(p + 1, s, n);
    return 1 + n;
}

static void get_layout(const uint8_t *p, kvx_layout *l)
{
    l->model_fingerprint = get64(p);
    l->n_layers = get32(p + 8);
    l->n_kv_heads = get32(p + 12);
    l->head_dim = get32(p + 16);
    l->block_size = get32(p + 20);
    l->kv_dtype = get32(p + 24);
    l->tp_rank = get32(p + 28);
    l->tp_size = get32(p + 32);
}

static void put_layout(uint8_t *p, const kvx_layout *l)
{
    put64(p, l->model_fingerprint);
    put32(p + 8, l->n_layers);
    put32(p + 12, l->n_kv_heads);
    put32(p + 16, l->head_dim);
    put32(p + 20, l->block_size);
    put32(p + 24, l->kv_dtype);
    put32(p + 28, l->tp_rank);
    put32(p + 32, l->tp_size);
}

int kvx_wire_decode(const kvx_hdr *h, const uint8_t *p, size_t len, kvx_msg *m, td_err *err)
{
    memset(m, 0, sizeof(*m));
    m->hdr = *h;
    if (len != h->payload_len)
        return td_err_set(err, TD_EFORMAT, "kvx: %s frame truncated: %zu of %u payload bytes",
                          kvx_wire_type_name(h->type), len, h->payload_len);
    switch (h->type) {
    case KVX_MSG_HELLO:
    case KVX_MSG_HELLO_ACK: {
        if (len < HELLO_PAYLOAD) return bad_len(err, h, HELLO_PAYLOAD);
        kvx_hello *x = &m->u.hello;
        if (len > HELLO_PAYLOAD) { /* the optional rail */
            size_t used = get_str(h, "rail", p + HELLO_PAYLOAD, len - HELLO_PAYLOAD, 1, x->rail, err);
            if (!used) return TD_EFORMAT;
            if (HELLO_PAYLOAD + used != len) return bad_len(err, h, HELLO_PAYLOAD + used);
        }
        memcpy(x->engine_id, p, 16);
        memcpy(x->expect_engine_id, p + 16, 16);
        get_layout(p + 32, &x->layout);
        x->n_segments = get32(p + 68);
        x->block_bytes = get64(p + 72);
        memcpy(x->nonce, p + 80, 16);
        x->features = get32(p + 96);
        return 0;
    }
    case KVX_MSG_AUTH:
        if (len != 32) return bad_len(err, h, 32);
        memcpy(m->u.auth.mac, p, 32);
        return 0;
    case KVX_MSG_READ:
    case KVX_MSG_UCX_GRANT: {
        if (len < 24) return bad_len(err, h, 24);
        memcpy(m->u.read.transfer_id, p, 16);
        m->u.read.flags = get32(p + 16);
        m->u.read.n_desc = get32(p + 20);
        if (m->u.read.flags & ~KVX_READ_CHECKSUMS)
            return td_err_set(err, TD_EFORMAT, "kvx: %s with unknown flags 0x%x",
                              kvx_wire_type_name(h->type), m->u.read.flags);
        if (m->u.read.n_desc == 0 || m->u.read.n_desc > KVX_MAX_DESC)
            return td_err_set(err, TD_EFORMAT, "kvx: %s with %u descriptors (limit 1..%u)",
                              kvx_wire_type_name(h->type), m->u.read.n_desc, KVX_MAX_DESC);
        size_t want = 24 + (size_t)m->u.read.n_desc * KVX_DESC_BYTES;
        if (len != want) return bad_len(err, h, want);
        m->u.read.desc = p + 24;
        for (uint32_t i = 0; i < m->u.read.n_desc; i++)
            if (kvx_wire_get_desc(m, i).n_blocks == 0)
                return td_err_set(err, TD_EFORMAT, "kvx: %s descriptor %u is empty",
                                  kvx_wire_type_name(h->type), i);
        return 0;
    }
    case KVX_MSG_DATA:
        if (len != KVX_DATA_PAYLOAD) return bad_len(err, h, KVX_DATA_PAYLOAD);
        m->u.data.data_len = get64(p);
        m->u.data.n_crc = get32(p + 8);
        if (m->u.data.n_crc > KVX_MAX_CRC)
            return td_err_set(err, TD_EFORMAT, "kvx: DATA with %u checksums (limit %u)",
                              m->u.data.n_crc, KVX_MAX_CRC);
        return 0;
    case KVX_MSG_WRITE:
        if (len != 28) return bad_len(err, h, 28);
        memcpy(m->u.write.transfer_id, p, 16);
        m->u.write.skip = get32(p + 16);
        m->u.write.n_blocks = get32(p + 20);
        m->u.write.timeout_ms = get32(p + 24);
        if (m->u.write.n_blocks == 0 || m->u.write.skip >= m->u.write.n_blocks)
            return td_err_set(err, TD_EFORMAT, "kvx: WRITE of %u blocks from block %u",
                              m->u.write.n_blocks, m->u.write.skip);
        return 0;
    case KVX_MSG_PUSH_READY: {
        if (len < 16) return bad_len(err, h, 16);
        m->u.push_ready.seg = get32(p);
        m->u.push_ready.n_seg = get32(p + 4);
        m->u.push_ready.index = get32(p + 8);
        m->u.push_ready.n = get32(p + 12);
        if (m->u.push_ready.n > KVX_MAX_DESC ||
            (m->u.push_ready.n && (m->u.push_ready.n_seg == 0 ||
                                   m->u.push_ready.seg + m->u.push_ready.n_seg <
                                       m->u.push_ready.seg)))
            return td_err_set(err, TD_EFORMAT,
                              "kvx: PUSH_READY of %u blocks in %u segments from %u (limit %u "
                              "blocks)",
                              m->u.push_ready.n, m->u.push_ready.n_seg, m->u.push_ready.seg,
                              KVX_MAX_DESC);
        size_t want = 16 + 4 * (size_t)m->u.push_ready.n;
        if (len != want) return bad_len(err, h, want);
        m->u.push_ready.ids = p + 16;
        return 0;
    }
    case KVX_MSG_RAIL: {
        size_t used = get_str(h, "rail name", p, len, 0, m->u.rail.name, err);
        if (!used) return TD_EFORMAT;
        return used == len ? 0 : bad_len(err, h, used);
    }
    case KVX_MSG_RAIL_ACK: {
        if (len < 2) return bad_len(err, h, 2);
        m->u.rail.port = get16(p);
        if (m->u.rail.port == 0) return td_err_set(err, TD_EFORMAT, "kvx: RAIL_ACK with port 0");
        size_t a = get_str(h, "address", p + 2, len - 2, 1, m->u.rail.addr, err);
        if (!a) return TD_EFORMAT;
        size_t b = get_str(h, "rail name", p + 2 + a, len - 2 - a, 1, m->u.rail.name, err);
        if (!b) return TD_EFORMAT;
        return 2 + a + b == len ? 0 : bad_len(err, h, 2 + a + b);
    }
    case KVX_MSG_PUSH_DONE:
        if (len < 4) return bad_len(err, h, 4);
        m->u.push_done.note_len = get32(p);
        if (m->u.push_done.note_len > KVX_MAX_NOTE)
            return td_err_set(err, TD_EFORMAT, "kvx: PUSH_DONE with a %u-byte note (limit %u)",
                              m->u.push_done.note_len, KVX_MAX_NOTE);
        if (len != 4 + (size_t)m->u.push_done.note_len)
            return bad_len(err, h, 4 + (size_t)m->u.push_done.note_len);
        m->u.push_done.note = p + 4;
        return 0;
    case KVX_MSG_RELEASE:
        if (len != 16) return bad_len(err, h, 16);
        memcpy(m->u.release.transfer_id, p, 16);
        return 0;
    case KVX_MSG_HEARTBEAT: {
        if (len < 4) return bad_len(err, h, 4);
        m->u.heartbeat.n_ids = get32(p);
        if (m->u.heartbeat.n_ids == 0 || m->u.heartbeat.n_ids > KVX_MAX_HEARTBEAT_IDS)
            return td_err_set(err, TD_EFORMAT, "kvx: HEARTBEAT with %u ids (limit 1..%u)",
                              m->u.heartbeat.n_ids, KVX_MAX_HEARTBEAT_IDS);
        size_t want = 4 + (size_t)m->u.heartbeat.n_ids * KVX_ID_BYTES;
        if (len != want) return bad_len(err, h, want);
        m->u.heartbeat.ids = p + 4;
        return 0;
    }
    case KVX_MSG_UCX_INFO:
    case KVX_MSG_UCX_DONE:
    case KVX_MSG_SHM_INFO:
    case KVX_MSG_CUDA_INFO:
        if (len != 0) return bad_len(err, h, 0);
        return 0;
    case KVX_MSG_CUDA_INFO_ACK:
        if (len != 112) return bad_len(err, h, 112);
        m->u.cuda_info.pid = get32(p);
        m->u.cuda_info.base = get64(p + 8);
        m->u.cuda_info.bytes = get64(p + 16);
        m->u.cuda_info.segment_stride = get64(p + 24);
        m->u.cuda_info.uuid = p + 32;
        m->u.cuda_info.handle = p + 48;
        if (m->u.cuda_info.pid == 0 || get32(p + 4) != 0 || m->u.cuda_info.bytes == 0 ||
            m->u.cuda_info.segment_stride == 0 ||
            m->u.cuda_info.segment_stride > m->u.cuda_info.bytes ||
            m->u.cuda_info.base + m->u.cuda_info.bytes < m->u.cuda_info.base)
            return td_err_set(err, TD_EFORMAT, "kvx: CUDA_INFO_ACK with pid %u, a non-zero pad, or an empty or wrapping region",
                              m->u.cuda_info.pid);
        return 0;
    case KVX_MSG_SHM_INFO_ACK:
        if (len != 48) return bad_len(err, h, 48);
        m->u.shm_info.pid = get32(p);
        m->u.shm_info.fd = get32(p + 4);
        m->u.shm_info.offset = get64(p + 8);
        m->u.shm_info.bytes = get64(p + 16);
        m->u.shm_info.segment_stride = get64(p + 24);
        m->u.shm_info.dev = get64(p + 32);
        m->u.shm_info.ino = get64(p + 40);
        if (m->u.shm_info.pid == 0 || m->u.shm_info.fd > INT32_MAX || m->u.shm_info.bytes == 0 ||
            m->u.shm_info.segment_stride == 0 || m->u.shm_info.segment_stride > m->u.shm_info.bytes ||
            m->u.shm_info.offset + m->u.shm_info.bytes < m->u.shm_info.offset)
            return td_err_set(err, TD_EFORMAT,
                              "kvx: SHM_INFO_ACK with pid %u, fd %u, an empty or wrapping region",
                              m->u.shm_info.pid, m->u.shm_info.fd);
        return 0;
    case KVX_MSG_UCX_INFO_ACK: {
        if (len < 40) return bad_len(err, h, 40);
        m->u.ucx_info.base = get64(p);
        m->u.ucx_info.segment_stride = get64(p + 8);
        m->u.ucx_info.bytes = get64(p + 16);
        m->u.ucx_info.stage_slot = get64(p + 24);
        m->u.ucx_info.addr_len = get32(p + 32);
        m->u.ucx_info.rkey_len = get32(p + 36);
        if (m->u.ucx_info.addr_len == 0 || m->u.ucx_info.addr_len > KVX_MAX_UCX_BLOB ||
            m->u.ucx_info.rkey_len == 0 || m->u.ucx_info.rkey_len > KVX_MAX_UCX_BLOB)
            return td_err_set(err, TD_EFORMAT,
                              "kvx: UCX_INFO_ACK with a %u-byte address and a %u-byte rkey "
                              "(limit 1..%u each)",
                              m->u.ucx_info.addr_len, m->u.ucx_info.rkey_len, KVX_MAX_UCX_BLOB);
        if (m->u.ucx_info.bytes == 0 ||
            m->u.ucx_info.base + m->u.ucx_info.bytes < m->u.ucx_info.base)
            return td_err_set(err, TD_EFORMAT, "kvx: UCX_INFO_ACK with an empty or wrapping region");
        if (m->u.ucx_info.stage_slot > m->u.ucx_info.bytes)
            return td_err_set(err, TD_EFORMAT,
                              "kvx: UCX_INFO_ACK with %llu-byte staging slots in a %llu-byte area",
                              (unsigned long long)m->u.ucx_info.stage_slot,
                              (unsigned long long)m->u.ucx_info.bytes);
        size_t want = 40 + (size_t)m->u.ucx_info.addr_len + m->u.ucx_info.rkey_len;
        if (len != want) return bad_len(err, h, want);
        m->u.ucx_info.addr = p + 40;
        m->u.ucx_info.rkey = p + 40 + m->u.ucx_info.addr_len;
        return 0;
    }
    case KVX_MSG_UCX_GRANTED: {
        if (len < 16) return bad_len(err, h, 16);
        m->u.ucx_granted.valid_ms = get32(p);
        m->u.ucx_granted.n_crc = get32(p + 4);
        m->u.ucx_granted.stage_off = get64(p + 8);
        if (m->u.ucx_granted.valid_ms == 0 || m->u.ucx_granted.n_crc > KVX_MAX_CRC)
            return td_err_set(err, TD_EFORMAT,
                              "kvx: UCX_GRANTED valid for %u ms with %u checksums (limit %u)",
                              m->u.ucx_granted.valid_ms, m->u.ucx_granted.n_crc, KVX_MAX_CRC);
        size_t want = 16 + 4 * (size_t)m->u.ucx_granted.n_crc;
        if (len != want) return bad_len(err, h, want);
        m->u.ucx_granted.crc = p + 16;
        return 0;
    }
    case KVX_MSG_ACK:
        if (len != 4) return bad_len(err, h, 4);
        m->u.ack.value = get32(p);
        return 0;
    case KVX_MSG_ERROR: {
        if (len < 6) return bad_len(err, h, 6);
        m->u.error.code = (int32_t)get32(p);
        uint16_t n = get16(p + 4);
        if (n > KVX_MAX_ERRMSG)
            return td_err_set(err, TD_EFORMAT, "kvx: ERROR message of %u bytes (limit %u)", n,
                              KVX_MAX_ERRMSG);
        if (len != 6u + n) return bad_len(err, h, 6u + n);
        if (m->u.error.code >= 0 || m->u.error.code < -1000)
            return td_err_set(err, TD_EFORMAT, "kvx: ERROR with code %d (must be negative)",
                              m->u.error.code);
        memcpy(m->u.error.msg, p + 6, n);
        m->u.error.msg[n] = 0;
        /* The message ends up in logs and HTTP bodies: keep it printable. */
        for (uint16_t i = 0; i < n; i++)
            if ((unsigned char)m->u.error.msg[i] < 0x20 || m->u.error.msg[i] == 0x7f)
                m->u.error.msg[i] = '?';
        if (n == 0) memcpy(m->u.error.msg, "(no message)", sizeof("(no message)"));
        /* TD_EAGAIN means "not yet, call again" to the code that gets it (a transfer still
         * running, a piece handed to another rail): from a peer it would keep a transfer
         * from ever ending, so it arrives as a protocol error. */
        if (m->u.error.code == TD_EAGAIN) m->u.error.code = TD_EPROTO;
        return 0;
    }
    }
    return td_err_set(err, TD_EFORMAT, "kvx: unknown message type %u", h->type);
}

int kvx_wire_decode_frame(const uint8_t *buf, size_t len, kvx_msg *out, td_err *err)
{
    if (len < KVX_HDR_BYTES)
        return td_err_set(err, TD_EFORMAT, "kvx: truncated frame header (%zu of %d bytes)", len,
                          KVX_HDR_BYTES);
    kvx_hdr h;
    int rc = kvx_wire_decode_hdr(buf, &h, err);
    if (rc) return rc;
    return kvx_wire_decode(&h, buf + KVX_HDR_BYTES, len - KVX_HDR_BYTES, out, err);
}

kvx_wire_desc kvx_wire_get_desc(const kvx_msg *m, uint32_t i)
{
    const uint8_t *p = m->u.read.desc + (size_t)i * KVX_DESC_BYTES;
    return (kvx_wire_desc){get32(p), get32(p + 4), get32(p + 8)};
}

uint32_t kvx_wire_trailer_get(const uint8_t *trailer, uint32_t i)
{
    return get32(trailer + (size_t)i * 4);
}

void kvx_wire_trailer_put(uint8_t *trailer, const uint32_t *crcs, uint32_t n_crc)
{
    for (uint32_t i = 0; i < n_crc; i++)
        put32(trailer + (size_t)i * 4, crcs[i]);
}

const uint8_t *kvx_wire_get_id(const kvx_msg *m, uint32_t i)
{
    return m->u.heartbeat.ids + (size_t)i * KVX_ID_BYTES;
}

size_t kvx_wire_encode_hello(uint8_t *buf, size_t cap, uint8_t type, uint32_t tag,
                             const kvx_hello *x)
{
    if (type != KVX_MSG_HELLO && type != KVX_MSG_HELLO_ACK) return 0;
    size_t rail = strnlen(x->rail, sizeof(x->rail));
    if (rail > KVX_MAX_RAIL) return 0;
    size_t n = put_hdr(buf, cap, type, tag, HELLO_PAYLOAD + (rail ? 1 + rail : 0));
    if (!n) return 0;
    uint8_t *p = buf + KVX_HDR_BYTES;
    memcpy(p, x->engine_id, 16);
    memcpy(p + 16, x->expect_engine_id, 16);
    put_layout(p + 32, &x->layout);
    put32(p + 68, x->n_segments);
    put64(p + 72, x->block_bytes);
    memcpy(p + 80, x->nonce, 16);
    put32(p + 96, x->features);
    if (rail) put_str(p + HELLO_PAYLOAD, x->rail);
    return n;
}

size_t kvx_wire_encode_rail(uint8_t *buf, size_t cap, uint32_t tag, const char *name)
{
    size_t len = strlen(name);
    if (len > KVX_MAX_RAIL) return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_RAIL, tag, 1 + len);
    if (n) put_str(buf + KVX_HDR_BYTES, name);
    return n;
}

size_t kvx_wire_encode_rail_ack(uint8_t *buf, size_t cap, uint32_t tag, const char *addr,
                                uint16_t port, const char *name)
{
    size_t a = strlen(addr), b = strlen(name);
    if (!a || !b || a > KVX_MAX_RAIL || b > KVX_MAX_RAIL || !port) return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_RAIL_ACK, tag, 2 + 1 + a + 1 + b);
    if (!n) return 0;
    uint8_t *p = buf + KVX_HDR_BYTES;
    put16(p, port);
    put_str(p + 2 + put_str(p + 2, addr), name);
    return n;
}

size_t kvx_wire_encode_auth(uint8_t *buf, size_t cap, uint32_t tag, const uint8_t mac[32])
{
    size_t n = put_hdr(buf, cap, KVX_MSG_AUTH, tag, 32);
    if (n) memcpy(buf + KVX_HDR_BYTES, mac, 32);
    return n;
}

static size_t encode_ranges(uint8_t *buf, size_t cap, uint8_t type, uint32_t tag,
                            const uint8_t transfer_id[KVX_ID_BYTES], uint32_t flags,
                            const kvx_wire_desc *d, uint32_t n_desc)
{
    if (n_desc == 0 || n_desc > KVX_MAX_DESC) return 0;
    size_t n = put_hdr(buf, cap, type, tag, 24 + (size_t)n_desc * KVX_DESC_BYTES);
    if (!n) return 0;
    uint8_t *p = buf + KVX_HDR_BYTES;
    memcpy(p, transfer_id, 16);
    put32(p + 16, flags);
    put32(p + 20, n_desc);
    for (uint32_t i = 0; i < n_desc; i++) {
        uint8_t *q = p + 24 + (size_t)i * KVX_DESC_BYTES;
        put32(q, d[i].segment);
        put32(q + 4, d[i].block);
        put32(q + 8, d[i].n_blocks);
    }
    return n;
}

size_t kvx_wire_encode_read(uint8_t *buf, size_t cap, uint32_t tag,
                            const uint8_t transfer_id[KVX_ID_BYTES], uint32_t flags,
                            const kvx_wire_desc *d, uint32_t n_desc)
{
    return encode_ranges(buf, cap, KVX_MSG_READ, tag, transfer_id, flags, d, n_desc);
}

size_t kvx_wire_encode_grant(uint8_t *buf, size_t cap, uint32_t tag,
                             const uint8_t transfer_id[KVX_ID_BYTES], uint32_t flags,
                             const kvx_wire_desc *d, uint32_t n_desc)
{
    return encode_ranges(buf, cap, KVX_MSG_UCX_GRANT, tag, transfer_id, flags, d, n_desc);
}

size_t kvx_wire_encode_empty(uint8_t *buf, size_t cap, uint8_t type, uint32_t tag)
{
    if (type != KVX_MSG_UCX_INFO && type != KVX_MSG_UCX_DONE && type != KVX_MSG_SHM_INFO &&
        type != KVX_MSG_CUDA_INFO)
        return 0;
    return put_hdr(buf, cap, type, tag, 0);
}

size_t kvx_wire_encode_shm_info(uint8_t *buf, size_t cap, uint32_t tag, uint32_t pid, uint32_t fd,
                                uint64_t offset, uint64_t bytes, uint64_t segment_stride,
                                uint64_t dev, uint64_t ino)
{
    size_t n = put_hdr(buf, cap, KVX_MSG_SHM_INFO_ACK, tag, 48);
    if (!n) return 0;
    uint8_t *p = buf + KVX_HDR_BYTES;
    put32(p, pid);
    put32(p + 4, fd);
    put64(p + 8, offset);
    put64(p + 16, bytes);
    put64(p + 24, segment_stride);
    put64(p + 32, dev);
    put64(p + 40, ino);
    return n;
}

size_t kvx_wire_encode_cuda_info(uint8_t *buf, size_t cap, uint32_t tag, uint32_t pid, uint64_t base,
                                 uint64_t bytes, uint64_t segment_stride, const uint8_t uuid[16],
                                 const uint8_t handle[64])
{
    size_t n = put_hdr(buf, cap, KVX_MSG_CUDA_INFO_ACK, tag, 112);
    if (!n) return 0;
    uint8_t *p = buf + KVX_HDR_BYTES;
    put32(p, pid);
    put32(p + 4, 0);
    put64(p + 8, base);
    put64(p + 16, bytes);
    put64(p + 24, segment_stride);
    memcpy(p + 32, uuid, 16);
    memcpy(p + 48, handle, 64);
    return n;
}

size_t kvx_wire_encode_ucx_info(uint8_t *buf, size_t cap, uint32_t tag, uint64_t base,
                                uint64_t segment_stride, uint64_t bytes, uint64_t stage_slot,
                                const void *addr, uint32_t addr_len, const void *rkey,
                                uint32_t rkey_len)
{
    if (addr_len == 0 || addr_len > KVX_MAX_UCX_BLOB || rkey_len == 0 ||
        rkey_len > KVX_MAX_UCX_BLOB || stage_slot > bytes)
        return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_UCX_INFO_ACK, tag, 40 + (size_t)addr_len + rkey_len);
    if (!n) return 0;
    uint8_t *p = buf + KVX_HDR_BYTES;
    put64(p, base);
    put64(p + 8, segment_stride);
    put64(p + 16, bytes);
    put64(p + 24, stage_slot);
    put32(p + 32, addr_len);
    put32(p + 36, rkey_len);
    memcpy(p + 40, addr, addr_len);
    memcpy(p + 40 + addr_len, rkey, rkey_len);
    return n;
}

size_t kvx_wire_encode_ucx_granted(uint8_t *buf, size_t cap, uint32_t tag, uint32_t valid_ms,
                                   uint64_t stage_off, const uint32_t *crcs, uint32_t n_crc)
{
    if (n_crc > KVX_MAX_CRC || valid_ms == 0) return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_UCX_GRANTED, tag, 16 + 4 * (size_t)n_crc);
    if (!n) return 0;
    put32(buf + KVX_HDR_BYTES, valid_ms);
    put32(buf + KVX_HDR_BYTES + 4, n_crc);
    put64(buf + KVX_HDR_BYTES + 8, stage_off);
    kvx_wire_trailer_put(buf + KVX_HDR_BYTES + 16, crcs, n_crc);
    return n;
}

size_t kvx_wire_encode_data(uint8_t *buf, size_t cap, uint32_t tag, uint64_t data_len,
                            uint32_t n_crc)
{
    if (n_crc > KVX_MAX_CRC) return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_DATA, tag, KVX_DATA_PAYLOAD);
    if (!n) return 0;
    put64(buf + KVX_HDR_BYTES, data_len);
    put32(buf + KVX_HDR_BYTES + 8, n_crc);
    return n;
}

size_t kvx_wire_encode_release(uint8_t *buf, size_t cap, uint32_t tag,
                               const uint8_t transfer_id[KVX_ID_BYTES])
{
    size_t n = put_hdr(buf, cap, KVX_MSG_RELEASE, tag, 16);
    if (n) memcpy(buf + KVX_HDR_BYTES, transfer_id, 16);
    return n;
}

size_t kvx_wire_encode_heartbeat(uint8_t *buf, size_t cap, uint32_t tag, const uint8_t *ids,
                                 uint32_t n_ids)
{
    if (n_ids == 0 || n_ids > KVX_MAX_HEARTBEAT_IDS) return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_HEARTBEAT, tag, 4 + (size_t)n_ids * KVX_ID_BYTES);
    if (!n) return 0;
    put32(buf + KVX_HDR_BYTES, n_ids);
    memcpy(buf + KVX_HDR_BYTES + 4, ids, (size_t)n_ids * KVX_ID_BYTES);
    return n;
}

size_t kvx_wire_encode_ack(uint8_t *buf, size_t cap, uint32_t tag, uint32_t value)
{
    size_t n = put_hdr(buf, cap, KVX_MSG_ACK, tag, 4);
    if (n) put32(buf + KVX_HDR_BYTES, value);
    return n;
}

size_t kvx_wire_encode_error(uint8_t *buf, size_t cap, uint32_t tag, int32_t code, const char *msg)
{
    size_t len = strnlen(msg, KVX_MAX_ERRMSG);
    if (code >= 0) return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_ERROR, tag, 6 + len);
    if (!n) return 0;
    put32(buf + KVX_HDR_BYTES, (uint32_t)code);
    put16(buf + KVX_HDR_BYTES + 4, (uint16_t)len);
    memcpy(buf + KVX_HDR_BYTES + 6, msg, len);
    return n;
}

size_t kvx_wire_encode_write(uint8_t *buf, size_t cap, uint32_t tag,
                             const uint8_t transfer_id[KVX_ID_BYTES], uint32_t skip,
                             uint32_t n_blocks, uint32_t timeout_ms)
{
    size_t n = put_hdr(buf, cap, KVX_MSG_WRITE, tag, 28);
    if (!n) return 0;
    memcpy(buf + KVX_HDR_BYTES, transfer_id, 16);
    put32(buf + KVX_HDR_BYTES + 16, skip);
    put32(buf + KVX_HDR_BYTES + 20, n_blocks);
    put32(buf + KVX_HDR_BYTES + 24, timeout_ms);
    return n;
}

size_t kvx_wire_encode_push_ready(uint8_t *buf, size_t cap, uint32_t tag, uint32_t seg,
                                  uint32_t n_seg, uint32_t index, const int32_t *ids, uint32_t n)
{
    if (n > KVX_MAX_DESC) return 0;
    size_t len = put_hdr(buf, cap, KVX_MSG_PUSH_READY, tag, 16 + 4 * (size_t)n);
    if (!len) return 0;
    uint8_t *p = buf + KVX_HDR_BYTES;
    put32(p, seg);
    put32(p + 4, n_seg);
    put32(p + 8, index);
    put32(p + 12, n);
    for (uint32_t i = 0; i < n; i++)
        put32(p + 16 + 4 * i, (uint32_t)ids[i]);
    return len;
}

size_t kvx_wire_encode_push_done(uint8_t *buf, size_t cap, uint32_t tag, const void *note,
                                 uint32_t note_len)
{
    if (note_len > KVX_MAX_NOTE) return 0;
    size_t n = put_hdr(buf, cap, KVX_MSG_PUSH_DONE, tag, 4 + (size_t)note_len);
    if (!n) return 0;
    put32(buf + KVX_HDR_BYTES, note_len);
    if (note_len) memcpy(buf + KVX_HDR_BYTES + 4, note, note_len);
    return n;
}

uint32_t kvx_wire_push_id(const kvx_msg *m, uint32_t i)
{
    return get32(m->u.push_ready.ids + 4 * (size_t)i);
}
