"""``python -m trainer probe``: measure, on the machine at hand, how large a batch fits and how fast it runs,
how fast the loader delivers, and whether the device would wait on data (seed 001's phases 1-3, automated).

Memory and speed per batch size, and the search for the largest batch that fits: :mod:`trainer.planning.step_probe`
(:func:`~trainer.planning.step_probe.measure_step`, :func:`~trainer.planning.step_probe.search_batch`).

Host RAM of the training process (both devices): the process's RSS high-water mark (``VmHWM`` of
``/proc/self/status``) after each batch size's timed steps (``rss_hwm_bytes``), and once after the whole batch
search, before the loader measurements (``host_rss_hwm_bytes``, next to ``host_data_bytes_per_process``: what the
dataset the process built holds, ``Task.host_data_bytes``). ``plan --jobs-per-instance`` takes the difference as
one training process's RSS on that device type (:func:`trainer.planning.host_ram.process_host_bytes`).

Loader (:func:`trainer.planning.loader_probe.measure_loader`): the task's real dataset through the trainer's ``build_loader`` for each
``num_workers`` x ``prefetch_factor``: images/s after the first batch, and host RAM as the peak summed private memory
(USS) of the worker processes (``/proc/<pid>/smaps_rollup``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from trainer.config import ConfigError, TrainConfig
from trainer.engine import distributed as dist
from trainer.engine.step import build_train_step
from trainer.planning.host_ram import GIB, predict_loader_ram
from trainer.planning.loader_probe import measure_loader, proc_kib
from trainer.planning.options import ProbeOptions
from trainer.planning.step_probe import StepMeasurement, measure_step, search_batch
from trainer.tasks import build_task


@dataclass
class ProbeResult:
    """Everything ``probe`` measured; written as JSON (bytes, seconds, images/s)."""

    config: dict
    precision: str
    device: str
    device_name: str
    image_size: str  # "H x W" pixels of the measured batches' images (Task.input_size)
    limit_bytes: float
    limit_source: str
    margin: float
    best_batch: Optional[int]
    best_images_per_s: Optional[float]
    measurements: list = field(default_factory=list)
    loader: list = field(default_factory=list)
    loader_ram_prediction: Optional[dict] = None
    host_rss_hwm_bytes: int = 0  # VmHWM of this process after the batch search (before the loader probes)
    host_data_bytes_per_process: int = 0  # Task.host_data_bytes(data)[0]: part of the RSS above
    host_data_bytes_per_host: int = 0  # Task.host_data_bytes(data)[1]: page cache shared by a host's processes
    gpu_waits_on_data: Optional[bool] = None
    decode_device: str = "cpu"  # where JPEGs were decoded (config decode_device)
    data_verdict: str = ""
    memory_method: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _device_limit(device: torch.device, opts: ProbeOptions) -> tuple[float, str]:
    if opts.memory_limit_gib is not None:
        return opts.memory_limit_gib * GIB, f"--memory-limit-gib {opts.memory_limit_gib}"
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1]), "torch.cuda.mem_get_info total"
    return proc_kib("/proc/meminfo", "MemAvailable") * 1024.0, "MemAvailable (/proc/meminfo)"


def run_probe(cfg: TrainConfig, opts: ProbeOptions, log: Callable[[str], None] = print) -> ProbeResult:
    """Measure memory/speed per batch size and the loader on this machine; return a :class:`ProbeResult`.

    Raises ConfigError / DataError (from the task) before anything is measured.
    """
    t_start = time.perf_counter()
    device = dist.resolve_device(cfg.device, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    limit, source = _device_limit(device, opts)
    if device.type == "cuda" and opts.memory_limit_gib is not None:
        total = torch.cuda.mem_get_info(device)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    task = build_task(cfg, dist.DistInfo(0, 0, 1, device))
    task.check_config()  # what train refuses is not probed (ConfigError)
    data = task.build_data()
    torch.manual_seed(cfg.seed)
    rig = build_train_step(cfg, task, task.build_model(data.num_outputs), device, num_outputs=data.num_outputs)
    size = None  # the task's largest training input
    shape = "x".join(str(d) for d in task.input_size())  # "224x224"
    log(
        f"probe: {cfg.model} at {shape} px on {device}, precision {rig.precision.name}, limit "
        f"{limit / GIB:.2f} GiB ({source}), margin {opts.margin:.0%}"
    )

    def measure(b: int) -> StepMeasurement:
        m = measure_step(rig, b, size, opts.steps, limit, opts.margin)
        log(
            f"probe: batch {b}: peak {m.peak_bytes / GIB:.3f} GiB, {m.images_per_s:.1f} images/s"
            + (" OOM" if m.oom else "")
            + ("" if m.fits else " (does not fit with margin)")
        )
        return m

    best, taken = search_batch(measure, opts.start_batch, opts.max_batch, opts.granularity)
    best_m = next((m for m in reversed(taken) if m.batch == best and m.fits), None)
    # before the loader probes (num_workers=0 loads here); VmHWM is max(recorded peak, current RSS) and the kernel
    # records the peak lazily, so a later read can be a few pages below an earlier one: keep the largest
    host_rss = max([proc_kib("/proc/self/status", "VmHWM") * 1024] + [m.rss_hwm_bytes for m in taken])
    data_per_process, data_per_host = (int(b) for b in task.host_data_bytes(data))
    loader_batch = best or opts.start_batch
    loader = []
    gpu_decode = cfg.decode_device == "cuda"
    decode = (
        f"decode: JPEGs on {device} (decode_device=cuda); the loader figures include that decode and the crops "
        "(the task's train_batch, synchronised)"
        if gpu_decode
        else "decode: in the loader workers (decode_device=cpu); the loader figures are the workers alone"
    )
    log(f"probe: {decode}")
    for w in sorted(set(opts.workers)):
        for p in sorted(set(opts.prefetch)) if w else [min(opts.prefetch)]:
            r = measure_loader(
                data.train,
                data.collate,
                cfg,
                loader_batch,
                w,
                p,
                opts.loader_batches,
                device_side=task.train_batch if gpu_decode else None,
            )
            log(
                f"probe: loader workers={w} prefetch={p}: {r['images_per_s']:.0f} images/s, workers private "
                f"{r['workers_private_bytes'] / GIB:.3f} GiB"
            )
            loader.append(r)
    cfg_row = next((r for r in loader if r["num_workers"] == cfg.num_workers), None)
    measured = [r for r in loader if r["num_workers"]]
    overhead = int(statistics.median([r["worker_overhead_bytes"] for r in measured])) if measured else None
    server = max(r["worker_server_bytes"] for r in measured) if measured else None
    ram = predict_loader_ram(
        loader_batch,
        task.input_size(),
        cfg.num_workers,
        cfg.prefetch_factor,
        bytes_per_sample=loader[0]["bytes_per_sample"] if loader else None,
        worker_overhead_bytes=overhead,
        worker_server_bytes=server,
    )
    res = ProbeResult(
        config=cfg.to_dict(),
        precision=rig.precision.name,
        device=device.type,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        image_size=shape,
        limit_bytes=limit,
        limit_source=source,
        margin=opts.margin,
        best_batch=best,
        best_images_per_s=best_m.images_per_s if best_m else None,
        measurements=[asdict(m) for m in taken],
        loader=loader,
        loader_ram_prediction=ram.to_dict(),
        decode_device=cfg.decode_device,
        host_rss_hwm_bytes=host_rss,
        host_data_bytes_per_process=data_per_process,
        host_data_bytes_per_host=data_per_host,
        memory_method=(
            "torch.cuda.max_memory_allocated/reserved"
            if device.type == "cuda"
            else "torch CPU allocator via torch.profiler(profile_memory=True) + live tensors; "
            "OOM simulated against the limit"
        ),
    )
    if best_m and loader:
        best_loader = max(loader, key=lambda r: r["images_per_s"])
        row = cfg_row or best_loader
        res.gpu_waits_on_data = row["images_per_s"] < best_m.images_per_s
        res.data_verdict = (
            f"{decode}; "
            f"loader at num_workers={row['num_workers']} prefetch={row['prefetch_factor']}: "
            f"{row['images_per_s']:.0f} images/s vs step {best_m.images_per_s:.0f} images/s at batch {best}: "
            + ("the device WAITS on data" if res.gpu_waits_on_data else "the loader keeps up")
            + f"; best loader setting measured: num_workers={best_loader['num_workers']} "
            f"prefetch={best_loader['prefetch_factor']} ({best_loader['images_per_s']:.0f} images/s)"
            + (" (CPU device: loader and step share the same cores here)" if device.type == "cpu" else "")
        )
    res.seconds = time.perf_counter() - t_start
    return res


#: The files ``probe`` writes into its ``--out-dir``.
OUTPUT_FILES = {"json": "probe.json", "md": "probe.md", "png": "probe.png"}


def check_out_dir(out_dir: str | Path) -> Path:
    """Create ``out_dir`` if needed and make sure the probe's files can be written there, before anything is
    measured (a probe takes minutes; its results must not be lost at the end). Returns the folder.

    Raises:
        ConfigError: naming the path: it exists and is not a folder, cannot be created, is not writable, or
            one of :data:`OUTPUT_FILES` is a folder.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--out-dir {out}: exists and is not a folder; give a folder for {', '.join(OUTPUT_FILES.values())}"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out-dir {out}: cannot create the folder ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out-dir {out}: folder is not writable")
    for name in OUTPUT_FILES.values():
        if (out / name).is_dir():
            raise ConfigError(f"--out-dir {out}: {out / name} is a folder; the probe writes a file of that name")
    return out


def write_probe(res: ProbeResult, out_dir: str | Path) -> dict[str, Path]:
    """Write ``probe.json``, ``probe.md`` and ``probe.png`` into ``out_dir``; return their paths."""
    from trainer.planning.report import render_markdown, render_plot

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / name for kind, name in OUTPUT_FILES.items()}
    paths["json"].write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    paths["md"].write_text(render_markdown(res.to_dict()))
    render_plot(res.to_dict(), paths["png"])
    return paths


def default_workers(cfg: TrainConfig) -> tuple:
    """0, 2, 4 and the config's num_workers, capped at this machine's CPU count."""
    cap = os.cpu_count() or 1
    return tuple(sorted({w for w in (0, 2, 4, cfg.num_workers) if w <= max(cap, 2)}))
