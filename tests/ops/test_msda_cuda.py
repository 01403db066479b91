"""Multi-scale deformable attention CUDA kernels against the PyTorch reference (needs a GPU and the built op).

Skipped with a reason when torch.cuda.is_available() is False. On a GPU machine a missing extension fails:
build it first (``bash images/build_msda.sh``; ``make test`` does). Shapes are DINO-4scale's levels
(100x167, 50x84, 25x42, 13x21; M=8, D=32, L=4, P=4) with a reduced batch and query count, plus odd shapes
that exercise the lane-group reduction (D=6, D=64), tails of the last warp, chunking and borders.

Tolerances against a float64 reference evaluated on the same (rounded) inputs, as max-abs-scaled atol plus
rtol (the kernels accumulate in fp32; only the final rounding to the output dtype differs):

| dtype | rtol | atol / max|ref| |
| --- | --- | --- |
| fp32 | 1e-4 | 1e-5 |
| fp16 | 2e-3 | 2e-3 |
| bf16 | 1.6e-2 | 1.6e-2 |
"""

from __future__ import annotations

import os

import pytest
import torch
from msda_cases import DINO_LEVELS, loaded_libraries, make_inputs

from trainer.ops import msda

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU: torch.cuda.is_available() is False (the CUDA kernels are only compiled on this machine)",
)

TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-10, 1e-12),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture(scope="module", autouse=True)
def _extension():
    if msda.load_extension() is None:
        pytest.fail(f"GPU present but {msda.extension_error()}")


def _close(got, want, dtype, what):
    rtol, atol = TOL[dtype]
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def _compare(dtype, im2col_step=64, **shape):
    """CUDA forward and backward (value, locations, weights) against the float64 reference on the GPU."""
    value, shapes, starts, loc, attn = make_inputs(dtype=dtype, device="cuda", **shape)
    grad_out = torch.randn(
        value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda", dtype=torch.float64
    ).to(dtype)
    ins = [t.detach().clone().requires_grad_() for t in (value, loc, attn)]
    out = msda.MSDeformAttnFunction.apply(ins[0], shapes, starts, ins[1], ins[2], im2col_step)
    out.backward(grad_out)
    ref_ins = [t.detach().double().requires_grad_() for t in (value, loc, attn)]
    ref = msda.ms_deform_attn_reference(ref_ins[0], shapes, ref_ins[1], ref_ins[2])
    ref.backward(grad_out.double())
    assert out.dtype == dtype and out.shape == ref.shape
    _close(out, ref.detach(), dtype, "output")
    for name, got, want in zip(("grad_value", "grad_sampling_locations", "grad_attention_weights"), ins, ref_ins):
        assert got.grad.dtype == dtype, name
        _close(got.grad, want.grad, dtype, name)


DINO = dict(m=8, d=32, levels=DINO_LEVELS, p=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dino_4scale_decoder_shape(dtype):
    _compare(dtype, n=2, lq=300, loc_range=(0.0, 1.0), **DINO)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dino_4scale_encoder_queries(dtype):
    _compare(dtype, n=1, lq=2000, loc_range=(-0.05, 1.05), seed=3, **DINO)


@pytest.mark.parametrize("d,m,lq", [(6, 3, 7), (64, 2, 5), (1, 1, 3), (48, 5, 11)])
def test_odd_channel_counts_and_warp_tails(d, m, lq):
    _compare(torch.float32, n=3, lq=lq, m=m, d=d, levels=((5, 7), (3, 2), (1, 1)), p=3, seed=d)


def test_im2col_chunking_gives_identical_results():
    value, shapes, starts, loc, attn = make_inputs(n=4, lq=9, m=2, d=32, dtype=torch.float32, device="cuda")
    whole = msda.MSDeformAttnFunction.apply(value, shapes, starts, loc, attn, 64)
    chunked = msda.MSDeformAttnFunction.apply(value, shapes, starts, loc, attn, 2)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    _compare(torch.float32, im2col_step=2, n=4, lq=9, m=2, d=32)


def test_borders_and_outside_locations_are_zero_padded():
    value, shapes, starts, loc, attn = make_inputs(
        n=1, lq=6, m=1, d=32, levels=((4, 6),), p=2, device="cuda", dtype=torch.float32
    )
    edges = torch.tensor([[0.0, 0.0], [1.0, 1.0], [-0.2, 0.5], [1.2, 0.5], [0.5, -0.125], [0.5, 1.125]], device="cuda")
    loc[0, :, 0, 0, 0] = edges
    loc[0, :, 0, 0, 1] = edges.flip(0)
    out = msda.MSDeformAttnFunction.apply(value, shapes, starts, loc, attn, 64)
    ref = msda.ms_deform_attn_reference(value.double(), shapes, loc.double(), attn.double())
    _close(out, ref, torch.float32, "border output")
    _compare(torch.float32, n=1, lq=64, m=1, d=32, levels=((4, 6),), p=2, loc_range=(-0.5, 1.5))


def test_gradcheck_float64():
    value, shapes, starts, loc, attn = make_inputs(
        n=2, lq=3, m=2, d=4, levels=((3, 4), (2, 2)), p=2, device="cuda", loc_range=(0.02, 0.98)
    )
    inputs = [t.requires_grad_() for t in (value, loc, attn)]
    assert torch.autograd.gradcheck(
        lambda v, sl, a: msda.MSDeformAttnFunction.apply(v, shapes, starts, sl, a, 1),
        inputs,
        eps=1e-6,
        atol=1e-5,
        nondet_tol=1e-10,
    )  # atomic adds: the order of the sums varies


def test_dispatch_uses_cuda_and_module_matches():
    value, shapes, starts, loc, attn = make_inputs(n=2, lq=4, device="cuda", dtype=torch.float32)
    out = msda.MultiScaleDeformableAttention(im2col_step=1)(value, shapes, starts, loc, attn)
    assert out.is_cuda and out.shape == (2, 4, 6)
    _close(
        out, msda.ms_deform_attn_reference(value.double(), shapes, loc.double(), attn.double()), torch.float32, "module"
    )


def test_cuda_errors_are_clear():
    value, shapes, starts, loc, attn = make_inputs(n=2, lq=4, device="cuda", dtype=torch.float32)
    with pytest.raises(ValueError, match="spatial_shapes is on cpu but value is on cuda"):
        msda.ms_deform_attn(value, shapes.cpu(), starts, loc, attn)
    with pytest.raises(RuntimeError, match="sampling_locations must be contiguous"):
        msda.MSDeformAttnFunction.apply(value, shapes, starts, loc.transpose(0, 1), attn, 64)
    with pytest.raises(RuntimeError, match="must share one dtype"):
        msda.MSDeformAttnFunction.apply(value, shapes, starts, loc.half(), attn, 64)


def test_the_op_runs_on_torchs_cuda_runtime():
    """The op is compiled by the base's nvcc 13.3 but links libcudart.so.13 by name; torch loaded its own CUDA 13.0
    runtime first (libtorch_cuda.so's DT_RPATH, searched before LD_LIBRARY_PATH's /usr/local/cuda/lib64), so the
    process holds one libcudart, torch's. Prints it (pytest -s)."""
    value, shapes, starts, loc, attn = make_inputs(n=1, lq=4, device="cuda", dtype=torch.float32)
    msda.ms_deform_attn(value, shapes, starts, loc, attn)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        loaded = loaded_libraries(f.read(), "libcudart")
    print("libcudart loaded:", loaded, "LD_LIBRARY_PATH:", os.environ.get("LD_LIBRARY_PATH", ""))
    torch_nvidia = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia"))
    assert len(loaded) == 1 and os.path.realpath(loaded[0]).startswith(torch_nvidia + os.sep), loaded
