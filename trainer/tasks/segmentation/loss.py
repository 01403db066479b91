"""Segmentation training loss: pixel cross-entropy plus multiclass soft Dice, both skipping ignored pixels."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SegmentationLoss(nn.Module):
    """``loss = ce_weight * loss_ce + dice_weight * loss_dice`` over the pixels whose target is not ignored.

    * ``loss_ce``: ``torch.nn.functional.cross_entropy`` summed over the non-ignored pixels and divided by their
      count (the ``reduction="mean"`` value with ``ignore_index``), 0 when every pixel is ignored (not NaN).
    * ``loss_dice``: ``segmentation_models_pytorch.losses.DiceLoss("multiclass", from_logits=True, ignore_index)``
      (Milletari et al. 2016, arXiv 1606.04797; smp docs https://smp.readthedocs.io/en/latest/losses.html): per
      class ``1 - 2|P∩T| / (|P| + |T|)`` on the softmax probabilities over the whole batch, ignored pixels removed
      from both P and T; a class without target pixels in the batch contributes 0 and still counts in the mean
      over the C classes; 0 when every pixel is ignored.

    Both terms are computed in float32 with autocast off, whatever the logits' dtype.

    Args:
        num_classes: C, the logits' channel count.
        ignore_index: target value of pixels to skip (void, padding).
        ce_weight, dice_weight: finite weights >= 0, not both 0.

    Raises:
        ValueError: a weight negative or not finite, both weights 0, or ``num_classes`` < 1.
    """

    def __init__(self, num_classes: int, ignore_index: int = 255, ce_weight: float = 1.0, dice_weight: float = 1.0):
        super().__init__()
        from segmentation_models_pytorch.losses import DiceLoss

        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        for name, w in (("ce_weight", ce_weight), ("dice_weight", dice_weight)):
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {w}")
        if ce_weight == 0 and dice_weight == 0:
            raise ValueError("ce_weight and dice_weight are both 0: the loss would be constant")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.ce_weight = float(ce_weight)
        self.dice_weight = float(dice_weight)
        self.dice = DiceLoss("multiclass", from_logits=True, ignore_index=ignore_index)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss terms of one batch.

        Args:
            logits: float ``(B, C, H, W)`` (any float dtype; cast to float32).
            target: int64 ``(B, H, W)``, values in ``[0, C)`` or ``ignore_index`` (others fail inside
                ``cross_entropy`` / ``one_hot``).

        Returns:
            ``{"loss", "loss_ce", "loss_dice"}``: float32 scalars, each with its autograd graph.

        Raises:
            ValueError: logits not ``(B, C, H, W)`` with C = ``num_classes``, or target shape not ``(B, H, W)``.
        """
        if logits.dim() != 4 or logits.shape[1] != self.num_classes:
            raise ValueError(f"logits must be (B, {self.num_classes}, H, W), got {tuple(logits.shape)}")
        if target.shape != (logits.shape[0], *logits.shape[2:]):
            raise ValueError(f"target must be {(logits.shape[0], *logits.shape[2:])}, got {tuple(target.shape)}")
        with torch.autocast(device_type=logits.device.type, enabled=False):
            logits = logits.float()
            target = target.long()
            valid = (target != self.ignore_index).sum()
            ce_sum = F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="sum")
            loss_ce = ce_sum / valid.clamp_min(1).to(ce_sum.dtype)
            loss_dice = self.dice(logits, target)
            loss = self.ce_weight * loss_ce + self.dice_weight * loss_dice
        return {"loss": loss, "loss_ce": loss_ce, "loss_dice": loss_dice}
