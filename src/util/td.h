/*
 * util/td.h - the base layer every module includes: error codes, the error
 * record that functions fill for their callers, assertions and logging.
 *
 * Conventions (docs/ARCHITECTURE.md, STYLE.md):
 *  - functions return int: 0 is success, a negative TD_E* code is failure;
 *  - a function that can fail in an interesting way takes a `td_err *` and fills
 *    it with the code and a one-line message that names the problem; the message
 *    is what a user finally sees, so it says what was wrong and where;
 *  - library code never exits; broken invariants abort through TD_ASSERT.
 */
#ifndef TD_UTIL_TD_H
#define TD_UTIL_TD_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    TD_OK = 0,
    TD_EINVAL = -1,       /* bad argument, flag or input */
    TD_ENOMEM = -2,       /* allocation failed or budget exhausted */
    TD_EIO = -3,          /* read/write/open failed */
    TD_EFORMAT = -4,      /* malformed file or message */
    TD_EUNSUPPORTED = -5, /* well formed, but not something we implement */
    TD_EAGAIN = -6,       /* not yet: call again */
    TD_ENOTFOUND = -7,    /* a named thing does not exist */
    TD_ERANGE = -8,       /* a value or offset out of range */
    TD_ETOOLARGE = -9,    /* can never fit */
    TD_ECANCELED = -10,   /* aborted by the caller */
    TD_ETIMEDOUT = -11,   /* a deadline passed */
    TD_ECONN = -12,       /* a peer is unreachable or went away */
    TD_EPROTO = -13,      /* a peer broke the protocol */
    TD_ESTATE = -14,      /* call not valid in the object's current state */
    TD_EBUSY = -15,       /* a peer is at a limit for now: try again a little later */
};

/** Name of an error code ("invalid argument", ...). Never NULL. */
const char *td_strerror(int code);

/* The reason phrase of an HTTP status code ("Bad Request"), or "Error" for one not listed. */
const char *td_http_reason(int status);

/* s as a Prometheus label value (backslash, double quote and newline escaped) in out,
 * cut short to fit cap (at least 1). */
void td_prom_escape(const char *s, char *out, size_t cap);

/** An error record: a code and a bounded, NUL-terminated message. */
typedef struct td_err {
    int code;
    char msg[256];
} td_err;

/**
 * Fill `err` (may be NULL) with `code` and a printf-style message, and return
 * `code`, so that `return td_err_set(err, TD_EFORMAT, "...")` reads naturally.
 */
int td_err_set(td_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/** Reset an error record to "no error". */
void td_err_clear(td_err *err);

#define TD_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (__builtin_expect(!(cond), 0)) td__assert_fail(#cond, __FILE__, __LINE__);              \
    } while (0)
#ifdef __cplusplus /* the CUDA backend's .cu files include this header */
[[noreturn]] void td__assert_fail(const char *expr, const char *file, int line);
#else
_Noreturn void td__assert_fail(const char *expr, const char *file, int line);
#endif

#define TD_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define TD_MIN(a, b) ((a) < (b) ? (a) : (b))
#define TD_MAX(a, b) ((a) > (b) ? (a) : (b))
#define TD_ALIGN_UP(x, a) (((x) + ((a)-1)) / (a) * (a))

/* Logging to stderr. The level is set once at start-up (TD_LOG env or --log-level). */
typedef enum { TD_LOG_DEBUG = 0, TD_LOG_INFO = 1, TD_LOG_WARN = 2, TD_LOG_ERROR = 3 } td_log_level;
void td_log_set_level(td_log_level level);
td_log_level td_log_get_level(void);
/** Parse "debug", "info", "warn", "error"; returns 0 or TD_EINVAL. */
int td_log_parse_level(const char *name, td_log_level *out);
void td_log(td_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define TD_DEBUG(...) td_log(TD_LOG_DEBUG, __VA_ARGS__)
#define TD_INFO(...) td_log(TD_LOG_INFO, __VA_ARGS__)
#define TD_WARN(...) td_log(TD_LOG_WARN, __VA_ARGS__)
#define TD_ERROR(...) td_log(TD_LOG_ERROR, __VA_ARGS__)

/** Monotonic clock in nanoseconds and seconds. */
uint64_t td_now_ns(void);
double td_now_s(void);

/** Allocation helpers that abort on failure (used only at start-up sizes). */
void *td_xmalloc(size_t n);
void *td_xcalloc(size_t n, size_t size);
/** 64-byte aligned allocation, zeroed; free with td_aligned_free. NULL on failure. */
void *td_aligned_alloc(size_t n);
void td_aligned_free(void *p);

/** 64-bit hashing (FNV-1a seeded then mixed); stable across runs and hosts. */
uint64_t td_hash64(const void *data, size_t len, uint64_t seed);

/** A small fast PRNG (xoshiro256**), seedable, for samplers and random weights. */
typedef struct td_rng {
    uint64_t s[4];
} td_rng;
void td_rng_seed(td_rng *rng, uint64_t seed);
uint64_t td_rng_next(td_rng *rng);
/** Uniform float in [0, 1). */
float td_rng_float(td_rng *rng);

/**
 * Raise this process's soft limit on open files to its hard limit: a router or a server
 * holds a connection per stream (and the router one more upstream), and the usual soft
 * limit of 1024 would refuse connections at a few hundred. Returns the soft limit now.
 */
long td_raise_fd_limit(void);

/**
 * A growable NUL-terminated string. Zero-initialise it; the caller frees p. An allocation
 * failure keeps what was built, sets oom and makes every later append a no-op, so a
 * builder can append freely and check oom once at the end.
 */
typedef struct td_sbuf {
    char *p;
    size_t len, cap;
    bool oom;
} td_sbuf;
/** Make room for n more bytes (and the NUL) at once; 0 or TD_ENOMEM. */
int td_sbuf_reserve(td_sbuf *b, size_t n);
/** Append n bytes of s (which need not be NUL-terminated); 0 or TD_ENOMEM. */
int td_sbuf_add(td_sbuf *b, const void *s, size_t n);
/** Append a formatted string; 0, TD_ENOMEM, or TD_EINVAL for a format that fails. */
int td_sbuf_printf(td_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/**
 * Parse helpers for flags: they accept the whole string or fail (no trailing
 * garbage, no overflow). Return 0 or TD_EINVAL.
 */
int td_parse_i64(const char *s, int64_t *out);
int td_parse_f64(const char *s, double *out);
/** Parse a size with an optional K/M/G/T suffix (binary, e.g. "4G" = 4 GiB). */
int td_parse_size(const char *s, uint64_t *out);

#endif
