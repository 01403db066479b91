"""Process-group set-up from torchrun's environment (also multi-node rendezvous), and small collectives.

torchrun (``torch.distributed.run``) sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` for every worker; a plain ``python -m trainer train`` has none of them and runs as a single
process. Backend: NCCL when training on CUDA, gloo on CPU. No launcher of our own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global ``rank`` of ``world_size``, ``local_rank`` on its host, its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the only rank that prints, writes logs and writes shared checkpoint files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is in use."""
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r}: expected an integer (set by torchrun)") from None


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """Pick the device: ``cuda:<local_rank>`` when CUDA is available (or asked for), else CPU.

    Raises:
        ConfigError: ``cuda`` was requested but no CUDA device is visible, or local_rank exceeds the GPUs.
    """
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ConfigError(
            f"device: 'cuda' requested but no CUDA device is visible{hint} "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
            "use --device cpu or --device auto"
        )
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise ConfigError(
            f"device: LOCAL_RANK={local_rank} but only {n} CUDA device(s) are visible; "
            f"start at most {n} process(es) per host (torchrun --nproc-per-node {n})"
        )
    return torch.device("cuda", local_rank)


def init(requested_device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Initialise the default process group if torchrun started us with WORLD_SIZE > 1.

    Returns the :class:`DistInfo` of this process. Safe to call when a group already exists.

    Raises:
        ConfigError: a torchrun variable is not an integer, or the device cannot be used (:func:`resolve_device`).
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = resolve_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def shutdown() -> None:
    """Destroy the process group if one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks in place and return it (no-op in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj, src: int = 0):
    """Return rank ``src``'s ``obj`` on every rank (pickled; for small control data only)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
