"""A trained model from a checkpoint: what ``predict``, ``export`` and ``evaluate`` share to read one.

``--checkpoint`` names a checkpoint folder (``ckpt-*``, or a file in one) or a run's ``checkpoint_dir``:
:func:`resolve_checkpoint` says which checkpoint that is, :func:`read_checkpoint` reads it whole (the next newest
when a training run prunes it meanwhile), :func:`load_model` rebuilds the task and its model from the
checkpoint's own config and label space and loads its weights (EMA or raw). Every bad ``--checkpoint`` is a
:class:`CheckpointArgError` whose message names the flag (the commands exit 2 with it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional


class CheckpointArgError(Exception):
    """``--checkpoint`` gives no usable trained model (missing, invalid, corrupt, written by an older trainer, or
    weights that do not fit); the message names the flag and the file (exit 2)."""


def _checkpoint_arg(path: str | Path) -> Path:
    """``--checkpoint`` as a folder: a file of a checkpoint (state.pt, ranks.pt, manifest.json) names its folder.

    Raises:
        CheckpointArgError: nothing there, or not a folder.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointArgError(f"--checkpoint: {p} does not exist")
    if p.is_file() and p.name in ("state.pt", "ranks.pt", "manifest.json"):
        p = p.parent
    if not p.is_dir():
        raise CheckpointArgError(f"--checkpoint: {p} is not a checkpoint folder (ckpt-*) or a checkpoint_dir")
    return p


def _none_valid(p: Path, notes: list[str]) -> CheckpointArgError:
    skipped = "; ".join(n.removeprefix("checkpoint: ") for n in notes if n.startswith("checkpoint: skipping "))
    return CheckpointArgError(
        f"--checkpoint: {p} holds no valid checkpoint (ckpt-* folders with a manifest.json)"
        + (f": {skipped}" if skipped else "")
    )


def _warn_skipped(notes: list[str], found: Path) -> None:
    """A ``warning:`` line for each newer checkpoint passed over as invalid (one pruned while read is not)."""
    for n in notes:
        if n.startswith("checkpoint: skipping "):
            name, _, why = n.removeprefix("checkpoint: skipping ").partition(": ")
            warn(f"--checkpoint: skipped {name} ({why}); using the older {found.name}")


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: itself (a folder with ``manifest.json``, or a file in one), else the
    one a run in checkpoint_dir ``path`` would resume from (:meth:`CheckpointDirectory.find_resume`). Each newer
    checkpoint passed over on the way (corrupt, incomplete) is named with its reason in a ``warning:`` line on
    stderr, so a fallback to an older checkpoint is never silent. Choosing is not reading: a command reads with
    :func:`read_checkpoint`, which takes another checkpoint when a running training prunes this one.

    Raises:
        CheckpointArgError: nothing there, or no valid checkpoint in it.
    """
    from trainer.engine.checkpoint_files import CheckpointDirectory

    p = _checkpoint_arg(path)
    if (p / "manifest.json").exists():
        return p
    # a reader only (no writer lock, no writability probe, no clean-up of the run's temporary files)
    found, notes = CheckpointDirectory(p).find_resume()
    if found is None:
        raise _none_valid(p, notes)
    _warn_skipped(notes, found)
    return found


def checkpoint_config_values(saved: dict) -> dict:
    """The config fields of a checkpoint's stored config (``state["config"]``, legacy values filled:
    :func:`~trainer.config.saved_config`) to rebuild its model from, without the fields that name weight files
    (``pretrained*``, ``init_from``, ``frame_weights``, ``encoder_weights``, ``weights``): the checkpoint's weights
    replace whatever they load, so a machine without those files can still read it."""
    from trainer.config import FIELDS, saved_config

    values = {k: v for k, v in saved_config(saved).items() if k in FIELDS}
    for name in FIELDS:
        if name.startswith("pretrained") or name in ("init_from", "frame_weights", "encoder_weights", "weights"):
            values[name] = FIELDS[name].default
    return values


def read_checkpoint(path: str | Path):
    """The checkpoint ``--checkpoint`` names, read whole on the CPU (a
    :class:`~trainer.engine.checkpoint_files.Checkpoint`: path, manifest, state; manifest and SHA-256 checked):
    a ``ckpt-*`` folder (or a file in one) itself, else the newest checkpoint of the checkpoint_dir ``path`` that
    can be read whole (:meth:`CheckpointDirectory.read_newest`: one that a training run still writing the folder
    prunes meanwhile is passed over for the next newest). Newer checkpoints skipped as invalid are warned about
    as :func:`resolve_checkpoint` does.

    Raises:
        CheckpointArgError: nothing there, no valid checkpoint in it, or the ``ckpt-*`` folder given is unreadable,
            corrupt or was deleted while being read.
    """
    from trainer.engine.checkpoint_files import CheckpointDirectory
    from trainer.errors import CheckpointError, CheckpointGone

    p = _checkpoint_arg(path)
    if (p / "manifest.json").exists() or p.name.startswith("ckpt-"):
        try:
            return CheckpointDirectory.read(p)
        except CheckpointGone as e:
            raise CheckpointArgError(
                f"--checkpoint: {e}; give its checkpoint_dir ({p.parent}) to read the newest"
            ) from None
        except CheckpointError as e:
            raise CheckpointArgError(f"--checkpoint: {e}") from None
    # a reader only (no writer lock, no writability probe, no clean-up of the run's temporary files)
    found, notes = CheckpointDirectory(p).read_newest()
    if found is None:
        raise _none_valid(p, notes)
    _warn_skipped(notes, found.path)
    return found


def num_outputs_of(label_space: dict) -> int:
    """Outputs of the model head: the label space's ``num_classes`` when it states one (detection's ``coco_ids``
    label space: max category id + 1), else the length of its names (``classes``, ``categories``, else its first
    list)."""
    if isinstance(label_space.get("num_classes"), int):
        return label_space["num_classes"]
    for key in ("classes", "categories"):
        if isinstance(label_space.get(key), list):
            return len(label_space[key])
    lists = [v for v in label_space.values() if isinstance(v, list)]
    if not lists:
        raise CheckpointArgError("--checkpoint: its label space names no classes; cannot size the model's head")
    return len(lists[0])


def read_state(path: Path) -> dict:
    """The training state of checkpoint ``path`` on the CPU (:meth:`CheckpointDirectory.load`: manifest and
    SHA-256 checked), read once and handed to :func:`load_model` / :func:`tracked_runs`.

    Raises:
        CheckpointArgError: unreadable or corrupt checkpoint.
    """
    from trainer.engine.checkpoint_files import CheckpointDirectory
    from trainer.errors import CheckpointError

    try:
        state, _ = CheckpointDirectory.load(path, 0, map_location="cpu")
    except CheckpointError as e:
        raise CheckpointArgError(f"--checkpoint: {e}") from None
    return state


def load_model(path: Path, device, use_ema: bool, state: Optional[dict] = None):
    """(task, model on ``device`` in eval mode, label space, ``"ema"`` | ``"model"``) of checkpoint ``path``;
    ``state``: its :func:`read_state`, when the caller has read it already.

    Raises:
        CheckpointArgError: unreadable checkpoint, no config or label space in it, or weights that do not fit.
    """
    from trainer.config import load_config
    from trainer.engine.distributed import DistInfo
    from trainer.errors import ConfigError
    from trainer.tasks import build_task

    if state is None:
        state = read_state(path)
    saved, label_space = state.get("config"), state.get("label_space")
    if not isinstance(saved, dict) or not saved.get("task"):
        raise CheckpointArgError(f"--checkpoint: {path} holds no config (written by an older trainer?)")
    if not isinstance(label_space, dict) or not label_space:
        raise CheckpointArgError(f"--checkpoint: {path} holds no label space (written by an older trainer?)")
    values = checkpoint_config_values(saved)
    values["device"] = "cpu" if device.type == "cpu" else "cuda"
    values["compile"] = False
    try:
        cfg = load_config(None, values)
    except ConfigError as e:
        raise CheckpointArgError(f"--checkpoint: {path}: its config does not load in this trainer: {e}") from None
    try:
        task = build_task(cfg, DistInfo(0, 0, 1, device))
        model = task.build_model(num_outputs_of(label_space))
    except ConfigError as e:
        raise CheckpointArgError(f"--checkpoint: {path}: cannot rebuild its model: {e}") from None
    which = load_weights(model, state, path, use_ema, f"model {cfg.model}")
    model.to(device).eval()
    return task, model, label_space, which


def load_weights(model, state: dict, path: Path, use_ema: bool, what: str) -> str:
    """Copy checkpoint ``path``'s weights (its :func:`read_state` ``state``) into ``model``: the EMA weights when
    ``use_ema`` and it has them, else the model's. Returns ``"ema"`` or ``"model"``.

    Raises:
        CheckpointArgError: no weights, or weights that do not fit ``model`` (``what`` names it in the message).
    """
    which = "ema" if use_ema and isinstance(state.get("ema"), dict) else "model"
    weights = state.get(which)
    if not isinstance(weights, dict):
        raise CheckpointArgError(f"--checkpoint: {path} holds no model weights")
    if which == "ema":  # AveragedModel: the module's keys under "module.", plus its "n_averaged" counter
        weights = {k.removeprefix("module."): v for k, v in weights.items() if k != "n_averaged"}
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        from trainer.engine.resume import state_dict_mismatch

        why = state_dict_mismatch(model, weights) or str(e).splitlines()[0]
        raise CheckpointArgError(f"--checkpoint: {path}: its {which} weights do not fit {what}: {why}") from None
    return which


def warn(message: str) -> None:
    """A ``warning:`` line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
