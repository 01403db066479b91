"""benchmarks/msda.py runs end to end on CPU (``--device cpu --small``: reference only) and prints its table."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_benchmark_script_runs_on_cpu():
    res = subprocess.run(
        [
            sys.executable,
            "benchmarks/msda.py",
            "--device",
            "cpu",
            "--small",
            "--dtypes",
            "fp32",
            "--iters",
            "1",
            "--warmup",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("| encoder") or ln.startswith("| decoder")]
    assert len(rows) == 3 and all("| fp32 | reference |" in r for r in rows), res.stdout
    ms = [float(r.split("|")[4]) for r in rows]
    assert all(m > 0 for m in ms)
    bad = subprocess.run(
        [sys.executable, "benchmarks/msda.py", "--device", "cpu", "--dtypes", "fp8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--dtypes: unknown ['fp8']" in bad.stderr
