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

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchvision.ops import sigmoid_focal_loss

from trainer.models.dino.matcher import MatchIndices, flat_pairs, pad_targets
from trainer.models.dino.utils import box_giou, cxcywh_to_xyxy

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


def _dn_single_pad(dn_meta: Mapping, sizes: Sequence[int]) -> tuple[int, int]:
    pad_size, groups = int(dn_meta["pad_size"]), int(dn_meta["num_dn_group"])
    if groups <= 0 or pad_size % groups != 0:
        raise ValueError(f"dn_meta: pad_size={pad_size} is not a positive multiple of num_dn_group={groups}")
    single_pad = pad_size // groups
    for n in sizes:
        if 2 * n > single_pad:
            raise ValueError(
                f"dn_meta: an image has {n} targets but a denoising group holds only {single_pad} queries "
                "(pos + neg), so the dn_meta was built for other targets"
            )
    return single_pad, groups


def _dn_pairs(dn_meta: Mapping, sizes: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`dn_positive_indices` as numpy arrays from the target counts alone (no tensor is read); with a
    static-size part (``dn_meta["max_boxes"]`` > 0) an image's targets past that many have no denoising query."""
    cap = int(dn_meta.get("max_boxes") or 0)
    if cap > 0:
        sizes = [min(n, cap) for n in sizes]
    single_pad, groups = _dn_single_pad(dn_meta, sizes)
    out = []
    for n in sizes:
        tgt = np.tile(np.arange(n, dtype=np.int64), groups)
        out.append((np.repeat(np.arange(groups, dtype=np.int64) * single_pad, n) + tgt, tgt))
    return out


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

    Raises:
        ValueError: ``pad_size`` not a multiple of ``num_dn_group``, or a group too small for an image's targets.
    """
    sizes = [int(t["labels"].shape[0]) for t in targets]
    return [(torch.from_numpy(q), torch.from_numpy(t)) for q, t in _dn_pairs(dn_meta, sizes)]


def _num_boxes(sizes: Sequence[int], device: torch.device) -> Tensor:
    """DETR's normaliser: target boxes in the batch, summed over ranks / world size, clamped to >= 1 (float32, 0-d,
    on ``device``; the count comes from the targets' shapes and is filled on the device, so there is neither a
    read-back nor a blocking host-to-device copy)."""
    n = torch.full((), float(sum(sizes)), device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(n)
        n = n / dist.get_world_size()
    return n.clamp(min=1.0)


class DinoCriterion(nn.Module):
    """DINO's training loss (see the module docstring for formulas).

    Args:
        num_classes: C, the width of ``pred_logits`` (upstream: max category id + 1, e.g. 91 for COCO).
        matcher: :class:`~trainer.models.dino.matcher.HungarianMatcher` (DINO-4scale costs 2 / 5 / 2), or any module
            with its ``match_pairs`` method.
        weight_dict: weight of every loss key that can be produced (see :func:`dino_weight_dict`); a missing key is an
            error rather than a silently dropped term. Weight 0 keeps a term logged but out of the total.
        focal_alpha: alpha of the sigmoid focal loss (DINO-4scale: 0.25); gamma is 2 as upstream.
        losses: which terms to compute, out of ``"labels"`` (``loss_ce``) and ``"boxes"`` (``loss_bbox``,
            ``loss_giou``). Upstream's logging-only ``"cardinality"`` is accepted and ignored.

    ``forward(outputs, targets)`` returns float32 0-d tensors, already weighted, under these keys (for ``L`` in the
    computed names): ``L`` (last layer), ``L_{i}`` (``aux_outputs[i]``), ``L_interm`` (``interm_outputs``), ``L_dn`` and
    ``L_dn_{i}`` (denoising queries of the last / i-th layer). The dn keys are always present (zeros when
    ``dn_meta`` is None or the batch has no targets), so the logged key set is stable from step to step.

    The prediction sets are stacked and every term is computed for all of them at once (one matcher pass with one
    device-to-host copy, none with the matcher's batched solver; one focal loss over (S, B, Q, C), one gather of matched boxes): the number of operator
    calls does not grow with the number of decoder layers, and nothing but the SciPy matcher's copy reads the device.
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

    # --- the terms of S stacked prediction sets (unweighted) ----------------------------------------------------

    def set_terms(
        self, logits: Tensor, boxes: Tensor, pairs: Tensor, tgt_labels: Tensor, tgt_boxes: Tensor, norm: Tensor
    ) -> dict[str, Tensor]:
        """Unweighted terms of S prediction sets at once.

        Args:
            logits: (S, B, Q, C) raw logits; boxes: (S, B, Q, 4) normalised cxcywh.
            pairs: int64 (4, K) rows (set, image, query, target index into the padded targets).
            tgt_labels: (B, T) int64; tgt_boxes: (B, T, 4) cxcywh (:func:`~.matcher.pad_targets`).
            norm: 0-d float32, the normaliser (``num_boxes``, times ``num_dn_group`` for denoising).

        Returns:
            ``{"loss_ce": (S,), "loss_bbox": (S,), "loss_giou": (S,)}`` (those of ``self.losses``), float32:
            ``loss_ce`` = sigmoid focal loss summed over queries and classes / norm (upstream's ``* Q``
            convention), ``loss_bbox`` = L1 of the matched pairs / norm, ``loss_giou`` = sum of 1 - GIoU / norm.
        """
        logits, boxes = logits.float(), boxes.float()
        if logits.shape[-1] != self.num_classes:
            raise ValueError(f"DinoCriterion: pred_logits has {logits.shape[-1]} classes, expected {self.num_classes}")
        s = logits.shape[0]
        set_idx, img_idx, query_idx, tgt_idx = pairs.unbind(0)
        out: dict[str, Tensor] = {}
        if "labels" in self.losses:
            onehot = torch.zeros_like(logits)
            onehot[set_idx, img_idx, query_idx, tgt_labels[img_idx, tgt_idx]] = 1.0
            focal = sigmoid_focal_loss(logits, onehot, alpha=self.focal_alpha, gamma=self.focal_gamma)
            out["loss_ce"] = focal.flatten(1).sum(1) / norm
        if "boxes" in self.losses:
            src = boxes[set_idx, img_idx, query_idx]
            tgt = tgt_boxes[img_idx, tgt_idx]
            per_pair = torch.stack(
                [(src - tgt).abs().sum(-1), 1.0 - box_giou(cxcywh_to_xyxy(src), cxcywh_to_xyxy(tgt), eps=1e-7)], 1
            )
            summed = per_pair.new_zeros(s, 2).index_add(0, set_idx, per_pair) / norm
            out["loss_bbox"], out["loss_giou"] = summed.unbind(1)
        return out

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

        Raises:
            ValueError: a target label outside [0, C) (checked from the matcher's one copy), more targets in an
                image than queries, non-finite predictions, inconsistent ``dn_meta``.
            KeyError: a computed term without a weight in ``weight_dict``.
        """
        return self.loss_and_terms(outputs, targets)[1]

    def loss_and_terms(self, outputs: Mapping, targets: Sequence[Mapping[str, Tensor]]) -> tuple[Tensor, dict]:
        """(training objective, weighted terms): :meth:`forward`'s dict and the sum of its values, the sum taken
        over the stacked per-set terms (a few operator calls, not one per term). Errors as :meth:`forward`."""
        device = outputs["pred_logits"].device
        with torch.autocast(device_type=device.type, enabled=False):
            groups = self._unweighted(outputs, targets, device)
            names = [name for keys, _ in groups for name in keys]
            missing = sorted(k for k in names if k not in self.weight_dict)
            if missing:
                raise KeyError(f"DinoCriterion: weight_dict has no weight for {missing} (see dino_weight_dict())")
            flat = torch.cat([values for _, values in groups])
            weights = torch.tensor([self.weight_dict[k] for k in names], dtype=torch.float32)
            weighted = flat * weights.to(device, non_blocking=True)
            total = weighted.sum()
        return total, dict(zip(names, weighted.unbind(0)))

    def _unweighted(
        self, outputs: Mapping, targets: Sequence[Mapping], device: torch.device
    ) -> list[tuple[list[str], Tensor]]:
        """Unweighted terms as groups of (names, float32 (K,) values), every computed key once."""
        sizes = [int(t["labels"].shape[0]) for t in targets]
        num_boxes = _num_boxes(sizes, device)
        tgt_labels, tgt_boxes = pad_targets(targets, device)
        aux = list(outputs.get("aux_outputs") or [])
        interm = outputs.get("interm_outputs")
        sets = [outputs, *aux] + ([interm] if interm is not None else [])
        suffixes = ["", *(f"_{i}" for i in range(len(aux)))] + (["_interm"] if interm is not None else [])

        logits = torch.stack([x["pred_logits"] for x in sets])
        boxes = torch.stack([x["pred_boxes"] for x in sets])
        pairs = self.matcher.match_pairs(logits, boxes, tgt_labels, tgt_boxes, sizes)
        terms = self.set_terms(logits, boxes, pairs, tgt_labels, tgt_boxes, num_boxes)
        groups = [([f"{key}{sfx}" for sfx in suffixes], per_set) for key, per_set in terms.items()]

        # Denoising: positive dn queries against their own targets, normalised by num_boxes * num_dn_group
        # (num_boxes counts every box, also those a static-size part leaves out: the same normaliser as without).
        dn_meta = outputs.get("dn_meta")
        dn_suffixes = ["_dn", *(f"_dn_{i}" for i in range(len(aux)))]
        if dn_meta is not None and sum(sizes) > 0:
            known = dn_meta["output_known_lbs_bboxes"]
            dn_aux = list(known.get("aux_outputs") or [])
            if len(dn_aux) != len(aux):
                raise ValueError(f"dn_meta has {len(dn_aux)} aux layers but outputs has {len(aux)}")
            dn_sets = [known, *dn_aux]
            pairs = flat_pairs([_dn_pairs(dn_meta, sizes)] * len(dn_sets), device)
            dn_logits = torch.stack([x["pred_logits"] for x in dn_sets])
            dn_boxes = torch.stack([x["pred_boxes"] for x in dn_sets])
            dn_norm = num_boxes * int(dn_meta["num_dn_group"])
            terms = self.set_terms(dn_logits, dn_boxes, pairs, tgt_labels, tgt_boxes, dn_norm)
            groups += [([f"{key}{sfx}" for sfx in dn_suffixes], per_set) for key, per_set in terms.items()]
        else:
            keys = [k for n in self.losses for k in LOSS_KEYS[n]]
            names = [f"{k}{sfx}" for k in keys for sfx in dn_suffixes]
            groups.append((names, torch.zeros(len(names), dtype=torch.float32, device=device)))
        return groups

    @staticmethod
    def total(loss_dict: Mapping[str, Tensor]) -> Tensor:
        """Training objective: the sum of the (already weighted) terms of :meth:`forward`."""
        if not loss_dict:
            raise ValueError("DinoCriterion.total: empty loss dict")
        return torch.stack([v.float() for v in loss_dict.values()]).sum()
