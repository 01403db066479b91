"""How ``python -m trainer export`` checks what it wrote: real files of the checkpoint's data (or the task's
example inputs) through the export (ONNX Runtime on the CPU, or the loaded TorchScript module) and through the
task's reference (:meth:`~trainer.tasks.base.Task.export_verification`: the PyTorch graph, or for DINO ``predict``
itself), compared as max |diff| per float output and the task's agreement phrase."""

from __future__ import annotations

from pathlib import Path

#: Real input files used for verification (at most).
VERIFY_FILES = 4


def sample_files(task, limit: int = VERIFY_FILES) -> list[str]:
    """Up to ``limit`` input files of the checkpoint's data, from the first of
    :meth:`~trainer.tasks.base.Task.export_sample_dirs` that holds any (searched recursively; the first file of
    each sub-folder, then the second..., so several classes are covered), of the extensions the task reads; []
    when the folders are gone."""
    from trainer.config import BUILTIN_DIGITS
    from trainer.data.formats.imagefolder import IMAGE_EXTENSIONS

    if not task.cfg.data_dir:
        return []
    exts = tuple(task.input_extensions or IMAGE_EXTENSIONS)
    root = Path(task.cfg.data_dir)
    if task.cfg.data_dir == BUILTIN_DIGITS:
        from trainer.data.formats.digits import cache_root

        root = cache_root() / "digits-v1"  # written by the training run; not rewritten here
    for d in task.export_sample_dirs(root):
        if d.is_dir():
            groups: dict[Path, list[str]] = {}  # by folder (class), then round-robin: several classes
            for f in sorted(d.rglob("*")):
                if f.is_file() and f.suffix.lower() in exts:
                    groups.setdefault(f.parent, []).append(str(f))
            picks = [g[i] for i in range(limit) for g in groups.values() if i < len(g)]
            if picks:
                return picks[:limit]
    return []


def verification_runs(task, model, module, fmt: str) -> tuple[list, list, str]:
    """(runs, reference, where they come from) for verifying an export: real files of the checkpoint's data
    (:func:`sample_files` through :meth:`Task.predict_inputs` and :meth:`Task.export_verification`: input tuples to
    run through the export and the reference outputs, numpy, runs concatenated along the batch), else the task's
    example inputs (3 samples) against ``module`` (the PyTorch graph)."""
    files = sample_files(task)
    if files:
        try:
            batch = task.predict_inputs(files)
        except Exception:  # noqa: BLE001 - a data layout the task's reader does not take: fall back, said below
            batch = {}
        if batch.get("n"):
            runs, reference, how = task.export_verification(model, module, batch, fmt)
            names = ", ".join(Path(p).name for p in batch["paths"])
            return runs, reference, f"{batch['n']} files of {task.cfg.data_dir} ({names}){how}"
    inputs = task.export_example(3)
    return (
        [inputs],
        torch_outputs(module, inputs),
        "the task's example inputs (3 seeded random samples; data_dir not readable)",
    )


def concat(outputs: list[list]) -> list:
    """Per-run output lists (numpy, in the graph's output order) -> one list, concatenated along the batch."""
    import numpy as np

    return [np.concatenate(parts) for parts in zip(*outputs)]


def compare(task, reference: list, exported: list) -> list[str]:
    """Lines: max |diff| per float output, then the task's agreement phrase."""
    import numpy as np

    lines = []
    for name, a, b in zip(task.export_output_names, reference, exported):
        if np.issubdtype(a.dtype, np.floating):
            lines.append(f"max |diff| {name}: {float(np.abs(a.astype(np.float64) - b).max()):.3g}")
    lines.append(task.export_agreement(reference, exported))
    return lines


def run_onnx(path: Path, inputs: tuple) -> list:
    """ONNX Runtime (CPU) outputs of ``inputs`` (numpy arrays, in the graph's output order)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: x.numpy() for n, x in zip(names, inputs)})


def torch_outputs(module, inputs: tuple) -> list:
    """``module``'s outputs of ``inputs`` as numpy arrays (no autograd)."""
    import torch

    with torch.no_grad():
        return [o.numpy() for o in module(*inputs)]
