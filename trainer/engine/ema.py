"""Exponential moving average of the weights, via ``torch.optim.swa_utils.AveragedModel``."""

from __future__ import annotations

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class TrainableEMA(AveragedModel):
    """``AveragedModel`` that leaves frozen parameters (``requires_grad=False``, e.g. seed 004's frozen per-frame
    ResNet-18) out of the average: they never change, so averaging them would only cost a pass over their bytes
    every step. Models without frozen parameters are averaged exactly as by ``AveragedModel``. The EMA copy still
    holds the frozen weights (it is a full model that evaluation runs)."""

    def __init__(self, model: nn.Module, decay: float):
        ema_update = get_ema_multi_avg_fn(decay)
        self._frozen: set[int] = set()

        def update_trainable(ema_list, model_list, n_averaged) -> None:
            keep = [i for i, t in enumerate(model_list) if t.data_ptr() not in self._frozen]
            if len(keep) == len(model_list):
                ema_update(ema_list, model_list, n_averaged)
            elif keep:
                ema_update([ema_list[i] for i in keep], [model_list[i] for i in keep], n_averaged)

        super().__init__(model, multi_avg_fn=update_trainable, use_buffers=True)

    def update_parameters(self, model: nn.Module) -> None:
        """One EMA step from ``model``'s current weights (the first call copies them all)."""
        self._frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
        super().update_parameters(model)


def build_ema(model: nn.Module, decay: float) -> AveragedModel:
    """EMA copy of ``model`` (unwrapped, not DDP/compiled) updated with ``ema = decay*ema + (1-decay)*w``
    after every optimizer step; buffers (BatchNorm running stats) are averaged too (``use_buffers=True``); frozen
    parameters are not averaged (:class:`TrainableEMA`)."""
    return TrainableEMA(model, decay)
