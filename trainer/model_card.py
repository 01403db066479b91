"""The ``model_card.md`` an export writes beside its model: inputs and outputs, classes, the checkpoint's recorded
metrics, the command that trains it again, how it was exported and verified, the license."""

from __future__ import annotations

import json
import shlex
from pathlib import Path


def metrics_lines(state: dict, manifest: dict, target: str) -> list[str]:
    """Markdown lines of the checkpoint's recorded validation metrics (last epoch, best target metric)."""
    lines = []
    history = state.get("history") or []
    if not history:
        lines.append(
            "- no evaluation was recorded in this checkpoint (written before its first epoch was evaluated): no "
            "validation metrics to report"
        )
    if history:
        last = history[-1]
        vals = {k: v for k, v in last.items() if k.startswith("val_") and isinstance(v, (int, float))}
        lines.append(
            f"- last evaluated epoch {last.get('epoch')}: " + ", ".join(f"{k} {v:.4g}" for k, v in vals.items())
        )
    if state.get("best_metric") is not None:
        lines.append(f"- best {target} over the run (selects the `best` checkpoint): {state['best_metric']:.4g}")
    progress = manifest.get("progress") or {}
    if progress:
        lines.append("- checkpoint progress: " + ", ".join(f"{k} {v}" for k, v in progress.items()))
    return lines or ["- none recorded in this checkpoint"]


#: Folder under an export's ``--out`` where the model card's reproduce command trains (fresh checkpoint and logs).
RETRAIN_DIR = "retrain"


def reproduce_command(out: Path) -> str:
    """The command that trains the exported model again: ``train --config OUT/train_config.yaml`` with its
    ``--checkpoint-dir`` and ``--log-dir`` in ``OUT/retrain/`` (empty folders, so it starts from scratch; the
    saved config's own folders hold the finished run, which ``train`` would resume: "nothing left to train")."""
    return (
        f"python -m trainer train --config {shlex.quote(str(out / 'train_config.yaml'))} "
        f"--checkpoint-dir {shlex.quote(str(out / RETRAIN_DIR / 'checkpoints'))} "
        f"--log-dir {shlex.quote(str(out / RETRAIN_DIR / 'logs'))}"
    )


def model_card(meta: dict, facts: dict, metrics: list[str], verify: list[str], license_line: str) -> str:
    """The ``model_card.md`` text. ``facts``: format, date, command, checkpoint, weights, data_dir, reproduce
    (:func:`reproduce_command`), evaluated (whether the checkpoint recorded an evaluation), fingerprint, how,
    verified_on."""
    post = {k: v for k, v in meta.items() if k in ("top_k", "num_select", "score_threshold", "postprocess", "palette")}
    classes = ", ".join(f"{i}: {c}" for i, c in zip(meta["class_ids"], meta["classes"]))
    lines = [
        f"# {meta['task']} model `{meta['model']}` ({facts['format']})",
        "",
        f"Exported {facts['date']} by `{facts['command']}` from checkpoint `{facts['checkpoint']}` "
        f"({facts['weights']} weights).",
        "",
        "## Inputs and outputs",
        f"- inputs: {', '.join(meta['inputs'])}: {meta['input_layout']}; size {meta['input_size']}"
        + (f" ({', '.join(meta['dynamic_axes'])} dynamic)" if facts["format"] != "safetensors" else ""),
        f"- preprocessing before the graph: {meta.get('preprocess', 'none')}",
        f"- normalisation: mean {meta['mean']}, std {meta['std']} ({meta['normalization']})",
        f"- outputs: {', '.join(meta['outputs'])}",
        f"- post-processing: {json.dumps(post) if post else 'none'}",
        f"- classes (id: name): {classes}",
        "",
        "## Data and metrics",
        f"- data: `{facts['data_dir']}`",
        *metrics,
        *(
            [
                "- these are the validation metrics the training run computed (there is no standalone evaluation "
                "command yet)."
            ]
            if facts["evaluated"]
            else []
        ),
        f"- reproduce: `{facts['reproduce']}` trains again from scratch with the checkpoint's saved config, into "
        "fresh checkpoint and log folders beside this card (the saved config's own folders hold the finished run, "
        "which `train` would resume instead).",
        f"- config fingerprint (sha256/16 of the trajectory fields): `{facts['fingerprint']}`",
        "",
        "## Export",
        f"- {facts['how']}",
        *([f"- verification on {facts['verified_on']}:", *[f"  - {v}" for v in verify]] if verify else []),
        "",
        "## License",
        f"- {license_line}",
        "",
    ]
    return "\n".join(lines)
