#!/usr/bin/env bash
# The seed's table at CPU scale (issue 6): output throughput, median TTFT and median TPOT
# at concurrency 1, 4 and 16, input 512 / output 128 tokens, llama-134m f16 (random
# weights, mkmodel), the machine's cores split evenly, for:
#   1P1D over tcp, 1P1D over shm, 1P1D in push mode, and one aggregated engine.
# Each configuration is a `tandem up` cluster; each level runs 2 x concurrency requests
# (as the llama.cpp anchor in ../shared/anchors.md did), with prompts no earlier level
# sent (a seed per level), so that no prefill is a prefix-cache hit. Results go to bench/results/,
# the comparison table to stdout and the plot to bench/seed_table.svg.
# Usage: bench/seed_table.sh [extra tandem bench flags]
# Environment: TANDEM (the binary, default build/tandem), SEED_TABLE_OUT (the results
# folder, default bench/results; the plot goes there too when it is not the default).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TANDEM:-build/tandem}
out=${SEED_TABLE_OUT:-bench/results}
plot=bench/seed_table.svg
[ "$out" = bench/results ] || plot=$out/seed_table.svg
mkdir -p "$out" build/models
model=build/models/llama-134m-f16.gguf
[ -f "$model" ] || $T mkmodel --preset llama-134m --type f16 --out "$model" >/dev/null
run() { # NAME UP-FLAGS...
    local name=$1
    shift
    local work
    work=$(mktemp -d)
    $T up --model "$model" --port 0 --workdir "$work" "$@" -- --kv-cache-memory 2G >"$work/up.out" &
    local up=$!
    for _ in $(seq 1 1200); do
        grep -q '^ready:' "$work/up.out" && break
        kill -0 $up 2>/dev/null || { echo "tandem up failed for $name" >&2; exit 1; }
        sleep 0.1
    done
    local url
    url=$(sed -n 's/^tandem up: \(http[^ ]*\).*/\1/p' "$work/up.out")
    for c in 1 4 16; do
        echo "== $name, concurrency $c" >&2
        # Each level its own seed: the same seed would give the next level the previous
        # level's prompts first, which the engines' prefix caches answer without a prefill.
        $T bench --base-url "$url" --input-len 512 --output-len 128 --ignore-eos --seed $c \
            --num-prompts $((2 * c)) --max-concurrency $c --label "$name" \
            --save-result "$out/$name-c$c.json" "${BENCH_FLAGS[@]}" >/dev/null
    done
    kill $up
    wait $up || true
    rm -rf "$work"
}
BENCH_FLAGS=("$@")
run 1p1d-tcp --prefill 1 --decode 1 --protocol tcp
run 1p1d-shm --prefill 1 --decode 1 --protocol shm
run 1p1d-push --prefill 1 --decode 1 --transfer-mode write
run aggregated --aggregated 1
files=()
for name in 1p1d-tcp 1p1d-shm 1p1d-push aggregated; do
    for c in 1 4 16; do files+=("$out/$name-c$c.json"); done
done
$T bench --compare "${files[@]}" --plot "$plot"
