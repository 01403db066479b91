"""TrainingStack: the compute side — ECR, roles, spot launch templates, the EC2 job recovery controller,
SageMaker job state machines.

``cdk destroy TrainingStack`` removes all of it; the data stack's bucket, volume and file system stay.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

import catalog
from infra import job_record
from infra.config import InfraConfig, machine_short
from infra.constructs import user_data
from infra.constructs.github_oidc import SAGEMAKER_ROLE_SUFFIX
from infra.constructs.nag import S3_READ_WRITE_ACTIONS, ack_findings, nag_arn
from infra.constructs.recovery import LaunchPins, RecoveryController
from infra.constructs.sagemaker_job import SageMakerSpotJobs, phases_from_context
from infra.constructs.spot_launch_template import SpotLaunchTemplate
from infra.stacks.data import DataStack, bucket_export
from infra.stacks.monitoring import MonitoringStack, idle_alarm_name, instance_idle_alarm_command

#: The service-linked role CloudWatch uses for alarm actions on EC2 instances (stop/terminate/reboot), its
#: service principal and path (CloudWatch user guide, "Using service-linked roles for CloudWatch").
EC2_ALARM_ACTIONS_SERVICE = "events.amazonaws.com"
EC2_ALARM_ACTIONS_ROLE = "AWSServiceRoleForCloudWatchEvents"


def ec2_alarm_service_linked_role_statement(stack: cdk.Stack) -> iam.PolicyStatement:
    """``iam:CreateServiceLinkedRole`` for CloudWatch's EC2-actions role only, for whoever creates an alarm
    with an EC2 action (``arn:aws:automate:<region>:ec2:stop|terminate``).

    PutMetricAlarm API reference: "The iam:CreateServiceLinkedRole permission for all alarms with EC2 actions";
    the first such alarm in an account creates ``AWSServiceRoleForCloudWatchEvents`` (trusting
    events.amazonaws.com: CloudWatch user guide, "Using service-linked roles for CloudWatch"). Granted rather
    than created in a stack: the role is one per account and usually exists already, and
    ``AWS::IAM::ServiceLinkedRole`` fails when it does. Scoped to that role's ARN and to
    ``iam:AWSServiceName = events.amazonaws.com`` (IAM user guide, "Service-linked role permissions").
    """
    return iam.PolicyStatement(
        actions=["iam:CreateServiceLinkedRole"],
        resources=[
            stack.format_arn(
                service="iam",
                region="",
                resource="role",
                resource_name=f"aws-service-role/{EC2_ALARM_ACTIONS_SERVICE}/{EC2_ALARM_ACTIONS_ROLE}",
            )
        ],
        conditions={"StringEquals": {"iam:AWSServiceName": EC2_ALARM_ACTIONS_SERVICE}},
    )


class TrainingStack(cdk.Stack):
    """Attributes: ``repository``, ``instance_role``, ``sagemaker_role``, ``launch_templates`` (type -> construct),
    ``recovery`` (the EC2 job recovery controller), ``state_machines`` (name -> StateMachine)."""

    def __init__(
        self, scope: Construct, cid: str, *, config: InfraConfig, data: DataStack, monitoring: MonitoringStack, **kwargs
    ) -> None:
        super().__init__(scope, cid, **kwargs)
        cfg = self.cfg = config
        cat = cfg.catalog()
        # The data stack's bucket (generated name), imported by its fixed export names.
        self.bucket = s3.Bucket.from_bucket_attributes(
            self,
            "DataBucket",
            bucket_arn=cdk.Fn.import_value(bucket_export(cfg, "arn")),
            bucket_name=cdk.Fn.import_value(bucket_export(cfg, "name")),
        )
        # Every tag immutable (push-image pushes commit tags only, no moving `latest`): a job restarting after
        # exit 75 or resubmitted under its run name gets the image it started with.
        self.repository = ecr.Repository(
            self,
            "Repository",
            repository_name=cfg.prefix,
            image_scan_on_push=True,
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            removal_policy=cdk.RemovalPolicy.DESTROY,
            empty_on_delete=True,
            lifecycle_rules=[
                ecr.LifecycleRule(
                    description="untagged images go after 7 days",
                    rule_priority=1,
                    tag_status=ecr.TagStatus.UNTAGGED,
                    max_image_age=cdk.Duration.days(7),
                ),
                ecr.LifecycleRule(
                    description="keep the newest 30 images",
                    rule_priority=2,
                    tag_status=ecr.TagStatus.ANY,
                    max_image_count=30,
                ),
            ],
        )
        self.instance_role = self._instance_role(cfg, data, monitoring)
        self.launch_templates: dict[str, SpotLaunchTemplate] = {}
        for name in cfg.launch_template_types:
            it = catalog.get(name, cat)
            ud = ec2.UserData.for_linux()
            ud.add_commands(
                user_data.render(
                    user_data.UserDataParams(
                        env=cfg.env,
                        volume_id=data.volume.volume_id,
                        repository_uri=self.repository.repository_uri,
                        train_log_group=monitoring.train_log_group.log_group_name,
                        idle_alarm_command=instance_idle_alarm_command(cfg, monitoring.topic.topic_arn),
                        idle_alarm_prefix=idle_alarm_name(cfg),
                        nproc_per_node=it.processes_per_host,
                        efa=it.efa,
                        default_config=cfg.train_config,
                        default_image_tag=cfg.image_tag,
                        jobs_bucket=self.bucket.bucket_name,
                        fsx_dns_name=data.file_system.dns_name if data.file_system else None,
                        fsx_mount_name=data.file_system.mount_name if data.file_system else None,
                    )
                )
            )
            lt = SpotLaunchTemplate(
                self,
                f"LaunchTemplate-{name}",
                instance=it,
                name=f"{cfg.prefix}-{name.replace('.', '-')}",
                role=self.instance_role,
                security_group=data.instance_sg,
                subnets=data.instance_subnets,
                ami_parameter=cfg.ami_parameter,
                user_data=ud,
                root_volume_gib=cfg.root_volume_gib,
                max_price_fraction=cfg.spot_max_price_fraction,
                private=cfg.nat_gateways > 0,
            )
            self.launch_templates[name] = lt
            cdk.CfnOutput(
                self,
                f"LaunchTemplateId{name.replace('.', '').replace('-', '')}",
                value=lt.launch_template_id,
                description=f"spot launch template for {name}",
            )

        self.recovery = RecoveryController(
            self,
            "Recovery",
            env=cfg.env,
            prefix=cfg.prefix,
            bucket=self.bucket,
            topic=monitoring.topic,
            volume_id=data.volume.volume_id,
            launch_templates={n: lt.launch_template_id for n, lt in self.launch_templates.items()},
            instance_role=self.instance_role,
            pins=LaunchPins(
                subnet_ids=tuple(s.subnet_id for s in data.instance_subnets[:1]),
                security_group_id=data.instance_sg.security_group_id,
                image_id=next(iter(self.launch_templates.values())).image_id,
            ),
            bucket_finding=f"Resource::{bucket_export(cfg, 'arn')}",
            idle_alarm_prefix=f"{idle_alarm_name(cfg)}-",
            account=cfg.account,
            region=cfg.region,
        )
        cdk.CfnOutput(self, "RecoveryFunctionName", value=self.recovery.function.function_name)
        cdk.CfnOutput(self, "RecoveryFailureQueueUrl", value=self.recovery.failures.queue_url)

        self.sagemaker_role = self._sagemaker_role()
        self.state_machines = {}
        common = dict(
            prefix=cfg.prefix,
            image_repository_uri=self.repository.repository_uri,
            execution_role=self.sagemaker_role,
            bucket_name=self.bucket.bucket_name,
            default_data_s3_uri=self.bucket.s3_url_for_object("datasets/"),
            volume_gib=cfg.sagemaker_volume_gib,
            max_run_s=int(cfg.sagemaker_max_run_hours * 3600),
            max_wait_s=int(cfg.sagemaker_max_wait_hours * 3600),
            default_image_tag=cfg.image_tag,
            env=cfg.env,
        )
        for name in cfg.sagemaker_instance_types:
            it = catalog.get(name, cat)
            short = machine_short(name)
            jobs = SageMakerSpotJobs(
                self, f"Job-{short}", name=f"{cfg.prefix}-train-{short}", phases=[(short, it, {})], **common
            )
            self.state_machines[f"train-{short}"] = jobs.state_machine
        scaling = SageMakerSpotJobs(
            self,
            "ScalingPlan",
            name=f"{cfg.prefix}-scaling-plan",
            phases=phases_from_context(cfg.scaling_phases, lambda n: catalog.get(n, cat)),
            **common,
        )
        self.state_machines["scaling-plan"] = scaling.state_machine
        for key, sm in self.state_machines.items():
            cdk.CfnOutput(
                self,
                f"StateMachine{key.replace('-', '')}",
                value=sm.state_machine_arn,
                description=f"SageMaker managed-spot job(s): {key}",
            )
            ack_findings(
                sm,
                "AwsSolutions-IAM5",
                ["Resource::*", self._nag_arn("sagemaker", f"training-job/{cfg.prefix}-*")],
                "X-Ray and CloudWatch Logs delivery actions that CDK "
                "adds for tracing/logging only accept '*'; SageMaker actions are scoped to this env's job names.",
            )
        cdk.CfnOutput(self, "RepositoryUri", value=self.repository.repository_uri)
        cdk.CfnOutput(self, "InstanceRoleArn", value=self.instance_role.role_arn)
        cdk.CfnOutput(self, "SageMakerRoleArn", value=self.sagemaker_role.role_arn)

    def _instance_role(self, cfg: InfraConfig, data: DataStack, monitoring: MonitoringStack) -> iam.Role:
        """EC2 instance role: SSM Session Manager (no SSH), CloudWatch agent, this env's bucket/image/volume."""
        role = iam.Role(
            self,
            "InstanceRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"{cfg.prefix} training instances",
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore"),
                iam.ManagedPolicy.from_aws_managed_policy_name("CloudWatchAgentServerPolicy"),
            ],
        )
        self.bucket.grant_read_write(role)
        # The job records decide what the recovery function launches (infra/recovery.py): an instance writes its
        # exit record (jobs/<job>/exits/...) but never a record.
        role.add_to_policy(
            iam.PolicyStatement(
                effect=iam.Effect.DENY,
                actions=["s3:PutObject", "s3:DeleteObject"],
                resources=[self.bucket.arn_for_objects(f"{job_record.PREFIX}*/record.json")],
            )
        )
        self.repository.grant_pull(role)
        monitoring.train_log_group.grant_write(role)
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:AttachVolume"],
                resources=[
                    self.format_arn(service="ec2", resource="volume", resource_name=data.volume.volume_id),
                    self.format_arn(service="ec2", resource="instance", resource_name="*"),
                ],
                conditions={"StringEquals": {"aws:ResourceTag/trainstack:env": cfg.env}},
            )
        )
        role.add_to_policy(iam.PolicyStatement(actions=["ec2:DescribeVolumes"], resources=["*"]))
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricAlarm", "cloudwatch:DeleteAlarms"],
                resources=[
                    self.format_arn(
                        service="cloudwatch",
                        resource="alarm",
                        arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
                        resource_name=f"{idle_alarm_name(cfg)}-*",
                    )
                ],
            )
        )
        # The idle alarm's EC2 action runs through CloudWatch's service-linked role; PutMetricAlarm creates it on
        # first use and then needs iam:CreateServiceLinkedRole (see ec2_alarm_service_linked_role).
        role.add_to_policy(ec2_alarm_service_linked_role_statement(self))
        ack_findings(
            role,
            "AwsSolutions-IAM4",
            [
                f"Policy::arn:<AWS::Partition>:iam::aws:policy/{p}"
                for p in ("AmazonSSMManagedInstanceCore", "CloudWatchAgentServerPolicy")
            ],
            "The AWS-documented policies for exactly these agents: Session Manager (instead of SSH) and the "
            "CloudWatch agent (GPU metrics).",
        )
        ack_findings(
            role,
            "AwsSolutions-IAM5",
            S3_READ_WRITE_ACTIONS
            + [
                self._bucket_objects(),
                "Resource::*",
                self._nag_arn("ec2", "instance/*"),
                self._nag_arn("cloudwatch", f"alarm:{idle_alarm_name(cfg)}-*"),
            ],
            "Object keys inside this environment's bucket (CDK grant_read_write), AttachVolume on instances "
            "tagged with this env only, the per-instance idle alarms, and ecr:GetAuthorizationToken / "
            "ec2:DescribeVolumes which only accept '*'.",
        )
        self._grant_mlflow(role)
        return role

    def _nag_arn(self, service: str, resource: str) -> str:
        return "Resource::" + nag_arn(service, resource, self.cfg.account, self.cfg.region)

    def _bucket_objects(self) -> str:
        """The data bucket's objects as cdk-nag names them in a finding (an import from the data stack)."""
        return f"Resource::{bucket_export(self.cfg, 'arn')}/*"

    def _grant_mlflow(self, role: iam.Role) -> None:
        """With context ``mlflow_tracking_server_arn``: ``sagemaker-mlflow:*`` on that tracking server only (the
        actions MLflow's client calls through the ``sagemaker-mlflow`` plugin: create/log/search runs, experiments,
        metrics, artifacts; AWS docs, "Set up IAM permissions for MLflow"). Nothing without it."""
        arn = self.cfg.mlflow_tracking_server_arn
        if arn is None:
            return
        role.add_to_policy(iam.PolicyStatement(actions=["sagemaker-mlflow:*"], resources=[arn]))
        ack_findings(
            role,
            "AwsSolutions-IAM5",
            ["Action::sagemaker-mlflow:*"],
            "Every MLflow tracking API (runs, metrics, params, artifacts, experiments) on the one tracking server "
            "given as context mlflow_tracking_server_arn; the trainer logs there with --tracking mlflow.",
        )

    def _sagemaker_role(self) -> iam.Role:
        """SageMaker execution role ``trainstack-<env>-sagemaker-<region>``: this env's bucket and image, its own
        logs and metrics. Named (not generated) so the operators' ``iam:PassRole`` can be scoped to exactly these
        roles (infra/constructs/github_oidc.py; a generated name is cut at 64 characters for long environment
        names); the region keeps the name unique, IAM names being account-wide (at most 11 + 20 + 11 + 14 = 56
        of IAM's 64 characters)."""
        role = iam.Role(
            self,
            "SageMakerRole",
            role_name=f"{self.cfg.prefix}-{SAGEMAKER_ROLE_SUFFIX}-{cdk.Aws.REGION}",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
            description="SageMaker training jobs (managed spot)",
        )
        self.bucket.grant_read_write(role)
        self.repository.grant_pull(role)
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[
                    self.format_arn(
                        service="logs",
                        resource="log-group",
                        arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
                        resource_name="/aws/sagemaker/TrainingJobs*",
                    )
                ],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringLike": {"cloudwatch:namespace": "/aws/sagemaker/*"}},
            )
        )
        ack_findings(
            role,
            "AwsSolutions-IAM5",
            S3_READ_WRITE_ACTIONS
            + [self._bucket_objects(), "Resource::*", self._nag_arn("logs", "log-group:/aws/sagemaker/TrainingJobs*")],
            "Object keys inside this environment's bucket, SageMaker's own log groups, PutMetricData (only '*', "
            "limited by namespace) and ecr:GetAuthorizationToken (only '*').",
        )
        self._grant_mlflow(role)
        return role
