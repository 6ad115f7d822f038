"""Hardware profiles: which profile a GPU or network is, what it should reach, and the thresholds of the checks.

The numbers live in hardware_profiles.yaml beside this file. This module needs only PyYAML and the standard
library: `sd3cluster verify` imports it, and Ansible's hardware_profiles filter loads it by path on the control
machine, so both sides apply the same rules to the same data.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DATA_FILE = Path(__file__).with_name("hardware_profiles.yaml")
DEFAULT_FRACTION = 0.8

# Checks with a threshold from the profiles, and the unit of their numbers.
GEMM = "gemm_bf16_tflops"
MEMORY = "memory_bandwidth_gb_s"
INTRA = "intra_node_busbw_gb_s"
INTER = "inter_node_busbw_gb_s"
TRAIN = "train_images_per_s"
UNITS = {GEMM: "TFLOP/s", MEMORY: "GB/s", INTRA: "GB/s", INTER: "GB/s", TRAIN: "images/s per GPU"}
LINK_LAYERS = ("ethernet", "infiniband", "efa")


class ProfileError(ValueError):
    """No profile fits, or a profile, fraction or threshold is wrong; the message names it and the fix."""


@dataclass(frozen=True)
class Expected:
    """What a healthy device should reach in one check, and where that number comes from."""

    value: float
    source: str

    def threshold(self, fraction: float) -> float:
        return self.value * check_fraction(fraction)


def check_fraction(fraction: Any) -> float:
    """The share of the expected value a check needs; 0 would pass anything, above 1 fails healthy nodes."""
    try:
        value = float(fraction)
    except (TypeError, ValueError):
        raise ProfileError(f"threshold fraction {fraction!r} is not a number; use one in (0, 1], e.g. 0.8") from None
    if not 0 < value <= 1:
        raise ProfileError(f"threshold fraction {value} is outside (0, 1]; use e.g. 0.8 (80% of the expected value)")
    return value


def load_profiles(path: Path | str | None = None) -> dict[str, Any]:
    """The profiles file: `path`, else $SD3_HARDWARE_PROFILES (a site's own copy, e.g. with its measured numbers),
    else the one shipped beside this module."""
    path = Path(path or os.environ.get("SD3_HARDWARE_PROFILES") or DATA_FILE)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ProfileError(f"hardware profiles {path} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"hardware profiles {path} are not valid YAML: {e}") from None
    for section in ("achievable", "verify_preset", "links", "gpus", "networks"):
        if not isinstance((data or {}).get(section), dict):
            raise ProfileError(f"hardware profiles {path} have no '{section}' mapping")
    return data


def _known(names: Any) -> str:
    return ", ".join(sorted(names))


def gpu_profile_name(profiles: dict[str, Any], device_name: str | None, override: str | None = None) -> str:
    """The profile of a GPU from the name nvidia-smi (or torch) prints; `override` names one outright."""
    gpus = profiles["gpus"]
    if override not in (None, "", "auto"):
        if override not in gpus:
            raise ProfileError(f"GPU profile '{override}' does not exist; use one of {_known(gpus)}, or 'auto'")
        return str(override)
    name = (device_name or "").strip()
    for key, gpu in gpus.items():
        if any(re.search(pattern, name) for pattern in gpu.get("match", [])):
            return str(key)
    raise ProfileError(f"no hardware profile matches the GPU '{name}'; name one of {_known(gpus)} explicitly "
                       f"(verify.gpu_profile / verify_gpu_profile), or add the model to {DATA_FILE.name}")


def network_profile_name(profiles: dict[str, Any], link_layer: str | None, speed_gbit: Any,
                         override: str | None = None) -> str:
    """The profile of a NIC from its link layer (ethernet, infiniband, efa) and speed in Gbit/s."""
    networks = profiles["networks"]
    if override not in (None, "", "auto"):
        if override not in networks:
            raise ProfileError(f"network profile '{override}' does not exist; use one of {_known(networks)}, or 'auto'")
        return str(override)
    layer = str(link_layer or "").lower()
    if layer not in LINK_LAYERS:
        raise ProfileError(f"link layer {link_layer!r} is none of {', '.join(LINK_LAYERS)}; name the network profile "
                           f"explicitly (one of {_known(networks)})")
    try:
        speed = float(speed_gbit)
    except (TypeError, ValueError):
        speed = -1.0
    for key, net in networks.items():
        if net["link_layer"] == layer and float(net["speed_gbit"]) == speed:
            return str(key)
    raise ProfileError(f"no network profile for {layer} at {speed_gbit} Gbit/s; name one of {_known(networks)} "
                       "explicitly (verify.network_profile / verify_network_profile)")


def _expected(entry: Any, achievable: dict[str, Any] | None) -> Expected | None:
    """measured beats estimate beats datasheet_peak x the achievable fraction."""
    if not isinstance(entry, dict):
        return None
    if entry.get("measured") is not None:
        return Expected(float(entry["measured"]), "measured")
    if entry.get("estimate") is not None:
        return Expected(float(entry["estimate"]), f"estimate: {entry.get('basis', 'no basis given')}")
    if entry.get("datasheet_peak") is not None and achievable is not None:
        share = float(achievable["fraction"])
        return Expected(float(entry["datasheet_peak"]) * share,
                        f"datasheet peak {entry['datasheet_peak']:g} x {share:g} ({achievable['basis']})")
    return None


def link_busbw(profiles: dict[str, Any], link: str, gpus: int) -> Expected | None:
    """Expected intra-node all-reduce bus bandwidth on `gpus` GPUs joined by `link`; None below 2 GPUs."""
    if link not in profiles["links"]:
        raise ProfileError(f"link type '{link}' does not exist; use one of {_known(profiles['links'])}")
    if gpus < 2:
        return None
    entry = profiles["links"][link]["busbw_gb_s"]
    table = {int(k): float(v) for k, v in entry["estimate"].items()}
    fits = [count for count in table if count >= gpus]
    if not fits:  # more GPUs than the link joins (a bridge pairs two cards)
        return None
    return Expected(table[min(fits)], f"estimate for {min(fits)} GPUs on {link}: {entry['basis']}")


def expected_numbers(profiles: dict[str, Any], gpu: str | None, gpus_per_node: int = 1, network: str | None = None,
                     nics: int = 1, link: str | None = None) -> dict[str, Expected | None]:
    """What each check should measure; None where no profile gives a number (that check skips)."""
    achievable = profiles["achievable"]
    out: dict[str, Expected | None] = dict.fromkeys(UNITS)
    if gpu is not None:
        entry = profiles["gpus"][gpu]
        out[GEMM] = _expected(entry.get(GEMM), achievable[GEMM])
        out[MEMORY] = _expected(entry.get(MEMORY), achievable[MEMORY])
        out[TRAIN] = _expected(entry.get(TRAIN), None)
        out[INTRA] = link_busbw(profiles, link or entry["link"], int(gpus_per_node))
    if network is not None:
        if int(nics) < 1:
            raise ProfileError(f"NICs per node must be 1 or more, got {nics}")
        net = profiles["networks"][network]
        share = float(achievable[INTER]["fraction"])
        out[INTER] = Expected(float(net["line_gb_s"]) * share * int(nics),
                              f"{nics} x {net['line_gb_s']:g} GB/s line rate ({network}) x {share:g} "
                              f"({achievable[INTER]['basis']})")
    return out


def thresholds(profiles: dict[str, Any], fraction: float = DEFAULT_FRACTION, **selection: Any) -> dict[str, Any]:
    """expected x fraction per check, with the expected value and its source; None where nothing is expected."""
    share = check_fraction(fraction)
    result: dict[str, Any] = {}
    for check, expected in expected_numbers(profiles, **selection).items():
        result[check] = None if expected is None else {
            "threshold": round(expected.threshold(share), 3), "expected": round(expected.value, 3),
            "fraction": share, "unit": UNITS[check], "source": expected.source}
    return result


def verdict(value: float | None, threshold: float | None) -> str:
    """pass / fail / skip: nothing measured, or nothing to compare with, is a skip and never a pass."""
    if value is None or threshold is None:
        return "skip"
    if threshold <= 0:
        raise ProfileError(f"threshold {threshold} would pass anything; thresholds must be above 0")
    return "pass" if value >= threshold else "fail"


def explain(check: str, value: float | None, threshold: float | None, source: str = "") -> str:
    """One line a person reads: the number, the threshold and where the threshold comes from."""
    unit = UNITS.get(check, "")
    if value is None:
        return f"{check}: not measured"
    if threshold is None:
        return f"{check}: {value:.4g} {unit}, no threshold (no profile number)"
    word = "at least" if value >= threshold else "below the threshold"
    return f"{check}: {value:.4g} {unit}, {word} {threshold:.4g} {unit}" + (f" ({source})" if source else "")


def nic_speed_gbit(raw: Any, link_layer: str = "ethernet") -> float | None:
    """A NIC's speed in Gbit/s from what the system reports: Ethernet in Mbit/s (/sys/class/net/*/speed,
    Ansible's facts), InfiniBand as `200 Gb/sec (4X HDR)` (/sys/class/infiniband/*/ports/*/rate). None: unknown."""
    text = str(raw if raw is not None else "").strip()
    if link_layer == "infiniband":
        match = re.match(r"([\d.]+)\s*Gb/sec", text)
        return float(match.group(1)) if match else None
    try:
        mbit = float(text)
    except ValueError:
        return None
    return mbit / 1000 if mbit > 0 else None  # -1: no link, or a virtual NIC that reports none


def network_from_nics(rdma_ports: list[dict[str, Any]] | None, ethernet_mbit: Any) -> tuple[str, float | None, int]:
    """(link layer, speed in Gbit/s, NICs) of the cluster network from what a node reports: its active RDMA ports
    (/sys/class/infiniband/*/ports/*: link_layer, state, rate) and the cluster interface's Ethernet speed (Mbit/s).

    Active InfiniBand ports carry NCCL when there are any (all at one speed: else the profile must be named);
    RDMA ports of another link layer (EFA reports none) are left to an explicit profile; otherwise the Ethernet
    interface's speed decides, one NIC."""
    active = [p for p in rdma_ports or [] if "ACTIVE" in str(p.get("state", "")).upper()]
    infiniband = [p for p in active if str(p.get("link_layer", "")).lower() == "infiniband"]
    if infiniband:
        speeds = {nic_speed_gbit(p.get("rate"), "infiniband") for p in infiniband}
        if len(speeds) != 1 or None in speeds:
            raise ProfileError(f"InfiniBand ports run at different or unknown speeds ({sorted(map(str, speeds))}); "
                               "name the network profile explicitly")
        return "infiniband", speeds.pop(), len(infiniband)
    unknown = [p for p in active if str(p.get("link_layer", "")).lower() not in ("ethernet", "infiniband")]
    if unknown:
        raise ProfileError(f"RDMA ports with link layer {unknown[0].get('link_layer')!r} (EFA?) cannot be matched by "
                           "speed; name the network profile explicitly (efa, and the NICs per node)")
    return "ethernet", nic_speed_gbit(ethernet_mbit, "ethernet"), 1
