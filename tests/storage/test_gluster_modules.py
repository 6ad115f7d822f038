"""Unit tests of our gluster modules on XML that gluster 10.3 printed (tests/storage/data), no gluster needed."""
from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
BRICKS3 = [f"10.0.0.1{i}:/data/glusterfs/brick1/shared" for i in (1, 2, 3)]
GROWN = [*BRICKS3, *(f"10.0.0.1{i}:/data/glusterfs/brick1/shared" for i in (4, 5, 6))]


_tree = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))
# What Ansible does when it ships a module to a node: its module_utils imports find the project's files.
MODULE_UTILS = {"ansible.module_utils.topology": _tree["load"]("ansible/plugins/module_utils/topology.py")}


def load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "ansible" / "plugins" / "modules" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict("sys.modules", MODULE_UTILS):
        spec.loader.exec_module(module)
    return module


gluster_volume = load("gluster_volume")
gluster_peer = load("gluster_peer")


def params(**overrides):
    base = {"name": "shared", "state": "started", "bricks": list(BRICKS3), "replica": 3, "arbiter": 0,
            "transport": "tcp", "options": {}, "force": False, "rebalance": True, "rebalance_wait": 0}
    return {**base, **overrides}


def volume(**overrides):
    base = {"name": "shared", "status": "Started", "replica": 3, "arbiter": 0, "distribute": 1,
            "bricks": list(BRICKS3), "options": {}}
    return {**base, **overrides}


def test_volume_info_is_read_from_gluster_xml():
    info = gluster_volume.parse_volume_info((DATA / "volume_info_replica2.xml").read_text())
    assert info["name"] == "shared"
    assert info["status"] == "Created"
    assert info["replica"] == 2
    assert info["arbiter"] == 0
    assert info["bricks"] == ["10.213.0.31:/data/glusterfs/shared/brick1", "10.213.0.32:/data/glusterfs/shared/brick1"]
    assert info["options"]["nfs.disable"] == "on"
    assert info["options"]["performance.client-io-threads"] == "off"


def test_missing_volume_reads_as_none():
    assert gluster_volume.parse_volume_info((DATA / "volume_info_missing.xml").read_text()) is None


def test_other_gluster_errors_are_raised_with_glusters_message():
    with pytest.raises(gluster_volume.GlusterError, match="root partition"):
        gluster_volume.parse_volume_info((DATA / "create_root_partition_error.xml").read_text())


def test_missing_volume_is_created_then_configured_then_started():
    commands, warnings = gluster_volume.plan(None, params(options={"network.ping-timeout": 10}, force=True))
    assert commands == [
        ["volume", "create", "shared", "replica", "3", "transport", "tcp", *BRICKS3, "force"],
        ["volume", "set", "shared", "network.ping-timeout", "10"],
        ["volume", "start", "shared"],
    ]
    assert warnings == []


def test_arbiter_volume_is_created_with_arbiter_count():
    commands, _ = gluster_volume.plan(None, params(arbiter=1, state="present"))
    assert commands == [["volume", "create", "shared", "replica", "3", "arbiter", "1", "transport", "tcp", *BRICKS3]]


def test_converged_volume_needs_no_command():
    current = volume(options={"auth.allow": "10.0.0.11,10.0.0.12", "cluster.self-heal-daemon": "on"})
    wanted = params(options={"auth.allow": "10.0.0.11,10.0.0.12", "cluster.self-heal-daemon": True})
    assert gluster_volume.plan(current, wanted) == ([], [])


def test_only_drifted_options_are_set():
    current = volume(options={"auth.allow": "10.0.0.11", "network.ping-timeout": "10"})
    commands, _ = gluster_volume.plan(current, params(options={"auth.allow": "10.0.0.11,10.0.0.14",
                                                                "network.ping-timeout": "10"}))
    assert commands == [["volume", "set", "shared", "auth.allow", "10.0.0.11,10.0.0.14"]]


def test_new_bricks_are_added_as_a_replica_set_then_rebalanced():
    commands, _ = gluster_volume.plan(volume(), params(bricks=GROWN))
    assert commands == [["volume", "add-brick", "shared", *GROWN[3:]], ["volume", "rebalance", "shared", "start"]]


def test_a_stopped_volume_that_grows_is_started_before_its_rebalance():
    commands, warnings = gluster_volume.plan(volume(status="Stopped"), params(bricks=GROWN, options={"a.b": "on"}))
    assert commands == [["volume", "add-brick", "shared", *GROWN[3:]], ["volume", "set", "shared", "a.b", "on"],
                        ["volume", "start", "shared"], ["volume", "rebalance", "shared", "start"]]
    assert warnings == []


@pytest.mark.parametrize(("status", "state", "last"), [
    ("Stopped", "present", ["volume", "add-brick"]),
    ("Created", "stopped", ["volume", "add-brick"]),
    ("Started", "stopped", ["volume", "stop"]),
])
def test_a_volume_that_grows_and_ends_stopped_is_not_rebalanced_but_warned_about(status, state, last):
    commands, warnings = gluster_volume.plan(volume(status=status), params(bricks=GROWN, state=state))
    assert commands[-1][:2] == last and not any(c[1] == "rebalance" for c in commands)
    assert len(warnings) == 1 and "gluster volume start shared" in warnings[0]
    assert "gluster volume rebalance shared start" in warnings[0]


def test_growth_without_rebalance_plans_none_and_warns_of_none():
    assert gluster_volume.plan(volume(status="Stopped"), params(bricks=GROWN, state="present", rebalance=False)) \
        == ([["volume", "add-brick", "shared", *GROWN[3:]]], [])


def test_new_bricks_that_are_not_a_whole_replica_set_are_refused():
    with pytest.raises(gluster_volume.GlusterError, match="not a multiple of replica 3"):
        gluster_volume.plan(volume(), params(bricks=[*BRICKS3, "10.0.0.14:/data/glusterfs/brick1/shared"]))


def test_new_replica_set_on_one_server_is_refused():
    one_server = [f"10.0.0.14:/data/glusterfs/brick{i}/shared" for i in (1, 2, 3)]
    with pytest.raises(gluster_volume.GlusterError, match="two copies on one server"):
        gluster_volume.plan(volume(), params(bricks=[*BRICKS3, *one_server]))


def test_replica_change_of_an_existing_volume_is_refused():
    with pytest.raises(gluster_volume.GlusterError, match=r"replica 2 arbiter 0.*replica 3"):
        gluster_volume.plan(volume(replica=2), params())


def test_unwanted_bricks_are_kept_with_a_warning():
    commands, warnings = gluster_volume.plan(volume(bricks=[*BRICKS3, "10.0.0.19:/x", "10.0.0.18:/x", "10.0.0.17:/x"]),
                                             params())
    assert commands == []
    assert "remove-brick" in warnings[0]


def test_stopped_volume_is_started_and_absent_volume_is_stopped_then_deleted():
    assert gluster_volume.plan(volume(status="Stopped"), params()) == ([["volume", "start", "shared"]], [])
    assert gluster_volume.plan(volume(), params(state="absent")) == (
        [["volume", "stop", "shared"], ["volume", "delete", "shared"]], [])
    assert gluster_volume.plan(None, params(state="absent")) == ([], [])


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"bricks": BRICKS3[:2]}, "not a multiple of replica 3"),
    ({"bricks": [*BRICKS3[:2], BRICKS3[0].replace("brick1", "brick2")]}, "two bricks on one server"),
    ({"bricks": ["10.0.0.11/data"] * 3}, "not host:/absolute/path"),
    ({"arbiter": 1, "replica": 2, "bricks": BRICKS3[:2]}, "an arbiter needs replica 3"),
    ({"replica": 0}, "replica is 0"),
])
def test_layout_problems_name_the_fix(overrides, problem):
    assert any(problem in p for p in gluster_volume.layout_problems(params(**overrides)))


def test_good_layout_has_no_problems():
    assert gluster_volume.layout_problems(params()) == []


def test_option_values_are_compared_as_gluster_stores_them():
    assert gluster_volume.option_value(True) == "on"
    assert gluster_volume.option_value(False) == "off"
    assert gluster_volume.option_value(10) == "10"


def test_pool_is_read_and_missing_peers_found():
    pool = gluster_peer.parse_pool((DATA / "pool_list.xml").read_text())
    assert [p["hostnames"] for p in pool] == [["10.213.0.32"], ["localhost"]]
    assert pool[1]["local"] and pool[1]["state"] == gluster_peer.IN_CLUSTER
    assert gluster_peer.missing_peers(pool, ["10.213.0.32", "10.213.0.33"]) == ["10.213.0.33"]
    assert gluster_peer.unhealthy_peers(pool, ["10.213.0.32"]) == []


def test_disconnected_peer_is_unhealthy():
    pool = gluster_peer.parse_pool((DATA / "pool_list.xml").read_text().replace("<connected>1</connected>",
                                                                                 "<connected>0</connected>", 1))
    assert gluster_peer.unhealthy_peers(pool, ["10.213.0.32"]) == ["10.213.0.32"]


def test_pool_error_is_raised():
    with pytest.raises(gluster_peer.GlusterError, match="does not exist"):
        gluster_peer.parse_pool((DATA / "volume_info_missing.xml").read_text())


def test_busy_glusterd_is_asked_again_then_its_answer_kept():
    answers = [(1, "", "volume add-brick: failed: Another transaction is in progress for shared."),
               (1, "", "Locking failed on 10.0.0.12. Please check log file for details."), (0, "success", "")]
    slept = []
    rc, out, _ = gluster_volume.run_retrying_when_transient(lambda _: answers.pop(0), ["volume", "start"],
                                                            sleep=slept.append)
    assert (rc, out) == (0, "success") and len(slept) == 2 and not answers


def test_a_peer_not_yet_connected_to_another_is_asked_again():
    # what the create right after the probe printed in a CI run of molecule/storage (gluster 10.3)
    not_connected = ("volume create: shared: failed: Staging failed on 10.213.0.33. Error: Host 10.213.0.32 "
                     "not connected")
    not_in_cluster = "volume start: shared: failed: Host 10.213.0.32 is not in 'Peer in Cluster' state"
    answers = [(1, "", not_connected), (1, not_in_cluster, ""), (0, "volume create: shared: success", "")]
    slept = []
    rc, out, _ = gluster_volume.run_retrying_when_transient(lambda _: answers.pop(0), ["volume", "create"],
                                                            sleep=slept.append)
    assert rc == 0 and "success" in out and slept == [5.0, 5.0]
    assert not gluster_volume.transient_refusal("volume create: shared: failed: Volume shared already exists")


def test_other_failures_and_a_busy_glusterd_that_stays_busy_are_returned():
    calls = []
    def failing(command):
        calls.append(command)
        return 1, "", "volume create: shared: failed: Brick may be containing or be contained by an existing brick"
    assert gluster_volume.run_retrying_when_transient(failing, ["volume", "create"], sleep=lambda _: None)[0] == 1
    assert len(calls) == 1
    busy = gluster_volume.run_retrying_when_transient(lambda _: (1, "", "Another transaction is in progress"), ["x"],
                                                      attempts=3, sleep=lambda _: None)
    assert busy == (1, "", "Another transaction is in progress")


# -- the rebalance after growth ----------------------------------------------------------------------------------
# rebalance_status_completed.xml: what gluster 10.3 printed after molecule/storage's growth (2 x 3, 6 nodes). The
# running and failed cases are that output with one node's status or failure count changed.
REBALANCE = (DATA / "rebalance_status_completed.xml").read_text()


def rebalance_with(node_status=None, failures=None):
    """The real status with the first node's statusStr and/or failures changed."""
    text = REBALANCE
    if node_status is not None:
        text = text.replace("<statusStr>completed</statusStr>", f"<statusStr>{node_status}</statusStr>", 1)
    if failures is not None:
        text = text.replace("<failures>0</failures>", f"<failures>{failures}</failures>", 1)
    return gluster_volume.parse_rebalance_status(text)


def test_rebalance_status_is_read_per_node_and_in_total():
    status = gluster_volume.parse_rebalance_status(REBALANCE)
    assert len(status["nodes"]) == 6
    assert {node["status"] for node in status["nodes"]} == {"completed"}
    assert status["total"]["files"] == sum(node["files"] for node in status["nodes"]) > 0
    assert status["total"]["failures"] == 0 and status["total"]["status"] == "completed"
    assert not gluster_volume.rebalance_running(status) and gluster_volume.rebalance_problem(status) == ""


@pytest.mark.parametrize("node_status", ["in progress", "not started", "fix-layout in progress"])
def test_a_node_still_at_work_keeps_the_rebalance_running(node_status):
    status = rebalance_with(node_status=node_status)
    assert gluster_volume.rebalance_running(status)
    assert gluster_volume.rebalance_problem(status) == ""
    assert "still running" in gluster_volume.rebalance_summary("shared", status, 12.0)
    assert "gluster volume rebalance shared status" in gluster_volume.rebalance_summary("shared", status, 12.0)


@pytest.mark.parametrize(("node_status", "failures", "expected"), [
    ("failed", None, "failed"), ("stopped", None, "stopped"), (None, "3", "files it failed to move: ")])
def test_a_failed_node_or_unmoved_files_are_a_problem_that_names_the_node(node_status, failures, expected):
    status = rebalance_with(node_status=node_status, failures=failures)
    problem = gluster_volume.rebalance_problem(status)
    assert expected in problem and status["nodes"][0]["name"] in problem


def test_a_refused_status_is_an_error():
    with pytest.raises(gluster_volume.GlusterError, match="does not exist"):
        gluster_volume.parse_rebalance_status((DATA / "volume_info_missing.xml").read_text())
    with pytest.raises(gluster_volume.GlusterError, match="no rebalance status"):
        gluster_volume.parse_rebalance_status((DATA / "pool_list.xml").read_text())


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_wait_ends_when_every_node_is_done_and_reports_the_time():
    answers = [rebalance_with(node_status="not started"), rebalance_with(node_status="in progress"),
               gluster_volume.parse_rebalance_status(REBALANCE)]
    clock = FakeClock()
    status, waited = gluster_volume.wait_for_rebalance(lambda: answers.pop(0), 300, every_s=5, sleep=clock.sleep,
                                                       clock=clock)
    assert not answers and waited == 10 and not gluster_volume.rebalance_running(status)
    assert "rebalance finished after 10 s of waiting" in gluster_volume.rebalance_summary("shared", status, waited)


def test_the_wait_stops_at_its_limit_and_at_once_on_a_problem():
    clock = FakeClock()
    running = rebalance_with(node_status="in progress")
    reads = []
    status, waited = gluster_volume.wait_for_rebalance(lambda: reads.append(1) or running, 12, every_s=5,
                                                       sleep=clock.sleep, clock=clock)
    assert waited == 12 and len(reads) == 4 and gluster_volume.rebalance_running(status)
    failed = rebalance_with(node_status="in progress", failures="2")
    status, waited = gluster_volume.wait_for_rebalance(lambda: failed, 300, sleep=clock.sleep, clock=FakeClock())
    assert waited == 0 and gluster_volume.rebalance_problem(status)
    status, waited = gluster_volume.wait_for_rebalance(lambda: running, 0, sleep=clock.sleep, clock=FakeClock())
    assert waited == 0 and gluster_volume.rebalance_running(status)


# -- bricks online before the rebalance; one more start for a node that failed at start -------------------------
# volume_status_grown.xml: `gluster volume status shared --xml` that gluster 10.3 printed in molecule/storage's
# growth (2 x 3 bricks, their rebalance running): bricks, then the self-heal daemons, then the volume's tasks.
VOLUME_STATUS = (DATA / "volume_status_grown.xml").read_text()
BRICKS6 = [f"10.213.0.3{i}:/data/glusterfs/brick1/shared" for i in range(1, 7)]


def with_brick_offline(address):
    """The real status with the brick on `address` not running (as gluster prints a brick that is down)."""
    head, _, tail = VOLUME_STATUS.partition(f"<hostname>{address}</hostname>")
    return head + f"<hostname>{address}</hostname>" + tail.replace("<status>1</status>", "<status>0</status>", 1)


def test_brick_status_lists_bricks_only_and_reads_which_are_online():
    bricks = gluster_volume.parse_brick_status(VOLUME_STATUS)
    assert [entry["brick"] for entry in bricks] == BRICKS6 and all(entry["online"] for entry in bricks)
    assert gluster_volume.offline_bricks(BRICKS6, bricks) == []
    down = gluster_volume.parse_brick_status(with_brick_offline("10.213.0.35"))
    assert [entry["online"] for entry in down] == [True, True, True, True, False, True]
    assert gluster_volume.offline_bricks(BRICKS6, down) == [BRICKS6[4]]
    # A brick gluster does not list at all (not in the volume yet) is offline too.
    assert gluster_volume.offline_bricks([*BRICKS6, "10.213.0.37:/b"], bricks) == ["10.213.0.37:/b"]
    with pytest.raises(gluster_volume.GlusterError, match="does not exist"):
        gluster_volume.parse_brick_status((DATA / "volume_info_missing.xml").read_text())


def test_the_rebalance_waits_for_bricks_until_online_or_its_limit():
    online = gluster_volume.parse_brick_status(VOLUME_STATUS)
    offline = gluster_volume.parse_brick_status(with_brick_offline("10.213.0.36"))
    answers = [offline, offline, online]
    clock = FakeClock()
    still_offline, waited = gluster_volume.wait_for_bricks(lambda: answers.pop(0), BRICKS6, 60, every_s=2,
                                                           sleep=clock.sleep, clock=clock)
    assert still_offline == [] and waited == 4 and not answers
    clock = FakeClock()
    still_offline, waited = gluster_volume.wait_for_bricks(lambda: offline, BRICKS6, 7, every_s=2,
                                                           sleep=clock.sleep, clock=clock)
    assert still_offline == [BRICKS6[5]] and waited == 7


def failed_at_start(status, node_name):
    """The status with node_name's rebalance failed before it looked at a file."""
    for node in status["nodes"]:
        if node["name"] == node_name:
            node.update(status="failed", files=0, skipped=0, failures=0)
    return status


def test_only_a_node_that_failed_before_any_file_is_started_again():
    # 10.213.0.34 looked at no file in the real run; 10.213.0.32 moved 74.
    assert gluster_volume.nodes_that_failed_at_start(failed_at_start(rebalance_with(), "10.213.0.34")) == \
        ["10.213.0.34"]
    midway = rebalance_with(node_status="failed")
    assert midway["nodes"][0]["files"] > 0 and gluster_volume.nodes_that_failed_at_start(midway) == []
    # Files that failed to move elsewhere are not mended by a second start: no restart at all.
    assert gluster_volume.nodes_that_failed_at_start(failed_at_start(rebalance_with(failures="2"), "10.213.0.34")) \
        == []


class FakeModule:
    """run_command and warn, as the module's helpers use them."""
    def __init__(self, rc=0):
        self.rc, self.commands, self.warnings = rc, [], []

    def run_command(self, command):
        self.commands.append(command[2:])
        return self.rc, "", "" if self.rc == 0 else "rebalance start refused"

    def warn(self, message):
        self.warnings.append(message)


# Both cases read answers that end the waits at once (no node at work, or no time left): no sleep happens.
def test_a_failed_start_is_started_again_once_the_others_are_done():
    first = failed_at_start(rebalance_with(node_status="in progress"), "10.213.0.34")
    first_done = failed_at_start(rebalance_with(), "10.213.0.34")
    second = gluster_volume.parse_rebalance_status(REBALANCE)
    answers = [first_done, second]
    module = FakeModule()
    status, waited = gluster_volume.restart_after_failed_start(module, "gluster", "shared", lambda: answers.pop(0),
                                                               first, 3.0, 300)
    assert module.commands == [["volume", "rebalance", "shared", "start"]]
    assert status is second and gluster_volume.rebalance_problem(status) == "" and waited == pytest.approx(3.0, abs=1)
    assert "10.213.0.34" in module.warnings[0] and "started once more" in module.warnings[0]


def test_no_second_start_while_the_wait_runs_out_or_when_gluster_refuses_it():
    running = failed_at_start(rebalance_with(node_status="in progress"), "10.213.0.34")
    module = FakeModule()
    status, _ = gluster_volume.restart_after_failed_start(module, "gluster", "shared", lambda: running, running,
                                                          0.0, 0)
    assert module.commands == [] and gluster_volume.rebalance_problem(status)
    done = failed_at_start(rebalance_with(), "10.213.0.34")
    refusing = FakeModule(rc=1)
    status, _ = gluster_volume.restart_after_failed_start(refusing, "gluster", "shared", lambda: done, done, 0.0, 60)
    assert len(refusing.commands) == 1 and "10.213.0.34 failed" in gluster_volume.rebalance_problem(status)
    assert "rebalance start refused" in refusing.warnings[0]
