/*
 * kvx/common.c - pieces both sides use: ids, layout checks, descriptor
 * coalescing, and socket I/O bounded by deadlines.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvx/kvx_internal.h"

_Atomic int kvx__test_corrupt_pieces;
_Atomic int kvx__test_answers_taken;
_Atomic int kvx__test_send_delay_ms;
_Atomic int kvx__test_send_bytes;
_Atomic int kvx__test_pieces_grouped;
_Atomic int kvx__test_pieces_helped;
_Atomic int kvx__test_no_wait_help;
_Atomic int kvx__test_no_bounce;
_Atomic int kvx__test_pieces_bounced;
_Atomic int kvx__test_busy_retries;
_Atomic int kvx__test_pieces_resent;
_Atomic int kvx__test_sends_delayed;
_Atomic int kvx__test_rail_fail;
_Atomic int kvx__test_slow_rail;
_Atomic int kvx__test_ucx_stage;
_Atomic int kvx__test_ucx_grants_staged;
_Atomic int kvx__test_ucx_pieces_unstaged;

void kvx__cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

int kvx__cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t deadline_ns)
{
    /* td_now_ns() reads CLOCK_MONOTONIC, the clock of these condition variables */
    struct timespec ts = {(time_t)(deadline_ns / 1000000000ull),
                          (long)(deadline_ns % 1000000000ull)};
    return pthread_cond_timedwait(cv, mu, &ts);
}

/* ---------------------------------------------------------------- ids, layouts, runs */

int kvx__random_id(uint8_t out[KVX_ID_BYTES])
{
    size_t got = 0;
    while (got < KVX_ID_BYTES) {
        ssize_t r = getrandom(out + got, KVX_ID_BYTES - got, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return TD_EIO;
        }
        got += (size_t)r;
    }
    return 0;
}

void kvx_id_to_hex(const uint8_t id[KVX_ID_BYTES], char out[KVX_ID_HEX])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < KVX_ID_BYTES; i++) {
        out[2 * i] = digits[id[i] >> 4];
        out[2 * i + 1] = digits[id[i] & 15];
    }
    out[KVX_ID_HEX - 1] = 0;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int kvx_id_from_hex(const char *hex, uint8_t id[KVX_ID_BYTES])
{
    if (!hex || strlen(hex) != 2 * KVX_ID_BYTES) return TD_EINVAL;
    for (int i = 0; i < KVX_ID_BYTES; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) return TD_EINVAL;
        id[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

int kvx_layout_compare(const kvx_layout *a, const kvx_layout *b, td_err *err)
{
    if (a->model_fingerprint != b->model_fingerprint)
        return td_err_set(
            err, TD_EPROTO, "kvx layout mismatch: model_fingerprint: local %016llx, peer %016llx",
            (unsigned long long)a->model_fingerprint, (unsigned long long)b->model_fingerprint);
#define CMP(f)                                                                                     \
    if (a->f != b->f)                                                                              \
        return td_err_set(err, TD_EPROTO, "kvx layout mismatch: " #f ": local %u, peer %u", a->f,  \
                          b->f);
    CMP(n_layers)
    CMP(n_kv_heads)
    CMP(head_dim)
    CMP(block_size)
    CMP(kv_dtype)
    CMP(tp_rank)
    CMP(tp_size)
#undef CMP
    return 0;
}

int kvx_region_check(const kvx_region *r, td_err *err)
{
    if (!r->base || r->n_segments == 0 || r->block_bytes == 0 || r->n_blocks == 0)
        return td_err_set(err, TD_EINVAL,
                          "kvx: region needs a base, segments, blocks and "
                          "a block size");
    if (r->block_bytes > UINT64_MAX / r->n_blocks ||
        r->block_bytes * r->n_blocks > r->segment_stride)
        return td_err_set(err, TD_EINVAL,
                          "kvx: region's %u blocks of %llu bytes do not fit a segment stride of "
                          "%llu bytes",
                          r->n_blocks, (unsigned long long)r->block_bytes,
                          (unsigned long long)r->segment_stride);
    if (r->segment_stride > UINT64_MAX / r->n_segments)
        return td_err_set(err, TD_EINVAL, "kvx: region size overflows");
    return 0;
}

void kvx__hello_fill(kvx_hello *h, const uint8_t engine_id[KVX_ID_BYTES], const kvx_layout *layout,
                     const kvx_region *region)
{
    memset(h, 0, sizeof(*h));
    memcpy(h->engine_id, engine_id, KVX_ID_BYTES);
    h->layout = *layout;
    h->n_segments = region->n_segments;
    h->block_bytes = region->block_bytes;
}

int kvx__hello_compare(const kvx_hello *local, const kvx_hello *peer, td_err *err)
{
    int rc = kvx_layout_compare(&local->layout, &peer->layout, err);
    if (rc) return rc;
    if (local->n_segments != peer->n_segments)
        return td_err_set(err, TD_EPROTO, "kvx layout mismatch: region segments: local %u, peer %u",
                          local->n_segments, peer->n_segments);
    if (local->block_bytes != peer->block_bytes)
        return td_err_set(
            err, TD_EPROTO, "kvx layout mismatch: region block bytes: local %llu, peer %llu",
            (unsigned long long)local->block_bytes, (unsigned long long)peer->block_bytes);
    return 0;
}

uint64_t kvx_piece_count(uint64_t total_bytes, uint32_t qp, uint64_t min_piece, uint64_t max_piece)
{
    uint64_t n = TD_MAX(TD_MIN(total_bytes / TD_MAX(min_piece, 1), (uint64_t)TD_MAX(qp, 1u)), 1);
    if (max_piece != UINT64_MAX && max_piece > 0)
        n = TD_MAX(n, (total_bytes + max_piece - 1) / max_piece);
    return n;
}

int kvx_coalesce(const int32_t *src, const int32_t *dst, int n, uint32_t src_limit,
                 uint32_t dst_limit, kvx_run *runs)
{
    int n_runs = 0;
    for (int i = 0; i < n; i++) {
        if (src[i] < 0 || (uint32_t)src[i] >= src_limit || dst[i] < 0 ||
            (uint32_t)dst[i] >= dst_limit)
            return TD_EINVAL;
        kvx_run *last = n_runs ? &runs[n_runs - 1] : NULL;
        if (last && (uint32_t)src[i] == last->src_block + last->n_blocks &&
            (uint32_t)dst[i] == last->dst_block + last->n_blocks) {
            last->n_blocks++;
        } else {
            runs[n_runs++] = (kvx_run){(uint32_t)src[i], (uint32_t)dst[i], 1};
        }
    }
    return n_runs;
}

/* ---------------------------------------------------------------- sockets */

void kvx__set_sock_opts(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    int fl = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Wait for `events` on fd until the deadline. */
static int wait_fd(int fd, short events, uint64_t deadline_ns, const char *what, td_err *err)
{
    for (;;) {
        uint64_t now = td_now_ns();
        if (now >= deadline_ns)
            return td_err_set(err, TD_ETIMEDOUT, "kvx: deadline passed while %s", what);
        uint64_t left_ms = (deadline_ns - now + 999999) / 1000000;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, left_ms > 60000 ? 60000 : (int)left_ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            return td_err_set(err, TD_ECONN, "kvx: poll failed while %s: %s", what,
                              strerror(errno));
        }
        if (r > 0) return 0; /* readable, writable, or an error the next call reports */
    }
}

int kvx__wait_readable(int fd, uint64_t deadline_ns, td_err *err)
{
    return wait_fd(fd, POLLIN, deadline_ns, "waiting for the answer", err);
}

int kvx__bind_device(int fd, const char *device)
{
    static _Atomic bool warned;
    if (setsockopt(fd, SOL_SOCKET, SO_BINDTODEVICE, device, (socklen_t)strlen(device) + 1) == 0)
        return 0;
    int e = errno;
    if (!atomic_exchange(&warned, true))
        TD_WARN("kvx: cannot bind sockets to network device %s (%s): rails then rely on their "
                "source addresses and the routes alone (grant CAP_NET_RAW to pin them)",
                device, strerror(e));
    return -1;
}

int kvx__iface_addr(const char *ifname, char *out, size_t cap, td_err *err)
{
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return td_err_set(err, TD_EIO, "kvx: getifaddrs: %s", strerror(errno));
    int found = 0; /* 2: IPv4, 1: global IPv6 */
    for (struct ifaddrs *i = ifs; i && found < 2; i = i->ifa_next) {
        if (!i->ifa_addr || strcmp(i->ifa_name, ifname)) continue;
        int fam = i->ifa_addr->sa_family;
        if (fam == AF_INET6 && (found ||
                                IN6_IS_ADDR_LINKLOCAL(&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr)))
            continue;
        if (fam != AF_INET && fam != AF_INET6) continue;
        socklen_t sl = fam == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
        if (getnameinfo(i->ifa_addr, sl, out, (socklen_t)cap, NULL, 0, NI_NUMERICHOST) == 0)
            found = fam == AF_INET ? 2 : 1;
    }
    freeifaddrs(ifs);
    if (!found)
        return td_err_set(err, TD_ENOTFOUND,
                          "kvx: network interface %s has no usable address (a TCP rail needs an "
                          "IPv4 or global IPv6 address on it)",
                          ifname);
    return 0;
}

int kvx__connect_from(const char *host, uint16_t port, const char *local_addr, const char *device,
                      uint64_t deadline_ns, int *fd_out, td_err *err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST};
    struct addrinfo *local = NULL;
    if (local_addr && getaddrinfo(local_addr, NULL, &hints, &local))
        return td_err_set(err, TD_EINVAL, "kvx: bad local address %s", local_addr);
    hints.ai_flags = 0;
    struct addrinfo *res = NULL;
    char ports[8];
    snprintf(ports, sizeof(ports), "%u", port);
    int g = getaddrinfo(host, ports, &hints, &res);
    if (g) {
        if (local) freeaddrinfo(local);
        return td_err_set(err, TD_ECONN, "kvx: cannot resolve %s: %s", host, gai_strerror(g));
    }
    const char *via = device ? device : "";
    int rc = td_err_set(err, TD_ECONN, "kvx: no address for %s:%u%s%s", host, port,
                        device ? " reachable from rail " : "", via);
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        if (local && ai->ai_family != local->ai_family) continue;
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        kvx__set_sock_opts(fd);
        if (device) kvx__bind_device(fd, device);
        if (local && bind(fd, local->ai_addr, local->ai_addrlen) < 0) {
            rc = td_err_set(err, TD_ECONN, "kvx: cannot bind to %s (rail %s): %s", local_addr, via,
                            strerror(errno));
            close(fd);
            continue;
        }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS) {
            rc = td_err_set(err, TD_ECONN, "kvx: connect to %s:%u from %s%s%s failed: %s", host,
                            port, local_addr ? local_addr : "any address", device ? " on rail " : "",
                            via, strerror(errno));
            close(fd);
            continue;
        }
        rc = wait_fd(fd, POLLOUT, deadline_ns, "connecting", err);
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        if (!rc) getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        if (!rc && soerr)
            rc = td_err_set(err, TD_ECONN, "kvx: connect to %s:%u from %s%s%s failed: %s", host,
                            port, local_addr ? local_addr : "any address", device ? " on rail " : "",
                            via, strerror(soerr));
        if (rc) {
            close(fd);
            continue;
        }
        *fd_out = fd;
        break;
    }
    freeaddrinfo(res);
    if (local) freeaddrinfo(local);
    return rc;
}

int kvx__connect(const char *host, uint16_t port, uint64_t deadline_ns, int *fd_out, td_err *err)
{
    return kvx__connect_from(host, port, NULL, NULL, deadline_ns, fd_out, err);
}

static int io_error(td_err *err, const char *what, ssize_t r)
{
    if (r == 0) return td_err_set(err, TD_ECONN, "kvx: peer closed the connection while %s", what);
    return td_err_set(err, TD_ECONN, "kvx: connection broken while %s: %s", what, strerror(errno));
}

int kvx__send_all(int fd, const void *buf, size_t n, uint64_t deadline_ns, td_err *err)
{
    struct iovec iov = {(void *)buf, n};
    return kvx__writev_all(fd, &iov, 1, deadline_ns, err);
}

int kvx__recv_all(int fd, void *buf, size_t n, uint64_t deadline_ns, td_err *err)
{
    struct iovec iov = {buf, n};
    return kvx__readv_all(fd, &iov, 1, deadline_ns, err);
}

/* Drop `done` bytes from the front of an iovec array; returns the new first index. */
static int iov_advance(struct iovec *iov, int i, int n_iov, size_t done)
{
    while (i < n_iov && done >= iov[i].iov_len) {
        done -= iov[i].iov_len;
        i++;
    }
    if (i < n_iov) {
        iov[i].iov_base = (uint8_t *)iov[i].iov_base + done;
        iov[i].iov_len -= done;
    }
    return i;
}

int kvx__writev_all(int fd, struct iovec *iov, int n_iov, uint64_t deadline_ns, td_err *err)
{
    int i = 0;
    while (i < n_iov && iov[i].iov_len == 0)
        i++;
    while (i < n_iov) {
        int cnt = TD_MIN(n_iov - i, IOV_MAX);
        struct msghdr mh = {.msg_iov = iov + i, .msg_iovlen = (size_t)cnt};
        ssize_t r = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = wait_fd(fd, POLLOUT, deadline_ns, "sending", err);
                if (rc) return rc;
                continue;
            }
            return io_error(err, "sending", r);
        }
        i = iov_advance(iov, i, n_iov, (size_t)r);
        while (i < n_iov && iov[i].iov_len == 0)
            i++;
    }
    return 0;
}

int kvx__readv_all(int fd, struct iovec *iov, int n_iov, uint64_t deadline_ns, td_err *err)
{
    int i = 0;
    while (i < n_iov && iov[i].iov_len == 0)
        i++;
    while (i < n_iov) {
        int cnt = TD_MIN(n_iov - i, IOV_MAX);
        ssize_t r = readv(fd, iov + i, cnt);
        if (r < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = wait_fd(fd, POLLIN, deadline_ns, "receiving", err);
                if (rc) return rc;
                continue;
            }
            return io_error(err, "receiving", r);
        }
        if (r == 0) return io_error(err, "receiving", 0);
        i = iov_advance(iov, i, n_iov, (size_t)r);
        while (i < n_iov && iov[i].iov_len == 0)
            i++;
    }
    return 0;
}

int kvx__recv_some(int fd, uint8_t *buf, size_t cap, bool wait_first, uint64_t deadline_ns,
                   size_t *got, td_err *err)
{
    for (bool wait = wait_first;; wait = true) {
        if (wait) {
            int rc = wait_fd(fd, POLLIN, deadline_ns, "receiving", err);
            if (rc) return rc;
        }
        ssize_t r = recv(fd, buf, cap, 0);
        if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (r <= 0) return io_error(err, "receiving", r);
        *got = (size_t)r;
        return 0;
    }
}

int kvx__recv_frame(int fd, uint8_t *buf, size_t cap, kvx_msg *m, uint64_t deadline_ns, td_err *err)
{
    int rc = kvx__recv_all(fd, buf, KVX_HDR_BYTES, deadline_ns, err);
    if (rc) return rc;
    kvx_hdr h;
    rc = kvx_wire_decode_hdr(buf, &h, err);
    if (rc) return rc;
    if (h.payload_len > cap)
        return td_err_set(err, TD_EFORMAT, "kvx: %u-byte payload exceeds the buffer",
                          h.payload_len);
    /* Waiting for a frame may be unbounded (an idle connection), but a frame that has
     * started must finish soon: a peer cannot hold a connection with half a frame. */
    uint64_t payload_deadline = TD_MIN(deadline_ns, td_now_ns() + 30ull * 1000000000ull);
    rc = kvx__recv_all(fd, buf, h.payload_len, payload_deadline, err);
    if (rc) return rc;
    return kvx_wire_decode(&h, buf, h.payload_len, m, err);
}

/* Until rb holds `need` bytes from lo: poll, then one recv of all that fits (the buffer is
 * usually empty here: the next frame has not come yet, so a read first would fail). */
static int rbuf_fill(int fd, kvx__rbuf *rb, size_t need, uint64_t deadline_ns, td_err *err)
{
    if (rb->lo == rb->hi) rb->lo = rb->hi = 0;
    if (rb->cap - rb->lo < need) {
        memmove(rb->buf, rb->buf + rb->lo, rb->hi - rb->lo);
        rb->hi -= rb->lo;
        rb->lo = 0;
    }
    while (rb->hi - rb->lo < need) {
        int rc = wait_fd(fd, POLLIN, deadline_ns, "receiving", err);
        if (rc) return rc;
        ssize_t r = recv(fd, rb->buf + rb->hi, rb->cap - rb->hi, 0);
        if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (r <= 0) return io_error(err, "receiving", r);
        rb->hi += (size_t)r;
    }
    return 0;
}

int kvx__rbuf_frame(int fd, kvx__rbuf *rb, kvx_msg *m, uint64_t deadline_ns, td_err *err)
{
    int rc = rbuf_fill(fd, rb, KVX_HDR_BYTES, deadline_ns, err);
    if (rc) return rc;
    kvx_hdr h;
    rc = kvx_wire_decode_hdr(rb->buf + rb->lo, &h, err);
    if (rc) return rc;
    if (h.payload_len > rb->cap - KVX_HDR_BYTES)
        return td_err_set(err, TD_EFORMAT, "kvx: %u-byte payload exceeds the buffer",
                          h.payload_len);
    uint64_t payload_deadline = TD_MIN(deadline_ns, td_now_ns() + 30ull * 1000000000ull);
    rc = rbuf_fill(fd, rb, KVX_HDR_BYTES + h.payload_len, payload_deadline, err);
    if (rc) return rc;
    const uint8_t *payload = rb->buf + rb->lo + KVX_HDR_BYTES;
    rb->lo += KVX_HDR_BYTES + h.payload_len;
    return kvx_wire_decode(&h, payload, h.payload_len, m, err);
}

const char *kvx_protocol_name(kvx_protocol p)
{
    switch (p) {
    case KVX_PROTO_TCP: return "tcp";
    case KVX_PROTO_SHM: return "shm";
    case KVX_PROTO_UCX: return "ucx";
    case KVX_PROTO_CUDA_IPC: return "cuda_ipc";
    }
    return "?";
}

bool kvx_protocol_available(kvx_protocol p)
{
    switch (p) {
    case KVX_PROTO_TCP: return true;
    case KVX_PROTO_SHM: return true; /* memfd + /proc/<pid>/fd, Linux */
    case KVX_PROTO_UCX:
#ifdef TD_HAVE_UCX
        return true; /* built with libucx (ucx.c) */
#else
        return false; /* built without libucx-dev */
#endif
    case KVX_PROTO_CUDA_IPC:
#ifdef TD_HAVE_CUDA
        return true; /* built with the CUDA backend (cuda_ipc.c) */
#else
        return false;
#endif
    }
    return false;
}

void kvx_debug_hooks(int send_delay_ms, int corrupt_pieces)
{
    atomic_store(&kvx__test_send_delay_ms, send_delay_ms);
    atomic_store(&kvx__test_corrupt_pieces, corrupt_pieces);
}
