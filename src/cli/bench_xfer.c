/*
 * cli/bench_xfer.c - `tandem bench-xfer`: throughput of a kvx transport (tcp by default,
 * --transport shm, or ucx where built) over loopback, next to the machine's limits measured
 * by the same program.
 *
 *   kvx tcp: a producer agent and a consumer client in this process; for each transfer
 *            size and concurrency C, C transfers of that size start together (each its own
 *            lease over the same producer blocks, each into its own consumer blocks) and
 *            the cell's GB/s is bytes moved / wall time, summed over repetitions.
 *   memcpy:  the same bytes copied between the two pools by num_worker_threads threads.
 *   raw tcp: 1 and qp_per_transfer loopback TCP streams (blocking 1 MiB send/recv) in the
 *            machine line; and, in each cell, qp_per_transfer streams moving the cell's
 *            bytes through windows as large as the memory kvx touches, alternated with
 *            kvx --trials times (best of each kept: the machine is shared and noisy).
 *   shm:     the cells compare with memcpy instead of raw TCP (shm's floor): the cell's
 *            bytes copied from the same producer window into the same consumer windows by
 *            num_worker_threads threads, each copying its share of every transfer,
 *            alternated with kvx --trials times like raw TCP.
 *   CPU s/GB: the process's user + system time per GB, for kvx and raw TCP alike; steadier
 *            than wall-clock GB/s on a busy machine.
 *   checksums: by default the producer's checksums are kept (computed once before the
 *            trials, as an engine with kv_checksums computes them while its forward pass
 *            writes the blocks), so a transfer reads the bytes once, on the consumer's
 *            side; --producer-checksums grant computes them for every transfer instead.
 *
 * The figures are printed, never asserted.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/flags.h"
#include "kvx/kvx.h"
#include "kvx/rails.h"
#include "util/crc32c.h"

typedef struct bench {
    const char *host; /* the producer's control address (127.0.0.1, or --producer-host) */
    uint8_t *prod, *cons;
    kvx_region prod_region, cons_region;
    uint64_t seg_prod, seg_cons; /* bytes per segment */
    int threads, qp;
} bench;

/* CPU seconds (user + system) this process has used: the machine is shared, so CPU per
 * byte compares the transports more steadily than wall-clock GB/s. */
static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

/* ---------------------------------------------------------------- memcpy floor */

typedef struct copy_job {
    uint8_t *dst;
    const uint8_t *src;
    size_t n;
} copy_job;

static void *copy_main(void *arg)
{
    copy_job *j = arg;
    memcpy(j->dst, j->src, j->n);
    return NULL;
}

static double memcpy_gbps(bench *b, uint64_t bytes, int threads, int reps)
{
    pthread_t t[64];
    copy_job j[64];
    threads = TD_MIN(threads, 64);
    double t0 = td_now_s();
    for (int r = 0; r < reps; r++) {
        uint64_t per = bytes / (uint64_t)threads;
        for (int i = 0; i < threads; i++) {
            j[i] = (copy_job){b->cons + (uint64_t)i * per, b->prod + (uint64_t)i * per, per};
            pthread_create(&t[i], NULL, copy_main, &j[i]);
        }
        for (int i = 0; i < threads; i++)
            pthread_join(t[i], NULL);
    }
    return (double)bytes * reps / (td_now_s() - t0) / 1e9;
}

/*
 * shm's floor per cell: conc transfers of size bytes, reps times, copied from the start of
 * the producer pool into consecutive consumer windows, as kvx shm moves them; each thread
 * copies its share of every transfer.
 */
typedef struct cell_copy_job {
    bench *b;
    uint64_t size, lo, hi; /* this thread's share [lo, hi) of each transfer */
    int conc, reps;
} cell_copy_job;

static void *cell_copy_main(void *arg)
{
    cell_copy_job *j = arg;
    for (int r = 0; r < j->reps; r++)
        for (int t = 0; t < j->conc; t++)
            memcpy(j->b->cons + (uint64_t)t * j->size + j->lo, j->b->prod + j->lo, j->hi - j->lo);
    return NULL;
}

static double memcpy_cell_gbps(bench *b, uint64_t size, int conc, int reps, double *cpu_per_gb)
{
    pthread_t t[64];
    cell_copy_job j[64];
    int threads = TD_MIN(b->threads, 64);
    double t0 = td_now_s(), c0 = cpu_s();
    for (int i = 0; i < threads; i++) {
        uint64_t lo = size * (uint64_t)i / (uint64_t)threads & ~(uint64_t)63;
        uint64_t hi =
            i == threads - 1 ? size : size * (uint64_t)(i + 1) / (uint64_t)threads & ~(uint64_t)63;
        j[i] = (cell_copy_job){b, size, lo, hi, conc, reps};
        pthread_create(&t[i], NULL, cell_copy_main, &j[i]);
    }
    for (int i = 0; i < threads; i++)
        pthread_join(t[i], NULL);
    double s = td_now_s() - t0, gb = (double)size * conc * reps / 1e9;
    if (cpu_per_gb) *cpu_per_gb = (cpu_s() - c0) / gb;
    return gb / s;
}

/* ---------------------------------------------------------------- raw TCP floor */

/* A stream sends from (or receives into) a window of its pool, cycling through it, so raw
 * TCP touches as much memory as kvx does and meets the same cache misses. */
typedef struct stream_job {
    int fd;
    uint8_t *buf;
    uint64_t bytes, window, start;
} stream_job;

static void *send_main(void *arg)
{
    stream_job *j = arg;
    for (uint64_t done = 0; done < j->bytes;) {
        uint64_t off = (j->start + done) % j->window;
        size_t n = (size_t)TD_MIN(TD_MIN(j->bytes - done, (uint64_t)1 << 20), j->window - off);
        ssize_t w = send(j->fd, j->buf + off, n, MSG_NOSIGNAL);
        if (w <= 0) return NULL;
        done += (uint64_t)w;
    }
    return NULL;
}

static void *recv_main(void *arg)
{
    stream_job *j = arg;
    for (uint64_t done = 0; done < j->bytes;) {
        uint64_t off = (j->start + done) % j->window;
        size_t n = (size_t)TD_MIN(TD_MIN(j->bytes - done, (uint64_t)1 << 20), j->window - off);
        ssize_t r = recv(j->fd, j->buf + off, n, 0);
        if (r <= 0) return NULL;
        done += (uint64_t)r;
    }
    return NULL;
}

/* Streams of `bytes` each over loopback, all at once; aggregate GB/s. */
static double raw_tcp_gbps(bench *b, int streams, uint64_t bytes, uint64_t prod_window,
                           uint64_t cons_window, double *cpu_per_gb)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 64) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl))
        return 0;
    stream_job sj[64], rj[64];
    pthread_t st[64], rt[64];
    streams = TD_MIN(streams, 64);
    for (int i = 0; i < streams; i++) {
        int cfd = socket(AF_INET, SOCK_STREAM, 0);
        connect(cfd, (struct sockaddr *)&sa, sizeof(sa));
        int afd = accept(lfd, NULL, NULL);
        sj[i] = (stream_job){cfd, b->prod, bytes, prod_window, 0};
        rj[i] = (stream_job){afd, b->cons, bytes, cons_window,
                             (uint64_t)i * cons_window / (uint64_t)streams};
    }
    double t0 = td_now_s(), c0 = cpu_s();
    for (int i = 0; i < streams; i++) {
        pthread_create(&st[i], NULL, send_main, &sj[i]);
        pthread_create(&rt[i], NULL, recv_main, &rj[i]);
    }
    for (int i = 0; i < streams; i++) {
        pthread_join(st[i], NULL);
        pthread_join(rt[i], NULL);
    }
    double s = td_now_s() - t0;
    if (cpu_per_gb) *cpu_per_gb = (cpu_s() - c0) / ((double)bytes * streams / 1e9);
    for (int i = 0; i < streams; i++) {
        close(sj[i].fd);
        close(rj[i].fd);
    }
    close(lfd);
    return (double)bytes * streams / s / 1e9;
}

/* ---------------------------------------------------------------- raw TCP on request */

/*
 * The least a pull transfer costs over TCP: each piece is a 16-byte request on one of qp
 * kept-open connections and its bytes back, the pieces cut as kvx cuts them
 * (kvx_piece_count: up to qp of them, at least 512 KiB where the size allows, at most
 * 8 MiB, equal), and qp client threads (one per connection)
 * take the pieces of a repetition's conc transfers in turn and wait for each other before
 * the next repetition, as kvx_xfer_wait does. No headers, checksums, leases or signalling:
 * what is left is the round trip and the stream. For small transfers this is the floor;
 * the streaming figure above is not reachable by any protocol that waits for a request.
 */
typedef struct rr_shared {
    bench *b;
    uint64_t size, piece;
    int conc, reps, n_pieces; /* pieces per transfer */
    _Atomic int *next;        /* per repetition: the next piece to take */
    pthread_barrier_t bar;
} rr_shared;

typedef struct rr_job {
    rr_shared *s;
    int cfd, sfd;
} rr_job;

static void *rr_server_main(void *arg)
{
    rr_job *j = arg;
    uint64_t rq[2]; /* offset, length; length 0 ends */
    for (;;) {
        if (recv(j->sfd, rq, sizeof(rq), MSG_WAITALL) != (ssize_t)sizeof(rq) || rq[1] == 0) break;
        const uint8_t *p = j->s->b->prod + rq[0];
        for (uint64_t done = 0; done < rq[1];) {
            ssize_t w = send(j->sfd, p + done, (size_t)(rq[1] - done), MSG_NOSIGNAL);
            if (w <= 0) return NULL;
            done += (uint64_t)w;
        }
    }
    return NULL;
}

static void *rr_client_main(void *arg)
{
    rr_job *j = arg;
    rr_shared *s = j->s;
    int per_rep = s->conc * s->n_pieces;
    pthread_barrier_wait(&s->bar); /* start together */
    for (int r = 0; r < s->reps; r++) {
        for (int k; (k = atomic_fetch_add(&s->next[r], 1)) < per_rep;) {
            int t = k / s->n_pieces;
            uint64_t off = (uint64_t)(k % s->n_pieces) * s->piece;
            uint64_t len = TD_MIN(s->piece, s->size - off), rq[2] = {off, len};
            if (send(j->cfd, rq, sizeof(rq), MSG_NOSIGNAL) != (ssize_t)sizeof(rq)) break;
            uint8_t *to = s->b->cons + (uint64_t)t * s->size + off;
            for (uint64_t done = 0; done < len;) {
                ssize_t n = recv(j->cfd, to + done, (size_t)(len - done), 0);
                if (n <= 0) break;
                done += (uint64_t)n;
            }
        }
        pthread_barrier_wait(&s->bar); /* the repetition's transfers are all done */
    }
    return NULL;
}

/* conc transfers of size bytes, reps times, each piece on request; aggregate GB/s. */
static double rr_tcp_gbps(bench *b, int streams, uint64_t size, int conc, int reps,
                          double *cpu_per_gb)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(lfd, 64) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        if (lfd >= 0) close(lfd);
        return 0;
    }
    streams = TD_MIN(streams, 64);
    rr_shared s = {.b = b, .size = size, .conc = conc, .reps = reps};
    uint64_t n = kvx_piece_count(size, (uint32_t)streams, KVX_MIN_PIECE_BYTES, (uint64_t)8 << 20);
    s.piece = (size + n - 1) / n;
    s.n_pieces = (int)((size + s.piece - 1) / s.piece);
    s.next = calloc((size_t)reps, sizeof(*s.next));
    rr_job j[64];
    pthread_t ct[64], st[64];
    int one = 1;
    for (int i = 0; i < streams; i++) {
        j[i].s = &s;
        j[i].cfd = socket(AF_INET, SOCK_STREAM, 0);
        connect(j[i].cfd, (struct sockaddr *)&sa, sizeof(sa));
        j[i].sfd = accept(lfd, NULL, NULL);
        setsockopt(j[i].cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        setsockopt(j[i].sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    }
    pthread_barrier_init(&s.bar, NULL, (unsigned)streams + 1);
    for (int i = 0; i < streams; i++) {
        pthread_create(&st[i], NULL, rr_server_main, &j[i]);
        pthread_create(&ct[i], NULL, rr_client_main, &j[i]);
    }
    pthread_barrier_wait(&s.bar);
    double t0 = td_now_s(), c0 = cpu_s();
    for (int r = 0; r < reps; r++)
        pthread_barrier_wait(&s.bar);
    double dt = td_now_s() - t0, cpu = cpu_s() - c0;
    for (int i = 0; i < streams; i++) {
        pthread_join(ct[i], NULL);
        uint64_t end[2] = {0, 0};
        send(j[i].cfd, end, sizeof(end), MSG_NOSIGNAL);
        pthread_join(st[i], NULL);
        close(j[i].cfd);
        close(j[i].sfd);
    }
    close(lfd);
    pthread_barrier_destroy(&s.bar);
    free(s.next);
    double gb = (double)size * conc * reps / 1e9;
    if (cpu_per_gb) *cpu_per_gb = cpu / gb;
    return gb / dt;
}

/* ---------------------------------------------------------------- kvx tcp */

static int run_cell(bench *b, kvx_agent *a, kvx_client *c, uint64_t size, int conc, int reps,
                    double *gbps, double *cpu_per_gb)
{
    const kvx_region *pr = &b->prod_region;
    int per = (int)(size / (pr->block_bytes * pr->n_segments));
    int32_t *src = malloc((size_t)per * sizeof(int32_t));
    int32_t *dst = malloc((size_t)conc * per * sizeof(int32_t));
    char(*tid)[KVX_ID_HEX] = malloc((size_t)conc * KVX_ID_HEX);
    kvx_xfer **x = malloc((size_t)conc * sizeof(*x));
    for (int i = 0; i < per; i++)
        src[i] = i;
    for (int i = 0; i < conc * per; i++)
        dst[i] = i;
    td_err err;
    int rc = 0;
    double total_s = 0, c0 = cpu_s();
    for (int r = 0; r < reps && !rc; r++) {
        for (int t = 0; t < conc && !rc; t++)
            rc = kvx_agent_register(a, src, per, 0, NULL, tid[t], &err);
        double t0 = td_now_s();
        for (int t = 0; t < conc && !rc; t++) {
            kvx_read_req rq = {.host = b->host,
                               .port = kvx_agent_port(a),
                               .engine_id = kvx_agent_engine_id(a),
                               .transfer_id = tid[t],
                               .src_blocks = src,
                               .dst_blocks = dst + (size_t)t * per,
                               .n_blocks = per,
                               .will_wait = true};
            rc = kvx_read_start(c, &rq, &x[t], &err);
            if (rc) conc = t; /* wait for the ones started */
        }
        for (int t = 0; t < conc; t++) {
            td_err res;
            int xr = kvx_xfer_wait(x[t], &res);
            if (xr && !rc) {
                rc = xr;
                err = res;
            }
            kvx_xfer_free(x[t]);
        }
        total_s += td_now_s() - t0;
        for (int t = 0; t < conc; t++)
            kvx_release(c, b->host, kvx_agent_port(a), kvx_agent_engine_id(a), tid[t], &err);
    }
    if (rc) fprintf(stderr, "bench-xfer: transfer failed: %s\n", err.msg);
    *gbps = (double)size * conc * reps / total_s / 1e9;
    /* Includes registering and releasing the leases, which real transfers also pay. */
    if (cpu_per_gb) *cpu_per_gb = (cpu_s() - c0) / ((double)size * conc * reps / 1e9);
    free(src);
    free(dst);
    free(tid);
    free(x);
    return rc;
}

/* ---------------------------------------------------------------- rails, namespaces, probe */

/* Move this thread into network namespace `name` (/var/run/netns/<name>, as made by
 * `ip netns add`); threads it starts afterwards live there too. */
static int enter_netns(const char *name)
{
    char path[300];
    snprintf(path, sizeof(path), "/var/run/netns/%s", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
        fprintf(stderr, "bench-xfer: cannot enter network namespace %s: %s\n", name,
                strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* Rails from a comma list and the device among them (no sysfs check: a benchmark across
 * namespaces sees the host's /sys). */
static int rails_from(const char *list, const char *device, kvx_rails *out)
{
    memset(out, 0, sizeof(*out));
    out->primary = -1;
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", list);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (out->n == KVX_MAX_RAILS || strlen(tok) >= KVX_RAIL_NAME) return -1;
        if (!strcmp(tok, device)) out->primary = out->n;
        snprintf(out->name[out->n++], KVX_RAIL_NAME, "%s", tok);
    }
    return out->primary < 0 ? -1 : 0;
}

/*
 * The byte-integrity probe: transfers of 64 B, 64 KiB and 1 MiB (1, 1024 and 16384
 * blocks of 64 bytes, one segment) from different producer offsets to different consumer
 * offsets, each destination fenced by 16 guard blocks on either side; every byte of each
 * destination must equal its source, and every guard byte must be untouched.
 */
static int run_probe(bench *b, kvx_agent *a, kvx_client *c)
{
    static const struct {
        int src, dst, n;
    } cases[] = {{7, 3 + 16, 1}, {333, 100, 1024}, {5000, 2000, 16384}, {1, 40000, 1024},
                 {20000, 19000, 1}};
    const uint64_t bb = b->prod_region.block_bytes;
    int bad = 0;
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        int src = cases[k].src, dst = cases[k].dst, n = cases[k].n;
        if ((uint64_t)(src + n) > b->prod_region.n_blocks ||
            (uint64_t)(dst + n + 16) > b->cons_region.n_blocks || dst < 16) {
            fprintf(stderr, "bench-xfer: the probe needs larger regions\n");
            return 1;
        }
        memset(b->cons + (dst - 16) * bb, 0xa5, (n + 32) * bb);
        int32_t *s = malloc((size_t)n * sizeof(int32_t)), *d = malloc((size_t)n * sizeof(int32_t));
        for (int i = 0; i < n; i++) s[i] = src + i, d[i] = dst + i;
        char tid[KVX_ID_HEX];
        td_err err;
        int rc = kvx_agent_register(a, s, n, 0, NULL, tid, &err);
        kvx_xfer *x = NULL;
        if (!rc) {
            kvx_read_req rq = {.host = b->host, .port = kvx_agent_port(a),
                               .engine_id = kvx_agent_engine_id(a), .transfer_id = tid,
                               .src_blocks = s, .dst_blocks = d, .n_blocks = n,
                               .will_wait = true};
            rc = kvx_read_start(c, &rq, &x, &err);
        }
        if (!rc) rc = kvx_xfer_wait(x, &err);
        kvx_xfer_free(x);
        kvx_agent_cancel(a, tid);
        free(s);
        free(d);
        bool same = !rc && !memcmp(b->cons + dst * bb, b->prod + src * bb, n * bb);
        bool guards = true;
        for (uint64_t i = 0; i < 16 * bb; i++)
            guards = guards && b->cons[(dst - 16) * bb + i] == 0xa5 &&
                     b->cons[(dst + n) * bb + i] == 0xa5;
        printf("probe: %8llu bytes, producer offset %8llu -> consumer offset %8llu: %s%s%s\n",
               (unsigned long long)(n * bb), (unsigned long long)(src * bb),
               (unsigned long long)(dst * bb), rc ? err.msg : same ? "data ok" : "DATA DIFFERS",
               rc ? "" : guards ? ", guards ok" : ", GUARDS OVERWRITTEN", "");
        bad += rc || !same || !guards;
    }
    printf("probe: %s\n", bad ? "FAILED" : "all verified");
    return bad ? 1 : 0;
}

static int parse_list(const char *s, uint64_t *out, int max, bool sizes)
{
    int n = 0;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (n == max) return -1;
        int64_t v;
        if (sizes ? td_parse_size(tok, &out[n]) : td_parse_i64(tok, &v)) return -1;
        if (!sizes) out[n] = (uint64_t)v;
        if (out[n] == 0) return -1;
        n++;
    }
    return n;
}

int cli_bench_xfer(int argc, char **argv)
{
    const char *sizes_s = "64K,1M,16M,64M", *conc_s = "1,4,16", *transport_s = "tcp";
    const char *pcrc_s = "kept";
    const char *host = "127.0.0.1", *pns = NULL, *cns = NULL, *rails_s = NULL, *rail_dev = NULL,
               *prail_dev = NULL;
    bool probe = false, no_matched = false, striping = false;
    int64_t threads = 4, qp = 4, segments = 8, min_mb = 256, trials = 3;
    uint64_t block_bytes = 8192;
    bool no_checksums = false, no_floor = false;
    cli_flag flags[] = {
        CLI_FLAG("sizes", CLI_FLAG_STR, &sizes_s, "transfer sizes (64K,1M,16M,64M)"),
        CLI_FLAG("concurrency", CLI_FLAG_STR, &conc_s, "concurrent transfers (1,4,16)"),
        CLI_FLAG("num-worker-threads", CLI_FLAG_INT, &threads, "consumer worker threads (4)"),
        CLI_FLAG("qp-per-transfer", CLI_FLAG_INT, &qp, "connections per peer (4)"),
        CLI_FLAG("segments", CLI_FLAG_INT, &segments, "segments (layers) per region (8)"),
        CLI_FLAG("block-bytes", CLI_FLAG_SIZE, &block_bytes, "bytes per block per segment (8K)"),
        CLI_FLAG("min-mb", CLI_FLAG_INT, &min_mb, "MiB moved per trial at least (256)"),
        CLI_FLAG("trials", CLI_FLAG_INT, &trials, "alternating trials per cell, best kept (3)"),
        CLI_FLAG("no-checksums", CLI_FLAG_BOOL, &no_checksums, "turn CRC32C off"),
        CLI_FLAG("producer-checksums", CLI_FLAG_STR, &pcrc_s,
                 "kept (computed as blocks are written, like an engine) or grant (per transfer)"),
        CLI_FLAG("producer-host", CLI_FLAG_STR, &host, "the producer's control address (127.0.0.1)"),
        CLI_FLAG("producer-netns", CLI_FLAG_STR, &pns, "run the producer in this network namespace"),
        CLI_FLAG("consumer-netns", CLI_FLAG_STR, &cns, "run the consumer in this network namespace"),
        CLI_FLAG("rails", CLI_FLAG_STR, &rails_s, "matched rails, a comma list of interfaces (tcp)"),
        CLI_FLAG("rail-device", CLI_FLAG_STR, &rail_dev, "the consumer's rail (one of --rails)"),
        CLI_FLAG("producer-rail-device", CLI_FLAG_STR, &prail_dev,
                 "the producer's primary rail (default: --rail-device)"),
        CLI_FLAG("no-matched-rails", CLI_FLAG_BOOL, &no_matched,
                 "one device per side, not matched by name"),
        CLI_FLAG("rail-striping", CLI_FLAG_BOOL, &striping,
                 "cut each transfer over every rail of --rails (matched)"),
        CLI_FLAG("probe", CLI_FLAG_BOOL, &probe,
                 "check bytes and guard bytes of 64 B, 64 KiB and 1 MiB transfers, then exit"),
        CLI_FLAG("no-floor", CLI_FLAG_BOOL, &no_floor, "skip the memcpy and raw TCP figures"),
        CLI_FLAG("transport", CLI_FLAG_STR, &transport_s,
                 "kvx transport: tcp, shm, or ucx where built (UCX_TLS picks UCX's own)"),
    };
    int prc =
        cli_flags_parse(flags, (int)TD_ARRAY_LEN(flags), argc, argv, "tandem bench-xfer [options]");
    if (prc) return prc == 1 ? 0 : 2;
    uint64_t sizes[16], concs[16];
    int n_sizes = parse_list(sizes_s, sizes, 16, true);
    int n_conc = parse_list(conc_s, concs, 16, false);
    if (n_sizes < 1 || n_conc < 1 || threads < 1 || threads > 64 || qp < 1 || qp > 64 ||
        segments < 1 || block_bytes < 64 || min_mb < 1 || trials < 1) {
        fprintf(stderr, "bench-xfer: bad --sizes, --concurrency or thread counts\n");
        return 2;
    }
    bool kept = !strcmp(pcrc_s, "kept");
    if (!kept && strcmp(pcrc_s, "grant")) {
        fprintf(stderr, "bench-xfer: --producer-checksums must be kept or grant, not '%s'\n",
                pcrc_s);
        return 2;
    }
    kvx_protocol proto = KVX_PROTO_TCP;
    bool proto_ok = false;
    for (int p = KVX_PROTO_TCP; p <= KVX_PROTO_UCX && !proto_ok; p++)
        if (!strcmp(transport_s, kvx_protocol_name((kvx_protocol)p))) {
            proto = (kvx_protocol)p;
            proto_ok = kvx_protocol_available(proto);
        }
    if (!proto_ok) {
        fprintf(stderr, "bench-xfer: transport '%s' is unknown or not built in\n", transport_s);
        return 2;
    }
    kvx_rails crails, prails;
    if (rails_s || rail_dev || prail_dev) {
        const char *pd = prail_dev ? prail_dev : rail_dev;
        int bad = !rail_dev || proto != KVX_PROTO_TCP;
        if (!bad && no_matched) { /* one device each */
            bad = rails_from(rail_dev, rail_dev, &crails) || rails_from(pd, pd, &prails);
        } else if (!bad) {
            bad = !rails_s || rails_from(rails_s, rail_dev, &crails) || rails_from(rails_s, pd, &prails);
        }
        if (bad) {
            fprintf(stderr, "bench-xfer: rails need --transport tcp, --rail-device among --rails "
                            "(and --producer-rail-device among them too)\n");
            return 2;
        }
    }
    bool use_rails = rail_dev != NULL;
    if (probe) { /* 64-byte blocks in one segment, up to 1 MiB per transfer */
        block_bytes = 64;
        segments = 1;
        n_sizes = n_conc = 1;
        sizes[0] = 1 << 20;
        concs[0] = 1;
    }
    uint64_t max_size = 0, max_conc = 0;
    for (int i = 0; i < n_sizes; i++) {
        if (sizes[i] % (block_bytes * (uint64_t)segments)) {
            fprintf(stderr, "bench-xfer: size %llu is not a multiple of segments x block bytes\n",
                    (unsigned long long)sizes[i]);
            return 2;
        }
        max_size = TD_MAX(max_size, sizes[i]);
    }
    for (int i = 0; i < n_conc; i++)
        max_conc = TD_MAX(max_conc, concs[i]);

    bench b = {.threads = (int)threads, .qp = (int)qp, .host = host};
    b.seg_prod = TD_MAX(max_size, (uint64_t)64 << 20) / (uint64_t)segments;
    b.seg_cons = TD_MAX(max_size * max_conc, (uint64_t)(qp + 1) << 26) / (uint64_t)segments;
    b.seg_prod = TD_ALIGN_UP(b.seg_prod, block_bytes);
    b.seg_cons = TD_ALIGN_UP(b.seg_cons, block_bytes);
    /* shm: the producer's pool is a memfd, as an engine's is with protocol shm. */
    int prod_fd = -1;
    size_t prod_len = b.seg_prod * (uint64_t)segments;
    if (proto == KVX_PROTO_SHM) {
        prod_fd = memfd_create("bench-xfer-pool", MFD_CLOEXEC);
        void *m = prod_fd >= 0 && ftruncate(prod_fd, (off_t)prod_len) == 0
                      ? mmap(NULL, prod_len, PROT_READ | PROT_WRITE, MAP_SHARED, prod_fd, 0)
                      : MAP_FAILED;
        b.prod = m == MAP_FAILED ? NULL : m;
    } else {
        b.prod = td_aligned_alloc(prod_len);
    }
    b.cons = td_aligned_alloc(b.seg_cons * (uint64_t)segments);
    if (!b.prod || !b.cons) {
        fprintf(stderr, "bench-xfer: cannot allocate the pools\n");
        return 1;
    }
    td_rng rng;
    td_rng_seed(&rng, 1);
    for (uint64_t i = 0; i < b.seg_prod * (uint64_t)segments; i += 8) {
        uint64_t v = td_rng_next(&rng);
        memcpy(b.prod + i, &v, 8);
    }
    memset(b.cons, 1, b.seg_cons * (uint64_t)segments); /* fault the pages in */
    b.prod_region = (kvx_region){.base = b.prod, .n_segments = (uint32_t)segments, .segment_stride = b.seg_prod,
                                 .block_bytes = block_bytes,
                                 .n_blocks = (uint32_t)(b.seg_prod / block_bytes),
                                 .shm = prod_fd >= 0, .shm_fd = prod_fd};
    uint32_t *kept_crc = NULL;
    uint8_t *kept_ok = NULL;
    if (kept && !no_checksums) {
        size_t n = (size_t)segments * b.prod_region.n_blocks;
        kept_crc = malloc(n * sizeof(uint32_t));
        kept_ok = malloc(n);
        if (!kept_crc || !kept_ok) {
            fprintf(stderr, "bench-xfer: cannot allocate the checksums\n");
            return 1;
        }
        for (int64_t sg = 0; sg < segments; sg++)
            td_crc32c_blocks(b.prod + (uint64_t)sg * b.seg_prod, block_bytes,
                             b.prod_region.n_blocks, kept_crc + (size_t)sg * b.prod_region.n_blocks);
        memset(kept_ok, 1, n);
        b.prod_region.block_crc = kept_crc;
        b.prod_region.block_crc_ok = kept_ok;
    }
    b.cons_region = (kvx_region){.base = b.cons, .n_segments = (uint32_t)segments, .segment_stride = b.seg_cons,
                                 .block_bytes = block_bytes,
                                 .n_blocks = (uint32_t)(b.seg_cons / block_bytes)};

    kvx_layout layout = {.model_fingerprint = 1, .n_layers = (uint32_t)segments};
    kvx_agent_opts ao;
    kvx_agent_opts_default(&ao);
    ao.layout = layout;
    ao.region = b.prod_region;
    ao.checksums = !no_checksums;
    ao.host = host;
    ao.rails = use_rails ? &prails : NULL;
    ao.matched_rails = !no_matched;
    kvx_client_opts co;
    kvx_client_opts_default(&co);
    co.layout = layout;
    co.region = b.cons_region;
    co.num_worker_threads = (int)threads;
    co.qp_per_transfer = (int)qp;
    co.verify_checksums = !no_checksums;
    co.transfer_timeout_ms = 120000;
    co.protocol = proto;
    co.rails = use_rails ? &crails : NULL;
    co.matched_rails = !no_matched;
    co.rail_striping = striping;
    kvx_agent *a;
    kvx_client *c;
    td_err err;
    /* Each side is made inside its namespace; the threads it starts stay there. */
    if ((pns && enter_netns(pns)) || kvx_agent_create(&a, &ao, &err)) {
        if (pns) fprintf(stderr, "bench-xfer: %s\n", err.msg);
        return 1;
    }
    if ((cns && enter_netns(cns)) || kvx_client_create(&c, &co, &err)) {
        fprintf(stderr, "bench-xfer: %s\n", err.msg);
        kvx_agent_destroy(a);
        return 1;
    }
    if (probe) {
        int prc = run_probe(&b, a, c);
        kvx_client_destroy(c);
        kvx_agent_destroy(a);
        td_aligned_free(b.prod);
        td_aligned_free(b.cons);
        free(kept_crc);
        free(kept_ok);
        return prc;
    }

    int ncpu = (int)sysconf(_SC_NPROCESSORS_ONLN);
    const char *tls = getenv("UCX_TLS");
    if (use_rails)
        printf("bench-xfer: rails %s, consumer on %s%s%s%s%s, producer control address %s\n",
               no_matched ? rail_dev : rails_s, rail_dev, no_matched ? "" : " (matched)",
               striping ? ", striped" : "", pns || cns ? ", producer namespace " : "",
               pns || cns ? (pns ? pns : "-") : "", host);
    printf("bench-xfer: kvx %s%s%s%s over %s, %d CPUs, %lld segments x %llu-byte blocks, "
           "%lld workers, %lld connections per peer, checksums %s\n",
           kvx_protocol_name(proto), proto == KVX_PROTO_UCX ? " (UCX_TLS=" : "",
           proto == KVX_PROTO_UCX ? (tls ? tls : "default") : "",
           proto == KVX_PROTO_UCX ? ")" : "", use_rails ? "rails" : "loopback", ncpu,
           (long long)segments, (unsigned long long)block_bytes, (long long)threads,
           (long long)qp,
           no_checksums ? "off"
           : kept       ? "on (CRC32C; the producer's kept as written)"
                        : "on (CRC32C; the producer's computed per transfer)");
    double raw1 = 0, rawq = 0, mcp = 0;
    if (!no_floor) {
        uint64_t vol = 1ull << 30;
        mcp = memcpy_gbps(&b, TD_MIN((uint64_t)64 << 20, b.seg_prod * (uint64_t)segments),
                          (int)threads, 16);
        raw1 = raw_tcp_gbps(&b, 1, vol, 64u << 20, 64u << 20, NULL);
        rawq = raw_tcp_gbps(&b, (int)qp, vol / (uint64_t)qp, 64u << 20, 64u << 20, NULL);
        printf("machine: memcpy %d threads %.2f GB/s; raw loopback TCP 1 stream %.2f GB/s, "
               "%lld streams %.2f GB/s\n\n",
               (int)threads, mcp, raw1, (long long)qp, rawq);
    }
    bool shm = proto == KVX_PROTO_SHM; /* its floor is memcpy, not raw TCP */
    /* tcp cells also show raw TCP on request (rr_tcp_gbps): the floor of a pull transfer. */
    bool rr = !shm && !no_floor;
    printf("%10s %6s %10s %13s %10s", "size", "conc", "kvx GB/s", shm ? "memcpy GB/s" : "raw tcp GB/s",
           shm ? "kvx / cpy" : "kvx / raw");
    if (rr) printf(" %13s %10s", "on req GB/s", "kvx / req");
    printf(" %10s %12s %12s %10s\n", "vs conc 1", "kvx CPU s/GB",
           shm ? "cpy CPU s/GB" : "raw CPU s/GB", shm ? "cpy / kvx" : "raw / kvx");
    int rc = 0;
    for (int i = 0; i < n_sizes && !rc; i++) {
        double first = 0;
        for (int j = 0; j < n_conc && !rc; j++) {
            int conc = (int)concs[j];
            uint64_t per_rep = sizes[i] * (uint64_t)conc;
            int reps = (int)TD_MAX((uint64_t)min_mb * (1u << 20) / per_rep, (uint64_t)3);
            reps = TD_MIN(reps, 2000);
            double w[1];
            run_cell(&b, a, c, sizes[i], conc, 1, w, NULL); /* warm-up: connections, caches */
            /* The machine is shared and noisy: alternate kvx and raw TCP moving the same bytes
             * over qp_per_transfer streams (memcpy for shm), and keep the best of each. */
            double best = 0, best_raw = 0, best_rr = 0, cpu = 1e30, cpu_raw = 1e30;
            for (int t = 0; t < trials && !rc; t++) {
                double g, cg, cr;
                rc = run_cell(&b, a, c, sizes[i], conc, reps, &g, &cg);
                best = TD_MAX(best, g);
                cpu = TD_MIN(cpu, cg);
                if (!no_floor && shm) {
                    best_raw = TD_MAX(best_raw, memcpy_cell_gbps(&b, sizes[i], conc, reps, &cr));
                    cpu_raw = TD_MIN(cpu_raw, cr);
                } else if (!no_floor) {
                    uint64_t bytes = TD_MAX(per_rep * (uint64_t)reps, (uint64_t)64 << 20);
                    best_raw = TD_MAX(best_raw, raw_tcp_gbps(&b, (int)qp, bytes / (uint64_t)qp,
                                                             sizes[i], per_rep, &cr));
                    cpu_raw = TD_MIN(cpu_raw, cr);
                }
                if (rr)
                    best_rr = TD_MAX(best_rr, rr_tcp_gbps(&b, (int)qp, sizes[i], conc, reps, NULL));
            }
            if (j == 0) first = best;
            char sz[32];
            if (sizes[i] >= (1u << 20))
                snprintf(sz, sizeof(sz), "%llu MiB", (unsigned long long)(sizes[i] >> 20));
            else
                snprintf(sz, sizeof(sz), "%llu KiB", (unsigned long long)(sizes[i] >> 10));
            printf("%10s %6d %10.2f %13.2f %9.2fx", sz, conc, best, best_raw,
                   best_raw > 0 ? best / best_raw : 0);
            if (rr) printf(" %13.2f %9.2fx", best_rr, best_rr > 0 ? best / best_rr : 0);
            printf(" %9.2fx %12.3f %12.3f %9.2fx\n", first > 0 ? best / first : 0, cpu,
                   no_floor ? 0 : cpu_raw, no_floor ? 0 : cpu_raw / cpu);
            fflush(stdout);
        }
    }
    kvx_client_destroy(c);
    kvx_agent_destroy(a);
    if (prod_fd >= 0) {
        munmap(b.prod, prod_len);
        close(prod_fd);
    } else {
        td_aligned_free(b.prod);
    }
    td_aligned_free(b.cons);
    free(kept_crc);
    free(kept_ok);
    return rc ? 1 : 0;
}
