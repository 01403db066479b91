"""One row of ``python -m trainer plan`` per instance type: a config's memory per GPU, images/s, job layout
(``--jobs-per-instance``), host RAM and vCPUs, epoch time and run cost on that type, and the ranking of the rows
(:func:`plan_rows`). How each figure is found is described in :mod:`trainer.planning.plan`, which gathers the
inputs (:class:`_Inputs`) and renders the plan; :mod:`trainer.planning.local` runs the same checks on this
machine (``sweep``'s K).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

import catalog
from catalog import REFERENCE_GPU, REFERENCE_IMAGES_PER_S
from trainer.config import TrainConfig
from trainer.planning.host_ram import GIB, HOST_RESERVED_VCPUS, MIB, predict_host_ram, predict_loader_ram
from trainer.planning.memory import target_precision
from trainer.tasks import task_class

if TYPE_CHECKING:
    from trainer.planning.options import PlanOptions


def gpu_model_of(device_name: str) -> Optional[str]:
    """Catalog GPU model named in a CUDA device name (``"NVIDIA A10G"`` -> ``"A10G"``), or None."""
    return next((g for g in sorted(catalog.GPU_MODELS, key=len, reverse=True) if g in device_name), None)


def model_gflops(cfg: TrainConfig, image_size: Optional[int], num_outputs: int) -> float:
    """Forward GFLOPs of one sample through ``cfg.model`` at ``image_size`` (None: the task's evaluation
    :meth:`~trainer.tasks.base.Task.input_size`): the task's predict on its example batch of one
    (FlopCounterMode on fake tensors, so no memory and no weights)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.engine.distributed import DistInfo
    from trainer.tasks import build_task

    task = build_task(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = task.build_model(num_outputs).eval().requires_grad_(False)  # no autograd hooks from the counter
        batch = task.example_batch(1, image_size=image_size, num_outputs=num_outputs, train=False)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            task.predict(model, batch)
    return counter.get_total_flops() / 1e9


@dataclass
class _Inputs:
    cfg: TrainConfig
    opts: PlanOptions
    dataset_size: int
    num_outputs: int
    probe: Optional[dict]
    predict: Callable = field(repr=False, default=None)
    input_size: tuple[int, int] = (224, 224)  # (H, W) of the largest training image (Task.input_size)
    sample_bytes: tuple[int, int] = (0, 0)  # Task.loader_sample_bytes(train=True), (train=False); 0: 3 x H x W
    data_bytes: tuple[int, int] = (0, 0)  # Task.host_data_bytes(data): (per process, per host)
    data_source: str = "Task.host_data_bytes"
    dataset_source: str = ""  # where dataset_size comes from (--dataset-size or the scanned data_dir)


def _throughput(inp: _Inputs, gpu: catalog.GpuModel, cache: dict) -> tuple[Optional[float], str]:
    """Images/s per GPU of this model on ``gpu`` and where the figure comes from."""
    probe, opts = inp.probe, inp.opts
    probe_gpu = gpu_model_of(probe["device_name"]) if probe and probe["device"] == "cuda" else None
    if probe_gpu and probe.get("best_images_per_s"):
        base = catalog.GPU_MODELS[probe_gpu]
        return (
            probe["best_images_per_s"] * gpu.relative_throughput / base.relative_throughput,
            f"probe on {probe['device_name']} x relative throughput",
        )
    if opts.images_per_second:
        base = catalog.GPU_MODELS[opts.throughput_gpu]
        return (
            opts.images_per_second * gpu.relative_throughput / base.relative_throughput,
            f"--images-per-second on {opts.throughput_gpu} x relative throughput",
        )
    if opts.model_memory_gib is not None:
        return None, "unknown: give --images-per-second or --probe-report"
    if not task_class(inp.cfg.task).flops_predict_speed:
        return None, f"unknown: {inp.cfg.task} speed does not follow FLOPs; give --images-per-second or --probe-report"
    if "ratio" not in cache:
        ref = TrainConfig(model="resnet50")
        cache["ratio"] = model_gflops(ref, 224, 1000) / model_gflops(inp.cfg, None, inp.num_outputs)
    ref = catalog.GPU_MODELS[REFERENCE_GPU]
    return (
        REFERENCE_IMAGES_PER_S * gpu.relative_throughput / ref.relative_throughput * cache["ratio"],
        "estimate: catalog relative throughput x ResNet-50 reference x FLOP ratio (no probe)",
    )


def _memory(inp: _Inputs, it: catalog.InstanceType, micro: int, procs: int, cache: dict) -> tuple[float, str]:
    """Bytes per GPU needed at ``micro`` images per forward, and the source."""
    if inp.opts.model_memory_gib is not None:
        return inp.opts.model_memory_gib * GIB, "--model-memory-gib"
    probe = inp.probe
    if probe and probe["device"] == "cuda" and gpu_model_of(probe["device_name"]) == it.gpu_model:
        m = next((m for m in probe["measurements"] if m["batch"] == micro), None)
        if m is not None and not m["oom"]:
            return float(max(m["reserved_bytes"], m["peak_bytes"])), f"probe (measured at batch {micro})"
    prec = target_precision(inp.cfg, it.gpu.bf16)
    key = (micro, prec.name, procs > 1)
    if key not in cache:
        cache[key] = inp.predict(
            inp.cfg, micro, num_outputs=inp.num_outputs, gpu_bf16=it.gpu.bf16, world_size=procs, context_bytes=0
        )
    need = cache[key].total_bytes - cache[key].cuda_context_bytes + it.gpu.cuda_context_bytes
    return float(need), f"predicted ({prec.name}, trainer/planning/memory.py)"


def plan_rows(inp: _Inputs, types: list[catalog.InstanceType]) -> list[dict]:
    """One dict per instance type (see :mod:`trainer.planning.plan`); sorted: fitting types first, then by
    on-demand run cost."""
    cfg, opts = inp.cfg, inp.opts
    mem_cache, tp_cache, rows = {}, {}, []
    for it in types:
        row = {
            "instance": it.name,
            "platform": it.platform,
            "gpus": it.gpus,
            "gpu_model": it.gpu_model,
            "gpu_memory_gib": round(it.gpu_memory_gib, 2),
            "vcpus": it.vcpus,
            "memory_gib": it.memory_gib,
            "on_demand_usd_per_hour": it.on_demand.usd_per_hour,
            "spot_usd_per_hour": it.spot.usd_per_hour,
            "spot_is_estimate": it.spot.estimate,
            "errors": [],
            "warnings": [],
            "memory_fits": False,
            "fits": False,
        }
        rows.append(row)
        if it.gpu is None:
            row["errors"].append("no GPU (CPU-only type)")
            continue
        jobs = opts.jobs_per_instance
        procs, share = _job_layout(it, jobs)  # processes per job, jobs per GPU
        row["processes_per_host"] = procs
        if jobs > 1:
            row.update(jobs_per_instance=jobs, processes_per_job=procs, jobs_per_gpu=share)
            if share > 1:
                row["warnings"].append(
                    f"{jobs} jobs time-slice {it.gpus} GPU(s) ({share} per GPU): GPU memory x {share}, images/s "
                    f"per job / {share} (context switches make this an upper bound)"
                )
            elif it.gpus % jobs:
                row["warnings"].append(f"{jobs} jobs x {procs} GPU(s) leave {it.gpus % jobs} GPU(s) idle")
            if jobs % it.gpus and share > 1:
                row["warnings"].append(f"{jobs} jobs do not spread evenly over {it.gpus} GPUs")
        issue = _check_nproc(it, opts.nproc_per_node, procs, jobs) if opts.nproc_per_node else None
        if issue:
            row["errors" if issue[0] == "error" else "warnings"].append(issue[1])
        denom = procs * cfg.accumulate_grad_batches
        if cfg.batch_size % denom:
            row["errors"].append(
                f"global batch {cfg.batch_size} is not divisible by {procs} processes"
                + (" per job" if jobs > 1 else "")
                + f" x {cfg.accumulate_grad_batches} accumulation"
            )
            continue
        micro = cfg.batch_size // denom
        row["micro_batch"] = micro
        need, row["memory_source"] = _memory(inp, it, micro, procs, mem_cache)
        if row["memory_source"].startswith("predicted"):
            row.update(cuda_context_mib=it.gpu.cuda_context_mib, cuda_context_source=it.gpu.cuda_context_source)
        if share > 1:
            need *= share
            row["memory_source"] += f" x {share} jobs per GPU (a CUDA context each)"
        have = it.gpu_memory_mib * MIB
        row["memory_per_gpu_gib"] = need / GIB
        row["headroom_pct"] = round(100 * (1 - need / have), 1)
        row["memory_fits"] = need <= have * (1 - opts.margin)
        if not row["memory_fits"]:
            row["errors"].append(
                f"needs {need / GIB:.1f} GiB per GPU, has {have / GIB:.1f} GiB minus "
                f"{opts.margin:.0%} margin: lower batch_size or raise accumulate_grad_batches"
            )
        if jobs == 1:  # the single-job checks, as before --jobs-per-instance
            ram = predict_loader_ram(
                micro,
                inp.input_size,
                cfg.num_workers,
                cfg.prefetch_factor,
                bytes_per_sample=inp.sample_bytes[0] or None,
            )
            if procs * ram.total_bytes > it.memory_mib * MIB * (1 - opts.margin):
                row["warnings"].append(f"loader RAM {procs * ram.total_bytes / GIB:.1f} GiB > host RAM minus margin")
            if procs * cfg.num_workers > it.vcpus:
                row["warnings"].append(
                    f"{procs} x num_workers {cfg.num_workers} = {procs * cfg.num_workers} loader "
                    f"processes on {it.vcpus} vCPUs"
                )
        _host_checks(inp, it, row, micro, procs, jobs)
        per_gpu, row["throughput_source"] = _throughput(inp, it.gpu, tp_cache)
        if per_gpu is None:
            continue
        host = per_gpu * procs * (opts.scaling_efficiency if procs > 1 else 1.0) / share
        if share > 1:
            row["throughput_source"] += f" / {share} jobs per GPU (time-sliced)"
        epoch_s = inp.dataset_size / host
        hours = cfg.epochs * epoch_s / 3600
        row.update(
            images_per_s=host,
            epoch_min=epoch_s / 60,
            run_hours=hours,
            run_usd_on_demand=hours * it.on_demand.usd_per_hour,
            run_usd_spot=hours * it.spot.usd_per_hour,
        )
        if jobs > 1:
            row["run_usd_per_job_on_demand"] = row["run_usd_on_demand"] / jobs
    for r in rows:
        r["fits"] = r["memory_fits"] and not r["errors"]
    rows.sort(
        key=lambda r: (
            bool(r["errors"]),
            not r["memory_fits"],
            r.get("run_usd_on_demand", math.inf),
            r["on_demand_usd_per_hour"],
            r["instance"],
        )
    )
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows


def _job_layout(it: catalog.InstanceType, jobs: int) -> tuple[int, int]:
    """(processes per job, jobs per GPU) for ``jobs`` jobs on ``it``: K <= GPUs: ``gpus // K`` GPUs each, one job
    per GPU; K > GPUs: one process per job, ``ceil(K / gpus)`` jobs time-slicing the busiest GPU."""
    if jobs <= it.gpus:
        return it.gpus // jobs, 1
    return 1, -(-jobs // it.gpus)


def _check_nproc(it: catalog.InstanceType, nproc: int, procs: int, jobs: int) -> Optional[tuple[str, str]]:
    """``--nproc-per-node`` against the processes of one job (K = 1: the catalog's check, unchanged)."""
    if jobs == 1:
        return catalog.check_processes_per_host(it, nproc)
    if nproc > procs:
        return "error", (
            f"--nproc-per-node {nproc} with --jobs-per-instance {jobs} on {it.name} ({it.gpus} GPU(s)): each job "
            f"has {procs} GPU(s); use {procs}"
        )
    if nproc < procs:
        return "warning", f"--nproc-per-node {nproc} leaves {procs - nproc} GPU(s) of each job idle; use {procs}"
    return None


def _host_checks(inp: _Inputs, it: catalog.InstanceType, row: dict, micro: int, procs: int, jobs: int) -> None:
    """Host RAM and vCPUs of ``jobs`` jobs on ``it`` into ``row``: ERROR (K > 1) when they exhaust the host,
    a warning when the shared page cache does not fit in what is left (see :mod:`trainer.planning.plan`)."""
    cfg, opts = inp.cfg, inp.opts
    train_bytes = inp.sample_bytes[0] or 3 * inp.input_size[0] * inp.input_size[1]
    ram = predict_host_ram(
        micro_batch=micro,
        bytes_per_sample=train_bytes,
        eval_bytes_per_sample=inp.sample_bytes[1] or train_bytes,
        eval_batch=cfg.eval_batch_size or 2 * micro,
        num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor,
        jobs=jobs,
        processes_per_job=procs,
        device_type="cuda" if it.gpus else "cpu",  # catalog rows without a GPU stop before; a CPU-only machine
        pin_memory=cfg.pin_memory,
        persistent_workers=cfg.persistent_workers,
        dataset_bytes=inp.data_bytes,
        dataset_source=inp.data_source,
        probe=inp.probe,
    )
    have = it.memory_mib * MIB
    budget = have * (1 - opts.margin)
    busy = jobs * procs * (1 + cfg.num_workers)
    cores = it.vcpus - HOST_RESERVED_VCPUS
    row.update(
        host_ram=ram.to_dict(),
        host_ram_need_gib=ram.total_bytes / GIB,
        host_ram_with_page_cache_gib=ram.with_page_cache_bytes / GIB,
        busy_processes=busy,
        vcpus_for_jobs=cores,
        host_fits=ram.total_bytes <= budget and (jobs == 1 or busy <= cores),
    )
    kind = "errors" if jobs > 1 else "warnings"
    who = f"--jobs-per-instance {jobs}: " if jobs > 1 else ""
    loader_warned = any(w.startswith("loader RAM") for w in row["warnings"])
    if ram.total_bytes > budget and not (jobs == 1 and loader_warned):
        row[kind].append(
            f"{who}host RAM {ram.total_bytes / GIB:.1f} GiB ({jobs} x {ram.per_job_bytes / GIB:.2f} GiB per job) > "
            f"{have / GIB:.1f} GiB minus {opts.margin:.0%} margin"
        )
    elif ram.total_bytes <= budget and ram.page_cache_bytes and ram.with_page_cache_bytes > budget:
        row["warnings"].append(
            f"shared page cache {ram.page_cache_bytes / GIB:.1f} GiB does not fit beside the jobs' "
            f"{ram.total_bytes / GIB:.1f} GiB in {budget / GIB:.1f} GiB: data will be re-read from disk"
        )
    if jobs > 1 and busy > cores:
        row["errors"].append(
            f"{who}{busy} busy processes ({jobs} jobs x {procs} x (1 main + {cfg.num_workers} workers)) > "
            f"{it.vcpus} vCPUs - {HOST_RESERVED_VCPUS} reserved: lower the jobs or num_workers"
        )
