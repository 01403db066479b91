"""The image's ``train`` entrypoint against a fake /opt/ml tree ($TRAINSTACK_SM_ROOT in a temp dir): the
torchrun command for one and two hosts, hyperparameters -> trainer flags, data channels, exit statuses and
the failure file, and real CPU runs through ``images/training/train`` (done, and SIGTERM -> exit 75)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides

from tests import forkserver
from trainer.sagemaker import entrypoint
from trainer.sagemaker.job import JobConfigError, data_dir_for, hyperparameter_flags, read_job_env

TRAIN = REPO / "images" / "training" / "train"


def make_root(root: Path, hosts=("algo-1",), current="algo-1", hps=None, channels=()) -> Path:
    """A SageMaker container's /opt/ml tree under ``root``."""
    cfg = root / "input" / "config"
    cfg.mkdir(parents=True)
    (cfg / "resourceconfig.json").write_text(
        json.dumps({"current_host": current, "hosts": list(hosts), "network_interface_name": "eth0"})
    )
    (cfg / "hyperparameters.json").write_text(json.dumps(hps or {}))
    (cfg / "inputdataconfig.json").write_text(json.dumps({c: {"TrainingInputMode": "File"} for c in channels}))
    for c in channels:
        (root / "input" / "data" / c).mkdir(parents=True)
    return root


def test_one_host_command(tmp_path):
    job = read_job_env(make_root(tmp_path, hps={"epochs": "3"}), env={})
    flags = entrypoint.trainer_flags(job)
    assert flags == [
        "--checkpoint-dir",
        str(tmp_path / "checkpoints"),
        "--log-dir",
        str(tmp_path / "output/data/logs"),
        "--epochs",
        "3",
    ]
    cmd = entrypoint.torchrun_command(job, flags, nproc=4, python="python3")
    assert cmd == [
        "python3",
        "-m",
        "trainer.launch",
        "--nproc-per-node",
        "4",
        "--nnodes",
        "1",
        "--standalone",
        "-m",
        "trainer",
        "train",
        *flags,
    ]


def test_two_host_command_uses_sorted_hosts(tmp_path):
    job = read_job_env(make_root(tmp_path, hosts=("algo-2", "algo-1"), current="algo-2"), env={"SM_NUM_GPUS": "8"})
    assert (job.nnodes, job.node_rank, job.master_addr) == (2, 1, "algo-1")
    assert entrypoint.processes_per_host(job) == 8
    cmd = entrypoint.torchrun_command(job, ["--epochs", "1"], nproc=8, python="py")
    assert cmd == [
        "py",
        "-m",
        "trainer.launch",
        "--nproc-per-node",
        "8",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "algo-1",
        "--master-port",
        "29500",
        "-m",
        "trainer",
        "train",
        "--epochs",
        "1",
    ]


def test_sm_variables_override_files(tmp_path):
    env = {
        "SM_HOSTS": '["algo-3", "algo-1", "algo-2"]',
        "SM_CURRENT_HOST": "algo-1",
        "SM_CHANNEL_TRAINING": "/mnt/imagenet",
        "SM_MODEL_DIR": "/mnt/model",
    }
    job = read_job_env(make_root(tmp_path, hosts=("algo-9",), current="algo-9"), env=env)
    assert (job.hosts, job.node_rank, job.master_addr) == (["algo-1", "algo-2", "algo-3"], 0, "algo-1")
    assert job.channels == {"training": Path("/mnt/imagenet")} and job.model_dir == Path("/mnt/model")


def test_without_sagemaker_files_it_is_one_local_host(tmp_path):
    job = read_job_env(tmp_path, env={})
    assert (job.in_job, job.hosts, job.node_rank, job.hyperparameters) == (False, ["localhost"], 0, {})


def test_hyperparameters_map_to_trainer_flags():
    hps = {
        "batch_size": "64",
        "learning-rate": None,
        "epochs": '"3"',
        "use-ema": "true",
        "pin_memory": "False",
        "amp": "false",
        "data": "/d",
        "compile_model": "TRUE",
        "scheduler": '"onecycle"',
        "resume": "null",
        "sagemaker_program": '"train.py"',
        "sagemaker_region": '"us-east-1"',
        "config": "configs/digits.yaml",
    }
    hps.pop("learning-rate")
    assert hyperparameter_flags(hps) == [
        "--no-amp",
        "--batch-size",
        "64",
        "--compile-model",
        "--config",
        "configs/digits.yaml",
        "--data",
        "/d",
        "--epochs",
        "3",
        "--no-pin-memory",
        "--scheduler",
        "onecycle",
        "--use-ema",
    ]


@pytest.mark.parametrize(
    "hps,pattern",
    [
        ({"epochs": "3", "learning_rate": "0.1"}, "unknown hyperparameter 'learning_rate'"),
        ({"use_ema": "yes"}, 'use_ema: got \'yes\'; expected "true" or "false"'),
        ({"lr": [0.1]}, r"lr: got \[0.1\]; expected a single value"),
    ],
)
def test_bad_hyperparameters_are_named(hps, pattern):
    with pytest.raises(JobConfigError, match=pattern):
        hyperparameter_flags(hps)


def test_unknown_hyperparameter_exits_2_with_failure_file(tmp_path, monkeypatch):
    make_root(tmp_path, hps={"batch_size": "2", "learning_rate": "1e-4"})
    monkeypatch.setenv("TRAINSTACK_SM_ROOT", str(tmp_path))
    assert entrypoint.main([]) == 2
    reason = (tmp_path / "output" / "failure").read_text()
    assert "unknown hyperparameter 'learning_rate'" in reason and "hyperparameters.json" in reason


def test_invalid_value_exits_2_naming_the_field(tmp_path, monkeypatch):
    make_root(tmp_path, hps={"label_smoothing": "2.0"})
    monkeypatch.setenv("TRAINSTACK_SM_ROOT", str(tmp_path))
    assert entrypoint.main([]) == 2
    assert "label_smoothing" in (tmp_path / "output" / "failure").read_text()


@pytest.mark.parametrize(
    "channels,expected",
    [
        (("training",), "input/data/training"),
        (("imagenet",), "input/data/imagenet"),
        (("train", "val"), "input/data"),
        (("training", "extra"), "input/data/training"),
        ((), None),
    ],
)
def test_data_channel_becomes_data_dir(tmp_path, channels, expected):
    job = read_job_env(make_root(tmp_path, channels=channels), env={})
    got = data_dir_for(job)
    assert got == (tmp_path / expected if expected else None)
    flags = entrypoint.trainer_flags(job)
    assert ("--data-dir" in flags) == bool(expected)


def test_ambiguous_channels_and_explicit_data_dir(tmp_path):
    job = read_job_env(make_root(tmp_path, channels=("a", "b")), env={})
    with pytest.raises(JobConfigError, match=r"data channels \['a', 'b'\]: cannot tell"):
        entrypoint.trainer_flags(job)
    job.hyperparameters = {"data_dir": "/opt/ml/input/data/a", "checkpoint_dir": "/ck"}
    flags = entrypoint.trainer_flags(job)
    assert flags.count("--data-dir") == 1 and flags.count("--checkpoint-dir") == 1 and "/ck" in flags


def test_interrupted_marker_decides_exit_75(tmp_path):
    job = read_job_env(make_root(tmp_path), env={})
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    stale = json.dumps({"reason": "SIGTERM", "checkpoint": "ckpt-5-m", "global_step": 5, "time_unix": 1})
    (ckpt / "interrupted.json").write_text(stale)
    assert entrypoint.outcome(job, 1, ckpt, marker_before=json.loads(stale)) == 1  # left by an earlier run
    assert "training exited 1" in job.failure_file.read_text()
    new = stale.replace('"time_unix": 1', '"time_unix": 2').replace("ckpt-5-m", "ckpt-9-m")
    (ckpt / "interrupted.json").write_text(new)
    assert entrypoint.outcome(job, 1, ckpt, marker_before=json.loads(stale)) == 75
    assert "interrupted (SIGTERM) after durable checkpoint ckpt-9-m" in job.failure_file.read_text()
    assert entrypoint.outcome(job, 3, tmp_path / "none", None) == 3
    assert "NaN" in job.failure_file.read_text()


def test_rank_records_decide_status_and_reason(tmp_path, capsys):
    """The lowest rank's record gives the status (2 do not retry, 3 NaN) and the one line, printed last."""
    job = read_job_env(make_root(tmp_path), env={})
    ckpt = tmp_path / "checkpoints"
    records = [
        {"exit": 2, "error": "data split 'val': folder /d/val does not exist", "rank": 0},
        {"exit": 2, "error": "data split 'val': folder /d/val does not exist", "rank": 1},
    ]
    assert entrypoint.outcome(job, 2, ckpt, None, records) == 2
    reason = job.failure_file.read_text()
    assert reason.startswith("data split 'val'") and "a retry fails the same way" in reason
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: train: exit 2: data split 'val': folder /d/val does not exist")
    assert entrypoint.outcome(job, 3, ckpt, None, [{"exit": 3, "error": "loss became NaN/inf", "rank": 1}]) == 3
    assert "loss became NaN/inf" in job.failure_file.read_text()
    # torchrun exits 1 although the rank said 75 and no marker appeared: the record's word is taken
    assert entrypoint.outcome(job, 1, ckpt, None, [{"exit": 75, "error": "interrupted (SIGTERM)", "rank": 0}]) == 75
    assert "interrupted (SIGTERM)" in job.failure_file.read_text()
    # a record never turns a successful torchrun into a failure
    (tmp_path / "model").mkdir()
    assert entrypoint.outcome(job, 0, ckpt, None, records) == 0


def test_failure_records_round_trip(tmp_path):
    from trainer import failures

    env = {
        "RANK": "1",
        failures.FAILURE_DIR_ENV: str(tmp_path),
        failures.TORCHELASTIC_ERROR_FILE_ENV: str(tmp_path / "error.json"),
    }
    assert failures.report(2, "ConfigError: x: bad", env=env)
    env["RANK"] = "0"
    assert failures.report(2, "ConfigError: y: bad", env=env)
    (tmp_path / "rank-7.json").write_text("{not json")
    assert failures.read_records(tmp_path) == [
        {"exit": 2, "error": "ConfigError: y: bad", "rank": 0},
        {"exit": 2, "error": "ConfigError: x: bad", "rank": 1},
    ]
    elastic = json.loads((tmp_path / "error.json").read_text())
    assert elastic["message"]["extraInfo"]["py_callstack"].startswith("error: ConfigError: y: bad (exit 2")
    assert failures.reported_exit(elastic) == 2 and failures.reported_exit({"message": "other"}) is None


def fake_torchrun(monkeypatch, rc: int = 0, records=()) -> list[bool]:
    """Replace torchrun in :func:`entrypoint.main` by a call that writes ``records`` ((exit, error, rank)) into
    $TRAINSTACK_FAILURE_DIR and returns ``rc``; the returned list gets, per launch, whether a failure file
    existed when torchrun would have started."""
    from trainer.failures import FAILURE_DIR_ENV, write_record

    launches: list[bool] = []

    def run(cmd, env):
        launches.append((Path(env["TRAINSTACK_SM_ROOT"]) / "output" / "failure").exists())
        for code, error, rank in records:
            write_record(env[FAILURE_DIR_ENV], code, error, rank)
        return rc

    monkeypatch.setenv("TRAINSTACK_NPROC_PER_NODE", "1")
    monkeypatch.setattr(entrypoint, "run_forwarding_signals", run)
    return launches


@pytest.mark.parametrize("hosts,current", [(("algo-1",), "algo-1"), (("algo-1", "algo-2"), "algo-2")])
def test_good_rerun_removes_an_earlier_failure_file(tmp_path, monkeypatch, hosts, current):
    """A bad-hyperparameter run, then a good one in the same root (spot restart, rerun): every host
    (each writes its own failure file) removes the earlier one before torchrun starts."""
    root = make_root(tmp_path, hosts=hosts, current=current, hps={"learning_rate": "1e-4"})
    monkeypatch.setenv("TRAINSTACK_SM_ROOT", str(root))
    assert entrypoint.main([]) == 2
    assert "unknown hyperparameter 'learning_rate'" in (root / "output" / "failure").read_text()
    (root / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"epochs": "1"}))
    launches = fake_torchrun(monkeypatch, rc=0)
    assert entrypoint.main([]) == 0
    assert launches == [False] and not (root / "output" / "failure").exists()


@pytest.mark.parametrize(
    "hps,records,status,expected",
    [
        ({"use_ema": "yes"}, None, 2, 'use_ema: got \'yes\'; expected "true" or "false"'),
        ({}, [(3, "loss became NaN/inf at step 7", 0)], 3, "loss became NaN/inf at step 7"),
        ({}, [(75, "interrupted (SIGTERM)", 0)], 75, "interrupted (SIGTERM)"),
    ],
)
def test_failed_rerun_leaves_only_its_own_reason(tmp_path, monkeypatch, capsys, hps, records, status, expected):
    """An earlier run's failure file, then a failing run (before launch, or from a rank's record): the file holds
    this run's reason alone, the same as the last line printed."""
    root = make_root(tmp_path, hps=hps)
    (root / "output").mkdir()
    (root / "output" / "failure").write_text("an earlier run's reason\nsecond line\n")
    monkeypatch.setenv("TRAINSTACK_SM_ROOT", str(root))
    launches = fake_torchrun(monkeypatch, rc=1, records=records or ())
    assert entrypoint.main([]) == status
    assert launches == ([] if records is None else [False])
    reason = (root / "output" / "failure").read_text()
    assert expected in reason and "earlier" not in reason and reason.count("\n") == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: train: exit {status}: {reason.strip()}"


def test_unremovable_failure_file_is_named_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """A read-only ``output/`` (removing raises EROFS): one line on stderr naming the file, then the run."""
    import errno

    root = make_root(tmp_path)
    failure = root / "output" / "failure"
    failure.parent.mkdir()
    failure.write_text("an earlier run's reason\n")
    unlink = Path.unlink

    def read_only(self, *args, **kwargs):
        if self == failure:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", read_only)
    monkeypatch.setenv("TRAINSTACK_SM_ROOT", str(root))
    launches = fake_torchrun(monkeypatch, rc=0)
    assert entrypoint.main([]) == 0 and launches == [True]
    warnings = [line for line in capsys.readouterr().err.splitlines() if str(failure) in line]
    assert warnings == [
        f"warning: train: cannot remove {failure} left by an earlier run (Read-only file system); going on"
    ]


def _sm_job(tmp_path: Path, tiny_digits: Path, **extra) -> tuple[Path, dict]:
    """A fake SageMaker job on the tiny digits (as the 'training' channel); returns (root, env)."""
    over = tiny_overrides(tiny_digits, tmp_path, **extra)
    for key in ("checkpoint_dir", "log_dir", "data_dir"):
        over.pop(key)
    hps = {
        k: json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in over.items()
    }
    hps["sagemaker_program"] = '"unused.py"'
    root = make_root(tmp_path / "opt_ml", hps=hps)
    (root / "input" / "data").mkdir(parents=True, exist_ok=True)
    (root / "input" / "data" / "training").symlink_to(tiny_digits, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINSTACK_SM_ROOT": str(root), "TRAINSTACK_NPROC_PER_NODE": "1"}
    return root, env


def test_end_to_end_train_on_cpu(tmp_path, tiny_digits):
    root, env = _sm_job(tmp_path, tiny_digits, epochs=1)
    res = forkserver.run([sys.executable, str(TRAIN)], cwd=REPO, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "--standalone" in res.stdout and f"--data-dir {root}/input/data/training" in res.stdout
    model = json.loads((root / "model" / "model.json").read_text())
    assert (root / "model" / model["checkpoint"] / "state.pt").is_file()
    assert (root / "checkpoints" / model["checkpoint"] / "manifest.json").is_file()
    assert (root / "output" / "data" / "logs" / "metrics.jsonl").is_file()
    assert not (root / "output" / "failure").exists()


def test_sigterm_reaches_every_rank_and_exits_75(tmp_path, tiny_digits):
    root, env = _sm_job(tmp_path, tiny_digits, epochs=40)
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # wait until training steps are running
        lines.append(line)
        if line.startswith("step=") or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, "".join(lines) + out
    marker = json.loads((root / "checkpoints" / "interrupted.json").read_text())
    assert "interrupted (SIGTERM)" in (root / "output" / "failure").read_text()
    assert (root / "checkpoints" / marker["checkpoint"] / "manifest.json").is_file()
    assert not (root / "model" / "model.json").exists()


def test_help_and_bad_process_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINSTACK_SM_ROOT", str(make_root(tmp_path)))
    with pytest.raises(SystemExit) as exc:
        entrypoint.main(["--help"])
    assert exc.value.code == 0 and "--batch-size" in capsys.readouterr().out
    monkeypatch.setenv("TRAINSTACK_NPROC_PER_NODE", "eight")
    assert entrypoint.main([]) == 2
    assert "$TRAINSTACK_NPROC_PER_NODE: expected an integer, got 'eight'" in (tmp_path / "output/failure").read_text()
