#!/usr/bin/env python3
"""Why a molecule scenario failed, from its log: the step molecule gave up in, molecule's own complaint
(an idempotence failure names the tasks that changed), and the last failed task with the start of its message.

run-scenarios.sh prints the summary once every scenario has ended, and asks for the failed step to decide whether a
failure is the environment's (create and prepare only start containers and fetch packages) and worth one more try.
molecule colours its log, so both read it with the colour codes taken out.

An Ansible task fails in three shapes: `fatal: [host]` (a task), `failed: [host] (item=...)` (one item of a loop:
the loop prints no fatal line) and `fatal: [host]: UNREACHABLE!`. A failure a verify expects and rescues looks the
same as any other, so the step line comes first: it says where the scenario stopped even when the last failure in
the log is a rescued one.

Usage: molecule_failure.py summary|step LOG
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
FAILED_STEP = re.compile(r"➜ (\w+): Executed: Failed")
TASK_BANNER = re.compile(r"TASK \[")
FAILURE = re.compile(r"(fatal|failed): \[[^\]]+\]")
# molecule's CRITICAL lines, but not the one it prints on every run while it looks for a default scenario
MOLECULE_COMPLAINT = re.compile(r"^CRITICAL (?!'molecule/default/molecule.yml' glob failed)")
STOPPED = "(stopped after"
MESSAGE_LINES = 10


def plain_lines(log_text: str) -> list[str]:
    return [ANSI.sub("", line) for line in log_text.splitlines()]


def _last_failed_step(lines: list[str]) -> str | None:
    steps = [m.group(1) for line in lines for m in [FAILED_STEP.search(line)] if m]
    return steps[-1] if steps else None


def failed_step(log_text: str) -> str | None:
    """The molecule step (create, converge, idempotence, verify, ...) that failed last; None when none did."""
    return _last_failed_step(plain_lines(log_text))


def failure_summary(log_text: str) -> str:
    """The lines that say why the scenario failed; one line saying none was found when the log shows no failure."""
    lines = plain_lines(log_text)
    out = []
    step = _last_failed_step(lines)
    if step:
        out.append(f"  molecule stopped in: {step}")
    stopped = [line.strip() for line in lines if line.startswith(STOPPED)]
    out += [f"  {line}" for line in stopped[-1:]]
    for index, line in enumerate(lines):
        if MOLECULE_COMPLAINT.search(line):
            out += [f"  {text.strip()}" for text in lines[index:index + MESSAGE_LINES] if text.strip()]
            break
    current_task, task, failed_at = "(before any task)", None, None
    for index, line in enumerate(lines):
        if TASK_BANNER.search(line):
            current_task = line.strip(" │")
        elif FAILURE.search(line):
            task, failed_at = current_task, index
    if failed_at is not None:
        out.append(f"  last failed task: {task}")
        out += lines[failed_at:failed_at + MESSAGE_LINES]
    if not out:
        return "  (no failed step or task in the log)"
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[1] not in ("summary", "step"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    path = Path(argv[2])
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        print(f"  (cannot read {path}: {error.strerror})")
        return 1
    if argv[1] == "step":
        print(failed_step(text) or "")
    else:
        print(failure_summary(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
