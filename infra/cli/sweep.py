"""``python -m infra sweep`` / ``sweep-status``: a hyperparameter sweep on SageMaker managed spot.

The sweep is validated and expanded into its trials without AWS by :mod:`infra.cli.sweep_plan` (the search space,
trials, objective and results table are ``trainer.config.sweep``'s, shared with ``python -m trainer sweep``).

Two strategies:

* ``jobs`` (default, this module): one managed-spot training job per trial through the environment's state machine
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
* ``tuning``: one hyperparameter tuning job ``trainstack-<env>-<SWEEP>``, which SageMaker schedules itself
  (:mod:`infra.cli.tuning`).

``sweep-status`` (:func:`gather`) reads the tuning job of that name if there is one, else the jobs strategy's
tagged training jobs; ``--dry-run`` (:func:`dry_run`) prints either strategy's requests without any AWS call.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any, Optional

from botocore.exceptions import ClientError

import catalog
from infra.cli import jobs
from infra.cli.outputs import Outputs, image_exists
from infra.cli.session import Aws, CliError, explain
from infra.cli.sweep_plan import TUNING_NAME_MAX, SweepPlan, cost_line, hp_value, wall_seconds
from infra.cli.tuning import tuning_request, tuning_rows


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


# ------------------------------------------------------------------------------------------------- status
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
            else (wall_seconds(j.get("TrainingStartTime"), j.get("TrainingEndTime")))
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
