#!/usr/bin/env bash
# On the CPU machine (Debian 12): gather what the GPU machine lacks into .gpu-kit/, which
# travels with the working tree to the GPU machine (Ubuntu 24.04 with CUDA, no package
# registry) where bench/gpu.sh unpacks it:
#   .gpu-kit/debs/    Debian packages, downloaded (apt-get download), never installed here
#   .gpu-kit/shared/  the part of ../shared the GPU tests read (stories260K and its goldens)
# Usage: scripts/gpu_kit.sh            (needs apt-get; run `apt-get update` once first)
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${TD_SHARED_DIR:-$(cd .. && pwd)/shared}
kit=.gpu-kit
mkdir -p "$kit/debs" "$kit/shared/models" "$kit/shared/golden"
# cJSON, cmocka and UCX are missing there; pkgconf finds them; libevent, PCRE2, libcurl and
# OpenSSL headers are brought too, so that the build does not depend on what the image has.
# UCX (with the libraries it links: rdmacm, numa) builds the ucx transport, which moves GPU
# memory through pinned host staging.
pkgs=(libcjson1 libcjson-dev libcmocka0 libcmocka-dev pkgconf pkgconf-bin libpkgconf3
      libevent-dev libevent-2.1-7 libevent-core-2.1-7 libevent-extra-2.1-7
      libevent-openssl-2.1-7 libevent-pthreads-2.1-7 libpcre2-dev libpcre2-8-0 libpcre2-16-0
      libpcre2-32-0 libpcre2-posix3 libcurl4-openssl-dev libssl-dev libucx0 libucx-dev librdmacm1
      libnuma1)
(cd "$kit/debs" && apt-get download "${pkgs[@]}" >/dev/null)
cp "$shared/models/stories260K.gguf" "$kit/shared/models/"
cp "$shared"/golden/stories260K* "$kit/shared/golden/"
echo "gpu kit: $(ls "$kit/debs" | wc -l) packages, $(du -sh "$kit" | cut -f1) in $kit"
