"""``python -m trainer plan``: rank the catalog's instance types for a config and a number of epochs.

Per instance type (facts and prices from :mod:`catalog`, the one copy):

* processes per host = the catalog's GPU count (``InstanceType.processes_per_host``); ``--nproc-per-node`` is
  checked against it (seed 000 starts 2 processes on ml.g5.2xlarge, which has 1 GPU);
* micro-batch per GPU = ``batch_size / (processes x accumulate_grad_batches)``, which must be whole;
* memory per GPU: measured by a CUDA probe report at that batch when one exists for the same GPU model, else
  predicted (:func:`trainer.planning.memory.predict_step_memory`: reserved peak + DDP buckets, plus the CUDA
  context of the row's GPU, catalog ``GpuModel.cuda_context_mib``, measured or assumed as it says), else
  ``--model-memory-gib``; ``memory_fits`` when <= the catalog's ``gpu_memory_mib`` x (1 - margin); a row
  ``fits`` only when its memory fits and it has no error (process count, batch divisibility, GPU);
* images/s per GPU, in order of preference: a CUDA probe report's measured images/s at its best batch, or
  ``--images-per-second`` measured on ``--throughput-gpu``, scaled by the catalog's ``relative_throughput``;
  otherwise :data:`REFERENCE_IMAGES_PER_S` (ResNet-50, A100) x relative throughput x the FLOP ratio of
  ResNet-50 at 224 px to this model at its size (``torch.utils.flop_counter.FlopCounterMode``, fake tensors),
  an estimate, said so in every row;
* host images/s = per GPU x processes x ``--scaling-efficiency`` (when processes > 1);
* epoch time = dataset images / host images/s; run hours = epochs x epoch time (evaluation, start-up and
  checkpoint time excluded); cost = hours x on-demand or spot USD/hour.

Parallel jobs (``--jobs-per-instance K``, default 1): K independent training jobs share one instance.

* K <= GPUs: each job gets ``gpus // K`` GPUs (its processes; the global batch must split over them; GPUs left
  over are a warning). K > GPUs: the jobs share the GPUs time-sliced, ``ceil(K / gpus)`` jobs on a GPU, each
  with its own CUDA context: memory per GPU = that many x one job's need, images/s per job = the GPU's / that many.
* Host RAM (:func:`trainer.planning.memory.predict_host_ram`): K x per-job RAM (process RSS, dataset held per
  process, loader, pinned batches) must stay <= host RAM x (1 - margin), else ERROR; the page cache the jobs
  share (counted once, evictable) only warns when it does not fit in what is left.
* vCPUs: busy processes = K x processes per job x (1 main + num_workers) (a decoding loader is CPU-bound, so its
  workers are busy whenever the GPU could go faster) must stay <= vCPUs - :data:`HOST_RESERVED_VCPUS`, else ERROR.
* With K = 1 the host figures are reported and only warn (the plan of one job is unchanged).
* Time, images/s and epoch are per job (the K jobs run at once); run cost is the instance's for that time,
  i.e. for all K jobs (``run_usd_per_job_on_demand`` divides it by K).

Errors (:class:`PlanError`, exit 2): unknown instance type, batch larger than the dataset, missing or corrupt
probe report, bad option values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import catalog
from catalog import REFERENCE_GPU, REFERENCE_IMAGES_PER_S
from trainer.config import TrainConfig
from trainer.planning.memory import (
    GIB,
    HOST_RESERVED_VCPUS,
    MIB,
    predict_host_ram,
    predict_loader_ram,
    predict_step_memory,
    target_precision,
)
from trainer.tasks import task_class


class PlanError(ValueError):
    """The plan cannot be made (unknown type, impossible batch, unusable probe report); one-line message."""


@dataclass
class PlanOptions:
    """Flags of ``plan`` that are not training fields (the number of epochs is the config's ``epochs``)."""

    probe_report: Optional[str] = None
    prices: Optional[str] = None
    platform: Optional[str] = None
    instances: tuple = ()
    nproc_per_node: Optional[int] = None
    margin: float = 0.10
    dataset_size: Optional[int] = None
    num_classes: Optional[int] = None
    model_memory_gib: Optional[float] = None
    images_per_second: Optional[float] = None
    throughput_gpu: str = REFERENCE_GPU
    scaling_efficiency: float = 0.9
    jobs_per_instance: int = 1
    out: Optional[str] = None

    def validate(self) -> PlanOptions:
        """Raise PlanError naming the first bad option."""
        if self.platform not in (None, "ec2", "sagemaker"):
            raise PlanError(f"--platform: got {self.platform!r}; allowed: ec2, sagemaker")
        if not 0 <= self.margin < 1:
            raise PlanError(f"--margin: got {self.margin}; must be in [0, 1)")
        if not 0 < self.scaling_efficiency <= 1:
            raise PlanError(f"--scaling-efficiency: got {self.scaling_efficiency}; must be in (0, 1]")
        if not isinstance(self.jobs_per_instance, int) or self.jobs_per_instance < 1:
            raise PlanError(f"--jobs-per-instance: got {self.jobs_per_instance}; must be an integer >= 1")
        for name in ("nproc_per_node", "dataset_size", "num_classes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise PlanError(f"--{name.replace('_', '-')}: got {v}; must be >= 1")
        for name in ("model_memory_gib", "images_per_second"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise PlanError(f"--{name.replace('_', '-')}: got {v}; must be a number > 0")
        if self.throughput_gpu not in catalog.GPU_MODELS:
            raise PlanError(
                f"--throughput-gpu: unknown GPU {self.throughput_gpu!r}; catalog GPUs: " + ", ".join(catalog.GPU_MODELS)
            )
        return self


def load_probe(path: str | Path) -> dict:
    """Read a ``probe.json``. Raises PlanError when missing, not JSON or without the probe's keys."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"probe report {p} does not exist (run: python -m trainer probe --config ...)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"probe report {p} is not a readable JSON file: {e}") from None
    need = ("device", "device_name", "measurements", "best_batch", "best_images_per_s", "image_size", "config")
    if not isinstance(data, dict) or any(k not in data for k in need):
        raise PlanError(f"probe report {p} lacks the probe's keys ({', '.join(need)}); was it written by probe?")
    return data


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
    """One dict per instance type (see module doc); sorted: fitting types first, then by on-demand run cost."""
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
    a warning when the shared page cache does not fit in what is left (see module doc)."""
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


def _dataset(cfg: TrainConfig, opts: PlanOptions, task=None) -> tuple[int, int, str, object]:
    """(training images per epoch, classes, source, the built TaskData or None): from the options, else by
    scanning ``cfg.data_dir`` with ``task`` (default: a fresh one)."""
    if opts.dataset_size is not None:
        return opts.dataset_size, opts.num_classes or 1000, "--dataset-size", None
    from trainer.engine.distributed import DistInfo
    from trainer.errors import DataError
    from trainer.tasks import build_task

    try:
        data = (task or build_task(cfg, DistInfo(0, 0, 1, torch.device("cpu")))).build_data()
    except DataError as e:
        raise PlanError(f"cannot count the training images ({e}); give --dataset-size") from None
    return len(data.train), opts.num_classes or data.num_outputs, f"scanned {cfg.data_dir}", data


def _inputs(cfg: TrainConfig, opts: PlanOptions, predict: Callable) -> tuple[_Inputs, object]:
    """The plan's inputs for ``cfg`` (task, dataset size and bytes, probe report) and the built TaskData (or None).

    Raises PlanError, ConfigError as :func:`make_plan`."""
    probe = load_probe(opts.probe_report) if opts.probe_report else None
    from trainer.engine.distributed import DistInfo
    from trainer.tasks import build_task

    task = build_task(cfg, DistInfo(0, 0, 1, torch.device("cpu")))
    task.check_config()  # what train refuses is not planned (ConfigError)
    size, classes, size_source, data = _dataset(cfg, opts, task)
    if cfg.batch_size > size:
        raise PlanError(f"batch_size {cfg.batch_size} is larger than the dataset ({size} training images)")
    hw = task.input_size()
    sample_bytes = (int(task.loader_sample_bytes(True)), int(task.loader_sample_bytes(False)))
    data_bytes = tuple(int(b) for b in task.host_data_bytes(data, size))
    data_source = "Task.host_data_bytes" + (
        ""
        if data is not None
        else " (data not scanned: --dataset-size)"
        if not any(data_bytes)
        else " (estimated from --dataset-size and the config)"
    )
    inp = _Inputs(cfg, opts, size, classes, probe, predict, hw, sample_bytes, data_bytes, data_source, size_source)
    return inp, data


def make_plan(cfg: TrainConfig, opts: PlanOptions, predict: Callable = predict_step_memory) -> dict:
    """The plan as a dict: ``rows`` (see :func:`plan_rows`), ``flags`` (problems for the whole plan), inputs.

    Raises PlanError (unknown instance, impossible batch, bad probe report), CatalogError (price file) and
    ConfigError (a config the task refuses, as train would: :meth:`Task.check_config`).
    """
    opts.validate()
    cat = catalog.load_price_file(opts.prices) if opts.prices else catalog.INSTANCE_TYPES
    try:
        types = [catalog.get(n, cat) for n in opts.instances] if opts.instances else [cat[n] for n in sorted(cat)]
    except catalog.CatalogError as e:
        raise PlanError(str(e)) from None
    if opts.platform:
        types = [t for t in types if t.platform == opts.platform]
    if not types:
        raise PlanError(f"no instance types left to plan (platform {opts.platform}, instances {opts.instances})")
    inp, data = _inputs(cfg, opts, predict)
    size, hw, data_bytes, probe = inp.dataset_size, inp.input_size, inp.data_bytes, inp.probe
    rows = plan_rows(inp, types)
    flags = []
    if opts.jobs_per_instance > 1 and data is None and not any(data_bytes):
        flags.append(
            "host RAM counts no dataset bytes: the data was not scanned (--dataset-size); drop --dataset-size "
            "to let the task report what its dataset holds in RAM"
        )
    if not any(r["fits"] for r in rows) and opts.jobs_per_instance > 1:
        flags.append(
            f"none of the {len(rows)} types planned can run {opts.jobs_per_instance} jobs of global batch "
            f"{cfg.batch_size}: see the ERROR notes (host RAM or vCPUs: fewer jobs or num_workers; GPU memory: "
            "lower batch_size or raise accumulate_grad_batches)"
        )
    elif not any(r["fits"] for r in rows):
        flags.append(
            f"none of the {len(rows)} types planned can run global batch {cfg.batch_size}: see the "
            f"ERROR notes (memory: lower batch_size or raise accumulate_grad_batches)"
        )
    if probe and probe["device"] != "cuda":
        flags.append(
            f"probe report from a {probe['device']} run: its memory and images/s are not GPU figures; "
            "GPU memory is predicted and throughput estimated instead"
        )
    model = (
        f"external model (--model-memory-gib {opts.model_memory_gib}, not built)"
        if opts.model_memory_gib is not None
        else f"{cfg.task} {cfg.model} at {hw[0]}x{hw[1]} px"
    )
    return {
        "model": model,
        "image_size": list(hw),
        "batch_size": cfg.batch_size,
        "accumulate_grad_batches": cfg.accumulate_grad_batches,
        "epochs": cfg.epochs,
        "precision": cfg.precision,
        "dataset_size": size,
        "dataset_source": inp.dataset_source,
        "margin": opts.margin,
        "scaling_efficiency": opts.scaling_efficiency,
        "jobs_per_instance": opts.jobs_per_instance,
        "host_data_bytes": list(data_bytes),
        "probe_report": opts.probe_report,
        "prices": opts.prices or "catalog/__init__.py",
        "flags": flags,
        "rows": rows,
    }


def _num(v, fmt="{:,.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def _ram_parts(ram: dict) -> str:
    """One line of a host RAM prediction's components per process (GiB) and whether each is measured."""
    process = "measured" if ram["process_source"].startswith("measured") else "assumed"
    return (
        f"process {ram['process_bytes'] / GIB:.2f} ({process}) + dataset {ram['dataset_bytes'] / GIB:.2f} + "
        f"loader {ram['loader']['total_bytes'] / GIB:.2f} + idle eval workers {ram['idle_eval_workers_bytes'] / GIB:.2f} "
        f"+ pinned {ram['pinned_bytes'] / GIB:.2f} = {ram['per_process_bytes'] / GIB:.2f} GiB"
    )


def verdict(row: dict) -> str:
    """The ``fits`` cell of a plan row: ``yes`` only without any error; ``ERROR`` when something other than
    memory is wrong (wrong process count, indivisible batch, no GPU; the notes say what); ``no`` when only the
    memory is too small."""
    if row["fits"]:
        return "yes"
    memory_errors = 1 if "memory_per_gpu_gib" in row and not row["memory_fits"] else 0
    return "no" if len(row["errors"]) == memory_errors else "ERROR"


def render_plan(plan: dict) -> str:
    """Markdown: one header line of inputs, the ranked table (seed 004's comparison, computed), the flags.
    The ``fits`` column is :func:`verdict`: a row with an error never says ``yes``."""
    jobs = plan.get("jobs_per_instance", 1)
    head = (
        f"Plan: {plan['model']}, global batch {plan['batch_size']}, "
        f"{plan['epochs']} epochs of {plan['dataset_size']:,} images ({plan['dataset_source']}), precision "
        f"{plan['precision']}, margin {plan['margin']:.0%}, prices {plan['prices']}"
    )
    if jobs > 1:
        head += (
            f", {jobs} jobs per instance (procs, images/s and times per job; run $ for the instance, all "
            f"{jobs} jobs; host RAM and busy processes for all {jobs} jobs)"
        )
    host_cols = " host RAM GiB need / have | busy procs / vCPUs |" if jobs > 1 else ""
    lines = [
        head,
        "",
        "| # | instance | GPUs | procs | micro-batch | GiB/GPU need / have | fits |"
        + host_cols
        + " images/s | epoch (min) | run (h) | $/h on-demand | $/h spot | run $ on-demand | run $ spot | notes |",
        "| ---: | --- | --- | ---: | ---: | --- | --- |"
        + (" --- | --- |" if jobs > 1 else "")
        + " ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in plan["rows"]:
        host = ""
        if jobs > 1:
            ram = (
                f"{r['host_ram_need_gib']:.1f} / {r['memory_gib']:.1f}"
                + (
                    f" (+{r['host_ram']['page_cache_bytes'] / GIB:.1f} cache)"
                    if r["host_ram"]["page_cache_bytes"]
                    else ""
                )
                if "host_ram" in r
                else "-"
            )
            cpu = f"{r['busy_processes']} / {r['vcpus']}" if "busy_processes" in r else "-"
            host = f" {ram} | {cpu} |"
        gpus = f"{r['gpus']}x {r['gpu_model']}" if r["gpus"] else "-"
        need = f"{_num(r.get('memory_per_gpu_gib'))} / {r['gpu_memory_gib']:.2f}" if "memory_per_gpu_gib" in r else "-"
        notes = "; ".join(
            [f"ERROR: {e}" for e in r["errors"]]
            + r["warnings"]
            + [r.get("memory_source", ""), r.get("throughput_source", "")]
            + ([f"host RAM per process: {_ram_parts(r['host_ram'])}"] if jobs > 1 and "host_ram" in r else [])
        )
        spot = _num(r["spot_usd_per_hour"], "{:.3f}") + ("*" if r["spot_is_estimate"] else "")
        lines.append(
            f"| {r['rank']} | {r['instance']} | {gpus} | {r.get('processes_per_host', '-')} | "
            f"{r.get('micro_batch', '-')} | {need} | {verdict(r)} |{host} "
            f"{_num(r.get('images_per_s'), '{:,.0f}')} | {_num(r.get('epoch_min'), '{:,.1f}')} | "
            f"{_num(r.get('run_hours'))} | {r['on_demand_usd_per_hour']:.3f} | {spot} | "
            f"{_num(r.get('run_usd_on_demand'))} | {_num(r.get('run_usd_spot'))} | {notes.strip('; ')} |"
        )
    lines += [
        "",
        f"\\* spot price is an estimate ({catalog.SPOT_FRACTION_ESTIMATE * 100:.0f} % of on-demand, "
        "catalog/__init__.py). Run time excludes evaluation, start-up and checkpoint writes.",
    ]
    lines += [f"FLAG: {f}" for f in plan["flags"]]
    return "\n".join(lines) + "\n"
