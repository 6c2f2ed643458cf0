/*
 * server/kvconfig.c - --kv-transfer-config, validated at start-up. The engine does not
 * use it yet (the transfer engine is a later issue), but a typo in a recipe must fail
 * now rather than be silently ignored, so unknown keys and bad values are errors and
 * kv_role has no default.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

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

int srv_kv_config_parse(srv_kv_config *c, const char *json, char *err, size_t cap)
{
    memset(c, 0, sizeof(*c));
    c->handshake_port = -1;
    c->port = -1;
    c->parallel_size = 1;
    cJSON *root = cJSON_Parse(json);
    if (!root) return fail(err, cap, "is not valid JSON", NULL);
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
        if (!strcmp(k, "kv_role")) {
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
            if (str_val(v, c->connector, sizeof(c->connector))) {
                rc = fail(err, cap, " must be a non-empty string", k);
                goto out;
            }
        } else if (!strcmp(k, "handshake_port") || !strcmp(k, "kv_port")) {
            if (int_val(v, 1, 65535, &i)) {
                rc = fail(err, cap, " must be an integer port in [1, 65535]", k);
                goto out;
            }
            if (!strcmp(k, "kv_port"))
                c->port = (int)i;
            else
                c->handshake_port = (int)i;
        } else if (!strcmp(k, "kv_ip")) {
            if (str_val(v, c->ip, sizeof(c->ip))) {
                rc = fail(err, cap, " must be a non-empty string (a host or address)", k);
                goto out;
            }
        } else if (!strcmp(k, "kv_rank")) {
            if (int_val(v, 0, 1 << 20, &i)) {
                rc = fail(err, cap, " must be an integer >= 0", k);
                goto out;
            }
            c->rank = (int)i;
        } else if (!strcmp(k, "kv_parallel_size")) {
            if (int_val(v, 1, 1 << 20, &i)) {
                rc = fail(err, cap, " must be an integer >= 1", k);
                goto out;
            }
            c->parallel_size = (int)i;
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
            rc = fail(err, cap,
                      " is not a known key (kv_role, kv_connector, handshake_port, "
                      "kv_ip, kv_port, kv_rank, kv_parallel_size, kv_buffer_device, "
                      "kv_buffer_size, kv_connector_extra_config)",
                      k);
            goto out;
        }
    }
    if (c->role == SRV_KV_NONE)
        rc = fail(err, cap, "'kv_role' is required", NULL);
    else if (c->rank >= c->parallel_size)
        rc = fail(err, cap, " must be less than kv_parallel_size", "kv_rank");
out:
    cJSON_Delete(root);
    if (rc) srv_kv_config_free(c);
    return rc;
}

void srv_kv_config_free(srv_kv_config *c)
{
    cJSON_Delete(c->extra);
    c->extra = NULL;
}
