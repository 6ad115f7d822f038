"""Progress of long rank-sharded work (generate, prepare): rank 0 prints done/total, the rate and an ETA."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .dist import Runtime


def fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """Rank 0: a line every few seconds (done/total, images/s, ETA) and, with `state_file`, the same as JSON for
    the monitoring (generate's progress.json)."""

    def __init__(self, rt: Runtime, total: int, done_before: int, workers_count: int, every_s: float,
                 label: str = "generate", state_file: Path | None = None):
        self.rt, self.total, self.every_s, self.label, self.state_file = rt, total, every_s, label, state_file
        self.done_before, self.workers = done_before, workers_count
        self.made = 0
        self.start = self.last = time.perf_counter()

    def rate(self) -> float:
        """Images/s of the whole job, estimated from this worker's pace (workers get equal shares of the work)."""
        elapsed = time.perf_counter() - self.start
        return self.made * self.workers / elapsed if elapsed > 0 and self.made else 0.0

    def update(self, made: int, force: bool = False, finished: bool = False, done: int | None = None) -> None:
        self.made += made
        if not self.rt.is_main or not (force or time.perf_counter() - self.last >= self.every_s):
            return
        self.last = time.perf_counter()
        done = min(self.total, self.done_before + self.made * self.workers) if done is None else done
        rate = self.rate()
        eta = (self.total - done) / rate if rate > 0 else None
        if not finished:
            print(f"[{self.label}] {done}/{self.total} images ({100 * done / max(self.total, 1):.0f}%), "
                  f"{rate:.2f} images/s, ETA {fmt_duration(eta) if eta is not None else '?'}", flush=True)
        if self.state_file is None:
            return
        state = {"done": done, "total": self.total, "images_per_s": rate, "eta_s": eta, "finished": finished,
                 "time": time.time()}
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")
        tmp.write_text(json.dumps(state) + "\n")
        os.replace(tmp, self.state_file)
