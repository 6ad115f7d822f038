#!/usr/bin/env bash
# Builds the sd3cluster image here, without a registry: on the local cluster's node image (Debian 12, which
# `make image` builds), with torch's CPU wheel from /opt/wheels when this machine has it (mounted into the
# build read-only, so the 190 MB wheel is never downloaded). Layers are cached: a rebuild after a change to the
# package's source reinstalls only the package.
#
# Usage: build-local.sh [TAG]       prints the image reference on the last line of stdout
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
tag=${1:-${SD3_WORKLOADS_IMAGE:-localhost/sd3cluster:local}}
wheels=${SD3_WHEELS_DIR:-/opt/wheels}
base=$(bash "$repo/localcluster/node-image.sh" --print-tag)
if ! podman image exists "$base"; then
  echo "the node image $base is missing: build it first with \`make image\`" >&2
  exit 1
fi

args=(--file "$repo/workloads/Containerfile" --ignorefile "$repo/workloads/Containerfile.dockerignore"
      --build-arg "BASE_IMAGE=$base" --build-arg "EXTRAS=${SD3_IMAGE_EXTRAS:-}" --tag "$tag")
if [[ -d $wheels ]]; then
  args+=(--volume "$wheels:/opt/wheels:ro" --build-arg FIND_LINKS=/opt/wheels)
fi
start=$(date +%s)
podman build "${args[@]}" "$repo" >&2
echo "image $tag built on $base in $(( $(date +%s) - start )) s" >&2
echo "$tag"
