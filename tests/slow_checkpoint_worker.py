"""Fault injection for tests/test_interruption.py and tests/test_bad_inputs_engine.py: ``python -m trainer train``
whose checkpoint writer stalls inside the write of ``state.pt`` (after creating ``MARKER``), so a test can
SIGKILL the job while a checkpoint is half-written, or press Ctrl-C a second time while it is being written.

``STALL_AT_STEP=N`` stalls the checkpoint of global step N; ``STALL_FROM_STEP=N`` the first one at step N or
later. The stall lasts 600 s, or until the trainer abandons the write (``CheckpointManager.abort``)."""

import os
import sys
import threading
from pathlib import Path

import trainer.engine.checkpoint as ckpt
from trainer.cli import main
from trainer.engine.checkpoint_files import _NAME as CHECKPOINT_NAME

STALL_AT = int(os.environ.get("STALL_AT_STEP", "-1"))
STALL_FROM = int(os.environ.get("STALL_FROM_STEP", "-1"))
MARKER = Path(os.environ["STALL_MARKER"])
_real = ckpt.atomic_torch_save
_real_abort = ckpt.CheckpointManager.abort
_aborted = threading.Event()


def _stalls(path: Path) -> bool:
    m = CHECKPOINT_NAME.match(path.parent.name.removeprefix(".tmp-"))
    if path.name != "state.pt" or not m or MARKER.exists():
        return False
    step = int(m.group(1))
    return step == STALL_AT or (STALL_FROM >= 0 and step >= STALL_FROM)


def _stalling_save(obj, path):
    if _stalls(Path(path)):
        meta = _real(obj, Path(path).with_name(".state.pt.full"))
        full = Path(path).with_name(".state.pt.full")
        Path(path).with_name(".state.pt.partial").write_bytes(full.read_bytes()[: meta["bytes"] // 2])
        full.unlink()  # half a file on disk, as a real crash would leave
        MARKER.write_text(str(path))
        _aborted.wait(600)
    return _real(obj, path)


def _abort(self):
    _aborted.set()
    _real_abort(self)


ckpt.atomic_torch_save = _stalling_save
ckpt.CheckpointManager.abort = _abort

if __name__ == "__main__":
    sys.exit(main())
