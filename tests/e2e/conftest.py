"""Fixtures of the e2e tier: one emulated account and one repository copy per test module, steps in order.

``journey`` starts the emulator, lays out the workspace, and runs the steps a user runs (``npx cdk ...``,
``python -m infra ...``, ``act ...``) as subprocesses in that workspace. When a test of the module failed, the
emulator's log and every step's output are kept under ``build/e2e-logs/<module>/`` (its path is printed).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.emulator import REPO, Emulator, workspace


class Journey:
    """An emulator, a workspace, and a log of the steps run in it (``steps``: (title, seconds, verified))."""

    def __init__(self, folder: Path, faults: list[dict] = ()):
        self.folder = folder
        self.emulator = Emulator(folder, faults)
        self.ws = workspace(folder / "ws")
        self.steps: list[tuple[str, float, str]] = []
        self.state: dict = {}

    def run(self, title: str, argv: list[str], *, timeout_s: float = 300, ok: bool = True, **env: str):
        """Run ``argv`` in the workspace with the emulator's environment; its output goes to
        ``<folder>/<n>-<title>.log``. ``ok``: a non-zero exit fails the test with the log's last lines."""
        started = time.monotonic()
        log = self.folder / f"{len(self.steps) + 1:02d}-{title.replace(' ', '_').replace('/', '_')}.log"
        proc = subprocess.run(
            argv,
            cwd=self.ws,
            env=self.emulator.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        log.write_text(
            f"$ {' '.join(argv)}\nexit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
        if ok and proc.returncode != 0:
            pytest.fail(f"{title}: exit {proc.returncode} ({log})\n{(proc.stdout + proc.stderr)[-3000:]}")
        self.steps.append((title, time.monotonic() - started, ""))
        return proc

    def verified(self, what: str) -> None:
        """Record what the last step was checked for (printed in the summary)."""
        title, seconds, _ = self.steps[-1]
        self.steps[-1] = (title, seconds, what)
        print(f"  [{seconds:5.1f} s] {title}: {what}", flush=True)


@pytest.fixture(scope="module")
def journey(request, tmp_path_factory):
    if not (REPO / "node_modules" / ".bin" / "cdk").exists():
        pytest.skip("the CDK CLI is not installed (make setup runs npm ci)")
    folder = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    j = Journey(folder, getattr(request.module, "FAULTS", []))  # the module's fault rules (tests/e2e/faults.py)
    j.emulator.start()
    failed_before = request.session.testsfailed
    try:
        yield j
    finally:
        j.emulator.stop()
        total = sum(s for _, s, _ in j.steps)
        print(f"\n{request.module.__name__}: {len(j.steps)} steps, {total:.0f} s")
        if request.session.testsfailed > failed_before:
            keep = REPO / "build" / "e2e-logs" / folder.name
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(folder, keep, ignore=shutil.ignore_patterns("ws"), dirs_exist_ok=True)
            print(f"e2e logs kept: {keep} (emulator.log and one log per step)")
