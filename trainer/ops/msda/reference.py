"""Pure-PyTorch multi-scale deformable attention: the specification the CUDA kernels are tested against.

Deformable DETR (Zhu et al., arXiv 2010.04159, eq. 3), as in DINO's ``ms_deform_attn_core_pytorch``:
bilinear sampling with ``F.grid_sample(mode="bilinear", padding_mode="zeros", align_corners=False)``, so a
normalised location ``(x, y)`` in [0, 1] samples pixel position ``(x * W - 0.5, y * H - 0.5)`` and the
grid is zero outside. Runs on any device and dtype that ``grid_sample`` supports; autograd differentiates it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def as_size(n):
    """``n`` as a Python int, or kept as it is when it is a ``torch.SymInt`` (torch.export tracing a dynamic
    height or width: ``int()`` would specialise the exported graph to the example's size)."""
    return n if isinstance(n, torch.SymInt) else int(n)


def ms_deform_attn_reference(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor | Sequence[tuple[int, int]],
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
) -> torch.Tensor:
    """Multi-scale deformable attention by ``grid_sample``; no argument checks (see ``ms_deform_attn``).

    Args:
        value: (N, S, M, D) float; S = sum over levels of H_l * W_l, levels stacked in order, row-major.
        spatial_shapes: (L, 2) int64, (H_l, W_l) per level in pixels.
        sampling_locations: (N, Lq, M, L, P, 2), normalised (x, y); [0, 1] spans the level's grid.
        attention_weights: (N, Lq, M, L, P), same dtype as value (usually softmax over L * P).

    Returns:
        (N, Lq, M * D) tensor, value's dtype: per query and head, the attention-weighted sum of the L * P
        bilinear samples, heads concatenated (head m occupies channels m*D .. m*D+D-1).
    """
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    pairs = spatial_shapes.tolist() if isinstance(spatial_shapes, torch.Tensor) else spatial_shapes
    shapes = [(as_size(h), as_size(w)) for h, w in pairs]
    value_list = value.split([h * w for h, w in shapes], dim=1)
    grids = 2 * sampling_locations - 1  # grid_sample's [-1, 1] convention
    samples = []
    for lvl, (h, w) in enumerate(shapes):
        # (N, H*W, M, D) -> (N*M, D, H, W)
        value_l = value_list[lvl].flatten(2).transpose(1, 2).reshape(n * m, d, h, w)
        # (N, Lq, M, P, 2) -> (N*M, Lq, P, 2)
        grid_l = grids[:, :, :, lvl].transpose(1, 2).flatten(0, 1)
        samples.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False))
    # (N, Lq, M, L, P) -> (N*M, 1, Lq, L*P)
    weights = attention_weights.transpose(1, 2).reshape(n * m, 1, lq, n_levels * n_points)
    out = (torch.stack(samples, dim=-2).flatten(-2) * weights).sum(-1).view(n, m * d, lq)
    return out.transpose(1, 2).contiguous()


def ms_deform_attn_reference_backward(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor | Sequence[tuple[int, int]],
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    grad_output: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`ms_deform_attn_reference` without autograd (what the op's backward runs off CUDA).

    With ``out = sum_{l, p} w[l, p] * S_l[p]`` per query and head, ``S_l = grid_sample(value_l, 2 * loc_l - 1)``:
    ``dL/dw[l, p] = <grad_out, S_l[p]>`` over the D channels (the samples are recomputed), and ``value`` and the
    locations get ``aten::grid_sampler_2d_backward`` of ``grad_out * w[l, p]`` (times 2 for the locations, from the
    grid's [-1, 1] convention).

    Args:
        value, spatial_shapes, sampling_locations, attention_weights: as the forward.
        grad_output: (N, Lq, M * D), value's dtype.

    Returns:
        (grad_value (N, S, M, D), grad_sampling_locations (N, Lq, M, L, P, 2), grad_attention_weights
        (N, Lq, M, L, P)), each in its input's dtype, contiguous.
    """
    n, _, m, d = value.shape
    _, lq, _, n_levels, n_points, _ = sampling_locations.shape
    pairs = spatial_shapes.tolist() if isinstance(spatial_shapes, torch.Tensor) else spatial_shapes
    shapes = [(as_size(h), as_size(w)) for h, w in pairs]
    value_list = value.split([h * w for h, w in shapes], dim=1)
    grids = 2 * sampling_locations - 1
    grad = grad_output.transpose(1, 2).reshape(n * m, d, lq, 1)
    weights = attention_weights.transpose(1, 2).reshape(n * m, 1, lq, n_levels, n_points)
    grad_values, grad_grids, grad_weights = [], [], []
    for lvl, (h, w) in enumerate(shapes):
        value_l = value_list[lvl].flatten(2).transpose(1, 2).reshape(n * m, d, h, w)
        grid_l = grids[:, :, :, lvl].transpose(1, 2).flatten(0, 1)
        samples = F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False)
        grad_weights.append((grad * samples).sum(1))  # (N*M, Lq, P)
        grad_value_l, grad_grid_l = torch.ops.aten.grid_sampler_2d_backward(
            grad * weights[:, :, :, lvl], value_l, grid_l, 0, 0, False, [True, True]
        )
        grad_values.append(grad_value_l.reshape(n, m * d, h * w).transpose(1, 2).reshape(n, h * w, m, d))
        grad_grids.append(grad_grid_l.view(n, m, lq, n_points, 2))
    grad_value = torch.cat(grad_values, 1).contiguous()
    grad_loc = (2 * torch.stack(grad_grids, 3)).transpose(1, 2).contiguous()
    grad_attn = torch.stack(grad_weights, 2).view(n, m, lq, n_levels, n_points).transpose(1, 2).contiguous()
    return grad_value, grad_loc.to(sampling_locations.dtype), grad_attn.to(attention_weights.dtype)
