"""tests/shared_once.py: a folder made once per test run whoever asks, nothing left by a failed make, and a key
that cannot be a file name refused before anything is written."""

from __future__ import annotations

import pytest

from tests import shared_once


def test_made_once_then_read_and_a_failed_make_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTACK_TEST_RUN", f"unit-{tmp_path.name}")
    monkeypatch.setattr(shared_once.tempfile, "gettempdir", lambda: str(tmp_path))
    calls = []

    def make(folder):
        calls.append(folder)
        (folder / "x").write_text("1")

    first = shared_once.shared_once("thing", make)
    assert shared_once.shared_once("thing", make) == first and len(calls) == 1 and (first / "x").read_text() == "1"

    def broken(folder):
        (folder / "half").write_text("")
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        shared_once.shared_once("broken", broken)
    assert not (shared_once.run_dir() / "broken").exists() and not (shared_once.run_dir() / "broken.done").exists()


@pytest.mark.parametrize("key", ["x" * 101, "a/b", ""])
def test_a_key_that_is_not_one_short_file_name_is_refused(key, tmp_path, monkeypatch):
    monkeypatch.setattr(shared_once.tempfile, "gettempdir", lambda: str(tmp_path))
    with pytest.raises(ValueError, match="expected one file name of at most 100 characters"):
        shared_once.shared_once(key, lambda folder: None)
    assert not any(tmp_path.iterdir())


def test_a_pytest_that_a_test_starts_leaves_the_runs_folder_alone(tmp_path):
    """gpu_suite's op step runs pytest inside a test: that pytest inherits the run's name and must not remove the
    folder the outer run still reads (it did: the shared digits run vanished under test_export in one CI run)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    run = tmp_path / "trainstack-tests-outer"
    (run / "digits_run").mkdir(parents=True)
    env = {**os.environ, "TRAINSTACK_TEST_RUN": "outer", "TMPDIR": str(tmp_path)}
    test = "tests/test_shared_once.py::test_a_key_that_is_not_one_short_file_name_is_refused"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", test],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (run / "digits_run").is_dir()
