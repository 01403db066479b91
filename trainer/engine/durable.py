"""Durable file primitives of the checkpoint writers: atomic writes (temporary file, fsync, rename, directory
fsync), ``torch.save`` streamed to disk with its size and SHA-256, and the OS error behind a failed write.

Used by :mod:`trainer.engine.checkpoint` (the manager and the writer thread) and by
:mod:`trainer.engine.checkpoint_writer` (the writer process), which therefore import this module and not each
other. Readers of a file written here see the old file or the new one, never a part (POSIX ``rename``).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import torch

from trainer.errors import error_detail

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


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
