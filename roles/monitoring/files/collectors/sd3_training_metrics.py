#!/usr/bin/env python3
"""Metrics of the newest sd3cluster training run (step, loss, images/s, MFU, last checkpoint) and of the newest
generation job (images done of total, images/s, ETA) as a .prom textfile.

Reads the JSON-lines log that `sd3cluster train` writes on rank 0 (`<output.dir>/metrics.jsonl`, one object per
logged step: {"step", "loss", ..., "images_per_s", "mfu", "time"}) from the runs folder on the shared volume. The
newest log (by modification time) among the glob patterns is the current run; only its tail is read, so a long
run costs the same as a short one. The last checkpoint is the `latest` file the package's CheckpointManager
writes last and atomically (it names the newest complete `step-NNNNNNNN` folder). A generation job
(`sd3cluster generate`) keeps `progress.json` in its output folder, rewritten atomically by its rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sd3_textfile import Family, render, write_atomically

TAIL_BYTES = 1 << 20
# The names a record may use for one value; the first one present wins.
KEYS = {
    "step": ("step", "global_step"),
    "time": ("time", "timestamp", "ts", "wall_time"),
    "loss": ("loss",),
    "images_per_s": ("images_per_s", "images_per_sec", "img_per_s"),
    "mfu": ("mfu",),
    "lr": ("lr", "learning_rate"),
    "total_steps": ("total_steps", "steps_total", "max_steps"),
}
CHECKPOINT_EVENTS = {"checkpoint", "checkpoint_saved", "save"}
END_EVENTS = {"end", "done", "finished", "train_end"}


def _get(record: dict, name: str) -> object:
    for key in KEYS[name]:
        if key in record and record[key] is not None:
            return record[key]
    return None


def _seconds(value: object) -> float | None:
    """Unix seconds from a number or an ISO 8601 string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def newest_log(runs_dir: Path, patterns: list[str]) -> Path | None:
    candidates = [p for pattern in patterns for p in runs_dir.glob(pattern) if p.is_file()]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def tail_records(path: Path, limit: int = TAIL_BYTES) -> list[dict]:
    """The JSON objects in the last `limit` bytes of the log (a first partial line is dropped)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        handle.seek(max(0, size - limit))
        data = handle.read()
    lines = data.split(b"\n")
    if size > limit:
        lines = lines[1:]
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written, or not JSON
        if isinstance(record, dict):
            records.append(record)
    return records


def last_checkpoint(run_dir: Path, run: str, patterns: list[str]) -> tuple[float, float | None] | None:
    """(time, step) of the newest checkpoint `latest` file matching the patterns ({run} is the run's name)."""
    found = []
    for raw in patterns:
        pattern = raw.replace("{run}", run)
        base, rel = (Path("/"), pattern.lstrip("/")) if pattern.startswith("/") else (run_dir, pattern)
        found += [p for p in base.glob(rel) if p.is_file()]
    if not found:
        return None
    newest = max(found, key=lambda p: p.stat().st_mtime)
    match = re.search(r"step-0*(\d+)", newest.read_text(errors="replace"))
    return newest.stat().st_mtime, float(match.group(1)) if match else None


def summarize(records: list[dict], mtime: float) -> dict[str, float]:
    """The newest value of each metric, the last step's time, the last checkpoint's time, and whether it ended."""
    out: dict[str, float] = {}
    finished = False
    for record in records:
        event = str(record.get("event", record.get("type", ""))).lower()
        when = _seconds(_get(record, "time"))
        if event in CHECKPOINT_EVENTS or ("checkpoint" in record and event == ""):
            out["last_checkpoint_time"] = when if when is not None else mtime
            ckpt_step = _get(record, "step")
            if isinstance(ckpt_step, int | float):
                out["last_checkpoint_step"] = float(ckpt_step)
        if event in END_EVENTS:
            finished = True
        total = _get(record, "total_steps")
        if isinstance(total, int | float):
            out["total_steps"] = float(total)
        step = _get(record, "step")
        if isinstance(step, int | float) and not isinstance(step, bool) and event not in CHECKPOINT_EVENTS:
            out["step"] = float(step)
            out["last_step_time"] = when if when is not None else mtime
            for name in ("loss", "images_per_s", "mfu", "lr"):
                value = _get(record, name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    out[name] = float(value)
    if "total_steps" in out and out.get("step", -1) >= out["total_steps"]:
        finished = True
    out["finished"] = 1.0 if finished else 0.0
    return out


FAMILIES = [
    ("step", "sd3_train_step", "Last optimizer step logged by the run."),
    ("total_steps", "sd3_train_total_steps", "Steps the run is configured for."),
    ("loss", "sd3_train_loss", "Training loss at the last logged step."),
    ("images_per_s", "sd3_train_images_per_second", "Training throughput of the whole job at the last logged step."),
    ("mfu", "sd3_train_mfu_ratio", "Model FLOPs utilisation at the last logged step (0-1, against the run's peak)."),
    ("lr", "sd3_train_learning_rate", "Learning rate at the last logged step."),
    ("last_step_time", "sd3_train_last_step_timestamp_seconds", "When the last step was logged."),
    ("last_checkpoint_time", "sd3_train_last_checkpoint_timestamp_seconds", "When the last checkpoint was written."),
    ("last_checkpoint_step", "sd3_train_last_checkpoint_step", "Step of the last checkpoint."),
]


def collect(runs_dir: Path, patterns: list[str], now: float,
            checkpoint_patterns: list[str] | None = None) -> list[Family]:
    found = Family("sd3_train_log_found", "1 when a training log was found under the runs folder.")
    last_run = Family("sd3_train_collector_last_run_timestamp_seconds", "When the training collector last ran.")
    last_run.add(now)
    log = newest_log(runs_dir, patterns) if runs_dir.is_dir() else None
    found.add(0 if log is None else 1)
    if log is None:
        return [found, last_run]
    mtime = log.stat().st_mtime
    summary = summarize(tail_records(log), mtime)
    run = os.path.relpath(log.parent, runs_dir)
    labels = {"run": log.stem if run == "." else run}
    checkpoint = last_checkpoint(log.parent, labels["run"], checkpoint_patterns or [])
    if checkpoint is not None and checkpoint[0] >= summary.get("last_checkpoint_time", 0):
        summary["last_checkpoint_time"] = checkpoint[0]
        if checkpoint[1] is not None:
            summary["last_checkpoint_step"] = checkpoint[1]
    families = [found, last_run]
    running = Family("sd3_train_running", "1 while the newest run has not logged its end (nor reached its last step).")
    running.add(1 - summary["finished"], **labels)
    modified = Family("sd3_train_log_modified_timestamp_seconds", "When the newest run's log last changed.")
    modified.add(mtime, **labels)
    families += [running, modified]
    for key, name, text in FAMILIES:
        if key in summary:
            family = Family(name, text)
            family.add(summary[key], **labels)
            families.append(family)
    return families


GENERATE_FAMILIES = [
    ("done", "sd3_generate_images_done", "Images of the newest generation job on disk."),
    ("total", "sd3_generate_images_total", "Images the newest generation job makes in all."),
    ("images_per_s", "sd3_generate_images_per_second", "Throughput of the newest generation job (all ranks)."),
    ("eta_s", "sd3_generate_eta_seconds", "Seconds the newest generation job expects to need still."),
    ("time", "sd3_generate_progress_timestamp_seconds", "When the newest generation job last reported progress."),
]


def collect_generation(runs_dir: Path, patterns: list[str]) -> list[Family]:
    """The newest generation job's progress.json (by modification time): one job, so labels stay few."""
    found = Family("sd3_generate_progress_found", "1 when a generation job's progress.json was found.")
    candidates = [p for pattern in patterns for p in runs_dir.glob(pattern) if p.is_file()] \
        if runs_dir.is_dir() else []
    newest = max(candidates, key=lambda p: p.stat().st_mtime, default=None)
    state = None
    if newest is not None:
        try:
            state = json.loads(newest.read_text())
        except (OSError, ValueError):
            state = None  # replaced while read; the next run reads it
    found.add(0 if not isinstance(state, dict) else 1)
    if not isinstance(state, dict):
        return [found]
    run = os.path.relpath(newest.parent, runs_dir)
    labels = {"run": newest.parent.name if run == "." else run}
    families = [found]
    running = Family("sd3_generate_running", "1 while the newest generation job has not finished.")
    running.add(0 if state.get("finished") else 1, **labels)
    families.append(running)
    for key, name, text in GENERATE_FAMILIES:
        value = state.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            family = Family(name, text)
            family.add(float(value), **labels)
            families.append(family)
    return families


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--textfile-dir", type=Path, required=True, help="node_exporter's textfile directory")
    parser.add_argument("--runs-dir", type=Path, required=True, help="folder of the training runs on the shared volume")
    parser.add_argument("--pattern", action="append", help="glob of a run's log under --runs-dir (repeatable)")
    parser.add_argument("--progress-pattern", action="append",
                        help="glob of a generation job's progress.json under --runs-dir (repeatable)")
    parser.add_argument("--checkpoint-pattern", action="append",
                        help="glob of the checkpoints' `latest` file, relative to the run's folder or absolute; "
                             "{run} stands for the run's name (repeatable)")
    args = parser.parse_args(argv)
    patterns = args.pattern or ["metrics.jsonl", "*/metrics.jsonl"]
    checkpoints = args.checkpoint_pattern or ["latest", "checkpoints/latest", "*/latest"]
    families = collect(args.runs_dir, patterns, time.time(), checkpoints)
    families += collect_generation(args.runs_dir, args.progress_pattern or ["progress.json", "*/progress.json"])
    write_atomically(args.textfile_dir, "sd3_training.prom", render(families))
    return 0


if __name__ == "__main__":
    sys.exit(main())
