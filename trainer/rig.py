"""One training step, built from the loop's own builders, for measuring and predicting (probe, memory).

:class:`StepRig` holds what :class:`trainer.loop.Trainer` builds for the device side of training — the task's
model (channels_last as configured), ``build_optimizer``, ``torch.amp.GradScaler``, ``build_ema`` and
``resolve_precision`` — and :meth:`StepRig.step` runs the inner loop of ``Trainer.train_epoch`` for one
optimizer step: ``accumulate_grad_batches`` micro-batches of autocast forward + ``task.loss`` + scaled
backward, then unscale + clip, ``scaler.step``, ``scaler.update``, ``zero_grad(set_to_none=True)``, EMA update.
Not included: DDP (single process; :mod:`trainer.memory` adds DDP's gradient buckets by formula), the LR
schedule (no memory, no time), statistics and logging (a few scalars).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from trainer.components.ema import build_ema
from trainer.components.optim import build_optimizer
from trainer.components.precision import Precision, resolve_precision, set_tf32
from trainer.config import TrainConfig
from trainer.distributed import DistInfo
from trainer.tasks import TASKS, Task


@dataclass
class StepRig:
    """Model, optimizer, scaler, EMA and precision of one rank, as the trainer builds them."""

    cfg: TrainConfig
    task: Task
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: Optional[nn.Module]
    precision: Precision
    device: torch.device
    num_outputs: int

    def synthetic_batch(self, batch: int, image_size: int, mixed_targets: Optional[bool] = None):
        """Device inputs of one micro-batch as ``task.train_inputs`` returns them, without a loader.

        Returns ``(x, y)``: ``x`` float32 (batch, 3, image_size, image_size) normalised-range values
        (channels_last when configured); ``y`` int64 (batch,) class indices, or float32 (batch, num_outputs)
        soft labels when MixUp/CutMix is on (``mixed_targets`` None = decide from the config), as after
        torchvision's v2.MixUp/CutMix.
        """
        if mixed_targets is None:
            mixed_targets = self.cfg.mixup_alpha > 0 or (self.cfg.cutmix_prob > 0 and self.cfg.cutmix_alpha > 0)
        u8 = torch.randint(0, 256, (batch, 3, image_size, image_size), dtype=torch.uint8, device=self.device)
        if self.cfg.channels_last:
            u8 = u8.contiguous(memory_format=torch.channels_last)
        x = u8.float().sub_(127.5).div_(64.0)
        if mixed_targets:
            y = torch.softmax(torch.randn(batch, self.num_outputs, device=self.device), dim=1)
        else:
            y = torch.randint(0, self.num_outputs, (batch,), device=self.device)
        return x, y

    def step(self, x: torch.Tensor, y: torch.Tensor, *, use_scaler_step: bool = True) -> torch.Tensor:
        """One optimizer step over ``accumulate_grad_batches`` micro-batches of ``(x, y)``; returns the last
        micro-batch's loss (detached). ``use_scaler_step=False`` calls ``optimizer.step()`` directly (needed
        under FakeTensorMode, where GradScaler's ``found_inf.item()`` has no value; the scaler's own memory is
        a few scalars)."""
        cfg, accum = self.cfg, self.cfg.accumulate_grad_batches
        loss = None
        for _ in range(accum):
            with self.precision.autocast(self.device):
                out = self.model(x)
                loss = self.task.loss(out, y)
            self.scaler.scale(loss / accum).backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        if use_scaler_step:
            if cfg.gradient_clip > 0:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(params, cfg.gradient_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if cfg.gradient_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.gradient_clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return loss.detach()

    @torch.no_grad()
    def eval_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Evaluation forward (no_grad, autocast) as ``Trainer.evaluate`` runs it; returns the outputs."""
        self.model.eval()
        try:
            with self.precision.autocast(self.device):
                return self.model(x)
        finally:
            self.model.train()


def build_rig(cfg: TrainConfig, device: torch.device, num_outputs: int, *, precision: Optional[Precision] = None,
              model: Optional[nn.Module] = None) -> StepRig:
    """Build a :class:`StepRig` on ``device`` with the loop's builders (see module doc).

    Args:
        cfg: validated config (model, optimizer, precision, EMA, channels_last, clip, accumulation are read).
        device: where the step runs (``cpu``, ``cuda:N``; a fake device under FakeTensorMode).
        num_outputs: classes of the model head.
        precision: the resolved precision to use (the memory predictor passes the target GPU's); defaults to
            ``resolve_precision(cfg.precision, device)`` as the loop does.
        model: an already materialised model to use instead of ``task.build_model`` (the memory predictor
            builds it on the meta device first).
    Raises:
        ConfigError: unknown model name (from the task).
    """
    task = TASKS[cfg.task](cfg, DistInfo(0, 0, 1, device))
    set_tf32(cfg.tf32)  # as Trainer.__init__: the step measured is the step trained
    precision = precision or resolve_precision(cfg.precision, device)
    if model is None:
        model = task.build_model(num_outputs).to(device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
    model.train()
    ema = build_ema(model, cfg.ema_decay) if cfg.use_ema else None
    optimizer = build_optimizer(cfg, model)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_scaler)
    return StepRig(cfg, task, model, optimizer, scaler, ema, precision, device, num_outputs)
