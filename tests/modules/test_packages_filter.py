"""The packages_not_installed filter on what dpkg-query printed on a Debian 12 node."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

FILTER = Path(__file__).resolve().parents[2] / "ansible" / "plugins" / "filter" / "packages.py"
spec = importlib.util.spec_from_file_location("packages_filter", FILTER)
packages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(packages)

# `dpkg-query --show --showformat='${Package} ${db:Status-Abbrev}\n' chrony sudo nfs-common gone half`
# (nfs-common removed with its configuration left, half failed to configure; "gone" is unknown, so absent).
PROBE = "chrony ii \nsudo hi \nnfs-common rc \nhalf iF \n"


def test_installed_names_are_dropped_and_the_rest_kept_in_order():
    names = ["chrony", "gone", "sudo", "nfs-common", "half"]
    assert packages.packages_not_installed(names, PROBE) == ["gone", "nfs-common", "half"]


def test_everything_installed_leaves_nothing_for_apt():
    assert packages.packages_not_installed(["chrony", "sudo"], PROBE) == []


def test_a_stripped_trailing_space_still_reads_as_installed():
    assert packages.packages_not_installed(["chrony"], "chrony ii") == []


@pytest.mark.parametrize("name", ["chrony=4.3-2", "chrony*", "chrony:amd64", "./chrony.deb", "docker-ce=5:24.*"])
def test_names_only_apt_can_match_are_always_left_to_apt(name):
    assert packages.packages_not_installed([name], PROBE + f"{name} ii \n") == [name]


def test_no_probe_output_means_apt_looks_at_everything():
    assert packages.packages_not_installed(["chrony", "sudo"], "") == ["chrony", "sudo"]
    assert packages.packages_not_installed(["chrony"], None) == ["chrony"]


def test_the_probe_format_matches_dpkg_query_on_this_machine():
    # dpkg is on every machine this project runs on; the format is the one the roles pass.
    out = subprocess.run(["dpkg-query", "--show", "--showformat=${Package} ${db:Status-Abbrev}\\n", "dpkg"],
                         capture_output=True, text=True, check=True).stdout
    assert packages.packages_not_installed(["dpkg"], out) == []
