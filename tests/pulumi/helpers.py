"""Valid stack settings the tests start from, and a normaliser for what the mocks hand back."""

from __future__ import annotations

from typing import Any

AWS_VALUES: dict[str, Any] = {
    "clusterName": "sd3",
    "availabilityZone": "us-east-1a",
    "adminCidrs": ["203.0.113.0/24"],
    "sshPublicKey": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITestKeyTestKeyTestKey admin@example",
    "gpuInstanceType": "p5.48xlarge",
    "gpuNodeCount": 3,
    "tags": {"project": "sd3-training"},
}

K8S_VALUES: dict[str, Any] = {
    "image": "registry.example.com/sd3cluster:0.1.0",
    "storageClassName": "efs-sc",
    "nodes": 3,
    "gpusPerNode": 8,
}


def integral(value: Any) -> Any:
    """Numbers cross the Pulumi RPC boundary as floats; give whole ones back as ints, as the program wrote them."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [integral(item) for item in value]
    return value
