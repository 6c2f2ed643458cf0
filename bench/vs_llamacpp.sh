#!/usr/bin/env bash
# The engine against llama.cpp on the same machine, model by model in the same minutes:
# llama-bench (pp512, tg128, 2 threads) then `tandem bench-engine` on the same llama-134m
# files (f32, f16, q8_0, made by mkmodel on first use), as BENCHMARKS.md records them.
# llama.cpp is not part of tandem: build it yourself and point LLAMA_BENCH at llama-bench.
# Usage: LLAMA_BENCH=/path/to/llama-bench bench/vs_llamacpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LB=${LLAMA_BENCH:?set LLAMA_BENCH to a llama.cpp llama-bench binary}
[ -x "$LB" ] || { echo "vs_llamacpp.sh: $LB is not an executable" >&2; exit 2; }
T=build/tandem
mkdir -p build/models
printf '%-6s %12s %12s %7s %12s %12s %7s\n' type "llama.cpp pp" "tandem pp" ratio "llama.cpp tg" "tandem tg" ratio
for type in f32 f16 q8_0; do
    m=build/models/llama-134m-$type.gguf
    [ -f "$m" ] || $T mkmodel --preset llama-134m --type "$type" --out "$m" >/dev/null
    lb=$("$LB" -m "$m" -p 512 -n 128 -t 2 -r 3 -o csv 2>/dev/null)
    # llama-bench's CSV: a header, then a row per test; columns found by name
    col() { echo "$lb" | tr -d '"' | awk -F, -v p="$1" -v g="$2" 'NR == 1 {
        for (i = 1; i <= NF; i++) c[$i] = i; next }
        $c["n_prompt"] == p && $c["n_gen"] == g { print $c["avg_ts"] }'; }
    lpp=$(col 512 0)
    ltg=$(col 0 128)
    if [ -z "$lpp" ] || [ -z "$ltg" ]; then
        echo "vs_llamacpp.sh: no pp512/tg128 rows from $LB" >&2
        exit 1
    fi
    te=$($T bench-engine --model "$m" --threads 2 --prompt-len 512 --log-level warn 2>&1)
    tpp=$(echo "$te" | awk '/^pp512/ {print $3}')
    ttg=$(echo "$te" | awk '/^tg128@b1/ {print $3}')
    awk -v t="$type" -v a="$lpp" -v b="$tpp" -v c="$ltg" -v d="$ttg" 'BEGIN {
        printf "%-6s %12.1f %12.1f %6.2fx %12.1f %12.1f %6.2fx\n", t, a, b, b / a, c, d, d / c }'
done
