"""The one loader of the repository's own Python (ansible/plugins/module_utils/source_tree.py), and the
plugins that use it: each shared file is loaded once, under one name, and no plugin carries a loader of its own."""
from __future__ import annotations

import importlib.util
import re
import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "ansible" / "plugins"
tree = runpy.run_path(str(PLUGINS / "module_utils" / "source_tree.py"))


def load_plugin(relative, name):
    """A plugin file as Ansible loads it: on its own, under a name of its own, outside any package."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_file_is_loaded_once_under_one_name():
    first = tree["load"]("ansible/plugins/module_utils/topology.py")
    again = tree["load"]("ansible/plugins/module_utils/topology.py")
    assert first is again
    assert first.__name__ == "sd3cluster_tree_ansible_plugins_module_utils_topology"
    assert sys.modules[first.__name__] is first
    assert first.whole_replica_sets(6, 3) and not first.whole_replica_sets(4, 3)


def test_the_plugins_share_one_copy_of_each_shared_file():
    apt_packages = load_plugin("ansible/plugins/action/apt_packages.py", "apt_packages_action_under_test")
    signed_repo = load_plugin("ansible/plugins/action/signed_apt_repository.py", "signed_repo_action_under_test")
    assert apt_packages.apt_rules is signed_repo.apt_rules
    topology_filter = load_plugin("ansible/plugins/filter/topology.py", "topology_filter_under_test_tree")
    preflight = load_plugin("ansible/plugins/filter/preflight.py", "preflight_filter_under_test_tree")
    assert preflight._topology() is topology_filter.topology
    # One exception class: an error raised by the rules is caught by every plugin's except clause.
    assert preflight._topology().GlusterError is topology_filter.topology.GlusterError
    assert preflight._firewall_rules().networks_problems(["10.0.0.0/8"], "cluster_admin_cidrs") == []


def test_a_file_with_dataclasses_loads():
    """hardware.py makes dataclasses, which look their module up in sys.modules while the class is made."""
    hardware_filter = load_plugin("ansible/plugins/filter/hardware_profiles.py", "hardware_filter_under_test_tree")
    assert hardware_filter.gpu_profile("NVIDIA H200") == "h200"


def test_a_file_that_fails_is_not_left_half_loaded(tmp_path, monkeypatch):
    broken = tmp_path / "broken_rules.py"
    broken.write_text("VALUE = 1\nraise RuntimeError('broken on purpose')\n")
    # The loader reads paths from the repository's root; a path that climbs out of it reaches the temporary file.
    relative = Path(*[".."] * len(REPO.parts[1:])) / broken.relative_to("/")
    with pytest.raises(RuntimeError, match="broken on purpose"):
        tree["load"](relative)
    assert tree["module_name"](relative) not in sys.modules
    broken.write_text("VALUE = 2\n")
    assert tree["load"](relative).VALUE == 2
    del sys.modules[tree["module_name"](relative)]


def test_no_plugin_carries_a_loader_of_its_own():
    """The loader is written once: every other plugin file reaches the tree through source_tree.load."""
    loaders = [str(path.relative_to(REPO)) for path in sorted(PLUGINS.rglob("*.py"))
               if path.name != "source_tree.py"
               and re.search(r"spec_from_file_location|module_from_spec|exec_module|sys\.path", path.read_text())]
    assert loaders == []
