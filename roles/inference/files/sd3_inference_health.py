#!/usr/bin/env python3
"""Active health checks for the inference balancer (nginx OSS has only passive ones).

Probes every worker's GET /readyz and writes nginx's upstream block, marking a worker `down` after `fall`
failed probes in a row and up again after `rise` good ones; nginx is reloaded only when the block changes.
The first probe of a worker decides its state at once. A worker that answers 503 (loading, warming up,
draining) is as unready as one that does not answer: the balancer sends it nothing new.

  sd3_inference_health.py --config FILE            probe every interval_s, for ever (the systemd service)
  sd3_inference_health.py --config FILE --once     probe once, write the block, reload nothing; prints
                                                   "changed" when the block changed (Ansible reads it)

Standard library only: it runs with the head's system Python.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Settings:
    upstream: str
    upstream_file: str
    workers: list[dict]
    server_options: str = ""
    keepalive: int = 16
    interval_s: float = 2.0
    timeout_s: float = 2.0
    fall: int = 2
    rise: int = 2
    reload_command: list[str] = field(default_factory=lambda: ["systemctl", "reload", "nginx"])
    state_file: str = ""

    @classmethod
    def load(cls, path: str) -> Settings:
        data = json.loads(Path(path).read_text())
        known = {name for name in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SystemExit(f"{path}: unknown settings {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)


@dataclass
class WorkerState:
    """What the checker believes of one worker; `up` None until its first probe."""

    up: bool | None = None
    streak: int = 0
    last_error: str = ""


def probe(url: str, timeout_s: float) -> tuple[bool, str]:
    """(ready, why not): ready only on 200 from /readyz within the timeout."""
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=timeout_s) as answer:
            return answer.status == 200, "" if answer.status == 200 else f"HTTP {answer.status}"
    except urllib.error.HTTPError as err:
        try:
            reason = json.loads(err.read() or b"{}").get("reason", "")
        except (ValueError, AttributeError):
            reason = ""
        return False, f"HTTP {err.code}" + (f" ({reason})" if reason else "")
    except (OSError, ValueError) as err:
        return False, str(getattr(err, "reason", err))


def update(state: WorkerState, ready: bool, error: str, fall: int, rise: int) -> None:
    """Hysteresis: `fall` failures in a row take a worker down, `rise` successes bring it back."""
    state.last_error = error
    if state.up is None:
        state.up, state.streak = ready, 0
        return
    if ready == state.up:
        state.streak = 0
        return
    state.streak += 1
    if state.streak >= (rise if ready else fall):
        state.up, state.streak = ready, 0


def render(settings: Settings, states: dict[str, WorkerState]) -> str:
    """nginx's upstream block: every worker, unready ones marked down (nginx answers 502 when all are)."""
    lines = ["# Written by sd3_inference_health.py from its probes of /readyz; do not edit (it is rewritten).",
             f"upstream {settings.upstream} {{"]
    for worker in settings.workers:
        state = states.get(worker["name"], WorkerState())
        options = " down" if state.up is False else (f" {settings.server_options}" if settings.server_options else "")
        lines.append(f"    server {worker['address']}:{worker['port']}{options};  # {worker['name']}"
                     + (f": {state.last_error}" if state.up is False and state.last_error else ""))
    if settings.keepalive > 0:
        lines.append(f"    keepalive {settings.keepalive};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_if_changed(path: str, text: str) -> bool:
    """Atomically replace the file when its content differs; True when it did."""
    target = Path(path)
    try:
        if target.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def check_once(settings: Settings, states: dict[str, WorkerState], pool: ThreadPoolExecutor,
               write_state: bool = True) -> bool:
    """Probe every worker in parallel, update the states, write the block (and the state file); True when the
    block changed."""
    results = pool.map(lambda w: probe(f"http://{w['address']}:{w['port']}", settings.timeout_s), settings.workers)
    for worker, (ready, error) in zip(settings.workers, results, strict=True):
        update(states.setdefault(worker["name"], WorkerState()), ready, error, settings.fall, settings.rise)
    changed = write_if_changed(settings.upstream_file, render(settings, states))
    if write_state and settings.state_file:
        write_if_changed(settings.state_file, json.dumps(
            {name: {"up": s.up, "error": s.last_error} for name, s in sorted(states.items())}, indent=1) + "\n")
    return changed


def reload_nginx(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"reload failed ({' '.join(command)}): {done.stderr.strip()}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args(argv)
    settings = Settings.load(args.config)
    states: dict[str, WorkerState] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(settings.workers)))) as pool:
        if args.once:
            # The state file lies in the service's runtime folder, which exists only while it runs.
            print("changed" if check_once(settings, states, pool, write_state=False) else "unchanged")
            return 0
        before: dict[str, bool | None] = {}
        while True:
            started = time.monotonic()
            if check_once(settings, states, pool):
                reload_nginx(settings.reload_command)
            now = {name: s.up for name, s in states.items()}
            for name, up in sorted(now.items()):
                if before.get(name) != up:
                    print(f"{name}: {'up' if up else 'down'}"
                          + (f" ({states[name].last_error})" if not up and states[name].last_error else ""), flush=True)
            before = now
            time.sleep(max(0.0, settings.interval_s - (time.monotonic() - started)))


if __name__ == "__main__":
    sys.exit(main())
