"""Checked entry point, autograd Function and CUDA/reference dispatch of multi-scale deformable attention.

Interface of DINO's / Deformable DETR's ``MSDeformAttnFunction`` (arXiv 2010.04159), so DINO-family code can
import it instead of compiling their op: ``value`` (N, S, M, D), ``spatial_shapes`` (L, 2) int64 as (H, W),
``level_start_index`` (L,) int64, ``sampling_locations`` (N, Lq, M, L, P, 2) in [0, 1] as (x, y),
``attention_weights`` (N, Lq, M, L, P), ``im2col_step`` (batch chunk of the CUDA launches; clamped to N, must
divide N). Output (N, Lq, M * D). fp32, fp64, fp16 and bf16.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

from trainer.ops.msda.extension import extension_error, load_extension  # noqa: F401 - extension_error re-exported

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_warned = False
_kernel_stand_in = False
_reference_graph = False


def _shape_error(name: str, expected: str, got) -> ValueError:
    return ValueError(f"ms_deform_attn: {name} must be {expected}, got shape {tuple(got)}")


def check_inputs(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    im2col_step: int,
    level_shapes: Optional[Sequence[tuple[int, int]]] = None,
) -> None:
    """Raise a clear error naming the argument when the inputs do not fit the op's contract.

    ``level_shapes``: the (H, W) of ``spatial_shapes`` as Python ints. Given, the level sizes are checked from
    them and the values of ``spatial_shapes``/``level_start_index`` are not read (no device->host copy, so no
    GPU sync per call, and shape-only tensors work); their agreement is the caller's promise.

    Raises:
        TypeError: not a tensor; value/sampling_locations/attention_weights not one of fp32/fp64/fp16/bf16 or
            not the same dtype; spatial_shapes/level_start_index not int64.
        ValueError: wrong rank or sizes; S != sum(H*W); level_start_index not the cumulative level offsets;
            tensors on different devices; a non-contiguous tensor; im2col_step < 1 or not dividing N.
    """
    named = {
        "value": value,
        "spatial_shapes": spatial_shapes,
        "level_start_index": level_start_index,
        "sampling_locations": sampling_locations,
        "attention_weights": attention_weights,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ms_deform_attn: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != value.device:
            raise ValueError(
                f"ms_deform_attn: {name} is on {t.device} but value is on {value.device}; "
                "all inputs must be on one device"
            )
        if not t.is_contiguous():
            raise ValueError(
                f"ms_deform_attn: {name} must be contiguous (call .contiguous()); "
                f"got strides {t.stride()} for shape {tuple(t.shape)}"
            )
    for name in ("value", "sampling_locations", "attention_weights"):
        if named[name].dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"ms_deform_attn: {name} must be float32, float64, float16 or bfloat16, got {named[name].dtype}"
            )
        if named[name].dtype != value.dtype:
            raise TypeError(
                f"ms_deform_attn: {name} is {named[name].dtype} but value is {value.dtype}; "
                "value, sampling_locations and attention_weights must share one dtype"
            )
    for name in ("spatial_shapes", "level_start_index"):
        if named[name].dtype != torch.int64:
            raise TypeError(f"ms_deform_attn: {name} must be int64, got {named[name].dtype}")
    if value.dim() != 4:
        raise _shape_error("value", "(N, S, M, D)", value.shape)
    if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2:
        raise _shape_error("spatial_shapes", "(L, 2) as (H, W) per level", spatial_shapes.shape)
    n, s, m, _ = value.shape
    n_levels = spatial_shapes.shape[0]
    if tuple(level_start_index.shape) != (n_levels,):
        raise _shape_error("level_start_index", f"(L,) = ({n_levels},)", level_start_index.shape)
    loc = sampling_locations.shape
    if len(loc) != 6 or (loc[0], loc[2], loc[3], loc[5]) != (n, m, n_levels, 2):
        raise _shape_error("sampling_locations", f"(N, Lq, M, L, P, 2) = ({n}, Lq, {m}, {n_levels}, P, 2)", loc)
    expected = (n, loc[1], m, n_levels, loc[4])
    if tuple(attention_weights.shape) != expected:
        raise _shape_error("attention_weights", f"(N, Lq, M, L, P) = {expected}", attention_weights.shape)
    if not isinstance(im2col_step, int) or im2col_step < 1:
        raise ValueError(f"ms_deform_attn: im2col_step must be an int >= 1, got {im2col_step!r}")
    if n and n % min(n, im2col_step):
        raise ValueError(f"ms_deform_attn: im2col_step ({im2col_step}) must divide the batch size N ({n})")
    if level_shapes is not None:
        if len(level_shapes) != n_levels:
            raise ValueError(f"ms_deform_attn: level_shapes has {len(level_shapes)} levels, spatial_shapes {n_levels}")
        flat = [int(x) for hw in level_shapes for x in hw]
        flat += [sum(flat[2 * j] * flat[2 * j + 1] for j in range(i)) for i in range(n_levels)]
    else:
        flat = torch.cat([spatial_shapes.flatten(), level_start_index]).tolist()  # one host sync
    hw = [flat[2 * i] * flat[2 * i + 1] for i in range(n_levels)]
    if any(flat[2 * i] < 1 or flat[2 * i + 1] < 1 for i in range(n_levels)):
        raise ValueError(f"ms_deform_attn: spatial_shapes must be positive (H, W) pairs, got {flat[: 2 * n_levels]}")
    if sum(hw) != s:
        raise ValueError(f"ms_deform_attn: value has S={s} positions but spatial_shapes give sum(H*W)={sum(hw)}")
    starts = [sum(hw[:i]) for i in range(n_levels)]
    if flat[2 * n_levels :] != starts:
        raise ValueError(
            f"ms_deform_attn: level_start_index must be {starts} (cumulative H*W of spatial_shapes), "
            f"got {flat[2 * n_levels :]}"
        )


class MSDeformAttnFunction(torch.autograd.Function):
    """Autograd Function over the CUDA kernels (DINO's ``MSDeformAttnFunction.apply`` signature).

    ``apply(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step)``
    returns (N, Lq, M * D). CUDA tensors and a built extension only (the C++ side rejects others with a
    RuntimeError); :func:`ms_deform_attn` is the checked entry point that also falls back to the reference.
    Backward returns gradients for value, sampling_locations and attention_weights (accumulated in fp32 for
    fp16/bf16, fp64 for fp64).
    """

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step):
        ext = load_extension()
        if ext is None:
            raise RuntimeError(f"MSDeformAttnFunction: {extension_error()}")
        ctx.im2col_step = int(im2col_step)
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
        return ext.forward(
            value, spatial_shapes, level_start_index, sampling_locations, attention_weights, ctx.im2col_step
        )

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
        grad_value, grad_loc, grad_attn = load_extension().backward(
            value,
            spatial_shapes,
            level_start_index,
            sampling_locations,
            attention_weights,
            grad_output.contiguous(),
            ctx.im2col_step,
        )
        return grad_value, None, None, grad_loc, grad_attn, None


class _KernelStandIn(torch.autograd.Function):
    """The CUDA kernels' allocations on shape-only tensors: forward allocates the output (N, Lq, M * D) in
    value's dtype and saves only its inputs; backward allocates the three gradients in the accumulation dtype
    (fp32 for fp16/bf16) and casts them to the input dtype, as ``msda_cuda_backward`` (csrc/msda_kernel.cu)."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        n, _, m, d = value.shape
        return value.new_empty(n, sampling_locations.shape[1], m * d)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        grads = []
        for t in ctx.saved_tensors:
            acc = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype
            grads.append(torch.zeros(t.shape, dtype=acc, device=t.device).to(t.dtype))
        return tuple(grads)


@contextlib.contextmanager
def cuda_kernel_stand_in():
    """While active, shape-only inputs (``FakeTensorMode``) go through :class:`_KernelStandIn` instead of the
    PyTorch reference: ``plan``'s GPU-memory prediction runs on fake CPU tensors, where the reference's
    ``grid_sample`` intermediates (several (N*M, D, Lq, P) tensors per level) would be counted although the GPU
    runs the CUDA kernels, which keep none. Tensors with values are unaffected."""
    global _kernel_stand_in
    before, _kernel_stand_in = _kernel_stand_in, True
    try:
        yield
    finally:
        _kernel_stand_in = before


@contextlib.contextmanager
def reference_graph():
    """While active, :func:`ms_deform_attn` runs the PyTorch reference (:func:`ms_deform_attn_reference`) as
    plain ``grid_sample``/``mul``/``sum`` operators instead of the custom operator ``trainstack::ms_deform_attn``,
    on every device and without the fallback warning: exporters (``torch.onnx.export``, ``torch.jit.trace``) then
    record a graph of standard operators (ONNX ``GridSample``, opset >= 16) that runs without our extension.
    Pass ``level_shapes`` so no tensor values are read (the level sizes become constants of the graph)."""
    global _reference_graph
    before, _reference_graph = _reference_graph, True
    try:
        yield
    finally:
        _reference_graph = before


def reference_graph_active() -> bool:
    """Whether :func:`reference_graph` is active (an exporter is tracing the model)."""
    return _reference_graph


def _warn_fallback(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"ms_deform_attn: using the PyTorch reference (slow): {reason}", RuntimeWarning, stacklevel=3)


def _promote_mixed(*tensors):
    """The float tensors cast to their common dtype when they differ (autocast); anything else unchanged."""
    if not all(isinstance(t, torch.Tensor) and t.dtype in FLOAT_DTYPES for t in tensors):
        return tensors
    common = tensors[0].dtype
    for t in tensors[1:]:
        common = torch.promote_types(common, t.dtype)
    return tuple(t if t.dtype == common else t.to(common) for t in tensors)


def ms_deform_attn(
    value: torch.Tensor,
    spatial_shapes: torch.Tensor,
    level_start_index: torch.Tensor,
    sampling_locations: torch.Tensor,
    attention_weights: torch.Tensor,
    im2col_step: int = 64,
    *,
    level_shapes: Optional[Sequence[tuple[int, int]]] = None,
) -> torch.Tensor:
    """Multi-scale deformable attention: CUDA kernels on CUDA tensors, else the reference (one warning), both
    through the custom operator ``torch.ops.trainstack.ms_deform_attn`` (:mod:`trainer.ops.msda.library`: one
    node for ``torch.compile``, a fake implementation for tracing, autograd registered).

    Args:
        value: (N, S, M, D) fp32/fp64/fp16/bf16, S = sum of H*W over levels.
        spatial_shapes: (L, 2) int64, (H, W) of each level in pixels.
        level_start_index: (L,) int64, offset of each level in S (cumulative H*W).
        sampling_locations: (N, Lq, M, L, P, 2), value's dtype, normalised (x, y) in [0, 1] (outside samples
            zeros, like ``grid_sample`` with zero padding, ``align_corners=False``).
        attention_weights: (N, Lq, M, L, P), value's dtype.
        im2col_step: batch chunk per CUDA launch (DINO's argument); clamped to N, must divide N.
        level_shapes: optional (H, W) per level as Python ints, equal to ``spatial_shapes``: saves the
            device->host copy the checks and the reference would make (see :func:`check_inputs`).

    Returns:
        (N, Lq, M * D), value's dtype and device.

    Mixed float dtypes, as DINO produces under autocast (``value`` bf16/fp16 from a Linear, locations and
    weights fp32 from the fp32 reference points and softmax), are promoted to the common dtype
    (``torch.promote_types``, fp32 there) and the output has that dtype: bf16 sampling locations would be off
    by up to ~0.3 px on a 167-pixel level (8 significant bits). Pass all three in bf16 for the bf16 kernels.

    Raises:
        TypeError, ValueError: see :func:`check_inputs` (each message names the argument).
    """
    value, sampling_locations, attention_weights = _promote_mixed(value, sampling_locations, attention_weights)
    if _reference_graph:  # exporters: sizes may be traced values (torch.jit.trace), so no checks here
        from trainer.ops.msda.reference import ms_deform_attn_reference

        shapes = level_shapes if level_shapes is not None else spatial_shapes
        return ms_deform_attn_reference(value, shapes, sampling_locations, attention_weights)
    check_inputs(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step, level_shapes
    )
    if _kernel_stand_in and is_fake(value):
        return _KernelStandIn.apply(value, sampling_locations, attention_weights)
    if not value.is_cuda or load_extension() is None:
        _warn_fallback(f"tensors on {value.device}" if not value.is_cuda else extension_error())
    from trainer.ops.msda.library import ms_deform_attn_op

    flat = [int(x) for hw in level_shapes for x in hw] if level_shapes is not None else []
    return ms_deform_attn_op(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights, int(im2col_step), flat
    )
