"""Child processes that die with their parent, whatever ends it (SIGKILL and the OOM killer included).

Linux ``prctl(PR_SET_PDEATHSIG, sig)`` (prctl(2)): the calling process gets ``sig`` when its parent dies. Two
rules of that call shape every use here:

* The "parent" is the *thread* that created the child: the signal is sent when that thread exits, even if the
  parent process lives on. A child must therefore be started from a thread that lives as long as its process,
  in practice the main thread (its exit is the process's exit); a child started from any other thread is not
  armed (the callers check :func:`started_from_main_thread`).
* A parent that died before the ``prctl`` sends nothing: after arming, the child compares ``getppid()`` with the
  parent's pid it was given, and if they differ sends itself the signal at once.

The setting survives ``exec`` (of a non-set-user-ID program), so a ``preexec_fn`` or the first lines of the
child's own code can arm it. Off Linux nothing is armed.
"""

from __future__ import annotations

import os
import sys
import threading
from functools import lru_cache
from typing import Optional

#: ``prctl`` option: the signal the calling process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


@lru_cache(maxsize=1)
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def started_from_main_thread() -> bool:
    """Whether a child started now would be armed safely: the calling thread is the main thread (module doc)."""
    return threading.current_thread() is threading.main_thread()


def load() -> Optional[object]:
    """Load libc now (in the parent, before a fork: a ``preexec_fn`` must not load a library). None off Linux."""
    return _libc() if sys.platform.startswith("linux") else None


def die_with_parent(sig: int, parent_pid: int) -> bool:
    """Arm this process to get ``sig`` when its parent (pid ``parent_pid``, the thread that started it) dies; if
    the parent is gone already (``getppid() != parent_pid``), send ``sig`` to this process now. Returns whether
    it was armed (False off Linux or when ``prctl`` fails)."""
    if not sys.platform.startswith("linux"):
        return False
    if _libc().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True
