#!/usr/bin/env bash
# Prefill/decode disaggregation with real processes over loopback: the equivalence test
# and the fault tests in node/pd.test.mjs (node's built-in test runner; it starts and
# kills the `tandem serve` processes itself), plus the start-up checks of the KV roles.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v node >/dev/null || fail "node is required for the server tests (apt-get install nodejs)"

# --- a port collision between two agents on one host is a clear error
start_server A --kv-transfer-config '{"kv_role":"kv_producer"}'
agent_port=$(sed -n 's/^kv transfer agent on [^:]*:\([0-9]*\) .*/\1/p' "$tmp/A.err")
[ -n "$agent_port" ] || fail "no agent line: $(cat "$tmp/A.err")"
rc=0
"$TD_BIN" serve --model "$MODEL" --threads 1 --server-port 0 \
    --kv-transfer-config "{\"kv_role\":\"kv_producer\",\"handshake_port\":$agent_port}" \
    >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -ne 0 ] || fail "a second agent on port $agent_port started"
grep -q "127.0.0.1:$agent_port" "$tmp/err" || fail "collision message: $(cat "$tmp/err")"
grep -qi "own port\|in use" "$tmp/err" || fail "collision message: $(cat "$tmp/err")"

TD_BIN=$TD_BIN TD_MODEL=$MODEL node --test --test-reporter=spec "$TESTS_DIR/node/pd.test.mjs" ||
    fail "node/pd.test.mjs failed"
