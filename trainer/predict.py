"""``python -m trainer predict``: run a trained checkpoint on a folder of images, draw what it sees, write JSON.

Usage::

    python -m trainer predict --checkpoint CKPT --images DIR --out DIR [--score-threshold 0.3]
        [--ema/--no-ema] [--device auto|cpu|cuda] [--batch-size N] [--limit N]

``CKPT`` is one checkpoint folder (``ckpt-*``) or a run's ``checkpoint_dir`` (then the checkpoint the trainer
would resume from: the ``latest`` pointer's, else the newest that validates). The run's config and label space
come from the checkpoint; the task rebuilds the model and owns how inputs are prepared
(:meth:`trainer.tasks.base.Task.predict_inputs`) and how predictions are drawn and recorded
(:meth:`~trainer.tasks.base.Task.render_predictions`). The image files directly in ``--images`` are read
(not sub-folders), sorted by name. Outputs: ``<out>/<stem>.png`` per image (``<stem>_<ext>.png`` when two
inputs share a stem) and ``<out>/predictions.json`` (the task's records; detection: COCO results format with
a ``file`` field). Runs in float32 on one process.

Exit status: 0 done (undecodable images are skipped, each named in a ``warning:`` line); 2 bad input, one line
naming the flag: missing or invalid checkpoint, missing or empty image folder, no readable image, output folder
not writable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from trainer.argtypes import bounded_number
from trainer.errors import EXIT_USAGE

PREDICTIONS_FILE = "predictions.json"


class PredictError(Exception):
    """A bad input of ``predict``; the message names the flag or file (exit 2)."""


# --- the command ------------------------------------------------------------------------------------------
def add_predict_command(sub) -> None:
    """Register the ``predict`` sub-command on ``sub`` (an argparse sub-parsers object)."""
    p = sub.add_parser(
        "predict",
        help="run a checkpoint on a folder of images or videos: drawn PNGs and predictions.json",
        description="Run a trained checkpoint of any task on a folder of its inputs and write predictions.json: "
        "classification top-5 per image, detection boxes (docs/detection.md, Predict), segmentation class-index "
        "masks <stem>_mask.png plus overlays (docs/segmentation.md), video top-5 per clip (docs/video.md).",
    )
    p.add_argument(
        "--checkpoint", required=True, metavar="CKPT", help="a checkpoint folder (ckpt-*) or a run's checkpoint_dir"
    )
    p.add_argument(
        "--images",
        required=True,
        metavar="DIR",
        help="folder of input files: images, or video files for a video checkpoint (not searched recursively)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output folder (created): <stem>.png per input (segmentation also <stem>_mask.png; an input whose files "
        "would overwrite another's gets _2, _3...), predictions.json",
    )
    p.add_argument(
        "--score-threshold",
        type=bounded_number(float, 0.0, 1.0),
        metavar="S",
        default=0.3,
        help="keep detections scoring at least this (detection; default 0.3)",
    )
    p.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="use the EMA weights when the checkpoint has them (default), else the model's",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    p.add_argument(
        "--batch-size", type=bounded_number(int, 1), metavar="N", default=8, help="images per forward (default 8)"
    )
    p.add_argument(
        "--limit",
        type=bounded_number(int, 1),
        metavar="N",
        default=None,
        help="predict only the first N images (by name)",
    )
    p.add_argument(
        "--track",
        action="store_true",
        help="also upload the drawn PNGs and predictions.json to the checkpoint's tracked runs (the training's "
        "--tracking sinks, run ids from the checkpoint), under <out folder name>/",
    )


def list_images(folder: str | Path, limit: Optional[int] = None, extensions: Optional[tuple] = None) -> list[str]:
    """Input files directly in ``folder`` (by extension, case-insensitive: ``extensions``, default the image
    extensions; the video task passes its video extensions), sorted by name; the first ``limit``.

    Raises:
        PredictError: no such folder, or no input file in it.
    """
    from trainer.data.formats.imagefolder import IMAGE_EXTENSIONS

    exts = tuple(extensions or IMAGE_EXTENSIONS)
    d = Path(folder)
    if not d.is_dir():
        raise PredictError(f"--images: {d} is not a folder")
    files = sorted(str(f) for f in d.iterdir() if f.is_file() and f.suffix.lower() in exts)
    if not files:
        kind = "image" if extensions is None else "input"
        raise PredictError(f"--images: {d} holds no {kind} files ({', '.join(exts)})")
    return files[:limit] if limit else files


def output_names(paths: list[str], suffixes: tuple[str, ...] = ("",)) -> dict[str, str]:
    """Input path -> drawn PNG's file name: ``<stem>.png``, or ``<stem>_<ext>.png`` when stems collide.

    ``suffixes``: the files a task writes per input, as suffixes of that name's stem (segmentation: ``("",
    "_mask")`` for ``x.png`` and ``x_mask.png``). No two inputs get a file name in common: an input whose files
    would overwrite another's (``x.png`` beside ``x_mask.png`` in segmentation) gets ``_2``, ``_3``... appended.
    """
    stems: dict[str, int] = {}
    for p in paths:
        stems[Path(p).stem] = stems.get(Path(p).stem, 0) + 1
    names, taken = {}, set()
    for p in paths:
        f = Path(p)
        base = f.stem if stems[f.stem] == 1 else f"{f.stem}_{f.suffix.lstrip('.').lower()}"
        stem, k = base, 1
        while any(f"{stem}{s}" in taken for s in suffixes):
            k += 1
            stem = f"{base}_{k}"
        taken.update(f"{stem}{s}" for s in suffixes)
        names[p] = f"{stem}.png"
    return names


def prepare_out(out: str | Path, images: str | Path) -> Path:
    """Create the output folder and check a file can be written in it.

    Raises:
        PredictError: it is a file, cannot be created or written, or is the image folder itself.
    """
    from trainer.engine.durable import describe_os_error

    d = Path(out)
    if d.exists() and not d.is_dir():
        raise PredictError(f"--out: {d} exists and is not a folder")
    if d.exists() and d.resolve() == Path(images).resolve():
        raise PredictError(f"--out: {d} is the --images folder (its PNGs would overwrite the inputs)")
    probe = d / f".predict-probe-{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"trainstack")
    except OSError as e:
        raise PredictError(f"--out: cannot write in {d}: {describe_os_error(e)}") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return d


def _input_extensions(manifest: dict) -> Optional[tuple]:
    """The file extensions the checkpoint's task reads (:attr:`Task.input_extensions`; None: images), from the
    task name in its ``manifest`` (older checkpoints have none)."""
    from trainer.tasks import task_class

    try:
        return task_class(manifest["task"]).input_extensions
    except (ValueError, KeyError, TypeError):
        return None


def predict(args: argparse.Namespace) -> str:
    """Run the command; returns the summary line. Raises :class:`PredictError` for bad input."""
    import torch

    from trainer.engine.distributed import resolve_device
    from trainer.engine.durable import describe_os_error
    from trainer.errors import ConfigError
    from trainer.trained import load_model, read_checkpoint, warn

    read = read_checkpoint(args.checkpoint)  # held whole from here: a training run may prune it meanwhile
    ckpt, state = read.path, read.state
    paths = list_images(args.images, args.limit, _input_extensions(read.manifest))
    del read
    out = prepare_out(args.out, args.images)
    try:
        device = resolve_device(args.device, 0)
    except ConfigError as e:
        raise PredictError(f"--device: {str(e).removeprefix('device: ')}") from None
    run_ids = tracked_runs(ckpt, state) if args.track else {}
    tracking_uri = state.get("tracking_uri")
    task, model, label_space, which = load_model(ckpt, device, args.ema, state)
    del state
    names = output_names(paths, task.output_suffixes)
    records: list[dict] = []
    predicted: list[str] = []  # input paths with outputs written
    done = 0
    for start in range(0, len(paths), args.batch_size):
        chunk = paths[start : start + args.batch_size]
        try:
            batch = task.predict_inputs(chunk, first_index=start)
        except NotImplementedError as e:
            raise PredictError(f"--checkpoint: {e}") from None
        for bad in batch.get("bad", ()):
            warn(f"--images: skipping {bad.path}: {bad.error}")
        kept = list(batch.get("paths", ()))
        if not batch.get("n"):
            continue
        with torch.no_grad():
            outputs = task.predict(model, batch)
        try:
            new = task.render_predictions(
                kept, batch, outputs, label_space, out, args.score_threshold, out_names=[names[p] for p in kept]
            )
        except OSError as e:
            raise PredictError(f"--out: cannot write in {out}: {describe_os_error(e)}") from None
        for r in new:  # classification and video: the top-k classes per input, one line each
            if "top5" in r:
                print(f"{r['file']}: " + ", ".join(f"{t['label']} {t['score']:.3f}" for t in r["top5"]), flush=True)
        records += new
        predicted += kept
        done += len(kept)
    if not done:
        raise PredictError(f"--images: none of the {len(paths)} image file(s) in {args.images} could be read")
    try:
        (out / PREDICTIONS_FILE).write_text(json.dumps(records, indent=1) + "\n")
    except OSError as e:
        raise PredictError(f"--out: cannot write {out / PREDICTIONS_FILE}: {describe_os_error(e)}") from None
    scored = [r for r in records if "score" in r]
    what = (
        f"{len(records)} detections above {args.score_threshold:g}"
        if scored or not records
        else f"{len(records)} records"
    )
    line = f"predict: {done} images -> {out} ({what}; {ckpt.name}, {which} weights)"
    if run_ids:
        stems = [Path(names[p]).stem for p in predicted]
        files = [out / PREDICTIONS_FILE] + [out / f"{stem}{sfx}.png" for stem in stems for sfx in task.output_suffixes]
        line += "\n" + track_outputs(task.cfg, run_ids, [f for f in files if f.is_file()], out, tracking_uri)
    return line


def tracked_runs(ckpt: Path, state: dict) -> dict:
    """Tracker name -> run id that the training of checkpoint ``ckpt`` (its :func:`~trainer.trained.read_state` ``state``)
    logged to (``state["tracking"]``).

    Raises:
        PredictError: the checkpoint holds none: its run was not trained with ``--tracking``, or was, but no
            tracker started (the message says which, from the checkpoint's config).
    """
    ids = {k: v for k, v in (state.get("tracking") or {}).items() if v}
    if not ids:
        asked = list((state.get("config") or {}).get("tracking") or [])
        if asked:
            raise PredictError(
                f"--track: {ckpt} holds no tracked run: its training asked for --tracking {','.join(asked)} but no "
                "tracker started (see that run's 'WARNING: tracking' lines); drop --track, or fix the tracker and "
                "train again"
            )
        raise PredictError(
            f"--track: {ckpt} holds no tracked run (its training ran without --tracking); drop --track or train "
            "with --tracking mlflow|wandb"
        )
    return ids


def track_outputs(cfg, run_ids: dict, files: list[Path], out: Path, stored_uri: Optional[str] = None) -> str:
    """Upload ``files`` (under ``out``) to the runs ``run_ids`` with the training config's tracking settings,
    each under ``<out folder name>/``; W&B keeps its offline files in ``out/wandb``. MLflow's store: ``stored_uri``
    (the resolved URI the checkpoint recorded, ``tracking_uri`` in its state), else the config's ``tracking_uri``,
    else ``MLFLOW_TRACKING_URI`` (:func:`~trainer.engine.trackers.resolve_mlflow_uri`). A tracker that fails is a
    ``WARNING`` line (the predictions on disk stay). Returns the summary line."""
    from trainer.engine.trackers import build_trackers
    from trainer.engine.tracking import TrackingSinks

    names = [n for n in (cfg.tracking or []) if n in run_ids] or list(run_ids)
    trackers = build_trackers(names, stored_uri or cfg.tracking_uri, cfg.tracking_experiment, None, out)
    sinks = TrackingSinks(
        trackers,
        lambda m: print(m, file=sys.stderr, flush=True),
        continues="the predictions stay on disk; going on",
        background=False,
    )
    sinks.attach(run_ids)
    for f in files:
        sinks.log_artifact(f, out.parent)
    done = [f"{t.name} run {sinks.run_ids[t.name]}" for t in sinks.live]
    sinks.detach()
    if not done:
        return "track: nothing uploaded (see the WARNING lines)"
    return f"track: {len(files)} files under {out.name}/ -> " + ", ".join(done)


def run_predict(args: argparse.Namespace) -> int:
    """``predict``'s exit status: 0, or 2 with one ``error:`` line for bad input."""
    from trainer.failures import fail
    from trainer.trained import CheckpointArgError

    try:
        line = predict(args)
    except (PredictError, CheckpointArgError) as e:
        return fail(EXIT_USAGE, str(e))
    print(line, flush=True)
    return 0
