/*
 * kvx/rails.h - matched rails: which network devices a transfer may use.
 *
 * A process has one primary device, its own NIC: an RDMA device (under
 * <sysfs>/class/infiniband, e.g. mlx5_2, ionic_2, rdma3) or a numbered network interface
 * used as a TCP rail (under <sysfs>/class/net, e.g. tdr2, eth1). Matched rails are the
 * devices of the primary's numbered name family that transfers may use. Rails are matched
 * by name, so rail names must be the same on every host, and a rail pairs only with the
 * rail of the same name on the peer.
 *
 * Everything here reads a few small sysfs files at start-up and allocates nothing: a
 * kvx_rails is a fixed-size value the caller owns and may copy.
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
    char name[KVX_MAX_RAILS][KVX_RAIL_NAME]; /* auto: sorted by number; explicit: list order */
    int primary;                             /* index of the primary device in name[] */
    kvx_rail_kind kind;
} kvx_rails;

/**
 * Split a device name into its family and number by the rule (.*\D)(\d+)$:
 * "ionic_2" -> "ionic_", 2; "mlx5_0" -> "mlx5_", 0; "rdma12" -> "rdma", 12; "eth1" ->
 * "eth", 1. Returns false for an unnumbered name ("ib", ""), for one whose family would be
 * empty ("7"), for a number of more than 9 digits (no device has one; it would overflow
 * int) and when the family does not fit in family[cap]. family and number may be NULL
 * when only the answer is wanted.
 */
bool kvx_rail_family(const char *name, char *family, size_t cap, int *number);

/**
 * Where device dev lives and whether its link is up. sysfs_root NULL or "" means "/sys".
 *  - RDMA (checked first): <root>/class/infiniband/<dev> exists; up = at least one
 *    ports/<n>/state file whose content starts with "4" ("4: ACTIVE").
 *  - NET: <root>/class/net/<dev> exists; up = its operstate is "up" (a trailing newline
 *    is fine).
 * Returns 0 (and sets *kind and *up; either may be NULL), TD_ENOTFOUND (the message names
 * the device and both directories looked in), TD_EINVAL for something that is no device
 * name (NULL, "", containing '/', ".", "..", or KVX_RAIL_NAME bytes or longer), or TD_EIO
 * when <root>/class cannot be read (the message says sysfs is unavailable and names the
 * path).
 */
int kvx_rail_state(const char *sysfs_root, const char *dev, kvx_rail_kind *kind, bool *up,
                   td_err *err);

/**
 * Resolve matched rails into *out (always written; n = 0 on any error).
 *  spec:    NULL or "" -> matched rails off (out->n = 0, returns 0, nothing else checked);
 *           "auto" (surrounding whitespace ignored) -> every device in the primary's class
 *           directory whose family equals the primary's and whose link is up, sorted by
 *           number (primary ionic_2 finds the active ionic_0..ionic_7 and skips mlx5_0, an
 *           inactive ionic_5 and an unnumbered ionic_x);
 *           otherwise -> an explicit comma list of names (whitespace around names trimmed),
 *           kept in list order; each must exist, but only the primary must be up.
 *  primary: the primary device, one name. Required when spec is on; up in both modes.
 *  allow:   NULL, "" or a comma list restricting usable devices (TANDEM_RDMA_DEVICES): auto
 *           drops devices not in it; an explicit list naming one not in it is an error.
 *  sysfs_root: "/sys" normally (NULL or "" mean that too); tests pass a fixture directory.
 *
 * Every misconfiguration is an error whose message names the problem and the fix, never a
 * silent disable. TD_EINVAL unless said: no primary; a primary that is a list; an
 * unnumbered primary with auto; a primary that does not exist (TD_ENOTFOUND) or is not up
 * (the message names the state file or operstate read, and what it said); unreadable
 * sysfs (TD_EIO); in an explicit list, an empty entry, a duplicate, a name of
 * KVX_RAIL_NAME bytes or more, a device that does not exist (TD_ENOTFOUND), more than
 * KVX_MAX_RAILS names, no primary among them, or RDMA devices and network interfaces
 * mixed; an allow list that excludes the primary; auto finding more than KVX_MAX_RAILS.
 */
int kvx_rails_resolve(const char *spec, const char *primary, const char *allow,
                      const char *sysfs_root, kvx_rails *out, td_err *err);

/** Index of name in r (exact match), or -1 (also for NULL). */
int kvx_rails_find(const kvx_rails *r, const char *name);

/**
 * One line for the start-up log into buf[cap] (always NUL-terminated when cap > 0,
 * truncated if short): "rdma: ionic_0, ionic_2 (primary), ionic_3", or "off" when n is 0.
 */
void kvx_rails_describe(const kvx_rails *r, char *buf, size_t cap);

/**
 * Validate a peer's advertised rail against r (producer side). NULL, "", a value with ','
 * (a list where one name is expected) or a name not in r are TD_EINVAL with a message that
 * names the value and lists r's rails; else 0 and *index = its index. There is no fallback
 * to another rail.
 */
int kvx_rails_check_peer(const kvx_rails *r, const char *peer_rail, int *index, td_err *err);

#endif
