#!/usr/bin/env bash
# Build the libFuzzer targets (clang, -DTD_FUZZ=ON) and run each for a number of
# inputs, seeded from tests/fuzz/corpus_<name>/ where that exists.
#
#   tests/fuzz/run_fuzz.sh [RUNS] [extra libFuzzer args...]     (RUNS default 20000)
#
# The committed seed corpus is never modified: each run works on a temporary copy.
# A crash leaves its reproducer in build-fuzz/artifacts/ and fails the script.
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=${1:-20000}
shift || true

jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DTD_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
fuzzers=()
for src in tests/fuzz/fuzz_*.c; do
    fuzzers+=("$(basename "$src" .c)")
done
cmake --build build-fuzz -j"$jobs" --target "${fuzzers[@]}"

mkdir -p build-fuzz/artifacts
status=0
for name in "${fuzzers[@]}"; do
    work=$(mktemp -d)
    seeds="tests/fuzz/corpus_${name#fuzz_}"
    [ -d "$seeds" ] && cp -r "$seeds"/. "$work"/
    echo "== $name: $runs runs"
    if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "build-fuzz/$name" -runs="$runs" -max_len=65536 -rss_limit_mb=2048 \
        -artifact_prefix=build-fuzz/artifacts/"$name"- "$@" "$work"; then
        echo "$name: FAILED (reproducer in build-fuzz/artifacts/)" >&2
        status=1
    fi
    rm -rf "$work"
done
exit $status
