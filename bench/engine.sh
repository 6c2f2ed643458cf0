#!/usr/bin/env bash
# The engine benchmark set recorded in BENCHMARKS.md: stories260K (96-token prompt, its
# context is 128) and the llama-134m shape in f32, f16 and q8_0, 2 threads.
# Usage: bench/engine.sh [extra bench-engine flags]
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${TD_SHARED_DIR:-../shared}
T=build/tandem
mkdir -p build/models
echo "### stories260K (f32)"
$T bench-engine --model "$SHARED/models/stories260K.gguf" --threads 2 --prompt-len 96 --gen-len 127 --log-level warn "$@"
for type in f32 f16 q8_0; do
    m=build/models/llama-134m-$type.gguf
    [ -f "$m" ] || $T mkmodel --preset llama-134m --type "$type" --out "$m" >/dev/null
    echo "### llama-134m ($type)"
    $T bench-engine --model "$m" --threads 2 --prompt-len 512 --log-level warn "$@"
done
