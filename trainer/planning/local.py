"""This machine as a plan row: how many single-process jobs of a config fit here side by side (``python -m
trainer sweep``'s K), through the same GPU-memory, host-RAM and vCPU checks as ``plan --jobs-per-instance``
(:mod:`trainer.planning.plan`, :mod:`trainer.planning.instance_rows`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import catalog
from trainer.config import TrainConfig
from trainer.planning.host_ram import MIB
from trainer.planning.instance_rows import _host_checks, _Inputs, gpu_model_of, plan_rows
from trainer.planning.memory import predict_step_memory
from trainer.planning.options import PlanError, PlanOptions
from trainer.planning.plan import _inputs


@dataclass(frozen=True)
class LocalMachine(catalog.InstanceType):
    """The machine this process runs on, as an instance type the plan's checks take (:func:`plan_rows`,
    :func:`_host_checks`); ``gpu_facts`` are the catalog's facts of its GPU model, or assumed ones for a GPU the
    catalog lacks (``relative_throughput`` 1.0, the catalog's assumed 800 MiB CUDA context). ``ram_source``
    says what ``memory_mib`` is."""

    gpu_facts: Optional[catalog.GpuModel] = None
    ram_source: str = ""

    @property
    def gpu(self) -> Optional[catalog.GpuModel]:
        """The GPU's facts (not looked up by name: a local GPU need not be in the catalog), or None."""
        return self.gpu_facts


def _available_ram_mib() -> tuple[int, str]:
    """Host RAM free for new processes now, in MiB, and its source: ``MemAvailable`` of ``/proc/meminfo`` (the
    kernel's estimate of memory available without swapping, page cache included), else physical RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024, "MemAvailable of /proc/meminfo (free now, not total)"
    except OSError:
        pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // MIB), "physical RAM (os.sysconf; /proc/meminfo unreadable)"


def local_machine() -> LocalMachine:
    """This machine's vCPUs (``os.sched_getaffinity``: the CPUs this process may run on), host RAM available now
    (:func:`_available_ram_mib`) and CUDA GPUs (``torch.cuda``: count, first GPU's name and total memory)."""
    vcpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ram_mib, ram_source = _available_ram_mib()
    gpus, model, gpu_mib, facts = 0, None, 0, None
    if torch.cuda.is_available() and torch.cuda.device_count():
        gpus = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        model = gpu_model_of(props.name) or props.name
        gpu_mib = int(props.total_memory // MIB)
        facts = catalog.GPU_MODELS.get(model) or catalog.GpuModel(
            props.name, f"{props.major}.{props.minor}", torch.cuda.is_bf16_supported(), 1.0, 800, False
        )
    price = catalog.Price(0.0, "-", "this machine (no price)")
    return LocalMachine(
        "this machine", vcpus, ram_mib, gpus, model, gpu_mib, "-", 0.0, False, 0, 0, price, price, facts, ram_source
    )


def local_jobs_row(inp: _Inputs, machine: LocalMachine, jobs: int) -> dict:
    """The plan's row for ``jobs`` single-process jobs side by side on ``machine``: with GPUs, :func:`plan_rows`
    on ``min(gpus, jobs)`` of them (one process per job: a GPU each, or time-sliced when jobs > GPUs), so GPU
    memory, host RAM and vCPUs are checked exactly as for ``plan --jobs-per-instance``; without a GPU, the same
    host RAM and vCPU checks (:func:`_host_checks`, CPU processes). ``row["fits"]`` says whether they fit."""
    import dataclasses

    opts = dataclasses.replace(inp.opts, jobs_per_instance=jobs, nproc_per_node=None)
    inp = dataclasses.replace(inp, opts=opts)
    if machine.gpus:
        return plan_rows(inp, [dataclasses.replace(machine, gpus=min(machine.gpus, jobs))])[0]
    cfg = inp.cfg
    row = {"instance": machine.name, "gpus": 0, "vcpus": machine.vcpus, "memory_gib": machine.memory_gib}
    row.update(errors=[], warnings=[], jobs_per_instance=jobs, processes_per_job=1)
    if cfg.batch_size % cfg.accumulate_grad_batches:
        row["errors"].append(
            f"global batch {cfg.batch_size} is not divisible by {cfg.accumulate_grad_batches} accumulation"
        )
    else:
        _host_checks(inp, machine, row, cfg.batch_size // cfg.accumulate_grad_batches, 1, jobs)
    row["fits"] = not row["errors"]
    return row


def max_local_jobs(
    cfg: TrainConfig,
    limit: int,
    probe_report: Optional[str] = None,
    margin: float = 0.10,
    machine: Optional[LocalMachine] = None,
) -> tuple[int, list[dict]]:
    """The largest K in ``1..limit`` such that K jobs of ``cfg`` fit on this machine (:func:`local_jobs_row`
    for K = 1, 2, ... until one does not fit), and the rows checked (the last one is the first that does not fit,
    unless K = ``limit``). K = 1 always counts as fitting: one job is what ``train`` runs; its row's warnings
    say what is short. ``machine`` defaults to :func:`local_machine`; ``probe_report`` is a ``probe.json`` whose
    measured process RSS replaces the assumed one (:func:`trainer.planning.host_ram.process_host_bytes`).

    Raises PlanError / ConfigError as :func:`make_plan` (the dataset is scanned once)."""
    if limit < 1:
        raise PlanError(f"jobs: got {limit}; must be >= 1")
    machine = machine or local_machine()
    opts = PlanOptions(probe_report=probe_report, margin=margin).validate()
    inp, _ = _inputs(cfg, opts, predict_step_memory)
    rows, best = [], 1
    for k in range(1, limit + 1):
        row = local_jobs_row(inp, machine, k)
        rows.append(row)
        if k > 1 and not row["fits"]:
            break
        best = k
    return best, rows
