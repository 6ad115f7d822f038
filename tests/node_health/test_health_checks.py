"""The node health check's parsers and verdicts against recorded nvidia-smi, kernel-log and lspci outputs, and its
Slurm rule: drain on failure, resume its own drains, leave an admin's alone."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The role installs the monitoring role's sd3_textfile.py beside the script; the tests import it from there.
sys.path.insert(0, str(ROOT / "roles" / "monitoring" / "files" / "collectors"))
_load = runpy.run_path(str(ROOT / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
nh = _load("roles/node_health/files/sd3_node_health.py")

FATAL = [48, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140]


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def checks(query="query_h200x8_good.csv", expected=8, lspci="lspci_h200x8.txt", dmesg="dmesg_clean.txt",
           nvlink="nvlink_good.txt", dcgm=None, min_power_percent=100) -> dict[str, nh.Result]:
    pending, _ = nh.new_xids(nh.parse_xids(read(dmesg)), {}, "boot-1")
    results = nh.gpu_checks(read(query) if query else None, "nvidia-smi not found", expected,
                            nh.parse_lspci(read(lspci)) if lspci else None, pending, FATAL,
                            nh.parse_nvlink(read(nvlink)) if nvlink else None, dcgm, min_power_percent)
    return {r.check: r for r in results}


def failing(results: dict[str, nh.Result]) -> dict[str, str]:
    return {name: r.detail for name, r in results.items() if r.status == nh.FAIL}


def test_a_healthy_h200_node_passes_every_gpu_check():
    results = checks()
    assert failing(results) == {}
    assert {n for n, r in results.items() if r.status == nh.PASS} == {
        "driver", "gpu_count", "ecc_uncorrected", "retired_pages_row_remap", "xid_errors", "pcie_link",
        "clock_throttle", "nvlink", "persistence_mode", "power_limit"}
    assert results["dcgm_diag"].status == nh.SKIP  # no dcgmi


def test_uncorrectable_ecc_fails_naming_the_gpu():
    assert failing(checks(query="query_ecc.csv")) == {
        "ecc_uncorrected": "GPU 3 (00000000:5d:00.0): 2 uncorrectable ECC error(s) since the driver loaded"}


def test_xid_79_since_the_last_check_fails_and_xid_13_alone_does_not():
    assert failing(checks(dmesg="dmesg_xid79.txt")) == {"xid_errors": "XID 79 on 0000:db:00 at 8123 s after boot"}
    events = nh.parse_xids(read("dmesg_xid79.txt"))
    assert [(bus, code) for _, bus, code in events] == [("0000:2a:00", 13), ("0000:db:00", 79)]


def test_an_unreadable_kernel_log_skips_the_xid_check():
    results = nh.gpu_checks(read("query_h200x8_good.csv"), "", 8, None, None, FATAL, None, None)
    assert {r.check: r.status for r in results}["xid_errors"] == nh.SKIP


def test_xids_are_counted_once_but_a_fatal_one_stays_until_reboot():
    events = nh.parse_xids(read("dmesg_xid79.txt"))
    pending, state = nh.new_xids(events, {}, "boot-1")
    assert len(pending) == 2
    again, state = nh.new_xids(events, state, "boot-1")  # the same lines: nothing new, the XID 79 still pending
    assert [e[2] for e in again] == [13, 79] and state["last_time"] == pytest.approx(8123.447001)
    after_reboot, state = nh.new_xids([], state, "boot-2")
    assert after_reboot == [] and state["pending"] == []


def test_an_x4_link_fails_from_nvidia_smi_and_from_lspci():
    assert failing(checks(query="query_x4.csv")) == {"pcie_link": "GPU 5 (00000000:ab:00.0): link x4 of x16"}
    assert failing(checks(lspci="lspci_x4.txt")) == {"pcie_link": "0000:5d:00.0: lspci LnkSta x4 of LnkCap x16"}


def test_a_slot_below_the_gpus_generation_fails_but_an_idle_downshift_does_not():
    assert failing(checks(query="query_gen3_slot.csv")) == {
        "pcie_link": "GPU 1 (00000000:2a:00.0): link at most gen 3, the GPU does gen 5"}
    # lspci_h200x8 shows every link at 2.5GT/s "(downgraded)": idle power saving, not a fault.
    assert checks()["pcie_link"].status == nh.PASS


def test_thermal_throttling_fails_and_the_power_cap_does_not():
    assert failing(checks(query="query_throttle.csv")) == {
        "clock_throttle": "GPU 2 (00000000:3a:00.0): hardware thermal slowdown (0x0000000000000040)"}


def test_a_missing_gpu_fails_against_the_inventory_and_the_pci_bus():
    detail = failing(checks(query="query_missing_gpu.csv"))["gpu_count"]
    assert "nvidia-smi lists 7 GPU(s), the inventory promises 8" in detail
    assert "8 NVIDIA GPU(s) on the PCI bus but nvidia-smi lists 7: one fell off the bus" in detail
    # Even without a promise, the bus shows the lost one.
    assert "fell off the bus" in failing(checks(query="query_missing_gpu.csv", expected=0))["gpu_count"]


def test_row_remap_failure_nvlink_down_and_persistence_off_fail():
    assert failing(checks(query="query_row_remap_failed.csv")) == {
        "retired_pages_row_remap": "GPU 6 (00000000:ba:00.0): row remapping failed (replace the GPU)"}
    assert failing(checks(nvlink="nvlink_down.txt")) == {"nvlink": "GPU 4: 17 of 18 links up"}
    assert set(failing(checks(query="query_persistence_off.csv"))) == {"persistence_mode"}


def test_a_gpu_capped_below_its_default_power_limit_fails_unless_the_cap_is_allowed():
    assert failing(checks(query="query_power_capped.csv")) == {
        "power_limit": "GPU 4 (00000000:9a:00.0): enforced power limit 500 W, 71% of its default 700 W "
                       "(sudo nvidia-smi -i 4 -pl 700)"}
    # a power budget the admin chose: 70% allowed passes, and 0 turns the check off
    assert checks(query="query_power_capped.csv", min_power_percent=70)["power_limit"].status == nh.PASS
    assert checks(query="query_power_capped.csv", min_power_percent=0)["power_limit"].status == nh.SKIP
    # a driver that does not report the limits: skip, never pass
    assert checks(query="query_a100_driver535.csv", expected=4, lspci=None,
                  nvlink=None)["power_limit"].status == nh.SKIP


def test_no_nvlink_reads_skip():
    assert nh.parse_nvlink(read("nvlink_none.txt")) == {}
    assert checks(nvlink="nvlink_none.txt")["nvlink"].status == nh.SKIP


def test_an_older_driver_s_field_names_are_read_and_what_it_lacks_skips():
    results = checks(query="query_a100_driver535.csv", expected=4, lspci=None, nvlink=None)
    assert failing(results) == {}
    assert results["clock_throttle"].status == nh.PASS  # clocks_throttle_reasons.active, the old name
    assert results["retired_pages_row_remap"].status == nh.PASS


def test_no_driver_fails_where_gpus_are_promised_and_skips_where_none_are():
    promised = checks(query=None, expected=8, lspci=None, nvlink=None)
    assert promised["driver"].status == nh.FAIL and "nvidia-smi does not answer" in promised["driver"].detail
    assert {r.status for n, r in promised.items() if n != "driver"} == {nh.SKIP}
    bare = checks(query=None, expected=0, lspci=None, nvlink=None)
    assert {r.status for r in bare.values()} == {nh.SKIP}


def test_dcgm_level_1_failure_is_reported():
    results = checks(dcgm=(226, "| Memory  | Fail - GPU 3: memory test failed |\n"))
    assert failing(results) == {"dcgm_diag": "| Memory  | Fail - GPU 3: memory test failed |"}


def test_dcgm_does_not_run_under_a_job():
    results = checks(dcgm="2 process(es) use the GPUs; the DCGM diagnostic runs on idle GPUs only")
    assert results["dcgm_diag"].status == nh.SKIP and "idle GPUs only" in results["dcgm_diag"].detail


def test_shared_volume_and_free_disk(tmp_path):
    assert nh.shared_volume_check(str(tmp_path)).detail == f"{tmp_path} is not mounted"
    assert nh.free_disk_check("/", 1e9).status == nh.FAIL
    assert "below 1e+09 GB" in nh.free_disk_check("/", 1e9).detail
    assert nh.free_disk_check("/", 0.001).status == nh.PASS


SHOW = "NodeName=gpu01 Arch=x86_64 CoresPerSocket=1\n   State={state} ThreadsPerCore=1\n{reason}"


@pytest.mark.parametrize(("state", "reason", "failures", "action"), [
    ("IDLE", "", ["ecc"], "drain"),
    ("IDLE", "", [], "none"),
    ("IDLE+DRAIN", "sd3-health: ecc_uncorrected: 2 errors [root@2026-12-03T20:00:00]", [], "resume"),
    ("IDLE+DRAIN", "replacing a fan [ops@2026-12-03T20:00:00]", [], "none"),
    ("IDLE+DRAIN", "replacing a fan [ops@2026-12-03T20:00:00]", ["ecc"], "none"),
    ("MIXED+DRAIN", "sd3-health: old reason", ["ecc"], "drain"),
])
def test_slurm_drains_failing_nodes_resumes_its_own_and_leaves_admins_drains(state, reason, failures, action):
    flags, current = nh.slurm_node(SHOW.format(state=state, reason=f"   Reason={reason}\n" if reason else ""))
    results = [nh.Result(f, nh.FAIL, "2 errors") for f in failures]
    got, text = nh.slurm_action(flags, current, results, "sd3-health:")
    assert got == action
    if action == "drain":
        assert text == "sd3-health: ecc: 2 errors"
    if reason and not reason.startswith("sd3-health:"):
        assert "drained by an admin (replacing a fan)" in text


def test_main_writes_a_metric_per_check_and_exits_1_on_failure(tmp_path, capsys):
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    for src, dst in (("query_ecc.csv", "nvidia-smi-query.csv"), ("dmesg_clean.txt", "dmesg.txt"),
                     ("lspci_h200x8.txt", "lspci.txt"), ("nvlink_good.txt", "nvidia-smi-nvlink.txt")):
        (recorded / dst).write_text(read(src))
    cfg = {"recorded_dir": str(recorded), "state_dir": str(tmp_path / "state"), "expected_gpus": 8,
           "xid_fatal": FATAL, "shared_path": "", "disk_path": "/", "min_free_disk_gb": 0.001,
           "textfile_dir": str(tmp_path / "textfile"), "node_name": "gpu01"}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert nh.main(["--config", str(tmp_path / "cfg.json"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["healthy"] is False
    prom = (tmp_path / "textfile" / "sd3_node_health.prom").read_text()
    assert 'sd3_node_health_check_ok{check="ecc_uncorrected"} 0' in prom
    assert 'sd3_node_health_check_ok{check="xid_errors"} 1' in prom
    assert 'sd3_node_health_check_skipped{check="shared_volume"} 1' in prom
    assert "sd3_node_health_healthy 0" in prom
    assert len([line for line in prom.splitlines() if line.startswith("sd3_node_health_check_skipped{")]) == len(
        nh.CHECKS)
    (recorded / "nvidia-smi-query.csv").write_text(read("query_h200x8_good.csv"))
    assert nh.main(["--config", str(tmp_path / "cfg.json")]) == 0


def test_a_missing_config_is_a_clear_error(tmp_path, capsys):
    assert nh.main(["--config", str(tmp_path / "nope.json")]) == 2
    assert "run the node_health role" in capsys.readouterr().err


def test_outputs_recorded_on_the_h200_machine_pass():
    """nvidia-smi's query and `nvlink -s` as the project's H200 machine printed them (benchmarks/hardware_profiles.md;
    that machine has no lspci, so the PCIe check reads nvidia-smi's link fields alone)."""
    results = checks(query="query_h200_recorded.csv", expected=1, lspci=None, nvlink="nvlink_h200_recorded.txt")
    assert failing(results) == {}
    assert results["gpu_count"].status == nh.PASS and "1 GPU(s)" in results["gpu_count"].detail
    assert results["persistence_mode"].status == nh.PASS
    assert results["nvlink"].status == nh.SKIP
