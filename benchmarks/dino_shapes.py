"""DINO's data path on the CPU: decode + augmentation images/s of one loader worker and how many distinct padded
batch shapes an epoch of facemask-coco makes for each ``pad_to_multiple`` (DINO-4scale's training recipe, 480..800
px multi-scale + crop branch, batch 2 in dataset order). Shapes that repeat are what a compiled layer and cuDNN's
autotuner reuse; the images/s says whether ``num_workers`` loader processes can feed the GPU.

    PYTHONPATH=. .venv/bin/python benchmarks/dino_shapes.py --data ../shared/data/facemask-coco
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.dino_step import facemask_overrides  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.engine.distributed import DistInfo  # noqa: E402
from trainer.tasks import build_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="facemask-coco folder")
    ap.add_argument("--timed", type=int, default=60, help="images decoded and augmented for the images/s figure")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one loader worker's view
    over = {**facemask_overrides(args.data), "device": "cpu", "batch_size": 2, "num_workers": 0}
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "dino_4scale_coco.yaml"), over)
    task = build_task(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    data = task.build_data()
    ds = data.train
    for i in range(3):
        ds[(0, i)]
    t0 = time.perf_counter()
    items = [ds[(0, i)] for i in range(args.timed)]
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    for k in range(0, len(items) - 1, 2):
        data.collate(items[k : k + 2])
    dc = time.perf_counter() - t1
    print(
        f"decode + augment: {len(items) / dt:.1f} images/s per worker (1 thread); "
        f"collate {1e3 * dc / (len(items) // 2):.1f} ms per batch of 2"
    )
    sizes = [tuple(ds[(0, i)][0].shape[-2:]) for i in range(len(ds))]
    pairs = list(zip(sizes[::2], sizes[1::2]))
    for m in (1, 32, 64, 128):
        shapes = {(-(-max(a[0], b[0]) // m) * m, -(-max(a[1], b[1]) // m) * m) for a, b in pairs}
        print(f"pad_to_multiple={m}: {len(shapes)} distinct padded shapes over {len(pairs)} batches of epoch 0")


if __name__ == "__main__":
    main()
