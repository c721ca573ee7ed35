#!/bin/sh
# Two-guest cross-check with perftest, run inside the guests:
#   python3 tools/guest/run.py --guests 2 -- sh tools/guest/pair_perftest.sh [SIZE] [ITERS]
# Role a is the ib_write_bw server, role b the client (MORIIO_GUEST_PEER_IP).
# Both use the RoCE v2 GID that carries the eth0 IPv4 address.
set -u
size=${1:-65536}
iters=${2:-200}
dev=${MORIIO_GUEST_DEVICE:-rxe0}
port=1
gids=/sys/class/infiniband/$dev/ports/$port

gid_index=
for path in "$gids"/gids/*; do
    i=${path##*/}
    if grep -q '^0000:0000:0000:0000:0000:ffff:' "$path" 2>/dev/null \
        && [ "$(cat "$gids/gid_attrs/types/$i" 2>/dev/null)" = "RoCE v2" ]; then
        gid_index=$i
        break
    fi
done
if [ -z "$gid_index" ]; then
    echo "pair_perftest: no RoCE v2 IPv4 GID on $dev" >&2
    exit 2
fi

echo "pair_perftest: role ${MORIIO_GUEST_ROLE} self ${MORIIO_GUEST_SELF_IP} peer" \
    "${MORIIO_GUEST_PEER_IP} gid index $gid_index"
# The guests boot independently: wait (up to 120 s) for the peer to answer.
# busybox-static (installed for the initramfs) brings ping; iputils may be absent.
waited=0
until busybox ping -c 1 -W 1 "$MORIIO_GUEST_PEER_IP" >/dev/null 2>&1; do
    waited=$((waited + 1))
    [ "$waited" -lt 120 ] || { echo "pair_perftest: peer never answered" >&2; exit 3; }
done
busybox ping -c 3 "$MORIIO_GUEST_PEER_IP" || exit 3

opts="-d $dev -i $port -x $gid_index -s $size -n $iters -F --report_gbits"
if [ "$MORIIO_GUEST_ROLE" = a ]; then
    # shellcheck disable=SC2086
    exec ib_write_bw $opts
fi
# The client may start before the server listens: retry the TCP exchange.
tries=0
while [ "$tries" -lt 60 ]; do
    # shellcheck disable=SC2086
    ib_write_bw $opts "$MORIIO_GUEST_PEER_IP" && exit 0
    tries=$((tries + 1))
    sleep 1
done
exit 1
