"""``benchmarks/gpu_busy.py``: GPU busy % over a training run's epoch window (the figure docs/benchmarks.md reports
for DINO's real loop), from nvidia-smi's CSV and the run's log; bad files are one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_busy  # noqa: E402


def _smi(path: Path, samples: list[tuple[int, int]]) -> Path:
    lines = ["timestamp, memory.used [MiB], utilization.gpu [%]"]
    lines += [
        f"2026/11/27 07:24:{i // 2:02d}.{5 * (i % 2)}00, {mem} MiB, {util} %" for i, (mem, util) in enumerate(samples)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_window_starts_at_the_first_busy_sample_and_lasts_the_epoch(tmp_path):
    # start-up with no memory, start-up at 2 %, 4 s of training at 50 %, then evaluation and shutdown at 0 %
    samples = [(0, 0)] * 3 + [(3000, 2)] * 4 + [(5000, 50)] * 8 + [(5000, 0)] * 10
    log = tmp_path / "run.log"
    log.write_text("step=20 loss=1.0\nepoch=1 step=40 train_loss=1.0 images_per_s=20.0 epoch_time_s=4.0\n")
    window, n_window, whole, n_whole = gpu_busy.busy(_smi(tmp_path / "smi.csv", samples), log)
    assert (window, n_window) == (50.0, 8)
    assert n_whole == 22 and whole == pytest.approx((4 * 2 + 8 * 50) / 22)


def test_a_log_without_an_epoch_line_is_one_line_and_exit_2(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("step=20 loss=1.0\n")
    smi = _smi(tmp_path / "smi.csv", [(5000, 50)] * 4)
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_busy.py"), str(smi), str(log)], capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no GPU samples" in p.stderr and str(log) in p.stderr
