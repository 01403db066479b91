"""Multi-scale deformable attention with its projections (Deformable DETR, arXiv 2010.04159, sec. 4.1, eq. 3).

Upstream's ``MSDeformAttn`` (``models/dino/ops/modules/ms_deform_attn.py``) on our op
:func:`trainer.ops.msda.ms_deform_attn`: parameters ``sampling_offsets``, ``attention_weights``, ``value_proj``,
``output_proj`` with upstream's shapes and initialisation, so upstream checkpoints load unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.ops.msda import ms_deform_attn
from trainer.ops.msda.function import reference_graph_active


def _im2col_step(n: int, preferred: int = 64) -> int:
    """Largest batch chunk <= ``preferred`` that divides ``n`` (the op requires a divisor; upstream uses 64).
    1 for a symbolic batch while an exporter traces the reference (torch.export: the reference takes no chunk, and
    ``%`` would guard the batch); torch.compile's symbolic batches keep the chunk (and its guard)."""
    if isinstance(n, torch.SymInt) and reference_graph_active():
        return 1
    step = max(1, min(n, preferred))
    return step if n % step == 0 else math.gcd(n, preferred)


class MSDeformAttn(nn.Module):
    """Each query attends to ``n_points`` sampled locations per head and level around its reference point.

    Args:
        d_model: channels C (divisible by ``n_heads``).
        n_levels: feature levels L.
        n_heads: heads M.
        n_points: sampling points P per head and level.

    Initialisation (upstream ``_reset_parameters``): ``sampling_offsets`` weight 0 and bias the fixed grid where
    head m points along angle 2*pi*m/M (direction scaled so its largest component is 1) at distances 1..P;
    ``attention_weights`` 0 (uniform softmax); ``value_proj``/``output_proj`` Xavier-uniform with zero bias.
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"MSDeformAttn: d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.im2col_step = 64
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        nn.init.zeros_(self.sampling_offsets.weight)
        thetas = torch.arange(self.n_heads, dtype=torch.float32) * (2.0 * math.pi / self.n_heads)
        grid = torch.stack([thetas.cos(), thetas.sin()], -1)
        grid = grid / grid.abs().max(-1, keepdim=True)[0]
        grid = grid.view(self.n_heads, 1, 1, 2).repeat(1, self.n_levels, self.n_points, 1)
        grid = grid * torch.arange(1, self.n_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.reshape(-1))
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.zeros_(self.value_proj.bias)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.zeros_(self.output_proj.bias)

    def forward(
        self,
        query: Tensor,
        reference_points: Tensor,
        input_flatten: Tensor,
        input_spatial_shapes: Tensor,
        input_level_start_index: Tensor,
        input_padding_mask: Tensor | None = None,
        level_shapes: Sequence[tuple[int, int]] | None = None,
    ) -> Tensor:
        """Deformable attention of ``query`` over the flattened multi-scale ``input_flatten``.

        Args:
            query: (N, Lq, C), content + positional embedding.
            reference_points: (N, Lq, L, 2) points (x, y) or (N, Lq, L, 4) boxes (cx, cy, w, h), normalised to
                [0, 1] of the padded feature map (valid ratios already applied). With points, offsets are in
                pixels of each level; with boxes, offsets are scaled by w/2, h/2 divided by P (upstream rule).
            input_flatten: (N, S, C) values, S = sum(H_l * W_l).
            input_spatial_shapes: (L, 2) int64 (H_l, W_l).
            input_level_start_index: (L,) int64.
            input_padding_mask: (N, S) bool, True on padding (those values are zeroed).
            level_shapes: ``input_spatial_shapes`` as Python ints, when the caller has them: the op then reads
                no tensor values (no GPU sync; works on shape-only tensors).

        Returns:
            (N, Lq, C).
        """
        n, lq, _ = query.shape
        s = input_flatten.shape[1]
        m, lvl, p = self.n_heads, self.n_levels, self.n_points
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(n, s, m, self.d_model // m)
        offsets = self.sampling_offsets(query).view(n, lq, m, lvl, p, 2)
        weights = self.attention_weights(query).view(n, lq, m, lvl * p)
        weights = F.softmax(weights, -1).view(n, lq, m, lvl, p)
        if reference_points.shape[-1] == 2:
            normalizer = input_spatial_shapes.flip(-1)  # (W, H) per level
            locations = reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
        elif reference_points.shape[-1] == 4:
            ref = reference_points[:, :, None, :, None]
            locations = ref[..., :2] + offsets / p * ref[..., 2:] * 0.5
        else:
            raise ValueError(f"MSDeformAttn: reference_points last dim must be 2 or 4, got {reference_points.shape}")
        out = ms_deform_attn(
            value.contiguous(),
            input_spatial_shapes,
            input_level_start_index,
            locations.contiguous(),
            weights.contiguous(),
            _im2col_step(n, self.im2col_step),
            level_shapes=level_shapes,
        )
        return self.output_proj(out)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_levels={self.n_levels}, n_heads={self.n_heads}, n_points={self.n_points}"
