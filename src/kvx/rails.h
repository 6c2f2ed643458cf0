/*
 * kvx/rails.h - matched rails: which network devices a transfer may use.
 *
 * A process has one primary device, its own NIC: an RDMA device (under
 * <sysfs>/class/infiniband, e.g. mlx5_2, ionic_2, rdma3) or a numbered network interface
 * used as a TCP rail (under <sysfs>/class/net, e.g. tdr2). Matched rails are the devices
 * of the primary's numbered name family that transfers may use; rail names must be the
 * same on every host, and a rail pairs only with the rail of the same name.
 */
#ifndef TD_KVX_RAILS_H
#define TD_KVX_RAILS_H

#include <stdbool.h>
#include <stddef.h>

#include "util/td.h"

#define KVX_MAX_RAILS 32
#define KVX_RAIL_NAME 64

typedef enum kvx_rail_kind { KVX_RAIL_NET = 0, KVX_RAIL_RDMA = 1 } kvx_rail_kind;

typedef struct kvx_rails {
    int n;                                   /* 0: matched rails off */
    char name[KVX_MAX_RAILS][KVX_RAIL_NAME]; /* auto: by number; explicit: list order */
    int primary;                             /* index of the primary device in name[] */
    kvx_rail_kind kind;
} kvx_rails;

/**
 * Split a device name by the rule (.*\D)(\d+)$: "ionic_2" -> "ionic_", 2; "rdma12" ->
 * "rdma", 12. False for an unnumbered name ("ib", "", or "7", whose family is empty).
 */
bool kvx_rail_family(const char *name, char *family, size_t cap, int *number);

/**
 * Where device dev lives and whether its link is up. RDMA (checked first):
 * <root>/class/infiniband/<dev> exists; up = some ports/<n>/state starts with "4"
 * ("4: ACTIVE"). NET: <root>/class/net/<dev> exists; up = its operstate is "up".
 * Returns 0, TD_ENOTFOUND (naming the device and both directories), TD_EINVAL (a name
 * with '/', ".", ".."), or TD_EIO when <root>/class cannot be read (sysfs unavailable).
 */
int kvx_rail_state(const char *sysfs_root, const char *dev, kvx_rail_kind *kind, bool *up,
                   td_err *err);

/**
 * Resolve matched rails. spec: NULL or "" (off: out->n = 0), "auto" (every device of the
 * primary's class and family whose link is up, sorted by number), or an explicit comma
 * list (names trimmed; each must exist, and the primary must be among them). primary: the
 * primary device, required when spec is on, and up in both modes. allow (NULL or ""):
 * a comma list restricting usable devices (TANDEM_RDMA_DEVICES): auto drops others, an
 * explicit list naming another is an error. Every misconfiguration is an error with a
 * message that names it (never a silent disable): no primary, a primary that is a list,
 * an unnumbered primary with auto, a missing or down primary, unreadable sysfs (TD_EIO),
 * an empty, duplicate, too long or unknown list entry, a list without the primary, mixed
 * kinds, an allow list without the primary, more than KVX_MAX_RAILS devices.
 */
int kvx_rails_resolve(const char *spec, const char *primary, const char *allow,
                      const char *sysfs_root, kvx_rails *out, td_err *err);

/** Index of name in r (exact match), or -1. */
int kvx_rails_find(const kvx_rails *r, const char *name);

/** "net: tdr0, tdr1 (primary), tdr2" for the start-up log. */
void kvx_rails_describe(const kvx_rails *r, char *buf, size_t cap);

/**
 * A peer's advertised rail against r (producer side): NULL, "", a list ("a,b") or a name
 * not in r are TD_EINVAL with a message naming the value and r's rails; else 0 and
 * *index = its index. No fallback to another rail.
 */
int kvx_rails_check_peer(const kvx_rails *r, const char *peer_rail, int *index, td_err *err);

#endif
