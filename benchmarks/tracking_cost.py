"""Per-call cost of the tracking sinks (MLflow, W&B): ``log_metrics`` of one step row (loss, lr, images_per_s)
to MLflow's file store and to W&B offline, timed over N calls after 5 warm-up calls.

Usage: ``python benchmarks/tracking_cost.py [--calls 200]`` (writes under a temporary folder). The per-step overhead
of a run is this cost / ``log_every_steps`` (a row is tracked only on the steps that write a JSONL row). Then the
same rows through :class:`TrackingSinks` as the training thread sees them, synchronous and with the background
delivery the trainer uses, for MLflow, W&B and MLflow behind a synthetic 50 ms round trip per ``log_batch``.

``--in-process BLOCKS [--block-steps 5]``: training steps of a small CNN in one process, interleaved blocks
without tracking and with each sink (see :func:`in_process_ab`): the excess per step, with the machine's drift
on every mode alike.

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

from trainer.engine.trackers import MlflowTracker, WandbTracker
from trainer.engine.tracking import TrackingSinks


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


class Latency:
    """Wrap an :class:`MlflowTracker`'s client so that every ``log_batch`` first sleeps ``seconds``: a stand-in for
    a remote tracking server's round trip (synthetic: no remote server is reachable from this machine)."""

    def __init__(self, tracker: MlflowTracker, seconds: float):
        real = tracker.client.log_batch

        def slow(*a, **kw):
            time.sleep(seconds)
            return real(*a, **kw)

        tracker.client.log_batch = slow


def sinks_per_call(make, calls: int, background: bool, latency_s: float = 0.0) -> tuple[float, float, float]:
    """``TrackingSinks.log_metrics`` of one step row, as the training thread sees it: median and mean ms per call,
    and the seconds ``finish`` then waited for the delivery thread."""
    t = make()
    sinks = TrackingSinks([t], print, background=background)
    sinks.start({})
    if latency_s:
        Latency(t, latency_s)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        sinks.log_metrics("step", i, {"loss": 1.0 / (i + 1), "lr": 0.01, "images_per_s": 100.0})
        times.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    sinks.finish()
    return statistics.median(times[5:]), statistics.fmean(times[5:]), time.perf_counter() - t0


def in_process_ab(blocks: int, block_steps: int, tmp: Path, batch: int = 8, side: int = 32) -> None:
    """Training steps of a small CNN (ResNet-18, 10 classes, ``batch`` images at ``side`` px, SGD, one thread; a
    short step, as on a GPU, so that a millisecond per row shows) in one process, in blocks of ``block_steps``
    that cycle through: no tracking; MLflow (file store) through the background sinks; W&B (offline) through the
    background sinks; MLflow called synchronously on the training thread — a tracked row after every step
    (``log_every_steps: 1``, the worst case). Short interleaved blocks put the machine's drift on every mode
    alike. Prints per mode the median step time and its excess over no tracking, and the median (and quartiles)
    of each block's median over the untracked block of the same cycle (the paired excess)."""
    import torch
    import torchvision

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, side, side), torch.randint(0, 10, (batch,))
    modes = {
        "none": None,
        "mlflow (background)": TrackingSinks([MlflowTracker(Path(tmp, "ab").as_uri(), "ab", "bg")], print),
        "wandb (background)": TrackingSinks([WandbTracker("ab", None, Path(tmp))], print),
        "mlflow (synchronous)": TrackingSinks(
            [MlflowTracker(Path(tmp, "ab").as_uri(), "ab", "sync")], print, background=False
        ),
    }
    for s in modes.values():
        if s is not None:
            s.start({})
    times: dict[str, list[float]] = {m: [] for m in modes}
    step = 0
    for _ in range(3):  # warm-up
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for _ in range(blocks):
        for mode, sinks in modes.items():
            for _ in range(block_steps):
                step += 1
                t0 = time.perf_counter()
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                if sinks is not None:
                    sinks.log_metrics("step", step, {"loss": loss.item(), "lr": 0.01, "images_per_s": 100.0})
                times[mode].append(time.perf_counter() - t0)
    for s in modes.values():
        if s is not None:
            s.finish()
    base = statistics.median(times["none"])

    def block_medians(ts: list[float]) -> list[float]:
        return [statistics.median(ts[i : i + block_steps]) for i in range(0, len(ts), block_steps)]

    base_blocks = block_medians(times["none"])
    for mode, ts in times.items():
        med = statistics.median(ts)
        paired = sorted(b / a - 1 for a, b in zip(base_blocks, block_medians(ts)))
        q1, q2, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired[0],) * 3
        print(
            f"{mode}: median {med * 1000:.2f} ms/step over {len(ts)} steps ({100 * (med / base - 1):+.2f} %); "
            f"paired with the untracked block of its cycle: median {100 * q2:+.2f} % (quartiles {100 * q1:+.2f} "
            f"… {100 * q3:+.2f} %)"
        )


def main() -> None:
    """Print one line per tracker: median and mean ms per call (or the side-by-side runs)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--side-by-side", type=int, default=0, metavar="PAIRS")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--in-process", type=int, default=0, metavar="BLOCKS", help="in-process A/B, BLOCKS cycles")
    p.add_argument("--block-steps", type=int, default=5)
    args = p.parse_args()
    if args.side_by_side:
        side_by_side(args.side_by_side, args.steps)
        return
    calls = args.calls
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=tmp, MLFLOW_ALLOW_FILE_STORE="true")
        if args.in_process:
            in_process_ab(args.in_process, args.block_steps, Path(tmp))
            return
        for t in (
            MlflowTracker(Path(tmp, "mlruns").as_uri(), "bench", None),
            WandbTracker("bench", None, Path(tmp)),
        ):
            t.start(None)
            med, mean = per_call_ms(t, calls)
            t.finish()
            print(f"{t.name}: log_metrics median {med:.3f} ms, mean {mean:.3f} ms over {calls} calls", flush=True)

        def mlflow():
            return MlflowTracker(Path(tmp, "mlruns").as_uri(), "bench", None)

        cases = [
            ("mlflow", mlflow, 0.0),
            ("wandb", lambda: WandbTracker("bench", None, Path(tmp)), 0.0),
            ("mlflow + 50 ms per log_batch (synthetic remote server)", mlflow, 0.05),
        ]
        for name, make, latency in cases:
            for background in (False, True):
                med, mean, flush = sinks_per_call(make, calls, background, latency)
                print(
                    f"sinks -> {name}, {'background' if background else 'synchronous'}: training thread median "
                    f"{med:.3f} ms, mean {mean:.3f} ms per row over {calls - 5} rows; finish waited {flush:.2f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
