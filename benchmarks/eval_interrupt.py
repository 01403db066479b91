"""SIGTERM during evaluation: seconds from the signal to the trainer's exit, and what the checkpoint folder holds.

One process on the CPU trains one step of ResNet-18 with EMA (two evaluations per epoch) on
``<data>`` (an ImageFolder, e.g. ../shared/data/hymenoptera: 153 val photos at 224 px), waits ``--delay`` s
after the step's log line (the evaluation is then running), sends SIGTERM to the process group and times the
exit. ``--code`` runs another checkout's trainer (e.g. main's, from ``git archive``) for a before/after pair.
``--task detection``: DINO-4scale R50 (the defaults) on a COCO folder such as ../shared/data/facemask-coco
(``annotations/custom_{split}.json``), one training step at 512 px, evaluation at ``--eval-size`` (default 800,
the issue's 149 s case), no EMA.

    PYTHONPATH=. .venv/bin/python benchmarks/eval_interrupt.py --data ../shared/data/hymenoptera
    PYTHONPATH=. .venv/bin/python benchmarks/eval_interrupt.py --task detection --data ../shared/data/facemask-coco
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    """Run the measurement; prints one result line. Exit 2 with one line when ``--data`` or ``--code`` is bad."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, type=Path, help="ImageFolder root (train/ and val/)")
    ap.add_argument("--code", type=Path, default=REPO, help="checkout whose trainer runs (default: this one)")
    ap.add_argument("--delay", type=float, default=5.0, help="seconds after the training step's line")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--task", choices=("classification", "detection"), default="classification")
    ap.add_argument("--eval-size", type=int, default=800, help="detection: evaluation shortest side (px)")
    args = ap.parse_args()
    folders = ("train", "val") if args.task == "classification" else ("annotations", "val2017")
    for d in (*(args.data / f for f in folders), args.code / "trainer"):
        if not d.is_dir():
            print(f"eval_interrupt: {d} is not a folder", file=sys.stderr)
            return 2
    out = Path(tempfile.mkdtemp(prefix="eval-interrupt-"))
    # fmt: off
    common = [
        "--epochs", "2", "--max-steps-per-epoch", "1", "--num-workers", "1", "--log-every-steps", "1",
        "--device", "cpu", "--checkpoint-dir", str(out / "ck"), "--log-dir", str(out / "logs"),
    ]
    if args.task == "classification":
        task = [
            "--data-dir", str(args.data.resolve()), "--model", "resnet18", "--image-size", str(args.image_size),
            "--batch-size", "8", "--lr", "0.003", "--use-ema",
        ]
    else:
        task = [
            "--task", "detection", "--data-dir", str(args.data.resolve()),
            "--coco-annotations", "annotations/custom_{split}.json", "--batch-size", "2", "--optimizer", "adamw",
            "--lr", "1e-4", "--min-scale", "512", "--max-scale", "512", "--eval-size", str(args.eval_size),
            "--precision", "32", "--no-use-ema",
        ]
    cmd = [sys.executable, "-m", "trainer", "train", *task, *common]
    # fmt: on
    env = {**os.environ, "PYTHONPATH": str(args.code.resolve()), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        cmd, cwd=args.code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step=1 "):
            break
    else:
        print("".join(lines[-20:]), file=sys.stderr)
        return 1
    time.sleep(args.delay)
    if p.poll() is not None:
        print("eval_interrupt: the run ended before the signal; lower --delay", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGTERM)
    rest = p.stdout.read()
    p.wait()
    took = time.monotonic() - t0
    ck = sorted(d.name for d in (out / "ck").iterdir() if d.name.startswith("ckpt-")) if (out / "ck").is_dir() else []
    evaluated = any(line.startswith("epoch=1 ") for line in (lines + rest.splitlines()))
    print(
        f"SIGTERM {args.delay:g} s after step 1 -> exit {p.returncode} after {took:.2f} s; "
        f"epoch 1 evaluated first: {evaluated}; checkpoints: {ck or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
