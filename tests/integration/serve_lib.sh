# Helpers for the `tandem serve` integration tests (sourced, not run by ctest: the glob
# only picks up test_*.sh). start_server NAME ARGS... starts a server on an ephemeral
# loopback port and sets ${NAME}_URL and ${NAME}_PID; every server is killed at exit.
: "${TD_BIN:?set TD_BIN to the tandem binary}"
SHARED=${TD_SHARED_DIR:-../shared}
[ -d "$SHARED/models" ] || { echo "shared data missing at '$SHARED': set TD_SHARED_DIR" >&2; exit 1; }
MODEL="$SHARED/models/stories260K.gguf"
TESTS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
server_pids=()
cleanup() {
    for p in "${server_pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${server_pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# Under set -e a failing command (a curl in $(...), a wait on a client) ends the test with
# no word; say which one, and where.
set -E
trap 'rc=$?; echo "FAIL: $(basename "$0") line $LINENO: \"$BASH_COMMAND\" exited $rc" >&2' ERR

start_server() {
    local name=$1
    shift
    : >"$tmp/$name.err" # exists before the server opens it: sed below must not race it
    "$TD_BIN" serve --model "$MODEL" --threads 2 --host 127.0.0.1 --server-port 0 \
        --log-level warn "$@" 2>"$tmp/$name.err" &
    local pid=$!
    server_pids+=("$pid")
    wait_listening "$name" "$pid" 127.0.0.1
}

# wait_listening NAME PID HOST: wait for server NAME (process PID, log $tmp/NAME.err) to
# print its port; sets ${NAME}_URL (http://HOST:port) and ${NAME}_PID.
wait_listening() {
    local name=$1 pid=$2 host=$3 port=""
    for _ in $(seq 1 600); do
        port=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$tmp/$name.err" | head -n 1)
        [ -n "$port" ] && break
        kill -0 "$pid" 2>/dev/null || fail "server $name exited: $(cat "$tmp/$name.err")"
        sleep 0.1
    done
    [ -n "$port" ] || fail "server $name did not start: $(cat "$tmp/$name.err")"
    printf -v "${name}_URL" 'http://%s:%s' "$host" "$port"
    printf -v "${name}_PID" '%s' "$pid"
}

# expect_flag_error "substring of stderr" serve-args...: `tandem serve` refuses to start (exit 2)
# with that message.
expect_flag_error() {
    local want=$1
    shift
    local rc=0
    "$TD_BIN" serve --model "$MODEL" --threads 1 --server-port 0 "$@" >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] || fail "serve $* exited $rc, expected 2: $(cat "$tmp/err")"
    grep -qF -- "$want" "$tmp/err" || fail "serve $*: stderr lacks '$want': $(cat "$tmp/err")"
}

# start_up WORKDIR [up args...] [-- serve args...]: `tandem up` on stories260K with a free
# router port, its output in $tmp/up.out and $tmp/up.err; waits until it is ready and sets
# UP (its pid) and UP_URL (the router's URL).
start_up() {
    local w=$1
    shift
    "$TD_BIN" up --model "$MODEL" --port 0 --workdir "$w" "$@" >"$tmp/up.out" 2>"$tmp/up.err" &
    UP=$!
    server_pids+=("$UP")
    for _ in $(seq 1 300); do
        grep -q '^ready:' "$tmp/up.out" && break
        kill -0 "$UP" 2>/dev/null || fail "tandem up exited: $(cat "$tmp/up.err")"
        sleep 0.1
    done
    grep -q '^ready:' "$tmp/up.out" || fail "tandem up not ready: $(cat "$tmp/up.err")"
    UP_URL=$(sed -n 's/^tandem up: \(http[^ ]*\).*/\1/p' "$tmp/up.out")
}
