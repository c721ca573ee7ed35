#!/bin/busybox sh
# /init of the moriio_async test guest (PID 1 inside the initramfs).
#
# Kept small and stable on purpose: build.py hashes this file into the cache
# key, so any change here rebuilds the cached guest. Everything that may change
# often (network, RDMA link, environment, running the command) lives in
# stage2.sh, which is read live from the host through the 9p root mount.
#
# Kernel command line parameters read here (set by run.py):
#   moriio_stage2=<host path of stage2.sh>
#   moriio_out=<host path of the writable results share>
#   moriio_role=a|b   moriio_guests=1|2

/bin/busybox --install -s /bin
export PATH=/bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

say() { echo "moriio-guest: $*"; }

stage2=
out=
role=a
guests=1
cache9p=loose
for word in $(cat /proc/cmdline); do
    case "$word" in
        moriio_stage2=*) stage2=${word#moriio_stage2=} ;;
        moriio_out=*) out=${word#moriio_out=} ;;
        moriio_role=*) role=${word#moriio_role=} ;;
        moriio_guests=*) guests=${word#moriio_guests=} ;;
        moriio_9pcache=*) cache9p=${word#moriio_9pcache=} ;;
    esac
done
say "init up after $(cut -d' ' -f1 /proc/uptime)s of guest uptime (role $role)"

halt_now() {
    sync
    poweroff -f
    # poweroff -f does not return; if it somehow does, let the kernel panic
    # (panic=-1 plus qemu -no-reboot ends the VM).
    exit 1
}

# crc32_generic before rdma_rxe: rxe asks the crypto API for "crc32" and fails
# with err -2 if no provider of that algorithm is loaded yet.
for m in $(cat /etc/moriio-modules); do
    modprobe "$m" || say "modprobe $m failed"
done

mkdir -p /newroot
# cache=loose lets the guest cache the (read-only, unchanging) host root's
# metadata and pages: without it every stat/open of a Python import is a
# round trip through emulated virtio to QEMU's 9p server.
if ! mount -t 9p -o "trans=virtio,version=9p2000.L,ro,msize=512000,cache=$cache9p" hostroot /newroot; then
    say "FATAL: cannot mount the host root over 9p"
    halt_now
fi
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
# /tmp: the host's /tmp (read-only, through 9p) under a writable tmpfs layer,
# so a checkout or cache under the host's /tmp stays visible while the guest
# writes go to guest memory. Plain tmpfs if overlayfs refuses.
mkdir -p /overlay
mount -t tmpfs -o mode=755 tmpfs /overlay
mkdir -p /overlay/upper /overlay/work
chmod 1777 /overlay/upper
if ! mount -t overlay -o lowerdir=/newroot/tmp,upperdir=/overlay/upper,workdir=/overlay/work \
        overlay /newroot/tmp; then
    say "overlay on /tmp failed: plain tmpfs (host /tmp hidden)"
    mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
fi
mkdir -p /newroot/dev/shm /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs -o mode=755 tmpfs /newroot/run

# The results share is writable and appears at its host path (a path under
# /run does not exist in the fresh tmpfs: create the mount point).
mkdir -p "/newroot$out" 2>/dev/null
if ! mount -t 9p -o trans=virtio,version=9p2000.L,rw,msize=512000 results "/newroot$out"; then
    say "FATAL: cannot mount the results share at $out"
    halt_now
fi

chroot /newroot /bin/sh "$stage2" "$role" "$out" "$guests"
rc=$?
if [ ! -e "/newroot$out/.moriio-guest/exit-$role" ]; then
    echo "$((rc == 0 ? 125 : rc))" > "/newroot$out/.moriio-guest/exit-$role"
    say "stage2 ended with $rc before recording an exit code"
fi
halt_now
