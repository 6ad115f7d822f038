#!/usr/bin/env python3
"""Slurm queue metrics (jobs by state, nodes by state) from `squeue` and `sinfo`, as a .prom textfile.

Where Slurm is not installed or its controller does not answer, the file says so (`sd3_slurm_up 0`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sd3_textfile import Family, render, run_command, write_atomically

# Always present, so a dashboard shows 0 rather than "no data".
JOB_STATES = ("pending", "running", "completing", "suspended")
NODE_STATES = ("idle", "allocated", "mixed", "down", "drained", "draining", "completing")
# sinfo's state suffixes: * not responding, ~ powered off, # powering up, ! powering down, % powering down,
# $ maintenance, @ reboot pending, ^ reboot issued, - planned.
STATE_FLAGS = "*~#!%$@^-"


def parse_squeue(text: str) -> Counter[str]:
    """`squeue -h -o %T` -> jobs per lower-case state."""
    return Counter(line.strip().lower() for line in text.splitlines() if line.strip())


def node_state(raw: str) -> tuple[str, bool]:
    """`idle*` -> ("idle", False): the base state and whether the node responds."""
    state = raw.strip().lower()
    responding = "*" not in state
    state = state.rstrip(STATE_FLAGS)
    # `drng` / `drain` forms and "drained"/"draining" as sinfo's long form prints them.
    if state == "drain":
        state = "drained"
    return state, responding


def parse_sinfo(text: str) -> tuple[Counter[str], int]:
    """`sinfo -h -N -o %N|%T` -> nodes per state (each node once, though it lies in several partitions)."""
    seen: dict[str, tuple[str, bool]] = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        name, raw = line.split("|", 1)
        seen.setdefault(name.strip(), node_state(raw))
    states = Counter(state for state, _ in seen.values())
    not_responding = sum(1 for _, ok in seen.values() if not ok)
    return states, not_responding


def _run(command: list[str], timeout: float) -> tuple[str | None, str]:
    return run_command(command, timeout, ": Slurm is not installed on this node")


def collect(squeue: str | None, sinfo: str | None, now: float, installed: bool = True) -> list[Family]:
    present = Family("sd3_slurm_installed", "1 when squeue is installed on this node.")
    present.add(1 if installed else 0)
    up = Family("sd3_slurm_up", "1 when squeue and sinfo answered.")
    up.add(1 if squeue is not None and sinfo is not None else 0)
    last_run = Family("sd3_slurm_collector_last_run_timestamp_seconds", "When the Slurm collector last ran.")
    last_run.add(now)
    families = [present, up, last_run]
    if squeue is not None:
        jobs = Family("sd3_slurm_jobs", "Jobs in the queue by state.")
        counts = parse_squeue(squeue)
        for state in sorted(set(JOB_STATES) | set(counts)):
            jobs.add(counts.get(state, 0), state=state)
        families.append(jobs)
    if sinfo is not None:
        nodes = Family("sd3_slurm_nodes", "Nodes by state (each node counted once).")
        counts, not_responding = parse_sinfo(sinfo)
        for state in sorted(set(NODE_STATES) | set(counts)):
            nodes.add(counts.get(state, 0), state=state)
        silent = Family("sd3_slurm_nodes_not_responding", "Nodes the controller marks as not responding (state*).")
        silent.add(not_responding)
        families += [nodes, silent]
    return families


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--textfile-dir", type=Path, required=True, help="node_exporter's textfile directory")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds squeue and sinfo may take each")
    args = parser.parse_args(argv)
    squeue, error = _run(["squeue", "-h", "-o", "%T"], args.timeout)
    sinfo, error2 = (None, "") if squeue is None else _run(["sinfo", "-h", "-N", "-o", "%N|%T"], args.timeout)
    for message in filter(None, (error, error2)):
        print(f"sd3_slurm_metrics: {message}", file=sys.stderr)
    families = collect(squeue, sinfo, time.time(), installed=shutil.which("squeue") is not None)
    write_atomically(args.textfile_dir, "sd3_slurm.prom", render(families))
    return 0


if __name__ == "__main__":
    sys.exit(main())
