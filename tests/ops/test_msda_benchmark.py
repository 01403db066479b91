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


def test_upstream_src_is_checked_before_anything_runs(shared_data, tmp_path):
    """``--upstream-src`` names a checkout of upstream's op: a folder without its sources, or a CPU run (upstream
    has CUDA kernels only), is one line and exit 2; the shared checkout is recognised (root or its src/)."""
    import importlib.util

    def run(*args):
        return subprocess.run(
            [sys.executable, "benchmarks/msda.py", "--device", "cpu", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )

    missing = run("--upstream-src", str(tmp_path))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "--upstream-src" in missing.stderr and "vision.cpp" in missing.stderr
    checkout = shared_data.parent / "gpu-check" / "upstream_msda"  # ../shared/gpu-check beside the data
    assert checkout.is_dir(), f"{checkout} missing (../shared/gpu-check/upstream_msda)"
    for path in (checkout, checkout / "src"):
        cpu = run("--upstream-src", str(path))
        assert cpu.returncode == 2 and "CUDA kernels only" in cpu.stderr and cpu.stderr.count("\n") == 1
    spec = importlib.util.spec_from_file_location("msda_bench", REPO / "benchmarks" / "msda.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.upstream_source_dir(str(checkout)) == checkout / "src"


def test_gpu_script_parses_and_refuses_missing_data_before_touching_the_gpu(tmp_path):
    """benchmarks/gpu_dino.sh (DINO's GPU figures in one command) is valid bash and checks DATA first."""
    script = REPO / "benchmarks" / "gpu_dino.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    res = subprocess.run(
        ["bash", str(script)],
        env={"PATH": "/usr/bin:/bin", "DATA": str(tmp_path), "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "facemask-coco" in res.stderr and res.stderr.count("\n") == 1
