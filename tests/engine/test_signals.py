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
    argv = [sys.executable, "-m", "trainer", "train", *flags(tmp_path, model=MODEL, epochs=1000, max_steps_per_epoch=5)]
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
