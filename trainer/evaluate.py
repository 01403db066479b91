"""``python -m trainer evaluate``: a model's validation metrics without training (upstream DINO's ``main.py --eval``,
detectron2's ``--eval-only``, timm's ``validate.py``).

Usage::

    python -m trainer evaluate [--config C] (--checkpoint CKPT | --init-from FILE)
        [--ema/--no-ema] [--device auto|cpu|cuda] [--data-dir DIR] [--eval-protocol batched|upstream]
        [--set FIELD=VALUE ...]

The config says the task, model and data, as for ``train``: the file ``C``, or without ``--config`` the config
the ``--checkpoint`` was trained with (its weight-file fields left out: the checkpoint holds the weights);
``--data-dir``, ``--device``, ``--eval-protocol`` and ``--set FIELD=VALUE`` (any config field, e.g.
``--set val_split=test --set num_workers=0``) override it. Its validation split is evaluated with the
task's own evaluator through the engine's evaluation loop (:meth:`trainer.engine.trainer.Trainer.evaluate`: the
same loader, padding, canvases, precision and metrics as the evaluation after each training epoch). The weights
come from ``--checkpoint`` (a ``ckpt-*`` folder or a run's ``checkpoint_dir``, as for ``predict``; its EMA weights
when it has them and ``--ema``, the default; its label space must be the data's) or, for detection, from
``--init-from`` (an upstream IDEA-Research/DINO checkpoint, loaded as the config field ``init_from`` loads it; its
one-line load report is printed: with ``label_space: coco_ids`` on COCO-format data an upstream COCO checkpoint
loads with 0 tensors re-initialised).

Nothing is trained or written next to the run: the engine's checkpoint and log folders are a temporary folder,
tracking is off, and the training split is not read (the validation split stands in for it, so only the data
that is evaluated must exist). One process; the global batch is set to 1 (``eval_batch_size`` keeps the config's
evaluation batch: its value, else twice the config's micro-batch).

Output: the metrics on one line, ``evaluate: <what> on <val split>: map=41.23 map_50=...`` (percentages as the
training log writes them), then ``done`` with the seconds taken.

Exit status: 0 done; 2 bad input, one line: neither or both of ``--checkpoint``/``--init-from``, a missing or
invalid checkpoint or file, ``--init-from`` with a task other than detection, a config that does not load, data
that cannot be read, a checkpoint whose label space or weights do not fit the config.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from trainer.errors import EXIT_USAGE


class EvaluateError(Exception):
    """A bad input of ``evaluate``; the message names the flag, field or file (exit 2)."""


def add_evaluate_command(sub) -> None:
    """Register the ``evaluate`` sub-command on ``sub`` (an argparse sub-parsers object)."""
    p = sub.add_parser(
        "evaluate",
        help="a checkpoint's validation metrics, no training",
        description="Evaluate a checkpoint (or, for detection, an upstream DINO checkpoint) on the config's "
        "validation split with the task's metrics, without training (docs/detection.md, Evaluate).",
    )
    p.add_argument(
        "--config",
        metavar="C",
        help="YAML config: task, model, data (as for train); default with --checkpoint: the checkpoint's own",
    )
    p.add_argument("--checkpoint", metavar="CKPT", help="a checkpoint folder (ckpt-*) or a run's checkpoint_dir")
    p.add_argument(
        "--init-from",
        metavar="FILE",
        help="detection: an upstream IDEA-Research/DINO checkpoint (.pth), loaded as the init_from field does",
    )
    p.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--checkpoint: use its EMA weights when it has them (default), else the model's",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="default: the config's")
    p.add_argument("--data-dir", metavar="DIR", default=None, help="override the config's data_dir")
    p.add_argument(
        "--eval-protocol",
        choices=("batched", "upstream"),
        default=None,
        help="detection: batched (the config's padding/canvases) or upstream (each image at its own size, batch 1 "
        "without padding); default: the config's",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field (repeatable; the value read as YAML), e.g. --set val_split=test",
    )


def _config(args: argparse.Namespace, tmp: str, saved: dict | None = None):
    """The evaluation's validated config: ``--config``'s file, else the checkpoint's stored config ``saved``
    (``state["config"]``), with the flags, ``--set`` and the evaluation-only overrides."""
    from trainer.argtypes import field_values
    from trainer.config import load_config
    from trainer.errors import ConfigError
    from trainer.trained import checkpoint_config_values

    try:
        over: dict = field_values(args.set)
    except ValueError as e:
        raise EvaluateError(str(e)) from None
    if args.device:
        over["device"] = args.device
    if args.data_dir:
        over["data_dir"] = args.data_dir
    if args.eval_protocol:
        over["eval_protocol"] = args.eval_protocol
    source = f"--config {args.config}" if args.config else f"--checkpoint {args.checkpoint}'s config"
    try:
        if args.config:
            cfg = load_config(args.config, over)
        else:
            cfg = load_config(None, {**checkpoint_config_values(saved or {}), **over})
    except ConfigError as e:
        raise EvaluateError(f"{source}: {e}") from None
    if args.init_from and cfg.task != "detection":
        raise EvaluateError(
            f"--init-from: reads upstream DINO checkpoints (task detection); {args.config} has task {cfg.task}: "
            "give --checkpoint"
        )
    eval_batch = cfg.eval_batch_size or 2 * cfg.micro_batch_size(1)
    values = {
        **cfg.to_dict(),
        "train_split": cfg.val_split,  # only the evaluated split must exist; the training one is never read
        "batch_size": 1,
        "accumulate_grad_batches": 1,
        "eval_batch_size": eval_batch,
        "checkpoint_dir": f"{tmp}/checkpoints",
        "log_dir": f"{tmp}/logs",
        "auto_resume": False,
        "resume": None,
        "tracking": [],
        "use_ema": False,
        "compile": False,
    }
    if args.init_from:
        values["init_from"] = args.init_from
    if "cuda_graphs" in values:
        values["cuda_graphs"] = False
    try:
        return load_config(None, values)
    except ConfigError as e:
        raise EvaluateError(f"{source}: {e}") from None


def _read(args: argparse.Namespace):
    """``--checkpoint`` read whole (:func:`trainer.trained.read_checkpoint`). Raises EvaluateError: no valid
    checkpoint there, or (without ``--config``) one that holds no config."""
    from trainer.trained import CheckpointArgError, read_checkpoint

    try:
        read = read_checkpoint(args.checkpoint)
    except CheckpointArgError as e:
        raise EvaluateError(str(e)) from None
    saved = read.state.get("config")
    if not args.config and not (isinstance(saved, dict) and saved.get("task")):
        raise EvaluateError(f"--checkpoint: {read.path} holds no config (written by an older trainer?): give --config")
    return read


def _load_checkpoint(trainer, args: argparse.Namespace, read) -> str:
    """Load the weights of ``read`` (``--checkpoint``, :func:`_read`) into ``trainer.model``; returns what was
    loaded, e.g. ``ckpt-000120 (ema weights)``.

    Raises:
        EvaluateError: another label space, or weights that do not fit.
    """
    from trainer.engine.resume import label_space_diff
    from trainer.trained import CheckpointArgError, load_weights

    path, state = read.path, read.state
    saved = state.get("label_space")
    if isinstance(saved, dict) and saved:
        diff = label_space_diff(saved, trainer.label_space)
        if diff:
            raise EvaluateError(
                f"--checkpoint: {path} was trained on another label space than {trainer.cfg.data_dir}'s: "
                + "; ".join(diff[:3])
            )
    try:
        which = load_weights(trainer.model, state, path, args.ema, f"the model of {args.config or 'its config'}")
    except CheckpointArgError as e:
        raise EvaluateError(str(e)) from None
    return f"{path.name} ({which} weights)"


def _check_nothing_random(report, path: str) -> None:
    """Refuse to score a model part of which ``--init-from`` did not fill (weights.py's ``InitReport``): its
    re-initialised or missing tensors are random, and the mAP of random class heads (0.00) would read as a
    measurement.

    Raises:
        EvaluateError: any tensor re-initialised or missing, naming the first three and the likely cause.
    """
    if report is None:
        return
    random = [*report.reinitialised, *report.missing]
    if random:
        hint = ""
        if report.checkpoint_classes and report.checkpoint_classes != report.num_classes:
            hint = (
                f"; the file's class heads have {report.checkpoint_classes} columns, the data's label space "
                f"{report.num_classes} (label_space: coco_ids for an upstream COCO checkpoint on COCO ids)"
            )
        raise EvaluateError(
            f"--init-from: {Path(path).name} leaves {len(random)} tensor(s) of the model random "
            f"({', '.join(random[:3])}{', ...' if len(random) > 3 else ''}): nothing to evaluate{hint}"
        )


def evaluate(args: argparse.Namespace) -> str:
    """Run the command; prints the metrics line and returns the closing line. Raises :class:`EvaluateError` for bad
    input (and the engine's ConfigError/DataError/CheckpointError, mapped by :func:`run_evaluate`)."""

    from trainer.engine.distributed import DistInfo, resolve_device
    from trainer.engine.trainer import Trainer

    if bool(args.checkpoint) == bool(args.init_from):
        raise EvaluateError(
            "--checkpoint / --init-from: give exactly one (a checkpoint of this trainer, or an upstream DINO .pth)"
        )
    if args.init_from and not Path(args.init_from).is_file():
        raise EvaluateError(f"--init-from: {args.init_from} is not a file (an upstream DINO checkpoint .pth)")
    if args.checkpoint and not Path(args.checkpoint).exists():
        raise EvaluateError(f"--checkpoint: {args.checkpoint} does not exist")
    if not args.config and not args.checkpoint:
        raise EvaluateError("--config: needed with --init-from (an upstream file holds no config of this trainer)")
    t0 = time.perf_counter()
    read = _read(args) if args.checkpoint else None
    with tempfile.TemporaryDirectory(prefix="trainstack-evaluate-") as tmp:
        cfg = _config(args, tmp, read.state.get("config") if read else None)
        device = resolve_device(cfg.device, 0)
        trainer = Trainer(cfg, DistInfo(0, 0, 1, device), evaluation_only=True)
        try:
            if args.init_from:
                _check_nothing_random(getattr(trainer.task, "init_report", None), args.init_from)
            what = _load_checkpoint(trainer, args, read) if read else f"{Path(args.init_from).name} (init_from)"
            result = trainer.evaluate(trainer.model)
        finally:
            trainer.close()
    if result is None:  # a stop signal during the evaluation
        raise EvaluateError("evaluate: interrupted before the metrics were computed")
    metrics, n_bad, _ = result
    shown = " ".join(f"{k}={_shown(k, v)}" for k, v in metrics.items())
    print(f"evaluate: {what} on {cfg.val_split}: {shown}", flush=True)
    skipped = f"; {n_bad} undecodable file(s) left out" if n_bad else ""
    return f"evaluate: done in {time.perf_counter() - t0:.1f} s{skipped}"


def _shown(key: str, value: float) -> str:
    """A metric as the closing line prints it: image counts as integers, an undefined metric (NaN, e.g. COCO's AP
    of an area range without ground truth) as ``-``, the rest with 2 decimals."""
    if key.startswith("images"):
        return str(int(value))
    return "-" if value != value else f"{value:.2f}"


def run_evaluate(args: argparse.Namespace) -> int:
    """``evaluate``'s exit status: 0, or 2 with one ``error:`` line for bad input."""
    from trainer.errors import CheckpointError, ConfigError, DataError
    from trainer.failures import fail

    try:
        line = evaluate(args)
    except EvaluateError as e:
        return fail(EXIT_USAGE, str(e))
    except (ConfigError, DataError, CheckpointError) as e:
        return fail(EXIT_USAGE, str(e))
    print(line, flush=True)
    return 0
