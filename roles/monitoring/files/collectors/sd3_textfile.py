"""Prometheus text format for node_exporter's textfile collector, written so that a scrape never sees half a file."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


@dataclass
class Family:
    """One metric family: its HELP, TYPE and samples (labels -> value)."""

    name: str
    help: str
    kind: str = "gauge"
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> None:
        self.samples.append((labels, float(value)))

    def render(self) -> str:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for labels, value in self.samples:
            label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
            lines.append(f"{self.name}{{{label_text}}} {_number(value)}" if labels else f"{self.name} {_number(value)}")
        return "\n".join(lines) + "\n"


def render(families: Iterable[Family]) -> str:
    return "".join(f.render() for f in families)


def write_atomically(directory: Path, name: str, text: str) -> Path:
    """Write `name` in `directory` through a temporary file and a rename (node_exporter reads only *.prom)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / name
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def run_command(argv: list[str], timeout: float, missing: str = "") -> tuple[str | None, str]:
    """(stdout, "") of a command that succeeded, else (None, why): not installed (with `missing` added), no answer
    within `timeout` seconds, or its exit status and first words of output. Collectors report, never raise."""
    if shutil.which(argv[0]) is None:
        return None, f"{argv[0]} not found{missing}"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(argv)} did not answer within {timeout:.0f} s"
    if done.returncode != 0:
        return None, f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}"
    return done.stdout, ""
