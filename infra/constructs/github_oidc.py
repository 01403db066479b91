"""GitHub Actions → AWS without stored keys: the OIDC identity provider and a deploy role scoped to one repo.

Trust (GitHub docs, "Configuring OpenID Connect in Amazon Web Services"): audience ``sts.amazonaws.com``,
subject ``repo:<owner>/<name>:ref:refs/heads/*`` (branches), ``:pull_request`` (pull requests) and
``:environment:*``. Permissions: assume the CDK bootstrap roles (``cdk-hnb659fds-*``: deploy, file and image
publishing, lookup), read stack outputs, push to this project's ECR repositories, and what
``python -m infra teardown`` needs in the destroy workflow.
"""

from __future__ import annotations

from typing import Optional

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from constructs import Construct

from infra.constructs.nag import ack_findings, env_literals, nag_arn

GITHUB_OIDC_URL = "token.actions.githubusercontent.com"


class GithubOidcDeployRole(Construct):
    """``provider_arn`` (created unless ``existing_provider_arn`` is given: one provider per account) and
    ``role`` (the role workflows pass to ``aws-actions/configure-aws-credentials`` as ``role-to-assume``)."""

    def __init__(self, scope: Construct, cid: str, *, repo: str, existing_provider_arn: Optional[str] = None,
                 account: Optional[str] = None, region: Optional[str] = None) -> None:
        super().__init__(scope, cid)
        stack = cdk.Stack.of(self)
        if existing_provider_arn:
            self.provider_arn = existing_provider_arn
        else:
            provider = iam.CfnOIDCProvider(self, "Provider", url=f"https://{GITHUB_OIDC_URL}",
                                           client_id_list=["sts.amazonaws.com"])
            self.provider_arn = provider.attr_arn
        self.role = iam.Role(self, "DeployRole", description=f"GitHub Actions of {repo}: cdk deploy/destroy, ECR push",
                             max_session_duration=cdk.Duration.hours(2),
                             assumed_by=iam.WebIdentityPrincipal(self.provider_arn, conditions={
                                 "StringEquals": {f"{GITHUB_OIDC_URL}:aud": "sts.amazonaws.com"},
                                 "StringLike": {f"{GITHUB_OIDC_URL}:sub": [
                                     f"repo:{repo}:ref:refs/heads/*", f"repo:{repo}:pull_request",
                                     f"repo:{repo}:environment:*"]}}))
        bootstrap_roles = stack.format_arn(service="iam", region="", resource="role", resource_name="cdk-hnb659fds-*")
        self.role.add_to_policy(iam.PolicyStatement(actions=["sts:AssumeRole"], resources=[bootstrap_roles]))
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["cloudformation:DescribeStacks", "ec2:DescribeInstances", "ec2:DescribeVolumes",
                     "ec2:DescribeSpotInstanceRequests", "states:ListExecutions", "sagemaker:ListTrainingJobs"],
            resources=["*"]))
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["ec2:TerminateInstances", "ec2:CancelSpotInstanceRequests", "ec2:DeleteVolume"],
            resources=["*"], conditions={"StringLike": {"aws:ResourceTag/trainstack:env": "*"}}))
        repos = stack.format_arn(service="ecr", resource="repository", resource_name="trainstack-*")
        self.role.add_to_policy(iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]))
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["ecr:BatchCheckLayerAvailability", "ecr:InitiateLayerUpload", "ecr:UploadLayerPart",
                     "ecr:CompleteLayerUpload", "ecr:PutImage", "ecr:BatchGetImage", "ecr:DescribeImages"],
            resources=[repos]))
        ack_findings(self.role, "AwsSolutions-IAM5", [
            "Resource::*", f"Resource::arn:<AWS::Partition>:iam::{env_literals(account, region)[0]}:role/cdk-hnb659fds-*",
            "Resource::" + nag_arn("ecr", "repository/trainstack-*", account, region)],
            "Describe/List calls only accept '*'; terminate/cancel/delete only on resources tagged trainstack:env; "
            "the CDK bootstrap roles are the documented way to deploy with CDK; ECR push only to trainstack-* "
            "repositories.")
        cdk.CfnOutput(stack, "GithubDeployRoleArn", value=self.role.role_arn,
                      description="set as repository variable AWS_DEPLOY_ROLE_ARN")
