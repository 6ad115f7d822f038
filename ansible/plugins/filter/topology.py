"""Filters over the storage topology rules of ansible/plugins/module_utils/topology.py (one copy of the
replica-set rule for roles, playbooks, the gluster modules and preflight)."""
from __future__ import annotations

import runpy
from pathlib import Path

# Filters cannot import module_utils or each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
topology = _load("ansible/plugins/module_utils/topology.py")
_network = _load("ansible/plugins/filter/cluster_network.py")
cluster_address = _network.cluster_address
is_ip_address = _network.is_ip_address


def gluster_bricks(addresses, bricks_per_node, brick_root, volume):
    """Every brick of a volume as host:/path, in the order that keeps each replica set on different servers."""
    return topology.brick_order(list(addresses), bricks_per_node, brick_root, volume)


def gluster_brick_moves(volume_info_xml, pool_list_lines, remove_plan, hostvars, primary):
    """The bricks on remove_plan.nodes and where each goes (remove_plan.targets), read from
    `gluster volume info --xml` and `gluster pool list`; each move's problem says why it cannot move."""
    return topology.brick_moves(topology.parse_volumes_info(volume_info_xml), topology.pool_hosts(pool_list_lines),
                                list(remove_plan["nodes"]), lambda host: cluster_address(host, hostvars),
                                dict(remove_plan.get("targets") or {}), primary)


def glusterfs_layout_problems(host, layout):
    """The glusterfs role's layout problems seen from host; layout holds the role's variables without their
    glusterfs_ prefix (nodes, bricks_per_node, brick_devices, bricks_on_root_fs, brick_root, volumes, replica,
    auth_allow, rebalance_wait)."""
    return topology.glusterfs_layout_problems(host, is_ip_address=is_ip_address, **layout)


def day2_removal_plan(remove_nodes, targets, groups, hostvars):
    """remove_node.yml's plan (topology.removal_plan) with addresses by the cluster_address rule."""
    return topology.removal_plan(remove_nodes, targets, groups, lambda host: cluster_address(host, hostvars))


def day2_scale_out_plan(play_hosts, scale_out_nodes, groups, hostvars):
    """scale_out.yml's plan (topology.scale_out_plan) from each play host's __day2_was fact."""
    was = {host: (hostvars[host].get("__day2_was") if host in hostvars else None) for host in play_hosts}
    return topology.scale_out_plan(scale_out_nodes, groups, list(play_hosts), was)


def day2_removal_problems(plan, groups):
    """Why remove_node.yml cannot go on (topology.removal_problems); [] when it may."""
    return topology.removal_problems(plan, groups)


def day2_scale_out_problems(plan, groups, marker_path, backend="glusterfs", replica=3, bricks_per_node=1):
    """Why scale_out.yml cannot go on (topology.scale_out_problems); [] when it may."""
    return topology.scale_out_problems(plan, groups, marker_path, backend, replica, bricks_per_node)


class FilterModule:
    def filters(self):
        return {"gluster_bricks": gluster_bricks, "gluster_brick_moves": gluster_brick_moves,
                "glusterfs_layout_problems": glusterfs_layout_problems, "day2_removal_plan": day2_removal_plan,
                "day2_scale_out_plan": day2_scale_out_plan, "day2_removal_problems": day2_removal_problems,
                "day2_scale_out_problems": day2_scale_out_problems}
