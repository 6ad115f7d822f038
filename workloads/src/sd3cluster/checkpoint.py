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

import contextlib
import json
import logging
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


def missing_parts(path: Path) -> list[str]:
    """What a complete checkpoint folder has and this one lacks (the marker, DCP's metadata, the run state)."""
    return [name for name in (MARKER, ".metadata", "trainer.json") if not (path / name).is_file()]


def is_complete(path: Path) -> bool:
    return not missing_parts(path)


def model_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The model settings a checkpoint's trainer.json records that differ from this run's, as
    `key: checkpoint X, config Y` (the transformer's own config keys one by one, so the user sees which)."""
    def flat(description: dict[str, Any]) -> dict[str, Any]:
        out = {f"model.{k}" if k in ("preset", "fuse_qkv") else k: v for k, v in description.items()
               if k != "transformer_config"}
        out.update({f"transformer.{k}": v for k, v in (description.get("transformer_config") or {}).items()})
        return out

    a, b = flat(saved), flat(current)
    return [f"{key}: checkpoint {a.get(key)!r}, config {b.get(key)!r}" for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key)]


_ADVICE = "move {path} away to resume from the one before, or set checkpoint.resume=never to start fresh"


def read_trainer_json(path: Path) -> dict[str, Any]:
    """The run state a checkpoint folder records (step, sampler, the model's description)."""
    trainer_file = Path(path) / "trainer.json"
    try:
        state = json.loads(trainer_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {trainer_file} cannot be read ({str(e).splitlines()[0][:200]}); "
                              f"{_ADVICE.format(path=path)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {trainer_file} holds no run state (a JSON {type(state).__name__}); "
                              f"{_ADVICE.format(path=path)}")
    return state


class _DcpLogCapture(logging.Filter):
    """DCP logs its read failures with their tracebacks on the root logger (which Python prints to stderr when no
    handler is set) before raising: keep those records from the terminal and give their messages to our error."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "torch/distributed/checkpoint" in record.pathname.replace(os.sep, "/"):
            self.messages.append(record.getMessage())
            return False
        return True


@contextlib.contextmanager
def _quiet_dcp_logs():
    capture = _DcpLogCapture()
    root = logging.getLogger()
    root.addFilter(capture)
    try:
        yield capture
    finally:
        root.removeFilter(capture)


def _failure_reason(path: Path, e: BaseException, dcp_messages: list[str]) -> str:
    """One line on why DCP could not read `path`, naming the file where that is known."""
    inner = e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))  # (exception, stack summary) per failed rank
        inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
    text = str(inner).splitlines()[0][:300] if str(inner) else ""
    reason = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    if isinstance(inner, EOFError):
        reason += ", a file of it ends too early"
    if any("metadata is not found" in m.lower() for m in dcp_messages):
        cause = text.split("global metadata read failed: ", 1)[-1].split("; rank local", 1)[0]
        return f"{path / '.metadata'} is damaged: {cause}"
    filename = getattr(inner, "filename", None)
    return f"{filename}: {reason}" if filename and filename not in reason else reason


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
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist; check checkpoint.resume or checkpoint.dir")
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} is a file, not a checkpoint folder (step-*); check "
                                  "checkpoint.resume or checkpoint.dir")
        missing = missing_parts(path)
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete: it has no {', '.join(missing)} (a save was cut "
                                  "off there); resume from another one or set checkpoint.resume=auto")
        advice = _ADVICE.format(path=path)
        trainer_state = read_trainer_json(path)
        with _quiet_dcp_logs() as dcp_logs:
            try:
                dcp.load(tensors, checkpoint_id=str(path))
            except (Exception, CheckpointException) as e:  # DCP's exception derives from BaseException
                raise CheckpointError(f"checkpoint {path} cannot be read "
                                      f"({_failure_reason(path, e, dcp_logs.messages)}); {advice}") from None
        rng_file = path / f"rank-{self.rt.rank}.pt"
        if rng_file.is_file():
            try:
                set_rng_state(torch.load(rng_file, weights_only=False), self.rt.device)
            except Exception as e:
                raise CheckpointError(f"checkpoint {rng_file} cannot be read ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0][:200] if str(e) else ''}); {advice}") from None
        return trainer_state
