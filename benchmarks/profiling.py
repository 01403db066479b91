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


#: The profiler region that :func:`graph_stand_in` runs a "captured" callable's forward and backward in.
CAPTURED = "cuda_graphs: captured"


@contextlib.contextmanager
def graph_stand_in():
    """Replace ``torch.cuda.make_graphed_callables`` with a CPU stand-in, so that a step with ``cuda_graphs: true``
    runs on the CPU with the same split between captured and eager work as on CUDA.

    The stand-in's callable runs the module eagerly, its forward and its backward (a custom autograd function that
    backpropagates through the saved forward) each inside a ``record_function(CAPTURED)`` region. ATen calls nested
    in that region are what one graph replay launches on CUDA; every other ATen call of the step is launched one by
    one from Python, as without graphs. :func:`captured_events` picks the first. The stand-in takes
    ``make_graphed_callables``'s arguments (a module, a tuple of sample tensors, ``allow_unused_input``) and
    ignores the samples: it captures nothing."""
    real = torch.cuda.make_graphed_callables

    def stand_in(module, sample_args, allow_unused_input=False, **_):
        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                with torch.enable_grad(), torch.profiler.record_function(CAPTURED):
                    inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]
                    outputs = module(*inputs)
                ctx.graph = (inputs, outputs)
                return tuple(o.detach() for o in outputs)

            @staticmethod
            def backward(ctx, *grads):
                inputs, outputs = ctx.graph
                pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
                with torch.profiler.record_function(CAPTURED):
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                return tuple(i.grad for i in inputs)

        return lambda *args: Replay.apply(*args)

    torch.cuda.make_graphed_callables = stand_in
    try:
        yield
    finally:
        torch.cuda.make_graphed_callables = real


def captured_events(events) -> list:
    """The events of a profile nested in a :data:`CAPTURED` region (what a graph replay launches on CUDA)."""
    out = []
    for e in events:
        parent = e.cpu_parent
        while parent is not None and parent.name != CAPTURED:
            parent = parent.cpu_parent
        if parent is not None:
            out.append(e)
    return out
