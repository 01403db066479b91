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
* Host RAM (:func:`trainer.planning.host_ram.predict_host_ram`): K x per-job RAM (process RSS, dataset held per
  process, loader, pinned batches) must stay <= host RAM x (1 - margin), else ERROR; the page cache the jobs
  share (counted once, evictable) only warns when it does not fit in what is left.
* vCPUs: busy processes = K x processes per job x (1 main + num_workers) (a decoding loader is CPU-bound, so its
  workers are busy whenever the GPU could go faster) must stay <= vCPUs - :data:`HOST_RESERVED_VCPUS`, else ERROR.
* With K = 1 the host figures are reported and only warn (the plan of one job is unchanged).
* Time, images/s and epoch are per job (the K jobs run at once); run cost is the instance's for that time,
  i.e. for all K jobs (``run_usd_per_job_on_demand`` divides it by K).

Errors (:class:`PlanError`, exit 2): unknown instance type, batch larger than the dataset, missing or corrupt
probe report, bad option values.

This module holds the options, the inputs (probe report, dataset size and bytes), the plan and its Markdown; the
rows themselves (memory, throughput, job layout, host checks, cost, ranking) are computed in
:mod:`trainer.planning.instance_rows`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

import catalog
from trainer.config import TrainConfig
from trainer.planning.host_ram import GIB
from trainer.planning.instance_rows import (  # noqa: F401 - gpu_model_of re-exported: its old home
    _Inputs,
    gpu_model_of,
    plan_rows,
)
from trainer.planning.memory import predict_step_memory
from trainer.planning.options import PlanError, PlanOptions


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
