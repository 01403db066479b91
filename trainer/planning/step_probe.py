"""Memory and speed of the trainer's step per batch size on the machine at hand, and the search for the largest
batch that fits (``python -m trainer probe``'s batch search; :mod:`trainer.planning.probe` runs it with the
loader measurements and writes the report). Separate because it measures one step and knows nothing of the
report, the loader or the output files.

Memory per batch size (:func:`measure_step`), on the trainer's own step (:mod:`trainer.engine.step`):

* CUDA: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated`` / ``max_memory_reserved`` over a
  warm-up step and the timed steps; ``torch.OutOfMemoryError`` is caught (tensors freed, ``empty_cache``) and
  counts as "does not fit". ``--memory-limit-gib`` caps the process with
  ``torch.cuda.set_per_process_memory_fraction`` so a smaller GPU's OOM happens for real.
* CPU: torch's CPU allocator, read through ``torch.profiler`` with ``profile_memory=True``: the peak of the
  running sum of allocation/free events during one step, plus the bytes live before it (weights, buffers,
  optimizer state, EMA). There is no
  OOM on CPU before the machine swaps, so ``--memory-limit-gib`` simulates one: a step whose measured peak
  exceeds the limit counts as out of memory.

Search (:func:`search_batch`): start at ``start_batch`` and double while the peak stays under
``limit x (1 - margin)``; after the first batch that does not (OOM or over the margin), bisect between the
last good and the first bad batch down to ``granularity`` images. The result is the largest batch that fits
with the margin.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from trainer.engine.step import TrainStep
from trainer.planning.host_ram import GIB
from trainer.planning.loader_probe import proc_kib


@dataclass
class StepMeasurement:
    """One batch size: peak device memory (bytes), step time (s), images/s; ``oom`` when it did not run."""

    batch: int
    peak_bytes: int = 0
    reserved_bytes: int = 0
    rss_hwm_bytes: int = 0
    step_s: float = 0.0
    images_per_s: float = 0.0
    oom: bool = False
    fits: bool = False
    note: str = ""


def _tensor_bytes(rig: TrainStep) -> int:
    """Bytes of the distinct storages live before a step: weights, buffers, optimizer state, EMA."""
    tensors = list(rig.model.parameters()) + list(rig.model.buffers())
    tensors += [v for s in rig.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    if rig.ema is not None:
        tensors += list(rig.ema.parameters()) + list(rig.ema.buffers())
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def cpu_step_peak_bytes(rig: TrainStep, batch: dict) -> int:
    """Peak bytes held by torch's CPU allocator during one optimizer step on the device ``batch`` (see module
    doc): the tensors live before the step (weights, buffers, optimizer state, EMA, the batch) plus the profiled
    allocations' high-water mark."""
    from torch.profiler import ProfilerActivity, profile

    base = _tensor_bytes(rig) + sum(v.untyped_storage().nbytes() for v in batch.values() if torch.is_tensor(v))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        rig.step(batch)
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return base + peak


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(
    rig: TrainStep, batch: int, image_size: Optional[int], steps: int, limit_bytes: float, margin: float
) -> StepMeasurement:
    """Peak memory and time of ``steps`` optimizer steps at ``batch`` images per forward, after a warm-up step
    (always on CUDA; on CPU only while the optimizer has no state yet, since the profiled step warms up too).

    ``limit_bytes``: device memory available (CUDA: the device or the --memory-limit-gib cap; CPU: the simulated
    limit). ``fits`` = ran and peak <= limit x (1 - margin). CUDA OOM is caught and reported as ``oom``.
    ``image_size`` None: the task's :meth:`~trainer.tasks.base.Task.input_size`.
    """
    m = StepMeasurement(batch)
    dev = rig.device
    x = None
    try:
        x = rig.example_batch(batch, image_size)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        if dev.type == "cuda" or not rig.optimizer.state:
            rig.step(x)  # warm-up: optimizer state (first batch size), cuDNN algorithm choice (CUDA)
        if dev.type == "cpu":
            m.peak_bytes = cpu_step_peak_bytes(rig, x)
            m.oom = m.peak_bytes > limit_bytes
            if m.oom:
                m.note = f"simulated OOM: measured peak > limit {limit_bytes / GIB:.3f} GiB"
        times = []
        for _ in range(steps):
            _sync(dev)
            t0 = time.perf_counter()
            rig.step(x)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        m.rss_hwm_bytes = proc_kib("/proc/self/status", "VmHWM") * 1024  # host RSS peak so far (both devices)
        if dev.type == "cuda":
            m.peak_bytes = torch.cuda.max_memory_allocated(dev)
            m.reserved_bytes = torch.cuda.max_memory_reserved(dev)
        m.step_s = statistics.median(times)
        m.images_per_s = batch * rig.cfg.accumulate_grad_batches / m.step_s
    except torch.OutOfMemoryError as e:
        m.oom, m.note = True, "CUDA OOM: " + str(e).splitlines()[0][:160]
    finally:
        del x
        rig.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    held = max(m.peak_bytes, m.reserved_bytes)
    m.fits = not m.oom and held <= limit_bytes * (1 - margin)
    return m


def search_batch(
    measure: Callable[[int], StepMeasurement], start: int, max_batch: int, granularity: int
) -> tuple[Optional[int], list[StepMeasurement]]:
    """Largest batch in [start, max_batch] for which ``measure(batch).fits``: doubling from ``start``, then
    bisection between the last fitting and the first failing batch until they are ``granularity`` apart.

    Returns ``(best batch or None if even ``start`` does not fit, every measurement in the order taken)``.
    """
    taken: list[StepMeasurement] = []
    good, bad, b = None, None, start
    while b <= max_batch:
        m = measure(b)
        taken.append(m)
        if not m.fits:
            bad = b
            break
        good, b = b, b * 2
    if good is None or bad is None:
        return good, taken
    while bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good:
            break
        m = measure(mid)
        taken.append(m)
        good, bad = (mid, bad) if m.fits else (good, mid)
    return good, taken
