#!/usr/bin/env bash
# Matched rails on a rail-isolated fabric (scripts/rail_fabric.sh): two network namespaces
# joined by a management link and four rails, rail i reaching only rail i.
#  - Start-up: auto discovery finds the primary's family with links up (tdr0..tdr3, not
#    the down tdr4 nor the management tdm0) and logs it; a down device, a missing one and a
#    list without the primary are start-up errors.
#  - Every producer rail x consumer rail pair (4 x 4) moves the KV over the consumer's rail,
#    three concurrent requests per pair, with output equal to one aggregated engine's.
#  - Striping (rail_striping): outputs equal; striping without matched rails is an error.
#  - Protocol ucx over the rails (where UCX is built): outputs equal, and the producer's
#    engine for the consumer's rail runs a UCX context restricted to that device.
#  - The transport-level byte-integrity probe (bench-xfer --probe) across the namespaces.
#  - Matched rails off and the rails crossed (producer device tdr1, consumer tdr3): the
#    request ends quickly with a clear error (kv_load_failure_policy fail), not a hang.
# Skips (exit 77) where network namespaces cannot be made (not root).
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v curl >/dev/null || fail "curl is required"
command -v jq >/dev/null || fail "jq is required (apt-get install jq)"
FABRIC="$TESTS_DIR/../../scripts/rail_fabric.sh"
if ! "$FABRIC" check; then
    echo "SKIP: network namespaces are not available here (run as root for the rail fabric)"
    exit 77
fi
N="tdrails$$"
"$FABRIC" up "$N" 4
trap '"$FABRIC" down "$N"; cleanup' EXIT
P="$N-p"
D="$N-d"
for _ in $(seq 1 100); do
    ok=1
    for h in "$P" "$D"; do
        for i in 0 1 2 3; do
            [ "$(ip netns exec "$h" cat /sys/class/net/tdr$i/operstate)" = up ] || ok=0
        done
    done
    [ "$ok" = 1 ] && break
    sleep 0.1
done
[ "$ok" = 1 ] || fail "the fabric's rails did not come up"

# serve_in NS NAME HOST KVCONFIG: a server inside namespace NS on HOST (its management
# address); sets ${NAME}_URL.
serve_in() {
    local ns=$1 name=$2 host=$3 kv=$4
    : >"$tmp/$name.err" # exists before the server opens it: sed below must not race it
    ip netns exec "$ns" "$TD_BIN" serve --model "$MODEL" --threads 1 --host "$host" \
        --server-port 0 --log-level info --kv-transfer-config "$kv" 2>"$tmp/$name.err" &
    local pid=$!
    server_pids+=("$pid")
    wait_listening "$name" "$pid" "$host"
}
# startup_error NS KVCONFIG PATTERN: the server must exit 2 with PATTERN in its error.
startup_error() {
    local rc=0
    timeout 20 ip netns exec "$1" "$TD_BIN" serve --model "$MODEL" --threads 1 --host 10.99.0.2 \
        --server-port 0 --kv-transfer-config "$2" >/dev/null 2>"$tmp/bad.err" || rc=$?
    [ "$rc" -eq 2 ] || fail "config $2 exited $rc, want 2: $(cat "$tmp/bad.err")"
    grep -q "$3" "$tmp/bad.err" || fail "config $2: no '$3' in: $(cat "$tmp/bad.err")"
}

startup_error "$D" '{"kv_role":"kv_consumer","rail_device":"tdr4","matched_rails":"auto"}' "tdr4"
startup_error "$D" '{"kv_role":"kv_consumer","rail_device":"tdr9"}' "tdr9"
startup_error "$D" '{"kv_role":"kv_consumer","rail_device":"tdr2","matched_rails":"tdr0,tdr1"}' "tdr2"
startup_error "$D" '{"kv_role":"kv_consumer","rail_device":"tdr2","matched_rails":"auto","protocol":"shm"}' "tcp or ucx"

start_server AGG
PROMPTS=("[1,5,6,7,8]" "[1,$(seq -s, 2 40)]" "[1,$(seq -s, 100 170)]")
want=()
for p in "${PROMPTS[@]}"; do
    want+=("$(curl -sf "$AGG_URL/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\":$p,\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true}" | jq -r '.choices[0].text')")
done

for r in 0 1 2 3; do
    serve_in "$P" "PROD$r" 10.99.0.1 \
        "{\"kv_role\":\"kv_producer\",\"rail_device\":\"tdr$r\",\"matched_rails\":\"auto\"}"
    serve_in "$D" "CONS$r" 10.99.0.2 \
        "{\"kv_role\":\"kv_consumer\",\"rail_device\":\"tdr$r\",\"matched_rails\":\"auto\",\"kv_load_failure_policy\":\"fail\"}"
done
grep -q "tdr0, tdr1 (primary), tdr2, tdr3" "$tmp/PROD1.err" ||
    fail "auto discovery did not log tdr0..tdr3: $(grep -i rail "$tmp/PROD1.err")"
if grep "rails" "$tmp/PROD1.err" | grep -q "tdr4\|tdm0"; then fail "auto took tdr4 or tdm0"; fi

# One request through producer PU and consumer CU (curl inside the decode host).
pd_request() {
    local pu=$1 cu=$2 prompt=$3 out=$4
    local kv
    kv=$(ip netns exec "$D" curl -sf "$pu/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\":$prompt,\"max_tokens\":1,\"temperature\":0,\"ignore_eos\":true,\"kv_transfer_params\":{\"do_remote_decode\":true}}" |
        jq -c .kv_transfer_params)
    ip netns exec "$D" curl -s "$cu/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\":$prompt,\"max_tokens\":8,\"temperature\":0,\"ignore_eos\":true,\"kv_transfer_params\":$kv}" >"$out"
}

for pr in 0 1 2 3; do
    for cr in 0 1 2 3; do
        pu_var="PROD${pr}_URL" cu_var="CONS${cr}_URL"
        for k in 0 1 2; do
            pd_request "${!pu_var}" "${!cu_var}" "${PROMPTS[$k]}" "$tmp/out.$pr.$cr.$k" &
        done
        wait $(jobs -p | tail -n 3) || true # the outputs are checked below
        for k in 0 1 2; do
            o="$tmp/out.$pr.$cr.$k"
            [ "$(jq -r '.choices[0].text' "$o")" = "${want[$k]}" ] ||
                fail "P tdr$pr -> D tdr$cr prompt $k: $(cat "$o")"
            [ "$(jq -r '.kv_transfer_params.kv_load' "$o")" = transferred ] ||
                fail "P tdr$pr -> D tdr$cr prompt $k did not transfer: $(cat "$o")"
        done
    done
done
# Each consumer's transfers ran on the producer's engine for the consumer's rail.
for pr in 0 1 2 3; do
    m=$(ip netns exec "$D" curl -sf "$(eval echo \$PROD${pr}_URL)/metrics")
    for cr in 0 1 2 3; do
        echo "$m" | grep -q "^tandem_kv_rail_reads_total{rail=\"tdr$cr\"} [1-9]" ||
            fail "producer tdr$pr served nothing on rail tdr$cr: $(echo "$m" | grep rail)"
    done
done

# Striping: a consumer that cuts each transfer over every matched rail.
serve_in "$D" STRIPE 10.99.0.2 \
    '{"kv_role":"kv_consumer","rail_device":"tdr0","matched_rails":"auto","rail_striping":true,"kv_load_failure_policy":"fail"}'
grep -q "striped over every matched rail" "$tmp/STRIPE.err" || fail "striping not on: $(cat "$tmp/STRIPE.err")"
for k in 0 1 2; do
    pd_request "$PROD2_URL" "$STRIPE_URL" "${PROMPTS[$k]}" "$tmp/stripe.$k"
    [ "$(jq -r '.choices[0].text' "$tmp/stripe.$k")" = "${want[$k]}" ] || fail "striped: $(cat "$tmp/stripe.$k")"
done
startup_error "$D" '{"kv_role":"kv_consumer","rail_device":"tdr0","rail_striping":true}' "matched_rails"

# Protocol ucx over the rails (UCX's tcp transport on each rail's interface): each rail's
# engine makes a UCX context restricted to its device (UCX_NET_DEVICES), with the region
# registered under its own keys.
if "$TD_BIN" bench-xfer --transport ucx --sizes 64K --concurrency 1 --trials 1 --min-mb 1 \
    --no-floor >/dev/null 2>&1; then
    export UCX_TLS=tcp
    serve_in "$P" UP 10.99.0.1 '{"kv_role":"kv_producer","protocol":"ucx","rail_device":"tdr0","matched_rails":"auto"}'
    serve_in "$D" UC 10.99.0.2 '{"kv_role":"kv_consumer","protocol":"ucx","rail_device":"tdr3","matched_rails":"auto","kv_load_failure_policy":"fail"}'
    for k in 0 1 2; do
        pd_request "$UP_URL" "$UC_URL" "${PROMPTS[$k]}" "$tmp/ucx.$k"
        [ "$(jq -r '.choices[0].text' "$tmp/ucx.$k")" = "${want[$k]}" ] || fail "ucx rails: $(cat "$tmp/ucx.$k")"
        [ "$(jq -r '.kv_transfer_params.kv_load' "$tmp/ucx.$k")" = transferred ] || fail "ucx rails: $(cat "$tmp/ucx.$k")"
    done
    grep -q "rail tdr3's UCX engine is up (device tdr3" "$tmp/UP.err" || fail "no UCX engine on tdr3: $(cat "$tmp/UP.err")"
    unset UCX_TLS
    echo "ucx over rails: ok"
else
    echo "ucx over rails: skipped (this build has no ucx)"
fi

# The byte-integrity probe at the transport level, across the hosts: 64 B, 64 KiB and
# 1 MiB at different offsets, guard bytes around each destination (consumer tdr2, producer
# primary tdr0: a second engine made on the producer's tdr2).
"$TD_BIN" bench-xfer --producer-netns "$P" --consumer-netns "$D" --producer-host 10.99.0.1 \
    --rails tdr0,tdr1,tdr2,tdr3 --rail-device tdr2 --producer-rail-device tdr0 --probe \
    >"$tmp/probe" 2>&1 || fail "probe: $(cat "$tmp/probe")"
[ "$(grep -c 'data ok, guards ok' "$tmp/probe")" -eq 5 ] && grep -q "all verified" "$tmp/probe" ||
    fail "probe: $(cat "$tmp/probe")"

# Matched rails off, rails crossed: a clear, quick error.
serve_in "$P" XP 10.99.0.1 '{"kv_role":"kv_producer","rail_device":"tdr1"}'
serve_in "$D" XC 10.99.0.2 '{"kv_role":"kv_consumer","rail_device":"tdr3","kv_load_failure_policy":"fail","transfer_timeout_ms":20000}'
t0=$(date +%s%N)
pd_request "$XP_URL" "$XC_URL" "${PROMPTS[1]}" "$tmp/crossed"
t1=$(date +%s%N)
grep -q "unreachable\|tdr3" "$tmp/crossed" || fail "crossed rails: $(cat "$tmp/crossed")"
[ $(((t1 - t0) / 1000000)) -lt 15000 ] || fail "crossed rails took $(((t1 - t0) / 1000000)) ms"
# And the same rail on both sides works without matched mode.
serve_in "$D" SC 10.99.0.2 '{"kv_role":"kv_consumer","rail_device":"tdr1","kv_load_failure_policy":"fail"}'
pd_request "$XP_URL" "$SC_URL" "${PROMPTS[2]}" "$tmp/same"
[ "$(jq -r '.choices[0].text' "$tmp/same")" = "${want[2]}" ] || fail "one device, same rail: $(cat "$tmp/same")"
echo "ok: 16 rail pairs, crossed rails fail fast, start-up errors"
