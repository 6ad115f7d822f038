"""Serving on the converged local cluster: `sd3cluster serve` workers on the gpu_nodes behind nginx on the head.

An open-loop load (bounded in count and time) goes only to the head's balancer, on the project's podman network.
During it, one node's worker is stopped (SIGTERM: it drains), and in a second load killed (SIGKILL: in-flight
requests die with it and systemd restarts it). Every request must still be answered 200: the balancer retries
on the other worker, the active checker marks the stopped one down. Prometheus on the head must have the
service's metrics of every worker, and a second run of the inference play must change nothing.
Runs after site.yml (test_local_cluster.py), in `make e2e-full`.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest
from e2e_support import REPO, inventory, node, playbook, wait_for

sys.path.insert(0, str(REPO / "workloads" / "src"))  # this worktree's sd3cluster, not an installed one
from sd3cluster.loadgen import open_loop, summarize

pytestmark = [pytest.mark.cluster, pytest.mark.full]

BALANCER_PORT = 8080
WORKER_PORT = 8100
# Well under a second of the tiny model on a busy 2-core host: one worker alone keeps up with the rate, so any
# answer but 200 is the balancer's fault, not overload.
BODY = {"prompt": "a lighthouse in a storm", "size": 64, "steps": 8}
RATE, COUNT = 1.0, 30
STATE = "/run/sd3-inference-health/state.json"
UPSTREAM = "/etc/nginx/sd3-inference/upstream.conf"


def address(host: str) -> str:
    return inventory()["all"]["hosts"][host]["ansible_host"]


def groups() -> tuple[str, list[str]]:
    children = inventory()["all"]["children"]
    return next(iter(children["head"]["hosts"])), list(children["gpu_nodes"]["hosts"])


def get(url: str, timeout: float = 5) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, {}
    except OSError:
        return 0, {}


def checker_state(head: str) -> dict:
    return json.loads(node(head, f"cat {STATE}"))


def prometheus(head: str, query: str) -> list[dict]:
    url = f"http://{address(head)}:9090/api/v1/query?" + urllib.parse.urlencode({"query": query})
    code, answer = get(url)
    assert code == 200, f"Prometheus answered {code} to {query}"
    return answer["data"]["result"]


def converge():
    return playbook("site.yml", "--tags", "inference", timeout=1200)


def load_with(head: str, action, after: int) -> tuple[list, float, int]:
    """The open-loop load against the balancer; `action` runs in a thread once `after` answers have come.
    Also returns how many of the load's requests nginx passed on to a second worker (its access log)."""
    log = "/var/log/nginx/sd3-inference.access.log"
    lines_before = int(node(head, f"wc -l < {log}").strip())
    started: list[float] = []
    lock = threading.Lock()

    def on_answer(_answer) -> None:
        with lock:
            on_answer.count += 1
            if on_answer.count == after and not started:
                started.append(time.monotonic())
                threading.Thread(target=action, daemon=True).start()

    on_answer.count = 0
    begin = time.monotonic()
    answers = open_loop(f"http://{address(head)}:{BALANCER_PORT}", BODY, RATE, COUNT, timeout_s=90,
                        on_answer=on_answer)
    assert started, "the load ended before the worker was stopped"
    lines = node(head, f"tail -n +{lines_before + 1} {log}").splitlines()
    retried = sum(1 for line in lines if "POST /v1/images/generations" in line and re.search(r"worker=\S+, ", line))
    return answers, started[0] - begin, retried


def test_the_balancer_routes_around_a_stopped_and_a_killed_worker():
    head, gpu_nodes = groups()
    assert len(gpu_nodes) >= 2, gpu_nodes
    victim, survivor = gpu_nodes[-1], gpu_nodes[0]
    names = {host: f"{host}-cpu0" for host in gpu_nodes}  # CPU nodes: one worker each

    # The play converges (a node restarted by an earlier test comes back) and a second run changes nothing.
    converge()
    converge().assert_unchanged("the second inference run")

    wait_for("every worker up in the checker", lambda: all(
        checker_state(head).get(names[h], {}).get("up") for h in gpu_nodes), 120)
    assert get(f"http://{address(head)}:{BALANCER_PORT}/readyz")[0] == 200

    # A few requests through the balancer reach every worker; Prometheus then has each one's request counter.
    for _ in range(2 * len(gpu_nodes)):
        request = urllib.request.Request(f"http://{address(head)}:{BALANCER_PORT}/v1/images/generations",
                                         json.dumps({"prompt": "warm"}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200
    query = 'sd3_serve_requests_total{job="sd3-inference", route="/v1/images/generations", code="200"}'
    seen = wait_for("Prometheus to scrape every worker's request counter", lambda: {
        r["metric"]["worker"] for r in prometheus(head, query) if float(r["value"][1]) > 0} >= set(names.values())
        and prometheus(head, query), 90, 3)
    assert {r["metric"]["instance"] for r in seen} == {f"{h}:{WORKER_PORT}" for h in gpu_nodes}

    # 1. SIGTERM during the load: the worker drains, the checker takes it out, the survivor takes the rest.
    def stop() -> None:
        node(victim, "systemctl stop sd3-inference@0", timeout=180)

    answers, stopped_at, retried = load_with(head, stop, COUNT // 3)
    report = summarize(answers, RATE)
    print(f"\n[inference] stop of {names[victim]} at {stopped_at:.1f} s, {retried} request(s) retried on another "
          f"worker: {json.dumps(report)}")
    assert report["codes"] == {"200": COUNT}, report  # every request answered, none lost or refused
    assert node(victim, "systemctl show -p ExecMainStatus --value sd3-inference@0").strip() == "0"  # a clean drain
    assert get(f"http://{address(victim)}:{WORKER_PORT}/readyz", timeout=3)[0] != 200
    wait_for("the checker to mark the stopped worker down", lambda: checker_state(head)[names[victim]]["up"] is False,
             30)
    upstream = node(head, f"cat {UPSTREAM}")
    assert re.search(rf"server {re.escape(address(victim))}:{WORKER_PORT} down;", upstream), upstream
    assert re.search(rf"server {re.escape(address(survivor))}:{WORKER_PORT} max_fails", upstream), upstream

    node(victim, "systemctl start sd3-inference@0")
    wait_for("the restarted worker back in the upstream block", lambda: checker_state(head)[names[victim]]["up"], 120)

    # 2. SIGKILL during the load: requests in flight on it fail there and are retried on the survivor;
    #    systemd restarts the worker (Restart=on-failure).
    restarts = int(node(victim, "systemctl show -p NRestarts --value sd3-inference@0").strip())

    def kill() -> None:
        node(victim, "systemctl kill -s SIGKILL sd3-inference@0")

    answers, killed_at, retried = load_with(head, kill, COUNT // 3)
    report = summarize(answers, RATE)
    print(f"[inference] kill of {names[victim]} at {killed_at:.1f} s, {retried} request(s) retried on another "
          f"worker: {json.dumps(report)}")
    assert report["codes"] == {"200": COUNT}, report
    wait_for("systemd to restart the killed worker", lambda: int(node(
        victim, "systemctl show -p NRestarts --value sd3-inference@0").strip()) > restarts, 60)
    wait_for("the killed worker ready and back in the upstream block",
             lambda: checker_state(head)[names[victim]]["up"], 180)
    assert "down;" not in node(head, f"cat {UPSTREAM}")
