"""Multi-scale deformable attention as a PyTorch custom operator, ``torch.ops.trainstack.ms_deform_attn``.

Registered with ``torch.library.custom_op`` (PyTorch's custom-operator API, torch >= 2.4) so that one op serves
every device and ``torch.compile`` sees it as a single opaque node instead of breaking its graph at it:

- the CUDA kernels of ``csrc/`` on CUDA tensors when the extension is built, the PyTorch reference otherwise
  (grid_sample forward, :func:`~trainer.ops.msda.reference.ms_deform_attn_reference_backward` backward);
- a fake (meta) implementation giving the output's shape, dtype and device, for tracing and FakeTensorMode;
- autograd through ``trainstack::ms_deform_attn_backward``, itself a custom op with the same two implementations.

The checked entry point is :func:`trainer.ops.msda.ms_deform_attn`; this module holds no argument checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from trainer.ops.msda.extension import load_extension
from trainer.ops.msda.reference import ms_deform_attn_reference, ms_deform_attn_reference_backward


def _extension():
    return load_extension()


def _shapes(spatial_shapes: Tensor, level_shapes: Sequence[int]):
    """(H, W) pairs from the flat ``level_shapes`` ints when given (no device read), else the tensor."""
    if level_shapes:
        return [(level_shapes[2 * i], level_shapes[2 * i + 1]) for i in range(len(level_shapes) // 2)]
    return spatial_shapes


@torch.library.custom_op("trainstack::ms_deform_attn", mutates_args=())
def ms_deform_attn_op(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    im2col_step: int,
    level_shapes: list[int],
) -> Tensor:
    """value (N, S, M, D), spatial_shapes (L, 2) int64, level_start_index (L,) int64, sampling_locations
    (N, Lq, M, L, P, 2), attention_weights (N, Lq, M, L, P), one float dtype; ``level_shapes``: the (H, W) pairs
    flattened as Python ints, or [] -> (N, Lq, M * D) in value's dtype."""
    ext = _extension() if value.is_cuda else None
    if ext is not None:
        return ext.forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step)
    shapes = _shapes(spatial_shapes, level_shapes)
    return ms_deform_attn_reference(value, shapes, sampling_locations, attention_weights)


@ms_deform_attn_op.register_fake
def _fake_forward(
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step, level_shapes
):
    n, _, m, d = value.shape
    return value.new_empty(n, sampling_locations.shape[1], m * d)


@torch.library.custom_op("trainstack::ms_deform_attn_backward", mutates_args=())
def ms_deform_attn_backward_op(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    grad_output: Tensor,
    im2col_step: int,
    level_shapes: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (value, sampling_locations, attention_weights) of :func:`ms_deform_attn_op`, their inputs'
    shapes and dtypes (the CUDA kernels accumulate fp16/bf16 in fp32)."""
    ext = _extension() if value.is_cuda else None
    if ext is not None:
        gv, gl, ga = ext.backward(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, grad_output, im2col_step
        )
        return gv, gl, ga
    shapes = _shapes(spatial_shapes, level_shapes)
    return ms_deform_attn_reference_backward(value, shapes, sampling_locations, attention_weights, grad_output)


@ms_deform_attn_backward_op.register_fake
def _fake_backward(
    value,
    spatial_shapes,
    level_start_index,
    sampling_locations,
    attention_weights,
    grad_output,
    im2col_step,
    level_shapes,
):
    return torch.empty_like(value), torch.empty_like(sampling_locations), torch.empty_like(attention_weights)


def _setup_context(ctx, inputs, output) -> None:
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step, level_shapes = inputs
    ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    ctx.im2col_step, ctx.level_shapes = im2col_step, level_shapes


def _backward(ctx, grad_output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
    gv, gl, ga = ms_deform_attn_backward_op(
        value,
        spatial_shapes,
        level_start_index,
        sampling_locations,
        attention_weights,
        grad_output.contiguous(),
        ctx.im2col_step,
        ctx.level_shapes,
    )
    return gv, None, None, gl, ga, None, None


ms_deform_attn_op.register_autograd(_backward, setup_context=_setup_context)
