"""os_vars_files: a role's OS vars files fall back distribution-version -> distribution -> family -> main."""

import itertools
import re
import runpy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_load = runpy.run_path(str(ROOT / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
os_vars = _load("ansible/plugins/filter/os_vars.py")


@pytest.mark.parametrize(("facts", "expected"), [
    ({"distribution": "Ubuntu", "distribution_major_version": "24", "os_family": "Debian"},
     ["Ubuntu-24.yml", "Ubuntu.yml", "Debian.yml", "main.yml"]),
    # Debian is its own family: its name comes once.
    ({"distribution": "Debian", "distribution_major_version": "12", "os_family": "Debian"},
     ["Debian-12.yml", "Debian.yml", "main.yml"]),
    ({"distribution": "Rocky", "distribution_major_version": "9", "os_family": "RedHat"},
     ["Rocky-9.yml", "Rocky.yml", "RedHat.yml", "main.yml"]),
    ({}, ["main.yml"]),
    (None, ["main.yml"]),
])
def test_most_specific_first(facts, expected):
    assert os_vars.os_vars_files(facts) == expected


def _first_found(role_vars, facts):
    for name in os_vars.os_vars_files(facts):
        if (role_vars / name).is_file():
            return name
    return None


ROLES = sorted(p for p in (ROOT / "roles").iterdir() if (p / "vars").is_dir())
SYSTEMS = [("Ubuntu", "22"), ("Ubuntu", "24"), ("Debian", "12")]


def _data(path):
    # The values, not the text: copies that differ only in their comments are still copies.
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_no_role_ships_identical_os_files(role):
    """A file that repeats the next one down the fallback adds nothing but a copy to keep in step."""
    for distribution, major in SYSTEMS:
        names = os_vars.os_vars_files({"distribution": distribution, "distribution_major_version": major,
                                       "os_family": "Debian"})
        present = [n for n in names if (role / "vars" / n).is_file()]
        for upper, lower in itertools.pairwise(present):
            assert _data(role / "vars" / upper) != _data(role / "vars" / lower), (
                f"{role.name}: vars/{upper} repeats vars/{lower}")
    # Release files that all say the same belong in the distribution's (or the family's) file.
    releases = [role / "vars" / f"Ubuntu-{m}.yml" for m in ("22", "24")]
    if all(f.is_file() for f in releases):
        assert _data(releases[0]) != _data(releases[1]), f"{role.name}: every Ubuntu release file is the same"


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_every_supported_system_finds_a_file(role):
    for distribution, major in SYSTEMS:
        facts = {"distribution": distribution, "distribution_major_version": major, "os_family": "Debian"}
        assert _first_found(role / "vars", facts) is not None, f"{role.name}: no vars file for {distribution} {major}"


def test_no_task_names_an_os_vars_file_itself():
    """A vars_from built from the distribution facts skips the fallback, and breaks once that file is folded."""
    offenders = [f"{path.relative_to(ROOT)}: {line.strip()}"
                 for path in sorted((ROOT / "roles").glob("*/tasks/*.yml"))
                 for line in re.findall(r"^\s*vars_from:.*$", path.read_text(), flags=re.MULTILINE)
                 if "distribution" in line or "ansible_facts" in line]
    assert not offenders, offenders
