#!/usr/bin/env bash
# A 3+1-node job with no single point of failure, on one machine: each node's launcher in its own
# network namespace on a bridge (addresses that exist only inside the namespaces), the embedded
# etcd (one member in each of nodes 0, 1 and 2), tiny-llama on CPU. Needs root and iproute2, and
# Debian's etcd-server package (apt-get install etcd-server).
#
#   examples/etcd_namespaces.sh up OUT [key=value ...]   start the four launchers, logs in OUT
#   examples/etcd_namespaces.sh kill K                   SIGKILL every process of node K
#   examples/etcd_namespaces.sh cut K | heal K           node K's link down (packets dropped) / up
#   examples/etcd_namespaces.sh down                     kill everything, remove the namespaces
#
# Then, e.g.: `up /tmp/job`, wait for a few lines in /tmp/job/out/metrics.jsonl, `kill 0`, and the
# job ends on nodes 1-3 with /tmp/job/out/report.json's coordinator_moves showing the move.
set -euo pipefail
TAG=clx
BR=${TAG}br
NET=10.77.0
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}

down() {
    for i in 0 1 2 3; do
        ip netns pids "${TAG}n$i" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "${TAG}n$i" 2>/dev/null || true
        ip link del "${TAG}v$i" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
}

case "${1:-}" in
up)
    OUT=$2; shift 2
    down
    mkdir -p "$OUT"
    ip link add "$BR" type bridge && ip link set "$BR" up
    for i in 0 1 2 3; do
        ip netns add "${TAG}n$i"
        ip link add "${TAG}v$i" type veth peer name eth0 netns "${TAG}n$i"
        ip link set "${TAG}v$i" master "$BR" up
        ip -n "${TAG}n$i" addr add "$NET.$((i + 1))/24" dev eth0
        ip -n "${TAG}n$i" link set eth0 up
        ip -n "${TAG}n$i" link set lo up
    done
    for i in 0 1 2 3; do
        ip netns exec "${TAG}n$i" env GLOO_SOCKET_IFNAME=eth0 HF_HUB_OFFLINE=1 \
            setsid "$PY" -m launcher train tiny-llama run.output_dir="$OUT/out" \
            distributed.num_nodes=3 distributed.nproc_per_node=2 checkpointless.spare_nodes=1 \
            checkpointless.spares=0 distributed.node_rank=$i distributed.master_port=29400 \
            checkpointless.coordinator=etcd checkpointless.confirm_s=12 \
            checkpointless.etcd.member_hosts=$NET.1,$NET.2,$NET.3 trainer.max_steps=40 \
            trainer.progress_bar=false "$@" > "$OUT/node$i.log" 2>&1 &
    done
    echo "four launchers started; logs in $OUT/node*.log"
    ;;
kill) ip netns pids "${TAG}n$2" | xargs -r kill -9 ;;
cut) ip link set "${TAG}v$2" down ;;
heal) ip link set "${TAG}v$2" up ;;
down) down ;;
*) sed -n '2,13p' "$0"; exit 2 ;;
esac
