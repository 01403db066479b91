"""Per-call cost of the tracking sinks (issue 26 item 1): ``log_metrics`` of one step row (loss, lr, images_per_s)
to MLflow's file store and to W&B offline, timed over N calls after 5 warm-up calls.

Usage: ``python benchmarks/tracking_cost.py [--calls 200]`` (writes under a temporary folder). The per-step overhead
of a run is this cost / ``log_every_steps`` (a row is tracked only on the steps that write a JSONL row).

``--side-by-side PAIRS``: the same training run without tracking, with ``--tracking mlflow`` (file store) and with
``--tracking wandb`` (offline), alternating, ``PAIRS`` rounds; every run trains ``--steps`` steps of the embedded
digits config (1 process, no loader workers) with a tracked row at every step (``--log-every-steps 1``, the
worst case) and is scored by the median wall time between consecutive step rows of its ``metrics.jsonl`` from
step 2 on (step 1's start-up excluded). Prints each run, then per sink the median over rounds of (tracked / untracked - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer.engine.tracking import MlflowTracker, WandbTracker


def per_call_ms(tracker, calls: int) -> tuple[float, float]:
    """Median and mean milliseconds of one ``log_metrics`` call of a 3-value step row."""
    for i in range(5):
        tracker.log_metrics("step", i, {"loss": 1.0 / (i + 1), "lr": 0.01, "images_per_s": 100.0})
    times = []
    for i in range(5, 5 + calls):
        t0 = time.perf_counter()
        tracker.log_metrics("step", i, {"loss": 1.0 / (i + 1), "lr": 0.01, "images_per_s": 100.0})
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), statistics.fmean(times)


REPO = Path(__file__).resolve().parents[1]
SINKS = {"none": [], "mlflow": ["--tracking", "mlflow"], "wandb": ["--tracking", "wandb"]}


def step_seconds(steps: int, sink: str, tmp: Path) -> float:
    """Median seconds between consecutive step rows (from step 2 to N) of one digits run with ``sink``."""
    run = tmp / f"{sink}-{time.monotonic_ns()}"
    run.mkdir()
    cmd = [sys.executable, "-m", "trainer", "train", "--config", str(REPO / "configs" / "digits.yaml")]
    cmd += ["--epochs", "1", "--max-steps-per-epoch", str(steps), "--warmup-epochs", "0", "--num-workers", "0"]
    cmd += ["--log-every-steps", "1", "--checkpoint-dir", "ck", "--log-dir", "logs", *SINKS[sink]]
    if sink == "mlflow":
        cmd += ["--tracking-uri", (run / "mlruns").as_uri()]
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(run))
    env["MLFLOW_ALLOW_FILE_STORE"] = "true"
    subprocess.run(cmd, cwd=run, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if r.get("kind") == "step" and r["step"] >= 2]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def side_by_side(pairs: int, steps: int) -> None:
    """Alternate the three sinks ``pairs`` times; print every run and the median relative cost per sink."""
    ratios: dict[str, list[float]] = {"mlflow": [], "wandb": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(pairs):
            secs = {sink: step_seconds(steps, sink, Path(tmp)) for sink in SINKS}
            print(f"round {r + 1}: " + ", ".join(f"{k} {v * 1000:.1f} ms/step" for k, v in secs.items()), flush=True)
            for sink in ratios:
                ratios[sink].append(secs[sink] / secs["none"] - 1)
    for sink, rs in ratios.items():
        print(
            f"{sink}: median {100 * statistics.median(rs):+.2f} % per step (rounds: "
            + ", ".join(f"{100 * x:+.2f} %" for x in rs)
            + ")",
            flush=True,
        )


def main() -> None:
    """Print one line per tracker: median and mean ms per call (or the side-by-side runs)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--side-by-side", type=int, default=0, metavar="PAIRS")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    if args.side_by_side:
        side_by_side(args.side_by_side, args.steps)
        return
    calls = args.calls
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp)
        for t in (
            MlflowTracker(Path(tmp, "mlruns").as_uri(), "bench", None),
            WandbTracker("bench", None, Path(tmp)),
        ):
            t.start(None)
            med, mean = per_call_ms(t, calls)
            t.finish()
            print(f"{t.name}: log_metrics median {med:.3f} ms, mean {mean:.3f} ms over {calls} calls", flush=True)


if __name__ == "__main__":
    main()
