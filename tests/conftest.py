"""Shared fixtures. Real datasets are read from ``$TRAINSTACK_DATA`` (default ``../shared/data`` beside the
checkout); a test that needs them fails (never skips) when they are missing, as CI requires."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forkserver

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TRAINSTACK_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["TRAINSTACK_CACHE"] = str(tmp_path_factory.mktemp("cache"))


def shared_data_problem(root: Path, chosen: bool) -> str | None:
    """Why ``root`` cannot serve as the shared datasets' folder, or None. The default folder must hold the whole
    set (hymenoptera stands for it); a folder ``chosen`` with ``$TRAINSTACK_DATA`` need only exist (e.g. the
    datasets carried to a GPU machine by ``benchmarks/gpu_carry.py``): a test then fails on the dataset it lacks."""
    if not (root.is_dir() if chosen else (root / "hymenoptera").is_dir()):
        return f"shared datasets not found at {root} (set TRAINSTACK_DATA); CI must have them"
    return None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Root of the shared real datasets (hymenoptera, imagenette-subset, ...)."""
    problem = shared_data_problem(SHARED_DATA, "TRAINSTACK_DATA" in os.environ)
    if problem:
        pytest.fail(problem)
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_digits(tmp_path_factory) -> Path:
    """Small real ImageFolder: 30 train + 8 val scans per digit from scikit-learn's digits (PNG, 8x8)."""
    return write_tiny_digits(tmp_path_factory.mktemp("tiny_digits"))


def write_tiny_digits(root: Path) -> Path:
    """Writes :func:`tiny_digits`' ImageFolder (``train/`` and ``val/``) under ``root``; returns ``root``."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    root.mkdir(parents=True, exist_ok=True)
    d = load_digits()
    counts: dict = {}
    for i, (img, label) in enumerate(zip(d.images, d.target)):
        k = counts.get(int(label), 0)
        if k >= 38:
            continue
        counts[int(label)] = k + 1
        split = "val" if k < 8 else "train"
        out = root / split / str(int(label))
        out.mkdir(parents=True, exist_ok=True)
        Image.fromarray((img * 255 / 16).astype(np.uint8), mode="L").save(out / f"{i:04d}.png")
    return root


def tiny_overrides(data_dir: Path, tmp: Path, **extra) -> dict:
    """Config overrides for a seconds-long CPU run on :func:`tiny_digits`: SGD at lr 0.0125 for the global batch
    of 32, i.e. the linear-scaling rule (0.1 x 32/256) exactly, so no test trains on a divergence-prone recipe."""
    base = dict(
        data_dir=str(data_dir),
        model="resnet18",
        image_size=32,
        crop_scale_min=0.5,
        hflip_prob=0.0,
        batch_size=32,
        epochs=2,
        lr=0.0125,
        warmup_epochs=0.5,
        scheduler="onecycle",
        num_workers=0,
        checkpoint_dir=str(tmp / "ckpt"),
        log_dir=str(tmp / "logs"),
        log_every_steps=2,
        device="cpu",
    )
    base.update(extra)
    return base


def run_trainer(
    args: list[str], cwd: Path = REPO, torchrun_nproc: int = 0, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m trainer train ARGS`` (or under torchrun) and return the completed process; the
    command (the single process, or torchrun's launcher; its ranks are fresh interpreters) is forked from
    :mod:`tests.forkserver`'s server (a fresh interpreter's behaviour)."""
    if torchrun_nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(torchrun_nproc),
            "--standalone",
            "-m",
            "trainer",
            "train",
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "trainer", "train", *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return forkserver.run(cmd, cwd=cwd, env=full_env, timeout=timeout)


#: The markers' one home (pytest.ini declares them): ``slow`` for tests that train, start torchrun, build the op
#: or synthesize the CDK app (by module, or by the fixtures that do so); ``multiprocess`` for tests that start
#: several processes; ``gpu`` for the CUDA-only modules. ``pytest -m "not slow"`` runs the quick part in ~2 min.
SLOW_MODULES = {
    "test_loop",
    "test_detection",
    "test_detection_learning",
    "test_detection_resume",
    "test_ddp",
    "test_ffcv",
    "test_interruption",
    "test_probe",
    "test_memory",
    "test_image_layout",
    "test_entrypoint",
    "test_submit_roundtrip",
    "test_msda_build",
    "test_msda_benchmark",
    "test_engine_seams",
    "test_bad_inputs_engine",
    "test_video",
    "test_recovery_trainer",
}
SLOW_FIXTURES = {
    "tiny_digits",
    "templates",
    "pr_env",
    "default_env",
    "default",
    "full",
    "executions",
    "moto_server",
    "swept",  # tests/planning/test_sweep.py: a real 2-trial sweep (train subprocesses)
}
MULTIPROCESS_MODULES = {
    "test_ddp",
    "test_ffcv",
    "test_interruption",
    "test_detection_resume",
    "test_video",
    "test_recovery_trainer",
}
MULTIPROCESS_FIXTURES = {"moto_server", "swept"}
GPU_MODULES = {"test_msda_cuda"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        stem = item.path.stem
        fixtures = set(getattr(item, "fixturenames", ()))
        if stem in SLOW_MODULES or fixtures & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if stem in MULTIPROCESS_MODULES or fixtures & MULTIPROCESS_FIXTURES:
            item.add_marker(pytest.mark.multiprocess)
        if stem in GPU_MODULES:
            item.add_marker(pytest.mark.gpu)
    items[:] = heaviest_files_first(items)


#: Seconds per test file (setup + call + teardown of its tests), measured by a whole run with
#: ``TRAINSTACK_TEST_DURATIONS=tests/durations.json make test``; it orders the files, nothing else.
DURATIONS_FILE = Path(__file__).parent / "durations.json"
#: Estimated seconds of a ``slow`` test and of a quick one, for files the durations file does not list.
SLOW_SECONDS, QUICK_SECONDS = 30.0, 1.0


def heaviest_files_first(items: list) -> list:
    """``items`` with whole test files in decreasing cost (:data:`DURATIONS_FILE`'s seconds, else ``slow`` tests x
    :data:`SLOW_SECONDS` + the others x :data:`QUICK_SECONDS`), each file's tests in their own order. ``make test``
    hands files to its pytest-xdist workers in this order (``--dist loadfile --no-loadscope-reorder``): the
    longest-first rule, so a long file does not start last and run alone while the other worker idles
    (xdist's own reorder sorts files by test count)."""
    try:
        measured = json.loads(DURATIONS_FILE.read_text())
    except (OSError, ValueError):
        measured = {}
    root = Path(__file__).parent.parent
    estimate: dict = {}
    for item in items:
        secs = SLOW_SECONDS if item.get_closest_marker("slow") else QUICK_SECONDS
        estimate[item.path] = estimate.get(item.path, 0.0) + secs

    def cost(path) -> float:
        try:
            return float(measured[str(Path(path).relative_to(root))])
        except (KeyError, ValueError, TypeError):
            return estimate[path]

    rank = {path: i for i, path in enumerate(sorted(estimate, key=lambda p: -cost(p)))}
    return sorted(items, key=lambda item: rank[item.path])


_file_seconds: dict = {}


def pytest_runtest_logreport(report):
    """Sum each test file's setup/call/teardown seconds (for ``TRAINSTACK_TEST_DURATIONS``)."""
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_configure(config):
    """The controller (or the only process) names this test run for :mod:`tests.shared_once` before any
    pytest-xdist worker starts; the workers inherit the name."""
    if not hasattr(config, "workerinput") and "TRAINSTACK_TEST_RUN" not in os.environ:
        import uuid

        os.environ["TRAINSTACK_TEST_RUN"] = uuid.uuid4().hex[:12]
        config._trainstack_names_the_run = True  # so only this process removes the run's directory


def pytest_sessionfinish(session):
    """On the controller (or the only process) that named the run: remove the run's :mod:`tests.shared_once`
    directory (a pytest that a test starts, e.g. ``gpu_suite``'s op step, inherits the name and must leave the
    directory to the run that is still reading it); with ``TRAINSTACK_TEST_DURATIONS=FILE``, write the per-file
    seconds of this run to FILE, longest first."""
    if getattr(session.config, "_trainstack_names_the_run", False):
        from tests.shared_once import run_dir

        shutil.rmtree(run_dir(), ignore_errors=True)
    out = os.environ.get("TRAINSTACK_TEST_DURATIONS")
    if out and not hasattr(session.config, "workerinput") and _file_seconds:
        ranked = dict(sorted(((k, round(v, 1)) for k, v in _file_seconds.items()), key=lambda kv: -kv[1]))
        Path(out).write_text(json.dumps(ranked, indent=1) + "\n")
