#!/usr/bin/env python3
"""Prints this node's CPU, memory, data-disk and GPU facts as JSON; reads only, changes nothing.

Usage: probe_node.py DATA_PATH
"""
import json
import os
import sys

NVIDIA_VENDOR = "0x10de"
# PCI class codes: 0x0300 VGA-compatible controller, 0x0302 3D controller (data-centre GPUs).
GPU_CLASSES = ("0x0300", "0x0302")


def memory_gb():
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def existing_ancestor(path):
    """The path itself, or its nearest parent that exists (the data disk may not be mounted yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def block_device(path):
    """Name and rotational flag of the block device behind path, or (None, None) when there is none
    (overlay, tmpfs, network or ZFS file systems have no single block device)."""
    dev = os.stat(path).st_dev
    sys_dir = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if os.major(dev) == 0 or not os.path.exists(sys_dir):
        return None, None
    real = os.path.realpath(sys_dir)
    for candidate in (real, os.path.dirname(real)):  # a partition's queue/ lives on its parent disk
        flag = os.path.join(candidate, "queue", "rotational")
        if os.path.exists(flag):
            with open(flag, encoding="ascii") as rotational:
                return os.path.basename(real), rotational.read().strip() == "1"
    return os.path.basename(real), None


def nvidia_gpus():
    count = 0
    root = "/sys/bus/pci/devices"
    for device in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, device, "vendor"), encoding="ascii") as vendor, \
                    open(os.path.join(root, device, "class"), encoding="ascii") as klass:
                if vendor.read().strip() == NVIDIA_VENDOR and klass.read().strip()[:6] in GPU_CLASSES:
                    count += 1
        except OSError:
            continue
    return count


def main():
    data_path = existing_ancestor(sys.argv[1] if len(sys.argv) > 1 else "/")
    stats = os.statvfs(data_path)
    device, rotational = block_device(data_path)
    json.dump({
        "cpu_cores": os.cpu_count() or 0,
        "memory_gb": round(memory_gb(), 2),
        "disk_path": data_path,
        "disk_free_gb": round(stats.f_bavail * stats.f_frsize / 1e9, 2),
        "disk_device": device,
        "disk_rotational": rotational,
        "nvidia_gpus": nvidia_gpus(),
    }, sys.stdout)


if __name__ == "__main__":
    main()
