#!/usr/bin/env bash
# `tandem up`: a 1P1D cluster from one command answers through its router; its engines
# lend each other their CPUs while idle (not with --no-lend-cpus); an engine killed is
# restarted and back behind the router; --status reports; SIGTERM stops every process
# (no orphans) and removes the state file. Bad flags are usage errors.
set -euo pipefail
source "$(dirname "$0")/serve_lib.sh"
command -v curl >/dev/null || fail "curl is required"
command -v jq >/dev/null || fail "jq is required (apt-get install jq)"

rc=0
"$TD_BIN" up --prefill 0 >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] || fail "--prefill 0 exited $rc"
rc=0
"$TD_BIN" up --protocol rdma >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] || fail "--protocol rdma exited $rc"
rc=0
"$TD_BIN" up --gpus 0,,1 >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q "comma-separated list of GPU numbers" "$tmp/err" || fail "--gpus 0,,1: $(cat "$tmp/err")"
rc=0
"$TD_BIN" up --gpus 64 >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] || fail "--gpus 64 exited $rc"
rc=0
"$TD_BIN" up --status --workdir "$tmp/none" >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 1 ] && grep -q "no cluster" "$tmp/err" || fail "--status without a cluster: $(cat "$tmp/err")"

W="$tmp/w"
start_up "$W"
R=$UP_URL
grep -q "prefill-0" "$tmp/up.out" && grep -q "decode-0" "$tmp/up.out" || fail "status lines: $(cat "$tmp/up.out")"

start_server AGG
ask() { curl -sf "$1/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt":[1,5,6,7,8],"max_tokens":8,"temperature":0,"ignore_eos":true}'; }
want=$(ask "$AGG_URL" | jq -r '.choices[0].text')
got=$(ask "$R")
[ "$(echo "$got" | jq -r '.choices[0].text')" = "$want" ] || fail "through tandem up: $got, want $want"
[ "$(echo "$got" | jq -r '.kv_transfer_params.kv_load')" = transferred ] || fail "no transfer: $got"

# The engines split the CPUs and lend them to each other while idle (--cpu-board): with
# the prefill engine idle, the decode engine's steps ran on both CPUs, with the same answer.
if [ "$(nproc)" -ge 2 ]; then
    [ "$(grep -c '+lent' "$tmp/up.out")" -eq 2 ] || fail "engines not lending: $(cat "$tmp/up.out")"
    borrowed=0
    for u in $(jq -r '.instances[] | select(.name != "router") | .url' "$W/cluster.json"); do
        n=$(curl -sf "$u/metrics" | awk '/^tandem_cpu_borrowed_runs_total/ {print int($2)}')
        borrowed=$((borrowed + ${n:-0}))
    done
    [ "$borrowed" -gt 0 ] || fail "no engine borrowed an idle CPU"
fi

# Every instance listens below the ephemeral port range, where no outgoing connection can
# take its port while it is down (so its restart below can bind it again).
low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
for u in $(jq -r '.router, .instances[].url' "$W/cluster.json"); do
    [ "${u##*:}" -lt "$low" ] || fail "$u is in the ephemeral range (from $low)"
done

# One cluster per workdir, and a --port already taken is an error, not a cluster that
# waits on (and registers its engines with) someone else's router.
rc=0
"$TD_BIN" up --model "$MODEL" --port 0 --workdir "$W" >"$tmp/o2" 2>"$tmp/e2" || rc=$?
[ "$rc" -eq 1 ] && grep -q "another \`tandem up\` runs from" "$tmp/e2" || fail "same workdir: $rc $(cat "$tmp/e2")"
rc=0
"$TD_BIN" up --model "$MODEL" --port "${R##*:}" --workdir "$tmp/w-taken" >"$tmp/o2" 2>"$tmp/e2" || rc=$?
[ "$rc" -eq 1 ] && grep -q "is in use" "$tmp/e2" || fail "port taken: $rc $(cat "$tmp/e2")"
! grep -q '^ready:' "$tmp/o2" || fail "a cluster on a taken port said ready"

"$TD_BIN" up --status --workdir "$W" >"$tmp/status" || fail "status: $(cat "$tmp/status")"
# A workdir it cannot write is said so (not "another tandem up runs"); a workdir whose lock
# is held before the state file exists is a cluster starting.
touch "$tmp/a-file"
rc=0
"$TD_BIN" up --model "$MODEL" --port 0 --workdir "$tmp/a-file" >"$tmp/o2" 2>"$tmp/e2" || rc=$?
[ "$rc" -eq 1 ] && grep -q "cannot create $tmp/a-file/lock: Not a directory" "$tmp/e2" || fail "workdir a file: $rc $(cat "$tmp/e2")"
mkdir -p "$tmp/w-starting"
(flock -x 9 && sleep 3) 9>"$tmp/w-starting/lock" &
sleep 0.3
rc=0
"$TD_BIN" up --status --workdir "$tmp/w-starting" >"$tmp/o2" 2>"$tmp/e2" || rc=$?
[ "$rc" -eq 1 ] && grep -q "a cluster is starting" "$tmp/e2" || fail "status while starting: $rc $(cat "$tmp/e2")"
[ "$(grep -c healthy "$tmp/status")" -eq 3 ] || fail "status: $(cat "$tmp/status")"

# Kill an engine (the decode, then the prefill): tandem up restarts it, it registers
# again, and requests succeed again.
for name in decode-0 prefill-0; do
    P=$(jq ".instances[] | select(.name == \"$name\") | .pid" "$W/cluster.json")
    kill -9 "$P"
    out=""
    for _ in $(seq 1 300); do
        NP=$(jq ".instances[] | select(.name == \"$name\") | .pid" "$W/cluster.json" 2>/dev/null || echo "$P")
        [ "$NP" != "$P" ] && out=$(ask "$R" 2>/dev/null) &&
            [ "$(echo "$out" | jq -r '.choices[0].text')" = "$want" ] && break
        out=""
        sleep 0.1
    done
    [ -n "$out" ] || fail "no answer after $name restarted: $(tail -5 "$tmp/up.err")"
    grep -q "$name restarted" "$tmp/up.err" || fail "no restart of $name logged: $(cat "$tmp/up.err")"
done

# SIGTERM: everything stops, nothing is left behind.
pids=$(jq '.instances[].pid' "$W/cluster.json")
kill -TERM "$UP"
wait "$UP" || fail "tandem up exited non-zero on SIGTERM"
for p in $pids; do
    kill -0 "$p" 2>/dev/null && fail "process $p outlived tandem up"
done
[ ! -f "$W/cluster.json" ] || fail "the state file is still there"
[ -s "$W/prefill-0.log" ] && [ -f "$W/router.log" ] || fail "per-instance logs missing"

# --no-lend-cpus: each engine confined to its share, nothing borrowed.
if [ "$(nproc)" -ge 2 ]; then
    start_up "$tmp/w2" --no-lend-cpus
    grep -q '+lent' "$tmp/up.out" && fail "--no-lend-cpus still lends: $(cat "$tmp/up.out")"
    got=$(ask "$UP_URL")
    [ "$(echo "$got" | jq -r '.choices[0].text')" = "$want" ] || fail "--no-lend-cpus: $got"
    for u in $(jq -r '.instances[] | select(.name != "router") | .url' "$tmp/w2/cluster.json"); do
        n=$(curl -sf "$u/metrics" | awk '/^tandem_cpu_borrowed_runs_total/ {print int($2)}')
        [ "${n:-0}" -eq 0 ] || fail "$u borrowed with --no-lend-cpus"
        pid=$(jq -r ".instances[] | select(.url == \"$u\") | .pid" "$tmp/w2/cluster.json")
        [ "$(taskset -pc "$pid" | sed 's/.*: //')" != "$(taskset -pc $$ | sed 's/.*: //')" ] ||
            fail "$u is not confined to its share"
    done
    kill -TERM "$UP"
    wait "$UP" || fail "tandem up --no-lend-cpus exited non-zero on SIGTERM"
fi
# An engine flag it does not know: the engine's own error line is shown, not only its usage.
rc=0
"$TD_BIN" up --model "$MODEL" --port 0 --workdir "$tmp/w4" -- --bogus-flag 1 >"$tmp/o4" 2>"$tmp/e4" || rc=$?
[ "$rc" -eq 1 ] && grep -q "unknown option '--bogus-flag'" "$tmp/e4" || fail "bad engine flag: $rc $(cat "$tmp/e4")"

# Several hosts from one config file: host "a" runs the router and the prefill engine,
# host "b" the decode engine, each under its own `tandem up` (both on loopback here).
# The router's port: a free one below the ephemeral range (as tandem up picks its own).
RP=$(python3 -c '
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
while True:
    p = random.randrange(max(1024, low - 10000), low)
    try:
        s = socket.socket(); s.bind(("127.0.0.1", p)); s.close(); print(p); break
    except OSError:
        pass')
cat >"$tmp/c.json" <<JSON
{"mode": "pd", "model": "$MODEL", "engine_flags": ["--threads", "1"],
 "router": {"host": "a", "port": $RP},
 "hosts": [{"name": "a", "address": "127.0.0.1", "prefill": 1},
           {"name": "b", "address": "127.0.0.1", "decode": 1}]}
JSON
# Stopped during start-up: never "ready", a non-zero status, nothing left behind. Host a of
# c.json, without host b: its router never sees a decode engine, so the start-up cannot end
# before the signal (a whole one-host cluster of this model was sometimes ready first).
"$TD_BIN" up --config "$tmp/c.json" --this-host a --workdir "$tmp/w3" >"$tmp/o3" 2>"$tmp/e3" &
U3=$!
for _ in $(seq 1 100); do
    [ "$(grep -l "listening on" "$tmp/w3/router.log" "$tmp/w3/prefill-0.log" 2>/dev/null | wc -l)" = 2 ] && break
    sleep 0.1
done
kill -TERM "$U3"
rc=0
wait "$U3" || rc=$?
[ "$rc" -eq 1 ] && grep -q "stopped during start-up" "$tmp/e3" || fail "SIGTERM in start-up: $rc $(cat "$tmp/e3")"
! grep -q '^ready:' "$tmp/o3" || fail "stopped in start-up, yet ready: $(cat "$tmp/o3")"
sleep 0.2
! pgrep -f "$tmp/w3/" >/dev/null || fail "processes outlived a stop in start-up: $(pgrep -af "$tmp/w3/")"
rc=0
"$TD_BIN" up --config "$tmp/c.json" --this-host zz >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q "this-host" "$tmp/err" || fail "unknown host: $(cat "$tmp/err")"
echo '{"mode": "pd", "hots": []}' >"$tmp/bad.json"
rc=0
"$TD_BIN" up --config "$tmp/bad.json" --this-host a >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q "unknown key 'hots'" "$tmp/err" || fail "config typo: $(cat "$tmp/err")"
# A port that is no port (one that would wrap to 8000 in an int, a huge number) is an error.
for bad in 4294975296 1e300 80.5; do
    sed "s/\"port\": $RP/\"port\": $bad/" "$tmp/c.json" >"$tmp/badport.json"
    rc=0
    "$TD_BIN" up --config "$tmp/badport.json" --this-host a >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] && grep -q "router.port a port" "$tmp/err" || fail "router port $bad: $(cat "$tmp/err")"
done
sed "s|\"model\": \"$MODEL\"|\"model\": 5|" "$tmp/c.json" >"$tmp/badmodel.json"
rc=0
"$TD_BIN" up --config "$tmp/badmodel.json" --this-host a >"$tmp/out" 2>"$tmp/err" || rc=$?
[ "$rc" -eq 2 ] && grep -q '"model" must be a string' "$tmp/err" || fail "model 5: $rc $(cat "$tmp/err")"
# A recipe with bytes after the object, a key twice, counts of the other mode or two hosts of
# one name is refused, not half read.
up_config_error() { # WANT JSON
    printf '%s' "$2" >"$tmp/e.json"
    rc=0
    "$TD_BIN" up --config "$tmp/e.json" --this-host a >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] && grep -q -- "$1" "$tmp/err" || fail "config $2: $rc $(cat "$tmp/err")"
}
hosts='"hosts": [{"name": "a", "address": "127.0.0.1", "prefill": 1, "decode": 1}]'
up_config_error "trailing data" "{\"mode\": \"pd\", \"router\": {\"host\": \"a\"}, $hosts} junk"
up_config_error "'mode' appears twice" "{\"mode\": \"aggregated\", \"mode\": \"pd\", \"router\": {\"host\": \"a\"}, $hosts}"
up_config_error '"engines" is for aggregated mode' \
    '{"mode": "pd", "router": {"host": "a"}, "hosts": [{"name": "a", "address": "127.0.0.1", "prefill": 1, "decode": 1, "engines": 2}]}'
up_config_error '"prefill" is for pd mode' \
    '{"mode": "aggregated", "router": {"host": "a"}, "hosts": [{"name": "a", "address": "127.0.0.1", "engines": 1, "prefill": 1}]}'
up_config_error "two hosts are named a" \
    '{"mode": "aggregated", "router": {"host": "a"}, "hosts": [{"name": "a", "address": "127.0.0.1", "engines": 1}, {"name": "a", "address": "127.0.0.2", "engines": 1}]}'
# Counts that would wrap in an int, and flags after -- that up sets for every engine itself.
for args in "--aggregated 4294967297" "--prefill 4294967296 --decode 1"; do
    rc=0
    # shellcheck disable=SC2086
    "$TD_BIN" up $args --model "$MODEL" --workdir "$tmp/wc" >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] && grep -q "0 to 32 engines" "$tmp/err" || fail "up $args: $rc $(cat "$tmp/err")"
done
for f in --port --server-port --host --kv_transfer_config=x --model; do
    rc=0
    "$TD_BIN" up --aggregated 1 --model "$MODEL" --workdir "$tmp/wc" -- "$f" 1 >"$tmp/out" 2>"$tmp/err" || rc=$?
    [ "$rc" -eq 2 ] && grep -q "sets it for every engine itself" "$tmp/err" || fail "up -- $f: $rc $(cat "$tmp/err")"
done
# A host that runs only the router (no engines here) starts it (it used to divide by zero).
cat >"$tmp/r-only.json" <<JSON
{"mode": "pd", "model": "$MODEL", "router": {"host": "r", "port": $RP},
 "hosts": [{"name": "r", "address": "127.0.0.1"}, {"name": "b", "address": "127.0.0.1", "prefill": 1, "decode": 1}]}
JSON
"$TD_BIN" up --config "$tmp/r-only.json" --this-host r --workdir "$tmp/wr" >"$tmp/r.out" 2>"$tmp/r.err" &
RO=$!
for _ in $(seq 1 100); do grep -q "listening on" "$tmp/wr/router.log" 2>/dev/null && break; sleep 0.1; done
grep -q "listening on" "$tmp/wr/router.log" || fail "router-only host: no router: $(cat "$tmp/r.err")"
kill -TERM "$RO"
rc=0
wait "$RO" || rc=$?
[ "$rc" -eq 1 ] || fail "router-only host exited $rc: $(cat "$tmp/r.err")"
"$TD_BIN" up --config "$tmp/c.json" --this-host a --workdir "$tmp/wa" >"$tmp/a.out" 2>"$tmp/a.err" &
A=$!
"$TD_BIN" up --config "$tmp/c.json" --this-host b --workdir "$tmp/wb" >"$tmp/b.out" 2>"$tmp/b.err" &
B=$!
server_pids+=("$A" "$B")
for _ in $(seq 1 300); do
    grep -q '^ready:' "$tmp/a.out" && grep -q '^ready:' "$tmp/b.out" && break
    sleep 0.1
done
grep -q '^ready:' "$tmp/a.out" || fail "host a not ready: $(cat "$tmp/a.err")"
got=$(ask "http://127.0.0.1:$RP")
[ "$(echo "$got" | jq -r '.choices[0].text')" = "$want" ] || fail "two hosts: $got"
[ "$(echo "$got" | jq -r '.kv_transfer_params.kv_load')" = transferred ] || fail "two hosts: $got"
pids=$(jq '.instances[].pid' "$tmp/wa/cluster.json" "$tmp/wb/cluster.json")
kill -TERM "$A" "$B"
wait "$A" && wait "$B" || fail "the supervisors exited non-zero"
for p in $pids; do
    kill -0 "$p" 2>/dev/null && fail "process $p outlived tandem up"
done
echo ok
