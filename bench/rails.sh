#!/usr/bin/env bash
# The striping benchmark: aggregate GB/s of kvx tcp transfers over 1, 2 and 4 matched
# rails of the rail-isolated fabric (scripts/rail_fabric.sh), each rail capped at RATE
# (default 1gbit, like a NIC) and once uncapped (then the CPUs are the limit). The 1-rail
# run is the per-rail limit, measured the same way. Needs root (network namespaces).
#   bench/rails.sh [RATE]
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-1gbit}
T=${TD_BIN:-build/tandem}
N="tdbench$$"
trap 'scripts/rail_fabric.sh down "$N"' EXIT
for cap in "$rate" ""; do
    scripts/rail_fabric.sh up "$N" 4 $cap
    sleep 2 # links come up
    echo "### rails capped at: ${cap:-no cap}"
    for rails in tdr0 tdr0,tdr1 tdr0,tdr1,tdr2,tdr3; do
        "$T" bench-xfer --producer-netns "$N-p" --consumer-netns "$N-d" --producer-host 10.99.0.1 \
            --rails "$rails" --rail-device tdr0 --rail-striping --sizes 16M,64M --concurrency 1,4 \
            --no-floor --trials 2 --min-mb 64 2>&1 | grep -v " info \| warn "
    done
    scripts/rail_fabric.sh down "$N"
done
