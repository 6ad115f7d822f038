#!/usr/bin/python3
"""sd3-backup: restic backups of the shared volume and of the cluster's state, checked and restored.

Installed by the backup role, which writes its settings to /etc/sd3-backup/config.json.

  sd3-backup run       back up the configured paths, apply retention, prune
  sd3-backup check     restic check, restore the latest snapshot into a scratch folder, compare checksums
  sd3-backup restore   restore one path of a snapshot to its place or elsewhere (--dry-run lists changes)

The three take one lock (flock), so two never overlap: a second run waits for the first, up to a
limit, then exits cleanly having done nothing. `run` and `check` write their results as Prometheus
metrics into node_exporter's textfile directory; `restore` prints a JSON report.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = "/etc/sd3-backup/config.json"
EXIT_LOCK_BUSY = 0  # a run that gave up waiting for the lock did nothing: not an error


class Failure(Exception):
    """A problem the user must act on; the message says what and how."""


class LockBusy(Exception):
    """Another sd3-backup run kept the lock for longer than the wait."""


def log(message: str) -> None:
    print(f"sd3-backup: {message}", flush=True)


def explain_restic_error(action: str, stderr: str) -> str:
    text = stderr.strip()
    if "wrong password" in text:
        return (f"restic {action}: the repository refused the password: backup_restic_password does not open "
                "this repository; set it to the repository's password (vault)")
    if "Is there a repository at the following location" in text:
        return (f"restic {action}: there is no repository at the configured location: run backup.yml "
                "(it initialises one) or correct backup_repository_type and its location variables")
    tail = " | ".join(line for line in text.splitlines()[-6:] if line.strip())
    return f"restic {action} failed: {tail or 'no message'}"


class Repository:
    def __init__(self, config: dict):
        self.wrapper = config["restic_wrapper"]
        self.host = config["snapshot_host"]
        self.tag = config["snapshot_tag"]

    def run(self, action: str, *args: str) -> str:
        proc = subprocess.run([self.wrapper, action, *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise Failure(explain_restic_error(action, proc.stderr))
        return proc.stdout

    def snapshot(self, name: str) -> dict:
        """The snapshot called name (an id or "latest") among this cluster's snapshots."""
        found = json.loads(self.run("snapshots", "--json", "--host", self.host, "--tag", self.tag) or "[]")
        if not found:
            raise Failure(f"the repository holds no snapshot of host {self.host} with tag {self.tag}: "
                          "run a backup first (systemctl start sd3-backup.service)")
        found.sort(key=lambda snap: snap["time"])
        if name == "latest":
            return found[-1]
        matches = [snap for snap in found if snap["id"].startswith(name) or snap.get("short_id") == name]
        if len(matches) != 1:
            raise Failure(f"snapshot '{name}' is {'ambiguous' if matches else 'not found'} among this cluster's "
                          f"snapshots: list them with `sd3-restic snapshots` and give a longer id or latest")
        return matches[0]


def parse_restic_time(text: str) -> float:
    # restic writes nanoseconds; Python reads at most microseconds.
    text = re.sub(r"(\.\d{6})\d+", r"\1", text.replace("Z", "+00:00"))
    return dt.datetime.fromisoformat(text).timestamp()


@contextlib.contextmanager
def exclusive_lock(path: str, wait_seconds: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another sd3-backup run holds {path}; waiting up to {wait_seconds} s for it to finish")
            deadline = time.monotonic() + wait_seconds
            while True:
                time.sleep(1)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockBusy from None
            log("the other run finished; going on")
        yield
    finally:
        os.close(fd)


class Metrics:
    """One textfile-collector file, replaced atomically so node_exporter never reads half of it."""

    def __init__(self, config: dict, name: str):
        self.path = Path(config["textfile_dir"]) / f"{name}.prom"
        self.labels = f'cluster="{config["cluster_name"]}"'
        self.lines: list[str] = []

    def add(self, metric: str, help_text: str, value: float) -> None:
        self.lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge",
                       f"{metric}{{{self.labels}}} {value:.17g}"]

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("\n".join(self.lines) + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, self.path)


class State:
    """Last results, kept across runs: a failed run must not forget when the last good one was."""

    def __init__(self, config: dict):
        self.path = Path(config["state_dir"]) / "state.json"
        try:
            self.data = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            self.data = {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(".state.json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path)


def backup(config: dict, repo: Repository) -> dict:
    paths = [path for path in config["paths"] if os.path.lexists(path)]
    missing = [path for path in config["paths"] if path not in paths]
    for path in missing:
        log(f"warning: {path} does not exist on this node; it is not in this snapshot")
    if missing and config["missing_paths"] == "fail":
        raise Failure(f"{len(missing)} configured path(s) missing ({', '.join(missing)}) and "
                      "backup_missing_paths is fail: create them or remove them from the backup paths")
    if not paths:
        raise Failure("none of the configured paths exists on this node: check backup_shared_paths and "
                      "backup_state_paths, and that the shared volume is mounted")
    excludes = [arg for pattern in config["exclude_patterns"] for arg in ("--exclude", pattern)]
    out = repo.run("backup", "--json", "--host", repo.host, "--tag", repo.tag, *excludes, *paths)
    summary = next((json.loads(line) for line in reversed(out.splitlines())
                    if line.startswith("{") and '"summary"' in line), None)
    if summary is None:
        raise Failure("restic backup printed no summary; see `journalctl -u sd3-backup`")
    summary["missing_paths"] = missing
    log(f"snapshot {summary['snapshot_id'][:8]}: {summary['files_new']} new, {summary['files_changed']} changed, "
        f"{summary['files_unmodified']} unchanged files; {summary['data_added']} bytes added to the repository")
    keep = [arg for option in ("daily", "weekly", "monthly")
            for arg in (f"--keep-{option}", str(config["keep"][option]))]
    prune = ["--prune"] if config["prune"] else []
    repo.run("forget", "--host", repo.host, "--tag", repo.tag, "--group-by", "host,tags", *keep, *prune)
    log(f"retention applied ({', '.join(f'{k} {v}' for k, v in config['keep'].items())})"
        + ("; unreferenced data pruned" if prune else ""))
    return summary


def command_run(config: dict, args: argparse.Namespace) -> int:
    repo, state, started = Repository(config), State(config), time.time()
    wait = config["lock_wait_seconds"] if args.wait is None else args.wait
    try:
        with exclusive_lock(config["lock_path"], wait):
            summary = backup(config, repo)
    except LockBusy:
        log(f"gave up after {wait} s: another run still holds {config['lock_path']}; this run did nothing")
        return EXIT_LOCK_BUSY
    except Failure as error:
        log(f"error: {error}")
        state.data["last_backup_failure"] = {"time": time.time(), "error": str(error)}
        ok = False
    else:
        state.data["last_backup"] = {**summary, "time": time.time()}
        state.data["last_backup_success_time"] = time.time()
        ok = True
    state.save()
    (Path(config["state_dir"]) / "last-backup.json").write_text(
        json.dumps(state.data.get("last_backup", {}), indent=2) + "\n")
    last = state.data.get("last_backup", {})
    metrics = Metrics(config, "sd3_backup")
    metrics.add("sd3_backup_last_run_success", "1 when the last backup run succeeded, 0 when it failed", ok)
    metrics.add("sd3_backup_last_run_timestamp_seconds", "When the last backup run ended", time.time())
    metrics.add("sd3_backup_last_run_duration_seconds", "How long the last backup run took", time.time() - started)
    metrics.add("sd3_backup_last_success_timestamp_seconds", "When the last successful backup ended",
                state.data.get("last_backup_success_time", 0))
    metrics.add("sd3_backup_last_added_bytes", "Bytes the last successful backup added to the repository",
                last.get("data_added", 0))
    metrics.add("sd3_backup_last_files", "Files in the last successful snapshot",
                last.get("total_files_processed", 0))
    metrics.add("sd3_backup_missing_paths", "Configured paths absent at the last successful backup",
                len(last.get("missing_paths", [])))
    metrics.write()
    return 0 if ok else 1


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def compare_with_sources(scratch: Path) -> dict:
    """Compare every restored file with its source, for the sources unchanged since the snapshot."""
    counts = {"compared": 0, "mismatched": 0, "changed_since": 0, "gone": 0}
    mismatches = []
    for folder, _dirs, files in os.walk(scratch):
        for name in files:
            restored = Path(folder) / name
            source = Path("/") / restored.relative_to(scratch)
            r_stat = restored.lstat()
            if not restored.is_file() or restored.is_symlink():
                continue
            try:
                s_stat = source.lstat()
            except FileNotFoundError:
                counts["gone"] += 1
                continue
            if s_stat.st_mtime_ns != r_stat.st_mtime_ns:
                counts["changed_since"] += 1
                continue
            counts["compared"] += 1
            if s_stat.st_size != r_stat.st_size or file_digest(source) != file_digest(restored):
                counts["mismatched"] += 1
                mismatches.append(str(source))
    for path in mismatches[:20]:
        log(f"MISMATCH: {path} differs from its copy in the snapshot although it has not changed since")
    return counts


def restore_check(config: dict, repo: Repository, result: dict) -> None:
    check_args = ["--read-data-subset", config["check_read_data_subset"]] if config["check_read_data_subset"] else []
    repo.run("check", *check_args)
    log("restic check: the repository is consistent" + (
        f" ({config['check_read_data_subset']} of the pack data read)" if check_args else ""))
    snap = repo.snapshot("latest")
    result["snapshot_time"] = parse_restic_time(snap["time"])
    result["snapshot_id"] = snap["id"]
    wanted = config["check_paths"] or snap["paths"]
    scratch = Path(config["check_scratch_path"])
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(mode=0o700, parents=True)
    try:
        includes = [arg for path in wanted for arg in ("--include", path)]
        repo.run("restore", snap["id"], "--target", str(scratch), *includes)
        counts = compare_with_sources(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result.update(counts)
    taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(result["snapshot_time"]))
    log(f"restored snapshot {snap['id'][:8]} of {taken}: "
        f"{counts['compared']} unchanged files compared, {counts['mismatched']} differ, "
        f"{counts['changed_since']} changed since, {counts['gone']} gone since")
    if counts["mismatched"]:
        raise Failure(f"{counts['mismatched']} restored file(s) differ from their unchanged sources: "
                      "the repository or the shared volume is damaged; run `sd3-restic check --read-data`")


def command_check(config: dict, args: argparse.Namespace) -> int:
    repo, state = Repository(config), State(config)
    wait = config["lock_wait_seconds"] if args.wait is None else args.wait
    result: dict = {"time": time.time()}
    try:
        with exclusive_lock(config["lock_path"], wait):
            restore_check(config, repo, result)
    except LockBusy:
        log(f"gave up after {wait} s: another run still holds {config['lock_path']}; this check did nothing")
        return EXIT_LOCK_BUSY
    except Failure as error:
        log(f"FAILED: {error}")
        result["error"] = str(error)
    age = time.time() - result["snapshot_time"] if "snapshot_time" in result else None
    max_age = config["check_max_age_hours"] * 3600
    if age is not None and age > max_age:
        log(f"FAILED: the latest snapshot is {age / 3600:.1f} h old, more than backup_check_max_age_hours "
            f"({config['check_max_age_hours']}): the backups have stopped; see `journalctl -u sd3-backup`")
        result.setdefault("error", "latest snapshot too old")
    ok = "error" not in result
    result["success"] = ok
    if ok:
        state.data["last_check_success_time"] = time.time()
    state.data["last_check"] = result
    state.save()
    metrics = Metrics(config, "sd3_backup_check")
    metrics.add("sd3_backup_check_success", "1 when the last restore check passed, 0 when it failed", ok)
    metrics.add("sd3_backup_check_last_run_timestamp_seconds", "When the last restore check ran", result["time"])
    metrics.add("sd3_backup_check_last_success_timestamp_seconds", "When a restore check last passed",
                state.data.get("last_check_success_time", 0))
    metrics.add("sd3_backup_check_files_compared", "Unchanged files compared by the last check",
                result.get("compared", 0))
    metrics.add("sd3_backup_check_files_mismatched", "Files whose restored copy differed", result.get("mismatched", 0))
    metrics.add("sd3_backup_latest_snapshot_timestamp_seconds", "Time of the latest snapshot at the last check",
                result.get("snapshot_time", 0))
    metrics.add("sd3_backup_stale",
                "1 when the latest snapshot is older than backup_check_max_age_hours or could not be read",
                age is None or age > max_age)
    metrics.write()
    log("restore check passed" if ok else "restore check FAILED")
    return 0 if ok else 1


def sync(source: Path, target: Path, dry_run: bool, delete: bool) -> list[str]:
    if source.is_dir() and not source.is_symlink():
        source_arg, target_arg = f"{source}/", f"{target}/"
    else:
        source_arg, target_arg = str(source), str(target)
    if not dry_run:
        target.parent.mkdir(parents=True, exist_ok=True)
    argv = ["rsync", "-aH", "--numeric-ids", "--checksum", "--itemize-changes", "--out-format=%i %n%L"]
    argv += ["--dry-run"] if dry_run else []
    argv += ["--delete"] if delete else []
    proc = subprocess.run([*argv, source_arg, target_arg], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise Failure(f"rsync into {target} failed: {proc.stderr.strip()}")
    # Lines of attribute-free no-ops ("." then only dots) are not changes.
    return [line for line in proc.stdout.splitlines() if line and not re.match(r"^\.[a-zL]\.+ ", line)]


def command_restore(config: dict, args: argparse.Namespace) -> int:
    repo = Repository(config)
    path = os.path.normpath(args.path)
    target = Path(os.path.normpath(args.target or path))
    if not os.path.isabs(path) or not target.is_absolute():
        print(json.dumps({"error": "the path to restore and the target must be absolute paths"}))
        return 2
    staging = Path(config["restore_staging_path"]) / f"restore-{os.getpid()}"
    report = {"path": path, "target": str(target), "dry_run": args.dry_run, "delete": args.delete}
    try:
        with exclusive_lock(config["lock_path"], config["lock_wait_seconds"]):
            snap = repo.snapshot(args.snapshot)
            report["snapshot"] = snap["id"]
            report["snapshot_time"] = snap["time"]
            staging.mkdir(mode=0o700, parents=True)
            repo.run("restore", snap["id"], "--target", str(staging), "--include", path)
            restored = staging / path.lstrip("/")
            if not os.path.lexists(restored):
                raise Failure(f"{path} is not in snapshot {snap['id'][:8]}; list what it holds with "
                              f"`sd3-restic ls {snap['id'][:8]}` and set backup_restore_path to one of those paths")
            report["changes"] = sync(restored, target, args.dry_run, args.delete)
    except LockBusy:
        report["error"] = f"another sd3-backup run still holds {config['lock_path']}; try again later"
    except Failure as error:
        report["error"] = str(error)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report["changed"] = bool(report.get("changes")) and not args.dry_run
    print(json.dumps(report, indent=2))
    return 1 if "error" in report else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sd3-backup", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="settings written by the backup role")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="back up, apply retention, prune")
    run.add_argument("--wait", type=int, help="seconds to wait for another run's lock (default: the config's)")
    check = commands.add_parser("check", help="restore check of the latest snapshot")
    check.add_argument("--wait", type=int, help="seconds to wait for another run's lock (default: the config's)")
    restore = commands.add_parser("restore", help="restore one path of a snapshot")
    restore.add_argument("--snapshot", default="latest", help="snapshot id or latest")
    restore.add_argument("--path", required=True, help="absolute path as backed up")
    restore.add_argument("--target", help="where to put it (default: its own place)")
    restore.add_argument("--dry-run", action="store_true", help="list what would change, change nothing")
    restore.add_argument("--delete", action="store_true", help="delete files the snapshot does not hold")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    handler = {"run": command_run, "check": command_check, "restore": command_restore}[args.command]
    return handler(config, args)


if __name__ == "__main__":
    sys.exit(main())
