#!/usr/bin/env bash
# Runs the GPU collector once on a machine with NVIDIA GPUs (nvidia-smi and python3; no systemd, no ansible),
# prints the .prom file it wrote and the raw nvidia-smi answer, and checks them. Exit 0: every GPU nvidia-smi
# lists has its utilisation, memory, temperature, power and clocks in the file, in base units.
# Usage, from the repository root: bash tests/monitoring/gpu_collector_on_device.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
collectors=roles/monitoring/files/collectors
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== nvidia-smi -L"
nvidia-smi -L
echo "== the collector's query, raw"
fields=$(python3 -c "import sys; sys.path.insert(0, '$collectors'); import sd3_gpu_metrics as g; print(','.join(g.FIELDS))")
nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits | tee "$out/query.csv"

echo "== python3 $collectors/sd3_gpu_metrics.py --textfile-dir $out"
start=$(date +%s.%N)
python3 "$collectors/sd3_gpu_metrics.py" --textfile-dir "$out"
echo "(took $(python3 -c "print(f'{$(date +%s.%N) - $start:.2f}')") s)"
echo "== $out/sd3_gpu.prom"
cat "$out/sd3_gpu.prom"

echo "== checks"
PYTHONPATH=tests/monitoring python3 - "$out/sd3_gpu.prom" "$(nvidia-smi -L | grep -c '^GPU ')" <<'PY'
import sys
from promtext import parse

metrics = parse(open(sys.argv[1]).read())
expected_gpus = int(sys.argv[2])
failures = []

def check(ok, text):
    print(("PASS " if ok else "FAIL ") + text)
    if not ok:
        failures.append(text)

def samples(name):
    return {lab.get("gpu"): v for lab, v in metrics.get(name, [])}

check(samples("sd3_gpu_collector_success").get(None) == 1, "sd3_gpu_collector_success is 1")
check(samples("sd3_gpu_count").get(None) == expected_gpus, f"sd3_gpu_count is {expected_gpus} (nvidia-smi -L)")
gpus = [str(i) for i in range(expected_gpus)]
ranges = {
    "sd3_gpu_utilization_ratio": (0, 1), "sd3_gpu_memory_utilization_ratio": (0, 1),
    "sd3_gpu_memory_used_bytes": (0, 1 << 40), "sd3_gpu_memory_total_bytes": (1 << 30, 1 << 40),
    "sd3_gpu_temperature_celsius": (5, 110), "sd3_gpu_power_watts": (1, 2000),
    "sd3_gpu_power_limit_watts": (10, 2000), "sd3_gpu_sm_clock_hertz": (1e7, 5e9),
    "sd3_gpu_memory_clock_hertz": (1e7, 1e10),
}
for name, (low, high) in ranges.items():
    values = samples(name)
    bad = {g: values.get(g) for g in gpus if values.get(g) is None or not low <= values[g] <= high}
    check(not bad, f"{name} of every GPU within [{low:g}, {high:g}]" + (f": {bad}" if bad else ""))
ecc = metrics.get("sd3_gpu_ecc_errors", [])
check(len(ecc) in (0, 2 * expected_gpus), f"sd3_gpu_ecc_errors: corrected and uncorrected per GPU, or none ({len(ecc)})")
readable = samples("sd3_gpu_kernel_log_readable").get(None)
print(f"INFO kernel log readable for XID events: {readable == 1} "
      f"({len(metrics.get('sd3_gpu_xid_events_total', []))} XID series)")
print("RESULT", "FAIL" if failures else "PASS")
sys.exit(1 if failures else 0)
PY
