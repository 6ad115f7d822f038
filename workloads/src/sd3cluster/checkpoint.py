"""Checkpoints with torch.distributed.checkpoint on the shared volume, made so a crash never leaves a bad "latest".

Layout of `checkpoint.dir`:
    .tmp-step-00000040/    a save in progress (or one a crash cut off): never read
    step-00000040/         DCP files (model, optimizer, EMA), trainer.json, rank-R.pt (RNG), COMPLETE
    latest                 the name of the newest complete checkpoint (written last, atomically)

A save writes everything into the temporary folder, waits for every rank, and only then does rank 0 write
COMPLETE, rename the folder to its final name and replace `latest`. Resuming takes the newest folder that
has COMPLETE; folders without it are ignored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .dist import Runtime, barrier, broadcast_object
from .errors import CheckpointError

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / ".metadata").is_file() and (path / "trainer.json").is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class CheckpointManager:
    def __init__(self, root: Path, rt: Runtime, keep: int = 3):
        self.root = Path(root)
        self.rt = rt
        self.keep = keep

    def save(self, step: int, tensors: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Collective: every rank calls it with its own state (DCP writes each rank's shards)."""
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".tmp-step-{step:08d}"
        if self.rt.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier(self.rt)
        dcp.save(tensors, checkpoint_id=str(tmp))
        torch.save(rng_state(self.rt.device), tmp / f"rank-{self.rt.rank}.pt")
        barrier(self.rt)
        if self.rt.is_main:
            _write_durable(tmp / "trainer.json", json.dumps(trainer_state))
            _write_durable(tmp / MARKER, json.dumps({"step": step, "world": self.rt.world, "time": time.time()}))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            _write_durable(self.root / "latest", final.name + "\n")
            self._prune()
        barrier(self.rt)
        return final

    def _prune(self) -> None:
        done = complete_checkpoints(self.root)
        for _, path in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)
        newest = done[-1][0] if done else -1
        for child in self.root.glob(".tmp-step-*"):
            m = re.match(r"^\.tmp-step-(\d{8})$", child.name)
            if m and int(m.group(1)) <= newest:
                shutil.rmtree(child, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, as rank 0 sees it (every rank gets the same answer)."""
        found = None
        if self.rt.is_main:
            done = complete_checkpoints(self.root)
            found = str(done[-1][1]) if done else None
        found = broadcast_object(self.rt, found)
        return Path(found) if found else None

    def load(self, path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
        """Fill `tensors` in place from `path`; returns the trainer state. Raises CheckpointError if unusable."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist; check checkpoint.resume or checkpoint.dir")
        if not is_complete(path):
            raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker or metadata): a save was cut "
                                  "off there; resume from another one or set checkpoint.resume=auto")
        try:
            dcp.load(tensors, checkpoint_id=str(path))
            trainer_state = json.loads((path / "trainer.json").read_text())
            rng_file = path / f"rank-{self.rt.rank}.pt"
            if rng_file.is_file():
                set_rng_state(torch.load(rng_file, weights_only=False), self.rt.device)
        except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
            raise CheckpointError(
                f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:300]}); move it "
                "away to resume from the one before, or set checkpoint.resume=never to start fresh") from None
        return trainer_state
