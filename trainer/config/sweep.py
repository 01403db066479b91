"""A hyperparameter sweep's search space and its trials: what ``python -m trainer sweep`` runs locally and what
``python -m infra sweep`` submits to SageMaker. Pure Python (no torch): ``infra/`` imports it.

Syntax (command line of both):

* ``--grid 'lr=[0.1, 0.03, 0.01]'``: a YAML list of values for one config field (or alias). Without ``--random``
  the trials are the Cartesian product of every ``--grid``, in the order given (the last grid varies fastest).
* ``--range 'lr=1e-4:0.1:log'``: ``NAME=LOW:HIGH`` with optional flags ``:log`` (log-uniform) and ``:int``
  (integers; implied when the field is an integer field). Only with ``--random N``.
* ``--random N``: N trials, each drawing every ``--range`` (uniform or log-uniform) and every ``--grid``
  (uniformly among its values, a categorical parameter) from a ``random.Random(seed)``: the same seed gives the
  same trials on every machine. This is the "Random" strategy of SageMaker Automatic Model Tuning, whose
  parameter ranges are the same three kinds (AWS docs, "Define Hyperparameter Ranges": categorical, continuous
  with Linear or Logarithmic scaling, integer).

Every trial is a dict field name -> value, checked against the trainer's own config validation by the callers
(together with the base config: a value is only valid or invalid in its config).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from trainer.config.fields import ALIASES, FIELDS
from trainer.errors import ConfigError

#: Upper bound of trials in one sweep (SageMaker's MaxNumberOfTrainingJobs per tuning job is 500 by default;
#: AWS docs, "Amazon SageMaker AI endpoints and quotas").
MAX_TRIALS = 500

#: Fields a sweep may not vary: where a trial's files go is the sweep's business, and ``task`` changes the meaning
#: of every other field.
FIXED_FIELDS = ("task", "data_dir", "checkpoint_dir", "log_dir", "resume", "device")


@dataclass(frozen=True)
class Range:
    """A numeric range for random search: ``low <= value <= high``.

    Attributes:
        name: the config field (aliases resolved).
        low, high: bounds, inclusive; ``low < high``; both > 0 when ``log``.
        log: sample log-uniformly (SageMaker ``ScalingType: Logarithmic``), else uniformly (``Linear``).
        integer: draw integers (SageMaker ``IntegerParameterRanges``); else floats (``ContinuousParameterRanges``).
    """

    name: str
    low: float
    high: float
    log: bool = False
    integer: bool = False

    def sample(self, rng: random.Random) -> Any:
        """One draw: an int when ``integer``, else a float rounded to 6 significant digits (so a trial's value
        prints and round-trips through SageMaker's string hyperparameters unchanged)."""
        if self.log:
            v = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            v = rng.uniform(self.low, self.high)
        if self.integer:
            return min(int(self.high), max(int(self.low), round(v)))
        return float(f"{v:.6g}")


@dataclass
class SearchSpace:
    """Grids and ranges over config fields; :meth:`trials` expands them.

    Attributes:
        grid: field -> values (each a list of at least one value), in command-line order.
        ranges: field -> :class:`Range`.
        random: number of random trials; ``None`` = grid search (the Cartesian product of ``grid``).
        seed: seed of the random draws.

    Raises (``__post_init__``):
        ConfigError: ranges without ``random``, an empty space, or more than :data:`MAX_TRIALS` trials.
    """

    grid: dict[str, list] = field(default_factory=dict)
    ranges: dict[str, Range] = field(default_factory=dict)
    random: Optional[int] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ranges and self.random is None:
            raise ConfigError(f"--range {next(iter(self.ranges))}: ranges are sampled; add --random N")
        if self.random is not None and not 1 <= self.random <= MAX_TRIALS:
            raise ConfigError(f"--random: got {self.random}; expected 1 to {MAX_TRIALS} trials")
        if not self.grid and not self.ranges:
            raise ConfigError(
                "sweep: nothing to sweep; give --grid NAME=[...] or --range NAME=LOW:HIGH with --random N"
            )
        if self.size > MAX_TRIALS:
            raise ConfigError(f"--grid: {self.size} trials; at most {MAX_TRIALS} (use --random N to sample)")

    @property
    def names(self) -> list[str]:
        """The swept fields, grid first, in command-line order."""
        return list(self.grid) + [n for n in self.ranges if n not in self.grid]

    @property
    def size(self) -> int:
        """Number of trials :meth:`trials` returns."""
        return self.random if self.random is not None else math.prod(len(v) for v in self.grid.values())

    def trials(self) -> list[dict[str, Any]]:
        """The trials, each a dict field -> value over :attr:`names`; deterministic for a given space and seed."""
        if self.random is None:
            keys = list(self.grid)
            return [dict(zip(keys, combo)) for combo in itertools.product(*(self.grid[k] for k in keys))]
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.random):
            t = {k: rng.choice(v) for k, v in self.grid.items()}
            t.update({k: r.sample(rng) for k, r in self.ranges.items()})
            out.append(t)
        return out


def _field_name(key: str, flag: str) -> str:
    name = ALIASES.get(key.strip(), key.strip())
    if name not in FIELDS:
        raise ConfigError(f"{flag} {key}: unknown config field (see `python -m trainer train --help`)")
    if name in FIXED_FIELDS:
        raise ConfigError(f"{flag} {key}: a sweep cannot vary {name}; set it for the whole sweep")
    return name


def _split(text: str, flag: str, expected: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key.strip() or not value.strip():
        raise ConfigError(f"{flag} {text!r}: expected {expected}")
    return key.strip(), value.strip()


def parse_grid(text: str) -> tuple[str, list]:
    """``'lr=[0.1, 0.01]'`` -> ``("lr", [0.1, 0.01])``. Values are YAML scalars in a YAML list; a one-value grid is
    written ``'lr=[0.1]'``.

    Raises:
        ConfigError: no ``=``, an unknown or fixed field, a value that is not a YAML list of scalars (a bare scalar
            such as ``lr=0.1`` included: a fixed value is ``--lr 0.1``), an empty list, or a value given twice.
    """
    key, value = _split(text, "--grid", "NAME=[V1, V2, ...]")
    name = _field_name(key, "--grid")
    try:
        values = yaml.safe_load(value)
    except yaml.YAMLError:
        raise ConfigError(f"--grid {key}: {value!r} is not a YAML list; expected [V1, V2, ...]") from None
    if not isinstance(values, list):
        raise ConfigError(
            f"--grid {key}: {value!r} is not a list; expected [V1, V2, ...] (one value: {key}=[{value}], or set it "
            f"for every trial with --{name.replace('_', '-')} {value})"
        )
    if not values or any(isinstance(v, (list, dict)) or v is None for v in values):
        raise ConfigError(f"--grid {key}: {value!r}; expected a non-empty list of scalars [V1, V2, ...]")
    if len({repr(v) for v in values}) != len(values):
        raise ConfigError(f"--grid {key}: {value!r} repeats a value")
    return name, values


def parse_range(text: str) -> Range:
    """``'lr=1e-4:0.1:log'`` -> ``Range("lr", 1e-4, 0.1, log=True)``; ``:int`` or an integer field draws integers.

    Raises:
        ConfigError: bad syntax, an unknown or fixed field, a non-numeric field, ``low >= high``, or a log range
            that is not positive.
    """
    expected = "NAME=LOW:HIGH[:log][:int]"
    key, value = _split(text, "--range", expected)
    name = _field_name(key, "--range")
    parts = value.split(":")
    flags = {p.strip().lower() for p in parts[2:]}
    if len(parts) < 2 or not flags <= {"log", "int"}:
        raise ConfigError(f"--range {text!r}: expected {expected}")
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise ConfigError(f"--range {key}: bounds {parts[0]!r}, {parts[1]!r} must be numbers") from None
    default = FIELDS[name].default
    typ = FIELDS[name].type if isinstance(FIELDS[name].type, str) else FIELDS[name].type.__name__
    if isinstance(default, bool) or not ("float" in typ or "int" in typ):
        raise ConfigError(f"--range {key}: {name} is not a numeric field; use --grid {name}=[...]")
    integer = "int" in flags or ("int" in typ and "float" not in typ)
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ConfigError(f"--range {key}: got LOW={parts[0]}, HIGH={parts[1]}; expected finite LOW < HIGH")
    if "log" in flags and low <= 0:
        raise ConfigError(f"--range {key}: a log range needs LOW > 0; got {parts[0]}")
    if integer and math.floor(high) < math.ceil(low):
        raise ConfigError(f"--range {key}: no integer between {parts[0]} and {parts[1]}")
    return Range(name, low, high, log="log" in flags, integer=integer)


def search_space(
    grids: list[str], ranges: list[str], random_trials: Optional[int] = None, seed: int = 0
) -> SearchSpace:
    """The :class:`SearchSpace` of the command line's ``--grid``, ``--range``, ``--random`` and ``--seed``.

    Raises:
        ConfigError: as :func:`parse_grid`, :func:`parse_range` and :class:`SearchSpace`; a field swept twice.
    """
    grid: dict[str, list] = {}
    rng: dict[str, Range] = {}
    for text in grids:
        name, values = parse_grid(text)
        if name in grid:
            raise ConfigError(f"--grid {name}: given twice")
        grid[name] = values
    for text in ranges:
        r = parse_range(text)
        if r.name in rng or r.name in grid:
            raise ConfigError(f"--range {r.name}: swept twice")
        rng[r.name] = r
    return SearchSpace(grid, rng, random_trials, seed)


def trial_name(index: int) -> str:
    """The name of trial ``index`` (0-based): ``t000``, ``t001``… (a folder, and a suffix of SageMaker job names)."""
    return f"t{index:03d}"


def objective(task: str, metric: Optional[str] = None) -> tuple[str, str]:
    """The metric a sweep ranks by and its direction: ``(key, "max" | "min")``.

    ``metric`` is a key of the epoch lines (``val_top1``) or an evaluator name (``top1``, prefixed ``val_``);
    default: the task's headline metric (the first of ``catalog.metrics.TASK_METRICS[task]``). Keys ending in
    ``loss`` are minimised, all others maximised.

    Raises:
        ConfigError: an unknown task, or a metric the task does not report.
    """
    from catalog.metrics import COMMON, TASK_METRICS

    if task not in TASK_METRICS:
        raise ConfigError(f"task: got {task!r}; expected one of {', '.join(TASK_METRICS)}")
    known = TASK_METRICS[task] + COMMON
    key = known[0] if metric is None else metric
    if key not in known and f"val_{key}" in known:
        key = f"val_{key}"
    if key not in known:
        raise ConfigError(f"--metric {metric}: {task} reports {', '.join(known)}")
    return key, ("min" if key.endswith("loss") or key.endswith("_time_s") else "max")


def rank(rows: list[dict], metric: str, mode: str) -> list[dict]:
    """``rows`` (each a trial's result dict) sorted best first by ``row[metric]``; rows without a finite value
    (failed or still running) come last, in their original order. Adds ``rank`` (1-based; ``None`` for those)."""
    ok, rest = [], []
    for r in rows:
        (ok if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric]) else rest).append(r)
    ok.sort(key=lambda r: r[metric], reverse=(mode == "max"))
    return [{**r, "rank": i + 1} for i, r in enumerate(ok)] + [{**r, "rank": None} for r in rest]


def results_markdown(rows: list[dict], names: list[str], metric: str, mode: str, extra: tuple = ()) -> str:
    """A Markdown table of ranked ``rows`` (from :func:`rank`): rank, trial, each swept field, ``metric``
    (best first, ``mode`` named in the header), the ``extra`` columns (e.g. ``best_epoch``), status, and wall
    time in seconds when rows carry ``wall_s``."""
    wall = ["wall_s"] if any("wall_s" in r for r in rows) else []
    cols = ["rank", "trial", *names, metric, *extra, "status", *wall]
    head = [c if c != metric else f"{metric} ({mode})" for c in cols]

    def cell(r: dict, c: str) -> str:
        v = r.get(c)
        if v is None:
            return "–"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(
    rows: list[dict], names: list[str], metric: str, mode: str, out_dir: Any, extra: tuple = ()
) -> dict[str, Any]:
    """Write a sweep's ranked results into ``out_dir``: ``results.md`` (:func:`results_markdown` with ``extra``),
    ``results.json`` (``{"metric", "mode", "parameters", "trials": rows}``) and ``results.png`` (``metric`` against
    each swept field, one panel per field, log x-axis for positive numeric fields spanning over 10x; categorical
    fields on a category axis; matplotlib's Agg backend, 100 dpi).

    Returns: ``{"md": Path, "json": Path, "png": Path}``. Raises OSError when ``out_dir`` cannot be written.
    """
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "results.md", "json": out / "results.json", "png": out / "results.png"}
    paths["md"].write_text(results_markdown(rows, names, metric, mode, extra), encoding="utf-8")
    doc = {"metric": metric, "mode": mode, "parameters": names, "trials": rows}
    paths["json"].write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("rank") is not None]
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(4 * max(1, len(names)), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        xs = [r.get(name) for r in done]
        ys = [r[metric] for r in done]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs) and xs
        if numeric:
            ax.scatter(xs, ys)
            if min(xs) > 0 and max(xs) / min(xs) > 10:
                ax.set_xscale("log")
        else:
            cats = sorted({str(x) for x in xs})
            ax.scatter([cats.index(str(x)) for x in xs], ys)
            ax.set_xticks(range(len(cats)), cats)
        if done:
            best = done[0]
            ax.scatter(
                [best[name] if numeric else sorted({str(x) for x in xs}).index(str(best[name]))],
                [best[metric]],
                marker="*",
                s=160,
                color="tab:red",
                label=f"best: {best['trial']}",
            )
            ax.legend(fontsize=7)
        ax.set_xlabel(name)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{len(done)} of {len(rows)} trials finished; {metric} ({mode})", fontsize=9)
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=100)
    plt.close(fig)
    return paths
