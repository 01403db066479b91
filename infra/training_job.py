"""The ``createTrainingJob.sync`` task of the SageMaker state machines as plain data (no aws_cdk import), so the
CLI can read it too: ``python -m infra sweep --strategy tuning --dry-run`` mirrors this request in a tuning job's
``TrainingJobDefinition`` without synthesizing the app. The construct is infra/constructs/sagemaker_job.py.
"""

from __future__ import annotations

from typing import Any, Optional

from catalog import InstanceType
from catalog.metrics import metric_definitions
from infra.config import PHASE_RE

#: SageMaker MetricDefinitions for the trainer's ``key=value`` epoch lines, every task's keys (catalog/metrics.py).
METRIC_DEFINITIONS = metric_definitions()
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
#: Keys of the execution input's ``sweep`` object, each a training-job tag ``trainstack:<key>``
#: (infra/cli/sweep_plan.py, ``SweepPlan.sweep_tags``).
SWEEP_TAGS = ("sweep", "trial", "parameters", "objective")


def training_job_state(
    *,
    phase: str,
    instance: InstanceType,
    prefix: str,
    image_repository_uri: str,
    role_arn: str,
    bucket_name: str,
    volume_gib: int,
    max_run_s: int,
    max_wait_s: int,
    hyperparameters_path: str = "$.args.hyperparameters",
    env: Optional[str] = None,
) -> dict[str, Any]:
    """The Amazon States Language of one ``createTrainingJob.sync`` task with managed spot.

    Job name: ``<prefix>-<phase>-<8 random hex>`` (at most 63 characters). Checkpoints:
    ``s3://<bucket_name>/checkpoints/<run_name>/<phase>/`` <-> ``/opt/ml/checkpoints``, one prefix per phase.
    Tags (SageMaker training jobs; what ``python -m infra sweep-status`` searches by, never the name prefix, which
    environment ``dev`` shares with ``dev-x``): ``trainstack:prefix``, ``trainstack:env`` (when ``env`` is given),
    ``trainstack:run`` (the execution's run name) and ``trainstack:sweep``, ``trainstack:trial``,
    ``trainstack:parameters``, ``trainstack:objective`` from the execution input's ``sweep`` object (empty strings
    outside a sweep; the state machine's defaults). Raises ValueError if ``max_wait_s < max_run_s`` (SageMaker requires MaxWaitTimeInSeconds >= MaxRuntimeInSeconds) or the phase
    name is not 1-16 lower-case letters, digits or '-'.
    """
    if max_wait_s < max_run_s:
        raise ValueError(f"MaxWaitTimeInSeconds ({max_wait_s}) must be >= MaxRuntimeInSeconds ({max_run_s})")
    if not PHASE_RE.match(phase):
        raise ValueError(f"phase name {phase!r}: expected 1-16 lower-case letters, digits or '-'")
    if instance.platform != "sagemaker":
        raise ValueError(f"{instance.name} is not a SageMaker (ml.*) instance type")
    return {
        "Type": "Task",
        "Resource": "arn:aws:states:::sagemaker:createTrainingJob.sync",
        "Parameters": {
            "TrainingJobName.$": f"States.Format('{prefix}-{phase}-{{}}', "
            "States.ArrayGetItem(States.StringSplit(States.UUID(), '-'), 0))",
            "AlgorithmSpecification": {
                "TrainingImage.$": f"States.Format('{image_repository_uri}:{{}}', $.args.image_tag)",
                "TrainingInputMode": "FastFile",
                "MetricDefinitions": METRIC_DEFINITIONS,
            },
            "RoleArn": role_arn,
            "InputDataConfig": [
                {
                    "ChannelName": "train",
                    "DataSource": {
                        "S3DataSource": {
                            "S3DataType": "S3Prefix",
                            "S3Uri.$": "$.args.data_s3_uri",
                            "S3DataDistributionType": "FullyReplicated",
                        }
                    },
                }
            ],
            "OutputDataConfig": {"S3OutputPath": f"s3://{bucket_name}/models/"},
            "ResourceConfig": {
                "InstanceType": instance.name,
                "InstanceCount.$": "$.args.instance_count",
                "VolumeSizeInGB": volume_gib,
            },
            "StoppingCondition": {"MaxRuntimeInSeconds": max_run_s, "MaxWaitTimeInSeconds": max_wait_s},
            "EnableManagedSpotTraining": True,
            "CheckpointConfig": {
                "S3Uri.$": f"States.Format('s3://{bucket_name}/checkpoints/{{}}/{phase}/', $.args.run_name)",
                "LocalPath": CHECKPOINT_LOCAL_PATH,
            },
            "HyperParameters.$": hyperparameters_path,
            "Environment": {"TRAINSTACK_NPROC_PER_NODE": str(instance.processes_per_host)},
            "Tags": [
                {"Key": "trainstack:prefix", "Value": prefix},
                *([{"Key": "trainstack:env", "Value": env}] if env else []),
                {"Key": "trainstack:run", "Value.$": "$.args.run_name"},
                *({"Key": f"trainstack:{k}", "Value.$": f"$.args.sweep.{k}"} for k in SWEEP_TAGS),
            ],
        },
        "ResultSelector": {
            "TrainingJobName.$": "$.TrainingJobName",
            "TrainingJobStatus.$": "$.TrainingJobStatus",
            "ModelArtifacts.$": "$.ModelArtifacts",
            "BillableTimeInSeconds.$": "$.BillableTimeInSeconds",
        },
        "ResultPath": f"$.jobs.{phase.replace('-', '_')}",
    }
