#!/usr/bin/python
"""Ansible module: a GlusterFS volume as data. Reads `gluster volume info NAME --xml`, then acts only on drift:
create, add bricks in whole replica sets (then rebalance), set options that differ, start or stop, delete."""
from __future__ import annotations

import re
import time

from ansible.module_utils.basic import AnsibleModule

# The replica rule and the XML reader live in module_utils/topology.py, shared with the filters, preflight,
# the local cluster and the cloud inventory. Ansible ships it with the module.
from ansible.module_utils.topology import (
    GlusterError,
    nodes_that_failed_at_start,
    offline_bricks,
    parse_brick_status,
    parse_rebalance_status,
    parse_volume_info,
    rebalance_problem,
    rebalance_running,
    rebalance_summary,
    sets_sharing_a_server,
    whole_replica_sets,
)

DOCUMENTATION = r"""
---
module: gluster_volume
short_description: Create, grow, configure and start a GlusterFS volume, acting only on drift
description:
  - Reads the volume with C(gluster volume info NAME --xml) and runs only the commands needed to reach the
    wanted state, so a second run changes nothing.
  - New bricks are added in whole replica sets, in the order given (list bricks so that consecutive groups of
    C(replica) bricks lie on different servers), and a rebalance is started once every brick is online.
  - Never removes bricks nor changes the replica count of an existing volume; it stops with a message instead.
  - Supports check mode (reports the commands it would run).
options:
  name:
    description: Volume name.
    type: str
    required: true
  state:
    description: C(started) (created and running), C(present) (created, left as it is), C(stopped), or C(absent)
      (stopped and deleted; the brick directories and their data stay on disk).
    type: str
    choices: [started, present, stopped, absent]
    default: started
  bricks:
    description: Every brick of the volume as C(host:/path), grouped in replica sets of C(replica) bricks.
    type: list
    elements: str
    default: []
  replica:
    description: Copies of every file (1 is a plain distributed volume).
    type: int
    default: 3
  arbiter:
    description: Arbiter bricks per replica set (0 or 1; the last brick of each set then holds metadata only).
    type: int
    default: 0
  transport:
    description: Brick transport.
    type: str
    choices: [tcp, rdma, "tcp,rdma"]
    default: tcp
  options:
    description: Volume options (C(gluster volume set)); values are compared as strings, booleans as on/off.
    type: dict
    default: {}
  force:
    description: Pass C(force) to create and add-brick, which gluster requires for bricks on the root file system.
    type: bool
    default: false
  rebalance:
    description: Start a rebalance after bricks were added, once the volume is started (it is the last command);
      a volume that grows but is left stopped gets a warning naming the commands instead.
    type: bool
    default: true
  rebalance_wait:
    description: Seconds to wait for a rebalance this run started to finish on every node (0 returns at once with
      its first status). A node whose rebalance failed before it looked at a file is given one more start once
      the others are done. The module fails when a node's rebalance failed or files failed to move; when the
      time runs out it warns and returns, and the rebalance goes on.
    type: int
    default: 0
author: sd3-cluster developers
"""

EXAMPLES = r"""
- name: A replica-3 volume on three storage nodes
  gluster_volume:
    name: shared
    replica: 3
    bricks: [10.0.0.11:/data/glusterfs/brick1/shared, 10.0.0.12:/data/glusterfs/brick1/shared,
             10.0.0.13:/data/glusterfs/brick1/shared]
    options:
      auth.allow: 10.0.0.11,10.0.0.12,10.0.0.13
      network.ping-timeout: "10"
"""

RETURN = r"""
commands:
  description: The gluster commands run (or that would run, in check mode).
  type: list
  returned: always
volume:
  description: The volume as read after the change (status, replica, bricks, options); empty when absent.
  type: dict
  returned: always
warnings_found:
  description: Drift the module does not repair itself (bricks to remove), with what to do.
  type: list
  returned: always
rebalance:
  description: The status of the rebalance this run started (nodes with their status, files moved, skipped and
    failed; the total), whether it is still running, the seconds waited and a one-line summary; empty when no
    rebalance was started.
  type: dict
  returned: always
"""

def option_value(value):
    """How gluster stores an option value: YAML booleans as on/off, everything else as its string."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def layout_problems(params):
    """Problems of the wanted layout itself, each with its fix; empty when it can be built."""
    problems = []
    replica, bricks = params["replica"], params["bricks"]
    if replica < 1:
        problems.append(f"replica is {replica}: use 1 or more (3 is the safe default)")
    if params["arbiter"] not in (0, 1):
        problems.append(f"arbiter is {params['arbiter']}: use 0 or 1")
    if params["arbiter"] and replica != 3:
        problems.append(f"an arbiter needs replica 3, not {replica}")
    if params["rebalance_wait"] < 0:
        problems.append(f"rebalance_wait is {params['rebalance_wait']}: give seconds, 0 or more")
    if params["state"] in ("started", "present") and not bricks:
        problems.append("no bricks given: list them as host:/path")
    if replica >= 1 and not whole_replica_sets(len(bricks), replica):
        problems.append(f"{len(bricks)} bricks is not a multiple of replica {replica}: add or remove bricks")
    for brick in bricks:
        host, _, path = brick.partition(":")
        if not host or not path.startswith("/"):
            problems.append(f"brick {brick!r} is not host:/absolute/path")
    if len(set(bricks)) != len(bricks):
        problems.append("a brick is listed twice: every brick needs its own host:/path")
    for number, members in sets_sharing_a_server(bricks, replica):
        problems.append(f"replica set {number} ({', '.join(members)}) has two "
                        "bricks on one server: order the bricks so each set spans different servers")
    return problems


def plan(current, params):
    """The gluster command lines (argument lists after `gluster`) that take current to the wanted state,
    and the drift left for a person to act on."""
    name, state = params["name"], params["state"]
    force = ["force"] if params["force"] else []
    commands, warnings, added = [], [], []
    if state == "absent":
        if current is not None:
            if current["status"] == "Started":
                commands.append(["volume", "stop", name])
            commands.append(["volume", "delete", name])
        return commands, warnings

    options = {key: option_value(value) for key, value in params["options"].items()}
    if current is None:
        layout = ["replica", str(params["replica"])] if params["replica"] > 1 else []
        if params["arbiter"]:
            layout += ["arbiter", str(params["arbiter"])]
        commands.append(["volume", "create", name, *layout, "transport", params["transport"],
                         *params["bricks"], *force])
        current_options, current_status = {}, "Created"
    else:
        if current["replica"] != params["replica"] or current["arbiter"] != params["arbiter"]:
            raise GlusterError(
                f"volume {name} is replica {current['replica']} arbiter {current['arbiter']}, the wanted one is "
                f"replica {params['replica']} arbiter {params['arbiter']}: changing it is not automatic (data "
                "moves); set the volume's replica back, or convert it by hand with add-brick/remove-brick")
        added = [b for b in params["bricks"] if b not in current["bricks"]]
        extra = [b for b in current["bricks"] if b not in params["bricks"]]
        if extra:
            warnings.append(f"volume {name} has bricks that are not wanted: {', '.join(extra)}; they are kept. "
                            "Remove them with `gluster volume remove-brick` (start, then commit) after draining.")
        if added:
            if not whole_replica_sets(len(added), params["replica"]):
                raise GlusterError(
                    f"{len(added)} new brick(s) for volume {name} ({', '.join(added)}) is not a multiple of replica "
                    f"{params['replica']}: add storage nodes (or bricks per node) so new bricks come in whole sets")
            for _number, members in sets_sharing_a_server(added, params["replica"]):
                raise GlusterError(
                    f"the new bricks {', '.join(members)} would form a replica set "
                    "with two copies on one server: add storage nodes in groups of the replica count")
            commands.append(["volume", "add-brick", name, *added, *force])
        current_options, current_status = current["options"], current["status"]

    for key in sorted(options):
        if current_options.get(key) != options[key]:
            commands.append(["volume", "set", name, key, options[key]])
    if state == "started" and current_status != "Started":
        commands.append(["volume", "start", name])
    if state == "stopped" and current_status == "Started":
        commands.append(["volume", "stop", name])
    # The rebalance comes last: after the options, so the new nodes' addresses are in auth.allow before their
    # rebalance processes reach the bricks; after the start, as gluster refuses one on a volume that is not
    # started (a volume left stopped, or stopped now, is left for a person to rebalance).
    if added and params["rebalance"]:
        ends_started = state == "started" or (state == "present" and current_status == "Started")
        if ends_started:
            commands.append(["volume", "rebalance", name, "start"])
        else:
            warnings.append(f"volume {name} grew but is not started, so no rebalance was started: after "
                            f"`gluster volume start {name}`, run `gluster volume rebalance {name} start`")
    return commands, warnings


# Refusals that the same command gets past when tried again a few seconds later:
# - glusterd serialises volume changes with a cluster-wide lock: a command that arrives while another node's
#   command holds it (a heal, a rebalance status, a second play) fails at once with "Another transaction is in
#   progress" or "Locking failed on" (seen in scale-out runs on the local cluster);
# - right after a probe, the new peers connect to one another in the background (gluster_peer waits only until
#   the probing node sees them): a command staged on one of them fails with "Staging failed on C. Error: Host B
#   not connected" until C has reached B (seen once in a CI run of molecule/storage, the create right after the
#   probe). Staging is a check before any change, so trying again is safe.
TRANSIENT_REFUSAL = re.compile(r"Another transaction is in progress|Locking failed on"
                               r"|Host \S+ not connected|is not in 'Peer in Cluster' state")


def transient_refusal(text):
    """Whether gluster's answer is one that the same command, tried again a few seconds later, gets past."""
    return bool(TRANSIENT_REFUSAL.search(text))


def run_retrying_when_transient(run, command, attempts=6, delay=5.0, sleep=time.sleep):
    """run(command) -> (rc, out, err), tried again while glusterd answers that it is busy or a peer not ready."""
    for attempt in range(1, attempts + 1):
        rc, out, err = run(command)
        if rc == 0 or not transient_refusal((err or "") + (out or "")) or attempt == attempts:
            return rc, out, err
        sleep(delay)
    return rc, out, err


def poll_until(read, done, timeout_s, every_s, sleep=time.sleep, clock=time.monotonic):
    """(last value, seconds waited): read() every every_s seconds until done(value) or timeout_s has passed."""
    start = clock()
    while True:
        value = read()
        waited = clock() - start
        if done(value) or waited >= timeout_s:
            return value, waited
        sleep(min(every_s, max(timeout_s - waited, 0.0)))


def wait_for_rebalance(read_status, timeout_s, every_s=5.0, sleep=time.sleep, clock=time.monotonic,
                       stop_on_problem=True):
    """(status, seconds waited): read_status() until no node is running or timeout_s has passed, or a problem
    shows (a failed node, files that failed to move), which ends the wait at once unless stop_on_problem is off."""
    def done(status):
        return not rebalance_running(status) or (stop_on_problem and bool(rebalance_problem(status)))
    return poll_until(read_status, done, timeout_s, every_s, sleep, clock)


# add-brick has glusterd start the new bricks' processes, which takes a few seconds; a rebalance started
# before they listen fails at once on nodes that cannot reach them (the likely cause of what CI saw once: a
# new node's rebalance "failed" with no file looked at). So the rebalance waits for every brick, this long at most.
BRICKS_ONLINE_TIMEOUT_S = 60


def wait_for_bricks(read_bricks, wanted, timeout_s, every_s=2.0, sleep=time.sleep, clock=time.monotonic):
    """(bricks of `wanted` still offline, seconds waited): read_bricks() (parse_brick_status) until every
    wanted brick is online or timeout_s has passed."""
    return poll_until(lambda: offline_bricks(wanted, read_bricks()), lambda offline: not offline, timeout_s,
                      every_s, sleep, clock)


def main():
    module = AnsibleModule(
        argument_spec={
            "name": {"type": "str", "required": True},
            "state": {"type": "str", "default": "started", "choices": ["started", "present", "stopped", "absent"]},
            "bricks": {"type": "list", "elements": "str", "default": []},
            "replica": {"type": "int", "default": 3},
            "arbiter": {"type": "int", "default": 0},
            "transport": {"type": "str", "default": "tcp", "choices": ["tcp", "rdma", "tcp,rdma"]},
            "options": {"type": "dict", "default": {}},
            "force": {"type": "bool", "default": False},
            "rebalance": {"type": "bool", "default": True},
            "rebalance_wait": {"type": "int", "default": 0},
        },
        supports_check_mode=True,
    )
    params = module.params
    gluster = module.get_bin_path("gluster", required=True)

    def info():
        rc, out, err = module.run_command([gluster, "--mode=script", "volume", "info", params["name"], "--xml"])
        if not out.strip():
            module.fail_json(msg=f"`gluster volume info {params['name']}` printed nothing (rc {rc}: {err.strip()}): "
                             "is glusterd running on this node?")
        try:
            return parse_volume_info(out)
        except GlusterError as error:
            module.fail_json(msg=f"reading volume {params['name']} failed: {error}")

    if params["state"] != "absent":
        problems = layout_problems(params)
        if problems:
            module.fail_json(msg=f"volume {params['name']} cannot be built as given; nothing was changed: "
                             + "; ".join(problems))
    current = info()
    try:
        commands, warnings = plan(current, params)
    except GlusterError as error:
        module.fail_json(msg=f"{error}; nothing was changed", volume=current or {})
    for warning in warnings:
        module.warn(warning)
    if module.check_mode or not commands:
        module.exit_json(changed=bool(commands), commands=[" ".join(c) for c in commands], volume=current or {},
                         warnings_found=warnings, rebalance={})

    for command in commands:
        if command[1] == "rebalance":
            wait_for_bricks_or_fail(module, gluster, params["name"], params["bricks"])
        rc, out, err = run_retrying_when_transient(module.run_command, [gluster, "--mode=script", *command])
        if rc != 0:
            module.fail_json(msg=f"`gluster {' '.join(command)}` failed: {(err or out).strip()}",
                             commands=[" ".join(c) for c in commands], volume=info() or {})
    rebalance = {}
    if ["volume", "rebalance", params["name"], "start"] in commands:
        rebalance = follow_rebalance(module, gluster, params["name"], params["rebalance_wait"])
    module.exit_json(changed=True, commands=[" ".join(c) for c in commands], volume=info() or {},
                     warnings_found=warnings, rebalance=rebalance)


def read_xml(module, gluster, command, parse):
    """parse() of `gluster --mode=script COMMAND` (asked again on a transient refusal); GlusterError with
    gluster's rc and message when it printed nothing parse can read."""
    rc, out, err = run_retrying_when_transient(module.run_command, [gluster, "--mode=script", *command])
    try:
        return parse(out)
    except GlusterError as error:
        raise GlusterError(f"rc {rc}: {error} {err.strip()}".strip()) from error


def wait_for_bricks_or_fail(module, gluster, name, bricks):
    """Waits for every brick of the volume to be online before its rebalance starts; fails, naming the bricks,
    when some are not online after BRICKS_ONLINE_TIMEOUT_S (the volume has grown; the rebalance is not started)."""
    then_what = (f"see `gluster volume status {name}` and /var/log/glusterfs/bricks/ on the nodes, then start "
                 f"the rebalance (`gluster volume rebalance {name} start`)")
    try:
        offline, waited = wait_for_bricks(
            lambda: read_xml(module, gluster, ["volume", "status", name, "--xml"], parse_brick_status), bricks,
            BRICKS_ONLINE_TIMEOUT_S)
    except GlusterError as error:
        module.fail_json(msg=f"volume {name} grew, but its bricks' status could not be read ({error}), so no "
                         f"rebalance was started: {then_what}")
    if offline:
        module.fail_json(msg=f"volume {name} grew, but its bricks {', '.join(offline)} were not online after "
                         f"{waited:.0f} s, so no rebalance was started: {then_what}")


def restart_after_failed_start(module, gluster, name, read_status, status, waited, wait_s):
    """(status, seconds waited in all): when nodes failed before they looked at a file, the rebalance is
    started once more, once the nodes still at work are done (within wait_s), and followed; the status as it
    was when there is no such node or it cannot be started again."""
    failed = nodes_that_failed_at_start(status)
    if not failed:
        return status, waited
    status, more = wait_for_rebalance(read_status, max(wait_s - waited, 0.0), stop_on_problem=False)
    waited += more
    if rebalance_running(status) or not nodes_that_failed_at_start(status):
        return status, waited
    rc, out, err = run_retrying_when_transient(module.run_command,
                                               [gluster, "--mode=script", "volume", "rebalance", name, "start"])
    if rc != 0:
        module.warn(f"volume {name}: starting the rebalance again failed: {(err or out).strip()}")
        return status, waited
    module.warn(f"volume {name}: the rebalance failed before it looked at a file on {', '.join(failed)}; "
                "it was started once more")
    status, more = wait_for_rebalance(read_status, max(wait_s - waited, 0.0))
    return status, waited + more


def follow_rebalance(module, gluster, name, wait_s):
    """The started rebalance's status, after waiting up to wait_s for it; fails on a problem, warns at the end
    of the wait while it still runs. Nodes that failed before they looked at a file get one more start, once
    the other nodes are done (within the same wait)."""
    def read_status():
        return read_xml(module, gluster, ["volume", "rebalance", name, "status", "--xml"], parse_rebalance_status)

    try:
        status, waited = wait_for_rebalance(read_status, wait_s)
        status, waited = restart_after_failed_start(module, gluster, name, read_status, status, waited, wait_s)
    except GlusterError as error:
        # The volume grew and the rebalance started: a status gluster would not give is no reason to fail the play.
        summary = (f"volume {name}: rebalance started, but its status could not be read ({error}); follow it with "
                   f"`gluster volume rebalance {name} status`")
        module.warn(summary)
        return {"nodes": [], "total": {}, "running": True, "waited_s": 0, "summary": summary}
    summary = rebalance_summary(name, status, waited)
    result = {**status, "running": rebalance_running(status), "waited_s": round(waited, 1), "summary": summary}
    problem = rebalance_problem(status)
    if problem:
        module.fail_json(msg=f"volume {name} grew, but its rebalance went wrong: {problem}. Files it did not move "
                         f"stay on their old bricks; see `gluster volume rebalance {name} status` and "
                         f"/var/log/glusterfs/{name}-rebalance.log on the nodes named, then start it again "
                         f"(`gluster volume rebalance {name} start`)", rebalance=result)
    if wait_s and result["running"]:
        module.warn(summary)
    return result


if __name__ == "__main__":
    main()
