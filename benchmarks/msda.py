"""Multi-scale deformable attention: our CUDA op against the PyTorch reference (grid_sample), DINO-4scale.

    python benchmarks/msda.py                       # GPU: fp32 and bf16, encoder and decoder shapes
    python benchmarks/msda.py --upstream-src DIR    # + upstream DINO's op built from a checkout, side by side
    python benchmarks/msda.py --device cpu --small  # proves the script on a CPU machine (reference only)

``--upstream-src``: a checkout of upstream DINO's op (IDEA-Research/DINO ``models/dino/ops``, Apache-2.0; the
folder holding ``src/vision.cpp``, or the repository root), e.g. ``../shared/gpu-check/upstream_msda`` (patched only
to compile on current torch). It is built here with torch's JIT loader (nothing of it enters the project) and
timed on the same inputs through a thin autograd wrapper of its ``ms_deform_attn_forward/backward``; it has fp32
and fp64 kernels only, so its rows appear for fp32. "ours" is :func:`trainer.ops.msda.ms_deform_attn`, the entry
point DINO calls (custom operator, autograd included).

Shapes (DINO-4scale, 800 x 1333 input; levels 100x167, 50x84, 25x42, 13x21 -> S = 22,223; M=8, D=32, L=4,
P=4): encoder N=2, Lq=S; decoder N=2, Lq=900 and 1,100. ``--small`` uses levels a quarter the size and fewer
queries. Prints a Markdown table: median forward and forward+backward time, peak memory allocated during
forward+backward beyond the inputs (CUDA only), speed-up over the reference, and max |CUDA - reference|.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.ops import msda  # noqa: E402

LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))
SMALL_LEVELS = ((25, 42), (13, 21), (7, 11), (4, 6))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cases(small: bool) -> list[tuple[str, int, tuple, int]]:
    """(name, N, levels, Lq) of each benchmarked shape."""
    levels = SMALL_LEVELS if small else LEVELS
    s = sum(h * w for h, w in levels)
    dec = (100, 120) if small else (900, 1100)
    return [
        (f"encoder Lq=S={s}", 2, levels, s),
        (f"decoder Lq={dec[0]}", 2, levels, dec[0]),
        (f"decoder Lq={dec[1]}", 2, levels, dec[1]),
    ]


def make(n, levels, lq, dtype, device, m=8, d=32, p=4):
    """Random op inputs: value (N, S, M, D), shapes, starts, locations in [0, 1], softmax weights."""
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = torch.tensor(levels, dtype=torch.int64, device=device)
    hw = shapes.prod(1)
    starts = torch.cat([hw.new_zeros(1), hw.cumsum(0)[:-1]])
    s = int(hw.sum())
    value = torch.randn(n, s, m, d, generator=g).to(device, dtype)
    loc = torch.rand(n, lq, m, len(levels), p, 2, generator=g).to(device, dtype)
    attn = torch.rand(n, lq, m, len(levels) * p, generator=g).softmax(-1).view(n, lq, m, len(levels), p)
    return value, shapes, starts, loc, attn.to(device, dtype)


UPSTREAM_SOURCES = ("vision.cpp", "cpu/ms_deform_attn_cpu.cpp", "cuda/ms_deform_attn_cuda.cu")


def upstream_source_dir(path: str) -> Path:
    """The ``src`` folder of an upstream op checkout: ``path`` itself, ``path/src`` or ``path/models/dino/ops/src``.

    Raises:
        SystemExit(2): none of them holds the three source files (one line naming what is missing).
    """
    root = Path(path)
    for cand in (root, root / "src", root / "models" / "dino" / "ops" / "src"):
        if all((cand / f).is_file() for f in UPSTREAM_SOURCES):
            return cand
    print(
        f"error: --upstream-src: {path} holds no upstream MSDA sources (expected {', '.join(UPSTREAM_SOURCES)} under "
        "it, its src/ or models/dino/ops/src/)",
        file=sys.stderr,
    )
    raise SystemExit(2)


def build_upstream(src: Path):
    """Upstream's op compiled by ``torch.utils.cpp_extension.load`` (its own flags: ``-DWITH_CUDA``, no half ops)."""
    from torch.utils import cpp_extension

    from trainer.ops.msda.build import extra_include_dirs

    t0 = time.time()
    mod = cpp_extension.load(
        name="upstream_msda",
        sources=[str(src / f) for f in UPSTREAM_SOURCES],
        extra_include_paths=[str(src), *extra_include_dirs(cpp_extension.CUDA_HOME)],
        extra_cflags=["-O3", "-DWITH_CUDA"],
        extra_cuda_cflags=[
            "-O3",
            "-DCUDA_HAS_FP16=1",
            "-D__CUDA_NO_HALF_OPERATORS__",
            "-D__CUDA_NO_HALF_CONVERSIONS__",
            "-D__CUDA_NO_HALF2_OPERATORS__",
        ],
        verbose=False,
    )
    print(f"upstream op built from {src} in {time.time() - t0:.0f} s\n", flush=True)
    return mod


def upstream_impl(mod):
    """callable(value, shapes, starts, loc, attn) over upstream's raw forward/backward, with autograd."""

    class Upstream(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v, sh, st, lc, a):
            ctx.save_for_backward(v, sh, st, lc, a)
            return mod.ms_deform_attn_forward(v, sh, st, lc, a, 64)

        @staticmethod
        def backward(ctx, g):
            v, sh, st, lc, a = ctx.saved_tensors
            gv, gl, ga = mod.ms_deform_attn_backward(v, sh, st, lc, a, g.contiguous(), 64)
            return gv, None, None, gl, ga

    return Upstream.apply


def impls(device: str, levels: tuple, upstream=None) -> dict:
    """name -> callable(value, shapes, starts, loc, attn); ``levels``: the (H, W) pairs of ``shapes``;
    ``upstream``: the built upstream module or None."""
    out = {"reference": lambda v, sh, st, lc, a: msda.ms_deform_attn_reference(v, sh, lc, a)}
    if device == "cuda":
        if msda.load_extension() is None:
            sys.exit(f"benchmarks/msda.py: {msda.extension_error()}")
        # level_shapes as Python ints, as DINO passes them: without them the entry point's checks read the
        # level table back from the GPU (one sync per call), which DINO's calls do not pay
        out = {"ours": lambda v, sh, st, lc, a: msda.ms_deform_attn(v, sh, st, lc, a, 64, level_shapes=levels), **out}
        if upstream is not None:
            out = {"upstream": upstream_impl(upstream), **out}
    return out


def timed(fn, device: str, iters: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in milliseconds (synchronising the GPU around each call)."""
    times = []
    for i in range(warmup + iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(fn, inputs, device, iters, warmup) -> dict:
    """Forward time, forward+backward time, peak extra memory (MiB) and the forward output."""
    with torch.no_grad():
        out = fn(*inputs)
        fwd = timed(lambda: fn(*inputs), device, iters, warmup)
    grads = [t.detach().clone().requires_grad_() for t in (inputs[0], inputs[3], inputs[4])]
    args = (grads[0], inputs[1], inputs[2], grads[1], grads[2])
    grad_out = torch.ones_like(out)

    def step():
        fn(*args).backward(grad_out)
        for t in grads:
            t.grad = None

    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    both = timed(step, device, iters, warmup)
    gpu = kernel_ms(step, iters) if device == "cuda" else None
    return {"fwd": fwd, "both": both, "peak": peak, "out": out, "gpu": gpu}


def kernel_ms(fn, iters: int) -> float:
    """GPU time (ms) of one ``fn()``: the device time of every kernel and memset it launches, summed by
    torch.profiler over ``iters`` calls and averaged; unlike wall time it leaves out the host's share (Python,
    dispatch, launches), which dominates small shapes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = sum(
        getattr(e, "self_device_time_total", 0) for e in prof.key_averages() if str(e.device_type).endswith("CUDA")
    )
    return total_us / 1e3 / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="quarter-size levels and fewer queries (CPU check)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--upstream-src", help="a checkout of upstream DINO's op to build and time beside ours")
    a = ap.parse_args(argv)
    src = upstream_source_dir(a.upstream_src) if a.upstream_src else None
    if src is not None and a.device != "cuda":
        print("error: --upstream-src: upstream's op has CUDA kernels only; run with --device cuda", file=sys.stderr)
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/msda.py: no CUDA GPU; use --device cpu --small to check the script (reference only)")
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        sys.exit(f"benchmarks/msda.py: --dtypes: unknown {unknown}; choose from {sorted(DTYPES)}")
    warnings.simplefilter("ignore", RuntimeWarning)
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(
        f"multi-scale deformable attention, {device_name}, torch {torch.__version__}, M=8 D=32 L=4 P=4, "
        f"median of {a.iters}\n"
    )
    print(
        "| case | dtype | impl | fwd ms | fwd+bwd ms | fwd+bwd GPU ms | peak MiB (fwd+bwd) | fwd speed-up "
        "| fwd+bwd speed-up | max abs diff vs reference |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    upstream = build_upstream(src) if src is not None else None
    ratios = []
    upstream_times: dict[str, dict] = {}
    for name, n, levels, lq in cases(a.small):
        for dt in dtypes:
            inputs = make(n, levels, lq, DTYPES[dt], a.device)
            fns = impls(a.device, levels, upstream if dt == "fp32" else None)
            results = {k: measure(fn, inputs, a.device, a.iters, a.warmup) for k, fn in fns.items()}
            if "upstream" in results:
                upstream_times[name] = results["upstream"]
            up = upstream_times.get(name)  # upstream runs fp32 only: bf16/fp16 rows compare with its fp32
            for impl in (k for k in results if k.startswith("ours") and up is not None):
                ours = results[impl]
                gpu = up["gpu"] / ours["gpu"] if up["gpu"] and ours["gpu"] else float("nan")
                ratios.append((f"{impl}, {name}", dt, up["fwd"] / ours["fwd"], up["both"] / ours["both"], gpu))
            ref = results["reference"]
            for impl, r in results.items():
                diff = (r["out"].float() - ref["out"].float()).abs().max().item()
                peak = "-" if r["peak"] is None else f"{r['peak']:.0f}"
                gpu = "-" if r["gpu"] is None else f"{r['gpu']:.3f}"
                print(
                    f"| {name} | {dt} | {impl} | {r['fwd']:.2f} | {r['both']:.2f} | {gpu} | {peak} | "
                    f"{ref['fwd'] / r['fwd']:.1f}x | {ref['both'] / r['both']:.1f}x | {diff:.2e} |",
                    flush=True,
                )
    for name, dt, fwd, both, gpu in ratios:
        print(
            f"vs upstream fp32, {name} {dt}: {fwd:.2f}x forward, {both:.2f}x forward+backward, "
            f"{gpu:.2f}x forward+backward GPU time (> 1: ours faster)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
