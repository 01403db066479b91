"""Our deformable-attention op as a PyTorch custom operator (trainer/ops/msda/library.py): torch.library's own
checks (schema, fake implementation, autograd registration), gradients equal to autograd through the reference,
and torch.compile tracing it as one node (no graph break), on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.msda_cases import make_inputs
from trainer.ops.msda import ms_deform_attn, ms_deform_attn_reference
from trainer.ops.msda.library import ms_deform_attn_op


def _args(dtype=torch.float64, level_shapes=True, **kw):
    value, shapes, starts, loc, attn = make_inputs(dtype=dtype, **kw)
    flat = [int(x) for x in shapes.flatten()] if level_shapes else []
    return value, shapes, starts, loc, attn, 2, flat


@pytest.mark.parametrize("level_shapes", [True, False])
def test_opcheck_schema_fake_and_autograd_registration(level_shapes):
    value, shapes, starts, loc, attn, step, flat = _args(level_shapes=level_shapes)
    for t in (value, loc, attn):
        t.requires_grad_(True)
    torch.library.opcheck(ms_deform_attn_op, (value, shapes, starts, loc, attn, step, flat))


def test_gradients_equal_autograd_through_the_reference():
    value, shapes, starts, loc, attn, step, flat = _args(n=2, lq=7, m=3, d=4, p=3)
    leaves = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
    ours = ms_deform_attn_op(leaves[0], shapes, starts, leaves[1], leaves[2], step, flat)
    grad_out = torch.randn_like(ours)
    got = torch.autograd.grad(ours, leaves, grad_out)
    ref_leaves = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
    ref = ms_deform_attn_reference(ref_leaves[0], shapes, ref_leaves[1], ref_leaves[2])
    want = torch.autograd.grad(ref, ref_leaves, grad_out)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    for name, g, w in zip(("value", "sampling_locations", "attention_weights"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)
    torch.autograd.gradcheck(
        lambda v, lc, a: ms_deform_attn_op(v, shapes, starts, lc, a, step, flat),
        [t.detach().clone().requires_grad_(True) for t in (value, loc, attn)],
    )


def test_the_entry_point_runs_the_custom_op_and_compiles_without_a_graph_break():
    value, shapes, starts, loc, attn, step, flat = _args(dtype=torch.float32)
    levels = [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]

    def f(v, lc, a):
        return ms_deform_attn(v, shapes, starts, lc, a, 2, level_shapes=levels).square().sum()

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        f(value, loc, attn)
    assert any(e.key == "trainstack::ms_deform_attn" for e in prof.key_averages())

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    leaves = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
    got = compiled(*leaves)
    got.backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
    want = f(*ref_leaves)
    want.backward()
    torch.testing.assert_close(got, want)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad)


def test_reference_graph_traces_standard_operators_with_the_same_values():
    """Under ``reference_graph()`` (the exporters' mode) a trace holds grid_sample and no custom op, the values equal
    the op's, and the custom operator is back once the context ends."""
    from trainer.ops.msda import reference_graph

    value, shapes, starts, loc, attn, step, flat = _args(dtype=torch.float32, n=2, lq=5)
    pairs = [(flat[2 * i], flat[2 * i + 1]) for i in range(len(flat) // 2)]

    def attend(v, sl, aw):
        return ms_deform_attn(v, shapes, starts, sl, aw, step, level_shapes=pairs)

    with reference_graph():
        traced = torch.jit.trace(attend, (value, loc, attn), check_trace=False)
    kinds = {n.kind() for n in traced.graph.nodes()}
    assert "aten::grid_sampler" in kinds and not any(k.startswith("trainstack::") for k in kinds)
    torch.testing.assert_close(
        traced(value, loc, attn), ms_deform_attn_op(value, shapes, starts, loc, attn, step, flat)
    )
    outside = {n.kind() for n in torch.jit.trace(attend, (value, loc, attn), check_trace=False).graph.nodes()}
    assert "trainstack::ms_deform_attn" in outside
