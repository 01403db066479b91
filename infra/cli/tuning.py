"""``python -m infra sweep --strategy tuning``: a sweep as one SageMaker hyperparameter tuning job, and the status,
``stop`` and ``teardown`` of such jobs. The plan (trials, strategy, K) is :mod:`infra.cli.sweep_plan`'s.

One ``CreateHyperParameterTuningJob`` named ``trainstack-<env>-<SWEEP>`` (at most 32 characters, the API's limit),
which SageMaker schedules itself with ``MaxParallelTrainingJobs = K``; ``MaxNumberOfTrainingJobs`` = the number of
trials. The ``TrainingJobDefinition`` is the state machine's own CreateTrainingJob request (read from the deployed
definition: role, instance type, volume, managed spot, MaxRuntime/MaxWait, metric regexes, environment), with
``StaticHyperParameters`` = the base config minus the swept fields, this sweep's image and data channel, and no
``CheckpointConfig`` (trials would share one prefix; see :func:`tuning_request`). Tags on the tuning job are
also added to every training job it launches (API reference, CreateHyperParameterTuningJob ``Tags``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from botocore.exceptions import ClientError

from infra.cli import jobs
from infra.cli.outputs import Outputs, image_exists
from infra.cli.session import Aws, CliError, explain
from infra.cli.sweep_plan import TUNING_NAME_MAX, SweepPlan, hp_value, tags, wall_seconds

#: "Number of metrics defined per hyperparameter tuning job: 20" (AWS docs, "Resource Limits for Automatic Model
#: Tuning"); a training job takes 40.
MAX_TUNING_METRICS = 20


def parameter_ranges(p: SweepPlan) -> dict[str, list]:
    """``ParameterRanges``: each grid a ``CategoricalParameterRanges`` entry (values as hyperparameter strings),
    each range ``IntegerParameterRanges`` or ``ContinuousParameterRanges`` with ``ScalingType`` Logarithmic or
    Linear (AWS docs, "Define Hyperparameter Ranges")."""
    out: dict[str, list] = {
        "CategoricalParameterRanges": [],
        "ContinuousParameterRanges": [],
        "IntegerParameterRanges": [],
    }
    for k, values in p.space.grid.items():
        out["CategoricalParameterRanges"].append({"Name": k, "Values": [jobs.hp_string(v) for v in values]})
    for k, r in p.space.ranges.items():
        entry = {
            "Name": k,
            "MinValue": str(int(r.low) if r.integer else r.low),
            "MaxValue": str(int(r.high) if r.integer else r.high),
            "ScalingType": "Logarithmic" if r.log else "Linear",
        }
        out["IntegerParameterRanges" if r.integer else "ContinuousParameterRanges"].append(entry)
    return {k: v for k, v in out.items() if v}


def tuning_metric_definitions(task: str, metric: str) -> list[dict[str, str]]:
    """The task's MetricDefinitions (the regexes the state machine's training jobs use, catalog/metrics.py), the
    objective first, cut to the tuning job's limit of :data:`MAX_TUNING_METRICS`."""
    from catalog.metrics import metric_definitions

    defs = metric_definitions([task])
    defs.sort(key=lambda d: d["Name"] != metric)
    return defs[:MAX_TUNING_METRICS]


def _static(value: Any) -> Any:
    """A state's Parameters without the ``.$`` (path or intrinsic) keys: what does not depend on the input."""
    if isinstance(value, dict):
        return {k: _static(v) for k, v in value.items() if not k.endswith(".$")}
    if isinstance(value, list):
        return [_static(v) for v in value]
    return value


def training_job_parameters(definition: dict) -> dict:
    """The ``Parameters`` of the ``createTrainingJob.sync`` task of a state machine's definition (ASL)."""
    for state in definition.get("States", {}).values():
        if str(state.get("Resource", "")).endswith(":sagemaker:createTrainingJob.sync"):
            return state["Parameters"]
    raise CliError("the state machine has no SageMaker training task", "redeploy the TrainingStack")


def tuning_request(p: SweepPlan, job: dict, image_uri: str, bucket: str, data_s3_uri: Optional[str] = None) -> dict:
    """The ``CreateHyperParameterTuningJob`` request of plan ``p``; ``job`` is the state machine's CreateTrainingJob
    ``Parameters`` (:func:`training_job_parameters`), whose static fields the definition mirrors.

    No ``CheckpointConfig``: a tuning job has one ``TrainingJobDefinition`` for all its trials, so they would share
    one S3 prefix, and SageMaker restores whatever is under a job's checkpoint S3 URI into its local path (AWS
    docs, "Resume training from a checkpoint"); no AWS page we found says a tuning job gives each trial its own
    prefix. A trial restoring another trial's checkpoint is refused by the trainer (config changed: exit 2), so a
    tuning trial interrupted by spot restarts from epoch 0 instead (SageMaker still retries it within
    MaxWaitTimeInSeconds). Long trials: ``--strategy jobs``, whose trials checkpoint to
    ``checkpoints/<SWEEP>-t003/<type>/`` each."""
    j = _static(job)
    algo = {
        "TrainingImage": image_uri,
        "TrainingInputMode": j["AlgorithmSpecification"]["TrainingInputMode"],
        "MetricDefinitions": tuning_metric_definitions(p.task, p.metric),
    }
    channels = []
    for ch in j["InputDataConfig"]:
        ch = json.loads(json.dumps(ch))
        ch["DataSource"]["S3DataSource"]["S3Uri"] = data_s3_uri or p.data or f"s3://{bucket}/datasets/"
        channels.append(ch)
    definition = {
        "StaticHyperParameters": p.static_hps,
        "AlgorithmSpecification": algo,
        "RoleArn": j["RoleArn"],
        "InputDataConfig": channels,
        "OutputDataConfig": j["OutputDataConfig"],
        "ResourceConfig": {**j["ResourceConfig"], "InstanceCount": 1},
        "StoppingCondition": j["StoppingCondition"],
        "EnableManagedSpotTraining": bool(j.get("EnableManagedSpotTraining")),
    }
    if j.get("Environment"):
        definition["Environment"] = j["Environment"]
    config = {
        "Strategy": p.tuning_strategy,
        "HyperParameterTuningJobObjective": {
            "Type": "Maximize" if p.mode == "max" else "Minimize",
            "MetricName": p.metric,
        },
        "ResourceLimits": {
            "MaxNumberOfTrainingJobs": len(p.trials),
            "MaxParallelTrainingJobs": p.max_parallel,
        },
        "ParameterRanges": parameter_ranges(p),
        "TrainingJobEarlyStoppingType": "Off",
    }
    if p.tuning_strategy != "Grid":
        config["RandomSeed"] = p.space.seed
    return {
        "HyperParameterTuningJobName": p.tuning_job_name,
        "HyperParameterTuningJobConfig": config,
        "TrainingJobDefinition": definition,
        "Tags": tags(p),
    }


def submit_tuning(aws: Aws, outputs: Outputs, p: SweepPlan, image_tag: str, sm=None, sfn=None, ecr=None) -> str:
    """Create the tuning job; returns its ARN. Reads the state machine's training-job request
    (``states:DescribeStateMachine``) and checks the image exists first."""
    arn = outputs.state_machine(p.machine)
    image_exists(aws, outputs, image_tag, ecr)
    sfn = sfn or aws.client("stepfunctions")
    sm = sm or aws.client("sagemaker")
    try:
        definition = json.loads(sfn.describe_state_machine(stateMachineArn=arn)["definition"])
    except ClientError as e:
        raise explain(e, f"reading state machine {p.machine}") from None
    req = tuning_request(
        p, training_job_parameters(definition), f"{outputs.repository_uri}:{image_tag}", outputs.bucket
    )
    try:
        return sm.create_hyper_parameter_tuning_job(**req)["HyperParameterTuningJobArn"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ResourceInUse":
            raise CliError(
                f"tuning job {p.tuning_job_name} exists already",
                f"`python -m infra --env {p.env} sweep-status --name {p.name}`, or another --name",
            ) from None
        raise explain(e, f"creating tuning job {p.tuning_job_name}") from None


def stop_tuning_jobs(aws: Aws, apply: bool, sm=None) -> list[str]:
    """Names of this environment's InProgress tuning jobs (stopped with ``apply``; SageMaker then stops their
    training jobs): ``teardown`` removes what still bills. Listed by the ``trainstack-<env>-`` prefix and kept only
    when tagged ``trainstack:env`` = this environment (the prefix alone also matches ``<env>-x``'s jobs).
    Raises CliError when AWS refuses (``sagemaker:ListHyperParameterTuningJobs``, ``ListTags``,
    ``StopHyperParameterTuningJob``)."""
    sm = sm or aws.client("sagemaker")
    mine = {"Key": "trainstack:env", "Value": aws.env}
    try:
        found = [
            j["HyperParameterTuningJobName"]
            for page in sm.get_paginator("list_hyper_parameter_tuning_jobs").paginate(
                NameContains=f"trainstack-{aws.env}-", StatusEquals="InProgress"
            )
            for j in page["HyperParameterTuningJobSummaries"]
            if mine in sm.list_tags(ResourceArn=j["HyperParameterTuningJobArn"]).get("Tags", [])
        ]
        if apply:
            for name in found:
                sm.stop_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
    except ClientError as e:
        raise explain(e, "stopping running tuning jobs") from None
    return found


def stop_tuning_job(aws: Aws, name: str, sm=None) -> Optional[str]:
    """``python -m infra stop NAME`` for a tuning job: stops ``NAME`` when it is a tuning job tagged with this
    environment (SageMaker then stops its training jobs) and says so; None when no tuning job has that name (the
    caller then treats it as a training job). Raises CliError for another environment's tuning job."""
    if not name.startswith(f"trainstack-{aws.env}-") or len(name) > TUNING_NAME_MAX:
        return None
    sm = sm or aws.client("sagemaker")
    try:
        job = sm.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("ResourceNotFound", "ValidationException"):
            return None
        raise explain(e, f"describing tuning job {name}") from None
    try:
        tags = sm.list_tags(ResourceArn=job["HyperParameterTuningJobArn"]).get("Tags", [])
        if {"Key": "trainstack:env", "Value": aws.env} not in tags:
            raise CliError(f"tuning job {name} is not tagged trainstack:env={aws.env}", "pass its own --env")
        sm.stop_hyper_parameter_tuning_job(HyperParameterTuningJobName=name)
    except ClientError as e:
        raise explain(e, f"stopping tuning job {name}") from None
    return f"stopping tuning job {name} (SageMaker stops its running training jobs)"


def _tuning_trial(job_name: str, tuning_name: str) -> str:
    """``trainstack-dev-x-003-1a2b3c4d`` -> ``t002`` (SageMaker numbers a tuning job's training jobs from 001)."""
    from trainer.config.sweep import trial_name

    m = re.match(rf"^{re.escape(tuning_name)}-(\d+)-[0-9a-f]+$", job_name) or re.search(
        r"-(\d{3})-[0-9a-f]+$", job_name
    )
    return trial_name(int(m.group(1)) - 1) if m else job_name


def tuning_rows(describe: dict, summaries: list[dict]) -> tuple[list[dict], list[str], str, str]:
    """Rows (trial, swept values, metric, status, wall_s), swept names, metric and mode of a tuning job from
    ``DescribeHyperParameterTuningJob`` and ``ListTrainingJobsForHyperParameterTuningJob``."""
    cfg = describe["HyperParameterTuningJobConfig"]
    obj = cfg["HyperParameterTuningJobObjective"]
    metric, mode = obj["MetricName"], ("max" if obj["Type"] == "Maximize" else "min")
    names = [r["Name"] for kind in cfg.get("ParameterRanges", {}).values() for r in kind]
    rows = []
    for s in sorted(summaries, key=lambda s: s["TrainingJobName"]):
        row = {"trial": _tuning_trial(s["TrainingJobName"], describe["HyperParameterTuningJobName"])}
        tuned = s.get("TunedHyperParameters", {})
        row.update({n: hp_value(tuned[n]) if n in tuned else None for n in names})
        final = s.get("FinalHyperParameterTuningJobObjectiveMetric")
        row[metric] = float(final["Value"]) if final else None
        row["status"] = s["TrainingJobStatus"]
        row["wall_s"] = wall_seconds(s.get("TrainingStartTime"), s.get("TrainingEndTime"))
        row["job"] = s["TrainingJobName"]
        rows.append(row)
    return rows, names, metric, mode
