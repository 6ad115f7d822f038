#!/usr/bin/env python3
"""GPU metrics from `nvidia-smi --query-gpu` and NVIDIA XID events from the kernel log, as a .prom textfile.

Used where NVIDIA's DCGM exporter is not installed. Every run rewrites the whole file; a failed query is
reported as `sd3_gpu_collector_success 0` (and the error on stderr), never as stale numbers.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sd3_textfile import Family, render, write_atomically

# Query fields, in order. Every one exists in the drivers we support (>= 470); unsupported values read [N/A].
FIELDS = [
    "index", "uuid", "name", "pci.bus_id", "driver_version",
    "utilization.gpu", "utilization.memory", "memory.used", "memory.total",
    "temperature.gpu", "power.draw", "power.limit", "clocks.sm", "clocks.mem",
    "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
]
# field -> (metric, help, factor applied to nvidia-smi's unit)
NUMERIC = {
    "utilization.gpu": ("sd3_gpu_utilization_ratio", "Time a kernel ran on the GPU (0-1).", 0.01),
    "utilization.memory": ("sd3_gpu_memory_utilization_ratio", "Time device memory was read or written (0-1).", 0.01),
    "memory.used": ("sd3_gpu_memory_used_bytes", "Device memory in use.", 1024 * 1024),
    "memory.total": ("sd3_gpu_memory_total_bytes", "Device memory installed.", 1024 * 1024),
    "temperature.gpu": ("sd3_gpu_temperature_celsius", "GPU core temperature.", 1),
    "power.draw": ("sd3_gpu_power_watts", "Power drawn by the board.", 1),
    "power.limit": ("sd3_gpu_power_limit_watts", "Power limit of the board.", 1),
    "clocks.sm": ("sd3_gpu_sm_clock_hertz", "SM clock.", 1e6),
    "clocks.mem": ("sd3_gpu_memory_clock_hertz", "Memory clock.", 1e6),
}
ECC = {
    "ecc.errors.corrected.volatile.total": "corrected",
    "ecc.errors.uncorrected.volatile.total": "uncorrected",
}
XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")


def _value(raw: str) -> float | None:
    raw = raw.strip()
    try:
        return float(raw)
    except ValueError:
        return None  # [N/A], [Not Supported], [Unknown Error], ...


def parse_query(text: str) -> list[dict[str, str]]:
    """Rows of `--format=csv,noheader,nounits` output as dicts keyed by FIELDS."""
    rows = []
    for number, row in enumerate(csv.reader(text.splitlines(), skipinitialspace=True), start=1):
        if not row:
            continue
        if len(row) != len(FIELDS):
            raise ValueError(f"nvidia-smi line {number} has {len(row)} values, expected {len(FIELDS)}: {row!r}")
        rows.append({k: v.strip() for k, v in zip(FIELDS, row, strict=True)})
    return rows


def parse_xid(lines: list[str]) -> Counter[tuple[str, str]]:
    """Count `NVRM: Xid (PCI:...): N` kernel messages by (PCI bus id, XID code)."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in lines:
        match = XID.search(line)
        if match:
            counts[(match.group(1).lower(), match.group(2))] += 1
    return counts


def read_kernel_log(path: Path | None) -> list[str] | None:
    """The kernel ring buffer (dmesg), or a file of it; None when it cannot be read."""
    if path is not None:
        return path.read_text(errors="replace").splitlines()
    if shutil.which("dmesg") is None:
        return None
    done = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
    return done.stdout.splitlines() if done.returncode == 0 else None


def collect(query_output: str | None, error: str, kernel_log: list[str] | None, now: float) -> list[Family]:
    success = Family("sd3_gpu_collector_success", "1 when nvidia-smi answered and its output was read.")
    last_run = Family("sd3_gpu_collector_last_run_timestamp_seconds", "When the GPU collector last ran.")
    last_run.add(now)
    families = [success, last_run]
    rows: list[dict[str, str]] = []
    if query_output is not None:
        try:
            rows = parse_query(query_output)
        except ValueError as e:
            error = str(e)
            query_output = None
    success.add(1 if query_output is not None else 0)
    if error:
        print(f"sd3_gpu_metrics: {error}", file=sys.stderr)

    count = Family("sd3_gpu_count", "GPUs nvidia-smi lists on this node.")
    count.add(len(rows))
    info = Family("sd3_gpu_info", "One per GPU: its name, PCI bus id and driver version.")
    numeric = {f: Family(*meta[:2]) for f, meta in NUMERIC.items()}
    ecc = Family("sd3_gpu_ecc_errors", "ECC errors since the driver loaded (volatile counters), by type.")
    for row in rows:
        ids = {"gpu": row["index"], "uuid": row["uuid"]}
        info.add(1, **ids, name=row["name"], pci_bus_id=row["pci.bus_id"].lower(), driver_version=row["driver_version"])
        for field_name, family in numeric.items():
            value = _value(row[field_name])
            if value is not None:
                family.add(value * NUMERIC[field_name][2], **ids)
        for field_name, kind in ECC.items():
            value = _value(row[field_name])
            if value is not None:
                ecc.add(value, **ids, type=kind)
    families += [count, info, *numeric.values(), ecc]

    xid = Family("sd3_gpu_xid_events_total", "NVIDIA XID messages in the kernel log, by PCI bus id and code.",
                 kind="counter")
    xid_readable = Family("sd3_gpu_kernel_log_readable", "1 when the kernel log could be read for XID events.")
    xid_readable.add(0 if kernel_log is None else 1)
    for (bus, code), n in sorted(parse_xid(kernel_log or []).items()):
        xid.add(n, pci_bus_id=bus, xid=code)
    return [*families, xid, xid_readable]


def query(nvidia_smi: str, timeout: float) -> tuple[str | None, str]:
    if shutil.which(nvidia_smi) is None:
        return None, f"{nvidia_smi} not found: no NVIDIA driver on this node"
    try:
        done = subprocess.run([nvidia_smi, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"{nvidia_smi} did not answer within {timeout:.0f} s"
    if done.returncode != 0:
        return None, f"{nvidia_smi} exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
    return done.stdout, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--textfile-dir", type=Path, required=True, help="node_exporter's textfile directory")
    parser.add_argument("--nvidia-smi", default="nvidia-smi", help="nvidia-smi command or path")
    parser.add_argument("--kernel-log", type=Path, help="read XID events from this file instead of dmesg")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds nvidia-smi may take")
    args = parser.parse_args(argv)
    output, error = query(args.nvidia_smi, args.timeout)
    families = collect(output, error, read_kernel_log(args.kernel_log), time.time())
    write_atomically(args.textfile_dir, "sd3_gpu.prom", render(families))
    return 0


if __name__ == "__main__":
    sys.exit(main())
