"""``nn.Module`` form of multi-scale deformable attention (the core sampling op, no projections)."""

from __future__ import annotations

import torch
from torch import nn

from trainer.ops.msda.function import ms_deform_attn


class MultiScaleDeformableAttention(nn.Module):
    """Core op of Deformable DETR / DINO (arXiv 2010.04159) as a module; no parameters.

    The value/offset/attention projections of ``MSDeformAttn`` belong to the model; this module is what its
    forward calls. CUDA kernels on CUDA tensors with the extension built, else the PyTorch reference.

    Args:
        im2col_step: batch chunk of each CUDA launch (DINO default 64); clamped to N, must divide N.
    """

    def __init__(self, im2col_step: int = 64):
        super().__init__()
        self.im2col_step = im2col_step

    def forward(
        self,
        value: torch.Tensor,
        spatial_shapes: torch.Tensor,
        level_start_index: torch.Tensor,
        sampling_locations: torch.Tensor,
        attention_weights: torch.Tensor,
    ) -> torch.Tensor:
        """value (N, S, M, D), spatial_shapes (L, 2) int64 (H, W), level_start_index (L,) int64,
        sampling_locations (N, Lq, M, L, P, 2) (x, y) in [0, 1], attention_weights (N, Lq, M, L, P)
        -> (N, Lq, M*D). Errors as :func:`trainer.ops.msda.function.check_inputs`."""
        return ms_deform_attn(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, self.im2col_step
        )

    def extra_repr(self) -> str:
        return f"im2col_step={self.im2col_step}"
