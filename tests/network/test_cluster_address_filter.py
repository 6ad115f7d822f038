"""The cluster_address rule (ansible/plugins/filter/cluster_network.py) that every role and playbook uses for a
node's address, and its use from Jinja as the roles write it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import jinja2
import pytest

FILTER = Path(__file__).resolve().parents[2] / "ansible" / "plugins" / "filter" / "cluster_network.py"
spec = importlib.util.spec_from_file_location("cluster_network_filter", FILTER)
net = importlib.util.module_from_spec(spec)
spec.loader.exec_module(net)

HOSTVARS = {"a": {"cluster_address": "10.0.0.1", "ansible_host": "192.168.0.1"}, "b": {"ansible_host": "10.0.0.2"},
            "c": {"cluster_address": ""}, "d": {"cluster_address": None, "ansible_host": ""}}


def test_cluster_address_then_ansible_host_then_the_name():
    assert [net.cluster_address(h, HOSTVARS) for h in "abcd"] == ["10.0.0.1", "10.0.0.2", "c", "d"]


def test_a_given_default_replaces_the_name():
    assert [net.cluster_address(h, HOSTVARS, "") for h in "abcd"] == ["10.0.0.1", "10.0.0.2", "", ""]


def test_nodes_without_address_are_named_in_order():
    assert net.nodes_without_address(["d", "a", "c", "b"], HOSTVARS) == ["d", "c"]
    assert net.nodes_without_address([], HOSTVARS) == []


def test_an_unknown_host_is_an_error_not_a_guess():
    with pytest.raises(KeyError):
        net.cluster_address("zz", HOSTVARS)


@pytest.fixture()
def env():
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    environment.filters.update(net.FilterModule().filters())
    return environment


def test_the_forms_the_roles_write(env):
    assert env.from_string("{{ 'b' | cluster_address(hostvars) }}").render(hostvars=HOSTVARS) == "10.0.0.2"
    assert env.from_string("{{ hosts | map('cluster_address', hostvars) | list }}").render(
        hosts=["a", "b", "c"], hostvars=HOSTVARS) == "['10.0.0.1', '10.0.0.2', 'c']"
    assert env.from_string("{{ 'd' | cluster_address(hostvars, '') }}").render(hostvars=HOSTVARS) == ""
