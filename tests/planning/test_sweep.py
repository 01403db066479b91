"""``python -m trainer sweep`` (trainer/planning/sweep.py) and its search space (trainer/config/sweep.py).

The space tests are pure Python. The sweep tests run one real 2-trial sweep of ``train`` subprocesses on the
shared hymenoptera photos (1 epoch of 2 steps at 32 px, no loader workers): first stopped by SIGTERM during its
first trial (exit 75, partial table), then run again to the end, then once more (nothing retrained); a
different space against the same folder and a ``--parallel`` above what the planner allows are exit 2. K is
asserted against :func:`trainer.planning.local.max_local_jobs` called directly.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from bad_input_table import REPO, check_error_line

from tests import forkserver
from trainer.config import load_config
from trainer.config.sweep import (
    parse_grid,
    parse_range,
    rank,
    results_markdown,
    search_space,
    trial_name,
)
from trainer.engine.durable import LOCK_FILE, WriterLock, lock_holder
from trainer.errors import ConfigError
from trainer.planning.local import max_local_jobs
from trainer.planning.sweep import parallel_for_space, resource_overrides, trial_result, worst_overrides

# ---------------------------------------------------------------------------------------------------- the space


def test_grid_is_the_cartesian_product_in_command_line_order():
    space = search_space(["lr=[0.1, 0.03, 0.01]", "batch_size=[32,64]"], [])
    assert space.names == ["lr", "batch_size"] and space.size == 6
    trials = space.trials()
    assert trials[0] == {"lr": 0.1, "batch_size": 32} and trials[1] == {"lr": 0.1, "batch_size": 64}
    assert trials[-1] == {"lr": 0.01, "batch_size": 64} and len({json.dumps(t) for t in trials}) == 6
    assert parse_grid("compile_model=[true, false]") == ("compile", [True, False])  # an alias, YAML booleans
    assert parse_grid("epochs=[3]") == ("epochs", [3])  # a one-value grid is a one-item list
    assert [trial_name(i) for i in (0, 7, 123)] == ["t000", "t007", "t123"]


def test_random_search_is_reproducible_and_within_its_ranges():
    args = (["optimizer=[sgd, adamw]"], ["lr=1e-4:0.1:log", "epochs=2:5"], 20)
    a, b = search_space(*args, seed=7).trials(), search_space(*args, seed=7).trials()
    assert a == b and a != search_space(*args, seed=8).trials() and len(a) == 20
    for t in a:
        assert 1e-4 <= t["lr"] <= 0.1 and isinstance(t["lr"], float)
        assert isinstance(t["epochs"], int) and 2 <= t["epochs"] <= 5  # an integer field draws integers
        assert t["optimizer"] in ("sgd", "adamw")
    r = parse_range("lr=1e-4:0.1:log")
    assert r.log and not r.integer and (r.low, r.high) == (1e-4, 0.1)


@pytest.mark.parametrize(
    "grids, ranges, random_trials, message",
    [
        (["lr"], [], None, "--grid 'lr': expected NAME=[V1, V2, ...]"),
        (["lrr=[0.1]"], [], None, "--grid lrr: unknown config field"),
        (["checkpoint_dir=[a, b]"], [], None, "a sweep cannot vary checkpoint_dir"),
        (["lr=[]"], [], None, "expected a non-empty list of scalars"),
        (["lr=0.1"], [], None, "--grid lr: '0.1' is not a list; expected [V1, V2, ...] (one value: lr=[0.1], or set"),
        (["lr=[0.1, 0.1]"], [], None, "repeats a value"),
        (["lr=[0.1]", "lr=[0.2]"], [], None, "--grid lr: given twice"),
        ([], ["lr=1e-4:0.1"], None, "ranges are sampled; add --random N"),
        ([], ["lr=0.1:0.01"], 3, "expected finite LOW < HIGH"),
        ([], ["lr=0:0.1:log"], 3, "a log range needs LOW > 0"),
        ([], ["model=1:2"], 3, "model is not a numeric field"),
        ([], ["lr=1:2:cubic"], 3, "expected NAME=LOW:HIGH[:log][:int]"),
        ([], [], None, "nothing to sweep"),
        (["lr=[0.1]"], [], 0, "--random: got 0"),
    ],
)
def test_space_errors_name_the_flag(grids, ranges, random_trials, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        search_space(grids, ranges, random_trials)


def test_trial_result_reads_the_epoch_rows_and_only_done_trials_rank(tmp_path):
    def trial(name, status, values):
        (tmp_path / name / "logs").mkdir(parents=True)
        rows = [{"kind": "epoch", "epoch": e, "val_loss": v} for e, v in enumerate(values, 1)]
        rows.insert(1, {"kind": "step", "val_loss": -5.0})  # step rows are not epochs
        text = "\n".join(json.dumps(r) for r in rows) + '\n{"kind": "ep'  # a line cut by a kill
        (tmp_path / name / "logs" / "metrics.jsonl").write_text(text)
        if status:
            (tmp_path / name / "status.json").write_text(json.dumps({**status, "wall_s": 3.0}))

    trial("t000", {"status": "done", "rc": 0}, [0.9, 0.5, 0.7])
    trial("t001", {"status": "failed", "rc": 3}, [0.4, math.nan])
    trial("t002", None, [])
    rows = [trial_result(f"t00{i}", {"lr": i}, "val_loss", "min", tmp_path) for i in range(3)]
    assert rows[0]["val_loss"] == 0.5 and rows[0]["best_epoch"] == 2 and rows[0]["last"] == 0.7
    assert rows[1]["val_loss"] is None and rows[1]["best_so_far"] == 0.4 and rows[1]["status"] == "failed rc=3"
    assert rows[2]["status"] == "pending" and rows[2]["epochs"] == 0
    ranked = rank(rows, "val_loss", "min")
    assert [r["rank"] for r in ranked] == [1, None, None]
    md = results_markdown(ranked, ["lr"], "val_loss", "min", extra=("best_epoch", "last"))
    assert md.splitlines()[0] == "| rank | trial | lr | val_loss (min) | best_epoch | last | status | wall_s |"


# ------------------------------------------------------------------------------------------------ a real sweep

BASE = REPO / "configs" / "hymenoptera.yaml"
TINY = [
    "--epochs",
    "1",
    "--max-steps-per-epoch",
    "2",
    "--image-size",
    "32",
    "--num-workers",
    "0",
    "--batch-size",
    "16",
    "--scheduler",
    "step",  # constant lr through epoch 1, so each epoch row's lr is the trial's own
    "--warmup-epochs",
    "0",
    "--device",
    "cpu",
]
GRID = ["--grid", "lr=[0.02, 0.005]"]


def _sweep(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer", "sweep", "--config", str(BASE), *args]
    return forkserver.run(cmd, cwd=REPO, env=env, timeout=timeout)


def _interrupted_sweep(args: list[str]) -> tuple[int, str]:
    """Start the sweep, SIGTERM it once its first trial has started; (exit status, stdout)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer", "sweep", "--config", str(BASE), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "t000: started" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(lines) + rest


@pytest.fixture(scope="module")
def swept(shared_data, tmp_path_factory):
    """A sweep stopped by SIGTERM during its first trial, then the same command run to the end."""
    out = tmp_path_factory.mktemp("sweep") / "out"
    args = ["--data", str(shared_data / "hymenoptera"), *TINY, *GRID, "--out", str(out)]
    rc, stopped = _interrupted_sweep(args)
    proc = _sweep(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, args, proc, (rc, stopped)


def test_sigterm_stops_the_sweep_with_a_partial_table_and_the_rerun_finishes(swept):
    out, _, proc, (rc, stopped) = swept
    assert rc == 75, stopped[-3000:]
    assert "t000: forwarding SIGTERM" in stopped and "t000: interrupted" in stopped
    assert "t001: started" not in stopped  # no trial starts after the signal
    assert re.search(r"\| – \| t000 \| 0\.02 \| .* \| interrupted \|", stopped)
    assert re.search(r"\| – \| t001 \| 0\.005 \| .* \| pending \|", stopped)
    assert "run the same command again to resume" in stopped
    assert "t000: started" in proc.stdout and "already finished" not in proc.stdout  # t000 ran again
    assert json.loads((out / "t000" / "status.json").read_text())["status"] == "done"


def test_sweep_ranks_each_trials_own_jsonl_rows(swept):
    out, _, proc, _ = swept
    doc = json.loads((out / "results.json").read_text())
    assert doc["metric"] == "val_top1" and doc["mode"] == "max" and doc["parameters"] == ["lr"]
    by_trial = {r["trial"]: r for r in doc["trials"]}
    assert set(by_trial) == {"t000", "t001"} and [r["rank"] for r in doc["trials"]] == [1, 2]
    assert doc["trials"][0]["val_top1"] >= doc["trials"][1]["val_top1"]
    for name, lr in (("t000", 0.02), ("t001", 0.005)):
        r = by_trial[name]
        epochs = [json.loads(x) for x in (out / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        epochs = [e for e in epochs if e["kind"] == "epoch"]
        assert r["lr"] == lr and r["status"] == "done" and r["epochs"] == len(epochs) == 1
        assert r["val_top1"] == max(e["val_top1"] for e in epochs) == r["last"] and r["best_epoch"] == 1
        assert epochs[0]["lr"] == pytest.approx(lr)  # the trial trained with its own lr
        assert epochs[0]["image_size"] == 32  # and with the fixed flags
        assert f"--lr {lr}" in (out / name / "train.log").read_text().splitlines()[0]
        assert (out / name / "checkpoints" / "latest").exists()
    table = (out / "results.md").read_text()
    assert table in proc.stdout and "| 1 | " in table and (out / "results.png").stat().st_size > 1000
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["space"]["grid"] == {"lr": [0.02, 0.005]} and len(manifest["base_sha256"]) == 64
    assert [t["trial"] for t in manifest["trials"]] == ["t000", "t001"]


def test_k_is_the_planners_answer_for_this_machine(swept):
    out, args, proc, _ = swept
    line = next(x for x in proc.stdout.splitlines() if "trial(s) at a time on this machine" in x)
    k = int(re.search(r"sweep: (\d+) trial\(s\) at a time", line).group(1))
    fixed = {"data_dir": args[1], "epochs": 1, "max_steps_per_epoch": 2, "image_size": 32, "num_workers": 0}
    fixed.update(batch_size=16, scheduler="step", warmup_epochs=0, device="cpu")
    cfg = load_config(BASE, worst_overrides(fixed, [{"lr": 0.02}, {"lr": 0.005}]))
    fit, _ = max_local_jobs(cfg, 2, probe_report=str(out / "probe" / "probe.json"))
    assert k == min(fit, 2)
    assert json.loads((out / "probe" / "probe.json").read_text())["host_rss_hwm_bytes"] > 0


def test_rerun_skips_finished_trials_and_another_space_is_refused(swept):
    out, args, _, _ = swept
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("t*/logs/metrics.jsonl")}
    proc = _sweep(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 of 2 trial(s) already finished" in proc.stdout and "started" not in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("t*/logs/metrics.jsonl")} == mtimes
    other = [a if a != "lr=[0.02, 0.005]" else "lr=[0.02, 0.001]" for a in args]
    proc = _sweep(*other)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "holds a sweep with another space" in lines[0]
    check_error_line(lines[0])


def test_parallel_above_what_fits_is_refused_in_one_line(swept, tmp_path):
    out, args, _, _ = swept
    fixed = {"data_dir": args[1], "epochs": 1, "max_steps_per_epoch": 2, "image_size": 32, "num_workers": 0}
    fixed.update(batch_size=16, scheduler="step", warmup_epochs=0, device="cpu")
    probe = str(out / "probe" / "probe.json")
    fit, _ = max_local_jobs(load_config(BASE, fixed), 64, probe_report=probe)
    assert fit < 64, "this machine fits 64 trials at a time: the refusal cannot be tested here"
    new = [a if a != str(out) else str(tmp_path / "o") for a in args]
    proc = _sweep(*new, "--parallel", str(fit + 1), "--probe-report", probe)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith(f"error: --parallel {fit + 1}: {fit + 1} trials at a time do not fit this machine")
    assert f"use --parallel {fit} or less" in lines[0] and "Traceback" not in proc.stdout + proc.stderr
    check_error_line(lines[0])
    assert not list((tmp_path / "o").glob("t*/train.log"))  # nothing started
    assert not (tmp_path / "o" / "sweep.json").exists()  # so the corrected command is not "another space" (N10)


def test_a_swept_model_is_checked_per_model_and_the_tightest_sets_k(shared_data, tmp_path, monkeypatch):
    """A grid over ``model`` checks K once per model (seed 004's incident was 4 jobs of one config; a sweep of a
    small and a large model must not be sized by the small one). The machine is a CPU host of 16 vCPUs with 32 GiB
    available (so the vCPU rule does not decide K); the probes are seeded, ``OUT/probe-<i>/probe.json`` as a CPU
    probe writes them, the second model's process taking 60 % of that RAM."""
    import dataclasses

    from trainer.planning import local

    host = dataclasses.replace(local.local_machine(), vcpus=16, memory_mib=32 * 1024, gpus=0, gpu_memory_mib=0)
    monkeypatch.setattr(local, "local_machine", lambda: host)
    fixed = {"data_dir": str(shared_data / "hymenoptera"), "image_size": 32, "num_workers": 0, "device": "cpu"}
    trials = [{"model": m, "lr": lr} for m in ("resnet18", "resnet50") for lr in (0.02, 0.005)]
    configs = resource_overrides({**fixed, "batch_size": 16}, [{**t, "batch_size": b} for t in trials for b in (8, 16)])
    assert [c["model"] for c in configs] == ["resnet18", "resnet50"] and {c["batch_size"] for c in configs} == {16}
    assert resource_overrides(fixed, [{"lr": 0.1}, {"lr": 0.2}]) == [fixed]  # nothing of the kind swept: one config
    out = tmp_path / "out"
    for i, (model, rss) in enumerate((("resnet18", 300 * 2**20), ("resnet50", int(0.6 * 32 * 2**30))), start=1):
        cfg = load_config(BASE, {**fixed, "model": model})
        probe = {"device": "cpu", "device_name": "cpu", "image_size": "32x32", "config": cfg.to_dict()}
        probe.update(best_batch=16, best_images_per_s=10.0, measurements=[], host_rss_hwm_bytes=rss)
        (out / f"probe-{i}").mkdir(parents=True)
        (out / f"probe-{i}" / "probe.json").write_text(json.dumps(probe))
    (out / "probe").mkdir()  # resnet18 alone is one config: its probe folder is OUT/probe
    (out / "probe" / "probe.json").write_text((out / "probe-1" / "probe.json").read_text())
    alone = parallel_for_space(BASE, fixed, trials[:2], 4, None, None, out)
    assert alone[0] == 4 and "capped by the 4 trial(s) to run" in alone[1]
    k, why = parallel_for_space(BASE, fixed, trials, 4, None, None, out)
    assert k == 1, why  # two resnet50 jobs need 120 % of the RAM
    assert "2 would not fit: host RAM" in why and why.endswith(
        "(the trials with model=resnet50, the tightest of 2 checked)"
    )
    with pytest.raises(ConfigError, match=r"^--parallel 2: 2 trials at a time do not fit this machine"):
        parallel_for_space(BASE, fixed, trials, 4, 2, None, out)


# -------------------------------------------------------------------------------------------- one writer per trial
def _popen_sweep(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer", "sweep", "--config", str(BASE), *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(pred, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sighup_stops_like_sigterm_and_a_killed_sweep_takes_its_trial_along(swept, tmp_path):
    """SIGHUP (the SSH session closed) is forwarded like SIGTERM (exit 75); a sweep killed outright (SIGKILL, as
    the OOM killer does) takes its running trial along: the trial gets SIGTERM (PR_SET_PDEATHSIG), checkpoints and
    ends, so its checkpoint folder's lock is free for the sweep run again (N1)."""
    out, (_, data, *_), _, _ = swept
    new = tmp_path / "o"
    args = ["--data", data, *TINY, "--epochs", "1000", "--grid", "lr=[0.02]", "--out", str(new)]
    args += ["--probe-report", str(out / "probe" / "probe.json")]
    ck = new / "t000" / "checkpoints"

    proc = _popen_sweep(args)
    for line in proc.stdout:
        if "t000: started" in line:
            break
    _wait(lambda: lock_holder(ck), "the trial never took its lock")
    proc.send_signal(signal.SIGHUP)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75 and "t000: forwarding SIGTERM" in rest and "t000: interrupted" in rest, rest

    proc = _popen_sweep(args)  # resumes t000; then the sweep is killed outright
    for line in proc.stdout:
        if "t000: started" in line:
            break
    _wait(lambda: lock_holder(ck), "the resumed trial never took its lock")
    trial = lock_holder(ck)["pid"]
    proc.kill()
    proc.wait(60)
    _wait(lambda: lock_holder(ck) is None, f"trial pid {trial} outlived its killed sweep", timeout=180)
    log = (new / "t000" / "train.log").read_text()
    # the lock is let go once the last checkpoint is durable: both segments stopped on SIGTERM with a checkpoint
    assert len(re.findall(r"interrupted: SIGTERM; stopped at global step \d+ .*durable", log)) == 2, log[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_trial_whose_lock_is_held_is_not_started_and_trials_share_one_tracking_store(swept, tmp_path, monkeypatch):
    """A resumed sweep never starts a trial whose checkpoint folder another process writes (it names that process;
    exit 75); the others run, all tracked in one MLflow store (OUT/mlruns) as runs named and tagged by trial (N9)."""
    pytest.importorskip("mlflow")
    out, args, _, _ = swept
    new = tmp_path / "o"
    args = [a if a != str(out) else str(new) for a in args]
    args += ["--probe-report", str(out / "probe" / "probe.json"), "--tracking", "mlflow"]
    lock = WriterLock(new / "t000" / "checkpoints")
    (new / "t000" / "checkpoints").mkdir(parents=True)
    assert lock.acquire() is None
    try:
        proc = _sweep(*args, "--parallel", "1")
    finally:
        lock.release()
    text = proc.stdout + proc.stderr
    assert proc.returncode == 75, text[-3000:]
    assert (
        f"sweep: t000: not started: its checkpoint_dir {new / 't000' / 'checkpoints'} is being written by pid {os.getpid()}"
        in text
    )
    assert "t001: done" in text and not (new / "t000" / "status.json").exists()
    assert not (new / "t000" / "logs").exists() and not (new / "t001" / "logs" / "mlruns").exists()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(new / "mlruns").resolve().as_uri())
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [(r.info.run_name, r.data.tags.get("trial"), r.info.status) for r in runs] == [("t001", "t001", "FINISHED")]
    assert runs[0].data.tags["sweep"] == str(new)


# ------------------------------------------------------------------- signals during the probe, one sweep per --out
@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_sweep_signalled_during_its_probe_stops_the_probe_and_says_so(shared_data, tmp_path):
    """SIGHUP while the sweep probes (before any trial): the probe is stopped and the sweep says so, exit 75.
    Before, the sweep died of the signal without a word and the probe ran on as an orphan."""
    import psutil

    out = tmp_path / "o"
    proc = _popen_sweep(["--data", str(shared_data / "hymenoptera"), *TINY, *GRID, "--out", str(out)])
    probes: list = []

    def probing() -> bool:
        probes[:] = [c for c in psutil.Process(proc.pid).children() if "probe" in c.cmdline()]
        return bool(probes)

    try:
        _wait(probing, "the probe never started", timeout=120)
        proc.send_signal(signal.SIGHUP)
        text, _ = proc.communicate(timeout=60)
        assert proc.returncode == 75, text[-3000:]
        assert f"sweep: SIGHUP during the probe: the probe (pid {probes[0].pid}) was stopped" in text, text[-3000:]
        _wait(lambda: not probes[0].is_running() or probes[0].status() == psutil.STATUS_ZOMBIE, "probe alive", 5)
        assert not (out / "sweep.json").exists()
    finally:
        for p in [proc, *probes]:
            if p.poll() is None if isinstance(p, subprocess.Popen) else p.is_running():
                p.kill()


@pytest.mark.slow
def test_a_second_sweep_on_the_same_out_is_refused_naming_the_first(shared_data, tmp_path):
    """A second sweep on an ``--out`` that a running sweep holds exits 2 with one line naming that sweep's pid, and
    starts nothing there. Before, both ran, so two trials trained at once where K = 1."""
    out = tmp_path / "o"
    out.mkdir()
    first = WriterLock(out)  # what a running sweep holds on its --out
    assert first.acquire() is None
    try:
        proc = _sweep("--data", str(shared_data / "hymenoptera"), *TINY, *GRID, "--out", str(out), timeout=120)
    finally:
        first.release()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and f"another sweep is running on this folder: pid {os.getpid()} on host " in err[0], err
    check_error_line(err[0])
    assert [p.name for p in out.iterdir() if p.name != LOCK_FILE] == []  # no probe, no trial
