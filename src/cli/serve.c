/*
 * cli/serve.c - `tandem serve`: the OpenAI-compatible engine server.
 *
 *   tandem serve --model M [--served-model-name NAME] [--host H] [--server-port P]
 *                [--kv-transfer-config JSON] [--chat-template chatml]
 *                [--data-parallel-size N] ...
 *
 * Engine flags are engine_opts'; the rest are the server's. Flag names follow the
 * seed systems' recipes (vLLM spellings, underscore aliases, -tp).
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/engine_opts.h"
#include "kvx/kvx.h"
#include "server/server.h"
#include "util/pool.h"

/*
 * The data-parallel ranks' engines. With more than one, the CPUs this process may use are
 * split evenly between them (a rank's compute threads are pinned inside its share, as
 * `tandem up` splits them between processes), and --threads is the total. Unless told not
 * to (or the ranks step together, with expert parallelism), the ranks lend each other
 * their shares while idle through a CPU board of their own (engine.h, cpu_board): a lone
 * request then runs on every CPU, not on its rank's share.
 */
static int create_ranks(td_engine **engines, cpu_set_t *cpus, int n, const td_engine_config *base,
                        td_ep_group *ep, bool lend, td_err *err)
{
    if (n == 1) return td_engine_create(&engines[0], base, err);
    cpu_set_t all;
    CPU_ZERO(&all);
    bool pin = sched_getaffinity(0, sizeof(all), &all) == 0;
    int ncpu = pin ? CPU_COUNT(&all) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (ncpu < 1) ncpu = 1;
    /* Each rank's own CPUs (--cpus) and the board; a board that cannot be made (no
     * writable temporary directory) leaves the ranks on their shares. */
    static char board[64], lists[SRV_MAX_DP][1000];
    lend = lend && pin && !ep && base->pin_threads && ncpu >= n &&
           (base->n_threads == 0 || base->n_threads / n == ncpu / n || base->n_threads == ncpu);
    int board_fd = -1;
    if (lend) {
        snprintf(board, sizeof(board), "/dev/shm/tandem-cpu-board-XXXXXX");
        board_fd = mkstemp(board);
        if (board_fd < 0) {
            snprintf(board, sizeof(board), "/tmp/tandem-cpu-board-XXXXXX");
            board_fd = mkstemp(board);
        }
        /* Unlinked at once, and reached through this descriptor: a server stopped or
         * killed while its ranks load leaves no file behind. */
        if (board_fd < 0) {
            lend = false;
        } else {
            unlink(board);
            snprintf(board, sizeof(board), "/proc/self/fd/%d", board_fd);
        }
    }
    int rc = 0;
    for (int r = 0; r < n && !rc; r++) {
        td_engine_config cfg = *base;
        cfg.ep = ep;
        cfg.ep_rank = r;
        /* rank r: CPUs [lo, hi) of the allowed set (one shared CPU when ranks outnumber them) */
        int lo = ncpu >= n ? (int)((int64_t)r * ncpu / n) : r % ncpu;
        int hi = ncpu >= n ? (int)((int64_t)(r + 1) * ncpu / n) : lo + 1;
        cfg.n_threads = base->n_threads > 0 ? TD_MAX(1, base->n_threads / n) : hi - lo;
        if (pin) {
            cpu_set_t mine;
            CPU_ZERO(&mine);
            for (int c = 0, k = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &all)) {
                    if (k >= lo && k < hi) CPU_SET(c, &mine);
                    k++;
                }
            if (lend) { /* its threads on its share, its guests on the others' */
                td_format_cpu_list(&mine, lists[r], sizeof(lists[r]));
                cfg.cpus = lists[r];
                cfg.cpu_board = board;
                cfg.n_threads = CPU_COUNT(&mine);
            } else {
                sched_setaffinity(0, sizeof(mine),
                                  &mine); /* the engine's threads start inside it */
            }
            cpus[r] = mine;
        }
        rc = td_engine_create(&engines[r], &cfg, err);
        if (rc) {
            char msg[sizeof(err->msg)];
            snprintf(msg, sizeof(msg), "%s", err->msg);
            td_err_set(err, err->code, "data-parallel rank %d: %s", r, msg);
        }
    }
    if (pin) sched_setaffinity(0, sizeof(all), &all);
    if (board_fd >= 0) close(board_fd); /* the ranks have it open and mapped */
    if (rc)
        for (int r = 0; r < n; r++) td_engine_free(engines[r]);
    return rc;
}

int cli_serve(int argc, char **argv)
{
    engine_opts eo;
    cli_flag flags[ENGINE_OPTS_MAX_FLAGS + 20];
    int nf = engine_opts_register(&eo, flags);
    srv_config sc;
    srv_config_default(&sc);
    const char *served = NULL, *host = sc.host, *kv_json = NULL, *chat = NULL;
    int64_t port = sc.port, tp = 1, dp = 1, max_queue = sc.max_queue, step_delay = 0, kv_delay = 0,
            kv_corrupt = 0;
    uint64_t max_body = sc.max_body_size;
    double stall = sc.health_stall_s, drain = sc.shutdown_timeout_s;
    bool debug = false, dp_attention = false, expert_parallel = false, no_lend = false;
    flags[nf++] = CLI_FLAG("served-model-name", CLI_FLAG_STR, &served,
                           "the model name clients use (default: the --model argument)");
    flags[nf++] = CLI_FLAG("host", CLI_FLAG_STR, &host, "address to listen on (0.0.0.0)");
    flags[nf++] = CLI_FLAG("server-port", CLI_FLAG_INT, &port,
                           "port to listen on (8000; 0 = any free port, printed at start)");
    flags[nf++] = CLI_FLAG("port", CLI_FLAG_INT, &port, "same as --server-port");
    flags[nf++] = CLI_FLAG("tensor-parallel-size", CLI_FLAG_INT, &tp, "tensor parallelism (1)");
    flags[nf++] = CLI_FLAG("tp", CLI_FLAG_INT, &tp, "same as --tensor-parallel-size");
    flags[nf++] = CLI_FLAG("data-parallel-size", CLI_FLAG_INT, &dp,
                           "data-parallel ranks in this server (1): each an engine with its own "
                           "scheduler, KV pool, compute threads (the CPUs split between the ranks) "
                           "and transfer agent (handshake_port + rank)");
    flags[nf++] = CLI_FLAG("dp", CLI_FLAG_INT, &dp, "same as --data-parallel-size");
    flags[nf++] = CLI_FLAG("no-lend-cpus", CLI_FLAG_BOOL, &no_lend,
                           "with --data-parallel-size: keep each rank on its own CPUs even while "
                           "another rank is idle");
    flags[nf++] = CLI_FLAG("enable-dp-attention", CLI_FLAG_BOOL, &dp_attention,
                           "accepted for the seed recipes: the ranks' attention is always "
                           "data-parallel (each rank attends over its own requests)");
    flags[nf++] = CLI_FLAG("enable-expert-parallel", CLI_FLAG_BOOL, &expert_parallel,
                           "split a mixture-of-experts model's experts across the data-parallel "
                           "ranks (a token exchange per MoE layer; the ranks step together)");
    flags[nf++] =
        CLI_FLAG("kv-transfer-config", CLI_FLAG_STR, &kv_json,
                 "JSON: kv_role (kv_producer|kv_consumer|kv_both, required), "
                 "kv_connector (tandem|mooncake|moriio), protocol (tcp|shm|ucx|cuda_ipc), "
                 "transfer_mode (read|write), handshake_port, kv_ip, num_worker_threads, "
                 "qp_per_transfer, lease_ms, transfer_timeout_ms, "
                 "kv_load_failure_policy (recompute|fail), verify_checksums, "
                 "auth_token (or TANDEM_KV_TOKEN), proxy_ip, proxy_ping_port, "
                 "http_port; see README");
    flags[nf++] = CLI_FLAG("chat-template", CLI_FLAG_STR, &chat,
                           "chatml | llama-2 | llama-3 | zephyr | mistral (default: detected "
                           "from the GGUF's tokenizer.chat_template)");
    flags[nf++] = CLI_FLAG("max-queue", CLI_FLAG_INT, &max_queue,
                           "requests waiting beyond --max-num-seqs before 429 (1024)");
    flags[nf++] = CLI_FLAG("max-body-size", CLI_FLAG_SIZE, &max_body,
                           "largest request body; larger ones get 413 (4M)");
    flags[nf++] = CLI_FLAG("health-stall-timeout", CLI_FLAG_FLOAT, &stall,
                           "seconds without an engine step, with work pending, before /health "
                           "answers 503 (60)");
    flags[nf++] = CLI_FLAG("shutdown-timeout", CLI_FLAG_FLOAT, &drain,
                           "on SIGTERM or SIGINT, seconds to let requests in flight and KV held "
                           "for consumers finish before exiting (30; 0: exit at once)");
    flags[nf++] = CLI_FLAG("enable-debug-endpoints", CLI_FLAG_BOOL, &debug,
                           "enable POST /debug/stop_engine (for tests)");
    flags[nf++] = CLI_FLAG("debug-kv-send-delay-ms", CLI_FLAG_INT, &kv_delay,
                           "test hook (needs --enable-debug-endpoints): the KV agent sleeps "
                           "this long before sending each transfer's bytes");
    flags[nf++] = CLI_FLAG("debug-kv-corrupt", CLI_FLAG_INT, &kv_corrupt,
                           "test hook (needs --enable-debug-endpoints): flip a byte in each of "
                           "the next N KV transfers this consumer receives");
    flags[nf++] = CLI_FLAG("debug-step-delay-ms", CLI_FLAG_INT, &step_delay,
                           "sleep after each engine step (tests; needs --enable-debug-endpoints)");
    int rc = cli_flags_parse(flags, nf, argc, argv, "tandem serve --model M [options]");
    if (rc) return rc == 1 ? 0 : 2;
    if (tp != 1) {
        fprintf(stderr, "error: --tensor-parallel-size %lld is not supported yet (only 1 is)\n",
                (long long)tp);
        return 2;
    }
    if (dp < 1 || dp > SRV_MAX_DP) {
        fprintf(stderr, "error: --data-parallel-size must be in [1, %d], got %lld\n", SRV_MAX_DP, (long long)dp);
        return 2;
    }
    if (dp > 1 && (eo.cpus || eo.cpu_board)) {
        fprintf(stderr,
                "error: --%s: data-parallel ranks split this process's CPUs between "
                "them; give each rank's process its CPUs with taskset or tandem up instead\n",
                eo.cpus ? "cpus" : "cpu-board");
        return 2;
    }
    if (expert_parallel && dp < 2) {
        fprintf(stderr, "error: --enable-expert-parallel splits the experts across data-parallel ranks: "
                        "it needs --data-parallel-size 2 or more\n");
        return 2;
    }
    if (port < 0 || port > 65535) {
        fprintf(stderr, "error: --server-port must be in [0, 65535], got %lld\n", (long long)port);
        return 2;
    }
    if (max_queue < 0 || max_queue > 1 << 20) {
        fprintf(stderr, "error: --max-queue must be in [0, 1048576]\n");
        return 2;
    }
    if (max_body < 1024 || max_body > (1ull << 30)) {
        fprintf(stderr, "error: --max-body-size must be in [1K, 1G]\n");
        return 2;
    }
    if (!(stall > 0)) {
        fprintf(stderr, "error: --health-stall-timeout must be > 0\n");
        return 2;
    }
    if (!(drain >= 0 && drain <= 86400)) {
        fprintf(stderr, "error: --shutdown-timeout must be in [0, 86400] seconds\n");
        return 2;
    }
    if (step_delay && !debug) {
        fprintf(stderr, "error: --debug-step-delay-ms needs --enable-debug-endpoints\n");
        return 2;
    }
    if ((kv_delay || kv_corrupt) && !debug) {
        fprintf(stderr, "error: --debug-kv-send-delay-ms and --debug-kv-corrupt need "
                        "--enable-debug-endpoints\n");
        return 2;
    }
    if (kv_delay < 0 || kv_delay > 60000 || kv_corrupt < 0 || kv_corrupt > 1000000) {
        fprintf(stderr, "error: --debug-kv-send-delay-ms must be in [0, 60000] and "
                        "--debug-kv-corrupt in [0, 1000000]\n");
        return 2;
    }
    kvx_debug_hooks((int)kv_delay, (int)kv_corrupt);
    if (step_delay < 0 || step_delay > 10000) {
        fprintf(stderr, "error: --debug-step-delay-ms must be in [0, 10000]\n");
        return 2;
    }
    if (chat && srv_chat_family_by_name(chat) < 0) {
        fprintf(stderr,
                "error: --chat-template must be chatml, llama-2, llama-3, zephyr or "
                "mistral, got '%s'\n",
                chat);
        return 2;
    }
    srv_kv_config kv;
    bool have_kv = false;
    if (kv_json) {
        char msg[600];
        if (srv_kv_config_parse(&kv, kv_json, msg, sizeof(msg))) {
            fprintf(stderr, "error: %s\n", msg);
            return 2;
        }
        if (srv_kv_rails(&kv, msg, sizeof(msg))) {
            fprintf(stderr, "error: --kv-transfer-config: %s\n", msg);
            srv_kv_config_free(&kv);
            return 2;
        }
        have_kv = true;
    }
    td_engine_config cfg;
    if (engine_opts_apply(&eo, &cfg)) {
        if (have_kv) srv_kv_config_free(&kv);
        return 2;
    }
    /* A GPU engine's KV moves by cuda_ipc (same host) or by tcp or ucx through pinned host
     * staging, in read mode; cuda_ipc moves only GPU memory. */
    bool on_gpu = td_device_gpu(cfg.device) >= 0;
    const char *why = NULL;
    if (have_kv && on_gpu && kv.protocol == SRV_KV_SHM)
        why = "with --device cuda the KV pool is in GPU memory: use protocol cuda_ipc (same "
              "host), tcp or ucx";
    else if (have_kv && on_gpu && kv.write_mode)
        why = "with --device cuda transfers read (transfer_mode read): push is not served from "
              "GPU memory";
    else if (have_kv && !on_gpu && kv.protocol == SRV_KV_CUDA_IPC)
        why = "protocol cuda_ipc moves GPU memory: it needs --device cuda";
    if (why) {
        fprintf(stderr, "error: --kv-transfer-config: %s\n", why);
        srv_kv_config_free(&kv);
        return 2;
    }
    /* A producer serving shm keeps its KV pool in a memfd that consumers map. */
    cfg.kv_shareable = have_kv && kv.protocol == SRV_KV_SHM &&
                       (kv.role == SRV_KV_PRODUCER || kv.role == SRV_KV_BOTH);
    /* A KV role commits its pool up front: blocks filled by a transfer would otherwise
     * take their page faults during the copy (about 3x its time, BENCHMARKS.md). */
    cfg.kv_prefault = have_kv && !on_gpu;
    /* The weights' pages too: "healthy" means the first request is as fast as the next. */
    cfg.weights_prefault = !on_gpu;
    /* A producer that sends checksums keeps them as its blocks fill, so a transfer does
     * not read every block a second time to checksum it (docs/ARCHITECTURE.md). */
    cfg.kv_checksums = have_kv && !on_gpu && kv.verify_checksums &&
                       (kv.role == SRV_KV_PRODUCER || kv.role == SRV_KV_BOTH);
    td_err err = {0};
    td_engine *engines[SRV_MAX_DP] = {0};
    static cpu_set_t cpus[SRV_MAX_DP];
    bool split = dp > 1 && sched_getaffinity(0, sizeof(cpus[0]), &cpus[0]) == 0;
    td_ep_group *ep = NULL;
    /* Loading may run an engine's thread pool here, which pins this thread to the pool's
     * first CPU; this thread becomes the HTTP I/O thread and starts the transfer agents'
     * threads, none of which should share that CPU with the engine thread. */
    cpu_set_t io_cpus;
    bool io_saved = pthread_getaffinity_np(pthread_self(), sizeof(io_cpus), &io_cpus) == 0;
    int created = (expert_parallel && td_ep_group_create(&ep, (int)dp, &err)) ||
                  create_ranks(engines, cpus, (int)dp, &cfg, ep, !no_lend, &err);
    /* With --cpu-board the other CPUs are other engines', lent only while they idle: the
     * I/O and transfer threads stay on this engine's own CPUs. */
    cpu_set_t home;
    if (!created && cfg.cpu_board && td_engine_cpus(engines[0], &home) > 0) io_cpus = home;
    if (io_saved) pthread_setaffinity_np(pthread_self(), sizeof(io_cpus), &io_cpus);
    if (created) {
        fprintf(stderr, "error: %s\n", err.msg);
        td_ep_group_free(ep);
        if (have_kv) srv_kv_config_free(&kv);
        return err.code == TD_EINVAL ? 2 : 1;
    }
    sc.host = host;
    sc.port = (int)port;
    sc.served_model_name = served;
    sc.model_path = eo.model;
    sc.chat_template = chat;
    sc.max_queue = (int)max_queue;
    sc.max_body_size = (size_t)max_body;
    sc.enable_debug_endpoints = debug;
    sc.debug_step_delay_ms = (int)step_delay;
    sc.health_stall_s = stall;
    sc.shutdown_timeout_s = drain;
    sc.block_size = cfg.block_size;
    sc.max_num_seqs = cfg.max_num_seqs;
    sc.kv_cache_dtype = cfg.kv_cache_dtype;
    sc.kv = have_kv ? &kv : NULL;
    sc.rank_cpus = split ? cpus : NULL;
    sc.ep = ep;
    srv_server *s = NULL;
    if (srv_server_create(&s, engines, (int)dp, &sc, &err)) { /* it frees the engines */
        fprintf(stderr, "error: %s\n", err.msg);
        td_ep_group_free(ep);
        if (have_kv) srv_kv_config_free(&kv);
        return 1;
    }
    rc = srv_server_run(s);
    srv_server_free(s);
    td_ep_group_free(ep); /* after the engines, whose steps used it */
    if (have_kv) srv_kv_config_free(&kv);
    return rc ? 1 : 0;
}
