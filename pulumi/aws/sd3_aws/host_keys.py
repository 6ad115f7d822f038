"""SSH host keys made from one secret seed, so the inventory can ship known_hosts (a pure module; no Pulumi).

Why: a host key made at first boot is unknown to the machine running Ansible, which then has to trust
whatever answers first (`StrictHostKeyChecking=accept-new`). Here each node's Ed25519 host key is derived from
the stack's secret `hostKeySeed` and its host name (HMAC-SHA256, RFC 8032 seed), given to cloud-init in the
user data, and its public half written into the inventory's known_hosts. The same seed and name always give
the same key, so `pulumi up` never sees a changed user data, and a replaced node comes back with its old key.

The private key travels in the instance's user data: anyone who may call ec2:DescribeInstanceAttribute on
the instance, or any process on the node that reads the metadata service, can read it. That is the same
trust as the node's root disk; restrict that IAM action to the cluster's administrators.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

KEY_TYPE = b"ssh-ed25519"


@dataclass(frozen=True)
class HostKey:
    private_openssh: str  # the file cloud-init writes to /etc/ssh/ssh_host_ed25519_key
    public_openssh: str  # "ssh-ed25519 AAAA... <host>"

    def known_hosts_line(self, *names: str) -> str:
        return f"{','.join(names)} {' '.join(self.public_openssh.split()[:2])}"


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def host_key(seed: str, hostname: str) -> HostKey:
    secret = hmac.new(seed.encode(), f"sd3-cluster host key {hostname}".encode(), hashlib.sha256).digest()
    public = Ed25519PrivateKey.from_private_bytes(secret).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    public_blob = _string(KEY_TYPE) + _string(public)
    # OpenSSH's own format (PROTOCOL.key), unencrypted. The check integer is random in ssh-keygen; here it is
    # derived too, so the same seed gives the same bytes.
    check = hmac.new(secret, b"check", hashlib.sha256).digest()[:4]
    private = (check + check + _string(KEY_TYPE) + _string(public) + _string(secret + public)
               + _string(hostname.encode()))
    private += bytes(range(1, 1 + (-len(private) % 8)))
    body = (b"openssh-key-v1\0" + _string(b"none") + _string(b"none") + _string(b"") + struct.pack(">I", 1)
            + _string(public_blob) + _string(private))
    encoded = base64.b64encode(body).decode()
    lines = [encoded[i:i + 70] for i in range(0, len(encoded), 70)]
    pem = "\n".join(["-----BEGIN OPENSSH PRIVATE KEY-----", *lines, "-----END OPENSSH PRIVATE KEY-----", ""])
    return HostKey(private_openssh=pem,
                   public_openssh=f"ssh-ed25519 {base64.b64encode(public_blob).decode()} {hostname}")
