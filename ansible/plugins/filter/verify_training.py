"""verify.yml's judgement of its training run through Slurm (roles/verify/tasks/training.yml): which speed the
run must reach, and the check result the report records for it.

The run has a speed threshold only where it trains the hardware profiles' verify preset (model, resolution,
batch size of hardware_profiles.yaml) on GPUs that have a profile: the profile's training images/s per GPU x
the fraction x the ranks that trained. The profiles and their rules are the sd3cluster package's, loaded by path
as the hardware_profiles filters load them.
"""

from __future__ import annotations

import runpy
from pathlib import Path

try:
    from ansible.errors import AnsibleFilterError as _FilterError
except ImportError:  # the unit tests also run without Ansible
    _FilterError = ValueError

_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
hardware = _load("workloads/src/sd3cluster/hardware.py")
values = _load("ansible/plugins/module_utils/values.py")

# Why a run across nodes can be slow while every GPU is fast: DDP sums all of SD3-medium's gradients in fp32 (8 GB)
# between the nodes every step, which a 10GbE network carries in seconds, not in the step's half second.
SPANS_NODES = ("; the job spans {nodes} nodes and every step sums all gradients across them: "
               "where sd3cluster verify's gpu_training check passes, the network between the nodes is what is slow "
               "(see this report's network checks)")
NO_SPEED_THRESHOLD = "no speed threshold (the job config is not the profiles' verify preset, or no GPU profile)"


def verify_training_threshold(gpu_profile, job_config, world, fraction):
    """Images/s the whole run must reach, or None where it has no speed threshold (see the module's text)."""
    if not gpu_profile:
        return None
    try:
        # The fraction and the profiles are checked whenever there is a GPU profile, whatever the job trained.
        profiles = hardware.load_profiles()
        row = hardware.thresholds(profiles, fraction, gpu=gpu_profile, gpus_per_node=1)[hardware.TRAIN]
    except hardware.ProfileError as e:
        raise _FilterError(str(e)) from None
    preset = profiles["verify_preset"]
    job = job_config if isinstance(job_config, dict) else {}
    model, data = job.get("model") or {}, job.get("data") or {}
    world = values.jinja_int(world)
    if not row or world <= 0 or (model.get("preset"), data.get("resolution"), data.get("batch_size")) != \
            (preset["model"], preset["resolution"], preset["batch_size"]):
        return None
    return row["threshold"] * world


def verify_training_check(sbatch, result, job_config, gpu_profile, fraction, nodes, steps, shared_path):
    """The report's check of the training run.

    sbatch: the registered result of `sbatch --parsable --wait` (rc, stdout_lines, stderr); result: what
    sd3_job_result.py read from the shared volume; job_config: the job's config file as data; nodes: the
    gpu_nodes the job was asked to run on; steps: the steps it trains (its last checkpoint is step-<steps>).
    """
    nodes, steps = values.jinja_int(nodes), values.jinja_int(steps)
    world = values.jinja_int((result.get("complete") or {}).get("world"))
    metrics = result.get("last_metrics")
    images_per_s = metrics.get("images_per_s") if metrics else None
    min_images_per_s = verify_training_threshold(gpu_profile, job_config, world, fraction)
    want_latest = f"step-{steps:08d}"
    problems = []
    if sbatch.get("rc") != 0:
        problems.append(f"sbatch exited {sbatch.get('rc')}: {values.text(sbatch.get('stderr')).strip()}")
    if not result.get("finished"):
        problems.append(f"the job did not finish (log {result.get('log_path')})")
    if result.get("nodes") != nodes:
        problems.append(f"ran on {result.get('nodes')} nodes, not {nodes}")
    if result.get("latest") != want_latest:
        problems.append(f"newest complete checkpoint is {result.get('latest')}, not {want_latest}")
    if not (nodes > 0 and world >= nodes and world % nodes == 0):
        problems.append(f"the checkpoint was written by {world} ranks")
    if not result.get("loss_finite"):
        problems.append(f"no finite loss in {shared_path}/runs/sd3-verify-train-*/metrics.jsonl")
    # `not >=`: a missing or NaN speed under a threshold fails.
    if min_images_per_s is not None and not (values.number(images_per_s) >= min_images_per_s):
        problems.append(f"{images_per_s} images/s, below the threshold {min_images_per_s:.4g} "
                        f"(hardware profile x {fraction}){SPANS_NODES.format(nodes=nodes) if nodes > 1 else ''}")
    job_id = (sbatch.get("stdout_lines") or ["none"])[0]
    speed = f", >= {min_images_per_s:.4g} images/s" if min_images_per_s is not None else f", {NO_SPEED_THRESHOLD}"
    return {
        "layer": "training",
        "check": f"sbatch train, {nodes} nodes, checkpoint on {shared_path}",
        "host": "cluster",
        "passed": not problems,
        "value": images_per_s,
        "unit": "images/s",
        "threshold": f"exit 0, {want_latest} by {nodes}+ ranks{speed}",
        "detail": "; ".join(problems) if problems else f"job {job_id}, {world} ranks",
    }


class FilterModule:
    def filters(self):
        return {"verify_training_threshold": verify_training_threshold,
                "verify_training_check": verify_training_check}
