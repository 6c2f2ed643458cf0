/* Unit tests for kvx/wire.c and the pure helpers of kvx/common.c: frame round trips, every
 * class of malformed input, CRC32C, descriptor coalescing, layout comparison, ids. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvx/kvx_internal.h"

static kvx_layout sample_layout(void)
{
    return (kvx_layout){.model_fingerprint = 0x1122334455667788ull,
                        .n_layers = 12,
                        .n_kv_heads = 12,
                        .head_dim = 64,
                        .block_size = 16,
                        .kv_dtype = 1,
                        .tp_rank = 0,
                        .tp_size = 1};
}

static void test_roundtrip(void **state)
{
    (void)state;
    uint8_t buf[4096];
    kvx_msg m;
    td_err err;

    kvx_hello h = {0};
    for (int i = 0; i < 16; i++)
        h.engine_id[i] = (uint8_t)i, h.nonce[i] = (uint8_t)(100 + i);
    h.layout = sample_layout();
    h.n_segments = 12;
    h.block_bytes = 32768;
    h.features = KVX_FEAT_CHECKSUMS;
    size_t n = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO, 7, &h);
    assert_true(n > KVX_HDR_BYTES);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_HELLO);
    assert_int_equal(m.hdr.tag, 7);
    assert_memory_equal(&m.u.hello.layout, &h.layout, sizeof(h.layout));
    assert_memory_equal(m.u.hello.engine_id, h.engine_id, 16);
    assert_memory_equal(m.u.hello.nonce, h.nonce, 16);
    assert_int_equal(m.u.hello.n_segments, 12);
    assert_int_equal(m.u.hello.block_bytes, 32768);
    assert_int_equal(m.u.hello.features, KVX_FEAT_CHECKSUMS);
    n = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO_ACK, 8, &h);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_HELLO_ACK);

    uint8_t id[16];
    for (int i = 0; i < 16; i++)
        id[i] = (uint8_t)(0xa0 + i);
    kvx_wire_desc d[3] = {{0, 5, 3}, {1, 0xfffffff0u, 7}, {11, 9, 1}};
    n = kvx_wire_encode_read(buf, sizeof(buf), 9, id, KVX_READ_CHECKSUMS, d, 3);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.read.n_desc, 3);
    assert_memory_equal(m.u.read.transfer_id, id, 16);
    for (uint32_t i = 0; i < 3; i++) {
        kvx_wire_desc g = kvx_wire_get_desc(&m, i);
        assert_int_equal(g.segment, d[i].segment);
        assert_int_equal(g.block, d[i].block);
        assert_int_equal(g.n_blocks, d[i].n_blocks);
    }

    uint32_t crcs[4] = {1, 0xdeadbeef, 3, 0xffffffff};
    n = kvx_wire_encode_data(buf, sizeof(buf), 10, 1ull << 40, 4);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.data.data_len, 1ull << 40);
    assert_int_equal(m.u.data.n_crc, 4);
    uint8_t trailer[16];
    kvx_wire_trailer_put(trailer, crcs, 4);
    for (uint32_t i = 0; i < 4; i++)
        assert_int_equal(kvx_wire_trailer_get(trailer, i), crcs[i]);
    assert_int_equal(kvx_wire_encode_data(buf, sizeof(buf), 10, 1, KVX_MAX_CRC + 1), 0);

    n = kvx_wire_encode_release(buf, sizeof(buf), 11, id);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_memory_equal(m.u.release.transfer_id, id, 16);

    uint8_t ids[32];
    memcpy(ids, id, 16);
    memset(ids + 16, 0x55, 16);
    n = kvx_wire_encode_heartbeat(buf, sizeof(buf), 12, ids, 2);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.heartbeat.n_ids, 2);
    assert_memory_equal(kvx_wire_get_id(&m, 1), ids + 16, 16);

    n = kvx_wire_encode_ack(buf, sizeof(buf), 13, 42);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.ack.value, 42);

    n = kvx_wire_encode_error(buf, sizeof(buf), 14, TD_ENOTFOUND, "no such\ttransfer");
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.error.code, TD_ENOTFOUND);
    assert_string_equal(m.u.error.msg, "no such?transfer"); /* control bytes made printable */
    /* A peer's "call again" would keep a transfer running forever: a protocol error here;
     * an empty message says so. */
    n = kvx_wire_encode_error(buf, sizeof(buf), 14, TD_EAGAIN, "");
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.error.code, TD_EPROTO);
    assert_string_equal(m.u.error.msg, "(no message)");

    uint8_t mac[32];
    memset(mac, 7, 32);
    n = kvx_wire_encode_auth(buf, sizeof(buf), 15, mac);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_memory_equal(m.u.auth.mac, mac, 32);

    /* Encoders refuse what the decoder would refuse. */
    assert_int_equal(kvx_wire_encode_read(buf, sizeof(buf), 1, id, 0, d, 0), 0);
    assert_int_equal(kvx_wire_encode_read(buf, 20, 1, id, 0, d, 3), 0);
    assert_int_equal(kvx_wire_encode_error(buf, sizeof(buf), 1, 5, "x"), 0);
    assert_int_equal(kvx_wire_encode_heartbeat(buf, sizeof(buf), 1, ids, 0), 0);
}

/* Every proper prefix of a valid frame is an error, never a crash or a success. */
static void test_truncated(void **state)
{
    (void)state;
    uint8_t buf[4096];
    kvx_msg m;
    td_err err;
    kvx_wire_desc d[2] = {{0, 1, 2}, {1, 3, 4}};
    uint8_t id[16] = {1};
    size_t sizes[4];
    uint8_t frames[4][512];
    kvx_hello h = {0};
    sizes[0] = kvx_wire_encode_hello(frames[0], 512, KVX_MSG_HELLO, 1, &h);
    sizes[1] = kvx_wire_encode_read(frames[1], 512, 1, id, 0, d, 2);
    sizes[2] = kvx_wire_encode_data(frames[2], 512, 1, 99, 3);
    sizes[3] = kvx_wire_encode_error(frames[3], 512, 1, TD_EIO, "disk on fire");
    for (int f = 0; f < 4; f++)
        for (size_t len = 0; len < sizes[f]; len++) {
            memcpy(buf, frames[f], len);
            td_err_clear(&err);
            assert_int_equal(kvx_wire_decode_frame(buf, len, &m, &err), TD_EFORMAT);
            assert_true(strlen(err.msg) > 0);
        }
    /* Trailing bytes after a whole frame are an error too. */
    memcpy(buf, frames[1], sizes[1]);
    buf[sizes[1]] = 0;
    assert_int_equal(kvx_wire_decode_frame(buf, sizes[1] + 1, &m, &err), TD_EFORMAT);
}

static void set32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void test_bad_headers(void **state)
{
    (void)state;
    uint8_t buf[256], good[256];
    kvx_msg m;
    td_err err;
    size_t n = kvx_wire_encode_ack(good, sizeof(good), 1, 1);

    memcpy(buf, good, n);
    buf[0] ^= 1; /* magic */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "magic"));

    memcpy(buf, good, n);
    buf[4] = KVX_VERSION + 1; /* version */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EUNSUPPORTED);
    assert_non_null(strstr(err.msg, "version 3"));

    int bad_types[] = {0, 15, 77, 255};
    for (size_t i = 0; i < TD_ARRAY_LEN(bad_types); i++) {
        memcpy(buf, good, n);
        buf[6] = (uint8_t)bad_types[i];
        assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
        assert_non_null(strstr(err.msg, "unknown message type"));
    }

    memcpy(buf, good, n);
    buf[7] = 0x80; /* flags */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);

    memcpy(buf, good, n);
    set32(buf + 8, 0xffffffffu); /* absurd length */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "exceeds the limit"));
    kvx_hdr h;
    assert_int_equal(kvx_wire_decode_hdr(buf, &h, &err), TD_EFORMAT);

    /* A length that is valid for the limit but wrong for the type. */
    memcpy(buf, good, n);
    set32(buf + 8, 5);
    buf[n] = 0;
    assert_int_equal(kvx_wire_decode_frame(buf, n + 1, &m, &err), TD_EFORMAT);
}

static void test_bad_payloads(void **state)
{
    (void)state;
    uint8_t buf[1024];
    kvx_msg m;
    td_err err;
    uint8_t id[16] = {0};
    kvx_wire_desc d[2] = {{0, 1, 2}, {1, 3, 4}};

    /* READ: n_desc disagreeing with the length, zero, beyond the limit, an empty range,
     * unknown flags. */
    size_t n = kvx_wire_encode_read(buf, sizeof(buf), 1, id, 0, d, 2);
    set32(buf + KVX_HDR_BYTES + 20, 3);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES + 20, 0);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES + 20, KVX_MAX_DESC + 1);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "descriptors"));
    set32(buf + KVX_HDR_BYTES + 20, 2);
    set32(buf + KVX_HDR_BYTES + 24 + 8, 0);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "empty"));
    n = kvx_wire_encode_read(buf, sizeof(buf), 1, id, 0x10, d, 2);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);

    /* DATA: more checksums than allowed; a payload longer than its fixed size. */
    n = kvx_wire_encode_data(buf, sizeof(buf), 1, 10, 2);
    set32(buf + KVX_HDR_BYTES + 8, KVX_MAX_CRC + 1);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES + 8, 3);
    set32(buf + 8, 16);
    memset(buf + n, 0, 4);
    assert_int_equal(kvx_wire_decode_frame(buf, n + 4, &m, &err), TD_EFORMAT);

    /* HEARTBEAT: zero ids, too many ids. */
    n = kvx_wire_encode_heartbeat(buf, sizeof(buf), 1, id, 1);
    set32(buf + KVX_HDR_BYTES, 0);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES, KVX_MAX_HEARTBEAT_IDS + 1);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);

    /* ERROR: a non-negative code, a message length beyond the payload or the limit. */
    n = kvx_wire_encode_error(buf, sizeof(buf), 1, TD_EIO, "abc");
    set32(buf + KVX_HDR_BYTES, 0);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES, (uint32_t)TD_EIO);
    buf[KVX_HDR_BYTES + 4] = 200;
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    buf[KVX_HDR_BYTES + 4] = 0xff;
    buf[KVX_HDR_BYTES + 5] = 0xff;
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);

    /* Fixed-size messages with a wrong size. */
    n = kvx_wire_encode_release(buf, sizeof(buf), 1, id);
    set32(buf + 8, 15);
    assert_int_equal(kvx_wire_decode_frame(buf, n - 1, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "RELEASE"));
}

/* AUTH is exactly a 32-byte MAC: every other length, a prefix, trailing bytes or a flag is
 * refused, and the encoder refuses a buffer too small for the frame. */
static void test_auth_frame(void **state)
{
    (void)state;
    uint8_t buf[256], frame[64], mac[32];
    kvx_msg m;
    td_err err;
    for (int i = 0; i < 32; i++)
        mac[i] = (uint8_t)(0xff - i);
    size_t n = kvx_wire_encode_auth(frame, sizeof(frame), 0xabcdef01u, mac);
    assert_int_equal(n, KVX_HDR_BYTES + 32);
    assert_int_equal(frame[6], KVX_MSG_AUTH);
    assert_int_equal(kvx_wire_decode_frame(frame, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_AUTH);
    assert_int_equal(m.hdr.tag, 0xabcdef01u);
    assert_memory_equal(m.u.auth.mac, mac, 32);
    assert_memory_equal(frame + KVX_HDR_BYTES, mac, 32); /* the MAC travels as is */
    assert_string_equal(kvx_wire_type_name(KVX_MSG_AUTH), "AUTH");

    for (size_t len = 0; len < n; len++) { /* every prefix */
        td_err_clear(&err);
        assert_int_equal(kvx_wire_decode_frame(frame, len, &m, &err), TD_EFORMAT);
        assert_true(strlen(err.msg) > 0);
    }
    memcpy(buf, frame, n); /* trailing bytes */
    buf[n] = 0;
    assert_int_equal(kvx_wire_decode_frame(buf, n + 1, &m, &err), TD_EFORMAT);

    uint32_t lens[] = {0, 1, 16, 31, 33, 64, 200};
    for (size_t i = 0; i < TD_ARRAY_LEN(lens); i++) { /* a consistent frame of the wrong size */
        memcpy(buf, frame, KVX_HDR_BYTES);
        set32(buf + 8, lens[i]);
        memset(buf + KVX_HDR_BYTES, 7, lens[i]);
        td_err_clear(&err);
        assert_int_equal(kvx_wire_decode_frame(buf, KVX_HDR_BYTES + lens[i], &m, &err), TD_EFORMAT);
        assert_non_null(strstr(err.msg, "AUTH payload"));
        assert_non_null(strstr(err.msg, "expected 32"));
    }

    memcpy(buf, frame, n);
    buf[7] = 1; /* no flag is defined */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);

    for (size_t cap = 0; cap < n; cap++)
        assert_int_equal(kvx_wire_encode_auth(buf, cap, 1, mac), 0);
}

static void test_crc32c(void **state)
{
    (void)state;
    assert_int_equal(td_crc32c(0, "123456789", 9), 0xE3069283u);
    assert_int_equal(td_crc32c_portable(0, "123456789", 9), 0xE3069283u);
    uint8_t *data = malloc(3 * 4099 + 64);
    td_rng rng;
    td_rng_seed(&rng, 5);
    for (int i = 0; i < 3 * 4099 + 64; i++)
        data[i] = (uint8_t)td_rng_next(&rng);
    for (size_t len = 0; len < 200; len++)
        assert_int_equal(td_crc32c(0, data + 1, len), td_crc32c_portable(0, data + 1, len));
    /* Continuation: crc(a || b) == crc(crc(a), b). */
    assert_int_equal(td_crc32c(td_crc32c(0, data, 100), data + 100, 900),
                     td_crc32c(0, data, 1000));
    for (uint32_t count = 1; count <= 7; count++) {
        uint32_t out[7];
        td_crc32c_blocks(data, 1027, count, out);
        for (uint32_t i = 0; i < count; i++)
            assert_int_equal(out[i], td_crc32c_portable(0, data + i * 1027, 1027));
    }
    free(data);
}

static void test_coalesce(void **state)
{
    (void)state;
    kvx_run runs[64];
    int32_t src[64], dst[64];
    /* 64 consecutive blocks on both sides: one run. */
    for (int i = 0; i < 64; i++)
        src[i] = 100 + i, dst[i] = 7 + i;
    assert_int_equal(kvx_coalesce(src, dst, 64, 1000, 1000, runs), 1);
    assert_int_equal(runs[0].src_block, 100);
    assert_int_equal(runs[0].dst_block, 7);
    assert_int_equal(runs[0].n_blocks, 64);
    /* A break on the consumer side only splits too. */
    dst[32] = 500;
    for (int i = 33; i < 64; i++)
        dst[i] = 501 + (i - 33);
    assert_int_equal(kvx_coalesce(src, dst, 64, 1000, 1000, runs), 2);
    assert_int_equal(runs[1].src_block, 132);
    assert_int_equal(runs[1].dst_block, 500);
    assert_int_equal(runs[1].n_blocks, 32);
    /* Four runs of 16: descriptors grow with runs, not blocks. */
    for (int i = 0; i < 64; i++)
        src[i] = (i / 16) * 100 + i % 16, dst[i] = i;
    assert_int_equal(kvx_coalesce(src, dst, 64, 1000, 1000, runs), 4);
    /* Nothing consecutive: one run per block. */
    for (int i = 0; i < 64; i++)
        src[i] = 2 * i, dst[i] = i;
    assert_int_equal(kvx_coalesce(src, dst, 64, 1000, 1000, runs), 64);
    /* Descending ids do not merge. */
    for (int i = 0; i < 8; i++)
        src[i] = 8 - i, dst[i] = 8 - i;
    assert_int_equal(kvx_coalesce(src, dst, 8, 1000, 1000, runs), 8);
    /* Out of range and negative ids. */
    src[0] = 1000;
    assert_int_equal(kvx_coalesce(src, dst, 1, 1000, 1000, runs), TD_EINVAL);
    src[0] = -1;
    assert_int_equal(kvx_coalesce(src, dst, 1, 1000, 1000, runs), TD_EINVAL);
    src[0] = 1;
    dst[0] = 5;
    assert_int_equal(kvx_coalesce(src, dst, 1, 1000, 5, runs), TD_EINVAL);
    assert_int_equal(kvx_coalesce(src, dst, 0, 1000, 5, runs), 0);
}

/* How a transfer is cut: up to qp pieces, none under the minimum unless the whole
 * transfer is, as many as the maximum needs. */
static void test_piece_count(void **state)
{
    (void)state;
    const uint64_t K = 1024, M = 1024 * K, MAX = 8 * M, NONE = UINT64_MAX;
    const uint64_t min = KVX_MIN_PIECE_BYTES, stripe = KVX_MIN_STRIPE_BYTES;
    assert_int_equal(kvx_piece_count(0, 4, min, MAX), 1);
    assert_int_equal(kvx_piece_count(64 * K, 4, min, MAX), 1);
    assert_int_equal(kvx_piece_count(min - 1, 4, min, MAX), 1);
    assert_int_equal(kvx_piece_count(M, 4, min, MAX), 2);      /* 2 x 512 KiB */
    assert_int_equal(kvx_piece_count(2 * M, 4, min, MAX), 4);  /* qp reached */
    assert_int_equal(kvx_piece_count(16 * M, 4, min, MAX), 4); /* 4 MiB each */
    assert_int_equal(kvx_piece_count(64 * M, 4, min, MAX), 8); /* 8 MiB each at most */
    assert_int_equal(kvx_piece_count(64 * M + 1, 4, min, MAX), 9);
    assert_int_equal(kvx_piece_count(64 * M, 4, min, NONE), 4); /* no maximum (cuda_ipc) */
    assert_int_equal(kvx_piece_count(M, 16, stripe, MAX), 16);  /* striped: 64 KiB pieces */
    assert_int_equal(kvx_piece_count(M, 0, min, MAX), 1);       /* qp 0 counts as 1 */
    assert_int_equal(kvx_piece_count(M, 4, 0, MAX), 4);         /* no minimum */
}

static void test_layout_and_ids(void **state)
{
    (void)state;
    kvx_layout a = sample_layout(), b = a;
    td_err err;
    assert_int_equal(kvx_layout_compare(&a, &b, &err), 0);
    b.block_size = 32;
    assert_int_equal(kvx_layout_compare(&a, &b, &err), TD_EPROTO);
    assert_non_null(strstr(err.msg, "block_size: local 16, peer 32"));
    b = a;
    b.kv_dtype = 7;
    assert_int_equal(kvx_layout_compare(&a, &b, &err), TD_EPROTO);
    assert_non_null(strstr(err.msg, "kv_dtype: local 1, peer 7"));
    b = a;
    b.model_fingerprint = 1;
    assert_int_equal(kvx_layout_compare(&a, &b, &err), TD_EPROTO);
    assert_non_null(strstr(err.msg, "model_fingerprint"));

    uint8_t id[16], back[16];
    assert_int_equal(kvx__random_id(id), 0);
    char hex[KVX_ID_HEX];
    kvx_id_to_hex(id, hex);
    assert_int_equal(strlen(hex), 32);
    assert_int_equal(kvx_id_from_hex(hex, back), 0);
    assert_memory_equal(id, back, 16);
    assert_int_equal(kvx_id_from_hex("00", back), TD_EINVAL);
    assert_int_equal(kvx_id_from_hex("0123456789abcdef0123456789abcdeg", back), TD_EINVAL);
    assert_int_equal(kvx_id_from_hex(NULL, back), TD_EINVAL);

    kvx_region r = {
        .base = id, .n_segments = 2, .segment_stride = 100, .block_bytes = 10, .n_blocks = 11};
    assert_int_equal(kvx_region_check(&r, &err), TD_EINVAL);
    r.n_blocks = 10;
    assert_int_equal(kvx_region_check(&r, &err), 0);
}

/* The push frames: round trips and the limits of each field. */
static void test_push_frames(void **state)
{
    (void)state;
    static uint8_t buf[KVX_HDR_BYTES + 16 + 4 * KVX_MAX_DESC + 64];
    kvx_msg m;
    td_err err;
    uint8_t id[16];
    for (int i = 0; i < 16; i++)
        id[i] = (uint8_t)(i * 9);

    size_t n = kvx_wire_encode_write(buf, sizeof(buf), 7, id, 2, 9, 1500);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_WRITE);
    assert_memory_equal(m.u.write.transfer_id, id, 16);
    assert_int_equal(m.u.write.skip, 2);
    assert_int_equal(m.u.write.n_blocks, 9);
    assert_int_equal(m.u.write.timeout_ms, 1500);
    set32(buf + KVX_HDR_BYTES + 16, 9); /* skip == n_blocks: nothing wanted */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES + 16, 0);
    set32(buf + KVX_HDR_BYTES + 20, 0);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_int_equal(kvx_wire_decode_frame(buf, n - 1, &m, &err), TD_EFORMAT); /* truncated */

    int32_t ids[3] = {5, 6, 70000};
    n = kvx_wire_encode_push_ready(buf, sizeof(buf), 1, 3, 2, 10, ids, 3);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.push_ready.seg, 3);
    assert_int_equal(m.u.push_ready.n_seg, 2);
    assert_int_equal(m.u.push_ready.index, 10);
    assert_int_equal(m.u.push_ready.n, 3);
    assert_int_equal(kvx_wire_push_id(&m, 2), 70000);
    n = kvx_wire_encode_push_ready(buf, sizeof(buf), 1, 0, 0, 0, NULL, 0); /* keep-alive */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.push_ready.n, 0);
    n = kvx_wire_encode_push_ready(buf, sizeof(buf), 1, 3, 2, 10, ids, 3);
    set32(buf + KVX_HDR_BYTES + 12, 4); /* count disagrees with the length */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES + 12, KVX_MAX_DESC + 1); /* absurd count */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES + 12, 3);
    set32(buf + KVX_HDR_BYTES + 4, 0); /* blocks in no segment */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES, 0xffffffffu); /* segments wrapping around */
    set32(buf + KVX_HDR_BYTES + 4, 2);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_int_equal(kvx_wire_encode_push_ready(buf, sizeof(buf), 1, 0, 1, 0, ids,
                                                KVX_MAX_DESC + 1),
                     0);

    n = kvx_wire_encode_push_done(buf, sizeof(buf), 1, "note", 4);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.u.push_done.note_len, 4);
    assert_memory_equal(m.u.push_done.note, "note", 4);
    set32(buf + KVX_HDR_BYTES, 5); /* longer than what follows */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    set32(buf + KVX_HDR_BYTES, KVX_MAX_NOTE + 1);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_int_equal(kvx_wire_encode_push_done(buf, sizeof(buf), 1, buf, KVX_MAX_NOTE + 1), 0);
}

/* Rails: HELLO's optional rail field, RAIL and RAIL_ACK, and their bad forms. */
static void test_rail_frames(void **state)
{
    (void)state;
    uint8_t buf[512];
    kvx_msg m;
    td_err err;
    kvx_hello h = {0};
    h.layout = sample_layout();
    size_t plain = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO, 1, &h);
    assert_int_equal(kvx_wire_decode_frame(buf, plain, &m, &err), 0);
    assert_string_equal(m.u.hello.rail, "");
    snprintf(h.rail, sizeof(h.rail), "tdr3");
    size_t n = kvx_wire_encode_hello(buf, sizeof(buf), KVX_MSG_HELLO, 1, &h);
    assert_int_equal(n, plain + 5);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_string_equal(m.u.hello.rail, "tdr3");
    buf[plain] = 9; /* the rail's length runs past the payload */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    buf[plain] = 2; /* shorter than the payload: bytes left over */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    buf[plain] = 4;
    buf[plain + 2] = 0; /* a NUL inside */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_non_null(strstr(err.msg, "not printable"));

    n = kvx_wire_encode_rail(buf, sizeof(buf), 3, "mlx5_2");
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_RAIL);
    assert_string_equal(m.u.rail.name, "mlx5_2");
    n = kvx_wire_encode_rail(buf, sizeof(buf), 3, ""); /* "your primary" */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_string_equal(m.u.rail.name, "");
    char longname[KVX_MAX_RAIL + 2];
    memset(longname, 'a', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    assert_int_equal(kvx_wire_encode_rail(buf, sizeof(buf), 3, longname), 0);

    n = kvx_wire_encode_rail_ack(buf, sizeof(buf), 4, "10.100.2.1", 40123, "tdr2");
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_RAIL_ACK);
    assert_string_equal(m.u.rail.addr, "10.100.2.1");
    assert_string_equal(m.u.rail.name, "tdr2");
    assert_int_equal(m.u.rail.port, 40123);
    assert_int_equal(kvx_wire_decode_frame(buf, n - 1, &m, &err), TD_EFORMAT); /* truncated */
    buf[KVX_HDR_BYTES] = buf[KVX_HDR_BYTES + 1] = 0; /* port 0 */
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), TD_EFORMAT);
    assert_int_equal(kvx_wire_encode_rail_ack(buf, sizeof(buf), 4, "", 1, "tdr2"), 0);
    assert_int_equal(kvx_wire_encode_rail_ack(buf, sizeof(buf), 4, "10.0.0.1", 0, "tdr2"), 0);
    assert_int_equal(kvx_wire_encode_rail_ack(buf, sizeof(buf), 4, "10.0.0.1", 1, ""), 0);
}

/* The cuda_ipc handshake: CUDA_INFO (empty) and its answer, round trip and bad payloads. */
static void test_cuda_frames(void **state)
{
    (void)state;
    uint8_t buf[512], uuid[16], handle[64];
    kvx_msg m;
    td_err err;
    for (int i = 0; i < 16; i++) uuid[i] = (uint8_t)(0xa0 + i);
    for (int i = 0; i < 64; i++) handle[i] = (uint8_t)(3 * i + 1);
    size_t n = kvx_wire_encode_empty(buf, sizeof(buf), KVX_MSG_CUDA_INFO, 5);
    assert_int_equal(n, KVX_HDR_BYTES);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_CUDA_INFO);
    assert_string_equal(kvx_wire_type_name(KVX_MSG_CUDA_INFO_ACK), "CUDA_INFO_ACK");

    n = kvx_wire_encode_cuda_info(buf, sizeof(buf), 6, 4242, 0x7f0000000000ull, 1u << 30,
                                  1u << 25, uuid, handle);
    assert_int_equal(n, KVX_HDR_BYTES + 112);
    assert_int_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
    assert_int_equal(m.hdr.type, KVX_MSG_CUDA_INFO_ACK);
    assert_int_equal(m.hdr.tag, 6);
    assert_int_equal(m.u.cuda_info.pid, 4242);
    assert_true(m.u.cuda_info.base == 0x7f0000000000ull);
    assert_true(m.u.cuda_info.bytes == (1u << 30));
    assert_true(m.u.cuda_info.segment_stride == (1u << 25));
    assert_memory_equal(m.u.cuda_info.uuid, uuid, 16);
    assert_memory_equal(m.u.cuda_info.handle, handle, 64);
    assert_int_equal(kvx_wire_decode_frame(buf, n - 1, &m, &err), TD_EFORMAT); /* truncated */
    assert_int_equal(kvx_wire_encode_cuda_info(buf, 100, 6, 1, 0, 1, 1, uuid, handle), 0);

    /* pid 0, a non-zero pad, no bytes, a stride over the size, a region that wraps */
    struct {
        uint32_t pid;
        uint64_t base, bytes, stride;
        int pad;
    } bad[] = {{0, 0, 4096, 4096, 0},
               {7, 0, 4096, 4096, 1},
               {7, 0, 0, 4096, 0},
               {7, 0, 4096, 8192, 0},
               {7, UINT64_MAX - 10, 4096, 4096, 0},
               {7, 0, 4096, 0, 0}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        n = kvx_wire_encode_cuda_info(buf, sizeof(buf), 6, bad[i].pid, bad[i].base, bad[i].bytes,
                                      bad[i].stride, uuid, handle);
        assert_int_not_equal(n, 0);
        if (bad[i].pad) buf[KVX_HDR_BYTES + 5] = 1;
        if (kvx_wire_decode_frame(buf, n, &m, &err) != TD_EFORMAT) fail_msg("accepted bad case %zu", i);
        assert_non_null(strstr(err.msg, "CUDA_INFO_ACK"));
    }
    /* CUDA_INFO with a payload */
    n = kvx_wire_encode_cuda_info(buf, sizeof(buf), 6, 7, 0, 4096, 4096, uuid, handle);
    buf[6] = KVX_MSG_CUDA_INFO; /* the header's type byte */
    assert_int_not_equal(kvx_wire_decode_frame(buf, n, &m, &err), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),   cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_bad_headers), cmocka_unit_test(test_bad_payloads),
        cmocka_unit_test(test_push_frames), cmocka_unit_test(test_rail_frames),
        cmocka_unit_test(test_crc32c),      cmocka_unit_test(test_coalesce),
        cmocka_unit_test(test_piece_count), cmocka_unit_test(test_layout_and_ids),
        cmocka_unit_test(test_auth_frame),  cmocka_unit_test(test_cuda_frames),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
