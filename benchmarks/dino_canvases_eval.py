"""DINO checkpoints evaluated with per-batch padding and with ``canvases: auto``, side by side.

Each checkpoint (a ``ckpt-<step>`` folder of ``python -m trainer train``, or its ``state.pt``) is evaluated twice on its
own run's validation split, through the trainer's own evaluation (:meth:`trainer.engine.trainer.Trainer.evaluate`),
once with the run's config and ``canvases: ''`` (every batch padded to its own size, rounded up to
``pad_to_multiple``) and once with ``canvases: auto`` (every batch on one of at most 2 evaluation canvases). With
one checkpoint trained each way this separates what canvases change at training time from what they change at
evaluation time. DINO's mask keeps padded tokens out of attention and query selection, but padding still reaches
the features, as in upstream DINO with its per-batch padding: after the backbone's first normalisation the padded
area is no longer zero, so convolutions near an image's bottom and right edges see it, and the input projections'
GroupNorm statistics include it.

Prints one JSON line per (checkpoint, evaluation padding): mAP, mAP@0.5, seconds.

    PYTHONPATH=. .venv/bin/python benchmarks/dino_canvases_eval.py RUN_A/ck/ckpt-000000336 RUN_B/ck/ckpt-000000336
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import load_config  # noqa: E402
from trainer.engine.distributed import DistInfo  # noqa: E402
from trainer.engine.trainer import Trainer  # noqa: E402


def evaluate(state: dict, canvases: str) -> dict:
    """mAP and mAP@0.5 (percent) of ``state``'s weights with its config's ``canvases`` set to ``canvases``, on
    the CPU with one thread and no loader workers, in a scratch checkpoint and log folder."""
    with tempfile.TemporaryDirectory() as tmp:
        over = {
            **state["config"],
            "canvases": canvases,
            "device": "cpu",
            "num_workers": 0,
            "checkpoint_dir": f"{tmp}/ck",
            "log_dir": f"{tmp}/logs",
            "auto_resume": False,
            "tracking": [],
        }
        t = Trainer(load_config(None, over), DistInfo(0, 0, 1, torch.device("cpu")))
        try:
            t.model.load_state_dict(state["model"])
            t0 = time.perf_counter()
            metrics, _, _ = t.evaluate(t.model)
            return {"map": metrics["map"], "map_50": metrics["map_50"], "s": round(time.perf_counter() - t0, 1)}
        finally:
            t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint folders (or their state.pt) of DINO runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for path in args.checkpoints:
        state = torch.load(path / "state.pt" if path.is_dir() else path, map_location="cpu", weights_only=False)
        trained = state["config"].get("canvases") or "per batch"
        for canvases in ("", "auto"):
            row = {"checkpoint": str(path), "trained": trained, "evaluated": canvases or "per batch"}
            print(json.dumps({**row, **evaluate(state, canvases)}), flush=True)


if __name__ == "__main__":
    main()
