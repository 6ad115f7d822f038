"""Pulumi mocks and stack settings shared by the tests of pulumi/aws and pulumi/k8s.

`pulumi.runtime.set_mocks` is process-wide, so every test that declares resources takes the `pulumi_mocks`
fixture (conftest.py), which installs a fresh recorder. `declare()` runs a program under `@pulumi.runtime.test`
(which waits for every registration) and returns what the program's output resolved to, so assertions run
outside any `.apply` and fail loudly. This module has a name of its own so it cannot clash with other test
folders' helpers; the projects' packages have distinct names too (sd3_aws, sd3_k8s).
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pulumi

REPO = Path(__file__).resolve().parents[2]
for project in ("aws", "k8s"):
    path = str(REPO / "pulumi" / project)
    if path not in sys.path:
        sys.path.insert(0, path)


@dataclass
class Declared:
    typ: str
    name: str
    inputs: dict[str, Any]
    custom: bool


def _new_host_key() -> dict[str, str]:
    """What the tls provider answers for an Ed25519 PrivateKey: a real key, made now by ssh-keygen."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)], check=True)
        return {"privateKeyOpenssh": path.read_text(), "publicKeyOpenssh": path.with_suffix(".pub").read_text()}


class RecordingMocks(pulumi.runtime.Mocks):
    """Records every resource; gives instances, addresses and file systems outputs the provider would."""

    def __init__(self) -> None:
        self.resources: list[Declared] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._private = ipaddress.ip_address("10.42.128.10")
        self._public = ipaddress.ip_address("198.51.100.10")

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict]:
        self.resources.append(Declared(args.typ, args.name, dict(args.inputs), bool(args.custom)))
        state = dict(args.inputs)
        if args.typ == "aws:ec2/instance:Instance":
            state["privateIp"] = str(self._private)
            self._private += 1
        elif args.typ == "aws:ec2/eip:Eip":
            state["publicIp"] = str(self._public)
            self._public += 1
        elif args.typ == "tls:index/privateKey:PrivateKey":
            state.update(_new_host_key())
        elif args.typ == "aws:ec2/launchTemplate:LaunchTemplate":
            state["latestVersion"] = 1
        elif args.typ == "aws:ec2/placementGroup:PlacementGroup":
            state["name"] = f"{args.name}-pg"
        elif args.typ == "aws:ec2/keyPair:KeyPair":
            state["keyName"] = f"{args.name}-key"
        elif args.typ == "aws:fsx/lustreFileSystem:LustreFileSystem":
            state.update(dnsName="fs-0123.fsx.us-east-1.amazonaws.com", mountName="abcdefgh")
        elif args.typ == "aws:efs/fileSystem:FileSystem":
            state["dnsName"] = "fs-0456.efs.us-east-1.amazonaws.com"
        elif args.typ == "aws:efs/mountTarget:MountTarget":
            state["ipAddress"] = "10.42.128.200"
        return f"{args.name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict, list | None]:
        self.calls.append((args.token, dict(args.args)))
        if args.token == "aws:ec2/getAmi:getAmi":
            return {"id": "ami-0ubuntu2204", "imageId": "ami-0ubuntu2204",
                    "name": "ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-amd64-server-20261201"}, []
        return {}, []

    def of_type(self, typ: str) -> list[Declared]:
        return [r for r in self.resources if r.typ == typ]


def declare(program: Callable[[], Any]) -> Any:
    """Run `program` as a Pulumi program under the installed mocks; return what its result resolves to."""
    resolved: list[Any] = []

    @pulumi.runtime.test
    def run() -> pulumi.Output[Any]:
        return pulumi.Output.from_input(program()).apply(lambda value: resolved.append(value) or value)

    run()
    assert resolved, "the program's output never resolved (an unknown value under the mocks?)"
    return resolved[0]


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
