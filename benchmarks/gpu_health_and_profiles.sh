#!/usr/bin/env bash
# On a GPU machine, from the repository root: the node health check against the real GPUs, then
# `sd3cluster verify` with the hardware profile found from the GPU's name (its GEMM, memory-bandwidth and
# per-GPU training thresholds must pass), then once more with a deliberately wrong profile (GPU numbers doubled:
# it must fail, naming the measured number and the threshold). Results go to $OUT (default ./gpu-results).
#
#   OUT=/tmp/out bash benchmarks/gpu_health_and_profiles.sh
#
# Needs: python3 with torch (CUDA), and the sd3cluster package's dependencies: diffusers, pydantic (and its
# pydantic-core, annotated-types, typing-inspection, typing-extensions), PyYAML, safetensors, tqdm. The package
# itself is used from workloads/src (PYTHONPATH), nothing is installed. No network, no systemd, no Ansible, no Slurm:
# the health check runs without --slurm (it drains nothing) and verify runs as one process per GPU.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/workloads/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
status=0
fail() { echo "FAIL: $*" | tee -a "$OUT/summary.txt"; status=1; }

python3 - <<'EOF' || { echo "missing Python packages (see above)"; exit 2; }
import importlib, sys
missing = [m for m in ("torch", "diffusers", "pydantic", "yaml", "safetensors", "tqdm") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"install these first (wheels): {', '.join(missing)}")
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
EOF

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
echo "GPUs: $gpus ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1))" | tee "$OUT/summary.txt"

# 1. Health check, as the node_health role installs it (the monitoring role's textfile writer beside it).
mkdir -p "$OUT/node-health" "$OUT/textfile"
cp roles/node_health/files/sd3_node_health.py roles/monitoring/files/collectors/sd3_textfile.py "$OUT/node-health/"
cat > "$OUT/node-health/config.json" <<EOF
{"node_name": "$(hostname -s)", "expected_gpus": $gpus, "xid_fatal": [48, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140],
 "dcgm_level": 1, "nvidia_smi": "nvidia-smi", "shared_path": "", "disk_path": "/", "min_free_disk_gb": 1,
 "drain_prefix": "sd3-health:", "textfile_dir": "$OUT/textfile", "state_dir": "$OUT/node-health/state", "recorded_dir": ""}
EOF
# The raw outputs the check reads, recorded for the tests of its parsers.
nvidia-smi --query-gpu=index,pci.bus_id,name,persistence_mode,ecc.errors.uncorrected.volatile.total,retired_pages.pending,remapped_rows.failure,remapped_rows.pending,pcie.link.gen.max,pcie.link.gen.gpumax,pcie.link.width.current,pcie.link.width.max,clocks_event_reasons.active \
  --format=csv,nounits > "$OUT/node-health/nvidia-smi-query.csv" 2>&1
nvidia-smi nvlink -s > "$OUT/node-health/nvidia-smi-nvlink.txt" 2>&1
lspci -D -vv -d 10de: > "$OUT/node-health/lspci.txt" 2>&1
python3 "$OUT/node-health/sd3_node_health.py" --config "$OUT/node-health/config.json" --json > "$OUT/health.json" 2> "$OUT/health.err"
health_rc=$?
python3 - "$OUT/health.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
data = json.load(open(sys.argv[1]))
for c in data["checks"]:
    print(f"  health {c['check']:24} {c['status']:4}  {c['detail']}")
EOF
[ "$health_rc" -eq 0 ] && echo "health check: PASS (exit 0)" | tee -a "$OUT/summary.txt" \
  || fail "health check exited $health_rc (see $OUT/health.json, $OUT/health.err)"

# 2. verify with the profile of this GPU (auto: from its name). The correctness checks train the tiny preset;
# the per-GPU training check trains the profiles' verify preset (SD3-medium 1024^2, batch 8, bf16, compiled).
common=(verify --device cuda --set data.resolution=64 --set data.batch_size=2 --set model.compile=false)
python3 -m sd3cluster "${common[@]}" --report "$OUT/verify-profile.json" > "$OUT/verify-profile.log" 2>&1
verify_rc=$?
tail -n 16 "$OUT/verify-profile.log" | tee -a "$OUT/summary.txt"
[ "$verify_rc" -eq 0 ] && echo "verify with the GPU's profile: PASS (exit 0)" | tee -a "$OUT/summary.txt" \
  || fail "verify with the GPU's profile exited $verify_rc (see $OUT/verify-profile.log)"

# 3. A deliberately wrong profile: every GPU's numbers doubled. GEMM and memory must fail, naming number and threshold.
python3 - "$OUT/wrong-profiles.yaml" <<'EOF'
import sys, yaml
from sd3cluster import hardware
data = hardware.load_profiles()
for gpu in data["gpus"].values():
    for key in ("gemm_bf16_tflops", "memory_bandwidth_gb_s", "train_images_per_s"):
        for kind in ("measured", "estimate", "datasheet_peak"):
            if isinstance(gpu.get(key), dict) and gpu[key].get(kind) is not None:
                gpu[key][kind] = 2 * gpu[key][kind]
open(sys.argv[1], "w").write(yaml.safe_dump(data, sort_keys=False))
EOF
SD3_HARDWARE_PROFILES="$OUT/wrong-profiles.yaml" python3 -m sd3cluster "${common[@]}" --set verify.gpu_training=false \
  --report "$OUT/verify-wrong-profile.json" > "$OUT/verify-wrong-profile.log" 2>&1
wrong_rc=$?
python3 - "$OUT/verify-wrong-profile.json" "$wrong_rc" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
checks = {c["name"]: c for c in json.load(open(sys.argv[1]))["checks"]}
ok = sys.argv[2] == "1"
for name in ("gpu_gemm_bf16", "gpu_memory_bandwidth"):
    c = checks[name]
    print(f"  wrong profile {name}: {c['status']}: {c['detail']}")
    ok &= c["status"] == "fail" and "below the threshold" in c["detail"]
print("verify with a wrong profile: " + ("FAILS as it must (exit 1, number and threshold named)" if ok
                                         else f"did NOT fail as it must (exit {sys.argv[2]})"))
sys.exit(0 if ok else 1)
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 4. The numbers, for benchmarks/ and the hardware profiles.
python3 - "$OUT/verify-profile.json" <<'EOF' | tee "$OUT/numbers.txt" | tee -a "$OUT/summary.txt"
import json, sys
checks = {c["name"]: c for c in json.load(open(sys.argv[1]))["checks"]}
for name in ("gpu_gemm_bf16", "gpu_memory_bandwidth", "gpu_training_images_per_s"):
    c = checks[name]
    value = f"{c['value']:.4g}" if isinstance(c["value"], (int, float)) else c["value"]
    print(f"{name}: {value} {c['unit']} (threshold {c['threshold']}, {c['status']}); {c['detail']}")
EOF
echo "overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$OUT/summary.txt"
exit $status
