"""The bad-input table of the command line, the config, the image's entrypoint, torchrun, probe and plan.

Each ``Case`` row: input -> exit status -> fragment of the last stderr line -> what survived (see
tests/bad_input_table.py for the contract: also no traceback anywhere). ``OUTPUT`` adds checks on a row's
whole output (usage line, message shown once, nothing measured).

Plain tests below the table, and why they are not rows: a bare ``torchrun`` prints its own launcher traceback
(``ChildFailedError``) whatever the ranks do, which the table forbids, so those two check what torchrun's report
shows; the second Ctrl-C, the final ``checkpoint:`` line and the error-during-training paths need a stand-in
Trainer (monkeypatched, in process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bad_input_table import REPO, Case, run_case, trainer_cmd
from conftest import run_trainer
from PIL import Image

TRAIN = REPO / "images" / "training" / "train"
DIGITS = REPO / "configs" / "digits.yaml"
TINY = [
    "--model",
    "resnet18",
    "--image-size",
    "32",
    "--batch-size",
    "8",
    "--num-workers",
    "0",
    "--device",
    "cpu",
    "--epochs",
    "1",
    "--max-steps-per-epoch",
    "2",
    "--checkpoint-dir",
    "ck",
    "--log-dir",
    "logs",
]
VAL_MISSING = "data split 'val': folder"


def images(root: Path, splits=("train", "val"), classes=("a", "b"), n: int = 4) -> Path:
    """A tiny ImageFolder: ``n`` 8x8 RGB PNGs per class and split."""
    rng = np.random.default_rng(0)
    for split in splits:
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
    return root


def _nothing_trained(tmp: Path) -> None:
    assert not (tmp / "ck").exists() or not any((tmp / "ck").iterdir())


def _nothing_swept(tmp: Path) -> None:
    assert not (tmp / "sw").exists()


def _results_file_kept(tmp: Path) -> None:
    assert (tmp / "results").read_text() == "earlier results\n"


def _sm_root(tmp: Path, hps: dict) -> Path:
    """A fake SageMaker /opt/ml under ``tmp/opt_ml`` with one 'training' channel -> ``tmp/data``."""
    root = tmp / "opt_ml"
    (root / "input" / "config").mkdir(parents=True)
    (root / "input" / "config" / "resourceconfig.json").write_text(
        json.dumps({"current_host": "algo-1", "hosts": ["algo-1"]})
    )
    (root / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hps))
    (root / "input" / "data").mkdir()
    (root / "input" / "data" / "training").symlink_to(tmp / "data", target_is_directory=True)
    return root


def _entrypoint_val_missing(tmp: Path) -> list[str]:
    images(tmp / "data", splits=("train",))
    _sm_root(
        tmp,
        {
            "model": "resnet18",
            "image_size": "32",
            "batch_size": "8",
            "num_workers": "0",
            "device": "cpu",
            "epochs": "1",
        },
    )
    return [sys.executable, str(TRAIN)]


def _entrypoint_failure_file(tmp: Path) -> None:
    root = tmp / "opt_ml"
    reason = (root / "output" / "failure").read_text()
    assert VAL_MISSING in reason and "a retry fails the same way" in reason, reason
    assert not (root / "model" / "model.json").exists()
    assert not (root / "checkpoints").exists() or not any((root / "checkpoints").glob("ckpt-*"))


def _usage(command: str):
    def check(proc: subprocess.CompletedProcess) -> None:
        assert "usage:" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[:300]

    return check


def _once(fragment: str):
    def check(proc: subprocess.CompletedProcess) -> None:
        out = proc.stdout + proc.stderr
        assert out.count(fragment) == 1, out[-4000:]

    return check


def _no_export(tmp: Path) -> None:
    assert not (tmp / "out").exists()


def _nothing_measured(proc: subprocess.CompletedProcess) -> None:
    assert "probe: " not in proc.stdout, proc.stdout  # not even the first "probe: <model> at ..." line


def _plan_refused(*task_flags: str) -> list[str]:
    """``plan`` of a config ``train`` refuses (``task_flags``), with a dataset size and one instance type so that
    nothing but the task's config check can stop it."""
    return trainer_cmd("plan", *task_flags, "--batch-size", "2", "--dataset-size", "100", "--instances", "g5.xlarge")


CASES = [
    # --- the command line ---------------------------------------------------------------------------------
    Case(
        "train-unknown-flag",
        lambda t: trainer_cmd("train", "--bogus"),
        2,
        "error: train: unrecognized arguments: --bogus; see python -m trainer train --help",
    ),
    Case(
        "probe-unknown-flag",
        lambda t: trainer_cmd("probe", "--bogus"),
        2,
        "error: probe: unrecognized arguments: --bogus; see python -m trainer probe --help",
    ),
    Case(
        "plan-unknown-flag",
        lambda t: trainer_cmd("plan", "--epochs", "3", "--bogus", "7"),
        2,
        "error: plan: unrecognized arguments: --bogus 7; see python -m trainer plan --help",
    ),
    Case(
        "write-ffcv-unknown-flag",
        lambda t: trainer_cmd("write-ffcv", "--data-dir", "d", "--ffcv-dir", "f", "--bogus"),
        2,
        "error: write-ffcv: unrecognized arguments: --bogus; see python -m trainer write-ffcv --help",
    ),
    Case(
        "unknown-command",
        lambda t: trainer_cmd("bogus"),
        2,
        "error: trainer: command: invalid choice: 'bogus' (choose from",
    ),
    Case("no-command", lambda t: trainer_cmd(), 2, "the following arguments are required: command"),
    Case(
        "train-cuda-graphs-on-cpu",
        lambda t: trainer_cmd(
            "train",
            "--task",
            "detection",
            "--data-dir",
            "d",
            "--canvases",
            "auto",
            "--dn-max-boxes",
            "100",
            "--cuda-graphs",
            "--device",
            "cpu",
        ),
        2,
        "error: cuda_graphs: needs a CUDA device, got cpu; train without --cuda-graphs",
    ),
    Case(
        "export-unsupported-format",
        lambda t: trainer_cmd("export", "--checkpoint", "ck", "--format", "tflite", "--out", "out"),
        2,
        "error: export: --format: invalid choice: 'tflite' (choose from 'onnx', 'torchscript', 'safetensors')",
    ),
    Case(
        "export-missing-checkpoint",
        lambda t: trainer_cmd("export", "--checkpoint", "nope", "--format", "onnx", "--out", "out"),
        2,
        "error: --checkpoint: nope does not exist; give a ckpt-* folder or a checkpoint_dir",
        lambda t: _no_export(t),
    ),
    # --- config values --------------------------------------------------------------------------------------
    Case(
        "image-size-100000",
        lambda t: trainer_cmd("train", *TINY, "--image-size", "100000"),
        2,
        "error: image_size: got 100000; must be <= 8192 pixels",
        _nothing_trained,
    ),
    Case(
        "tracking-unknown",
        lambda t: trainer_cmd("train", *TINY, "--tracking", "mlflow,tensorbord"),
        2,
        "error: tracking: got 'tensorbord'; allowed: mlflow, wandb (a list: mlflow,wandb)",
        _nothing_trained,
    ),
    Case(  # accepted before, then nothing tracked
        "tracking-uri-sqlite-without-sqlalchemy",
        lambda t: trainer_cmd("train", *TINY, "--tracking", "mlflow", "--tracking-uri", "sqlite:///mlflow.db"),
        2,
        "error: tracking_uri: got 'sqlite:///mlflow.db': scheme sqlite: needs SQLAlchemy",
        _nothing_trained,
    ),
    Case(
        "tracking-uri-ftp",
        lambda t: trainer_cmd("train", *TINY, "--tracking", "mlflow", "--tracking-uri", "ftp://h/mlruns"),
        2,
        "error: tracking_uri: got 'ftp://h/mlruns': scheme ftp: this install's MLflow opens a path or file:, http:",
        _nothing_trained,
    ),
    Case(
        "mlflow-tracking-uri-env-ftp",
        lambda t: trainer_cmd("train", *TINY, "--warmup-epochs", "0", "--tracking", "mlflow"),
        2,
        "error: MLFLOW_TRACKING_URI: got 'ftp://h/mlruns': scheme ftp:",
        _nothing_trained,
        env={"MLFLOW_TRACKING_URI": "ftp://h/mlruns"},
    ),
    Case(
        "progressive-min-size-100000",
        lambda t: trainer_cmd("train", "--progressive-min-size", "100000"),
        2,
        "error: progressive_min_size: got 100000; must be <= 8192 pixels",
        _nothing_trained,
    ),
    Case(
        "config-file-not-yaml",
        lambda t: [(t / "c.yaml").write_text("lr: [1\n"), trainer_cmd("train", "--config", "c.yaml")][1],
        2,
        "error: config file c.yaml: not valid YAML (while parsing",
    ),
    Case(
        "device-cuda-without-gpu",
        lambda t: trainer_cmd("train", "--data-dir", "data", *TINY, "--device", "cuda"),
        2,
        "error: device: 'cuda' requested but no CUDA device is visible",
        _nothing_trained,
        env={"CUDA_VISIBLE_DEVICES": ""},
    ),
    Case(
        "decode-device-cuda-on-cpu",
        lambda t: trainer_cmd("train", "--data-dir", str(images(t / "data")), *TINY, "--decode-device", "cuda"),
        2,
        "error: decode_device: got 'cuda' but the training device is cpu",
        _nothing_trained,
    ),
    Case(
        "decode-device-cuda-with-ffcv",
        lambda t: trainer_cmd("train", *TINY, "--use-ffcv", "--ffcv-dir", "f", "--decode-device", "cuda"),
        2,
        "error: decode_device: got 'cuda' with use_ffcv",
        _nothing_trained,
    ),
    # --- errors met inside the training process (one line, exit 2, by trainer.errors.exit_code) ------------
    Case(
        "val-split-missing",
        lambda t: trainer_cmd("train", "--data-dir", str(images(t / "data", ("train",))), *TINY),
        2,
        f"error: {VAL_MISSING}",
        _nothing_trained,
    ),
    Case(
        "resume-from-missing-checkpoint",
        lambda t: trainer_cmd("train", "--data-dir", str(images(t / "data")), "--resume", "nope", *TINY),
        2,
        "error: nope: no manifest.json",
        _nothing_trained,
    ),
    # --- the image's entrypoint: a rank's data error reaches the exit status and the failure file -----------
    Case(
        "entrypoint-rank-data-error",
        _entrypoint_val_missing,
        2,
        f"error: train: exit 2: {VAL_MISSING}",
        _entrypoint_failure_file,
        env={"TRAINSTACK_SM_ROOT": "opt_ml", "TRAINSTACK_NPROC_PER_NODE": "2"},
        timeout=600,
    ),
    # --- probe and plan: outputs checked before any work -----------------------------------------------------
    Case(
        "probe-out-dir-is-a-file",
        lambda t: [
            (t / "results").write_text("earlier results\n"),
            trainer_cmd("probe", "--data-dir", str(images(t / "data")), *TINY, "--out-dir", "results"),
        ][1],
        2,
        "error: --out-dir results: exists and is not a folder",
        _results_file_kept,
    ),
    Case(  # plan skipped the task's config check (a ValueError traceback building the model)
        "plan-detection-config-train-refuses",
        lambda t: _plan_refused("--task", "detection", "--model", "resnet18", "--hidden-dim", "48", "--nheads", "4"),
        2,
        "error: hidden_dim: got 48; must be divisible by nheads (4) and by 32 (GroupNorm(32, hidden_dim) in "
        "DINO's input projection)",
    ),
    Case(
        "plan-segmentation-size-train-refuses",
        lambda t: _plan_refused("--task", "segmentation", "--model", "unet", "--image-size", "60", "--classes", "a,b"),
        2,
        "error: image_size: got 60; unet needs a multiple of 32 (e.g. 32)",
    ),
    Case(
        "plan-video-frames-train-refuses",
        lambda t: _plan_refused("--task", "video", "--model", "r3d_18", "--num-frames", "0"),
        2,
        "error: num_frames: got 0; must be an integer >= 1",
    ),
    Case(
        "plan-out-inside-a-file",
        lambda t: [
            (t / "results").write_text("earlier results\n"),
            trainer_cmd(
                "plan",
                "--batch-size",
                "8",
                "--model-memory-gib",
                "1",
                "--dataset-size",
                "100",
                "--instances",
                "g5.xlarge",
                "--out",
                "results/plan.json",
            ),
        ][1],
        2,
        "error: --out results/plan.json: cannot create its folder results",
        _results_file_kept,
    ),
    Case("sweep-no-config", lambda t: trainer_cmd("sweep", "--grid", "lr=[0.1]", "--out", "sw"), 2, "error: --config"),
    Case(
        "sweep-unknown-grid-field",
        lambda t: trainer_cmd("sweep", "--config", str(DIGITS), "--grid", "lrr=[0.1]", "--out", "sw"),
        2,
        "error: --grid lrr: unknown config field",
    ),
    Case(  # trial t001's bad value is found before t000 runs
        "sweep-trial-bad-value",
        lambda t: trainer_cmd("sweep", "--config", str(DIGITS), "--grid", "lr=[0.1, -1]", "--out", "sw"),
        2,
        "error: sweep trial t001 (lr=-1): lr: got -1.0; must be a finite number > 0",
        lambda t: _nothing_swept(t),
    ),
    Case(
        "sweep-sets-checkpoint-dir",
        lambda t: trainer_cmd(
            "sweep", "--config", str(DIGITS), "--checkpoint-dir", "ck", "--grid", "lr=[0.1]", "--out", "sw"
        ),
        2,
        "error: --checkpoint-dir: the sweep sets it per trial",
    ),
]

OUTPUT = {
    "train-unknown-flag": _usage("train"),
    "probe-unknown-flag": _usage("probe"),
    "plan-unknown-flag": _usage("plan"),
    "write-ffcv-unknown-flag": _usage("write-ffcv"),
    "entrypoint-rank-data-error": _once(VAL_MISSING),
    "val-split-missing": _once(VAL_MISSING),
    "probe-out-dir-is-a-file": _nothing_measured,
}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path):
    proc = run_case(case, tmp_path)
    if case.id in OUTPUT:
        OUTPUT[case.id](proc)


# --- torchrun: the message once, as torchrun's root cause ----------------------------------------------------
def _root_cause(out: str) -> str:
    assert "Root Cause (first observed failure):" in out, out[-4000:]
    return out.split("Root Cause (first observed failure):", 1)[1]


def test_torchrun_rank_data_error_is_the_root_cause_once(tmp_path):
    """Both ranks meet the missing val split; torchrun (exit 1: its choice) shows the message once, as the
    root cause, and the other rank as a note pointing at it (never "To enable traceback see ...")."""
    data = images(tmp_path / "data", splits=("train",))
    p = run_trainer(
        [
            "--data-dir",
            str(data),
            *TINY[:-4],
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        torchrun_nproc=2,
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert out.count(VAL_MISSING) == 1, out[-4000:]
    assert f"error: {VAL_MISSING}" in _root_cause(out)
    assert "To enable traceback" not in out, out[-4000:]
    _nothing_trained(tmp_path)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--label-smoothing", "2"], "error: label_smoothing: got 2.0; must be in [0.0, 1.0)"),
        (["--bogus"], "error: train: unrecognized arguments: --bogus"),
    ],
    ids=["config-value", "unknown-flag"],
)
def test_torchrun_config_error_prints_once(tmp_path, args, message):
    """Rejected before training, in every rank: one message, torchrun's root cause (and one usage text)."""
    p = run_trainer([*args, "--checkpoint-dir", str(tmp_path / "ck")], torchrun_nproc=2)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert out.count(message.split(": ", 2)[-1]) == 1, out[-4000:]
    assert message in _root_cause(out)
    assert "usage: python -m trainer" not in out


# --- in process: what train.run does with each kind of ending -------------------------------------------------
class _Ckpt:
    def __init__(self, root: Path, durable, latest):
        self.dir, self.last_durable, self._latest = root, durable, latest

    def pointer(self, name):
        return self._latest if name == "latest" else None

    def release_lock(self):  # CheckpointManager's: run.py lets go of the writer lock however the run ends
        self.released = True


def _stand_in(monkeypatch, tmp_path, fit=None, init=None):
    """Replace trainer.engine.trainer.Trainer with a stand-in whose fit() or __init__ does what the test needs."""
    from trainer.engine import trainer as loop

    class StandIn:
        def __init__(self, cfg, info, stop):
            if init:
                init()
            self.interrupted, self.best = None, 50.0
            self.best_metric = "top1"
            self.ckpt = _Ckpt(tmp_path / "ck", (tmp_path / "ck" / "ckpt-9", 1.0), "ckpt-3")
            self.log = type("L", (), {"dir": tmp_path / "logs"})()

        def fit(self):
            return fit() if fit else {"val_top1": 50.0}

        def close(self):
            return None

        def final_checkpoint(self):
            return self.ckpt.last_durable[0]

        def abort(self):
            return self.final_checkpoint()

    monkeypatch.setattr(loop, "Trainer", StandIn)


def _cfg(tmp_path):
    from trainer.config import load_config

    return load_config(
        None,
        {
            "data_dir": str(tmp_path / "data"),
            "checkpoint_dir": str(tmp_path / "ck"),
            "log_dir": str(tmp_path / "logs"),
            "device": "cpu",
        },
    )


def test_second_ctrl_c_exits_130_and_cleans_up(tmp_path, monkeypatch, capsys):
    from trainer.engine import run as train

    ck = tmp_path / "ck"
    (ck / ".tmp-ckpt-7").mkdir(parents=True)
    (ck / ".tmp-ckpt-7" / "state.pt").write_bytes(b"half written")
    (ck / "ckpt-5").mkdir()

    def second_ctrl_c():
        raise KeyboardInterrupt

    _stand_in(monkeypatch, tmp_path, fit=second_ctrl_c)
    assert train.run(_cfg(tmp_path)) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1] == (
        "aborted by a second Ctrl-C; no checkpoint written for the current step; last durable "
        f"checkpoint: {ck / 'ckpt-9'}"
    )
    assert not list(ck.glob(".tmp-ckpt-*")) and (ck / "ckpt-5").is_dir()  # durable checkpoints stay


def test_final_checkpoint_line_is_this_runs_last_durable_checkpoint(tmp_path, monkeypatch, capsys):
    from trainer.engine import run as train

    _stand_in(monkeypatch, tmp_path)
    assert train.run(_cfg(tmp_path)) == 0
    out = capsys.readouterr().out
    assert f"checkpoint: {tmp_path / 'ck' / 'ckpt-9'}\n" in out and "ckpt-3" not in out


def test_input_error_during_training_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from trainer.engine import run as train
    from trainer.errors import CheckpointError

    def disk_full():
        raise CheckpointError("ck/.tmp-ckpt-12-m/state.pt: cannot write: No space left on device")

    _stand_in(monkeypatch, tmp_path, fit=disk_full)
    assert train.run(_cfg(tmp_path)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == ["error: ck/.tmp-ckpt-12-m/state.pt: cannot write: No space left on device"]


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    from trainer.engine import run as train

    def bug():
        raise ZeroDivisionError("division by zero")

    _stand_in(monkeypatch, tmp_path, init=bug)
    with pytest.raises(ZeroDivisionError):
        train.run(_cfg(tmp_path))


def test_library_errors_become_one_clean_line():
    """Decoder and torch.load messages: no C++ source location, no weights_only=False advice, cut at a word."""
    import argparse as ap
    import io

    import torch
    from torchvision.io import decode_image

    from trainer.errors import error_detail, shorten

    with pytest.raises(RuntimeError) as jpeg:
        decode_image(torch.frombuffer(bytearray(b"\xff\xd8\xff\xe0" + b"x" * 40), dtype=torch.uint8))
    assert ".cpp:" in str(jpeg.value) and ".cpp" not in error_detail(jpeg.value)
    assert error_detail(jpeg.value).startswith("RuntimeError: ") and "decode_" not in error_detail(jpeg.value)
    buf = io.BytesIO()
    torch.save({"args": ap.Namespace(lr=1)}, buf)
    buf.seek(0)
    with pytest.raises(Exception) as pickled:
        torch.load(buf, weights_only=True)
    assert "weights_only` set to `False`" in str(pickled.value)
    assert error_detail(pickled.value) == "UnpicklingError: not a file of tensors only (it holds argparse.Namespace)"
    assert shorten("alpha beta gamma", 12) == "alpha beta…" and shorten("alpha beta", 12) == "alpha beta"
    assert len(shorten("word " * 100, 50)) <= 50 and shorten("word " * 100, 50).endswith("word…")
