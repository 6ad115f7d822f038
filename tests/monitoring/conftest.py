"""Fixtures of the monitoring tests: the collector scripts of roles/monitoring as modules."""

from __future__ import annotations

import pytest
from monitoring_support import load_collector


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
