"""Loader throughput and host RAM, measured on the trainer's own loader (used by ``probe``).

Images/s after the first batch (worker start-up reported apart) and the workers' added host RAM: the peak
summed private memory (USS = Private_Clean + Private_Dirty of ``/proc/<pid>/smaps_rollup``) of this process's
children while they load. Pages shared with the parent after fork are not counted: they exist anyway.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from trainer.config import TrainConfig
from trainer.data.loading import build_loader, iterate, shutdown_all
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


def _children_private_bytes() -> int:
    """Sum of the private (USS: Private_Clean + Private_Dirty) bytes of this process's children: what the
    workers add to the host; pages shared with the parent after fork exist anyway."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split() if (task / "children").exists() else []:
            rollup = f"/proc/{pid}/smaps_rollup"
            total += (proc_kib(rollup, "Private_Clean") + proc_kib(rollup, "Private_Dirty")) * 1024
    return total


def measure_loader(dataset, collate, cfg: TrainConfig, batch: int, workers: int, prefetch: int, n_batches: int) -> dict:
    """Images/s and host RAM of the trainer's loader over ``n_batches`` batches of ``batch`` images.

    Returns ``{"num_workers", "prefetch_factor", "images_per_s", "first_batch_s", "workers_private_bytes",
    "worker_overhead_bytes", "bytes_per_sample"}``; images/s excludes the first batch (worker start-up).
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
    t0 = time.perf_counter()
    it = iterate(loader)
    first = next(it)
    t1 = time.perf_counter()
    images, priv, sample_bytes = 0, 0, first["image"][0].nbytes if len(first["image"]) else 0
    for i, b in enumerate(it):
        images += len(b["image"])
        priv = max(priv, _children_private_bytes()) if workers else priv
        if i + 2 >= n_batches:
            break
    t2 = time.perf_counter()
    priv = max(priv, _children_private_bytes()) if workers else 0
    shutdown_all()
    in_flight = workers * prefetch * batch * sample_bytes
    return {
        "num_workers": workers,
        "prefetch_factor": prefetch,
        "images_per_s": images / max(t2 - t1, 1e-9) if images else len(first["image"]) / (t1 - t0),
        "first_batch_s": t1 - t0,
        "workers_private_bytes": priv,
        "bytes_per_sample": int(sample_bytes),
        "worker_overhead_bytes": int(max(priv - in_flight, 0) / workers) if workers else 0,
    }
