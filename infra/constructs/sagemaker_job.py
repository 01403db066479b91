"""SageMaker training jobs with managed spot, as Step Functions state machines.

CDK's ``SageMakerCreateTrainingJob`` task has no ``EnableManagedSpotTraining``/``CheckpointConfig``, so each
job is a ``CustomState`` calling ``arn:aws:states:::sagemaker:createTrainingJob.sync`` with the raw
CreateTrainingJob request (SageMaker API reference; Step Functions "Create and manage Amazon SageMaker jobs").

Execution input (every key optional but ``run_name``)::

    {"run_name": "resnet50-a", "image_tag": "3f2c1ab", "instance_count": 1,
     "data_s3_uri": "s3://<bucket>/datasets/imagenette/", "hyperparameters": {"epochs": "5"},
     "sweep": {"sweep": "roofs-lr", "trial": "t003", "parameters": "lr", "objective": "val_top1 max"}}

``sweep`` (``python -m infra sweep`` sends it) becomes the training job's ``trainstack:sweep``/``:trial``/
``:parameters``/``:objective`` tags (empty outside a sweep), next to ``trainstack:env`` and ``trainstack:run``.

``run_name`` and the phase key the checkpoint prefix ``s3://<bucket>/checkpoints/<run_name>/<phase>/``: a new
execution with the same run name resumes each phase from its own checkpoint, and a later phase (seed 001's GPU
phase after its CPU smoke run, with another batch size) never restores an earlier phase's checkpoint, which the
trainer would refuse (exit 2). Processes per host are the catalog's GPU count (``TRAINSTACK_NPROC_PER_NODE``);
ml.g5.2xlarge gets 1, never the 2 of seed 000.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from catalog import InstanceType
from infra.training_job import CHECKPOINT_LOCAL_PATH, METRIC_DEFINITIONS, SWEEP_TAGS, training_job_state  # noqa: F401


class SageMakerSpotJobs(Construct):
    """State machines running managed-spot training jobs in sequence (one phase per job).

    ``phases``: ``[(name, InstanceType, {hyperparameter: str})]``; a phase's hyperparameters override the
    execution input's. Attribute ``state_machine``.
    """

    def __init__(
        self,
        scope: Construct,
        cid: str,
        *,
        name: str,
        phases: Sequence[tuple[str, InstanceType, Mapping[str, str]]],
        prefix: str,
        image_repository_uri: str,
        execution_role: iam.IRole,
        bucket_name: str,
        default_data_s3_uri: str,
        volume_gib: int,
        max_run_s: int,
        max_wait_s: int,
        default_image_tag: Optional[str],
        env: Optional[str] = None,
    ) -> None:
        super().__init__(scope, cid)
        image_default = {"image_tag": default_image_tag} if default_image_tag else {}
        defaults = sfn.Pass(
            self,
            "Defaults",
            parameters={
                "defaults": {
                    **image_default,
                    "instance_count": 1,
                    "hyperparameters": {},
                    "data_s3_uri": default_data_s3_uri,
                    "sweep": {k: "" for k in SWEEP_TAGS},
                },
                "input.$": "$",
            },
        )
        merge = sfn.Pass(
            self, "MergeInput", parameters={"args.$": "States.JsonMerge($.defaults, $.input, false)", "jobs": {}}
        )
        chain = defaults.next(merge)
        for phase, instance, hyperparameters in phases:
            hp = sfn.Pass(
                self,
                f"Hyperparameters-{phase}",
                parameters={"phase": {str(k): str(v) for k, v in hyperparameters.items()}},
                result_path="$.phase",
            )
            merged = sfn.Pass(
                self,
                f"MergeHyperparameters-{phase}",
                parameters={"merged.$": "States.JsonMerge($.args.hyperparameters, $.phase.phase, false)"},
                result_path="$.hp",
            )
            job = sfn.CustomState(
                self,
                f"Train-{phase}",
                state_json=training_job_state(
                    phase=phase,
                    instance=instance,
                    prefix=prefix,
                    image_repository_uri=image_repository_uri,
                    role_arn=execution_role.role_arn,
                    bucket_name=bucket_name,
                    volume_gib=volume_gib,
                    max_run_s=max_run_s,
                    max_wait_s=max_wait_s,
                    hyperparameters_path="$.hp.merged",
                    env=env,
                ),
            )
            chain = chain.next(hp).next(merged).next(job)
        # /aws/vendedlogs/ prefix: CloudWatch Logs then grants Step Functions' log delivery without adding to the
        # account's resource policy (5,120 characters per region, exhausted after a few environments otherwise).
        log_group = logs.LogGroup(
            self,
            "Logs",
            log_group_name=f"/aws/vendedlogs/states/{name}",
            retention=logs.RetentionDays.THREE_MONTHS,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=name,
            definition_body=sfn.DefinitionBody.from_chainable(chain),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            timeout=cdk.Duration.seconds(max_wait_s * len(phases) + 3600),
        )
        stack = cdk.Stack.of(self)
        job_arn = stack.format_arn(service="sagemaker", resource="training-job", resource_name=f"{prefix}-*")
        self.state_machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=[
                    "sagemaker:CreateTrainingJob",
                    "sagemaker:DescribeTrainingJob",
                    "sagemaker:StopTrainingJob",
                    "sagemaker:AddTags",
                ],
                resources=[job_arn],
            )
        )
        self.state_machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
                resources=[
                    stack.format_arn(
                        service="events",
                        resource="rule",
                        resource_name="StepFunctionsGetEventsForSageMakerTrainingJobsRule",
                    )
                ],
            )
        )
        self.state_machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[execution_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
            )
        )


def phases_from_context(phases: Sequence[Mapping[str, Any]], lookup) -> list[tuple[str, InstanceType, dict]]:
    """``[{"name", "instance_type", "hyperparameters"}]`` (context ``scaling_phases``) -> construct phases."""
    return [(p["name"], lookup(p["instance_type"]), dict(p.get("hyperparameters") or {})) for p in phases]
