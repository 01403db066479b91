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

Loading uses ``torch.load(weights_only=True)``. Readers (``predict``, ``export``, ``resume_from`` of another run)
use :class:`CheckpointDirectory` alone and take no lock: they follow ``latest``, which names only complete
checkpoints.
"""

from __future__ import annotations

import json
import random
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from trainer.engine.durable import sha256_file
from trainer.errors import CheckpointError, error_detail

FORMAT_VERSION = 1
#: Written next to the checkpoints when a run stops on request (JSON: reason, checkpoint, global_step); a
#: launcher that only sees torchrun's exit status can read it. Removed when the next run starts.
INTERRUPTED_MARKER = "interrupted.json"
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


def _check_archive(path: Path) -> None:
    """Raise :class:`CheckpointError` when ``path`` is not a complete ``torch.save`` archive (a zip file whose
    central directory, at its end, can be read): a truncated file whose manifest was rewritten to match it passes
    the size and SHA-256 checks, then fails ``torch.load`` with an opaque ``[Errno 22] Invalid argument``. Reads
    only the central directory (no decompression)."""
    try:
        with zipfile.ZipFile(path):
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

        Returns the manifest. Raises :class:`CheckpointError` saying what is wrong.
        """
        path = Path(path)
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no manifest.json (incomplete or not a checkpoint directory)") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}/manifest.json: unreadable ({e})") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {manifest.get('format_version')!r}, this trainer reads {FORMAT_VERSION}"
            )
        for fname, meta in manifest.get("files", {}).items():
            f = path / fname
            if not f.is_file():
                raise CheckpointError(f"{f}: missing")
            if f.stat().st_size != meta["bytes"]:
                raise CheckpointError(f"{f}: {f.stat().st_size} bytes, manifest says {meta['bytes']} (truncated?)")
            if sha256_file(f) != meta["sha256"]:
                raise CheckpointError(f"{f}: SHA-256 differs from the manifest (corrupt)")
            if f.suffix == ".pt":
                _check_archive(f)
        return manifest

    def find_resume(self) -> tuple[Optional[Path], list[str]]:
        """Newest checkpoint that validates, and log lines saying which one and why (skipped ones named).

        Order: the ``latest`` pointer's target first, then every other checkpoint newest first.
        """
        notes = []
        candidates = self.list()
        latest = self.pointer("latest")
        if latest:
            candidates.sort(key=lambda p: p.name != latest)
            if not (self.dir / latest).is_dir():  # a dangling pointer is a fallback too, said like the others
                notes.append(f"checkpoint: skipping {latest}: the 'latest' pointer names it, but it does not exist")
        for p in candidates:
            try:
                self.validate(p)
            except CheckpointError as e:
                notes.append(f"checkpoint: skipping {p.name}: {e}")
                continue
            why = "the 'latest' pointer" if p.name == latest else "the newest checkpoint that validates"
            notes.append(f"checkpoint: resuming from {p} ({why})")
            return p, notes
        return None, notes

    @staticmethod
    def load(path: str | Path, rank: int = 0, map_location: Any = "cpu") -> tuple[dict, Optional[dict]]:
        """Validate and load ``path``: returns (state, this rank's part ``{"rng": ..., ...}``, or None if the
        checkpoint was written by fewer ranks). Raises :class:`CheckpointError`."""
        path = Path(path)
        CheckpointDirectory.validate(path)
        try:
            state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
            rng = torch.load(path / "ranks.pt", map_location="cpu", weights_only=True)["ranks"]
        except Exception as e:  # noqa: BLE001 - report any unpickling error with the path
            raise CheckpointError(f"{path}: cannot load ({error_detail(e, 300)})") from None
        return state, (rng[rank] if rank < len(rng) else None)
