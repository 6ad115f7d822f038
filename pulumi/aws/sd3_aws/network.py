"""The cluster's network: one VPC, a public and a private subnet in one availability zone."""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

from .addressing import subnet_plan
from .config import AwsClusterConfig
from .tags import cluster_tags


class ClusterNetwork(pulumi.ComponentResource):
    """VPC, internet gateway, NAT gateway and two subnets in the cluster's zone.

    The head and the NAT gateway sit in the public subnet; GPU nodes and the file system in the private one,
    since instances with several EFA interfaces cannot take a public address anyway.
    """

    def __init__(self, name: str, config: AwsClusterConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:aws:ClusterNetwork", name, None, opts)
        plan = subnet_plan(config.vpc_cidr)
        child = pulumi.ResourceOptions(parent=self)

        def tags(role: str) -> dict[str, str]:
            return cluster_tags(config.cluster_name, role, extra=config.tags)

        self.vpc = aws.ec2.Vpc(f"{name}-vpc", cidr_block=plan.vpc, enable_dns_hostnames=True,
                               enable_dns_support=True, tags=tags("vpc"), opts=child)
        self.internet_gateway = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=self.vpc.id, tags=tags("igw"), opts=child)
        self.public_subnet = aws.ec2.Subnet(
            f"{name}-public", vpc_id=self.vpc.id, cidr_block=plan.public, availability_zone=config.availability_zone,
            map_public_ip_on_launch=False, tags=tags("public-subnet"), opts=child)
        self.private_subnet = aws.ec2.Subnet(
            f"{name}-private", vpc_id=self.vpc.id, cidr_block=plan.private, availability_zone=config.availability_zone,
            map_public_ip_on_launch=False, tags=tags("private-subnet"), opts=child)

        self.nat_address = aws.ec2.Eip(f"{name}-nat-eip", domain="vpc", tags=tags("nat-eip"), opts=child)
        self.nat_gateway = aws.ec2.NatGateway(
            f"{name}-nat", allocation_id=self.nat_address.id, subnet_id=self.public_subnet.id, tags=tags("nat"),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[self.internet_gateway]))

        public_routes = aws.ec2.RouteTable(
            f"{name}-public-rt", vpc_id=self.vpc.id, tags=tags("public-rt"),
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", gateway_id=self.internet_gateway.id)],
            opts=child)
        private_routes = aws.ec2.RouteTable(
            f"{name}-private-rt", vpc_id=self.vpc.id, tags=tags("private-rt"),
            routes=[aws.ec2.RouteTableRouteArgs(cidr_block="0.0.0.0/0", nat_gateway_id=self.nat_gateway.id)],
            opts=child)
        aws.ec2.RouteTableAssociation(f"{name}-public-rta", subnet_id=self.public_subnet.id,
                                      route_table_id=public_routes.id, opts=child)
        aws.ec2.RouteTableAssociation(f"{name}-private-rta", subnet_id=self.private_subnet.id,
                                      route_table_id=private_routes.id, opts=child)

        self.cidr = plan.vpc
        self.register_outputs({
            "vpc_id": self.vpc.id,
            "public_subnet_id": self.public_subnet.id,
            "private_subnet_id": self.private_subnet.id,
        })
