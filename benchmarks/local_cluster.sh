#!/usr/bin/env bash
# Times the local cluster's phases, cold and warm: node image build, cluster-up, site.yml.
# Cold = nothing built (the image and the package-cache image are removed first); warm = all reused.
# Usage (root, from the repository root): bash benchmarks/local_cluster.sh [NODES]
# It tears the local cluster down; run it when no molecule scenario is running.
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=${1:-3}
export CONTAINERS_CONF=$PWD/localcluster/containers.conf ANSIBLE_CONFIG=$PWD/ansible.cfg
py=.venv/bin/python
tag=$(bash localcluster/node-image.sh --print-tag)
# Seconds a command took (it must succeed).
t() { local s=$EPOCHREALTIME; "$@" >/dev/null 2>&1; python3 -c "print($EPOCHREALTIME - $s)"; }

$py localcluster/cluster.py down >/dev/null
podman rmi -f "$tag" "${tag/sd3-node:/sd3-pkgcache:}" >/dev/null 2>&1 || true
image_cold=$(t bash localcluster/node-image.sh)
image_warm=$(t bash localcluster/node-image.sh)
up_cold=$(t $py localcluster/cluster.py up --nodes "$nodes")
site_first=$(t .venv/bin/ansible-playbook site.yml -i inventories/local)
site_again=$(t .venv/bin/ansible-playbook site.yml -i inventories/local)
up_running=$(t $py localcluster/cluster.py up --nodes "$nodes")
$py localcluster/cluster.py down >/dev/null
up_warm=$(t $py localcluster/cluster.py up --nodes "$nodes")
printf '| phase | seconds |\n|---|---|\n'
printf '| node image build, cold (debootstrap) | %.1f |\n' "$image_cold"
printf '| node image build, warm (recipe unchanged) | %.1f |\n' "$image_warm"
printf '| cluster-up %s nodes, cold (package cache installed once) | %.1f |\n' "$nodes" "$up_cold"
printf '| cluster-up %s nodes, warm (after cluster-down) | %.1f |\n' "$nodes" "$up_warm"
printf '| cluster-up with the nodes running | %.1f |\n' "$up_running"
printf '| site.yml, first run | %.1f |\n' "$site_first"
printf '| site.yml, second run | %.1f |\n' "$site_again"
