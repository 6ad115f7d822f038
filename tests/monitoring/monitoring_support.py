"""Paths of the monitoring tests and a loader of the role's collector scripts (files the role installs, not a package).

Imported by name from the test modules; not from conftest, whose module name other test folders share.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COLLECTORS = REPO / "roles" / "monitoring" / "files" / "collectors"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load_collector(name: str):
    if str(COLLECTORS) not in sys.path:
        sys.path.insert(0, str(COLLECTORS))
    spec = importlib.util.spec_from_file_location(name, COLLECTORS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
