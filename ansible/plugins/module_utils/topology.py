"""The storage topology of a cluster in one place: which bricks form a replica set, the order bricks are
listed in, and whether a number of storage nodes holds whole replica sets. Pure Python (no Ansible), so the
gluster modules, the filters, preflight, the local cluster and the cloud inventory all share one rule.

Gluster forms replica sets from consecutive bricks of the list given to `volume create`/`add-brick`: bricks
1..R are set 1, R+1..2R set 2, and so on. Listing brick i of every node before brick i+1 keeps the copies of
one set on different servers as long as the node count is a multiple of R (or at least R with one brick each).
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

# opErrno of `gluster volume info NAME --xml` for a volume that does not exist (gluster 10).
MISSING_VOLUME_ERRNO = "30806"


class GlusterError(Exception):
    """The gluster CLI failed or answered something we cannot read."""


def brick_host(brick):
    """The server part of a `host:/path` brick."""
    return str(brick).partition(":")[0]


def brick_order(addresses, bricks_per_node, brick_root, volume):
    """Every brick of `volume` as host:/path: brick 1 of every node, then brick 2, ... so that consecutive
    replica sets span different servers."""
    return [f"{address}:{brick_root}/brick{index}/{volume}"
            for index in range(1, int(bricks_per_node) + 1) for address in addresses]


def replica_sets(bricks, replica):
    """The bricks cut into consecutive replica sets of `replica` (a short last set when the count does not
    divide; whole_replica_sets says whether it does)."""
    replica = max(int(replica), 1)
    return [list(bricks[start:start + replica]) for start in range(0, len(bricks), replica)]


def whole_replica_sets(brick_count, replica):
    """True when brick_count bricks make only whole replica sets."""
    return int(replica) >= 1 and int(brick_count) % int(replica) == 0


def sets_sharing_a_server(bricks, replica):
    """(1-based set number, bricks) of each whole replica set with two bricks on one server."""
    if int(replica) <= 1:
        return []
    return [(number, members) for number, members in enumerate(replica_sets(bricks, replica), start=1)
            if len(members) == int(replica) and len({brick_host(b) for b in members}) != len(members)]


def storage_node_count(node_count, replica):
    """The most nodes (of node_count, one brick each) that hold whole replica sets of `replica`."""
    replica = max(int(replica), 1)
    return replica * (int(node_count) // replica)


def _volume(volume):
    bricks = []
    for brick in volume.findall("bricks/brick"):
        name = brick.findtext("name") or (brick.text or "")
        bricks.append({"name": name.strip(), "arbiter": brick.findtext("isArbiter", "0").strip() == "1"})
    return {
        "name": volume.findtext("name", "").strip(),
        "id": volume.findtext("id", "").strip(),
        "status": volume.findtext("statusStr", "").strip(),
        "type": volume.findtext("typeStr", "").strip(),
        "replica": int(volume.findtext("replicaCount", "1")),
        "arbiter": int(volume.findtext("arbiterCount", "0")),
        "distribute": int(volume.findtext("distCount", "1")),
        "bricks": [b["name"] for b in bricks],
        "options": {o.findtext("name", "").strip(): o.findtext("value", "").strip()
                    for o in volume.findall("options/option")},
    }


def _volumes_root(text):
    """The <cliOutput> root, or None when gluster said the volume does not exist."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise GlusterError(f"gluster printed no readable XML ({err}): {text[:300]!r}") from err
    if root.findtext("opRet", "0").strip() != "0":
        errstr = root.findtext("opErrstr", "").strip()
        if (root.findtext("opErrno", "").strip() == MISSING_VOLUME_ERRNO or "does not exist" in errstr
                or "No volumes present" in errstr):
            return None
        raise GlusterError(errstr or "gluster volume info failed")
    return root


def parse_volume_info(text):
    """The one volume of `gluster volume info NAME --xml` as a dict, or None when it does not exist."""
    root = _volumes_root(text)
    volume = None if root is None else root.find("volInfo/volumes/volume")
    return None if volume is None else _volume(volume)


def parse_volumes_info(text):
    """Every volume of `gluster volume info --xml` (no name), in gluster's order."""
    root = _volumes_root(text)
    return [] if root is None else [_volume(v) for v in root.findall("volInfo/volumes/volume")]


def _rebalance_counts(element):
    return {"status": element.findtext("statusStr", "").strip(), "files": _as_int(element.findtext("files")),
            "skipped": _as_int(element.findtext("skipped")), "failures": _as_int(element.findtext("failures"))}


def parse_rebalance_status(text):
    """`gluster volume rebalance NAME status --xml`: {"nodes": [{"name", "status", "files", "skipped",
    "failures"}, ...], "total": {"status", "files", "skipped", "failures"}} (total: gluster's aggregate)."""
    root = _volumes_root(text)
    if root is None:
        raise GlusterError("the volume does not exist")
    rebalance = root.find("volRebalance")
    if rebalance is None:
        raise GlusterError(f"gluster printed no rebalance status: {text[:300]!r}")
    nodes = [{"name": node.findtext("nodeName", "").strip(), **_rebalance_counts(node)}
             for node in rebalance.findall("node")]
    aggregate = rebalance.find("aggregate")
    if aggregate is not None:
        total = _rebalance_counts(aggregate)
    else:
        total = {key: sum(node[key] for node in nodes) for key in ("files", "skipped", "failures")}
        total["status"] = ""
    return {"nodes": nodes, "total": total}


def parse_brick_status(text):
    """The bricks of `gluster volume status NAME --xml`: [{"brick": "host:/path", "online": bool}, ...]. The
    daemons it lists as well (self-heal, NFS: their path is "localhost", not a directory) are left out."""
    root = _volumes_root(text)
    if root is None:
        raise GlusterError("the volume does not exist")
    return [{"brick": f"{node.findtext('hostname', '').strip()}:{node.findtext('path', '').strip()}",
             "online": node.findtext("status", "").strip() == "1"}
            for node in root.findall("volStatus/volumes/volume/node")
            if node.findtext("path", "").strip().startswith("/")]


def offline_bricks(wanted, brick_status):
    """The bricks of `wanted` that brick_status (parse_brick_status) does not show online, in wanted's order."""
    online = {entry["brick"] for entry in brick_status if entry["online"]}
    return [brick for brick in wanted if brick not in online]


def rebalance_running(status):
    """Whether any node's rebalance has still to start or finish ("not started" right after `start`)."""
    return any(node["status"] == "not started" or "in progress" in node["status"] for node in status["nodes"])


def rebalance_problem(status):
    """What went wrong with a rebalance, naming the nodes, or "" when nothing did (so far)."""
    problems = [f"{node['name']} {node['status']}" for node in status["nodes"]
                if "failed" in node["status"] or node["status"] == "stopped"]
    failures = [f"{node['name']} {node['failures']}" for node in status["nodes"] if node["failures"]]
    if failures:
        problems.append("files it failed to move: " + ", ".join(failures))
    return "; ".join(problems)


def nodes_that_failed_at_start(status):
    """The nodes whose rebalance failed before it moved, skipped or failed a single file, when that is all that
    went wrong (else []): such a node's rebalance could not start (its process found a brick it could not
    reach), which a second start can mend, unlike files that failed to move or a rebalance stopped by hand."""
    failed_at_start = [node["name"] for node in status["nodes"]
                       if "failed" in node["status"] and not (node["files"] or node["skipped"] or node["failures"])]
    other_problems = [node for node in status["nodes"] if node["name"] not in failed_at_start
                      and ("failed" in node["status"] or node["status"] == "stopped" or node["failures"])]
    return [] if other_problems else failed_at_start


def rebalance_summary(volume, status, waited_s):
    """One line for the play's output: the state, the counts and, while it runs, how to follow it."""
    total = status["total"]
    state = "still running" if rebalance_running(status) else "finished"
    line = (f"volume {volume}: rebalance {state} after {waited_s:.0f} s of waiting; {total['files']} files moved, "
            f"{total['skipped']} skipped, {total['failures']} failed")
    if rebalance_running(status):
        line += f"; follow it with `gluster volume rebalance {volume} status`"
    return line


def pool_hosts(pool_list_lines):
    """The Hostname column of `gluster pool list` (UUID, Hostname, State; the node itself is localhost)."""
    return [line.split()[1] for line in list(pool_list_lines)[1:] if len(line.split()) > 1]


def brick_moves(volumes, pool, nodes, address_of, targets, primary):
    """One move per brick that lies on a node to remove: volume, node, old, new, target, problem (empty when
    it can move). volumes: parse_volumes_info's list; pool: pool_hosts; address_of: host -> cluster address;
    targets: node -> the node that takes its bricks; primary: the node the gluster commands run on."""
    moves = []
    for node in nodes:
        address = address_of(node)
        for volume in volumes:
            name, bricks, replica = volume["name"], volume["bricks"], max(volume["replica"], 1)
            for position, brick in enumerate(bricks):
                if brick_host(brick) not in (address, node):
                    continue
                path = brick.split(":", 1)[1]
                target = targets.get(node) or ""
                target_address = address_of(target) if target else ""
                first = (position // replica) * replica
                set_hosts = [brick_host(b) for b in bricks[first:first + replica]]
                problem = ""
                if not target:
                    problem = (
                        f"{node} holds brick {brick} of volume {name} (replica {replica}): name a node to take it, "
                        f"-e '{{\"day2_remove_node_brick_targets\": {{\"{node}\": \"NEWNODE\"}}}}', a host of the "
                        "inventory outside storage_nodes that is in the trusted pool (run the glusterfs role on it "
                        f"and `gluster peer probe ADDRESS` from {primary}); or, when whole replica sets leave "
                        f"together, shrink the volume first on {primary}: `gluster volume remove-brick {name} BRICKS "
                        "start`, wait for `... status` to say completed, then `... commit`")
                elif target_address not in pool and target not in pool:
                    problem = (f"the brick target {target} ({target_address}) of {node} is not in the trusted pool "
                               f"(gluster pool list on {primary}): run the glusterfs role on it and "
                               f"`gluster peer probe {target_address}`")
                elif target_address in set_hosts:
                    problem = (f"the brick target {target} already holds a brick of the replica set of {brick} "
                               f"(volume {name}): pick a node without one, so the set keeps {replica} copies on "
                               "different servers")
                moves.append({"volume": name, "node": node, "old": brick,
                              "new": f"{target_address}:{path}" if target else "", "target": target,
                              "problem": problem})
    return moves


def _as_int(value):
    """Jinja's `int`: the number, or 0 where the value is none."""
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        try:
            return int(float(str(value).strip()))
        except (TypeError, ValueError):
            return 0


def _as_bool(value):
    """Ansible's `bool`."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("yes", "on", "1", "true", "y", "t")


VOLUME_STATES = ("started", "present", "stopped", "absent")
_VOLUME_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def glusterfs_layout_problems(host, nodes, bricks_per_node, brick_devices, bricks_on_root_fs, brick_root, volumes,
                              replica, auth_allow, is_ip_address, rebalance_wait=0):
    """The problems of the glusterfs role's layout as seen from `host`, each naming the variable and the fix."""
    problems = []
    nodes = list(nodes or [])
    count = len(nodes)
    if count == 0:
        problems.append("glusterfs_nodes is empty (default: the storage_nodes group): put the storage servers in "
                        "storage_nodes")
    if host not in nodes:
        problems.append(f"{host} runs the glusterfs role but is not in glusterfs_nodes: run it on storage_nodes only")
    per_node = _as_int(bricks_per_node)
    if per_node < 1:
        problems.append(f"glusterfs_bricks_per_node (cluster_storage_bricks_per_node) is {per_node}: use 1 or more")
    devices = list(brick_devices or [])
    if len(devices) not in (0, per_node):
        problems.append(f"glusterfs_brick_devices lists {len(devices)} device(s) on {host} but "
                        f"glusterfs_bricks_per_node is {per_node}: list one device per brick, or none for directories")
    if not devices and not _as_bool(bricks_on_root_fs):
        problems.append(f"no glusterfs_brick_devices on {host} and glusterfs_bricks_on_root_fs is false: list the "
                        "brick disks in glusterfs_brick_devices, or set glusterfs_bricks_on_root_fs: true when "
                        f"{brick_root} is a mounted data disk")
    names = []
    for index, volume in enumerate(volumes or [], start=1):
        name = volume.get("name", "?")
        wanted = _as_int(volume.get("replica", replica))
        arbiter = _as_int(volume.get("arbiter", 0))
        if "name" not in volume or not _VOLUME_NAME.match(str(volume["name"])):
            problems.append(f"glusterfs_volumes entry {index} has name '{volume.get('name', '')}': use letters, "
                            "digits, - and _")
        elif volume["name"] in names:
            problems.append(f"glusterfs_volumes: volume '{volume['name']}' is declared twice: keep one entry")
        else:
            names.append(volume["name"])
        if wanted < 1:
            problems.append(f"volume {name}: replica is {wanted}: use 1 or more (3 is the safe default)")
        elif wanted > count:
            problems.append(f"volume {name}: replica {wanted} but only {count} storage node(s): add storage nodes or "
                            "lower cluster_storage_replica (glusterfs_replica, or the volume's replica)")
        elif not whole_replica_sets(count * per_node, wanted):
            problems.append(f"volume {name}: {count * per_node} bricks ({count} storage nodes x {per_node}) is not a "
                            f"multiple of replica {wanted}: add storage nodes in groups of {wanted} or change "
                            "cluster_storage_bricks_per_node")
        if arbiter not in (0, 1) or (arbiter == 1 and wanted != 3):
            problems.append(f"volume {name}: arbiter {arbiter} with replica {wanted}: an arbiter is 0 or 1, and 1 "
                            "needs replica 3")
        if volume.get("state", "started") not in VOLUME_STATES:
            problems.append(f"volume {name}: state '{volume['state']}': use started, present, stopped or absent")
    if _as_int(rebalance_wait) < 0:
        problems.append(f"glusterfs_rebalance_wait is {rebalance_wait}: give the seconds to wait for a rebalance, 0 "
                        "(do not wait) or more")
    for address in auth_allow or []:
        if not is_ip_address(address):
            problems.append(f"glusterfs_auth_allow holds '{address}', not an IP address: set cluster_address (or "
                            "ansible_host) of every node to its address")
    return problems


def node_list(value):
    """A list of node names given as a list or as one comma-separated string (-e day2_remove_nodes=node4,node5)."""
    names = value.split(",") if isinstance(value, str) else list(value or [])
    return [name for name in (str(n).strip() for n in names) if name]


def removal_plan(remove_nodes, targets, groups, address_of):
    """remove_node.yml's plan: the nodes to remove, those unknown to the inventory, the nodes that stay, the gpu
    and storage nodes after the removal (each removed storage node's place taken by its brick target, in the
    same position, so the brick order stays) and their addresses."""
    nodes = node_list(remove_nodes)
    targets = dict(targets or {})
    everyone = list(groups.get("all", []))
    storage = list(groups.get("storage_nodes", []))
    gpu = list(groups.get("gpu_nodes", []))
    keep = [host for host in everyone if host not in nodes]
    removed_storage = [host for host in storage if host in nodes]
    without_target = [host for host in removed_storage if host not in targets]
    storage_after = [targets.get(host, host) for host in storage]
    storage_after = [host for host in storage_after if host not in without_target]
    return {
        "nodes": nodes,
        "unknown": [host for host in nodes if host not in everyone],
        "keep": keep,
        "keep_addresses": [address_of(host) for host in keep],
        "gpu_nodes": [host for host in gpu if host not in nodes],
        "removed_gpu_nodes": [host for host in gpu if host in nodes],
        "removed_storage": removed_storage,
        "storage_nodes": storage_after,
        "storage_addresses": [address_of(host) for host in storage_after],
        "targets": targets,
    }


def _unique(items):
    return list(dict.fromkeys(items))


def scale_out_plan(scale_out_nodes, groups, play_hosts, was):
    """scale_out.yml's plan. was: host -> the groups its marker recorded at its last converge (None when it
    carries no marker). New nodes are the ones named in day2_scale_out_nodes, else every node without a marker;
    new storage nodes are storage nodes that are new or were not storage nodes when last converged."""
    named = node_list(scale_out_nodes)
    everyone = list(groups.get("all", []))
    marked = [host for host in play_hosts if was.get(host) is not None]
    if named:
        new = _unique(host for host in named if host in everyone)
    else:
        new = _unique(host for host in everyone if host not in marked)
    was_not_storage = [host for host in marked if "storage_nodes" not in (was.get(host) or [])]
    head = list(groups.get("head", []))
    compute = head + list(groups.get("gpu_nodes", []))
    new_storage = [host for host in groups.get("storage_nodes", []) if host in new + was_not_storage]
    slurm_changes = any(host in compute for host in new)
    return {
        "named": named,
        "unknown": _unique(host for host in named if host not in everyone),
        "marked": marked,
        "new": new,
        "new_storage": new_storage,
        "slurm_changes": slurm_changes,
        # The hosts each layer playbook runs on (scale_out.yml makes a group of each and passes it as
        # layer_hosts): the storage mount everywhere when new storage nodes change the volfile servers of every
        # fstab line; the scheduler on every Slurm host when the node list changes (a new slurm.conf reaches them
        # all before the daemons restart); monitoring on the new nodes, on new storage nodes (their GlusterFS
        # collector) and on the head (Prometheus's targets).
        "layer_hosts": {
            "day2_new": new,
            "day2_mount": everyone if new_storage else new,
            "day2_slurm": [host for host in everyone if host in compute] if slurm_changes else [],
            "day2_monitoring": [host for host in everyone if host in new + new_storage + head],
        },
    }


_NOTHING_CHANGED = "Nothing was changed."


def removal_problems(plan, groups):
    """Why remove_node.yml cannot go on with plan (removal_plan's answer): the first that applies, one sentence
    naming the knob and the fix; [] when it may go on."""
    nodes, heads = plan["nodes"], list(groups.get("head", []))
    if not nodes or plan["unknown"]:
        what = (f"day2_remove_nodes names {', '.join(plan['unknown'])}, not in the inventory" if nodes
                else "day2_remove_nodes is empty")
        return [f"{what}: name the nodes to remove as they are in the inventory, e.g. -e day2_remove_nodes=node4 "
                f"(or node4,node5). {_NOTHING_CHANGED}"]
    if set(nodes) & set(heads) or not plan["gpu_nodes"]:
        return [f"day2_remove_nodes ({', '.join(nodes)}) would take away the head ({', '.join(heads)}, which runs "
                "slurmctld and Prometheus) or every gpu node; the cluster would stop working. Remove other nodes, or "
                f"move the head first (a new head is built with site.yml). {_NOTHING_CHANGED}"]
    targets, storage = plan["targets"], set(groups.get("storage_nodes", []))
    if (set(targets) - set(plan["removed_storage"]) or set(targets.values()) - set(plan["keep"])
            or set(targets.values()) & storage):
        return [f"day2_remove_node_brick_targets ({targets}) must map each removed storage node "
                f"({', '.join(plan['removed_storage']) or 'none'}) to a node that stays in the inventory and is not a "
                "storage node yet (it takes over that node's bricks and its place in storage_nodes). Fix the map. "
                f"{_NOTHING_CHANGED}"]
    return []


def scale_out_problems(plan, groups, marker_path, backend="glusterfs", replica=3, bricks_per_node=1):
    """Why scale_out.yml cannot go on with plan (scale_out_plan's answer), one sentence each naming the knob and
    the fix; [] when it may go on. Of the checks of which nodes are new, only the first that applies is said
    (no marker anywhere also makes the head new); the two checks of new storage nodes are said each."""
    new, new_storage = plan["new"], plan["new_storage"]
    if plan["unknown"]:
        return [f"day2_scale_out_nodes names {', '.join(plan['unknown'])}, not in the inventory: add each new host to "
                "the inventory and its groups (gpu_nodes, storage_nodes), then run scale_out.yml again. "
                f"{_NOTHING_CHANGED}"]
    if not plan["marked"] and not plan["named"]:
        return [f"No node carries the marker {marker_path}, so scale_out.yml cannot tell the new nodes from the "
                "cluster. A new cluster is built with site.yml. A cluster converged before site.yml wrote the marker: "
                "mark its nodes once with `ansible-playbook ansible/playbooks/converged.yml -i INVENTORY --limit "
                "'!NEW_NODE'`, or name the new nodes with -e day2_scale_out_nodes=NODE,NODE. " + _NOTHING_CHANGED]
    if not new and not new_storage:
        return [f"Nothing to scale out: every node of the inventory ({', '.join(groups.get('all', []))}) carries the "
                f"marker {marker_path} with its current groups. Add the new hosts to the inventory and its groups, or "
                f"name them with -e day2_scale_out_nodes=NODE,NODE. {_NOTHING_CHANGED}"]
    new_heads = [host for host in new if host in groups.get("head", [])]
    if new_heads:
        return [f"{', '.join(new_heads)} in the head group is new (no marker {marker_path}): scale_out.yml adds nodes "
                "to a running cluster and its head. Build a cluster with a new head with site.yml. " + _NOTHING_CHANGED]
    problems = []
    if backend == "glusterfs" and new_storage:
        replica, bricks = _as_int(replica), len(new_storage) * _as_int(bricks_per_node)
        if not whole_replica_sets(bricks, replica):
            problems.append(f"The new storage nodes {', '.join(new_storage)} give {bricks} new brick(s) per volume, "
                            f"which must be whole replica sets of {replica} (cluster_storage_replica). Add storage "
                            f"nodes in groups of {replica}, or leave them out of storage_nodes for now (as gpu_nodes "
                            f"only). {_NOTHING_CHANGED}")
        storage = list(groups.get("storage_nodes", []))
        if sorted(storage[-len(new_storage):]) != sorted(new_storage):
            problems.append(f"The new storage nodes {', '.join(new_storage)} must come last in the storage_nodes group "
                            "(the first storage node forms the pool and bricks are added in the group's order): move "
                            f"them to the end of storage_nodes in the inventory. {_NOTHING_CHANGED}")
    return problems
