"""mIoU, pixel accuracy and mean accuracy of a segmentation run from a confusion matrix summed across ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trainer.engine.evaluation import SumEvaluator, metric_key

#: Metrics over all classes (besides the per-class ``iou_<name>``); values in % (x 100).
SUMMARY = ("miou", "pixel_acc", "mean_acc")


def confusion_from_sums(sums: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The ``(C, C)`` float64 confusion matrix (rows: target class, columns: predicted class; pixel counts) from
    the flattened ``(C * C,)`` vector :class:`ConfusionMatrixEvaluator` sums.

    Raises:
        ValueError: ``sums`` does not hold ``num_classes ** 2`` values.
    """
    if sums.numel() != num_classes * num_classes:
        raise ValueError(f"sums has {sums.numel()} values, expected num_classes**2 = {num_classes * num_classes}")
    return sums.reshape(num_classes, num_classes).to(torch.float64)


class ConfusionMatrixEvaluator(SumEvaluator):
    """Semantic segmentation metrics from a pixel confusion matrix, in % (x 100), all "max".

    With ``cm[t, p]`` the number of non-ignored pixels of target class t predicted as p, ``TP_c = cm[c, c]``,
    ``T_c`` = row sum (target pixels of c), ``P_c`` = column sum (predicted pixels of c) and
    ``U_c = T_c + P_c - TP_c`` (Long et al. 2015, "Fully Convolutional Networks", arXiv 1411.4038, Sec. 5;
    IoU as in PASCAL VOC, Everingham et al. 2010):

    * ``iou_<metric_key(name)>``: ``TP_c / U_c``; 0.0 when ``U_c`` = 0 (class in neither target nor prediction).
    * ``miou``: mean of ``TP_c / U_c`` over the classes with ``U_c`` > 0 only (classes absent from both target and
      prediction are left out of the mean, not counted as 0 nor 1); 0.0 when no pixel was counted.
    * ``pixel_acc``: ``sum_c TP_c / sum_c T_c``; 0.0 when no pixel was counted.
    * ``mean_acc``: mean of the per-class recall ``TP_c / T_c`` over the classes with ``T_c`` > 0.

    Args:
        num_classes: C.
        class_names: C names (for the per-class keys, via :func:`metric_key`).
        device: where the statistics are accumulated.
        ignore_index: target value of pixels to skip (void, padding); their predictions are not counted.
        sources: names of the datasets of a multi-dataset run (``batch["source"]`` int64 (B,) says each image's);
            with two or more, one matrix per source is kept (size S * C * C) and ``miou_<source>`` and
            ``pixel_acc_<source>`` are added; the other metrics are over all sources together.

    Raises:
        ValueError: ``num_classes`` < 1, ``len(class_names) != num_classes``, or two names with one metric key.
    """

    def __init__(
        self,
        num_classes: int,
        class_names: list[str],
        device: torch.device,
        ignore_index: int = 255,
        sources: Sequence[str] = (),
    ):
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for num_classes={num_classes}")
        keys = [f"iou_{metric_key(n)}" for n in class_names]
        if len(set(keys)) != len(keys) or set(keys) & set(SUMMARY):
            raise ValueError(f"class names {list(class_names)} give clashing metric keys {keys}")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.keys = keys
        self.sources = [metric_key(s) for s in sources] if len(sources) > 1 else []
        per_source = [f"{m}_{s}" for s in self.sources for m in ("miou", "pixel_acc")]
        self.directions = {k: "max" for k in (*SUMMARY, *keys, *per_source)}
        self.size = max(1, len(self.sources)) * num_classes * num_classes
        super().__init__(device)

    def statistics(self, outputs: Any, batch: dict) -> torch.Tensor:
        """Flattened confusion matrix of one batch: float64 ``(C * C,)`` on the masks' device.

        Args:
            outputs: float logits ``(B, C, H, W)`` (argmax over dim 1) or integer predicted labels ``(B, H, W)``
                in ``[0, C)``.
            batch: ``batch["mask"]``: int64 ``(B, H, W)``, values in ``[0, C)`` or ``ignore_index``.

        Raises:
            ValueError: outputs of another shape or dtype, or a label outside ``[0, C)`` that is not ignored.
        """
        target = batch["mask"]
        if outputs.dim() == 4 and outputs.is_floating_point():
            if outputs.shape[1] != self.num_classes:
                raise ValueError(f"logits must have {self.num_classes} channels, got {tuple(outputs.shape)}")
            pred = outputs.argmax(dim=1)
        elif outputs.dim() == 3 and not outputs.is_floating_point():
            pred = outputs
        else:
            raise ValueError(f"outputs must be float logits (B, C, H, W) or int labels (B, H, W), got {outputs.shape}")
        if pred.shape != target.shape:
            raise ValueError(f"predictions {tuple(pred.shape)} and masks {tuple(target.shape)} differ in shape")
        keep = target != self.ignore_index
        t = target[keep].long()
        p = pred.to(target.device)[keep].long()
        c = self.num_classes
        bad = (t < 0) | (t >= c) | (p < 0) | (p >= c)
        if bool(bad.any()):
            raise ValueError(f"labels outside [0, {c}) that are not ignore_index={self.ignore_index}")
        flat = t * c + p
        if self.sources:
            src = batch["source"].to(target.device).view(-1, 1, 1).expand_as(target)[keep].long()
            flat = flat + src * (c * c)
        return torch.bincount(flat, minlength=self.size).to(torch.float64)

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """``miou``, ``pixel_acc``, ``mean_acc`` and ``iou_<name>`` (in %) over every source, plus ``miou_<source>``
        and ``pixel_acc_<source>`` per source in a multi-dataset run."""
        c2 = self.num_classes * self.num_classes
        per = sums.reshape(-1, c2)
        out = self._scores(per.sum(0))
        for name, part in zip(self.sources, per):
            scores = self._scores(part)
            out.update({f"miou_{name}": scores["miou"], f"pixel_acc_{name}": scores["pixel_acc"]})
        return out

    def _scores(self, sums: torch.Tensor) -> dict[str, float]:
        cm = confusion_from_sums(sums, self.num_classes).cpu()
        tp = cm.diagonal()
        in_target = cm.sum(dim=1)
        in_pred = cm.sum(dim=0)
        union = in_target + in_pred - tp
        iou = torch.where(union > 0, tp / union.clamp_min(1), torch.zeros_like(tp))
        present = union > 0
        out = {
            "miou": 100.0 * float(iou[present].mean()) if bool(present.any()) else 0.0,
            "pixel_acc": 100.0 * float(tp.sum() / in_target.sum()) if float(in_target.sum()) > 0 else 0.0,
            "mean_acc": 100.0 * float((tp / in_target.clamp_min(1))[in_target > 0].mean())
            if bool((in_target > 0).any())
            else 0.0,
        }
        out.update({k: 100.0 * float(v) for k, v in zip(self.keys, iou)})
        return out
