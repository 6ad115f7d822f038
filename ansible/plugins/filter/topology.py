"""Filters over the storage topology rules of ansible/plugins/module_utils/topology.py (one copy of the
replica-set rule for roles, playbooks, the gluster modules and preflight)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_MODULE = Path(__file__).resolve().parents[1] / "module_utils" / "topology.py"
_spec = importlib.util.spec_from_file_location("sd3cluster_topology", _MODULE)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])
topology = sys.modules[_spec.name]


def gluster_bricks(addresses, bricks_per_node, brick_root, volume):
    """Every brick of a volume as host:/path, in the order that keeps each replica set on different servers."""
    return topology.brick_order(list(addresses), bricks_per_node, brick_root, volume)


class FilterModule:
    def filters(self):
        return {"gluster_bricks": gluster_bricks}
