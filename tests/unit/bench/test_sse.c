/* Unit tests for bench/sse.c, the reader of a server's SSE stream: which events count as
 * tokens, what usage and timings it takes, [DONE], error events, malformed payloads and
 * counts, lines split across chunks, and the line cap. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/sse.h"

typedef struct fix {
    bench_request r;
    bench_sse s;
} fix;

static int setup(void **state)
{
    fix *f = calloc(1, sizeof(*f));
    bench_request_init(&f->r);
    bench_sse_init(&f->s, &f->r);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fix *f = *state;
    bench_sse_free(&f->s);
    bench_request_free(&f->r);
    free(f);
    return 0;
}

static void feed(fix *f, const char *text, double now)
{
    assert_true(bench_sse_feed(&f->s, text, strlen(text), now));
}

static void test_completion_stream(void **state)
{
    fix *f = *state;
    feed(f, "data: {\"choices\":[{\"text\":\"Hi\",\"finish_reason\":null}]}\n\n", 1.0);
    feed(f, "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":null}]}\n\n",
         2.0); /* half a char */
    feed(f,
         "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}],\"usage\":"
         "{\"prompt_tokens\":5,\"completion_tokens\":3,\"prompt_tokens_details\":"
         "{\"cached_tokens\":4},\"timings\":{\"ttft_ms\":2.5}}}\n\n",
         3.0);
    assert_false(f->s.done);
    feed(f, "data: [DONE]\n\n", 4.0);
    assert_true(f->s.done);
    assert_false(f->s.bad_event);
    assert_int_equal(f->r.num_events, 2); /* the finishing chunk is no token */
    assert_true(f->r.t_events[0] == 1.0 && f->r.t_events[1] == 2.0);
    assert_true(f->r.t_end == 4.0);
    assert_true(f->s.have_usage);
    assert_int_equal(f->r.prompt_tokens, 5);
    assert_int_equal(f->r.output_tokens, 3);
    assert_int_equal(f->r.cached_tokens, 4);
    assert_true(f->r.timing_ms[BENCH_T_SERVER_TTFT] == 2.5);
}

static void test_chat_role_chunk_and_comments(void **state)
{
    fix *f = *state;
    feed(f, ": a comment\r\nevent: message\r\nid: 7\r\n", 1.0);
    feed(f, "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\r\n\r\n",
         1.0);
    feed(f, "data:{\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\r\n\r\n", 2.0);
    feed(f, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\r\n\r\n", 3.0);
    assert_int_equal(f->r.num_events, 2);
    assert_false(f->s.bad_event);
    assert_false(f->s.have_usage);
}

static void test_split_lines(void **state)
{
    fix *f = *state;
    const char *text = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DO";
    for (const char *p = text; *p; p++)
        assert_true(bench_sse_feed(&f->s, p, 1, 1.0));
    assert_int_equal(f->r.num_events, 1);
    assert_false(f->s.done);
    feed(f, "NE]", 2.0);
    bench_sse_end(&f->s, 3.0); /* the last line has no newline */
    assert_true(f->s.done);
}

static void test_errors_and_bad_counts(void **state)
{
    fix *f = *state;
    feed(f, "data: {\"error\":{\"message\":\"out of memory\"}}\n\n", 1.0);
    assert_string_equal(f->s.stream_error, "error event: out of memory");
    assert_false(f->s.bad_event);
    static const char *const bad[] = {"1e300", "-3", "2.5", "\"7\"", "[1]"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        f->s.bad_event = false;
        char line[160];
        snprintf(line, sizeof(line), "data: {\"usage\":{\"completion_tokens\":%s}}\n", bad[i]);
        feed(f, line, 2.0);
        assert_true(f->s.bad_event);
        assert_false(f->s.have_usage);
        assert_int_equal(f->r.output_tokens, 0);
    }
    f->s.bad_event = false;
    feed(f, "data: {\"usage\":{\"completion_tokens\":null}}\n", 2.0); /* absent: fine */
    assert_false(f->s.bad_event);
    feed(f, "data: {not json\n", 2.0);
    assert_true(f->s.bad_event);
}

/* Nothing after [DONE] is believed; a payload is one JSON value; "error": null is none. */
static void test_after_done_and_trailing(void **state)
{
    fix *f = *state;
    feed(f, "data: {\"error\":null,\"choices\":[{\"text\":\"a\"}]}\n\n", 1.0);
    assert_string_equal(f->s.stream_error, "");
    assert_false(f->s.bad_event);
    assert_int_equal(f->r.num_events, 1);
    feed(f, "data: {\"choices\":[{\"text\":\"b\"}]}garbage\n\n", 1.1);
    assert_true(f->s.bad_event);
    assert_int_equal(f->r.num_events, 1);
    f->s.bad_event = false;
    feed(f, "data: [DONE]\n\n", 1.2);
    assert_true(f->s.done);
    assert_true(f->r.t_end == 1.2);
    feed(f, "data: {\"choices\":[{\"text\":\"c\"}]}\n\ndata: [DONE]\n\n", 1.5);
    assert_true(f->s.bad_event);
    assert_int_equal(f->r.num_events, 1);
    assert_true(f->r.t_end == 1.2);
}

static void test_line_cap(void **state)
{
    fix *f = *state;
    size_t n = 1 << 20;
    char *chunk = malloc(n);
    memset(chunk, 'a', n);
    bool go = true;
    for (int i = 0; i < 8 && go; i++)
        go = bench_sse_feed(&f->s, chunk, n, 1.0);
    assert_false(go);
    assert_true(f->s.too_long);
    assert_true(f->s.line_cap <= BENCH_SSE_LINE_CAP);
    free(chunk);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_completion_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chat_role_chunk_and_comments, setup, teardown),
        cmocka_unit_test_setup_teardown(test_split_lines, setup, teardown),
        cmocka_unit_test_setup_teardown(test_errors_and_bad_counts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_after_done_and_trailing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_line_cap, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
