"""A checkpoint writer in its own process: serialisation, SHA-256, write and fsync of ``state.pt`` off the training
process, so they compete with the training step for neither the GIL nor (on a GPU host with spare cores) its CPU.

How the state gets there without a copy through a pipe: :class:`~trainer.engine.staging.StagingBuffers` in
shared mode stages every tensor into one flat shared-memory buffer (:func:`shared_buffer`; on a GPU also page-locked with
``cudaHostRegister`` so the device-to-host copies stay asynchronous). The buffer is handed to the writer process
once (a file descriptor over a Unix socket), and again only when the state's layout changes. Per
checkpoint the pipe carries only the tree's skeleton: every tensor replaced by ``(byte offset, dtype, shape)``.
The writer clones each slot into its own tensor (so ``state.pt`` has one storage per tensor, byte for byte the
format the thread writer produces) and calls the same :func:`~trainer.engine.durable.atomic_torch_save`.

Why a process of our own (docs/architecture.md, "Dated decisions"): ``torch.distributed.checkpoint``'s
``async_save`` with process-based staging is the library way, but it writes DCP's sharded ``.distcp`` format, not
this repo's ``state.pt`` + manifest, which every resume, ``validate`` and ``export`` reads.

The process ignores SIGINT and SIGTERM (a Ctrl-C to the process group or a spot interruption notice must not kill
a write half-way: the trainer decides when to stop) and exits when its pipe closes. Started by the training
process's main thread, it also gets SIGKILL the moment that process dies (Linux ``PR_SET_PDEATHSIG``,
:mod:`trainer.parent_death`): a checkpoint that the dead trainer can no longer complete is not worth finishing,
and a write left half-done stays in a ``.tmp-ckpt-*`` folder that the next run removes. Started by another thread
(a restart after the process died, from the trainer's writer thread, which ends after each checkpoint) it is not
armed and ends with its pipe. Either way a trainer gone mid-write ends it quietly, without a traceback in the log.
It is started with the fresh interpreter (:class:`WriterProcess`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

import torch

#: Marker of a tensor slot in a skeleton sent to the writer: ``(_SLOT, byte_offset, dtype_name, shape)``.
_SLOT = "__trainstack_slot__"


def skeleton(tree: Any, base_ptr: int) -> Any:
    """``tree`` with every tensor (a view of the flat buffer whose first byte is at address ``base_ptr``) replaced
    by ``(_SLOT, byte offset, dtype name, shape)``; dicts, lists and tuples rebuilt, other values kept."""
    if isinstance(tree, torch.Tensor):
        return (_SLOT, tree.data_ptr() - base_ptr, str(tree.dtype).removeprefix("torch."), tuple(tree.shape))
    if isinstance(tree, dict):
        return {k: skeleton(v, base_ptr) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(skeleton(v, base_ptr) for v in tree)
    return tree


def rebuild(tree: Any, flat: torch.Tensor) -> Any:
    """Inverse of :func:`skeleton` on the writer's side: each slot becomes a clone (own storage) of its bytes in
    ``flat`` (uint8, 1-D) viewed as its dtype and shape."""
    if isinstance(tree, tuple) and len(tree) == 4 and tree[0] == _SLOT:
        _, offset, dtype, shape = tree
        dt = getattr(torch, dtype)
        n = dt.itemsize * (int(torch.Size(shape).numel()))
        return flat[offset : offset + n].view(dt).view(shape).clone()
    if isinstance(tree, dict):
        return {k: rebuild(v, flat) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(rebuild(v, flat) for v in tree)
    return tree


def shared_buffer(nbytes: int) -> tuple[torch.Tensor, int]:
    """A flat uint8 CPU tensor of ``nbytes`` bytes on an anonymous shared-memory file (Linux ``memfd_create``: not
    limited by the size of ``/dev/shm``, 64 MiB in a default Docker container), and that file's descriptor (kept
    open: it is what the writer process maps). Raises OSError where memfd is unavailable."""
    fd = os.memfd_create("trainstack-checkpoint", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    return flat, fd


def _serve(sock_fd: int, parent_pid: Optional[int] = None) -> None:
    """The writer process's loop on socket ``sock_fd``: ``("buffer", nbytes)`` + a descriptor maps a new shared
    buffer; ``("save", skeleton, path)`` writes it and answers ``("ok", {"bytes", "sha256"})``,
    ``("oserror", errno, strerror, filename)`` or ``("error", text)``; end of the socket, or a trainer gone
    before the answer, ends the process quietly. ``parent_pid``: the trainer's pid when it started this process
    from its main thread: SIGKILL when it dies (module doc)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if parent_pid is not None:
        from trainer.parent_death import die_with_parent

        die_with_parent(signal.SIGKILL, parent_pid)
    torch.set_num_threads(1)
    from trainer.engine.durable import atomic_torch_save

    sock = socket.socket(fileno=sock_fd)
    conn = Connection(os.dup(sock_fd))
    flat = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "buffer":
            try:
                _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            except OSError:
                return
            if not fds:  # the trainer is gone
                return
            flat = torch.from_file(f"/proc/self/fd/{fds[0]}", shared=True, size=msg[1], dtype=torch.uint8)
            os.close(fds[0])
            continue
        try:
            reply = ("ok", atomic_torch_save(rebuild(msg[1], flat), Path(msg[2])))
        except OSError as e:
            reply = ("oserror", e.errno, e.strerror or str(e), e.filename)
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except OSError:  # BrokenPipeError, ConnectionResetError: the trainer is gone, nobody to tell
            return


class WriterProcess:
    """The trainer's handle on one writer process (rank 0 only; started at the first :meth:`save_state`).

    The process is ``python -c`` of this module's loop, started with :mod:`subprocess` and a socket pair, not
    with :mod:`multiprocessing`: its ``spawn`` method re-imports the parent's main script in the child, which
    fails for a script without an ``if __name__ == "__main__"`` guard, and ``fork`` is unsafe after CUDA is
    initialised and with threads running.

    Raises (from :meth:`save_state`):
        OSError: the write failed in the writer (same errno, message and file name as in-process).
        RuntimeError: the writer process died (its exit code in the message) or reported another error; the next
            call starts a new process.
    """

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._sock: Optional[socket.socket] = None
        self._conn: Optional[Connection] = None
        self._sent: Optional[torch.Tensor] = None  # the flat buffer the process holds
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the process now if it is not running (returns at once; the child imports torch in its own time)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.close()
                self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the trainer package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        from trainer.parent_death import started_from_main_thread

        parent = os.getpid() if started_from_main_thread() else None  # the module doc: which thread starts it
        code = f"from trainer.engine.checkpoint_writer import _serve; _serve({theirs.fileno()}, {parent})"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL
        )
        theirs.close()
        self._sock, self._conn, self._sent = ours, Connection(os.dup(ours.fileno())), None

    def save_state(self, tree: Any, flat: torch.Tensor, fd: int, path: Path) -> dict:
        """Write ``tree`` (tensors: views of the shared ``flat`` buffer, whose file is ``fd``) to ``path`` in the
        writer process, as :func:`~trainer.engine.durable.atomic_torch_save` would; returns ``{"bytes",
        "sha256"}``. Blocks the calling (writer) thread until the file is durable."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self.close()
                self._start()
            try:
                if self._sent is not flat:
                    self._conn.send(("buffer", flat.numel()))
                    socket.send_fds(self._sock, [b"F"], [fd])
                    self._sent = flat
                self._conn.send(("save", skeleton(tree, flat.data_ptr()), str(path)))
                reply = self._conn.recv()
            except (EOFError, OSError):
                code = self._proc.wait(timeout=10) if self._proc is not None else None
                self.close()
                raise RuntimeError(f"the checkpoint writer process died (exit code {code})") from None
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "oserror":
            raise OSError(reply[1], reply[2], reply[3])
        raise RuntimeError(f"checkpoint writer process: {reply[1]}")

    def close(self) -> None:
        """End the writer process (closing its socket: it only works while the trainer waits on it, so nothing
        is left half-written) and wait up to 10 s for it."""
        for c in (self._conn, self._sock):
            if c is not None:
                c.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = self._conn = self._sock = self._sent = None
