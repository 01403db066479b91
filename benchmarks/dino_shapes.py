"""DINO's data path on the CPU: decode + augmentation images/s of one loader worker and how many distinct padded
batch shapes an epoch of facemask-coco makes for each ``pad_to_multiple`` (DINO-4scale's training recipe, 480..800
px multi-scale + crop branch, batch 2 in dataset order). Shapes that repeat are what a compiled layer and cuDNN's
autotuner reuse; the images/s says whether ``num_workers`` loader processes can feed the GPU.

Then ``canvases: auto`` (fixed canvases) against today's per-batch padding (``pad_to_multiple`` 64), over ``--epochs``
epochs of the training order at batch 2 and the evaluation batches at 4, from the transformed sizes (no decode):
distinct padded shapes and the share of padded pixels.

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
    ap.add_argument("--epochs", type=int, default=4, help="training epochs compared with and without canvases")
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
    compare_canvases(over, args.epochs)


def compare_canvases(over: dict, epochs: int) -> None:
    """Print distinct shapes and padding share per epoch, per-batch padding vs ``canvases: auto``."""
    from trainer.data.formats import canvases as cv
    from trainer.data.sampler import EpochSampler

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(str(root / "configs" / "dino_4scale_coco.yaml"), {**over, "canvases": "auto"})
    t0 = time.perf_counter()
    data = build_task(cfg, DistInfo(0, 0, 1, torch.device("cpu"))).build_data()
    print(f"auto canvases chosen in {time.perf_counter() - t0:.1f} s (data set-up included):")
    print(next(line for line in data.report if line.startswith("data: canvases")))
    train_c, eval_c = data.collate.keywords["canvases"], data.val_collate.keywords["canvases"]

    def shapes(items, canvases):
        out = set()
        for it in items:
            hw = (cv.round_up(max(h for h, _ in it), 64), cv.round_up(max(w for _, w in it), 64))
            out.add(cv.fit_canvas(*hw, canvases) or hw if canvases else hw)
        return out

    print("| batches | padding | distinct shapes | padded pixels (share) |")
    print("| --- | --- | ---: | ---: |")
    for epoch in range(epochs):
        order = EpochSampler(len(data.train), shuffle=True, seed=cfg.seed)
        order.set_epoch(epoch)
        idx = [i for _, i in order]
        items = [[data.train.transformed_size(epoch, i) for i in idx[k : k + 2]] for k in range(0, len(idx) - 1, 2)]
        for name, cs in (("per batch", []), ("auto", train_c)):
            share = cv.padding_share(items, cs, 64)
            print(f"| training epoch {epoch} ({len(items)} x 2) | {name} | {len(shapes(items, cs))} | {share:.1%} |")
    val = [
        [data.val.transformed_size(0, i) for i in range(k, min(k + 4, len(data.val)))]
        for k in range(0, len(data.val), 4)
    ]
    for name, cs in (("per batch", []), ("auto", eval_c)):
        print(
            f"| evaluation ({len(val)} x 4) | {name} | {len(shapes(val, cs))} | {cv.padding_share(val, cs, 64):.1%} |"
        )


if __name__ == "__main__":
    main()
