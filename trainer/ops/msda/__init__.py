"""Multi-scale deformable attention (Deformable DETR, arXiv 2010.04159; DINO's MultiScaleDeformableAttention).

- :func:`ms_deform_attn` checked entry point: CUDA kernels (fp32/fp64/fp16/bf16) on CUDA tensors when the
  extension is built (``images/build_msda.sh``), else the PyTorch reference with one RuntimeWarning.
- :class:`MSDeformAttnFunction`, :func:`ms_deform_attn_core_pytorch`: DINO's names, drop-in for its code.
- :class:`MultiScaleDeformableAttention`: the same op as an ``nn.Module``.
- :func:`cuda_kernel_stand_in`: shape-only stand-in with the kernels' allocations (GPU-memory prediction).
- :func:`reference_graph`: the reference as plain operators, for exporters (ONNX, TorchScript).
"""

from trainer.ops.msda.function import (
    MSDeformAttnFunction,
    check_inputs,
    cuda_kernel_stand_in,
    extension_error,
    load_extension,
    ms_deform_attn,
    reference_graph,
)
from trainer.ops.msda.module import MultiScaleDeformableAttention
from trainer.ops.msda.reference import ms_deform_attn_reference

ms_deform_attn_core_pytorch = ms_deform_attn_reference  # DINO's name for the reference

__all__ = [
    "MSDeformAttnFunction",
    "MultiScaleDeformableAttention",
    "check_inputs",
    "cuda_kernel_stand_in",
    "extension_error",
    "load_extension",
    "ms_deform_attn",
    "ms_deform_attn_core_pytorch",
    "ms_deform_attn_reference",
    "reference_graph",
]
