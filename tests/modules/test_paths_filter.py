"""path_kind_problem: "does not exist" only when nothing is there; otherwise what is there instead."""

import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_load = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
paths = _load("ansible/plugins/filter/paths.py")

ABSENT = {"exists": False}
FOLDER = {"exists": True, "isdir": True, "isreg": False, "executable": True}
FILE = {"exists": True, "isdir": False, "isreg": True, "executable": False}
COMMAND = {"exists": True, "isdir": False, "isreg": True, "executable": True}


@pytest.mark.parametrize(("stat", "kind", "expected"), [
    (ABSENT, "executable", "/opt/x does not exist"),
    (FOLDER, "executable", "/opt/x is a folder, not an executable file"),
    (FILE, "executable", "/opt/x is a file that is not executable, not an executable file"),
    (FILE, "dir", "/opt/x is a file that is not executable, not a folder"),
    (COMMAND, "dir", "/opt/x is an executable file, not a folder"),
    (FOLDER, "file", "/opt/x is a folder, not a file"),
    (None, "file", "/opt/x does not exist"),
])
def test_wrong_kind_is_said_as_such(stat, kind, expected):
    assert paths.path_kind_problem(stat, "/opt/x", kind) == expected


@pytest.mark.parametrize(("stat", "kind"), [(COMMAND, "executable"), (FILE, "file"), (FOLDER, "dir")])
def test_right_kind_is_no_problem(stat, kind):
    assert paths.path_kind_problem(stat, "/opt/x", kind) == ""


def test_unknown_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="kind must be one of"):
        paths.path_kind_problem(FILE, "/opt/x", "socket")
