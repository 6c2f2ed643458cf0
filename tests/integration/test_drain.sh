#!/usr/bin/env bash
# Graceful shutdown of `tandem serve`: on SIGTERM a server finishes what it has (a stream
# in flight ends whole, with [DONE]; prompt KV held for a consumer is kept until it is
# released) while /health says "draining" and new requests get 503; past
# --shutdown-timeout what is left ends with finish_reason "abort"; a second signal exits at
# once. Every exit is 0. The router drains the same way, and `tandem up` stops the router
# first, so a stream in flight through a 1P1D cluster ends whole.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v curl >/dev/null || fail "curl is required"
command -v jq >/dev/null || fail "jq is required (apt-get install jq)"

expect_flag_error "--shutdown-timeout" --shutdown-timeout -1

# stream URL MAX_TOKENS OUT: a streamed completion in the background (pid in $stream_pid)
stream() {
    curl -sN "$1/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\":[1,306],\"max_tokens\":$2,\"ignore_eos\":true,\"stream\":true}" >"$3" &
    stream_pid=$!
    for _ in $(seq 1 100); do grep -q '"text"' "$3" 2>/dev/null && return; sleep 0.05; done
    fail "no token streamed from $1: $(cat "$3")"
}
# gone PID TENTHS: the process has exited within TENTHS tenths of a second
gone() {
    for _ in $(seq 1 "$2"); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
    return 1
}

# drains NAME: server NAME (${NAME}_URL, ${NAME}_PID, log $tmp/NAME.err), streaming 60
# tokens, gets SIGTERM: /health says draining, a new request gets 503, the stream ends
# whole (60 tokens, [DONE]; kept in $tmp/NAME.out) and the process exits 0.
drains() {
    local url pid
    url=$(eval echo "\$${1}_URL")
    pid=$(eval echo "\$${1}_PID")
    stream "$url" 60 "$tmp/$1.out"
    kill -TERM "$pid"
    code=$(curl -s -o "$tmp/h" -w '%{http_code}' "$url/health")
    [ "$code" = 503 ] && [ "$(jq -r .status "$tmp/h")" = draining ] ||
        fail "$1: /health while draining: $code $(cat "$tmp/h")"
    code=$(curl -s -o "$tmp/n" -w '%{http_code}' "$url/v1/completions" \
        -H 'Content-Type: application/json' -d '{"prompt":[1,306],"max_tokens":2}')
    [ "$code" = 503 ] && grep -q "shutting down" "$tmp/n" ||
        fail "$1: a new request while draining: $code $(cat "$tmp/n")"
    wait "$stream_pid" ||
        fail "$1: the streaming client failed (curl exit $?): $(tail -c 300 "$tmp/$1.out")"
    wait "$pid" || fail "$1: exit status after draining: $(tail -n 5 "$tmp/$1.err")"
    [ "$(grep -c '"text"' "$tmp/$1.out")" -eq 60 ] && grep -q '^data: \[DONE\]' "$tmp/$1.out" ||
        fail "$1: the stream did not end whole: $(tail -c 300 "$tmp/$1.out")"
}

# --- a stream in flight ends whole; meanwhile /health is 503 and new requests are refused
start_server A --enable-debug-endpoints --debug-step-delay-ms 20
drains A
grep -q '"finish_reason":"length"' "$tmp/A.out" || fail "finish reason: $(tail -c 300 "$tmp/A.out")"
grep -q "draining: 1 request" "$tmp/A.err" || fail "log: $(cat "$tmp/A.err")"

# --- past --shutdown-timeout: what is left ends with finish_reason "abort", then the exit
start_server B --enable-debug-endpoints --debug-step-delay-ms 20 --shutdown-timeout 0.5
stream "$B_URL" 120 "$tmp/b.out"
kill -TERM "$B_PID"
wait "$stream_pid" || fail "the cut stream's client failed (curl exit $?)"
wait "$B_PID" || fail "exit status after the timeout: $(tail -n 5 "$tmp/B.err")"
grep -q '"finish_reason":"abort"' "$tmp/b.out" && grep -q '^data: \[DONE\]' "$tmp/b.out" ||
    fail "the cut stream: $(tail -c 300 "$tmp/b.out")"

# --- a second signal exits at once
start_server C --enable-debug-endpoints --debug-step-delay-ms 20
stream "$C_URL" 120 "$tmp/c.out"
kill -TERM "$C_PID"
sleep 0.2
kill -TERM "$C_PID"
gone "$C_PID" 10 || fail "still running 1 s after a second SIGTERM"
wait "$stream_pid" || true

# --- the router drains the same way: the stream it relays ends whole, new requests get 503
# start_router NAME ARGS...: a router (log $tmp/NAME.err), its URL and pid as start_server's,
# started in the background until its /health says 200 (its workers answered) or 5 s pass
start_router() {
    local name=$1
    shift
    : >"$tmp/$name.err"
    "$TD_BIN" router --host 127.0.0.1 --port 0 --log-level warn "$@" 2>"$tmp/$name.err" &
    server_pids+=("$!")
    wait_listening "$name" "$!" 127.0.0.1
    local url
    url=$(eval echo "\$${name}_URL")
    for _ in $(seq 1 100); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health")" = 200 ] && break
        sleep 0.05
    done
}
start_server E --enable-debug-endpoints --debug-step-delay-ms 20
start_router R --worker "$E_URL"
drains R
# past --shutdown-timeout-secs the router ends a relayed stream with an error event and
# [DONE], and those last bytes reach the client before it exits
start_router R3 --worker "$E_URL" --shutdown-timeout-secs 0.3
stream "$R3_URL" 120 "$tmp/r3.out"
kill -TERM "$R3_PID"
wait "$stream_pid" || fail "the router's cut stream: curl exit $?: $(tail -c 300 "$tmp/r3.out")"
wait "$R3_PID" || fail "router exit status after the timeout: $(tail -n 5 "$tmp/R3.err")"
grep -q 'shutting down' "$tmp/r3.out" && grep -q '^data: \[DONE\]' "$tmp/r3.out" ||
    fail "the router's cut stream did not end with an error event: $(tail -c 300 "$tmp/r3.out")"
"$TD_BIN" router --shutdown-timeout-secs -2 --worker "$E_URL" >"$tmp/out" 2>"$tmp/err" && fail "a negative drain"
grep -q "shutdown-timeout-secs" "$tmp/err" || fail "router flag error: $(cat "$tmp/err")"

# --- a router takes a draining engine out at once (not after --health-failure-threshold
# failed checks), and sends the requests that follow to the other one
start_server G --enable-debug-endpoints --debug-step-delay-ms 20
start_server H
: >"$tmp/R2.err"
"$TD_BIN" router --host 127.0.0.1 --port 0 --log-level warn --worker "$G_URL" --worker "$H_URL" \
    --health-check-interval-secs 0.1 --health-failure-threshold 100 2>"$tmp/R2.err" &
server_pids+=("$!")
wait_listening R2 "$!" 127.0.0.1
for _ in $(seq 1 100); do
    [ "$(curl -s "$R2_URL/workers" | jq '[.workers[] | select(.healthy and .reachable)] | length')" = 2 ] && break
    sleep 0.05
done
stream "$G_URL" 100 "$tmp/g.out"
kill -TERM "$G_PID"
out=""
for _ in $(seq 1 40); do
    out=$(curl -s "$R2_URL/workers" | jq -r ".workers[] | select(.url == \"$G_URL\") | .healthy")
    [ "$out" = false ] && break
    sleep 0.05
done
[ "$out" = false ] || fail "the draining engine is still healthy at the router after 2 s"
for _ in 1 2 3 4; do
    code=$(curl -s -o "$tmp/x" -w '%{http_code}' "$R2_URL/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt":[1,306],"max_tokens":2}')
    [ "$code" = 200 ] || fail "a request after the drain began: $code $(cat "$tmp/x")"
done
wait "$stream_pid" || fail "the stream on the draining engine failed (curl exit $?)"

# --- stopping `tandem up` (1P1D) loses nothing: the router drains first, then the engines
W="$tmp/up"
start_up "$W" -- --enable-debug-endpoints --debug-step-delay-ms 20
pids=$(jq '.instances[].pid' "$W/cluster.json")
stream "$UP_URL" 60 "$tmp/u.out"
kill -TERM "$UP"
wait "$stream_pid" || fail "the stream through tandem up failed (curl exit $?)"
wait "$UP" || fail "tandem up exit status: $(tail -n 5 "$tmp/up.err")"
[ "$(grep -c '"text"' "$tmp/u.out")" -eq 60 ] && grep -q '^data: \[DONE\]' "$tmp/u.out" ||
    fail "the stream through tandem up did not end whole: $(tail -c 300 "$tmp/u.out")"
for p in $pids; do kill -0 "$p" 2>/dev/null && fail "process $p outlived tandem up"; done

# --- two signals at once (Ctrl-C, then a supervisor's SIGTERM, before `up` began to stop):
# the second is passed on too, so the cluster stops at once rather than after a drain
W="$tmp/up2"
start_up "$W" -- --enable-debug-endpoints --debug-step-delay-ms 50
pids=$(jq '.instances[].pid' "$W/cluster.json")
stream "$UP_URL" 120 "$tmp/u2.out" # 6 s at 50 ms a token
sleep 0.5
kill -INT "$UP"
kill -TERM "$UP"
wait "$UP" || true
wait "$stream_pid" || true
[ "$(grep -c '"text"' "$tmp/u2.out")" -lt 120 ] || fail "the stream ran to its end after two signals (a drain)"
for p in $pids; do kill -0 "$p" 2>/dev/null && fail "process $p outlived tandem up"; done

# --- prompt KV held for a consumer keeps a producer up until it is released
start_server P --kv-transfer-config '{"kv_role":"kv_producer"}'
curl -s "$P_URL/v1/completions" -H 'Content-Type: application/json' -d \
    '{"prompt":[1,306,400],"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true}}' >"$tmp/p.json"
tid=$(jq -r .kv_transfer_params.transfer_id "$tmp/p.json")
[ -n "$tid" ] && [ "$tid" != null ] || fail "no transfer id: $(cat "$tmp/p.json")"
kill -TERM "$P_PID"
sleep 0.5
kill -0 "$P_PID" 2>/dev/null || fail "the producer exited with KV still held"
grep -q "1 KV lease(s) held" "$tmp/P.err" || fail "log: $(cat "$tmp/P.err")"
code=$(curl -s -o "$tmp/r" -w '%{http_code}' "$P_URL/kv_release" -H 'Content-Type: application/json' \
    -d "{\"transfer_id\":\"$tid\"}")
[ "$code" = 200 ] || fail "kv_release: $code $(cat "$tmp/r")"
wait "$P_PID" || fail "producer exit status: $(tail -n 5 "$tmp/P.err")"
echo ok
