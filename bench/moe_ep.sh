#!/usr/bin/env bash
# MoE serving on the CPU: one engine, two data-parallel ranks each holding every expert,
# and two ranks splitting the experts (--enable-expert-parallel), the same `tandem bench`
# against each (greedy, ignore_eos). Prints the figures BENCHMARKS.md records.
#   bench/moe_ep.sh [MODEL_PRESET] [DTYPE]   (default moe-1b q8_0; results in bench/results/moe/)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-moe-1b} dtype=${2:-q8_0} out=bench/results/moe
mkdir -p "$out"
bin=build/tandem
run() { # LABEL PORT serve-args...
    local label=$1 port=$2
    shift 2
    "$bin" serve --load-format dummy --model "$preset" --dtype "$dtype" --threads "$(nproc)" \
        --server-port "$port" --log-level warn "$@" 2>"$out/$label.log" &
    local pid=$!
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
    "$bin" bench --base-url "http://127.0.0.1:$port" --input-len 64 --output-len 32 --ignore-eos \
        --num-prompts 32 --max-concurrency 8 --seed 1 --label "$label" --save-result "$out/$label.json" 2>&1 |
        grep -E "Output token throughput|Median TTFT|Median TPOT|Successful"
    kill $pid
    wait $pid || true
}
echo "== $preset $dtype, $(nproc) CPUs: one engine"; run one 8451
echo "== two data-parallel ranks, every expert on each"; run dp2 8452 --dp 2
echo "== two ranks splitting the experts"; run dp2-ep 8453 --dp 2 --enable-dp-attention --enable-expert-parallel
"$bin" bench --compare "$out/one.json" "$out/dp2.json" "$out/dp2-ep.json" --plot "$out/compare.svg" 2>&1 || true
