"""Batch generation through Slurm on the converged local cluster: the sd3_job role's sbatch template with
SD3_COMMAND=generate on every gpu_node writes every image of a prompt file once, with its manifest, into the
job's run folder on the shared volume; the monitoring collector reads the job's progress there.
Runs after site.yml (test_local_cluster.py), in `make e2e-full`.
"""
from __future__ import annotations

import json
import re

import pytest
from e2e_support import inventory, job_field, node, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.full]

TEMPLATE = "/opt/sd3cluster/jobs/train-sd3.sbatch"
PROMPTS = [f"a photo of a red house number {i}" for i in range(9)]


def test_slurm_generation_job_writes_every_image_once():
    groups = inventory()["all"]["children"]
    head = next(iter(groups["head"]["hosts"]))
    gpu_nodes = list(groups["gpu_nodes"]["hosts"])
    assert len(gpu_nodes) >= 2, groups
    node(head, "mkdir -p /shared/prompts && cat > /shared/prompts/e2e.txt <<'EOF'\n" + "\n".join(PROMPTS) + "\nEOF")
    job = node(head, f"SD3_COMMAND=generate sbatch --parsable --job-name=sd3-generate --nodes={len(gpu_nodes)} "
                     f"{TEMPLATE} '' --prompts /shared/prompts/e2e.txt --images-per-prompt 2").strip()
    log, run = f"/shared/jobs/logs/sd3-generate-{job}.out", f"/shared/runs/sd3-generate-{job}"
    try:
        wait_for(f"job {job} to end", lambda: job_field(head, job, "JobState") in ("COMPLETED", "FAILED"), 600, 2)
    finally:
        node(head, f"scancel {job}", check=False)
    text = node(head, f"cat {log}")
    assert job_field(head, job, "JobState") == "COMPLETED", text[-4000:]

    expected = [f"{i:06d}-{k:03d}.png" for i in range(len(PROMPTS)) for k in range(2)]
    listed = node(head, f"ls -A {run}/images").split()
    assert sorted(listed) == expected, listed  # every image, nothing half-written left beside them
    manifest = [json.loads(line) for line in node(head, f"cat {run}/manifest.jsonl").splitlines()]
    assert [m["file"] for m in manifest] == [f"images/{name}" for name in expected]
    assert len({m["seed"] for m in manifest}) == len(expected)
    # One process per node (CPU nodes), each rendered a share; the summary counts every image once.
    assert re.search(rf"done: {len(expected)} new image\(s\)", text), text[-3000:]
    ranks = re.findall(r"^\[generate\]\s+(\d+)\s+(\d+)\s+\d+", text, re.MULTILINE)
    assert len(ranks) == len(gpu_nodes) and all(int(made) > 0 for _, made in ranks), text[-3000:]
    assert sum(int(made) for _, made in ranks) == len(expected)
    progress = json.loads(node(head, f"cat {run}/progress.json"))
    assert progress["done"] == progress["total"] == len(expected) and progress["finished"] is True

    # The head's training collector reports that job (it runs on a timer; run it once now).
    node(head, "systemctl start sd3-training-metrics.service")
    metrics = node(head, "cat /var/lib/prometheus/node-exporter/sd3_training.prom")
    assert re.search(rf'sd3_generate_images_done\{{run="sd3-generate-{job}"\}} {len(expected)}', metrics), metrics
