"""How often a child forked from a threaded Python process deadlocks, and that loader workers no longer fork.

The hazard behind the shared-run hang (docs/benchmarks.md, "The fork deadlock"): CPython 3.11's ``os.fork``
runs ``PyOS_AfterFork_Child`` in the child, whose ``_PyThreadState_DeleteExcept`` takes the runtime's
thread-state lock; a thread of the parent that held that lock at the fork (a C/C++ thread entering Python:
``PyGILState_Ensure`` creates a thread state under it, without the GIL) leaves the child waiting forever.

``--threads N`` foreign threads (pthreads made with ctypes, each running a Python callback, so each creates a
thread state) run while the main thread:
- ``--mode fork``: forks children that exit at once, for ``--seconds``; a child still alive after 2 s counts as
  deadlocked (killed). Prints ``forks N deadlocked K``.
- ``--mode loader``: iterates :func:`trainer.data.loading.build_loader` loaders with 2 workers, a fresh
  iterator each time, for ``--seconds``; an iterator whose worker does not answer within 20 s counts as
  failed. ``--start-method fork`` makes the same loaders fork this process, as they did before the fork
  server. Prints ``iterators N failed K``.

Usage: ``python benchmarks/fork_deadlock.py --mode fork --threads 4 --seconds 60``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_libc = ctypes.CDLL(None)
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@_CALLBACK
def _enter_python(arg):
    return None


def _foreign_threads_forever() -> None:
    tid = ctypes.c_ulong()
    while True:
        _libc.pthread_create(ctypes.byref(tid), None, _enter_python, None)
        _libc.pthread_join(tid, None)


def _fork_children(seconds: float) -> tuple[int, int]:
    n = deadlocked = 0
    end = time.time() + seconds
    while time.time() < end:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        n += 1
        for _ in range(200):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.01)
        else:
            deadlocked += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    return n, deadlocked


def _iterate_loaders(seconds: float, start_method: str) -> tuple[int, int]:
    import torch
    from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset

    from trainer.data.loading import build_loader

    ds = TensorDataset(torch.arange(8.0))
    n = failed = 0
    end = time.time() + seconds
    while time.time() < end:
        loader = build_loader(
            ds,
            BatchSampler(SequentialSampler(ds), 4, drop_last=False),
            torch.utils.data.default_collate,
            num_workers=2,
            prefetch_factor=1,
            pin_memory=False,
            persistent_workers=False,
        )
        loader.timeout = 20
        if start_method == "fork":  # the loader before the fork server
            loader.multiprocessing_context = "fork"
        try:
            assert sum(len(b[0]) for b in loader) == 8
        except RuntimeError:
            failed += 1
        n += 1
    return n, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["fork", "loader"], default="fork")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument(
        "--start-method",
        choices=["server", "fork"],
        default="server",
        help="loader mode: the trainer's fork server, or forking this process as before",
    )
    ap.add_argument("--switch-interval", type=float, default=1e-5, help="sys.setswitchinterval, seconds")
    a = ap.parse_args()
    if a.mode == "loader":
        import torch  # noqa: F401  (imported before the threads start, as in a trainer)
    sys.setswitchinterval(a.switch_interval)
    for _ in range(a.threads):
        threading.Thread(target=_foreign_threads_forever, daemon=True).start()
    if a.mode == "fork":
        n, bad = _fork_children(a.seconds)
        print(f"python {sys.version.split()[0]} threads {a.threads}: forks {n} deadlocked {bad}", flush=True)
    else:
        n, bad = _iterate_loaders(a.seconds, a.start_method)
        print(f"python {sys.version.split()[0]} threads {a.threads} {a.start_method}: iterators {n} failed {bad}")
    os._exit(0)


if __name__ == "__main__":
    main()
