"""Imports the collector scripts of roles/monitoring (they are files the role installs, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def gpu():
    return load_collector("sd3_gpu_metrics")


@pytest.fixture(scope="session")
def training():
    return load_collector("sd3_training_metrics")


@pytest.fixture(scope="session")
def slurm():
    return load_collector("sd3_slurm_metrics")


@pytest.fixture(scope="session")
def gluster():
    return load_collector("sd3_gluster_metrics")


@pytest.fixture(scope="session")
def textfile():
    return load_collector("sd3_textfile")
