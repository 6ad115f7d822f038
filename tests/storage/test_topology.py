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


def volumes_xml(*volumes):
    """`gluster volume info --xml` of volumes given as (name, replica, arbiter, bricks), in the form of
    volume_info_replica2.xml (gluster 10.3)."""
    parts = []
    for name, replica, arbiter, bricks in volumes:
        items = "".join(f"<brick uuid='u'>{b}<name>{b}</name><isArbiter>0</isArbiter></brick>" for b in bricks)
        parts.append(f"<volume><name>{name}</name><statusStr>Started</statusStr><replicaCount>{replica}</replicaCount>"
                     f"<arbiterCount>{arbiter}</arbiterCount><bricks>{items}</bricks><options/></volume>")
    return (f"<cliOutput><opRet>0</opRet><opErrno>0</opErrno><opErrstr/><volInfo><volumes>{''.join(parts)}"
            f"<count>{len(parts)}</count></volumes></volInfo></cliOutput>")


NODES = {f"node{i}": {"cluster_address": f"10.213.0.3{i}"} for i in range(1, 6)}
SHARED = [f"10.213.0.3{i}:/data/glusterfs/brick1/shared" for i in (1, 2, 3)]
POOL = ["UUID\t\t\t\t\tHostname   \tState", "u2\t10.213.0.32\tConnected", "u3\t10.213.0.33\tConnected",
        "u4\t10.213.0.34\tConnected", "u1\tlocalhost  \tConnected"]


def moves(xml, nodes, targets=None, pool=POOL):
    plan = {"nodes": nodes, "targets": targets or {}}
    return topology_filter.gluster_brick_moves(xml, pool, plan, NODES, "node1")


def test_a_removed_storage_node_without_target_gets_the_message_of_the_e2e_check():
    [move] = moves(volumes_xml(("shared", 3, 0, SHARED)), ["node3"])
    assert move["old"] == SHARED[2] and move["new"] == "" and move["volume"] == "shared"
    assert move["problem"].startswith(f"node3 holds brick {SHARED[2]} of volume shared (replica 3): name a node")
    assert "day2_remove_node_brick_targets" in move["problem"] and "\"node3\": \"NEWNODE\"" in move["problem"]
    assert "gluster volume remove-brick shared BRICKS start" in move["problem"]


def test_a_target_in_the_pool_outside_the_set_takes_the_brick_on_the_same_path():
    [move] = moves(volumes_xml(("shared", 3, 0, SHARED)), ["node3"], {"node3": "node4"})
    assert move == {"volume": "shared", "node": "node3", "old": SHARED[2], "target": "node4", "problem": "",
                    "new": "10.213.0.34:/data/glusterfs/brick1/shared"}


def test_a_target_outside_the_pool_is_named_with_the_probe_to_run():
    [move] = moves(volumes_xml(("shared", 3, 0, SHARED)), ["node3"], {"node3": "node5"})
    assert move["problem"] == ("the brick target node5 (10.213.0.35) of node3 is not in the trusted pool (gluster pool "
                               "list on node1): run the glusterfs role on it and `gluster peer probe 10.213.0.35`")


def test_a_target_already_in_the_replica_set_would_put_two_copies_on_one_server():
    [move] = moves(volumes_xml(("shared", 3, 0, SHARED)), ["node3"], {"node3": "node2"})
    assert move["problem"] == (f"the brick target node2 already holds a brick of the replica set of {SHARED[2]} "
                               "(volume shared): pick a node without one, so the set keeps 3 copies on different "
                               "servers")


def test_a_node_without_bricks_moves_nothing_and_sets_are_read_per_volume():
    six = [f"10.213.0.3{i}:/b/brick1/big" for i in (1, 2, 3)] + [f"10.213.0.3{i}:/b/brick2/big" for i in (1, 2, 4)]
    xml = volumes_xml(("shared", 3, 0, SHARED), ("big", 3, 1, six))
    assert moves(xml, ["node5"]) == []
    # node4's brick is in big's second set (node1, node2, node4): node3 may take it, node2 may not.
    [ok] = moves(xml, ["node4"], {"node4": "node3"})
    assert ok["volume"] == "big" and ok["problem"] == "" and ok["new"] == "10.213.0.33:/b/brick2/big"
    [bad] = moves(xml, ["node4"], {"node4": "node2"})
    assert "already holds a brick of the replica set" in bad["problem"]


def test_no_volumes_means_no_moves():
    empty = ("<cliOutput><opRet>-1</opRet><opErrno>0</opErrno><opErrstr>No volumes present</opErrstr>"
             "</cliOutput>")
    assert moves(empty, ["node3"]) == []
    assert moves(volumes_xml(), ["node3"]) == []


def layout(**overrides):
    values = {"nodes": ["s1", "s2", "s3"], "bricks_per_node": "1", "brick_devices": [], "bricks_on_root_fs": "true",
              "brick_root": "/data/glusterfs", "volumes": [{"name": "shared", "replica": "3"}], "replica": "3",
              "auth_allow": ["10.0.0.1", "10.0.0.2"]}
    values.update(overrides)
    return topology_filter.glusterfs_layout_problems("s1", values)


def test_a_good_layout_has_no_problem():
    assert layout() == []
    assert layout(bricks_per_node=2, brick_devices=["/dev/vdb", "/dev/vdc"], bricks_on_root_fs=False) == []


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"nodes": []}, "glusterfs_nodes is empty (default: the storage_nodes group): put the storage servers in "
                    "storage_nodes"),
    ({"nodes": ["s2", "s3", "s4"]}, "s1 runs the glusterfs role but is not in glusterfs_nodes: run it on "
                                    "storage_nodes only"),
    ({"bricks_per_node": "0"}, "glusterfs_bricks_per_node (cluster_storage_bricks_per_node) is 0: use 1 or more"),
    ({"rebalance_wait": -5}, "glusterfs_rebalance_wait is -5: give the seconds to wait for a rebalance, 0 (do not "
                             "wait) or more"),
    ({"brick_devices": ["/dev/vdb"], "bricks_per_node": 2},
     "glusterfs_brick_devices lists 1 device(s) on s1 but glusterfs_bricks_per_node is 2: list one device per brick, "
     "or none for directories"),
    ({"bricks_on_root_fs": False},
     "no glusterfs_brick_devices on s1 and glusterfs_bricks_on_root_fs is false: list the brick disks in "
     "glusterfs_brick_devices, or set glusterfs_bricks_on_root_fs: true when /data/glusterfs is a mounted data disk"),
    ({"volumes": [{"name": "a b"}]}, "glusterfs_volumes entry 1 has name 'a b': use letters, digits, - and _"),
    ({"volumes": [{"name": "v"}, {"name": "v"}]}, "glusterfs_volumes: volume 'v' is declared twice: keep one entry"),
    ({"volumes": [{"name": "v", "replica": 0}]}, "volume v: replica is 0: use 1 or more (3 is the safe default)"),
    ({"replica": "4", "volumes": [{"name": "v"}]},
     "volume v: replica 4 but only 3 storage node(s): add storage nodes or lower cluster_storage_replica "
     "(glusterfs_replica, or the volume's replica)"),
    ({"nodes": ["s1", "s2", "s3", "s4"]},
     "volume shared: 4 bricks (4 storage nodes x 1) is not a multiple of replica 3: add storage nodes in groups of 3 "
     "or change cluster_storage_bricks_per_node"),
    ({"volumes": [{"name": "v", "replica": 2, "arbiter": 1}]},
     "volume v: arbiter 1 with replica 2: an arbiter is 0 or 1, and 1 needs replica 3"),
    ({"volumes": [{"name": "v", "state": "gone"}]},
     "volume v: state 'gone': use started, present, stopped or absent"),
    ({"auth_allow": ["10.0.0.1", "node2"]},
     "glusterfs_auth_allow holds 'node2', not an IP address: set cluster_address (or ansible_host) of every node to "
     "its address"),
])
def test_each_layout_problem_names_the_variable_and_the_fix(overrides, problem):
    assert problem in layout(**overrides)


# The local cluster after scale-out 3 -> 4 (localcluster layout(4)): node1 head, node2-4 train, node1-3 storage.
GROUPS4 = {"all": ["node1", "node2", "node3", "node4"], "head": ["node1"], "gpu_nodes": ["node2", "node3", "node4"],
           "storage_nodes": ["node1", "node2", "node3"]}


def removal(nodes, targets=None):
    return topology_filter.FilterModule().filters()["day2_removal_plan"](nodes, targets or {}, GROUPS4, NODES)


def test_removing_a_gpu_node_keeps_storage_as_it_is():
    plan = removal("node4")
    assert plan["nodes"] == ["node4"] and plan["unknown"] == [] and plan["removed_storage"] == []
    assert plan["keep"] == ["node1", "node2", "node3"]
    assert plan["keep_addresses"] == ["10.213.0.31", "10.213.0.32", "10.213.0.33"]
    assert plan["gpu_nodes"] == ["node2", "node3"] and plan["removed_gpu_nodes"] == ["node4"]
    assert plan["storage_nodes"] == ["node1", "node2", "node3"]


def test_a_brick_target_takes_the_removed_storage_node_s_place_in_order():
    plan = removal(" node3 , ", {"node3": "node4"})
    assert plan["nodes"] == ["node3"] and plan["removed_storage"] == ["node3"]
    assert plan["storage_nodes"] == ["node1", "node2", "node4"]
    assert plan["storage_addresses"] == ["10.213.0.31", "10.213.0.32", "10.213.0.34"]
    assert plan["targets"] == {"node3": "node4"}


def test_a_removed_storage_node_without_target_leaves_storage_and_unknown_names_are_listed():
    plan = removal(["node3", "node9"])
    assert plan["storage_nodes"] == ["node1", "node2"] and plan["unknown"] == ["node9"]
    assert removal("")["nodes"] == [] and removal([])["nodes"] == []


GROUPS3 = {"all": ["node1", "node2", "node3"], "head": ["node1"], "gpu_nodes": ["node2", "node3"],
           "storage_nodes": ["node1", "node2", "node3"]}
WAS3 = {"node1": ["head", "storage_nodes"], "node2": ["gpu_nodes", "storage_nodes"],
        "node3": ["gpu_nodes", "storage_nodes"]}


def scale_out(scale_out_nodes, groups, was):
    hostvars = {host: ({"__day2_was": groups_was} if groups_was is not None else {})
                for host, groups_was in was.items()}
    return topology_filter.day2_scale_out_plan(groups["all"], scale_out_nodes, groups, hostvars)


def test_scale_out_3_to_4_finds_the_unmarked_gpu_node_and_no_new_storage():
    plan = scale_out([], GROUPS4, {**WAS3, "node4": None})
    assert plan == {"named": [], "unknown": [], "marked": ["node1", "node2", "node3"], "new": ["node4"],
                    "new_storage": [], "slurm_changes": True,
                    "layer_hosts": {"day2_new": ["node4"], "day2_mount": ["node4"],
                                    "day2_slurm": ["node1", "node2", "node3", "node4"],
                                    "day2_monitoring": ["node1", "node4"]}}


def test_named_nodes_are_new_and_unknown_names_are_listed():
    plan = scale_out("node4, node9", GROUPS4, {**WAS3, "node4": None})
    assert plan["named"] == ["node4", "node9"] and plan["unknown"] == ["node9"] and plan["new"] == ["node4"]


def test_a_marked_node_that_became_a_storage_node_is_new_storage_but_not_new():
    groups = {**GROUPS4, "storage_nodes": ["node1", "node2", "node3", "node4"], "gpu_nodes": ["node2", "node3"]}
    plan = scale_out([], groups, {**WAS3, "node4": ["gpu_nodes"]})
    assert plan["new"] == [] and plan["new_storage"] == ["node4"] and plan["slurm_changes"] is False
    # The volfile servers change in every fstab line; Slurm's node list does not; the new storage node gets its
    # GlusterFS collector and the head Prometheus's targets.
    assert plan["layer_hosts"] == {"day2_new": [], "day2_mount": ["node1", "node2", "node3", "node4"],
                                   "day2_slurm": [], "day2_monitoring": ["node1", "node4"]}


def test_a_new_storage_only_node_mounts_everywhere_and_leaves_slurm_alone():
    groups = {**GROUPS4, "storage_nodes": ["node1", "node2", "node3", "node4"], "gpu_nodes": ["node2", "node3"]}
    plan = scale_out([], groups, {**WAS3, "node4": None})
    assert plan["new"] == ["node4"] and plan["new_storage"] == ["node4"] and plan["slurm_changes"] is False
    assert plan["layer_hosts"]["day2_slurm"] == [] and plan["layer_hosts"]["day2_new"] == ["node4"]
    assert plan["layer_hosts"]["day2_mount"] == ["node1", "node2", "node3", "node4"]
    assert plan["layer_hosts"]["day2_monitoring"] == ["node1", "node4"]


# ------------------------------------------------------------------ the day-2 plans' stops (before any change)

MARKER = "/etc/sd3-cluster/converged.json"


def removal_problems(nodes, targets=None):
    return topology_filter.day2_removal_problems(removal(nodes, targets), GROUPS4)


def test_a_removal_the_cluster_survives_has_no_problem():
    assert removal_problems("node4") == []
    assert removal_problems("node3", {"node3": "node4"}) == []


@pytest.mark.parametrize("nodes, targets, said, not_said", [
    ("", None, "day2_remove_nodes is empty: name the nodes to remove", "not in the inventory"),
    ("node4,node9", None, "day2_remove_nodes names node9, not in the inventory", "is empty"),
    ("node1", None, "day2_remove_nodes (node1) would take away the head (node1, which runs slurmctld", "brick_targets"),
    ("node2,node3,node4", {"node2": "node1"}, "would take away the head (node1, which runs slurmctld and Prometheus) "
     "or every gpu node", "brick_targets"),
    ("node3", {"node3": "node2"}, "day2_remove_node_brick_targets ({'node3': 'node2'}) must map each removed storage "
     "node (node3) to a node that stays in the inventory and is not a storage node yet", "head"),
    ("node3", {"node3": "node3"}, "must map each removed storage node (node3)", "head"),
    ("node4", {"node2": "node4"}, "must map each removed storage node (none)", "head"),
])
def test_each_removal_stop_says_only_its_own_problem(nodes, targets, said, not_said):
    problems = removal_problems(nodes, targets)
    assert len(problems) == 1 and said in problems[0] and not_said not in problems[0], problems
    assert problems[0].endswith("Nothing was changed.")


def scale_out_problems(names, groups, was, **storage):
    plan = scale_out(names, groups, was)
    return topology_filter.day2_scale_out_problems(plan, groups, MARKER, **storage)


def test_a_scale_out_that_can_join_has_no_problem():
    assert scale_out_problems([], GROUPS4, {**WAS3, "node4": None}) == []


def test_scale_out_stops_in_order_naming_the_first_thing_that_is_wrong():
    no_marker = scale_out_problems([], GROUPS4, dict.fromkeys(GROUPS4["all"]))
    assert len(no_marker) == 1 and no_marker[0].startswith(f"No node carries the marker {MARKER}"), no_marker
    nothing = scale_out_problems([], GROUPS3, WAS3)
    assert nothing == [f"Nothing to scale out: every node of the inventory (node1, node2, node3) carries the marker "
                       f"{MARKER} with its current groups. Add the new hosts to the inventory and its groups, or name "
                       "them with -e day2_scale_out_nodes=NODE,NODE. Nothing was changed."]
    unknown = scale_out_problems("node9", GROUPS4, {**WAS3, "node4": None})
    assert len(unknown) == 1 and unknown[0].startswith("day2_scale_out_nodes names node9, not in the inventory")
    new_head = scale_out_problems([], GROUPS4, {**WAS3, "node1": None, "node4": None})
    assert len(new_head) == 1 and new_head[0].startswith(f"node1 in the head group is new (no marker {MARKER})")


GROUPS5 = {"all": ["node1", "node2", "node3", "node4", "node5"], "head": ["node1"],
           "gpu_nodes": ["node2", "node3", "node4", "node5"], "storage_nodes": ["node1", "node2", "node3", "node4"]}


def test_new_storage_nodes_must_make_whole_replica_sets():
    was = {**WAS3, "node4": None, "node5": None}
    problems = scale_out_problems([], GROUPS5, was)
    assert problems == ["The new storage nodes node4 give 1 new brick(s) per volume, which must be whole replica sets "
                        "of 3 (cluster_storage_replica). Add storage nodes in groups of 3, or leave them out of "
                        "storage_nodes for now (as gpu_nodes only). Nothing was changed."]
    # Values as -e gives them (text) are read as the playbook reads them.
    assert scale_out_problems([], GROUPS5, was, replica="1") == []
    assert "2 new brick(s)" in scale_out_problems([], GROUPS5, was, replica="3", bricks_per_node="2")[0]
    # Only GlusterFS has bricks: an NFS cluster takes any storage node.
    assert scale_out_problems([], GROUPS5, was, backend="nfs") == []


def test_new_storage_nodes_must_come_last_and_both_storage_stops_are_said():
    groups = {**GROUPS5, "storage_nodes": ["node4", "node1", "node2", "node3"]}
    was = {**WAS3, "node4": None, "node5": None}
    last = scale_out_problems([], groups, was, replica=1)
    assert len(last) == 1 and last[0].startswith("The new storage nodes node4 must come last in the storage_nodes")
    both = scale_out_problems([], groups, was)
    assert len(both) == 2 and "whole replica sets of 3" in both[0] and "must come last" in both[1]
