#!/usr/bin/env bash
# The main job: a model at a real shape (llama-134m, random weights, the Llama-2
# vocabulary) answering a prompt. Needs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${TD_SHARED_DIR:-../shared}
model=build/llama-134m-f16.gguf
if [ ! -f "$model" ]; then
    vocab=()
    [ -f "$SHARED/tokenizer/ggml-vocab-llama-spm.gguf" ] && vocab=(--vocab-from "$SHARED/tokenizer/ggml-vocab-llama-spm.gguf")
    build/tandem mkmodel --preset llama-134m --type f16 "${vocab[@]}" --out "$model"
fi
build/tandem generate --model "$model" --prompt "Once upon a time" -n 32
