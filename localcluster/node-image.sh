#!/usr/bin/env bash
# Builds the local cluster's node image: Debian 12 minbase with systemd, sshd and python3, so a
# container boots like a small server. The tag is a hash of this recipe (this file plus the extra CA
# certificates baked in), so the image is built once and reused until the recipe changes.
#
# Usage: node-image.sh [--print-tag]     prints the image reference on the last line of stdout
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
mirror=${SD3_DEBIAN_MIRROR:-http://deb.debian.org/debian}
ca_dir=${SD3_EXTRA_CA_DIR:-/usr/local/share/ca-certificates}
work=${SD3_STATE_DIR:-/var/lib/sd3-cluster}/image-build
packages=python3,openssh-server,sudo,systemd,systemd-sysv,dbus,iproute2,iputils-ping,ca-certificates,procps,less,pciutils,gnupg,apt-transport-https

recipe_hash() {
  {
    cat "$0"
    echo "$mirror $packages"
    find "$ca_dir" -maxdepth 1 -name '*.crt' -type f -print0 2>/dev/null | sort -z | xargs -0r cat
  } | sha256sum | cut -c1-12
}

tag="localhost/sd3-node:$(recipe_hash)"
if [[ ${1:-} == --print-tag ]]; then echo "$tag"; exit 0; fi

if podman image exists "$tag"; then
  echo "node image $tag is up to date (recipe unchanged)"
  echo "$tag"
  exit 0
fi

start=$(date +%s)
rootfs="$work/rootfs"
rm -rf "$work"
mkdir -p "$rootfs"
trap 'rm -rf "$work"' EXIT

echo "[1/3] debootstrap Debian 12 into $rootfs (about a minute)" >&2
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >"$work.log" 2>&1 || {
  echo "debootstrap failed; its log follows" >&2; tail -n 30 "$work.log" >&2; exit 1; }

echo "[2/3] configure the node: CA certificates, sshd host keys per boot, apt cache kept" >&2
# Extra CA certificates (a corporate proxy's, or this sandbox's) so HTTPS (pip) works on the nodes.
find "$ca_dir" -maxdepth 1 -name '*.crt' -type f -exec cp {} "$rootfs/usr/local/share/ca-certificates/" \; 2>/dev/null || true
chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
# Every node gets its own SSH host keys, made at first boot, not shared through the image.
rm -f "$rootfs"/etc/ssh/ssh_host_*
cat >"$rootfs/etc/systemd/system/sd3-ssh-hostkeys.service" <<'UNIT'
[Unit]
Description=Generate this node's SSH host keys
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
UNIT
ln -sf /etc/systemd/system/sd3-ssh-hostkeys.service "$rootfs/etc/systemd/system/multi-user.target.wants/sd3-ssh-hostkeys.service"
# Keep downloaded packages: /var/cache/apt/archives is the node's own; the shared cache is a proxy.
echo 'APT::Keep-Downloaded-Packages "true";' >"$rootfs/etc/apt/apt.conf.d/10keep-downloads"
# Units that make no sense in a container and only slow the boot.
for unit in systemd-timesyncd.service getty@tty1.service; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done
echo 'root:!' | chroot "$rootfs" chpasswd -e
: >"$rootfs/etc/machine-id"
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb

echo "[3/3] import as $tag" >&2
tar -C "$rootfs" -c . | podman import --change 'CMD ["/sbin/init"]' --change 'STOPSIGNAL SIGRTMIN+3' \
  - "$tag" >/dev/null
echo "node image built in $(( $(date +%s) - start )) s" >&2
echo "$tag"
