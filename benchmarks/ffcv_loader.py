"""Loader speed: the trainer's FFCV path against its ImageFolder path, side by side in one process.

Both are the trainer's own training loaders (``trainer.data.formats.ffcv.build_loaders`` and the ImageFolder
DataLoader the loop builds): random-resized crop to ``--size`` (scale 0.08-1), flip, uint8 batches,
normalised by ``normalize_on_device`` on the CPU consumer (what a CPU run pays; on a GPU host it runs on the
device). Same batch, same worker count (DataLoader processes vs FFCV/numba threads), rounds alternate so
machine noise hits both. A round is one full epoch, measured from ``iter()`` to the last batch, so the FFCV
figure includes its per-epoch numba recompilation (the seeded decoder compiles the epoch in; see
docs/ffcv.md); ``first_batch_s`` shows that start-up cost separately.

    python benchmarks/ffcv_loader.py --data ../shared/data/imagenette-subset --size 160 --workers 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import BatchSampler

from trainer.config import load_config
from trainer.data.formats.ffcv import BetonSplit, build_loaders
from trainer.data.formats.imagefolder import ImageFolderDataset, collate_skip_bad, scan_split
from trainer.data.loading import build_loader
from trainer.data.sampler import EpochSampler
from trainer.data.transforms import normalize_on_device
from trainer.engine.distributed import DistInfo
from trainer.tasks.classification.task import _TrainTransformForEpoch

CPU = torch.device("cpu")


def _imagefolder(cfg, batch):
    scan = scan_split(cfg.data_dir, "train")
    sampler = EpochSampler(len(scan.samples), shuffle=True, seed=cfg.seed)
    loader = build_loader(
        ImageFolderDataset(scan, _TrainTransformForEpoch(cfg), seed=cfg.seed),
        BatchSampler(sampler, batch, drop_last=True),
        collate_skip_bad,
        num_workers=cfg.num_workers,
        prefetch_factor=2,
        pin_memory=False,
        persistent_workers=True,
    )
    return sampler, loader


def _ffcv(cfg, batch):
    d = Path(cfg.ffcv_dir)
    train, _ = build_loaders(
        cfg, DistInfo(0, 0, 1, CPU), BetonSplit(d / "train.ffcv"), BetonSplit(d / "val.ffcv"), batch, batch
    )
    return train.order, train


def _epoch(sampler, loader, epoch):
    """One epoch: (images/s from iter() to the end, seconds to the first batch, images/s after the first)."""
    sampler.set_epoch(epoch)
    n, t0, first, n0 = 0, time.perf_counter(), None, 0
    for b in loader:
        n += normalize_on_device(b["image"], CPU, channels_last=True).shape[0]
        if first is None:
            first, n0 = time.perf_counter() - t0, n
    total = time.perf_counter() - t0
    return n / total, first, (n - n0) / (total - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="ImageFolder root (train/ and val/)")
    ap.add_argument("--ffcv-dir", help="existing write-ffcv output for --data (default: convert into a temp dir)")
    ap.add_argument("--max-resolution", type=int, default=256, help="write-ffcv --max-resolution when converting")
    ap.add_argument("--size", type=int, default=160)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="ffcv-bench-")
    ffcv_dir = args.ffcv_dir or tmp.name
    if not args.ffcv_dir:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer",
                "write-ffcv",
                "--data-dir",
                args.data,
                "--ffcv-dir",
                ffcv_dir,
                "--max-resolution",
                str(args.max_resolution),
                "--num-workers",
                str(args.workers),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    cfg = load_config(
        None,
        dict(
            data_dir=args.data,
            ffcv_dir=ffcv_dir,
            image_size=args.size,
            hflip_prob=0.5,
            num_workers=args.workers,
            device="cpu",
        ),
    )
    runs = {"imagefolder": _imagefolder(cfg, args.batch), "ffcv": _ffcv(cfg, args.batch)}
    torch.set_num_threads(1)  # the consumer's normalisation; FFCV's Loader resets it to --workers
    rates: dict = {k: [] for k in runs}
    firsts: dict = {k: [] for k in runs}
    steady: dict = {k: [] for k in runs}
    for r in range(args.rounds):
        for name, (sampler, loader) in runs.items():
            rate, first, after_first = _epoch(sampler, loader, r)
            rates[name].append(rate)
            firsts[name].append(first)
            steady[name].append(after_first)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        json.dumps(
            {
                "size": args.size,
                "workers": args.workers,
                "batch": args.batch,
                "rounds": args.rounds,
                "images_per_epoch": len(runs["imagefolder"][0]) // args.batch * args.batch,
                "images_per_s_median": {k: round(v, 1) for k, v in med.items()},
                "all_rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "after_first_batch_images_per_s_median": {k: round(statistics.median(v), 1) for k, v in steady.items()},
                "first_batch_s_median": {k: round(statistics.median(v), 2) for k, v in firsts.items()},
                "ffcv_over_imagefolder": round(med["ffcv"] / med["imagefolder"], 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
