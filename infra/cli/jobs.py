"""SageMaker side of the CLI: submit a managed-spot job through the stack's state machine, list, stop.

``submit`` turns a trainer config (the same YAML ``python -m trainer train --config`` reads, validated by
``trainer.config.load_config``, which needs no torch) into SageMaker hyperparameters, checks that the image tag
exists in ECR, and starts an execution of ``trainstack-<env>-train-<type>`` or ``-scaling-plan``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any, Optional

import yaml
from botocore.exceptions import ClientError

import catalog
from infra.cli.outputs import Outputs, image_exists
from infra.cli.session import Aws, CliError, explain
from infra.config import state_machine_names

#: Fields SageMaker owns inside the job (channels, /opt/ml/checkpoints, /opt/ml/model): never sent.
PLATFORM_FIELDS = ("data_dir", "checkpoint_dir", "log_dir", "resume", "device")
_RUN_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9-]{0,39}$")


def hp_string(value: Any) -> str:
    """A config value as a SageMaker hyperparameter string: lists/dicts as JSON, booleans lower-case."""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def hyperparameters(config_path: Optional[str], overrides: dict[str, str]) -> dict[str, str]:
    """SageMaker hyperparameters (str -> str) from a trainer YAML plus ``--set key=value`` overrides.

    The merged values are validated by the trainer's own config loader first. Raises CliError naming the
    file or key (missing file, bad YAML, unknown field, invalid value).
    """
    from trainer.config import ALIASES, FIELDS, ConfigError, load_config, yaml_fields  # pure Python: no torch

    values: dict[str, Any] = {}
    if config_path:
        p = Path(config_path)
        if not p.is_file():
            raise CliError(
                f"--config: {p} " + ("is a directory; expected a YAML file" if p.is_dir() else "does not exist")
            )
        try:
            values = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"--config: {p} cannot be read as UTF-8 text: {e}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise CliError(f"--config: {p} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    for key in overrides:
        if ALIASES.get(key, key) not in FIELDS:
            raise CliError(f"--set {key}: unknown trainer config key (see `python -m trainer train --help`)")
    try:  # the trainer's own validation: unknown keys (with close matches) and bad values
        load_config(config_path, {ALIASES.get(k, k): v for k, v in overrides.items() if k not in PLATFORM_FIELDS})
    except ConfigError as e:
        raise CliError(str(e)) from None
    if config_path:  # flat field names: nested sections (optim: {lr: ...}) and aliases resolved
        values = yaml_fields(config_path)
    values.update({ALIASES.get(k, k): v for k, v in overrides.items()})
    hp = {}
    for k, v in values.items():
        if k in PLATFORM_FIELDS:
            continue
        hp[k] = hp_string(v)
    if len(hp) > 100:
        raise CliError(f"{len(hp)} hyperparameters; SageMaker accepts at most 100")
    return hp


def execution_name(run_name: str, now: Optional[dt.datetime] = None) -> str:
    """``<run_name>-YYYYmmdd-HHMMSS`` (Step Functions names: at most 80 characters)."""
    now = now or dt.datetime.now(dt.UTC)
    return f"{run_name}-{now:%Y%m%d-%H%M%S}"


def check_request(
    run_name: str,
    config: Optional[str],
    overrides: dict[str, str],
    data_s3_uri: Optional[str] = None,
    instance_count: int = 1,
) -> dict[str, str]:
    """The checks of :func:`submit` that need no AWS call (the CLI runs them before opening a session).

    Returns the hyperparameters. Raises CliError for a bad run name, instance count, ``--data`` URI or config.
    """
    if not _RUN_RE.match(run_name):
        raise CliError(f"run name {run_name!r}: expected 1-40 letters, digits or '-' (it keys the S3 checkpoints)")
    if instance_count < 1:
        raise CliError(f"--instance-count {instance_count}: expected at least 1")
    if data_s3_uri and not data_s3_uri.startswith("s3://"):
        raise CliError(f"--data {data_s3_uri!r}: expected an s3:// URI")
    return hyperparameters(config, overrides)


def submit(
    aws: Aws,
    outputs: Outputs,
    machine: str,
    run_name: str,
    image_tag: str,
    config: Optional[str],
    overrides: dict[str, str],
    data_s3_uri: Optional[str] = None,
    instance_count: int = 1,
    nproc_per_node: Optional[int] = None,
    sfn=None,
    ecr=None,
) -> str:
    """Start a managed-spot SageMaker run; returns the execution ARN.

    ``nproc_per_node`` is only checked: processes per host come from the catalog's GPU count, so asking for
    2 on a 1-GPU type (seed 000's mistake on ml.g5.2xlarge) is an error. Raises CliError for a bad run
    name, missing image, unknown state machine or a bad config.
    """
    hp = check_request(run_name, config, overrides, data_s3_uri, instance_count)
    arn = outputs.state_machine(machine)
    if machine.startswith("train-"):
        it = catalog.get("ml." + machine.removeprefix("train-").replace("-", ".", 1))
        issue = catalog.check_processes_per_host(it, nproc_per_node) if nproc_per_node is not None else None
        if issue:
            raise CliError(issue[1], f"drop the flag: the job runs {it.processes_per_host} (the catalog's GPU count)")
    digest = image_exists(aws, outputs, image_tag, ecr)
    payload = {
        "run_name": run_name,
        "image_tag": image_tag,  # immutable in the repository: a resumed or resubmitted run gets the same image
        "image_digest": digest,  # recorded in the execution input
        "instance_count": instance_count,
        "hyperparameters": hp,
    }
    if data_s3_uri:
        payload["data_s3_uri"] = data_s3_uri
    sfn = sfn or aws.client("stepfunctions")
    try:
        out = sfn.start_execution(stateMachineArn=arn, name=execution_name(run_name), input=json.dumps(payload))
    except ClientError as e:
        raise explain(e, f"starting {machine}") from None
    return out["executionArn"]


def list_runs(aws: Aws, outputs: Outputs, sfn=None, sm=None) -> dict[str, list[dict]]:
    """Recent executions of this environment's state machines and its SageMaker training jobs."""
    sfn = sfn or aws.client("stepfunctions")
    sm = sm or aws.client("sagemaker")
    executions = []
    try:
        for key, arn in sorted(outputs.state_machines.items()):
            for ex in sfn.list_executions(stateMachineArn=arn, maxResults=20)["executions"]:
                executions.append(
                    {
                        "machine": key,
                        "name": ex["name"],
                        "status": ex["status"],
                        "start": ex["startDate"],
                        "arn": ex["executionArn"],
                    }
                )
        jobs = [
            {"name": j["TrainingJobName"], "status": j["TrainingJobStatus"], "start": j["CreationTime"]}
            for j in sm.list_training_jobs(
                NameContains=f"trainstack-{aws.env}-", MaxResults=50, SortBy="CreationTime", SortOrder="Descending"
            )["TrainingJobSummaries"]
        ]
    except ClientError as e:
        raise explain(e, "listing runs") from None
    return {"executions": executions, "jobs": jobs}


def _call(doing: str, fn, **kwargs):
    """``fn(**kwargs)``, with a ClientError turned into a CliError saying what was being done."""
    try:
        return fn(**kwargs)
    except ClientError as e:
        raise explain(e, doing) from None


def describe_execution(aws: Aws, arn: str, sfn=None) -> dict:
    """Status, start/stop times, input and (when finished) output or error of one state-machine execution."""
    sfn = sfn or aws.client("stepfunctions")
    ex = _call(f"describing execution {arn}", sfn.describe_execution, executionArn=arn)
    out = {k: ex.get(k) for k in ("name", "status", "startDate", "stopDate", "error", "cause")}
    for k in ("input", "output"):
        if ex.get(k):
            out[k] = json.loads(ex[k])
    return out


def describe_job(aws: Aws, name: str, sm=None) -> dict:
    """Status, secondary status, billable seconds and spot savings of one training job."""
    sm = sm or aws.client("sagemaker")
    j = _call(f"describing job {name}", sm.describe_training_job, TrainingJobName=name)
    return {
        k: j.get(k)
        for k in (
            "TrainingJobName",
            "TrainingJobStatus",
            "SecondaryStatus",
            "FailureReason",
            "BillableTimeInSeconds",
            "TrainingTimeInSeconds",
            "EnableManagedSpotTraining",
            "ResourceConfig",
            "CheckpointConfig",
            "ModelArtifacts",
        )
    }


def stop_run(aws: Aws, target: str, sfn=None, sm=None) -> str:
    """Stop an execution (by ARN) or a training job (by name). Returns what was done."""
    try:
        if target.startswith("arn:") and ":execution:" in target:
            (sfn or aws.client("stepfunctions")).stop_execution(executionArn=target, cause="python -m infra stop")
            return f"stopped execution {target}"
        if not target.startswith(f"trainstack-{aws.env}-"):
            raise CliError(
                f"{target!r} is neither an execution ARN nor a training job of environment {aws.env}",
                "`python -m infra status` lists them",
            )
        (sm or aws.client("sagemaker")).stop_training_job(TrainingJobName=target)
        return f"stopping training job {target}"
    except ClientError as e:
        raise explain(e, f"stopping {target}") from None


def stop_running_executions(aws: Aws, outputs: Outputs, apply: bool, sfn=None) -> list[str]:
    """ARNs of this environment's RUNNING executions (stopped with ``apply``: Step Functions then stops their
    training jobs). The state machines are the stack's outputs, or, when the training stack's outputs are
    unknown (a rolled-back deploy), every state machine whose name is one this environment's stack can give
    (infra.config.state_machine_names: exact names, so environment ``dev`` never stops ``dev-x``'s runs).
    Raises CliError when AWS refuses (``states:ListStateMachines``, ``states:ListExecutions``,
    ``states:StopExecution``)."""
    sfn = sfn or aws.client("stepfunctions")
    names = state_machine_names(aws.env, catalog.names("sagemaker"))
    try:
        arns = list(outputs.state_machines.values())
        if not arns:
            arns = [
                m["stateMachineArn"]
                for page in sfn.get_paginator("list_state_machines").paginate()
                for m in page["stateMachines"]
                if m["name"] in names
            ]
        running = [
            ex["executionArn"]
            for arn in arns
            for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=arn, statusFilter="RUNNING")
            for ex in page["executions"]
        ]
        if apply:
            for arn in running:
                sfn.stop_execution(executionArn=arn, cause="python -m infra teardown")
    except ClientError as e:
        raise explain(e, "stopping running executions") from None
    return running
