"""Spot safety for detection: a DINO run stopped by SIGTERM twice mid-epoch (a worker process augmenting, denoising
noise from the global generator, EMA, AdamW) and resumed with the same command ends bit-identical to an
uninterrupted run (same machine, same thread count)."""

from __future__ import annotations

import signal
import sys

import yaml
from test_detection import _cfg, facemask_subset
from test_interruption import REPO, _assert_same_state, _env, _final_state, _run_until

from tests import forkserver


def _command(shared_data, tmp_path, name: str, n_train: int = 6, n_val: int = 2, **extra) -> list[str]:
    """``python -m trainer train --config`` of a 2-epoch DINO run on ``n_train``/``n_val`` facemask images
    (EMA, AdamW, one loader worker); ``extra``: more config fields."""
    data = facemask_subset(shared_data, tmp_path / "data", n_train, n_val)
    out = tmp_path / name
    cfg = _cfg(
        data,
        out,
        **{
            "epochs": 2,
            "batch_size": 2,
            "use_ema": True,
            "ema_decay": 0.9,
            "num_workers": 1,
            "log_every_steps": 1,
            "scheduler": "cosine",
            "warmup_epochs": 0.5,
            **extra,
        },
    ).to_dict()
    out.mkdir(parents=True, exist_ok=True)
    (out / "c.yaml").write_text(yaml.safe_dump(cfg))
    return [sys.executable, "-m", "trainer", "train", "--config", str(out / "c.yaml")]


def test_detection_sigterm_resume_is_bit_exact(shared_data, tmp_path):
    env = _env(OMP_NUM_THREADS="1")
    ref = _command(shared_data, tmp_path, "reference")
    p = forkserver.run(ref, cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    cmd = _command(shared_data, tmp_path, "interrupted")
    for step in (2, 4):  # mid-epoch 1 (3 steps per epoch), mid-epoch 2
        rc, log = _run_until(cmd, step, signal.SIGTERM, env=env, timeout=900)
        assert rc == 75 and "interrupted: SIGTERM" in log, log[-3000:]
    p = forkserver.run(cmd, cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "the previous run was interrupted: SIGTERM" in p.stdout
    ref, resumed = _final_state(tmp_path / "reference"), _final_state(tmp_path / "interrupted")
    _assert_same_state(ref, resumed)
    assert [h["val_map"] for h in ref["history"]] == [h["val_map"] for h in resumed["history"]]
