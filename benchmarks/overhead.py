"""Trainer overhead: images/s of Trainstack's loop vs a minimal hand-written PyTorch loop.

Same model (torchvision ``--model``, same seed), same optimizer (SGD momentum 0.9), same uint8 batches held
in memory (real imagenette photos, decoded and resized once), same per-batch normalisation; fp32 on CPU.
The trainer's ``train_epoch`` runs with its loader replaced by the in-memory batches, so what is measured is
the loop itself: accumulation bookkeeping, schedule, NaN flag, metrics, logging. Alternating rounds.

    python benchmarks/overhead.py --data ../shared/data/imagenette-subset --model resnet18 --size 112 \
        --batch 32 --steps 12 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from trainer.config import load_config
from trainer.data.formats.imagefolder import decode_file, scan_split
from trainer.data.transforms import normalize_on_device, val_transform
from trainer.engine.distributed import DistInfo
from trainer.engine.trainer import Trainer
from trainer.tasks.classification.task import build_classifier


def in_memory_batches(root, size, batch, steps):
    """``steps`` collated uint8 batches of real photos from ``root/train`` (decoded and resized once)."""
    scan = scan_split(root, "train")
    tf = val_transform(size, 0.875)
    imgs, labels = [], []
    for path, label in scan.samples[:: max(1, len(scan.samples) // (batch * steps))][: batch * steps]:
        imgs.append(tf(decode_file(path)))
        labels.append(label)
    x, y = torch.stack(imgs), torch.tensor(labels)
    return [
        {"image": x[i * batch : (i + 1) * batch], "label": y[i * batch : (i + 1) * batch], "bad": []}
        for i in range(steps)
    ], len(scan.classes)


def in_memory_trainer(
    data: str, model: str, size: int, batch: int, batches: list, stop=None, device: str = "cpu", **extra
) -> Trainer:
    """A single-process Trainer on ``device`` (fp32 unless ``precision`` is given; logs and checkpoints in a
    temporary folder) whose loader is replaced by ``batches`` (uint8 host batches, moved by the step)."""
    tmp = tempfile.mkdtemp()
    cfg = load_config(
        None,
        dict(
            data_dir=data,
            model=model,
            image_size=size,
            batch_size=batch,
            epochs=1000,
            lr=0.01,
            precision=extra.pop("precision", "32"),
            num_workers=0,
            log_every_steps=10**9,
            auto_resume=False,
            checkpoint_dir=f"{tmp}/ck",
            log_dir=f"{tmp}/logs",
            device=device,
            **extra,
        ),
    )
    trainer = Trainer(cfg, DistInfo(0, 0, 1, torch.device(device)), stop)
    trainer.train_loader, trainer.steps_per_epoch = batches, len(batches)
    return trainer


def in_memory_parser(doc: str, model: str, size: int, batch: int, steps: int) -> argparse.ArgumentParser:
    """The flags every in-memory benchmark shares: --data, --model, --size (px), --batch, --steps."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default=model)
    ap.add_argument("--size", type=int, default=size)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    return ap


def main() -> None:
    ap = in_memory_parser(__doc__, "resnet18", 112, 32, 12)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    batches, n_classes = in_memory_batches(args.data, args.size, args.batch, args.steps)
    cpu = torch.device("cpu")
    trainer = in_memory_trainer(
        args.data,
        args.model,
        args.size,
        args.batch,
        batches,
        scheduler="cosine",
        channels_last=False,
        no_decay_norm_bias=False,
    )
    cfg = trainer.cfg

    torch.manual_seed(0)
    model = build_classifier(args.model, n_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=cfg.weight_decay)

    def minimal():
        model.train()
        for b in batches:
            x = normalize_on_device(b["image"], cpu, False)
            loss = F.cross_entropy(model(x), b["label"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return len(batches) * args.batch

    def ours():
        trainer.step_in_epoch = 0
        trainer.train_epoch()
        trainer.epoch += 1
        return len(batches) * args.batch

    rates = {"trainer": [], "minimal": []}
    ours(), minimal()  # warm-up (allocator, oneDNN primitives)
    for _ in range(args.rounds):
        for name, fn in (("trainer", ours), ("minimal", minimal)):
            t0 = time.perf_counter()
            n = fn()
            rates[name].append(n / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        json.dumps(
            {
                "model": args.model,
                "size": args.size,
                "batch": args.batch,
                "steps": args.steps,
                "threads": torch.get_num_threads(),
                "images_per_s": {k: round(v, 2) for k, v in med.items()},
                "all_rounds": {k: [round(x, 2) for x in v] for k, v in rates.items()},
                "ratio_trainer_over_minimal": round(med["trainer"] / med["minimal"], 4),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
