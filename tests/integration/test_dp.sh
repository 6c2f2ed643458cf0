#!/usr/bin/env bash
# Data-parallel ranks in one `tandem serve` (--data-parallel-size): flag checks, then
# node/dp.test.mjs (aggregated, prefill/decode for every rank pair, the router's
# --dp-aware mode, a stopped rank), with real processes over loopback.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v node >/dev/null || fail "node is required for the server tests (apt-get install nodejs)"

expect_flag_error "--data-parallel-size must be in [1, 64], got 0" --data-parallel-size 0
expect_flag_error "--data-parallel-size must be in [1, 64], got 65" --dp 65
expect_flag_error "needs --data-parallel-size 2 or more" --enable-expert-parallel
expect_flag_error "expert parallelism needs a mixture-of-experts model (llama has no experts)" --dp 2 --enable-expert-parallel

TD_BIN=$TD_BIN TD_MODEL=$MODEL node --test --test-reporter=spec "$TESTS_DIR/node/dp.test.mjs" ||
    fail "node/dp.test.mjs failed"
