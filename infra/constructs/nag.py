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


def nag_arn(service: str, resource: str, account: str | None = None, region: str | None = None) -> str:
    """An ARN as cdk-nag prints it in finding ids (pseudo parameters as ``<AWS::Region>`` and so on)."""
    return (f"arn:<AWS::Partition>:{service}:{region or '<AWS::Region>'}:{account or '<AWS::AccountId>'}:"
            f"{resource}")


#: The actions CDK's ``Bucket.grant_read_write`` uses, as cdk-nag reports them.
S3_READ_WRITE_ACTIONS = ["Action::s3:GetObject*", "Action::s3:GetBucket*", "Action::s3:List*",
                         "Action::s3:DeleteObject*", "Action::s3:Abort*"]
