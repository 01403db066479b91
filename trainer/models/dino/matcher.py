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

Two solvers, one cost (``solver``): ``scipy`` copies the cost blocks to the host once and solves each (set, image)
with :func:`scipy.optimize.linear_sum_assignment` (the reference); ``batched`` solves every (set, image) at once on
the cost's device with torch-linear-assignment (Triton on CUDA, its SciPy loop elsewhere), the cost padded to the
batch's largest per-image target count T (RF-DETR's padding; the padded targets cost 0 against every query, so
with Q >= T they take queries no real target needs and change neither the real targets' optimum nor its cost).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from trainer.models.dino.utils import box_giou, cxcywh_to_xyxy, has_values

__all__ = ["SOLVERS", "HungarianMatcher", "MatchIndices", "batched_solver_missing", "flat_pairs", "pad_targets"]

#: ``solver`` values of :class:`HungarianMatcher`.
SOLVERS = ("scipy", "batched")

#: One image's assignment: (prediction indices into Q, target indices into N), both int64 on the CPU, equal length.
MatchIndices = tuple[Tensor, Tensor]


def pad_targets(targets: Sequence[Mapping[str, Tensor]], device: torch.device) -> tuple[Tensor, Tensor]:
    """The batch's targets as two padded tensors: labels int64 (B, T) and boxes float32 (B, T, 4) normalised cxcywh,
    ``T = max N_i`` (at least 1); padding rows hold label 0 and box 0. Two ``pad_sequence`` calls, no host sync."""
    labels = [t["labels"].to(device=device, dtype=torch.int64).reshape(-1) for t in targets]
    boxes = [t["boxes"].to(device=device, dtype=torch.float32).reshape(-1, 4) for t in targets]
    if not labels or max(x.shape[0] for x in labels) == 0:
        b = len(targets)
        return torch.zeros(b, 1, dtype=torch.int64, device=device), torch.zeros(b, 1, 4, device=device)
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(labels, batch_first=True), pad(boxes, batch_first=True)


def flat_pairs(pairs: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], device: torch.device) -> Tensor:
    """(set, image) -> (query idx, target idx) int64 arrays as one int64 (4, K) device tensor of rows (set, image,
    query, target): built on the host, one host-to-device copy."""
    cols = [
        np.stack([np.full_like(q, s), np.full_like(q, i), q, t])
        for s, per_image in enumerate(pairs)
        for i, (q, t) in enumerate(per_image)
    ]
    flat = np.concatenate(cols, 1) if cols else np.zeros((4, 0), dtype=np.int64)
    return torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64)).to(device, non_blocking=True)


def batched_solver_missing(cuda: bool) -> str | None:
    """None when the batched solver can run (torch-linear-assignment importable, and on CUDA its Triton module),
    else why not (one line)."""
    try:
        import torch_linear_assignment  # noqa: F401

        if cuda:
            import torch_linear_assignment._triton  # noqa: F401
    except ImportError as e:
        what = "torch-linear-assignment's Triton solver" if cuda else "torch-linear-assignment"
        return f"{what} does not import ({e})"
    return None


def _check_sizes(sizes: Sequence[int], batch: int, num_queries: int) -> None:
    """ValueError unless there is one target count per image and each is at most the number of queries."""
    if len(sizes) != batch:
        raise ValueError(f"HungarianMatcher: {len(sizes)} targets for a batch of {batch} predictions")
    for i, n in enumerate(sizes):
        if n > num_queries:
            raise ValueError(
                f"HungarianMatcher: image {i} has {n} targets but the model has only {num_queries} queries; "
                "one-to-one matching needs num_queries >= targets per image (raise num_queries or cap targets)"
            )


def _solve_batched(cost: Tensor) -> Tensor:
    """Row-to-column assignment of N cost matrices at once: cost (N, R, C) float32 with R <= C and every entry
    finite -> (N, R) int64 column per row, on the cost's device.

    On CUDA torch-linear-assignment's Triton kernel (one program per matrix) runs with its validation off: its
    public entry point reads the device twice (a NaN scan and an infeasibility flag), and a finite dense matrix
    with R <= C is always feasible. Elsewhere its public entry point (SciPy per matrix)."""
    import torch_linear_assignment

    if cost.is_cuda:
        from torch_linear_assignment import _triton

        return _triton.batch_linear_assignment(cost, validation="off")
    return torch_linear_assignment.batch_linear_assignment(cost)


class HungarianMatcher(nn.Module):
    """Optimal one-to-one assignment of queries to targets, per image (DETR's bipartite matching with DINO's costs).

    Args:
        cost_class: weight of the focal-style classification cost (DINO-4scale: 2.0).
        cost_bbox: weight of the L1 cost between normalised cxcywh boxes (DINO-4scale: 5.0).
        cost_giou: weight of the negative generalised-IoU cost on xyxy boxes (DINO-4scale: 2.0).
        focal_alpha: focal-loss alpha of the class cost (DINO-4scale: 0.25).
        focal_gamma: focal-loss gamma of the class cost (upstream hard-codes 2.0).
        solver: ``"scipy"`` (the reference: one device-to-host copy, SciPy per set and image) or ``"batched"``
            (every set and image at once on the cost's device, :meth:`match_pairs`; needs torch-linear-assignment).

    The costs run without gradients, in float32 (even under autocast), for every prediction set of a step at once
    (:meth:`match_stacked`: the decoder layers and the encoder proposals, stacked): the cost blocks of all sets and
    images, plus the targets' label range, reach the host in **one** device-to-host copy (the step's only host
    sync), then each (set, image) is solved with :func:`scipy.optimize.linear_sum_assignment`.
    """

    def __init__(
        self,
        cost_class: float = 1.0,
        cost_bbox: float = 1.0,
        cost_giou: float = 1.0,
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
        solver: str = "scipy",
    ) -> None:
        super().__init__()
        if solver not in SOLVERS:
            raise ValueError(f"HungarianMatcher: solver must be one of {SOLVERS}, got {solver!r}")
        self.solver = solver
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
            f"focal_alpha={self.focal_alpha}, focal_gamma={self.focal_gamma}, solver={self.solver}"
        )

    def batched_cost(self, logits: Tensor, boxes: Tensor, tgt_labels: Tensor, tgt_boxes: Tensor) -> Tensor:
        """Matching costs of every query against every (padded) target of its image, all sets at once.

        Args:
            logits: (S, B, Q, C) raw class logits (sigmoid, no background class), S prediction sets.
            boxes: (S, B, Q, 4) predicted boxes, normalised (cx, cy, w, h).
            tgt_labels: (B, T) int64 class indices (clamped into [0, C) here; the range is checked by
                :meth:`match_stacked`).
            tgt_boxes: (B, T, 4) target boxes, normalised (cx, cy, w, h).

        Returns:
            (S, B, Q, T) float32 cost (module docstring); lower is a better match.
        """
        logits, boxes = logits.float(), boxes.float()
        s, b, q, c = logits.shape
        labels = tgt_labels.to(device=logits.device, dtype=torch.int64).clamp(0, c - 1)
        tgt_boxes = tgt_boxes.to(device=boxes.device, dtype=torch.float32)
        t = labels.shape[-1]
        # Focal-shaped class cost, evaluated only at the target classes: (S, B, Q, T).
        prob = logits.sigmoid().gather(3, labels[None, :, None, :].expand(s, b, q, t))
        alpha, gamma = self.focal_alpha, self.focal_gamma
        neg = (1.0 - alpha) * prob.pow(gamma) * -(1.0 - prob + 1e-8).log()
        pos = alpha * (1.0 - prob).pow(gamma) * -(prob + 1e-8).log()
        cost_class = pos - neg
        cost_bbox = torch.cdist(boxes.reshape(s * b, q, 4), tgt_boxes.repeat(s, 1, 1), p=1).view(s, b, q, t)
        giou = box_giou(cxcywh_to_xyxy(boxes)[..., :, None, :], cxcywh_to_xyxy(tgt_boxes)[None, :, None, :, :])
        return self.cost_bbox * cost_bbox + self.cost_class * cost_class - self.cost_giou * giou

    def cost_matrix(self, logits: Tensor, boxes: Tensor, tgt_labels: Tensor, tgt_boxes: Tensor) -> Tensor:
        """Matching cost of one image: logits (Q, C), boxes (Q, 4) cxcywh, tgt_labels (N,) int64 in [0, C),
        tgt_boxes (N, 4) cxcywh -> (Q, N) float32 (:meth:`batched_cost` for one set and one image)."""
        return self.batched_cost(logits[None, None], boxes[None, None], tgt_labels[None], tgt_boxes[None])[0, 0]

    @torch.no_grad()
    def match_stacked(
        self, logits: Tensor, boxes: Tensor, tgt_labels: Tensor, tgt_boxes: Tensor, sizes: Sequence[int]
    ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """Match S prediction sets of a batch in one pass (one device-to-host copy).

        Args:
            logits: (S, B, Q, C) raw logits; boxes: (S, B, Q, 4) normalised cxcywh.
            tgt_labels: (B, T) int64, tgt_boxes: (B, T, 4) cxcywh, padded (:func:`pad_targets`).
            sizes: N_i, the real targets of each image (Python ints, <= T).

        Returns:
            ``result[s][i] = (pred_idx, tgt_idx)``, int64 numpy arrays of length N_i, ``pred_idx`` ascending.

        Raises:
            ValueError: an image has more targets than there are queries (Q >= N_i is assumed, as in DETR: every
                target must receive its own query), a target label outside [0, C), or the cost holds NaN/inf
                (e.g. a diverged model).
        """
        s, b, num_queries, num_classes = logits.shape
        _check_sizes(sizes, b, num_queries)
        empty = np.zeros(0, dtype=np.int64)
        if sum(sizes) == 0:
            return [[(empty, empty) for _ in sizes] for _ in range(s)]
        if not has_values(logits):
            # Shape-only costs (plan's memory prediction): queries 0..n-1 to targets 0..n-1, the same number
            # of matches, so the same loss-term sizes, as a real assignment.
            return [[(np.arange(n), np.arange(n)) for n in sizes] for _ in range(s)]
        with torch.autocast(device_type=logits.device.type, enabled=False):
            cost = self.batched_cost(logits, boxes, tgt_labels, tgt_boxes)
            real = torch.cat([tgt_labels[i, :n] for i, n in enumerate(sizes) if n]).to(cost.device)
            label_range = torch.stack(torch.aminmax(real)).to(torch.float32)
            blocks = [cost[:, i, :, :n].reshape(-1) for i, n in enumerate(sizes) if n]
            flat = torch.cat([*blocks, label_range]).cpu().numpy()  # the one host sync of the step
        lo, hi = int(flat[-2]), int(flat[-1])
        if lo < 0 or hi >= num_classes:
            raise ValueError(f"HungarianMatcher: target labels must lie in [0, {num_classes}), got [{lo}, {hi}]")
        if not np.isfinite(flat).all():
            raise ValueError("HungarianMatcher: the matching cost contains NaN or inf (non-finite predictions?)")
        result: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(s)]
        offset = 0
        for n in sizes:
            if n == 0:
                for per_set in result:
                    per_set.append((empty, empty))
                continue
            block = flat[offset : offset + s * num_queries * n].reshape(s, num_queries, n)
            offset += s * num_queries * n
            for k in range(s):
                rows, cols = linear_sum_assignment(block[k])
                result[k].append((rows.astype(np.int64), cols.astype(np.int64)))
        return result

    @torch.no_grad()
    def match_pairs(
        self, logits: Tensor, boxes: Tensor, tgt_labels: Tensor, tgt_boxes: Tensor, sizes: Sequence[int]
    ) -> Tensor:
        """The matched pairs of S prediction sets as one int64 (4, K) tensor on ``logits.device``, rows (set, image,
        query, target index into the padded targets), ``K = S * sum(sizes)`` (what the criterion gathers with).

        ``solver="scipy"``: :meth:`match_stacked` then one host-to-device copy of the pairs. ``solver="batched"``:
        the (S, B, Q, T) cost with the padded targets' columns set to 0 and non-finite entries to +-1e8
        (``nan_to_num``), transposed to (S * B, T, Q) and solved at once (:func:`_solve_batched`); the real targets'
        rows are picked by indices built on the host from ``sizes``, so the matcher itself never reads the device.
        A pair's query is optimal for the image's real targets (equal total cost to SciPy's; with tied costs the
        queries may differ). The label range and a non-finite cost are not checked on this path (no read-back):
        the data layer maps every label into [0, C), and a non-finite prediction makes the loss non-finite, which
        the engine stops on.

        Args and Raises: as :meth:`match_stacked` (``solver="scipy"``); ``"batched"`` raises only for an image
        with more targets than queries.
        """
        device = logits.device
        if self.solver == "scipy" or not has_values(logits):
            return flat_pairs(self.match_stacked(logits, boxes, tgt_labels, tgt_boxes, sizes), device)
        s, b, num_queries, _ = logits.shape
        _check_sizes(sizes, b, num_queries)
        if sum(sizes) == 0:
            return torch.zeros(4, 0, dtype=torch.int64, device=device)
        t = tgt_labels.shape[-1]
        real = np.arange(t)[None, :] < np.asarray(sizes)[:, None]  # (B, T) on the host
        with torch.autocast(device_type=device.type, enabled=False):
            cost = self.batched_cost(logits, boxes, tgt_labels, tgt_boxes)
            keep = torch.from_numpy(real).to(device, non_blocking=True)
            cost = torch.nan_to_num(cost.masked_fill(~keep[None, :, None, :], 0.0), nan=1e8, posinf=1e8, neginf=-1e8)
            query_of = _solve_batched(cost.flatten(0, 1).transpose(1, 2).contiguous()).view(s, b, t)
        img, tgt = (np.repeat(x[None], s, 0) for x in np.nonzero(real))
        sets = np.repeat(np.arange(s), img.shape[1])
        index = torch.from_numpy(np.stack([sets, img.reshape(-1), tgt.reshape(-1)])).to(device, non_blocking=True)
        query = query_of[index[0], index[1], index[2]]
        return torch.stack([index[0], index[1], query, index[2]])

    @torch.no_grad()
    def forward(self, outputs: Mapping[str, Tensor], targets: Sequence[Mapping[str, Tensor]]) -> list[MatchIndices]:
        """Match each image's queries to its targets (one prediction set; :meth:`match_stacked` does many).

        Args:
            outputs: ``{"pred_logits": (B, Q, C) raw logits, "pred_boxes": (B, Q, 4) normalised cxcywh}``; other
                keys are ignored.
            targets: B dicts with ``"labels"`` (N_i,) int64 and ``"boxes"`` (N_i, 4) normalised cxcywh.

        Returns:
            B tuples ``(pred_idx, tgt_idx)`` of int64 CPU tensors of length N_i (empty for an image without targets):
            query ``pred_idx[k]`` is assigned to target ``tgt_idx[k]``; ``pred_idx`` is sorted ascending.

        Raises:
            ValueError: as :meth:`match_stacked`.
        """
        logits = outputs["pred_logits"]
        if len(targets) != logits.shape[0]:
            raise ValueError(f"HungarianMatcher: {len(targets)} targets for a batch of {logits.shape[0]} predictions")
        labels, boxes = pad_targets(targets, logits.device)
        sizes = [int(t["labels"].shape[0]) for t in targets]
        sets = self.match_stacked(logits[None], outputs["pred_boxes"][None], labels, boxes, sizes)
        return [(torch.from_numpy(r), torch.from_numpy(c)) for r, c in sets[0]]
