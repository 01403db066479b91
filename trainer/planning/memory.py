"""Predict peak GPU memory of a training step, and the loader's host RAM, on a machine without a GPU.

GPU memory (:func:`predict_step_memory`)
    The trainer's own step (:mod:`trainer.engine.step`: the task's model, ``build_optimizer``, EMA, autocast, loss,
    backward, optimizer step) runs twice plus one evaluation forward under ``torch._subclasses.FakeTensorMode``:
    every tensor has its real shape, dtype and strides but no data, so ResNet-50 at batch 256 costs seconds of
    CPU and no memory. Live bytes are counted by torch's maintained tracker,
    ``torch.distributed._tools.mem_tracker.MemTracker`` (per category: parameters, buffers, gradients,
    activations, backward temporaries, optimizer state), and by :class:`AllocatorModel`, which applies the CUDA
    caching allocator's rules to every live storage (c10/cuda/CUDACachingAllocator.cpp: sizes rounded up to
    512-byte blocks; requests <= 1 MiB served from 2 MiB segments, 1-10 MiB from 20 MiB segments, larger ones
    rounded up to 2 MiB). Step two is the steady state (optimizer state exists during forward and backward).

    Fake tensors live on the CPU device here: autocast then uses CPU autocast's op lists as a stand-in for CUDA's
    (both run convolutions and matmuls in the low-precision dtype, losses and reductions in fp32), and
    ``FakeTensorMode`` cannot fake CUDA when no CUDA driver is present (autograd asks the driver for a context).

    Included: weights, buffers, gradients, optimizer state, EMA copy, activations saved for backward, backward
    temporaries, input batch and targets, allocator rounding, DDP's gradient buckets (one fp32 copy of the
    gradients when world_size > 1; DDP docs, ``gradient_as_bucket_view``), the CUDA context (a constant, below).
    Excluded: cuDNN/cuBLAS workspaces chosen at run time (benchmark mode can pick algorithms with large
    workspaces), allocator fragmentation beyond segment rounding, torch.compile's different fusion, NCCL's
    own buffers, pinned host memory.

Loader host RAM (:func:`predict_loader_ram`)
    Seed 002's formula, with measured inputs: ``num_workers x prefetch_factor`` batches in flight, each
    ``micro_batch x bytes_per_sample`` (decoded uint8 tensors, 3 x H x W bytes, not seed 002's float32), plus
    ``num_workers x worker_overhead_bytes`` (a forked worker's private memory, USS, measured by ``probe``), per rank.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from trainer.config import TrainConfig
from trainer.engine.distributed import DistInfo
from trainer.engine.precision import Precision, resolve_precision
from trainer.engine.step import build_train_step
from trainer.ops.msda import cuda_kernel_stand_in
from trainer.tasks import build_task

MIB, GIB = 1024**2, 1024**3

#: CUDA context + cuBLAS/cuDNN handles of a torch process on one GPU, in bytes. Documented estimate (CUDA 12/13
#: on Ampere/Hopper: 400-600 MiB as reported by nvidia-smi for an idle torch process after its first
#: convolution); not measured in this repository yet: ``benchmarks/memory_prediction.py --device cuda``
#: prints the measured figure (``torch.cuda.mem_get_info`` before and after initialisation) to replace it.
CUDA_CONTEXT_BYTES = 600 * MIB

#: Private memory (USS) of one forked loader worker beyond the batches it holds, in bytes: 17.3-22.3 MiB measured
#: by ``python -m trainer probe`` on CPU-2 (imagenette subset, 112 px, 1-2 workers; docs/planning.md), rounded
#: up. The default when no probe report gives a measured figure.
WORKER_OVERHEAD_BYTES = 24 * MIB

_BLOCK, _SMALL, _SMALL_SEG, _MID, _MID_SEG, _LARGE_ROUND = 512, MIB, 2 * MIB, 10 * MIB, 20 * MIB, 2 * MIB


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class AllocatorModel(TorchDispatchMode):
    """Dispatch mode that counts live tensor storages the way the CUDA caching allocator would hold them.

    ``allocated`` = sum of live block sizes (each rounded up to 512 B): what ``torch.cuda.memory_allocated``
    reports. ``reserved`` = the segments those blocks need (small blocks pooled in 2 MiB segments, 1-10 MiB
    blocks pooled in 20 MiB segments, larger blocks rounded up to 2 MiB), without fragmentation: a lower
    estimate of ``torch.cuda.memory_reserved``. Peaks of both are kept (bytes). Storages are found on every
    op's outputs and released through weak-reference callbacks, as MemTracker does.
    """

    def __init__(self):
        super().__init__()
        self._live = WeakIdKeyDictionary()
        self._sums = [0, 0, 0]  # small (<= 1 MiB), mid (1-10 MiB), large (> 10 MiB), rounded to 512 B
        self._large_reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    @property
    def allocated(self) -> int:
        return sum(self._sums)

    @property
    def reserved(self) -> int:
        return _round_up(self._sums[0], _SMALL_SEG) + _round_up(self._sums[1], _MID_SEG) + self._large_reserved

    def _change(self, size: int, sign: int) -> None:
        block = _round_up(max(size, 1), _BLOCK)
        kind = 0 if block <= _SMALL else 1 if block <= _MID else 2
        self._sums[kind] += sign * block
        if kind == 2:
            self._large_reserved += sign * _round_up(block, _LARGE_ROUND)

    def track(self, tensors) -> None:
        """Count the storages of ``tensors`` (an iterable of tensors, e.g. parameters made before entering)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self._live and st.nbytes() > 0:
                    size = st.nbytes()
                    self._live[st] = size
                    self._change(size, +1)
                    torch.utils.weak.weakref.finalize(st, self._change, size, -1)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_flatten(out)[0])
        return out


@dataclass
class MemoryPrediction:
    """Predicted peak device memory of one rank (bytes), with what it includes and excludes."""

    micro_batch: int
    input_size: tuple  # (H, W) pixels of the training batch's images
    precision: str
    world_size: int
    allocated_peak_bytes: int  # compare with torch.cuda.max_memory_allocated()
    reserved_peak_bytes: int  # compare with torch.cuda.max_memory_reserved() (fragmentation excluded)
    ddp_bucket_bytes: int
    cuda_context_bytes: int
    breakdown_at_peak: dict = field(default_factory=dict)  # MemTracker category -> bytes (unrounded)
    seconds: float = 0.0
    includes: tuple = (
        "weights",
        "buffers",
        "gradients",
        "optimizer state",
        "EMA copy",
        "activations",
        "backward temporaries",
        "input batch",
        "512 B block / segment rounding",
        "DDP gradient buckets (world_size > 1)",
        "CUDA context (constant)",
    )
    excludes: tuple = (
        "cuDNN/cuBLAS workspaces",
        "allocator fragmentation",
        "torch.compile fusion",
        "NCCL buffers",
        "pinned host memory",
    )

    @property
    def total_bytes(self) -> int:
        """What the process holds on the GPU: reserved peak + DDP buckets + CUDA context (bytes)."""
        return self.reserved_peak_bytes + self.ddp_bucket_bytes + self.cuda_context_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        d["includes"], d["excludes"] = list(self.includes), list(self.excludes)
        return d


def target_precision(cfg: TrainConfig, gpu_bf16: bool = True) -> Precision:
    """The precision the trainer resolves on a GPU with (``gpu_bf16``) or without bf16 support.

    Mirrors :func:`trainer.engine.precision.resolve_precision` for ``amp`` on CUDA (bf16 on Ampere+, fp16 +
    GradScaler before); the explicit choices are resolved by that function itself.
    """
    if cfg.precision != "amp":
        return resolve_precision(cfg.precision, torch.device("cpu"))
    if gpu_bf16:
        return Precision("bf16-mixed", torch.bfloat16, False)
    return Precision("16-mixed", torch.float16, True)


def predict_step_memory(
    cfg: TrainConfig,
    micro_batch: int,
    *,
    num_outputs: int = 1000,
    image_size: Optional[int] = None,
    gpu_bf16: bool = True,
    world_size: int = 1,
    precision: Optional[Precision] = None,
    context_bytes: int = CUDA_CONTEXT_BYTES,
    eval_batch: Optional[int] = None,
    cuda_kernels: bool = True,
) -> MemoryPrediction:
    """Predict one rank's peak GPU memory for ``cfg`` at ``micro_batch`` images per forward (see module doc).

    Args:
        cfg: validated config (model, optimizer, EMA, precision, channels_last, clip, accumulation).
        micro_batch: images per forward/backward on one GPU (>= 1).
        num_outputs: classes of the model head (ImageNet: 1000).
        image_size: training resolution in pixels (default: the task's :meth:`~trainer.tasks.base.Task.input_size`,
            e.g. ``cfg.image_size`` square, the largest progressive size; detection max_scale x max_size).
        gpu_bf16: whether the target GPU supports bf16 (catalog ``GpuModel.bf16``), for ``precision: amp``.
        world_size: DDP processes; > 1 adds DDP's gradient buckets.
        precision: force a resolved precision (e.g. fp32 to compare with a CPU measurement).
        context_bytes: CUDA context constant added to ``total_bytes`` (0 for a CPU comparison).
        eval_batch: evaluation batch per rank (default ``cfg.eval_batch_size`` or 2 x micro_batch).
        cuda_kernels: count our CUDA ops' allocations (:func:`trainer.ops.msda.cuda_kernel_stand_in`), as a GPU
            runs them; False counts their PyTorch reference, to compare with a CPU measurement.
    Returns:
        :class:`MemoryPrediction` (bytes). Takes about 1 s per 64 ResNet-50 images on 2 CPU cores.
    Raises:
        ValueError: micro_batch < 1. ConfigError: unknown model.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    size = image_size or None
    prec = precision or target_precision(cfg, gpu_bf16)
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    task = build_task(cfg, DistInfo(0, 0, 1, cpu))
    alloc = AllocatorModel()
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")  # deepcopy of fake tensors (EMA) warns about data pointers
        model = task.build_model(num_outputs)  # built as fake tensors: initialisers run on shapes only
        example = task.example_batch(1, image_size=size, num_outputs=num_outputs)
        shape = tuple(int(d) for d in example["image"].shape[-2:])
        del example
        if cfg.channels_last:  # Module.to would swap tensors, which fake tensors (weak-referenced) refuse
            for p in model.parameters():
                if p.dim() == 4:
                    p.data = p.data.contiguous(memory_format=torch.channels_last)
        alloc.track([*model.parameters(), *model.buffers()])
        with alloc:
            rig = build_train_step(
                cfg,
                task,
                model,
                cpu,
                precision=prec,
                num_outputs=num_outputs,
                compile_model=False,
                place=False,
            )
        # MemTracker hooks every parameter's gradient and refuses frozen ones (a frozen backbone stem): then the
        # per-category breakdown is left out and the allocator model alone counts.
        frozen = any(not p.requires_grad for p in rig.model.parameters())
        tracker = contextlib.nullcontext() if frozen else MemTracker()
        if not frozen:
            tracker.track_external(*[m for m in (rig.model, rig.optimizer, rig.ema) if m is not None])
        kernels = cuda_kernel_stand_in() if cuda_kernels else contextlib.nullcontext()
        with alloc, tracker, kernels:
            for _ in range(2):
                x = rig.example_batch(micro_batch, size)
                rig.step(x, use_scaler=False)
                del x
                if not frozen:
                    tracker.reset_mod_stats()
            x = rig.example_batch(eval_batch or cfg.eval_batch_size or 2 * micro_batch, size, train=False)
            rig.eval_forward(x)
            del x
        peak = {} if frozen else tracker.get_tracker_snapshot("peak").get(cpu, {})
        grad_bytes = sum(p.numel() * 4 for p in rig.model.parameters() if p.requires_grad)
    return MemoryPrediction(
        micro_batch=micro_batch,
        input_size=shape,
        precision=prec.name,
        world_size=world_size,
        allocated_peak_bytes=alloc.peak_allocated,
        reserved_peak_bytes=alloc.peak_reserved,
        ddp_bucket_bytes=grad_bytes if world_size > 1 else 0,
        cuda_context_bytes=context_bytes,
        breakdown_at_peak={str(getattr(k, "value", k)): int(v) for k, v in peak.items()},
        seconds=time.perf_counter() - t0,
    )


@dataclass
class LoaderRamPrediction:
    """Host RAM of one rank's DataLoader (bytes): seed 002's buffer formula plus worker overhead."""

    micro_batch: int
    num_workers: int
    prefetch_factor: int
    bytes_per_sample: int
    worker_overhead_bytes: int
    bytes_per_sample_source: str
    worker_overhead_source: str

    @property
    def batches_in_flight(self) -> int:
        return self.num_workers * self.prefetch_factor if self.num_workers else 1

    @property
    def buffer_bytes(self) -> int:
        return self.batches_in_flight * self.micro_batch * self.bytes_per_sample

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes + self.num_workers * self.worker_overhead_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(batches_in_flight=self.batches_in_flight, buffer_bytes=self.buffer_bytes, total_bytes=self.total_bytes)
        return d


def predict_loader_ram(
    micro_batch: int,
    image_size: int | tuple[int, int],
    num_workers: int,
    prefetch_factor: int,
    *,
    bytes_per_sample: Optional[int] = None,
    worker_overhead_bytes: Optional[int] = None,
) -> LoaderRamPrediction:
    """Host RAM of one rank's loader: ``workers x prefetch x micro_batch x bytes_per_sample + workers x overhead``.

    Source: seed 002 ("Total RAM buffer = num_workers x prefetch_factor x batch_memory"), with the batch in the
    trainer's format (uint8, 3 x H x W bytes per image, ``image_size`` = side or (H, W), unless a measured
    ``bytes_per_sample`` is given)
    and the per-worker overhead (measured by ``probe``, else :data:`WORKER_OVERHEAD_BYTES`). ``num_workers=0``
    loads in the training process: one batch, no workers. Multiply by the ranks of a host for the host's RAM.
    """
    measured = bytes_per_sample is not None
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    return LoaderRamPrediction(
        micro_batch,
        num_workers,
        prefetch_factor,
        int(bytes_per_sample if measured else 3 * h * w),
        int(WORKER_OVERHEAD_BYTES if worker_overhead_bytes is None else worker_overhead_bytes),
        "measured (probe)" if measured else "3 x H x W uint8 (the loader's batch format)",
        "measured (probe)" if worker_overhead_bytes is not None else "WORKER_OVERHEAD_BYTES default (CPU-2)",
    )
