#!/usr/bin/env bash
# Runs every test: the Release build, the same suite under AddressSanitizer +
# UndefinedBehaviorSanitizer, and a short run of each libFuzzer target.
# Shared data comes from $TD_SHARED_DIR (default: ../shared next to the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
export TD_SHARED_DIR=${TD_SHARED_DIR:-$(cd .. && pwd)/shared}
[ -d "$TD_SHARED_DIR" ] || { echo "shared data folder '$TD_SHARED_DIR' is missing: set TD_SHARED_DIR" >&2; exit 1; }
jobs=$(nproc)

# The server tests drive `tandem serve` with the official openai npm client; install it
# once (npm ci, from the lock file), after which the tests run offline.
node_dir=tests/integration/node
if [ ! -d "$node_dir/node_modules/openai" ] || [ "$node_dir/package-lock.json" -nt "$node_dir/node_modules/.package-lock.json" ]; then
    echo "== npm ci in $node_dir"
    command -v npm >/dev/null || { echo "npm is missing: apt-get install nodejs npm" >&2; exit 1; }
    (cd "$node_dir" && npm ci --no-audit --no-fund --prefer-offline --loglevel=error)
fi

# Each ctest run's closing lines are kept, so that the run ends on one summary of them all.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run_ctest() { # NAME DIR [ctest args...]
    local name=$1 dir=$2
    shift 2
    (cd "$dir" && ctest --output-on-failure "$@") 2>&1 | tee "$logs/$name"
    return "${PIPESTATUS[0]}"
}

# The CUDA backend is compiled wherever nvcc is installed, and its tests run where a GPU
# is present. This comes first so that the run ends on the main suites.
nvcc_bin=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$nvcc_bin" ]; then
    echo "== CUDA backend build ($nvcc_bin) and its tests"
    cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON \
        -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null
    cmake --build build-cuda -j"$jobs" --target tandem test_engine_cuda test_kvx_cuda
    if nvidia-smi -L >/dev/null 2>&1; then
        run_ctest cuda build-cuda -R cuda
    else
        echo "== CUDA backend: no GPU here (nvidia-smi), its tests not run"
    fi
else
    echo "== CUDA backend: nvcc not found, not built"
fi

fuzz_note="not run (clang missing)"
if [ -x tests/fuzz/run_fuzz.sh ] && command -v clang >/dev/null; then
    echo "== fuzz smoke runs (libFuzzer's log: build-fuzz/fuzz.log)"
    mkdir -p build-fuzz
    if ! tests/fuzz/run_fuzz.sh 20000 >build-fuzz/fuzz.log 2>&1; then
        tail -n 60 build-fuzz/fuzz.log
        echo "fuzz smoke runs: FAILED (build-fuzz/fuzz.log)" >&2
        exit 1
    fi
    grep '^== fuzz_' build-fuzz/fuzz.log || true
    fuzz_note="$(grep -c '^== fuzz_' build-fuzz/fuzz.log) targets, no crash"
fi

echo "== release build and tests"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null
cmake --build build -j"$jobs"
run_ctest release build -j"$jobs"

echo "== ASan + UBSan build and tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTD_SANITIZE=ON -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 run_ctest asan build-asan -j"$jobs"

# One closing line over every ctest run above (skipped tests are those whose hardware,
# a GPU, is missing here).
passed=0 failed=0 skipped=0
for f in "$logs"/*; do
    line=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$f" | tail -n 1)
    total=$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")
    fail=$(sed -E 's/.* ([0-9]+) tests? failed.*/\1/' <<<"$line")
    skip=$(grep -cE '\(Skipped\)$' "$f" || true)
    passed=$((passed + total - fail - skip)) failed=$((failed + fail)) skipped=$((skipped + skip))
done
echo "== fuzz: $fuzz_note"
echo "tests: $passed passed, $failed failed, $skipped skipped"
