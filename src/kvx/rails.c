/* kvx/rails.c - matched rails: device discovery in sysfs and validation (rails.h). */
#include "kvx/rails.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

bool kvx_rail_family(const char *name, char *family, size_t cap, int *number)
{
    size_t n = name ? strlen(name) : 0, d = n;
    while (d > 0 && name[d - 1] >= '0' && name[d - 1] <= '9') d--;
    if (d == n || d == 0 || n - d > 9) return false; /* no number, no family, absurd number */
    if (d >= cap) return false;
    memcpy(family, name, d);
    family[d] = 0;
    *number = atoi(name + d);
    return true;
}

static bool is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The first line of a small file, without its newline; false if unreadable. */
static bool read_line(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(buf, (int)cap, f) != NULL;
    fclose(f);
    if (ok) buf[strcspn(buf, "\r\n")] = 0;
    return ok;
}

static bool bad_name(const char *dev)
{
    return !dev || !dev[0] || strchr(dev, '/') || !strcmp(dev, ".") || !strcmp(dev, "..") ||
           strlen(dev) >= KVX_RAIL_NAME;
}

/* Whether an RDMA device has an ACTIVE port. */
static bool rdma_up(const char *dir)
{
    char path[1100];
    snprintf(path, sizeof(path), "%s/ports", dir);
    DIR *d = opendir(path);
    if (!d) return false;
    bool up = false;
    struct dirent *e;
    while (!up && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char state[64], p[1500];
        snprintf(p, sizeof(p), "%s/%s/state", path, e->d_name);
        up = read_line(p, state, sizeof(state)) && state[0] == '4';
    }
    closedir(d);
    return up;
}

int kvx_rail_state(const char *root, const char *dev, kvx_rail_kind *kind, bool *up, td_err *err)
{
    if (bad_name(dev)) return td_err_set(err, TD_EINVAL, "'%s' is not a device name", dev ? dev : "");
    char cls[512], path[1024];
    snprintf(cls, sizeof(cls), "%s/class", root);
    if (!is_dir(cls))
        return td_err_set(err, TD_EIO,
                          "sysfs is unavailable: %s cannot be read (mount sysfs, or give the "
                          "rails as an explicit list where sysfs is hidden)",
                          cls);
    snprintf(path, sizeof(path), "%s/infiniband/%s", cls, dev);
    if (is_dir(path)) {
        *kind = KVX_RAIL_RDMA;
        *up = rdma_up(path);
        return 0;
    }
    snprintf(path, sizeof(path), "%s/net/%s", cls, dev);
    if (is_dir(path)) {
        char state[64], p[1100];
        snprintf(p, sizeof(p), "%s/operstate", path);
        *kind = KVX_RAIL_NET;
        *up = read_line(p, state, sizeof(state)) && !strcmp(state, "up");
        return 0;
    }
    return td_err_set(err, TD_ENOTFOUND, "device %s does not exist (looked in %s/infiniband and %s/net)",
                      dev, cls, cls);
}

int kvx_rails_find(const kvx_rails *r, const char *name)
{
    for (int i = 0; name && i < r->n; i++)
        if (!strcmp(r->name[i], name)) return i;
    return -1;
}

/* Whether name is in the comma list (NULL or "": everything is). */
static bool allowed(const char *allow, const char *name)
{
    if (!allow || !allow[0]) return true;
    size_t n = strlen(name);
    for (const char *p = allow; *p;) {
        while (*p == ' ' || *p == ',') p++;
        const char *e = p;
        while (*e && *e != ',') e++;
        const char *t = e;
        while (t > p && t[-1] == ' ') t--;
        if ((size_t)(t - p) == n && !strncmp(p, name, n)) return true;
        p = e;
    }
    return false;
}

static void list_names(const kvx_rails *r, char *buf, size_t cap)
{
    size_t at = 0;
    buf[0] = 0;
    for (int i = 0; i < r->n && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%s", i ? ", " : "", r->name[i]);
}

static int by_number(const void *a, const void *b)
{
    char f[KVX_RAIL_NAME];
    int x = 0, y = 0;
    kvx_rail_family(a, f, sizeof(f), &x);
    kvx_rail_family(b, f, sizeof(f), &y);
    return (x > y) - (x < y);
}

static int resolve_auto(const char *primary, kvx_rail_kind kind, const char *allow,
                        const char *root, kvx_rails *out, td_err *err)
{
    char fam[KVX_RAIL_NAME], dir[600];
    int num;
    if (!kvx_rail_family(primary, fam, sizeof(fam), &num))
        return td_err_set(err, TD_EINVAL,
                          "the primary device %s has no number, so its family is unknown: give "
                          "the rails as an explicit list instead of auto",
                          primary);
    snprintf(dir, sizeof(dir), "%s/class/%s", root, kind == KVX_RAIL_RDMA ? "infiniband" : "net");
    DIR *d = opendir(dir);
    if (!d) return td_err_set(err, TD_EIO, "sysfs is unavailable: %s: %s", dir, strerror(errno));
    struct dirent *e;
    int rc = 0;
    while (!rc && (e = readdir(d))) {
        char f[KVX_RAIL_NAME];
        int k;
        if (e->d_name[0] == '.' || bad_name(e->d_name) ||
            !kvx_rail_family(e->d_name, f, sizeof(f), &k) || strcmp(f, fam) ||
            !allowed(allow, e->d_name))
            continue;
        kvx_rail_kind kk;
        bool up = false;
        if (kvx_rail_state(root, e->d_name, &kk, &up, err) || kk != kind || !up) continue;
        if (out->n == KVX_MAX_RAILS) {
            rc = td_err_set(err, TD_EINVAL, "auto found more than %d %s* devices", KVX_MAX_RAILS, fam);
            break;
        }
        snprintf(out->name[out->n++], KVX_RAIL_NAME, "%s", e->d_name);
    }
    closedir(d);
    if (rc) return rc;
    qsort(out->name, (size_t)out->n, KVX_RAIL_NAME, by_number);
    return 0;
}

static int resolve_list(const char *spec, kvx_rail_kind kind, const char *allow,
                        const char *root, kvx_rails *out, td_err *err)
{
    for (const char *p = spec;;) {
        while (*p == ' ') p++;
        const char *e = p;
        while (*e && *e != ',') e++;
        const char *t = e;
        while (t > p && t[-1] == ' ') t--;
        size_t n = (size_t)(t - p);
        if (n == 0)
            return td_err_set(err, TD_EINVAL, "the rail list \"%s\" has an empty entry", spec);
        if (n >= KVX_RAIL_NAME)
            return td_err_set(err, TD_EINVAL, "a rail name in \"%s\" is longer than %d bytes",
                              spec, KVX_RAIL_NAME - 1);
        if (out->n == KVX_MAX_RAILS)
            return td_err_set(err, TD_EINVAL, "more than %d rails in \"%s\"", KVX_MAX_RAILS, spec);
        char name[KVX_RAIL_NAME];
        memcpy(name, p, n);
        name[n] = 0;
        if (kvx_rails_find(out, name) >= 0)
            return td_err_set(err, TD_EINVAL, "rail %s is listed twice in \"%s\"", name, spec);
        if (!allowed(allow, name))
            return td_err_set(err, TD_EINVAL,
                              "rail %s is not among the allowed devices (%s)", name, allow);
        kvx_rail_kind kk;
        bool up;
        int rc = kvx_rail_state(root, name, &kk, &up, err);
        if (rc) return rc;
        if (kk != kind)
            return td_err_set(err, TD_EINVAL,
                              "rail %s is %s but the primary is %s: a rail list has one kind",
                              name, kk == KVX_RAIL_RDMA ? "an RDMA device" : "a network interface",
                              kind == KVX_RAIL_RDMA ? "an RDMA device" : "a network interface");
        snprintf(out->name[out->n++], KVX_RAIL_NAME, "%s", name);
        if (!*e) break;
        p = e + 1;
    }
    return 0;
}

int kvx_rails_resolve(const char *spec, const char *primary, const char *allow,
                      const char *sysfs_root, kvx_rails *out, td_err *err)
{
    memset(out, 0, sizeof(*out));
    if (!spec || !spec[0]) return 0;
    if (!primary || !primary[0])
        return td_err_set(err, TD_EINVAL,
                          "matched rails need this process's primary device (rail_device, "
                          "TANDEM_RAIL_DEVICE)");
    if (strchr(primary, ','))
        return td_err_set(err, TD_EINVAL,
                          "matched rails need a single primary device, not the list \"%s\"",
                          primary);
    kvx_rail_kind kind;
    bool up = false;
    int rc = kvx_rail_state(sysfs_root, primary, &kind, &up, err);
    if (rc) return rc;
    if (!up)
        return td_err_set(err, TD_EINVAL,
                          "the primary device %s is not up (%s/class/%s/%s/%s): matched rails "
                          "need an active primary",
                          primary, sysfs_root, kind == KVX_RAIL_RDMA ? "infiniband" : "net",
                          primary, kind == KVX_RAIL_RDMA ? "ports/*/state" : "operstate");
    if (!allowed(allow, primary))
        return td_err_set(err, TD_EINVAL, "the primary device %s is not among the allowed (%s)",
                          primary, allow);
    out->kind = kind;
    rc = !strcmp(spec, "auto") ? resolve_auto(primary, kind, allow, sysfs_root, out, err)
                               : resolve_list(spec, kind, allow, sysfs_root, out, err);
    if (!rc && (out->primary = kvx_rails_find(out, primary)) < 0) {
        char names[512];
        list_names(out, names, sizeof(names));
        rc = td_err_set(err, TD_EINVAL, "the rails (%s) do not include the primary device %s",
                        names, primary);
    }
    if (rc) memset(out, 0, sizeof(*out));
    return rc;
}

void kvx_rails_describe(const kvx_rails *r, char *buf, size_t cap)
{
    size_t at = (size_t)snprintf(buf, cap, "%s: ", r->kind == KVX_RAIL_RDMA ? "rdma" : "net");
    for (int i = 0; i < r->n && at < cap; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%s%s", i ? ", " : "", r->name[i],
                               i == r->primary ? " (primary)" : "");
}

int kvx_rails_check_peer(const kvx_rails *r, const char *peer, int *index, td_err *err)
{
    char names[512];
    list_names(r, names, sizeof(names));
    if (!peer || !peer[0])
        return td_err_set(err, TD_EINVAL,
                          "the consumer named no rail; matched rails need its single rail (one "
                          "of %s)",
                          names);
    if (strchr(peer, ','))
        return td_err_set(err, TD_EINVAL,
                          "the consumer named several rails (\"%.80s\"); matched rails need one "
                          "(one of %s)",
                          peer, names);
    int i = kvx_rails_find(r, peer);
    if (i < 0)
        return td_err_set(err, TD_EINVAL,
                          "the consumer's rail %.80s is not one of this producer's rails (%s); "
                          "no other rail is used in its place",
                          peer, names);
    *index = i;
    return 0;
}
