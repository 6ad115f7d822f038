"""The training, Slurm and GlusterFS collectors against logs and command outputs in the formats their tools write."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from monitoring_support import FIXTURES
from promtext import parse, value


def _write_run(runs, name, steps, start=1000.0, mtime=None):
    run = runs / name
    run.mkdir(parents=True)
    # As sd3cluster's MetricsLogger.log writes them: {"step", **metrics, "images_per_s", "mfu", "time"}.
    lines = [json.dumps({"step": s, "loss": 1.0 / s, "lr": 1e-4, "grad_norm": 0.5, "images_per_s": 10.0 + s,
                         "mfu": 0.3 + s / 100, "time": start + s}) for s in range(1, steps + 1)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if mtime is not None:
        os.utime(run / "metrics.jsonl", (mtime, mtime))
    return run


def test_newest_run_is_reported(training, textfile, tmp_path):
    _write_run(tmp_path, "old", 50, mtime=10)
    run = _write_run(tmp_path, "sd3-medium-1024", 7)
    (run / "checkpoints" / "step-00000005").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-00000005\n")
    m = parse(textfile.render(training.collect(tmp_path, ["*/metrics.jsonl"], 2000.0, ["checkpoints/latest"])))
    labels = {"run": "sd3-medium-1024"}
    assert value(m, "sd3_train_log_found") == 1
    assert value(m, "sd3_train_step", **labels) == 7
    assert value(m, "sd3_train_loss", **labels) == pytest.approx(1 / 7)
    assert value(m, "sd3_train_images_per_second", **labels) == 17
    assert value(m, "sd3_train_mfu_ratio", **labels) == pytest.approx(0.37)
    assert value(m, "sd3_train_learning_rate", **labels) == pytest.approx(1e-4)
    assert value(m, "sd3_train_last_step_timestamp_seconds", **labels) == 1007
    assert value(m, "sd3_train_last_checkpoint_step", **labels) == 5
    ckpt_time = (run / "checkpoints" / "latest").stat().st_mtime
    assert value(m, "sd3_train_last_checkpoint_timestamp_seconds", **labels) == pytest.approx(ckpt_time)
    assert value(m, "sd3_train_running", **labels) == 1
    assert all(lab.get("run") != "old" for samples in m.values() for lab, _ in samples)


def test_checkpoints_apart_from_the_run_as_the_sbatch_template_puts_them(training, textfile, tmp_path):
    """sd3_job's train-sd3.sbatch: output.dir=<shared>/runs/<run>, checkpoint.dir=<shared>/checkpoints/<run>."""
    _write_run(tmp_path / "runs", "train-sd3-42", 3)
    ckpt = tmp_path / "checkpoints" / "train-sd3-42"
    ckpt.mkdir(parents=True)
    (ckpt / "latest").write_text("step-00000002\n")
    patterns = [f"{tmp_path}/checkpoints/{{run}}/latest", "checkpoints/latest"]
    m = parse(textfile.render(training.collect(tmp_path / "runs", ["*/metrics.jsonl"], 0.0, patterns)))
    assert value(m, "sd3_train_last_checkpoint_step", run="train-sd3-42") == 2


def test_partial_last_line_and_long_log(training, textfile, tmp_path, monkeypatch):
    run = _write_run(tmp_path, "r", 5000)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 5001, "loss": 0.')  # being written
    monkeypatch.setattr(training, "TAIL_BYTES", 4096)
    m = parse(textfile.render(training.collect(tmp_path, ["*/metrics.jsonl"], 0.0)))
    assert value(m, "sd3_train_step", run="r") == 5000
    assert "sd3_train_last_checkpoint_step" not in m


def test_end_record_and_total_steps_finish_a_run(training, tmp_path):
    summary = training.summarize([{"step": 3, "loss": 1.0, "total_steps": 3}], 0.0)
    assert summary["finished"] == 1
    summary = training.summarize([{"step": 3, "loss": 1.0}, {"event": "end"}], 0.0)
    assert summary["finished"] == 1


def test_newest_generation_job_progress(training, textfile, tmp_path):
    """As sd3cluster generate's rank 0 writes progress.json in its output folder (the sbatch template's run folder)."""
    old = tmp_path / "train-sd3-7"
    old.mkdir()
    (old / "progress.json").write_text(json.dumps({"done": 5, "total": 5, "finished": True, "time": 1.0}))
    os.utime(old / "progress.json", (10, 10))
    job = tmp_path / "sd3-generate-9"
    job.mkdir()
    (job / "progress.json").write_text(json.dumps({"done": 120, "total": 1000, "images_per_s": 3.5, "eta_s": 251.4,
                                                   "finished": False, "time": 1796330000.0}))
    m = parse(textfile.render(training.collect_generation(tmp_path, ["*/progress.json"])))
    labels = {"run": "sd3-generate-9"}
    assert value(m, "sd3_generate_progress_found") == 1
    assert value(m, "sd3_generate_images_done", **labels) == 120
    assert value(m, "sd3_generate_images_total", **labels) == 1000
    assert value(m, "sd3_generate_images_per_second", **labels) == 3.5
    assert value(m, "sd3_generate_eta_seconds", **labels) == pytest.approx(251.4)
    assert value(m, "sd3_generate_running", **labels) == 1
    (job / "progress.json").write_text("{not json")
    m = parse(textfile.render(training.collect_generation(tmp_path, ["*/progress.json"])))
    assert value(m, "sd3_generate_progress_found") == 0


def test_no_runs_folder(training, textfile, tmp_path):
    m = parse(textfile.render(training.collect(tmp_path / "missing", ["*/metrics.jsonl"], 5.0)))
    assert value(m, "sd3_train_log_found") == 0
    assert "sd3_train_step" not in m


def test_slurm_queue_and_nodes(slurm, textfile):
    squeue = (FIXTURES / "squeue_states.txt").read_text()
    sinfo = (FIXTURES / "sinfo_nodes.txt").read_text()
    m = parse(textfile.render(slurm.collect(squeue, sinfo, 0.0)))
    assert value(m, "sd3_slurm_up") == 1
    assert value(m, "sd3_slurm_jobs", state="pending") == 2
    assert value(m, "sd3_slurm_jobs", state="running") == 1
    assert value(m, "sd3_slurm_jobs", state="completing") == 1
    assert value(m, "sd3_slurm_jobs", state="suspended") == 0
    # gpu1 is listed in two partitions and counted once.
    assert value(m, "sd3_slurm_nodes", state="allocated") == 1
    assert value(m, "sd3_slurm_nodes", state="idle") == 1
    assert value(m, "sd3_slurm_nodes", state="drained") == 1
    assert value(m, "sd3_slurm_nodes", state="down") == 1
    assert value(m, "sd3_slurm_nodes_not_responding") == 2


def test_slurm_absent(slurm, textfile):
    m = parse(textfile.render(slurm.collect(None, None, 0.0, installed=False)))
    assert value(m, "sd3_slurm_installed") == 0
    assert value(m, "sd3_slurm_up") == 0
    assert "sd3_slurm_jobs" not in m


def test_slurm_script_without_slurm(tmp_path, monkeypatch):
    import subprocess
    import sys

    # The path is spelled out: `conftest` is also the name of other folders' conftest modules.
    collectors = Path(__file__).resolve().parents[2] / "roles" / "monitoring" / "files" / "collectors"
    env = {**os.environ, "PATH": str(tmp_path)}  # no squeue on this PATH
    subprocess.run([sys.executable, str(collectors / "sd3_slurm_metrics.py"), "--textfile-dir", str(tmp_path)],
                   check=True, env=env, capture_output=True)
    assert value(parse((tmp_path / "sd3_slurm.prom").read_text()), "sd3_slurm_installed") == 0


def test_gluster_bricks_and_heal(gluster, textfile):
    status = (FIXTURES / "gluster_volume_status.xml").read_text()
    heal = (FIXTURES / "gluster_heal_summary.xml").read_text()
    m = parse(textfile.render(gluster.collect(status, {"shared": heal}, 0.0)))
    assert value(m, "sd3_gluster_up") == 1
    assert len(m["sd3_gluster_brick_online"]) == 3  # the self-heal daemons are left out
    assert value(m, "sd3_gluster_brick_online", brick="st1:/bricks/shared") == 1
    assert value(m, "sd3_gluster_brick_online", brick="st3:/bricks/shared") == 0
    assert value(m, "sd3_gluster_heal_pending_entries", brick="st1:/bricks/shared") == 17
    assert value(m, "sd3_gluster_split_brain_entries", brick="st2:/bricks/shared") == 1


def test_gluster_absent(gluster, textfile):
    m = parse(textfile.render(gluster.collect(None, {}, 0.0)))
    assert value(m, "sd3_gluster_up") == 0
