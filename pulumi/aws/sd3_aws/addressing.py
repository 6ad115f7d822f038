"""How the VPC's address space is split: a small public subnet (head, NAT) and a large private one (GPU nodes)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class SubnetPlan:
    vpc: str
    public: str
    private: str


def subnet_plan(vpc_cidr: str) -> SubnetPlan:
    """The private subnet is the upper half of the VPC (EFA interfaces each take an address);
    the public one is the first /24 of the lower half, or the whole lower half when that is smaller."""
    vpc = ipaddress.ip_network(vpc_cidr)
    lower, upper = vpc.subnets(prefixlen_diff=1)
    public = next(lower.subnets(new_prefix=24)) if lower.prefixlen < 24 else lower
    return SubnetPlan(vpc=str(vpc), public=str(public), private=str(upper))
