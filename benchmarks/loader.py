"""Loader speed: Trainstack's ImageFolder pipeline vs torchvision.datasets.ImageFolder + PIL transforms.

Same files, same transforms (RandomResizedCrop(size, scale=(0.08, 1)), horizontal flip, ImageNet
normalisation), same batch size and worker count, measured alternately in one process so machine noise hits
both. Ours decodes with torchvision.io and hands uint8 batches to the training device, which normalises
them (``--consumer-normalize`` charges that to the CPU consumer too); the baseline is the textbook PIL path
(default_loader -> RandomResizedCrop -> ToTensor -> Normalize per image, in the worker).

    python benchmarks/loader.py --data ../shared/data/imagenette-subset --size 160 --workers 1 --rounds 3

``--decode-device cuda`` compares instead Trainstack's two decode paths on the same samples: the worker path
(``decode_device: cpu``) and the device path (``decode_device: cuda``: workers read bytes and draw crops, then
``decode_on_device`` decodes, crops and flips each batch on ``--device``; CUDA when available, else the CPU,
which measures the device path's code without a GPU), plus that path's loader alone (``encoded_loader_only``:
what the workers deliver when the decode after them costs nothing, the ceiling a GPU decode can reach):

    python benchmarks/loader.py --data ../shared/data/imagenette-subset --size 160 --workers 1 --decode-device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.data import BatchSampler, DataLoader
from torchvision import datasets
from torchvision import transforms as T

from trainer.data.formats.device_jpeg import collate_encoded, decode_on_device
from trainer.data.formats.imagefolder import ImageFolderDataset, collate_skip_bad, scan_split
from trainer.data.sampler import EpochSampler
from trainer.data.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_on_device, train_transform


def _ours(root, size, workers, batch, consumer_normalize, decode_on=None, encoded=False):
    """Trainstack's loader; ``decode_on`` (a device): the ``decode_device: cuda`` path, decoded there;
    ``encoded`` without ``decode_on``: that path's loader alone (bytes and crops, nothing decoded after it)."""
    scan = scan_split(root, "train")
    encoded = encoded or decode_on is not None
    mode = "cuda" if encoded else "cpu"
    ds = ImageFolderDataset(scan, lambda e, s=size: train_transform(s, 0.08, 0.5), seed=0, decode_device=mode)
    sampler = EpochSampler(len(ds), shuffle=True, seed=0)
    loader = DataLoader(
        ds,
        batch_sampler=BatchSampler(sampler, batch, drop_last=False),
        num_workers=workers,
        collate_fn=collate_encoded if encoded else collate_skip_bad,
        prefetch_factor=2 if workers else None,
    )
    dev = decode_on or torch.device("cpu")

    def run():
        n = 0
        for b in loader:
            if encoded and decode_on is None:
                n += len(b["label"])
                continue
            images = b["image"] if decode_on is None else decode_on_device(b, decode_on)[0]
            x = normalize_on_device(images, dev, channels_last=False) if consumer_normalize else images
            n += x.shape[0]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return n

    return run


def _pil(root, size, workers, batch):
    tf = T.Compose(
        [
            T.RandomResizedCrop(size, scale=(0.08, 1.0)),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    ds = datasets.ImageFolder(f"{root}/train", transform=tf)
    loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, prefetch_factor=2 if workers else None)

    def run():
        n = 0
        for x, _ in loader:
            n += x.shape[0]
        return n

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--size", type=int, default=160)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--consumer-normalize",
        action="store_true",
        help="also normalise each batch on the CPU in the consumer (what a CPU-only run pays; on "
        "a GPU host this happens on the device)",
    )
    ap.add_argument(
        "--decode-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: Trainstack vs torchvision+PIL; cuda: Trainstack's worker decode vs its device decode",
    )
    ap.add_argument("--device", default="auto", help="where the device path decodes: auto (cuda if present), cpu, cuda")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.decode_device == "cuda":
        dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        base = "worker_decode"
        runs = {
            base: _ours(args.data, args.size, args.workers, args.batch, args.consumer_normalize),
            f"device_decode_{dev.type}": _ours(
                args.data, args.size, args.workers, args.batch, args.consumer_normalize, decode_on=dev
            ),
            "encoded_loader_only": _ours(args.data, args.size, args.workers, args.batch, False, encoded=True),
        }
    else:
        base = "torchvision_pil"
        runs = {
            "trainstack": _ours(args.data, args.size, args.workers, args.batch, args.consumer_normalize),
            base: _pil(args.data, args.size, args.workers, args.batch),
        }
    rates: dict = {k: [] for k in runs}
    for _r in range(args.rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            n = fn()
            rates[name].append(n / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    other = next(k for k in med if k != base)  # the first run after the baseline
    per_worker = max(args.workers, 1)
    print(
        json.dumps(
            {
                "size": args.size,
                "decode_device": args.decode_device,
                "workers": args.workers,
                "consumer_normalize": args.consumer_normalize,
                "batch": args.batch,
                "rounds": args.rounds,
                "images_per_s": {k: round(v, 1) for k, v in med.items()},
                "images_per_s_per_worker": {k: round(v / per_worker, 1) for k, v in med.items()},
                "all_rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "speedup": round(med[other] / med[base], 2),
                "speedup_of": f"{other} over {base}",
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
