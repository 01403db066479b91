"""Small building blocks of DINO shared by the transformer and the model (upstream ``models/dino/utils.py`` and
``util/misc.py``): inverse sigmoid, MLP head, sine embedding of anchor boxes, encoder proposals.

Boxes are (cx, cy, w, h) normalised to [0, 1] of the valid (un-padded) image unless said otherwise; "unsigmoid"
means inverse-sigmoid space (logits of the normalised coordinates).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.ops.msda.reference import as_size


def has_values(t: Tensor) -> bool:
    """False for shape-only tensors (``torch._subclasses.FakeTensorMode``, the ``meta`` device), whose values
    cannot be read: value checks and the Hungarian solver skip them. ``plan``'s memory prediction runs DINO's
    training step that way (:mod:`trainer.planning.memory`)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def level_shapes(spatial_shapes) -> list[tuple[int, int]]:
    """(H_l, W_l) per level as Python ints from a (L, 2) int64 tensor (one device->host copy) or a sequence of
    pairs (no copy; also works on shape-only tensors' models, see :func:`has_values`)."""
    if isinstance(spatial_shapes, Tensor):
        return [(int(h), int(w)) for h, w in spatial_shapes.tolist()]
    return [(as_size(h), as_size(w)) for h, w in spatial_shapes]


def symbolic(shapes) -> bool:
    """Whether any (H_l, W_l) of ``shapes`` is a ``torch.SymInt`` (torch.export with dynamic height/width)."""
    return any(isinstance(n, torch.SymInt) for pair in shapes for n in pair)


def box_giou(boxes1: Tensor, boxes2: Tensor, eps: float = 0.0) -> Tensor:
    """Generalised IoU of (x1, y1, x2, y2) boxes, broadcast over the leading dims (Rezatofighi et al. 2019,
    arXiv:1902.09630, Alg. 1): ``IoU - (|C| - |A u B|) / |C|``, C the smallest enclosing box.

    ``boxes1[..., :, None, :]`` against ``boxes2[..., None, :, :]`` gives the pairwise (..., Q, N) matrix of
    ``torchvision.ops.generalized_box_iou`` (equal values with ``eps=0``); equal shapes give the element-wise form
    of ``torchvision.ops.generalized_box_iou_loss`` (``1 - box_giou(a, b, 1e-7)``), here without its boolean-mask
    indexing (``aten::nonzero``, a host sync on CUDA): the intersection's sides are clamped at 0 instead, the same
    values and zero gradient where the boxes do not overlap.

    Args:
        boxes1, boxes2: float (..., 4) broadcastable, x2 >= x1 and y2 >= y1.
        eps: added to the union and the enclosing area (0 as the pairwise torchvision form, 1e-7 as its loss).

    Returns:
        float (...) in [-1, 1] (broadcast shape without the last dim).
    """
    area1 = (boxes1[..., 2] - boxes1[..., 0]) * (boxes1[..., 3] - boxes1[..., 1])
    area2 = (boxes2[..., 2] - boxes2[..., 0]) * (boxes2[..., 3] - boxes2[..., 1])
    inter_wh = (
        torch.minimum(boxes1[..., 2:], boxes2[..., 2:]) - torch.maximum(boxes1[..., :2], boxes2[..., :2])
    ).clamp(min=0)
    inter = inter_wh[..., 0] * inter_wh[..., 1]
    union = area1 + area2 - inter
    enclose_wh = torch.maximum(boxes1[..., 2:], boxes2[..., 2:]) - torch.minimum(boxes1[..., :2], boxes2[..., :2])
    enclose = enclose_wh[..., 0] * enclose_wh[..., 1]
    return inter / (union + eps) - (enclose - union) / (enclose + eps)


def cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """(..., 4) (cx, cy, w, h) -> (..., 4) (x1, y1, x2, y2), any leading dims (``torchvision.ops.box_convert``
    takes (N, 4) only)."""
    centre, half = boxes[..., :2], boxes[..., 2:] / 2
    return torch.cat([centre - half, centre + half], -1)


def inverse_sigmoid(x: Tensor, eps: float = 1e-3) -> Tensor:
    """log(x / (1 - x)) with x clamped to [0, 1] and both terms to >= eps (upstream's eps 1e-3): finite for 0 and 1."""
    x = x.clamp(0.0, 1.0)
    return torch.log(x.clamp(min=eps) / (1.0 - x).clamp(min=eps))


class MLP(nn.Module):
    """``num_layers`` Linear layers with ReLU between them (upstream ``MLP``; parameters ``layers.<i>.weight``).

    Used as the box head (``bbox_embed``: hidden -> hidden -> hidden -> 4) and as ``ref_point_head``.
    """

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int):
        super().__init__()
        self.num_layers = num_layers
        dims_in = [input_dim] + [hidden_dim] * (num_layers - 1)
        dims_out = [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims_in, dims_out))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < self.num_layers - 1:
                x = F.relu(x)
        return x


def gen_sineembed_for_position(pos_tensor: Tensor, d_model: int = 256, temperature: float = 10000.0) -> Tensor:
    """Sine embedding of anchor boxes (DAB-DETR / DINO sec. 3.2 query positional embedding).

    Each coordinate c in [0, 1] becomes ``d_model // 2`` features: ``c * 2 pi / T^(2 floor(i/2) / n)``, sine at even
    and cosine at odd i (interleaved), T = 10000; the coordinates' features are concatenated in upstream's order.
    All coordinates are embedded in one pass (a fixed number of operator calls, not one chain per coordinate).

    Args:
        pos_tensor: (..., 2) as (x, y) or (..., 4) as (cx, cy, w, h), normalised to [0, 1].
        d_model: hidden size; each coordinate gets ``d_model // 2`` features (upstream hard-codes 128 = 256 // 2).

    Returns:
        float32 (..., 2 * (d_model // 2)) for 2 coordinates or (..., 4 * (d_model // 2)) for 4, in the upstream
        order (y, x) or (y, x, w, h).

    Raises:
        ValueError: the last dim is neither 2 nor 4.
    """
    k = pos_tensor.size(-1)
    if k not in (2, 4):
        raise ValueError(f"gen_sineembed_for_position: last dim must be 2 or 4, got {k}")
    n = d_model // 2
    coords = torch.cat([pos_tensor[..., 1:2], pos_tensor[..., :1], pos_tensor[..., 2:]], -1)  # (y, x[, w, h])
    dim_t = torch.arange(n, dtype=torch.float32, device=pos_tensor.device)
    dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / n)
    pos = coords.float()[..., None] * (2 * math.pi) / dim_t  # (..., k, n)
    return torch.stack((pos[..., 0::2].sin(), pos[..., 1::2].cos()), dim=-1).flatten(-3)


def gen_encoder_output_proposals(
    memory: Tensor, memory_padding_mask: Tensor, spatial_shapes, base_wh: float = 0.05
) -> tuple[Tensor, Tensor]:
    """One anchor box per encoder token (two-stage DINO / Deformable DETR sec. 4.2).

    Token (i, j) of level l proposes the box centred on the pixel centre, normalised by the valid size of that
    image at that level, with w = h = ``base_wh * 2**l``. Tokens on padding, and proposals with any coordinate
    outside (0.01, 0.99), get +inf coordinates (upstream's marker) and a zeroed memory.

    Args:
        memory: (B, S, C) encoder output, S = sum(H_l * W_l).
        memory_padding_mask: (B, S) bool, True on padding.
        spatial_shapes: (L, 2) int64 (H_l, W_l), or those pairs as Python ints (no device->host copy).

    Returns:
        output_memory (B, S, C) (memory with invalid tokens zeroed), output_proposals float32 (B, S, 4)
        unsigmoid (cx, cy, w, h), +inf where invalid.
    """
    b = memory.shape[0]
    proposals = []
    start = 0
    for lvl, (h, w) in enumerate(level_shapes(spatial_shapes)):
        mask_l = memory_padding_mask[:, start : start + h * w].view(b, h, w)
        valid_h = (~mask_l[:, :, 0]).sum(1)
        valid_w = (~mask_l[:, 0, :]).sum(1)
        ys, xs = torch.meshgrid(
            torch.arange(h, dtype=torch.float32, device=memory.device),
            torch.arange(w, dtype=torch.float32, device=memory.device),
            indexing="ij",
        )
        grid = torch.stack([xs, ys], -1)  # (H, W, 2) as (x, y)
        scale = torch.stack([valid_w, valid_h], -1).view(b, 1, 1, 2).float()
        centres = (grid.unsqueeze(0) + 0.5) / scale
        wh = torch.full_like(centres, base_wh * (2.0**lvl))
        proposals.append(torch.cat([centres, wh], -1).view(b, -1, 4))
        start += h * w
    output_proposals = torch.cat(proposals, 1)
    valid = ((output_proposals > 0.01) & (output_proposals < 0.99)).all(-1, keepdim=True)
    output_proposals = torch.log(output_proposals / (1 - output_proposals))
    invalid = memory_padding_mask.unsqueeze(-1) | ~valid
    output_proposals = output_proposals.masked_fill(invalid, float("inf"))
    output_memory = memory.masked_fill(invalid, 0.0)
    return output_memory, output_proposals
