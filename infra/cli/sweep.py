"""``python -m infra sweep`` / ``sweep-status``: a hyperparameter sweep on SageMaker managed spot (issue 26 item 3).

The search space, its trials, the objective and the results table are ``trainer.config.sweep``'s, the same module
``python -m trainer sweep`` runs locally, so both give the same trials (same seed) and the same table.

Two strategies:

* ``jobs`` (default): one managed-spot training job per trial through the environment's state machine
  ``trainstack-<env>-train-<type>`` (the ``submit`` path: run name ``<SWEEP>-t003``, checkpoints
  ``s3://<bucket>/checkpoints/<SWEEP>-t003/<type>/``). Nothing in the stack schedules trials, so ``sweep`` keeps at
  most K running: it starts the trials that have no execution yet until K executions of the sweep are RUNNING, and
  stops. **Run the same command again to top up** (as trials finish). It is idempotent: a trial with an execution
  is never started again, unless ``--retry-failed`` and its execution failed (it then resumes from its
  checkpoint); and it refuses a changed sweep under the same name (a fingerprint of the trials and the base
  hyperparameters travels in every execution input). The state machine tags each training
  job ``trainstack:env``, ``trainstack:sweep``, ``trainstack:trial``: ``sweep-status`` finds them with SageMaker
  ``Search`` on those tags (AWS API reference, ``Filter``: "To define a tag filter, enter a value with the form
  ``Tags.<key>``"), never by the name prefix alone (which env ``dev`` shares with ``dev-x``).
* ``tuning``: one ``CreateHyperParameterTuningJob`` named ``trainstack-<env>-<SWEEP>`` (at most 32 characters, the
  API's limit), which SageMaker schedules itself with ``MaxParallelTrainingJobs = K``. Strategy: ``Grid`` for a
  grid-only space without ``--random`` (SageMaker's Grid search takes categorical parameters only, "How
  Hyperparameter Tuning Works"), ``Bayesian`` when there are ``--range``s, ``Random`` for ``--random N`` over grids
  only; ``--tuning-strategy`` overrides. ``MaxNumberOfTrainingJobs`` = the number of trials. The
  ``TrainingJobDefinition`` is the state machine's own CreateTrainingJob request (read from the deployed definition:
  role, instance type, volume, managed spot, MaxRuntime/MaxWait, metric regexes, environment), with
  ``StaticHyperParameters`` = the base config minus the swept fields, this sweep's image and data channel, and no
  ``CheckpointConfig`` (trials would share one prefix; see :func:`tuning_request`). Tags on the tuning job are
  also added to every training job it launches (API reference, CreateHyperParameterTuningJob ``Tags``).

K (``--max-parallel``, default 2: seed 004's "2-3 parallel jobs"): at most 100, the hard limit of parallel
training jobs per tuning job (AWS docs, "Resource Limits for Automatic Model Tuning": default 10, can be
increased to 100; above 10 ask for a quota increase first). Each trial runs on its own instance of the
machine's type, so ``python -m trainer plan``'s per-instance sizing applies per trial: the type must fit one
trial (``--plan FILE``, a plan written by ``python -m trainer plan --out FILE``, refuses a type it says does not
fit: :func:`check_plan`), and K trials bill K instances at once (each at the spot rate of ``catalog``).

Every trial (base config + ``--set`` + the trial's values) is validated by the trainer's own config loader before
any AWS call; a bad one is exit 2 naming the trial and the field.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from botocore.exceptions import ClientError

import catalog
from infra.cli import jobs
from infra.cli.outputs import Outputs, image_exists
from infra.cli.session import Aws, CliError, explain

#: SageMaker's hard limit of parallel training jobs per tuning job (default quota 10; "Resource Limits for
#: Automatic Model Tuning").
MAX_PARALLEL = 100
DEFAULT_PARALLEL = 2
#: "Number of metrics defined per hyperparameter tuning job: 20" (same page); a training job takes 40.
MAX_TUNING_METRICS = 20
#: "Number of hyperparameters that can be searched: 30"; "each categorical hyperparameter can have at most 30
#: different values" (same page; the API's CategoricalParameterRange.Values max 30).
MAX_TUNED = 30
TUNING_NAME_MAX = 32  # HyperParameterTuningJobName: 1-32 characters, [a-zA-Z0-9](-*[a-zA-Z0-9]){0,31}
SWEEP_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,33}[a-z0-9])?$")  # + "-t000" = a 40-character run name
TUNING_STRATEGIES = ("Bayesian", "Random", "Grid")


def hp_value(text: str) -> Any:
    """A hyperparameter string back as a value (``"0.03"`` -> 0.03, ``"adamw"`` -> "adamw")."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return v if isinstance(v, (int, float, str, bool)) else text


@dataclass
class SweepPlan:
    """A validated sweep: everything ``sweep`` sends, computed without AWS."""

    name: str
    env: str
    machine: str
    instance_type: str
    task: str
    names: list[str]
    trials: list[dict[str, Any]]
    trial_hps: list[dict[str, str]]  # the full hyperparameters of each trial
    static_hps: dict[str, str]  # base config minus the swept fields
    metric: str
    mode: str
    strategy: str
    tuning_strategy: Optional[str]
    space: Any
    max_parallel: int
    config: Optional[str]
    overrides: dict[str, str]
    data: Optional[str] = None
    fingerprint: str = field(default="")

    @property
    def tuning_job_name(self) -> str:
        return f"trainstack-{self.env}-{self.name}"

    def run_name(self, index: int) -> str:
        from trainer.config.sweep import trial_name

        return f"{self.name}-{trial_name(index)}"

    def sweep_tags(self, trial: str = "") -> dict[str, str]:
        """The ``sweep`` object of an execution input: the training job's ``trainstack:<key>`` tags."""
        return {
            "sweep": self.name,
            "trial": trial,
            "parameters": " ".join(self.names),
            "objective": f"{self.metric} {self.mode}",
        }


def plan(
    env: str,
    name: str,
    machine: str,
    config: Optional[str],
    overrides: dict[str, str],
    grids: list[str],
    ranges: list[str],
    random_trials: Optional[int] = None,
    seed: int = 0,
    metric: Optional[str] = None,
    strategy: str = "jobs",
    tuning_strategy: Optional[str] = None,
    max_parallel: int = DEFAULT_PARALLEL,
    data: Optional[str] = None,
) -> SweepPlan:
    """Validate a sweep and expand its trials (no AWS call). Raises CliError naming the flag, trial or field."""
    from trainer.config import ConfigError, load_config
    from trainer.config.sweep import objective, search_space, trial_name

    if not SWEEP_RE.match(name):
        raise CliError(
            f"--name {name!r}: expected 1-35 lower-case letters, digits or '-' (the trials' run names "
            "<NAME>-t000 key their S3 checkpoints and must stay within 40 characters)"
        )
    if not machine.startswith("train-"):
        raise CliError(f"--machine {machine!r}: a sweep runs on one type; expected train-<type>, e.g. train-g5-xlarge")
    instance_type = "ml." + machine.removeprefix("train-").replace("-", ".", 1)
    try:
        catalog.get(instance_type)
    except catalog.CatalogError as e:
        raise CliError(f"--machine {machine!r}: {e}") from None
    if not 1 <= max_parallel <= MAX_PARALLEL:
        raise CliError(
            f"--max-parallel {max_parallel}: expected 1 to {MAX_PARALLEL} (SageMaker's limit of parallel training "
            "jobs per tuning job; the default quota is 10)"
        )
    if strategy not in ("jobs", "tuning"):
        raise CliError(f"--strategy {strategy!r}: expected jobs or tuning")
    if data and not data.startswith("s3://"):
        raise CliError(f"--data {data!r}: expected an s3:// URI")
    try:
        space = search_space(grids, ranges, random_trials, seed)
        base = load_config(config, {k: v for k, v in overrides.items() if k not in jobs.PLATFORM_FIELDS})
        metric_key, mode = objective(base.task, metric)
    except ConfigError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"--config: {e}") from None
    base_hps = jobs.hyperparameters(config, overrides)
    trials = space.trials()
    trial_hps = []
    for i, trial in enumerate(trials):
        try:
            trial_hps.append(jobs.hyperparameters(config, {**overrides, **trial}))
        except CliError as e:
            values = ", ".join(f"{k}={v}" for k, v in trial.items())
            raise CliError(f"trial {trial_name(i)} ({values}): {e.message}") from None
    names = space.names
    static = {k: v for k, v in base_hps.items() if k not in names}
    tuner = None
    if strategy == "tuning":
        tuner = tuning_strategy or ("Bayesian" if space.ranges else ("Grid" if space.random is None else "Random"))
        if tuner not in TUNING_STRATEGIES:
            raise CliError(f"--tuning-strategy {tuner!r}: expected one of {', '.join(TUNING_STRATEGIES)}")
        if tuner == "Grid" and (space.ranges or space.random is not None):
            raise CliError(
                "--tuning-strategy Grid: SageMaker's grid search takes categorical parameters only; "
                "drop --range/--random, or use Bayesian or Random"
            )
        if len(names) > MAX_TUNED:
            raise CliError(f"{len(names)} swept fields; a tuning job searches at most {MAX_TUNED}")
        for k, values in space.grid.items():
            if len(values) > MAX_TUNED:
                raise CliError(f"--grid {k}: {len(values)} values; a tuning job takes at most {MAX_TUNED} per field")
        tuning_name = f"trainstack-{env}-{name}"
        if len(tuning_name) > TUNING_NAME_MAX:
            room = TUNING_NAME_MAX - len(f"trainstack-{env}-")
            raise CliError(
                f"--name {name!r}: the tuning job name {tuning_name!r} has {len(tuning_name)} characters; "
                f"SageMaker takes at most {TUNING_NAME_MAX}",
                f"use a name of at most {room} characters in environment {env}",
            )
    fingerprint = hashlib.sha256(json.dumps([static, trial_hps], sort_keys=True).encode()).hexdigest()[:16]
    return SweepPlan(
        name=name,
        env=env,
        machine=machine,
        instance_type=instance_type,
        task=base.task,
        names=names,
        trials=trials,
        trial_hps=trial_hps,
        static_hps=static,
        metric=metric_key,
        mode=mode,
        strategy=strategy,
        tuning_strategy=tuner,
        space=space,
        max_parallel=max_parallel,
        config=config,
        overrides=overrides,
        data=data,
        fingerprint=fingerprint,
    )


#: Fields whose value changes a trial's memory per GPU: a plan made for another value says nothing about them.
MEMORY_FIELDS = ("model", "image_size", "precision", "channels_last", "accumulate_grad_batches")


def check_plan(p: SweepPlan, plan_file: str) -> None:
    """Refuse a machine that ``python -m trainer plan --out FILE`` says does not fit one trial.

    Each trial has its own instance, so the plan's per-instance verdict (row ``instance`` = the machine's type,
    ``fits``) applies per trial. The plan was made for one config: a trial with a larger ``batch_size`` than the
    plan's, or another value of a field in :data:`MEMORY_FIELDS`, is refused too (plan the largest trial).

    Raises CliError naming ``--plan`` (unreadable file, no row for the type, a row that does not fit, a trial
    beyond the planned config)."""
    from trainer.config.sweep import trial_name

    try:
        doc = json.loads(Path(plan_file).read_text(encoding="utf-8"))
        rows = {r["instance"]: r for r in doc["rows"]}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CliError(
            f"--plan {plan_file}: not a plan ({type(e).__name__}: {e})",
            "write one with `python -m trainer plan --config BASE --out plan.json`",
        ) from None
    row = rows.get(p.instance_type)
    if row is None:
        raise CliError(f"--plan {plan_file}: no row for {p.instance_type}", "plan that type too")
    if not row.get("fits"):
        why = "; ".join(row.get("errors") or []) or "memory per GPU over the budget"
        raise CliError(
            f"--plan {plan_file}: one trial does not fit {p.instance_type} ({why})",
            "pick a type the plan says fits, or a smaller batch",
        )
    planned = doc.get("batch_size")
    for i, hp in enumerate(p.trial_hps):
        if isinstance(planned, int) and int(hp.get("batch_size", planned)) > planned:
            raise CliError(
                f"--plan {plan_file}: planned for batch_size {planned}; trial {trial_name(i)} uses {hp['batch_size']}",
                "plan the sweep's largest batch (`python -m trainer plan --set batch_size=...`)",
            )
    varied = [n for n in p.names if n in MEMORY_FIELDS]
    if varied:
        raise CliError(
            f"--plan {plan_file}: the sweep varies {', '.join(varied)}, which changes memory per GPU; one plan "
            "cannot vouch for every trial",
            "drop --plan, or plan each value separately",
        )


def cost_line(p: SweepPlan) -> str:
    """What the sweep bills while K trials run: one instance per trial at the catalog's spot rate."""
    it = catalog.get(p.instance_type)
    rate = it.spot.usd_per_hour
    kind = "estimated" if it.spot.estimate else "recorded"
    return (
        f"each trial bills its own {p.instance_type} at ~${rate:.2f}/h spot ({kind}, catalog; on-demand "
        f"${it.on_demand.usd_per_hour:.2f}/h); {p.max_parallel} at a time ~${rate * p.max_parallel:.2f}/h"
    )


# ------------------------------------------------------------------------------------------------- tuning strategy
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


def tags(p: SweepPlan) -> list[dict[str, str]]:
    """``trainstack:env`` and the sweep's tags (added to every training job the tuning job launches)."""
    return [{"Key": "trainstack:env", "Value": p.env}] + [
        {"Key": f"trainstack:{k}", "Value": v} for k, v in p.sweep_tags().items() if k != "trial"
    ]


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


# ---------------------------------------------------------------------------------------------- jobs strategy
def execution_input(p: SweepPlan, index: int, image_tag: str, digest: Optional[str] = None) -> dict:
    """The state-machine input of trial ``index``: :func:`infra.cli.jobs.submit`'s, plus the ``sweep`` object
    (tags) and the sweep's fingerprint."""
    from trainer.config.sweep import trial_name

    payload = {
        "run_name": p.run_name(index),
        "image_tag": image_tag,
        "image_digest": digest,
        "instance_count": 1,
        "hyperparameters": p.trial_hps[index],
        "sweep": p.sweep_tags(trial_name(index)),
        "sweep_fingerprint": p.fingerprint,
    }
    if p.data:
        payload["data_s3_uri"] = p.data
    return payload


def _existing(sfn, arn: str, name: str) -> dict[str, dict]:
    """Trial -> newest execution (name, status, arn) of this sweep on state machine ``arn``."""
    rx = re.compile(rf"^{re.escape(name)}-(t\d{{3}})-\d{{8}}-\d{{6}}$")
    found: dict[str, dict] = {}
    for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=arn):
        for ex in page["executions"]:
            m = rx.match(ex["name"])
            if m and (m.group(1) not in found or ex["startDate"] > found[m.group(1)]["startDate"]):
                found[m.group(1)] = ex
    return found


#: Execution states after which ``--retry-failed`` starts a trial again (same run name: it resumes from its
#: checkpoint prefix).
FAILED_STATES = ("FAILED", "TIMED_OUT", "ABORTED")


def submit_jobs(
    aws: Aws, outputs: Outputs, p: SweepPlan, image_tag: str, retry_failed: bool = False, sfn=None, ecr=None
) -> dict[str, Any]:
    """Top the sweep up to K running trials: start the first trials without an execution (with ``retry_failed``
    also those whose newest execution failed, timed out or was aborted) until K executions of the sweep are
    RUNNING. Returns ``{"started": [execution ARNs], "running": n, "done": n, "left": n}`` (``done``: trials
    whose newest execution ended, ``left``: trials still to start).

    Raises CliError when an execution of this sweep name carries another fingerprint (a changed sweep)."""
    from trainer.config.sweep import trial_name

    arn = outputs.state_machine(p.machine)
    sfn = sfn or aws.client("stepfunctions")
    try:
        existing = _existing(sfn, arn, p.name)
        if existing:
            first = next(iter(existing.values()))
            got = json.loads(sfn.describe_execution(executionArn=first["executionArn"]).get("input") or "{}")
            if got.get("sweep_fingerprint") != p.fingerprint:
                raise CliError(
                    f"sweep {p.name!r} exists on {p.machine} with other trials or base config",
                    "rerun it with its original arguments to top it up, or pick another --name",
                )
    except ClientError as e:
        raise explain(e, f"listing the executions of {p.machine}") from None
    running = sum(1 for ex in existing.values() if ex["status"] == "RUNNING")
    todo = [
        i
        for i in range(len(p.trials))
        if trial_name(i) not in existing or (retry_failed and existing[trial_name(i)]["status"] in FAILED_STATES)
    ]
    done = sum(1 for t, ex in existing.items() if ex["status"] != "RUNNING")
    started = []
    digest = None
    for i in todo:
        if running >= p.max_parallel:
            break
        if digest is None:
            digest = image_exists(aws, outputs, image_tag, ecr) or ""
        payload = execution_input(p, i, image_tag, digest or None)
        try:
            out = sfn.start_execution(
                stateMachineArn=arn, name=jobs.execution_name(p.run_name(i)), input=json.dumps(payload)
            )
        except ClientError as e:
            raise explain(e, f"starting trial {trial_name(i)}") from None
        started.append(out["executionArn"])
        running += 1
        done -= trial_name(i) in existing  # a retried trial is running again
    return {"started": started, "running": running, "done": done, "left": len(todo) - len(started)}


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


# ------------------------------------------------------------------------------------------------- status
def _seconds(start, end) -> Optional[float]:
    if isinstance(start, dt.datetime) and isinstance(end, dt.datetime):
        return round((end - start).total_seconds(), 1)
    return None


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
        row["wall_s"] = _seconds(s.get("TrainingStartTime"), s.get("TrainingEndTime"))
        row["job"] = s["TrainingJobName"]
        rows.append(row)
    return rows, names, metric, mode


def search_filters(env: str, name: str) -> dict:
    """The ``Search`` expression of a jobs-strategy sweep's training jobs: tags ``trainstack:env`` and
    ``trainstack:sweep`` equal, both (the tags, not the ``trainstack-<env>-`` name prefix)."""
    return {
        "Filters": [
            {"Name": "Tags.trainstack:env", "Operator": "Equals", "Value": env},
            {"Name": "Tags.trainstack:sweep", "Operator": "Equals", "Value": name},
        ],
        "Operator": "And",
    }


def job_rows(env: str, name: str, jobs_found: list[dict]) -> tuple[list[dict], list[str], str, str]:
    """Rows, swept names, metric and mode of a jobs-strategy sweep from its training jobs (``Search`` results'
    ``TrainingJob``): names and objective from the jobs' ``trainstack:parameters``/``:objective`` tags, values from
    their ``HyperParameters``, the metric from ``FinalMetricDataList``; the newest job of each trial."""
    newest: dict[str, tuple[dict, dict]] = {}
    for j in jobs_found:
        t = {x["Key"]: x["Value"] for x in j.get("Tags", [])}
        if t.get("trainstack:env") != env or t.get("trainstack:sweep") != name:
            continue  # Search filtered already; this keeps a second environment's jobs out whatever it returned
        trial = t.get("trainstack:trial") or j["TrainingJobName"]
        if trial not in newest or j["CreationTime"] > newest[trial][0]["CreationTime"]:
            newest[trial] = (j, t)
    if not newest:
        raise CliError(
            f"no training jobs tagged trainstack:sweep={name} in environment {env}, and no tuning job "
            f"trainstack-{env}-{name}",
            f"start it: `python -m infra --env {env} sweep --name {name} ...`",
        )
    _, tags0 = next(iter(newest.values()))
    names = tags0.get("trainstack:parameters", "").split()
    metric, _, mode = tags0.get("trainstack:objective", "").partition(" ")
    rows = []
    for trial in sorted(newest):
        j, _t = newest[trial]
        hp = j.get("HyperParameters", {})
        row = {"trial": trial, **{n: hp_value(hp[n]) if n in hp else None for n in names}}
        finals = {m["MetricName"]: m["Value"] for m in j.get("FinalMetricDataList", [])}
        row[metric] = float(finals[metric]) if metric in finals else None
        row["status"] = j["TrainingJobStatus"]
        row["wall_s"] = (
            float(j["TrainingTimeInSeconds"])
            if j.get("TrainingTimeInSeconds") is not None
            else (_seconds(j.get("TrainingStartTime"), j.get("TrainingEndTime")))
        )
        row["job"] = j["TrainingJobName"]
        rows.append(row)
    return rows, names, metric, mode or "max"


def gather(aws: Aws, name: str, sm=None) -> dict[str, Any]:
    """The sweep's trials, ranked: ``{"strategy", "rows", "names", "metric", "mode"}``. A tuning job
    ``trainstack-<env>-<name>`` if there is one, else the training jobs tagged with the sweep."""
    from trainer.config.sweep import rank

    sm = sm or aws.client("sagemaker")
    tuning = f"trainstack-{aws.env}-{name}"
    describe = None
    if len(tuning) <= TUNING_NAME_MAX:
        try:
            describe = sm.describe_hyper_parameter_tuning_job(HyperParameterTuningJobName=tuning)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("ResourceNotFound", "ValidationException"):
                raise explain(e, f"describing tuning job {tuning}") from None
    try:
        if describe is not None:
            summaries = [
                s
                for page in sm.get_paginator("list_training_jobs_for_hyper_parameter_tuning_job").paginate(
                    HyperParameterTuningJobName=tuning
                )
                for s in page["TrainingJobSummaries"]
            ]
            rows, names, metric, mode = tuning_rows(describe, summaries)
            strategy = "tuning"
        else:
            found = [
                r["TrainingJob"]
                for page in sm.get_paginator("search").paginate(
                    Resource="TrainingJob", SearchExpression=search_filters(aws.env, name)
                )
                for r in page["Results"]
                if "TrainingJob" in r
            ]
            rows, names, metric, mode = job_rows(aws.env, name, found)
            strategy = "jobs"
    except ClientError as e:
        raise explain(e, f"listing the trials of sweep {name}") from None
    return {"strategy": strategy, "rows": rank(rows, metric, mode), "names": names, "metric": metric, "mode": mode}


def dry_run(p: SweepPlan, image_tag: str) -> dict[str, Any]:
    """What ``sweep`` would send, without any AWS call: names the stack outputs only know are placeholders in
    ``<...>`` (role, bucket, repository, state machine ARN) and the training job's sizes are this checkout's
    defaults (infra/config.py); a real run reads them from the deployed state machine. ``jobs``: the StartExecution
    requests of a first run (the first K trials); ``tuning``: the CreateHyperParameterTuningJob request."""
    from infra.config import InfraConfig, machine_short
    from infra.training_job import training_job_state

    cfg = InfraConfig(env=p.env)
    note = "dry run: no AWS call; <...> are the stack outputs a real run reads, sizes are this checkout's defaults"
    if p.strategy == "tuning":
        state = training_job_state(
            phase=machine_short(p.instance_type),
            instance=catalog.get(p.instance_type),
            prefix=cfg.prefix,
            image_repository_uri="<RepositoryUri>",
            role_arn="<SageMakerRoleArn>",
            bucket_name="<BucketName>",
            volume_gib=cfg.sagemaker_volume_gib,
            max_run_s=int(cfg.sagemaker_max_run_hours * 3600),
            max_wait_s=int(cfg.sagemaker_max_wait_hours * 3600),
            env=p.env,
        )
        req = tuning_request(p, state["Parameters"], f"<RepositoryUri>:{image_tag}", "<BucketName>")
        return {"note": note, "cost": cost_line(p), "CreateHyperParameterTuningJob": req}
    now = dt.datetime.now(dt.UTC)
    starts = [
        {
            "stateMachineArn": f"<StateMachine {cfg.prefix}-{p.machine}>",
            "name": jobs.execution_name(p.run_name(i), now),
            "input": execution_input(p, i, image_tag),
        }
        for i in range(min(p.max_parallel, len(p.trials)))
    ]
    return {"note": note, "cost": cost_line(p), "trials": len(p.trials), "StartExecution": starts}
