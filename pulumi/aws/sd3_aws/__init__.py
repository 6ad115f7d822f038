"""The AWS layer of sd3-cluster: network, placement, GPU instances, shared file system, Ansible inventory."""

import sys
from pathlib import Path

# The settings code both programs share lives beside them in pulumi/common (no install step for `pulumi up`).
_COMMON = str(Path(__file__).resolve().parents[2] / "common")
if _COMMON not in sys.path:
    sys.path.append(_COMMON)
