#!/usr/bin/env bash
# Installs the Debian 12 packages tandem needs, then builds build/tandem (Release).
# Run as root (or with sudo). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(build-essential cmake pkg-config clang libevent-dev libcjson-dev libpcre2-dev
      libcmocka-dev libcurl4-openssl-dev libclang-rt-14-dev libssl-dev jq curl iproute2
      libucx-dev) # libucx-dev: the kvx ucx transport (optional; built when present)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
# Node.js + npm (for the openai-client tests): a NodeSource nodejs bundles npm and
# conflicts with Debian's npm package, so ask for them only when absent.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if ((${#missing[@]})); then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
