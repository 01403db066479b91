"""Build the CDK app: three stacks per environment, cdk-nag's AwsSolutions pack on every synth.

``cdk deploy TrainingStack -c env=pr-42`` deploys ``pr-42-DataStack``, ``pr-42-MonitoringStack`` and
``pr-42-TrainingStack`` (TrainingStack depends on the other two, so CDK deploys them first). Construct ids
(``DataStack``, ``MonitoringStack``, ``TrainingStack``) never change; only stack names carry the prefix.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Optional

import aws_cdk as cdk  # the jsii Node process starts here; infra/__init__.py has silenced its Node banner
from cdk_nag import AwsSolutionsChecks

from infra.config import InfraConfig, InfraConfigError, from_context
from infra.stacks.ci import CiStack
from infra.stacks.data import DataStack
from infra.stacks.monitoring import MonitoringStack
from infra.stacks.training import TrainingStack

#: CDK feature flags this app relies on (set before any construct is created).
FEATURE_FLAGS = {
    # grant S3 server-access-log delivery by bucket policy, not the legacy LogDeliveryWrite ACL (cfn-lint W3045)
    "@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy": True,
    # the data stack's exports stay protected while the training stack imports them
    "@aws-cdk/core:defaultCrossStackReferences": "strong",
}


def build_app(
    context: Optional[Mapping[str, Any]] = None, outdir: Optional[str] = None, app: Optional[cdk.App] = None
) -> tuple[cdk.App, InfraConfig, dict[str, cdk.Stack]]:
    """Create (or fill) an App; returns it, the validated config and the stacks by construct id.

    ``context`` is used by tests; ``cdk`` itself passes ``-c`` values through the App.
    Raises infra.config.InfraConfigError for bad context.
    """
    if app is None:
        app = cdk.App(context=dict(context or {}), outdir=outdir)
    for flag, value in FEATURE_FLAGS.items():
        if app.node.try_get_context(flag) is None:
            app.node.set_context(flag, value)
    cfg = from_context(app.node.try_get_context)
    env = cdk.Environment(account=cfg.account, region=cfg.region) if cfg.account and cfg.region else None
    cdk.Tags.of(app).add("trainstack:env", cfg.env)
    cdk.Tags.of(app).add("project", "trainstack")
    data = DataStack(
        app,
        "DataStack",
        config=cfg,
        env=env,
        stack_name=cfg.stack_name("DataStack"),
        termination_protection=False,
        description=f"Trainstack {cfg.env}: S3, EBS data volume, FSx, VPC (volume on destroy: {cfg.data_volume_removal})",
    )
    monitoring = MonitoringStack(
        app,
        "MonitoringStack",
        config=cfg,
        env=env,
        stack_name=cfg.stack_name("MonitoringStack"),
        description=f"Trainstack {cfg.env}: alarms, events, logs, dashboard",
    )
    training = TrainingStack(
        app,
        "TrainingStack",
        config=cfg,
        data=data,
        monitoring=monitoring,
        env=env,
        stack_name=cfg.stack_name("TrainingStack"),
        description=f"Trainstack {cfg.env}: ECR, roles, spot launch templates, SageMaker jobs",
    )
    training.add_stack_dependency(monitoring)
    training.add_stack_dependency(data)
    stacks = {"DataStack": data, "MonitoringStack": monitoring, "TrainingStack": training}
    if cfg.github_repo:
        stacks["CiStack"] = CiStack(
            app,
            "CiStack",
            config=cfg,
            env=env,
            stack_name="trainstack-ci",
            description=f"Trainstack: GitHub OIDC deploy role for {cfg.github_repo}",
        )
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app, cfg, stacks


def main() -> int:
    """``cdk synth`` / ``cdk deploy``'s entry (app.py, through cdk.json): build the app from context and synth.

    Returns the exit status: 0, or 2 after printing one line ``error: context KEY: got VALUE; expected ...``
    (no traceback) when a context value is invalid. The CDK CLI then adds its own "Subprocess exited" line.
    """
    try:
        app, _cfg, _stacks = build_app()
    except InfraConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app.synth()
    return 0
