/*
 * router/workers.c - the worker registry: who the workers are, whether they are alive
 * (active health checks), whether requests to them succeed (a circuit breaker per
 * worker), their load, their KV-transfer identity (/kv_transfer_info), and a pool of
 * keep-alive connections to each.
 */
#include <event2/buffer.h>
#include <event2/keyvalq_struct.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "router/rt_impl.h"

static const double LAT_BUCKETS[RT_LAT_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                   0.1,   0.25,   0.5,   1.0,  2.5,   10.0};

/* What a request of the router's own to a worker is. */
enum { CHECK_HEALTH, CHECK_INFO /* GET /kv_transfer_info */, CHECK_RELEASE /* POST /kv_release */ };

typedef struct rt_check {
    rt_router *r;
    rt_worker *w;
    struct evhttp_connection *conn;
    int kind; /* CHECK_* */
    /* inside evhttp_make_request, which fails some requests at once (no descriptor for the
     * socket) by calling on_check_done before it returns: send_check then ends the check */
    bool sending, failed_at_once;
    struct rt_check *next, *prev;
} check;

const char *rt_role_name(rt_role r)
{
    return r == RT_ROLE_PREFILL ? "prefill" : r == RT_ROLE_DECODE ? "decode" : "worker";
}

const char *rt_cb_name(rt_cb_state s)
{
    return s == RT_CB_OPEN ? "open" : s == RT_CB_HALF_OPEN ? "half_open" : "closed";
}

/* "http://host:port[/]" -> host, port. Only plain http: the engines speak nothing else. */
static int parse_url(const char *url, char *host, size_t cap, int *port, td_err *err)
{
    const char *p = url;
    if (strncmp(p, "http://", 7))
        return td_err_set(err, TD_EINVAL, "worker URL '%s' must start with http://", url);
    p += 7;
    const char *colon = strrchr(p, ':');
    const char *end = p + strlen(p);
    while (end > p && end[-1] == '/')
        end--;
    if (!colon || colon >= end || colon == p || (size_t)(colon - p) >= cap)
        return td_err_set(err, TD_EINVAL, "worker URL '%s' needs a host and a port", url);
    memcpy(host, p, (size_t)(colon - p));
    host[colon - p] = 0;
    for (const char *c = host; *c; c++) /* a host name, an IPv4 or a bracketed IPv6 address */
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '.' || *c == '-' || *c == '_' || *c == ':' || *c == '[' || *c == ']'))
            return td_err_set(err, TD_EINVAL, "worker URL '%.200s' has a bad host", url);
    char digits[8];
    size_t nd = (size_t)(end - colon - 1);
    if (nd == 0 || nd >= sizeof(digits))
        return td_err_set(err, TD_EINVAL, "worker URL '%s' has a bad port", url);
    memcpy(digits, colon + 1, nd);
    digits[nd] = 0;
    int64_t v;
    if (td_parse_i64(digits, &v) || v < 1 || v > 65535)
        return td_err_set(err, TD_EINVAL, "worker URL '%s' has a bad port", url);
    *port = (int)v;
    return 0;
}

int rt_url_check(const char *url, td_err *err)
{
    char host[200];
    int port;
    return parse_url(url, host, sizeof(host), &port, err);
}

int rt_worker_add(rt_router *r, const char *url, rt_role role, bool dynamic, rt_worker **out,
                  td_err *err)
{
    if (out) *out = NULL;
    rt_worker *w = calloc(1, sizeof(*w));
    if (!w) return td_err_set(err, TD_ENOMEM, "out of memory");
    int rc = parse_url(url, w->host, sizeof(w->host), &w->port, err);
    if (rc) {
        free(w);
        return rc;
    }
    snprintf(w->url, sizeof(w->url), "http://%s:%d", w->host, w->port);
    w->id = ++r->next_worker_id;
    w->role = role;
    w->healthy = true; /* until the checks say otherwise */
    w->reported_load = -1;
    w->external_load = -1;
    w->dp_rank = -1;
    w->dp_size = 1;
    w->dynamic = dynamic;
    w->last_seen_ns = td_now_ns();
    w->refs = 1; /* the registry's */
    rt_worker **pp = &r->workers;
    while (*pp)
        pp = &(*pp)->next;
    *pp = w;
    if (out) *out = w;
    return 0;
}

bool rt_url_same(const char *a, const char *b)
{
    char ha[200], hb[200];
    int pa, pb;
    td_err e;
    return !parse_url(a, ha, sizeof(ha), &pa, &e) && !parse_url(b, hb, sizeof(hb), &pb, &e) &&
           pa == pb && !strcasecmp(ha, hb);
}

rt_worker *rt_worker_find_url(rt_router *r, const char *url)
{
    char host[200];
    int port;
    td_err e;
    if (parse_url(url, host, sizeof(host), &port, &e)) return NULL;
    for (rt_worker *w = r->workers; w; w = w->next)
        if (w->port == port && !strcmp(w->host, host)) return w;
    return NULL;
}

rt_worker *rt_worker_find_id(rt_router *r, uint64_t id)
{
    for (rt_worker *w = r->workers; w; w = w->next)
        if (w->id == id) return w;
    return NULL;
}

void rt_worker_ref(rt_worker *w)
{
    w->refs++;
}

static void worker_free(rt_worker *w)
{
    for (int i = 0; i < w->n_idle; i++)
        evhttp_connection_free(w->idle[i]);
    free(w->idle);
    free(w);
}

void rt_worker_unref(rt_router *r, rt_worker *w)
{
    (void)r;
    if (--w->refs == 0) worker_free(w);
}

void rt_worker_remove(rt_router *r, rt_worker *w)
{
    for (rt_worker **pp = &r->workers; *pp; pp = &(*pp)->next)
        if (*pp == w) {
            *pp = w->next;
            break;
        }
    w->removed = true;
    w->next = NULL;
    rt_policy_forget(r->policy[w->role], w->id);
    rt_worker_unref(r, w);
}

void rt_workers_free(rt_router *r)
{
    /* Checks in flight: freeing their connection drops the request without a callback. */
    while (r->checks) {
        struct rt_check *c = r->checks;
        r->checks = c->next;
        evhttp_connection_free(c->conn);
        c->w->n_conns--;
        rt_worker_unref(r, c->w);
        free(c);
    }
    while (r->workers)
        rt_worker_remove(r, r->workers);
}

struct evhttp_connection *rt_conn_get(rt_router *r, rt_worker *w, double timeout_s)
{
    struct evhttp_connection *c = NULL;
    if (w->n_idle > 0) {
        c = w->idle[--w->n_idle];
    } else {
        c = evhttp_connection_base_new(r->base, NULL, w->host, (unsigned short)w->port);
        if (!c) return NULL;
        evhttp_connection_set_retries(c, 0);
        w->n_conns++;
    }
    struct timeval tv = {(time_t)timeout_s, (suseconds_t)((timeout_s - (double)(time_t)timeout_s) * 1e6)};
    evhttp_connection_set_timeout_tv(c, &tv);
    return c;
}

void rt_conn_put(rt_worker *w, struct evhttp_connection *c)
{
    if (w->removed || w->n_idle >= 1024) {
        evhttp_connection_free(c);
        w->n_conns--;
        return;
    }
    if (w->n_idle == w->cap_idle) {
        int cap = w->cap_idle ? 2 * w->cap_idle : 16;
        struct evhttp_connection **n = realloc(w->idle, (size_t)cap * sizeof(*n));
        if (!n) {
            evhttp_connection_free(c);
            w->n_conns--;
            return;
        }
        w->idle = n;
        w->cap_idle = cap;
    }
    w->idle[w->n_idle++] = c;
}

/* The breaker's view now: an open breaker turns half-open once its timeout passed. */
static rt_cb_state breaker(rt_router *r, rt_worker *w)
{
    if (w->cb == RT_CB_OPEN &&
        td_now_ns() - w->cb_opened_ns >= (uint64_t)(r->cfg.cb_timeout_s * 1e9)) {
        w->cb = RT_CB_HALF_OPEN;
        w->cb_ok = 0;
        r->breaker_transitions++;
        TD_INFO("router: %s %s breaker half-open", rt_role_name(w->role), w->url);
    }
    return w->cb;
}

static bool eligible(rt_router *r, rt_worker *w)
{
    if (!w->healthy || !w->reachable) return false;
    if (w->role != RT_ROLE_WORKER && r->cfg.pd && !w->info_ok) return false;
    if (!r->cfg.circuit_breaker) return true;
    rt_cb_state s = breaker(r, w);
    /* half-open: one trial request at a time */
    return s == RT_CB_CLOSED || (s == RT_CB_HALF_OPEN && w->in_flight == 0);
}

int rt_eligible(rt_router *r, rt_role role, rt_worker **out, int cap, const rt_worker *exclude)
{
    int n = 0;
    for (rt_worker *w = r->workers; w && n < cap; w = w->next)
        if (w->role == role && w != exclude && eligible(r, w)) out[n++] = w;
    return n;
}

rt_worker *rt_pick(rt_router *r, rt_role role, const char *text, size_t len,
                   const rt_worker *exclude)
{
    rt_worker *ws[RT_MAX_WORKERS];
    rt_candidate cs[RT_MAX_WORKERS];
    int n = rt_eligible(r, role, ws, RT_MAX_WORKERS, exclude);
    if (n == 0) return NULL;
    rt_policy_kind kinds[RT_N_ROLES] = {r->cfg.worker_policy, r->cfg.prefill_policy,
                                        r->cfg.decode_policy};
    /* A retry (exclude: the worker that failed) does not take round_robin's next turn: the
     * turns are the requests', and with one of two workers dead every request's first try
     * would land on the dead one. */
    if (exclude && kinds[role] == RT_POLICY_ROUND_ROBIN)
        return ws[td_rng_next(&r->rng) % (uint64_t)n];
    /* The ranks of a --dp-aware engine share its URL: each is named url@rank, so that the
     * policies that hash by name (prefix_hash's ring) tell them apart. */
    char names[RT_MAX_WORKERS][sizeof(ws[0]->url) + 16];
    for (int i = 0; i < n; i++) {
        const char *name = ws[i]->url;
        if (ws[i]->dp_rank >= 0) {
            snprintf(names[i], sizeof(names[i]), "%s@%d", ws[i]->url, ws[i]->dp_rank);
            name = names[i];
        }
        cs[i] = (rt_candidate){.worker_id = ws[i]->id,
                               .url = name,
                               .in_flight = ws[i]->in_flight,
                               .reported_load = ws[i]->external_load};
    }
    int k = rt_policy_pick(r->policy[role], cs, n, text, len);
    return ws[k >= 0 && k < n ? k : 0];
}

void rt_worker_result(rt_router *r, rt_worker *w, bool ok, double seconds)
{
    w->requests++;
    if (!ok) w->failures++;
    if (ok && seconds >= 0) {
        int b = 0;
        while (b < RT_LAT_BUCKETS && seconds > LAT_BUCKETS[b])
            b++;
        w->lat_hist[b]++;
        w->lat_sum += seconds;
    }
    if (!r->cfg.circuit_breaker) return;
    rt_cb_state s = breaker(r, w);
    if (ok) {
        w->cb_fail = 0;
        if (s == RT_CB_HALF_OPEN && ++w->cb_ok >= r->cfg.cb_success_threshold) {
            w->cb = RT_CB_CLOSED;
            r->breaker_transitions++;
            TD_INFO("router: %s %s breaker closed", rt_role_name(w->role), w->url);
        }
        return;
    }
    w->cb_ok = 0;
    if (s == RT_CB_HALF_OPEN || ++w->cb_fail >= r->cfg.cb_failure_threshold) {
        if (s != RT_CB_OPEN) {
            r->breaker_transitions++;
            TD_WARN("router: %s %s breaker open after %d failure(s)", rt_role_name(w->role),
                    w->url, s == RT_CB_HALF_OPEN ? 1 : w->cb_fail);
        }
        w->cb = RT_CB_OPEN;
        w->cb_opened_ns = td_now_ns();
        w->cb_fail = 0;
    }
}

/* ---------------------------------------------------------------- health checks */

static void check_unlink(check *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        c->r->checks = c->next;
    if (c->next) c->next->prev = c->prev;
}

static void health_mark(rt_router *r, rt_worker *w, bool ok, const char *why)
{
    if (ok) {
        w->health_fail = 0;
        if (!w->healthy && ++w->health_ok >= r->cfg.health_success_threshold) {
            w->healthy = true;
            TD_INFO("router: %s %s is healthy again", rt_role_name(w->role), w->url);
        }
        return;
    }
    w->health_ok = 0;
    if (w->healthy && ++w->health_fail >= r->cfg.health_failure_threshold) {
        w->healthy = false;
        TD_WARN("router: %s %s is unhealthy: %s", rt_role_name(w->role), w->url, why);
    }
}

/* v is a JSON number holding an integer in [lo, hi]: *out = it. */
static bool json_int(const cJSON *v, double lo, double hi, int *out)
{
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
        v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo || v->valuedouble > hi)
        return false;
    *out = (int)v->valuedouble;
    return true;
}

/* A handshake port as an engine reports it: a port, or absent/null (none, 0). */
static bool json_port(const cJSON *v, int *out)
{
    *out = 0;
    return !v || cJSON_IsNull(v) || json_int(v, 1, 65535, out);
}

static cJSON *body_json(struct evhttp_request *req)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t n = evbuffer_get_length(in);
    if (n == 0 || n > (1u << 20)) return NULL;
    char *s = malloc(n + 1);
    if (!s) return NULL;
    evbuffer_remove(in, s, n);
    s[n] = 0;
    cJSON *j = cJSON_Parse(s);
    free(s);
    return j;
}

/* A data-parallel rank's own transfer agent, where the engine lists them (`dp_ranks`, one
 * agent per rank): the push (write) mode's decode leg must name the agent of the rank
 * that runs the prefill. Engines that list none keep the top-level agent. */
static const cJSON *rank_entry(const cJSON *j, int rank)
{
    const cJSON *ranks = cJSON_GetObjectItemCaseSensitive(j, "dp_ranks"), *a;
    cJSON_ArrayForEach(a, ranks)
    {
        int k;
        if (json_int(cJSON_GetObjectItemCaseSensitive(a, "rank"), 0, 255, &k) && k == rank)
            return a;
    }
    return NULL;
}

/* A rank's own agent, where the engine lists one; false if its port is not a port. */
static bool rank_agent(rt_worker *w, const cJSON *j)
{
    const cJSON *a = rank_entry(j, w->dp_rank);
    if (a) {
        const cJSON *port = cJSON_GetObjectItemCaseSensitive(a, "handshake_port");
        const cJSON *host = cJSON_GetObjectItemCaseSensitive(a, "kv_host");
        const cJSON *eid = cJSON_GetObjectItemCaseSensitive(a, "engine_id");
        int p;
        if (port && !cJSON_IsNull(port)) {
            if (!json_port(port, &p)) return false;
            w->kv_port = p;
        }
        if (cJSON_IsString(host)) snprintf(w->kv_host, sizeof(w->kv_host), "%s", host->valuestring);
        if (cJSON_IsString(eid))
            snprintf(w->engine_id, sizeof(w->engine_id), "%s", eid->valuestring);
    }
    return true;
}

/* Refuse a worker whose report the router cannot use (kr: the kv_role it reported),
 * logged when it was ready before or reports another role. */
static void info_refuse(rt_worker *w, const char *kr, const char *why)
{
    if (w->info_ok || !w->kv_role[0] || strcmp(w->kv_role, kr))
        TD_ERROR("router: refusing %s %s: %s", rt_role_name(w->role), w->url, why);
    snprintf(w->kv_role, sizeof(w->kv_role), "%s", kr);
    w->info_ok = false;
}

bool rt_worker_health_apply(rt_worker *w, const cJSON *j)
{
    const cJSON *inst = cJSON_GetObjectItemCaseSensitive(j, "instance_id");
    bool restarted = false;
    if (cJSON_IsString(inst) && strlen(inst->valuestring) < sizeof(w->instance)) {
        restarted = w->instance[0] && strcmp(w->instance, inst->valuestring) != 0;
        snprintf(w->instance, sizeof(w->instance), "%s", inst->valuestring);
    }
    int load;
    /* A data-parallel rank's own load where the engine reports it per rank: its total
     * would make every rank look as busy as the busiest. */
    const cJSON *ranks = cJSON_GetObjectItemCaseSensitive(j, "rank_loads");
    const cJSON *mine = w->dp_rank >= 0 && cJSON_IsArray(ranks)
                            ? cJSON_GetArrayItem(ranks, w->dp_rank)
                            : cJSON_GetObjectItemCaseSensitive(j, "load");
    if (json_int(mine, 0, INT_MAX, &load)) {
        /* The report counts this router's own requests too; the policies add in_flight
         * themselves, so keep only what others put there. */
        w->reported_load = load;
        w->external_load = TD_MAX(w->reported_load - w->in_flight, 0);
    }
    return restarted;
}

void rt_worker_info_apply(rt_router *r, rt_worker *w, const cJSON *j)
{
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(j, "kv_role");
    const cJSON *eid = cJSON_GetObjectItemCaseSensitive(j, "engine_id");
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(j, "kv_host");
    const cJSON *port = cJSON_GetObjectItemCaseSensitive(j, "handshake_port");
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(j, "transfer_mode");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    const cJSON *dp = cJSON_GetObjectItemCaseSensitive(j, "dp_size");
    if (cJSON_IsString(model)) snprintf(w->model, sizeof(w->model), "%s", model->valuestring);
    const char *kr = cJSON_IsString(role) ? role->valuestring : "none";
    bool match = w->role == RT_ROLE_WORKER ||
                 (w->role == RT_ROLE_PREFILL &&
                  (!strcmp(kr, "kv_producer") || !strcmp(kr, "kv_both"))) ||
                 (w->role == RT_ROLE_DECODE &&
                  (!strcmp(kr, "kv_consumer") || !strcmp(kr, "kv_both")));
    if (!match) {
        char why[96];
        snprintf(why, sizeof(why), "its kv_role is %.64s", kr);
        return info_refuse(w, kr, why);
    }
    int kv_port;
    if (!json_port(port, &kv_port))
        return info_refuse(w, kr, "its /kv_transfer_info has a handshake_port that is not a port");
    char new_id[40] = "";
    const cJSON *mine = w->dp_rank > 0 ? rank_entry(j, w->dp_rank) : NULL; /* a rank's own agent */
    if (mine) eid = cJSON_GetObjectItemCaseSensitive(mine, "engine_id");
    if (cJSON_IsString(eid)) snprintf(new_id, sizeof(new_id), "%s", eid->valuestring);
    if (w->info_ok && w->engine_id[0] && strcmp(w->engine_id, new_id))
        TD_INFO("router: %s %s restarted (engine %s, was %s)", rt_role_name(w->role), w->url,
                new_id, w->engine_id);
    snprintf(w->engine_id, sizeof(w->engine_id), "%s", new_id);
    snprintf(w->kv_role, sizeof(w->kv_role), "%s", kr);
    snprintf(w->kv_host, sizeof(w->kv_host), "%s",
             cJSON_IsString(host) ? host->valuestring : w->host);
    w->kv_port = kv_port;
    w->write_mode = cJSON_IsString(mode) && !strcmp(mode->valuestring, "write");
    /* The instance this report describes: a later /health from another one is a restart
     * (rt_worker_health_apply), even when no health check ran in between. */
    const cJSON *inst = cJSON_GetObjectItemCaseSensitive(j, "instance_id");
    if (cJSON_IsString(inst) && strlen(inst->valuestring) < sizeof(w->instance))
        snprintf(w->instance, sizeof(w->instance), "%s", inst->valuestring);
    if (w->dp_rank > 0 && !rank_agent(w, j))
        return info_refuse(w, kr,
                           "its /kv_transfer_info has a rank whose handshake_port is not a port");
    if (!w->info_ok)
        TD_INFO("router: %s %s ready (%s, engine %s%s)", rt_role_name(w->role), w->url, kr,
                w->engine_id[0] ? w->engine_id : "-", w->write_mode ? ", write mode" : "");
    w->info_ok = true;
    int dp_size = cJSON_IsNumber(dp) && dp->valuedouble >= 1 && dp->valuedouble <= 256
                      ? (int)dp->valuedouble
                      : 1;
    if (r->cfg.dp_aware && dp_size > 1 && w->dp_rank < 0) {
        /* One worker per data-parallel rank: this one is rank 0, the others join it. */
        w->dp_rank = 0;
        w->dp_size = dp_size;
        TD_INFO("router: %s %s has %d data-parallel ranks: one worker each",
                rt_role_name(w->role), w->url, dp_size);
        for (int k = 1; k < dp_size; k++) {
            rt_worker *s;
            td_err e;
            if (rt_worker_add(r, w->url, w->role, w->dynamic, &s, &e)) break;
            s->dp_rank = k;
            s->dp_size = dp_size;
            s->info_ok = true;
            s->reachable = true;
            memcpy(s->engine_id, w->engine_id, sizeof(s->engine_id));
            memcpy(s->kv_host, w->kv_host, sizeof(s->kv_host));
            memcpy(s->kv_role, w->kv_role, sizeof(s->kv_role));
            memcpy(s->model, w->model, sizeof(s->model));
            s->kv_port = w->kv_port;
            s->write_mode = w->write_mode;
            rank_agent(s, j);
        }
    }
}

/* A check's end: its answer (req; NULL if it was never sent) applied, then the check
 * unlinked and freed. */
static void check_end(check *c, struct evhttp_request *req, bool sent)
{
    rt_router *r = c->r;
    rt_worker *w = c->w;
    int code = req ? evhttp_request_get_response_code(req) : 0;
    if (!sent) { /* the router's own failure (out of descriptors): no verdict on w */
        if (c->kind == CHECK_HEALTH) w->check_in_flight = false;
        goto out;
    }
    if (code > 0 && !w->reachable) {
        w->reachable = true;
        TD_INFO("router: %s %s answers", rt_role_name(w->role), w->url);
    }
    if (c->kind == CHECK_RELEASE) {
        /* 404: the consumer had released it already, or the lease had expired */
        if (code == 200) r->kv_releases++;
        TD_INFO("router: POST %s/kv_release answered %d", w->url, code);
    } else if (c->kind == CHECK_HEALTH) {
        w->check_in_flight = false;
    }
    if (!w->removed && c->kind != CHECK_RELEASE) {
        if (c->kind == CHECK_INFO) {
            cJSON *j = code == 200 ? body_json(req) : NULL;
            if (j) rt_worker_info_apply(r, w, j);
            cJSON_Delete(j);
        } else {
            cJSON *j = code == 200 || code == 503 ? body_json(req) : NULL;
            const cJSON *st = cJSON_GetObjectItemCaseSensitive(j, "status");
            bool draining =
                code == 503 && cJSON_IsString(st) && !strcmp(st->valuestring, "draining");
            /* A --dp-aware rank is healthy while its own rank serves, though another rank
             * of its engine has stopped (the engine's /health is then a 503 for all). */
            bool ok = code == 200;
            if (code == 503 && !draining && w->dp_rank >= 0) {
                const cJSON *rs = cJSON_GetObjectItemCaseSensitive(j, "rank_status");
                const cJSON *mine = cJSON_IsArray(rs) ? cJSON_GetArrayItem(rs, w->dp_rank) : NULL;
                ok = cJSON_IsString(mine) && !strcmp(mine->valuestring, "ok");
            }
            bool restarted = ok && rt_worker_health_apply(w, j);
            cJSON_Delete(j);
            if (restarted) {
                /* A new process: what the breaker and the checks learnt of the old one says
                 * nothing of it, and its transfer agent (port, engine id) is another one:
                 * ineligible until its /kv_transfer_info is read again. */
                TD_INFO("router: %s %s restarted (a new instance at the same URL): reading its "
                        "/kv_transfer_info again",
                        rt_role_name(w->role), w->url);
                rt_worker_reincarnated(r, w);
            }
            char why[64];
            snprintf(why, sizeof(why), code ? "/health answered %d" : "no answer", code);
            /* An engine shutting down takes no new requests: out at once, not after
             * --health-failure-threshold checks (its own answers would be 503s meanwhile). */
            if (draining && w->healthy) {
                w->health_fail = r->cfg.health_failure_threshold - 1;
                snprintf(why, sizeof(why), "it is shutting down (draining)");
            }
            health_mark(r, w, ok, why);
            /* A worker that answers but whose identity is unknown (or may have changed
             * after a restart): read /kv_transfer_info again. */
            if (ok && (!w->info_ok || !w->model[0]) && !w->removed) rt_worker_probe(r, w);
        }
    }
out:
    check_unlink(c);
    rt_conn_put(w, c->conn);
    rt_worker_unref(r, w);
    free(c);
}

static void on_check_done(struct evhttp_request *req, void *arg)
{
    check *c = arg;
    if (c->sending) { /* failed inside evhttp_make_request: send_check ends it */
        c->failed_at_once = true;
        return;
    }
    check_end(c, req, true);
}

/* One request of the router's own to w (a health check, an info read, a KV release): a
 * GET, or a POST of a JSON body; its answer goes to on_check_done. */
static void send_check(rt_router *r, rt_worker *w, int kind, const char *path, const char *body)
{
    check *c = calloc(1, sizeof(*c));
    if (!c) return;
    c->r = r;
    c->w = w;
    c->kind = kind;
    c->conn = rt_conn_get(r, w, r->cfg.health_timeout_s);
    if (!c->conn) {
        free(c);
        return;
    }
    struct evhttp_request *req = evhttp_request_new(on_check_done, c);
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Host", w->host);
    if (body) {
        evhttp_add_header(h, "Content-Type", "application/json");
        evbuffer_add(evhttp_request_get_output_buffer(req), body, strlen(body));
    }
    rt_worker_ref(w);
    if (kind == CHECK_HEALTH) w->check_in_flight = true;
    c->next = r->checks;
    if (r->checks) r->checks->prev = c;
    r->checks = c;
    c->sending = true;
    int rc = evhttp_make_request(c->conn, req, body ? EVHTTP_REQ_POST : EVHTTP_REQ_GET, path);
    c->sending = false;
    if (rc || c->failed_at_once) check_end(c, NULL, false); /* libevent freed req */
}

void rt_worker_release_kv(rt_router *r, const char *url, const char *transfer_id)
{
    rt_worker *w = rt_worker_find_url(r, url);
    if (!w) return; /* gone: its lease expires by itself */
    char body[128];
    snprintf(body, sizeof(body), "{\"transfer_id\":\"%.64s\"}", transfer_id);
    send_check(r, w, CHECK_RELEASE, "/kv_release", body);
}

void rt_worker_reincarnated(rt_router *r, rt_worker *w)
{
    w->info_ok = false;
    w->engine_id[0] = 0;
    w->healthy = true;
    w->health_fail = w->health_ok = 0;
    w->cb = RT_CB_CLOSED;
    w->cb_fail = w->cb_ok = 0;
    rt_worker_probe(r, w);
}

void rt_worker_probe(rt_router *r, rt_worker *w)
{
    send_check(r, w, CHECK_INFO, "/kv_transfer_info", NULL);
}

static void on_health_timer(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    rt_router *r = arg;
    uint64_t now = td_now_ns();
    for (rt_worker *w = r->workers, *next; w; w = next) {
        next = w->next;
        if (w->dynamic && now - w->last_seen_ns > (uint64_t)(r->cfg.worker_ttl_s * 1e9)) {
            TD_WARN("router: evicting %s %s: no heartbeat for %.0f s", rt_role_name(w->role),
                    w->url, r->cfg.worker_ttl_s);
            r->evictions++;
            rt_worker_remove(r, w);
            continue;
        }
        if (r->cfg.health_checks && !w->check_in_flight)
            send_check(r, w, CHECK_HEALTH, r->cfg.health_endpoint, NULL);
        else if (!r->cfg.health_checks && !w->info_ok)
            rt_worker_probe(r, w);
    }
}

/*
 * Discovery: a worker not known yet (its engine was still starting at the first probe, or
 * it refused its role) is probed again soon, then less and less often, rather than only at
 * the next health check (10 s by default), so that a cluster started in any order serves
 * as soon as its engines are up.
 */
#define DISCOVERY_TICK_S 0.25

static void on_discovery_timer(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    rt_router *r = arg;
    uint64_t now = td_now_ns();
    for (rt_worker *w = r->workers; w; w = w->next) {
        if (w->info_ok) {
            w->probe_gap_s = 0;
            continue;
        }
        if (w->removed || now < w->next_probe_ns) continue;
        w->probe_gap_s = w->probe_gap_s > 0 ? w->probe_gap_s * 2 : DISCOVERY_TICK_S;
        if (w->probe_gap_s > r->cfg.health_interval_s) w->probe_gap_s = r->cfg.health_interval_s;
        w->next_probe_ns = now + (uint64_t)(w->probe_gap_s * 1e9);
        rt_worker_probe(r, w);
    }
}

void rt_health_start(rt_router *r)
{
    for (rt_worker *w = r->workers; w; w = w->next)
        rt_worker_probe(r, w);
    r->discovery_timer = event_new(r->base, -1, EV_PERSIST, on_discovery_timer, r);
    struct timeval dtv = {0, (suseconds_t)(DISCOVERY_TICK_S * 1e6)};
    event_add(r->discovery_timer, &dtv);
    double iv = r->cfg.health_interval_s;
    /* Dynamic workers are evicted on this timer too: run it often enough for the TTL. */
    if (iv > r->cfg.worker_ttl_s / 3) iv = r->cfg.worker_ttl_s / 3;
    if (iv < 0.05) iv = 0.05;
    r->health_timer = event_new(r->base, -1, EV_PERSIST, on_health_timer, r);
    struct timeval tv = {(time_t)iv, (suseconds_t)((iv - (double)(time_t)iv) * 1e6)};
    event_add(r->health_timer, &tv);
}

/* ---------------------------------------------------------------- introspection */

cJSON *rt_workers_json(rt_router *r)
{
    cJSON *arr = cJSON_CreateArray();
    for (rt_worker *w = r->workers; w; w = w->next) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "id", (double)w->id);
        cJSON_AddStringToObject(o, "url", w->url);
        cJSON_AddStringToObject(o, "role", rt_role_name(w->role));
        if (w->dp_rank >= 0) { /* a data-parallel rank of its engine: routable as url@rank */
            char name[sizeof(w->url) + 16];
            snprintf(name, sizeof(name), "%s@%d", w->url, w->dp_rank);
            cJSON_AddStringToObject(o, "name", name);
            cJSON_AddNumberToObject(o, "dp_rank", w->dp_rank);
        }
        cJSON_AddBoolToObject(o, "healthy", w->healthy);
        cJSON_AddBoolToObject(o, "reachable", w->reachable);
        cJSON_AddStringToObject(o, "circuit_breaker",
                                r->cfg.circuit_breaker ? rt_cb_name(breaker(r, w)) : "disabled");
        cJSON_AddNumberToObject(o, "in_flight", w->in_flight);
        cJSON_AddNumberToObject(o, "load", w->reported_load);
        if (w->role != RT_ROLE_WORKER) {
            cJSON_AddBoolToObject(o, "ready", w->info_ok);
            cJSON_AddStringToObject(o, "kv_role", w->kv_role);
            cJSON_AddStringToObject(o, "engine_id", w->engine_id);
            cJSON_AddStringToObject(o, "transfer_mode", w->write_mode ? "write" : "read");
        }
        cJSON_AddBoolToObject(o, "dynamic", w->dynamic);
        cJSON_AddNumberToObject(o, "requests", (double)w->requests);
        cJSON_AddNumberToObject(o, "failures", (double)w->failures);
        cJSON_AddItemToArray(arr, o);
    }
    return arr;
}

/* A worker's labels: its URL escaped as a label value, and its data-parallel rank where
 * it is one rank of an engine (--dp-aware: the ranks share a URL, and one series each). */
static const char *lbl(const rt_worker *w, char out[600])
{
    char url[400];
    td_prom_escape(w->url, url, sizeof(url));
    if (w->dp_rank >= 0 && w->dp_size > 1)
        snprintf(out, 600, "worker=\"%s\",dp_rank=\"%d\"", url, w->dp_rank);
    else
        snprintf(out, 600, "worker=\"%s\"", url);
    return out;
}

void rt_workers_metrics(rt_router *r, struct evbuffer *b)
{
    char L[600];
    evbuffer_add_printf(b, "# HELP tandem_router_worker_healthy 1 if the worker passes its "
                           "health checks.\n# TYPE tandem_router_worker_healthy gauge\n");
    for (rt_worker *w = r->workers; w; w = w->next)
        evbuffer_add_printf(b, "tandem_router_worker_healthy{%s,role=\"%s\"} %d\n", lbl(w, L),
                            rt_role_name(w->role), w->healthy ? 1 : 0);
    evbuffer_add_printf(b, "# HELP tandem_router_worker_breaker_open 1 while the worker's "
                           "circuit breaker is open, 0.5 half-open.\n"
                           "# TYPE tandem_router_worker_breaker_open gauge\n");
    for (rt_worker *w = r->workers; w; w = w->next)
        evbuffer_add_printf(b, "tandem_router_worker_breaker_open{%s} %g\n", lbl(w, L),
                            w->cb == RT_CB_OPEN        ? 1.0
                            : w->cb == RT_CB_HALF_OPEN ? 0.5
                                                       : 0.0);
    evbuffer_add_printf(b, "# HELP tandem_router_worker_in_flight Requests in flight to the "
                           "worker.\n# TYPE tandem_router_worker_in_flight gauge\n");
    for (rt_worker *w = r->workers; w; w = w->next)
        evbuffer_add_printf(b, "tandem_router_worker_in_flight{%s} %d\n", lbl(w, L), w->in_flight);
    evbuffer_add_printf(b, "# HELP tandem_router_worker_requests_total Requests relayed to the "
                           "worker.\n# TYPE tandem_router_worker_requests_total counter\n");
    for (rt_worker *w = r->workers; w; w = w->next)
        evbuffer_add_printf(b, "tandem_router_worker_requests_total{%s} %llu\n", lbl(w, L),
                            (unsigned long long)w->requests);
    evbuffer_add_printf(b, "# HELP tandem_router_worker_failures_total Relayed requests that "
                           "failed (connection, timeout, 5xx).\n"
                           "# TYPE tandem_router_worker_failures_total counter\n");
    for (rt_worker *w = r->workers; w; w = w->next)
        evbuffer_add_printf(b, "tandem_router_worker_failures_total{%s} %llu\n", lbl(w, L),
                            (unsigned long long)w->failures);
    evbuffer_add_printf(b, "# HELP tandem_router_worker_latency_seconds Time from relaying a "
                           "request to the end of the worker's answer.\n"
                           "# TYPE tandem_router_worker_latency_seconds histogram\n");
    for (rt_worker *w = r->workers; w; w = w->next) {
        uint64_t cum = 0;
        for (int i = 0; i < RT_LAT_BUCKETS; i++) {
            cum += w->lat_hist[i];
            evbuffer_add_printf(b,
                                "tandem_router_worker_latency_seconds_bucket{%s,"
                                "le=\"%g\"} %llu\n",
                                lbl(w, L), LAT_BUCKETS[i], (unsigned long long)cum);
        }
        cum += w->lat_hist[RT_LAT_BUCKETS];
        evbuffer_add_printf(b,
                            "tandem_router_worker_latency_seconds_bucket{%s,le=\"+Inf\"} "
                            "%llu\ntandem_router_worker_latency_seconds_sum{%s} %.6f\n"
                            "tandem_router_worker_latency_seconds_count{%s} %llu\n",
                            lbl(w, L), (unsigned long long)cum, lbl(w, L), w->lat_sum, lbl(w, L),
                            (unsigned long long)cum);
    }
}
