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
fork deadlock"). ``python -m trainer train`` makes that server a fork of itself taken at its start, while it has
no other thread (:func:`fork_worker_server`); elsewhere the server is a fresh interpreter.

None of them outlives the training process, whatever ends it (SIGKILL and the OOM killer included): the server
gets SIGKILL when the training process dies, and each worker when the server dies (Linux ``PR_SET_PDEATHSIG``,
:mod:`trainer.parent_death`). Without that, SIGKILL of the training process left the server, its workers and
``multiprocessing``'s resource tracker alive for good: each worker holds the server's liveness pipe (so the
server never sees its last client go) and watches only its own parent, the server; the tracker ends when the
last holder of its pipe, a worker, has. The server is armed only when started from the main thread (the signal
follows the thread that started it: :func:`start_worker_server`); the tracker is not armed (when its pipe
closes it unlinks what the dead processes left, which a death signal would skip).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from trainer import parent_death
from trainer.data.sampler import EpochSampler

_LIVE = weakref.WeakSet()


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PRELOAD = {"__main__", "torch", "torchvision", __name__}
_FORKED: set = set()  # pids of worker servers started by fork_worker_server
#: Environment variable that hands a fresh worker server the pid of the process (main thread) that started it.
_PARENT_ENV = "TRAINSTACK_WORKER_SERVER_PARENT"
_SERVER_PID: Optional[int] = None  # in the worker server and its workers: the server's pid


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores SIGTERM and SIGINT (see module doc), then unblocks them.

    A worker starts with both blocked (inherited from the fork server, :func:`worker_context`), because torch's
    worker loop installs a SIGTERM handler that kills the worker before this function runs; a signal that came
    in between is held pending and discarded here.

    The worker also gets SIGKILL when the server, its parent, dies (module doc)."""
    if _SERVER_PID is not None:
        parent_death.die_with_parent(signal.SIGKILL, _SERVER_PID)
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def worker_context(*objects) -> multiprocessing.context.BaseContext:
    """The ``multiprocessing`` context loader workers start from: ``forkserver``.

    ``os.fork`` of the training process runs CPython's after-fork clean-up in the child, which takes the runtime's
    thread-state lock; if another thread held that lock at the fork (a C/C++ thread entering Python holds it,
    without the GIL, while ``PyGILState_Ensure`` makes its thread state), the child waits on it forever. CPython
    3.11's ``fork`` does not take the lock first (3.13's does; 3.14 made ``forkserver`` Linux's default start method
    for this reason). The fork server is a single-threaded process, one per training process: a fork of it taken at
    its start (:func:`fork_worker_server`), or else a fresh interpreter started on first use that imports torch,
    torchvision, the main script (``python script.py``: under its ``if __name__ == "__main__"`` guard, as
    ``multiprocessing``'s ``spawn`` does; ``python -m trainer`` imports nothing) and the modules of ``objects`` (the
    dataset and collate function) before it forks any worker; a worker then receives its dataset pickled. Modules
    named after the server started are imported by each worker instead. The server ignores SIGTERM and SIGINT like
    the workers (importing this module there, or the fork, does it): a signal to the process group must not end it,
    since each worker watches its parent, the server, and stops when it dies; it ends with its last client. It also
    blocks them, so that each worker starts with them blocked (see :func:`ignore_stop_signals`).
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
    at once; a no-op when it runs already. Called from the main thread, the server dies with this process
    (module doc); from another thread it is not armed (the thread's exit would kill it)."""
    import multiprocessing.forkserver

    os.environ[_PARENT_ENV] = str(os.getpid()) if parent_death.started_from_main_thread() else ""
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(_PARENT_ENV, None)


def fork_worker_server() -> bool:
    """Start the fork server of :func:`worker_context` as a fork of this process, not as a fresh interpreter.

    A fresh server imports torch, torchvision and the preloaded modules again: ~3.5 s of one core and ~370 MiB
    of its own memory per training process (docs/benchmarks.md, "The fork deadlock"). A fork of a process that
    imported them already starts in milliseconds and shares their pages copy-on-write. The fork is only safe
    while no other thread can enter Python (module doc), so this is for the very start of a training process,
    before its process group, loaders, logger threads or CUDA exist: ``python -m trainer train`` calls it there
    (:func:`trainer.engine.run.run`). ``multiprocessing`` still runs the server (its own ``forkserver.main``
    loop, listener, liveness pipe and preload list): only the ``exec`` of a new interpreter is replaced by
    ``os.fork`` (:func:`_fork_passfds`), for this one start.

    Returns True when the server now runs as a fork of this process; False, changing nothing, when a server runs
    already, another Python thread is alive, CUDA is initialised or the OS is not Linux (the child lists its
    descriptors in ``/proc``): the first loader with workers then starts the fresh one
    (:func:`start_worker_server`).
    """
    import multiprocessing.forkserver
    import multiprocessing.util
    import threading

    if sys.platform != "linux" or worker_server_pid() is not None:
        return False
    if threading.active_count() > 1 or torch.cuda.is_initialized():
        return False
    worker_context()
    spawn = multiprocessing.util.spawnv_passfds
    multiprocessing.util.spawnv_passfds = _fork_passfds
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = spawn
    _FORKED.add(worker_server_pid())
    return True


def _fork_passfds(path: str, args: list[str], passfds) -> int:
    """``multiprocessing.util.spawnv_passfds``'s contract (run ``args`` = ``[python, ..., "-c", code]`` with only
    stdin/stdout/stderr and ``passfds`` open; return its pid), kept by forking this process and running ``code``
    in the child. Every other descriptor is closed there, and every object alive at the fork is exempt from the
    garbage collector (``gc.freeze``), so no stale file object can later close a descriptor number reused by the
    server. The child never returns: ``os._exit`` with the code's exit status (its parent's ``atexit`` handlers
    are not its own)."""
    import gc

    code = args[args.index("-c") + 1]
    keep = {0, 1, 2, *passfds}
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        gc.freeze()
        for fd in {int(n) for n in os.listdir("/proc/self/fd")} - keep:
            try:
                os.close(fd)
            except OSError:
                pass
        if "multiprocessing.forkserver" in code:  # the server, not the resource tracker
            _serve_stop_signals_blocked()
            parent_death.die_with_parent(signal.SIGKILL, parent)
        exec(compile(code, "<multiprocessing server>", "exec"), {"__name__": "__mp_server__"})
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(status)


def worker_server_pid() -> Optional[int]:
    """Process id of this process's fork server (:func:`worker_context`), None before it started."""
    import multiprocessing.forkserver

    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def worker_server_note(num_workers: int) -> str:
    """The run log's line on where ``num_workers`` loader workers start from: the server's pid and whether it is
    a fork of this process (:func:`fork_worker_server`) or a fresh interpreter."""
    pid = worker_server_pid()
    how = "a fork of this process" if pid in _FORKED else "a fresh interpreter" if pid else "not started yet"
    return f"loader: {num_workers} worker(s) per loader, started from a fork server: {how} (pid {pid})"


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
    :func:`worker_context`; ``dataset`` and ``collate`` must therefore pickle when ``num_workers > 0``. Call
    :func:`start_worker_server` once the loaders are built: a server that the first iteration starts is not
    armed to die with this process (that may be another thread than the main one).
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
    notes: list = field(default_factory=list)  #: lines for the run's log (where the workers start from)


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
    notes = []
    if cfg.num_workers > 0:
        start_worker_server()
        notes.append(worker_server_note(cfg.num_workers))
    return SplitLoaders(train, val, train_order, val_order, notes)


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


def _serve_stop_signals_blocked() -> None:
    """The worker server's signal set-up (:func:`worker_context`): SIGTERM and SIGINT blocked and ignored; its
    pid kept for its workers (:func:`ignore_stop_signals`)."""
    global _SERVER_PID
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    for s in _STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    _SERVER_PID = os.getpid()


def _is_fresh_server() -> bool:
    """True in the fresh-interpreter server itself, False in a worker forked from it (a worker holds the server's
    liveness descriptor, set before it unpickles anything that could import this module)."""
    import multiprocessing.forkserver

    return multiprocessing.forkserver._forkserver._forkserver_alive_fd is None


if _in_worker_server():
    if _is_fresh_server():
        _serve_stop_signals_blocked()
        _parent = os.environ.pop(_PARENT_ENV, "")
        if _parent.isdigit():  # started from its parent's main thread (start_worker_server)
            parent_death.die_with_parent(signal.SIGKILL, int(_parent))
    else:  # a worker importing this module for the first time: set up like the server's workers
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        for _s in _STOP_SIGNALS:
            signal.signal(_s, signal.SIG_IGN)
