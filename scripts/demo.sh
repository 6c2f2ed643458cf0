#!/usr/bin/env bash
# The main job: `tandem up` starts a local cluster (a router, one prefill and one decode
# engine) on a model at a real shape (llama-134m, random weights, the Llama-2 vocabulary),
# one request goes through the router, and the answer and how its KV moved are printed.
# Needs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${TD_SHARED_DIR:-../shared}
model=build/llama-134m-f16.gguf
if [ ! -f "$model" ]; then
    vocab=()
    [ -f "$SHARED/tokenizer/ggml-vocab-llama-spm.gguf" ] && vocab=(--vocab-from "$SHARED/tokenizer/ggml-vocab-llama-spm.gguf")
    build/tandem mkmodel --preset llama-134m --type f16 "${vocab[@]}" --out "$model"
fi

work=$(mktemp -d)
build/tandem up --model "$model" --port 0 --workdir "$work" -- --kv-cache-memory 256M \
    >"$work/up.out" &
up=$!
trap 'kill $up 2>/dev/null; wait $up 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 600); do
    grep -q '^ready:' "$work/up.out" && break
    kill -0 $up 2>/dev/null || exit 1
    sleep 0.1
done
grep -v '^ready:' "$work/up.out"
router=$(sed -n 's/^tandem up: \(http[^ ]*\).*/\1/p' "$work/up.out")

echo
echo "POST $router/v1/completions  {\"prompt\": \"Once upon a time\", \"max_tokens\": 32}"
answer=$(curl -s "$router/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt":"Once upon a time","max_tokens":32,"temperature":0}')
echo "$answer" | jq -r '"text: " + .choices[0].text'
echo "$answer" | jq -c '.kv_transfer_params | {kv_load, transferred_blocks, transferred_bytes, timing}'
