#!/usr/bin/env bash
# promtool for the unit tests of the alert rules (`promtool test rules`, `promtool check rules`), taken from the
# distribution's prometheus package (the one the head runs) and unpacked into DIR/bin; nothing is installed on
# this machine and no service starts. Usage: promtool.sh DIR (default .cache/tools).
set -euo pipefail
dest=${1:-.cache/tools}
[[ -x $dest/bin/promtool ]] && exit 0
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
  echo "promtool.sh: needs apt-get and dpkg-deb (Debian or Ubuntu); or put a promtool on PATH" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && apt-get download -q prometheus >"$work/log" 2>&1); then
  echo "promtool.sh: \`apt-get download prometheus\` failed (is the apt cache current? run apt-get update):" >&2
  tail -5 "$work/log" >&2
  exit 1
fi
dpkg-deb --fsys-tarfile "$work"/prometheus_*.deb | tar -x -C "$work" ./usr/bin/promtool
install -D -m 0755 "$work/usr/bin/promtool" "$dest/bin/promtool"
echo "promtool.sh: $("$dest/bin/promtool" --version 2>&1 | head -1) in $dest/bin"
