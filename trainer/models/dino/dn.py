"""Contrastive denoising (CDN) queries of DINO (Zhang et al. 2022, arXiv 2203.03605, sec. 3.2; DN-DETR).

Upstream ``models/dino/dn_components.py`` (``prepare_for_cdn``, ``dn_post_process``), device-agnostic.

Layout of the ``pad_size`` denoising queries placed before the matching queries in the decoder: ``num_dn_group``
groups of ``2 * max_gt`` rows (``max_gt`` = most boxes in one image of the batch); in group g, rows
``[2 g max_gt, 2 g max_gt + n_b)`` are image b's positives (its boxes in order) and the next ``max_gt`` rows
start its negatives; the rows past an image's own box count are zero padding (label embedding 0, anchor logit 0).

Number of groups (upstream's rule, kept): with ``d = 2 * dn_number``: ``d // (2 * max_gt)`` when ``d >= 100``
(so DINO-4scale's 100 gives ``100 // max_gt`` groups, at least 1), ``d`` itself when ``0 < d < 100`` (upstream
quirk: a small ``dn_number`` means that many pairs of groups, whatever ``max_gt``), 1 for a batch with no boxes.

Static size (``max_boxes`` > 0, the config's ``dn_max_boxes``): the groups are still upstream's for the batch, but
the part is padded with inert rows to :func:`static_dn_rows` rows on every batch, so the decoder's input length
(``rows + num_queries``) and its attention mask's shape no longer depend on the batch's box counts -- with fixed
canvases the model's shapes then depend on the canvas alone (one ``torch.compile`` graph or CUDA graph per
canvas). An inert row has label embedding 0 and anchor logit 0 like the padding slots; it sees only the inert
rows and the matching queries, and no other query sees it, so the real rows and the matching queries compute what
they compute without it. An image with more than ``max_boxes`` boxes puts only its first ``max_boxes`` in the
denoising part (the matching part and its loss still see every box).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from trainer.models.dino.utils import inverse_sigmoid


def num_dn_groups(dn_number: int, max_gt: int) -> int:
    """Denoising groups for a batch whose largest image has ``max_gt`` boxes (upstream's rule, module docstring)."""
    d = 2 * dn_number
    if max_gt == 0:
        return 1
    if d >= 100:
        d = d // (2 * max_gt)
    return max(d, 1)


@functools.cache
def static_dn_rows(dn_number: int, max_boxes: int) -> int:
    """Rows of the denoising part at a static size: the most that any batch whose largest image has at most
    ``max_boxes`` boxes needs, ``max over m in [0, max_boxes] of 2 m num_dn_groups(dn_number, m)`` (200 for
    DINO-4scale's ``dn_number`` 100 and any ``max_boxes`` <= 100). 0 when ``dn_number`` or ``max_boxes`` is 0."""
    if dn_number <= 0 or max_boxes <= 0:
        return 0
    return max(2 * m * num_dn_groups(dn_number, m) for m in range(max_boxes + 1))


def dn_attention_mask(
    num_groups: int, single_pad: int, num_queries: int, device=None, padded_size: int | None = None
) -> Tensor:
    """Decoder self-attention mask, (P + Q, P + Q) bool, True = may NOT attend; P = ``padded_size`` or, when None,
    pad = groups * 2 * single_pad.

    Matching queries cannot see any denoising query (no ground truth leaks); each denoising group sees itself
    and the matching queries but no other group; the inert rows past ``pad`` (static size, module docstring) are
    one more such group. Built from each row's group id (inert rows: ``num_groups``, matching queries:
    ``num_groups + 1``) in a fixed number of operator calls, whatever the number of groups.
    """
    group = 2 * single_pad
    pad = num_groups * group
    rows = pad if padded_size is None else int(padded_size)
    if rows < pad:
        raise ValueError(f"dn_attention_mask: padded_size {rows} is smaller than the {pad} denoising rows")
    idx = torch.arange(rows + num_queries, device=device)
    gid = idx.div(max(group, 1), rounding_mode="floor").clamp(max=num_groups)
    gid = torch.where(idx >= pad, num_groups, gid)
    gid = torch.where(idx >= rows, num_groups + 1, gid)
    # row r may not attend column c when c is a denoising (or inert) query of another group than r's
    return (gid[None, :] <= num_groups) & (gid[:, None] != gid[None, :])


def prepare_for_cdn(
    targets: Sequence[dict],
    dn_number: int,
    label_noise_ratio: float,
    box_noise_scale: float,
    num_queries: int,
    num_classes: int,
    hidden_dim: int,
    label_enc: nn.Embedding,
    generator: torch.Generator | None = None,
    max_boxes: int = 0,
) -> tuple[Tensor, Tensor, Tensor, dict]:
    """Noised ground truth as denoising queries (DINO sec. 3.2), the attention mask and ``dn_meta``.

    Label noise: each query's label is replaced, with probability ``label_noise_ratio / 2``, by one drawn
    uniformly from [0, num_classes). Box noise, on the (x1, y1, x2, y2) corners: each corner moves by
    ``sign * r * (w/2, h/2) * box_noise_scale`` with a random sign, r ~ U[0, 1) for positives and U[1, 2) for
    negatives (so negatives lie farther from the box), then clamped to [0, 1].

    Nothing is read back from the device: the layout comes from the targets' shapes (index tensors built on the
    host, one copy to the device), and labels are clamped into [0, num_classes) for the embedding lookup instead
    of checked here (an out-of-range label would be a device-side assert on CUDA). The range check is the
    criterion's, in the matcher's one device-to-host copy of the same step.

    Args:
        targets: per image {"labels": int64 (N_b,) in [0, num_classes), "boxes": float (N_b, 4) cxcywh in [0, 1]}.
        label_enc: ``nn.Embedding(num_classes + 1, hidden_dim)`` (row ``num_classes`` is never used by noise).
        generator: optional RNG for the noise (default: the global one).
        max_boxes: 0 = the part sized for this batch (upstream); > 0 = padded to :func:`static_dn_rows` rows
            whatever the batch, an image's boxes past the first ``max_boxes`` left out of it (module docstring).

    Returns:
        input_query_label (B, P, hidden_dim), input_query_bbox (B, P, 4) unsigmoid, attn_mask (P + num_queries,)
        * 2 bool, dn_meta {"pad_size": the real rows, "num_dn_group", "padded_size": P, "max_boxes"}; P =
        pad_size without ``max_boxes``.
    """
    device = label_enc.weight.device
    batch_size = len(targets)
    counts = [int(t["labels"].numel()) for t in targets]
    if max_boxes > 0:
        counts = [min(n, max_boxes) for n in counts]
    max_gt = max(counts, default=0)
    groups = num_dn_groups(dn_number, max_gt)
    single_pad = max_gt
    pad_size = single_pad * 2 * groups
    padded_size = static_dn_rows(dn_number, max_boxes) if max_boxes > 0 else pad_size
    weight = label_enc.weight
    input_query_label = weight.new_zeros(batch_size, padded_size, hidden_dim)
    input_query_bbox = torch.zeros(batch_size, padded_size, 4, device=device)
    attn_mask = dn_attention_mask(groups, single_pad, num_queries, device, padded_size)
    meta = {"pad_size": pad_size, "num_dn_group": groups, "padded_size": padded_size, "max_boxes": max_boxes}
    n_boxes = sum(counts)
    if n_boxes == 0:
        return input_query_label, input_query_bbox, attn_mask, meta

    labels = torch.cat([t["labels"].reshape(-1)[:n] for t, n in zip(targets, counts)])
    boxes = torch.cat([t["boxes"].reshape(-1, 4)[:n] for t, n in zip(targets, counts)])
    labels, boxes = labels.to(device=device, dtype=torch.long), boxes.to(device=device, dtype=torch.float32)
    # 2 * groups blocks (positive, negative, positive, ...), each the batch's boxes in order; per row: its image,
    # its slot in the image's group block, and whether it is a negative -- from the counts alone, on the host.
    blocks = 2 * groups
    image = np.repeat(np.arange(batch_size), counts)
    within = np.concatenate([np.arange(n) for n in counts])
    block = np.repeat(np.arange(blocks), n_boxes)
    layout = np.stack([np.tile(image, blocks), np.tile(within, blocks) + block * single_pad, block % 2])
    known_bid, rows, negative = torch.from_numpy(layout.astype(np.int64)).to(device, non_blocking=True).unbind(0)
    known_labels = labels.clamp(0, num_classes - 1).repeat(blocks)
    known_boxes = boxes.repeat(blocks, 1)

    if label_noise_ratio > 0:
        p = torch.rand(known_labels.shape, device=device, generator=generator)
        chosen = p < label_noise_ratio * 0.5
        new = torch.randint(0, num_classes, known_labels.shape, device=device, generator=generator)
        known_labels = torch.where(chosen, new, known_labels)

    if box_noise_scale > 0:
        half = known_boxes[:, 2:] / 2
        xyxy = torch.cat([known_boxes[:, :2] - half, known_boxes[:, :2] + half], 1)
        diff = torch.cat([half, half], 1)
        sign = torch.randint(0, 2, known_boxes.shape, device=device, generator=generator).float() * 2.0 - 1.0
        part = torch.rand(known_boxes.shape, device=device, generator=generator) + negative[:, None]
        xyxy = (xyxy + part * sign * diff * box_noise_scale).clamp(0.0, 1.0)
        known_boxes = torch.cat([(xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2]], 1)

    input_query_label = input_query_label.index_put((known_bid, rows), label_enc(known_labels))
    input_query_bbox = input_query_bbox.index_put((known_bid, rows), inverse_sigmoid(known_boxes))
    return input_query_label, input_query_bbox, attn_mask, meta


def dn_post_process(outputs_class: Tensor, outputs_coord: Tensor, dn_meta: dict, aux_loss: bool = True):
    """Split decoder outputs into the denoising part (stored in ``dn_meta``) and the matching part (returned).

    Args:
        outputs_class: (n_dec, B, pad + Q, num_classes) logits; outputs_coord: (n_dec, B, pad + Q, 4) boxes.
        dn_meta: from :func:`prepare_for_cdn`; gains "output_known_lbs_bboxes" {"pred_logits" (B, pad, K),
            "pred_boxes" (B, pad, 4), "aux_outputs" [per earlier layer {"pred_logits", "pred_boxes"}]}, also when
            pad_size is 0 (0-row tensors; upstream leaves the key out then). The inert rows of a static-size part
            (between ``pad_size`` and ``padded_size``) go to neither.

    Returns:
        (outputs_class, outputs_coord) of the matching queries, (n_dec, B, Q, ...).
    """
    pad = dn_meta["pad_size"]
    rows = dn_meta.get("padded_size", pad)
    known_class, known_coord = outputs_class[:, :, :pad], outputs_coord[:, :, :pad]
    out = {"pred_logits": known_class[-1], "pred_boxes": known_coord[-1]}
    if aux_loss:
        out["aux_outputs"] = [{"pred_logits": c, "pred_boxes": b} for c, b in zip(known_class[:-1], known_coord[:-1])]
    dn_meta["output_known_lbs_bboxes"] = out
    return outputs_class[:, :, rows:], outputs_coord[:, :, rows:]
