"""The DINO overfit recipe of ``tests/tasks/test_detection_learning.py`` (4 facemask images, 128 px, 30 epochs)
with per-batch padding and with ``canvases: auto``, seeds 0 and 1, one thread: one JSON line per run (best and
last mAP@0.5 on the training images, last mAP, first and last train loss, seconds). It checks that the
learning tests keep their thresholds with canvases on.

    PYTHONPATH=. .venv/bin/python benchmarks/dino_canvases_overfit.py --data ../shared/data --out /tmp/ovf
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "tasks"))
from test_detection_learning import CPU, _cfg, overfit_data  # noqa: E402

from trainer.engine.trainer import Trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared datasets' folder")
    ap.add_argument("--out", default="/tmp/dino-canvases-overfit", help="scratch folder (replaced)")
    ap.add_argument("--seeds", default="0,1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shared = Path(args.data).resolve()
    for seed in (int(s) for s in args.seeds.split(",")):
        for canvases in ("", "auto"):
            tmp = Path(args.out) / f"seed{seed}-{canvases or 'off'}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            cfg = _cfg(overfit_data(shared, tmp), tmp, seed=seed, canvases=canvases)
            t0 = time.perf_counter()
            t = Trainer(cfg, CPU)
            last = t.fit()
            t.close()
            curve = [round(h["val_map_50"], 1) for h in t.history]
            row = {
                "seed": seed,
                "canvases": canvases or "off",
                "best_map50": max(curve),
                "last_map50": round(last["val_map_50"], 1),
                "last_map": round(last["val_map"], 1),
                "loss_first": round(t.history[0]["train_loss"], 3),
                "loss_last": round(last["train_loss"], 3),
                "s": round(time.perf_counter() - t0),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
