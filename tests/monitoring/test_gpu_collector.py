"""The GPU collector against recorded `nvidia-smi --query-gpu` answers and kernel logs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from monitoring_support import COLLECTORS, FIXTURES
from promtext import parse, value


def test_h200_node(gpu, textfile):
    query = (FIXTURES / "nvidia_smi_h200x8.csv").read_text()
    log = (FIXTURES / "kernel_log_xid.txt").read_text().splitlines()
    m = parse(textfile.render(gpu.collect(query, "", log, 1000.0)))
    assert value(m, "sd3_gpu_collector_success") == 1
    assert value(m, "sd3_gpu_count") == 8
    assert len(m["sd3_gpu_info"]) == 8
    first = {"gpu": "0", "uuid": "GPU-4f2a7c1e-90b3-4d2e-8c6a-1b5e0d3f9a00"}
    assert value(m, "sd3_gpu_utilization_ratio", **first) == pytest.approx(0.97)
    assert value(m, "sd3_gpu_memory_total_bytes", **first) == 143771 * 2**20
    assert value(m, "sd3_gpu_memory_used_bytes", **first) == 81234 * 2**20
    assert value(m, "sd3_gpu_temperature_celsius", **first) == 52
    assert value(m, "sd3_gpu_power_watts", **first) == pytest.approx(612.48)
    assert value(m, "sd3_gpu_power_limit_watts", **first) == 700
    assert value(m, "sd3_gpu_sm_clock_hertz", **first) == 1980e6
    assert value(m, "sd3_gpu_memory_clock_hertz", **first) == 3201e6
    assert value(m, "sd3_gpu_ecc_errors", gpu="5", type="corrected") == 5
    assert value(m, "sd3_gpu_ecc_errors", gpu="7", type="uncorrected") == 1
    info = next(lab for lab, _ in m["sd3_gpu_info"] if lab["gpu"] == "7")
    assert info["name"] == "NVIDIA H200"
    assert info["pci_bus_id"] == "00000000:db:00.0"
    assert info["driver_version"] == "580.65.06"
    # Two XID 48 (the bus id in either case) and one XID 63 on the same GPU.
    assert value(m, "sd3_gpu_xid_events_total", pci_bus_id="0000:db:00", xid="48") == 2
    assert value(m, "sd3_gpu_xid_events_total", pci_bus_id="0000:db:00", xid="63") == 1
    assert value(m, "sd3_gpu_kernel_log_readable") == 1


def test_unsupported_fields_are_left_out(gpu, textfile):
    query = (FIXTURES / "nvidia_smi_not_supported.csv").read_text()
    m = parse(textfile.render(gpu.collect(query, "", [], 0.0)))
    assert value(m, "sd3_gpu_collector_success") == 1
    assert value(m, "sd3_gpu_temperature_celsius", gpu="0") == 41
    assert "sd3_gpu_power_watts" not in m
    assert "sd3_gpu_ecc_errors" not in m


def test_no_driver_reports_failure_and_no_gpu_values(gpu, textfile):
    m = parse(textfile.render(gpu.collect(None, "nvidia-smi not found", None, 0.0)))
    assert value(m, "sd3_gpu_collector_success") == 0
    assert value(m, "sd3_gpu_count") == 0
    assert value(m, "sd3_gpu_kernel_log_readable") == 0
    assert "sd3_gpu_temperature_celsius" not in m


def test_a_line_with_the_wrong_number_of_fields_is_a_failure(gpu, textfile):
    m = parse(textfile.render(gpu.collect("0, GPU-x, NVIDIA H200\n", "", [], 0.0)))
    assert value(m, "sd3_gpu_collector_success") == 0


def test_script_writes_the_file_with_a_replayed_nvidia_smi(tmp_path):
    """The script end to end: argument parsing, running nvidia-smi, the atomic write."""
    replay = tmp_path / "nvidia-smi"
    replay.write_text(f"#!/bin/sh\nexec cat {FIXTURES / 'nvidia_smi_h200x8.csv'}\n")
    replay.chmod(0o755)
    out = tmp_path / "textfile"
    subprocess.run([sys.executable, str(COLLECTORS / "sd3_gpu_metrics.py"), "--textfile-dir", str(out),
                    "--nvidia-smi", str(replay), "--kernel-log", str(FIXTURES / "kernel_log_xid.txt")], check=True)
    assert [p.name for p in out.iterdir()] == ["sd3_gpu.prom"]
    m = parse((out / "sd3_gpu.prom").read_text())
    assert value(m, "sd3_gpu_count") == 8


def test_failing_nvidia_smi_is_reported(tmp_path):
    broken = tmp_path / "nvidia-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\n"
                      "exit 9\n")
    broken.chmod(0o755)
    done = subprocess.run([sys.executable, str(COLLECTORS / "sd3_gpu_metrics.py"), "--textfile-dir", str(tmp_path),
                           "--nvidia-smi", str(broken), "--kernel-log", str(FIXTURES / "kernel_log_xid.txt")],
                          capture_output=True, text=True, check=True)
    assert "exited 9" in done.stderr and "communicate with the driver" in done.stderr
    assert value(parse((tmp_path / "sd3_gpu.prom").read_text()), "sd3_gpu_collector_success") == 0
