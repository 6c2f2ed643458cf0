#!/usr/bin/env bash
# `tandem serve` with the official `openai` npm client (tests/integration/node). The
# package is installed by scripts/test.sh and .ci/run (`npm ci` there); this test never
# reaches the network, and fails clearly when the install is missing.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v node >/dev/null || fail "node is required (apt-get install nodejs npm)"
[ -d "$TESTS_DIR/node/node_modules/openai" ] ||
    fail "tests/integration/node/node_modules is missing: run 'npm ci' in tests/integration/node (scripts/test.sh does)"
start_server MAIN --chat-template chatml --served-model-name stories
TD_URL=$MAIN_URL TD_MODEL_NAME=stories node --test --test-reporter=spec \
    "$TESTS_DIR/node/openai.test.mjs" || fail "node/openai.test.mjs failed: $(tail -n 20 "$tmp/MAIN.err")"
echo "ok"
