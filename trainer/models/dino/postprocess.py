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
from torchvision.ops import box_convert

__all__ = ["PostProcess"]


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
        bs, num_queries, num_classes = logits.shape
        if not isinstance(orig_sizes, Tensor) and len(orig_sizes) and isinstance(orig_sizes[0], Tensor):
            orig_sizes = torch.stack([torch.as_tensor(s).reshape(2) for s in orig_sizes])
        sizes = torch.as_tensor(orig_sizes, dtype=torch.float32, device=logits.device).reshape(-1, 2)
        if sizes.shape[0] != bs:
            raise ValueError(f"PostProcess: {sizes.shape[0]} orig_sizes for a batch of {bs}")

        k = min(self.num_select, num_queries * num_classes)
        scores, flat_idx = logits.sigmoid().reshape(bs, -1).topk(k, dim=1)  # sorted descending
        query = torch.div(flat_idx, num_classes, rounding_mode="floor")
        labels = flat_idx % num_classes

        xyxy = box_convert(boxes, "cxcywh", "xyxy")
        xyxy = torch.gather(xyxy, 1, query.unsqueeze(-1).expand(-1, -1, 4))
        h, w = sizes.unbind(1)
        xyxy = xyxy * torch.stack([w, h, w, h], dim=1)[:, None, :]

        return [{"scores": s, "labels": l.to(torch.int64), "boxes": b} for s, l, b in zip(scores, labels, xyxy)]
