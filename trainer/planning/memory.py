"""Predict peak GPU memory of a training step on a machine without a GPU.

GPU memory (:func:`predict_step_memory`)
    The trainer's own step (:mod:`trainer.engine.step`: the task's model, ``build_optimizer``, EMA, autocast, loss,
    backward, optimizer step) runs twice plus one evaluation forward under ``torch._subclasses.FakeTensorMode``:
    every tensor has its real shape, dtype and strides but no data, so ResNet-50 at batch 256 costs seconds of
    CPU and no memory. Live bytes are counted by torch's maintained tracker,
    ``torch.distributed._tools.mem_tracker.MemTracker`` (per category: parameters, buffers, gradients,
    activations, backward temporaries, optimizer state), and by :class:`AllocatorModel`, which replays every
    storage's allocation and release through a model of the CUDA caching allocator
    (:mod:`trainer.planning.allocator`, after c10/cuda/CUDACachingAllocator.cpp: 512-byte blocks; a small pool
    of 2 MiB segments for requests <= 1 MiB, a large pool of 20 MiB segments for 1-10 MiB and 2 MiB-rounded
    segments above; best-fit reuse of cached blocks, splitting and merging; segments never released), so the
    reserved peak includes the allocator's cache and fragmentation. Step two is the steady state (optimizer
    state exists during forward and backward).

    Fake tensors live on the CPU device here: autocast then uses CPU autocast's op lists as a stand-in for CUDA's
    (both run convolutions and matmuls in the low-precision dtype, losses and reductions in fp32), and
    ``FakeTensorMode`` cannot fake CUDA when no CUDA driver is present (autograd asks the driver for a context).

    Included: weights, buffers, gradients, optimizer state, EMA copy, activations saved for backward, backward
    temporaries, input batch and targets, the caching allocator's rounding, cache and fragmentation (segment
    level, as above), DDP's gradient buckets (one fp32 copy of the gradients when world_size > 1; DDP docs,
    ``gradient_as_bucket_view``), the CUDA context (``context_bytes``: the planner passes the target GPU's,
    ``catalog.GpuModel.cuda_context_mib``). Excluded: allocations inside kernels (cuDNN/cuBLAS workspaces
    chosen at run time; benchmark mode can pick algorithms with large workspaces), allocations of ops whose
    fake implementation differs from the CUDA kernel's, the order of frees when it differs from CPython's
    reference counting under fake tensors, torch.compile's different fusion, NCCL's own buffers, pinned host
    memory, ``PYTORCH_CUDA_ALLOC_CONF`` settings (expandable segments, max_split_size_mb, garbage collection),
    the allocator releasing its cache on an imminent out-of-memory.

The loader's and the host's RAM are predicted in :mod:`trainer.planning.host_ram` (arithmetic, no fake tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

import catalog
from trainer.config import TrainConfig
from trainer.engine.distributed import DistInfo
from trainer.engine.precision import Precision, resolve_precision
from trainer.engine.step import build_train_step
from trainer.ops.msda import cuda_kernel_stand_in
from trainer.planning.allocator import AllocatorModel
from trainer.tasks import build_task

#: GPU memory a torch process holds outside the caching allocator (CUDA context, lazily loaded kernels), in bytes,
#: when the target GPU is not known: the largest figure of the catalog (``catalog.GpuModel.cuda_context_mib``,
#: measured on the H100, assumed for the others). The planner uses the figure of the GPU it plans for.
CUDA_CONTEXT_BYTES = max(g.cuda_context_bytes for g in catalog.GPU_MODELS.values())


@dataclass
class MemoryPrediction:
    """Predicted peak device memory of one rank (bytes), with what it includes and excludes."""

    micro_batch: int
    input_size: tuple  # (H, W) pixels of the training batch's images
    precision: str
    world_size: int
    allocated_peak_bytes: int  # compare with torch.cuda.max_memory_allocated()
    reserved_peak_bytes: int  # compare with torch.cuda.max_memory_reserved() (allocator cache included)
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
        "caching allocator cache and fragmentation (segment level, default allocator config)",
        "DDP gradient buckets (world_size > 1)",
        "CUDA context (per GPU model, catalog)",
    )
    excludes: tuple = (
        "cuDNN/cuBLAS workspaces",
        "allocations inside kernels",
        "PYTORCH_CUDA_ALLOC_CONF settings (expandable segments, max_split_size_mb)",
        "cache release on out-of-memory",
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
        context_bytes: CUDA context (bytes) added to ``total_bytes``: the target GPU's
            (``catalog.GPU_MODELS[name].cuda_context_bytes``), :data:`CUDA_CONTEXT_BYTES` when unknown, 0 for a
            CPU comparison.
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
        warnings.simplefilter("ignore")  # torch warns when anything reads a fake tensor's data pointer
        model = task.build_model(num_outputs)  # built as fake tensors: initialisers run on shapes only
        example = task.example_batch(1, image_size=size, num_outputs=num_outputs)
        if "image" in example:  # the image tasks: what the example really is (detection: not square)
            shape = tuple(int(d) for d in example["image"].shape[-2:])
        else:  # clips (B, T, 3, S, S) or cached features: the frame size the task reports
            shape = (size, size) if size else tuple(int(d) for d in task.input_size())
        del example
        if cfg.channels_last:  # Module.to would swap tensors, which fake tensors (weak-referenced) refuse
            for p in model.parameters():
                if p.dim() == 4:
                    p.data = p.data.contiguous(memory_format=torch.channels_last)
        alloc.track([*model.parameters(), *model.buffers()])
        with alloc:
            rig = build_train_step(
                dataclasses.replace(cfg, use_ema=False),  # the EMA copy is held below
                task,
                model,
                cpu,
                precision=prec,
                num_outputs=num_outputs,
                compile_model=False,
                place=False,
            )
            # EMA (AveragedModel): one deep copy of every parameter and buffer, updated in place after each optimizer
            # step (torch._foreach_lerp_), so it costs exactly one clone of each. A deep copy of a fake model is not
            # made: it raises on BatchNorm's remembered num_batches_tracked in torch 2.14 and, worked around, left
            # the fake mode's memory corrupted for the next prediction (a segfault).
            ema_copy = [t.detach().clone() for t in (*model.parameters(), *model.buffers())] if cfg.use_ema else []
        # MemTracker hooks every parameter's gradient and refuses frozen ones (a frozen backbone stem): then the
        # per-category breakdown is left out and the allocator model alone counts.
        frozen = any(not p.requires_grad for p in rig.model.parameters())
        tracker = contextlib.nullcontext() if frozen else MemTracker()
        if not frozen:
            tracker.track_external(*[m for m in (rig.model, rig.optimizer) if m is not None])
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
        del ema_copy
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
