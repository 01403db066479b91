"""Per-call cost of the tracking sinks (issue 26 item 1): ``log_metrics`` of one step row (loss, lr, images_per_s)
to MLflow's file store and to W&B offline, timed over N calls after 5 warm-up calls.

Usage: ``python benchmarks/tracking_cost.py [--calls 200]`` (writes under a temporary folder). The per-step overhead
of a run is this cost / ``log_every_steps`` (a row is tracked only on the steps that write a JSONL row).
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def main() -> None:
    """Print one line per tracker: median and mean ms per call."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    calls = p.parse_args().calls
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
