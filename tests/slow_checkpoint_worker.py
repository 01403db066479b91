"""Fault injection for tests/test_interruption.py: ``python -m trainer train`` whose checkpoint writer
stalls inside the write of ``state.pt`` at global step ``STALL_AT`` (after creating ``MARKER``), so the test
can SIGKILL the job while a checkpoint is half-written."""

import os
import sys
import time
from pathlib import Path

import trainer.checkpoint as ckpt
from trainer.cli import main

STALL_AT, MARKER = int(os.environ["STALL_AT_STEP"]), Path(os.environ["STALL_MARKER"])
_real = ckpt.atomic_torch_save


def _stalling_save(obj, path):
    if Path(path).name == "state.pt" and f"ckpt-{STALL_AT:09d}" in str(path):
        meta = _real(obj, Path(path).with_name(".state.pt.full"))
        full = Path(path).with_name(".state.pt.full")
        Path(path).with_name(".state.pt.partial").write_bytes(full.read_bytes()[: meta["bytes"] // 2])
        full.unlink()  # half a file on disk, as a real crash would leave
        MARKER.write_text(str(path))
        time.sleep(600)
    return _real(obj, path)


ckpt.atomic_torch_save = _stalling_save

if __name__ == "__main__":
    sys.exit(main())
