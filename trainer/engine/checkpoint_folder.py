"""The writer's housekeeping of a checkpoint folder, around the writes themselves.

Opening a folder to write in (:func:`check_writable`, :func:`remove_stale_temporaries`: what a killed run left),
retention (:func:`prune`: which checkpoints a folder keeps) and the one line a failed write becomes
(:func:`write_error`). Separate from :mod:`trainer.engine.checkpoint` (:class:`CheckpointManager`: staging, the
writer thread or process, assembling one checkpoint and moving ``latest``), which calls these on rank 0; none of
them writes a checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from trainer.engine.durable import describe_os_error
from trainer.errors import CheckpointError

_TMP_FILE = re.compile(r"^\.(.+)\.tmp-\d+$")  # atomic_* temporary name -> the file it becomes
_STALE_POINTER_TMP = re.compile(r"^\.(latest|best|interrupted\.json)\.tmp-\d+$")


def check_writable(directory: Path) -> None:
    """Create ``directory`` and write, fsync and delete a probe file in it.

    Raises:
        CheckpointError: it exists and is not a folder, cannot be created, or a file cannot be written in it.
    """
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"checkpoint_dir: {directory} exists and is not a folder; choose a folder for checkpoints"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint_dir: cannot create {directory}: {describe_os_error(e)}"
            + (f" at {e.filename}" if e.filename and str(e.filename) != str(directory) else "")
            + "; choose a writable folder"
        ) from None
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"trainstack")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(
            f"checkpoint_dir: cannot write in {directory}: {describe_os_error(e)}; choose a writable folder"
        ) from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass


def remove_stale_temporaries(directory: Path) -> None:
    """Delete what a write killed mid-way (SIGKILL, power loss) left in ``directory``: ``.tmp-ckpt-*`` folders and
    the temporary files of the ``latest``, ``best`` and ``interrupted.json`` pointers. Call it holding the folder's
    writer lock."""
    for stale in directory.glob(".tmp-ckpt-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in directory.iterdir():
        if _STALE_POINTER_TMP.match(stale.name):
            stale.unlink(missing_ok=True)


def write_error(directory: Path, name: str, progress: dict, e: OSError, latest: Optional[str]) -> CheckpointError:
    """One line for the checkpoint ``name`` of ``directory`` that could not be written: the OS error ``e``, what
    is still on disk (``latest``: the name the ``latest`` pointer holds, or None) and what to do."""
    where = " writing " + _TMP_FILE.sub(r"\1", Path(e.filename).name) if e.filename else ""
    kept = (
        f"the previous checkpoint {directory / latest} is intact and 'latest' still points to it"
        if latest
        else "no earlier checkpoint exists in this folder"
    )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        todo = f"free space in {directory} (or choose another checkpoint_dir)"
    elif e.errno == errno.EFBIG:
        todo = "raise the file size limit (ulimit -f) or choose another checkpoint_dir"
    else:
        todo = f"fix {directory} (or choose another checkpoint_dir)"
    err = CheckpointError(
        f"{directory / name}: cannot write this checkpoint (global step "
        f"{progress.get('global_step')}): {describe_os_error(e)}{where}; {kept}. "
        f"To go on, {todo} and run the same command again"
    )
    err.__cause__ = e
    return err


def prune(directory: Path, found: list[Path], keep: set, keep_last: int, keep_every: int) -> None:
    """Delete the checkpoints of ``found`` (newest first, :meth:`CheckpointDirectory.list`) that nothing keeps:
    not named in ``keep`` (the ``latest`` and ``best`` pointers), not among the newest ``keep_last`` complete ones
    (counted by global step: the mid-epoch checkpoint written before an evaluation is the same step as the epoch
    end after it, which supersedes it), not an epoch end that ``keep_every`` (epochs) keeps. Folders without a
    manifest (incomplete, foreign) are left alone and count for nothing. Each is renamed to
    ``.tmp-<name>-pruned`` before it is deleted: a reader (:meth:`CheckpointDirectory.read_newest`) then finds
    it whole or not at all, never half deleted."""
    keep = set(keep)
    steps: set[str] = set()
    for d in found:  # at one step the epoch end comes before its ``-m`` twin
        step = d.name.removesuffix("-m")
        if len(steps) < keep_last and step not in steps and (d / "manifest.json").is_file():
            steps.add(step)
            keep.add(d.name)
    for d in found:
        if d.name in keep:
            continue
        try:
            prog = json.loads((d / "manifest.json").read_text())["progress"]
        except (OSError, ValueError, KeyError):
            continue  # not ours to judge: leave incomplete/foreign folders alone
        if prog.get("step_in_epoch", 0) == 0 and prog.get("epoch", 0) % keep_every == 0:
            continue
        # renamed out of the way first (one atomic step), so a reader sees the whole checkpoint or none of it
        gone = directory / f".tmp-{d.name}-pruned"
        try:
            os.replace(d, gone)
        except OSError:
            gone = d
        shutil.rmtree(gone, ignore_errors=True)
