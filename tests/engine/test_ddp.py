"""Multi-process runs under torchrun (gloo on CPU): identical parameters on every rank, the CLI end to end,
and seed 003's command line run as written (FFCV flags removed, a local ImageFolder given)."""

from __future__ import annotations

import json
import os
import shlex
import sys

import torch
from conftest import REPO, run_trainer
from test_config import SEED_003_FLAGS

from tests import forkserver


def _args(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def test_two_rank_ddp_keeps_parameters_equal(tiny_digits, tmp_path):
    args = _args(
        dict(
            data_dir=tiny_digits,
            model="resnet18",
            image_size=32,
            hflip_prob=0,
            batch_size=32,
            epochs=1,
            lr=0.05,
            num_workers=1,
            accumulate_grad_batches=2,
            gradient_clip=1.0,
            checkpoint_dir=tmp_path / "ck",
            log_dir=tmp_path / "logs",
            device="cpu",
        )
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(REPO / "tests" / "ddp_worker.py"),
        str(tmp_path),
        *args,
        "--use-ema",
        "--mixup-alpha",
        "0.2",
    ]
    # torchrun's launcher forked from the tests' fork server (its ranks are fresh interpreters all the same)
    p = forkserver.run(cmd, cwd=REPO, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert r0.keys() == r1.keys() and len(r0) > 10
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    assert "world_size=2" in p.stdout and "micro_batch=8" in p.stdout


def test_cli_under_torchrun_prints_outputs(tiny_digits, tmp_path):
    p = run_trainer(
        _args(
            dict(
                data_dir=tiny_digits,
                model="resnet18",
                image_size=32,
                batch_size=32,
                epochs=1,
                lr=0.02,
                num_workers=0,
                checkpoint_dir=tmp_path / "ck",
                log_dir=tmp_path / "logs",
            )
        ),
        torchrun_nproc=2,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    epoch_lines = [l for l in lines if l.startswith("epoch=")]
    assert len(epoch_lines) == 1  # only rank 0 prints
    import re

    assert re.search(r"val_top1=([0-9.]+)", epoch_lines[0]) and re.search(r"train_loss=([0-9.eE+-]+)", epoch_lines[0])
    assert any(l.startswith("checkpoint: ") and "ckpt-" in l for l in lines)
    assert any(l.startswith("plot: ") and l.endswith("curves.png") for l in lines)


def test_seed_003_command_runs_as_written(shared_data, tmp_path):
    """Seed 003's flags verbatim, then only what a CPU test must change (size, data and output paths)."""
    small = (
        f"--data-dir {shared_data / 'hymenoptera'} --checkpoint-dir {tmp_path / 'ck'} --log-dir {tmp_path / 'logs'} "
        "--model resnet18 --batch-size 32 --epochs 3 --warmup-epochs 1 --image-size 64 "
        "--progressive-min-size 32 --num-workers 1 --max-steps-per-epoch 2"
    )
    p = run_trainer(shlex.split(SEED_003_FLAGS) + shlex.split(small), torchrun_nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "precision=fp32" in out  # --amp on CPU: fp32 unless asked
    assert "1 .gif" in out  # the GIF is decoded and reported in the census
    rows = [json.loads(l) for l in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["image_size"] for r in epochs] == [32, 48, 64]  # progressive resize, 3 stages
    assert all("ema_val_top1" in r for r in epochs)
    assert "WARNING: lr" in out  # 0.8 for a global batch of 32 is far beyond linear scaling


def test_bad_config_exits_2_before_training(tmp_path):
    p = run_trainer(
        [
            "--data-dir",
            str(tmp_path / "missing"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--log-dir",
            str(tmp_path / "logs"),
        ]
    )
    assert p.returncode == 2
    assert "data split 'train'" in p.stderr and "does not exist" in p.stderr
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
