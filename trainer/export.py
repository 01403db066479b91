"""``python -m trainer export``: turn a trained checkpoint into what a serving stack loads, with a model card.

Usage::

    python -m trainer export --checkpoint CKPT --format onnx|torchscript|safetensors --out DIR
        [--opset 18] [--weights ema|raw] [--verify/--no-verify] [--task TASK]

``CKPT`` is a checkpoint folder (``ckpt-*``) or a run's ``checkpoint_dir``, resolved and loaded exactly as
``predict`` does (:func:`trainer.trained.read_checkpoint`, :func:`trainer.trained.load_model`). The task says
how its model is exported (:meth:`trainer.tasks.base.Task.export_module`: ImageNet normalisation of float32 pixel
values in [0, 255] inside the graph, the task's post-processing after it) and what serving needs to know
(:meth:`~trainer.tasks.base.Task.export_metadata`: classes and ids, input size, mean/std, post-processing).

Outputs in ``DIR``: ``model.onnx`` (``torch.onnx.export`` with the torch.export-based exporter, torch's default
since 2.9, which needs ``onnxscript``; a dynamic batch axis; the metadata as JSON strings in ``metadata_props``),
``model.pt`` (``torch.jit.trace``; the metadata as ``_extra_files["metadata.json"]``) or ``model.safetensors``
(weights only; the metadata as str -> JSON string in its header); ``train_config.yaml`` (the checkpoint's config)
and ``model_card.md`` (:mod:`trainer.model_card`). Verification (:mod:`trainer.export_verify`; on by default for onnx and torchscript): the exported model (ONNX Runtime on
CPU, or the loaded TorchScript module) against PyTorch on real inputs (a few files of the checkpoint's
``data_dir`` when it exists, else the task's example inputs): max |diff| per float output and the task's agreement
(top-1 / mask pixels), printed and written into the model card; ONNX is also run at batch 1.

Exit status: 0 done; 2 bad input, one line: missing or invalid checkpoint, a checkpoint of another task than
``--task``, an output folder that cannot be created or that holds another export (another checkpoint's, or another
format's: :func:`check_out`), a format the task cannot export, an ``--opset`` outside what this install's exporter
writes (:func:`opset_range`, checked the same for every format) or given with a format that has no opset.

Writes: every file (model, ``train_config.yaml``, ``model_card.md``) goes to a temporary name in ``DIR`` and is
renamed into place when complete (:func:`trainer.engine.durable.atomic_write_bytes`), so an export that fails (a full
disk) leaves the previous export's file or none, never a truncated one. A checkpoint_dir that a training run is
writing is read, not waited for: its ``latest`` names only complete checkpoints, and a ``note:`` line names the run.

DINO's graph (:mod:`trainer.tasks.detection.export`) runs the deformable attention as the PyTorch reference
(``GridSample``), so it needs no custom-op library at serving time; it takes evaluation-resized images of any size
(ONNX; TorchScript a fixed square canvas) plus each image's size, ends in DINO's top-``num_select``
post-processing, and is verified against ``predict`` itself (:meth:`~trainer.tasks.base.Task.export_verification`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Optional

from trainer.argtypes import bounded_number
from trainer.errors import EXIT_USAGE

FORMATS = ("onnx", "torchscript", "safetensors")
FILES = {"onnx": "model.onnx", "torchscript": "model.pt", "safetensors": "model.safetensors"}
MODEL_CARD = "model_card.md"


class ExportError(Exception):
    """A bad input of ``export``; the message names the flag (exit 2)."""


def add_export_command(sub) -> None:
    """Register the ``export`` sub-command on ``sub`` (an argparse sub-parsers object)."""
    from trainer.tasks import task_names

    p = sub.add_parser(
        "export",
        help="export a checkpoint as ONNX, TorchScript or safetensors with a model card",
        description="Export a trained checkpoint of any task with its serving "
        "metadata and a model_card.md; ONNX and TorchScript exports are verified against PyTorch.",
    )
    p.add_argument(
        "--checkpoint", required=True, metavar="CKPT", help="a checkpoint folder (ckpt-*) or a run's checkpoint_dir"
    )
    p.add_argument("--format", required=True, choices=FORMATS, help="onnx | torchscript | safetensors (weights only)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument(
        "--opset",
        type=bounded_number(int),
        default=None,
        metavar="N",
        help="ONNX opset (--format onnx only): 18 (torch.onnx's, the default) to the highest onnxscript's version "
        "converter writes (25 with onnxscript 0.7); others are refused",
    )
    p.add_argument(
        "--weights",
        choices=("ema", "raw"),
        default="ema",
        help="ema: the EMA weights when the checkpoint has them (default), else the model's; raw: the model's",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare the export with PyTorch on real inputs (onnx, torchscript; default on)",
    )
    p.add_argument("--task", choices=task_names(), default=None, help="refuse a checkpoint of another task")


def prepare_out(out: str | Path) -> Path:
    """Create the output folder.

    Raises:
        ExportError: it is a file or cannot be created.
    """
    from trainer.engine.durable import describe_os_error

    d = Path(out)
    if d.exists() and not d.is_dir():
        raise ExportError(f"--out: {d} exists and is not a folder; give a folder path")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"--out: cannot create {d}: {describe_os_error(e)}; give a writable folder") from None
    return d


def opset_range() -> tuple[int, int]:
    """``(lowest, highest)`` ONNX opset :func:`export_onnx` can write with this install (18 and 25 with torch 2.14
    and onnxscript 0.7.2).

    Lowest: torch.onnx's torch.export-based exporter implements opset ``TORCHLIB_OPSET`` (18,
    ``torch/onnx/_internal/exporter/_constants.py``); asked for less, it converts with onnxscript's version
    converter, whose range starts at ``SUPPORTED_MIN_ONNX_OPSET`` (18 in
    ``onnxscript/version_converter/_version_converter.py``), so it keeps 18 (a QA pass on 2026-11-28: ``--opset 17``
    wrote 18 with exit 0). Highest: that converter's ``SUPPORTED_MAX_ONNX_OPSET`` (25); asked for more,
    ``torch.onnx.export`` keeps 18 without a word. 18 for both ends where those constants are not found."""
    lowest = highest = 18
    try:
        from torch.onnx._internal.exporter import _constants

        lowest = int(_constants.TORCHLIB_OPSET)
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    try:
        from onnxscript.version_converter import _version_converter

        lowest = max(lowest, int(_version_converter.SUPPORTED_MIN_ONNX_OPSET))
        highest = int(_version_converter.SUPPORTED_MAX_ONNX_OPSET)
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    return lowest, max(lowest, highest)


def check_opset(opset: Optional[int], fmt: str) -> int:
    """The opset to write: ``opset`` (default: the lowest of :func:`opset_range`), checked the same way for every
    format before anything is read.

    Raises:
        ExportError: outside :func:`opset_range`, or given with a format that writes no opset."""
    lowest, highest = opset_range()
    if opset is not None and not lowest <= opset <= highest:
        raise ExportError(
            f"--opset: got {opset}; this exporter writes opsets {lowest} to {highest} (torch.onnx's lowest, "
            "onnxscript's version converter's highest); give one of those"
        )
    if opset is not None and fmt != "onnx":
        raise ExportError(f"--opset: --format {fmt} writes no ONNX opset; leave --opset out or use --format onnx")
    return lowest if opset is None else opset


#: Names of the files an export writes into ``--out`` (the model files of every format, the config, the card).
EXPORT_FILES = (*FILES.values(), "train_config.yaml", MODEL_CARD)
_CARD_CHECKPOINT = re.compile(r"from checkpoint `([^`]+)`")


def check_out(out: Path, ckpt: Path, fmt: str) -> None:
    """Refuse an ``--out`` that holds another export: a model file of another format, or a model card of another
    checkpoint (an export of the same checkpoint and format is replaced, file by file, atomically).

    Raises:
        ExportError: naming what is there."""
    if not out.is_dir():
        return
    others = sorted(name for f, name in FILES.items() if f != fmt and (out / name).exists())
    if others:
        raise ExportError(
            f"--out: {out} holds another export ({', '.join(others)}); give an empty folder (one export per folder, "
            "so that its model card describes every file in it)"
        )
    try:
        card = (out / MODEL_CARD).read_text()
    except (OSError, UnicodeDecodeError):
        return
    found = _CARD_CHECKPOINT.search(card)
    if found and Path(found.group(1)).resolve() != ckpt.resolve():
        raise ExportError(
            f"--out: {out} holds the export of another checkpoint ({found.group(1)}); give an empty folder or "
            "that export's own --checkpoint"
        )


def _tmp_name(path: Path) -> Path:
    """Where a file of the export is written before it is renamed to ``path`` (same folder, so the rename is atomic)."""
    import os

    return path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")


def _metadata_strings(meta: dict) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def export_onnx(module, example: tuple, path: Path, task, opset: int, meta: dict) -> int:
    """``torch.onnx.export`` (torch.export-based, ``dynamo=True``) with the task's dynamic axes
    (:meth:`~trainer.tasks.base.Task.export_dynamic_shapes`: batch, and height/width for segmentation), then
    ``meta`` (plus ``opset``) as JSON strings in the model's ``metadata_props``. Returns the opset of the saved
    model: the exporter writes 18 and converts down to a lower ``opset`` only where onnx's version converter
    can (it keeps 18 otherwise, with a warning)."""
    import contextlib
    import io
    import warnings

    import onnx
    import torch

    shapes = task.export_dynamic_shapes()
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")  # the exporter's progress lines and its opset-18 notice: not the user's
        program = torch.onnx.export(
            module,
            example,
            input_names=list(task.export_input_names),
            output_names=list(task.export_output_names),
            opset_version=opset,
            dynamic_shapes=shapes,
            dynamo=True,
            verbose=False,
        )
    program.save(str(path))
    model = onnx.load(str(path))
    meta = {**meta, "opset": max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))}
    for k, v in _metadata_strings(meta).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, v
    onnx.save(model, str(path))
    return meta["opset"]


def export(args: argparse.Namespace) -> list[str]:
    """Run the command; returns the printed lines. Raises :class:`ExportError` for bad input."""
    import torch

    from trainer.engine.durable import describe_holder, lock_holder
    from trainer.trained import CheckpointArgError, load_model, read_checkpoint

    opset = check_opset(args.opset, args.format)
    try:
        read = read_checkpoint(args.checkpoint)  # held whole from here: a training run may prune it meanwhile
    except CheckpointArgError as e:
        raise ExportError(f"{e}; give a ckpt-* folder or a checkpoint_dir") from None
    ckpt, state, manifest = read.path, read.state, read.manifest
    del read
    found = manifest.get("task") if isinstance(manifest, dict) else None
    if args.task and found and found != args.task:
        raise ExportError(
            f"--checkpoint: {ckpt} is a {found} checkpoint, not {args.task}; give a {args.task} checkpoint"
        )
    holder = lock_holder(ckpt.parent)
    if holder is not None:
        print(
            f"note: --checkpoint: {ckpt.parent} is being written by a training run ({describe_holder(holder)}); "
            f"exporting its complete checkpoint {ckpt.name}",
            file=sys.stderr,
            flush=True,
        )
    check_out(Path(args.out), ckpt, args.format)
    try:
        task, model, label_space, which = load_model(ckpt, torch.device("cpu"), args.weights == "ema", state)
    except CheckpointArgError as e:
        raise ExportError(str(e)) from None
    if args.task and task.name != args.task:
        raise ExportError(f"--checkpoint: {ckpt} is a {task.name} checkpoint, not {args.task}")
    why = task.export_unsupported(args.format)
    if why:
        raise ExportError(f"--format: {why}")
    created = not Path(args.out).exists()
    out = prepare_out(args.out)
    try:
        return _write_export(args, out, ckpt, state, manifest, task, model, label_space, which, opset)
    except BaseException:
        if created:  # never leave an empty --out behind (the files are renamed into it only once written)
            try:
                out.rmdir()
            except OSError:
                pass
        raise


def _write_export(args, out: Path, ckpt: Path, state: dict, manifest: dict, task, model, label_space, which, opset):
    """The export's files in ``out`` (each written to a temporary name, renamed once complete); returns the
    printed lines. Raises :class:`ExportError` when ``out`` cannot be written."""
    import torch
    import yaml

    from trainer.engine.durable import atomic_write_bytes, describe_os_error
    from trainer.export_verify import compare, concat, run_onnx, torch_outputs, verification_runs
    from trainer.model_card import metrics_lines, model_card, reproduce_command

    if args.format == "torchscript":  # one line instead of torch's FutureWarning per torch.jit call (trace, save, load)
        import warnings

        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning)
        print(
            f"note: --format torchscript: torch {torch.__version__.split('+')[0]} deprecates TorchScript (torch.jit) "
            "in favour of torch.export; --format onnx is the exchange format that stays",
            file=sys.stderr,
            flush=True,
        )
    meta = task.export_metadata(label_space, args.format)
    meta.update(checkpoint=ckpt.name, weights=which, config_fingerprint=str(state.get("fingerprint")))
    model.float().eval()
    path = out / FILES[args.format]
    tmp = _tmp_name(path)  # renamed to path once written and verified
    lines, verify, verified_on = [], [], ""
    try:
        if args.format == "safetensors":
            from safetensors.torch import load_file, save_file

            weights = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
            save_file(weights, str(tmp), metadata=_metadata_strings(meta))
            back = load_file(str(tmp))
            same = back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
            verify = [f"{len(weights)} tensors read back {'identical' if same else 'DIFFERENT'}"]
            verified_on, how = "the saved file", "safetensors.torch.save_file: weights only (the model's state_dict)"
        else:
            module = task.export_module(model).eval()
            example = task.export_example(2)
            if args.format == "onnx":
                written = export_onnx(module, example, tmp, task, opset, meta)
                if written != opset:
                    print(
                        f"warning: --opset {opset}: the converter could not convert this graph; wrote opset "
                        f"{written} (the model card says so)",
                        file=sys.stderr,
                        flush=True,
                    )
                how = (
                    f"torch.onnx.export (torch {torch.__version__.split('+')[0]}, torch.export-based exporter, "
                    f"onnxscript), opset {written} (asked {opset}), dynamic axes: {', '.join(meta['dynamic_axes'])}; "
                    "standard ONNX ops only; "
                    "metadata in metadata_props (JSON strings)"
                )
            else:
                import warnings

                with torch.no_grad(), warnings.catch_warnings():
                    # TracerWarnings on shapes read as Python values (fixed in the trace; the verification below
                    # runs the traced module on the real inputs)
                    warnings.simplefilter("ignore", torch.jit.TracerWarning)
                    traced = torch.jit.trace(module, example, check_trace=False)
                torch.jit.save(traced, str(tmp), _extra_files={"metadata.json": json.dumps(meta)})
                how = "torch.jit.trace; metadata as _extra_files['metadata.json']"
            if args.verify:
                runs, ref, verified_on = verification_runs(task, model, module, args.format)
                if args.format == "onnx":
                    got = concat([run_onnx(tmp, inputs) for inputs in runs])
                    one = run_onnx(tmp, tuple(x[:1] for x in runs[0]))
                    verified_on += "; ONNX Runtime CPU vs PyTorch float32"
                    verify = compare(task, ref, got) + [
                        f"batch 1 run: max |diff| {task.export_output_names[0]} vs PyTorch "
                        f"{float(abs(one[0].astype('float64') - ref[0][:1]).max()):.3g}"
                    ]
                else:
                    loaded = torch.jit.load(str(tmp))
                    got = concat([torch_outputs(loaded, inputs) for inputs in runs])
                    verified_on += "; loaded TorchScript vs PyTorch float32"
                    verify = compare(task, ref, got)
        facts = {
            "format": args.format,
            "date": datetime.date.today().isoformat(),
            "command": "python -m trainer export " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["export"] else []),
            "checkpoint": str(ckpt),
            "weights": which,
            "data_dir": task.cfg.data_dir,
            "reproduce": reproduce_command(out),
            "evaluated": bool(state.get("history")),
            "fingerprint": state.get("fingerprint"),
            "how": how,
            "verified_on": verified_on,
        }
        card = model_card(
            meta, facts, metrics_lines(state, manifest, task.check_target()[0]), verify, task.backbone_license()
        )
        tmp.replace(path)
        atomic_write_bytes(out / "train_config.yaml", yaml.safe_dump(state["config"], sort_keys=False).encode())
        atomic_write_bytes(out / MODEL_CARD, card.encode())
    except OSError as e:
        raise ExportError(f"--out: cannot write in {out}: {describe_os_error(e)}; give a writable folder") from None
    finally:
        tmp.unlink(missing_ok=True)
    if verify:
        lines.append(f"verify: on {verified_on}")
    lines += [f"verify: {v}" for v in verify]
    lines.append(f"export: {task.name} {task.cfg.model} -> {path} ({args.format}; {ckpt.name}, {which} weights)")
    return lines


def run_export(args: argparse.Namespace) -> int:
    """``export``'s exit status: 0, or 2 with one ``error:`` line for bad input."""
    from trainer.failures import fail

    try:
        lines = export(args)
    except ExportError as e:
        return fail(EXIT_USAGE, str(e))
    print("\n".join(lines), flush=True)
    return 0
