"""Host staging buffers for checkpoint copies: the state's tensors copied to host memory reused from one
checkpoint to the next (pinned, non-blocking device-to-host copies on a GPU; one flat shared-memory buffer for the
writer process). :class:`~trainer.engine.checkpoint.CheckpointManager` stages the state here, and its writer
serialises from these buffers.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch


class StagingBuffers:
    """Host copies of a state tree in buffers kept from one checkpoint to the next, so a periodic checkpoint
    allocates nothing and, on a GPU, does not wait for its device-to-host copies.

    :meth:`stage` copies every tensor of the tree into a buffer of the same shape and dtype reused by tree path
    (a new buffer only when a path is new or its shape/dtype changed): CPU tensors with a plain ``copy_``; CUDA
    tensors into pinned host memory with ``non_blocking=True`` on the current stream, so the copies run in stream
    order after the step that produced the values and before any later kernel that changes them, while the host
    goes on. :meth:`ready` blocks until those copies are done (an event recorded after them): the writer thread
    calls it before serialising. Pinned, reused buffers are what ``torch.distributed.checkpoint``'s staging does
    (``torch.distributed.checkpoint.staging``); the caller must not stage again before the previous staged tree
    is written (:meth:`~trainer.engine.checkpoint.CheckpointManager.save` waits for the writer first).

    ``shared=True`` (the writer process, :mod:`trainer.engine.checkpoint_writer`): the buffers are views of one
    flat uint8 buffer in shared memory (:attr:`flat`, a memfd: see
    :func:`~trainer.engine.checkpoint_writer.shared_buffer`; 64-byte aligned slots in tree order; page-locked with
    ``cudaHostRegister`` when the state has CUDA tensors), laid out again only when the tree's tensor layout
    changes.

    Memory: one host copy of the state (bytes = the state's tensor bytes, + 63 per tensor when shared), held for
    the run.
    """

    def __init__(self, shared: bool = False) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._event: Optional[Any] = None
        self.shared = shared
        self.flat: Optional[torch.Tensor] = None  #: shared mode: the flat uint8 buffer every slot is a view of
        self.fd: Optional[int] = None  #: shared mode: the descriptor of :attr:`flat`'s shared-memory file
        self._layout: Optional[list] = None
        self._registered: Optional[int] = None  # data_ptr of a cudaHostRegister-ed flat buffer
        self.allocated = 0  #: buffers (re)allocated so far: stays flat across checkpoints of one model

    def stage(self, obj: Any, path: tuple = ()) -> Any:
        """The tree ``obj`` with every tensor replaced by its host buffer (filled, or being filled, with a copy);
        other values as they are (dicts, lists and tuples rebuilt)."""
        if path == ():
            self._event = None
            if self.shared:
                self._lay_out(obj)
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                pin = t.device.type == "cuda"
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self._buffers[path] = buf
                self.allocated += 1
            if t.device.type == "cuda":
                buf.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                buf.copy_(t)
            return buf
        if isinstance(obj, dict):
            return {k: self.stage(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.stage(v, (*path, i)) for i, v in enumerate(obj))
        return obj

    def _lay_out(self, obj: Any) -> None:
        """Shared mode: make :attr:`flat` and the slot views fit ``obj``'s tensors (no-op when the layout is
        unchanged)."""
        found: list = []

        def walk(o: Any, p: tuple) -> None:
            if isinstance(o, torch.Tensor):
                found.append((p, tuple(o.shape), o.dtype, o.device.type == "cuda"))
            elif isinstance(o, dict):
                for k, v in o.items():
                    walk(v, (*p, k))
            elif isinstance(o, (list, tuple)):
                for i, v in enumerate(o):
                    walk(v, (*p, i))

        walk(obj, ())
        if found == self._layout:
            return
        self.release()
        offsets, total = [], 0
        for _, shape, dtype, _ in found:
            offsets.append(total)
            total += -(-dtype.itemsize * math.prod(shape) // 64) * 64
        from trainer.engine.checkpoint_writer import shared_buffer

        flat, self.fd = shared_buffer(max(total, 64))
        if any(cuda for *_, cuda in found):
            rc = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
            if int(rc) == 0:
                self._registered = flat.data_ptr()
        self._buffers = {}
        for (p, shape, dtype, _), off in zip(found, offsets):
            n = dtype.itemsize * math.prod(shape)
            self._buffers[p] = flat[off : off + n].view(dtype).view(shape)
        self.flat, self._layout = flat, found
        self.allocated += 1

    def release(self) -> None:
        """Shared mode: drop the flat buffer (unregistering it from CUDA if it was page-locked)."""
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        if self.fd is not None:
            os.close(self.fd)
        self.flat, self.fd, self._layout, self._buffers = None, None, None, {}

    def ready(self) -> None:
        """Block until the device-to-host copies of the last :meth:`stage` are complete (no-op on CPU)."""
        if self._event is not None:
            self._event.synchronize()
