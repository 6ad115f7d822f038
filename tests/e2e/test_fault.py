"""A node lost in the middle of training (the fault test), on the converged local cluster.

The training job of the sd3_job role's sbatch template runs on every gpu_node; once it has a complete
checkpoint, the last gpu_node's container is killed (as a crashed server). Slurm requeues the job
(SlurmdTimeout, 30 s in inventories/local, or the job itself when its step fails first); it waits for
its nodes, the container is started again, and the job must resume from its last complete checkpoint
and finish. Afterwards the GlusterFS volume must heal (no entries left to heal, every brick up).
Runs after site.yml (test_local_cluster.py), in `make e2e-full`.
"""
from __future__ import annotations

import re
import time

import pytest
from e2e_support import inventory, job_field, node, run, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.full]

TEMPLATE = "/opt/sd3cluster/jobs/train-sd3.sbatch"
CONFIG = "/opt/sd3cluster/jobs/train-sd3.yaml"
STEPS = 300


def test_training_survives_a_killed_node_and_the_volume_heals():
    groups = inventory()["all"]["children"]
    head = next(iter(groups["head"]["hosts"]))
    gpu_nodes = list(groups["gpu_nodes"]["hosts"])
    victim = gpu_nodes[-1]
    assert len(gpu_nodes) >= 2 and victim not in groups["head"]["hosts"], groups

    job = node(head, f"sbatch --parsable --job-name=sd3-fault --nodes={len(gpu_nodes)} {TEMPLATE} {CONFIG} "
                     f"--set train.steps={STEPS} --set checkpoint.every=5 --set checkpoint.keep=3 "
                     f"--set train.log_every=5").strip()
    checkpoints, log = f"/shared/checkpoints/sd3-fault-{job}", f"/shared/jobs/logs/sd3-fault-{job}.out"
    try:
        before = wait_for("the job's first complete checkpoint",
                          lambda: node(head, f"cat {checkpoints}/latest 2>/dev/null", check=False).strip(), 600, 0.5)
        before_step = int(before.removeprefix("step-"))
        assert before_step < STEPS, f"the job reached {before} before the node could be killed"

        run("podman", "kill", f"sd3-{victim}")
        killed_at = time.monotonic()
        wait_for("Slurm to requeue the job", lambda: int(job_field(head, job, "Restarts") or 0) >= 1, 240)
        requeue_s = time.monotonic() - killed_at

        run("podman", "start", f"sd3-{victim}")
        wait_for(f"job {job} to complete", lambda: job_field(head, job, "JobState") in ("COMPLETED", "FAILED"), 900, 3)
        text = node(head, f"cat {log}")
        assert job_field(head, job, "JobState") == "COMPLETED", text[-4000:]
    finally:
        run("podman", "start", f"sd3-{victim}", check=False)
        node(head, f"scancel {job}", check=False)

    # It resumed from a checkpoint no older than the one seen before the kill, and finished the run.
    resumed = [int(step) for step in re.findall(r"resumed from \S*step-\d+ at step (\d+)", text)]
    assert resumed and resumed[0] >= before_step, text[-4000:]
    assert node(head, f"cat {checkpoints}/latest").strip() == f"step-{STEPS:08d}"
    assert re.search(rf"job {job} finished", text), text[-4000:]
    print(f"killed {victim} at {before}; requeued after {requeue_s:.0f} s; resumed at step {resumed[0]}")

    # The returned node's bricks heal: every brick connected, nothing left to heal.
    def healed() -> bool:
        node(head, "gluster volume heal shared", check=False)
        info = node(head, "gluster volume heal shared info", check=False)
        entries = [int(n) for n in re.findall(r"Number of entries: (\d+)", info)]
        return bool(entries) and len(entries) == info.count("Status: Connected") and not any(entries)
    wait_for("the shared volume to heal", healed, 600, 5)
    wait_for(f"{victim} to mount the shared volume again",
             lambda: "is a mountpoint" in node(victim, "mountpoint /shared", check=False), 180, 3)
    wait_for(f"{victim} idle in Slurm",
             lambda: "idle" in node(head, f"sinfo --noheader --Node --nodes={victim} --format %T", check=False), 180, 3)
