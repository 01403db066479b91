"""Precision policy: which autocast dtype, whether a GradScaler is needed, TF32."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """Resolved precision: ``dtype`` for autocast (None = fp32, no autocast) and ``use_scaler`` (fp16)."""

    name: str
    dtype: torch.dtype | None
    use_scaler: bool

    def autocast(self, device: torch.device):
        """``torch.autocast`` context for ``device``, or a no-op in fp32."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """Map the config's ``precision`` to a :class:`Precision`.

    ``amp``: bf16 on CUDA devices that support it (Ampere+), fp16 + GradScaler on older GPUs, fp32 on CPU
    (CPU autocast is slower than fp32 for convolutions on most hosts, so it is only used when asked for).
    """
    if requested == "32":
        return Precision("fp32", None, False)
    if requested == "bf16-mixed":
        return Precision("bf16-mixed", torch.bfloat16, False)
    if requested == "16-mixed":
        return Precision("16-mixed", torch.float16, True)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision("bf16-mixed", torch.bfloat16, False)
        return Precision("16-mixed", torch.float16, True)
    return Precision("fp32", None, False)


def set_cudnn_benchmark(device: torch.device, static_shapes: bool) -> None:
    """cuDNN benchmark mode (autotune each convolution shape once, then run the fastest algorithm) on CUDA when
    the task's batches have static shapes (``Task.static_input_shapes``); off otherwise. The chosen algorithms
    may differ from run to run, so GPU runs are not bit-reproducible with it (they are not without it either:
    cuDNN's default backward algorithms are non-deterministic); CPU runs are unaffected."""
    torch.backends.cudnn.benchmark = device.type == "cuda" and static_shapes


def set_tf32(enabled: bool) -> None:
    """Allow (or forbid) TF32 tensor-core math for fp32 matmul and cuDNN convolutions (Ampere and newer)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
