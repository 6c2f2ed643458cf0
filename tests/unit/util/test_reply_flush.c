/*
 * util/reply_flush: a reply queued with evhttp just before the loop ends reaches a client
 * that reads it whole once td_replies_flush has run (a real listener and a client thread on
 * loopback); a client that stops reading holds the exit no longer than the bound.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/reply_flush.h"
#include "util/td.h"

typedef struct server {
    struct event_base *base;
    struct evhttp *http;
    td_replies replies;
    size_t body_len;
    int port;
} server;

/* Answer with body_len bytes, then end the loop at once, as a drained server does. */
static void on_request(struct evhttp_request *req, void *arg)
{
    server *s = arg;
    struct evbuffer *b = evbuffer_new();
    char *chunk = malloc(1 << 16);
    memset(chunk, 'x', 1 << 16);
    for (size_t n = 0; n < s->body_len; n += 1 << 16)
        evbuffer_add(b, chunk, TD_MIN((size_t)1 << 16, s->body_len - n));
    free(chunk);
    td_replies_track(&s->replies, req);
    evhttp_send_reply(req, 200, "OK", b);
    evbuffer_free(b);
    event_base_loopexit(s->base, NULL);
}

static void server_start(server *s, size_t body_len)
{
    memset(s, 0, sizeof(*s));
    s->body_len = body_len;
    s->base = event_base_new();
    s->http = evhttp_new(s->base);
    assert_non_null(s->http);
    evhttp_set_gencb(s->http, on_request, s);
    struct evhttp_bound_socket *sock = evhttp_bind_socket_with_handle(s->http, "127.0.0.1", 0);
    assert_non_null(sock);
    struct sockaddr_in a;
    socklen_t len = sizeof(a);
    assert_int_equal(getsockname(evhttp_bound_socket_get_fd(sock), (struct sockaddr *)&a, &len), 0);
    s->port = ntohs(a.sin_port);
}

typedef struct client {
    int port;
    int read_body; /* 0: send the request and never read */
    volatile int stop;
    size_t got;    /* bytes of the answer read, headers included */
    size_t header; /* where the body starts */
} client;

static void *client_main(void *arg)
{
    client *c = arg;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)c->port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) return NULL;
    const char *rq = "GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    if (write(fd, rq, strlen(rq)) != (ssize_t)strlen(rq)) return NULL;
    if (!c->read_body) {
        while (!c->stop)
            usleep(10000);
        close(fd);
        return NULL;
    }
    char buf[1 << 16], head[4] = {0};
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) {
        for (ssize_t i = 0; i < n && !c->header; i++) { /* the end of the headers */
            memmove(head, head + 1, 3);
            head[3] = buf[i];
            if (!memcmp(head, "\r\n\r\n", 4)) c->header = c->got + (size_t)i + 1;
        }
        c->got += (size_t)n;
    }
    close(fd);
    return NULL;
}

static void test_tail_reaches_a_reading_client(void **state)
{
    (void)state;
    server s;
    const size_t body = 32u << 20; /* far more than the socket buffers: not written in one pass */
    server_start(&s, body);
    client c = {.port = s.port, .read_body = 1};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, client_main, &c), 0);
    event_base_dispatch(s.base); /* until the answer is queued */
    assert_int_equal(td_replies_flush(s.base, &s.replies, 10000), 0);
    assert_int_equal(s.replies.unsent, 0);
    evhttp_free(s.http);
    pthread_join(t, NULL);
    assert_true(c.header > 0);
    assert_int_equal(c.got - c.header, body);
    event_base_free(s.base);
}

static void test_a_stalled_client_holds_the_exit_no_longer_than_the_bound(void **state)
{
    (void)state;
    server s;
    server_start(&s, 64u << 20);
    client c = {.port = s.port, .read_body = 0};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, client_main, &c), 0);
    event_base_dispatch(s.base);
    uint64_t t0 = td_now_ns();
    assert_int_equal(td_replies_flush(s.base, &s.replies, 300), 1);
    double ms = (double)(td_now_ns() - t0) / 1e6;
    assert_true(ms >= 290.0); /* it waited its bound, and returned (else ctest's timeout) */
    evhttp_free(s.http);      /* cuts the stalled connection */
    c.stop = 1;
    pthread_join(t, NULL);
    event_base_free(s.base);
}

static void test_nothing_queued_returns_at_once(void **state)
{
    (void)state;
    struct event_base *base = event_base_new();
    td_replies r = {0};
    uint64_t t0 = td_now_ns();
    assert_int_equal(td_replies_flush(base, &r, 5000), 0);
    assert_true(td_now_ns() - t0 < 1000000000ull);
    event_base_free(base);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tail_reaches_a_reading_client),
        cmocka_unit_test(test_a_stalled_client_holds_the_exit_no_longer_than_the_bound),
        cmocka_unit_test(test_nothing_queued_returns_at_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
