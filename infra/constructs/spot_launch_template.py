"""A spot launch template for one instance type of the catalog.

Spot market options (one-time, terminate on interruption, max price = a fraction of the catalog's on-demand
price), IMDSv2 required with hop limit 2 (the trainer's spot-notice poller runs inside a container, one hop
further), instance tags in IMDS, an encrypted gp3 root volume (seed 003: 200 GiB), the Deep Learning AMI
resolved at deploy time from its SSM public parameter, and EFA interfaces where the type supports them.

EFA: an instance with more than one network interface cannot get a public IPv4 address (EC2 user guide,
"Assign a public IPv4 address"). With ``nat_gateways=1`` the template puts one EFA interface on every network
card (p4d: 4, p5: 32) in the private subnet; with no NAT it uses one EFA interface with a public IP, enough
for single-node training (seed 003's p4d run) but a quarter of p4d's 400 Gbit/s for multi-node.
"""

from __future__ import annotations

from collections.abc import Sequence

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from constructs import Construct

from catalog import InstanceType


class SpotLaunchTemplate(Construct):
    """``launch_template`` (ec2.LaunchTemplate) for ``instance`` and ``image_id``; see the module docstring.

    ``private``: the subnets are private (behind a NAT): no public IP, and every EFA card is used.
    Raises ValueError for a SageMaker (``ml.*``) type.
    """

    def __init__(
        self,
        scope: Construct,
        cid: str,
        *,
        instance: InstanceType,
        name: str,
        role: iam.IRole,
        security_group: ec2.ISecurityGroup,
        subnets: Sequence[ec2.ISubnet],
        ami_parameter: str,
        user_data: ec2.UserData,
        root_volume_gib: int,
        max_price_fraction: float,
        private: bool,
    ) -> None:
        super().__init__(scope, cid)
        if instance.platform != "ec2":
            raise ValueError(f"launch templates are for EC2 types, got {instance.name}")
        self.instance = instance
        image = ec2.MachineImage.from_ssm_parameter(ami_parameter, os=ec2.OperatingSystemType.LINUX)
        #: The AMI id the template names (a CloudFormation parameter resolved from SSM at deploy time).
        self.image_id = image.get_image(self).image_id
        self.launch_template = ec2.LaunchTemplate(
            self,
            "Resource",
            launch_template_name=name,
            instance_type=ec2.InstanceType(instance.name),
            machine_image=image,
            role=role,
            user_data=user_data,
            require_imdsv2=True,
            http_tokens=ec2.LaunchTemplateHttpTokens.REQUIRED,
            http_put_response_hop_limit=2,
            instance_metadata_tags=True,
            instance_initiated_shutdown_behavior=ec2.InstanceInitiatedShutdownBehavior.TERMINATE,
            block_devices=[
                ec2.BlockDevice(
                    device_name="/dev/sda1",
                    volume=ec2.BlockDeviceVolume.ebs(
                        root_volume_gib,
                        encrypted=True,
                        volume_type=ec2.EbsDeviceVolumeType.GP3,
                        delete_on_termination=True,
                    ),
                )
            ],
            spot_options=ec2.LaunchTemplateSpotOptions(
                request_type=ec2.SpotRequestType.ONE_TIME,
                interruption_behavior=ec2.SpotInstanceInterruption.TERMINATE,
                max_price=round(instance.on_demand.usd_per_hour * max_price_fraction, 4),
            ),
        )
        # Public IP without NAT (decision, cost): the default VPC has no NAT gateway (~$33/month + $0.045/GB) and
        # no interface endpoints (ECR api+dkr, logs, monitoring, SSM x3, STS, EC2: ~$65/month idle per
        # environment), so instances reach AWS over a public IPv4 ($0.005/h while running) with no ingress rule
        # but from their own security group. -c nat_gateways=1 puts them in a private subnet instead.
        # Network interfaces carry the subnet (so `run-instances --launch-template` needs nothing else) and,
        # on EFA types, the EFA interface type. Security groups move into the interfaces.
        cards = instance.max_efa_interfaces if (instance.efa and private) else 1
        interfaces = []
        for card in range(cards):
            nic = {
                "DeviceIndex": 0 if card == 0 else 1,
                "NetworkCardIndex": card,
                "SubnetId": subnets[0].subnet_id,
                "Groups": [security_group.security_group_id],
                "DeleteOnTermination": True,
            }
            if instance.efa:
                nic["InterfaceType"] = "efa"
            if cards == 1:
                nic["AssociatePublicIpAddress"] = not private
            interfaces.append(nic)
        cfn = self.launch_template.node.default_child
        cfn.add_property_override("LaunchTemplateData.NetworkInterfaces", interfaces)
        cfn.add_property_deletion_override("LaunchTemplateData.SecurityGroupIds")
        cdk.Tags.of(self.launch_template).add("trainstack:instance-type", instance.name)

    @property
    def launch_template_id(self) -> str:
        return self.launch_template.launch_template_id
