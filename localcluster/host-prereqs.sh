#!/usr/bin/env bash
# Installs what the local cluster needs on this machine and checks the kernel, with one clear
# message when something is missing. Safe to run again: it only installs what is absent.
set -euo pipefail

fail() { echo "host-prereqs: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || fail "run as root (sudo make ...): the local cluster starts privileged systemd containers."
[[ -r /etc/os-release ]] && . /etc/os-release
case "${ID:-}-${VERSION_ID:-}" in
  debian-12|ubuntu-22.04|ubuntu-24.04) ;;
  *) echo "host-prereqs: ${PRETTY_NAME:-this system} is not tested; Debian 12 and Ubuntu 22.04/24.04 are." >&2 ;;
esac

packages=(podman runc debootstrap iproute2 iputils-ping openssh-client python3-venv make git)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "host-prereqs: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || \
  fail "the kernel has no overlay file system: podman needs it (load the 'overlay' module or use another kernel)."
[[ -e /dev/fuse ]] || modprobe fuse 2>/dev/null || \
  fail "/dev/fuse is missing: GlusterFS mounts need FUSE (load the 'fuse' module)."
[[ -d /sys/fs/cgroup ]] || fail "/sys/fs/cgroup is not mounted: systemd containers need cgroups."
ip link add sd3-probe type bridge 2>/dev/null && ip link del sd3-probe || \
  fail "cannot create a network bridge: the kernel needs bridge support (module 'bridge') for the cluster network."
# Each systemd node container holds about 7 inotify instances; the default limit of 128 per user stops
# the 10th or so node from booting (it exits 255 with no log). Raised for this boot only, and said so.
inotify=$(cat /proc/sys/fs/inotify/max_user_instances)
if (( inotify < 1024 )); then
  echo "host-prereqs: raising fs.inotify.max_user_instances from $inotify to 8192 (systemd node containers need it; until reboot)"
  sysctl -q -w fs.inotify.max_user_instances=8192
fi
echo "host-prereqs: ok (podman $(podman --version | awk '{print $3}'))"
