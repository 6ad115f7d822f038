#!/usr/bin/env python3
"""Pings every peer in parallel, once plainly and once with don't-fragment at the cluster MTU, and
prints one JSON object per peer. Reads only, changes nothing.

Usage: ping_peers.py --count N --mtu MTU NAME=ADDRESS [NAME=ADDRESS ...]
"""
import argparse
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# IPv4 header (20 bytes) plus ICMP header (8 bytes): a payload of MTU - 28 fills one frame exactly.
IPV4_ICMP_OVERHEAD = 28
RTT = re.compile(r"= [\d.]+/([\d.]+)/")


def ping(address, count, payload=None):
    cmd = ["ping", "-n", "-q", "-c", str(count), "-i", "0.2", "-W", "1"]
    if payload is not None:
        cmd += ["-M", "do", "-s", str(payload)]
    result = subprocess.run([*cmd, address], capture_output=True, text=True, timeout=10 + 2 * count, check=False)
    match = RTT.search(result.stdout)
    return result.returncode == 0, float(match.group(1)) if match else None


def check(peer, address, count, mtu):
    report = {"peer": peer, "address": address, "reachable": False, "rtt_avg_ms": None,
              "mtu_payload": mtu - IPV4_ICMP_OVERHEAD, "mtu_ok": False, "error": None}
    try:
        report["reachable"], report["rtt_avg_ms"] = ping(address, count)
        if report["reachable"]:
            report["mtu_ok"], _ = ping(address, count, report["mtu_payload"])
    except (OSError, subprocess.TimeoutExpired) as err:
        report["error"] = f"ping failed to run: {err}"
    return report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=3)
    parser.add_argument("--mtu", type=int, required=True)
    parser.add_argument("peers", nargs="*")
    args = parser.parse_args()
    peers = [item.split("=", 1) for item in args.peers]
    if shutil.which("ping") is None:
        reports = [{"peer": p, "address": a, "error": "ping is not installed on this node: install iputils-ping"}
                   for p, a in peers]
    else:
        with ThreadPoolExecutor(max_workers=16) as pool:
            reports = list(pool.map(lambda pa: check(pa[0], pa[1], args.count, args.mtu), peers))
    json.dump(reports, sys.stdout)


if __name__ == "__main__":
    main()
