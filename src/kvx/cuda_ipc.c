/*
 * kvx/cuda_ipc.c - the cuda_ipc transport: a consumer on the same host copies straight out
 * of the producer's KV pool in GPU memory, device to device.
 *
 * Per session, once: CUDA_INFO over an authenticated control connection; the producer
 * answers with its pid, the pool's device address, size and segment stride, its GPU's
 * UUID and the pool's cudaIpcMemHandle_t. The consumer checks that it can see that GPU
 * (another host, or a CUDA_VISIBLE_DEVICES that hides it, is a clear error, not a copy
 * from the wrong memory) and opens the handle (cudaIpcOpenMemHandle, peer access enabled
 * when the GPUs differ) for the session's life. A consumer in the producer's own process
 * cannot open its own handle: it finds the region among those its agents serve and uses
 * the pointer.
 *
 * Per piece, the grant exchange of shm (grant.c): UCX_GRANT pins the transfer's blocks
 * (never with checksums: the bytes never leave the GPUs' memory and links, and the host
 * never reads them), then the copies on the worker thread's
 * own non-blocking stream (one launch of the copy kernel of cuda_copy.cu for the whole
 * piece, whose ranges are grouped into rows where consecutive layers have the same
 * blocks), an event recorded after them, the thread waits on the event, then
 * UCX_DONE unpins. Pieces are cut by kvx_piece_count with no 8 MiB cap as for host
 * memory (a grant round trip costs more than copying a few MiB). The consumer's engine learns that
 * the load finished only after that, and launches its next kernels after it, so its
 * compute stream sees the bytes. Pieces run on the client's worker threads, so several
 * transfers' copies are in flight at once on several streams.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

/* ---- this process's device regions (built with or without CUDA: the agent uses them) ---- */

#define LOCAL_MAX 16
static pthread_mutex_t local_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uint8_t handle[64];
    void *base;
    int refs;
} local_regions[LOCAL_MAX];

void kvx__cuda_local_add(const kvx_region *r)
{
    pthread_mutex_lock(&local_mu);
    int free_at = -1;
    for (int i = 0; i < LOCAL_MAX; i++) {
        if (local_regions[i].refs && !memcmp(local_regions[i].handle, r->ipc_handle, 64)) {
            local_regions[i].refs++;
            pthread_mutex_unlock(&local_mu);
            return;
        }
        if (!local_regions[i].refs && free_at < 0) free_at = i;
    }
    if (free_at >= 0) {
        memcpy(local_regions[free_at].handle, r->ipc_handle, 64);
        local_regions[free_at].base = r->base;
        local_regions[free_at].refs = 1;
    }
    pthread_mutex_unlock(&local_mu);
}

void kvx__cuda_local_remove(const kvx_region *r)
{
    pthread_mutex_lock(&local_mu);
    for (int i = 0; i < LOCAL_MAX; i++)
        if (local_regions[i].refs && !memcmp(local_regions[i].handle, r->ipc_handle, 64)) {
            local_regions[i].refs--;
            break;
        }
    pthread_mutex_unlock(&local_mu);
}

void *kvx__cuda_local_find(const uint8_t handle[64])
{
    void *base = NULL;
    pthread_mutex_lock(&local_mu);
    for (int i = 0; i < LOCAL_MAX && !base; i++)
        if (local_regions[i].refs && !memcmp(local_regions[i].handle, handle, 64))
            base = local_regions[i].base;
    pthread_mutex_unlock(&local_mu);
    return base;
}

#ifdef TD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kvx/cuda_copy.h"

enum { COPY_KERNEL, COPY_MEMCPY, COPY_2D };
static int copy_mode;
static pthread_once_t copy_mode_once = PTHREAD_ONCE_INIT;
static void copy_mode_read(void)
{
    const char *v = getenv("TD_KVX_CUDA_COPY");
    copy_mode = v && !strcmp(v, "memcpy") ? COPY_MEMCPY
                : v && !strcmp(v, "2d")   ? COPY_2D
                                          : COPY_KERNEL;
}

typedef struct cuda_session {
    kvx__grant_pool gp; /* its mutex also guards opening the handle */
    bool open;
    bool opened_ipc;     /* the pointer came from cudaIpcOpenMemHandle (close it) */
    int device;          /* the consumer's device, current when the handle was opened */
    const uint8_t *peer; /* the producer's pool in this process's address space */
    uint64_t bytes, stride;
} cuda_session;

static void cuda_session_free(void *state)
{
    cuda_session *cs = state;
    if (!cs) return;
    kvx__grant_pool_fini(&cs->gp);
    if (cs->opened_ipc) {
        cudaSetDevice(cs->device);
        cudaIpcCloseMemHandle((void *)cs->peer);
    }
    free(cs);
}

static cuda_session *session_state(struct kvx__session *s)
{
    return kvx__session_state_get(s, sizeof(cuda_session), cuda_session_free);
}

/* Each worker thread's stream and event, made on its first piece, destroyed at its exit. */
typedef struct thread_copy {
    cudaStream_t stream;
    cudaEvent_t done;
    int device;
    int n_sm;
    uint8_t *stage; /* pinned host memory for tcp's staging (kvx__stage_*), grown on use */
    size_t stage_cap;
    cudaEvent_t slot_ev[2]; /* kvx__stage_copy_start / kvx__stage_wait */
    bool slot_busy[2];
} thread_copy;
static pthread_key_t copy_key;
static pthread_once_t copy_once = PTHREAD_ONCE_INIT;

static void thread_copy_free(void *p)
{
    thread_copy *tc = p;
    cudaSetDevice(tc->device);
    if (tc->stage) cudaFreeHost(tc->stage);
    cudaEventDestroy(tc->slot_ev[0]);
    cudaEventDestroy(tc->slot_ev[1]);
    cudaEventDestroy(tc->done);
    cudaStreamDestroy(tc->stream);
    free(tc);
}

static void copy_key_make(void)
{
    pthread_key_create(&copy_key, thread_copy_free);
}

static int thread_copy_get(int device, thread_copy **out, td_err *err)
{
    pthread_once(&copy_once, copy_key_make);
    thread_copy *tc = pthread_getspecific(copy_key);
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return td_err_set(err, TD_EIO, "kvx cuda_ipc: cannot use GPU %d: %s", device,
                          cudaGetErrorString(e));
    if (tc && tc->device == device) {
        *out = tc;
        return 0;
    }
    if (tc) {
        pthread_setspecific(copy_key, NULL);
        thread_copy_free(tc);
        cudaSetDevice(device);
    }
    tc = calloc(1, sizeof(*tc));
    if (!tc) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    tc->device = device;
    cudaDeviceGetAttribute(&tc->n_sm, cudaDevAttrMultiProcessorCount, device);
    if (tc->n_sm < 1) tc->n_sm = 1;
    if ((e = cudaStreamCreateWithFlags(&tc->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        free(tc);
        return td_err_set(err, TD_EIO, "kvx cuda_ipc: cannot create a stream: %s",
                          cudaGetErrorString(e));
    }
    if ((e = cudaEventCreateWithFlags(&tc->done, cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&tc->slot_ev[0], cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&tc->slot_ev[1], cudaEventDisableTiming)) != cudaSuccess) {
        if (tc->slot_ev[0]) cudaEventDestroy(tc->slot_ev[0]);
        if (tc->done) cudaEventDestroy(tc->done);
        cudaStreamDestroy(tc->stream);
        free(tc);
        return td_err_set(err, TD_EIO, "kvx cuda_ipc: cannot create an event: %s",
                          cudaGetErrorString(e));
    }
    pthread_setspecific(copy_key, tc);
    *out = tc;
    return 0;
}

/* ---- host staging: tcp out of or into GPU memory (agent.c serve_read, client.c) ---- */

int kvx__stage_buf(int device, size_t bytes, uint8_t **buf, td_err *err)
{
    thread_copy *tc = NULL;
    int rc = thread_copy_get(device, &tc, err);
    if (rc) return rc;
    if (tc->stage_cap < bytes) {
        if (tc->stage) cudaFreeHost(tc->stage);
        tc->stage = NULL;
        tc->stage_cap = 0;
        cudaError_t e = cudaMallocHost((void **)&tc->stage, bytes);
        if (e != cudaSuccess)
            return td_err_set(err, TD_ENOMEM, "kvx: cannot pin %zu bytes of host staging: %s",
                              bytes, cudaGetErrorString(e));
        tc->stage_cap = bytes;
    }
    *buf = tc->stage;
    return 0;
}

int kvx__stage_copy(int device, void *dst, const void *src, size_t n, bool to_device, td_err *err)
{
    thread_copy *tc = NULL;
    int rc = thread_copy_get(device, &tc, err);
    if (rc) return rc;
    cudaError_t e = cudaMemcpyAsync(
        dst, src, n, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, tc->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(tc->stream);
    if (e != cudaSuccess)
        return td_err_set(err, TD_EIO, "kvx: staging copy %s the GPU failed: %s",
                          to_device ? "to" : "from", cudaGetErrorString(e));
    return 0;
}

int kvx__pinned_alloc(int device, size_t bytes, void **out, td_err *err)
{
    *out = NULL;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaMallocHost(out, bytes);
    if (e != cudaSuccess) {
        *out = NULL;
        return td_err_set(err, TD_ENOMEM, "kvx: cannot pin %zu bytes of host staging: %s", bytes,
                          cudaGetErrorString(e));
    }
    return 0;
}

void kvx__pinned_free(void *p)
{
    if (p) cudaFreeHost(p);
}

/* TD_KVX_STAGE_OVERLAP=0: every started copy is waited for at once (A/B runs of one binary) */
static bool stage_overlap(void)
{
    static int on = -1;
    if (on < 0) {
        const char *v = getenv("TD_KVX_STAGE_OVERLAP");
        on = !(v && !strcmp(v, "0"));
    }
    return on;
}

int kvx__stage_copy_start(int device, int slot, void *dst, const void *src, size_t n, bool to_device,
                          td_err *err)
{
    if (!stage_overlap()) return kvx__stage_copy(device, dst, src, n, to_device, err);
    thread_copy *tc = NULL;
    int rc = thread_copy_get(device, &tc, err);
    if (rc) return rc;
    cudaError_t e = cudaMemcpyAsync(
        dst, src, n, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, tc->stream);
    if (e == cudaSuccess) e = cudaEventRecord(tc->slot_ev[slot & 1], tc->stream);
    if (e != cudaSuccess)
        return td_err_set(err, TD_EIO, "kvx: staging copy %s the GPU failed: %s",
                          to_device ? "to" : "from", cudaGetErrorString(e));
    tc->slot_busy[slot & 1] = true;
    return 0;
}

int kvx__stage_wait(int device, int slot, td_err *err)
{
    thread_copy *tc = NULL;
    int rc = thread_copy_get(device, &tc, err);
    if (rc) return rc;
    if (!tc->slot_busy[slot & 1]) return 0;
    tc->slot_busy[slot & 1] = false;
    cudaError_t e = cudaEventSynchronize(tc->slot_ev[slot & 1]);
    if (e != cudaSuccess)
        return td_err_set(err, TD_EIO, "kvx: staging copy with the GPU failed: %s",
                          cudaGetErrorString(e));
    return 0;
}

/* Open the producer's pool once per session (a kvx__grant_setup_fn: under the pool lock). */
static int open_pool(struct kvx__session *s, void *user, int fd, uint64_t deadline, td_err *err)
{
    cuda_session *cs = user;
    if (cs->open) return 0;
    const kvx_region *r = &kvx__session_opts(s)->region;
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    uint8_t buf[512];
    kvx_msg m;
    int rc = kvx__info_ask(s, fd, KVX_MSG_CUDA_INFO, KVX_MSG_CUDA_INFO_ACK, "cuda_ipc", buf,
                           sizeof(buf), &m, deadline, err);
    if (rc) return rc;
    cudaError_t e = cudaSetDevice(r->device_id);
    if (e != cudaSuccess)
        return td_err_set(err, TD_EIO, "kvx cuda_ipc: cannot use GPU %d: %s", r->device_id,
                          cudaGetErrorString(e));
    /* The producer's GPU must be one this process sees (same host, visible devices). */
    int n_dev = 0, found = -1;
    cudaGetDeviceCount(&n_dev);
    for (int d = 0; d < n_dev && found < 0; d++) {
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, d) == cudaSuccess &&
            !memcmp(prop.uuid.bytes, m.u.cuda_info.uuid, 16))
            found = d;
    }
    if (found < 0)
        return td_err_set(err, TD_EUNSUPPORTED,
                          "kvx cuda_ipc: producer %s:%u's GPU is not one this process can see "
                          "(another host, or hidden by CUDA_VISIBLE_DEVICES); cuda_ipc needs "
                          "both engines on GPUs of one host",
                          host, port);
    void *peer = kvx__cuda_local_find(m.u.cuda_info.handle);
    if (!peer) {
        cudaIpcMemHandle_t h;
        _Static_assert(sizeof(h) == 64, "cudaIpcMemHandle_t is 64 bytes");
        memcpy(&h, m.u.cuda_info.handle, sizeof(h));
        e = cudaIpcOpenMemHandle(&peer, h, cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
            cudaGetLastError(); /* not sticky: clear it */
            return td_err_set(err, TD_EUNSUPPORTED,
                              "kvx cuda_ipc: cannot open producer %s:%u's KV pool (pid %u, GPU "
                              "%d here): %s",
                              host, port, m.u.cuda_info.pid, found, cudaGetErrorString(e));
        }
        cs->opened_ipc = true;
    }
    cs->peer = peer;
    cs->device = r->device_id;
    cs->bytes = m.u.cuda_info.bytes;
    cs->stride = m.u.cuda_info.segment_stride;
    cs->open = true;
    TD_INFO("kvx cuda_ipc: opened producer %s:%u's KV pool (%.1f MiB on GPU %d%s)", host, port,
            (double)cs->bytes / (1 << 20), found, cs->opened_ipc ? "" : ", same process");
    return 0;
}

static int cuda_run_piece(struct kvx__session *s, struct kvx__piece *p, td_err *err)
{
    const kvx_region *r = &kvx__session_opts(s)->region;
    const char *host = kvx__session_host(s);
    uint16_t port = kvx__session_port(s);
    kvx__piece_info pi;
    kvx__piece_get_info(p, &pi);
    cuda_session *cs = session_state(s);
    if (!cs) return td_err_set(err, TD_ENOMEM, "kvx: out of memory");
    thread_copy *tc = NULL;
    int rc = thread_copy_get(r->device_id, &tc, err);
    if (rc) return rc;
    kvx__grant g;
    rc = kvx__grant_pin(s, &cs->gp, p, false, "cuda_ipc", open_pool, cs, &g, err);
    if (rc) return rc;
    pthread_once(&copy_mode_once, copy_mode_read);
    /* Ranges of consecutive segments with the same blocks (a piece lists them segment by
     * segment) become one group of rows, the pitches being the two strides; the groups go
     * to the copy kernel (cuda_copy.cu) in launches of up to KVX_COPY_MAX_GROUPS. Where
     * something is not a multiple of 16 bytes, a row at a time by cudaMemcpyAsync. The
     * TD_KVX_CUDA_COPY variable (memcpy, 2d) picks the runtime's copies instead, to compare. */
    cudaError_t e = cudaSuccess;
    kvx_copy_group groups[KVX_COPY_MAX_GROUPS];
    int n_groups = 0;
    bool aligned = ((uintptr_t)r->base | (uintptr_t)cs->peer | r->segment_stride | cs->stride |
                    r->block_bytes) %
                       16 ==
                   0;
    for (uint32_t k = 0; k < pi.count && !rc && e == cudaSuccess;) {
        kvx__piece_range d = kvx__piece_get_range(p, k);
        uint32_t rows = 1;
        while (k + rows < pi.count) {
            kvx__piece_range n = kvx__piece_get_range(p, k + rows);
            if (n.seg != d.seg + rows || n.src != d.src || n.dst != d.dst || n.n != d.n) break;
            rows++;
        }
        uint64_t len = (uint64_t)d.n * r->block_bytes;
        uint64_t off = (uint64_t)d.seg * cs->stride + (uint64_t)d.src * r->block_bytes;
        uint64_t last = off + (uint64_t)(rows - 1) * cs->stride;
        if (off > cs->bytes || last > cs->bytes || len > cs->bytes - last) {
            rc = td_err_set(err, TD_EPROTO,
                            "kvx cuda_ipc: producer %s:%u's region (%llu bytes) does not hold "
                            "segments %u-%u, blocks %u+%u",
                            host, port, (unsigned long long)cs->bytes, d.seg, d.seg + rows - 1,
                            d.src, d.n);
            break;
        }
        uint64_t dst_off = kvx__offset(r, d.seg, d.dst);
        if (copy_mode == COPY_KERNEL && aligned && len / 16 * rows < UINT32_MAX) {
            groups[n_groups++] = (kvx_copy_group){.src_off = off,
                                                  .dst_off = dst_off,
                                                  .spitch = cs->stride,
                                                  .dpitch = r->segment_stride,
                                                  .row_chunks = (uint32_t)(len / 16),
                                                  .rows = rows};
            if (n_groups == KVX_COPY_MAX_GROUPS) {
                if (kvx__cuda_copy_groups(r->base, cs->peer, groups, n_groups, tc->n_sm,
                                          tc->stream))
                    e = cudaGetLastError();
                n_groups = 0;
            }
        } else if (copy_mode == COPY_2D && rows > 1) {
            e = cudaMemcpy2DAsync((uint8_t *)r->base + dst_off, r->segment_stride, cs->peer + off,
                                  cs->stride, (size_t)len, rows, cudaMemcpyDeviceToDevice,
                                  tc->stream);
        } else {
            for (uint32_t j = 0; j < rows && e == cudaSuccess; j++)
                e = cudaMemcpyAsync((uint8_t *)r->base + dst_off + (uint64_t)j * r->segment_stride,
                                    cs->peer + off + (uint64_t)j * cs->stride, (size_t)len,
                                    cudaMemcpyDeviceToDevice, tc->stream);
        }
        k += rows;
    }
    if (n_groups > 0 && !rc && e == cudaSuccess &&
        kvx__cuda_copy_groups(r->base, cs->peer, groups, n_groups, tc->n_sm, tc->stream))
        e = cudaGetLastError();
    /* Wait for what was queued, even after an error: the grant must outlive the copies. */
    cudaError_t e2 = cudaEventRecord(tc->done, tc->stream);
    if (e2 == cudaSuccess)
        e2 = cudaEventSynchronize(tc->done);
    else
        cudaStreamSynchronize(tc->stream);
    if (e == cudaSuccess) e = e2;
    if (!rc && e != cudaSuccess)
        rc = td_err_set(err, TD_EIO, "kvx cuda_ipc: copying from producer %s:%u failed: %s", host,
                        port, cudaGetErrorString(e));
    if (!rc && td_now_ns() > pi.deadline_ns)
        rc = td_err_set(err, TD_ETIMEDOUT, "kvx cuda_ipc: deadline passed while copying from %s:%u",
                        host, port);
    kvx__grant_done(&cs->gp, &g);
    return rc;
}

const kvx__transport kvx__cuda_transport = {"cuda_ipc", cuda_run_piece, kvx__session_control,
                                            cuda_session_free};
#else /* no CUDA: GPU memory cannot be staged */

int kvx__pinned_alloc(int device, size_t bytes, void **out, td_err *err)
{
    (void)device, (void)bytes;
    *out = NULL;
    return td_err_set(err, TD_EUNSUPPORTED, "kvx: GPU memory needs the CUDA backend");
}

void kvx__pinned_free(void *p)
{
    (void)p;
}

int kvx__stage_buf(int device, size_t bytes, uint8_t **buf, td_err *err)
{
    (void)device, (void)bytes, (void)buf;
    return td_err_set(err, TD_EUNSUPPORTED, "kvx: GPU memory needs the CUDA backend");
}

int kvx__stage_copy(int device, void *dst, const void *src, size_t n, bool to_device, td_err *err)
{
    (void)device, (void)dst, (void)src, (void)n, (void)to_device;
    return td_err_set(err, TD_EUNSUPPORTED, "kvx: GPU memory needs the CUDA backend");
}

int kvx__stage_copy_start(int device, int slot, void *dst, const void *src, size_t n, bool to_device,
                          td_err *err)
{
    (void)device, (void)slot, (void)dst, (void)src, (void)n, (void)to_device;
    return td_err_set(err, TD_EUNSUPPORTED, "kvx: GPU memory needs the CUDA backend");
}

int kvx__stage_wait(int device, int slot, td_err *err)
{
    (void)device, (void)slot, (void)err;
    return 0;
}
#endif
