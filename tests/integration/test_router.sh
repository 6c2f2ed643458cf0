#!/usr/bin/env bash
# `tandem router` with real `tandem serve` instances over loopback: the tests in
# node/router.test.mjs (node's built-in runner and the official openai client; they
# start and kill the processes themselves), plus the router's start-up checks.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v node >/dev/null || fail "node is required for the router tests (apt-get install nodejs)"
[ -d "$TESTS_DIR/node/node_modules/openai" ] ||
    fail "tests/integration/node/node_modules is missing: run 'npm ci' in tests/integration/node (scripts/test.sh does)"

# Flags: unknown ones, bad values and impossible combinations are errors that name them.
expect_usage_error() {
    local want=$1
    shift
    local rc=0
    "$TD_BIN" router "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] || fail "router $* exited $rc, expected 2: $(cat "$tmp/err")"
    grep -q -- "$want" "$tmp/err" || fail "router $*: expected '$want' in: $(cat "$tmp/err")"
}
expect_usage_error "unknown option '--prefil'" --pd-disaggregation --prefil http://127.0.0.1:1
expect_usage_error "policy" --worker http://127.0.0.1:1 --policy fastest
expect_usage_error "pd-disaggregation" --prefill http://127.0.0.1:1 --decode http://127.0.0.1:2
expect_usage_error "http://" --worker 127.0.0.1:1
expect_usage_error "rank-mapping" --worker http://127.0.0.1:1 --atom-pd-rank-mapping-policy all
expect_usage_error "max-payload-size" --worker http://127.0.0.1:1 --max-payload-size 10
# The same worker twice (a trailing slash or the host's case make no other worker).
expect_usage_error "out of range" --worker http://127.0.0.1:1 --retry-max-retries 4294967297
expect_usage_error "out of range" --worker http://127.0.0.1:1 --cb-failure-threshold -4294967295
expect_usage_error "given twice" --worker http://127.0.0.1:1 --worker http://127.0.0.1:1/
expect_usage_error "given twice" --pd-disaggregation --prefill http://h:1 --prefill http://H:1 --decode http://h:2
# Durations past 1e7 s would overflow the timers: refused rather than broken.
for f in --request-timeout-secs --queue-timeout-secs --health-check-interval-secs --cb-timeout-duration-secs \
    --retry-max-backoff-secs; do
    expect_usage_error "at most 1e7" --worker http://127.0.0.1:1 "$f" 1e10
done

TD_BIN=$TD_BIN TD_MODEL=$MODEL node --test --test-reporter=spec "$TESTS_DIR/node/router.test.mjs" ||
    fail "node/router.test.mjs failed"
