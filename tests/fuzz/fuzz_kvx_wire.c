/*
 * libFuzzer target for the kvx wire protocol: read the input as a stream of frames, decode
 * each strictly, touch every decoded array, and check that a decoded message encodes back
 * to the same bytes. Any crash, sanitizer report or abort is a bug: hostile bytes from a
 * peer must only ever produce an error.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvx/wire.h"

static volatile uint64_t sink;

static size_t reencode(const kvx_msg *m, uint8_t *out, size_t cap)
{
    switch (m->hdr.type) {
    case KVX_MSG_HELLO:
    case KVX_MSG_HELLO_ACK:
        return kvx_wire_encode_hello(out, cap, m->hdr.type, m->hdr.tag, &m->u.hello);
    case KVX_MSG_AUTH:
        return kvx_wire_encode_auth(out, cap, m->hdr.tag, m->u.auth.mac);
    case KVX_MSG_READ:
    case KVX_MSG_UCX_GRANT: {
        kvx_wire_desc *d = malloc(m->u.read.n_desc * sizeof(*d));
        for (uint32_t i = 0; i < m->u.read.n_desc; i++)
            d[i] = kvx_wire_get_desc(m, i);
        size_t n = m->hdr.type == KVX_MSG_READ
                       ? kvx_wire_encode_read(out, cap, m->hdr.tag, m->u.read.transfer_id,
                                              m->u.read.flags, d, m->u.read.n_desc)
                       : kvx_wire_encode_grant(out, cap, m->hdr.tag, m->u.read.transfer_id,
                                               m->u.read.flags, d, m->u.read.n_desc);
        free(d);
        return n;
    }
    case KVX_MSG_UCX_INFO:
    case KVX_MSG_UCX_DONE:
    case KVX_MSG_SHM_INFO:
    case KVX_MSG_CUDA_INFO:
        return kvx_wire_encode_empty(out, cap, m->hdr.type, m->hdr.tag);
    case KVX_MSG_CUDA_INFO_ACK:
        return kvx_wire_encode_cuda_info(out, cap, m->hdr.tag, m->u.cuda_info.pid,
                                         m->u.cuda_info.base, m->u.cuda_info.bytes,
                                         m->u.cuda_info.segment_stride, m->u.cuda_info.uuid,
                                         m->u.cuda_info.handle);
    case KVX_MSG_SHM_INFO_ACK:
        return kvx_wire_encode_shm_info(out, cap, m->hdr.tag, m->u.shm_info.pid, m->u.shm_info.fd,
                                        m->u.shm_info.offset, m->u.shm_info.bytes,
                                        m->u.shm_info.segment_stride, m->u.shm_info.dev,
                                        m->u.shm_info.ino);
    case KVX_MSG_UCX_INFO_ACK:
        return kvx_wire_encode_ucx_info(out, cap, m->hdr.tag, m->u.ucx_info.base,
                                        m->u.ucx_info.segment_stride, m->u.ucx_info.bytes,
                                        m->u.ucx_info.stage_slot, m->u.ucx_info.addr,
                                        m->u.ucx_info.addr_len, m->u.ucx_info.rkey,
                                        m->u.ucx_info.rkey_len);
    case KVX_MSG_UCX_GRANTED: {
        uint32_t *crc = malloc(4 * (size_t)m->u.ucx_granted.n_crc + 4);
        for (uint32_t i = 0; i < m->u.ucx_granted.n_crc; i++)
            crc[i] = kvx_wire_trailer_get(m->u.ucx_granted.crc, i);
        size_t n = kvx_wire_encode_ucx_granted(out, cap, m->hdr.tag, m->u.ucx_granted.valid_ms,
                                               m->u.ucx_granted.stage_off, crc,
                                               m->u.ucx_granted.n_crc);
        free(crc);
        return n;
    }
    case KVX_MSG_DATA:
        return kvx_wire_encode_data(out, cap, m->hdr.tag, m->u.data.data_len, m->u.data.n_crc);
    case KVX_MSG_RELEASE:
        return kvx_wire_encode_release(out, cap, m->hdr.tag, m->u.release.transfer_id);
    case KVX_MSG_HEARTBEAT:
        return kvx_wire_encode_heartbeat(out, cap, m->hdr.tag, m->u.heartbeat.ids,
                                         m->u.heartbeat.n_ids);
    case KVX_MSG_ACK:
        return kvx_wire_encode_ack(out, cap, m->hdr.tag, m->u.ack.value);
    case KVX_MSG_WRITE:
        return kvx_wire_encode_write(out, cap, m->hdr.tag, m->u.write.transfer_id,
                                     m->u.write.skip, m->u.write.n_blocks, m->u.write.timeout_ms);
    case KVX_MSG_PUSH_READY: {
        int32_t *ids = malloc(4 * (size_t)m->u.push_ready.n + 4);
        for (uint32_t i = 0; i < m->u.push_ready.n; i++)
            ids[i] = (int32_t)kvx_wire_push_id(m, i);
        size_t n = kvx_wire_encode_push_ready(out, cap, m->hdr.tag, m->u.push_ready.seg,
                                              m->u.push_ready.n_seg, m->u.push_ready.index, ids,
                                              m->u.push_ready.n);
        free(ids);
        return n;
    }
    case KVX_MSG_PUSH_DONE:
        return kvx_wire_encode_push_done(out, cap, m->hdr.tag, m->u.push_done.note,
                                         m->u.push_done.note_len);
    case KVX_MSG_RAIL:
        return kvx_wire_encode_rail(out, cap, m->hdr.tag, m->u.rail.name);
    case KVX_MSG_RAIL_ACK:
        return kvx_wire_encode_rail_ack(out, cap, m->hdr.tag, m->u.rail.addr, m->u.rail.port,
                                        m->u.rail.name);
    }
    return 0; /* ERROR messages are sanitized on decode, so they do not round-trip */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t at = 0;
    while (size - at >= KVX_HDR_BYTES) {
        kvx_hdr h;
        td_err err;
        if (kvx_wire_decode_hdr(data + at, &h, &err)) {
            if (!err.msg[0]) abort(); /* every error carries a message */
            return 0;
        }
        if (h.payload_len > size - at - KVX_HDR_BYTES) {
            /* A truncated payload must be refused, whatever its type. */
            kvx_msg m;
            if (kvx_wire_decode(&h, data + at + KVX_HDR_BYTES, size - at - KVX_HDR_BYTES, &m,
                                &err) == 0)
                abort();
            return 0;
        }
        size_t len = KVX_HDR_BYTES + h.payload_len;
        kvx_msg m;
        if (kvx_wire_decode_frame(data + at, len, &m, &err) == 0) {
            if (m.hdr.type == KVX_MSG_READ || m.hdr.type == KVX_MSG_UCX_GRANT)
                for (uint32_t i = 0; i < m.u.read.n_desc; i++) {
                    kvx_wire_desc d = kvx_wire_get_desc(&m, i);
                    if (d.n_blocks == 0) abort();
                    sink += d.segment + d.block + d.n_blocks;
                }
            if (m.hdr.type == KVX_MSG_DATA) {
                /* The checksum trailer follows the data; read what the input holds of it. */
                size_t rest = size - at - len;
                uint32_t n = (uint32_t)TD_MIN((uint64_t)m.u.data.n_crc, rest / 4);
                for (uint32_t i = 0; i < n; i++)
                    sink += kvx_wire_trailer_get(data + at + len, i);
            }
            if (m.hdr.type == KVX_MSG_HEARTBEAT)
                for (uint32_t i = 0; i < m.u.heartbeat.n_ids; i++)
                    sink += kvx_wire_get_id(&m, i)[0];
            if (m.hdr.type == KVX_MSG_ERROR) sink += strlen(m.u.error.msg);
            size_t cap = len + 64;
            uint8_t *out = malloc(cap);
            size_t n = reencode(&m, out, cap);
            if (m.hdr.type != KVX_MSG_ERROR && (n != len || memcmp(out, data + at, len)))
                abort(); /* decoding must be exact: what it accepts, it can reproduce */
            free(out);
        } else if (!err.msg[0]) {
            abort();
        }
        at += len;
    }
    return 0;
}
