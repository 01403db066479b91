"""Predicted vs measured peak memory of the trainer's step (trainer/planning/memory.py vs the real thing). Goal: +-10 %.

GPU (the default cases: ResNet-50 at batch 64, 128, 256 and ConvNeXt-Tiny at 64, 128; 224 px, bf16 autocast,
SGD momentum, channels_last): the prediction runs on the CPU under FakeTensorMode; the measurement runs the same
step on the GPU (warm-up step, ``reset_peak_memory_stats``, one step and one evaluation forward at 2 x batch,
``max_memory_allocated`` / ``max_memory_reserved``). Reserved is predicted by the caching-allocator model
(trainer/planning/allocator.py). Also prints the CUDA context per GPU model that the planner adds (catalog
``GpuModel.cuda_context_mib``, measured or assumed) and, on a GPU, the context measured on it (``mem_get_info``
used minus ``memory_reserved``) beside the catalog's figure for that GPU model.

    PYTHONPATH=. python benchmarks/memory_prediction.py --device cuda

CPU (proves the script here; fp32, torch's CPU allocator peak read through the profiler, no evaluation pass):

    PYTHONPATH=. python benchmarks/memory_prediction.py --device cpu --cases resnet18:16,64 --image-size 64 \
        --precision 32

Other tasks: ``--config`` gives the task and its section (e.g. DINO's), ``--image-size 0`` the task's own largest
input (detection: max_scale x max_size), ``--num-outputs`` the classes; ``--predict-only`` prints the prediction
the GPU run would print (evaluation at 2 x batch, our CUDA ops' allocations) where the step cannot be measured
(DINO R50 at 800 x 1333 without a GPU; ResNet-50 as ``--device cuda`` runs it: ``--device cpu --predict-only``):

    PYTHONPATH=. python benchmarks/memory_prediction.py --config configs/seed000_dino_floorplans.yaml \
        --cases resnet50:2 --image-size 0 --num-outputs 2 --precision 32 --predict-only
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import catalog
from trainer.config import load_config
from trainer.engine.precision import resolve_precision
from trainer.engine.step import build_single_rank_step
from trainer.planning.allocator import MIB
from trainer.planning.memory import predict_step_memory
from trainer.planning.plan import gpu_model_of
from trainer.planning.step_probe import cpu_step_peak_bytes

DEFAULT_CASES = "resnet50:64,128,256;convnext_tiny:64,128"


def measure(cfg, batch: int, size: int, device: torch.device, num_outputs: int) -> tuple[int, int, int]:
    """(peak allocated, peak reserved, context) bytes of one step (+ eval forward on CUDA) at ``batch``."""
    torch.manual_seed(0)
    rig = build_single_rank_step(cfg, device, num_outputs)
    x = rig.example_batch(batch, size)
    rig.step(x)
    if device.type == "cpu":
        return cpu_step_peak_bytes(rig, x), 0, 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rig.step(x)
    del x
    xe = rig.example_batch(2 * batch, size, train=False)
    rig.eval_forward(xe)
    del xe
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out = (
        torch.cuda.max_memory_allocated(),
        torch.cuda.max_memory_reserved(),
        total - free - torch.cuda.memory_reserved(),
    )
    del rig
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--cases", default=DEFAULT_CASES, help="model:batch,batch;model:batch,... (torchvision names)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--precision", default="bf16-mixed", help="trainer precision: bf16-mixed | 16-mixed | 32")
    p.add_argument("--config", default=None, help="YAML config (task, its section); --cases sets the model")
    p.add_argument("--num-outputs", type=int, default=1000, help="classes of the head")
    p.add_argument("--predict-only", action="store_true", help="skip the measurement")
    a = p.parse_args()
    device = torch.device(a.device)
    print(
        "| model | px | batch | precision | predicted allocated (MiB) | measured allocated (MiB) | error | "
        "predicted reserved (MiB) | measured reserved (MiB) | error | predict s |"
    )
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    contexts = []
    for case in a.cases.split(";"):
        model, batches = case.split(":")
        over = {"model": model, "precision": a.precision, "device": a.device}
        if a.image_size:
            over["image_size"] = a.image_size
        cfg = load_config(a.config, over)
        size = a.image_size or None
        prec = resolve_precision(cfg.precision, device)
        for b in (int(x) for x in batches.split(",")):
            t0 = time.perf_counter()
            pred = predict_step_memory(
                cfg,
                b,
                num_outputs=a.num_outputs,
                image_size=size,
                precision=prec,
                context_bytes=0,
                eval_batch=2 * b if device.type == "cuda" or a.predict_only else 1,  # as the GPU run does
                cuda_kernels=device.type == "cuda" or a.predict_only,  # a CPU measurement runs the references
            )
            secs = time.perf_counter() - t0
            px = "x".join(str(d) for d in pred.input_size)
            if a.predict_only:
                print(
                    f"| {model} | {px} | {b} | {prec.name} | {pred.allocated_peak_bytes / MIB:,.0f} | - | - | "
                    f"{pred.reserved_peak_bytes / MIB:,.0f} | - | - | {secs:.1f} |",
                    flush=True,
                )
                continue
            alloc, reserved, ctx = measure(cfg, b, size, device, a.num_outputs)
            contexts.append(ctx)
            err_a = 100 * (pred.allocated_peak_bytes / alloc - 1)
            err_r = f"{100 * (pred.reserved_peak_bytes / reserved - 1):+.1f} %" if reserved else "-"
            print(
                f"| {model} | {px} | {b} | {prec.name} | {pred.allocated_peak_bytes / MIB:,.0f} | "
                f"{alloc / MIB:,.0f} | {err_a:+.1f} % | {pred.reserved_peak_bytes / MIB:,.0f} | "
                f"{f'{reserved / MIB:,.0f}' if reserved else '-'} | {err_r} | {secs:.1f} |",
                flush=True,
            )
    print("\n| GPU model | CUDA context the planner adds (MiB) | source |")
    print("| --- | ---: | --- |")
    for g in catalog.GPU_MODELS.values():
        print(f"| {g.name} | {g.cuda_context_mib:,} | {g.cuda_context_source} |")
    if device.type == "cuda" and contexts:
        name = torch.cuda.get_device_name()
        known = catalog.GPU_MODELS.get(gpu_model_of(name) or "")
        print(
            f"\nCUDA context + library handles measured on {name}: {max(contexts) / MIB:,.0f} MiB "
            "(mem_get_info used - memory_reserved); catalog: "
            + (f"{known.cuda_context_mib:,} MiB ({known.cuda_context_source})" if known else "no entry for this GPU")
        )


if __name__ == "__main__":
    main()
