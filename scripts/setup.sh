#!/usr/bin/env bash
# Installs the Debian 12 packages tandem needs, then builds build/tandem (Release).
# Run as root (or with sudo). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(build-essential cmake pkg-config clang libevent-dev libcjson-dev libpcre2-dev
      libcmocka-dev libcurl4-openssl-dev libclang-rt-14-dev nodejs npm)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
