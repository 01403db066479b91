"""Exponential moving average of the weights, via ``torch.optim.swa_utils.AveragedModel``."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


class TrainableEMA(AveragedModel):
    """``AveragedModel`` (its ``state_dict``: ``module.*`` and ``n_averaged``) with an update that never waits for
    the GPU and leaves frozen parameters out.

    * ``AveragedModel.update_parameters`` reads its device counter ``n_averaged`` twice per call
      (``bool(n_averaged == 0)``, ``n_averaged > 0``: two host syncs per optimizer step on CUDA, torch 2.14) and
      averages integer buffers (BatchNorm's ``num_batches_tracked``) one tensor at a time. Here the count is
      mirrored in a Python int (read from the buffer once after construction or ``load_state_dict``), floating
      tensors are averaged with one ``torch._foreach_lerp_`` per (device, dtype) group (torch's
      ``get_ema_multi_avg_fn``) and integer buffers with three ``_foreach`` calls of torch's own formula
      (``ema * decay + model * (1 - decay)`` cast back): the same values, bit for bit
      (``tests/engine/test_ema.py`` compares with ``AveragedModel``).
    * Frozen parameters (``requires_grad=False``, e.g. seed 004's frozen per-frame ResNet-18) never change, so
      averaging them would only cost a pass over their bytes every step: they are left out. The EMA copy still
      holds the frozen weights (it is a full model that evaluation runs).
    """

    def __init__(self, model: nn.Module, decay: float):
        super().__init__(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
        self.decay = decay
        self._count: int | None = None  # mirror of n_averaged; None: read the buffer at the next update

    def _load_from_state_dict(self, *args, **kwargs):
        self._count = None
        super()._load_from_state_dict(*args, **kwargs)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """One EMA step from ``model``'s current weights and buffers (the first call copies them all)."""
        if self._count is None:
            self._count = int(self.n_averaged)  # one read after construction or load_state_dict
        ema = [*self.module.parameters(), *self.module.buffers()]
        src = [*model.parameters(), *model.buffers()]
        frozen = {id(p) for p in model.parameters() if not p.requires_grad}  # identity: fake tensors have no data
        pairs = [(e, s) for e, s in zip(ema, src) if id(s) not in frozen]  # no_grad: no detach needed
        if pairs:
            targets = [e for e, _ in pairs]
            sources = [s if s.device == e.device else s.to(e.device) for e, s in pairs]
            if self._count == 0:
                torch._foreach_copy_(targets, sources)
            else:
                groups = _group_tensors_by_device_and_dtype([targets, sources])
                for (_, dtype), ([t, s], _) in groups.items():
                    if dtype.is_floating_point or dtype.is_complex:
                        torch._foreach_lerp_(t, s, 1.0 - self.decay)
                    else:
                        mixed = torch._foreach_add(
                            torch._foreach_mul(t, self.decay), torch._foreach_mul(s, 1.0 - self.decay)
                        )
                        torch._foreach_copy_(t, mixed)
        self.n_averaged.add_(1)
        self._count += 1


def build_ema(model: nn.Module, decay: float) -> AveragedModel:
    """EMA copy of ``model`` (unwrapped, not DDP/compiled) updated with ``ema = decay*ema + (1-decay)*w``
    after every optimizer step; buffers (BatchNorm running stats) are averaged too (``use_buffers=True``); frozen
    parameters are not averaged (:class:`TrainableEMA`)."""
    return TrainableEMA(model, decay)
