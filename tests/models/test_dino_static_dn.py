"""Static-size denoising part (``dn_max_boxes``): one decoder input shape whatever the batch's
box counts, and the same training signal as upstream's per-batch sizing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models.test_dino import K, inputs, tiny_cfg
from trainer.models.dino import build_dino
from trainer.models.dino.criterion import DinoCriterion, dino_weight_dict
from trainer.models.dino.dn import num_dn_groups, prepare_for_cdn, static_dn_rows
from trainer.models.dino.matcher import HungarianMatcher

pytestmark = pytest.mark.filterwarnings("ignore:ms_deform_attn. using the PyTorch reference:RuntimeWarning")

Q, H = 7, 8  # matching queries, hidden width


def _targets(counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"labels": torch.randint(0, K, (n,), generator=g), "boxes": torch.rand(n, 4, generator=g) * 0.5 + 0.25}
        for n in counts
    ]


def _cdn(targets, max_boxes, dn_number=100, seed=3):
    torch.manual_seed(0)
    enc = nn.Embedding(K + 1, H)
    g = torch.Generator().manual_seed(seed)
    return prepare_for_cdn(targets, dn_number, 0.5, 0.4, Q, K, H, enc, generator=g, max_boxes=max_boxes)


def test_static_rows_bound_every_batch_the_cap_allows():
    assert static_dn_rows(100, 100) == 200 and static_dn_rows(100, 7) == 200 and static_dn_rows(100, 150) == 300
    assert static_dn_rows(0, 30) == 0 and static_dn_rows(100, 0) == 0
    assert static_dn_rows(4, 3) == 2 * 3 * 8  # dn_number < 50: upstream's 2 * dn_number groups of 2 * max_gt
    for dn_number, cap in ((100, 100), (100, 13), (4, 5), (60, 40)):
        worst = max(2 * m * num_dn_groups(dn_number, m) for m in range(cap + 1))
        assert static_dn_rows(dn_number, cap) == worst


@pytest.mark.parametrize("counts", [(1, 3), (7, 2), (0, 0), (2, 100), (120, 1)])
def test_one_shape_for_every_batch_and_the_real_rows_are_upstreams(counts):
    targets = _targets(counts)
    label, bbox, mask, meta = _cdn(targets, max_boxes=100)
    assert label.shape == (2, 200, H) and bbox.shape == (2, 200, 4) and mask.shape == (200 + Q, 200 + Q)
    capped = [{k: v[:100] for k, v in t.items()} for t in targets]
    ref_label, ref_bbox, ref_mask, ref_meta = _cdn(capped, max_boxes=0)
    pad = ref_meta["pad_size"]
    assert meta == {**ref_meta, "padded_size": 200, "max_boxes": 100}
    # the real rows: the same noise draws, bit for bit, as upstream's sizing of the same (capped) boxes
    assert torch.equal(label[:, :pad], ref_label) and torch.equal(bbox[:, :pad], ref_bbox)
    assert (label[:, pad:] == 0).all() and (bbox[:, pad:] == 0).all()  # inert rows
    # the mask: the real rows among themselves as upstream; nobody else sees an inert row and the matching
    # queries see exactly what they saw without the static size
    assert torch.equal(mask[:pad, :pad], ref_mask[:pad, :pad])
    assert torch.equal(mask[200:, 200:], ref_mask[pad:, pad:]) and torch.equal(mask[200:, :pad], ref_mask[pad:, :pad])
    assert mask[:pad, pad:200].all() and mask[200:, pad:200].all()
    assert not mask[pad:200, pad:200].any() and not mask[pad:200, 200:].any()  # inert rows: themselves + queries
    assert not mask[:, 200:].any()  # everyone may see the matching queries
    assert (~mask).any(1).all()  # no row is masked out entirely (no NaN softmax)


def test_the_model_with_a_static_part_computes_the_same_loss():
    """Inert rows change nothing the loss sees: matching outputs, denoising outputs and every loss term agree
    (to float rounding: the attention runs over a longer, masked row) with upstream's per-batch sizing."""
    images, mask, targets = inputs()
    torch.manual_seed(0)
    base = build_dino(tiny_cfg(), num_classes=K).train()
    static = build_dino(tiny_cfg(dn_max_boxes=5), num_classes=K).train()
    static.load_state_dict(base.state_dict())
    torch.manual_seed(7)
    out_base = base(images, mask, targets)
    torch.manual_seed(7)
    out_static = static(images, mask, targets)
    meta = out_static["dn_meta"]
    assert meta["padded_size"] == static_dn_rows(4, 5) > meta["pad_size"] == out_base["dn_meta"]["pad_size"]
    torch.testing.assert_close(out_static["pred_logits"], out_base["pred_logits"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_static["pred_boxes"], out_base["pred_boxes"], rtol=1e-4, atol=1e-5)
    known_s, known_b = meta["output_known_lbs_bboxes"], out_base["dn_meta"]["output_known_lbs_bboxes"]
    torch.testing.assert_close(known_s["pred_logits"], known_b["pred_logits"], rtol=1e-4, atol=1e-5)
    criterion = DinoCriterion(K, HungarianMatcher(2.0, 5.0, 2.0), dino_weight_dict(2))
    loss_b, loss_s = criterion(out_base, targets), criterion(out_static, targets)
    assert loss_s.keys() == loss_b.keys()
    for k in loss_b:
        torch.testing.assert_close(loss_s[k], loss_b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_boxes_past_the_cap_get_no_denoising_query_but_are_still_matched():
    images, mask, _ = inputs()
    targets = _targets((9, 2), seed=5)
    torch.manual_seed(0)
    m = build_dino(tiny_cfg(dn_max_boxes=3, num_queries=20), num_classes=K).train()
    out = m(images, mask, targets)
    meta = out["dn_meta"]
    assert meta["pad_size"] == 2 * 3 * num_dn_groups(4, 3) and meta["padded_size"] == static_dn_rows(4, 3)
    losses = DinoCriterion(K, HungarianMatcher(2.0, 5.0, 2.0), dino_weight_dict(2))(out, targets)
    assert all(torch.isfinite(v) for v in losses.values()) and float(losses["loss_bbox_dn"].detach()) > 0


def test_compiled_layers_see_one_shape_whatever_the_box_counts():
    """The CPU proxy of recompilation, counted: with the static-size part, training steps whose images hold 1, 3 and
    6 boxes compile the encoder and decoder layers once (dynamo's backend "eager": the graphs and guards of
    ``compile: true`` without Inductor's code generation); with upstream's per-batch sizing a new largest box
    count recompiles the decoder layer."""
    from torch._dynamo.utils import counters

    images, mask, _ = inputs()
    graphs = {}
    for cap in (6, 0):
        torch.manual_seed(0)
        m = build_dino(tiny_cfg(dn_max_boxes=cap), num_classes=K).train()
        m(images, mask, _targets((1, 1)))  # eager first: the op's one-time fallback warning is not traced
        for layer in [*m.transformer.encoder.layers, *m.transformer.decoder.layers]:
            layer.compile(backend="eager")
        torch._dynamo.reset()
        counters.clear()
        graphs[cap] = []
        for n in (1, 3, 6):
            out = m(images, mask, _targets((n, 1), seed=n))
            out["pred_boxes"].sum().backward()
            graphs[cap].append(counters["stats"]["unique_graphs"])
        assert dict(counters["graph_break"]) == {}
    assert graphs[6][0] >= 2 and graphs[6] == [graphs[6][0]] * 3  # encoder and decoder layers, once each
    assert graphs[0][-1] > graphs[0][0]  # per-batch sizing: the decoder recompiles for a new box count


def test_compiled_layers_compile_once_per_canvas():
    """``compile: true`` with canvases: over 4 canvases, each seen with two box counts
    and then seen again, the encoder and decoder layers compile once per canvas (the level shapes are Python ints
    the layers specialise on), at most 4 graphs each, never for a new box count or a canvas seen before
    (dynamo's backend "eager", as above)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = build_dino(tiny_cfg(dn_max_boxes=6), num_classes=K).train()
    g = torch.Generator().manual_seed(0)
    canvases = [(96, 128), (128, 96), (128, 128), (96, 160)]

    def step(hw, n):
        images = torch.randn(2, 3, *hw, generator=g)
        mask = torch.zeros(2, *hw, dtype=torch.bool)
        mask[1, hw[0] // 2 :] = True
        m(images, mask, _targets((n, 1), seed=n))["pred_boxes"].sum().backward()

    step(canvases[0], 1)  # eager first: the op's one-time fallback warning is not traced
    for layer in [*m.transformer.encoder.layers, *m.transformer.decoder.layers]:
        layer.compile(backend="eager")
    torch._dynamo.reset()
    counters.clear()
    seen = []
    for hw in canvases:
        for n in (1, 4):
            step(hw, n)
            seen.append(counters["stats"]["unique_graphs"])
    for hw in canvases:  # the same canvases again
        step(hw, 2)
    assert dict(counters["graph_break"]) == {}
    assert seen == [2, 2, 4, 4, 6, 6, 8, 8], seen  # encoder + decoder layer per canvas; a new box count: nothing
    assert counters["stats"]["unique_graphs"] == 2 * len(canvases)
