"""The storage topology rules (ansible/plugins/module_utils/topology.py) and their filter: brick order,
replica sets, whole-set counts, and the XML reader shared with the gluster_volume module."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


topology = load("ansible/plugins/module_utils/topology.py", "topology_under_test")
topology_filter = load("ansible/plugins/filter/topology.py", "topology_filter_under_test")


def test_brick_order_lists_brick_one_of_every_node_before_brick_two():
    bricks = topology.brick_order(["10.0.0.1", "10.0.0.2", "10.0.0.3"], 2, "/data/glusterfs", "shared")
    assert bricks == [
        "10.0.0.1:/data/glusterfs/brick1/shared", "10.0.0.2:/data/glusterfs/brick1/shared",
        "10.0.0.3:/data/glusterfs/brick1/shared", "10.0.0.1:/data/glusterfs/brick2/shared",
        "10.0.0.2:/data/glusterfs/brick2/shared", "10.0.0.3:/data/glusterfs/brick2/shared"]
    assert topology.sets_sharing_a_server(bricks, 3) == []


def test_the_filter_gives_the_same_order_as_the_rule():
    assert topology_filter.FilterModule().filters()["gluster_bricks"](["a", "b"], "1", "/b", "v") == ["a:/b/brick1/v",
                                                                                                      "b:/b/brick1/v"]


def test_node_by_node_order_puts_two_copies_on_one_server_and_names_the_set():
    bricks = ["a:/b1/v", "a:/b2/v", "b:/b1/v", "b:/b2/v"]
    assert topology.sets_sharing_a_server(bricks, 2) == [(1, ["a:/b1/v", "a:/b2/v"]), (2, ["b:/b1/v", "b:/b2/v"])]
    assert topology.sets_sharing_a_server(bricks, 1) == []


def test_replica_sets_are_consecutive_bricks_with_a_short_last_set_when_not_whole():
    assert topology.replica_sets(["1", "2", "3", "4", "5"], 2) == [["1", "2"], ["3", "4"], ["5"]]
    assert topology.sets_sharing_a_server(["a:/x", "b:/x", "a:/y"], 2) == []  # the short set is not a set yet


@pytest.mark.parametrize(("bricks", "replica", "whole"), [(6, 3, True), (4, 3, False), (0, 3, True), (3, 0, False)])
def test_whole_replica_sets(bricks, replica, whole):
    assert topology.whole_replica_sets(bricks, replica) is whole


@pytest.mark.parametrize(("nodes", "replica", "storage"), [(1, 1, 1), (2, 2, 2), (3, 3, 3), (4, 3, 3), (7, 3, 6)])
def test_storage_node_count_is_the_largest_multiple_of_the_replica(nodes, replica, storage):
    assert topology.storage_node_count(nodes, replica) == storage


def test_volume_info_xml_is_read_once_for_module_and_rules():
    info = topology.parse_volume_info((DATA / "volume_info_replica2.xml").read_text())
    assert info["replica"] == 2 and len(info["bricks"]) == 2
    assert topology.parse_volume_info((DATA / "volume_info_missing.xml").read_text()) is None
    with pytest.raises(topology.GlusterError, match="no readable XML"):
        topology.parse_volume_info("not xml")
