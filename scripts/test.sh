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

echo "== release build and tests"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null
cmake --build build -j"$jobs"
(cd build && ctest --output-on-failure -j"$jobs")

echo "== ASan + UBSan build and tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTD_SANITIZE=ON -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null
cmake --build build-asan -j"$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j"$jobs")

# The CUDA backend is compiled wherever nvcc is installed; its tests run where a GPU is
# present and skip (with the reason) elsewhere.
nvcc_bin=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$nvcc_bin" ]; then
    echo "== CUDA backend build ($nvcc_bin) and its tests"
    cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON \
        -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DTD_SHARED_DIR="$TD_SHARED_DIR" >/dev/null
    cmake --build build-cuda -j"$jobs" --target tandem test_engine_cuda
    (cd build-cuda && ctest --output-on-failure -R cuda)
else
    echo "== CUDA backend: nvcc not found, not built"
fi

if [ -x tests/fuzz/run_fuzz.sh ] && command -v clang >/dev/null; then
    echo "== fuzz smoke runs"
    tests/fuzz/run_fuzz.sh 20000
fi
