"""Hungarian matching between DINO's predictions and the ground-truth boxes of each image.

DETR (Carion et al. 2020, arXiv:2005.12872, Sec. 3.1) trains with a one-to-one assignment of predictions to targets
found by the Hungarian algorithm on a pairwise cost; Deformable DETR (Zhu et al. 2020, arXiv:2010.04159) and DINO
(Zhang et al. 2022, arXiv:2203.03605) replace DETR's softmax class cost by a focal-loss-shaped sigmoid cost. The cost
of assigning prediction ``q`` to target ``j`` (label ``c_j``, box ``b_j``) is, as in upstream DINO
(``models/dino/matcher.py``, ``HungarianMatcher``)::

    p       = sigmoid(logit[q, c_j])
    pos     = alpha * (1 - p) ** gamma * -log(p + 1e-8)         # focal loss if q were labelled c_j
    neg     = (1 - alpha) * p ** gamma * -log(1 - p + 1e-8)     # focal loss if q were background for c_j
    C[q, j] = cost_class * (pos - neg)
            + cost_bbox  * || box[q] - b_j ||_1                  # L1 on normalised (cx, cy, w, h)
            + cost_giou  * -GIoU(xyxy(box[q]), xyxy(b_j))        # Rezatofighi et al. 2019, arXiv:1902.09630

DINO-4scale (upstream ``config/DINO/DINO_4scale.py``) uses ``cost_class=2.0, cost_bbox=5.0, cost_giou=2.0,
focal_alpha=0.25`` and ``gamma=2``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn
from torchvision.ops import box_convert, generalized_box_iou

from trainer.models.dino.utils import has_values

__all__ = ["HungarianMatcher", "MatchIndices"]

#: One image's assignment: (prediction indices into Q, target indices into N), both int64 on the CPU, equal length.
MatchIndices = tuple[Tensor, Tensor]


class HungarianMatcher(nn.Module):
    """Optimal one-to-one assignment of queries to targets, per image (DETR's bipartite matching with DINO's costs).

    Args:
        cost_class: weight of the focal-style classification cost (DINO-4scale: 2.0).
        cost_bbox: weight of the L1 cost between normalised cxcywh boxes (DINO-4scale: 5.0).
        cost_giou: weight of the negative generalised-IoU cost on xyxy boxes (DINO-4scale: 2.0).
        focal_alpha: focal-loss alpha of the class cost (DINO-4scale: 0.25).
        focal_gamma: focal-loss gamma of the class cost (upstream hard-codes 2.0).

    The forward pass runs without gradients, in float32 (even under autocast); the cost blocks of all images are
    moved to the CPU in one transfer, and each image is solved with :func:`scipy.optimize.linear_sum_assignment`.
    """

    def __init__(
        self,
        cost_class: float = 1.0,
        cost_bbox: float = 1.0,
        cost_giou: float = 1.0,
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
    ) -> None:
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher: cost_class, cost_bbox and cost_giou cannot all be 0")
        self.cost_class = float(cost_class)
        self.cost_bbox = float(cost_bbox)
        self.cost_giou = float(cost_giou)
        self.focal_alpha = float(focal_alpha)
        self.focal_gamma = float(focal_gamma)

    def extra_repr(self) -> str:
        return (
            f"cost_class={self.cost_class}, cost_bbox={self.cost_bbox}, cost_giou={self.cost_giou}, "
            f"focal_alpha={self.focal_alpha}, focal_gamma={self.focal_gamma}"
        )

    def cost_matrix(self, logits: Tensor, boxes: Tensor, tgt_labels: Tensor, tgt_boxes: Tensor) -> Tensor:
        """Matching cost of one image.

        Args:
            logits: (Q, C) raw class logits (sigmoid, no background class).
            boxes: (Q, 4) predicted boxes, normalised (cx, cy, w, h) in [0, 1].
            tgt_labels: (N,) int64 class indices in [0, C).
            tgt_boxes: (N, 4) target boxes, normalised (cx, cy, w, h).

        Returns:
            (Q, N) float32 cost (see the module docstring for the formula); lower is a better match.
        """
        logits = logits.float()
        boxes = boxes.float()
        tgt_boxes = tgt_boxes.to(device=boxes.device, dtype=torch.float32)
        tgt_labels = tgt_labels.to(device=logits.device, dtype=torch.int64)

        # Focal-shaped class cost, evaluated only at the target classes: (Q, N).
        prob = logits.sigmoid()[:, tgt_labels]
        alpha, gamma = self.focal_alpha, self.focal_gamma
        neg = (1.0 - alpha) * prob.pow(gamma) * -(1.0 - prob + 1e-8).log()
        pos = alpha * (1.0 - prob).pow(gamma) * -(prob + 1e-8).log()
        cost_class = pos - neg

        cost_bbox = torch.cdist(boxes, tgt_boxes, p=1)
        cost_giou = -generalized_box_iou(
            box_convert(boxes, "cxcywh", "xyxy"),
            box_convert(tgt_boxes, "cxcywh", "xyxy"),
        )
        return self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou

    @torch.no_grad()
    def forward(self, outputs: Mapping[str, Tensor], targets: Sequence[Mapping[str, Tensor]]) -> list[MatchIndices]:
        """Match each image's queries to its targets.

        Args:
            outputs: ``{"pred_logits": (B, Q, C) raw logits, "pred_boxes": (B, Q, 4) normalised cxcywh}``; other
                keys are ignored.
            targets: B dicts with ``"labels"`` (N_i,) int64 and ``"boxes"`` (N_i, 4) normalised cxcywh.

        Returns:
            B tuples ``(pred_idx, tgt_idx)`` of int64 CPU tensors of length N_i (empty for an image without targets):
            query ``pred_idx[k]`` is assigned to target ``tgt_idx[k]``; ``pred_idx`` is sorted ascending.

        Raises:
            ValueError: batch sizes disagree, an image has more targets than there are queries (Q >= N_i is assumed,
                as in DETR: every target must receive its own query), or the cost holds NaN/inf (e.g. a diverged model).
        """
        logits = outputs["pred_logits"]
        boxes = outputs["pred_boxes"]
        bs, num_queries = logits.shape[:2]
        if len(targets) != bs:
            raise ValueError(f"HungarianMatcher: {len(targets)} targets for a batch of {bs} predictions")
        sizes = [int(t["boxes"].shape[0]) for t in targets]
        for i, n in enumerate(sizes):
            if n > num_queries:
                raise ValueError(
                    f"HungarianMatcher: image {i} has {n} targets but the model has only {num_queries} queries; "
                    "one-to-one matching needs num_queries >= targets per image (raise num_queries or cap targets)"
                )

        empty = torch.empty(0, dtype=torch.int64)
        if sum(sizes) == 0:
            return [(empty, empty.clone()) for _ in range(bs)]

        # Per-image cost blocks (Q x N_i, not Q x sum(N) as one batched matrix would), one device->host copy.
        with torch.autocast(device_type=logits.device.type, enabled=False):
            blocks = [
                self.cost_matrix(logits[i], boxes[i], t["labels"], t["boxes"]).flatten()
                for i, (t, n) in enumerate(zip(targets, sizes))
                if n > 0
            ]
            flat = torch.cat(blocks).cpu()
        if not has_values(flat):
            # Shape-only costs (plan's memory prediction): queries 0..n-1 to targets 0..n-1, the same number
            # of matches, so the same loss-term sizes, as a real assignment.
            return [(torch.arange(n), torch.arange(n)) for n in sizes]
        if not torch.isfinite(flat).all():
            raise ValueError("HungarianMatcher: the matching cost contains NaN or inf (non-finite predictions?)")

        result: list[MatchIndices] = []
        offset = 0
        for n in sizes:
            if n == 0:
                result.append((empty.clone(), empty.clone()))
                continue
            cost = flat[offset : offset + num_queries * n].view(num_queries, n)
            offset += num_queries * n
            rows, cols = linear_sum_assignment(cost.numpy())
            result.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
        return result
