/*
 * server/kvconfig.c - --kv-transfer-config, validated at start-up. A typo in a recipe
 * must fail now rather than be silently ignored, so unknown keys, wrong types, bad values
 * and impossible combinations are errors, and kv_role has no default. Keys that the seed
 * recipes carry for another system (MORI-IO's RDMA tuning) are accepted, and the parser
 * says in `notes` that they have no effect on the chosen transport.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "kvx/rails.h"
#include "util/json.h"
#include "server/server.h"

const char *srv_kv_role_name(srv_kv_role r)
{
    switch (r) {
    case SRV_KV_PRODUCER:
        return "kv_producer";
    case SRV_KV_CONSUMER:
        return "kv_consumer";
    case SRV_KV_BOTH:
        return "kv_both";
    case SRV_KV_NONE:
        break;
    }
    return "none";
}

const char *srv_kv_protocol_name(srv_kv_protocol p)
{
    switch (p) {
    case SRV_KV_TCP: return "tcp";
    case SRV_KV_SHM: return "shm";
    case SRV_KV_UCX: return "ucx";
    case SRV_KV_CUDA_IPC: return "cuda_ipc";
    }
    return "?";
}

static int fail(char *err, size_t cap, const char *msg, const char *key)
{
    if (key)
        snprintf(err, cap, "--kv-transfer-config: '%s'%s", key, msg);
    else
        snprintf(err, cap, "--kv-transfer-config: %s", msg);
    return TD_EINVAL;
}

static int int_val(const cJSON *v, int64_t lo, int64_t hi, int64_t *out)
{
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
        v->valuedouble != floor(v->valuedouble) || v->valuedouble < (double)lo ||
        v->valuedouble > (double)hi)
        return TD_EINVAL;
    *out = (int64_t)v->valuedouble;
    return 0;
}

static int str_val(const cJSON *v, char *dst, size_t cap)
{
    if (!cJSON_IsString(v) || strlen(v->valuestring) >= cap || !v->valuestring[0]) return TD_EINVAL;
    snprintf(dst, cap, "%s", v->valuestring);
    return 0;
}

static int bool_val(const cJSON *v, bool *out)
{
    if (!cJSON_IsBool(v)) return TD_EINVAL;
    *out = cJSON_IsTrue(v);
    return 0;
}

#define KNOWN_KEYS                                                                              \
    "kv_role, kv_connector, protocol, transfer_mode, handshake_port, kv_ip, kv_port, "          \
    "kv_rank, kv_parallel_size, kv_buffer_device, kv_buffer_size, num_worker_threads, "         \
    "qp_per_transfer, lease_ms, transfer_timeout_ms, kv_load_failure_policy, "                  \
    "verify_checksums, proxy_ip, proxy_ping_port, http_port, auth_token, post_batch_size, "     \
    "max_send_wr, max_cqe_num, max_msg_sge, enable_notification, kv_connector_extra_config, "    \
    "rail_device, ib_device, matched_rails, rail_striping"

/* Integer keys: name, range, where to store, and the message for a bad value. */
typedef struct int_key {
    const char *name;
    int64_t lo, hi;
    size_t off;
    const char *msg;
} int_key;

#define OFF(f) offsetof(srv_kv_config, f)
static const int_key INT_KEYS[] = {
    {"handshake_port", 1, 65535, OFF(handshake_port), " must be an integer port in [1, 65535]"},
    {"kv_port", 1, 65535, OFF(port), " must be an integer port in [1, 65535]"},
    {"kv_rank", 0, 1 << 20, OFF(rank), " must be an integer >= 0"},
    {"kv_parallel_size", 1, 1 << 20, OFF(parallel_size), " must be an integer >= 1"},
    {"num_worker_threads", 1, 256, OFF(num_worker_threads), " must be an integer in [1, 256]"},
    {"qp_per_transfer", 1, 64, OFF(qp_per_transfer), " must be an integer in [1, 64]"},
    {"lease_ms", 100, 3600000, OFF(lease_ms), " must be an integer in [100, 3600000] (ms)"},
    {"transfer_timeout_ms", 10, 3600000, OFF(transfer_timeout_ms),
     " must be an integer in [10, 3600000] (ms)"},
    {"proxy_ping_port", 1, 65535, OFF(proxy_ping_port), " must be an integer port in [1, 65535]"},
    {"http_port", 1, 65535, OFF(http_port), " must be an integer port in [1, 65535]"},
    {"post_batch_size", -1, 1 << 20, OFF(post_batch_size), " must be an integer >= -1"},
    {"max_send_wr", 0, 1 << 24, OFF(max_send_wr), " must be an integer >= 0"},
    {"max_cqe_num", 0, 1 << 24, OFF(max_cqe_num), " must be an integer >= 0"},
    {"max_msg_sge", 0, 1 << 16, OFF(max_msg_sge), " must be an integer >= 0"},
};

int srv_kv_config_parse(srv_kv_config *c, const char *json, char *err, size_t cap)
{
    memset(c, 0, sizeof(*c));
    c->handshake_port = -1;
    c->port = -1;
    c->parallel_size = 1;
    c->num_worker_threads = 4;
    c->qp_per_transfer = 4;
    c->lease_ms = 30000;
    c->transfer_timeout_ms = 30000;
    c->recompute = true;
    c->verify_checksums = true;
    c->proxy_ping_port = c->http_port = -1;
    c->post_batch_size = c->max_send_wr = c->max_cqe_num = c->max_msg_sge = -1;
    c->enable_notification = -1;
    snprintf(c->connector, sizeof(c->connector), "tandem");
    bool mode_set = false;
    char why[160], msg[200];
    cJSON *root = td_json_parse_strict(json, strlen(json), why, sizeof(why));
    if (!root) {
        snprintf(msg, sizeof(msg), "is not valid JSON: %s", why);
        return fail(err, cap, msg, NULL);
    }
    int rc = 0;
    if (!cJSON_IsObject(root)) {
        rc = fail(err, cap, "must be a JSON object", NULL);
        goto out;
    }
    const cJSON *v;
    cJSON_ArrayForEach(v, root)
    {
        const char *k = v->string;
        int64_t i;
        const int_key *ik = NULL;
        for (size_t j = 0; j < sizeof(INT_KEYS) / sizeof(INT_KEYS[0]); j++)
            if (!strcmp(k, INT_KEYS[j].name)) ik = &INT_KEYS[j];
        if (ik) {
            if (int_val(v, ik->lo, ik->hi, &i)) {
                rc = fail(err, cap, ik->msg, k);
                goto out;
            }
            *(int *)((char *)c + ik->off) = (int)i;
        } else if (!strcmp(k, "kv_role")) {
            const char *s = cJSON_IsString(v) ? v->valuestring : "";
            if (!strcmp(s, "kv_producer"))
                c->role = SRV_KV_PRODUCER;
            else if (!strcmp(s, "kv_consumer"))
                c->role = SRV_KV_CONSUMER;
            else if (!strcmp(s, "kv_both"))
                c->role = SRV_KV_BOTH;
            else {
                rc = fail(err, cap, " must be kv_producer, kv_consumer or kv_both", k);
                goto out;
            }
        } else if (!strcmp(k, "kv_connector")) {
            if (str_val(v, c->connector, sizeof(c->connector)) ||
                (strcmp(c->connector, "tandem") && strcmp(c->connector, "mooncake") &&
                 strcmp(c->connector, "moriio"))) {
                rc = fail(err, cap,
                          " must be \"tandem\", or one of the aliases \"mooncake\" (push) and "
                          "\"moriio\" (pull)",
                          k);
                goto out;
            }
        } else if (!strcmp(k, "protocol")) {
            const char *s = cJSON_IsString(v) ? v->valuestring : "";
            if (!strcmp(s, "tcp"))
                c->protocol = SRV_KV_TCP;
            else if (!strcmp(s, "shm"))
                c->protocol = SRV_KV_SHM;
            else if (!strcmp(s, "ucx"))
                c->protocol = SRV_KV_UCX;
            else if (!strcmp(s, "cuda_ipc"))
                c->protocol = SRV_KV_CUDA_IPC;
            else {
                rc = fail(err, cap, " must be \"tcp\", \"shm\", \"ucx\" or \"cuda_ipc\"", k);
                goto out;
            }
        } else if (!strcmp(k, "transfer_mode")) {
            const char *s = cJSON_IsString(v) ? v->valuestring : "";
            if (strcmp(s, "read") && strcmp(s, "write")) {
                rc = fail(err, cap, " must be \"read\" (pull) or \"write\" (push)", k);
                goto out;
            }
            c->write_mode = !strcmp(s, "write");
            mode_set = true;
        } else if (!strcmp(k, "kv_load_failure_policy")) {
            const char *s = cJSON_IsString(v) ? v->valuestring : "";
            if (strcmp(s, "recompute") && strcmp(s, "fail")) {
                rc = fail(err, cap, " must be \"recompute\" or \"fail\"", k);
                goto out;
            }
            c->recompute = !strcmp(s, "recompute");
        } else if (!strcmp(k, "verify_checksums")) {
            if (bool_val(v, &c->verify_checksums)) {
                rc = fail(err, cap, " must be true or false", k);
                goto out;
            }
        } else if (!strcmp(k, "enable_notification")) {
            bool b;
            if (bool_val(v, &b)) {
                rc = fail(err, cap, " must be true or false", k);
                goto out;
            }
            c->enable_notification = b;
        } else if (!strcmp(k, "kv_ip") || !strcmp(k, "proxy_ip")) {
            char *dst = !strcmp(k, "kv_ip") ? c->ip : c->proxy_ip;
            if (str_val(v, dst, sizeof(c->ip))) {
                rc = fail(err, cap, " must be a non-empty string (a host or address)", k);
                goto out;
            }
        } else if (!strcmp(k, "rail_device") || !strcmp(k, "ib_device")) {
            if (str_val(v, c->rail_device, sizeof(c->rail_device)) || strchr(c->rail_device, ',')) {
                rc = fail(err, cap,
                          " must name one device (an RDMA device or a network interface), "
                          "not a list",
                          k);
                goto out;
            }
        } else if (!strcmp(k, "rail_striping")) {
            if (bool_val(v, &c->rail_striping)) {
                rc = fail(err, cap, " must be true or false", k);
                goto out;
            }
        } else if (!strcmp(k, "matched_rails")) {
            if (str_val(v, c->matched_rails, sizeof(c->matched_rails))) {
                rc = fail(err, cap, " must be \"auto\" or a comma-separated list of devices", k);
                goto out;
            }
        } else if (!strcmp(k, "auth_token")) {
            if (str_val(v, c->auth_token, sizeof(c->auth_token))) {
                rc = fail(err, cap, " must be a non-empty string of at most 255 bytes", k);
                goto out;
            }
        } else if (!strcmp(k, "kv_buffer_device")) {
            if (str_val(v, c->buffer_device, sizeof(c->buffer_device)) ||
                (strcmp(c->buffer_device, "cpu") && strcmp(c->buffer_device, "cuda"))) {
                rc = fail(err, cap, " must be \"cpu\" or \"cuda\"", k);
                goto out;
            }
        } else if (!strcmp(k, "kv_buffer_size")) {
            if (int_val(v, 0, INT64_MAX / 2, &i)) {
                rc = fail(err, cap, " must be a non-negative number of bytes", k);
                goto out;
            }
            c->buffer_size = (uint64_t)i;
        } else if (!strcmp(k, "kv_connector_extra_config")) {
            if (!cJSON_IsObject(v)) {
                rc = fail(err, cap, " must be an object", k);
                goto out;
            }
            cJSON_Delete(c->extra);
            c->extra = cJSON_Duplicate(v, 1);
        } else {
            rc = fail(err, cap, " is not a known key (" KNOWN_KEYS ")", k);
            goto out;
        }
    }
    if (c->role == SRV_KV_NONE) {
        rc = fail(err, cap, "'kv_role' is required", NULL);
    } else if (c->rank >= c->parallel_size) {
        rc = fail(err, cap, " must be less than kv_parallel_size", "kv_rank");
    } else if (c->protocol == SRV_KV_CUDA_IPC && !strcmp(c->buffer_device, "cpu")) {
        rc = fail(err, cap,
                  "'kv_buffer_device' must be cuda for protocol cuda_ipc (its KV lives in GPU "
                  "memory)",
                  NULL);
    } else if (!strcmp(c->buffer_device, "cuda") && c->protocol == SRV_KV_SHM) {
        rc = fail(err, cap, "'kv_buffer_device' cuda goes with protocol cuda_ipc, tcp or ucx",
                  NULL);
    } else if (c->protocol == SRV_KV_CUDA_IPC && c->write_mode && mode_set) {
        rc = fail(err, cap, "'transfer_mode' write is not served from GPU memory: protocol "
                  "cuda_ipc reads (transfer_mode read)", NULL);
    } else if (c->protocol == SRV_KV_CUDA_IPC) {
        c->write_mode = false; /* the consumer copies out of the producer's pool */
    } else if (!mode_set && !strcmp(c->connector, "mooncake")) {
        c->write_mode = true; /* mooncake means push semantics */
    } else if (!mode_set && !strcmp(c->connector, "moriio")) {
        c->write_mode = false; /* moriio means pull semantics */
    }
    if (!rc) {
        /* MORI-IO's RDMA queue settings have no counterpart in tcp or shm (nor in ucx,
         * which sizes its own queues): accepted, and the start-up log says so. */
        static const char *const mori[] = {"post_batch_size", "max_send_wr", "max_cqe_num",
                                           "max_msg_sge", "enable_notification"};
        for (int j = 0; j < 5; j++) {
            if (cJSON_GetObjectItemCaseSensitive(root, mori[j]) == NULL) continue;
            size_t n = strlen(c->notes);
            snprintf(c->notes + n, sizeof(c->notes) - n, "%s%s is ignored for protocol %s",
                     n ? "; " : "", mori[j], srv_kv_protocol_name(c->protocol));
        }
    }
out:
    cJSON_Delete(root);
    if (rc) srv_kv_config_free(c);
    return rc;
}

void srv_kv_config_free(srv_kv_config *c)
{
    cJSON_Delete(c->extra);
    c->extra = NULL;
    explicit_bzero(c->auth_token, sizeof(c->auth_token));
}

/* One setting that two variables may give (ours and the seed's alias): the value, NULL if
 * neither is set, or an error when they disagree. */
static int env_pair(const char *ours, const char *alias, const char **out, char *err, size_t cap)
{
    const char *a = getenv(ours), *b = getenv(alias);
    if (a && !a[0]) a = NULL;
    if (b && !b[0]) b = NULL;
    if (a && b && strcmp(a, b)) {
        snprintf(err, cap, "%s=%s and %s=%s disagree: set one of them", ours, a, alias, b);
        return TD_EINVAL;
    }
    *out = a ? a : b;
    return 0;
}

const char *srv_kv_host_ip(void)
{
    const char *v = getenv("TANDEM_HOST_IP");
    if (!v || !v[0]) v = getenv("ATOM_HOST_IP");
    return v && v[0] ? v : NULL;
}

/* TANDEM_RDMA_SL / TC (or MORI's): checked, and handed to UCX unless UCX's own are set. */
static int rdma_qos(char *err, size_t cap)
{
    static const struct {
        const char *ours, *alias, *ucx;
        long max;
    } q[] = {{"TANDEM_RDMA_SL", "MORI_RDMA_SL", "UCX_IB_SL", 15},
             {"TANDEM_RDMA_TC", "MORI_RDMA_TC", "UCX_IB_TRAFFIC_CLASS", 255}};
    for (int i = 0; i < 2; i++) {
        const char *v;
        if (env_pair(q[i].ours, q[i].alias, &v, err, cap)) return TD_EINVAL;
        if (!v) continue;
        char *end;
        long n = strtol(v, &end, 10);
        if (*end || end == v || n < 0 || n > q[i].max) {
            snprintf(err, cap, "%s=%s must be an integer in [0, %ld]", q[i].ours, v, q[i].max);
            return TD_EINVAL;
        }
        setenv(q[i].ucx, v, 0);
    }
    return 0;
}

int srv_kv_rails(srv_kv_config *c, char *err, size_t cap)
{
    kvx_rails *out = &c->rails;
    bool *matched = &c->rails_matched;
    memset(out, 0, sizeof(*out));
    *matched = false;
    if (rdma_qos(err, cap)) return TD_EINVAL;
    const char *spec, *dev, *allow;
    if (env_pair("TANDEM_MATCHED_RAILS", "ATOM_MOONCAKE_MATCHED_RAILS", &spec, err, cap) ||
        env_pair("TANDEM_RAIL_DEVICE", "ATOM_MOONCAKE_IB_DEVICE", &dev, err, cap) ||
        env_pair("TANDEM_RDMA_DEVICES", "MORI_RDMA_DEVICES", &allow, err, cap))
        return TD_EINVAL;
    if (c->matched_rails[0]) {
        if (spec && strcmp(spec, c->matched_rails)) {
            snprintf(err, cap, "matched_rails \"%s\" in the config and \"%s\" in the environment "
                     "disagree: set one of them", c->matched_rails, spec);
            return TD_EINVAL;
        }
        spec = c->matched_rails;
    }
    if (c->rail_device[0]) {
        if (dev && strcmp(dev, c->rail_device)) {
            snprintf(err, cap, "rail_device \"%s\" in the config and \"%s\" in the environment "
                     "disagree: set one of them", c->rail_device, dev);
            return TD_EINVAL;
        }
        dev = c->rail_device;
    }
    if (!spec && !dev) {
        if (!c->rail_striping) return 0;
        snprintf(err, cap, "rail_striping needs matched_rails and rail_device");
        return TD_EINVAL;
    }
    if (c->protocol != SRV_KV_TCP && c->protocol != SRV_KV_UCX) {
        snprintf(err, cap,
                 "rails (rail_device, matched_rails) are for transfers between hosts: they "
                 "need protocol tcp or ucx, not %s",
                 srv_kv_protocol_name(c->protocol));
        return TD_EINVAL;
    }
    const char *root = getenv("TANDEM_SYSFS_ROOT");
    if (!root || !root[0]) root = "/sys";
    td_err e = {0};
    if (spec) {
        if (kvx_rails_resolve(spec, dev, allow, root, out, &e)) {
            snprintf(err, cap, "matched rails: %s", e.msg);
            return TD_EINVAL;
        }
        *matched = true;
    } else if (c->rail_striping) {
        snprintf(err, cap, "rail_striping needs matched_rails (auto or a list)");
        return TD_EINVAL;
    } else {
        /* One device, not matched: it must exist and be up. */
        kvx_rail_kind kind;
        bool up = false;
        if (strchr(dev, ',')) {
            snprintf(err, cap, "rail_device must name one device, not the list \"%s\"", dev);
            return TD_EINVAL;
        }
        if (kvx_rail_state(root, dev, &kind, &up, &e)) {
            snprintf(err, cap, "rail_device: %s", e.msg);
            return TD_EINVAL;
        }
        if (!up) {
            snprintf(err, cap, "rail_device %s: its link is not up", dev);
            return TD_EINVAL;
        }
        out->n = 1;
        snprintf(out->name[0], sizeof(out->name[0]), "%s", dev);
        out->primary = 0;
        out->kind = kind;
    }
    if (out->kind == KVX_RAIL_RDMA && c->protocol != SRV_KV_UCX) {
        snprintf(err, cap,
                 "%s is an RDMA device: rails over RDMA devices need protocol ucx (tcp rails "
                 "are network interfaces)",
                 out->name[out->primary]);
        memset(out, 0, sizeof(*out));
        return TD_EINVAL;
    }
    return 0;
}
