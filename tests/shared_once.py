"""Things a test run makes once and every test module and pytest-xdist worker reads: a folder per key under one
directory of the run (``TRAINSTACK_TEST_RUN``, which ``tests/conftest.py`` sets in the controller before the
pytest-xdist workers start, so they inherit it; else this process's id), filled by the first caller while the others wait on a file lock. Only for what the readers never change
(the synthesized CDK templates, say). ``tests/conftest.py`` removes the directory when the run ends."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def run_dir() -> Path:
    """This test run's shared directory (not created)."""
    run = os.environ.get("TRAINSTACK_TEST_RUN") or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"trainstack-tests-{run}"


def shared_once(key: str, make: Callable[[Path], None]) -> Path:
    """The folder for ``key`` (a short file name: hash long identities), made by ``make(folder)`` the first time
    any worker asks in this test run. A ``make`` that raises leaves no folder behind, so the next caller tries
    again (and fails the same way). Raises ValueError for a key that is not one plain file name of at most
    100 characters."""
    if len(key) > 100 or "/" in key or key in ("", ".", ".."):
        raise ValueError(f"shared_once key {key!r}: expected one file name of at most 100 characters")
    root = run_dir()
    root.mkdir(parents=True, exist_ok=True)
    folder, done = root / key, root / f"{key}.done"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            done.touch()
    return folder
