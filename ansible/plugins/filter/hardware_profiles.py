"""Jinja filters over the hardware profiles: a GPU's or a network's profile and the verify thresholds.

The rules and the data are the sd3cluster package's (workloads/src/sd3cluster/hardware.py and
hardware_profiles.yaml); this file loads that module by path, so the control machine needs PyYAML (Ansible's
own dependency) and not the package, and the playbooks and `sd3cluster verify` can never disagree.
"""

import runpy
from pathlib import Path

try:
    from ansible.errors import AnsibleFilterError as _FilterError
except ImportError:  # the unit tests also run without Ansible
    _FilterError = ValueError

_load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
hardware = _load("workloads/src/sd3cluster/hardware.py")


def _guarded(function):
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except hardware.ProfileError as e:
            raise _FilterError(str(e)) from None

    wrapper.__name__ = function.__name__
    wrapper.__doc__ = function.__doc__
    return wrapper


def gpu_profile(device_name, override=None):
    """'NVIDIA H200' -> 'h200'; an unknown name without an override is an error naming the choices."""
    return hardware.gpu_profile_name(hardware.load_profiles(), device_name, override)


def network_profile(link_layer, speed, override=None):
    """('ethernet', 100000 Mbit/s as Ansible's facts give it) or ('infiniband', '400 Gb/sec (4X NDR)') -> a profile."""
    if override not in (None, "", "auto"):
        return hardware.network_profile_name(hardware.load_profiles(), link_layer, None, override)
    gbit = hardware.nic_speed_gbit(speed, str(link_layer or ""))
    return hardware.network_profile_name(hardware.load_profiles(), link_layer, gbit if gbit is not None else speed)


def network_from_nics(probe, override="auto"):
    """The output of verify's nic_probe.py -> {'profile', 'nics', 'link_layer', 'speed_gbit'}. override: 'auto'
    finds the profile from the NICs; 'none' (or '') means no network profile; any other value names one (then the
    NICs per node come from the inventory, nics is None)."""
    if override in ("none", None, ""):
        return {"profile": "", "nics": None, "link_layer": None, "speed_gbit": None}
    profiles = hardware.load_profiles()
    if override != "auto":
        return {"profile": hardware.network_profile_name(profiles, None, None, override), "nics": None,
                "link_layer": None, "speed_gbit": None}
    layer, gbit, nics = hardware.network_from_nics(probe.get("rdma_ports"), probe.get("ethernet_mbit"))
    name = hardware.network_profile_name(profiles, layer, gbit if gbit is not None else "unknown")
    return {"profile": name, "nics": nics, "link_layer": layer, "speed_gbit": gbit}


def verify_thresholds(gpu, gpus_per_node=1, network=None, fraction=hardware.DEFAULT_FRACTION, nics=1, link=None):
    """Per check: threshold (expected x fraction), expected, unit and source; None where no number exists."""
    return hardware.thresholds(hardware.load_profiles(), fraction, gpu=gpu or None, gpus_per_node=int(gpus_per_node),
                               network=network or None, nics=int(nics), link=link or None)


class FilterModule:
    def filters(self):
        return {name: _guarded(f) for name, f in (("gpu_profile", gpu_profile), ("network_profile", network_profile),
                                                  ("network_from_nics", network_from_nics),
                                                  ("verify_thresholds", verify_thresholds))}
