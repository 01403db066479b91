"""Writing checkpoints: atomic, validated, full-state, asynchronous; pruning, and the interruption marker.

The on-disk format, validation, finding and loading live in :mod:`trainer.engine.checkpoint_files`
(:class:`~trainer.engine.checkpoint_files.CheckpointDirectory`, which :class:`CheckpointManager` extends).

Durability (how a crash at any instant leaves a loadable checkpoint): every file is written to a temporary
name, flushed, ``fsync``-ed and renamed; the checkpoint is assembled in ``.tmp-<name>/`` and renamed into
place only when complete; ``latest`` moves (again by rename) only after that; older checkpoints are deleted
only after the new one is durable. ``progress`` holds ``epoch`` (0-based epoch to continue in),
``step_in_epoch`` (optimizer steps already done in it) and ``global_step``, so mid-epoch checkpoints fit
the same format.

Writes are asynchronous: :meth:`CheckpointManager.save` copies the state into host buffers reused from one
checkpoint to the next (:class:`~trainer.engine.staging.StagingBuffers`: no allocation; on a GPU the copies are
queued on the stream into pinned memory and the host does not wait for them) and a background thread waits for
those copies, then serialises, hashes, writes and renames; :meth:`wait` blocks until the last checkpoint is
durable. A new save waits for the previous one first.

Write failures (full disk, file size limit, I/O error): the writer removes its ``.tmp-ckpt-*`` folder, leaves
``latest`` on the previous checkpoint and keeps a :class:`CheckpointError` naming the checkpoint and the OS
error; :attr:`CheckpointManager.failed` is a plain attribute read, so the training loop polls it at every
optimizer step (no device synchronisation) and stops at the next one. torch's C++ writer reports a failed
write as an opaque ``RuntimeError`` (``unexpected pos ...``, ``basic_ios::clear``);
:func:`~trainer.engine.durable.atomic_torch_save` turns it back into the ``OSError`` behind it
(:func:`~trainer.engine.durable.explain_write_failure`).

The folder's housekeeping around the writes (is it writable, what a killed run left, which checkpoints are
pruned, the line a failed write becomes) lives in :mod:`trainer.engine.checkpoint_folder`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from trainer.engine.checkpoint_files import (
    FORMAT_VERSION,
    INTERRUPTED_MARKER,
    CheckpointDirectory,
    capture_rng,
    checkpoint_name,
)
from trainer.engine.checkpoint_folder import check_writable, prune, remove_stale_temporaries, write_error
from trainer.engine.durable import WriterLock, _tensor_bytes, atomic_torch_save, atomic_write_bytes, fsync_dir
from trainer.engine.staging import StagingBuffers
from trainer.errors import CheckpointError

#: Checkpoint writers (``checkpoint_writer``): see :class:`CheckpointManager`.
WRITERS = ("auto", "thread", "process")
#: ``auto`` uses the writer process from this many tensor bytes of state (128 MiB, ResNet-50 with EMA and momentum
#: is ~300 MiB, ResNet-18 85 MiB: below it a thread writes in well
#: under a step, and a process would only add its start-up, ~2 s of CPU to import torch).
PROCESS_WRITER_MIN_BYTES = 128 << 20


class _Aborted(Exception):
    """The checkpoint being written was abandoned (:meth:`CheckpointManager.abort`)."""


class CheckpointManager(CheckpointDirectory):
    """Save checkpoints in one directory (and, as a :class:`CheckpointDirectory`, validate, find and load them).

    Collective: :meth:`save` must be called by every rank (rank 0 gathers the RNG states and writes; the
    others only take part in the gather and the final barrier). All ranks may call :meth:`load`.

    Args:
        directory: checkpoint folder (created if missing).
        rank, world_size: this process's place in the process group.
        keep_every_epochs: epoch-end checkpoints with ``epoch % keep_every_epochs == 0`` are kept;
            ``latest`` and ``best`` are always kept; every other checkpoint is deleted once ``keep_last`` newer
            ones are durable.
        keep_last: the newest ``keep_last`` complete checkpoints (mid-epoch ones too) are never pruned. With 1, the
            previous checkpoint goes as soon as a newer one is durable here, which is too soon for a copy of the
            folder that lags behind it: SageMaker uploads ``/opt/ml/checkpoints`` to S3 while the job runs and
            deletes in S3 what the job deletes ("If a checkpoint is deleted in the SageMaker container, it will
            also be deleted in the S3 folder": AWS, "Use checkpoints in Amazon SageMaker AI"), so a spot
            interruption can find the old checkpoint deleted and the new one not yet uploaded; an FSx for Lustre
            export to S3 is asynchronous too. With 2 (the config's default) the previous checkpoint stays until a
            newer one has been durable for a whole checkpoint interval.
        writer: who serialises, hashes and writes ``state.pt``: ``thread`` (a thread of this process),
            ``process`` (a writer process on shared memory, :mod:`trainer.engine.checkpoint_writer`) or ``auto``
            (the process when the state holds at least :data:`PROCESS_WRITER_MIN_BYTES` of tensors, else the
            thread). ``process`` and ``auto`` fall back to the thread, with a message in :attr:`notes`, where
            Linux's ``memfd_create`` is missing.

    One writer per folder: rank 0 takes the folder's :class:`~trainer.engine.durable.WriterLock` here, before it
    cleans up what a killed run left, and holds it until :meth:`release_lock` (or its process ends). Readers
    (``predict``, ``export``, ``resume_from`` of another run) use a :class:`CheckpointDirectory` and take no lock:
    they follow ``latest``, which names only complete checkpoints.

    Raises:
        CheckpointError: (rank 0) the folder cannot be created or a file cannot be written in it (read-only
            file system, no permission, a file in the way), or another run holds its lock (named by pid, host
            and start time): checked here, before any training.
    """

    def __init__(
        self,
        directory: str | Path,
        rank: int = 0,
        world_size: int = 1,
        keep_every_epochs: int = 1,
        writer: str = "thread",
        keep_last: int = 1,
    ):
        if writer not in WRITERS:
            raise ValueError(f"writer: got {writer!r}; expected one of {', '.join(WRITERS)}")
        super().__init__(directory)
        if keep_last < 1:
            raise ValueError(f"keep_last: got {keep_last!r}; expected an integer >= 1")
        self.rank, self.world_size, self.keep_every, self.keep_last = rank, world_size, keep_every_epochs, keep_last
        self.writer = writer  #: resolved to ``thread`` or ``process`` at the first save
        self._process = None  # a checkpoint_writer.WriterProcess once the process writer is in use
        self.notes: list[str] = []  #: one-line messages for the run's log (the writer chosen, a fallback)
        self._writer: Optional[threading.Thread] = None
        self._written = threading.Event()  # set when the writer's work is over (see join)
        self._error: Optional[BaseException] = None
        self._abort = threading.Event()
        self._staging = StagingBuffers()
        self.last_durable: Optional[tuple[Path, float]] = None  # (path, time.monotonic() when durable)
        self.lock = WriterLock(self.dir)  #: rank 0's one-writer lock on the folder (held until release_lock)
        self.lock_note: Optional[str] = None  #: a line for the run's log when the folder cannot be locked
        if rank == 0:
            check_writable(self.dir)
            self.lock_note = self.lock.acquire()  # before anything below touches a file another run may write
            remove_stale_temporaries(self.dir)

    # .. saving ..........................................................................................
    def save(
        self,
        state: dict,
        progress: dict,
        *,
        rank_state: Optional[dict] = None,
        is_best: bool = False,
        blocking: bool = False,
    ) -> Optional[Path]:
        """Write a checkpoint of ``state`` at ``progress`` and move ``latest`` (and ``best``) to it.

        Args:
            state: rank 0's training state (tensors, dicts, numbers, strings); copied to host memory before
                this returns, so the caller may keep training.
            progress: ``{"epoch", "step_in_epoch", "global_step"}`` (ints).
            rank_state: this rank's own small state (e.g. running epoch statistics); gathered with every
                rank's RNG state into ``ranks.pt``.
            is_best: also move the ``best`` pointer.
            blocking: wait until the checkpoint is durable (otherwise a background thread finishes it).

        Returns the checkpoint directory it will have (rank 0), None elsewhere. A failed write is raised by
        the next :meth:`save` or :meth:`wait`; the previous checkpoints stay untouched.
        """
        mine = {"rng": capture_rng(), **(rank_state or {})}
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        if self.rank != 0:
            return None
        self.wait()
        self._abort.clear()
        self._written.clear()
        self._choose_writer(_tensor_bytes(state))
        full = self._staging.stage({**state, "progress": dict(progress), "format_version": FORMAT_VERSION})
        self._writer = threading.Thread(
            target=self._write_guarded,
            name="checkpoint-writer",
            daemon=True,
            args=(full, {"ranks": gathered}, dict(progress), is_best),
        )
        self._writer.start()
        if blocking:
            self.wait()
        return self.dir / checkpoint_name(progress)

    def prepare(self, state: dict) -> str:
        """Resolve :attr:`writer` for ``state`` (the training state as :meth:`save` will get it) and start the
        writer process now if it is chosen, so that its start-up (a fresh interpreter importing torch, ~2-3 s of
        CPU) overlaps training instead of delaying the first checkpoint. Returns a one-line description of the
        choice for the run's log."""
        nbytes = _tensor_bytes(state)
        self._choose_writer(nbytes)
        if self._process is not None:
            self._process.start()
        why = "" if self.writer == "thread" or self.notes else f" (state {nbytes / 2**20:.0f} MiB)"
        return f"checkpoint: writer {self.writer}{why}" + (f"; {self.notes[-1]}" if self.notes else "")

    def _choose_writer(self, nbytes: int) -> None:
        """Resolve :attr:`writer` for a state of ``nbytes`` tensor bytes (see the class docstring)."""
        if self.writer == "thread" or self._process is not None:
            return  # already resolved
        want = self.writer == "process" or nbytes >= PROCESS_WRITER_MIN_BYTES
        if want and not hasattr(os, "memfd_create"):
            self.notes.append("checkpoint: writer thread, not process: no memfd_create on this OS (Linux only)")
            want = False
        if want:
            from trainer.engine.checkpoint_writer import WriterProcess

            self._process = WriterProcess()
            self._staging = StagingBuffers(shared=True)
        self.writer = "process" if want else "thread"

    def close(self) -> None:
        """Wait for the last write (without raising its error), then end the writer process if there is one
        and free its shared buffer. The manager can still save afterwards (a new process starts)."""
        self.join()
        if self._process is not None:
            self._process.close()
            self._staging.release()
            self._staging = StagingBuffers(shared=True)

    def release_lock(self) -> None:
        """Let go of the folder's writer lock (idempotent; the kernel also releases it when the process ends);
        its file is deleted only while it is still this run's (never a newcomer's that replaced it)."""
        self.lock.release()

    def wait(self) -> Optional[Path]:
        """Block until the last checkpoint write finished; re-raise its error (a :class:`CheckpointError`
        naming the checkpoint and the OS error). Returns the last durable checkpoint's path (rank 0)."""
        self.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self.last_durable[0] if self.last_durable else None

    def join(self) -> None:
        """Block until the background write (if any) finished, without raising its error.

        Waits on an event the writer sets when done, not only on ``Thread.join``: in Python 3.11 a join
        interrupted by Ctrl-C marks the thread stopped while it still runs, and a later join returns at once.
        """
        if self._writer is not None:
            self._written.wait()
            self._writer.join()
            self._writer = None
        if self._error is None:
            try:
                self.lock.check()  # a lost lock is this writer's failure: every rank stops (see wait)
            except CheckpointError as e:
                self._error = e

    @property
    def failed(self) -> bool:
        """True when a background write failed and :meth:`wait` has not raised it yet. A plain attribute
        read (no lock, no device work): cheap enough to poll at every optimizer step."""
        return self._error is not None

    def abort(self) -> None:
        """Abandon the checkpoint being written (a second Ctrl-C): the writer stops before its next file or
        rename, this waits for it, and every ``.tmp-ckpt-*`` folder is removed. Checkpoints that were
        already complete (renamed into place) stay. Safe to call more than once and on any rank."""
        self._abort.set()
        self.join()
        self._error = None
        if self.rank == 0 and self.dir.is_dir():
            for tmp in self.dir.glob(".tmp-ckpt-*"):
                shutil.rmtree(tmp, ignore_errors=True)

    def _write_guarded(self, state: dict, rng: dict, progress: dict, is_best: bool) -> None:
        name = checkpoint_name(progress)
        try:
            path = self._write(state, rng, progress, is_best)
            self.last_durable = (path, time.monotonic())
        except _Aborted:
            shutil.rmtree(self.dir / f".tmp-{name}", ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            shutil.rmtree(self.dir / f".tmp-{name}", ignore_errors=True)
            self._error = (
                write_error(self.dir, name, progress, e, self.pointer("latest")) if isinstance(e, OSError) else e
            )
        finally:
            self._written.set()

    def _check_abort(self) -> None:
        if self._abort.is_set():
            raise _Aborted()

    def _write(self, state: dict, rng: dict, progress: dict, is_best: bool) -> Path:
        self._staging.ready()
        name = checkpoint_name(progress)
        final, tmp = self.dir / name, self.dir / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files = {}
        for fname, obj in (("state.pt", state), ("ranks.pt", rng)):
            self._check_abort()
            if fname == "state.pt" and self._process is not None:
                files[fname] = self._save_in_process(obj, tmp / fname)
            else:
                files[fname] = atomic_torch_save(obj, tmp / fname)
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": name,
            "progress": progress,
            "world_size": self.world_size,
            "task": (state.get("config") or {}).get("task") if isinstance(state, dict) else None,
            "created_unix": time.time(),
            "files": files,
        }
        atomic_write_bytes(tmp / "manifest.json", json.dumps(manifest, indent=2).encode())
        self._check_abort()
        self.lock.check()  # another run in this folder (our lock file deleted or replaced): write nothing more
        old = None
        if final.exists():  # same step written again (a rerun after a crash before `latest` moved)
            old = self.dir / f".tmp-old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(self.dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        atomic_write_bytes(self.dir / "latest", name.encode())
        if is_best:
            atomic_write_bytes(self.dir / "best", name.encode())
        keep = {self.pointer("latest"), self.pointer("best")}
        prune(self.dir, self.list(), keep, self.keep_last, self.keep_every)
        return final

    def _save_in_process(self, staged: dict, path: Path) -> dict:
        """``state.pt`` through the writer process; if that process fails (dies, cannot start), this thread
        writes the same bytes itself and says so on stderr (the next checkpoint starts a new process)."""
        from trainer.engine.checkpoint_writer import rebuild, skeleton

        flat = self._staging.flat
        try:
            return self._process.save_state(staged, flat, self._staging.fd, path)
        except RuntimeError as e:
            print(f"checkpoint: {e}; {path.parent.name} is written by the training process", file=sys.stderr)
            return atomic_torch_save(rebuild(skeleton(staged, flat.data_ptr()), flat), path)

    # .. interruption marker .............................................................................
    def mark_interrupted(self, reason: str, path: Optional[Path], global_step: int) -> None:
        """Write ``interrupted.json`` (reason, checkpoint name, global step) for launchers (rank 0)."""
        marker = {
            "reason": reason,
            "checkpoint": path.name if path else None,
            "global_step": global_step,
            "time_unix": time.time(),
        }
        atomic_write_bytes(self.dir / INTERRUPTED_MARKER, json.dumps(marker).encode())

    def pop_interrupted(self) -> Optional[dict]:
        """Read and remove ``interrupted.json`` left by the previous run; None if there is none."""
        data = self.read_interrupted(self.dir)
        (self.dir / INTERRUPTED_MARKER).unlink(missing_ok=True)
        return data
