"""module_utils/values.py: the filters read a value as the playbooks read it (Jinja's int, Ansible's bool, a
count that may come as text from -e), and every filter that checks inputs shares this one copy."""
from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
load = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
values = load("ansible/plugins/module_utils/values.py")


@pytest.mark.parametrize("given, expected", [(None, ""), ("", ""), ("a", "a"), (3, "3"), (False, "False")])
def test_text_is_empty_for_none_and_str_otherwise(given, expected):
    assert values.text(given) == expected


@pytest.mark.parametrize("given, expected", [(7, 7), ("7", 7), ("7.9", 7), (7.9, 7), ("x", 0), (None, 0), ("", 0)])
def test_jinja_int_reads_as_jinja_does(given, expected):
    assert values.jinja_int(given) == expected


@pytest.mark.parametrize("given, expected", [(3, 3.0), ("2.5", 2.5), (" 4 ", 4.0)])
def test_number_reads_numbers_and_numeric_text(given, expected):
    assert values.number(given) == expected


@pytest.mark.parametrize("given", [None, "", "fast", float("nan"), [1]])
def test_number_is_nan_for_anything_else(given):
    assert math.isnan(values.number(given))  # every comparison with NaN fails, so a threshold check fails


@pytest.mark.parametrize("given, expected", [(True, True), (False, False), ("yes", True), ("On", True),
                                             (" true ", True), ("1", True), (1, True), ("t", True), ("no", False),
                                             (2, False), ("", False), (None, False), ("maybe", False)])
def test_ansible_bool_reads_as_ansible_does(given, expected):
    assert values.ansible_bool(given) is expected


@pytest.mark.parametrize("given, expected", [(5, 5), (-5, -5), ("5", 5), (" 12 ", 12), ("-3", -3), (True, None),
                                             ("5.0", None), (5.0, None), ("five", None), (None, None), ("", None)])
def test_whole_number_takes_ints_and_digits_only(given, expected):
    assert values.whole_number(given) == expected


def test_every_input_filter_uses_the_shared_readers():
    for name in ("backup", "gpu_stack", "firewall", "preflight"):
        text = (REPO / "ansible" / "plugins" / "filter" / f"{name}.py").read_text()
        assert 'values = _load("ansible/plugins/module_utils/values.py")' in text, name
        for reader in ("def _int(", "def _text(", "def _truthy("):
            assert reader not in text, f"{name}.py defines {reader} again: use module_utils/values.py"
