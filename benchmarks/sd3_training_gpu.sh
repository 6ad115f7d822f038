#!/usr/bin/env bash
# The training-speed runs of benchmarks/sd3_training.md on one GPU machine: every case in its own process,
# all in one call. Usage (from the repository root, wheels of the optional `fa4` extra and of diffusers & co.
# under WHEELS, as benchmarks/gpu_wheels.sh fetches them, the CUTLASS libraries already unpacked into SITE,
# results written to OUT):
#   WHEELS=.gpuwhl OUT=/tmp/out bash benchmarks/sd3_training_gpu.sh [tests] [attention] [1024] [train] [512] [split] [mlp] [mlp1024]
#     [normtests] [norms] [fa4bwd] [knobs] [caches] [restore] [adamw] [layout] [final1024] [targets1024] [final512]
#     [chain] [ab] [fa4layout] [ref1024] [projgemm] [proj] [health] [normcfg]
# BASE: other commits' copies of the package's source, each made here by
#   mkdir -p .gpubase/REV && git archive REV workloads/src | tar -x -C .gpubase/REV
# and carried (.gpubase): part `ab` runs the optimized step from this tree and from each folder BASE names (spaces
# between), one process each, all traced. SRC: the source the other parts run (default: this tree's).
set -uo pipefail
: "${OUT:?set OUT to the results folder}" "${WHEELS:=.gpuwhl}" "${SITE:=/tmp/site}"
mkdir -p "$OUT" "$SITE"
# Into a stage first, then merged: pip --target will not add to a package folder that exists (the CUTLASS DSL's
# libraries come in several wheels that share nvidia_cutlass_dsl/, and -libs-cu13 may be unpacked there already).
rm -rf "$SITE.stage" && python3 -m pip install -q --no-index --no-deps --target "$SITE.stage" "$WHEELS"/*.whl 2>&1 | tail -2
cp -a "$SITE.stage/." "$SITE/"
# pip --target does not run the CUTLASS DSL's .pth file: its packages folder goes on the path by hand. Through a
# path with a site-packages folder in it: quack keys its kernel cache by the source of the functions an epilogue
# calls, except for installed ones, which it knows by a "site-packages" in their file name.
mkdir -p /tmp/bench-env && ln -sfn "$SITE" /tmp/bench-env/site-packages
export PYTHONPATH="/tmp/bench-env/site-packages:/tmp/bench-env/site-packages/nvidia_cutlass_dsl/dsl_packages:${SRC:-$PWD/workloads/src}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; from sd3cluster.attention import fa4_import_problem as p; \
print('torch', torch.__version__, 'fa4:', p() or 'imports')"
bench() {  # NAME CASE [extra args]: one case, one process
  local name=$1 case=$2; shift 2
  echo "== $name ($case)"
  python3 benchmarks/sd3_throughput.py --case "$case" --steps 10 --warmup 3 --out "$OUT/$name.json" "$@" 2>&1 \
    | grep -v "^|" | grep -E "^\[|images/s|TFLOP|failed|memory|Error" | tail -40
}
gpu_logged() {  # NAME COMMAND...: the command with the card's clock, power and temperature logged every 200 ms
  # beside it into $OUT/NAME-gpu.csv (kernels held under load run at the power limit's clock, not the boost clock)
  local name=$1 smi; shift
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 \
    > "$OUT/$name-gpu.csv" & smi=$!
  "$@"
  kill "$smi"
}
train_run() {  # sd3cluster train itself, its metrics.jsonl read
  echo "== sd3cluster train, 1024^2, batch 8, 40 steps, a log line every 10"
  rm -rf /tmp/train-run
  python3 -m sd3cluster train --device cuda --set model.preset=sd3-medium --set data.resolution=1024 \
    --set data.batch_size=8 --set data.synthetic_samples=400 --set train.steps=40 --set train.log_every=10 \
    --set output.dir=/tmp/train-run --set output.progress=false --set output.tensorboard=false 2>&1 \
    | grep -E "^(model|attention|done)|Error" | tail -5
  cp /tmp/train-run/metrics.jsonl "$OUT/train-1024.jsonl" && python3 -c "
import json; rows=[json.loads(l) for l in open('$OUT/train-1024.jsonl')]
for r in rows: print(f\"train step {r['step']}: {r['images_per_s']:.2f} images/s (over the last 10 steps), MFU {r['mfu']:.3f}\")"
}
targets_1024() {  # the three cases the 1024^2 targets need: the reference, bench optimized, train
  bench ref-1024 sd3-medium:1024:8:reference
  bench opt-1024 sd3-medium:1024:8:optimized
  train_run
}
for part in "${@:-tests attention 1024 train}"; do for p in $part; do case $p in
  tests) python3 -m pytest -q tests/workloads/test_attention.py tests/workloads/test_fused_mlp.py \
           tests/workloads/test_fused_norm.py 2>&1 | tail -5 ;;
  attention) python3 benchmarks/sd3_throughput.py --sdpa --case sd3-medium:256:1:reference --steps 1 --warmup 1 \
               2>&1 | grep -E "^(sdpa|fa4|matmul)" ;;
  1024) bench ref-1024 sd3-medium:1024:8:reference
        bench opt-1024 sd3-medium:1024:8:optimized
        bench opt-cudnn-1024 sd3-medium:1024:8:optimized:attn=cudnn ;;
  train) train_run ;;
  ref1024) bench ref-1024 sd3-medium:1024:8:reference ;;
  512) bench ref-512 sd3-medium:512:32:reference
       bench opt-512 sd3-medium:512:32:optimized ;;
  split) bench split-1024 sd3-medium:1024:8:optimized --profile-steps 3 ;;
  mlp) python3 -m pytest -q tests/workloads/test_fused_mlp.py 2>&1 | tail -3
       bench opt-1024 sd3-medium:1024:8:optimized:mlp=torch
       bench opt-mlp-1024 sd3-medium:1024:8:optimized:mlp=quack
       bench split-mlp-1024 sd3-medium:1024:8:optimized:mlp=quack --profile-steps 3 ;;
  mlp1024) bench ref-1024 sd3-medium:1024:8:reference
           bench opt-1024 sd3-medium:1024:8:optimized
           bench opt-torchmlp-1024 sd3-medium:1024:8:optimized:mlp=torch ;;
  # with the card's clock and power logged beside it (FA4 alone runs into the power limit as the step does)
  fa4layout) gpu_logged fa4-layouts python3 benchmarks/fa4_layouts.py --out "$OUT/fa4-layouts.json" 2>&1 \
               | grep -E "TFLOP/s|failed|Error" ;;
  # the attention projections' GEMMs, cuBLAS against quack (the feed-forward's GEMMs run faster on quack), the
  # card's clock and power logged beside them
  projgemm) gpu_logged projection-gemms python3 benchmarks/projection_gemms.py \
              --out "$OUT/projection-gemms.json" 2>&1 | grep -E "TFLOP/s|failed|a step|Error" ;;
  # the attention projections on quack (model.projections, run 19): its GPU test, the step with it and without
  proj) python3 -m pytest -q tests/workloads/test_row_blocks.py 2>&1 | tail -3
        bench opt-1024 sd3-medium:1024:8:optimized
        bench opt-projtorch-1024 sd3-medium:1024:8:optimized:proj=torch ;;
  # the node health check and `sd3cluster verify` (benchmarks/gpu_health_and_profiles.sh) with the kernels of the
  # prod install (the fa4 extra, printed as importing at the top): its per-GPU training check measures the
  # profiles' train_images_per_s
  health) OUT="$OUT/health" bash benchmarks/gpu_health_and_profiles.sh | tail -14 ;;
  # the fused adaLN kernels alone under other launch configurations (rows per program, warps), the clock logged
  normcfg) gpu_logged adaln-configs python3 benchmarks/adaln_kernel_configs.py --out "$OUT/adaln-configs.json" 2>&1 \
             | grep -E "GB/s|DIFFERS|failed|Error" ;;
  fa4bwd) python3 benchmarks/fa4_backward_configs.py --out "$OUT/fa4-bwd-configs.json" 2>&1 \
            | grep -E "TFLOP/s|failed:" | tail -15 ;;
  # Inductor's reductions over SD3's 1536 channels are looped (two passes over a row) unless persistent
  # reductions are allowed past 1024 elements: multi_kernel compiles both and keeps the faster at run time.
  knobs) TORCHINDUCTOR_MULTI_KERNEL=1 bench opt-multikernel-1024 sd3-medium:1024:8:optimized ;;
  normtests) python3 -m pytest -q tests/workloads/test_fused_norm.py 2>&1 | tail -3 ;;
  norms) python3 benchmarks/adaln_kernels.py 2>&1 | grep -E "ms|Error" | tail -6
         bench opt-1024 sd3-medium:1024:8:optimized
         bench opt-normtorch-1024 sd3-medium:1024:8:optimized:norm=torch ;;
  # quack's tuned GEMM configurations, for the next machine: `caches` saves them, `restore` (CACHE=the tar) puts
  # them back, which saves its tuning (about 3 minutes at a new shape) in the first step
  caches) tar -C "$HOME" -cJf "$OUT/quack-cache.tar.xz" .quack && ls -la "$OUT/quack-cache.tar.xz" ;;
  restore) tar -C "$HOME" -xJf "${CACHE:?set CACHE to a quack-cache.tar.xz}" && echo "quack cache restored" ;;
  # the Triton AdamW (optim.kernel): its tests on the GPU, the optimizer step alone, the training step with each
  adamw) python3 -m pytest -q tests/workloads/test_fused_adamw.py 2>&1 | tail -3
         for k in torch triton; do
           python3 benchmarks/adamw_kernels.py --kernel $k --configs 4096x4,2048x4 \
             --out "$OUT/adamw-$k.json" 2>&1 | tail -5; done
         bench opt-1024 sd3-medium:1024:8:optimized
         bench opt-adamtorch-1024 sd3-medium:1024:8:optimized:opt=torch
         bench split-1024 sd3-medium:1024:8:optimized --profile-steps 3 ;;
  # bf16 weights with fp32 masters (train.weights) and the sequence-first blocks (model.layout): their tests on the
  # GPU, the step as it is (fp32 weights, batch layout), with each of the two, with both, and the split with both
  layout) python3 -m pytest -q tests/workloads/test_fused_adamw.py tests/workloads/test_bf16_weights.py \
            tests/workloads/test_attention.py tests/workloads/test_fused_norm.py 2>&1 | tail -4
          bench opt-1024 sd3-medium:1024:8:optimized
          bench opt-w16-1024 sd3-medium:1024:8:optimized:w=auto
          bench opt-seq-1024 sd3-medium:1024:8:optimized:layout=auto
          bench opt-both-1024 sd3-medium:1024:8:optimized:w=auto,layout=auto
          bench split-both-1024 sd3-medium:1024:8:optimized:w=auto,layout=auto --profile-steps 3 ;;
  # the chained sequence-first blocks (run 15): their GPU tests, the step with and without the sequence-first layout,
  # and the copy ops of one step of each (the stream-sized block-edge copies of run 14 should be gone)
  chain) python3 -m pytest -q tests/workloads/test_fused_norm.py 2>&1 | tail -3
         bench opt-1024 sd3-medium:1024:8:optimized --copy-ops
         bench opt-batch-1024 sd3-medium:1024:8:optimized:layout=batch --copy-ops ;;
  # the comparison of the performance targets, each case its own process: 1024^2 in one call, 512^2 in the next
  # (quack tunes its GEMMs for 512^2 for 3 to 6.5 minutes on a machine whose cache lacks that shape)
  final1024) targets_1024
             bench opt-adamtorch-1024 sd3-medium:1024:8:optimized:opt=torch ;;
  # final1024 without its torch-AdamW comparison, for a short device call
  targets1024) targets_1024 ;;
  final512) bench ref-512 sd3-medium:512:32:reference
            bench opt-512 sd3-medium:512:32:optimized ;;
  # one change against the tree it was made on (BASE), each step traced for the split and the kernel table. Each
  # tree compiles into its own Inductor cache: trees before parallel.tag_compile_caches would be handed this tree's
  # cached graphs, planned with its custom ops' output shapes (run 17's first try failed so).
  ab) bench opt-1024 sd3-medium:1024:8:optimized --profile-steps 3
      for base in ${BASE:?set BASE to the other trees, see the top}; do
        PYTHONPATH="${PYTHONPATH%:*}:$PWD/$base/workloads/src" TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$(basename "$base")" \
          bench "base-$(basename "$base")-1024" sd3-medium:1024:8:optimized --profile-steps 3
      done ;;
  *) echo "unknown part $p (the parts are listed at the top of $0)" >&2; exit 2 ;;
esac; done; done
