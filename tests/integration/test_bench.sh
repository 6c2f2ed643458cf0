#!/usr/bin/env bash
# `tandem bench` against a real `tandem serve` on stories260K: a closed-loop run, a paced
# run with a goodput SLO, a chat run, --compare with its SVG, and usage errors (exit 2).
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v jq >/dev/null || fail "jq is needed"

# One server for both endpoints: stories260K has no chat template, so name one. Each engine
# step sleeps 2 ms: stories260K makes 8 tokens in well under a millisecond, and a request
# whose tokens all arrive in one read has a TPOT of 0 (seen on a loaded 2-core machine).
start_server s --chat-template chatml --enable-debug-endpoints --debug-step-delay-ms 2

# A result file's latency fields must be numbers above 0. (A median or p99 gap between
# token events may be 0: events that arrive in one read share a timestamp.)
check_result() {
    local f=$1 n=$2 label=$3
    [ "$(jq .completed "$f")" = "$n" ] || fail "$f: completed is not $n: $(jq -c .errors "$f")"
    [ "$(jq .failed "$f")" = 0 ] || fail "$f: failed requests: $(jq .errors "$f")"
    for m in ttft tpot itl e2el; do
        for s in mean median p99; do
            min=0
            [ "$m" = itl ] && [ "$s" != mean ] && min=-1
            jq -e ".${s}_${m}_ms | type == \"number\" and . > $min" "$f" >/dev/null ||
                fail "$f: ${s}_${m}_ms is not a number > $min: $(jq ".${s}_${m}_ms" "$f")"
        done
    done
    for m in output_throughput request_throughput total_token_throughput duration; do
        jq -e ".$m > 0" "$f" >/dev/null || fail "$f: $m is not > 0"
    done
    [ "$(jq -r .label "$f")" = "$label" ] || fail "$f: label is not $label"
    [ "$(jq .total_output_tokens "$f")" = $((n * 8)) ] || fail "$f: not 8 tokens a request"
}

common=(--num-prompts 8 --input-len 32 --output-len 8 --ignore-eos --vocab 512)

"$TD_BIN" bench --base-url "$s_URL" "${common[@]}" --max-concurrency 4 \
    --save-result "$tmp/r.json" --label t >"$tmp/r.out" 2>"$tmp/r.err" ||
    fail "bench failed: $(cat "$tmp/r.err" "$tmp/r.out")"
check_result "$tmp/r.json" 8 t
[ "$(jq .max_concurrency "$tmp/r.json")" = 4 ] || fail "max_concurrency not saved"
grep -q "Serving Benchmark Result" "$tmp/r.out" || fail "no summary table: $(cat "$tmp/r.out")"
grep -q "Median TPOT (ms)" "$tmp/r.out" || fail "no TPOT rows"
# stderr is not a TTY here: no progress bar
if grep -q $'\r' "$tmp/r.err"; then fail "progress bar written to a non-TTY"; fi
# tandem reports usage.timings: the breakdown is there
jq -e '.mean_server_ttft_ms | type == "number"' "$tmp/r.json" >/dev/null ||
    fail "no server-reported timings"

# The same prompts again (the same --seed, the same server): the server's prefix cache
# answers their full blocks, bench counts those tokens and warns that the run measured
# cached prefills. The first run's prompts were new to the server (no warning there).
grep -q "prefix cache" "$tmp/r.err" && fail "a first run warned of cached prompts: $(cat "$tmp/r.err")"
"$TD_BIN" bench --base-url "$s_URL" "${common[@]}" --max-concurrency 4 \
    --save-result "$tmp/again.json" --label t >"$tmp/again.out" 2>"$tmp/again.err" ||
    fail "bench failed: $(cat "$tmp/again.err")"
jq -e '.total_cached_tokens >= 8 * 16' "$tmp/again.json" >/dev/null ||
    fail "repeated prompts: total_cached_tokens is $(jq .total_cached_tokens "$tmp/again.json")"
grep -q "Prompt tokens from the prefix cache" "$tmp/again.out" || fail "no cached-tokens row"
grep -q "came from the server's prefix cache" "$tmp/again.err" ||
    fail "no warning for repeated prompts: $(cat "$tmp/again.err")"

# Poisson arrivals at 50 req/s, a goodput SLO every request meets, a prefix, two goodput terms.
"$TD_BIN" bench --base-url "$s_URL/" "${common[@]}" --request-rate 50 --seed 3 \
    --goodput ttft:10000 e2el:60000 --prefix-len 8 --max-concurrency 8 \
    --save-result "$tmp/r2.json" --label t >"$tmp/r2.out" 2>"$tmp/r2.err" ||
    fail "paced bench failed: $(cat "$tmp/r2.err")"
check_result "$tmp/r2.json" 8 t
jq -e '.goodput > 0 and .request_rate == 50' "$tmp/r2.json" >/dev/null ||
    fail "goodput/request_rate wrong: $(jq '{goodput, request_rate}' "$tmp/r2.json")"
grep -q "Request goodput" "$tmp/r2.out" || fail "no goodput row"
[ "$(jq .total_input_tokens "$tmp/r2.json")" = $((8 * 40)) ] || fail "prefix tokens not sent"

# Chat: text prompts of random words (fewer: a word can be several tokens, and the template
# adds some, within stories260K's 128-token context).
"$TD_BIN" bench --base-url "$s_URL" --endpoint /v1/chat/completions "${common[@]}" --input-len 16 \
    --max-concurrency 2 --save-result "$tmp/chat.json" --label chat \
    >"$tmp/chat.out" 2>"$tmp/chat.err" || fail "chat bench failed: $(cat "$tmp/chat.err")"
check_result "$tmp/chat.json" 8 chat

# A prompts file, with a model name given: no token ids, text prompts.
printf 'Once upon a time\n\nThe cat sat\n' >"$tmp/prompts.txt"
"$TD_BIN" bench --base-url "$s_URL" --dataset prompts --dataset-path "$tmp/prompts.txt" \
    --num-prompts 3 --output-len 8 --ignore-eos --model "$MODEL" --percentiles 99.9 \
    --save-result "$tmp/p.json" >"$tmp/p.out" 2>"$tmp/p.err" ||
    fail "prompts bench failed: $(cat "$tmp/p.err")"
jq -e '.completed == 3 and .failed == 0 and (."p99.9_ttft_ms" > 0)' "$tmp/p.json" >/dev/null ||
    fail "prompts run: $(cat "$tmp/p.json")"

# --compare: a table with both labels, and an SVG plot.
"$TD_BIN" bench --compare "$tmp/r.json" "$tmp/chat.json" "$tmp/r2.json" --plot "$tmp/c.svg" \
    >"$tmp/cmp.out" 2>"$tmp/cmp.err" || fail "compare failed: $(cat "$tmp/cmp.err")"
grep -q "<svg" "$tmp/c.svg" || fail "no SVG written"
grep -q "</svg>" "$tmp/c.svg" || fail "SVG not finished"
grep -q "median TTFT" "$tmp/cmp.out" || fail "no compare table: $(cat "$tmp/cmp.out")"
head -n 1 "$tmp/cmp.out" | grep -q "chat" || fail "labels missing from the header"
# A value past any scale (the plot leaves it out, and ends) and a long non-ASCII label (cut
# between characters): still a well-formed SVG. The percentile key keeps every digit.
jq '.median_ttft_ms = 1.7e308 | .label = ("é" * 40) + "\u0001"' "$tmp/r.json" >"$tmp/odd.json"
timeout 20 "$TD_BIN" bench --compare "$tmp/odd.json" "$tmp/r2.json" --plot "$tmp/odd.svg" >"$tmp/odd.out" \
    2>"$tmp/odd.err" || fail "compare of odd values: $(cat "$tmp/odd.err")"
[ "$(stat -c %s "$tmp/odd.svg")" -lt 100000 ] || fail "the SVG of odd values is $(stat -c %s "$tmp/odd.svg") bytes"
python3 -c 'import sys, xml.dom.minidom; xml.dom.minidom.parse(sys.argv[1])' "$tmp/odd.svg" ||
    fail "the SVG of odd values is not well-formed XML"
python3 -c 'import sys; open(sys.argv[1], encoding="utf-8").read()' "$tmp/odd.out" || fail "the table cut a character"

# Behind a router that wants an API key: OPENAI_API_KEY goes with the requests and with
# the model lookup (no --model given).
: >"$tmp/rk.err"
"$TD_BIN" router --host 127.0.0.1 --port 0 --worker "$s_URL" --api-key k1 --log-level warn \
    2>"$tmp/rk.err" &
rk=$!
server_pids+=("$rk")
wait_listening rk "$rk" 127.0.0.1
for _ in $(seq 100); do curl -sf "$rk_URL/health" >/dev/null && break; sleep 0.1; done
OPENAI_API_KEY=k1 "$TD_BIN" bench --base-url "$rk_URL" --num-prompts 2 --input-len 4 --output-len 2 \
    --vocab 512 --save-result "$tmp/key.json" >/dev/null 2>"$tmp/key.err" ||
    fail "bench with an API key: $(cat "$tmp/key.err")"
jq -e '.completed == 2 and .failed == 0' "$tmp/key.json" >/dev/null || fail "API key run: $(cat "$tmp/key.json")"
! grep -q "sending no model name" "$tmp/key.err" || fail "the model lookup went without the key: $(cat "$tmp/key.err")"
kill "$rk" 2>/dev/null || true

# --compare refuses a JSON file that is not a bench result.
echo '{"a":1}' >"$tmp/not-a-result.json"
rc=0
"$TD_BIN" bench --compare "$tmp/r.json" "$tmp/not-a-result.json" --plot "$tmp/x.svg" >/dev/null \
    2>"$tmp/cmp2.err" || rc=$?
[ "$rc" != 0 ] || fail "--compare took a file that is not a result"
grep -q "not a tandem bench result" "$tmp/cmp2.err" || fail "--compare: $(cat "$tmp/cmp2.err")"

# A server that accepts the connection and never answers: each request fails after
# --idle-timeout, and the run ends.
command -v node >/dev/null || fail "node is needed"
node -e 'const s = require("net").createServer(() => {}).listen(0, "127.0.0.1", () => console.log(s.address().port))' \
    >"$tmp/silent.port" &
silent=$!
for _ in $(seq 50); do [ -s "$tmp/silent.port" ] && break; sleep 0.1; done
rc=0
timeout 60 "$TD_BIN" bench --base-url "http://127.0.0.1:$(cat "$tmp/silent.port")" --model x \
    --num-prompts 2 --input-len 4 --output-len 2 --idle-timeout 1 --save-result "$tmp/silent.json" \
    >/dev/null 2>&1 || rc=$?
kill "$silent" 2>/dev/null || true
[ "$rc" = 1 ] || fail "bench against a silent server exited $rc, not 1"
jq -e '.failed == 2 and (.errors | tostring | test("timeout"))' "$tmp/silent.json" >/dev/null ||
    fail "silent server: $(jq -c .errors "$tmp/silent.json")"

# A server that is not there: requests fail with a reason, and the exit status is 1.
rc=0
"$TD_BIN" bench --base-url http://127.0.0.1:1 --model x --num-prompts 2 --input-len 4 \
    --output-len 2 --save-result "$tmp/dead.json" >/dev/null 2>&1 || rc=$?
[ "$rc" = 1 ] || fail "bench against nothing exited $rc, not 1"
jq -e '.failed == 2 and .completed == 0' "$tmp/dead.json" >/dev/null || fail "failures not saved"

# Usage errors exit 2.
expect_usage_error() {
    local rc=0
    "$TD_BIN" bench "$@" >/dev/null 2>&1 || rc=$?
    [ "$rc" = 2 ] || fail "'bench $*' exited $rc, not 2"
}
expect_usage_error --base-url "$s_URL" --no-such-flag
expect_usage_error --base-url "$s_URL" --endpoint /bad
expect_usage_error --base-url "$s_URL" --goodput nonsense
expect_usage_error --base-url "$s_URL" --goodput ttft:abc
expect_usage_error --base-url "$s_URL" --request-rate -3
expect_usage_error --base-url "$s_URL" --percentiles 50,abc
expect_usage_error --base-url "$s_URL" --percentiles 99,99
expect_usage_error --base-url "$s_URL" --dataset sharegpt
expect_usage_error --num-prompts 3
expect_usage_error --base-url "$s_URL" --idle-timeout -1
expect_usage_error --base-url "$s_URL" --num-prompts 1 --save-result "$tmp/no-such-dir/r.json"
# `tandem bench-serve` (the server-overhead benchmark) runs its rounds against a server it
# starts and prints both rates and their ratio; every stream of every round must complete.
"$TD_BIN" bench-serve --model "$MODEL" --threads 1 --streams 8 --prompt-len 16 --max-tokens 8 \
    --rounds 2 --log-level warn >"$tmp/bs.out" 2>"$tmp/bs.err" || fail "bench-serve failed: $(cat "$tmp/bs.err")"
[ "$(grep -c '^HTTP, kept-alive .*: 8 streams x 8 tokens: 64 tokens in' "$tmp/bs.out")" = 2 ] ||
    fail "bench-serve: two HTTP rounds of 64 tokens expected: $(cat "$tmp/bs.out")"
[ "$(grep -c '^C API.*: 8 streams x 8 tokens: 64 tokens in' "$tmp/bs.out")" = 3 ] ||
    fail "bench-serve: a warm-up and two C-API rounds of 64 tokens expected: $(cat "$tmp/bs.out")"
grep -q '^ratio : HTTP / C API = [0-9.]* end to end' "$tmp/bs.out" || fail "bench-serve: no ratio: $(cat "$tmp/bs.out")"
rc=0
"$TD_BIN" bench-serve --model "$MODEL" --rounds 0 >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "bench-serve --rounds 0 exited $rc, not 2"
echo "PASS: test_bench"
