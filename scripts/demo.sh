#!/usr/bin/env bash
# The main job: a local prefill + decode + router cluster on a model at a real shape
# (llama-134m, random weights, the Llama-2 vocabulary) answering one request through the
# router, then the answer and how its KV moved. Needs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${TD_SHARED_DIR:-../shared}
model=build/llama-134m-f16.gguf
if [ ! -f "$model" ]; then
    vocab=()
    [ -f "$SHARED/tokenizer/ggml-vocab-llama-spm.gguf" ] && vocab=(--vocab-from "$SHARED/tokenizer/ggml-vocab-llama-spm.gguf")
    build/tandem mkmodel --preset llama-134m --type f16 "${vocab[@]}" --out "$model"
fi

logs=$(mktemp -d)
pids=()
stop() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$logs"
}
trap stop EXIT

# start NAME ARGS...: run `tandem ARGS` in the background, wait for its "listening on"
# line, and set NAME_URL.
start() {
    local name=$1
    shift
    build/tandem "$@" 2>"$logs/$name.log" &
    pids+=($!)
    local port=""
    for _ in $(seq 1 600); do
        port=$(sed -n 's/^listening on .*:\([0-9]*\)$/\1/p' "$logs/$name.log" | head -n 1)
        [ -n "$port" ] && break
        kill -0 "${pids[-1]}" 2>/dev/null || { cat "$logs/$name.log" >&2; exit 1; }
        sleep 0.1
    done
    [ -n "$port" ] || { echo "$name did not start" >&2; cat "$logs/$name.log" >&2; exit 1; }
    printf -v "${name}_URL" 'http://127.0.0.1:%s' "$port"
    echo "$name: http://127.0.0.1:$port"
}

engine=(serve --model "$model" --threads 1 --host 127.0.0.1 --server-port 0 --log-level warn
    --kv-cache-memory 256M)
start prefill "${engine[@]}" --kv-transfer-config '{"kv_role":"kv_producer"}'
start decode "${engine[@]}" --kv-transfer-config '{"kv_role":"kv_consumer"}'
start router router --host 127.0.0.1 --port 0 --log-level warn --pd-disaggregation \
    --prefill "$prefill_URL" --decode "$decode_URL"
for _ in $(seq 1 100); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$router_URL/health")" = 200 ] && break
    sleep 0.1
done

echo
echo "POST $router_URL/v1/completions  {\"prompt\": \"Once upon a time\", \"max_tokens\": 32}"
answer=$(curl -s "$router_URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt":"Once upon a time","max_tokens":32,"temperature":0}')
echo "$answer" | jq -r '"text: " + .choices[0].text'
echo "$answer" | jq -c '.kv_transfer_params | {kv_load, transferred_blocks, transferred_bytes, timing}'
