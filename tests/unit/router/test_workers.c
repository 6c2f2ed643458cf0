/* Unit tests for router/workers.c: what the router takes from an engine's reports. A
 * /kv_transfer_info whose role fits and whose fields are well formed makes the worker
 * ready; a wrong role, or a handshake port that is not a port (out of range, fractional,
 * a string, a huge number), refuses it; a /health "load" that is not a count is ignored;
 * a new /health "instance_id" at the same URL is a restart. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "router/rt_impl.h"

typedef struct fix {
    rt_router r;
    rt_worker *w;
} fix;

static int setup(void **state)
{
    td_log_set_level((td_log_level)(TD_LOG_ERROR + 1)); /* refusals are logged */
    fix *f = calloc(1, sizeof(*f));
    f->r.cfg.pd = true;
    td_err err;
    assert_int_equal(
        rt_worker_add(&f->r, "http://127.0.0.1:8100", RT_ROLE_DECODE, true, &f->w, &err), 0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    fix *f = *state;
    rt_workers_free(&f->r);
    free(f);
    return 0;
}

/* Apply the report text to the worker. */
static void apply(fix *f, const char *json)
{
    cJSON *j = cJSON_Parse(json);
    assert_non_null(j);
    rt_worker_info_apply(&f->r, f->w, j);
    cJSON_Delete(j);
}

static void test_good_report_makes_ready(void **state)
{
    fix *f = *state;
    apply(f, "{\"kv_role\":\"kv_consumer\",\"engine_id\":\"e1\",\"kv_host\":\"10.0.0.7\","
             "\"handshake_port\":5600,\"transfer_mode\":\"write\",\"model\":\"m\"}");
    assert_true(f->w->info_ok);
    assert_int_equal(f->w->kv_port, 5600);
    assert_string_equal(f->w->kv_host, "10.0.0.7");
    assert_string_equal(f->w->engine_id, "e1");
    assert_true(f->w->write_mode);
    /* No agent (an aggregated engine): port 0, and the worker is still usable. */
    apply(f, "{\"kv_role\":\"kv_both\",\"engine_id\":\"e1\",\"handshake_port\":null}");
    assert_true(f->w->info_ok);
    assert_int_equal(f->w->kv_port, 0);
}

static void test_wrong_role_refused(void **state)
{
    fix *f = *state;
    apply(f, "{\"kv_role\":\"kv_producer\",\"engine_id\":\"e1\",\"handshake_port\":5600}");
    assert_false(f->w->info_ok);
    assert_string_equal(f->w->kv_role, "kv_producer");
}

static void test_bad_port_refused(void **state)
{
    fix *f = *state;
    static const char *const bad[] = {"70000", "0",        "-1",     "5600.5",
                                      "1e300", "\"5600\"", "[5600]", "true"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        apply(f, "{\"kv_role\":\"kv_consumer\",\"handshake_port\":5600}");
        assert_true(f->w->info_ok);
        char json[200];
        snprintf(json, sizeof(json), "{\"kv_role\":\"kv_consumer\",\"handshake_port\":%s}", bad[i]);
        apply(f, json);
        assert_false(f->w->info_ok);
        assert_true(f->w->kv_port >= 0 && f->w->kv_port <= 65535);
    }
}

static void test_bad_rank_port_refused(void **state)
{
    fix *f = *state;
    f->w->dp_rank = 1;
    apply(f, "{\"kv_role\":\"kv_consumer\",\"handshake_port\":5600,\"dp_ranks\":["
             "{\"rank\":0,\"handshake_port\":5600},{\"rank\":1,\"handshake_port\":5601}]}");
    assert_true(f->w->info_ok);
    assert_int_equal(f->w->kv_port, 5601);
    apply(f, "{\"kv_role\":\"kv_consumer\",\"handshake_port\":5600,\"dp_ranks\":["
             "{\"rank\":1,\"handshake_port\":1e300}]}");
    assert_false(f->w->info_ok);
    /* A rank that is no integer names no rank: the top-level agent stands. */
    apply(f, "{\"kv_role\":\"kv_consumer\",\"handshake_port\":5600,\"dp_ranks\":["
             "{\"rank\":1.5,\"handshake_port\":5609},{\"rank\":1e300,\"handshake_port\":5608}]}");
    assert_true(f->w->info_ok);
    assert_int_equal(f->w->kv_port, 5600);
}

static void test_health_load(void **state)
{
    fix *f = *state;
    static const struct {
        const char *json;
        int load;
    } cases[] = {{"{\"load\":3}", 3},   {"{\"load\":-4}", 3},    {"{\"load\":1e300}", 3},
                 {"{\"load\":2.5}", 3}, {"{\"load\":\"7\"}", 3}, {"{}", 3},
                 {"{\"load\":0}", 0}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cJSON *j = cJSON_Parse(cases[i].json);
        rt_worker_health_apply(f->w, j);
        cJSON_Delete(j);
        assert_int_equal(f->w->reported_load, cases[i].load);
        assert_true(f->w->external_load >= 0);
    }
    rt_worker_health_apply(f->w, NULL);
    assert_int_equal(f->w->reported_load, 0);
}

static void test_health_instance(void **state)
{
    fix *f = *state;
    static const struct {
        const char *json;
        bool restarted;
    } cases[] = {{"{\"instance_id\":\"aaaa\"}", false}, /* the first one seen */
                 {"{\"instance_id\":\"aaaa\"}", false}, {"{}", false},
                 {"{\"instance_id\":7}", false},          {"{\"instance_id\":\"bbbb\"}", true},
                 {"{\"instance_id\":\"bbbb\"}", false}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        cJSON *j = cJSON_Parse(cases[i].json);
        assert_int_equal(rt_worker_health_apply(f->w, j), cases[i].restarted);
        cJSON_Delete(j);
    }
    assert_string_equal(f->w->instance, "bbbb");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_good_report_makes_ready, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_role_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_port_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_rank_port_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_health_load, setup, teardown),
        cmocka_unit_test_setup_teardown(test_health_instance, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
