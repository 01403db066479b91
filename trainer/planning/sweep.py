"""``python -m trainer sweep``: a hyperparameter sweep on this machine, K trials at a time, K from the planner.

Usage::

    python -m trainer sweep --config BASE [--FIELD VALUE ...] --grid 'lr=[0.1,0.03]' [--grid ...]
        [--range 'lr=1e-4:0.1:log' --random N --sweep-seed S] [--metric top1] --out DIR [--parallel K]

* Space: :mod:`trainer.config.sweep` (``--grid``, ``--range``, ``--random``; the draw's seed is ``--sweep-seed``,
  because ``--seed`` is the training seed, a config field fixed for every trial like any other ``--FIELD``).
* Every trial's config (base file + fixed flags + the trial's values + its own ``checkpoint_dir``/``log_dir``
  under ``OUT/<trial>/``) is validated with :func:`trainer.config.load_config` before any trial starts.
* K, trials at a time: the largest K for which :func:`trainer.planning.local.max_local_jobs` (the checks of
  ``plan --jobs-per-instance K``, on this machine: host RAM available now, vCPUs, GPU memory with CUDA) says K
  jobs fit, capped by the trials left to run. The config checked is the base config with each swept resource
  field (:data:`RESOURCE_FIELDS`) at its largest value in the space, once per combination of the swept values of
  :data:`CHOICE_RESOURCE_FIELDS` (model, precision, ...), and K is the smallest answer
  (:func:`parallel_for_space`). Host RAM per job comes from one cheap probe of each such config
  (:func:`cheap_probe`: one batch size, one timed step, the config's loader setting; ~10 s on 2 vCPUs), written
  to ``OUT/probe/`` (``OUT/probe-<i>/`` for several) and reused by a re-run; ``--probe-report FILE`` uses an
  existing one for all.
  ``--parallel K`` above that K is refused (exit 2), so a sweep cannot repeat seed 004's 4-jobs incident.
* Each trial: ``sys.executable -m trainer train ...`` in its own session (a terminal's Ctrl-C reaches only the
  sweep) that dies with the sweep (Linux ``PR_SET_PDEATHSIG``: SIGTERM when the sweep ends in any way, SIGKILL and
  OOM included, so the trial checkpoints and exits 75 instead of training on as an orphan), output in
  ``OUT/<trial>/train.log``, ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = vCPUs // K (at least 1),
  and with several GPUs ``CUDA_VISIBLE_DEVICES`` = its slot's GPU (slot i of K: GPU i mod GPUs).
* Tracking (``--tracking``): every trial logs to one MLflow store, ``OUT/mlruns`` unless ``--tracking-uri`` or
  ``MLFLOW_TRACKING_URI`` names one, as a run named after the trial (unless ``--tracking-run-name``) with the tags
  ``trial`` (``t000``...) and ``sweep`` (``OUT``).
* ``OUT/sweep.json``: the manifest (base config path, its SHA-256 and resolved values, fixed flags, the space,
  its seed, the metric, the trials), written only once every check has passed (the configs, K). ``OUT/<trial>/status.json``: ``{"status": "done" | "failed" |
  "interrupted", "rc", "wall_s"}``. Re-running the same command resumes: done and failed trials are skipped
  (delete a trial's ``status.json`` to run it again), interrupted and pending ones run (the trainer resumes from
  their checkpoints). Another space, metric or base config against an existing ``OUT`` is exit 2.
* SIGTERM / SIGINT / SIGHUP (a closed terminal or SSH session): forwarded once as SIGTERM to the running trials,
  which checkpoint and exit 75; the sweep waits for them, writes the partial results and exits 75. During the
  probe (before any trial): the probe is stopped, one line says so, exit 75. The probe and the trials are
  started by :mod:`trainer.planning.sweep_processes`.
* One sweep per ``OUT``: once the inputs are checked the sweep holds ``OUT/writer.lock``
  (:class:`trainer.engine.durable.WriterLock`) to its end; a second sweep on the same ``--out`` is exit 2, naming
  the first one's pid.
* A trial whose checkpoint folder another process is writing (a trial of an earlier sweep still alive: its
  ``writer.lock``, :func:`trainer.engine.durable.lock_holder`) is not started: the sweep names that process and
  exits 75 once the others are done (run the same command again when it has ended).
* Results (:func:`trial_result`): per trial the best value of the objective over its epoch rows of
  ``OUT/<trial>/logs/metrics.jsonl`` (``kind == "epoch"``) and its epoch, the last value, status, wall seconds;
  ranked (:func:`trainer.config.sweep.rank`, done trials only) into ``OUT/results.md|json|png``.

Exit codes: 0 every trial done; 1 any trial failed (results still written); 2 bad input (one line, nothing run);
75 interrupted (run the same command again to resume).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from trainer.config import FIELDS, ConfigError, load_config
from trainer.config.sweep import objective, rank, results_markdown, search_space, trial_name, write_results
from trainer.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from trainer.planning.scale import epoch_rows
from trainer.planning.sweep_processes import SweepInterrupted, cheap_probe, run_trials, train_flags, trial_dirs

#: Fields whose largest swept value is used for the planner's check of K (they set memory and CPU per job).
RESOURCE_FIELDS = ("batch_size", "eval_batch_size", "image_size", "num_workers", "prefetch_factor")
#: Swept fields with no "largest" value that set a job's memory (weights and activations per model, bytes per
#: value, memory format, where JPEGs are decoded): K is checked for every combination of their swept values.
CHOICE_RESOURCE_FIELDS = ("model", "precision", "channels_last", "decode_device")

#: Exit status when a trial failed (the results are still written).
EXIT_TRIAL_FAILED = 1


MANIFEST = "sweep.json"


def add_sweep_command(sub, add_train_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``sweep`` on the ``trainer`` sub-parsers: ``--config`` and every training field (fixed for all
    trials, as for ``train``), plus the sweep's own flags."""
    p = sub.add_parser(
        "sweep",
        help="run a hyperparameter sweep here, as many trials at a time as the planner says fit",
        description="Grid or random search over config fields; each trial is a `train` subprocess with its own "
        "OUT/<trial>/ folder; results ranked in OUT/results.md|json|png (docs/sweeps.md).",
    )
    add_train_flags(p)
    g = p.add_argument_group("sweep (not training fields)")
    g.add_argument("--grid", action="append", default=[], metavar="NAME=[V1,V2]", help="Values of one field.")
    g.add_argument(
        "--range", action="append", default=[], metavar="NAME=LOW:HIGH[:log][:int]", help="Sampled with --random."
    )
    from trainer.argtypes import bounded_number

    g.add_argument("--random", type=bounded_number(int, 1), default=None, metavar="N", help="N random trials.")
    g.add_argument("--sweep-seed", type=int, default=0, metavar="S", help="Seed of the random draws (default 0).")
    g.add_argument("--metric", default=None, help="Objective (default: the task's headline metric, e.g. val_top1).")
    g.add_argument("--out", required=True, metavar="DIR", help="Sweep folder (manifest, trials, results).")
    g.add_argument(
        "--parallel", type=bounded_number(int, 1), default=None, metavar="K", help="Trials at a time (<= what fits)."
    )
    g.add_argument("--probe-report", default=None, metavar="FILE", help="probe.json of the base config to use.")


def _fixed_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The training fields given on the command line (fixed for every trial)."""
    fixed = {k: v for k, v in vars(args).items() if k in FIELDS}
    for name in ("checkpoint_dir", "log_dir", "resume"):
        if name in fixed:
            raise ConfigError(f"--{name.replace('_', '-')}: the sweep sets it per trial (OUT/<trial>/); drop it")
    return fixed


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tracking_overrides(cfg, out: Path) -> dict[str, str]:
    """``{"tracking_uri": file URI of OUT/mlruns}`` when the trials track to MLflow and no store is named
    (``tracking_uri``, ``MLFLOW_TRACKING_URI``): one store for the whole sweep instead of one per trial's
    ``log_dir``; else ``{}``."""
    if "mlflow" not in (cfg.tracking or []) or cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        return {}
    return {"tracking_uri": (out / "mlruns").resolve().as_uri()}


def _check_manifest(out: Path, manifest: dict) -> None:
    """Raise ConfigError when ``out`` holds another sweep (its manifest differs in identity)."""
    path = out / MANIFEST
    if not path.exists():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--out {out}: {MANIFEST} is unreadable ({e}); use another --out") from None
    for key in ("base_config", "base_sha256", "base_values", "fixed", "space", "metric", "trials"):
        if old.get(key) != manifest[key]:
            raise ConfigError(
                f"--out {out}: holds a sweep with another {key.replace('_', ' ')} ({MANIFEST}); "
                "run the same command to resume it, or choose a new --out"
            )


def worst_overrides(fixed: dict, trials: list[dict]) -> dict:
    """``fixed`` with each swept :data:`RESOURCE_FIELDS` field at its largest value in ``trials``: the
    overrides of the config the planner checks K for."""
    worst = dict(fixed)
    for name in RESOURCE_FIELDS:
        vals = [t[name] for t in trials if isinstance(t.get(name), (int, float))]
        if vals:
            worst[name] = max(vals)
    return worst


def resource_overrides(fixed: dict, trials: list[dict]) -> list[dict]:
    """The overrides of every config the planner checks K for: :func:`worst_overrides`, once per distinct
    combination of the :data:`CHOICE_RESOURCE_FIELDS` values among ``trials`` (in their first-seen order; one
    config when the space sweeps none of them)."""
    worst = worst_overrides(fixed, trials)
    combos: list[dict] = []
    for t in trials:
        c = {f: t[f] for f in CHOICE_RESOURCE_FIELDS if f in t}
        if c not in combos:
            combos.append(c)
    return [{**worst, **c} for c in combos]


def parallel_for_space(
    base: Path, fixed: dict, trials: list[dict], n_todo: int, requested: Optional[int], probe_report, out: Path
) -> tuple[int, str]:
    """K for a space: the smallest :func:`choose_parallel` over the configs of :func:`resource_overrides`, each
    with its own :func:`cheap_probe` (``OUT/probe/``; with several configs ``OUT/probe-<i>/``, i from 1) unless
    ``probe_report`` is given (then that one report is used for all). The line names the config that limits K
    when there are several.

    Raises:
        ConfigError: ``requested`` does not fit one of the configs, or a probe failed.
    """
    configs = resource_overrides(fixed, trials)
    best: Optional[tuple[int, str]] = None
    for i, over in enumerate(configs, start=1):
        cfg = load_config(base, over)
        folder = out / ("probe" if len(configs) == 1 else f"probe-{i}")
        probe = probe_report or str(cheap_probe(str(base), over, cfg, folder))
        k, why = choose_parallel(cfg, n_todo, requested, probe)
        if len(configs) > 1:
            which = ", ".join(f"{f}={over[f]}" for f in CHOICE_RESOURCE_FIELDS if f in over)
            why += f" (the trials with {which}, the tightest of {len(configs)} checked)"
        if best is None or k < best[0]:
            best = (k, why)
    return best


def choose_parallel(cfg, n_trials: int, requested: Optional[int], probe_report: Optional[str]) -> tuple[int, str]:
    """K, the trials to run at a time, and one line saying why (see module doc).

    Raises:
        ConfigError: ``requested`` is more than the planner's check allows on this machine (names the limit).
    """
    from trainer.planning.local import local_machine, max_local_jobs

    machine = local_machine()
    limit = max(1, requested or n_trials)
    fit, rows = max_local_jobs(cfg, limit, probe_report=probe_report, machine=machine)
    here = f"{machine.vcpus} vCPUs, {machine.memory_gib:.1f} GiB RAM available" + (
        f", {machine.gpus} x {machine.gpu_model} {machine.gpu_memory_gib:.0f} GiB" if machine.gpus else ", no GPU"
    )
    why_not = ""
    if len(rows) > fit:  # the first K that did not fit
        why_not = rows[fit]["errors"][0].replace(f"--jobs-per-instance {fit + 1}: ", "")
    if requested is not None and requested > fit:
        raise ConfigError(
            f"--parallel {requested}: {fit + 1} trials at a time do not fit this machine ({here}): {why_not}; "
            f"use --parallel {fit} or less (trainer.planning.local.max_local_jobs)"
        )
    k = min(fit, n_trials, requested or fit)
    if requested is not None:
        reason = f"--parallel {requested}, which fits"
    elif why_not:
        reason = f"{fit + 1} would not fit: {why_not}"
    else:
        reason = f"capped by the {n_trials} trial(s) to run"
    return k, f"sweep: {k} trial(s) at a time on this machine ({here}); {reason}"


def trial_result(name: str, values: dict, metric: str, mode: str, out: Path) -> dict:
    """One trial's row: ``trial``, its values, ``metric`` = the best epoch value (max or min by ``mode``; only
    when done, so only done trials are ranked), ``best_epoch``, ``last`` (last epoch's value), ``epochs`` (epoch
    rows logged), ``status`` (``done`` | ``failed rc=N`` | ``interrupted`` | ``pending``), ``wall_s``."""
    paths = trial_dirs(out, name)
    status = json.loads(paths["status"].read_text()) if paths["status"].exists() else {"status": "pending"}
    rows = [
        r
        for r in epoch_rows(paths["logs"] / "metrics.jsonl")
        if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])
    ]
    best = None
    if rows:
        best = (max if mode == "max" else min)(rows, key=lambda r: r[metric])
    state = status["status"]
    if state == "failed":
        state = f"failed rc={status.get('rc')}"
    row = {"trial": name, **values}
    row[metric] = best[metric] if best is not None and state == "done" else None
    row.update(
        best_epoch=best.get("epoch") if best else None,
        best_so_far=best[metric] if best else None,
        last=rows[-1][metric] if rows else None,
        epochs=len(rows),
        status=state,
        wall_s=round(status["wall_s"], 1) if "wall_s" in status else None,
    )
    return row


def run_sweep(args: argparse.Namespace, log: Callable[[str], None] = print) -> int:
    """Run the sweep of parsed ``args`` (module doc); returns the exit code. Raises ConfigError, DataError,
    PlanError on bad input, before any trial starts."""
    if not args.config:
        raise ConfigError("--config: required; the base config every trial starts from")
    base = Path(args.config)
    fixed = _fixed_overrides(args)
    space = search_space(args.grid, args.range, args.random, args.sweep_seed)
    cfg = load_config(base, fixed)
    metric, mode = objective(cfg.task, args.metric)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: is a file; expected a folder for the sweep")
    trials = space.trials()
    names = [trial_name(i) for i in range(len(trials))]
    argvs = []
    shared = tracking_overrides(cfg, out)
    for name, values in zip(names, trials):  # every trial's config, before any trial runs
        paths = trial_dirs(out, name)
        where = {"checkpoint_dir": str(paths["checkpoints"]), "log_dir": str(paths["logs"]), **shared}
        if cfg.tracking and not cfg.tracking_run_name and "tracking_run_name" not in values:
            where["tracking_run_name"] = name
        try:
            load_config(base, {**fixed, **values, **where})
        except ConfigError as e:
            shown = ", ".join(f"{k}={v}" for k, v in values.items())
            raise ConfigError(f"sweep trial {name} ({shown}): {e}") from None
        argvs.append(
            [
                sys.executable,
                "-m",
                "trainer",
                "train",
                "--config",
                str(base),
                *train_flags({**fixed, **values, **where}),
            ]
        )
    manifest = {
        "base_config": str(base),
        "base_sha256": _sha256(base),
        "base_values": json.loads(json.dumps(cfg.to_dict(), default=str)),
        "fixed": {k: str(v) for k, v in fixed.items()},
        "space": {
            "grid": space.grid,
            "ranges": {k: vars(r) for k, r in space.ranges.items()},
            "random": space.random,
            "seed": space.seed,
        },
        "metric": {"key": metric, "mode": mode},
        "trials": [{"trial": n, **t} for n, t in zip(names, trials)],
    }
    _check_manifest(out, manifest)

    def state(name: str) -> str:
        p = trial_dirs(out, name)["status"]
        return json.loads(p.read_text())["status"] if p.exists() else "pending"

    lock = _lock_out(out)  # a second sweep on OUT is refused from here on
    try:
        todo = [(n, a) for n, a in zip(names, argvs) if state(n) not in ("done", "failed")]
        skipped = len(names) - len(todo)
        if skipped:
            log(f"sweep: {skipped} of {len(names)} trial(s) already finished in {out}: skipped")
        stopped, held = False, 0
        k, why = (
            parallel_for_space(base, fixed, trials, len(todo), args.parallel, args.probe_report, out)
            if todo
            else (0, "")
        )
        out.mkdir(parents=True, exist_ok=True)  # every check has passed: the manifest marks OUT as this sweep's
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        if todo:
            log(why)
            from trainer.planning.local import local_machine

            stopped, held = run_trials(todo, out, k, local_machine().gpus, log)
        rows = rank([trial_result(n, t, metric, mode, out) for n, t in zip(names, trials)], metric, mode)
        import logging

        logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)  # "findfont: ..." lines, not ours
        paths = write_results(rows, space.names, metric, mode, out, extra=("best_epoch", "last"))
        print(results_markdown(rows, space.names, metric, mode, extra=("best_epoch", "last")), end="")
        log(f"sweep: results: {paths['md']}, {paths['json']}, {paths['png']}")
        if stopped or held:
            log(f"sweep: interrupted; run the same command again to resume ({out})")
            return EXIT_INTERRUPTED
        if any(r["status"].startswith("failed") for r in rows):
            return EXIT_TRIAL_FAILED
        return EXIT_OK
    finally:
        lock.release()


def _lock_out(out: Path):
    """Take ``OUT``'s lock (:class:`trainer.engine.durable.WriterLock` on ``OUT/writer.lock``, created with
    ``OUT``), so that a second sweep on the same ``--out`` is refused instead of running trials beside this one.

    Raises:
        ConfigError: another sweep holds it (names its pid, host and start time), or it cannot be taken.
    """
    from trainer.engine.durable import WriterLock, describe_holder, lock_holder
    from trainer.errors import CheckpointError

    out.mkdir(parents=True, exist_ok=True)
    lock = WriterLock(out)
    try:
        lock.acquire()
    except CheckpointError as e:
        holder = lock_holder(out)
        if holder is None:
            raise ConfigError(f"--out {out}: cannot be locked: {e}") from None
        raise ConfigError(
            f"--out {out}: another sweep is running on this folder: {describe_holder(holder)}; wait for it to end "
            "or choose another --out"
        ) from None
    return lock


def run_sweep_command(args: argparse.Namespace) -> int:
    """``python -m trainer sweep``: :func:`run_sweep`, bad input as one ``error: ...`` line and exit 2."""
    from catalog import CatalogError
    from trainer.data.formats.imagefolder import DataError
    from trainer.planning.options import PlanError

    try:
        return run_sweep(args, log=lambda m: print(m, flush=True))
    except (ConfigError, DataError, PlanError, CatalogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SweepInterrupted as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # Ctrl-C before the trials started (their handler covers the rest)
        print("error: sweep: interrupted before any trial started; run the same command again", file=sys.stderr)
        return EXIT_INTERRUPTED
