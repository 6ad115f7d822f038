"""sd3-backup's own logic, without restic: the comparison of a restored tree with its sources, the
lock between runs, the metrics file, and the messages for restic's errors."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROGRAM = Path(__file__).resolve().parents[2] / "roles" / "backup" / "files" / "sd3_backup.py"
spec = importlib.util.spec_from_file_location("sd3_backup", PROGRAM)
sd3_backup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sd3_backup)


def restore_copy(source_root: Path, scratch: Path) -> None:
    """What restic restore does: the tree under its absolute path below the scratch folder, times kept."""
    shutil.copytree(source_root, scratch / str(source_root).lstrip("/"), copy_function=shutil.copy2)


def test_unchanged_files_are_compared_and_match(tmp_path):
    source = tmp_path / "shared" / "checkpoints"
    source.mkdir(parents=True)
    for index in range(20):
        (source / f"shard-{index}").write_bytes(os.urandom(1000 + index))
    restore_copy(source, tmp_path / "scratch")
    counts = sd3_backup.compare_with_sources(tmp_path / "scratch")
    assert counts == {"compared": 20, "mismatched": 0, "changed_since": 0, "gone": 0}


def test_a_silently_changed_file_is_a_mismatch_and_newer_or_gone_files_are_not(tmp_path):
    source = tmp_path / "ckpt"
    source.mkdir()
    for name in ("same", "corrupt", "newer", "gone"):
        (source / name).write_bytes(b"x" * 4096)
    restore_copy(source, tmp_path / "scratch")
    corrupt = source / "corrupt"
    stat = corrupt.stat()
    corrupt.write_bytes(b"y" * 4096)  # same size, same time: the content changed behind restic's back
    os.utime(corrupt, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (source / "newer").write_bytes(b"trained further")
    os.utime(source / "newer", (time.time() + 10, time.time() + 10))
    (source / "gone").unlink()
    counts = sd3_backup.compare_with_sources(tmp_path / "scratch")
    assert counts == {"compared": 2, "mismatched": 1, "changed_since": 1, "gone": 1}


def test_a_second_run_waits_for_the_lock_then_gives_up(tmp_path, capsys):
    lock = tmp_path / "lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "3"])
    try:
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(sd3_backup.LockBusy), sd3_backup.exclusive_lock(str(lock), 1):
            pass
        assert 1 <= time.monotonic() - started < 3
        assert "waiting up to 1 s" in capsys.readouterr().out
    finally:
        holder.wait()
    with sd3_backup.exclusive_lock(str(lock), 0):
        pass


def test_metrics_file_is_complete_and_readable(tmp_path):
    metrics = sd3_backup.Metrics({"textfile_dir": str(tmp_path / "textfile"), "cluster_name": "c1"}, "sd3_backup")
    metrics.add("sd3_backup_last_run_success", "1 when the last run succeeded", True)
    metrics.add("sd3_backup_last_success_timestamp_seconds", "When", 1764700000.25)
    metrics.write()
    text = (tmp_path / "textfile" / "sd3_backup.prom").read_text()
    assert 'sd3_backup_last_run_success{cluster="c1"} 1\n' in text
    assert 'sd3_backup_last_success_timestamp_seconds{cluster="c1"} 1764700000.25\n' in text
    assert "# TYPE sd3_backup_last_run_success gauge" in text
    assert list((tmp_path / "textfile").iterdir()) == [tmp_path / "textfile" / "sd3_backup.prom"]


@pytest.mark.parametrize(("stderr", "expected"), [
    ("Fatal: wrong password or no key found\n", "backup_restic_password does not open this repository"),
    ("Fatal: unable to open config file: Stat: file does not exist\nIs there a repository at the following "
     "location?\nsftp:restic@10.0.0.9:/srv/restic/c1\n", "there is no repository at the configured location"),
    ("subprocess ssh: ssh: connect to host 10.0.0.9 port 22: No route to host\nFatal: unable to open repository",
     "No route to host"),
])
def test_restic_errors_are_explained(stderr, expected):
    assert expected in sd3_backup.explain_restic_error("backup", stderr)


def test_restic_times_with_nanoseconds_are_read():
    assert sd3_backup.parse_restic_time("2026-12-02T19:04:05.123456789+00:00") == pytest.approx(1796238245.123456)
    assert sd3_backup.parse_restic_time("2026-12-02T19:04:05Z") == 1796238245


def test_the_program_runs_as_a_script():
    out = subprocess.run([sys.executable, str(PROGRAM), "--help"], capture_output=True, text=True, check=True)
    assert "restore" in out.stdout
