"""One training step: the only implementation of a micro-step and an optimizer step, used by the training loop
(:class:`trainer.engine.trainer.Trainer`), the probe and the memory prediction (:mod:`trainer.planning`) alike,
so the step measured is the step trained, by construction.

A **micro-step** runs the task's model step (the model sees the whole device batch and returns outputs plus loss
terms) under autocast and backpropagates ``loss / accumulate_grad_batches`` scaled by the GradScaler; DDP's
gradient all-reduce runs only when ``sync`` is true (``no_sync`` otherwise). An **optimizer step** unscales and
clips the global gradient norm (when ``gradient_clip > 0``), steps through the GradScaler, updates the scale,
zeroes the gradients (``set_to_none``) and updates the EMA. The LR schedule is the loop's (it needs the epoch
length).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from trainer.config import TrainConfig
from trainer.engine.ema import build_ema
from trainer.engine.optim import build_optimizer
from trainer.engine.precision import Precision, resolve_precision, set_cudnn_benchmark, set_tf32
from trainer.tasks.base import StepOutput, Task


def clip_grad_norm(params: list, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; returns the norm before clipping
    (0-d float32 tensor, on the gradients' device).

    ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with ``foreach`` when every gradient is on one device and
    dtype (the same values: per-tensor norms from ``torch._foreach_norm``, the norm of their stack, the factor
    ``min(1, max_norm / (norm + 1e-6))`` applied by ``torch._foreach_mul_``), without its per-tensor
    ``norm.to(device)`` calls (one host-side operator call per parameter per step). Other cases go to torch's.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if len({(g.device, g.dtype) for g in grads}) > 1 or any(g.is_sparse for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


@dataclass
class TrainStep:
    """Model, optimizer, GradScaler, EMA and precision of one rank, and the two halves of a training step.

    Attributes:
        model: the raw module (state_dict, EMA source, evaluation).
        train_model: what the forward runs through: ``model`` itself, or its DDP wrapper in a multi-process run.
        accumulate: micro-batches per optimizer step (``accumulate_grad_batches``).
        num_outputs: classes of the model head (for :meth:`example_batch`).
    """

    cfg: TrainConfig
    task: Task
    model: nn.Module
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: Optional[nn.Module]
    precision: Precision
    device: torch.device
    num_outputs: int = 1000

    @property
    def accumulate(self) -> int:
        return self.cfg.accumulate_grad_batches

    def micro_step(self, batch: dict, sync: bool = True) -> StepOutput:
        """Forward + scaled backward of one device batch. ``sync=False`` skips DDP's gradient all-reduce (every
        micro-batch but the last of an optimizer step). Returns the task's :class:`StepOutput` (loss with grad)."""
        ctx = nullcontext() if sync or self.train_model is self.model else self.train_model.no_sync()
        with ctx:
            with self.precision.autocast(self.device):
                out = self.task.model_step(self.train_model, batch)
            loss = out.loss if self.accumulate == 1 else out.loss / self.accumulate
            self.scaler.scale(loss).backward()
        return out

    def optimizer_step(self, use_scaler: bool = True) -> None:
        """Unscale + clip (``gradient_clip > 0``), step, update the scale, zero the gradients, update the EMA.

        ``use_scaler=False`` calls ``optimizer.step()`` directly: under FakeTensorMode (memory prediction)
        GradScaler's ``found_inf.item()`` has no value; the scaler's own memory is a few scalars.
        """
        clip = self.cfg.gradient_clip
        params = [p for p in self.model.parameters() if p.requires_grad] if clip > 0 else []
        if use_scaler:
            if clip > 0:
                self.scaler.unscale_(self.optimizer)
                clip_grad_norm(params, clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if clip > 0:
                clip_grad_norm(params, clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.model)

    def step(self, batch: dict, *, use_scaler: bool = True) -> torch.Tensor:
        """One optimizer step over ``accumulate_grad_batches`` micro-steps of the same device ``batch`` (for
        measuring: the probe, the memory prediction). Returns the last micro-batch's loss (detached)."""
        out = None
        for i in range(self.accumulate):
            out = self.micro_step(batch, sync=i == self.accumulate - 1)
        self.optimizer_step(use_scaler=use_scaler)
        return out.loss.detach()

    def example_batch(self, batch_size: int, image_size: Optional[int] = None, train: bool = True, **kw) -> dict:
        """The task's representative device batch for this model (:meth:`trainer.tasks.base.Task.example_batch`)."""
        return self.task.example_batch(
            batch_size, image_size=image_size, num_outputs=self.num_outputs, train=train, **kw
        )

    @torch.no_grad()
    def eval_forward(self, batch: dict, model: Optional[nn.Module] = None):
        """Evaluation forward of ``model`` (default the raw model) as the loop runs it: eval mode, no_grad,
        autocast, ``task.predict``. Restores the module's training flag. Returns the task's outputs."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        try:
            with self.precision.autocast(self.device):
                return self.task.predict(model, batch)
        finally:
            model.train(was_training)


def build_train_step(
    cfg: TrainConfig,
    task: Task,
    model: nn.Module,
    device: torch.device,
    *,
    precision: Optional[Precision] = None,
    wrap=None,
    num_outputs: int = 1000,
    compile_model: bool = True,
    place: bool = True,
) -> TrainStep:
    """Place ``model`` and build the optimizer, GradScaler and EMA around it, as every caller must.

    Args:
        cfg: validated config (optimizer, precision, EMA, channels_last, compile, clip, accumulation are read).
        task: the task whose model step runs.
        model: freshly built (CPU or meta-materialised) module; moved to ``device`` (channels_last as configured).
        device: where the step runs (``cpu``, ``cuda:N``; a fake device under FakeTensorMode).
        precision: resolved precision to use (the memory predictor passes the target GPU's); default
            ``resolve_precision(cfg.precision, device)``.
        wrap: optional ``f(model) -> module`` that wraps the (compiled) model for the forward, e.g. DDP.
        num_outputs: classes of the model head (recorded for :meth:`TrainStep.example_batch`).
        compile_model: False skips ``torch.compile`` even when configured (the memory prediction traces fake
            tensors).
        place: False keeps ``model`` where and as it is (already on ``device`` in the configured memory format:
            the memory predictor's fake-tensor model, which cannot be moved).
    Raises:
        ConfigError: unknown optimizer settings (from :func:`build_optimizer`).
    """
    set_tf32(cfg.tf32)
    set_cudnn_benchmark(device, task.static_input_shapes)
    precision = precision or resolve_precision(cfg.precision, device)
    if place:
        model = model.to(device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
    model.train()
    ema = build_ema(model, cfg.ema_decay) if cfg.use_ema else None
    optimizer = build_optimizer(cfg, model, task.lr_scales())
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_scaler)
    if cfg.compile and compile_model:
        task.compile_model(model)  # in place: a wrapper below wraps the compiled module, state_dict keys unchanged
    train_model = wrap(model) if wrap is not None else model
    return TrainStep(cfg, task, model, train_model, optimizer, scaler, ema, precision, device, num_outputs)


def build_single_rank_step(
    cfg: TrainConfig,
    device: torch.device,
    num_outputs: int,
    *,
    precision: Optional[Precision] = None,
    model: Optional[nn.Module] = None,
    compile_model: bool = True,
) -> TrainStep:
    """The training step of a one-process run on ``device`` without data: the task of ``cfg.task``
    (:func:`trainer.tasks.build_task`), its model with ``num_outputs`` classes (or ``model``, already
    materialised, e.g. by the memory predictor from the meta device) and :func:`build_train_step`.
    For the probe and the memory prediction. Raises ConfigError: unknown model name (from the task)."""
    from trainer.engine.distributed import DistInfo
    from trainer.tasks import build_task

    task = build_task(cfg, DistInfo(0, 0, 1, device))
    if model is None:
        model = task.build_model(num_outputs)
    return build_train_step(
        cfg, task, model, device, precision=precision, num_outputs=num_outputs, compile_model=compile_model
    )
