"""Durable file primitives of the checkpoint writers: atomic writes (temporary file, fsync, rename, directory
fsync), ``torch.save`` streamed to disk with its size and SHA-256, and the OS error behind a failed write.

Used by :mod:`trainer.engine.checkpoint` (the manager and the writer thread) and by
:mod:`trainer.engine.checkpoint_writer` (the writer process), which therefore import this module and not each
other. Readers of a file written here see the old file or the new one, never a part (POSIX ``rename``).

One writer per run: :class:`WriterLock` is the exclusive lock a training run holds on its checkpoint folder
(``flock`` on :data:`LOCK_FILE` inside it), and :func:`lock_holder` says who holds it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from trainer.errors import CheckpointError, error_detail

#: Bytes :func:`explain_write_failure` tries to append to find the OS error behind a failed torch.save.
_PROBE_BYTES = 1 << 20


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames inside it survive a power loss (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + rename (readers see the old or the new file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_torch_save(obj: Any, path: Path) -> dict:
    """``torch.save`` straight to a temporary file, fsync, rename; returns ``{"bytes", "sha256"}``.

    Saving to a path lets torch's C++ writer stream the tensors to disk; saving into ``io.BytesIO`` first
    held the GIL for the whole copy and stalled the training thread while a checkpoint was written.

    Raises:
        OSError: the write failed (also when torch reports it as a ``RuntimeError``: see
            :func:`explain_write_failure`). The temporary file is removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        try:
            torch.save(obj, tmp)
        except RuntimeError as e:
            cause = explain_write_failure(tmp, _tensor_bytes(obj))
            if cause is None:
                raise
            raise cause from e
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        meta = {"bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return meta


def explain_write_failure(path: Path, needed: int) -> Optional[OSError]:
    """The ``OSError`` behind a write to ``path`` that torch's C++ writer reported only as a ``RuntimeError``.

    Appends up to 1 MiB to ``path`` (which the caller deletes afterwards) and fsyncs it: a full disk, a file
    size limit (``RLIMIT_FSIZE``, with SIGXFSZ ignored), a quota or an I/O error fail again there with their
    errno. If that write succeeds, ``statvfs`` is asked whether ``needed`` bytes would still fit (ENOSPC if
    not). Returns None when neither finds a cause (the ``RuntimeError`` was not about the disk).
    """
    try:
        with open(path, "ab") as f:
            f.write(bytes(min(_PROBE_BYTES, max(needed, 1))))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return OSError(e.errno, e.strerror, str(path))
    try:
        st = os.statvfs(Path(path).parent)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < needed:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def _tensor_bytes(obj: Any) -> int:
    """Bytes of all tensor data in a state tree (what :func:`torch.save` has to write, at least)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def describe_os_error(e: BaseException) -> str:
    """``"No space left on device (ENOSPC)"`` for an ``OSError``, ``"Type: message"`` for anything else."""
    if isinstance(e, OSError) and e.errno:
        return f"{e.strerror or os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
    return error_detail(e, 300)


def sha256_file(path: Path | BinaryIO) -> str:
    """Hex SHA-256 of a file (a path, or a binary file open for reading, hashed from where it stands to its end),
    read in 4 MiB chunks."""
    if not isinstance(path, (str, os.PathLike)):
        return _sha256_of(path)
    with open(path, "rb") as f:
        return _sha256_of(f)


def _sha256_of(f: BinaryIO) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 22), b""):
        h.update(chunk)
    return h.hexdigest()


#: The lock file a training run holds inside its checkpoint folder (:class:`WriterLock`).
LOCK_FILE = "writer.lock"
#: Further tries of a refused ``flock`` before the folder counts as written by another run (0.05 s, 0.1 s, ...).
_BUSY_TRIES = 4


def _read_holder(path: Path) -> dict:
    """The ``{"pid", "host", "started"}`` a holder wrote into the lock file (``{}`` when unreadable)."""
    try:
        holder = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: dict) -> str:
    """``"pid 4242 on host ip-10-0-0-5 since 2026-11-28T06:30:00Z"`` (``"an unknown process"`` when empty)."""
    if not holder:
        return "an unknown process"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('started', '?')}"


class WriterLock:
    """The exclusive lock of the one process that writes a checkpoint folder (a training run's rank 0).

    ``flock(LOCK_EX | LOCK_NB)`` on ``<directory>/writer.lock``; the holder writes ``{"pid", "host", "started"}``
    (started: UTC, ISO 8601) into the file so that a refused writer can name it. The kernel releases the lock when
    the holder's last file descriptor closes, so a process that dies (SIGKILL, OOM, a lost node's fencing) leaves
    no stale lock, whatever the file still says. :meth:`release` deletes the file while it still holds the lock;
    :meth:`acquire` therefore checks, once it holds a lock, that the path still names the file it locked
    (and tries again otherwise).

    A lock belongs to a file, not to its name: a lock file deleted (or replaced) while held lets the next run
    create a new one and lock that. The holder therefore remembers the file it locked (device and inode) and
    :meth:`check` (at every checkpoint, and at the end) fails when the path names another file or none;
    :meth:`release` deletes the path only while it still names the holder's own file. A lock file that cannot be
    opened for writing (another user's, left by a run that is gone) is opened read-only to ask whether anyone
    holds it: if not, it is stale and replaced (the folder being writable); otherwise the message names its
    holder and owner.

    Where it works: local disks and EBS (one kernel), and Amazon FSx for Lustre, whose clients mount with the
    ``flock`` option (coherent across all client nodes: mount.lustre(8); the AWS guide's mount command uses it:
    https://docs.aws.amazon.com/fsx/latest/LustreGuide/mounting-ec2-instance.html). A Lustre client mounted
    ``localflock`` locks only within its own node; one mounted ``noflock`` fails ``flock`` with ENOSYS, and so do
    some network file systems: :meth:`acquire` then returns a note and the run goes on unguarded.

    Forked children (loader workers forked after the lock was taken) share its file description, so the lock
    lasts until they too have exited; the checkpoint writer process is started with ``exec`` and does not.
    """

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK_FILE
        self._fd: Optional[int] = None
        self._file: Optional[tuple[int, int]] = None  # (st_dev, st_ino) of the file this object locked

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> Optional[str]:
        """Take the lock; returns None, or a one-line note when the file system cannot lock (the run goes on).

        Raises:
            CheckpointError: another process holds it (the message names its pid, host and start time), or the
                lock file cannot be created, or a stale one of another user cannot be replaced.
        """
        busy = 0
        while self._fd is None:
            fd, writable = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) and busy < _BUSY_TRIES:
                    busy += 1  # a reader's momentary shared lock (lock_holder) lasts microseconds
                    time.sleep(0.05 * busy)
                    continue
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(
                        f"checkpoint_dir: {self.path.parent} is being written by another run: "
                        f"{describe_holder(_read_holder(self.path))} (lock {self.path}); wait for it to end or stop "
                        "it, or give this run another checkpoint_dir"
                    ) from None
                return (
                    f"checkpoint: {self.path.parent} cannot be locked ({describe_os_error(e)}: a file system "
                    "mounted without flock support); nothing stops a second run from writing it"
                )
            st = os.fstat(fd)
            if not _names(self.path, st):  # released and deleted by its previous holder between our open and flock
                os.close(fd)
                continue
            if not writable:  # nobody holds this read-only (another user's) file: stale, replaced while we lock it
                self._replace_stale(fd, st)
                continue
            self._fd, self._file = fd, (st.st_dev, st.st_ino)
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, record, 0)
        return None

    def _open(self) -> tuple[int, bool]:
        """(file descriptor of the lock file, whether it is open for writing): created if missing; opened
        read-only when it exists but cannot be opened for writing (another user's)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), True
        except OSError as e:
            err = e
        if err.errno == errno.EACCES:
            try:
                return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC), False
            except OSError:
                pass
            try:
                owner = os.stat(self.path).st_uid
            except OSError:
                owner = None
            if owner is not None and owner != os.geteuid():
                raise CheckpointError(
                    f"checkpoint_dir: the lock file {self.path} belongs to uid {owner} and cannot be opened "
                    f"({describe_os_error(err)}), so whether a run holds it cannot be told; delete it if no run "
                    "writes this folder, or give this run another checkpoint_dir"
                ) from None
        raise CheckpointError(
            f"checkpoint_dir: cannot create the lock file {self.path}: {describe_os_error(err)}; "
            "choose a writable folder"
        ) from None

    def _replace_stale(self, fd: int, st: os.stat_result) -> None:
        """Delete the stale lock file ``fd`` (locked by us, so no second newcomer deletes a fresh one) and close
        it; :meth:`acquire` then creates a new one. Raises CheckpointError naming it when it cannot be deleted."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CheckpointError(
                f"checkpoint_dir: the lock file {self.path} is held by uid {st.st_uid}, "
                f"{describe_holder(_read_holder(self.path))}, stale: no process holds its lock, but it cannot be "
                f"replaced ({describe_os_error(e)}); delete it, or give this run another checkpoint_dir"
            ) from None
        finally:
            os.close(fd)

    def check(self) -> None:
        """Raise CheckpointError when the lock file this object holds was deleted or replaced (then another run
        may be writing the folder: the message names the pid and host in the new file, when there is one).
        No-op when nothing is held."""
        if self._fd is None or self._file is None:
            return
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        except OSError:
            return  # cannot tell (a network file system's hiccup): the next check asks again
        if st is not None and (st.st_dev, st.st_ino) == self._file:
            return
        if st is None:
            what = "was deleted while this run held it"
        else:
            newcomer = _read_holder(self.path)
            who = describe_holder(newcomer) if newcomer else "no process named in it"
            what = f"was replaced while this run held it (now: {who})"
        raise CheckpointError(
            f"checkpoint_dir: the lock file {self.path} {what}; another run may be writing {self.path.parent}, "
            "so this run stops here: its checkpoints so far are complete; stop the other run, or give one of "
            "them another checkpoint_dir"
        )

    def release(self) -> None:
        """Delete the lock file (only while the path still names the file this object locked: never another
        run's) and let go of the lock (idempotent)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        mine, self._file = self._file, None
        try:
            st = os.stat(self.path)
            if mine is not None and (st.st_dev, st.st_ino) == mine:
                self.path.unlink()
        except OSError:
            pass
        os.close(fd)


def _names(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` still names the file whose ``fstat`` is ``st``."""
    try:
        return os.path.samestat(st, os.stat(path))
    except FileNotFoundError:
        return False


def lock_holder(directory: str | Path) -> Optional[dict]:
    """Who writes the checkpoint folder ``directory`` now: the holder's ``{"pid", "host", "started"}`` (``{}``
    when it wrote none yet), or None when no process holds :class:`WriterLock` there (or it cannot be asked).
    Takes no lock that a writer could wait for: a shared ``flock`` tried once and let go at once."""
    path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return _read_holder(path)
        return None
    finally:
        os.close(fd)
    return None
