/*
 * server/register.c - registration with a router. An engine whose kv-transfer config
 * names a router (proxy_ip, proxy_ping_port) POSTs its URL, role and engine id to the
 * router's /workers at start-up and then every REGISTER_PERIOD_S seconds; the router
 * evicts a worker whose heartbeats stop, and recognises a restarted engine by its new
 * engine id. The router being down is not an error here: the next beat tries again.
 */
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_impl.h"

#define REGISTER_PERIOD_S 5
#define FIRST_RETRY_MS 250 /* until the first registration succeeds (the router may be
                              starting at the same moment) */

struct srv__registrar {
    srv_server *s;
    struct evhttp_connection *conn;
    struct event *timer;
    char host[64];
    int port;
    char body[768];
    char auth[300]; /* "Bearer KEY" from TANDEM_ROUTER_API_KEY, or "" */
    bool busy, warned, registered;
};

static void on_answer(struct evhttp_request *req, void *arg)
{
    srv__registrar *g = arg;
    g->busy = false;
    int code = req ? evhttp_request_get_response_code(req) : 0;
    if (code == 200 || code == 201) {
        if (g->warned || code == 201)
            TD_INFO("registered with the router at %s:%d", g->host, g->port);
        g->warned = false;
        if (!g->registered) { /* from now on, a heartbeat every REGISTER_PERIOD_S */
            g->registered = true;
            struct timeval tv = {REGISTER_PERIOD_S, 0};
            event_del(g->timer);
            event_add(g->timer, &tv);
        }
        return;
    }
    if (!g->warned)
        TD_WARN("cannot register with the router at %s:%d (%s); retrying every %d s", g->host,
                g->port, code ? "it refused" : "no answer", REGISTER_PERIOD_S);
    g->warned = true;
}

static void beat(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    srv__registrar *g = arg;
    if (g->busy) return; /* the last one is still on its way */
    struct evhttp_request *req = evhttp_request_new(on_answer, g);
    if (!req) return;
    struct evkeyvalq *h = evhttp_request_get_output_headers(req);
    evhttp_add_header(h, "Host", g->host);
    evhttp_add_header(h, "Content-Type", "application/json");
    if (g->auth[0]) evhttp_add_header(h, "Authorization", g->auth);
    evbuffer_add(evhttp_request_get_output_buffer(req), g->body, strlen(g->body));
    /* Busy until on_answer, which evhttp_make_request may call before it returns (a
     * request it fails at once, out of descriptors): set before, so that it is not left
     * busy with no answer to come (and no heartbeat ever again). */
    g->busy = true;
    if (evhttp_make_request(g->conn, req, EVHTTP_REQ_POST, "/workers")) g->busy = false;
}

int srv__register_start(srv_server *s, const srv_kv_config *kv, td_err *err)
{
    if (!kv->proxy_ip[0] && kv->proxy_ping_port <= 0) return 0;
    if (!kv->proxy_ip[0] || kv->proxy_ping_port <= 0)
        return td_err_set(err, TD_EINVAL,
                          "--kv-transfer-config: proxy_ip and proxy_ping_port go together (the "
                          "router to register with)");
    srv__registrar *g = calloc(1, sizeof(*g));
    if (!g) return td_err_set(err, TD_ENOMEM, "out of memory");
    g->s = s;
    snprintf(g->host, sizeof(g->host), "%s", kv->proxy_ip);
    g->port = kv->proxy_ping_port;
    /* The address the router should use: kv_ip, else --host unless it is every interface. */
    const char *adv = kv->ip[0] ? kv->ip : s->cfg.host;
    if (!adv || !adv[0] || !strcmp(adv, "0.0.0.0") || !strcmp(adv, "::")) adv = "127.0.0.1";
    const char *role = kv->role == SRV_KV_PRODUCER ? "prefill" : "decode";
    snprintf(g->body, sizeof(g->body),
             "{\"url\":\"http://%s:%d\",\"role\":\"%s\",\"engine_id\":\"%s\",\"instance_id\":"
             "\"%s\",\"heartbeat\":true}",
             adv, kv->http_port > 0 ? kv->http_port : s->port, role,
             s->ranks[0].pd ? pd_engine_id(s->ranks[0].pd) : "", s->instance_id);
    const char *key = getenv("TANDEM_ROUTER_API_KEY"); /* a router started with --api-key */
    if (key && key[0] && strlen(key) < sizeof(g->auth) - 8 && !strpbrk(key, "\r\n"))
        snprintf(g->auth, sizeof(g->auth), "Bearer %s", key);
    g->conn = evhttp_connection_base_new(s->base, NULL, g->host, (unsigned short)g->port);
    g->timer = event_new(s->base, -1, EV_PERSIST, beat, g);
    if (!g->conn || !g->timer) {
        if (g->conn) evhttp_connection_free(g->conn);
        if (g->timer) event_free(g->timer);
        free(g);
        return td_err_set(err, TD_ENOMEM, "out of memory");
    }
    evhttp_connection_set_timeout(g->conn, 3);
    struct timeval tv = {0, FIRST_RETRY_MS * 1000};
    event_add(g->timer, &tv);
    s->registrar = g;
    beat(-1, 0, g); /* at once */
    TD_INFO("registering with the router at %s:%d as %s every %d s", g->host, g->port, role,
            REGISTER_PERIOD_S);
    return 0;
}

void srv__register_stop(srv_server *s)
{
    srv__registrar *g = s->registrar;
    if (!g) return;
    event_free(g->timer);
    evhttp_connection_free(g->conn); /* drops a beat in flight without its callback */
    free(g);
    s->registrar = NULL;
}
