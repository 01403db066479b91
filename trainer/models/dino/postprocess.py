"""DINO's inference post-processing: top-k (query, class) detections as absolute xyxy pixel boxes.

As upstream IDEA-Research/DINO ``models/dino/dino.py`` ``PostProcess`` (from Deformable DETR, arXiv:2010.04159): with
sigmoid class scores there is no background class, so the ``num_select`` best-scoring (query, class) pairs over all
``Q * C`` pairs are kept (a query may appear once per class). DINO-4scale evaluates COCO with ``num_select = 300``.
Upstream's optional NMS (off by default, ``nms_iou_threshold=-1``) is not implemented.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from trainer.models.dino.utils import cxcywh_to_xyxy

__all__ = ["PostProcess", "top_detections"]


def top_detections(logits: Tensor, boxes: Tensor, num_select: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``num_select`` best (query, class) pairs per image over all ``Q * C`` (capped at ``Q * C``).

    Args:
        logits: float (B, Q, C) raw class logits; boxes: float (B, Q, 4) normalised (cx, cy, w, h).

    Returns:
        (scores float (B, K) sigmoid, sorted descending; labels int64 (B, K) class index in [0, C); boxes float
        (B, K, 4) (x1, y1, x2, y2) still normalised to [0, 1] of the image). Plain tensor ops, so exporters trace
        it (``python -m trainer export`` ends DINO's graph with it).
    """
    b, q, c = logits.shape
    scores, flat = logits.sigmoid().reshape(b, q * c).topk(min(int(num_select), q * c), dim=1)
    query = torch.div(flat, c, rounding_mode="floor")
    xyxy = torch.gather(cxcywh_to_xyxy(boxes), 1, query.unsqueeze(-1).expand(-1, -1, 4))
    return scores, flat % c, xyxy


class PostProcess(nn.Module):
    """Convert DINO's raw outputs to per-image detections.

    Args:
        num_select: detections kept per image (DINO-4scale: 300); capped at ``Q * C``.

    ``forward(outputs, orig_sizes)``:

    - ``outputs["pred_logits"]``: (B, Q, C) raw logits; ``outputs["pred_boxes"]``: (B, Q, 4) normalised cxcywh.
    - ``orig_sizes``: (B, 2) tensor or B pairs, each image's original ``(H, W)`` in pixels (the size the boxes are
      reported in, e.g. before resizing for COCO evaluation).

    Returns B dicts, sorted by descending score::

        "scores": (K,) float32 sigmoid(logit) of the selected (query, class) pair
        "labels": (K,) int64 class index in [0, C) (the model's contiguous class index)
        "boxes":  (K, 4) float32 (x1, y1, x2, y2) in pixels of orig_size: (cx - w/2) * W, (cy - h/2) * H, ...

    Boxes are not clipped to the image (as upstream).
    """

    def __init__(self, num_select: int = 300) -> None:
        super().__init__()
        if num_select <= 0:
            raise ValueError(f"PostProcess: num_select must be positive, got {num_select}")
        self.num_select = int(num_select)

    def extra_repr(self) -> str:
        return f"num_select={self.num_select}"

    @torch.no_grad()
    def forward(self, outputs: Mapping[str, Tensor], orig_sizes: Tensor | Sequence) -> list[dict[str, Tensor]]:
        logits = outputs["pred_logits"].float()
        boxes = outputs["pred_boxes"].float()
        bs = logits.shape[0]
        if not isinstance(orig_sizes, Tensor) and len(orig_sizes) and isinstance(orig_sizes[0], Tensor):
            orig_sizes = torch.stack([torch.as_tensor(s).reshape(2) for s in orig_sizes])
        sizes = torch.as_tensor(orig_sizes, dtype=torch.float32, device=logits.device).reshape(-1, 2)
        if sizes.shape[0] != bs:
            raise ValueError(f"PostProcess: {sizes.shape[0]} orig_sizes for a batch of {bs}")

        scores, labels, xyxy = top_detections(logits, boxes, self.num_select)
        h, w = sizes.unbind(1)
        xyxy = xyxy * torch.stack([w, h, w, h], dim=1)[:, None, :]

        return [{"scores": s, "labels": l.to(torch.int64), "boxes": b} for s, l, b in zip(scores, labels, xyxy)]
