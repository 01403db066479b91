"""DINO's training step under torch.profiler: host syncs and operator calls per step (a CPU proxy of GPU cost).

The real ``TrainStep`` (:func:`trainer.engine.step.build_single_rank_step`: model, AdamW, clipping, precision) of
the detection task runs on two kinds of batch: the task's example batch (``--image-size`` px, 8 boxes per image)
and real facemask-coco batches through the real dataset, augmentation and ``collate_detection`` (``--data``).
Per step it prints:

- host syncs: ``aten::_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``: each blocks the host until the
  GPU has caught up), ``aten::nonzero`` (boolean-mask indexing: its output size is data-dependent, a sync on CUDA),
  and Python-level ``.tolist()`` / ``.numpy()`` / ``.cpu()`` calls (counted by wrapping those methods, since on a
  CPU they make no ATen call); on the CPU every such call is counted, although on a GPU a call on a tensor that
  already lives on the host would not sync, so the CPU figure is an upper bound of the GPU's;
- ATen operator calls (every ``aten::`` event, forward and backward: a proxy for CUDA kernel launches);
- the Hungarian matcher's share of the step's wall time (``--matcher scipy``: its ``linear_sum_assignment`` runs on
  the host; on a GPU the share includes the wait for the forward pass at its one device-to-host copy; ``--matcher
  batched``: torch-linear-assignment on the device, no copy on CUDA).

With ``--cuda-graphs`` (and ``--canvases auto --dn-max-boxes 100``, which it needs) it also splits the ATen calls
into those inside the captured graphs and the eager rest, what the host still launches per step (on a CPU through
``profiling.graph_stand_in``).

The counts do not depend on the machine or the thread count: ``tests/tasks/test_dino_step_proxy.py`` pins them.
It ends with one line ``host_syncs_per_step=N aten_calls_per_step=M`` (the larger of the two batch kinds).

    python benchmarks/dino_step.py --data ../shared/data/facemask-coco            # CPU proxy, batch 2, 512 px
    python benchmarks/dino_step.py --data DIR --device cuda --model resnet50 --image-size 800 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profiling import (  # noqa: E402,F401
    HOST_COPY_METHODS,
    SYNC_OPS,
    captured_events,
    count_calls,
    count_host_copies,
    graph_stand_in,
)

from trainer.config import load_config  # noqa: E402
from trainer.engine.step import build_single_rank_step  # noqa: E402


def facemask_overrides(data: str) -> dict:
    """Config keys that read ../shared/data/facemask-coco's layout (train2017/, annotations/custom_train.json)."""
    return {
        "data_dir": data,
        "train_split": "train",
        "val_split": "val",
        "coco_annotations": "annotations/custom_{split}.json",
        "coco_images": "{split}2017",
    }


def build(args) -> tuple:
    """(TrainStep, real device batches or []) for ``args`` (DINO-4scale sizes unless overridden)."""
    over = {
        "task": "detection",
        "model": args.model,
        "device": args.device,
        "precision": args.precision,
        "batch_size": args.batch,
        "optimizer": "adamw",
        "lr": 1e-4,
        "weight_decay": 1e-4,
        "gradient_clip": 0.1,
        "num_queries": args.num_queries,
        "min_scale": args.image_size,
        "max_scale": args.image_size,
        "max_size": round(args.image_size * 1333 / 800),
        "eval_size": args.image_size,
        "num_workers": 0,
        "channels_last": False,
        "compile": args.compile,
        "matcher": args.matcher,
        "canvases": args.canvases,
        "dn_max_boxes": args.dn_max_boxes,
        "cuda_graphs": args.cuda_graphs,
    }
    if args.hidden_dim:
        over.update(hidden_dim=args.hidden_dim, dim_feedforward=args.dim_feedforward)
    if args.data:
        over.update(facemask_overrides(args.data))
    cfg = load_config(None, over)
    torch.manual_seed(0)
    rig = build_single_rank_step(cfg, torch.device(args.device), 3)
    real = []
    if args.data:
        data = rig.task.build_data()
        ds = data.train
        # the images with the most boxes first (facemask has up to 115 per image): the matcher's worst case
        order = sorted(range(len(ds)), key=lambda i: -int(ds.split.box_start[i + 1] - ds.split.box_start[i]))
        picks = order[: args.batch * args.real_batches]
        for k in range(args.real_batches):
            items = [ds[(0, i)] for i in picks[k * args.batch : (k + 1) * args.batch]]
            real.append(rig.task.train_batch(data.collate(items)))
    return rig, real


def profile_steps(rig, batches: list, steps: int, device: str) -> dict:
    """Profile ``steps`` optimizer steps cycling over ``batches``; per-step counts and the matcher's time share."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    matcher = rig.task.criterion.matcher
    match_s = [0.0]
    original = matcher.match_pairs  # what the criterion calls

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            match_s[0] += time.perf_counter() - t0

    for b in batches:  # warm-up: allocator, oneDNN primitives, compiled graphs
        rig.step(b)
    host = {}
    matcher.match_pairs = timed
    try:
        with count_host_copies(host), profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for i in range(steps):
                rig.step(batches[i % len(batches)])
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        del matcher.match_pairs  # the instance attribute: the class's method shows through again
    calls, aten = count_calls(prof.events())
    captured = count_calls(captured_events(prof.events()))[1]
    syncs = {k: calls.get(k, 0) for k in SYNC_OPS}
    result = {
        "steps": steps,
        "ms_per_step": 1e3 * wall / steps,
        "syncs": {k: v / steps for k, v in syncs.items()},
        "host_copies": {k: host.get(k, 0) / steps for k in HOST_COPY_METHODS},
        "aten_calls": aten / steps,
        "captured_aten_calls": captured / steps,
        "eager_aten_calls": (aten - captured) / steps,
        "matcher_share": match_s[0] / wall,
        "top": sorted(((c / steps, k) for k, c in calls.items() if k.startswith("aten::")), reverse=True)[:12],
    }
    result["host_syncs"] = sum(result["syncs"].values()) + sum(result["host_copies"].values())
    if device == "cuda":
        result["cuda_syncs"] = calls.get("cudaStreamSynchronize", 0) / steps
        result["kernel_launches"] = calls.get("cudaLaunchKernel", 0) / steps
        kernels = gpu_kernel_times(prof)
        result["gpu_kernel_ms"] = sum(kernels.values()) / steps
        result["top_kernels"] = sorted(((ms / steps, k) for k, ms in kernels.items()), reverse=True)[:8]
    return result


def gpu_kernel_times(prof) -> dict[str, float]:
    """Summed device time (ms) of each GPU kernel name in a profile (torch.profiler's CUDA events)."""
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0)
            out[evt.key] = out.get(evt.key, 0.0) + us / 1e3
    return out


def time_steps(rig, batch_sizes: list[int], image_size: int, steps: int, device: str) -> list[dict]:
    """ms per step, images/s and peak memory of the example batch at each batch size, without the profiler
    (after two warm-up steps; the GPU is synchronised around the timed steps)."""
    rows = []
    for b in batch_sizes:
        x = rig.example_batch(b, image_size)
        for _ in range(2):
            rig.step(x)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            rig.step(x)
        if device == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        row = {"batch": b, "ms_per_step": 1e3 * dt, "images_per_s": b / dt}
        if device == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        rows.append(row)
    return rows


def time_batches(rig, batches: list, steps: int, device: str) -> float:
    """ms per step cycling over ``batches`` (real facemask batches: varying shapes and box counts), without the
    profiler, after one warm-up pass over them."""
    for b in batches:
        rig.step(b)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        rig.step(batches[i % len(batches)])
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / steps


def stand_in(args):
    """:func:`profiling.graph_stand_in` for ``--cuda-graphs`` on a CPU (where no graph can be captured), else a
    no-op context."""
    return graph_stand_in() if args.cuda_graphs and args.device == "cpu" else contextlib.nullcontext()


def measure(args) -> dict:
    """{batch kind: profile_steps result} for the example batch and (with ``--data``) real facemask batches.

    With ``--cuda-graphs`` on a CPU, :func:`profiling.graph_stand_in` stands in for the capture: the dense part
    runs eagerly inside a marked region, and ``eager_aten_calls`` counts what a CUDA run would still launch one
    by one per step (on CUDA the real graphs replay and every counted call is eager)."""
    with stand_in(args):
        rig, real = build(args)
        kinds = {"example": [rig.example_batch(args.batch, args.image_size)]}
        if real:
            kinds["facemask"] = real
        return {name: profile_steps(rig, batches, args.steps, args.device) for name, batches in kinds.items()}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="facemask-coco folder (../shared/data/facemask-coco); without it: example only")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="resnet18", help="ResNet backbone (resnet18 keeps the CPU proxy quick)")
    ap.add_argument("--batch", type=int, default=2, help="micro-batch (images per step)")
    ap.add_argument("--image-size", type=int, default=512, help="shorter side in px (longer: x 1333/800)")
    ap.add_argument("--num-queries", type=int, default=900)
    ap.add_argument("--precision", default="32")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps per batch kind")
    ap.add_argument("--real-batches", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile as the trainer's --compile does")
    ap.add_argument("--matcher", default="scipy", help="the config's matcher: scipy, batched or auto")
    ap.add_argument("--canvases", default="", help="the config's canvases: '' (per-batch padding) or auto")
    ap.add_argument("--dn-max-boxes", type=int, default=0, help="the config's dn_max_boxes (0: per-batch size)")
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the config's cuda_graphs (needs --canvases and --dn-max-boxes); on a CPU a stand-in marks what a "
        "graph would replay and the eager remainder is counted",
    )
    ap.add_argument("--hidden-dim", type=int, help="narrower transformer (the counts do not change; the test's speed)")
    ap.add_argument("--dim-feedforward", type=int, default=2048)
    ap.add_argument("--time-batches", default="", help="comma list of batch sizes to time without the profiler")
    ap.add_argument("--time-steps", type=int, default=10)
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.time_batches:
        with stand_in(args):
            rig, real = build(args)
            sizes = [int(b) for b in args.time_batches.split(",")]
            for row in time_steps(rig, sizes, args.image_size, args.time_steps, args.device):
                print(
                    "timed: " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                )
            if real:
                ms = time_batches(rig, real, args.time_steps, args.device)
                print(f"timed: facemask batches ({len(real)} of batch {args.batch}) ms_per_step={ms:.2f}")
        del rig
    results = measure(args)
    for name, r in results.items():
        print(
            f"{name}: {r['ms_per_step']:.0f} ms/step, host syncs {r['host_syncs']:.1f} "
            f"({', '.join(f'{k} {v:.1f}' for k, v in {**r['syncs'], **r['host_copies']}.items())}), "
            f"ATen calls {r['aten_calls']:.0f}"
            + (
                f" (in the graphs {r['captured_aten_calls']:.0f}, eager {r['eager_aten_calls']:.0f})"
                if args.cuda_graphs
                else ""
            )
            + f", matcher {100 * r['matcher_share']:.1f} % of wall"
            + (
                f", cudaStreamSynchronize {r['cuda_syncs']:.0f}, kernel launches {r['kernel_launches']:.0f}"
                if "cuda_syncs" in r
                else ""
            )
        )
        print("  top ATen calls per step: " + ", ".join(f"{k} {c:.0f}" for c, k in r["top"]))
        if "gpu_kernel_ms" in r:
            print(
                f"  GPU kernel time {r['gpu_kernel_ms']:.1f} ms of {r['ms_per_step']:.1f} ms wall per step; top: "
                + "; ".join(f"{k[:60]} {ms:.2f} ms" for ms, k in r["top_kernels"])
            )
    syncs = max(r["host_syncs"] for r in results.values())
    aten = max(r["aten_calls"] for r in results.values())
    print(f"host_syncs_per_step={syncs:g} aten_calls_per_step={aten:.0f}")


if __name__ == "__main__":
    main()
