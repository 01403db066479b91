"""DataLoader construction and shutdown that survive stop signals.

systemd (``KillMode=control-group``), ``docker stop`` on a process group and Ctrl-C signal every process,
loader workers included. A worker killed by SIGTERM makes the training process raise "DataLoader worker ...
killed by signal" before it can write its stop checkpoint, so workers ignore SIGTERM/SIGINT
(:func:`ignore_stop_signals`) and end when the loader shuts them down, or within 5 s of their parent's death
(PyTorch's worker watchdog). Because they ignore SIGTERM, ``multiprocessing``'s exit hook (terminate, then
join) would wait for them forever: every iterator made by :func:`iterate` is therefore shut down
gracefully by :func:`shutdown_all`, which also runs at interpreter exit before ``multiprocessing``'s hook.

Workers start from a fork server (:func:`worker_context`), not by forking the training process: a training
process has threads (gloo's, the checkpoint writer, other loaders' queue feeders), and CPython before 3.13 can
leave a child forked from a threaded process deadlocked in its after-fork clean-up (docs/benchmarks.md, "The
fork deadlock").
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from trainer.data.sampler import EpochSampler

_LIVE = weakref.WeakSet()


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PRELOAD = {"__main__", "torch", "torchvision", __name__}


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores SIGTERM and SIGINT (see module doc), then unblocks them.

    A worker starts with both blocked (inherited from the fork server, :func:`worker_context`), because torch's
    worker loop installs a SIGTERM handler that kills the worker before this function runs; a signal that came
    in between is held pending and discarded here."""
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def worker_context(*objects) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context loader workers start from: ``forkserver``.

    ``os.fork`` of the training process runs CPython's after-fork clean-up in the child, which takes the
    runtime's thread-state lock; if another thread held that lock at the fork (a C/C++ thread entering Python
    holds it, without the GIL, while ``PyGILState_Ensure`` makes its thread state), the child waits on it
    forever. CPython 3.11's ``fork`` does not take the lock first (3.13's does; 3.14 made ``forkserver``
    Linux's default start method for this reason). The fork
    server is a fresh single-threaded interpreter, started once per process on first use, that imports torch,
    torchvision, the main script (``python script.py``: under its ``if __name__ == "__main__"`` guard, as
    ``multiprocessing``'s ``spawn`` does; ``python -m trainer`` imports nothing) and the modules of ``objects``
    (the dataset and collate function) before it forks any worker; a worker then receives its dataset pickled.
    Modules named after the server started are imported by each worker instead. The server ignores SIGTERM and
    SIGINT like the workers (importing this module there does it): a signal to the process group must not end
    it, since each worker watches its parent, the server, and stops when it dies; it ends with its last client.
    It also blocks them, so that each worker starts with them blocked (see :func:`ignore_stop_signals`).
    """
    ctx = multiprocessing.get_context("forkserver")
    for o in objects:
        m = getattr(getattr(o, "func", o), "__module__", None)  # a functools.partial names its function's
        if isinstance(m, str):
            _PRELOAD.add(m)
    ctx.set_forkserver_preload(sorted(_PRELOAD))  # the union of every loader's so far: one server serves them all
    return ctx


def start_worker_server() -> None:
    """Start the fork server of :func:`worker_context` now (it imports torch and the preloaded modules, ~3.5 s
    of one core), so that this overlaps the caller's own set-up instead of delaying the first batch. Returns
    at once; a no-op when it runs already."""
    import multiprocessing.forkserver

    multiprocessing.forkserver.ensure_running()


def worker_server_pid() -> Optional[int]:
    """Process id of this process's fork server (:func:`worker_context`), None before it started."""
    import multiprocessing.forkserver

    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


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
    augmentation come from the sampler keys, never from the loader's seed). Workers start from
    :func:`worker_context`; ``dataset`` and ``collate`` must therefore pickle when ``num_workers > 0``.
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
        multiprocessing_context=worker_context(dataset, collate) if num_workers > 0 else None,
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
    (``micro_batch`` per rank, drop_last; evaluation: ``eval_batch``, keep the last) and :func:`build_loader`;
    with workers, their fork server starts here (:func:`start_worker_server`).
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
    if cfg.num_workers > 0:
        start_worker_server()
    return SplitLoaders(train, val, train_order, val_order)


def iterate(loader, before_fork: Optional[Callable[[], object]] = None) -> Iterator:
    """``iter(loader)``, remembered so that :func:`shutdown_all` can stop its workers.

    ``before_fork`` runs first when this call will start worker processes (the first iteration of a persistent
    loader, every iteration of a non-persistent one); the trainer waits there for its checkpoint writer thread.
    That was the first fix for the fork deadlock (a worker forked while that thread held a lock); workers now
    start from the fork server (:func:`worker_context`), which removes the hazard for every thread, and the
    wait is kept as the cheaper half of the old guarantee.
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


def _in_worker_server() -> bool:
    """True in the fork server :func:`worker_context` starts (``python -c "from multiprocessing.forkserver
    import main; ..."``)."""
    return any(a.startswith("from multiprocessing.forkserver import main") for a in getattr(sys, "orig_argv", ()))


if _in_worker_server():
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    for _s in _STOP_SIGNALS:
        signal.signal(_s, signal.SIG_IGN)
