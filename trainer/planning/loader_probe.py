"""Loader throughput and host RAM, measured on the trainer's own loader (used by ``probe``).

Images/s after the first batch (worker start-up reported apart) and the workers' added host RAM: the peak
summed private memory (USS = Private_Clean + Private_Dirty of ``/proc/<pid>/smaps_rollup``) of the workers
while they load, and apart the anonymous memory of the fork server they start from (``_workers_bytes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from trainer.config import TrainConfig
from trainer.data.loading import build_loader, iterate, shutdown_all, start_worker_server, worker_server_pid
from trainer.data.sampler import EpochSampler


def proc_kib(path: str, key: str) -> int:
    """Integer value (kB) of ``key`` in a /proc status-style file, 0 if absent."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def uss_bytes(pid: int) -> int:
    """Private memory (USS = ``Private_Clean + Private_Dirty`` of ``/proc/<pid>/smaps_rollup``) of process ``pid``,
    in bytes; 0 if it cannot be read."""
    rollup = f"/proc/{pid}/smaps_rollup"
    return (proc_kib(rollup, "Private_Clean") + proc_kib(rollup, "Private_Dirty")) * 1024


def _workers_bytes(it) -> tuple[int, int]:
    """Host RAM the loader iterator ``it``'s workers add, in bytes: (their summed private memory, USS =
    Private_Clean + Private_Dirty of ``/proc/<pid>/smaps_rollup``; the anonymous memory of the fork server they
    start from, :func:`trainer.data.loading.worker_context`: torch and the dataset's modules, imported there once,
    shared copy-on-write with every worker, there only because there are workers)."""
    total = sum(uss_bytes(w.pid) for w in getattr(it, "_workers", []))
    server = worker_server_pid()
    return total, proc_kib(f"/proc/{server}/smaps_rollup", "Anonymous") * 1024 if server else 0


def _batch_bytes(batch: dict) -> int:
    """Bytes of the tensors in a collated batch (tensors, and lists of tensors such as encoded JPEGs)."""
    total = 0
    for v in batch.values():
        for t in v if isinstance(v, (list, tuple)) else [v]:
            total += t.nbytes if isinstance(t, torch.Tensor) else 0
    return total


def measure_loader(
    dataset,
    collate,
    cfg: TrainConfig,
    batch: int,
    workers: int,
    prefetch: int,
    n_batches: int,
    device_side: Optional[Callable[[dict], object]] = None,
) -> dict:
    """Images/s and host RAM of the trainer's loader over ``n_batches`` batches of ``batch`` images.

    ``device_side``: the part of the input pipeline that runs in the training process on each batch (the
    task's ``train_batch``: with ``decode_device: cuda`` the JPEG decode and crops), timed with the loader
    (CUDA synchronised after each batch); None: the loader alone.

    Returns ``{"num_workers", "prefetch_factor", "images_per_s", "first_batch_s", "workers_private_bytes",
    "worker_server_bytes", "worker_overhead_bytes", "bytes_per_sample", "includes_device_side"}`` (bytes: the
    workers' summed USS peak, their fork server's anonymous memory, USS per worker beyond its batches); images/s
    excludes the first batch (worker start-up); ``bytes_per_sample`` is one decoded image's bytes, or with an
    encoded batch (no ``"image"`` key) its tensor bytes per sample (JPEG bytes, crop rows, worker-decoded
    fallbacks).
    """
    sampler = EpochSampler(len(dataset), 0, 1, shuffle=True, seed=cfg.seed)
    loader = build_loader(
        dataset,
        torch.utils.data.BatchSampler(sampler, batch, drop_last=False),
        collate,
        num_workers=workers,
        prefetch_factor=prefetch,
        pin_memory=False,
        persistent_workers=False,
    )

    def finish(b: dict) -> None:
        if device_side is not None:
            device_side(b)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    t0 = time.perf_counter()
    if workers > 0:
        start_worker_server()  # from this thread, so that the server dies with this process
    it = iterate(loader)
    first = next(it)
    finish(first)
    t1 = time.perf_counter()
    n_first = len(first["label"])
    if "image" in first:  # decoded uint8 (B, 3, h, w)
        sample_bytes = first["image"][0].nbytes if n_first else 0
    else:  # encoded batch: JPEG bytes, crop rows and worker-decoded fallbacks, per sample
        sample_bytes = _batch_bytes(first) // n_first if n_first else 0
    images, priv, server = 0, 0, 0
    for i, b in enumerate(it):
        finish(b)
        images += len(b["label"])
        if workers:
            priv, server = (max(a, m) for a, m in zip((priv, server), _workers_bytes(it)))
        if i + 2 >= n_batches:
            break
    t2 = time.perf_counter()
    if workers:
        priv, server = (max(a, m) for a, m in zip((priv, server), _workers_bytes(it)))
    shutdown_all()
    in_flight = workers * prefetch * batch * sample_bytes
    return {
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "images_per_s": images / max(t2 - t1, 1e-9) if images else n_first / (t1 - t0),
        "first_batch_s": t1 - t0,
        "workers_private_bytes": priv,
        "worker_server_bytes": server,
        "bytes_per_sample": int(sample_bytes),
        "worker_overhead_bytes": int(max(priv - in_flight, 0) / workers) if workers else 0,
        "includes_device_side": device_side is not None,
    }
