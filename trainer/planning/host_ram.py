"""Predict the host RAM a training job needs: its loader's batches and workers, and K jobs side by side on one
instance (``plan --jobs-per-instance``), on any machine.

Separate from :mod:`trainer.planning.memory` (GPU memory of the training step under fake tensors): this is
arithmetic over measured or assumed figures (a ``probe.json``, the task's sample and dataset bytes, torch's
loader and pinned-memory rules) and imports no torch.

Loader host RAM (:func:`predict_loader_ram`)
    Seed 002's formula, with measured inputs: ``num_workers x prefetch_factor`` batches in flight, each
    ``micro_batch x bytes_per_sample`` (decoded uint8 tensors, 3 x H x W bytes, not seed 002's float32), plus
    ``num_workers x worker_overhead_bytes`` (a forked worker's private memory, USS, measured by ``probe``), per rank.

Host RAM of K jobs on one instance (:func:`predict_host_ram`, ``plan --jobs-per-instance``)
    Per training process: its own RSS (a CUDA probe's measured ``host_rss_hwm_bytes`` minus the dataset it held,
    else the assumed :data:`CUDA_PROCESS_HOST_BYTES`), the dataset bytes it holds privately
    (``Task.host_data_bytes(data)[0]``), its loader (:func:`predict_loader_ram` at ``Task.loader_sample_bytes``),
    the idle workers of a persistent evaluation loader, and its pinned batches. Per job: x processes; per host:
    x jobs, plus the page cache the jobs share (``Task.host_data_bytes(data)[1]``, counted once, evictable).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

MIB, GIB = 1024**2, 1024**3

#: Private memory (USS) of one forked loader worker beyond the batches it holds, in bytes: 17.3-22.3 MiB measured
#: by ``python -m trainer probe`` on CPU-2 (imagenette subset, 112 px, 1-2 workers; docs/planning.md), rounded
#: up. The default when no probe report gives a measured figure.
WORKER_OVERHEAD_BYTES = 24 * MIB

#: Anonymous memory of the loader workers' fork server (``trainer.data.loading.worker_context``), once per training
#: process that has workers, in bytes: 369.6 MiB measured (``/proc/<pid>/smaps_rollup`` ``Anonymous`` of a fresh
#: interpreter after importing torch 2.14.1, torchvision 0.29.1 and the classification task; AMD EPYC VM,
#: 2026-11-27; docs/planning.md), rounded up. The default when no probe report gives a measured figure.
WORKER_SERVER_BYTES = 384 * MIB

#: Host RAM (RSS) of one PyTorch training process driving one GPU, without its dataset and loader, in bytes.
#: ASSUMED, not measured here (no GPU in this repository's CI): torch 2.x with CUDA 12/13, the CUDA driver's
#: host-side context, cuBLAS/cuBLASLt and cuDNN 9 loaded after the first convolution, the Python heap and the
#: model's CPU copy before ``.to(device)``. Public reports put such a process at 1.3-2 GiB RSS after its first
#: cuDNN convolution (pytorch/pytorch#12873, #19397, #31767; before CUDA 11.7's lazy module loading, which
#: lowers the *device* context, pytorch/pytorch#86509); cuDNN 9's engine libraries and torch 2.x's larger CUDA
#: binaries add to the file-backed part. 3 GiB is the upper end, rounded up: replace it with the figure a probe
#: on the GPU measures (``python -m trainer probe`` on CUDA writes ``host_rss_hwm_bytes``; ``plan --probe-report``
#: uses it). VmHWM also counts shared-library pages that K processes share, so K x this over-counts a little.
CUDA_PROCESS_HOST_BYTES = 3 * GIB

#: Host RAM (RSS) of one CPU training process without its dataset and loader, in bytes. ASSUMED (torch import
#: ~0.4 GiB plus a small model, its optimizer state and activations in host RAM); a CPU probe measures it.
CPU_PROCESS_HOST_BYTES = 1 * GIB

#: vCPUs kept free per host for the OS, the loaders' pin-memory threads and the CUDA driver's threads when jobs
#: share an instance. ASSUMED (a rule of thumb, not measured): one vCPU.
HOST_RESERVED_VCPUS = 1


@dataclass
class LoaderRamPrediction:
    """Host RAM of one rank's DataLoader (bytes): seed 002's buffer formula, the per-worker overhead and, with
    workers, their fork server once (``worker_server_bytes``)."""

    micro_batch: int
    num_workers: int
    prefetch_factor: int
    bytes_per_sample: int
    worker_overhead_bytes: int
    bytes_per_sample_source: str
    worker_overhead_source: str
    worker_server_bytes: int = WORKER_SERVER_BYTES

    @property
    def batches_in_flight(self) -> int:
        return self.num_workers * self.prefetch_factor if self.num_workers else 1

    @property
    def buffer_bytes(self) -> int:
        return self.batches_in_flight * self.micro_batch * self.bytes_per_sample

    @property
    def total_bytes(self) -> int:
        server = self.worker_server_bytes if self.num_workers else 0
        return self.buffer_bytes + self.num_workers * self.worker_overhead_bytes + server

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(batches_in_flight=self.batches_in_flight, buffer_bytes=self.buffer_bytes, total_bytes=self.total_bytes)
        return d


def predict_loader_ram(
    micro_batch: int,
    image_size: int | tuple[int, int],
    num_workers: int,
    prefetch_factor: int,
    *,
    bytes_per_sample: Optional[int] = None,
    worker_overhead_bytes: Optional[int] = None,
    worker_server_bytes: Optional[int] = None,
) -> LoaderRamPrediction:
    """Host RAM of one rank's loader: ``workers x prefetch x micro_batch x bytes_per_sample + workers x overhead``
    ``+ server`` (the workers' fork server, once when ``num_workers > 0``: measured by ``probe``, else
    :data:`WORKER_SERVER_BYTES`).

    Source: seed 002 ("Total RAM buffer = num_workers x prefetch_factor x batch_memory"), with the batch in the
    trainer's format (uint8, 3 x H x W bytes per image, ``image_size`` = side or (H, W), unless a measured
    ``bytes_per_sample`` is given)
    and the per-worker overhead (measured by ``probe``, else :data:`WORKER_OVERHEAD_BYTES`). ``num_workers=0``
    loads in the training process: one batch, no workers. Multiply by the ranks of a host for the host's RAM.
    """
    measured = bytes_per_sample is not None
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    return LoaderRamPrediction(
        micro_batch,
        num_workers,
        prefetch_factor,
        int(bytes_per_sample if measured else 3 * h * w),
        int(WORKER_OVERHEAD_BYTES if worker_overhead_bytes is None else worker_overhead_bytes),
        "measured (probe)" if measured else "3 x H x W uint8 (the loader's batch format)",
        "measured (probe)" if worker_overhead_bytes is not None else "WORKER_OVERHEAD_BYTES default (CPU-2)",
        int(WORKER_SERVER_BYTES if worker_server_bytes is None else worker_server_bytes),
    )


def pinned_batches(num_workers: int, prefetch_factor: int) -> int:
    """Batches a loader keeps pinned in the training process with ``pin_memory``: ``prefetch_factor x num_workers``.

    Source: torch/utils/data/dataloader.py, ``_MultiProcessingDataLoaderIter._try_put_index``: at most
    ``prefetch_factor * num_workers`` index tasks are outstanding; each finished batch passes the main
    process's ``pin_memory_thread`` (torch/utils/data/_utils/pin_memory.py) which copies it into page-locked memory
    before the training loop takes it. ``num_workers=0``: one batch, pinned in the loop itself."""
    return num_workers * prefetch_factor if num_workers else 1


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes the caching host allocator holds for a pinned tensor of ``nbytes``: the next power of two
    (ATen/core/CachingHostAllocator.h, "Round up the allocation to the nearest power of two"; the rounding
    threshold ``pinned_max_round_threshold`` defaults to unlimited). Freed blocks stay cached in the process."""
    return 1 << max(int(nbytes) - 1, 0).bit_length() if nbytes > 0 else 0


def process_host_bytes(probe: Optional[dict], device_type: str = "cuda") -> tuple[int, str]:
    """RSS of one training process without its dataset and loader (bytes) and where the figure comes from.

    Measured when ``probe`` (a ``probe.json`` dict) ran on ``device_type``: its ``host_rss_hwm_bytes`` (VmHWM of
    the probe's process after the batch search's timed steps, before its loader measurements) minus the dataset
    the probe's process held (``host_data_bytes_per_process``); else the assumed constant of the device type."""
    if probe and probe.get("device") == device_type and probe.get("host_rss_hwm_bytes"):
        data = int(probe.get("host_data_bytes_per_process") or 0)
        where = probe.get("device_name") or device_type
        return max(int(probe["host_rss_hwm_bytes"]) - data, 0), (
            f"measured (probe VmHWM on {where}" + (f" minus its dataset {data / GIB:.2f} GiB)" if data else ")")
        )
    if device_type == "cuda":
        return CUDA_PROCESS_HOST_BYTES, "ASSUMED: CUDA_PROCESS_HOST_BYTES (no probe on a GPU)"
    return CPU_PROCESS_HOST_BYTES, "ASSUMED: CPU_PROCESS_HOST_BYTES (no probe on a CPU)"


@dataclass
class HostRamPrediction:
    """Host RAM of ``jobs`` training jobs side by side on one instance (bytes), by component and source.

    Per training process: ``process_bytes`` + ``dataset_bytes`` + ``loader.total_bytes`` +
    ``idle_eval_workers_bytes`` + ``pinned_bytes``; a job has ``processes_per_job`` of them; the host holds
    ``jobs`` jobs (``total_bytes``) and, once, the shared page cache (``page_cache_bytes``, evictable)."""

    jobs: int
    processes_per_job: int
    process_bytes: int
    process_source: str
    dataset_bytes: int
    dataset_source: str
    loader: LoaderRamPrediction
    idle_eval_workers_bytes: int
    pinned_bytes: int
    pinned_source: str
    page_cache_bytes: int
    page_cache_source: str

    @property
    def per_process_bytes(self) -> int:
        return (
            self.process_bytes
            + self.dataset_bytes
            + self.loader.total_bytes
            + self.idle_eval_workers_bytes
            + self.pinned_bytes
        )

    @property
    def per_job_bytes(self) -> int:
        return self.processes_per_job * self.per_process_bytes

    @property
    def total_bytes(self) -> int:
        """What the jobs hold (not evictable): jobs x per job; the shared page cache is not included."""
        return self.jobs * self.per_job_bytes

    @property
    def with_page_cache_bytes(self) -> int:
        return self.total_bytes + self.page_cache_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["loader"] = self.loader.to_dict()
        d.update(
            per_process_bytes=self.per_process_bytes,
            per_job_bytes=self.per_job_bytes,
            total_bytes=self.total_bytes,
            with_page_cache_bytes=self.with_page_cache_bytes,
        )
        return d


def predict_host_ram(
    *,
    micro_batch: int,
    bytes_per_sample: int,
    num_workers: int,
    prefetch_factor: int,
    jobs: int = 1,
    processes_per_job: int = 1,
    device_type: str = "cuda",
    pin_memory: bool = True,
    persistent_workers: bool = True,
    eval_batch: Optional[int] = None,
    eval_bytes_per_sample: Optional[int] = None,
    dataset_bytes: tuple[int, int] = (0, 0),
    dataset_source: str = "Task.host_data_bytes",
    probe: Optional[dict] = None,
) -> HostRamPrediction:
    """Host RAM of ``jobs`` independent jobs of ``processes_per_job`` training processes each (see module doc).

    Args:
        micro_batch / eval_batch: samples per training / evaluation batch of one process (eval default 2 x micro).
        bytes_per_sample / eval_bytes_per_sample: ``Task.loader_sample_bytes(train)`` (eval default: the same).
        num_workers, prefetch_factor, pin_memory, persistent_workers: the config's loader fields.
        device_type: ``"cuda"`` (pinned batches count when ``pin_memory``) or ``"cpu"``.
        dataset_bytes: ``Task.host_data_bytes(data)``: (held by every process, shared by the host's processes).
        probe: a ``probe.json`` dict: its measured process RSS (same device type) and worker overhead are used.
    """
    if jobs < 1 or processes_per_job < 1:
        raise ValueError(f"jobs and processes_per_job must be >= 1, got {jobs}, {processes_per_job}")
    overhead = server = None
    ram_pred = (probe or {}).get("loader_ram_prediction") or {}
    if str(ram_pred.get("worker_overhead_source", "")).startswith("measured"):
        overhead = int(ram_pred["worker_overhead_bytes"])
        server = ram_pred.get("worker_server_bytes")  # absent from reports written before the fork server
    loader = predict_loader_ram(
        micro_batch,
        1,
        num_workers,
        prefetch_factor,
        bytes_per_sample=bytes_per_sample,
        worker_overhead_bytes=overhead,
        worker_server_bytes=server,
    )
    loader.bytes_per_sample_source = "Task.loader_sample_bytes"
    proc, proc_source = process_host_bytes(probe, device_type)
    eval_batch = eval_batch or 2 * micro_batch
    eval_sample = eval_bytes_per_sample or bytes_per_sample
    # A persistent evaluation loader keeps its workers alive (idle) while the training loader runs.
    idle = num_workers * loader.worker_overhead_bytes if persistent_workers else 0
    pinned, pinned_source = 0, "no pinned memory (pin_memory off or not CUDA)"
    if pin_memory and device_type == "cuda":
        n = pinned_batches(num_workers, prefetch_factor)
        train_block = pinned_block_bytes(micro_batch * bytes_per_sample)
        eval_block = pinned_block_bytes(eval_batch * eval_sample)
        pinned = n * (train_block + eval_block)
        pinned_source = (
            f"{n} batches (prefetch_factor x num_workers, torch DataLoader) x (training {train_block / MIB:.1f} MiB "
            f"+ evaluation {eval_block / MIB:.1f} MiB), rounded to powers of two and cached by "
            "the CUDA caching host allocator"
        )
    per_process, per_host = (int(b) for b in dataset_bytes)
    return HostRamPrediction(
        jobs=jobs,
        processes_per_job=processes_per_job,
        process_bytes=int(proc),
        process_source=proc_source,
        dataset_bytes=per_process,
        dataset_source=f"{dataset_source} (held by every process)",
        loader=loader,
        idle_eval_workers_bytes=idle,
        pinned_bytes=pinned,
        pinned_source=pinned_source,
        page_cache_bytes=per_host,
        page_cache_source=f"{dataset_source} (page cache shared by the host's processes, evictable)",
    )
