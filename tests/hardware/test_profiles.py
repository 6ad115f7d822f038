"""The hardware profiles: lookup from nvidia-smi names and NIC speeds, threshold arithmetic, the data file's
provenance, and the Ansible filter that reads the same file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hw = _load("hardware_rules", ROOT / "workloads" / "src" / "sd3cluster" / "hardware.py")
flt = _load("hardware_filter", ROOT / "ansible" / "plugins" / "filter" / "hardware_profiles.py")
PROFILES = hw.load_profiles()

# Names as `nvidia-smi --query-gpu=name --format=csv,noheader` prints them (driver 535-580).
SMI_NAMES = {
    "NVIDIA H200": "h200",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA A100-SXM4-80GB": "a100-sxm-80gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA L40S": "l40s",
    "NVIDIA L4": "l4",
    "NVIDIA A10G": "a10g",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA GeForce RTX 3090": "rtx-3090",
}


@pytest.mark.parametrize(("smi_name", "profile"), sorted(SMI_NAMES.items()))
def test_every_listed_model_is_found_from_its_nvidia_smi_name(smi_name, profile):
    assert hw.gpu_profile_name(PROFILES, smi_name) == profile


def test_l4_does_not_swallow_l40s_nor_h200_the_nvl_variant():
    assert hw.gpu_profile_name(PROFILES, "NVIDIA L40S") == "l40s"
    with pytest.raises(hw.ProfileError, match="no hardware profile matches the GPU 'NVIDIA H200 NVL'"):
        hw.gpu_profile_name(PROFILES, "NVIDIA H200 NVL")


def test_unknown_model_must_be_named_and_the_error_lists_the_choices():
    with pytest.raises(hw.ProfileError) as err:
        hw.gpu_profile_name(PROFILES, "Tesla V100-SXM2-32GB")
    assert "Tesla V100-SXM2-32GB" in str(err.value) and "h200" in str(err.value)
    assert "verify.gpu_profile" in str(err.value)
    assert hw.gpu_profile_name(PROFILES, "Tesla V100-SXM2-32GB", override="a100-40gb") == "a100-40gb"


def test_a_misspelt_override_is_an_error_not_a_silent_default():
    with pytest.raises(hw.ProfileError, match="GPU profile 'h20' does not exist"):
        hw.gpu_profile_name(PROFILES, "NVIDIA H200", override="h20")
    with pytest.raises(hw.ProfileError, match="network profile 'ib-xdr' does not exist"):
        hw.network_profile_name(PROFILES, "infiniband", 800, override="ib-xdr")


@pytest.mark.parametrize(("layer", "raw", "profile"), [
    ("ethernet", 10000, "eth-10g"), ("ethernet", "25000", "eth-25g"), ("ethernet", 100000, "eth-100g"),
    ("ethernet", 200000, "eth-200g"), ("ethernet", 400000, "eth-400g"),
    ("infiniband", "200 Gb/sec (4X HDR)", "ib-hdr"), ("infiniband", "400 Gb/sec (4X NDR)", "ib-ndr"),
])
def test_network_profile_from_the_nic_speed_the_system_reports(layer, raw, profile):
    gbit = hw.nic_speed_gbit(raw, layer)
    assert hw.network_profile_name(PROFILES, layer, gbit) == profile
    assert flt.network_profile(layer, raw) == profile


def test_a_nic_without_link_or_an_odd_speed_needs_an_explicit_profile():
    assert hw.nic_speed_gbit(-1) is None  # /sys/class/net/*/speed of a NIC without link
    with pytest.raises(hw.ProfileError, match=r"no network profile for ethernet at 40\.0 Gbit/s"):
        hw.network_profile_name(PROFILES, "ethernet", 40.0)
    with pytest.raises(hw.ProfileError, match="name the network profile explicitly"):
        hw.network_profile_name(PROFILES, "token-ring", 16)
    assert hw.network_profile_name(PROFILES, "efa", None, override="efa") == "efa"


def test_threshold_is_expected_times_fraction():
    t = hw.thresholds(PROFILES, 0.8, gpu="h200", gpus_per_node=8, network="ib-ndr", nics=8)
    assert t[hw.GEMM]["expected"] == 770.0 and t[hw.GEMM]["threshold"] == 616.0
    assert t[hw.GEMM]["source"] == "measured"
    assert t[hw.TRAIN]["threshold"] == pytest.approx(15.2)
    assert t[hw.MEMORY]["expected"] == 4288.0 and t[hw.MEMORY]["source"] == "measured"
    datasheet = hw.thresholds(PROFILES, 0.8, gpu="a100-sxm-80gb")[hw.MEMORY]
    assert datasheet["expected"] == pytest.approx(2039 * 0.85)
    assert datasheet["threshold"] == pytest.approx(2039 * 0.85 * 0.8)
    assert datasheet["source"].startswith("datasheet peak 2039 x 0.85")
    assert t[hw.INTRA]["threshold"] == pytest.approx(360 * 0.8)
    assert t[hw.INTER]["expected"] == pytest.approx(8 * 50 * 0.8)
    half = hw.thresholds(PROFILES, 0.5, gpu="h200")
    assert half[hw.GEMM]["threshold"] == 385.0


@pytest.mark.parametrize("fraction", [0, 0.0, -0.5, 1.5, "most", None])
def test_a_fraction_that_passes_anything_or_fails_healthy_nodes_is_refused(fraction):
    with pytest.raises(hw.ProfileError, match="fraction"):
        hw.thresholds(PROFILES, fraction, gpu="h200")


def test_checks_without_a_number_have_no_threshold():
    one_gpu = hw.thresholds(PROFILES, gpu="h200", gpus_per_node=1)
    assert one_gpu[hw.INTRA] is None  # a one-GPU node has no intra-node all-reduce
    assert one_gpu[hw.INTER] is None  # no network named
    small = hw.thresholds(PROFILES, gpu="rtx-4090", gpus_per_node=4)
    assert small[hw.TRAIN] is None  # the verify preset does not fit in 24 GB
    assert small[hw.INTRA]["threshold"] == pytest.approx(16 * 0.8)
    bridge = hw.thresholds(PROFILES, gpu="rtx-3090", gpus_per_node=4, link="nvlink_bridge_3090")
    assert bridge[hw.INTRA] is None  # a bridge joins two cards only


def test_verdict_never_passes_what_was_not_measured():
    assert hw.verdict(None, 616.0) == "skip"
    assert hw.verdict(700.0, None) == "skip"
    assert hw.verdict(700.0, 616.0) == "pass"
    assert hw.verdict(385.0, 616.0) == "fail"
    with pytest.raises(hw.ProfileError, match="would pass anything"):
        hw.verdict(1.0, 0.0)


def test_explain_names_the_number_and_the_threshold():
    line = hw.explain(hw.GEMM, 385.0, 616.0, "measured")
    assert line == "gemm_bf16_tflops: 385 TFLOP/s, below the threshold 616 TFLOP/s (measured)"


def test_every_number_says_where_it_comes_from():
    achievable = PROFILES["achievable"]
    assert all(0 < a["fraction"] <= 1 and a["basis"] for a in achievable.values())
    for name, gpu in PROFILES["gpus"].items():
        assert gpu["match"] and gpu["source"] and gpu["link"] in PROFILES["links"], name
        for check in (hw.GEMM, hw.MEMORY):
            entry = gpu[check]
            assert entry.get("datasheet_peak", 0) > 0, (name, check)  # every model has its vendor peak
        for check in (hw.GEMM, hw.MEMORY, hw.TRAIN):
            entry = gpu.get(check) or {}
            assert set(entry) <= {"datasheet_peak", "measured", "estimate", "basis"}, (name, check)
            if "estimate" in entry:
                assert entry.get("basis"), (name, check)
        fits = gpu["memory_gb"] >= PROFILES["verify_preset"]["min_memory_gb"]
        assert (hw.TRAIN in gpu) == fits, f"{name}: train_images_per_s only for GPUs that hold the verify preset"
    assert {n["link_layer"] for n in PROFILES["networks"].values()} == set(hw.LINK_LAYERS)
    assert {n["speed_gbit"] for n in PROFILES["networks"].values() if n["link_layer"] == "ethernet"} == {
        10, 25, 100, 200, 400}


def test_the_h200_and_h100_numbers_are_the_ones_measured_here():
    h200 = PROFILES["gpus"]["h200"]
    assert h200["gemm_bf16_tflops"]["measured"] == 770
    assert h200["train_images_per_s"]["measured"] == 19.0
    h100 = PROFILES["gpus"]["h100-sxm"]
    assert (h100["gemm_bf16_tflops"]["measured"], h100["memory_bandwidth_gb_s"]["measured"],
            h100["train_images_per_s"]["measured"]) == (794, 3016, 19.1)


def test_a_broken_data_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "profiles.yaml"
    bad.write_text("gpus: [\n")
    with pytest.raises(hw.ProfileError, match="not valid YAML"):
        hw.load_profiles(bad)
    bad.write_text(yaml.safe_dump({"gpus": {}}))
    with pytest.raises(hw.ProfileError, match="no 'achievable' mapping"):
        hw.load_profiles(bad)


def test_the_filter_reads_the_same_file_and_turns_errors_into_filter_errors():
    filters = flt.FilterModule().filters()
    assert filters["gpu_profile"]("NVIDIA H100 80GB HBM3") == "h100-sxm"
    t = filters["verify_thresholds"]("h100-sxm", 8, "ib-ndr", 0.8, 8)
    assert t == hw.thresholds(PROFILES, 0.8, gpu="h100-sxm", gpus_per_node=8, network="ib-ndr", nics=8)
    with pytest.raises(flt._FilterError, match="no hardware profile matches the GPU 'Quadro P400'"):
        filters["gpu_profile"]("Quadro P400")
    with pytest.raises(flt._FilterError, match="fraction"):
        filters["verify_thresholds"]("h200", 1, None, 0)


HDR = {"link_layer": "InfiniBand", "state": "4: ACTIVE", "rate": "200 Gb/sec (4X HDR)"}
NDR = {"link_layer": "InfiniBand", "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)"}
DOWN = {"link_layer": "InfiniBand", "state": "1: DOWN", "rate": "10 Gb/sec (4X SDR)"}
ROCE = {"link_layer": "Ethernet", "state": "4: ACTIVE", "rate": "100 Gb/sec (4X EDR)"}
EFA = {"link_layer": "Unspecified", "state": "4: ACTIVE", "rate": "100 Gb/sec (4X EDR)"}


def test_the_network_is_found_from_the_nodes_nics():
    assert hw.network_from_nics([NDR] * 8 + [DOWN], 25000) == ("infiniband", 400.0, 8)
    assert hw.network_from_nics([ROCE], "100000") == ("ethernet", 100.0, 1)  # RoCE: the interface's speed
    assert hw.network_from_nics([], "25000") == ("ethernet", 25.0, 1)
    assert flt.network_from_nics({"rdma_ports": [HDR] * 4, "ethernet_mbit": "10000"}) == {
        "profile": "ib-hdr", "nics": 4, "link_layer": "infiniband", "speed_gbit": 200.0}
    assert flt.network_from_nics({"rdma_ports": [], "ethernet_mbit": "-1"}, "none")["profile"] == ""
    assert flt.network_from_nics({"rdma_ports": [EFA], "ethernet_mbit": None}, "efa")["profile"] == "efa"


def test_nics_that_cannot_be_matched_need_an_explicit_profile():
    with pytest.raises(hw.ProfileError, match="different or unknown speeds"):
        hw.network_from_nics([HDR, NDR], None)
    with pytest.raises(hw.ProfileError, match="EFA"):
        hw.network_from_nics([EFA], None)
    with pytest.raises(flt._FilterError, match="no network profile for ethernet at unknown Gbit/s"):
        flt.FilterModule().filters()["network_from_nics"]({"rdma_ports": [], "ethernet_mbit": "-1"}, "auto")
