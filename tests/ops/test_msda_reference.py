"""Multi-scale deformable attention on CPU: the PyTorch reference against an explicit float64 loop, gradcheck,
shapes and dtypes, the automatic fallback with one warning, and the clear errors for bad inputs."""

from __future__ import annotations

import warnings

import pytest
import torch
from msda_cases import make_inputs, naive_msda

from trainer.ops import msda
from trainer.ops.msda import extension as msda_extension
from trainer.ops.msda import function as msda_function


@pytest.fixture(autouse=True)
def _fresh_warning_flag(monkeypatch):
    monkeypatch.setattr(msda_function, "_warned", False)


@pytest.mark.parametrize(
    "seed,levels,p", [(0, ((4, 5), (2, 3), (1, 1)), 2), (1, ((7, 3),), 4), (2, ((3, 6), (5, 2)), 1)]
)
def test_reference_matches_explicit_bilinear_loop(seed, levels, p):
    value, shapes, starts, loc, attn = make_inputs(levels=levels, p=p, seed=seed)
    got = msda.ms_deform_attn_reference(value, shapes, loc, attn)
    torch.testing.assert_close(got, naive_msda(value, shapes, loc, attn), rtol=1e-12, atol=1e-12)


def test_reference_zero_outside_and_exact_at_pixel_centres():
    value, shapes, starts, loc, attn = make_inputs(n=1, lq=1, m=1, d=2, levels=((2, 3),), p=2)
    loc[..., 0, :] = torch.tensor([1.6, -0.6], dtype=torch.float64)  # beyond the half-pixel border: zero
    loc[..., 1, :] = torch.tensor([(2 + 0.5) / 3, (1 + 0.5) / 2], dtype=torch.float64)  # centre of pixel (1, 2)
    attn[...] = 0.0
    attn[..., 0] = 5.0
    attn[..., 1] = 1.0
    out = msda.ms_deform_attn_reference(value, shapes, loc, attn)
    torch.testing.assert_close(out[0, 0], value[0, 1 * 3 + 2, 0], rtol=1e-12, atol=1e-12)


def test_shapes_and_dtypes_through_the_module():
    mod = msda.MultiScaleDeformableAttention(im2col_step=2)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        value, shapes, starts, loc, attn = make_inputs(n=4, lq=7, m=3, d=5, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out = mod(value, shapes, starts, loc, attn)
        assert out.shape == (4, 7, 15) and out.dtype == dtype and out.is_contiguous()
        want = naive_msda(value, shapes, loc, attn)
        tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_gradcheck_reference():
    value, shapes, starts, loc, attn = make_inputs(
        n=1, lq=3, m=2, d=2, levels=((3, 4), (2, 2)), p=2, loc_range=(0.02, 0.98)
    )
    inputs = [t.requires_grad_() for t in (value, loc, attn)]
    assert torch.autograd.gradcheck(
        lambda v, sl, a: msda.ms_deform_attn_reference(v, shapes, sl, a), inputs, eps=1e-6, atol=1e-5
    )


def test_cpu_falls_back_to_reference_with_one_warning():
    value, shapes, starts, loc, attn = make_inputs()
    with pytest.warns(RuntimeWarning, match="PyTorch reference") as record:
        first = msda.ms_deform_attn(value, shapes, starts, loc, attn)
        second = msda.ms_deform_attn(value, shapes, starts, loc, attn, im2col_step=1)
    assert len([w for w in record if "ms_deform_attn" in str(w.message)]) == 1
    torch.testing.assert_close(first, msda.ms_deform_attn_reference(value, shapes, loc, attn), rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert msda.ms_deform_attn_core_pytorch is msda.ms_deform_attn_reference  # DINO's name


def test_level_shapes_give_the_same_result_without_reading_the_shape_tensors():
    """``level_shapes`` (Python ints, as DINO passes them): same output, no device->host copy, so the op also runs
    on shape-only tensors (FakeTensorMode, plan's memory prediction); a level count that disagrees is named."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    value, shapes, starts, loc, attn = make_inputs(levels=((4, 5), (2, 3)))
    pairs = [tuple(hw) for hw in shapes.tolist()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = msda.ms_deform_attn(value, shapes, starts, loc, attn)
        torch.testing.assert_close(msda.ms_deform_attn(value, shapes, starts, loc, attn, level_shapes=pairs), want)
        with pytest.raises(ValueError, match="level_shapes has 1 levels, spatial_shapes 2"):
            msda.ms_deform_attn(value, shapes, starts, loc, attn, level_shapes=pairs[:1])
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(t) for t in (value, shapes, starts, loc, attn)]
            out = msda.ms_deform_attn(*fake, level_shapes=pairs)
    assert out.shape == want.shape and out.dtype == want.dtype


def test_cuda_kernel_stand_in_allocates_what_the_kernels_return_on_shape_only_tensors():
    """Under ``cuda_kernel_stand_in`` fake inputs get the kernels' output and gradient shapes and dtypes (bf16
    in, bf16 gradients out), while tensors with values still run the reference unchanged."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    value, shapes, starts, loc, attn = make_inputs(levels=((4, 5), (2, 3)))
    value, loc, attn = (t.to(torch.bfloat16).requires_grad_() for t in (value, loc, attn))
    with warnings.catch_warnings(), msda.cuda_kernel_stand_in():
        warnings.simplefilter("ignore", RuntimeWarning)
        real = msda.ms_deform_attn(value, shapes, starts, loc, attn)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [mode.from_tensor(t) for t in (value, loc, attn)]
            out = msda.ms_deform_attn(fake[0], shapes, starts, fake[1], fake[2], level_shapes=[(4, 5), (2, 3)])
            grads = torch.autograd.grad(out.float().sum(), fake)
    assert out.shape == real.shape and out.dtype == real.dtype == torch.bfloat16
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, torch.bfloat16) for t in (value, loc, attn)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.testing.assert_close(real, msda.ms_deform_attn(value, shapes, starts, loc, attn), rtol=0, atol=0)


def _bad(name):
    """Valid inputs as a dict with one entry replaced by ``name``'s mutation."""
    value, shapes, starts, loc, attn = make_inputs(
        n=4, lq=3, m=2, d=4, levels=((4, 5), (2, 3)), p=2, dtype=torch.float32
    )
    args = dict(
        value=value,
        spatial_shapes=shapes,
        level_start_index=starts,
        sampling_locations=loc,
        attention_weights=attn,
        im2col_step=64,
    )
    mutations = {
        "value_3d": ("value", value[0]),
        "value_int": ("value", value.to(torch.int32)),
        "loc_dtype": ("sampling_locations", loc.double()),
        "attn_shape": ("attention_weights", attn[..., :1].contiguous()),
        "loc_last_dim": ("sampling_locations", loc[..., :1].contiguous()),
        "loc_levels": ("sampling_locations", loc[:, :, :, :1].contiguous()),
        "shapes_float": ("spatial_shapes", shapes.float()),
        "shapes_1d": ("spatial_shapes", shapes.flatten()),
        "starts_len": ("level_start_index", starts[:1].contiguous()),
        "starts_wrong": ("level_start_index", starts + 1),
        "s_mismatch": ("value", value[:, 1:].contiguous()),
        "non_contiguous": ("value", value.transpose(2, 3).contiguous().transpose(2, 3)),
        "non_tensor": ("attention_weights", attn.tolist()),
        "im2col_zero": ("im2col_step", 0),
        "im2col_divide": ("im2col_step", 3),
    }
    key, replacement = mutations[name]
    args[key] = replacement
    return args


@pytest.mark.parametrize(
    "case,error,pattern",
    [
        ("value_3d", ValueError, r"value must be \(N, S, M, D\)"),
        ("value_int", TypeError, "value must be float32, float64, float16 or bfloat16, got torch.int32"),
        ("attn_shape", ValueError, r"attention_weights must be \(N, Lq, M, L, P\) = \(4, 3, 2, 2, 2\)"),
        ("loc_last_dim", ValueError, r"sampling_locations must be \(N, Lq, M, L, P, 2\)"),
        ("loc_levels", ValueError, r"sampling_locations must be .*got shape \(4, 3, 2, 1, 2, 2\)"),
        ("shapes_float", TypeError, "spatial_shapes must be int64, got torch.float32"),
        ("shapes_1d", ValueError, r"spatial_shapes must be \(L, 2\)"),
        ("starts_len", ValueError, r"level_start_index must be \(L,\) = \(2,\)"),
        ("starts_wrong", ValueError, r"level_start_index must be \[0, 20\]"),
        ("s_mismatch", ValueError, r"value has S=25 positions but spatial_shapes give sum\(H\*W\)=26"),
        ("non_contiguous", ValueError, "value must be contiguous"),
        ("non_tensor", TypeError, "attention_weights must be a torch.Tensor, got list"),
        ("im2col_zero", ValueError, "im2col_step must be an int >= 1, got 0"),
        ("im2col_divide", ValueError, r"im2col_step \(3\) must divide the batch size N \(4\)"),
    ],
)
def test_clear_errors(case, error, pattern):
    with pytest.raises(error, match=pattern):
        msda.ms_deform_attn(**_bad(case))


@pytest.mark.filterwarnings("ignore:ms_deform_attn. using the PyTorch reference")
def test_mixed_dtypes_are_checked_strictly_but_promoted_by_the_entry_point():
    """The Function's contract is one dtype; the public entry promotes autocast's bf16 value + fp32 locations."""
    args = _bad("im2col_divide")
    args["im2col_step"] = 64
    strict = dict(args, sampling_locations=args["sampling_locations"].double())
    with pytest.raises(TypeError, match="sampling_locations is torch.float64 but value is torch.float32"):
        msda.check_inputs(**strict)
    mixed = dict(args, value=args["value"].bfloat16())
    out = msda.ms_deform_attn(**mixed)
    assert out.dtype == torch.float32
    expected = msda.ms_deform_attn_reference(
        args["value"].bfloat16().float(), args["spatial_shapes"], args["sampling_locations"], args["attention_weights"]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_device_mismatch_is_named():
    args = _bad("im2col_divide")
    args["im2col_step"] = 64
    args["level_start_index"] = args["level_start_index"].to("meta")
    with pytest.raises(ValueError, match="level_start_index is on meta but value is on cpu"):
        msda.ms_deform_attn(**args)


def test_function_without_extension_raises_clearly(monkeypatch):
    monkeypatch.setattr(msda_extension, "_ext", None)
    monkeypatch.setattr(msda_extension, "_ext_error", "CUDA extension not built (test)")
    value, shapes, starts, loc, attn = make_inputs()
    with pytest.raises(RuntimeError, match="MSDeformAttnFunction: CUDA extension not built"):
        msda.MSDeformAttnFunction.apply(value, shapes, starts, loc, attn, 64)
