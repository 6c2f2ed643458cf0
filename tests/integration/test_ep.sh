#!/usr/bin/env bash
# Expert parallelism between the data-parallel ranks of one `tandem serve`: MoE models made
# by `tandem mkmodel` (llama with experts, and qwen2moe with its shared expert), then
# node/ep.test.mjs: identical greedy output with and without expert parallelism,
# aggregated and through prefill/decode for every rank pair, the exchange memory apart
# from the KV pools, a stopped rank, bad flag combinations.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v node >/dev/null || fail "node is required for the server tests (apt-get install nodejs)"
"$TD_BIN" mkmodel --out "$tmp/moe.gguf" --preset moe-tiny --seed 4 >/dev/null
"$TD_BIN" mkmodel --out "$tmp/q2.gguf" --preset qwen2moe-tiny --seed 5 >/dev/null
"$TD_BIN" mkmodel --out "$tmp/all.gguf" --preset moe-tiny --experts 2 --experts-used 2 --seed 6 >/dev/null
TD_BIN=$TD_BIN TD_MOE_MODELS="$tmp/moe.gguf,$tmp/q2.gguf" TD_MOE_ALL_EXPERTS="$tmp/all.gguf" TD_DENSE_MODEL=$MODEL \
    node --test --test-reporter=spec "$TESTS_DIR/node/ep.test.mjs" || fail "node/ep.test.mjs failed"
