"""Fixtures for the Pulumi tests; the mocks themselves are in sd3_pulumi_testing.py."""

from __future__ import annotations

import pulumi
import pytest
from sd3_pulumi_testing import RecordingMocks


@pytest.fixture
def pulumi_mocks() -> RecordingMocks:
    mocks = RecordingMocks()
    pulumi.runtime.set_mocks(mocks, project="sd3-test", stack="test", preview=False)
    return mocks
