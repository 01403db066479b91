"""Multi-scale deformable attention: our CUDA op against the PyTorch reference (grid_sample), DINO-4scale.

    python benchmarks/msda.py                       # GPU: fp32 and bf16, encoder and decoder shapes
    python benchmarks/msda.py --device cpu --small  # proves the script on a CPU machine (reference only)

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


def impls(device: str) -> dict:
    """name -> callable(value, shapes, starts, loc, attn)."""
    out = {"reference": lambda v, sh, st, lc, a: msda.ms_deform_attn_reference(v, sh, lc, a)}
    if device == "cuda":
        if msda.load_extension() is None:
            sys.exit(f"benchmarks/msda.py: {msda.extension_error()}")
        out = {"cuda": lambda v, sh, st, lc, a: msda.MSDeformAttnFunction.apply(v, sh, st, lc, a, 64), **out}
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
    return {"fwd": fwd, "both": both, "peak": peak, "out": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="quarter-size levels and fewer queries (CPU check)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args(argv)
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
        "| case | dtype | impl | fwd ms | fwd+bwd ms | peak MiB (fwd+bwd) | fwd speed-up | fwd+bwd speed-up "
        "| max abs diff vs reference |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, n, levels, lq in cases(a.small):
        for dt in dtypes:
            inputs = make(n, levels, lq, DTYPES[dt], a.device)
            results = {k: measure(fn, inputs, a.device, a.iters, a.warmup) for k, fn in impls(a.device).items()}
            ref = results["reference"]
            for impl, r in results.items():
                diff = (r["out"].float() - ref["out"].float()).abs().max().item()
                peak = "-" if r["peak"] is None else f"{r['peak']:.0f}"
                print(
                    f"| {name} | {dt} | {impl} | {r['fwd']:.2f} | {r['both']:.2f} | {peak} | "
                    f"{ref['fwd'] / r['fwd']:.1f}x | {ref['both'] / r['both']:.1f}x | {diff:.2e} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
