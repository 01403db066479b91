"""DataStack: what must outlive the compute — S3 bucket, EBS gp3 data volume, optional FSx for Lustre, network.

On ``cdk destroy DataStack``: the buckets are retained and the EBS volume snapshotted, except in ``ephemeral``
(pull-request) environments, where the buckets go with their objects and the volume without a snapshot
(context ``data_volume_removal`` overrides the volume's: snapshot, retain, delete); the FSx file system, the
VPC and everything else are deleted. Bucket names are generated, so an environment can
always be deployed again under the same name. Seed 003 keeps FFCV data and checkpoints on a
400 GiB gp3 volume at 16,000 IOPS that moves between instances; an EBS volume attaches only to instances in
its own AZ, so the VPC here has subnets in that one AZ only and every launch template places instances there.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from constructs import Construct

from infra.config import InfraConfig
from infra.constructs.nag import ack

#: context data_volume_removal -> the data volume's removal policy. Pull-request environments default to
#: "delete": a snapshot of each closed PR's 400 GiB volume was left behind that nothing ever deleted.
VOLUME_REMOVAL = {
    "snapshot": cdk.RemovalPolicy.SNAPSHOT,
    "retain": cdk.RemovalPolicy.RETAIN,
    "delete": cdk.RemovalPolicy.DESTROY,
}
LUSTRE_PORTS = ((988, 988), (1018, 1023))  # FSx for Lustre user guide, "File system access control with VPC"


def bucket_export(cfg: InfraConfig, what: str) -> str:
    """CloudFormation export name of the data bucket's ``arn`` or ``name`` (unique per account and region)."""
    return f"{cfg.prefix}-data-bucket-{what}"


class DataStack(cdk.Stack):
    """S3 (datasets/, checkpoints/, models/, artifacts/), the data volume, FSx, VPC and security groups.

    Attributes read by the other stacks: ``bucket``, ``access_log_bucket``, ``volume``, ``vpc``,
    ``instance_subnets``, ``instance_sg``, ``file_system`` (None when ``fsx=off``).
    """

    def __init__(self, scope: Construct, cid: str, *, config: InfraConfig, **kwargs) -> None:
        super().__init__(scope, cid, **kwargs)
        cfg = config

        # No fixed bucket names: a retained bucket would make deploying the same environment again fail.
        # Ephemeral (pull-request) environments delete their buckets, objects included, with the stack.
        removal = (
            dict(removal_policy=cdk.RemovalPolicy.DESTROY, auto_delete_objects=True)
            if cfg.ephemeral
            else dict(removal_policy=cdk.RemovalPolicy.RETAIN)
        )
        self.access_log_bucket = s3.Bucket(
            self,
            "AccessLogs",
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            versioned=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            **removal,
            lifecycle_rules=[
                s3.LifecycleRule(expiration=cdk.Duration.days(365), noncurrent_version_expiration=cdk.Duration.days(30))
            ],
        )
        ack(
            self.access_log_bucket,
            "AwsSolutions-S1",
            "This is the access-log bucket itself; logging it into itself would loop.",
        )
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            versioned=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            **removal,
            server_access_logs_bucket=self.access_log_bucket,
            server_access_logs_prefix="bucket/",
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="old-versions",
                    noncurrent_version_expiration=cdk.Duration.days(30),
                    abort_incomplete_multipart_upload_after=cdk.Duration.days(7),
                )
            ],
        )

        subnets = [ec2.SubnetConfiguration(name="public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24)]
        private_type = ec2.SubnetType.PRIVATE_WITH_EGRESS if cfg.nat_gateways else ec2.SubnetType.PRIVATE_ISOLATED
        subnets.append(ec2.SubnetConfiguration(name="private", subnet_type=private_type, cidr_mask=20))
        self.vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr("10.42.0.0/16"),
            availability_zones=[cfg.az],
            nat_gateways=cfg.nat_gateways,
            subnet_configuration=subnets,
            gateway_endpoints={"S3": ec2.GatewayVpcEndpointOptions(service=ec2.GatewayVpcEndpointAwsService.S3)},
        )
        flow_logs = logs.LogGroup(
            self, "FlowLogs", retention=logs.RetentionDays.ONE_MONTH, removal_policy=cdk.RemovalPolicy.DESTROY
        )
        self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_logs),
            traffic_type=ec2.FlowLogTrafficType.REJECT,
        )
        # With a NAT the instances sit in the private subnet (required for multi-card EFA); else public + IP.
        self.instance_subnets = self.vpc.select_subnets(
            subnet_group_name="private" if cfg.nat_gateways else "public"
        ).subnets

        # Explicit egress (allow_all_outbound=False): with allow-all, CDK drops every explicit egress rule, and
        # EFA needs the self-referencing one (EFA user guide: all inbound and outbound traffic to and from the
        # security group itself). HTTPS reaches the AWS APIs, ECR and S3 (no interface endpoints), HTTP the
        # Ubuntu package mirrors (FSx client, CloudWatch agent dependencies).
        self.instance_sg = ec2.SecurityGroup(
            self,
            "InstanceSg",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="Training instances: no ingress but from each other (NCCL/EFA need all traffic)",
        )
        self.instance_sg.add_ingress_rule(self.instance_sg, ec2.Port.all_traffic(), "NCCL/EFA between instances")
        self.instance_sg.add_egress_rule(self.instance_sg, ec2.Port.all_traffic(), "NCCL/EFA between instances")
        self.instance_sg.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "AWS APIs, ECR, S3 (HTTPS)")
        self.instance_sg.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(80), "Ubuntu package mirrors")
        if cfg.ssh_cidr:
            self.instance_sg.add_ingress_rule(ec2.Peer.ipv4(cfg.ssh_cidr), ec2.Port.tcp(22), "SSH (context ssh_cidr)")

        self.volume = ec2.Volume(
            self,
            "DataVolume",
            availability_zone=cfg.az,
            size=cdk.Size.gibibytes(cfg.data_volume_gib),
            volume_type=ec2.EbsDeviceVolumeType.GP3,
            iops=cfg.data_volume_iops,
            throughput=cfg.data_volume_throughput_mibps,
            encrypted=True,
            removal_policy=VOLUME_REMOVAL[cfg.data_volume_removal],
        )
        cdk.Tags.of(self.volume).add("trainstack:role", "data")

        self.file_system = None
        if cfg.fsx != "off":
            self.file_system = self._fsx(cfg)

        # Exported under fixed names (the generated bucket name travels through them) so that the training
        # stack's IAM findings name the import stably: see TrainingStack._bucket_objects.
        self.export_value(self.bucket.bucket_arn, name=bucket_export(cfg, "arn"))
        self.export_value(self.bucket.bucket_name, name=bucket_export(cfg, "name"))
        for name, value, desc in [
            ("BucketName", self.bucket.bucket_name, "datasets/, checkpoints/, models/, artifacts/"),
            ("DataVolumeId", self.volume.volume_id, "EBS gp3 data volume (mounted at /data)"),
            ("AvailabilityZone", cfg.az, "AZ of the data volume and the instances"),
            ("VpcId", self.vpc.vpc_id, "training VPC"),
            ("InstanceSecurityGroupId", self.instance_sg.security_group_id, "training instances"),
            ("InstanceSubnetId", self.instance_subnets[0].subnet_id, "subnet the launch templates use"),
        ]:
            cdk.CfnOutput(self, name, value=value, description=desc)

    def _fsx(self, cfg: InfraConfig) -> fsx.LustreFileSystem:
        """FSx for Lustre in the instances' subnet, ``fsx_data_path`` linked to ``s3://bucket/datasets/`` (seed 002).

        SCRATCH_2 and PERSISTENT_2 alike link through a data repository association with automatic import and
        export (NEW, CHANGED, DELETED), on Lustre 2.15. Why DRAs (docs/architecture.md): they "are supported on all
        FSx for Lustre 2.12 and 2.15 file systems, excluding scratch_1" (FSx API reference,
        CreateDataRepositoryAssociation; FSx for Lustre user guide, "Linking your file system to an Amazon S3
        bucket"); the ImportPath/ExportPath link is the user guide's "Working with older deployment types" and
        has no automatic export on SCRATCH_2. Files appear under ``/fsx<fsx_data_path>`` on both types.
        """
        sg = ec2.SecurityGroup(
            self,
            "FsxSg",
            vpc=self.vpc,
            allow_all_outbound=False,
            description="FSx for Lustre: Lustre ports from the training instances",
        )
        for lo, hi in LUSTRE_PORTS:
            for peer in (self.instance_sg, sg):
                sg.add_ingress_rule(peer, ec2.Port.tcp_range(lo, hi), "Lustre")
            sg.add_egress_rule(sg, ec2.Port.tcp_range(lo, hi), "Lustre between file servers")
            self.instance_sg.add_egress_rule(sg, ec2.Port.tcp_range(lo, hi), "Lustre client")
        persistent = cfg.fsx == "PERSISTENT_2"
        lustre = fsx.LustreConfiguration(
            deployment_type=getattr(fsx.LustreDeploymentType, cfg.fsx),
            per_unit_storage_throughput=cfg.fsx_throughput_mibps_per_tib if persistent else None,
            data_compression_type=fsx.LustreDataCompressionType.LZ4,
        )
        fs = fsx.LustreFileSystem(
            self,
            "Lustre",
            vpc=self.vpc,
            vpc_subnet=self.instance_subnets[0],
            security_group=sg,
            storage_capacity_gib=cfg.fsx_storage_gib,
            lustre_configuration=lustre,
            file_system_type_version=fsx.FileSystemTypeVersion.V_2_15,
            # Deleted with the stack: a retained file system keeps its subnet and security group, so the stack
            # (VPC) could never be deleted. It is a cache of s3://bucket/datasets/ (PERSISTENT_2 exports new and
            # changed files automatically; SCRATCH_2 results must be exported or written to /data or S3).
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        fsx.CfnDataRepositoryAssociation(
            self,
            "DataRepositoryAssociation",
            file_system_id=fs.file_system_id,
            file_system_path=cfg.fsx_data_path,
            data_repository_path=self.bucket.s3_url_for_object("datasets/"),
            batch_import_meta_data_on_create=True,
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(
                    events=["NEW", "CHANGED", "DELETED"]
                ),
                auto_export_policy=fsx.CfnDataRepositoryAssociation.AutoExportPolicyProperty(
                    events=["NEW", "CHANGED", "DELETED"]
                ),
            ),
        )
        cdk.CfnOutput(self, "FsxDnsName", value=fs.dns_name, description="FSx for Lustre DNS name")
        cdk.CfnOutput(self, "FsxMountName", value=fs.mount_name, description="FSx for Lustre mount name")
        return fs
