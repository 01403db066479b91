"""One writer per run: ``train`` holds an exclusive ``flock`` on its checkpoint folder
(:class:`trainer.engine.durable.WriterLock`); a second writer exits 2 naming the first's pid, host and start time
while the first trains on; the kernel frees the lock of a process that dies; a second Ctrl-C (exit 130) leaves the
MLflow run KILLED, not RUNNING."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO
from test_bad_inputs_engine import _env, flags, tiny_data

from trainer.engine.checkpoint import CheckpointManager
from trainer.engine.durable import LOCK_FILE, WriterLock, lock_holder
from trainer.errors import CheckpointError


def test_a_second_lock_is_refused_naming_the_holder_and_free_again_after_release(tmp_path: Path):
    first = WriterLock(tmp_path)
    assert first.acquire() is None and first.held
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert lock_holder(tmp_path) == holder
    with pytest.raises(CheckpointError) as e:
        WriterLock(tmp_path).acquire()  # flock locks belong to the open file: a second open conflicts
    msg = str(e.value)
    assert msg.startswith(f"checkpoint_dir: {tmp_path} is being written by another run: pid {os.getpid()} on host ")
    assert f"since {holder['started']}" in msg and "\n" not in msg
    first.release()
    assert not (tmp_path / LOCK_FILE).exists() and lock_holder(tmp_path) is None
    second = WriterLock(tmp_path)
    assert second.acquire() is None
    second.release()


def test_the_checkpoint_manager_takes_the_lock_before_cleaning_up(tmp_path: Path):
    """A second manager on a folder being written must not delete the first one's half-written checkpoint."""
    first = CheckpointManager(tmp_path)
    (tmp_path / ".tmp-ckpt-000000007").mkdir()  # the first run's checkpoint in progress
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
        CheckpointManager(tmp_path)
    assert (tmp_path / ".tmp-ckpt-000000007").is_dir()
    first.release_lock()
    CheckpointManager(tmp_path).release_lock()
    assert not (tmp_path / ".tmp-ckpt-000000007").exists()


def test_the_lock_of_a_killed_process_is_free(tmp_path: Path):
    """SIGKILL leaves the lock file (with its old holder written in it) but not the lock: the kernel drops it."""
    code = (
        "import sys, time\nfrom trainer.engine.durable import WriterLock\n"
        "WriterLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(600)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "held"
        assert lock_holder(tmp_path)["pid"] == p.pid
        with pytest.raises(CheckpointError, match=f"pid {p.pid} "):
            WriterLock(tmp_path).acquire()
    finally:
        p.kill()
        p.wait(60)
    assert (tmp_path / LOCK_FILE).exists() and lock_holder(tmp_path) is None
    mine = WriterLock(tmp_path)
    assert mine.acquire() is None
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    mine.release()


class _Lines:
    """The output lines of a running process, read by a thread (so the test can wait for one without blocking)."""

    def __init__(self, p: subprocess.Popen):
        self.p, self.lines, self.cond = p, [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()

    def wait_for(self, pred, after: int = 0, timeout: float = 300) -> int:
        """Index of the first line from ``after`` on that satisfies ``pred``; fails when the process ends first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for i in range(after, len(self.lines)):
                    if pred(self.lines[i]):
                        return i
                assert self.p.poll() is None and time.monotonic() < deadline, "".join(self.lines[-30:])
                self.cond.wait(0.5)


def _start(tmp: Path, env: dict, *args: str, **extra) -> tuple[subprocess.Popen, _Lines]:
    p = subprocess.Popen(
        [sys.executable, *args, "train", *flags(tmp, **extra)],
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return p, _Lines(p)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_train_on_the_same_checkpoint_dir_exits_2_naming_the_first_which_trains_on(tmp_path: Path):
    """While one ``train`` runs, a second one on its checkpoint_dir exits 2 with one line
    naming the first's pid; the first keeps training and ends as usual (SIGTERM: exit 75)."""
    tiny_data(tmp_path / "data", train=40)
    first, out = _start(tmp_path, _env(), "-m", "trainer", epochs=1000, max_steps_per_epoch=5)
    try:
        seen = out.wait_for(lambda line: line.startswith("step="))
        second = subprocess.run(
            [sys.executable, "-m", "trainer", "train", *flags(tmp_path, epochs=1000, max_steps_per_epoch=5)],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        err = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(err) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"is being written by another run: pid {first.pid} on host {socket.gethostname()} since " in err[0]
        assert "checkpoint_dir" in err[0] and not second.stdout.count("step=")
        # the first trains on: new step lines after the refusal
        out.wait_for(lambda line: line.startswith("step="), after=len(out.lines))
        assert first.poll() is None and seen >= 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGTERM)
        first.wait(300)
    assert first.returncode == 75, "".join(out.lines[-30:])
    assert not (tmp_path / "ck" / LOCK_FILE).exists()  # released at the end of the run


@pytest.mark.slow
@pytest.mark.multiprocess
def test_second_ctrl_c_leaves_the_mlflow_run_killed(tmp_path: Path, monkeypatch):
    """Ctrl-C, then Ctrl-C again while the stop checkpoint is being written: exit 130
    and the (local file-store) MLflow run ends KILLED, not RUNNING for ever."""
    pytest.importorskip("mlflow")
    tiny_data(tmp_path / "data", train=40)
    marker = tmp_path / "stalled"
    env = {**_env(), "STALL_FROM_STEP": "3", "STALL_MARKER": str(marker), "MLFLOW_ALLOW_FILE_STORE": "true"}
    p, out = _start(
        tmp_path,
        env,
        str(REPO / "tests" / "slow_checkpoint_worker.py"),
        checkpoint_every_steps=2,
        max_steps_per_epoch=10,
        tracking="mlflow",
    )
    out.wait_for(lambda line: line.startswith("step=3 "))
    os.killpg(p.pid, signal.SIGINT)
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert p.poll() is None and time.monotonic() < deadline, "".join(out.lines[-30:])
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)
    p.wait(120)
    assert p.returncode == 130, "".join(out.lines[-30:])
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "logs" / "mlruns").resolve().as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.status for r in runs] == ["KILLED"], "".join(out.lines[-30:])
    assert not (tmp_path / "ck" / LOCK_FILE).exists()
