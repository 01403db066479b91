"""GitHub Actions → AWS without stored keys: the OIDC identity provider and a deploy role scoped to one repo.

Trust (GitHub docs, "Configuring OpenID Connect in Amazon Web Services"): audience ``sts.amazonaws.com``,
subject ``repo:<owner>/<name>:ref:refs/heads/*`` (branches), ``:pull_request`` (pull requests) and
``:environment:*``. Permissions: assume the CDK bootstrap roles (``cdk-hnb659fds-*``: deploy, file and image
publishing, lookup), read stack outputs, push to this project's ECR repositories and pull the AWS Deep Learning
Containers base image (account 763104351884), and what ``python -m infra teardown`` needs in the destroy
workflow (mark the EC2 job records under ``jobs/`` of the data buckets stopped, terminate, cancel, delete
volumes, stop executions, delete idle alarms), what ``status`` reads (the job records, the recovery failure
queue's depth), and what ``python -m infra
sweep``/``sweep-status`` need: start the state machines' executions (jobs strategy), create, describe, list and
stop ``trainstack-*`` hyperparameter tuning jobs with their tags (``teardown`` lists and stops the running
ones), pass the training stacks' SageMaker role to
SageMaker only, and ``sagemaker:Search`` (tagged training jobs). tests/test_infra_iam.py and
tests/infra/test_infra_sweep.py check the CLI's calls against this policy.
"""

from __future__ import annotations

from typing import Optional

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from constructs import Construct

from infra.config import DLC_REGISTRY_ACCOUNT
from infra.constructs.nag import ack_findings, env_literals, nag_arn

GITHUB_OIDC_URL = "token.actions.githubusercontent.com"
#: The SageMaker execution role of each environment is ``trainstack-<env>-<this>-<region>``
#: (TrainingStack._sagemaker_role).
SAGEMAKER_ROLE_SUFFIX = "sagemaker"


class GithubOidcDeployRole(Construct):
    """``provider_arn`` (created unless ``existing_provider_arn`` is given: one provider per account) and
    ``role`` (the role workflows pass to ``aws-actions/configure-aws-credentials`` as ``role-to-assume``)."""

    def __init__(
        self,
        scope: Construct,
        cid: str,
        *,
        repo: str,
        existing_provider_arn: Optional[str] = None,
        account: Optional[str] = None,
        region: Optional[str] = None,
    ) -> None:
        super().__init__(scope, cid)
        stack = cdk.Stack.of(self)
        if existing_provider_arn:
            self.provider_arn = existing_provider_arn
        else:
            provider = iam.CfnOIDCProvider(
                self, "Provider", url=f"https://{GITHUB_OIDC_URL}", client_id_list=["sts.amazonaws.com"]
            )
            self.provider_arn = provider.attr_arn
        self.role = iam.Role(
            self,
            "DeployRole",
            description=f"GitHub Actions of {repo}: cdk deploy/destroy, ECR push",
            max_session_duration=cdk.Duration.hours(2),
            assumed_by=iam.WebIdentityPrincipal(
                self.provider_arn,
                conditions={
                    "StringEquals": {f"{GITHUB_OIDC_URL}:aud": "sts.amazonaws.com"},
                    "StringLike": {
                        f"{GITHUB_OIDC_URL}:sub": [
                            f"repo:{repo}:ref:refs/heads/*",
                            f"repo:{repo}:pull_request",
                            f"repo:{repo}:environment:*",
                        ]
                    },
                },
            ),
        )
        bootstrap_roles = stack.format_arn(service="iam", region="", resource="role", resource_name="cdk-hnb659fds-*")
        self.role.add_to_policy(iam.PolicyStatement(actions=["sts:AssumeRole"], resources=[bootstrap_roles]))
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "cloudformation:DescribeStacks",
                    "ec2:DescribeInstances",
                    "ec2:DescribeVolumes",
                    "ec2:DescribeSpotInstanceRequests",
                    "states:ListStateMachines",
                    "states:ListExecutions",
                    "sagemaker:ListTrainingJobs",
                    "sagemaker:Search",
                    "sagemaker:ListHyperParameterTuningJobs",
                    "sagemaker:ListTags",
                    "cloudwatch:DescribeAlarms",
                ],
                resources=["*"],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:TerminateInstances", "ec2:CancelSpotInstanceRequests", "ec2:DeleteVolume"],
                resources=["*"],
                conditions={"StringLike": {"aws:ResourceTag/trainstack:env": "*"}},
            )
        )
        # teardown: stop this project's running executions (Step Functions then stops their training jobs) and
        # delete the per-instance idle alarms of the instances it terminates
        executions = stack.format_arn(
            service="states",
            resource="execution",
            resource_name="trainstack-*",
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )
        self.role.add_to_policy(
            iam.PolicyStatement(actions=["states:StopExecution", "states:DescribeExecution"], resources=[executions])
        )
        # sweep (infra/cli/sweep.py, tuning.py): the jobs strategy starts the stacks' state machines and reads their
        # definition (the tuning strategy mirrors its training job); the tuning strategy creates a tuning job, whose
        # Tags need sagemaker:AddTags on it (SageMaker developer guide, "Grant permission to tag SageMaker AI resources
        # on creation"), and passes the SageMaker execution role: iam:PassRole to sagemaker.amazonaws.com only, on
        # the training stacks' roles trainstack-<env>-sagemaker-<region> (one CiStack per account
        # serves every environment, hence trainstack-* rather than one environment's prefix).
        machines = stack.format_arn(
            service="states",
            resource="stateMachine",
            resource_name="trainstack-*",
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )
        self.role.add_to_policy(
            iam.PolicyStatement(actions=["states:StartExecution", "states:DescribeStateMachine"], resources=[machines])
        )
        tuning_jobs = stack.format_arn(
            service="sagemaker", resource="hyper-parameter-tuning-job", resource_name="trainstack-*"
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "sagemaker:CreateHyperParameterTuningJob",
                    "sagemaker:DescribeHyperParameterTuningJob",
                    "sagemaker:ListTrainingJobsForHyperParameterTuningJob",
                    "sagemaker:StopHyperParameterTuningJob",
                    "sagemaker:AddTags",
                ],
                resources=[tuning_jobs],
            )
        )
        sagemaker_roles = stack.format_arn(
            service="iam", region="", resource="role", resource_name=f"trainstack-*-{SAGEMAKER_ROLE_SUFFIX}-*"
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[sagemaker_roles],
                conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
            )
        )
        alarms = stack.format_arn(
            service="cloudwatch",
            resource="alarm",
            resource_name="trainstack-*-gpu-idle-*",
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )
        self.role.add_to_policy(iam.PolicyStatement(actions=["cloudwatch:DeleteAlarms"], resources=[alarms]))
        repos = stack.format_arn(service="ecr", resource="repository", resource_name="trainstack-*")
        self.role.add_to_policy(iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]))
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "ecr:BatchCheckLayerAvailability",
                    "ecr:InitiateLayerUpload",
                    "ecr:UploadLayerPart",
                    "ecr:CompleteLayerUpload",
                    "ecr:PutImage",
                    "ecr:BatchGetImage",
                    "ecr:GetDownloadUrlForLayer",
                    "ecr:DescribeImages",
                ],
                resources=[repos],
            )
        )
        # push-image builds FROM an AWS Deep Learning Container: pulling across accounts needs this allow on
        # the caller's side too (any region: the Dockerfile names its registry's region itself)
        dlc = stack.format_arn(
            service="ecr", region="*", account=DLC_REGISTRY_ACCOUNT, resource="repository", resource_name="*"
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"],
                resources=[dlc],
            )
        )
        # teardown marks this project's EC2 jobs stopped before it terminates them (infra/job_record.py end: the
        # recovery function then relaunches none): the job records under jobs/ of the data buckets, whose names
        # CloudFormation makes from the stack name <env>-DataStack (lower case) and a random suffix.
        data_buckets = f"arn:{stack.partition}:s3:::*datastack*"
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:ListBucket"],
                resources=[data_buckets],
                conditions={"StringLike": {"s3:prefix": ["jobs/*"]}},
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(actions=["s3:GetObject", "s3:PutObject"], resources=[f"{data_buckets}/jobs/*"])
        )
        # status counts the messages in each environment's recovery failure queue (infra/cli/ec2_jobs.py)
        queues = stack.format_arn(
            service="sqs", resource="trainstack-*-recovery-failures", arn_format=cdk.ArnFormat.NO_RESOURCE_NAME
        )
        self.role.add_to_policy(iam.PolicyStatement(actions=["sqs:GetQueueAttributes"], resources=[queues]))
        acct, reg = env_literals(account, region)
        ack_findings(
            self.role,
            "AwsSolutions-IAM5",
            [
                "Resource::*",
                f"Resource::arn:<AWS::Partition>:iam::{acct}:role/cdk-hnb659fds-*",
                "Resource::" + nag_arn("ecr", "repository/trainstack-*", account, region),
                "Resource::" + nag_arn("states", "execution:trainstack-*", account, region),
                "Resource::" + nag_arn("cloudwatch", "alarm:trainstack-*-gpu-idle-*", account, region),
                "Resource::" + nag_arn("states", "stateMachine:trainstack-*", account, region),
                "Resource::" + nag_arn("sagemaker", "hyper-parameter-tuning-job/trainstack-*", account, region),
                f"Resource::arn:<AWS::Partition>:iam::{acct}:role/trainstack-*-{SAGEMAKER_ROLE_SUFFIX}-*",
                f"Resource::arn:<AWS::Partition>:ecr:*:{DLC_REGISTRY_ACCOUNT}:repository/*",
                "Resource::arn:<AWS::Partition>:s3:::*datastack*",
                "Resource::arn:<AWS::Partition>:s3:::*datastack*/jobs/*",
                "Resource::" + nag_arn("sqs", "trainstack-*-recovery-failures", account, region),
            ],
            "Describe/List calls only accept '*'; terminate/cancel/delete only on resources tagged trainstack:env; "
            "the CDK bootstrap roles are the documented way to deploy with CDK; ECR push only to trainstack-* "
            "repositories; ECR pull of the AWS Deep Learning Containers registry's public base images; stop "
            "executions and delete idle alarms only of trainstack-* names; sweeps start trainstack-* state machines, "
            "manage trainstack-* tuning jobs and pass only the training stacks' SageMaker role, to SageMaker only; "
            "teardown reads and marks the EC2 job records under jobs/ of the data buckets (generated names); status "
            "counts the messages of the trainstack-*-recovery-failures queues.",
        )
        cdk.CfnOutput(
            stack,
            "GithubDeployRoleArn",
            value=self.role.role_arn,
            description="set as repository variable AWS_DEPLOY_ROLE_ARN",
        )
