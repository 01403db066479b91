"""DINO's set-prediction loss: focal classification, L1 and GIoU box terms, deep supervision and denoising.

Sources: DETR (arXiv:2005.12872, Sec. 3.1, eq. 1-2: Hungarian-matched loss, aux decoder losses, normalisation by the
number of target boxes), Deformable DETR (arXiv:2010.04159: sigmoid focal classification, two-stage encoder proposals),
DINO (arXiv:2203.03605, Sec. 3.3: contrastive denoising, whose positive queries reconstruct their own target), and
upstream IDEA-Research/DINO ``models/dino/dino.py`` (``SetCriterion``, ``build_dino``) for names and scales.

For one set of predictions (final decoder layer, each earlier decoder layer, the encoder proposals, and the denoising
queries of each layer) with matched pairs ``(q, j)`` and ``num_boxes`` = number of target boxes in the batch
(averaged over ranks, clamped to >= 1)::

    loss_ce   = sum_{b, q, c} FL(logit[b, q, c], onehot[b, q, c]) / num_boxes    # FL: sigmoid focal, alpha, gamma=2
    loss_bbox = sum_{(q, j)} || box_q - box_j ||_1 / num_boxes                  # normalised cxcywh
    loss_giou = sum_{(q, j)} (1 - GIoU(xyxy(box_q), xyxy(box_j))) / num_boxes

``onehot`` is 1 at (matched query, its target's class) and 0 elsewhere (unmatched queries are background for every
class). Upstream writes the class term as ``mean_over_queries(...).sum() / num_boxes * Q``, which equals the sum over
queries and classes above, i.e. ``torchvision.ops.sigmoid_focal_loss(..., reduction="sum") / num_boxes``.
The denoising terms use ``num_boxes * num_dn_group`` (every target has one positive query per group).

Every returned term is already multiplied by its weight; DINO-4scale's weights are built by :func:`dino_weight_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import box_convert, generalized_box_iou, generalized_box_iou_loss, sigmoid_focal_loss

from trainer.models.dino.matcher import MatchIndices
from trainer.models.dino.utils import has_values

__all__ = ["DinoCriterion", "dino_weight_dict", "dn_positive_indices", "LOSS_KEYS"]

#: Loss names produced by each entry of ``losses``.
LOSS_KEYS: dict[str, tuple[str, ...]] = {"labels": ("loss_ce",), "boxes": ("loss_bbox", "loss_giou")}


def dino_weight_dict(
    num_decoder_layers: int = 6,
    cls_loss_coef: float = 1.0,
    bbox_loss_coef: float = 5.0,
    giou_loss_coef: float = 2.0,
    interm_loss_coef: float = 1.0,
    use_dn: bool = True,
    two_stage: bool = True,
) -> dict[str, float]:
    """Loss weights as upstream ``build_dino`` makes them (defaults: ``config/DINO/DINO_4scale.py``).

    ``loss_{ce,bbox,giou}`` and ``loss_{ce,bbox,giou}_dn`` for the last layer, the same keys suffixed ``_0`` ..
    ``_{num_decoder_layers - 2}`` for the earlier layers (e.g. ``loss_ce_dn_3``), and ``*_interm`` (no dn) scaled by
    ``interm_loss_coef`` for the encoder proposals when ``two_stage``. Without ``use_dn`` the dn keys get weight 0
    (upstream leaves them out of its weight dict; :class:`DinoCriterion` always emits them, as zeros, for logging).
    """
    base = {"loss_ce": cls_loss_coef, "loss_bbox": bbox_loss_coef, "loss_giou": giou_loss_coef}
    per_layer = dict(base)
    per_layer.update({f"{k}_dn": (v if use_dn else 0.0) for k, v in base.items()})
    weights = dict(per_layer)
    for i in range(num_decoder_layers - 1):
        weights.update({f"{k}_{i}": v for k, v in per_layer.items()})
    if two_stage:
        weights.update({f"{k}_interm": v * interm_loss_coef for k, v in base.items()})
    return {k: float(v) for k, v in weights.items()}


def dn_positive_indices(dn_meta: Mapping, targets: Sequence[Mapping[str, Tensor]]) -> list[MatchIndices]:
    """Fixed assignment of the positive denoising queries to their own targets (no Hungarian matching).

    DINO's contrastive denoising part (arXiv:2203.03605, Sec. 3.3; upstream ``prepare_for_cdn`` / ``SetCriterion``)
    holds ``num_dn_group`` groups of ``single_pad = pad_size // num_dn_group`` queries each. With ``M`` the largest
    number of targets of an image in the batch, ``single_pad = 2 * M``: a group's first ``M`` slots are the positive
    (lightly noised) copies of the image's targets, the next ``M`` the negative (strongly noised) ones, and slots past
    an image's own ``N_i`` targets are padding. So, for image ``i``, group ``g`` and target ``t < N_i``::

        positive query = g * single_pad + t          (negative query = g * single_pad + single_pad // 2 + t)

    Args:
        dn_meta: ``{"pad_size": int, "num_dn_group": int, ...}``.
        targets: B dicts with ``"labels"`` (N_i,).

    Returns:
        B tuples ``(dn_query_idx, tgt_idx)``, int64 on the CPU, each of length ``num_dn_group * N_i``, group-major.
    """
    pad_size, groups = int(dn_meta["pad_size"]), int(dn_meta["num_dn_group"])
    if groups <= 0 or pad_size % groups != 0:
        raise ValueError(f"dn_meta: pad_size={pad_size} is not a positive multiple of num_dn_group={groups}")
    single_pad = pad_size // groups
    result: list[MatchIndices] = []
    for t in targets:
        n = int(t["labels"].shape[0])
        if 2 * n > single_pad:
            raise ValueError(
                f"dn_meta: an image has {n} targets but a denoising group holds only {single_pad} queries "
                "(pos + neg), so the dn_meta was built for other targets"
            )
        tgt = torch.arange(n, dtype=torch.int64).repeat(groups)  # [0..n-1, 0..n-1, ...]
        query = (torch.arange(groups, dtype=torch.int64) * single_pad).repeat_interleave(n) + tgt
        result.append((query, tgt))
    return result


def _num_boxes(targets: Sequence[Mapping[str, Tensor]], device: torch.device) -> Tensor:
    """DETR's normaliser: target boxes in the batch, summed over ranks / world size, clamped to >= 1 (float32, 0-d)."""
    n = torch.tensor(float(sum(int(t["labels"].shape[0]) for t in targets)), device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(n)
        n = n / dist.get_world_size()
    return n.clamp(min=1.0)


class DinoCriterion(nn.Module):
    """DINO's training loss (see the module docstring for formulas).

    Args:
        num_classes: C, the width of ``pred_logits`` (upstream: max category id + 1, e.g. 91 for COCO).
        matcher: e.g. :class:`~trainer.models.dino.matcher.HungarianMatcher` (DINO-4scale costs 2 / 5 / 2).
        weight_dict: weight of every loss key that can be produced (see :func:`dino_weight_dict`); a missing key is an
            error rather than a silently dropped term. Weight 0 keeps a term logged but out of the total.
        focal_alpha: alpha of the sigmoid focal loss (DINO-4scale: 0.25); gamma is 2 as upstream.
        losses: which terms to compute, out of ``"labels"`` (``loss_ce``) and ``"boxes"`` (``loss_bbox``,
            ``loss_giou``). Upstream's logging-only ``"cardinality"`` is accepted and ignored.

    ``forward(outputs, targets)`` returns float32 0-d tensors, already weighted, under these keys (for ``L`` in the
    computed names): ``L`` (last layer), ``L_{i}`` (``aux_outputs[i]``), ``L_interm`` (``interm_outputs``), ``L_dn`` and
    ``L_dn_{i}`` (denoising queries of the last / i-th layer). The dn keys are always present (zeros when
    ``dn_meta`` is None or the batch has no targets), so the logged key set is stable from step to step.
    """

    def __init__(
        self,
        num_classes: int,
        matcher: nn.Module,
        weight_dict: Mapping[str, float],
        focal_alpha: float = 0.25,
        losses: Iterable[str] = ("labels", "boxes"),
        focal_gamma: float = 2.0,
    ) -> None:
        super().__init__()
        losses = [x for x in losses if x != "cardinality"]
        unknown = [x for x in losses if x not in LOSS_KEYS]
        if unknown:
            raise ValueError(f"DinoCriterion: unknown losses {unknown}; supported: {sorted(LOSS_KEYS)}")
        if not losses:
            raise ValueError("DinoCriterion: no losses requested")
        self.num_classes = int(num_classes)
        self.matcher = matcher
        self.weight_dict = {k: float(v) for k, v in weight_dict.items()}
        self.focal_alpha = float(focal_alpha)
        self.focal_gamma = float(focal_gamma)
        self.losses = list(losses)

    # --- individual terms (unweighted) -------------------------------------------------------------------------

    def loss_labels(
        self, outputs: Mapping[str, Tensor], targets: Sequence[Mapping], indices: list[MatchIndices], num_boxes: Tensor
    ) -> dict[str, Tensor]:
        """Sigmoid focal loss over every (query, class) pair, summed, / num_boxes (upstream's ``* Q`` convention)."""
        logits = outputs["pred_logits"].float()
        if logits.shape[-1] != self.num_classes:
            raise ValueError(f"DinoCriterion: pred_logits has {logits.shape[-1]} classes, expected {self.num_classes}")
        onehot = torch.zeros_like(logits)
        batch_idx, query_idx = self._src_index(indices, logits.device)
        labels = torch.cat([t["labels"][j.to(t["labels"].device)] for t, (_, j) in zip(targets, indices)])
        labels = labels.to(device=logits.device, dtype=torch.int64)
        onehot[batch_idx, query_idx, labels] = 1.0
        loss = sigmoid_focal_loss(logits, onehot, alpha=self.focal_alpha, gamma=self.focal_gamma, reduction="sum")
        return {"loss_ce": loss / num_boxes}

    def loss_boxes(
        self, outputs: Mapping[str, Tensor], targets: Sequence[Mapping], indices: list[MatchIndices], num_boxes: Tensor
    ) -> dict[str, Tensor]:
        """L1 on normalised cxcywh and 1 - GIoU on xyxy of the matched pairs, each summed / num_boxes."""
        pred = outputs["pred_boxes"].float()
        batch_idx, query_idx = self._src_index(indices, pred.device)
        src = pred[batch_idx, query_idx]
        tgt = torch.cat([t["boxes"][j.to(t["boxes"].device)] for t, (_, j) in zip(targets, indices)])
        tgt = tgt.to(device=pred.device, dtype=torch.float32)
        loss_bbox = F.l1_loss(src, tgt, reduction="sum") / num_boxes
        # Element-wise GIoU of the matched pairs (torchvision's loss form: the diagonal of the pairwise
        # generalized_box_iou upstream takes, without the N x N matrix; eps=1e-7 guards degenerate boxes).
        src_xyxy, tgt_xyxy = box_convert(src, "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy")
        if has_values(src):
            loss_giou = generalized_box_iou_loss(src_xyxy, tgt_xyxy, "sum") / num_boxes
        else:  # shape-only tensors: torchvision's loss masks by value; the pairwise form has no such step
            loss_giou = (1 - generalized_box_iou(src_xyxy, tgt_xyxy).diagonal()).sum() / num_boxes
        return {"loss_bbox": loss_bbox, "loss_giou": loss_giou}

    @staticmethod
    def _src_index(indices: list[MatchIndices], device: torch.device) -> tuple[Tensor, Tensor]:
        batch = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)]).to(device)
        query = torch.cat([src for src, _ in indices]).to(device)
        return batch, query

    def _terms(
        self, outputs: Mapping[str, Tensor], targets: Sequence[Mapping], indices: list[MatchIndices], num_boxes: Tensor
    ) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name in self.losses:
            fn = self.loss_labels if name == "labels" else self.loss_boxes
            out.update(fn(outputs, targets, indices, num_boxes))
        return out

    def _zero_terms(self, device: torch.device) -> dict[str, Tensor]:
        return {k: torch.zeros((), dtype=torch.float32, device=device) for n in self.losses for k in LOSS_KEYS[n]}

    # --- forward ----------------------------------------------------------------------------------------------

    def forward(self, outputs: Mapping, targets: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
        """Weighted loss terms of one batch.

        Args:
            outputs: the model's dict: ``pred_logits`` (B, Q, C) raw logits, ``pred_boxes`` (B, Q, 4) normalised
                cxcywh, optional ``aux_outputs`` (list of such dicts, earlier decoder layers), optional
                ``interm_outputs`` (encoder proposals), optional ``dn_meta`` (None or ``{"pad_size", "num_dn_group",
                "output_known_lbs_bboxes": {"pred_logits", "pred_boxes", "aux_outputs"}}``).
            targets: B dicts: ``labels`` (N_i,) int64 in [0, C), ``boxes`` (N_i, 4) float normalised cxcywh.

        Returns:
            ``{name: weighted float32 0-d tensor}``; sum them with :meth:`total`.
        """
        device = outputs["pred_logits"].device
        self._check_labels(targets)
        with torch.autocast(device_type=device.type, enabled=False):
            raw = self._unweighted(outputs, targets, device)
        missing = sorted(k for k in raw if k not in self.weight_dict)
        if missing:
            raise KeyError(f"DinoCriterion: weight_dict has no weight for {missing} (see dino_weight_dict())")
        return {k: v * self.weight_dict[k] for k, v in raw.items()}

    def _check_labels(self, targets: Sequence[Mapping[str, Tensor]]) -> None:
        """Out-of-range labels would index past the one-hot (a device-side assert on CUDA): fail clearly, once."""
        labels = [t["labels"].reshape(-1) for t in targets if t["labels"].numel()]
        if not labels or not has_values(labels[0]):  # shape-only tensors (plan's memory prediction)
            return
        flat = torch.cat([x.to(labels[0].device) for x in labels])
        lo, hi = torch.stack(torch.aminmax(flat)).tolist()  # one device->host sync per step
        if lo < 0 or hi >= self.num_classes:
            raise ValueError(f"DinoCriterion: target labels must lie in [0, {self.num_classes}), got [{lo}, {hi}]")

    def _unweighted(self, outputs: Mapping, targets: Sequence[Mapping], device: torch.device) -> dict[str, Tensor]:
        num_boxes = _num_boxes(targets, device)
        aux = list(outputs.get("aux_outputs") or [])
        losses: dict[str, Tensor] = {}

        losses.update(self._terms(outputs, targets, self.matcher(outputs, targets), num_boxes))
        for i, layer in enumerate(aux):
            terms = self._terms(layer, targets, self.matcher(layer, targets), num_boxes)
            losses.update({f"{k}_{i}": v for k, v in terms.items()})
        interm = outputs.get("interm_outputs")
        if interm is not None:
            terms = self._terms(interm, targets, self.matcher(interm, targets), num_boxes)
            losses.update({f"{k}_interm": v for k, v in terms.items()})

        # Denoising: positive dn queries against their own targets, normalised by num_boxes * num_dn_group.
        dn_meta = outputs.get("dn_meta")
        has_targets = any(int(t["labels"].shape[0]) > 0 for t in targets)
        if dn_meta is not None and has_targets:
            known = dn_meta["output_known_lbs_bboxes"]
            dn_aux = list(known.get("aux_outputs") or [])
            if len(dn_aux) != len(aux):
                raise ValueError(f"dn_meta has {len(dn_aux)} aux layers but outputs has {len(aux)}")
            dn_idx = dn_positive_indices(dn_meta, targets)
            dn_norm = num_boxes * int(dn_meta["num_dn_group"])
            losses.update({f"{k}_dn": v for k, v in self._terms(known, targets, dn_idx, dn_norm).items()})
            for i, layer in enumerate(dn_aux):
                losses.update({f"{k}_dn_{i}": v for k, v in self._terms(layer, targets, dn_idx, dn_norm).items()})
        else:
            zeros = self._zero_terms(device)
            losses.update({f"{k}_dn": v for k, v in zeros.items()})
            for i in range(len(aux)):
                losses.update({f"{k}_dn_{i}": v.clone() for k, v in zeros.items()})
        return losses

    @staticmethod
    def total(loss_dict: Mapping[str, Tensor]) -> Tensor:
        """Training objective: the sum of the (already weighted) terms of :meth:`forward`."""
        if not loss_dict:
            raise ValueError("DinoCriterion.total: empty loss dict")
        return torch.stack([v.float() for v in loss_dict.values()]).sum()
