"""The plan of ``python -m infra sweep``: a hyperparameter sweep on SageMaker managed spot,
validated and expanded into its trials without any AWS call.

The search space, its trials, the objective and the results table are ``trainer.config.sweep``'s, the same module
``python -m trainer sweep`` runs locally, so both give the same trials (same seed) and the same table.

Every trial (base config + ``--set`` + the trial's values) is validated by the trainer's own config loader before
any AWS call; a bad one is exit 2 naming the trial and the field. :func:`plan` also checks what each strategy's
requests need: the ``jobs`` strategy's run names ``<SWEEP>-t003`` stay within 40 characters; the ``tuning``
strategy's job name ``trainstack-<env>-<SWEEP>`` within 32 (the API's limit), at most :data:`MAX_TUNED` swept
fields and values per grid, and its SageMaker strategy: ``Grid`` for a grid-only space without ``--random``
(SageMaker's Grid search takes categorical parameters only, "How Hyperparameter Tuning Works"), ``Bayesian`` when
there are ``--range``s, ``Random`` for ``--random N`` over grids only; ``--tuning-strategy`` overrides.

K (``--max-parallel``, default 2: seed 004's "2-3 parallel jobs"): at most 100, the hard limit of parallel
training jobs per tuning job (AWS docs, "Resource Limits for Automatic Model Tuning": default 10, can be
increased to 100; above 10 ask for a quota increase first). Each trial runs on its own instance of the
machine's type, so ``python -m trainer plan``'s per-instance sizing applies per trial: the type must fit one
trial (``--plan FILE``, a plan written by ``python -m trainer plan --out FILE``, refuses a type it says does not
fit: :func:`check_plan`), and K trials bill K instances at once (each at the spot rate of ``catalog``:
:func:`cost_line`).

What is sent: :mod:`infra.cli.sweep` (``--strategy jobs``) and :mod:`infra.cli.tuning` (``--strategy tuning``).
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

import catalog
from infra.cli import jobs
from infra.cli.session import CliError

#: SageMaker's hard limit of parallel training jobs per tuning job (default quota 10; "Resource Limits for
#: Automatic Model Tuning").
MAX_PARALLEL = 100
DEFAULT_PARALLEL = 2
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


def tags(p: SweepPlan) -> list[dict[str, str]]:
    """``trainstack:env`` and the sweep's tags (added to every training job the tuning job launches)."""
    return [{"Key": "trainstack:env", "Value": p.env}] + [
        {"Key": f"trainstack:{k}", "Value": v} for k, v in p.sweep_tags().items() if k != "trial"
    ]


def wall_seconds(start, end) -> Optional[float]:
    """Seconds from ``start`` to ``end`` (SageMaker's datetimes), to 0.1 s; None unless both are datetimes."""
    if isinstance(start, dt.datetime) and isinstance(end, dt.datetime):
        return round((end - start).total_seconds(), 1)
    return None
