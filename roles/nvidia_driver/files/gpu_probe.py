#!/usr/bin/env python3
"""Prints what this node holds for the NVIDIA driver as JSON: GPUs and NVSwitches on the PCI bus,
whether nouveau or the nvidia module is loaded, Secure Boot, the running kernel. Reads only.

Usage: gpu_probe.py
"""
import json
import os
import platform
import shutil
import subprocess
import sys

NVIDIA_VENDOR = "0x10de"
# PCI class codes: 0x0300 VGA-compatible controller, 0x0302 3D controller (data-centre GPUs),
# 0x0680 other bridge (NVSwitch).
GPU_CLASSES = ("0x0300", "0x0302")
NVSWITCH_CLASS = "0x0680"
# Turing (TU10x/TU11x) and every later generation have device ids from 0x1e00 on; Volta, Pascal and
# older lie below. NVIDIA's open kernel modules support Turing and newer only.
FIRST_TURING_DEVICE_ID = 0x1E00
SECURE_BOOT_VAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"


def read(path):
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


def pci_devices():
    root = "/sys/bus/pci/devices"
    gpus, nvswitches = [], 0
    for slot in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if read(os.path.join(root, slot, "vendor")) != NVIDIA_VENDOR:
            continue
        klass = (read(os.path.join(root, slot, "class")) or "")[:6]
        device = read(os.path.join(root, slot, "device")) or "0x0"
        if klass in GPU_CLASSES:
            turing_or_newer = int(device, 16) >= FIRST_TURING_DEVICE_ID
            gpus.append({"slot": slot, "device_id": device, "turing_or_newer": turing_or_newer})
        elif klass == NVSWITCH_CLASS:
            nvswitches += 1
    return gpus, nvswitches


def secure_boot():
    """True or False when known, None on a machine without EFI (legacy BIOS boots have no Secure Boot)."""
    if shutil.which("mokutil"):
        result = subprocess.run(["mokutil", "--sb-state"], capture_output=True, text=True, check=False)
        text = (result.stdout + result.stderr).lower()
        if "enabled" in text:
            return True
        if "disabled" in text or "not supported" in text:
            return False
    try:
        with open(SECURE_BOOT_VAR, "rb") as var:
            # 4 bytes of attributes, then the value.
            return var.read()[4:5] == b"\x01"
    except OSError:
        return False if os.path.isdir("/sys/firmware/efi") else None


def main():
    gpus, nvswitches = pci_devices()
    json.dump({
        "gpus": gpus,
        "gpu_count": len(gpus),
        "all_turing_or_newer": bool(gpus) and all(gpu["turing_or_newer"] for gpu in gpus),
        "nvswitch_count": nvswitches,
        "nouveau_loaded": os.path.isdir("/sys/module/nouveau"),
        "nvidia_loaded": os.path.exists("/proc/driver/nvidia/version"),
        "nvidia_module_version": read("/sys/module/nvidia/version"),
        "secure_boot": secure_boot(),
        "kernel": platform.release(),
        "nvidia_smi": shutil.which("nvidia-smi"),
    }, sys.stdout)


if __name__ == "__main__":
    main()
