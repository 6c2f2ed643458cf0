#!/usr/bin/env bash
# A rail-isolated fabric on one machine, for tests and by hand: two "hosts" as network
# namespaces, <name>-p (prefill) and <name>-d (decode), joined by
#   - a management link tdm0 (10.99.0.1 <-> 10.99.0.2): the control address of each host;
#   - N rails tdr0..tdr<N-1>: veth pairs, rail i joining 10.100.i.1 (p) to 10.100.i.2 (d),
#     each in its own subnet with no routing between rails, and ARP answered only for the
#     asking interface's addresses, so rail i of one host reaches only rail i of the other;
#   - one more rail, tdr<N>, that exists on both sides with its link down.
#
#   scripts/rail_fabric.sh check            exit 0 if namespaces can be made here
#   scripts/rail_fabric.sh up NAME [N] [RATE]  build it (N rails, default 4); RATE (e.g.
#                                           1gbit) caps each rail both ways like a NIC
#                                           (tc tbf), for the striping benchmark
#   scripts/rail_fabric.sh down NAME        remove it
#
# Run a process on a host with: ip netns exec NAME-p CMD (the namespace sees its own
# /sys/class/net). Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN).
set -euo pipefail

cmd=${1:-}
name=${2:-}
rails=${3:-4}
rate=${4:-}

check() {
    command -v ip >/dev/null || { echo "rail fabric: the ip command (iproute2) is missing" >&2; return 2; }
    local probe="tdprobe$$"
    if ! ip netns add "$probe" 2>/dev/null; then
        echo "rail fabric: cannot create network namespaces here (needs root: CAP_SYS_ADMIN, CAP_NET_ADMIN)" >&2
        return 2
    fi
    ip netns del "$probe"
}

down() {
    ip netns del "$name-p" 2>/dev/null || true
    ip netns del "$name-d" 2>/dev/null || true
}

up() {
    [[ "$rails" =~ ^[0-9]+$ ]] && ((rails >= 1 && rails <= 16)) || { echo "rail fabric: 1 to 16 rails" >&2; exit 2; }
    down
    ip netns add "$name-p"
    ip netns add "$name-d"
    trap 'down' ERR
    for h in p d; do
        ip -n "$name-$h" link set lo up
        # Answer ARP only for the addresses of the asking interface, as separate NICs on
        # separate switches would: otherwise rail 3 could reach rail 1's address.
        ip netns exec "$name-$h" sysctl -qw net.ipv4.conf.all.arp_ignore=1 net.ipv4.conf.all.arp_announce=2
    done
    ip link add tdm0 netns "$name-p" type veth peer name tdm0 netns "$name-d"
    ip -n "$name-p" addr add 10.99.0.1/24 dev tdm0
    ip -n "$name-d" addr add 10.99.0.2/24 dev tdm0
    for h in p d; do ip -n "$name-$h" link set tdm0 up; done
    for ((i = 0; i <= rails; i++)); do
        ip link add "tdr$i" netns "$name-p" type veth peer name "tdr$i" netns "$name-d"
        ip -n "$name-p" addr add "10.100.$i.1/24" dev "tdr$i"
        ip -n "$name-d" addr add "10.100.$i.2/24" dev "tdr$i"
        if ((i < rails)); then
            for h in p d; do
                ip -n "$name-$h" link set "tdr$i" up
                if [ -n "$rate" ]; then
                    ip netns exec "$name-$h" tc qdisc add dev "tdr$i" root tbf rate "$rate" \
                        burst 256kb latency 50ms
                fi
            done
        fi
    done
    trap - ERR
}

case "$cmd" in
check) check ;;
up) [ -n "$name" ] || { echo "usage: $0 up NAME [RAILS] [RATE]" >&2; exit 2; }; up ;;
down) [ -n "$name" ] || { echo "usage: $0 down NAME" >&2; exit 2; }; down ;;
*) echo "usage: $0 check | up NAME [RAILS] [RATE] | down NAME" >&2; exit 2 ;;
esac
