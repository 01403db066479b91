"""The checkpoint writer process: byte-identical files to the writer thread, a new shared buffer
only when the layout changes, the OS error of a failed write, a dead writer replaced, Ctrl-C/SIGTERM ignored, and
``auto`` choosing by state size. End to end: tests/engine/test_loop.py (bit-exact resume from process-written
checkpoints) and tests/engine/test_interruption.py (Ctrl-C to the process group)."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest
import torch

from trainer.config.schema import CHECKPOINT_WRITERS
from trainer.engine import checkpoint as ckpt
from trainer.engine.checkpoint import CheckpointManager
from trainer.engine.staging import StagingBuffers

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs memfd (Linux)")


def _state(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 33, generator=g) * scale
    return {
        "model": {"w": w, "w_t": w.t(), "bn.num_batches_tracked": torch.tensor(7), "half": w[:3].bfloat16()},
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(5, 5, dtype=torch.float64)}}, "lr": [0.1, 0.2]},
        "flags": torch.tensor([True, False]),
        "empty": torch.zeros(0, 4),
        "nested": (1, [torch.arange(10), "x"], {"k": torch.tensor(2.5)}),
        "config": {"task": "classification", "lr": 0.1},
    }


def _progress(step: int) -> dict:
    return {"epoch": 0, "step_in_epoch": step, "global_step": step}


def _save(mgr: CheckpointManager, state: dict, step: int):
    mgr.save(state, _progress(step))
    return mgr.wait()


def test_writers_are_the_config_choices():
    assert ckpt.WRITERS == CHECKPOINT_WRITERS


def test_process_writes_the_same_bytes_as_the_thread(tmp_path):
    """Same state, same step: state.pt has the same SHA-256 from both writers (one storage per tensor, as torch
    saves them from the thread), and loads back equal, dtypes, shapes and tuple/list types included."""
    paths = {}
    for writer in ("thread", "process"):
        mgr = CheckpointManager(tmp_path / writer, writer=writer)
        paths[writer] = _save(mgr, _state(), 3)
        assert mgr.writer == writer
        mgr.close()
    sums = {w: CheckpointManager.validate(p)["files"]["state.pt"]["sha256"] for w, p in paths.items()}
    assert sums["thread"] == sums["process"]
    a, _ = CheckpointManager.load(paths["thread"])
    b, _ = CheckpointManager.load(paths["process"])
    assert type(b["nested"]) is tuple and type(b["nested"][1]) is list and b["nested"][1][1] == "x"
    assert b["model"]["half"].dtype == torch.bfloat16 and b["flags"].dtype == torch.bool
    assert b["empty"].shape == (0, 4) and torch.equal(b["model"]["w_t"], _state()["model"]["w"].t())
    assert torch.equal(a["optimizer"]["state"][0]["momentum_buffer"], b["optimizer"]["state"][0]["momentum_buffer"])


def test_layout_change_sends_a_new_buffer_and_values_are_those_at_save_time(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", writer="process")
    state = {"w": torch.zeros(1000)}
    for step in (1, 2):
        state["w"].fill_(step)
        mgr.save(state, _progress(step))
        state["w"].fill_(-1)  # training goes on while the process writes
        mgr.wait()
    assert mgr._staging.allocated == 1  # one flat shared buffer for both checkpoints
    state = {"w": torch.full((1000,), 3.0), "momentum": torch.full((7,), 4.0)}  # optimizer state appeared
    path = _save(mgr, state, 3)
    assert mgr._staging.allocated == 2
    loaded, _ = CheckpointManager.load(path)
    assert torch.equal(loaded["w"], torch.full((1000,), 3.0)) and torch.equal(loaded["momentum"], torch.full((7,), 4.0))
    mgr.close()


def test_staging_slots_are_aligned_views_of_one_shared_buffer():
    s = StagingBuffers(shared=True)
    staged = s.stage({"a": torch.ones(3, dtype=torch.float16), "b": torch.arange(5, dtype=torch.int64)})
    base = s.flat.data_ptr()
    offsets = [t.data_ptr() - base for t in (staged["a"], staged["b"])]
    assert offsets == [0, 64] and s.fd is not None
    assert torch.equal(staged["b"], torch.arange(5))
    s.release()
    assert s.flat is None and s.fd is None


def test_a_failed_write_in_the_process_is_the_os_error_and_a_checkpoint_error(tmp_path):
    from trainer.engine.checkpoint_writer import WriterProcess

    s = StagingBuffers(shared=True)
    staged = s.stage({"w": torch.ones(10)})
    proc = WriterProcess()
    target = tmp_path / "state.pt"
    target.mkdir()  # a folder where the file must go
    with pytest.raises(OSError) as e:
        proc.save_state(staged, s.flat, s.fd, target)
    assert e.value.errno == errno.EISDIR
    proc.close()
    # through the manager: the same one-line CheckpointError as the thread's, previous checkpoint kept
    mgr = CheckpointManager(tmp_path / "ck", writer="process")
    first = _save(mgr, {"w": torch.ones(10)}, 1)
    real = mgr._process.save_state

    def obstructed(tree, flat, fd, path):  # a folder where the file must go, in the real writer process
        path.mkdir()
        return real(tree, flat, fd, path)

    mgr._process.save_state = obstructed
    mgr.save({"w": torch.ones(10)}, _progress(2))
    with pytest.raises(ckpt.CheckpointError, match=r"ckpt-000000002-m: cannot write this checkpoint .*intact"):
        mgr.wait()
    assert mgr.pointer("latest") == first.name
    mgr.close()


def test_a_dead_writer_is_replaced_and_signals_do_not_kill_it(tmp_path, capfd):
    mgr = CheckpointManager(tmp_path / "ck", writer="process")
    _save(mgr, {"w": torch.ones(100)}, 1)
    proc = mgr._process._proc
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C to the process group, a spot notice
        os.kill(proc.pid, sig)
    time.sleep(0.5)
    assert proc.poll() is None
    assert _save(mgr, {"w": torch.full((100,), 2.0)}, 2).name == "ckpt-000000002-m"
    proc.kill()
    proc.wait()
    path = _save(mgr, {"w": torch.full((100,), 3.0)}, 3)  # a new process, a new copy of the buffer
    assert mgr._process._proc.pid != proc.pid
    assert torch.equal(CheckpointManager.load(path)[0]["w"], torch.full((100,), 3.0))

    def dies(*a, **k):
        raise RuntimeError("the checkpoint writer process died (exit code -9)")

    mgr._process.save_state = dies  # dies mid-write: the training process writes this one itself
    path = _save(mgr, {"w": torch.full((100,), 4.0)}, 4)
    CheckpointManager.validate(path)
    assert torch.equal(CheckpointManager.load(path)[0]["w"], torch.full((100,), 4.0))
    assert "ckpt-000000004-m is written by the training process" in capfd.readouterr().err
    mgr.close()


def test_auto_chooses_by_state_size(tmp_path, monkeypatch):
    small = CheckpointManager(tmp_path / "a", writer="auto")
    assert small.prepare({"w": torch.ones(10)}) == "checkpoint: writer thread" and small._process is None
    monkeypatch.setattr(ckpt, "PROCESS_WRITER_MIN_BYTES", 4000)
    big = CheckpointManager(tmp_path / "b", writer="auto")
    assert big.prepare({"w": torch.ones(1000)}) == "checkpoint: writer process (state 0 MiB)"
    assert big._process._proc is not None  # started now, before the first checkpoint
    _save(big, {"w": torch.ones(1000)}, 1)
    big.close()
    with pytest.raises(ValueError, match="writer: got 'fast'"):
        CheckpointManager(tmp_path / "c", writer="fast")


def test_writer_process_whose_trainer_is_gone_mid_write_ends_quietly(tmp_path):
    """The trainer goes (its socket closes) while the writer process writes: the writer finishes, finds nobody to
    answer and exits 0 without a traceback. Before, it printed a BrokenPipeError traceback into the run's log."""
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection
    from pathlib import Path

    from trainer.engine.checkpoint_writer import shared_buffer, skeleton

    ours, theirs = socket.socketpair()
    root = str(Path(ckpt.__file__).resolve().parents[2])
    code = f"from trainer.engine.checkpoint_writer import _serve; _serve({theirs.fileno()})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        pass_fds=[theirs.fileno()],
        env={**os.environ, "PYTHONPATH": root},
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    flat, fd = shared_buffer(4096)
    tree = {"w": flat[:1024].view(torch.float32)}
    conn = Connection(os.dup(ours.fileno()))
    conn.send(("buffer", flat.numel()))
    socket.send_fds(ours, [b"F"], [fd])
    conn.send(("save", skeleton(tree, flat.data_ptr()), str(tmp_path / "state.pt")))
    conn.close()
    ours.close()  # the trainer is gone before the answer
    _, err = proc.communicate(timeout=60)
    os.close(fd)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert (tmp_path / "state.pt").is_file()
