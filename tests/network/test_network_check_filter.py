"""The network check's rules (ansible/plugins/filter/network_check.py): the pairs iperf3 measures, and the verdict
on each pair, with messages that name the pair, the measurement, the variable and the fix."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
load = runpy.run_path(str(REPO / "ansible" / "plugins" / "module_utils" / "source_tree.py"))["load"]
check = load("ansible/plugins/filter/network_check.py")

HOSTS = ["n1", "n2", "n3"]
ADDRESSES = {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}
GOOD_PING = {"reachable": True, "loss_pct": 0.0, "rtt_min_ms": 0.05, "rtt_avg_ms": 0.08, "rtt_max_ms": 0.2,
             "mtu_ok": True, "mtu_payload": 8972}


def hostvars(pings=None, bare=()):
    """Inventory variables with each host's registered pings: {source: {peer: ping fields}}."""
    pings = pings or {}
    result = {}
    for host in HOSTS:
        variables = {"cluster_address": ADDRESSES[host]}
        if host not in bare:
            rows = [{"peer": peer, "address": ADDRESSES[peer], **GOOD_PING, **pings.get(host, {}).get(peer, {})}
                    for peer in HOSTS if peer != host]
            variables["__network_check_pings"] = {"stdout": json.dumps(rows)}
        result[host] = variables
    return result


def iperf(source, target, rc=0, **fields):
    run = {"item": {"source": source, "target": target}, "rc": rc}
    if rc == 0:
        run["stdout"] = json.dumps({"gbps": 9.41, "retransmits": 3, **fields})
    else:
        run.update(fields)
    return run


def verdict(variables, runs=(), max_rtt_ms=1.0, min_gbps=5.0, mtu=9000):
    return check.network_check_verdict(HOSTS, variables, list(runs), max_rtt_ms, min_gbps, mtu)


def test_all_pairs_and_the_ring_in_play_order_with_target_addresses():
    every = check.network_check_pair_list(HOSTS, "all", hostvars())
    assert [(p["source"], p["target"]) for p in every] == [
        ("n1", "n2"), ("n1", "n3"), ("n2", "n1"), ("n2", "n3"), ("n3", "n1"), ("n3", "n2")]
    ring = check.network_check_pair_list(HOSTS, "ring", hostvars())
    assert ring == [{"source": "n1", "target": "n2", "target_address": "10.0.0.2"},
                    {"source": "n2", "target": "n3", "target_address": "10.0.0.3"},
                    {"source": "n3", "target": "n1", "target_address": "10.0.0.1"}]
    assert check.network_check_pair_list(["n1"], "all", hostvars()) == []


def test_a_good_network_passes_with_every_measurement_in_its_pair():
    report = verdict(hostvars(), [iperf("n1", "n2")])
    assert report["passed"] is True and report["problems"] == [] and len(report["pairs"]) == 6
    first = report["pairs"][0]
    assert first == {"source": "n1", "target": "n2", "source_address": "10.0.0.1", "target_address": "10.0.0.2",
                     "rtt_min_ms": 0.05, "rtt_avg_ms": 0.08, "rtt_max_ms": 0.2, "loss_pct": 0.0, "mtu_ok": True,
                     "gbps": 9.41, "retransmits": 3, "problems": [], "ok": True}
    # A pair iperf3 did not measure (ring mode) has no bandwidth and no problem for it.
    assert report["pairs"][1]["gbps"] is None and report["pairs"][1]["ok"] is True


@pytest.mark.parametrize("ping, runs, expected", [
    ({"rtt_avg_ms": 2.5}, [], "n1 -> n2 (10.0.0.2): round trip 2.500 ms, above 1.0 ms (network_check_max_rtt_ms): put "
     "the nodes on one switch, find the congested link, or raise the threshold"),
    ({"mtu_ok": False}, [], "n1 -> n2 (10.0.0.2): a ping of 8972 bytes with don't-fragment (MTU 9000 minus 28, "
     "network_check_mtu) did not pass: set that MTU on both interfaces and every switch port between them"),
    ({"reachable": False, "loss_pct": 100.0, "rtt_avg_ms": None}, [], "n1 -> n2 (10.0.0.2): no answer to ping (100.0% "
     "lost): check the node is up and ICMP is allowed between nodes"),
    ({"error": "ping is not installed"}, [], "n1 -> n2 (10.0.0.2): ping is not installed"),
    ({}, [iperf("n1", "n2", gbps=1.234)], "n1 -> n2 (10.0.0.2): 1.23 Gbit/s, below 5.0 Gbit/s "
     "(network_check_min_gbps): check link speed and duplex (ethtool), cabling and the switch, or lower the threshold"),
    ({}, [iperf("n1", "n2", rc=1, stderr="  connection refused\n")], "n1 -> n2 (10.0.0.2): bandwidth not measured: "
     "netcheck.py failed on n1: connection refused"),
    ({}, [iperf("n1", "n2", rc=1, msg="unreachable")], "netcheck.py failed on n1: unreachable"),
    ({}, [iperf("n1", "n2", rc=2)], "netcheck.py failed on n1: no output"),
    ({}, [iperf("n1", "n2", error="iperf3 server busy")],
     "n1 -> n2 (10.0.0.2): bandwidth not measured: iperf3 server busy"),
])
def test_each_miss_is_one_problem_of_its_pair_only(ping, runs, expected):
    report = verdict(hostvars({"n1": {"n2": ping}}), runs)
    assert report["passed"] is False
    assert len(report["problems"]) == 1 and expected in report["problems"][0], report["problems"]
    bad = [pair for pair in report["pairs"] if not pair["ok"]]
    assert [(p["source"], p["target"]) for p in bad] == [("n1", "n2")] and bad[0]["problems"] == report["problems"]


def test_an_unreachable_peer_is_not_also_judged_on_round_trip_or_mtu():
    report = verdict(hostvars({"n2": {"n3": {"reachable": False, "loss_pct": 100.0, "rtt_avg_ms": 99.0,
                                             "mtu_ok": False}}}))
    assert len(report["problems"]) == 1 and "no answer to ping" in report["problems"][0]


def test_thresholds_given_as_text_by_extra_vars_are_read_as_numbers():
    report = verdict(hostvars({"n1": {"n2": {"rtt_avg_ms": 2.5}}}), [iperf("n1", "n2", gbps=4.0)],
                     max_rtt_ms="3", min_gbps="4.5", mtu="9000")
    assert report["problems"] == ["n1 -> n2 (10.0.0.2): 4.00 Gbit/s, below 4.5 Gbit/s (network_check_min_gbps): check "
                                  "link speed and duplex (ethtool), cabling and the switch, or lower the threshold"]


def test_a_host_that_ran_no_ping_adds_no_pair():
    report = verdict(hostvars(bare=("n3",)))
    assert {pair["source"] for pair in report["pairs"]} == {"n1", "n2"} and report["passed"] is True


def test_good_settings_have_no_problem_and_extra_vars_text_is_read_as_numbers():
    assert check.network_check_input_problems("n1", "ring", "10", "9000", "n1", HOSTS) == []
    assert check.network_check_input_problems("n1", "all", 1, 1280, "n3", HOSTS) == []


@pytest.mark.parametrize("settings, expected", [
    ({"pairs_mode": "mesh"}, "n1: network_check_pairs is 'mesh': use all or ring"),
    ({"iperf_seconds": 0}, "n1: network_check_iperf_seconds is 0: use a whole number from 1 to 60"),
    ({"iperf_seconds": "61"}, "n1: network_check_iperf_seconds is '61': use a whole number from 1 to 60"),
    ({"iperf_seconds": "ten"}, "network_check_iperf_seconds is 'ten'"),
    ({"mtu": 1000}, "n1: network_check_mtu is 1000: use the cluster network's MTU, at least 1280"),
    ({"report_host": "n9"}, "n1: network_check_report_host 'n9' is not a host of this play: name one of n1, n2, n3"),
])
def test_each_bad_setting_is_named_alone(settings, expected):
    given = {"pairs_mode": "all", "iperf_seconds": 10, "mtu": 9000, "report_host": "n1", **settings}
    problems = check.network_check_input_problems("n1", given["pairs_mode"], given["iperf_seconds"], given["mtu"],
                                                  given["report_host"], HOSTS)
    assert len(problems) == 1 and expected in problems[0], problems
