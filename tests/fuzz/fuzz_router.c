/*
 * libFuzzer target for what the router reads from engines and from POST /workers: a worker
 * URL (rt_url_check, rt_worker_add), an engine's /kv_transfer_info report
 * (rt_worker_info_apply) and its /health body (rt_worker_health_apply). The first byte
 * sets the router's mode and the worker's role and rank; the rest is the URL and, parsed
 * as JSON, the reports. Nothing may crash, a refused URL carries a message, and whatever
 * a report says, the worker's state stays in range: a port or 0, a load of -1 or more,
 * at most 256 ranks, and a refused report leaves the worker not ready.
 *
 *   build-fuzz/fuzz_router -max_total_time=60 tests/fuzz/corpus_router
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/rt_impl.h"

static void check(bool ok, const char *what)
{
    if (!ok) {
        fprintf(stderr, "fuzz_router: invariant broken: %s\n", what);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1u << 16)) return 0;
    td_log_set_level((td_log_level)(TD_LOG_ERROR + 1)); /* quiet: refusals are logged */
    const uint8_t flags = data[0];
    char *text = malloc(size);
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;

    rt_router r;
    memset(&r, 0, sizeof(r));
    r.cfg.pd = flags & 1;
    r.cfg.dp_aware = (flags >> 1) & 1;
    rt_role role = !r.cfg.pd ? RT_ROLE_WORKER : (flags >> 2) & 1 ? RT_ROLE_DECODE : RT_ROLE_PREFILL;

    /* The text as a worker URL. */
    td_err err = {0};
    rt_worker *w = NULL;
    if (rt_url_check(text, &err)) {
        check(err.msg[0] != 0, "a refused URL has a message");
        check(rt_worker_add(&r, text, role, true, &w, &err) != 0 && !w,
              "rt_worker_add refuses what rt_url_check refuses");
    } else {
        check(rt_worker_add(&r, text, role, true, &w, &err) == 0 && w, "a checked URL is added");
        check(w->port >= 1 && w->port <= 65535, "a URL's port is a port");
        check(rt_worker_find_url(&r, w->url) == w, "a worker is found by its own URL");
    }

    /* The text as the reports of a worker at a fixed URL. */
    cJSON *j = cJSON_ParseWithLength(text, size - 1);
    if (j) {
        rt_worker *v = NULL;
        check(rt_worker_add(&r, "http://127.0.0.1:8000", role, true, &v, &err) == 0 && v,
              "a plain URL is added");
        if ((flags >> 3) & 1) v->dp_rank = (flags >> 4) & 7;
        for (int pass = 0; pass < 2; pass++) { /* the second as a known worker reporting again */
            rt_worker_info_apply(&r, v, j);
            check(v->kv_port >= 0 && v->kv_port <= 65535, "kv_port is a port or 0");
            check(v->dp_size >= 1 && v->dp_size <= 256, "dp_size in [1, 256]");
            check(strlen(v->kv_role) < sizeof(v->kv_role), "kv_role terminated");
            check(strlen(v->engine_id) < sizeof(v->engine_id), "engine_id terminated");
            check(strlen(v->model) < sizeof(v->model), "model terminated");
            rt_worker_health_apply(v, j);
            check(v->reported_load >= -1 && v->external_load >= -1, "loads are -1 or more");
        }
        int n = 0;
        for (rt_worker *x = r.workers; x; x = x->next) {
            check(x->kv_port >= 0 && x->kv_port <= 65535, "every worker's kv_port in range");
            n++;
        }
        check(n <= 2 + 255, "at most one worker per rank");
        rt_worker_health_apply(v, NULL);
        cJSON_Delete(j);
    }
    rt_workers_free(&r);
    free(text);
    return 0;
}
