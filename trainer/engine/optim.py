"""Optimizer, LR schedule (per optimizer step) and the linear-scaling sanity check."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR, StepLR

from trainer.config import TrainConfig

#: Goyal et al. 2017, "Accurate, Large Minibatch SGD": lr = 0.1 x global_batch / 256 for ResNet-50 + SGD.
REFERENCE_LR, REFERENCE_BATCH = 0.1, 256


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay_norm_bias: bool,
    lr: float = 0.0,
    lr_scales: Optional[dict[str, float]] = None,
) -> list[dict]:
    """Weights with decay and (optionally) biases + 1-D norm parameters without it; each split again by
    ``lr_scales`` (parameter-name prefix -> multiplier of ``lr``, e.g. ``{"backbone.": 0.1}`` for DINO's backbone
    lr 1e-5 at lr 1e-4; the first matching prefix wins). Without ``lr_scales`` the groups carry no ``lr`` (the
    optimizer's default applies) and are exactly the one or two groups of a plain run; with them, each group
    has its ``lr``, empty groups are left out, and the groups at ``lr`` itself come first (``param_groups[0]["lr"]``
    is the lr the loop logs).
    """
    if not lr_scales:
        if not no_decay_norm_bias:
            return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
        decay, no_decay = [], []
        for p in model.parameters():
            if p.requires_grad:
                (no_decay if p.ndim <= 1 else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    buckets: dict[tuple[float, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            scale = next((s for prefix, s in lr_scales.items() if name.startswith(prefix)), 1.0)
            buckets.setdefault((scale, no_decay_norm_bias and p.ndim <= 1), []).append(p)
    return [
        {"params": params, "weight_decay": 0.0 if no_decay else weight_decay, "lr": lr * scale}
        for (scale, no_decay), params in sorted(buckets.items(), key=lambda kv: (kv[0][0] != 1.0, kv[0]))
    ]


def fused_supported(params) -> bool:
    """True when torch has a fused optimizer kernel for every parameter (floating point, on a device in
    ``torch.optim.optimizer._get_fused_kernels_supported_devices()``: CUDA and CPU among them in torch 2.14)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    params = list(params)
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def build_optimizer(
    cfg: TrainConfig, model: nn.Module, lr_scales: Optional[dict[str, float]] = None
) -> torch.optim.Optimizer:
    """SGD (momentum, nesterov off, as seed 003) or AdamW (betas=(momentum, 0.999)) over :func:`param_groups`
    (``lr_scales``: the task's per-module learning-rate multipliers, e.g. a backbone at 0.1 x lr).

    The fused implementation (``fused=True``: a few kernels per parameter group instead of a dozen per parameter,
    and no per-parameter ``step.item()`` on the host) where torch has it for the parameters' device
    (:func:`fused_supported`): both optimizers on CUDA; on the CPU AdamW only (its unfused CPU loop reads every
    step counter with ``.item()``); SGD keeps torch's default on the CPU, as before, so the CPU figures and
    tests measured with it stay valid. Fused and unfused optimizers share their ``state_dict`` format, so
    checkpoints move between them.
    """
    groups = param_groups(model, cfg.weight_decay, cfg.no_decay_norm_bias, cfg.lr, lr_scales)
    params = [p for g in groups for p in g["params"]]
    fused = fused_supported(params) or None
    if cfg.optimizer == "sgd":
        fused = fused if all(p.device.type == "cuda" for p in params) else None
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999), fused=fused)


#: OneCycle's start and end as fractions of ``lr`` (torch's OneCycleLR defaults: div_factor=25,
#: final_div_factor=1e4).
ONECYCLE_START, ONECYCLE_END = 1.0 / 25.0, 1.0 / 25.0 / 1e4


def _cos_between(start: float, end: float, pct: float) -> float:
    """Cosine interpolation from ``start`` (pct=0) to ``end`` (pct=1)."""
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1.0)


def one_cycle_factor(step: int, warm: int, total: int) -> float:
    """The 1cycle policy (Smith 2018) as a multiple of ``lr`` at optimizer step ``step`` (0-based).

    Cosine warm-up from ``ONECYCLE_START`` to 1 over ``warm`` steps, then cosine annealing to
    ``ONECYCLE_END`` at step ``total``. Defined for every ``0 <= warm <= total`` (``warm=0``: start at
    ``lr``; ``warm=total``: warm-up only), always in ``[ONECYCLE_END, 1]``. torch's OneCycleLR divides by
    zero when the warm-up rounds to 0 or 1 step, hence this closed form.
    """
    if step < warm:
        return _cos_between(ONECYCLE_START, 1.0, step / warm)
    if total <= warm:
        return 1.0
    return _cos_between(1.0, ONECYCLE_END, min((step - warm) / (total - warm), 1.0))


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    """Per-optimizer-step LR schedule over ``cfg.epochs * steps_per_epoch`` steps (stepped once after every
    optimizer step). Warm-up lasts ``round(warmup_epochs * steps_per_epoch)`` steps, at most all of them.

    * ``onecycle``: :func:`one_cycle_factor` (cosine from lr/25 up to lr, then down to lr/25e4).
    * ``cosine``: linear warmup from lr/100 for ``warmup_epochs``, then cosine to 0.
    * ``step``: linear warmup, then x ``step_gamma`` every ``step_size_epochs``.

    Every total/warm-up combination works (including a single step), and the LR never exceeds ``lr``.
    """
    total = cfg.epochs * steps_per_epoch
    warm = min(int(round(cfg.warmup_epochs * steps_per_epoch)), total)
    if cfg.scheduler == "onecycle":
        return LambdaLR(optimizer, lambda step: one_cycle_factor(step, warm, total))
    if cfg.scheduler == "cosine":
        main = CosineAnnealingLR(optimizer, T_max=max(total - warm, 1), eta_min=0.0)
    else:
        main = StepLR(optimizer, step_size=cfg.step_size_epochs * steps_per_epoch, gamma=cfg.step_gamma)
    if warm == 0:
        return main
    warmup = LinearLR(optimizer, start_factor=0.01, end_factor=1.0, total_iters=warm)
    return SequentialLR(optimizer, [warmup, main], milestones=[warm])


def linear_scaling_warning(cfg: TrainConfig, tolerance: float = 1.05) -> str | None:
    """Message when an SGD ``lr`` exceeds linear scaling from 0.1 per 256 images (seed 003's divergence
    story: loss rising, accuracy falling to 0.1 %, NaN), else None."""
    if cfg.optimizer != "sgd":
        return None
    linear = REFERENCE_LR * cfg.batch_size / REFERENCE_BATCH
    if cfg.lr > linear * tolerance:
        return (
            f"lr {cfg.lr:g} is {cfg.lr / linear:.2f}x the linear-scaling rule for global batch "
            f"{cfg.batch_size} (0.1 x {cfg.batch_size}/256 = {linear:g}; Goyal et al. 2017). Seed 003 "
            f"diverged to NaN this way; lower lr, lengthen warmup_epochs or set gradient_clip."
        )
    return None
