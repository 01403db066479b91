"""cdk-nag v3 acknowledgements: every suppression goes through :func:`ack`, with its reason in code."""

from __future__ import annotations

import aws_cdk as cdk
from constructs import IConstruct


def ack(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge cdk-nag ``rule`` (e.g. ``AwsSolutions-IAM5``) on ``scope`` and everything below it."""
    cdk.Validations.of(scope).acknowledge(cdk.Acknowledgment(id=rule, reason=reason))


def ack_findings(scope: IConstruct, rule: str, findings: list[str], reason: str) -> None:
    """Acknowledge each finding ``rule[finding]`` (cdk-nag v3 reports wildcard permissions one by one)."""
    for f in findings:
        ack(scope, f"{rule}[{f}]", reason)


def env_literals(account: str | None, region: str | None) -> tuple[str, str]:
    """(account, region) as cdk-nag prints them: literal in an env-aware stack (both known), else pseudo
    parameters."""
    return (account, region) if account and region else ("<AWS::AccountId>", "<AWS::Region>")


def nag_arn(service: str, resource: str, account: str | None = None, region: str | None = None) -> str:
    """An ARN as cdk-nag prints it in finding ids (pseudo parameters as ``<AWS::Region>`` and so on)."""
    acct, reg = env_literals(account, region)
    return f"arn:<AWS::Partition>:{service}:{reg}:{acct}:{resource}"


#: The actions CDK's ``Bucket.grant_read_write`` uses, as cdk-nag reports them.
S3_READ_WRITE_ACTIONS = [
    "Action::s3:GetObject*",
    "Action::s3:GetBucket*",
    "Action::s3:List*",
    "Action::s3:DeleteObject*",
    "Action::s3:Abort*",
]
