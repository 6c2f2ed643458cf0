/*
 * Matched-rail discovery and validation (kvx/rails.c) on a fixture sysfs tree made under a
 * mkdtemp() directory: name families, auto discovery by family and link state for RDMA
 * devices and network interfaces, explicit lists, the allow list, every start-up error
 * (return code and the key words of its message), odd input, the producer's check of a
 * consumer's rail, and the start-up log line. No root and no namespaces needed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvx/rails.h"

/* The fixture's sysfs root: <tmp>/td-rails-XXXXXX. */
static char root[1024];

/* ---------------------------------------------------------------- fixture tree */

/* mkdir -p. */
static void make_dirs(const char *path)
{
    char buf[2048];
    assert_true((size_t)snprintf(buf, sizeof(buf), "%s", path) < sizeof(buf));
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(buf, 0755);
            *p = '/';
        }
    assert_true(mkdir(buf, 0755) == 0 || access(buf, F_OK) == 0);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    assert_int_equal(fclose(f), 0);
}

/* <root>/class/infiniband/<dev>/ports/<port>/state holding state ("4: ACTIVE", "1: DOWN"). */
static void add_rdma_port(const char *dev, int port, const char *state)
{
    char path[2048];
    snprintf(path, sizeof(path), "%s/class/infiniband/%s/ports/%d", root, dev, port);
    make_dirs(path);
    snprintf(path, sizeof(path), "%s/class/infiniband/%s/ports/%d/state", root, dev, port);
    write_file(path, state);
}

static void add_rdma(const char *dev, const char *state)
{
    add_rdma_port(dev, 1, state);
}

/* <root>/class/net/<ifname>/operstate holding operstate ("up\n", "down\n"). */
static void add_net(const char *ifname, const char *operstate)
{
    char path[2048];
    snprintf(path, sizeof(path), "%s/class/net/%s", root, ifname);
    make_dirs(path);
    snprintf(path, sizeof(path), "%s/class/net/%s/operstate", root, ifname);
    write_file(path, operstate);
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

static int setup(void **state)
{
    (void)state;
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof(root), "%s/td-rails-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(root)) return -1;

    /* ionic_*: 0..7 and 10 active except ionic_5; ionic_x has no number. */
    for (int i = 0; i <= 7; i++) {
        char dev[32];
        snprintf(dev, sizeof(dev), "ionic_%d", i);
        add_rdma(dev, i == 5 ? "1: DOWN\n" : "4: ACTIVE\n");
    }
    add_rdma("ionic_10", "4: ACTIVE\n");
    add_rdma("ionic_x", "4: ACTIVE\n");
    /* ionic_8 vanished: sysfs entries are links to device directories, and this one
     * dangles (auto skips it without leaving an error behind). */
    char link[2048];
    snprintf(link, sizeof(link), "%s/class/infiniband/ionic_8", root);
    if (symlink("../../devices/gone/ionic_8", link)) return -1;
    /* mlx5_*: mlx5_3's first port is down but its second is active, so it is up. */
    add_rdma("mlx5_0", "4: ACTIVE\n");
    add_rdma("mlx5_1", "4: ACTIVE\n");
    add_rdma("mlx5_10", "4: ACTIVE");
    add_rdma_port("mlx5_3", 1, "1: DOWN\n");
    add_rdma_port("mlx5_3", 2, "4: ACTIVE\n");
    add_rdma_port("mlx5_4", 1, "2: INIT\n");
    /* rdma*: rdma3 has no ports directory at all (not up). */
    add_rdma("rdma0", "4: ACTIVE\n");
    add_rdma("rdma1", "4: ACTIVE\n");
    add_rdma("rdma12", "4: ACTIVE\n");
    char path[2048];
    snprintf(path, sizeof(path), "%s/class/infiniband/rdma3", root);
    make_dirs(path);
    add_rdma("ib", "4: ACTIVE\n"); /* unnumbered */
    /* dual0 is both an RDMA device and a net interface: RDMA is checked first. */
    add_rdma("dual0", "4: ACTIVE\n");
    add_net("dual0", "up\n");

    /* TCP rails: tdr2 down; tdm0 and eth* are other families; lo is "unknown". */
    add_net("tdr0", "up\n");
    add_net("tdr1", "up\n");
    add_net("tdr2", "down\n");
    add_net("tdr3", "up\n");
    add_net("tdm0", "up\n");
    add_net("eth0", "up\n");
    add_net("eth1", "up"); /* no trailing newline */
    add_net("lo", "unknown\n");
    /* big0..big32: one more active interface than a kvx_rails holds. */
    for (int i = 0; i <= KVX_MAX_RAILS; i++) {
        char ifname[32];
        snprintf(ifname, sizeof(ifname), "big%d", i);
        add_net(ifname, "up\n");
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return nftw(root, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A path under the fixture root. */
static const char *under_root(const char *rel)
{
    static char path[2048];
    snprintf(path, sizeof(path), "%s/%s", root, rel);
    return path;
}

static void assert_msg_has(const td_err *err, const char *needle)
{
    if (!strstr(err->msg, needle)) fail_msg("no \"%s\" in the message \"%s\"", needle, err->msg);
}

/* Resolve expecting success, and compare the names in order. */
static void expect_rails(const char *spec, const char *primary, const char *allow,
                         kvx_rail_kind kind, const char *const *names, int n, int primary_at)
{
    kvx_rails r;
    td_err err;
    td_err_clear(&err);
    int rc = kvx_rails_resolve(spec, primary, allow, root, &r, &err);
    if (rc) fail_msg("resolve(%s, %s): %d %s", spec, primary, rc, err.msg);
    assert_int_equal(err.code, 0); /* success leaves the error record alone */
    assert_int_equal(r.kind, kind);
    assert_int_equal(r.n, n);
    for (int i = 0; i < n; i++)
        assert_string_equal(r.name[i], names[i]);
    assert_int_equal(r.primary, primary_at);
    assert_string_equal(r.name[r.primary], primary);
}

/* Resolve expecting rc; out is cleared (n 0) and the message carries each needle. */
static void expect_error(const char *spec, const char *primary, const char *allow,
                         const char *sysfs_root, int rc, const char *needle1, const char *needle2)
{
    kvx_rails r;
    memset(&r, 0x5a, sizeof(r));
    td_err err;
    td_err_clear(&err);
    assert_int_equal(kvx_rails_resolve(spec, primary, allow, sysfs_root, &r, &err), rc);
    assert_int_equal(err.code, rc);
    assert_int_equal(r.n, 0);
    if (needle1) assert_msg_has(&err, needle1);
    if (needle2) assert_msg_has(&err, needle2);
}

/* ---------------------------------------------------------------- families */

static void test_family(void **state)
{
    (void)state;
    char f[KVX_RAIL_NAME];
    int n = -1;
    assert_true(kvx_rail_family("ionic_2", f, sizeof(f), &n));
    assert_string_equal(f, "ionic_");
    assert_int_equal(n, 2);
    assert_true(kvx_rail_family("mlx5_0", f, sizeof(f), &n));
    assert_string_equal(f, "mlx5_");
    assert_int_equal(n, 0);
    assert_true(kvx_rail_family("mlx5_10", f, sizeof(f), &n));
    assert_string_equal(f, "mlx5_");
    assert_int_equal(n, 10);
    assert_true(kvx_rail_family("rdma0", f, sizeof(f), &n));
    assert_string_equal(f, "rdma");
    assert_int_equal(n, 0);
    assert_true(kvx_rail_family("rdma12", f, sizeof(f), &n));
    assert_string_equal(f, "rdma");
    assert_int_equal(n, 12);
    assert_true(kvx_rail_family("eth1", f, sizeof(f), &n));
    assert_string_equal(f, "eth");
    assert_int_equal(n, 1);
    assert_true(kvx_rail_family("a007", f, sizeof(f), &n)); /* leading zeros are digits */
    assert_string_equal(f, "a");
    assert_int_equal(n, 7);

    /* Unnumbered, empty, digits only (empty family), NULL: false, outputs untouched. */
    strcpy(f, "keep");
    n = -1;
    assert_false(kvx_rail_family("ib", f, sizeof(f), &n));
    assert_false(kvx_rail_family("ionic_x", f, sizeof(f), &n));
    assert_false(kvx_rail_family("", f, sizeof(f), &n));
    assert_false(kvx_rail_family("7", f, sizeof(f), &n));
    assert_false(kvx_rail_family("123", f, sizeof(f), &n));
    assert_false(kvx_rail_family(NULL, f, sizeof(f), &n));
    assert_false(kvx_rail_family("x12345678901", f, sizeof(f), &n)); /* would overflow int */
    assert_string_equal(f, "keep");
    assert_int_equal(n, -1);

    /* The family must fit with its NUL; outputs are optional. */
    assert_false(kvx_rail_family("ionic_2", f, 6, &n));
    assert_true(kvx_rail_family("ionic_2", f, 7, &n));
    assert_string_equal(f, "ionic_");
    assert_true(kvx_rail_family("ionic_2", NULL, 0, NULL));
    assert_false(kvx_rail_family("ionic", NULL, 0, NULL));
}

/* ---------------------------------------------------------------- one device */

static void test_rail_state(void **state)
{
    (void)state;
    kvx_rail_kind kind;
    bool up;
    td_err err;

    assert_int_equal(kvx_rail_state(root, "ionic_0", &kind, &up, &err), 0);
    assert_int_equal(kind, KVX_RAIL_RDMA);
    assert_true(up);
    assert_int_equal(kvx_rail_state(root, "ionic_5", &kind, &up, &err), 0);
    assert_int_equal(kind, KVX_RAIL_RDMA);
    assert_false(up);
    assert_int_equal(kvx_rail_state(root, "mlx5_3", &kind, &up, &err), 0); /* port 2 active */
    assert_true(up);
    assert_int_equal(kvx_rail_state(root, "mlx5_4", &kind, &up, &err), 0); /* "2: INIT" */
    assert_false(up);
    assert_int_equal(kvx_rail_state(root, "mlx5_10", &kind, &up, &err), 0); /* no newline */
    assert_true(up);
    assert_int_equal(kvx_rail_state(root, "rdma3", &kind, &up, &err), 0); /* no ports */
    assert_int_equal(kind, KVX_RAIL_RDMA);
    assert_false(up);
    assert_int_equal(kvx_rail_state(root, "dual0", &kind, &up, &err), 0);
    assert_int_equal(kind, KVX_RAIL_RDMA); /* RDMA is checked first */

    assert_int_equal(kvx_rail_state(root, "tdr0", &kind, &up, &err), 0);
    assert_int_equal(kind, KVX_RAIL_NET);
    assert_true(up);
    assert_int_equal(kvx_rail_state(root, "tdr2", &kind, &up, &err), 0);
    assert_int_equal(kind, KVX_RAIL_NET);
    assert_false(up);
    assert_int_equal(kvx_rail_state(root, "eth1", &kind, &up, &err), 0); /* "up", no newline */
    assert_true(up);
    assert_int_equal(kvx_rail_state(root, "lo", &kind, &up, &err), 0); /* "unknown" */
    assert_false(up);

    /* Not found: names the device and both directories. */
    td_err_clear(&err);
    assert_int_equal(kvx_rail_state(root, "ionic_9", &kind, &up, &err), TD_ENOTFOUND);
    assert_int_equal(err.code, TD_ENOTFOUND);
    assert_msg_has(&err, "ionic_9");
    assert_msg_has(&err, "class/infiniband");
    assert_msg_has(&err, "class/net");
    assert_int_equal(kvx_rail_state(root, "ionic_8", &kind, &up, &err), TD_ENOTFOUND);
    assert_msg_has(&err, "ionic_8");

    /* No class directory under the root: sysfs unavailable, naming the path. */
    char missing[1100];
    snprintf(missing, sizeof(missing), "%s/no-such-sysfs", root);
    assert_int_equal(kvx_rail_state(missing, "tdr0", &kind, &up, &err), TD_EIO);
    assert_msg_has(&err, "sysfs is unavailable");
    assert_msg_has(&err, "no-such-sysfs/class");

    /* Names that would escape the class directory, or are no names at all. */
    const char *bad[] = {NULL, "", ".", "..", "../net/tdr0", "tdr0/..", "net/tdr0", "/tdr0"};
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++) {
        td_err_clear(&err);
        assert_int_equal(kvx_rail_state(root, bad[i], &kind, &up, &err), TD_EINVAL);
        assert_msg_has(&err, "not a device name");
    }
    char longname[300];
    memset(longname, 'x', sizeof(longname) - 2);
    longname[sizeof(longname) - 2] = '1';
    longname[sizeof(longname) - 1] = 0;
    assert_int_equal(kvx_rail_state(root, longname, &kind, &up, &err), TD_EINVAL);
}

/* ---------------------------------------------------------------- auto */

static void test_auto_ionic(void **state)
{
    (void)state;
    /* Active ionic_* by number (10 after 7): not ionic_5 (down), ionic_8 (gone), ionic_x,
     * mlx5_0, dual0. */
    const char *want[] = {"ionic_0", "ionic_1", "ionic_2", "ionic_3",
                          "ionic_4", "ionic_6", "ionic_7", "ionic_10"};
    expect_rails("auto", "ionic_2", NULL, KVX_RAIL_RDMA, want, 8, 2);
    expect_rails("auto", "ionic_10", "", KVX_RAIL_RDMA, want, 8, 7);
    expect_rails(" auto\t", "ionic_0", NULL, KVX_RAIL_RDMA, want, 8, 0);
}

static void test_auto_other_families(void **state)
{
    (void)state;
    /* rdma3 has no ports (not up); ib is unnumbered. */
    const char *rdma[] = {"rdma0", "rdma1", "rdma12"};
    expect_rails("auto", "rdma1", NULL, KVX_RAIL_RDMA, rdma, 3, 1);
    /* mlx5_3 is up through its second port; mlx5_4 is only INIT. */
    const char *mlx[] = {"mlx5_0", "mlx5_1", "mlx5_3", "mlx5_10"};
    expect_rails("auto", "mlx5_0", NULL, KVX_RAIL_RDMA, mlx, 4, 0);
    expect_rails("auto", "mlx5_3", NULL, KVX_RAIL_RDMA, mlx, 4, 2);
}

static void test_auto_net(void **state)
{
    (void)state;
    /* tdr2 is down; tdm0 and eth0 are other families. */
    const char *tdr[] = {"tdr0", "tdr1", "tdr3"};
    expect_rails("auto", "tdr1", NULL, KVX_RAIL_NET, tdr, 3, 1);
    expect_rails("auto", "tdr0", NULL, KVX_RAIL_NET, tdr, 3, 0);
    const char *eth[] = {"eth0", "eth1"};
    expect_rails("auto", "eth1", NULL, KVX_RAIL_NET, eth, 2, 1);
    /* More than KVX_MAX_RAILS found is an error, unless the allow list narrows them. */
    expect_error("auto", "big0", NULL, root, TD_EINVAL, "more than 32", "big*");
    const char *big[] = {"big0", "big7", "big32"};
    expect_rails("auto", "big7", "big32,big7, big0", KVX_RAIL_NET, big, 3, 1);
}

/* ---------------------------------------------------------------- primary errors */

static void test_off(void **state)
{
    (void)state;
    kvx_rails r;
    td_err err;
    td_err_clear(&err);
    /* Off needs nothing else: no primary, no sysfs. */
    memset(&r, 0x5a, sizeof(r));
    assert_int_equal(kvx_rails_resolve(NULL, NULL, NULL, "/nonexistent", &r, &err), 0);
    assert_int_equal(r.n, 0);
    memset(&r, 0x5a, sizeof(r));
    assert_int_equal(kvx_rails_resolve("", "tdr1", "tdr9", root, &r, &err), 0);
    assert_int_equal(r.n, 0);
    assert_int_equal(err.code, 0);
    char d[64];
    kvx_rails_describe(&r, d, sizeof(d));
    assert_string_equal(d, "off");
}

static void test_primary_errors(void **state)
{
    (void)state;
    /* Missing, a list. */
    expect_error("auto", NULL, NULL, root, TD_EINVAL, "primary device", "rail_device");
    expect_error("tdr0,tdr1", "", NULL, root, TD_EINVAL, "primary device", NULL);
    expect_error("auto", "mlx5_0,mlx5_1", NULL, root, TD_EINVAL, "single primary", "mlx5_0,mlx5_1");
    /* Not found, in both modes. */
    expect_error("auto", "ionic_9", NULL, root, TD_ENOTFOUND, "ionic_9", "class/infiniband");
    expect_error("tdr9,tdr0", "tdr9", NULL, root, TD_ENOTFOUND, "tdr9", "class/net");
    /* Not up, in both modes: the message names the file read and what it said. */
    expect_error("auto", "ionic_5", NULL, root, TD_EINVAL, "not up", "ports/1/state");
    expect_error("auto", "ionic_5", NULL, root, TD_EINVAL, "ionic_5", "1: DOWN");
    expect_error("auto", "rdma3", NULL, root, TD_EINVAL, "not up", "ports/<n>/state");
    expect_error("auto", "tdr2", NULL, root, TD_EINVAL, "not up", "operstate reads \"down\"");
    expect_error("tdr0,tdr2", "tdr2", NULL, root, TD_EINVAL, "tdr2", "not up");
    expect_error("auto", "lo", NULL, root, TD_EINVAL, "not up", "unknown");
    /* Unnumbered with auto: family unknown, use a list. An explicit list is fine. */
    expect_error("auto", "ib", NULL, root, TD_EINVAL, "no number", "explicit list");
    const char *ib[] = {"ib"};
    expect_rails("ib", "ib", NULL, KVX_RAIL_RDMA, ib, 1, 0);
    /* sysfs unreadable: the root has no class directory. */
    expect_error("auto", "tdr1", NULL, under_root("no-such-sysfs"), TD_EIO, "sysfs is unavailable",
                 "no-such-sysfs/class");
    expect_error("tdr1", "tdr1", NULL, "/nonexistent-td-sysfs", TD_EIO, "sysfs is unavailable",
                 "/nonexistent-td-sysfs/class");
    /* Odd primaries never reach a path outside the class directories. */
    expect_error("auto", "../net/tdr1", NULL, root, TD_EINVAL, "not a device name", NULL);
    expect_error("auto", "..", NULL, root, TD_EINVAL, "not a device name", NULL);
    char huge[5000];
    memset(huge, 'q', sizeof(huge) - 1);
    huge[sizeof(huge) - 1] = 0;
    expect_error("auto", huge, NULL, root, TD_EINVAL, "not a device name", NULL);
    expect_error("auto", "tdr1", NULL, huge, TD_EINVAL, "too long", NULL);
}

/* ---------------------------------------------------------------- explicit lists */

static void test_list_ok(void **state)
{
    (void)state;
    /* Order kept, whitespace around names trimmed. */
    const char *tdr[] = {"tdr3", "tdr0", "tdr1"};
    expect_rails(" tdr3,\ttdr0 , tdr1 ", "tdr1", NULL, KVX_RAIL_NET, tdr, 3, 2);
    /* A listed device may be down (only the primary must be up). */
    const char *down[] = {"tdr1", "tdr2"};
    expect_rails("tdr1,tdr2", "tdr1", NULL, KVX_RAIL_NET, down, 2, 0);
    /* Names need not share a family, only a kind. */
    const char *rdma[] = {"mlx5_1", "ionic_0", "ionic_5", "ib"};
    expect_rails("mlx5_1,ionic_0,ionic_5,ib", "ionic_0", NULL, KVX_RAIL_RDMA, rdma, 4, 1);
    const char *one[] = {"tdr0"};
    expect_rails("tdr0", "tdr0", NULL, KVX_RAIL_NET, one, 1, 0);
}

static void test_list_errors(void **state)
{
    (void)state;
    expect_error("tdr0,tdr3", "tdr1", NULL, root, TD_EINVAL,
                 "do not include the primary device tdr1", "tdr0, tdr3");
    expect_error("tdr1,tdr9", "tdr1", NULL, root, TD_ENOTFOUND, "tdr9", "does not exist");
    expect_error("tdr1,,tdr3", "tdr1", NULL, root, TD_EINVAL, "empty entry", "tdr1,,tdr3");
    expect_error("tdr1,", "tdr1", NULL, root, TD_EINVAL, "empty entry", NULL);
    expect_error(",tdr1", "tdr1", NULL, root, TD_EINVAL, "empty entry", NULL);
    expect_error("tdr1, \t,tdr0", "tdr1", NULL, root, TD_EINVAL, "empty entry", NULL);
    expect_error(" ", "tdr1", NULL, root, TD_EINVAL, "empty entry", NULL);
    expect_error("tdr1,tdr0, tdr1", "tdr1", NULL, root, TD_EINVAL, "tdr1 is listed twice", NULL);
    expect_error("tdr1,mlx5_0", "tdr1", NULL, root, TD_EINVAL, "mlx5_0 is an RDMA device",
                 "one kind");
    expect_error("ionic_0,tdr0", "ionic_0", NULL, root, TD_EINVAL, "tdr0 is a network interface",
                 "one kind");
    expect_error("tdr1,../tdr0", "tdr1", NULL, root, TD_EINVAL, "not a device name", NULL);

    /* A name of KVX_RAIL_NAME bytes or more. */
    char list[300];
    memset(list, 'a', 80);
    snprintf(list + 80, sizeof(list) - 80, "1,tdr1");
    expect_error(list, "tdr1", NULL, root, TD_EINVAL, "longer than 63", NULL);

    /* More than KVX_MAX_RAILS names (all of which exist). */
    char many[1024];
    size_t at = 0;
    for (int i = 0; i <= KVX_MAX_RAILS; i++)
        at += (size_t)snprintf(many + at, sizeof(many) - at, "%sbig%d", i ? "," : "", i);
    expect_error(many, "big0", NULL, root, TD_EINVAL, "more than 32", NULL);
    /* Exactly KVX_MAX_RAILS is fine. */
    *strrchr(many, ',') = 0;
    kvx_rails r;
    td_err err;
    assert_int_equal(kvx_rails_resolve(many, "big31", NULL, root, &r, &err), 0);
    assert_int_equal(r.n, KVX_MAX_RAILS);
    assert_string_equal(r.name[31], "big31");
    assert_int_equal(r.primary, 31);
}

/* ---------------------------------------------------------------- allow list */

static void test_allow(void **state)
{
    (void)state;
    /* Auto drops what the allow list lacks (mlx5_0 is another family anyway). */
    const char *some[] = {"ionic_0", "ionic_2", "ionic_3"};
    expect_rails("auto", "ionic_2", "ionic_3, mlx5_0,ionic_0 ,\tionic_2", KVX_RAIL_RDMA, some, 3,
                 1);
    /* An allow list naming a down device does not bring it back. */
    const char *two[] = {"ionic_2", "ionic_6"};
    expect_rails("auto", "ionic_2", "ionic_2,ionic_5,ionic_6", KVX_RAIL_RDMA, two, 2, 0);
    /* The allow list must include the primary, in both modes. */
    expect_error("auto", "ionic_2", "ionic_0,ionic_3", root, TD_EINVAL,
                 "primary device ionic_2 is not among the allowed", "ionic_0,ionic_3");
    expect_error("tdr1,tdr3", "tdr1", "tdr3", root, TD_EINVAL, "tdr1", "allowed");
    /* An explicit list may not name a device outside it. */
    expect_error("tdr1,tdr3", "tdr1", "tdr1", root, TD_EINVAL, "rail tdr3 is not among the allowed",
                 NULL);
    const char *ok[] = {"tdr1", "tdr3"};
    expect_rails("tdr1,tdr3", "tdr1", "tdr0,tdr1,tdr3", KVX_RAIL_NET, ok, 2, 0);
    /* Matching is by whole name: "tdr" does not allow "tdr1". */
    expect_error("auto", "tdr1", "tdr,tdr10", root, TD_EINVAL, "not among the allowed", NULL);
}

/* ---------------------------------------------------------------- peer check, find, describe */

static void test_check_peer(void **state)
{
    (void)state;
    kvx_rails r;
    td_err err;
    assert_int_equal(kvx_rails_resolve("auto", "tdr0", NULL, root, &r, &err), 0);
    int i = -1;
    assert_int_equal(kvx_rails_check_peer(&r, "tdr3", &i, &err), 0);
    assert_int_equal(i, 2);
    assert_int_equal(kvx_rails_check_peer(&r, "tdr0", &i, &err), 0);
    assert_int_equal(i, 0);

    i = -1;
    td_err_clear(&err);
    assert_int_equal(kvx_rails_check_peer(&r, NULL, &i, &err), TD_EINVAL);
    assert_int_equal(err.code, TD_EINVAL);
    assert_msg_has(&err, "named no rail");
    assert_msg_has(&err, "tdr0, tdr1, tdr3");
    assert_int_equal(kvx_rails_check_peer(&r, "", &i, &err), TD_EINVAL);
    assert_msg_has(&err, "named no rail");
    assert_msg_has(&err, "tdr0, tdr1, tdr3");
    assert_int_equal(kvx_rails_check_peer(&r, "tdr0,tdr1", &i, &err), TD_EINVAL);
    assert_msg_has(&err, "several rails");
    assert_msg_has(&err, "\"tdr0,tdr1\"");
    assert_msg_has(&err, "tdr0, tdr1, tdr3");
    assert_int_equal(kvx_rails_check_peer(&r, "a,b", &i, &err), TD_EINVAL);
    assert_msg_has(&err, "\"a,b\"");
    assert_int_equal(kvx_rails_check_peer(&r, "tdr2", &i, &err), TD_EINVAL); /* down: no rail */
    assert_msg_has(&err, "\"tdr2\" is not one of this producer's rails");
    assert_msg_has(&err, "tdr0, tdr1, tdr3");
    assert_int_equal(kvx_rails_check_peer(&r, "tdr", &i, &err), TD_EINVAL); /* no prefixes */
    assert_int_equal(i, -1); /* untouched by every refusal */

    /* A very long value is cut in the message, never overflowing it. */
    char huge[2000];
    memset(huge, 'z', sizeof(huge) - 1);
    huge[sizeof(huge) - 1] = 0;
    assert_int_equal(kvx_rails_check_peer(&r, huge, &i, &err), TD_EINVAL);
    assert_true(strlen(err.msg) < sizeof(err.msg));
    assert_msg_has(&err, "tdr0, tdr1, tdr3");

    /* With matched rails off, every rail is refused. */
    kvx_rails off;
    assert_int_equal(kvx_rails_resolve(NULL, NULL, NULL, root, &off, &err), 0);
    assert_int_equal(kvx_rails_check_peer(&off, "tdr0", &i, &err), TD_EINVAL);
    assert_msg_has(&err, "tdr0");
}

static void test_find_and_describe(void **state)
{
    (void)state;
    kvx_rails r;
    td_err err;
    char d[256];
    assert_int_equal(
        kvx_rails_resolve("auto", "ionic_2", "ionic_0,ionic_2,ionic_3", root, &r, &err), 0);
    kvx_rails_describe(&r, d, sizeof(d));
    assert_string_equal(d, "rdma: ionic_0, ionic_2 (primary), ionic_3");
    assert_int_equal(kvx_rails_find(&r, "ionic_3"), 2);
    assert_int_equal(kvx_rails_find(&r, "ionic_"), -1);
    assert_int_equal(kvx_rails_find(&r, "ionic_33"), -1);
    assert_int_equal(kvx_rails_find(&r, NULL), -1);

    assert_int_equal(kvx_rails_resolve("auto", "tdr1", NULL, root, &r, &err), 0);
    kvx_rails_describe(&r, d, sizeof(d));
    assert_string_equal(d, "net: tdr0, tdr1 (primary), tdr3");

    /* A short buffer is truncated and stays terminated; cap 0 writes nothing. */
    char small[12];
    memset(small, '#', sizeof(small));
    kvx_rails_describe(&r, small, sizeof(small));
    assert_string_equal(small, "net: tdr0, ");
    d[0] = '#';
    kvx_rails_describe(&r, d, 0);
    assert_int_equal(d[0], '#');

    /* The longest description fits a large buffer in full. */
    char many[1024], big[4096];
    size_t at = 0;
    for (int i = 0; i < KVX_MAX_RAILS; i++)
        at += (size_t)snprintf(many + at, sizeof(many) - at, "%sbig%d", i ? "," : "", i);
    assert_int_equal(kvx_rails_resolve(many, "big5", NULL, root, &r, &err), 0);
    kvx_rails_describe(&r, big, sizeof(big));
    assert_non_null(strstr(big, "big5 (primary), big6"));
    assert_non_null(strstr(big, ", big31"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_family),         cmocka_unit_test(test_rail_state),
        cmocka_unit_test(test_auto_ionic),     cmocka_unit_test(test_auto_other_families),
        cmocka_unit_test(test_auto_net),       cmocka_unit_test(test_off),
        cmocka_unit_test(test_primary_errors), cmocka_unit_test(test_list_ok),
        cmocka_unit_test(test_list_errors),    cmocka_unit_test(test_allow),
        cmocka_unit_test(test_check_peer),     cmocka_unit_test(test_find_and_describe),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
