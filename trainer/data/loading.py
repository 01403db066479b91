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
from typing import Callable, Iterator, Optional

import torch


from torch.utils.data import DataLoader, Dataset, Sampler

_LIVE = weakref.WeakSet()


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores SIGTERM and SIGINT (see module doc)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def build_loader(dataset: Dataset, batch_sampler: Sampler, collate: Callable, *, num_workers: int,
                 prefetch_factor: int, pin_memory: bool, persistent_workers: bool) -> DataLoader:
    """``torch.utils.data.DataLoader`` over ``batch_sampler`` with stop-signal-safe workers.

    The loader gets a private ``torch.Generator``: otherwise every ``iter(loader)`` draws its base seed from
    torch's global generator, which would shift the MixUp/CutMix stream of a resumed run (data order and
    augmentation come from the sampler keys, never from the loader's seed).
    """
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate,
                      generator=torch.Generator(),
                      worker_init_fn=ignore_stop_signals if num_workers > 0 else None, pin_memory=pin_memory,
                      persistent_workers=persistent_workers and num_workers > 0,
                      prefetch_factor=prefetch_factor if num_workers > 0 else None)


def iterate(loader, before_fork: Optional[Callable[[], object]] = None) -> Iterator:
    """``iter(loader)``, remembered so that :func:`shutdown_all` can stop its workers.

    ``before_fork`` runs first when this call will fork worker processes (the first iteration of a persistent
    loader, every iteration of a non-persistent one): forking while another thread holds a lock (a checkpoint
    being written in the background) can leave the child deadlocked on that lock, so the caller waits for
    such threads there.
    """
    forks = getattr(loader, "num_workers", 0) > 0 and (  # any iterable works; only DataLoaders fork
        not loader.persistent_workers or getattr(loader, "_iterator", None) is None)
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


