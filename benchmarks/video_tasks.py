"""The video task on the shared clips: the clip-source and arrow-of-time runs, and the cached-feature speed-up.

Derives both labelled sets from ``../shared/data/video-clips`` (trainer/data/formats/video/derived.py: windows of
``--frames`` frames at stride 2, ``--size`` px, split by time 70/30, no overlap), then trains seed 004's model
(frozen ResNet-18 per frame + a Transformer over time) with the trainer's own ``fit``, single process on CPU:

* clip source (7 classes; majority baseline = the largest validation class's share) and arrow of time (forward vs
  reversed windows; chance 50 %), on cached features: best and last validation top-1 per run.
* per-epoch time of the same config uncached (the frozen ResNet runs on every frame of every step) and cached (the
  features are read from the float16 cache; the one-off fill is timed apart).

    PYTHONPATH=. .venv/bin/python benchmarks/video_tasks.py --data ../shared/data/video-clips [--arrow-model r3d_18]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from trainer.config import load_config
from trainer.data.formats.video.derived import write_clip_sets
from trainer.engine.distributed import DistInfo
from trainer.engine.trainer import Trainer

CPU = DistInfo(0, 0, 1, torch.device("cpu"))


def _cfg(data_dir: Path, out: Path, args, **kw):
    base = dict(
        task="video",
        model="frame_transformer",
        video_format="arrays",
        data_dir=str(data_dir),
        num_frames=args.frames,
        temporal_crop="uniform",
        image_size=args.size,
        hflip_prob=0.0,
        batch_size=16,
        epochs=args.epochs,
        optimizer="adamw",
        lr=1e-3,
        weight_decay=0.01,
        precision="32",
        device="cpu",
        num_workers=0,
        channels_last=False,
        temporal_dim=64,
        temporal_layers=2,
        temporal_heads=4,
        temporal_mlp_dim=128,
        temporal_dropout=0.0,
        checkpoint_dir=str(out / "ck"),
        log_dir=str(out / "logs"),
        log_every_steps=1000,
        checkpoint_interval=1000,
    )
    return load_config(None, {**base, **kw})


def _fit(cfg) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    t = Trainer(cfg, CPU)
    setup = time.perf_counter() - t0
    t.fit()
    t.close()
    rows = [json.loads(line) for line in (Path(cfg.log_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "epoch"], setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data/video-clips")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--timing-epochs", type=int, default=2)
    ap.add_argument(
        "--arrow-model",
        default="",
        help="also train this torchvision video model (uncached, all layers trained) on the arrow-of-time set",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="video-bench-"))
    videos = sorted(Path(args.data).iterdir())
    counts = write_clip_sets(videos, tmp / "sets", num_frames=args.frames, stride=2, size=args.size)
    print(f"sets: {counts}")
    print(f"torch threads: {torch.get_num_threads()}")
    print("| set | classes | train / val clips | baseline top-1 (%) | best val top-1 (%) | last val top-1 (%) |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name in ("clip-source", "arrow-of-time"):
        cfg = _cfg(tmp / "sets" / name, tmp / f"run-{name}", args, cache_features=True)
        epochs, _ = _fit(cfg)
        import numpy as np

        labels = np.load(tmp / "sets" / name / "val.npz")["labels"]
        baseline = 100.0 * np.bincount(labels).max() / len(labels)
        top1 = [e["val_top1"] for e in epochs]
        print(
            f"| {name} | {int(labels.max()) + 1} | {counts[name]['train']} / {counts[name]['val']} | {baseline:.1f} "
            f"| {max(top1):.1f} | {top1[-1]:.1f} |"
        )
    if args.arrow_model:
        name = "arrow-of-time"
        cfg = _cfg(tmp / "sets" / name, tmp / f"run-{args.arrow_model}", args, model=args.arrow_model)
        epochs, _ = _fit(cfg)
        top1 = [e["val_top1"] for e in epochs]
        print(f"| {name}, {args.arrow_model} (trained end to end) | 2 | | 50.0 | {max(top1):.1f} | {top1[-1]:.1f} |")
    print()
    print("| clip-source, per epoch | setup incl. cache fill (s) | epoch time (s), median of epochs |")
    print("| --- | ---: | ---: |")
    for cached in (False, True):
        out = tmp / f"timing-{cached}"
        cfg = _cfg(tmp / "sets" / "clip-source", out, args, cache_features=cached, epochs=args.timing_epochs)
        epochs, setup = _fit(cfg)
        times = sorted(e["epoch_time_s"] for e in epochs)
        print(f"| {'cached' if cached else 'uncached'} | {setup:.2f} | {times[len(times) // 2]:.2f} |")


if __name__ == "__main__":
    main()
