"""CiStack: the GitHub OIDC provider and deploy role (deployed once per account, by hand:
``npx cdk deploy CiStack -c github_repo=owner/name``). Only in the app when ``github_repo`` is set."""

from __future__ import annotations

import aws_cdk as cdk
from constructs import Construct

from infra.config import InfraConfig
from infra.constructs.github_oidc import GithubOidcDeployRole


class CiStack(cdk.Stack):
    """Attribute ``deploy_role`` (the GithubOidcDeployRole construct)."""

    def __init__(self, scope: Construct, cid: str, *, config: InfraConfig, **kwargs) -> None:
        super().__init__(scope, cid, **kwargs)
        self.deploy_role = GithubOidcDeployRole(
            self,
            "Github",
            repo=config.github_repo,
            existing_provider_arn=config.github_oidc_provider_arn,
            account=config.account,
            region=config.region,
        )
