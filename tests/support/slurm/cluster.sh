#!/usr/bin/env bash
# A real Slurm on this machine for the tests: slurmctld in the root network namespace and one
# slurmd per node, each in its own network, hostname and mount namespace (its own address on a
# bridge, its own hostname, its own /etc/hosts), so srun, the launchers and gloo see distinct
# hosts. Addresses exist only inside the namespaces and the bridge, all removed by `down`.
#
#   tests/support/slurm/cluster.sh up DIR [NODES]   start munge, slurmctld and NODES slurmd (default 3)
#   tests/support/slurm/cluster.sh down DIR         stop them and remove the namespaces and the bridge
#
# Needs root, iproute2, and Debian's slurmctld, slurmd, slurm-client and munge packages.
set -euo pipefail
cmd=$1 dir=$(realpath -m "$2") nodes=${3:-3}
BR=clslurm0 NET=10.78.0 PREFIX=cls

down() {
    for pidfile in "$dir"/*.pid; do
        [ -e "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 0.5
    for ns in $(ip netns list | awk '{print $1}' | grep "^${PREFIX}n" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
    if [ -e "$dir/munged.ours" ] && [ -s /run/munge/munged.pid ]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$dir/munged.ours"
    fi
}

if [ "$cmd" = down ]; then down; exit 0; fi

down
mkdir -p "$dir"/{state,log,etc} $(for i in $(seq 1 "$nodes"); do echo "$dir/spool-n$i"; done)
# munge: one key, one daemon; its socket is a file, so every namespace reaches it
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chmod 400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then munged --force && touch "$dir/munged.ours"; fi

{
    echo "127.0.0.1 localhost"
    echo "$NET.1 ctl"
    for i in $(seq 1 "$nodes"); do echo "$NET.$((10 + i)) n$i"; done
} > "$dir/etc/hosts"

cat > "$dir/slurm.conf" <<CONF
ClusterName=cltest
SlurmctldHost=$(hostname)($NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pidfile
SlurmdPidFile=$dir/slurmd-%n.pidfile
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/builtin
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=10
InactiveLimit=0
MinJobAge=300
NodeName=n[1-$nodes] NodeAddr=$NET.[11-$((10 + nodes))] CPUs=2 RealMemory=2000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
sed -i "s/NodeName=n\[1-$nodes\] NodeAddr=$NET.\[11-$((10 + nodes))\]/NodeName=n[1-$nodes] NodeAddr=$(seq -s, -f "$NET.%g" 11 $((10 + nodes)))/" "$dir/slurm.conf"

# slurmd loads its cgroup plugin whatever the process tracking; this kernel mounts cgroup v1
# controllers (v2 alone is refused as a hybrid): processes are tracked by /proc (linuxproc)
printf 'CgroupPlugin=cgroup/v1\n' > "$dir/cgroup.conf"

ip link add "$BR" type bridge
ip addr add "$NET.1/24" dev "$BR"
ip link set "$BR" up
for i in $(seq 1 "$nodes"); do
    ns=${PREFIX}n$i
    ip netns add "$ns"
    ip link add "${PREFIX}v$i" type veth peer name eth0 netns "$ns"
    ip link set "${PREFIX}v$i" master "$BR" up
    ip -n "$ns" addr add "$NET.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
done

SLURM_CONF=$dir/slurm.conf slurmctld -D -f "$dir/slurm.conf" > "$dir/log/slurmctld.out" 2>&1 &
echo $! > "$dir/slurmctld.pid"
for i in $(seq 1 "$nodes"); do
    ip netns exec "${PREFIX}n$i" unshare --uts --mount --propagation private sh -c "
        hostname n$i
        mount --bind '$dir/etc/hosts' /etc/hosts
        exec env SLURM_CONF='$dir/slurm.conf' slurmd -D -f '$dir/slurm.conf'" \
        > "$dir/log/slurmd-n$i.out" 2>&1 &
    echo $! > "$dir/slurmd-n$i.pid"
done
export SLURM_CONF=$dir/slurm.conf
for _ in $(seq 1 40); do
    if [ "$(timeout 3 sinfo -h -N -o %T 2>/dev/null | grep -c idle)" -eq "$nodes" ]; then
        echo "slurm up: $nodes nodes idle (SLURM_CONF=$dir/slurm.conf)"; exit 0
    fi
    sleep 0.5
done
echo "slurm did not come up:" >&2
sinfo -N >&2 || true
tail -n 20 "$dir/log/slurmctld.out" "$dir/log/slurmd-n1.out" >&2 || true
exit 1
