"""verify.yml's check of its training run through Slurm (ansible/plugins/filter/verify_training.py): the speed
threshold from the hardware profiles where the job trains their verify preset, and every way the run can fail."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The loader the filters themselves use (ansible/plugins/module_utils/source_tree.py).
_load = runpy.run_path(str(ROOT / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
flt = _load("ansible/plugins/filter/verify_training.py")
hw = flt.hardware
PROFILES = hw.load_profiles()
PRESET = PROFILES["verify_preset"]
VERIFY_JOB = {"model": {"preset": PRESET["model"]},
              "data": {"resolution": PRESET["resolution"], "batch_size": PRESET["batch_size"]}}
TINY_JOB = {"model": {"preset": "tiny"}, "data": {"resolution": 64, "batch_size": 2}}
H200_PER_GPU = hw.thresholds(PROFILES, 0.8, gpu="h200")[hw.TRAIN]["threshold"]


def sbatch(rc=0, job="4242", stderr=""):
    return {"rc": rc, "stdout_lines": [job] if job else [], "stderr": stderr}


def result(world=16, nodes=2, latest="step-00000020", finished=True, loss_finite=True, images_per_s=250.0):
    return {"log_path": "/shared/jobs/logs/sd3-verify-train-4242.out", "nodes": nodes, "finished": finished,
            "latest": latest, "complete": {"world": world} if world else None, "loss_finite": loss_finite,
            "last_metrics": {"images_per_s": images_per_s} if images_per_s is not None else None}


def check(sbatch_result=None, job_result=None, job=VERIFY_JOB, gpu="h200", fraction=0.8, nodes=2, steps=20):
    return flt.verify_training_check(sbatch_result or sbatch(), job_result or result(), job, gpu, fraction, nodes,
                                     steps, "/shared")


def test_the_threshold_is_the_profile_per_gpu_x_fraction_x_ranks():
    assert H200_PER_GPU == pytest.approx(PROFILES["gpus"]["h200"][hw.TRAIN]["measured"] * 0.8)
    assert flt.verify_training_threshold("h200", VERIFY_JOB, 16, 0.8) == pytest.approx(H200_PER_GPU * 16)
    # As the playbook passes them: strings from the inventory or `-e`.
    assert flt.verify_training_threshold("h200", VERIFY_JOB, "8", "0.5") == pytest.approx(
        PROFILES["gpus"]["h200"][hw.TRAIN]["measured"] * 0.5 * 8)


@pytest.mark.parametrize("gpu, job, world", [
    ("", VERIFY_JOB, 16),                                                # no GPU profile (the local cluster)
    ("h200", TINY_JOB, 16),                                              # another model
    ("h200", {**VERIFY_JOB, "data": {**VERIFY_JOB["data"], "resolution": 512}}, 16),
    ("h200", {**VERIFY_JOB, "data": {**VERIFY_JOB["data"], "batch_size": 4}}, 16),
    ("h200", {}, 16),                                                    # a job config without settings
    ("h200", None, 16),                                                  # an empty job config file
    ("h200", VERIFY_JOB, 0),                                             # no checkpoint: no ranks known
])
def test_no_speed_threshold_where_the_job_is_not_the_verify_preset_or_nothing_is_known(gpu, job, world):
    assert flt.verify_training_threshold(gpu, job, world, 0.8) is None


def test_a_run_that_did_everything_passes_and_says_what_it_measured():
    got = check()
    assert got == {
        "layer": "training", "check": "sbatch train, 2 nodes, checkpoint on /shared", "host": "cluster",
        "passed": True, "value": 250.0, "unit": "images/s",
        "threshold": f"exit 0, step-00000020 by 2+ ranks, >= {H200_PER_GPU * 16:.4g} images/s",
        "detail": "job 4242, 16 ranks"}


def test_too_slow_for_the_profile_fails_with_both_numbers():
    slow = H200_PER_GPU * 16 * 0.9
    got = check(job_result=result(images_per_s=slow))
    assert not got["passed"]
    assert got["detail"] == (f"{slow} images/s, below the threshold {H200_PER_GPU * 16:.4g} (hardware profile x 0.8)"
                             + flt.SPANS_NODES.format(nodes=2))
    assert "the network between the nodes" in got["detail"]
    # On one node the network is not in the step, and the detail does not blame it.
    one_node = check(job_result=result(nodes=1, world=8, images_per_s=H200_PER_GPU * 8 * 0.9), nodes=1)
    assert not one_node["passed"] and "network" not in one_node["detail"]
    # No metrics at all under a threshold is a failure too, never a pass.
    got = check(job_result=result(images_per_s=None))
    assert not got["passed"] and got["detail"].startswith("None images/s, below the threshold")


def test_without_a_threshold_any_speed_passes_and_the_threshold_says_why():
    got = check(job=TINY_JOB, job_result=result(images_per_s=0.5))
    assert got["passed"] and got["value"] == 0.5
    assert got["threshold"] == f"exit 0, step-00000020 by 2+ ranks, {flt.NO_SPEED_THRESHOLD}"
    assert check(gpu="", job_result=result(images_per_s=None))["passed"]


@pytest.mark.parametrize("sbatch_result, job_result, nodes, problem", [
    (sbatch(rc=1, job="", stderr="sbatch: error: Batch job submission failed\n"), result(), 2,
     "sbatch exited 1: sbatch: error: Batch job submission failed"),
    (None, result(finished=False), 2, "the job did not finish (log /shared/jobs/logs/sd3-verify-train-4242.out)"),
    (None, result(nodes=1, world=8), 2, "ran on 1 nodes, not 2"),
    (None, result(latest="step-00000010"), 2, "newest complete checkpoint is step-00000010, not step-00000020"),
    (None, result(latest=None), 2, "newest complete checkpoint is None, not step-00000020"),
    (None, result(world=3), 2, "the checkpoint was written by 3 ranks"),       # not a whole number of nodes
    (None, result(world=None), 2, "the checkpoint was written by 0 ranks"),    # no completion record
    (None, result(loss_finite=False), 2, "no finite loss in /shared/runs/sd3-verify-train-*/metrics.jsonl"),
])
def test_each_way_the_run_fails_is_named(sbatch_result, job_result, nodes, problem):
    got = check(sbatch_result, job_result, job=TINY_JOB, nodes=nodes)
    assert not got["passed"]
    assert problem in got["detail"].split("; ")


def test_several_problems_are_all_named():
    got = check(sbatch(rc=124, stderr=""), result(finished=False, latest=None, world=None, loss_finite=False),
                job=TINY_JOB)
    assert got["detail"].split("; ") == [
        "sbatch exited 124: ", "the job did not finish (log /shared/jobs/logs/sd3-verify-train-4242.out)",
        "newest complete checkpoint is None, not step-00000020", "the checkpoint was written by 0 ranks",
        "no finite loss in /shared/runs/sd3-verify-train-*/metrics.jsonl"]


def test_a_bad_fraction_is_a_filter_error_whatever_the_job_trained():
    for job, world in ((VERIFY_JOB, 8), (TINY_JOB, 8), (VERIFY_JOB, 0)):
        with pytest.raises(flt._FilterError, match="fraction"):
            flt.verify_training_threshold("h200", job, world, 0)
    # Without a GPU profile there is no threshold to make, so no fraction is read (the local cluster).
    assert flt.verify_training_threshold("", VERIFY_JOB, 8, 0) is None


@pytest.mark.parametrize("speed", [float("nan"), "fast", ""])
def test_a_speed_that_is_not_a_number_fails_under_a_threshold(speed):
    got = check(job_result=result(images_per_s=speed))
    assert not got["passed"] and "below the threshold" in got["detail"]


def test_the_playbook_calls_the_filter_and_keeps_no_rule_in_jinja():
    tasks = (ROOT / "roles" / "verify" / "tasks" / "training.yml").read_text()
    assert "verify_training_check(" in tasks
    assert "{% set" not in tasks and "images/s, below the threshold" not in tasks
