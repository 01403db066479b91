"""Signals a terminal or SSH session sends, and processes that must not outlive the trainer.

* SIGHUP (the SSH session dropped) stops ``train`` like SIGTERM: a durable checkpoint, exit 75, the MLflow run
  KILLED (not RUNNING), even when the terminal its output went to is gone (writes to it fail with EIO).
* SIGKILL of a ``train`` with loader workers leaves none of its processes behind: the workers' fork server, the
  workers, multiprocessing's resource tracker and the checkpoint writer process end with it.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_bad_inputs_engine import _env, flags, tiny_data

#: A small model (ShuffleNetV2 x0.5): what is asserted does not depend on it, and each step is cheap.
MODEL = "shufflenet_v2_x0_5"

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _read_until(fd: int, text: str, p: subprocess.Popen, timeout: float = 60) -> str:
    """Output read from the pty master ``fd`` until ``text`` appears; fails when ``p`` ends first."""
    seen, deadline = b"", time.monotonic() + timeout
    while text.encode() not in seen:
        assert p.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
        try:
            seen += os.read(fd, 4096)
        except OSError:
            time.sleep(0.05)
    return seen.decode(errors="replace")


def test_sighup_after_the_terminal_closed_checkpoints_exits_75_and_ends_the_mlflow_run(tmp_path: Path, monkeypatch):
    """An SSH drop: the terminal (a pty) is gone, then SIGHUP reaches the process group. Before, ``train`` died of
    the signal (exit -1 = SIGHUP) with no checkpoint and its MLflow run left RUNNING."""
    pytest.importorskip("mlflow")
    tiny_data(tmp_path / "data", train=40)
    master, slave = pty.openpty()
    env = {**_env(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    argv = [sys.executable, "-m", "trainer", "train", *flags(tmp_path, model=MODEL, epochs=1000, max_steps_per_epoch=2)]
    p = subprocess.Popen(
        argv + ["--tracking", "mlflow"], cwd=tmp_path, env=env, stdout=slave, stderr=slave, start_new_session=True
    )
    os.close(slave)
    try:
        _read_until(master, "evaluating epoch 1 ", p)
    finally:
        os.close(master)  # the terminal is gone: the trainer's next write to it fails with EIO
    os.killpg(p.pid, signal.SIGHUP)
    assert p.wait(120) == 75
    marker = json.loads((tmp_path / "ck" / "interrupted.json").read_text())
    assert marker["reason"] == "SIGHUP"
    latest = (tmp_path / "ck" / "latest").read_text().strip()
    assert (tmp_path / "ck" / latest / "manifest.json").is_file()
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "logs" / "mlruns").resolve().as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.status for r in runs] == ["KILLED"]


def _session(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid`` (zombies count as gone)."""
    procs = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                procs.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return procs


def _assert_killed_with_all_its_processes(p: subprocess.Popen, tree: list, lines: list) -> None:
    """``p`` (killed, the leader of its own session) is gone, and within 5 s so is every process of its session and
    of ``tree`` (its descendants before the kill); any left are killed after the check."""
    p.wait(30)
    deadline = time.monotonic() + 5
    while (left := _session(p.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not left, [" ".join(c.cmdline())[:200] for c in left] + lines[-20:]
        assert not [c.pid for c in tree if psutil.pid_exists(c.pid) and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        for c in _session(p.pid):
            c.kill()


def test_sigkill_of_train_leaves_no_worker_server_worker_tracker_or_writer_behind(tmp_path: Path):
    """SIGKILL of ``train`` with 2 loader workers and the checkpoint writer process: within 5 s none of the
    processes it started is alive. Before, the fork server, the workers and the resource tracker stayed for good
    (each worker holds the server's liveness pipe, and the server is the parent the workers watch)."""
    tiny_data(tmp_path / "data", train=40)
    argv = [sys.executable, "-m", "trainer", "train"]
    argv += flags(tmp_path, model=MODEL, epochs=1000, max_steps_per_epoch=5, num_workers=2, log_every_steps=1)
    argv += ["--checkpoint-writer", "process", "--checkpoint-every-steps", "1"]
    p = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("step=2 "):
                break
        tree = psutil.Process(p.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in tree)
        # the server and the tracker are forks of the trainer (its command line), the workers forks of the server
        assert "checkpoint_writer" in names and len(tree) >= 5, names  # writer, server, tracker, 2 train workers
    finally:
        p.kill()
    _assert_killed_with_all_its_processes(p, tree, lines)
    assert "Traceback" not in p.stdout.read()  # the checkpoint writer ended quietly (no BrokenPipeError)


#: A process whose loader (2 workers) starts a fresh-interpreter fork server from its main thread, as ``probe``
#: and a ``Trainer`` in a threaded process do, then waits to be killed.
_FRESH_SERVER = """
import time, torch
from trainer.data.loading import build_loader, iterate, start_worker_server, worker_server_note
data = torch.utils.data.TensorDataset(torch.arange(64.0))
sampler = torch.utils.data.BatchSampler(range(64), 4, drop_last=False)
loader = build_loader(data, sampler, torch.utils.data.default_collate, num_workers=2, prefetch_factor=2,
                      pin_memory=False, persistent_workers=True)
start_worker_server()
it = iterate(loader)
next(it)
print(worker_server_note(2), flush=True)
time.sleep(600)
"""


def test_sigkill_leaves_no_fresh_worker_server_or_worker_behind():
    """The fresh-interpreter server (not a fork of the trainer) dies with the process that started it from its
    main thread, and its workers with it."""
    p = subprocess.Popen(
        [sys.executable, "-c", _FRESH_SERVER], env=_env(), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        line = p.stdout.readline()
        assert "a fresh interpreter" in line, line
        tree = psutil.Process(p.pid).children(recursive=True)
        assert len(tree) >= 4, tree  # server, 2 workers, resource tracker
    finally:
        p.kill()
    _assert_killed_with_all_its_processes(p, tree, [])
