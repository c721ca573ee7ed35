#!/bin/sh
# Second stage of the guest boot, run by init.sh after it has chrooted into
# the host's root (read-only 9p). This file is read live from the host, so
# editing it needs no rebuild of the cached guest.
#
# Arguments: ROLE OUT_DIR GUESTS. run.py has written $OUT_DIR/.moriio-guest/
# job-$ROLE.sh, which sets the network parameters and defines run_job().
set -u
role=$1
out=$2
guests=$3
state=$out/.moriio-guest
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH

say() { echo "moriio-guest: $*"; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
t_stage2=$(uptime_s)

finish() {
    echo "$1" > "$state/exit-$role"
    say "command exit code $1 (role $role)"
    exit 0
}

if [ ! -r "$state/job-$role.sh" ]; then
    say "FATAL: no job file $state/job-$role.sh"
    finish 125
fi
# shellcheck disable=SC1090
. "$state/job-$role.sh"

# Kernel module auto-loading (tc netem, ...): the kernel runs this helper,
# which points the host's kmod at the guest kernel's module tree in the cache.
if modprobe_bin=$(command -v modprobe); then
    printf '#!/bin/sh\nexec %s -d %s "$@"\n' "$modprobe_bin" "$kernel_root" > /run/moriio-modprobe
    chmod 755 /run/moriio-modprobe
    echo /run/moriio-modprobe > /proc/sys/kernel/modprobe
fi

ip link set lo up
case "$net_mode" in
    veth)
        # One guest: a veth pair gives rxe a netdev with carrier and an IPv4
        # address. Only rxe0 (on veth0) passes traffic: QPs on the same rxe
        # device loop inside rxe, whereas rxe0 <-> rxe1 across the pair hangs.
        # busybox ip cannot create veth pairs; this is the host's iproute2.
        ip link add veth0 type veth peer name veth1 || finish 125
        ip addr add "$self_ip/$prefix_len" dev veth0
        ip addr add "$veth1_ip/$prefix_len" dev veth1
        ip link set veth1 up
        ip link set veth0 up
        netdev=veth0
        ;;
    eth)
        # Two guests: eth0 is a virtio NIC on a QEMU UDP socket over the
        # host's loopback, wired only to the other guest.
        ip addr add "$self_ip/$prefix_len" dev eth0
        ip link set eth0 up
        netdev=eth0
        ;;
    *)
        say "FATAL: unknown net_mode $net_mode"
        finish 125
        ;;
esac

t_net=$(uptime_s)
if ! rdma link add "$rdma_dev" type rxe netdev "$netdev"; then
    say "FATAL: rdma link add $rdma_dev failed"
    finish 125
fi

# The GID table fills asynchronously from netdev address events; wait until
# the port is ACTIVE and an IPv4-mapped GID exists (bounded: 10 s).
ports=/sys/class/infiniband/$rdma_dev/ports/1
i=0
while [ "$i" -lt 100 ]; do
    if grep -q ACTIVE "$ports/state" 2>/dev/null \
        && grep -qs '0000:0000:0000:0000:0000:ffff:' "$ports"/gids/*; then
        break
    fi
    sleep 0.1
    i=$((i + 1))
done

t_rxe=$(uptime_s)

# Locked memory: MRs pin pages, and the default 8 MiB limit is soon reached.
ulimit -l unlimited

say "rdma link:"
rdma link show
if [ "$guests" = 2 ]; then
    say "network: $netdev $self_ip, peer $peer_ip"
fi
say "ibv_devinfo -d $rdma_dev:"
LD_LIBRARY_PATH=$rdma_core_prefix/lib "$rdma_core_prefix/bin/ibv_devinfo" -d "$rdma_dev" -v \
    | grep -E 'hca_id|transport|fw_ver|node_guid|max_qp:|max_qp_wr|max_sge:|max_cqe|max_mr_size|state|active_mtu|link_layer|GID\['
say "ready after $(uptime_s)s of guest uptime (role $role; stage2 at ${t_stage2}s," \
    "network at ${t_net}s, $rdma_dev active at ${t_rxe}s)"

cd "$job_cwd" || finish 125
run_job
finish $?
