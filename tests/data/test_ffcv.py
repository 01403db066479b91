"""FFCV path: write-ffcv on the real hymenoptera and imagenette subsets, a 2-rank torchrun run from
the .ffcv files with progressive resizing, a bit-exact mid-epoch resume, and the errors raised before training
(missing extra, missing file, truncated file, corrupt header). Needs the ffcv extra (``make ffcv``)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, run_trainer
from test_interruption import _assert_same_state, _cmd, _env, _final_state, _run_until

from tests import forkserver
from trainer.data.formats.imagefolder import DataError, scan_split


def _write(data, out, *extra) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "write-ffcv",
        "--data-dir",
        str(data),
        "--ffcv-dir",
        str(out),
        "--max-resolution",
        "48",
        "--num-workers",
        "2",
        *extra,
    ]
    return forkserver.run(cmd, cwd=REPO, env=_env(), timeout=300)


@pytest.fixture(scope="module")
def betons(shared_data, tmp_path_factory):
    """Both shared ImageFolder subsets converted once: {name: ffcv_dir}."""
    out = {}
    for name in ("hymenoptera", "imagenette-subset"):
        d = tmp_path_factory.mktemp(name)
        p = _write(shared_data / name, d)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "write-ffcv: train: " in p.stdout and "write-ffcv: val: " in p.stdout, p.stdout
        out[name] = d
    return out


@pytest.mark.parametrize("name", ["hymenoptera", "imagenette-subset"])
def test_write_ffcv_keeps_every_sample_in_scan_order(betons, shared_data, name):
    from trainer.data.formats.ffcv import check_beton

    for split in ("train", "val"):
        scan = scan_split(shared_data / name, split)
        info = check_beton(betons[name] / f"{split}.ffcv")
        assert info["samples"] == len(scan.samples)
        assert info["labels"].tolist() == [label for _, label in scan.samples]  # FFCV index i = ImageFolder i
        meta = json.loads((betons[name] / f"{split}.json").read_text())
        assert meta["classes"] == scan.classes and meta["options"]["max_resolution"] == 48
        s = meta["summary"]
        assert s["jpg"] + s["raw"] == len(scan.samples) and 0 < s["jpg"] < len(scan.samples)  # proportion 0.5
        assert s["max_side"] <= 48


def _flags(ffcv_dir, out, **extra):
    """test_interruption's flags (EMA, MixUp/CutMix, progressive resizing, 2 DDP ranks) on the FFCV path."""
    return dict(
        data_dir="unused",
        use_ffcv="",
        ffcv_dir=ffcv_dir,
        hflip_prob=0.5,
        epochs=2,
        max_steps_per_epoch=4,
        checkpoint_dir=out / "ck",
        log_dir=out / "logs",
        **extra,
    )


@pytest.fixture(scope="module")
def ffcv_reference(betons, tmp_path_factory):
    """Uninterrupted 2-rank torchrun run on imagenette's .ffcv: 2 epochs x 4 steps at 16 then 32 px, EMA."""
    out = tmp_path_factory.mktemp("ffcv_ref")
    cmd = _cmd(**_flags(betons["imagenette-subset"], out, progressive_stages=2), data=None, out=out, nproc=2)
    p = forkserver.run(cmd, cwd=REPO, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout, _final_state(out), out


def test_two_rank_ffcv_run_trains_and_evaluates(ffcv_reference):
    stdout, state, out = ffcv_reference
    assert "world_size=2" in stdout and "micro_batch=16" in stdout and "data: ffcv: 10 classes" in stdout
    rows = [json.loads(l) for l in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["image_size"] for r in epochs] == [16, 32]  # progressive resizing through the FFCV decoder
    assert all(np.isfinite(r["train_loss"]) and 0 <= r["val_top1"] <= 100 and "ema_val_top1" in r for r in epochs)
    assert state["progress"]["global_step"] == 8


def test_ffcv_mid_epoch_resume_is_bit_exact(betons, ffcv_reference, tmp_path):
    """SIGTERM in the middle of epoch 0 (step 2 of 4), same command again: same weights, EMA, momentum."""
    cmd = _cmd(**_flags(betons["imagenette-subset"], tmp_path, progressive_stages=2), data=None, out=tmp_path, nproc=2)
    rc, log = _run_until(cmd, 2, signal.SIGTERM)
    assert "interrupted: SIGTERM" in log, log[-3000:]
    ck = tmp_path / "ck"
    assert (ck / (ck / "latest").read_text().strip()).name.endswith("-m")  # a mid-epoch checkpoint
    p = forkserver.run(cmd, cwd=REPO, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "checkpoint: continuing in epoch 1 of 2 at step " in p.stdout
    _assert_same_state(ffcv_reference[1], _final_state(tmp_path))


# --- errors before training -------------------------------------------------------------------------------
def _train_rc(ffcv_dir, tmp_path, env=None):
    p = run_trainer(
        [
            "--use-ffcv",
            "--ffcv-dir",
            str(ffcv_dir),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--log-dir",
            str(tmp_path / "logs"),
            "--device",
            "cpu",
            "--num-workers",
            "1",
        ],
        env=env,
    )
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    return p.returncode, p.stderr


def test_missing_extra_is_a_clear_exit_2(tmp_path, shared_data):
    fake = tmp_path / "site"
    (fake / "ffcv").mkdir(parents=True)
    (fake / "ffcv" / "__init__.py").write_text("raise ImportError('simulated: libturbojpeg.so.0 not found')\n")
    env = {"PYTHONPATH": f"{fake}:{REPO}"}
    rc, err = _train_rc(tmp_path, tmp_path, env=env)
    assert rc == 2 and "simulated: libturbojpeg" in err and "make ffcv" in err and "libopencv-dev" in err, err
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "write-ffcv",
            "--data-dir",
            str(shared_data / "hymenoptera"),
            "--ffcv-dir",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env={**_env(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "make ffcv" in p.stderr, p.stderr


def test_missing_and_truncated_files_exit_2(betons, tmp_path):
    rc, err = _train_rc(tmp_path / "nowhere", tmp_path)
    assert rc == 2 and "nowhere/train.ffcv does not exist" in err and "write-ffcv" in err, err
    d = tmp_path / "cut"
    shutil.copytree(betons["hymenoptera"], d)
    data = (d / "train.ffcv").read_bytes()
    (d / "train.ffcv").write_bytes(data[: len(data) // 2])
    rc, err = _train_rc(d, tmp_path)
    assert rc == 2 and f"{d / 'train.ffcv'}" in err and "truncated" in err, err


@pytest.mark.parametrize(
    "patch,expect",
    [
        ((0, b"\x07\x00"), "format version 7"),  # version field
        ((2, b"\x00\x00"), "0 fields"),  # num_fields
        ((16, b"\xff" * 8), "truncated or corrupt"),  # alloc_table_ptr beyond the end
        (None, "shorter than the"),  # 10 bytes of a header
    ],
)
def test_corrupt_header_is_named(betons, tmp_path, patch, expect):
    from trainer.data.formats.ffcv import check_beton

    path = tmp_path / "val.ffcv"
    data = bytearray((betons["hymenoptera"] / "val.ffcv").read_bytes())
    if patch is None:
        data = data[:10]
    else:
        data[patch[0] : patch[0] + len(patch[1])] = patch[1]
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=expect) as e:
        check_beton(path)
    assert str(path) in str(e.value)


def test_undecodable_file_fails_the_conversion(tmp_path, shared_data):
    src = tmp_path / "data"
    for split in ("train", "val"):
        shutil.copytree(shared_data / "hymenoptera" / split / "bees", src / split / "bees")
        (src / split / "ants").mkdir(parents=True)
        (src / split / "ants" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    p = _write(src, tmp_path / "out", "--splits", "train")
    assert p.returncode == 2 and "broken.jpg" in p.stderr and "cannot be decoded" in p.stderr, p.stderr
    assert not (tmp_path / "out" / "train.ffcv").exists()
