"""Shared helpers of the CPU proxies of GPU step cost (``dino_step.py``, ``overhead.py --profile``): count host
syncs, host copies and ATen operator calls of a step under ``torch.profiler``. Counts, not times: they do not depend
on the machine or the thread count, so tests can pin them.
"""

from __future__ import annotations

import contextlib

import torch

#: ATen ops that block the host until the GPU has caught up: ``.item()`` / ``int(t)`` / ``bool(t)``, and
#: boolean-mask indexing (its output size is data-dependent).
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
#: Tensor methods that copy to the host; on a CPU tensor they make no ATen call, so they are counted by wrapping.
HOST_COPY_METHODS = ("tolist", "numpy", "cpu")


@contextlib.contextmanager
def count_host_copies(counts: dict):
    """Count calls of ``Tensor.tolist/numpy/cpu`` (they make no ATen call on a CPU tensor) into ``counts``."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_COPY_METHODS}

    def wrap(name, fn):
        def counted(self, *a, **kw):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *a, **kw)

        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _one_launch(name: str) -> bool:
    """Ops whose CUDA implementation is one (multi-tensor) kernel launch while their CPU implementation loops in
    ATen calls of its own: torch's ``_foreach_*`` / ``_fused_*`` optimizer kernels and our deformable-attention op."""
    return name.startswith(("aten::_foreach_", "aten::_fused_", "trainstack::"))


def count_calls(events) -> tuple[dict, int]:
    """({event name: calls}, ATen calls) over profiler ``events``, counting each :func:`_one_launch` op once: the
    events nested inside it (its CPU loop, e.g. the CPU fused AdamW kernel's per-parameter ``step.item()``) are
    left out, as they do not exist on a GPU."""
    calls: dict[str, int] = {}
    aten = 0
    for e in events:
        parent, nested = e.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = _one_launch(parent.name), parent.cpu_parent
        if nested and e.name.startswith(("aten::", "trainstack::")):
            continue  # CUDA runtime events (cudaLaunchKernel ...) inside such an op are real launches: kept
        calls[e.name] = calls.get(e.name, 0) + 1
        aten += e.name.startswith(("aten::", "trainstack::"))
    return calls, aten


@contextlib.contextmanager
def count_device_tensors_from_host(counts: dict, device: torch.device):
    """Count ``torch.tensor`` / ``torch.as_tensor`` calls given ``device=`` that resolves to ``device``'s type, into
    ``counts["from_host"]``. On CUDA each such call on Python data is a copy from pageable host memory, which
    synchronises the host with the GPU stream (PyTorch's blocking copy); on the CPU it costs nothing, so the
    number of calls is the proxy. Calls without ``device=`` (host tensors, e.g. the loop's gloo control flags)
    are not counted."""
    saved = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def wrap(fn):
        def counted(*a, **kw):
            dev = kw.get("device")
            if dev is not None and torch.device(dev).type == device.type:
                counts["from_host"] = counts.get("from_host", 0) + 1
            return fn(*a, **kw)

        return counted

    for name, fn in saved.items():
        setattr(torch, name, wrap(fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)
