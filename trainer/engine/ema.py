"""Exponential moving average of the weights, via ``torch.optim.swa_utils.AveragedModel``."""

from __future__ import annotations

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def build_ema(model: nn.Module, decay: float) -> AveragedModel:
    """EMA copy of ``model`` (unwrapped, not DDP/compiled) updated with ``ema = decay*ema + (1-decay)*w``
    after every optimizer step; buffers (BatchNorm running stats) are averaged too (``use_buffers=True``)."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
