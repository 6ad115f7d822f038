"""The one way the controller-side plugins load this repository's own Python: by its path in the tree.

Ansible loads each filter and action plugin file on its own, outside any package, and makes module_utils
importable (`from ansible.module_utils.topology import ...`) only inside the modules it ships to a node: a
filter or an action plugin that imports `ansible.module_utils.apt_rules` is skipped with "No module named".
So the filters and action plugins reach the shared rules (module_utils/*.py, another filter's rules, the
sd3cluster package's hardware.py) through load(). Modules keep the plain `ansible.module_utils` import.

A plugin gets load() with the standard library alone (this file cannot be imported either):

    _load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "module_utils" / "source_tree.py"))["load"]
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def module_name(relative_path):
    """The name a file is loaded under: one per file, so every plugin of a run shares one copy of it."""
    return "sd3cluster_tree_" + re.sub(r"\W", "_", Path(relative_path).with_suffix("").as_posix())


def load(relative_path):
    """The module of the file at relative_path (from the repository's root), loaded once per process.

    It is registered in sys.modules before it runs: dataclasses look their module up there while a class is
    made, and every plugin then shares one copy (one exception class, one cache)."""
    name = module_name(relative_path)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # a file that failed to load is not left half-made for the next plugin
            raise
    return sys.modules[name]
