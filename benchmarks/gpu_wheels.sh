#!/usr/bin/env bash
# The packages benchmarks/sd3_training_gpu.sh installs on the GPU machine, fetched here (that machine reaches no
# registry): its image has torch, transformers and accelerate but not diffusers, pydantic or the `fa4` extra, and its
# python3 is 3.12, so the compiled wheels are fetched for cp312. The `fa4` extra's pins are read from
# workloads/pyproject.toml; the CUTLASS DSL's library wheels take the DSL's version. nvidia-cutlass-dsl-libs-cu13's
# wheel (92 MB) is over what one call carries (64 MiB, the repository's own files included): it goes unpacked into
# an xz archive (about 61 MiB, 2-3 minutes on 2 cores), cut in two: LIBS/a/ (40 MiB) is carried alone in a first
# call that copies it to /tmp/parts, LIBS/b/ with WHEELS in the next one, which joins the halves and unpacks them
# into the site folder:  cat /tmp/parts/cu13.tar.xz.00 LIBS/b/cu13.tar.xz.01 | tar -xJ -C /tmp/site
# Usage: bash benchmarks/gpu_wheels.sh [WHEELS (default .gpuwhl)] [LIBS (default .fa4cu13)]
set -euo pipefail
WHEELS=${1:-.gpuwhl} LIBS=${2:-.fa4cu13}
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$WHEELS" "$LIBS"
mapfile -t FA4 < <(python3 -c '
import tomllib
for req in tomllib.load(open("workloads/pyproject.toml", "rb"))["project"]["optional-dependencies"]["fa4"]:
    print(req)')
DSL=$(printf '%s\n' "${FA4[@]}" | sed -nE 's/^nvidia-cutlass-dsl(\[[a-z0-9,]*\])?==//p')
if [ -z "$DSL" ]; then
  echo "gpu_wheels.sh: no nvidia-cutlass-dsl[EXTRAS]==VERSION pin in workloads/pyproject.toml's fa4 extra" >&2
  exit 1
fi
BINARY=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64)
# diffusers and the pydantic these runs used (what the GPU image lacks of the package's own dependencies)
"$PIP" download -q --no-deps -d "$WHEELS" "${BINARY[@]}" "${FA4[@]}" "nvidia-cutlass-dsl-libs-base==$DSL" \
  "nvidia-cutlass-dsl-libs-core==$DSL" diffusers==0.42.1 importlib_metadata==10.2.0 zipp==4.1.2 pydantic==2.12.5 \
  pydantic-core==2.41.5 typing_extensions==4.16.0 annotated-types==0.8.0 typing-inspection==0.4.5
# cu13.version names the DSL version the archive holds: a new pin packs it again.
if [ ! -f "$LIBS/cu13.tar.xz" ] || [ "$(cat "$LIBS/cu13.version" 2>/dev/null)" != "$DSL" ]; then
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' EXIT
  "$PIP" download -q --no-deps -d "$stage" "${BINARY[@]}" "nvidia-cutlass-dsl-libs-cu13==$DSL"
  mkdir "$stage/unpacked"
  python3 -m zipfile -e "$stage"/nvidia_cutlass_dsl_libs_cu13-*.whl "$stage/unpacked"
  echo "packing nvidia-cutlass-dsl-libs-cu13 into $LIBS/cu13.tar.xz (2-3 minutes)"
  tar -C "$stage/unpacked" -cf - . | xz -T2 -9 > "$LIBS/cu13.tar.xz.part"
  mv "$LIBS/cu13.tar.xz.part" "$LIBS/cu13.tar.xz"
  echo "$DSL" > "$LIBS/cu13.version"
fi
# The halves, from the whole archive (kept here to tell whether the pin changed)
if [ ! -f "$LIBS/b/cu13.tar.xz.01" ] || [ "$LIBS/cu13.tar.xz" -nt "$LIBS/b/cu13.tar.xz.01" ]; then
  rm -rf "$LIBS/a" "$LIBS/b" && mkdir -p "$LIBS/a" "$LIBS/b"
  split -b 40M -d -a 2 "$LIBS/cu13.tar.xz" "$LIBS/a/cu13.tar.xz."
  mv "$LIBS/a/cu13.tar.xz.01" "$LIBS/b/"
fi
ls -la "$WHEELS" "$LIBS" "$LIBS/a" "$LIBS/b"
