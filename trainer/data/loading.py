"""DataLoader construction and shutdown that survive stop signals.

systemd (``KillMode=control-group``), ``docker stop`` on a process group and Ctrl-C signal every process,
loader workers included. A worker killed by SIGTERM makes the training process raise "DataLoader worker ...
killed by signal" before it can write its stop checkpoint, so workers ignore SIGTERM/SIGINT
(:func:`ignore_stop_signals`) and end when the loader shuts them down, or within 5 s of their parent's death
(PyTorch's worker watchdog). Because they ignore SIGTERM, ``multiprocessing``'s exit hook (terminate, then
join) would wait for them forever: every iterator made by :func:`iterate` is therefore shut down
gracefully by :func:`shutdown_all`, which also runs at interpreter exit before ``multiprocessing``'s hook.
"""

from __future__ import annotations

import atexit
import signal
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from trainer.data.sampler import EpochSampler

_LIVE = weakref.WeakSet()


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores SIGTERM and SIGINT (see module doc)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def build_loader(
    dataset: Dataset,
    batch_sampler: Sampler,
    collate: Callable,
    *,
    num_workers: int,
    prefetch_factor: int,
    pin_memory: bool,
    persistent_workers: bool,
) -> DataLoader:
    """``torch.utils.data.DataLoader`` over ``batch_sampler`` with stop-signal-safe workers.

    The loader gets a private ``torch.Generator``: otherwise every ``iter(loader)`` draws its base seed from
    torch's global generator, which would shift the MixUp/CutMix stream of a resumed run (data order and
    augmentation come from the sampler keys, never from the loader's seed).
    """
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        collate_fn=collate,
        generator=torch.Generator(),
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )


@dataclass
class SplitLoaders:
    """This rank's loaders and their orders. ``train_order``/``val_order`` have ``set_epoch(epoch, start=0)``
    and ``len()`` = samples of this rank per epoch (:class:`trainer.data.sampler.EpochSampler`, or a format's
    own order such as FFCV's)."""

    train: Iterable
    val: Iterable
    train_order: object
    val_order: object


def build_split_loaders(cfg, info, data, micro_batch: int, eval_batch: int) -> SplitLoaders:
    """The train and val loaders of a task's data for one rank, whatever the format.

    ``data``: a :class:`trainer.tasks.base.TaskData`; when it brings its own ``loaders`` (FFCV) those are used,
    otherwise a seeded :class:`EpochSampler` (shuffled for training, sharded by rank) feeds a ``BatchSampler``
    (``micro_batch`` per rank, drop_last; evaluation: ``eval_batch``, keep the last) and :func:`build_loader`.
    ``cfg``: the config (loader fields and seed); ``info``: the rank's DistInfo. Raises ConfigError from the
    format (e.g. an FFCV order that does not support several processes).
    """
    if data.loaders is not None:
        train, val = data.loaders(cfg, info, data.train, data.val, micro_batch, eval_batch)
        return SplitLoaders(train, val, train.order, val.order)
    train_order = EpochSampler(len(data.train), info.rank, info.world_size, shuffle=True, seed=cfg.seed)
    val_order = EpochSampler(len(data.val), info.rank, info.world_size, shuffle=False)
    kw = dict(
        num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor,
        persistent_workers=cfg.persistent_workers,
        pin_memory=cfg.pin_memory and info.device.type == "cuda",
    )
    train = build_loader(data.train, BatchSampler(train_order, micro_batch, drop_last=True), data.collate, **kw)
    val_collate = data.val_collate or data.collate
    val = build_loader(data.val, BatchSampler(val_order, eval_batch, drop_last=False), val_collate, **kw)
    return SplitLoaders(train, val, train_order, val_order)


def iterate(loader, before_fork: Optional[Callable[[], object]] = None) -> Iterator:
    """``iter(loader)``, remembered so that :func:`shutdown_all` can stop its workers.

    ``before_fork`` runs first when this call will fork worker processes (the first iteration of a persistent
    loader, every iteration of a non-persistent one): forking while another thread holds a lock (a checkpoint
    being written in the background) can leave the child deadlocked on that lock, so the caller waits for
    such threads there.
    """
    forks = getattr(loader, "num_workers", 0) > 0 and (  # any iterable works; only DataLoaders fork
        not loader.persistent_workers or getattr(loader, "_iterator", None) is None
    )
    if before_fork is not None and forks:
        before_fork()
    it = iter(loader)
    if hasattr(it, "_shutdown_workers"):
        _LIVE.add(it)
    return it


def shutdown_all() -> None:
    """Gracefully stop the workers of every live iterator made by :func:`iterate`."""
    for it in list(_LIVE):
        it._shutdown_workers()  # torch's own graceful path (sentinel to each worker, then join)
        _LIVE.discard(it)


atexit.register(shutdown_all)
