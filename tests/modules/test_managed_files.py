"""The managed_files module run as Ansible runs it (a process reading its arguments), on files in a temp folder."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "ansible" / "plugins" / "modules" / "managed_files.py"
ME = str(os.getuid())


def run(tmp_path, check=False, diff=False, **args):
    """Run the module with args; its JSON answer (failed answers included)."""
    args_file = tmp_path.parent / f"{tmp_path.name}-args.json"
    module_args = {**args, "_ansible_check_mode": check, "_ansible_diff": diff}
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": module_args}))
    proc = subprocess.run([sys.executable, str(MODULE), str(args_file)], capture_output=True, text=True, check=False)
    return json.loads(proc.stdout)


def mode_of(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_new_files_are_written_with_their_modes_and_reported(tmp_path):
    result = run(tmp_path, mode="0644", files=[
        {"path": str(tmp_path / "a.service"), "content": "[Unit]\n"},
        {"path": str(tmp_path / "b.py"), "content": "print(1)\n", "mode": "0755"},
    ])
    assert result["changed"] is True
    assert result["changed_paths"] == [str(tmp_path / "a.service"), str(tmp_path / "b.py")]
    assert (tmp_path / "a.service").read_text() == "[Unit]\n"
    assert mode_of(tmp_path / "a.service") == 0o644
    assert mode_of(tmp_path / "b.py") == 0o755
    # Nothing left behind by the atomic writes.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.service", "b.py"]


def test_second_run_changes_nothing(tmp_path):
    files = [{"path": str(tmp_path / "a"), "content": "x\n", "mode": "0600", "owner": ME, "group": str(os.getgid())}]
    assert run(tmp_path, files=files)["changed"] is True
    before = os.stat(tmp_path / "a")
    again = run(tmp_path, files=files)
    assert again["changed"] is False
    assert again["changed_paths"] == []
    assert os.stat(tmp_path / "a").st_ino == before.st_ino


def test_only_the_drifted_file_is_rewritten(tmp_path):
    (tmp_path / "same").write_text("same\n")
    (tmp_path / "drift").write_text("old\n")
    os.chmod(tmp_path / "same", 0o644)
    inode = os.stat(tmp_path / "same").st_ino
    result = run(tmp_path, mode="0644", files=[
        {"path": str(tmp_path / "same"), "content": "same\n"},
        {"path": str(tmp_path / "drift"), "content": "new\n"},
    ])
    assert result["changed_paths"] == [str(tmp_path / "drift")]
    assert (tmp_path / "drift").read_text() == "new\n"
    assert os.stat(tmp_path / "same").st_ino == inode


def test_a_missing_trailing_newline_is_drift(tmp_path):
    (tmp_path / "a").write_text("x")
    assert run(tmp_path, files=[{"path": str(tmp_path / "a"), "content": "x\n"}])["changed"] is True
    assert (tmp_path / "a").read_text() == "x\n"


def test_mode_alone_is_fixed_in_place(tmp_path):
    (tmp_path / "a").write_text("x\n")
    os.chmod(tmp_path / "a", 0o600)
    inode = os.stat(tmp_path / "a").st_ino
    result = run(tmp_path, diff=True, files=[{"path": str(tmp_path / "a"), "content": "x\n", "mode": "0644"}])
    assert result["changed"] is True
    assert mode_of(tmp_path / "a") == 0o644
    assert os.stat(tmp_path / "a").st_ino == inode
    header = f"{tmp_path / 'a'} (attributes)"
    assert result["diff"] == [{"before_header": header, "after_header": header,
                               "before": {"mode": "0600"}, "after": {"mode": "0644"}}]


def test_unset_mode_keeps_the_existing_mode(tmp_path):
    (tmp_path / "a").write_text("old\n")
    os.chmod(tmp_path / "a", 0o640)
    run(tmp_path, files=[{"path": str(tmp_path / "a"), "content": "new\n"}])
    assert mode_of(tmp_path / "a") == 0o640


def test_check_mode_reports_and_writes_nothing(tmp_path):
    (tmp_path / "old").write_text("old\n")
    result = run(tmp_path, check=True, diff=True, files=[
        {"path": str(tmp_path / "new"), "content": "new\n", "mode": "0644"},
        {"path": str(tmp_path / "old"), "content": "changed\n"},
        {"path": str(tmp_path / "gone"), "state": "absent"},
    ])
    assert result["changed"] is True
    assert result["changed_paths"] == [str(tmp_path / "new"), str(tmp_path / "old")]
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "old").read_text() == "old\n"
    assert result["diff"][0] == {"before_header": "/dev/null", "after_header": str(tmp_path / "new"),
                                 "before": "", "after": "new\n"}
    assert result["diff"][1]["before"] == "old\n"
    assert result["diff"][1]["after"] == "changed\n"


def test_check_mode_tolerates_an_owner_an_earlier_task_would_make(tmp_path):
    entry = {"path": str(tmp_path / "k"), "content": "k\n", "owner": "no-such-user-sd3"}
    result = run(tmp_path, check=True, files=[entry])
    assert result["changed"] is True
    assert not result.get("failed")
    assert "no-such-user-sd3" in json.dumps(result["warnings"])


def test_absent_files_are_removed_once(tmp_path):
    (tmp_path / "stale.timer").write_text("x\n")
    files = [{"path": str(tmp_path / "stale.timer"), "state": "absent"},
             {"path": str(tmp_path / "never"), "state": "absent"}]
    assert run(tmp_path, files=files)["changed_paths"] == [str(tmp_path / "stale.timer")]
    assert not (tmp_path / "stale.timer").exists()
    assert run(tmp_path, files=files)["changed"] is False


def test_a_symlink_is_replaced_by_a_file(tmp_path):
    (tmp_path / "target").write_text("target\n")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert run(tmp_path, files=[{"path": str(tmp_path / "link"), "content": "target\n"}])["changed"] is True
    assert not (tmp_path / "link").is_symlink()
    assert (tmp_path / "target").read_text() == "target\n"


@pytest.mark.parametrize(("entry", "message"), [
    ({"path": "relative/file", "content": "x"}, "give an absolute path"),
    ({"path": "{tmp}/a", "content": "x", "mode": "rw-r--r--"}, "is not an octal mode"),
    ({"path": "{tmp}/a", "content": "x", "mode": "17777"}, "out of range"),
    ({"path": "{tmp}/a"}, "state=present needs content"),
    ({"path": "{tmp}/no-folder/a", "content": "x"}, "does not exist; create it first"),
    ({"path": "{tmp}/a/b", "content": "x", "_file_at": "{tmp}/a"}, "/a is not a folder (a file is there)"),
    ({"path": "{tmp}", "content": "x"}, "is a folder"),
    ({"path": "{tmp}/a", "content": "x", "owner": "no-such-user-sd3"}, "owner 'no-such-user-sd3' does not exist"),
])
def test_bad_entries_fail_with_the_path_and_the_fix(tmp_path, entry, message):
    entry = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in entry.items()}
    file_at = entry.pop("_file_at", None)  # a file where the entry's folder should be
    if file_at:
        Path(file_at).write_text("in the way\n")
    result = run(tmp_path, files=[entry])
    assert result["failed"] is True
    assert message in result["msg"]
    assert not (tmp_path / "a").exists() or (tmp_path / "a").read_text() == "in the way\n"
