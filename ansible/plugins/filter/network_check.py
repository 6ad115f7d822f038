"""The network check's rules (roles/network_check): its settings, which ordered pairs iperf3 measures, and the
verdict on every pair from the pings each host ran and the iperf3 runs, each judged against the thresholds. Each
problem is one sentence naming the pair, what was measured, the variable and the fix. Unit-tested in tests/network."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

# Filters cannot import module_utils or each other: the repository's Python comes through module_utils/source_tree.py.
_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
cluster_address = _load("ansible/plugins/filter/cluster_network.py").cluster_address
whole_number = _load("ansible/plugins/module_utils/values.py").whole_number

PAIR_MODES = ("all", "ring")
# iperf3's run per pair, in seconds: long enough to leave TCP's slow start, short enough for a ring of many nodes.
IPERF_SECONDS = (1, 60)
# The least MTU the check accepts: IPv6's minimum link MTU.
LEAST_MTU = 1280


def network_check_input_problems(host, pairs_mode, iperf_seconds, mtu, report_host, play_hosts):
    """The check's settings that cannot work, one sentence each naming the variable and what to give; []: fine."""
    problems = []
    if pairs_mode not in PAIR_MODES:
        problems.append(f"{host}: network_check_pairs is '{pairs_mode}': use {' or '.join(PAIR_MODES)}")
    seconds = whole_number(iperf_seconds)
    if seconds is None or not IPERF_SECONDS[0] <= seconds <= IPERF_SECONDS[1]:
        problems.append(f"{host}: network_check_iperf_seconds is {iperf_seconds!r}: use a whole number from "
                        f"{IPERF_SECONDS[0]} to {IPERF_SECONDS[1]}")
    if whole_number(mtu) is None or whole_number(mtu) < LEAST_MTU:
        problems.append(f"{host}: network_check_mtu is {mtu!r}: use the cluster network's MTU, at least {LEAST_MTU}")
    if report_host not in list(play_hosts):
        problems.append(f"{host}: network_check_report_host '{report_host}' is not a host of this play: name one of "
                        f"{', '.join(play_hosts)}")
    return problems


def network_check_pair_list(hosts, mode, hostvars):
    """The ordered pairs iperf3 measures, [{source, target, target_address}]: every one (mode all) or each host
    to the next in the play's order, the last to the first (mode ring)."""
    hosts = list(hosts)
    pairs = []
    for index, source in enumerate(hosts):
        next_one = hosts[(index + 1) % len(hosts)]
        for target in hosts:
            if source != target and (mode == "all" or target == next_one):
                pairs.append({"source": source, "target": target, "target_address": cluster_address(target, hostvars)})
    return pairs


def _json(text, empty):
    return json.loads(text) if text else empty


def _iperf_by_pair(iperf_results):
    """{'source>target': netcheck.py's answer, or {'error': why there is none}} from the registered loop."""
    measured = {}
    for run in iperf_results or []:
        item = run.get("item") or {}
        if run.get("rc", 1) == 0:
            result = _json(run.get("stdout"), {})
        else:
            why = run.get("stderr")
            why = run.get("msg", "no output") if why is None else why
            result = {"error": f"netcheck.py failed on {item.get('source')}: {str(why).strip()}"}
        measured[f"{item.get('source')}>{item.get('target')}"] = result
    return measured


def _pair_problems(pair, ping, bandwidth, max_rtt_ms, min_gbps, mtu):
    problems = []
    if ping.get("error"):
        problems.append(f"{pair}: {ping['error']}")
    elif not ping.get("reachable"):
        problems.append(f"{pair}: no answer to ping ({ping.get('loss_pct')}% lost): check the node is up and ICMP is "
                        "allowed between nodes")
    else:
        if float(ping["rtt_avg_ms"]) > float(max_rtt_ms):
            problems.append(f"{pair}: round trip {float(ping['rtt_avg_ms']):.3f} ms, above {max_rtt_ms} ms "
                            "(network_check_max_rtt_ms): put the nodes on one switch, find the congested link, or "
                            "raise the threshold")
        if not ping.get("mtu_ok"):
            problems.append(f"{pair}: a ping of {ping.get('mtu_payload')} bytes with don't-fragment (MTU {mtu} minus "
                            "28, network_check_mtu) did not pass: set that MTU on both interfaces and every switch "
                            "port between them")
    if bandwidth.get("error"):
        problems.append(f"{pair}: bandwidth not measured: {bandwidth['error']}")
    elif bandwidth.get("gbps") is not None and float(bandwidth["gbps"]) < float(min_gbps):
        problems.append(f"{pair}: {float(bandwidth['gbps']):.2f} Gbit/s, below {min_gbps} Gbit/s "
                        "(network_check_min_gbps): check link speed and duplex (ethtool), cabling and the switch, or "
                        "lower the threshold")
    return problems


def network_check_verdict(hosts, hostvars, iperf_results, max_rtt_ms, min_gbps, mtu):
    """{pairs, problems, passed}: one entry per ordered pair that a host pinged (its registered
    __network_check_pings: netcheck.py's JSON list), with the bandwidth iperf3 measured for it where it ran."""
    bandwidths = _iperf_by_pair(iperf_results)
    pairs, problems = [], []
    for source in hosts:
        registered = hostvars[source].get("__network_check_pings") or {}
        for ping in _json(registered.get("stdout"), []):
            pair = f"{source} -> {ping['peer']} ({ping['address']})"
            bandwidth = bandwidths.get(f"{source}>{ping['peer']}", {})
            found = _pair_problems(pair, ping, bandwidth, max_rtt_ms, min_gbps, mtu)
            problems.extend(found)
            pairs.append({"source": source, "target": ping["peer"], "source_address": cluster_address(source, hostvars),
                          "target_address": ping["address"], "rtt_min_ms": ping.get("rtt_min_ms"),
                          "rtt_avg_ms": ping.get("rtt_avg_ms"), "rtt_max_ms": ping.get("rtt_max_ms"),
                          "loss_pct": ping.get("loss_pct"), "mtu_ok": ping.get("mtu_ok", False),
                          "gbps": bandwidth.get("gbps"), "retransmits": bandwidth.get("retransmits"),
                          "problems": found, "ok": not found})
    return {"pairs": pairs, "problems": problems, "passed": not problems}


class FilterModule:
    def filters(self):
        return {"network_check_input_problems": network_check_input_problems,
                "network_check_pair_list": network_check_pair_list, "network_check_verdict": network_check_verdict}
