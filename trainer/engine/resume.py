"""Resuming a run from a checkpoint: which checkpoint (``resume``, or ``auto_resume``'s newest complete one),
whether it fits this run (label space, model weights, optimizer and EMA state, trajectory config unless
``force_resume``), and where training continues (epoch, step in epoch, global step, LR schedule, per-rank
random streams and epoch statistics). :class:`ResumeMixin` is the part of :class:`~trainer.engine.trainer.Trainer`
that does it; the checkpoint format itself is :mod:`trainer.engine.checkpoint`'s."""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Optional

import torch

from trainer.config import FIELDS, NON_TRAJECTORY_FIELDS, saved_config
from trainer.engine import distributed as dist
from trainer.engine.checkpoint import CheckpointError, CheckpointManager
from trainer.models.local_weights import state_dict_diff


def config_diff(saved: dict, current: dict) -> list[str]:
    """Trajectory fields that differ between a checkpoint's config and this run's, one phrase each. A field the
    checkpoint does not record (added to the schema after it was written) reads as its ``legacy`` value when it
    has one (:func:`trainer.config.saved_config`: what the older trainer really used, e.g. ``pad_value: black``),
    else counts as unchanged while this run keeps the field's default, which reproduces what the older trainer
    did."""
    saved = saved_config(saved)
    keys = sorted(k for k in set(saved) | set(current) if k not in NON_TRAJECTORY_FIELDS)
    return [
        f"{k}: checkpoint {saved.get(k)!r} -> now {current.get(k)!r}"
        for k in keys
        if saved.get(k) != current.get(k) and not (k not in saved and k in FIELDS and _is_default(k, current.get(k)))
    ]


def _is_default(name: str, value) -> bool:
    f = FIELDS[name]
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return value == default


def _names(values: list, first: int = 8) -> str:
    shown = ", ".join(map(str, values[:first]))
    return f"[{shown}{', ...' if len(values) > first else ''}]"


def label_space_diff(saved: dict, current: dict) -> list[str]:
    """What differs between a checkpoint's label space and the data's, one phrase per key, e.g.
    ``classes: checkpoint has 2 [ants, bees], data has 3 [ants, bees, wasps]; only in data: wasps``."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            text = f"{key}: checkpoint has {len(a)} {_names(a)}, data has {len(b)} {_names(b)}"
            only_ckpt = [x for x in a if x not in b]
            only_data = [x for x in b if x not in a]
            for label, items in (("only in checkpoint", only_ckpt), ("only in data", only_data)):
                if items:
                    text += f"; {label}: {', '.join(map(str, items[:5]))}" + (" ..." if len(items) > 5 else "")
            if not only_ckpt and not only_data:
                text += "; same names in another order (the outputs would mean other classes)"
            out.append(text)
        else:
            out.append(f"{key}: checkpoint {a!r}, data {b!r}")
    return out


def state_dict_mismatch(model: torch.nn.Module, saved: dict, first: int = 3) -> Optional[str]:
    """Summary of why ``saved`` cannot be loaded into ``model`` (missing, unexpected and differently shaped
    keys, the first ``first`` of each), or None when every key and shape matches."""
    missing, unexpected, shapes = state_dict_diff(model.state_dict(), saved)
    parts = []
    for label, items in (
        ("missing in the checkpoint", missing),
        ("not in the model", unexpected),
        ("of another shape (checkpoint vs model)", shapes),
    ):
        if items:
            parts.append(f"{len(items)} {label}: " + ", ".join(items[:first]) + (", ..." if len(items) > first else ""))
    return "; ".join(parts) or None


class ResumeMixin:
    """Trainer methods that restore a checkpoint into the trainer's model, optimizer, scheduler, scaler, EMA and
    progress counters. Expects the attributes :class:`~trainer.engine.trainer.Trainer` sets before calling
    ``_resume_if_asked`` (cfg, info, device, log, ckpt, label_space, model, optimizer, scheduler, scaler, ema,
    steps_per_epoch). Raises CheckpointError for a checkpoint that does not fit (see each method)."""

    # .. resume ..............................................................................................
    def _resume_if_asked(self) -> None:
        cfg = self.cfg
        self._rank_state = None
        path: Optional[Path] = None
        if cfg.resume:
            path = Path(cfg.resume)
            if path.is_file() and path.name in ("state.pt", "manifest.json", "ranks.pt"):
                path = path.parent
            self.log.info(f"checkpoint: resuming from {path} (--resume)")
        elif cfg.auto_resume:  # rank 0 chooses, every rank loads the same one
            path, notes = self.ckpt.find_resume() if self.info.is_main else (None, [])
            for n in notes:
                self.log.info(n)
            path = dist.broadcast_object(path)
        if path is None:
            return
        state, self._rank_state = CheckpointManager.load(path, self.info.rank, map_location=self.device)
        self._check_label_space(path, state)
        diff = config_diff(state.get("config", {}), self.cfg.to_dict())
        if diff and not cfg.force_resume:
            raise CheckpointError(
                f"{path}: the config changed since this checkpoint was written; "
                f"refusing to resume (pass --force-resume to accept): " + "; ".join(diff)
            )
        if diff:
            self.log.info("checkpoint: config changed (accepted by --force-resume): " + "; ".join(diff))
        self._load_weights(path, state)
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(
                f"{path}: the optimizer state does not fit this run's optimizer "
                f"({cfg.optimizer}, no_decay_norm_bias={cfg.no_decay_norm_bias}): "
                f"{str(e).splitlines()[0]}"
            ) from None
        if diff:  # keep the new hyperparameters (lr, momentum, ...) and schedule, moved to the saved step
            for g, f in zip(self.optimizer.param_groups, fresh):
                g.update(f)
            self._fast_forward_scheduler(state["progress"]["global_step"])
        else:
            try:
                self.scheduler.load_state_dict(state["scheduler"])
            except (KeyError, ValueError, TypeError):  # written by another schedule implementation
                self.log.info(
                    "checkpoint: the LR schedule's saved state is of another format; recomputed it for the saved step"
                )
                self._fast_forward_scheduler(state["progress"]["global_step"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema") is not None:
            try:
                self.ema.load_state_dict(state["ema"])
            except RuntimeError:
                raise CheckpointError(
                    f"{path}: the EMA weights do not fit model {cfg.model}: "
                    f"{state_dict_mismatch(self.ema, state['ema'])}"
                ) from None
        p = state["progress"]
        self.epoch, self.step_in_epoch, self.global_step = p["epoch"], p["step_in_epoch"], p["global_step"]
        self.best = state.get("best_metric")
        self.history = list(state.get("history", []))
        self._tracking_ids = dict(state.get("tracking") or {})
        self._tracking_uri = state.get("tracking_uri")
        self.resumed_from = Path(path)
        saved_ws = state.get("world_size", self.info.world_size)
        if self.info.world_size != saved_ws:
            self._rank_state = None  # other rank layout: fresh per-rank streams and epoch statistics
            position = (
                f"the position in epoch {self.epoch + 1} is kept (its first {self.step_in_epoch} steps' "
                f"samples are skipped, so the rest of the epoch is the same data, up to wrap-around "
                f"padding) but its train statistics count only the steps from here; "
                if self.step_in_epoch
                else ""
            )
            self.log.info(
                f"checkpoint: world size changed (checkpoint {saved_ws} rank(s) -> now "
                f"{self.info.world_size}): {position}per-rank random streams (MixUp/CutMix, RNG) restart "
                f"fresh, so the run is not bit-identical to one without the change"
            )
        if p["step_in_epoch"] and self._rank_state is not None:
            self._resumed_epoch_stats = self._rank_state.get("epoch_stats")
        if self.epoch >= cfg.epochs:
            self.log.info(
                f"checkpoint: all {cfg.epochs} epoch(s) of this config are done (global step "
                f"{self.global_step}); nothing left to train"
            )
        elif self.step_in_epoch >= self.steps_per_epoch:
            self.log.info(
                f"checkpoint: epoch {self.epoch + 1} of {cfg.epochs} is trained (global step "
                f"{self.global_step}); evaluating it"
            )
        else:
            self.log.info(
                f"checkpoint: continuing in epoch {self.epoch + 1} of {cfg.epochs} at step "
                f"{self.step_in_epoch + 1} of {self.steps_per_epoch} (after global step {self.global_step})"
            )

    def _check_label_space(self, path: Path, state: dict) -> None:
        """Refuse a checkpoint whose label space differs from the data's (``force_resume`` does not override
        it: the model's outputs would silently mean other labels); a notice for checkpoints without one."""
        if "label_space" not in state:
            self.log.info(
                f"checkpoint: {path} records no label space (written by an older trainer); "
                f"cannot check that its classes match the data's"
            )
            return
        saved = state["label_space"] or {}
        if not saved or not self.label_space:
            return
        diff = label_space_diff(saved, self.label_space)
        if diff:
            raise CheckpointError(
                f"{path}: the data's labels differ from the checkpoint's: "
                + "; ".join(diff)
                + ". Refusing to resume (--force-resume does not override this); train into "
                "another checkpoint_dir, or restore the data's class folders"
            )

    def _load_weights(self, path: Path, state: dict) -> None:
        """Load the model weights; CheckpointError naming the missing/unexpected/reshaped keys otherwise."""
        saved = state.get("model")
        what = f"{path}: the checkpoint's weights do not fit model {self.cfg.model}"
        saved_model = state.get("config", {}).get("model")
        if saved_model and saved_model != self.cfg.model:
            what += f" (it was written for {saved_model})"
        if not isinstance(saved, dict):
            raise CheckpointError(f"{what}: it holds no model state")
        mismatch = state_dict_mismatch(self.model, saved)
        if mismatch:
            raise CheckpointError(f"{what}: {mismatch}")
        try:
            self.model.load_state_dict(saved)
        except RuntimeError as e:
            raise CheckpointError(f"{what}: {str(e).splitlines()[0]}") from None

    def _fast_forward_scheduler(self, steps: int) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            for _ in range(steps):
                self.scheduler.step()
