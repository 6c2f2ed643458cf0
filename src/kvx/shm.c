/*
 * kvx/shm.c - the shm transport: a same-host consumer copies straight out of the
 * producer's KV pool, which lives in a memfd.
 *
 * Per session, once: SHM_INFO over an authenticated control connection; the producer
 * answers with its pid, the memfd's descriptor number, the region's offset and size, and
 * the memfd's device and inode; the consumer opens /proc/<pid>/fd/<fd> read-only (the
 * kernel allows it to a process of the same user in the same PID namespace, the same rule
 * as for reading its memory), checks with fstat that it opened that very file (in another
 * PID namespace the pid names another process), and maps it PROT_READ for the session's
 * life.
 *
 * Per piece, on a pooled control connection: UCX_GRANT (READ's ranges) makes the producer
 * check them against the transfer's lease and pin it, and answer UCX_GRANTED with one
 * CRC32C per block; the consumer copies the ranges out of the mapping (with checksums, copy
 * and checksum in one pass), verifies the checksums, and sends UCX_DONE to unpin. So a
 * consumer still reads only the blocks of a transfer id it was handed, and the producer
 * never reuses blocks while they are copied (an expired or released lease stays pinned
 * until UCX_DONE or the pin limit, and kvx_agent_destroy waits for pinned connections).
 * The pieces of a transfer run on the client's worker threads, so a copy uses several
 * cores.
 *
 * The mapping itself gives a same-user process the whole pool: shm is for trusted
 * same-host peers, like any shared-memory transport (a same-user process could read the
 * producer's memory anyway).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

_Atomic int kvx__test_copy_delay_ms;
_Atomic int kvx__test_copies_delayed;

typedef struct shm_session {
    kvx__grant_pool gp; /* its mutex also guards the mapping's setup */
    const uint8_t *map; /* the producer's memfd, whole; NULL until mapped */
    size_t map_len;
    uint64_t offset, bytes; /* the region inside the mapping */
    uint64_t stride;        /* the producer's segment stride */
} shm_session;

static void shm_session_free(void *state)
{
    shm_session *ss = state;
    if (!ss) return;
    kvx__grant_pool_fini(&ss->gp);
    if (ss->map) munmap((void *)ss->map, ss->map_len);
    free(ss);
}

static shm_session *session_state(struct kvx__session *s)
{
    return kvx__session_state_get(s, sizeof(shm_session), shm_session_free);
}

/* Map the producer's pool once per session (a kvx__grant_setup_fn: under the pool's lock). */
static int map_pool(struct kvx__session *s, void *user, int fd, uint64_t deadline, td_err *err)
{
    shm_session *ss = user;
    if (ss->map) return 0;
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    uint8_t buf[512];
    kvx_msg m;
    int rc = kvx__info_ask(s, fd, KVX_MSG_SHM_INFO, KVX_MSG_SHM_INFO_ACK, "shm", buf, sizeof(buf),
                           &m, deadline, err);
    if (rc) return rc;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%u/fd/%u", m.u.shm_info.pid, m.u.shm_info.fd);
    int mfd = open(path, O_RDONLY | O_CLOEXEC);
    if (mfd < 0)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "kvx shm: cannot open producer %s:%u's pool (%s): %s; shm needs a "
                          "producer on this host, same user and PID namespace (else use tcp)",
                          host, port, path, strerror(errno));
    /* The pid is the producer's in its own PID namespace: a consumer in another one (a
     * container sharing only the network, say) may have opened some other process's
     * descriptor, possibly its own pool. The memfd's identity settles it. */
    struct stat st;
    if (fstat(mfd, &st) != 0 || (uint64_t)st.st_dev != m.u.shm_info.dev ||
        (uint64_t)st.st_ino != m.u.shm_info.ino) {
        close(mfd);
        return td_err_set(err, TD_EUNSUPPORTED,
                          "kvx shm: %s on this host is not producer %s:%u's pool (a producer in "
                          "another PID namespace or container?); shm needs a producer on this "
                          "host, same user and PID namespace (else use tcp)",
                          path, host, port);
    }
    size_t len = (size_t)(m.u.shm_info.offset + m.u.shm_info.bytes);
    if ((uint64_t)st.st_size < len) {
        close(mfd);
        return td_err_set(err, TD_EPROTO, "kvx shm: producer %s:%u's pool is %lld bytes, not %zu",
                          host, port, (long long)st.st_size, len);
    }
    void *map = mmap(NULL, len, PROT_READ, MAP_SHARED, mfd, 0);
    close(mfd);
    if (map == MAP_FAILED)
        return td_err_set(err, TD_EIO, "kvx shm: cannot map producer %s:%u's pool: %s", host, port,
                          strerror(errno));
    ss->map = map;
    ss->map_len = len;
    ss->offset = m.u.shm_info.offset;
    ss->bytes = m.u.shm_info.bytes;
    ss->stride = m.u.shm_info.segment_stride;
    return 0;
}

static int shm_run_piece(struct kvx__session *s, struct kvx__piece *p, td_err *err)
{
    const kvx_client_opts *o = kvx__session_opts(s);
    const kvx_region *r = &o->region;
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    kvx__piece_info pi;
    kvx__piece_get_info(p, &pi);
    bool want_crc = o->verify_checksums;
    shm_session *ss = session_state(s);
    uint32_t *crc = want_crc ? malloc(pi.blocks * sizeof(uint32_t)) : NULL;
    if (!ss || (want_crc && !crc)) {
        free(crc);
        return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    }
    kvx__grant g;
    int rc = kvx__grant_pin(s, &ss->gp, p, want_crc, "shm", map_pool, ss, &g, err);
    if (rc) {
        free(crc);
        return rc;
    }
    const kvx_msg m = g.m;
    /* The pin lasts valid_ms from the producer's send: copy well within it. */
    uint64_t until =
        TD_MIN(pi.deadline_ns, td_now_ns() + (uint64_t)m.u.ucx_granted.valid_ms * 750000ull);
    int delay = atomic_load(&kvx__test_copy_delay_ms);
    if (delay > 0) {
        atomic_fetch_add(&kvx__test_copies_delayed, 1);
        usleep((useconds_t)delay * 1000);
    }
    bool corrupt = atomic_load(&kvx__test_corrupt_pieces) > 0 &&
                   atomic_fetch_sub(&kvx__test_corrupt_pieces, 1) > 0;
    uint32_t at = 0;
    for (uint32_t k = 0; k < pi.count && !rc; k++) {
        kvx__piece_range d = kvx__piece_get_range(p, k);
        uint64_t len = (uint64_t)d.n * r->block_bytes;
        uint64_t off = (uint64_t)d.seg * ss->stride + (uint64_t)d.src * r->block_bytes;
        if (off > ss->bytes || len > ss->bytes - off) {
            rc = td_err_set(err, TD_EPROTO,
                            "kvx shm: producer %s:%u's region (%llu bytes) does not hold "
                            "segment %u, blocks %u+%u",
                            host, port, (unsigned long long)ss->bytes, d.seg, d.src, d.n);
            break;
        }
        uint8_t *dst = (uint8_t *)r->base + kvx__offset(r, d.seg, d.dst);
        const uint8_t *src = ss->map + ss->offset + off;
        /* Copy and checksum in batches that stay in cache, so the checksum reads what the
         * copy just wrote instead of making a second pass over memory. */
        uint32_t per = kvx__batch_blocks(r->block_bytes, 128 << 10);
        for (uint32_t j = 0; j < d.n; j += per) {
            uint32_t cn = TD_MIN(per, d.n - j);
            uint64_t o2 = (uint64_t)j * r->block_bytes;
            if (want_crc && !(corrupt && k == 0 && j == 0)) {
                /* One pass: the checksum folds the bytes as they are stored. */
                td_crc32c_copy_blocks(dst + o2, src + o2, r->block_bytes, cn, crc + at + j);
                continue;
            }
            memcpy(dst + o2, src + o2, (size_t)cn * r->block_bytes);
            if (corrupt && k == 0 && j == 0) dst[r->block_bytes / 2] ^= 0x5a;
            if (want_crc) td_crc32c_blocks(dst + o2, r->block_bytes, cn, crc + at + j);
        }
        if (want_crc) {
            for (uint32_t j = 0; j < d.n; j++) {
                uint32_t want;
                memcpy(&want, m.u.ucx_granted.crc + 4 * (size_t)(at + j), 4);
                if (crc[at + j] != want) {
                    rc = td_err_set(err, TD_EPROTO,
                                    "kvx: checksum mismatch from %s:%u in segment %u, producer "
                                    "block %u (consumer block %u)",
                                    host, port, d.seg, d.src + j, d.dst + j);
                    break;
                }
            }
        }
        at += d.n;
        if (!rc && td_now_ns() > until)
            rc = td_err_set(err, TD_ETIMEDOUT, "kvx shm: deadline passed while copying from %s:%u",
                            host, port);
    }
    kvx__grant_done(&ss->gp, &g);
    free(crc);
    return rc;
}

const kvx__transport kvx__shm_transport = {"shm", shm_run_piece, kvx__session_control,
                                           shm_session_free};
