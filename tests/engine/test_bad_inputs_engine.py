"""Bad inputs of the training engine (loop, checkpoints, interruption, schedules): what a user sees.

The table rows run ``python -m trainer train ...`` on tiny PNG data built in the test's folder (input -> exit
status -> fragment of the last stderr line -> what survived). What a subprocess cannot express (a full disk,
torch's opaque write error, a read-only folder as root, the LR schedule grid, a second Ctrl-C at a chosen
moment, a bad val file behind the data's own up-front check) is a plain test below the table.
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from bad_input_table import REPO, Case, run_case, trainer_cmd

from tests import forkserver
from trainer.engine.checkpoint import CheckpointError, CheckpointManager

CLASSES = ("ants", "bees")


# --- tiny inputs ------------------------------------------------------------------------------------------
def tiny_data(root: Path, classes=CLASSES, train: int = 12, val: int = 4) -> Path:
    """ImageFolder of 8x8 RGB PNGs (a different colour per class), ``train``/``val`` files per class."""
    from PIL import Image

    for split, n in (("train", train), ("val", val)):
        for c, name in enumerate(classes):
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (8, 8), ((60 * c + 7 * i) % 256, 40 * c % 256, 255 - 9 * i % 256)).save(d / f"{i}.png")
    return root


def flags(tmp: Path, **extra) -> list[str]:
    """Flags of a seconds-long CPU run writing into ``tmp/ck`` and ``tmp/logs`` (``""``: a switch, None:
    left out)."""
    base = dict(
        data_dir=tmp / "data",
        model="resnet18",
        image_size=32,
        batch_size=8,
        epochs=1,
        max_steps_per_epoch=2,
        num_workers=0,
        device="cpu",
        checkpoint_dir=tmp / "ck",
        log_dir=tmp / "logs",
        log_every_steps=1,
        lr=0.01,
        warmup_epochs=0,
    )
    base.update(extra)
    out = []
    for k, v in base.items():
        if v is not None:
            out += [f"--{k.replace('_', '-')}"] + ([] if v == "" else [str(v)])
    return out


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "PYTHONUNBUFFERED": "1"}


def _train(tmp: Path, prefix: list[str] | None = None, **extra) -> subprocess.CompletedProcess:
    """A run that must succeed (``prefix``: the command before ``train``, default ``python -m trainer``)."""
    argv = [*(prefix or trainer_cmd()), "train", *flags(tmp, **extra)]
    p = forkserver.run(argv, cwd=tmp, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def _no_tmp_left(ck: Path) -> None:
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")], sorted(p.name for p in ck.iterdir())


def _nothing_trained(tmp: Path) -> None:
    ck = tmp / "ck"
    assert not ck.exists() or not any(ck.iterdir())
    jsonl = tmp / "logs" / "metrics.jsonl"
    assert not jsonl.exists() or not jsonl.read_text().strip()


# --- rows -------------------------------------------------------------------------------------------------
def _ckpt_dir_under_a_file(tmp: Path) -> list[str]:
    tiny_data(tmp / "data")
    (tmp / "afile").write_text("not a folder")
    return trainer_cmd("train", *flags(tmp, checkpoint_dir=tmp / "afile" / "ck"))


def _ckpt_dir_is_a_file(tmp: Path) -> list[str]:
    tiny_data(tmp / "data")
    (tmp / "ck").write_text("keep me")
    return trainer_cmd("train", *flags(tmp))


def _file_untouched(tmp: Path) -> None:
    assert (tmp / "ck").read_text() == "keep me"


def _ckpt_dir_read_only(tmp: Path) -> list[str]:
    tiny_data(tmp / "data")
    (tmp / "ck").mkdir()
    (tmp / "ck").chmod(0o555)
    return trainer_cmd("train", *flags(tmp))


def _previous_good(tmp: Path) -> None:
    """Setup: a 2-epoch run, then forget its last checkpoint, so a rerun resumes at step 2 and saves again."""
    tiny_data(tmp / "data")
    _train(tmp, epochs=2)
    ck = tmp / "ck"
    shutil.rmtree(ck / "ckpt-000000004")
    (ck / "latest").write_text("ckpt-000000002")


def _file_size_limit(tmp: Path) -> list[str]:
    _previous_good(tmp)
    # A 4 MiB file size limit (RLIMIT_FSIZE) with SIGXFSZ ignored: every write beyond it fails with EFBIG, as
    # a full disk fails with ENOSPC (tested in-process below). The state.pt of a ResNet-18 is ~90 MB.
    return [
        "bash",
        "-c",
        'trap "" XFSZ; ulimit -f 4096; exec "$@"',
        "bash",
        *trainer_cmd("train", *flags(tmp, epochs=2, checkpoint_every_steps=1, max_steps_per_epoch=6)),
    ]


def _previous_checkpoint_intact(tmp: Path) -> None:
    ck = tmp / "ck"
    assert (ck / "latest").read_text() == "ckpt-000000002"
    CheckpointManager.validate(ck / "ckpt-000000002")
    _no_tmp_left(ck)


_BASE_RUNS: dict[str, Path] = {}


def _trained(tmp: Path) -> None:
    """``tiny_data`` and one finished default run (``ck`` at step 2, ``logs``) in ``tmp``: trained once per
    pytest worker in a folder of its own, then copied, so the rows that change something after a finished run
    share one training (the checkpoint's saved paths name the base folder; resume compares the training
    fields, not where the files were)."""
    if "default" not in _BASE_RUNS:
        base = Path(tempfile.mkdtemp(prefix="bad-input-base-"))
        atexit.register(shutil.rmtree, base, True)  # 86 MB that each run used to leave in /tmp
        tiny_data(base / "data")
        _train(base)
        _BASE_RUNS["default"] = base
    for name in ("data", "ck", "logs"):
        shutil.copytree(_BASE_RUNS["default"] / name, tmp / name)


def _label_space_setup(tmp: Path, change) -> list[str]:
    _trained(tmp)
    change(tmp / "data")
    return trainer_cmd("train", *flags(tmp))


def _add_class(data: Path) -> None:
    tiny_data(data, classes=("wasps",))


def _rename_class(data: Path) -> None:
    for split in ("train", "val"):
        (data / split / "bees").rename(data / split / "wasps")


def _checkpoint_kept(tmp: Path) -> None:
    ck = tmp / "ck"
    assert (ck / "latest").read_text() == "ckpt-000000002"
    CheckpointManager.validate(ck / "ckpt-000000002")
    assert [p.name for p in ck.iterdir() if p.name.startswith("ckpt-")] == ["ckpt-000000002"]


def _other_model_forced(tmp: Path) -> list[str]:
    _trained(tmp)
    return trainer_cmd("train", *flags(tmp, model="resnet34", force_resume=""))


def _batch_indivisible_before_data(tmp: Path) -> list[str]:
    return trainer_cmd("train", *flags(tmp, data_dir=tmp / "no-such-data", batch_size=9, accumulate_grad_batches=2))


_as_root = pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root writes into a read-only (0555) folder; see test_read_only_checkpoint_dir",
)

CASES = [
    Case("ckpt-dir-cannot-be-created", _ckpt_dir_under_a_file, 2, "checkpoint_dir: cannot create", _nothing_trained),
    Case("ckpt-dir-is-a-file", _ckpt_dir_is_a_file, 2, "is not a folder", _file_untouched),
    pytest.param(
        Case("ckpt-dir-read-only", _ckpt_dir_read_only, 2, "checkpoint_dir: cannot write in", _nothing_trained),
        marks=_as_root,
        id="ckpt-dir-read-only",
    ),
    Case(
        "ckpt-write-fails-file-size-limit", _file_size_limit, 2, "File too large (EFBIG)", _previous_checkpoint_intact
    ),
    Case(
        "label-space-class-added",
        lambda tmp: _label_space_setup(tmp, _add_class),
        2,
        "classes: checkpoint has 2 [ants, bees], data has 3 [ants, bees, wasps]; only in data: wasps",
        _checkpoint_kept,
    ),
    Case(
        "label-space-class-renamed",
        lambda tmp: _label_space_setup(tmp, _rename_class),
        2,
        "only in checkpoint: bees; only in data: wasps",
        _checkpoint_kept,
    ),
    Case(
        "label-space-class-renamed-force-resume",
        lambda tmp: [*_label_space_setup(tmp, _rename_class), "--force-resume"],
        2,
        "(--force-resume does not override this)",
        _checkpoint_kept,
    ),
    Case(
        "force-resume-other-model",
        _other_model_forced,
        2,
        "weights do not fit model resnet34 (it was written for resnet18)",
        _checkpoint_kept,
    ),
    Case(
        "batch-indivisible-checked-before-data",
        _batch_indivisible_before_data,
        2,
        "batch_size: global batch 9 is not divisible",
        _nothing_trained,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, tmp_path: Path):
    run_case(case, tmp_path)


# --- runs that used to crash and must now train -----------------------------------------------------------
_SHORT = ["--max-steps-per-epoch", "1", "--epochs", "2", "--batch-size", "8", "--image-size", "32"]


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["--scheduler", "onecycle", "--warmup-epochs", "0"], id="onecycle-without-warmup"),
        pytest.param(["--config", str(REPO / "configs" / "digits.yaml")], id="digits.yaml-one-step-per-epoch"),
        pytest.param(
            ["--config", str(REPO / "configs" / "hymenoptera.yaml")], id="hymenoptera.yaml-one-step-per-epoch"
        ),
    ],
)
def test_onecycle_short_runs_train(extra: list[str], tmp_path: Path):
    """OneCycle with a warm-up that rounds to 0 or 1 step (torch's OneCycleLR divided by zero there)."""
    tiny_data(tmp_path / "data")
    base = flags(
        tmp_path,
        epochs=None,
        max_steps_per_epoch=None,
        batch_size=None,
        image_size=None,
        warmup_epochs=None if "--config" in extra else 0,
        lr=None if "--config" in extra else 0.01,
    )
    p = forkserver.run(
        trainer_cmd("train", *extra, *_SHORT, *base),
        cwd=tmp_path,
        env=_env(),
        timeout=600,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Traceback" not in out, out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if r["kind"] == "epoch"]
    assert len(lrs) == 2 and all(math.isfinite(x) for x in lrs)


# --- focused tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["onecycle", "cosine", "step"])
def test_every_schedule_length_and_warmup_works(scheduler: str):
    """Total steps 1..5, warm-up 0..total steps: builds, steps without a warning, LR finite and <= lr."""
    import warnings

    from trainer.config import TrainConfig
    from trainer.engine.optim import build_scheduler

    for total in range(1, 6):
        for warm in range(total + 1):
            cfg = TrainConfig(scheduler=scheduler, epochs=total, warmup_epochs=warm, lr=0.1, step_size_epochs=1)
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                sched = build_scheduler(cfg, opt, steps_per_epoch=1)
                lrs = [opt.param_groups[0]["lr"]]
                for _ in range(total):
                    opt.step()
                    sched.step()
                    lrs.append(opt.param_groups[0]["lr"])
            assert all(math.isfinite(x) and 0.0 <= x <= 0.1 * (1 + 1e-12) for x in lrs), (total, warm, lrs)
            if warm and scheduler == "onecycle":
                assert lrs[warm] == pytest.approx(0.1) and lrs[0] == pytest.approx(0.1 / 25)
            if not warm and scheduler == "onecycle":
                assert lrs[0] == pytest.approx(0.1) and lrs[-1] < lrs[0]


def test_read_only_checkpoint_dir(tmp_path: Path, monkeypatch):
    """EROFS/EACCES at the probe write (what a 0555 folder gives a non-root user): one line naming the folder,
    raised when the manager is made, i.e. before any data is read."""
    import builtins

    import trainer.engine.checkpoint_folder as folder

    real_open = builtins.open

    def read_only(path, mode="r", *a, **kw):
        if "w" in mode and ".write-probe-" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(folder, "open", read_only, raising=False)
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint_dir: cannot write in {tmp_path / 'ck'}: "
        r"Read-only file system \(EROFS\)",
    ):
        CheckpointManager(tmp_path / "ck")


def _trainer(tmp: Path, **extra):
    from conftest import tiny_overrides

    from trainer.config import load_config
    from trainer.engine.distributed import DistInfo
    from trainer.engine.trainer import Trainer

    cpu = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    kw = dict(batch_size=8, max_steps_per_epoch=3, epochs=2, lr=0.01, warmup_epochs=0, log_every_steps=1)
    kw.update(extra)
    return Trainer(load_config(None, tiny_overrides(tmp / "data", tmp, **kw)), cpu)


def test_full_disk_stops_at_the_next_step(tmp_path: Path, monkeypatch):
    """ENOSPC while writing the checkpoint of step 4: training stops at step 5 (not at the next save) with a
    CheckpointError naming the checkpoint and the OS error; the step-3 checkpoint stays 'latest', and the
    half-written folder is gone."""
    import trainer.engine.checkpoint as ckpt

    tiny_data(tmp_path / "data")
    t = _trainer(tmp_path, checkpoint_every_steps=1)
    real_save, real_write = ckpt.CheckpointManager.save, ckpt.atomic_torch_save

    def full_disk(obj, path):
        if "ckpt-000000004" in str(path) and Path(path).name == "ranks.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(obj, path)

    def joined_save(self, *a, **kw):  # the write has failed before the next step: a deterministic test
        path = real_save(self, *a, **kw)
        self.join()
        return path

    monkeypatch.setattr(ckpt, "atomic_torch_save", full_disk)
    monkeypatch.setattr(ckpt.CheckpointManager, "save", joined_save)
    with pytest.raises(CheckpointError) as e:
        t.fit()
    ck = tmp_path / "ckpt"
    msg = str(e.value)
    assert (
        f"{ck / 'ckpt-000000004-m'}: cannot write this checkpoint (global step 4): No space left on device "
        f"(ENOSPC) writing ranks.pt; the previous checkpoint {ck / 'ckpt-000000003'} is intact" in msg
    ), msg
    assert t.global_step == 5  # the step after the failed write
    assert (ck / "latest").read_text() == "ckpt-000000003"
    CheckpointManager.validate(ck / "ckpt-000000003")
    _no_tmp_left(ck)


def test_torch_write_error_becomes_the_os_error(tmp_path: Path, monkeypatch):
    """torch.save reports a failed write as RuntimeError('... unexpected pos ...'); the checkpoint writer turns
    it into the OSError behind it (here: the file system has no room left) and removes the temporary file."""
    import trainer.engine.checkpoint as ckpt

    def failing_save(obj, path):
        Path(path).write_bytes(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    with pytest.raises(OSError) as e:
        ckpt.atomic_torch_save({"w": torch.zeros(1000)}, tmp_path / "state.pt")
    assert e.value.errno == errno.ENOSPC and "unexpected pos" in str(e.value.__cause__)
    assert list(tmp_path.iterdir()) == []
    # not a disk problem: torch's error goes through unchanged
    monkeypatch.undo()
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        ckpt.atomic_torch_save({"w": torch.zeros(10)}, tmp_path / "state.pt")
    assert list(tmp_path.iterdir()) == []


def test_bad_val_files_are_named_and_the_epoch_is_kept(tmp_path: Path, monkeypatch):
    """The loop's after-training val check (a safety net behind the data's up-front check): it names the files,
    saves the epoch's training first, and the same command evaluates it again once the files are fixed."""
    from trainer.data.formats.imagefolder import BadSample, DataError
    from trainer.engine.trainer import Trainer

    tiny_data(tmp_path / "data")
    real = Trainer.evaluate
    bad = [
        BadSample(str(tmp_path / "data" / "val" / "ants" / f"broken{i}.png"), "OSError: truncated") for i in range(7)
    ]
    monkeypatch.setattr(Trainer, "evaluate", lambda self, m: (real(self, m)[0], len(bad), bad))
    t = _trainer(tmp_path, epochs=1, max_bad_fraction=0.1)
    with pytest.raises(
        DataError,
        match=r"val: 7 of 8 files could not be decoded, more than max_bad_fraction=0.1 "
        r"\(\S+broken0.png \(OSError: truncated\); .*broken4.png \(OSError: "
        r"truncated\) \.\.\.\); the training of epoch 1 is saved in "
        r"\S+ckpt-000000003-m:",
    ):
        t.fit()
    monkeypatch.setattr(Trainer, "evaluate", real)
    t = _trainer(tmp_path, epochs=1, max_bad_fraction=0.1)
    assert (t.epoch, t.step_in_epoch, t.global_step) == (0, 3, 3)
    last = t.fit()
    t.close()
    assert t.epoch == 1 and t.global_step == 3 and "val_top1" in last and len(t.history) == 1
    assert (tmp_path / "ckpt" / "latest").read_text() == "ckpt-000000003"


def test_checks_before_the_data_scan(tmp_path: Path, monkeypatch):
    """Task.check_config runs before build_data (a ConfigError there costs no data scan)."""
    from trainer.config import ConfigError
    from trainer.tasks.classification.task import ClassificationTask

    def refuse(self):
        raise ConfigError("model: needs 224 px")

    def no_scan(self):
        raise AssertionError("the data was read before the config checks")

    monkeypatch.setattr(ClassificationTask, "check_config", refuse)
    monkeypatch.setattr(ClassificationTask, "build_data", no_scan)
    with pytest.raises(ConfigError, match="model: needs 224 px"):
        _trainer(tmp_path)


def test_world_size_change_is_said(tmp_path: Path):
    """A 2-rank checkpoint resumed by 1 process: one notice saying what changes."""
    tiny_data(tmp_path / "data")
    args = flags(tmp_path, epochs=2, max_steps_per_epoch=1)
    p = forkserver.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "-m",
            "trainer",
            "train",
            *args,
        ],
        cwd=tmp_path,
        env=_env(),
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    ck = tmp_path / "ck"
    shutil.rmtree(ck / "ckpt-000000002")
    (ck / "latest").write_text("ckpt-000000001")
    p = forkserver.run(trainer_cmd("train", *args), cwd=tmp_path, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert (
        "checkpoint: world size changed (checkpoint 2 rank(s) -> now 1): per-rank random streams "
        "(MixUp/CutMix, RNG) restart fresh"
    ) in p.stdout, p.stdout[-3000:]
    assert "checkpoint: continuing in epoch 2 of 2 at step 1 of 1 (after global step 1)" in p.stdout


def test_second_ctrl_c_aborts_cleanly(tmp_path: Path):
    """First Ctrl-C: one acknowledgement; the stop checkpoint starts. Second Ctrl-C while it is being written:
    exit 130, one clear line, no traceback, its .tmp-ckpt folder removed, the earlier durable checkpoint kept."""
    tiny_data(tmp_path / "data", train=40)
    marker = tmp_path / "stalled"
    env = {**_env(), "STALL_FROM_STEP": "5", "STALL_MARKER": str(marker)}
    cmd = [
        sys.executable,
        str(REPO / "tests" / "slow_checkpoint_worker.py"),
        "train",
        *flags(tmp_path, checkpoint_every_steps=2, max_steps_per_epoch=10),
    ]
    p = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 300
    for line in p.stdout:
        if line.startswith("step=5 "):
            break
        assert time.monotonic() < deadline
    os.killpg(p.pid, signal.SIGINT)
    while not marker.exists():
        assert p.poll() is None and time.monotonic() < deadline, "the job ended before stalling"
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert err.count("SIGINT: stopping at the next step; Ctrl-C again to abort without saving") == 1, err
    assert "aborted" in [line for line in err.splitlines() if line.strip()][-1]
    ck = tmp_path / "ck"
    _no_tmp_left(ck)
    assert (ck / "latest").read_text() == "ckpt-000000004-m"
    CheckpointManager.validate(ck / "ckpt-000000004-m")
    assert not (ck / "interrupted.json").exists()
