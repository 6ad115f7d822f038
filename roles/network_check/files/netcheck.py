#!/usr/bin/env python3
"""Measures the network from this node and prints JSON; changes nothing.

  netcheck.py ping --count N --mtu MTU NAME=ADDRESS ...
      latency to every peer (in parallel) and whether a don't-fragment ping of MTU - 28 bytes passes
  netcheck.py iperf --server ADDRESS --port P --seconds S
      TCP throughput from this node to an iperf3 server, retried while the server is busy or starting
"""
import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# IPv4 header (20 bytes) plus ICMP header (8 bytes): a payload of MTU - 28 fills one frame exactly.
IPV4_ICMP_OVERHEAD = 28
RTT = re.compile(r"= ([\d.]+)/([\d.]+)/([\d.]+)")
LOSS = re.compile(r"([\d.]+)% packet loss")
# iperf3 answers these while the server finishes the previous test or has not bound its port yet.
RETRYABLE = ("busy", "Connection refused", "unable to connect", "unable to receive")


def ping(address, count, payload=None):
    cmd = ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-W", "1"]
    if payload is not None:
        cmd += ["-M", "do", "-s", str(payload)]
    result = subprocess.run([*cmd, address], capture_output=True, text=True, timeout=10 + 2 * count, check=False)
    rtt = RTT.search(result.stdout)
    loss = LOSS.search(result.stdout)
    return {
        "ok": result.returncode == 0,
        "rtt_ms": [float(v) for v in rtt.groups()] if rtt else None,
        "loss_pct": float(loss.group(1)) if loss else 100.0,
    }


def ping_peer(peer, address, count, mtu):
    report = {"peer": peer, "address": address, "reachable": False, "rtt_min_ms": None, "rtt_avg_ms": None,
              "rtt_max_ms": None, "loss_pct": 100.0, "mtu_payload": mtu - IPV4_ICMP_OVERHEAD, "mtu_ok": False,
              "error": None}
    try:
        plain = ping(address, count)
        report["reachable"], report["loss_pct"] = plain["ok"], plain["loss_pct"]
        if plain["rtt_ms"]:
            report["rtt_min_ms"], report["rtt_avg_ms"], report["rtt_max_ms"] = plain["rtt_ms"]
        if plain["ok"]:
            report["mtu_ok"] = ping(address, count, report["mtu_payload"])["ok"]
    except (OSError, subprocess.TimeoutExpired) as err:
        report["error"] = f"ping failed to run: {err}"
    return report


def cmd_ping(args):
    peers = [item.split("=", 1) for item in args.peers]
    if shutil.which("ping") is None:
        return [{"peer": p, "address": a, "error": "ping is not installed: install iputils-ping"} for p, a in peers]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda pa: ping_peer(pa[0], pa[1], args.count, args.mtu), peers))


def cmd_iperf(args):
    report = {"server": args.server, "gbps": None, "retransmits": None, "seconds": args.seconds, "error": None}
    if shutil.which("iperf3") is None:
        report["error"] = "iperf3 is not installed on the client: install the iperf3 package"
        return report
    cmd = ["iperf3", "--client", args.server, "--port", str(args.port), "--time", str(args.seconds),
           "--json", "--connect-timeout", "3000"]
    for attempt in range(args.attempts):
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=args.seconds + 20, check=False)
            data = json.loads(result.stdout or "{}")
        except subprocess.TimeoutExpired:
            report["error"] = f"iperf3 did not finish within {args.seconds + 20} s"
            return report
        except json.JSONDecodeError:
            data = {"error": (result.stderr or result.stdout).strip() or f"iperf3 exited with {result.returncode}"}
        if "error" not in data:
            end = data.get("end", {})
            received = end.get("sum_received", {})
            report["gbps"] = round(received.get("bits_per_second", 0.0) / 1e9, 3)
            report["retransmits"] = end.get("sum_sent", {}).get("retransmits")
            report["error"] = None
            return report
        report["error"] = f"iperf3: {data['error']}"
        if not any(word in data["error"] for word in RETRYABLE) or attempt + 1 == args.attempts:
            break
        time.sleep(1)
    return report


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ping")
    p.add_argument("--count", type=int, default=5)
    p.add_argument("--mtu", type=int, required=True)
    p.add_argument("peers", nargs="*")
    i = sub.add_parser("iperf")
    i.add_argument("--server", required=True)
    i.add_argument("--port", type=int, default=5201)
    i.add_argument("--seconds", type=int, default=2)
    i.add_argument("--attempts", type=int, default=5)
    args = parser.parse_args()
    json.dump(cmd_ping(args) if args.command == "ping" else cmd_iperf(args), sys.stdout)


if __name__ == "__main__":
    main()
