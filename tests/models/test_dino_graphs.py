"""``cuda_graphs``: DINO's dense part (backbone to heads) replayed from CUDA graphs, one per
canvas. On the CPU: every configuration that cannot be captured is refused in one line, and the dense part is
capture-safe (no host read, no tensor made from host data, after the first call of a shape); the capture itself
and its equality with the eager step run on CUDA only (skipped here)."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_dino import K, tiny_cfg
from trainer.config import ConfigError, load_config
from trainer.engine.distributed import DistInfo
from trainer.models.dino import build_dino
from trainer.models.dino.graphs import GraphedDense
from trainer.tasks import build_task

pytestmark = pytest.mark.filterwarnings("ignore:ms_deform_attn. using the PyTorch reference:RuntimeWarning")

CUDA = torch.cuda.is_available()
OK = {"task": "detection", "data_dir": "d", "canvases": "auto", "dn_max_boxes": 100, "cuda_graphs": True}


@pytest.mark.parametrize(
    "over, world, reason",
    [
        ({"compile": True}, 1, "not with compile: true"),
        ({"canvases": ""}, 1, "needs fixed canvases"),
        ({"dn_max_boxes": 0}, 1, "needs dn_max_boxes > 0 with denoising (dn_number 100)"),
        ({"accumulate_grad_batches": 2}, 1, "needs accumulate_grad_batches 1, got 2"),
        ({}, 2, "runs in one process only, got 2"),
        ({}, 1, "needs a CUDA device, got cpu"),
    ],
)
def test_what_cannot_be_captured_is_refused_in_one_line(over, world, reason):
    cfg = load_config(None, {**OK, **over})
    task = build_task(cfg, DistInfo(0, 0, world, torch.device("cpu")))
    with pytest.raises(ConfigError) as e:
        task.check_config()
    assert str(e.value).startswith(f"cuda_graphs: {reason}") and str(e.value).endswith("train without --cuda-graphs")
    assert "\n" not in str(e.value)


def test_without_denoising_no_dn_max_boxes_is_needed():
    task = build_task(
        load_config(None, {**OK, "dn_number": 0, "dn_max_boxes": 0}), DistInfo(0, 0, 1, torch.device("cpu"))
    )
    with pytest.raises(ConfigError, match="needs a CUDA device"):  # only the device is left to refuse
        task.check_config()


def _inputs(model, counts=(3, 1), size=(128, 192)):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(len(counts), 3, *size, generator=g)
    mask = torch.zeros(len(counts), *size, dtype=torch.bool)
    mask[1, 96:] = True
    targets = [
        {"labels": torch.randint(0, K, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g) * 0.4 + 0.3}
        for n in counts
    ]
    return images, mask, targets


def test_the_dense_part_reads_nothing_from_the_host(monkeypatch):
    """What a CUDA capture forbids, counted on the CPU in a second call of a shape (the first may make and keep
    its constants, as the warm-up before a capture does): no ``.item()`` / ``nonzero`` / ``.tolist()`` /
    ``.numpy()`` / ``.cpu()`` and no tensor made from host data (``torch.tensor``, ``as_tensor``, ``from_numpy``),
    whose host-to-device copy would stop the capture."""
    torch.manual_seed(0)
    model = build_dino(tiny_cfg(dn_max_boxes=10), K).train()
    images, mask, targets = _inputs(model)
    dn = model.denoising_queries(targets)[:3]
    model.dense(images, mask, *dn)
    made = []
    for name in ("tensor", "as_tensor", "from_numpy"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **kw: made.append(_name) or _real(*a, **kw))
    reads = []
    for name in ("item", "tolist", "numpy", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _real=real, _n=name, **kw: reads.append(_n) or _real(self, *a, **kw)
        )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outs = model.dense(images, mask, *dn)
        sum(o.float().sum() for o in outs).backward()
    ops = {e.name for e in prof.events()}
    assert made == [] and reads == []
    assert not ops & {"aten::_local_scalar_dense", "aten::nonzero", "aten::item"}, ops


def test_a_shape_first_seen_in_inference_mode_still_trains():
    """The kept level tensors of a shape first seen under ``torch.inference_mode`` (an evaluation) must serve a
    training step's backward at the same shape (autograd cannot save inference tensors)."""
    torch.manual_seed(0)
    model = build_dino(tiny_cfg(dn_max_boxes=10), K)
    images, mask, targets = _inputs(model)
    with torch.inference_mode():
        model.eval()(images, mask)
    out = model.train()(images, mask, targets)
    (out["pred_boxes"].sum() + out["pred_logits"].sum()).backward()
    assert model.transformer.level_embed.grad is not None


def test_pack_of_dense_is_the_forward():
    """``forward`` = ``denoising_queries`` (eager) + ``dense`` (what is captured) + ``pack``: the same dict."""
    torch.manual_seed(0)
    model = build_dino(tiny_cfg(dn_max_boxes=10), K).train()
    images, mask, targets = _inputs(model)
    torch.manual_seed(5)
    ref = model(images, mask, targets)
    torch.manual_seed(5)
    label, bbox, attn, meta = model.denoising_queries(targets)
    got = model.pack(model.dense(images, mask, label, bbox, attn), meta)
    plain = lambda m: {k: v for k, v in m.items() if k != "output_known_lbs_bboxes"}  # noqa: E731
    assert got.keys() == ref.keys() and plain(meta) == plain(ref["dn_meta"])
    for key in ("pred_logits", "pred_boxes"):
        assert torch.equal(got[key], ref[key])
        assert torch.equal(
            got["dn_meta"]["output_known_lbs_bboxes"][key], ref["dn_meta"]["output_known_lbs_bboxes"][key]
        )


def test_past_max_graphs_new_shapes_run_eagerly_with_one_notice():
    torch.manual_seed(0)
    model = build_dino(tiny_cfg(dn_max_boxes=10), K).train()
    lines = []
    graphs = GraphedDense(model, max_graphs=0, log=lines.append)
    images, mask, targets = _inputs(model)
    dn = model.denoising_queries(targets)[:3]
    for _ in range(2):
        out = graphs(images, mask, *dn)
        assert all(torch.equal(a, b) for a, b in zip(out, model.dense(images, mask, *dn)))
    assert lines == ["cuda_graphs: 0 shapes captured; new shapes run eagerly"] and graphs.graphs == {}


def test_one_capture_per_signature_with_make_graphed_callables_calling_convention(monkeypatch):
    """The capture path on the CPU, with ``torch.cuda.make_graphed_callables`` replaced by a stand-in that keeps its
    contract (one callable: ``sample_args`` is the flat tuple of tensors the warm-up calls it with; autocast's
    cache off): one capture per canvas and ``requires_grad`` signature, none for a canvas seen before."""
    calls = []

    def fake(module, sample_args, allow_unused_input=False):
        assert isinstance(sample_args, tuple) and all(isinstance(t, torch.Tensor) for t in sample_args)
        assert not torch.is_autocast_cache_enabled()
        assert all(a.grad_fn is None for a in sample_args)  # detached copies, not the step's tensors
        calls.append([tuple(t.shape) for t in sample_args])
        module(*sample_args)  # the warm-up's call
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake)
    torch.manual_seed(0)
    model = build_dino(tiny_cfg(dn_max_boxes=10), K).train()
    lines = []
    graphs = GraphedDense(model, log=lines.append)
    for size, counts in (((128, 192), (3, 1)), ((192, 128), (2, 5)), ((128, 192), (1, 1))):
        images, mask, targets = _inputs(model, counts, size)
        dn = model.denoising_queries(targets)[:3]
        out = graphs(images, mask, *dn)
        assert len(out) == 5 and out[0].shape[:2] == (2, 2)  # (n_dec, B, pad + Q, K)
    assert [c[0] for c in calls] == [(2, 3, 128, 192), (2, 3, 192, 128)] and len(graphs.graphs) == 2
    assert lines == [
        f"cuda_graphs: capturing the forward and backward for input 2x3x{h}x{w}" for h, w in ((128, 192), (192, 128))
    ]


@pytest.mark.skipif(not CUDA, reason="needs CUDA (graph capture)")
@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_a_graphed_step_equals_the_eager_step_on_cuda(precision):
    """Two canvases, each captured once and replayed: the same outputs and parameter gradients as eager."""
    torch.manual_seed(0)
    model = build_dino(tiny_cfg(dn_max_boxes=10), K).cuda().train()
    lines = []
    graphs = GraphedDense(model, log=lines.append)
    for size, counts in (((128, 192), (3, 1)), ((192, 128), (2, 5)), ((128, 192), (1, 1)), ((192, 128), (4, 0))):
        images, mask, targets = _inputs(model, counts, size)
        images, mask = images.cuda(), mask.cuda()
        targets = [{k: v.cuda() for k, v in t.items()} for t in targets]
        dn = model.denoising_queries(targets)[:3]
        results = []
        for run in (model.dense, graphs):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=precision or torch.float32, enabled=precision is not None):
                outs = run(images, mask, *(d.detach().requires_grad_(d.requires_grad) for d in dn))
            loss = sum((o.float() ** 2).mean() for o in outs if o.requires_grad)
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            results.append(([o.detach().clone() for o in outs], grads))
        (eager_out, eager_g), (graph_out, graph_g) = results
        tol = dict(rtol=1e-5, atol=1e-5) if precision is None else dict(rtol=2e-2, atol=2e-2)
        for a, b in zip(eager_out, graph_out):
            torch.testing.assert_close(a, b, **tol)
        assert len(eager_g) == len(graph_g)
        for a, b in zip(eager_g, graph_g):
            torch.testing.assert_close(a, b, **tol)
    assert len(graphs.graphs) == 2 and sum("capturing" in line for line in lines) == 2
