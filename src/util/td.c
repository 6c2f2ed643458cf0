/* util/td.c - errors, logging, clocks, allocation, hashing, PRNG, number parsing. */
#include "util/td.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

const char *td_strerror(int code)
{
    switch (code) {
    case TD_OK: return "ok";
    case TD_EINVAL: return "invalid argument";
    case TD_ENOMEM: return "out of memory";
    case TD_EIO: return "i/o error";
    case TD_EFORMAT: return "malformed input";
    case TD_EUNSUPPORTED: return "unsupported";
    case TD_EAGAIN: return "try again";
    case TD_ENOTFOUND: return "not found";
    case TD_ERANGE: return "out of range";
    case TD_ETOOLARGE: return "too large";
    case TD_ECANCELED: return "canceled";
    case TD_ETIMEDOUT: return "timed out";
    case TD_ECONN: return "connection failed";
    case TD_EPROTO: return "protocol error";
    case TD_ESTATE: return "invalid state";
    case TD_EBUSY:
        return "busy";
    default: return "unknown error";
    }
}

int td_err_set(td_err *err, int code, const char *fmt, ...)
{
    if (err) {
        err->code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
    }
    return code;
}

void td_err_clear(td_err *err)
{
    if (err) {
        err->code = 0;
        err->msg[0] = '\0';
    }
}

void td__assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "tandem: assertion failed: %s (%s:%d)\n", expr, file, line);
    fflush(stderr);
    abort();
}

static td_log_level g_log_level = TD_LOG_INFO;
static int g_log_level_init;

void td_log_set_level(td_log_level level)
{
    g_log_level = level;
    g_log_level_init = 1;
}

int td_log_parse_level(const char *name, td_log_level *out)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(name, names[i]) == 0) {
            *out = (td_log_level)i;
            return 0;
        }
    }
    if (strcmp(name, "warning") == 0) {
        *out = TD_LOG_WARN;
        return 0;
    }
    return TD_EINVAL;
}

td_log_level td_log_get_level(void)
{
    if (!g_log_level_init) {
        const char *env = getenv("TD_LOG");
        td_log_level lvl;
        if (env && td_log_parse_level(env, &lvl) == 0) g_log_level = lvl;
        g_log_level_init = 1;
    }
    return g_log_level;
}

void td_log(td_log_level level, const char *fmt, ...)
{
    if (level < td_log_get_level()) return;
    static const char *tags[] = {"debug", "info", "warn", "error"};
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%02d:%02d:%02d.%03ld %-5s %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
            ts.tv_nsec / 1000000, tags[level], line);
}

uint64_t td_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double td_now_s(void)
{
    return (double)td_now_ns() * 1e-9;
}

void *td_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) td__assert_fail("malloc", __FILE__, __LINE__);
    return p;
}

void *td_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) td__assert_fail("calloc", __FILE__, __LINE__);
    return p;
}

void *td_aligned_alloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, TD_ALIGN_UP(n ? n : 1, 64)) != 0) return NULL;
    memset(p, 0, TD_ALIGN_UP(n ? n : 1, 64));
    return p;
}

void td_aligned_free(void *p)
{
    free(p);
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

uint64_t td_hash64(const void *data, size_t len, uint64_t seed)
{
    const uint8_t *p = data;
    uint64_t h = 0xcbf29ce484222325ull ^ mix64(seed + 0x9e3779b97f4a7c15ull);
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return mix64(h ^ len);
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void td_rng_seed(td_rng *rng, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t td_rng_next(td_rng *rng)
{
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

float td_rng_float(td_rng *rng)
{
    return (float)(td_rng_next(rng) >> 40) * (1.0f / 16777216.0f);
}

int td_parse_i64(const char *s, int64_t *out)
{
    if (!s || !*s) return TD_EINVAL;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end) return TD_EINVAL;
    *out = v;
    return 0;
}

int td_parse_f64(const char *s, double *out)
{
    if (!s || !*s) return TD_EINVAL;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v)) return TD_EINVAL;
    *out = v;
    return 0;
}

int td_parse_size(const char *s, uint64_t *out)
{
    if (!s || !*s || *s == '-') return TD_EINVAL;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !isfinite(v) || v < 0) return TD_EINVAL;
    double mult = 1;
    switch (*end) {
    case 'k': case 'K': mult = 1024.0; end++; break;
    case 'm': case 'M': mult = 1024.0 * 1024; end++; break;
    case 'g': case 'G': mult = 1024.0 * 1024 * 1024; end++; break;
    case 't': case 'T': mult = 1024.0 * 1024 * 1024 * 1024; end++; break;
    default: break;
    }
    if (*end == 'i' || *end == 'B') end++;
    if (*end == 'B') end++;
    if (*end) return TD_EINVAL;
    double bytes = v * mult;
    if (bytes > 1.8e19) return TD_EINVAL;
    *out = (uint64_t)bytes;
    return 0;
}

long td_raise_fd_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) return -1;
    /* Linux caps the limit at fs.nr_open (2^20 by default), whatever the hard limit says. */
    rlim_t to = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > ((rlim_t)1 << 20) ? (rlim_t)1 << 20
                                                                                 : rl.rlim_max;
    if (rl.rlim_cur < to) {
        struct rlimit want = {to, rl.rlim_max};
        if (setrlimit(RLIMIT_NOFILE, &want) == 0) rl.rlim_cur = to;
    }
    return rl.rlim_cur == RLIM_INFINITY ? -1 : (long)rl.rlim_cur;
}

/* ---- growable strings ---- */

int td_sbuf_reserve(td_sbuf *b, size_t more)
{
    if (b->oom) return TD_ENOMEM;
    if (b->p && b->len + more < b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap <= b->len + more) {
        if (cap > SIZE_MAX / 2) {
            b->oom = true;
            return TD_ENOMEM;
        }
        cap *= 2;
    }
    char *g = realloc(b->p, cap);
    if (!g) {
        b->oom = true;
        return TD_ENOMEM;
    }
    b->p = g;
    b->cap = cap;
    return 0;
}

int td_sbuf_add(td_sbuf *b, const void *s, size_t n)
{
    if (td_sbuf_reserve(b, n)) return TD_ENOMEM;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

int td_sbuf_printf(td_sbuf *b, const char *fmt, ...)
{
    if (b->oom) return TD_ENOMEM;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) return TD_EINVAL;
    if (b->p && b->len + (size_t)n < b->cap) {
        b->len += (size_t)n;
        return 0;
    }
    if (td_sbuf_reserve(b, (size_t)n)) return TD_ENOMEM;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

const char *td_http_reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 409:
        return "Conflict";
    case 413:
        return "Payload Too Large";
    case 422:
        return "Unprocessable Content";
    case 429:
        return "Too Many Requests";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    default:
        return "Error";
    }
}

void td_prom_escape(const char *s, char *out, size_t cap)
{
    size_t w = 0;
    for (; *s; s++) {
        const char *e = *s == '\\' ? "\\\\" : *s == '"' ? "\\\"" : *s == '\n' ? "\\n" : NULL;
        size_t n = e ? 2 : 1;
        if (w + n + 1 > cap) break;
        if (e)
            memcpy(out + w, e, 2);
        else
            out[w] = *s;
        w += n;
    }
    out[w] = 0;
}
