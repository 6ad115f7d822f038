#!/usr/bin/env python3
"""Reads what one finished sd3 Slurm job left on the shared volume and prints it as one JSON object.

    sd3_job_result.py SHARED_DIR RUN_NAME

Run on the head by verify.yml (ansible.builtin.script): the job's log, its newest complete checkpoint and
that checkpoint's completion record, the last metrics record, and the `sd3cluster verify` report if any.
Missing pieces are null, so the play can say which one is missing instead of failing on a read.
"""
import json
import math
import re
import sys
from pathlib import Path


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    shared, run = Path(sys.argv[1]), sys.argv[2]
    log_path = shared / "jobs" / "logs" / f"{run}.out"
    log = log_path.read_text(errors="replace") if log_path.is_file() else ""
    checkpoints = shared / "checkpoints" / run
    latest = (checkpoints / "latest").read_text().strip() if (checkpoints / "latest").is_file() else None
    complete = read_json(checkpoints / latest / "COMPLETE") if latest else None
    metrics_path = shared / "runs" / run / "metrics.jsonl"
    records = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    starts = [int(n) for n in re.findall(r"sd3cluster \w+, (\d+) nodes", log)]
    print(json.dumps({
        "log_path": str(log_path),
        "log_tail": log[-3000:],
        "nodes": starts[-1] if starts else None,
        "starts": len(starts),  # more than one: Slurm requeued the job
        "resumed": re.findall(r"resumed from \S*?(step-\d+) at step (\d+)", log),
        "finished": bool(re.search(r"\[sd3-train\] job \d+ finished", log)),
        "latest": latest,
        "complete": complete,
        "checkpoints": sorted(p.name for p in checkpoints.glob("step-*")) if checkpoints.is_dir() else [],
        "last_metrics": records[-1] if records else None,
        "loss_finite": bool(records) and math.isfinite(float(records[-1].get("loss", "nan"))),
        "verify": read_json(shared / "runs" / run / "verify.json"),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
