"""verify's thresholds: from the hardware profiles or explicit, never 0, and skip (not pass) where nothing applies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sd3_helpers import TINY, sd3cluster
from sd3cluster import hardware
from sd3cluster.config import ConfigError, load_config
from sd3cluster.dist import local_runtime
from sd3cluster.verify import FAIL, PASS, SKIP, Check, Limit, Report, _judge, _per_gpu, resolve_limits


def test_limits_of_an_h200_node_come_from_its_profile():
    cfg = load_config(overrides=["verify.network_profile=ib-ndr", "verify.nics_per_node=8"])
    limits = resolve_limits(cfg, "NVIDIA H200", gpus_on_node=8, nodes=2)
    assert limits[hardware.GEMM].threshold == 616.0
    assert "770 expected (measured) x 0.8" in limits[hardware.GEMM].source
    assert limits[hardware.TRAIN].threshold == pytest.approx(15.2)
    assert limits[hardware.INTRA].threshold == pytest.approx(288.0)
    assert limits[hardware.INTER].threshold == pytest.approx(8 * 50 * 0.8 * 0.8)


def test_explicit_thresholds_replace_the_profile_and_the_fraction_scales_it():
    cfg = load_config(overrides=["verify.min_gemm_tflops=700", "verify.threshold_fraction=0.5"])
    limits = resolve_limits(cfg, "NVIDIA H200", gpus_on_node=1, nodes=1)
    assert limits[hardware.GEMM] == Limit(700.0, "verify.min_gemm_tflops, set explicitly")
    assert limits[hardware.TRAIN].threshold == pytest.approx(9.5)
    assert limits[hardware.INTRA].threshold is None  # one GPU
    assert limits[hardware.INTER].threshold is None  # one node


def test_an_unknown_gpu_must_be_named():
    cfg = load_config()
    with pytest.raises(ConfigError, match="no hardware profile matches the GPU 'NVIDIA B200'"):
        resolve_limits(cfg, "NVIDIA B200", gpus_on_node=8, nodes=1)
    named = load_config(overrides=["verify.gpu_profile=h200"])
    assert resolve_limits(named, "NVIDIA B200", gpus_on_node=8, nodes=1)[hardware.GEMM].threshold == 616.0
    off = load_config(overrides=["verify.gpu_profile=none"])
    assert resolve_limits(off, "NVIDIA B200", gpus_on_node=8, nodes=1)[hardware.GEMM].threshold is None


def test_network_profile_none_means_no_inter_node_threshold():
    limits = resolve_limits(load_config(overrides=["verify.network_profile=none"]), "NVIDIA H200", 8, 2)
    assert limits[hardware.INTER].threshold is None


def test_a_misspelt_profile_is_an_error_even_without_a_gpu():
    with pytest.raises(ConfigError, match="GPU profile 'h20' does not exist"):
        resolve_limits(load_config(overrides=["verify.gpu_profile=h20"]), None, 1, 1)
    with pytest.raises(ConfigError, match="network profile 'ib-xdr' does not exist"):
        resolve_limits(load_config(overrides=["verify.network_profile=ib-xdr"]), None, 1, 2)


@pytest.mark.parametrize("override", ["verify.min_busbw_gbps=0", "verify.min_images_per_s=0",
                                      "verify.min_gemm_tflops=0", "verify.threshold_fraction=0",
                                      "verify.threshold_fraction=1.2"])
def test_a_threshold_that_passes_anything_is_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(overrides=[override])


def test_a_slow_gpu_fails_naming_the_number_and_the_threshold():
    check = _judge("gpu_gemm_bf16", hardware.GEMM, 385.0, Limit(616.0, "profile h200"), "slowest GPU n1:3")
    assert check.status == FAIL
    assert "385 TFLOP/s, below the threshold 616 TFLOP/s (profile h200)" in check.detail
    assert _judge("gpu_gemm_bf16", hardware.GEMM, 700.0, Limit(616.0, "x"), "").status == PASS
    assert _judge("gpu_gemm_bf16", hardware.GEMM, 700.0, Limit(None, "no profile"), "").status == SKIP


def test_a_slow_training_gpu_names_the_kernels_it_ran_with():
    # a GPU without the fa4 extra trains slower: the failing check must say so, not only the number
    rt = local_runtime(torch.device("cuda", 0))  # the measurement is given, no GPU is touched
    check = _per_gpu(rt, "gpu_training_images_per_s", hardware.TRAIN, Limit(15.2, "profile h200"),
                     lambda: (12.5, "kernels: attention: cudnn (auto: flash-attn-4 is not installed)"))
    assert check.status == FAIL
    assert "below the threshold 15.2" in check.detail
    assert check.detail.endswith(": kernels: attention: cudnn (auto: flash-attn-4 is not installed)")
    gemm = _per_gpu(rt, "gpu_gemm_bf16", hardware.GEMM, Limit(616.0, "x"), lambda: (700.0, ""))
    assert gemm.status == PASS and "kernels" not in gemm.detail and not gemm.detail.endswith("; ")


def test_skips_do_not_fail_the_report_but_a_failure_does():
    report = Report(1, "cpu", [Check("a", PASS, 1, 1, ""), Check("b", SKIP, None, None, "")])
    assert report.passed and "1 passed, 0 failed, 1 skipped" in report.table()
    report.checks.append(Check("c", FAIL, 1, 2, ""))
    assert not report.passed
    assert [c["skipped"] for c in json.loads(report.to_json())["checks"]] == [False, True, False]


@pytest.mark.slow
def test_one_rank_skips_the_all_reduce_and_a_missed_threshold_fails_the_run(tmp_path: Path):
    report = tmp_path / "report.json"
    result = sd3cluster("verify", "--device", "cpu", *TINY, "--report", str(report))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    for name in ("allreduce_intra_node", "allreduce_inter_node", "gpu_gemm_bf16", "gpu_memory_bandwidth",
                 "gpu_training_images_per_s"):
        assert checks[name]["status"] == "skip" and checks[name]["value"] is None, checks[name]
    assert not [c for c in checks.values() if c["status"] == "pass" and c["value"] is None]
    assert checks["throughput"]["status"] == "skip" and checks["throughput"]["value"] > 0

    slow = sd3cluster("verify", "--device", "cpu", *TINY, "--report", str(report), "--min-images-per-s", "1e9")
    assert slow.returncode == 1, slow.stdout[-3000:] + slow.stderr[-3000:]
    throughput = {c["name"]: c for c in json.loads(report.read_text())["checks"]}["throughput"]
    assert throughput["status"] == "fail"
    assert "below the threshold 1e+09 (verify.min_images_per_s)" in throughput["detail"]
    assert "verdict: FAIL" in slow.stdout


def test_a_zero_threshold_on_the_command_line_is_a_clear_error():
    result = sd3cluster("verify", "--device", "cpu", *TINY, "--min-busbw", "0")
    assert result.returncode == 2
    assert "verify.min_busbw_gbps: Input should be greater than 0" in result.stderr
    assert "Traceback" not in result.stderr
