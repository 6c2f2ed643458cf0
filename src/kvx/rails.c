/*
 * kvx/rails.c - matched rails (rails.h): find a primary device's numbered family in sysfs,
 * check explicit rail lists against sysfs, and validate the rail a consumer asks for.
 *
 * This runs at start-up (check_peer once per connection), so it favours plain code and
 * clear messages over speed. Every path is built with a truncation check, names are
 * checked before they reach a path ('/', ".", ".." are refused), and nothing is allocated.
 */
#include "kvx/rails.h"

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Paths under sysfs: the root plus a few short components. */
#define RAIL_PATH 4096
/* What a device's state file said: "ports/1/state reads \"1: DOWN\"". */
#define SEEN_CAP 128

static const char *kind_dir(kvx_rail_kind kind)
{
    return kind == KVX_RAIL_RDMA ? "infiniband" : "net";
}

static const char *kind_noun(kvx_rail_kind kind)
{
    return kind == KVX_RAIL_RDMA ? "an RDMA device" : "a network interface";
}

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

bool kvx_rail_family(const char *name, char *family, size_t cap, int *number)
{
    if (!name) return false;
    size_t len = strlen(name), digits_at = len;
    while (digits_at > 0 && name[digits_at - 1] >= '0' && name[digits_at - 1] <= '9')
        digits_at--;
    /* No number, no family before it, or a number that would overflow an int. */
    if (digits_at == len || digits_at == 0 || len - digits_at > 9) return false;
    if (family) {
        if (digits_at >= cap) return false;
        memcpy(family, name, digits_at);
        family[digits_at] = 0;
    }
    if (number) {
        int v = 0;
        for (size_t i = digits_at; i < len; i++)
            v = v * 10 + (name[i] - '0');
        *number = v;
    }
    return true;
}

/* snprintf into a path buffer; false when it did not fit (never a silently cut path). */
__attribute__((format(printf, 3, 4))) static bool path_fmt(char *buf, size_t cap, const char *fmt,
                                                           ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
    return n >= 0 && (size_t)n < cap;
}

static bool is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The first line of a small file without its line end; false if it cannot be read. */
static bool read_line(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(buf, (int)cap, f) != NULL;
    fclose(f);
    if (ok) buf[strcspn(buf, "\r\n")] = 0;
    return ok;
}

/* A name that may become one path component under sysfs. */
static bool valid_name(const char *dev)
{
    return dev && dev[0] && !strchr(dev, '/') && strcmp(dev, ".") && strcmp(dev, "..") &&
           strnlen(dev, KVX_RAIL_NAME) < KVX_RAIL_NAME;
}

static const char *root_or_default(const char *root)
{
    return root && root[0] ? root : "/sys";
}

/* <root>/class into cls, and whether it can be read at all. */
static int class_dir(const char *root, char *cls, size_t cap, td_err *err)
{
    if (!path_fmt(cls, cap, "%s/class", root))
        return td_err_set(err, TD_EINVAL, "the sysfs root \"%.60s...\" is too long", root);
    DIR *d = opendir(cls);
    if (!d)
        return td_err_set(err, TD_EIO,
                          "sysfs is unavailable: %s cannot be read (%s); mount sysfs, or point "
                          "TANDEM_SYSFS_ROOT at it",
                          cls, strerror(errno));
    closedir(d);
    return 0;
}

/*
 * Whether an RDMA device has an ACTIVE port ("4: ACTIVE" in ports/<n>/state). When none is,
 * seen[] says what was read, relative to the device's directory, for the message about a
 * primary that is not up.
 */
static bool rdma_up(const char *dev_dir, char *seen, size_t seen_cap)
{
    char ports[RAIL_PATH];
    snprintf(seen, seen_cap, "ports/<n>/state: none readable");
    if (!path_fmt(ports, sizeof(ports), "%s/ports", dev_dir)) return false;
    DIR *d = opendir(ports);
    if (!d) return false;
    bool up = false, first = true;
    struct dirent *e;
    while (!up && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[RAIL_PATH], state[64];
        if (!path_fmt(path, sizeof(path), "%s/%s/state", ports, e->d_name) ||
            !read_line(path, state, sizeof(state)))
            continue;
        up = state[0] == '4';
        if (first && !up)
            snprintf(seen, seen_cap, "ports/%.32s/state reads \"%s\"", e->d_name, state);
        first = false;
    }
    closedir(d);
    return up;
}

/* Whether a network interface's operstate is "up"; seen[] as for rdma_up. */
static bool net_up(const char *dev_dir, char *seen, size_t seen_cap)
{
    char path[RAIL_PATH], state[64];
    snprintf(seen, seen_cap, "operstate: unreadable");
    if (!path_fmt(path, sizeof(path), "%s/operstate", dev_dir) ||
        !read_line(path, state, sizeof(state)))
        return false;
    snprintf(seen, seen_cap, "operstate reads \"%s\"", state);
    return !strcmp(state, "up");
}

/* kvx_rail_state, with seen[SEEN_CAP] saying which state file said what. */
static int rail_state(const char *root, const char *dev, kvx_rail_kind *kind, bool *up, char *seen,
                      size_t seen_cap, td_err *err)
{
    if (!valid_name(dev))
        return td_err_set(err, TD_EINVAL,
                          "\"%.80s\" is not a device name (empty, a path, or %d bytes or longer)",
                          dev ? dev : "", KVX_RAIL_NAME);
    char cls[RAIL_PATH], dir[RAIL_PATH];
    int rc = class_dir(root, cls, sizeof(cls), err);
    if (rc) return rc;
    for (int k = KVX_RAIL_RDMA; k >= KVX_RAIL_NET; k--) {
        if (!path_fmt(dir, sizeof(dir), "%s/%s/%s", cls, kind_dir((kvx_rail_kind)k), dev))
            return td_err_set(err, TD_EINVAL, "the sysfs root \"%.60s...\" is too long", root);
        if (!is_dir(dir)) continue;
        bool u = k == KVX_RAIL_RDMA ? rdma_up(dir, seen, seen_cap) : net_up(dir, seen, seen_cap);
        if (kind) *kind = (kvx_rail_kind)k;
        if (up) *up = u;
        return 0;
    }
    return td_err_set(err, TD_ENOTFOUND,
                      "device %s does not exist (looked in %s/infiniband and %s/net): check the "
                      "name",
                      dev, cls, cls);
}

int kvx_rail_state(const char *sysfs_root, const char *dev, kvx_rail_kind *kind, bool *up,
                   td_err *err)
{
    char seen[SEEN_CAP];
    return rail_state(root_or_default(sysfs_root), dev, kind, up, seen, sizeof(seen), err);
}

/* Append a name already checked by valid_name (shorter than KVX_RAIL_NAME) to out. */
static void add_name(kvx_rails *out, const char *name)
{
    size_t len = strnlen(name, KVX_RAIL_NAME - 1);
    memcpy(out->name[out->n], name, len);
    out->name[out->n][len] = 0;
    out->n++;
}

int kvx_rails_find(const kvx_rails *r, const char *name)
{
    for (int i = 0; name && i < r->n; i++)
        if (!strcmp(r->name[i], name)) return i;
    return -1;
}

/*
 * The entry of a comma list that starts at p, trimmed: *at and *len. Returns where it ends
 * (the ',' or the NUL), so the next entry starts one past it unless that is the NUL.
 */
static const char *list_entry(const char *p, const char **at, size_t *len)
{
    const char *end = p;
    while (*end && *end != ',')
        end++;
    const char *a = p, *b = end;
    while (a < b && is_space(*a))
        a++;
    while (b > a && is_space(b[-1]))
        b--;
    *at = a;
    *len = (size_t)(b - a);
    return end;
}

/* Whether name is in the allow list (NULL or "": everything is). Empty entries are skipped. */
static bool allowed(const char *allow, const char *name)
{
    if (!allow || !allow[0]) return true;
    size_t n = strlen(name);
    for (const char *p = allow;;) {
        const char *at;
        size_t len;
        const char *end = list_entry(p, &at, &len);
        if (len == n && !strncmp(at, name, n)) return true;
        if (!*end) return false;
        p = end + 1;
    }
}

/* "a, b, c" into buf[cap], truncated if short. */
static void list_names(const kvx_rails *r, char *buf, size_t cap)
{
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < r->n && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%s", i ? ", " : "", r->name[i]);
}

/* Sort auto's devices by number (one family, so the number orders them); names break ties. */
static int by_number(const void *a, const void *b)
{
    int x = 0, y = 0;
    kvx_rail_family(a, NULL, 0, &x);
    kvx_rail_family(b, NULL, 0, &y);
    return x != y ? (x > y) - (x < y) : strcmp(a, b);
}

static int resolve_auto(const char *primary, kvx_rail_kind kind, const char *allow,
                        const char *root, kvx_rails *out, td_err *err)
{
    char fam[KVX_RAIL_NAME], dir[RAIL_PATH];
    if (!kvx_rail_family(primary, fam, sizeof(fam), NULL))
        return td_err_set(err, TD_EINVAL,
                          "the primary device %s has no number, so its family is unknown: give "
                          "the rails as an explicit list instead of auto",
                          primary);
    if (!path_fmt(dir, sizeof(dir), "%s/class/%s", root, kind_dir(kind)))
        return td_err_set(err, TD_EINVAL, "the sysfs root \"%.60s...\" is too long", root);
    DIR *d = opendir(dir);
    if (!d)
        return td_err_set(err, TD_EIO, "sysfs is unavailable: %s cannot be read (%s)", dir,
                          strerror(errno));
    struct dirent *e;
    int rc = 0;
    while (!rc && (e = readdir(d))) {
        char f[KVX_RAIL_NAME], seen[SEEN_CAP];
        if (!valid_name(e->d_name) || !kvx_rail_family(e->d_name, f, sizeof(f), NULL) ||
            strcmp(f, fam) || !allowed(allow, e->d_name))
            continue;
        /* A device that vanished or is down is simply not a rail: auto takes what is up.
         * Its error goes to a scratch record so that *err stays clean on success. */
        kvx_rail_kind k;
        bool up = false;
        td_err scratch;
        if (rail_state(root, e->d_name, &k, &up, seen, sizeof(seen), &scratch) || k != kind || !up)
            continue;
        if (out->n == KVX_MAX_RAILS) {
            rc = td_err_set(err, TD_EINVAL,
                            "auto found more than %d active %s* devices in %s: restrict them "
                            "with TANDEM_RDMA_DEVICES or give an explicit list",
                            KVX_MAX_RAILS, fam, dir);
            break;
        }
        add_name(out, e->d_name);
    }
    closedir(d);
    if (rc) return rc;
    qsort(out->name, (size_t)out->n, KVX_RAIL_NAME, by_number);
    return 0;
}

static int resolve_list(const char *spec, kvx_rail_kind kind, const char *primary,
                        const char *allow, const char *root, kvx_rails *out, td_err *err)
{
    for (const char *p = spec;;) {
        const char *at;
        size_t len;
        const char *end = list_entry(p, &at, &len);
        if (len == 0)
            return td_err_set(err, TD_EINVAL,
                              "the rail list \"%.80s\" has an empty entry: remove the extra comma",
                              spec);
        if (len >= KVX_RAIL_NAME)
            return td_err_set(err, TD_EINVAL,
                              "rail name \"%.40s...\" is longer than %d bytes: no device has "
                              "such a name",
                              at, KVX_RAIL_NAME - 1);
        if (out->n == KVX_MAX_RAILS)
            return td_err_set(err, TD_EINVAL, "the rail list has more than %d names: list fewer",
                              KVX_MAX_RAILS);
        char name[KVX_RAIL_NAME], seen[SEEN_CAP];
        memcpy(name, at, len);
        name[len] = 0;
        if (kvx_rails_find(out, name) >= 0)
            return td_err_set(err, TD_EINVAL,
                              "rail %s is listed twice in the rail list: name each device once",
                              name);
        if (!allowed(allow, name))
            return td_err_set(err, TD_EINVAL,
                              "rail %s is not among the allowed devices (TANDEM_RDMA_DEVICES "
                              "\"%.80s\"): add it there or drop it from the rail list",
                              name, allow);
        kvx_rail_kind k;
        bool up;
        int rc = rail_state(root, name, &k, &up, seen, sizeof(seen), err);
        if (rc) return rc;
        if (k != kind)
            return td_err_set(err, TD_EINVAL,
                              "rail %s is %s but the primary %s is %s: list devices of one kind",
                              name, kind_noun(k), primary, kind_noun(kind));
        add_name(out, name);
        if (!*end) return 0;
        p = end + 1;
    }
}

/* Whether spec is "auto", give or take surrounding whitespace. */
static bool is_auto(const char *spec)
{
    const char *at;
    size_t len;
    return !*list_entry(spec, &at, &len) && len == 4 && !strncmp(at, "auto", 4);
}

int kvx_rails_resolve(const char *spec, const char *primary, const char *allow,
                      const char *sysfs_root, kvx_rails *out, td_err *err)
{
    memset(out, 0, sizeof(*out));
    if (!spec || !spec[0]) return 0;
    const char *root = root_or_default(sysfs_root);
    if (!primary || !primary[0])
        return td_err_set(err, TD_EINVAL,
                          "matched rails need this process's primary device: set rail_device "
                          "(TANDEM_RAIL_DEVICE)");
    if (strchr(primary, ','))
        return td_err_set(err, TD_EINVAL,
                          "matched rails need a single primary device, not the list \"%.80s\": "
                          "name this process's own device",
                          primary);
    kvx_rail_kind kind;
    bool up = false;
    char seen[SEEN_CAP];
    int rc = rail_state(root, primary, &kind, &up, seen, sizeof(seen), err);
    if (rc) return rc;
    if (!up)
        return td_err_set(err, TD_EINVAL,
                          "the primary device %s is not up (%s/class/%s/%s/%s): bring its link "
                          "up or choose an active primary",
                          primary, root, kind_dir(kind), primary, seen);
    if (!allowed(allow, primary))
        return td_err_set(err, TD_EINVAL,
                          "the primary device %s is not among the allowed devices "
                          "(TANDEM_RDMA_DEVICES \"%.80s\"): add it there",
                          primary, allow);
    out->kind = kind;
    rc = is_auto(spec) ? resolve_auto(primary, kind, allow, root, out, err)
                       : resolve_list(spec, kind, primary, allow, root, out, err);
    if (!rc && (out->primary = kvx_rails_find(out, primary)) < 0) {
        char names[160];
        list_names(out, names, sizeof(names));
        rc = td_err_set(err, TD_EINVAL,
                        "the rails (%s) do not include the primary device %s: add it to the list",
                        names, primary);
    }
    if (rc) memset(out, 0, sizeof(*out));
    return rc;
}

void kvx_rails_describe(const kvx_rails *r, char *buf, size_t cap)
{
    if (!cap) return;
    if (r->n <= 0) {
        snprintf(buf, cap, "off");
        return;
    }
    size_t at = (size_t)snprintf(buf, cap, "%s: ", r->kind == KVX_RAIL_RDMA ? "rdma" : "net");
    for (int i = 0; i < r->n && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%s%s", i ? ", " : "", r->name[i],
                               i == r->primary ? " (primary)" : "");
}

int kvx_rails_check_peer(const kvx_rails *r, const char *peer, int *index, td_err *err)
{
    char names[160];
    list_names(r, names, sizeof(names));
    if (r->n <= 0) snprintf(names, sizeof(names), "none: matched rails are off here");
    if (!peer || !peer[0])
        return td_err_set(err, TD_EINVAL,
                          "the consumer named no rail (\"\"); matched rails need its single rail, "
                          "one of: %s",
                          names);
    if (strchr(peer, ','))
        return td_err_set(err, TD_EINVAL,
                          "the consumer named several rails (\"%.80s\"); matched rails need one, "
                          "one of: %s",
                          peer, names);
    int i = kvx_rails_find(r, peer);
    if (i < 0)
        return td_err_set(err, TD_EINVAL,
                          "the consumer's rail \"%.80s\" is not one of this producer's rails (%s); "
                          "no other rail is used in its place",
                          peer, names);
    if (index) *index = i;
    return 0;
}
