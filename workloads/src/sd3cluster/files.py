"""Files other processes (other ranks and nodes, a rerun) may read at any moment: written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_file_atomic(data: bytes, path: Path) -> None:
    """Temporary name, fsync, rename: a reader never sees half a file. The temporary name starts with a dot and
    ends in .tmp (`.NAME.PID.tmp`), so a process killed mid-write leaves nothing that looks like a finished file."""
    tmp = temporary_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def remove_temporaries(folder: Path, pattern: str = "*") -> int:
    """Removes what killed writers of `pattern` files left in `folder`; call it while no writer runs."""
    stale = list(folder.glob(f".{pattern}.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def keep_settings(path: Path, settings: dict[str, Any]) -> list[str]:
    """A resumable run's settings: written to `path` (JSON) by the first run; a later run into the same folder
    gets what differs ("key: old before, new now"), empty when it may continue. A damaged file is rewritten."""
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = None
        if isinstance(old, dict):
            return [f"{k}: {old.get(k)!r} before, {settings[k]!r} now" for k in sorted(settings)
                    if old.get(k) != settings[k]]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings, indent=2) + "\n")
    os.replace(tmp, path)
    return []
