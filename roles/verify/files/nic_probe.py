#!/usr/bin/env python3
"""Prints the NICs NCCL may use on this node as JSON: the RDMA ports (/sys/class/infiniband) and the speed of
the interface that holds the cluster address. Reads only.

    nic_probe.py CLUSTER_ADDRESS
"""
import json
import subprocess
import sys
from pathlib import Path


def read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def rdma_ports():
    ports = []
    for port in sorted(Path("/sys/class/infiniband").glob("*/ports/*")):
        ports.append({"device": port.parent.parent.name, "port": port.name, "link_layer": read(port / "link_layer"),
                      "state": read(port / "state"), "rate": read(port / "rate")})
    return ports


def ethernet_mbit(address: str):
    done = subprocess.run(["ip", "-o", "addr", "show", "to", address], capture_output=True, text=True, check=False)
    fields = done.stdout.split()
    if done.returncode != 0 or len(fields) < 2:
        return None
    return read(Path("/sys/class/net") / fields[1] / "speed") or None


print(json.dumps({"rdma_ports": rdma_ports(), "ethernet_mbit": ethernet_mbit(sys.argv[1])}))
