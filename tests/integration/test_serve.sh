#!/usr/bin/env bash
# `tandem serve` over real loopback HTTP: flag checks, then the behaviour suite in
# node/serve.test.mjs (node's built-in test runner and fetch only; no npm packages),
# then /health going to 503 once the engine loop is stopped through the debug hook.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v node >/dev/null || fail "node is required for the server tests (apt-get install nodejs)"

# --- flags: strict, with clear errors
expect_flag_error "unknown option '--no-such-flag'" --no-such-flag
expect_flag_error "--tensor-parallel-size 2 is not supported yet" -tp 2
expect_flag_error "--tensor-parallel-size 4 is not supported yet" --tensor-parallel-size 4
expect_flag_error "'kv_role' is required" --kv-transfer-config '{"kv_connector":"tandem"}'
expect_flag_error "'kv_role' must be kv_producer, kv_consumer or kv_both" --kv-transfer-config '{"kv_role":"producer"}'
expect_flag_error "'kv_bogus' is not a known key" --kv-transfer-config '{"kv_role":"kv_both","kv_bogus":1}'
expect_flag_error "'handshake_port' must be an integer port" --kv-transfer-config '{"kv_role":"kv_both","handshake_port":"x"}'
expect_flag_error "'kv_connector_extra_config' must be an object" --kv-transfer-config '{"kv_role":"kv_both","kv_connector_extra_config":[]}'
expect_flag_error "is not valid JSON" --kv-transfer-config '{kv_role'
# GPU memory moves by cuda_ipc, tcp or ucx (never shm), and cuda_ipc moves only GPU memory
expect_flag_error "protocol cuda_ipc moves GPU memory: it needs --device cuda" --kv-transfer-config '{"kv_role":"kv_both","protocol":"cuda_ipc"}'
expect_flag_error "with --device cuda the KV pool is in GPU memory: use protocol cuda_ipc (same host), tcp or ucx" --device cuda --kv-transfer-config '{"kv_role":"kv_consumer","protocol":"shm"}'
expect_flag_error "with --device cuda transfers read" --device cuda --kv-transfer-config '{"kv_role":"kv_consumer","kv_connector":"mooncake"}'
expect_flag_error "'kv_buffer_device' cuda goes with protocol cuda_ipc, tcp or ucx" --kv-transfer-config '{"kv_role":"kv_both","kv_buffer_device":"cuda","protocol":"shm"}'
expect_flag_error "'transfer_mode' write is not served from GPU memory" --kv-transfer-config '{"kv_role":"kv_both","protocol":"cuda_ipc","transfer_mode":"write"}'
expect_flag_error "--chat-template must be chatml" --chat-template jinja
expect_flag_error "--device must be cpu, cuda or cuda:N (GPU N, 0..63), got 'cuda:64'" --device cuda:64
expect_flag_error "--device must be cpu, cuda or cuda:N (GPU N, 0..63), got 'gpu'" --device gpu
expect_flag_error "--kv-cache-dtype" --kv_cache_dtype q3

# --- the soft limit on open files is raised to the hard one (capped at Linux's 2^20): a
# server holds a socket per stream, and a soft limit of 1024 would refuse connections early.
hard=$(ulimit -Hn)
if [ "$hard" = unlimited ] || [ "$hard" -gt 1048576 ]; then hard=1048576; fi
: >"$tmp/FD.err"
(ulimit -Sn 256 && exec "$TD_BIN" serve --model "$MODEL" --threads 1 --host 127.0.0.1 \
    --server-port 0 --log-level warn 2>"$tmp/FD.err") &
server_pids+=("$!")
wait_listening FD "$!" 127.0.0.1
soft=$(awk '/^Max open files/ {print $4}' "/proc/$FD_PID/limits")
[ "$soft" = "$hard" ] || fail "open files: soft limit $soft, want the hard limit $hard"
kill "$FD_PID"

# --- the main server (underscore aliases and -tp 1 accepted) and a slow one for
# disconnects and queue limits (each engine step sleeps 20 ms).
start_server MAIN --chat-template chatml --enable-debug-endpoints -tp 1 --kv_cache_dtype f16 \
    --served-model-name stories --kv-transfer-config \
    '{"kv_role":"kv_producer","kv_connector":"tandem","handshake_port":5601,"kv_connector_extra_config":{"a":1}}'
start_server SLOW --enable-debug-endpoints --debug-step-delay-ms 20 --max-num-seqs 4 --max-queue 2

TD_URL=$MAIN_URL TD_SLOW_URL=$SLOW_URL TD_MODEL_NAME=stories TD_BIN=$TD_BIN TD_MODEL=$MODEL \
    node --test --test-reporter=spec "$TESTS_DIR/node/serve.test.mjs" ||
    fail "node/serve.test.mjs failed (server stderr: $(tail -n 20 "$tmp/MAIN.err"))"

# --- CPU placement: with --threads 1 and a second CPU allowed, the engine thread (which
# steps the engine, and so is pinned to the pool's CPU) runs alone on its CPU, and the HTTP
# thread and the KV transfer threads it started stay off it. (The pool used to pin the
# thread that made it, which is the HTTP thread, and every thread started after shared
# that one CPU.)
if [ "$(nproc)" -ge 2 ]; then
    hs=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    start_server PIN --threads 1 --kv-transfer-config "{\"kv_role\":\"kv_producer\",\"handshake_port\":$hs}"
    curl -sf "$PIN_URL/v1/completions" -d '{"prompt":[1,306],"max_tokens":2}' >/dev/null ||
        fail "placement server: request failed"
    main_cpus=$(sed -n 's/^Cpus_allowed_list:\s*//p' "/proc/$PIN_PID/status")
    engine_cpu="" others=0
    for t in /proc/$PIN_PID/task/*; do
        [ "$(basename "$t")" = "$PIN_PID" ] && continue
        c=$(sed -n 's/^Cpus_allowed_list:\s*//p' "$t/status")
        if [ "$c" = "$main_cpus" ]; then others=$((others + 1)); continue; fi
        [ -z "$engine_cpu" ] || fail "two threads pinned apart from the HTTP thread ($engine_cpu, $c)"
        engine_cpu=$c
    done
    [ -n "$engine_cpu" ] || fail "no thread is pinned apart from the HTTP thread (all on $main_cpus)"
    [[ "$engine_cpu" =~ ^[0-9]+$ ]] || fail "the engine thread may run on '$engine_cpu', not one CPU"
    python3 - "$main_cpus" "$engine_cpu" <<'PY' || fail "the HTTP thread ($main_cpus) shares the engine's CPU $engine_cpu"
import sys
cpus = set()
for part in sys.argv[1].split(","):
    lo, _, hi = part.partition("-")
    cpus.update(range(int(lo), int(hi or lo) + 1))
sys.exit(1 if int(sys.argv[2]) in cpus or not cpus else 0)
PY
    [ "$others" -ge 1 ] || fail "no transfer thread found beside the HTTP thread"
    echo "placement: engine thread on CPU $engine_cpu; HTTP and $others transfer threads on $main_cpus"
    kill "$PIN_PID"
fi

# --- the weights are mapped before the server listens: a 10 MB model (mkmodel) is wholly
# resident in the server's mapping of it before any request, so the first request does
# not fault its pages in (loading touches only the metadata and a few rows).
"$TD_BIN" mkmodel --out "$tmp/w.gguf" --dim 512 --layers 2 --heads 8 --ffn 1408 --vocab 1024 \
    --type f16 >/dev/null || fail "mkmodel for the prefault check failed"
"$TD_BIN" serve --model "$tmp/w.gguf" --threads 1 --host 127.0.0.1 --server-port 0 --log-level warn \
    2>"$tmp/W.err" &
w_pid=$!
server_pids+=("$w_pid")
wait_listening W "$w_pid" 127.0.0.1
read -r w_size w_rss < <(awk -v f="$tmp/w.gguf" '$NF == f {m = 1; next} m && /^Size:/ {s = $2}
    m && /^Rss:/ {print s, $2; exit}' "/proc/$w_pid/smaps")
[ -n "$w_size" ] || fail "no mapping of the model in the server's smaps"
[ "$w_rss" -eq "$w_size" ] || fail "the model is not wholly mapped at start-up: $w_rss of $w_size kB resident"
echo "weights: $w_rss of $w_size kB of the model mapped before the first request"
kill "$w_pid"

# --- /health: 503 while work waits longer than --health-stall-timeout without a step
# (here each step is followed by a 3 s sleep), and 200 again once the work is done.
start_server STALL --enable-debug-endpoints --debug-step-delay-ms 3000 --health-stall-timeout 0.5
curl -s "$STALL_URL/v1/completions" -d '{"prompt":[1,306],"max_tokens":2,"ignore_eos":true}' >"$tmp/stall.out" &
stall_curl=$!
stalled=""
for _ in $(seq 1 200); do
    code=$(curl -s -o "$tmp/h" -w '%{http_code}' "$STALL_URL/health")
    if [ "$code" = 503 ]; then stalled=1; break; fi
    sleep 0.05
done
[ -n "$stalled" ] || fail "/health never reported the stall"
grep -q "stalled" "$tmp/h" || fail "/health stall reason: $(cat "$tmp/h")"
wait "$stall_curl" || fail "the stalled request failed"
grep -q '"finish_reason":"length"' "$tmp/stall.out" || fail "stalled request: $(cat "$tmp/stall.out")"
code=$(curl -s -o "$tmp/h" -w '%{http_code}' "$STALL_URL/health")
[ "$code" = 200 ] || fail "/health after the stall: $code $(cat "$tmp/h")"

# --- /health: 200 while the loop runs, 503 with a reason once it has stopped
code=$(curl -s -o "$tmp/h" -w '%{http_code}' "$MAIN_URL/health")
[ "$code" = 200 ] || fail "/health before stop: $code $(cat "$tmp/h")"
# A rank that is not one of the server's is a 400, and stops nothing.
for q in rank=abc rank=1 rank=-1 rank=99999999999999999999 rnk=0; do
    code=$(curl -s -o "$tmp/h" -w '%{http_code}' -XPOST "$MAIN_URL/debug/stop_engine?$q")
    [ "$code" = 400 ] || fail "stop_engine?$q: $code $(cat "$tmp/h")"
done
code=$(curl -s -o "$tmp/h" -w '%{http_code}' "$MAIN_URL/health")
[ "$code" = 200 ] || fail "/health after refused stops: $code $(cat "$tmp/h")"
curl -s -XPOST "$MAIN_URL/debug/stop_engine" >/dev/null
code=$(curl -s -o "$tmp/h" -w '%{http_code}' "$MAIN_URL/health")
[ "$code" = 503 ] || fail "/health after stop: $code $(cat "$tmp/h")"
grep -q "engine loop has stopped" "$tmp/h" || fail "/health reason: $(cat "$tmp/h")"
code=$(curl -s -o "$tmp/h" -w '%{http_code}' "$MAIN_URL/v1/completions" -d '{"prompt":[1,2]}')
[ "$code" = 503 ] || fail "completion after stop: $code $(cat "$tmp/h")"
# The slow server has the hook too; stop it the same way.
code=$(curl -s -o /dev/null -w '%{http_code}' -XPOST "$SLOW_URL/debug/stop_engine")
[ "$code" = 200 ] || fail "debug hook on SLOW: $code"

# A clean shutdown on SIGTERM.
kill -TERM "$MAIN_PID"
wait "$MAIN_PID" || fail "server exited non-zero on SIGTERM: $(tail -n 5 "$tmp/MAIN.err")"
echo "ok"
