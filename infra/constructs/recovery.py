"""The EC2 recovery controller: EventBridge rules -> a Lambda function running ``infra.recovery.handler``.

The function's code is this repository's ``infra/`` package as it is (``Code.from_asset`` of the repository
root with everything but ``infra/`` excluded): boto3 is in the Lambda Python runtime, so nothing is bundled
and synthesis needs no container. Rules (EventBridge user guide, "Creating rules that react to events";
EC2 user guide, "Spot Instance interruption notices", "State change events for Amazon EC2 instances"):
the interruption warning and rebalance recommendation, state changes to stopping/shutting-down/terminated,
and a tick every ``infra.recovery_settings.TICK_S`` seconds.

Least privilege (EC2 user guide, "Example policies for working with the Amazon EC2 API": launch templates;
IAM user guide, "Granting a user permissions to pass a role"): RunInstances only through this environment's
launch templates (``ec2:LaunchTemplate``), their subnet, security group and AMI as the templates name them
(``ec2:IsLaunchTemplateResource``; AMI owners Amazon or this account) and never without the ``trainstack:env``
tag (an explicit Deny),
CreateTags only as part of RunInstances, PassRole only of the instance role to EC2, TerminateInstances only on
this environment's instances, S3 only under ``jobs/`` of the data bucket, Publish only to the alarm topic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aws_cdk as cdk
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_lambda_destinations as destinations
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from infra import job_record, recovery_settings
from infra.constructs.nag import ack, ack_findings, env_literals, nag_arn
from infra.stacks.monitoring import function_failure_alarm, queue_depth_alarm

REPO = Path(__file__).resolve().parents[2]
#: Everything but the infra package (and its caches) stays out of the function's code.
ASSET_EXCLUDE = ["*", ".*", "!infra", "!infra/**", "**/__pycache__", "**/*.pyc"]
STATE_CHANGES = ["stopping", "shutting-down", "terminated"]
HANDLER = "infra.recovery.handler"
#: Lambda's own retries of a failed asynchronous invocation before the event goes to the on-failure queue.
ASYNC_RETRIES = 2


@dataclass(frozen=True)
class LaunchPins:
    """What this deploy put into the launch templates and RunInstances must keep: the instances' subnet ids,
    security group id and AMI id (CDK tokens)."""

    subnet_ids: tuple[str, ...]
    security_group_id: str
    image_id: str


class RecoveryController(Construct):
    """Attributes: ``function``, ``role``, ``rules`` (name -> Rule), ``failures`` (the on-failure SQS queue),
    ``alarm`` (Errors + Throttles -> the topic), ``queue_alarm`` (messages in the failure queue -> the topic). ``idle_alarm_prefix``: name prefix of the per-instance GPU-idle
    alarms (their ALARM state fails the job). ``launch_templates``: instance type ->
    launch template id (CDK tokens); ``bucket_finding``: the data bucket's ARN as cdk-nag names it in a finding
    (``Resource::<import>``); ``account``/``region``: the stack's when env-aware (cdk-nag prints them)."""

    def __init__(
        self,
        scope: Construct,
        cid: str,
        *,
        env: str,
        prefix: str,
        bucket: s3.IBucket,
        topic: sns.ITopic,
        volume_id: str,
        launch_templates: Mapping[str, str],
        instance_role: iam.IRole,
        pins: LaunchPins,
        bucket_finding: str,
        idle_alarm_prefix: str,
        account: str | None = None,
        region: str | None = None,
    ) -> None:
        super().__init__(scope, cid)
        self.bucket_finding, self.account, self.region = bucket_finding, account, region
        stack = cdk.Stack.of(self)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description=f"{prefix} EC2 job recovery (infra/recovery.py)",
        )
        log_group = logs.LogGroup(
            self,
            "Logs",
            log_group_name=f"/aws/lambda/{prefix}-recovery",
            retention=logs.RetentionDays.THREE_MONTHS,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        # Loud failure: an event whose invocation still fails after Lambda's retries (or that EventBridge could
        # not deliver) lands here (14 days), and the alarm below tells the topic (AWS Lambda developer guide,
        # "Capturing records of Lambda asynchronous invocations": on-failure destinations).
        self.failures = sqs.Queue(
            self,
            "Failures",
            queue_name=f"{prefix}-recovery-failures",
            retention_period=cdk.Duration.days(14),
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
        )
        ack(
            self.failures,
            "AwsSolutions-SQS3",
            "This queue is the dead-letter queue: the function's on-failure destination and the EventBridge "
            "targets' dead-letter queue; a queue behind it would only hide failures once more.",
        )
        # No reserved concurrency: one invocation at a time is not needed (a lease and conditional writes in the
        # job record let one invocation act per job), and a reservation fails the deploy in accounts whose
        # concurrency limit is 10 (Lambda keeps 10 unreserved).
        self.function = lambda_.Function(
            self,
            "Function",
            function_name=f"{prefix}-recovery",
            description="Relaunch interrupted EC2 training jobs from their checkpoint (infra/recovery.py)",
            runtime=lambda_.Runtime.PYTHON_3_14,
            handler=HANDLER,
            code=lambda_.Code.from_asset(str(REPO), exclude=ASSET_EXCLUDE),
            role=self.role,
            timeout=cdk.Duration.seconds(120),
            memory_size=256,
            log_group=log_group,
            on_failure=destinations.SqsDestination(self.failures),
            retry_attempts=ASYNC_RETRIES,
            environment={
                "TRAINSTACK_IDLE_ALARM_PREFIX": idle_alarm_prefix,
                "TRAINSTACK_ENV": env,
                "TRAINSTACK_BUCKET": bucket.bucket_name,
                "TRAINSTACK_TOPIC_ARN": topic.topic_arn,
                "TRAINSTACK_VOLUME_ID": volume_id,
                "TRAINSTACK_LAUNCH_TEMPLATES": stack.to_json_string(dict(launch_templates)),
            },
        )
        self._grant(stack, env, bucket, topic, log_group, launch_templates, instance_role, pins)
        self.alarm = function_failure_alarm(self, "FailureAlarm", self.function, topic, f"{prefix}-recovery-failures")
        self.queue_alarm = queue_depth_alarm(
            self, "FailureQueueAlarm", self.failures, topic, f"{prefix}-recovery-failure-queue"
        )
        target = targets.LambdaFunction(self.function, retry_attempts=4, dead_letter_queue=self.failures)
        ec2_events = ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]
        self.rules = {
            "spot": events.Rule(
                self,
                "SpotRule",
                description=f"{prefix}: spot interruption warnings -> recovery",
                event_pattern=events.EventPattern(source=["aws.ec2"], detail_type=ec2_events),
                targets=[target],
            ),
            "state": events.Rule(
                self,
                "StateRule",
                description=f"{prefix}: instances stopping or ending -> recovery",
                event_pattern=events.EventPattern(
                    source=["aws.ec2"],
                    detail_type=["EC2 Instance State-change Notification"],
                    detail={"state": STATE_CHANGES},
                ),
                targets=[target],
            ),
            "idle": events.Rule(
                self,
                "IdleAlarmRule",
                description=f"{prefix}: GPU-idle alarms in ALARM -> recovery (the job fails, not relaunched)",
                event_pattern=events.EventPattern(
                    source=["aws.cloudwatch"],
                    detail_type=["CloudWatch Alarm State Change"],
                    detail={"alarmName": [{"prefix": idle_alarm_prefix}], "state": {"value": ["ALARM"]}},
                ),
                targets=[target],
            ),
            "tick": events.Rule(
                self,
                "TickRule",
                description=f"{prefix}: recovery retries (capacity backoff, missed events, cost cap)",
                schedule=events.Schedule.rate(cdk.Duration.seconds(recovery_settings.TICK_S)),
                targets=[target],
            ),
        }

    def _grant(self, stack, env, bucket, topic, log_group, launch_templates, instance_role, pins) -> None:
        role = self.role

        def lt_arn(template_id: str) -> str:
            return stack.format_arn(service="ec2", resource="launch-template", resource_name=template_id)

        def arn(resource: str, name: str = "*", account: str | None = None) -> str:
            return stack.format_arn(service="ec2", resource=resource, resource_name=name, account=account)

        lt_arns = [lt_arn(i) for i in launch_templates.values()]
        launched = [arn(r) for r in ("volume", "network-interface", "spot-instances-request")]
        from_template = {"ArnLike": {"ec2:LaunchTemplate": lt_arns}}
        pinned = {**from_template, "Bool": {"ec2:IsLaunchTemplateResource": "true"}}
        role.add_to_policy(
            iam.PolicyStatement(actions=["ec2:RunInstances"], resources=lt_arns + launched, conditions=from_template)
        )
        # The instance only of the type its template was made for (ec2:InstanceType on the instance resource):
        # a template version the role makes (the on-demand copy) cannot change the type, nor can an override.
        for itype, template_id in launch_templates.items():
            role.add_to_policy(
                iam.PolicyStatement(
                    actions=["ec2:RunInstances"],
                    resources=[arn("instance")],
                    conditions={
                        "ArnLike": {"ec2:LaunchTemplate": lt_arn(template_id)},
                        "StringEquals": {"ec2:InstanceType": itype},
                    },
                )
            )
        # What the templates name (subnet, security group, AMI) only as the template names it, never overridden
        # (EC2 user guide, "Use launch templates to control launching instances": ec2:IsLaunchTemplateResource),
        # and by ARN the very subnets, security group and AMI this deploy put into the templates: a new template
        # version naming others is refused too. The AMI also only from the owners the AMI parameter can resolve
        # to: Amazon (the Deep Learning AMI) or this account (a custom ami_parameter).
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:RunInstances"],
                resources=[arn("subnet", s) for s in pins.subnet_ids] + [arn("security-group", pins.security_group_id)],
                conditions=pinned,
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:RunInstances"],
                resources=[arn("image", pins.image_id, account="")],
                conditions={**pinned, "StringEquals": {"ec2:Owner": ["amazon", stack.account]}},
            )
        )
        # Never without this environment's tag, and what the templates set and a new version could drop denied
        # outright (EC2 user guide, "Example policies for working with the Amazon EC2 API": require IMDSv2;
        # require encrypted volumes). User data has no condition key: it stays what the role writes into a
        # version (docs/infrastructure.md, "IAM").
        for resource, condition in (
            ("instance", {"StringNotEquals": {"aws:RequestTag/trainstack:env": env}}),
            ("instance", {"StringNotEquals": {"ec2:MetadataHttpTokens": "required"}}),
            ("volume", {"Bool": {"ec2:Encrypted": "false"}}),
        ):
            role.add_to_policy(
                iam.PolicyStatement(
                    effect=iam.Effect.DENY,
                    actions=["ec2:RunInstances"],
                    resources=[arn(resource)],
                    conditions=condition,
                )
            )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:CreateTags"],
                resources=launched,
                conditions={"StringEquals": {"ec2:CreateAction": "RunInstances"}},
            )
        )
        # The on-demand fallback copies the default version without its spot options (infra/recovery_ec2.py,
        # on_demand_version): needed, and not narrower than these templates; IAM cannot condition a version's
        # content (EC2 user guide, "IAM permissions required for Amazon EC2 launch templates"), so what it may
        # launch is bounded by the RunInstances statements above.
        role.add_to_policy(iam.PolicyStatement(actions=["ec2:CreateLaunchTemplateVersion"], resources=lt_arns))
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:TerminateInstances"],
                resources=[arn("instance")],
                conditions={"StringEquals": {"aws:ResourceTag/trainstack:env": env}},
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:DescribeInstances", "ec2:DescribeVolumes", "ec2:DescribeLaunchTemplateVersions"],
                resources=["*"],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[instance_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}},
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:GetObject", "s3:PutObject"],
                resources=[bucket.arn_for_objects(f"{job_record.PREFIX}*")],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:ListBucket"],
                resources=[bucket.bucket_arn],
                conditions={"StringLike": {"s3:prefix": [f"{job_record.PREFIX}*"]}},
            )
        )
        topic.grant_publish(role)
        log_group.grant_write(role)
        _, reg = env_literals(self.account, self.region)
        ack_findings(
            role,
            "AwsSolutions-IAM5",
            [
                "Resource::" + nag_arn("ec2", f"{r}/*", self.account, self.region)
                for r in ("instance", "volume", "network-interface", "spot-instances-request")
            ]
            + ["Resource::*", f"{self.bucket_finding}/jobs/*"]
            + ["Action::kms:GenerateDataKey*"],
            "RunInstances/CreateTags name resources that do not exist yet: limited to launches from this "
            "environment's launch templates (ec2:LaunchTemplate), tagged with it (Deny otherwise) and to tagging "
            "during RunInstances; TerminateInstances only on instances tagged with this environment; Describe* "
            "accept only '*'; S3 only the job records under jobs/; kms:GenerateDataKey* on the alarm topic's own key "
            "(CDK grant_publish: the topic is encrypted).",
        )
