"""Trainer overhead: images/s of Trainstack's loop vs a minimal hand-written PyTorch loop.

Same model (torchvision ``--model``, same seed), same optimizer (SGD momentum 0.9; the trainer's is fused on
CUDA, the minimal loop keeps torch's default), same uint8 batches held in memory (real imagenette photos, decoded
and resized once; pinned on CUDA), same per-batch normalisation. The trainer's ``train_epoch`` runs with its
loader replaced by the in-memory batches, so what is measured is the loop itself: accumulation bookkeeping,
schedule, NaN flag, metrics, logging. Alternating rounds, one JSON line per precision (``--precisions``: fp32
``32`` on the CPU; ``bf16-mixed`` runs with channels_last, as ``../shared/gpu-check/throughput.py``), ending
with ``ratio_trainer_over_minimal=X`` (the lowest over the precisions).

``--profile`` counts instead of timing (a CPU proxy of GPU cost; ``tests/engine/test_step_overhead.py`` pins it):
per optimizer step of each loop, ATen operator calls (a proxy for kernel launches), host syncs (``.item()``,
boolean indexing, ``.tolist()/.numpy()/.cpu()``) and tensors built from Python data on the training device
(``torch.tensor(..., device=...)``: on CUDA a blocking copy from pageable memory, i.e. a host sync), and ends
with ``extra_aten_calls_per_step=N host_syncs_per_step=M``.

    python benchmarks/overhead.py --data ../shared/data/imagenette-subset --model resnet18 --size 112 \
        --batch 32 --steps 12 --rounds 5
    python benchmarks/overhead.py --data ../shared/data/imagenette-subset --model resnet18 --size 64 \
        --batch 8 --steps 4 --profile
    python benchmarks/overhead.py --data DIR --model resnet50 --size 224 --batch 256 --steps 20 --rounds 3 \
        --device cuda --precisions bf16-mixed,32

``--ffcv-dir DIR`` (seed 003's loader): instead of in-memory batches both loops read the trainer's own
FFCV train loader (``--use-ffcv``: ``DIR/train.ffcv`` written by ``python -m trainer write-ffcv``, FFCV's
``--workers`` threads, batches moved to the device by FFCV's ``ToDevice``), one whole epoch per round, so both
pay the same decoding and FFCV's per-epoch numba compilation; ``--steps`` is then unused.

    python benchmarks/overhead.py --data DIR --ffcv-dir FFCV_DIR --model resnet50 --size 224 --batch 256 \
        --workers 14 --rounds 2 --device cuda --precisions bf16-mixed
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profiling import (  # noqa: E402
    HOST_COPY_METHODS,
    SYNC_OPS,
    count_calls,
    count_device_tensors_from_host,
    count_host_copies,
)

from trainer.config import load_config  # noqa: E402
from trainer.data.formats.image_decode import decode_file  # noqa: E402
from trainer.data.formats.imagefolder import scan_split  # noqa: E402
from trainer.data.transforms import normalize_on_device, val_transform  # noqa: E402
from trainer.engine.distributed import DistInfo  # noqa: E402
from trainer.engine.trainer import Trainer  # noqa: E402
from trainer.tasks.classification.task import build_classifier  # noqa: E402


def in_memory_batches(root, size, batch, steps, pin: bool = False):
    """``steps`` collated uint8 batches of real photos from ``root/train`` (decoded and resized once; page-locked
    when ``pin``, as the loader's ``pin_memory`` makes them on CUDA)."""
    scan = scan_split(root, "train")
    tf = val_transform(size, 0.875)
    imgs, labels = [], []
    paths = scan.samples[:: max(1, len(scan.samples) // (batch * steps))]
    while len(paths) < batch * steps:  # a small dataset repeats its photos
        paths = paths + paths
    for path, label in paths[: batch * steps]:
        imgs.append(tf(decode_file(path)))
        labels.append(label)
    x, y = torch.stack(imgs), torch.tensor(labels)
    out = []
    for i in range(steps):
        xi, yi = x[i * batch : (i + 1) * batch].clone(), y[i * batch : (i + 1) * batch].clone()
        if pin:
            xi, yi = xi.pin_memory(), yi.pin_memory()
        out.append({"image": xi, "label": yi, "bad": []})
    return out, len(scan.classes)


def _scratch_run(device: str) -> dict:
    """Config keys of a benchmark run: loader in the main process, no step logs, no resume, logs and checkpoints
    in a new temporary folder, on ``device``."""
    tmp = tempfile.mkdtemp()
    return dict(
        num_workers=0,
        log_every_steps=10**9,
        auto_resume=False,
        checkpoint_dir=f"{tmp}/ck",
        log_dir=f"{tmp}/logs",
        device=device,
    )


def in_memory_trainer(
    data: str, model: str, size: int, batch: int, batches: list, stop=None, device: str = "cpu", **extra
) -> Trainer:
    """A single-process Trainer on ``device`` (fp32 unless ``precision`` is given; logs and checkpoints in a
    temporary folder) whose loader is replaced by ``batches`` (uint8 host batches, moved by the step)."""
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
            **_scratch_run(device),
            **extra,
        ),
    )
    trainer = Trainer(cfg, DistInfo(0, 0, 1, torch.device(device)), stop)
    trainer.train_loader, trainer.steps_per_epoch = batches, len(batches)
    return trainer


def ffcv_trainer(data: str, ffcv_dir: str, model: str, size: int, batch: int, device: str, **extra) -> Trainer:
    """A single-process Trainer on ``device`` that keeps its own FFCV train loader (``use_ffcv``: reads
    ``ffcv_dir/train.ffcv`` and ``val.ffcv``; ``num_workers`` in ``extra`` = FFCV's threads); temporary logs and
    checkpoints. Raises what the trainer raises for a missing extra or a bad .ffcv file (ConfigError/DataError)."""
    over = {**_scratch_run(device), **extra}
    over.update(data_dir=data, use_ffcv=True, ffcv_dir=ffcv_dir, model=model, image_size=size, batch_size=batch)
    cfg = load_config(None, dict(epochs=1000, lr=0.01, **over))
    return Trainer(cfg, DistInfo(0, 0, 1, torch.device(device)))


class _FirstBatches:
    """Re-iterable over the first ``n`` batches of each pass over ``loader``: the bare loop takes as many
    batches of the trainer's FFCV loader as the trainer's epoch (``max_steps_per_epoch`` may cut it)."""

    def __init__(self, loader, n: int):
        self.loader, self.n = loader, n

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.n)


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


def minimal_loop(model, batches: list, device: torch.device, precision: str, channels_last: bool, weight_decay: float):
    """The hand-written loop the trainer is compared with: normalise, forward under autocast (bf16 for
    ``bf16-mixed``), cross-entropy, backward, SGD (torch's default implementation), ``zero_grad``. Returns a
    callable that runs one pass over ``batches`` and returns the images it trained on."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=weight_decay)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "32")

    def run(part: list = batches) -> int:
        model.train()
        for b in part:
            x = normalize_on_device(b["image"], device, channels_last)
            y = b["label"].to(device, non_blocking=True)
            with amp:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return sum(b["image"].shape[0] for b in part)

    return run


def config_trainer(config: str, steps: int, device: str, pin: bool, **over) -> tuple[Trainer, list]:
    """A single-process Trainer for ``config`` (any task: its data, model, optimizer; temporary logs and
    checkpoints) and ``steps`` of its own collated training batches, taken once from its loader (``num_workers``
    0) and kept in memory (page-locked when ``pin``); the trainer's loader is replaced by them."""
    over = dict(**_scratch_run(device), epochs=1000, **over)
    trainer = Trainer(load_config(config, over), DistInfo(0, 0, 1, torch.device(device)))
    trainer.sampler.set_epoch(0)
    batches = []
    for batch in trainer.train_loader:
        batches.append(batch)
        if len(batches) == steps:
            break
    if pin:
        batches = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    trainer.train_loader, trainer.steps_per_epoch = batches, len(batches)
    return trainer, batches


def task_loop(trainer: Trainer, batches: list):
    """The bare loop for any task: a copy of the trainer's freshly built model, the task's own batch preparation
    and loss (``train_batch``, ``model_step``) under the same autocast, ``backward``, torch's default SGD
    (momentum) or AdamW at the config's lr and weight decay, ``zero_grad``; no EMA, statistics, schedule or
    checkpoint logic. Returns a callable like :func:`minimal_loop`'s."""
    cfg, task, dev, prec = trainer.cfg, trainer.task, trainer.device, trainer.precision
    model = copy.deepcopy(trainer.model)  # call before the trainer trains: the same initial weights and layout
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler(dev.type, enabled=prec.use_scaler)

    def run(part: list = batches) -> int:
        model.train()
        n = 0
        for b in part:
            b = task.train_batch(b)
            with prec.autocast(dev):
                loss = task.model_step(model, b).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            n += b["n"]
        return n

    return run


def trainer_loop(trainer: Trainer):
    """One pass of the trainer's ``train_epoch`` over its in-memory batches (or ``part`` of them), or one epoch of
    its own loader when that is no list (``--ffcv-dir``); returns the images trained on."""
    batches = trainer.train_loader

    def run(part: list = batches) -> int:
        if isinstance(part, list):  # in-memory batches; a real loader (FFCV) keeps the trainer's step count
            trainer.train_loader, trainer.steps_per_epoch = part, len(part)
        trainer.step_in_epoch = 0
        trainer.train_epoch()
        trainer.epoch += 1
        return trainer.steps_per_epoch * trainer.micro * trainer.accum

    return run


def synced(fn, device: torch.device):
    def run(*a) -> int:
        n = fn(*a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return n

    return run


def _counts(fn, part: list, device: torch.device) -> tuple[dict, int]:
    host, built = {}, {}
    with count_host_copies(host), count_device_tensors_from_host(built, device), profile() as prof:
        fn(part)
    calls, aten = count_calls(prof.events())
    syncs = sum(calls.get(k, 0) for k in SYNC_OPS) + sum(host.get(k, 0) for k in HOST_COPY_METHODS)
    return {**calls, "host_syncs": syncs, "device_tensors_from_host": built.get("from_host", 0)}, aten


def step_counts(fn, batches: list, device: torch.device) -> dict:
    """Marginal per-step counts of a loop ``fn(batches)`` under torch.profiler: the counts of a pass over all
    ``batches`` minus those of a pass over the first half, divided by the steps between, so what a loop does
    once per pass (the trainer's epoch start and end) cancels. ATen calls, host syncs (:data:`profiling.SYNC_OPS`
    + host-copy methods) and tensors built from host data on ``device``; ``calls``: per event name."""
    half = batches[: len(batches) // 2]
    fn(batches)  # warm-up
    (short, a_short), (full, a_full) = _counts(fn, half, device), _counts(fn, batches, device)
    steps = len(batches) - len(half)
    calls = {k: (full.get(k, 0) - short.get(k, 0)) / steps for k in set(full) | set(short)}
    return {
        "aten_calls": (a_full - a_short) / steps,
        "host_syncs": calls.pop("host_syncs"),
        "device_tensors_from_host": calls.pop("device_tensors_from_host"),
        "calls": calls,
    }


def _typed(key: str, value: str) -> tuple:
    import yaml

    return key, yaml.safe_load(value)


def main() -> None:
    ap = in_memory_parser(__doc__, "resnet18", 112, 32, 12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--precisions",
        default=None,
        help="comma-separated: 32, bf16-mixed (default: 32 on the CPU, bf16-mixed,32 on CUDA)",
    )
    ap.add_argument("--profile", action="store_true", help="count ATen calls and host syncs per step, no timing")
    ap.add_argument("--config", help="YAML config of any task: its data (--data), model, loss and optimizer")
    ap.add_argument("--ffcv-dir", help="write-ffcv output of --data: both loops read the trainer's FFCV loader")
    ap.add_argument("--workers", type=int, default=4, help="with --ffcv-dir: FFCV's threads (num_workers)")
    ap.add_argument(
        "--set", action="append", type=lambda kv: tuple(_typed(*kv.split("=", 1))), help="config override key=value"
    )
    args = ap.parse_args()
    if args.ffcv_dir and (args.config or args.profile):
        ap.exit(2, "error: --ffcv-dir: times the classification loop; use it without --config and --profile\n")
    dev = torch.device(args.device)
    precisions = (args.precisions or ("32" if dev.type == "cpu" else "bf16-mixed,32")).split(",")
    pin = dev.type == "cuda"
    if not args.config and not args.ffcv_dir:
        batches, n_classes = in_memory_batches(args.data, args.size, args.batch, args.steps, pin=pin)
    ratios, results = [], []
    for prec in precisions:
        cl = prec != "32"
        if args.config:  # any task: its own batches, model, loss and optimizer
            over = dict(data_dir=args.data, batch_size=args.batch, precision=prec, **dict(args.set or []))
            if args.size:
                over["image_size"] = args.size
            trainer, batches = config_trainer(args.config, args.steps, args.device, pin, **over)
            cl, bare = trainer.cfg.channels_last, task_loop(trainer, batches)
        elif args.ffcv_dir:  # both loops read the trainer's FFCV loader (batches already on the device)
            trainer = ffcv_trainer(
                args.data,
                args.ffcv_dir,
                args.model,
                args.size,
                args.batch,
                args.device,
                precision=prec,
                scheduler="cosine",
                channels_last=cl,
                no_decay_norm_bias=False,
                num_workers=args.workers,
                **dict(args.set or []),
            )
            torch.manual_seed(0)
            model = build_classifier(args.model, trainer.task.num_classes).to(dev)
            if cl:
                model = model.to(memory_format=torch.channels_last)
            batches = _FirstBatches(trainer.train_loader, trainer.steps_per_epoch)
            bare = minimal_loop(model, batches, dev, prec, cl, trainer.cfg.weight_decay)
        else:
            trainer = in_memory_trainer(
                args.data,
                args.model,
                args.size,
                args.batch,
                batches,
                device=args.device,
                precision=prec,
                scheduler="cosine",
                channels_last=cl,
                no_decay_norm_bias=False,
                **dict(args.set or []),
            )
            torch.manual_seed(0)
            model = build_classifier(args.model, n_classes).to(dev)
            if cl:
                model = model.to(memory_format=torch.channels_last)
            bare = minimal_loop(model, batches, dev, prec, cl, trainer.cfg.weight_decay)
        loops = {
            "trainer": synced(trainer_loop(trainer), dev),
            "minimal": synced(bare, dev),
        }
        row = {
            "task": trainer.task.name,
            "model": trainer.cfg.model,
            "size": trainer.cfg.image_size,
            "batch": args.batch,
            "steps": args.steps,
            "precision": prec,
            "channels_last": cl,
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        if args.ffcv_dir:  # whole epochs of the FFCV loader, not --steps
            row.update(steps=trainer.steps_per_epoch, loader=f"ffcv, {args.workers} threads")
        if args.profile:
            counts = {k: step_counts(fn, batches, dev) for k, fn in loops.items()}
            t, m = counts["trainer"], counts["minimal"]
            extra = {
                k: round(t["calls"].get(k, 0) - m["calls"].get(k, 0), 2)
                for k in set(t["calls"]) | set(m["calls"])
                if k.startswith("aten::")
            }
            row.update({k: {n: v for n, v in c.items() if n != "calls"} for k, c in counts.items()})
            row["extra_aten_calls_per_step"] = round(t["aten_calls"] - m["aten_calls"], 2)
            row["extra_by_op"] = dict(sorted(((k, v) for k, v in extra.items() if v), key=lambda kv: -abs(kv[1]))[:15])
            results.append(row)
            print(json.dumps(row), flush=True)
            continue
        rates = {k: [] for k in loops}
        for fn in loops.values():  # warm-up (allocator, oneDNN primitives, cuDNN autotuning)
            fn()
        for _ in range(args.rounds):
            for name, fn in loops.items():
                t0 = time.perf_counter()
                n = fn()
                rates[name].append(n / (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in rates.items()}
        ratios.append(med["trainer"] / med["minimal"])
        row.update(
            {
                "images_per_s": {k: round(v, 2) for k, v in med.items()},
                "all_rounds": {k: [round(x, 2) for x in v] for k, v in rates.items()},
                "ratio_trainer_over_minimal": round(ratios[-1], 4),
            }
        )
        print(json.dumps(row), flush=True)
        del trainer, bare, loops
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.profile:
        worst = max(results, key=lambda r: r["extra_aten_calls_per_step"])
        print(
            f"extra_aten_calls_per_step={worst['extra_aten_calls_per_step']} "
            f"host_syncs_per_step={max(r['trainer']['host_syncs'] for r in results)} "
            f"device_tensors_from_host_per_step={max(r['trainer']['device_tensors_from_host'] for r in results)}"
        )
    else:
        print(f"ratio_trainer_over_minimal={min(ratios):.4f}")


if __name__ == "__main__":
    main()
