"""What a checkpoint directory holds and how it is read: names, the RNG state, validation against the manifest,
finding the checkpoint to resume from, and loading (no writing: :mod:`trainer.engine.checkpoint`).

On-disk format (``FORMAT_VERSION`` 1), one directory per checkpoint::

    <checkpoint_dir>/
      ckpt-000001234/          epoch-end checkpoint at global optimizer step 1234
      ckpt-000001300-m/        mid-epoch checkpoint (stop request or periodic) at step 1300, or the last step
                               of an epoch, written before its evaluation (step_in_epoch == steps per epoch;
                               pruned once the epoch-end ckpt-000001300 is ``latest``)
        state.pt               model, optimizer, scheduler, grad scaler, EMA, progress, config, fingerprint
        ranks.pt               per-rank state: {"ranks": [{"rng": {python, numpy, torch, cuda}, ...}, ...]}
        manifest.json          format version, progress, the task name, and {file: {bytes, sha256}} for every file above
      latest                   text: name of the newest complete checkpoint
      best                     text: name of the checkpoint with the best primary metric

Loading uses ``torch.load(weights_only=True)``. Readers (``predict``, ``export``, ``evaluate``, ``resume_from`` of
another run) use :class:`CheckpointDirectory` alone and take no lock: they follow ``latest``, which names only
complete checkpoints, and read with :meth:`CheckpointDirectory.read_newest`, which holds a checkpoint's files open
while it checks and loads them and takes the next newest when the running training pruned its choice first.
"""

from __future__ import annotations

import json
import os
import random
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from trainer.engine.durable import sha256_file
from trainer.errors import CheckpointError, CheckpointGone, error_detail

FORMAT_VERSION = 1
#: Written next to the checkpoints when a run stops on request (JSON: reason, checkpoint, global_step); a
#: launcher that only sees torchrun's exit status can read it. Removed when the next run starts.
INTERRUPTED_MARKER = "interrupted.json"
#: How often :meth:`CheckpointDirectory.read_newest` (and ``find_resume``) list the folder again after the
#: checkpoint they chose was pruned under them (each pruned one means a newer one was written).
READ_TRIES = 5
_NAME = re.compile(r"^ckpt-(\d{9})(-m)?$")


def checkpoint_name(progress: dict) -> str:
    """``ckpt-<global step>`` at an epoch end, ``ckpt-<global step>-m`` mid-epoch."""
    return f"ckpt-{int(progress['global_step']):09d}" + ("-m" if progress.get("step_in_epoch", 0) else "")


def _order(name: str) -> tuple[int, int]:
    m = _NAME.match(name)
    return (int(m.group(1)), 0 if m.group(2) else 1) if m else (-1, -1)


# --- RNG state --------------------------------------------------------------------------------------------
def capture_rng() -> dict:
    """RNG states of this process: python ``random``, numpy, torch CPU and (if present) every CUDA device.

    Stored as tensors and plain Python values so ``torch.load(weights_only=True)`` accepts them.
    """
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng`."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(i) for i in x) if isinstance(x, (list, tuple)) else x


def _check_archive(file: Any, path: Path) -> None:
    """Raise :class:`CheckpointError` when ``file`` (the open file ``path``) is not a complete ``torch.save`` archive (a zip file whose
    central directory, at its end, can be read): a truncated file whose manifest was rewritten to match it passes
    the size and SHA-256 checks, then fails ``torch.load`` with an opaque ``[Errno 22] Invalid argument``. Reads
    only the central directory (no decompression)."""
    try:
        with zipfile.ZipFile(file):
            pass
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a complete torch archive ({error_detail(e, 200)}; truncated?)") from None


class CheckpointDirectory:
    """The checkpoints of one folder, read only: ``latest``/``best`` pointers, the checkpoints newest first,
    validation, the checkpoint to resume from, loading. :class:`~trainer.engine.checkpoint.CheckpointManager`
    (the writer) extends it.

    Args:
        directory: the checkpoint folder (it need not exist: then it lists nothing).
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    @staticmethod
    def read_interrupted(directory: str | Path) -> Optional[dict]:
        """``interrupted.json`` of a checkpoint directory without removing it; None if there is none, a
        placeholder reason if it cannot be read or parsed."""
        try:
            return json.loads((Path(directory) / INTERRUPTED_MARKER).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"reason": "unknown (unreadable interrupted.json)"}

    def pointer(self, name: str) -> Optional[str]:
        """Checkpoint name stored in the ``latest`` or ``best`` pointer file, or None."""
        try:
            return (self.dir / name).read_text().strip() or None
        except OSError:
            return None

    def list(self) -> list[Path]:
        """Complete-looking checkpoint directories, newest (highest global step) first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if p.is_dir() and _NAME.match(p.name)]
        return sorted(found, key=lambda p: _order(p.name), reverse=True)

    @staticmethod
    def validate(path: str | Path) -> dict:
        """Check a checkpoint directory against its manifest (format, file sizes, SHA-256).

        Returns the manifest. Raises :class:`CheckpointGone` when the folder was removed (a running training
        pruned it), else :class:`CheckpointError` saying what is wrong.
        """
        with _OpenCheckpoint(path) as ck:
            return ck.manifest

    def _first(self, accept: Callable[[Path], Any]) -> tuple[Optional[Path], Any, list[str]]:
        """The newest checkpoint ``accept`` takes (``accept(path)`` returns a value or raises), its value, and log
        lines saying which one and why (skipped ones named).

        Order: the ``latest`` pointer's target first, then every other checkpoint newest first. A checkpoint
        removed while it is read (:class:`CheckpointGone`: the running training pruned it, after writing a newer
        one) is passed over with a note, and the folder is listed again (at most :data:`READ_TRIES` times in all)
        so that the newer checkpoint is found.
        """
        notes: list[str] = []
        for _ in range(READ_TRIES):
            gone = False
            candidates = self.list()
            latest = self.pointer("latest")
            if latest:
                candidates.sort(key=lambda p: p.name != latest)
                if not (self.dir / latest).is_dir():  # a dangling pointer is a fallback too, said like the others
                    notes.append(f"checkpoint: skipping {latest}: the 'latest' pointer names it, but it does not exist")
            for p in candidates:
                try:
                    value = accept(p)
                except CheckpointError as e:
                    if isinstance(e, CheckpointGone) or not p.is_dir():  # listed above, gone now: pruned
                        notes.append(f"checkpoint: passed over {p.name}: removed while being read (pruned by the run)")
                        gone = True
                    else:
                        notes.append(f"checkpoint: skipping {p.name}: {e}")
                    continue
                why = "the 'latest' pointer" if p.name == latest else "the newest checkpoint that validates"
                notes.append(f"checkpoint: resuming from {p} ({why})")
                return p, value, notes
            if not gone:
                break
        return None, None, notes

    def find_resume(self) -> tuple[Optional[Path], list[str]]:
        """Newest checkpoint that validates, and log lines saying which one and why (skipped ones named).

        Order: the ``latest`` pointer's target first, then every other checkpoint newest first (see
        :meth:`_first` for a checkpoint pruned while it is validated).
        """
        path, _, notes = self._first(self.validate)
        return path, notes

    def read_newest(self, rank: int = 0, map_location: Any = "cpu") -> tuple[Optional[Checkpoint], list[str]]:
        """The newest checkpoint that can be read whole, read (:meth:`read`), and log lines as
        :meth:`find_resume` gives them; ``(None, notes)`` when there is none.

        For readers of a folder a training run may be writing (``predict``, ``export``, ``evaluate``): each
        checkpoint's files are opened before they are checked and read, so one pruned after that is still read
        whole, and one pruned before is passed over for the next newest (:meth:`_first`).
        """
        path, value, notes = self._first(lambda p: self.read(p, rank, map_location))
        return (value if path is not None else None), notes

    @staticmethod
    def read(path: str | Path, rank: int = 0, map_location: Any = "cpu") -> Checkpoint:
        """Open every file of checkpoint ``path``, check them against the manifest (format, sizes, SHA-256) and
        load them, all from the open files (a checkpoint deleted meanwhile is still read whole: POSIX keeps an
        unlinked file's data while it is open).

        Raises:
            CheckpointGone: the checkpoint was removed before its files could be opened.
            CheckpointError: anything else wrong with it (incomplete, corrupt, unreadable).
        """
        with _OpenCheckpoint(path) as ck:
            try:
                state = torch.load(ck.files["state.pt"], map_location=map_location, weights_only=True)
                ranks = torch.load(ck.files["ranks.pt"], map_location="cpu", weights_only=True)["ranks"]
            except Exception as e:  # noqa: BLE001 - report any unpickling error with the path
                raise CheckpointError(f"{ck.path}: cannot load ({error_detail(e, 300)})") from None
        return Checkpoint(ck.path, ck.manifest, state, ranks[rank] if rank < len(ranks) else None)

    @staticmethod
    def load(path: str | Path, rank: int = 0, map_location: Any = "cpu") -> tuple[dict, Optional[dict]]:
        """Validate and load ``path`` (:meth:`read`): returns (state, this rank's part ``{"rng": ..., ...}``, or
        None if the checkpoint was written by fewer ranks). Raises :class:`CheckpointError`."""
        ck = CheckpointDirectory.read(path, rank, map_location)
        return ck.state, ck.rank_state


@dataclass
class Checkpoint:
    """One checkpoint read whole (:meth:`CheckpointDirectory.read`)."""

    path: Path  #: its folder
    manifest: dict  #: manifest.json
    state: dict  #: state.pt
    rank_state: Optional[dict]  #: the reading rank's part of ranks.pt (None: written by fewer ranks)


class _OpenCheckpoint:
    """A checkpoint folder with all its files open and checked against its manifest (format version, sizes,
    SHA-256, complete torch archives); ``files``: name -> open binary file, at offset 0. Closes them on exit."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.files: dict[str, Any] = {}
        self._was_there = self.path.is_dir()  # a folder that never existed was not pruned: say what is missing
        try:
            raw = self._open("manifest.json").read()
        except FileNotFoundError:
            raise self._missing("no manifest.json (incomplete or not a checkpoint directory)") from None
        except OSError as e:
            self.close()
            raise CheckpointError(f"{self.path}/manifest.json: unreadable ({e})") from None
        try:
            self.manifest = json.loads(raw)
        except ValueError as e:
            self.close()
            raise CheckpointError(f"{self.path}/manifest.json: unreadable ({e})") from None
        try:
            self._check()
        except BaseException:
            self.close()
            raise

    def _open(self, name: str):
        self.files[name] = f = open(self.path / name, "rb")
        return f

    def _missing(self, what: str) -> CheckpointError:
        """CheckpointGone when the folder, there when the read began, is gone now (pruned), else
        CheckpointError(what)."""
        self.close()
        if self._was_there and not self.path.is_dir():
            return CheckpointGone(f"{self.path}: removed while being read (a running training pruned it)")
        return CheckpointError(f"{self.path}: {what}")

    def _check(self) -> None:
        manifest = self.manifest
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.path}: format_version {manifest.get('format_version')!r}, this trainer reads {FORMAT_VERSION}"
            )
        listed = manifest.get("files", {})
        for fname in listed:  # all opened first: a prune after this point cannot take them away
            try:
                self._open(fname)
            except (FileNotFoundError, IsADirectoryError):
                raise self._missing(f"{fname}: missing") from None
        for fname, meta in listed.items():
            f, where = self.files[fname], self.path / fname
            size = os.fstat(f.fileno()).st_size
            if size != meta["bytes"]:
                raise CheckpointError(f"{where}: {size} bytes, manifest says {meta['bytes']} (truncated?)")
            if sha256_file(f) != meta["sha256"]:
                raise CheckpointError(f"{where}: SHA-256 differs from the manifest (corrupt)")
            if where.suffix == ".pt":
                _check_archive(f, where)
            f.seek(0)
        for fname in ("state.pt", "ranks.pt"):
            if fname not in self.files:
                raise CheckpointError(f"{self.path}: the manifest lists no {fname}")

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}

    def __enter__(self) -> _OpenCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
