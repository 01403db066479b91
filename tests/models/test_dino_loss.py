"""DINO matcher, criterion and post-processing (trainer/models/dino/{matcher,criterion,postprocess}.py), on CPU."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
from torchvision.ops import box_convert, generalized_box_iou

from trainer.models.dino.criterion import DinoCriterion, dino_weight_dict, dn_positive_indices
from trainer.models.dino.matcher import HungarianMatcher
from trainer.models.dino.postprocess import PostProcess

NUM_CLASSES = 7
NUM_LAYERS = 3  # final + 2 aux


def _matcher() -> HungarianMatcher:
    return HungarianMatcher(cost_class=2.0, cost_bbox=5.0, cost_giou=2.0, focal_alpha=0.25)


def _criterion(losses=("labels", "boxes"), weight_dict=None) -> DinoCriterion:
    wd = weight_dict if weight_dict is not None else dino_weight_dict(num_decoder_layers=NUM_LAYERS)
    return DinoCriterion(NUM_CLASSES, _matcher(), wd, focal_alpha=0.25, losses=losses)


def _rand_boxes(*shape, gen) -> torch.Tensor:
    cxcy = torch.rand(*shape, 2, generator=gen) * 0.6 + 0.2
    wh = torch.rand(*shape, 2, generator=gen) * 0.3 + 0.05
    return torch.cat([cxcy, wh], -1)


def _targets(sizes, gen) -> list[dict]:
    return [
        {"labels": torch.randint(0, NUM_CLASSES, (n,), generator=gen), "boxes": _rand_boxes(n, gen=gen)} for n in sizes
    ]


def _head(bs, q, gen, requires_grad=False) -> dict:
    logits = torch.randn(bs, q, NUM_CLASSES, generator=gen).requires_grad_(requires_grad)
    boxes = _rand_boxes(bs, q, gen=gen).requires_grad_(requires_grad)
    return {"pred_logits": logits, "pred_boxes": boxes}


def _outputs(targets, q=12, gen=None, dn=True, groups=2, requires_grad=False) -> dict:
    """A synthetic DINO output dict: final layer, NUM_LAYERS - 1 aux layers, encoder proposals, optional dn part."""
    bs = len(targets)
    out = _head(bs, q, gen, requires_grad)
    out["aux_outputs"] = [_head(bs, q, gen, requires_grad) for _ in range(NUM_LAYERS - 1)]
    out["interm_outputs"] = _head(bs, q, gen, requires_grad)
    out["dn_meta"] = None
    max_n = max(int(t["labels"].numel()) for t in targets)
    if dn and max_n > 0:
        pad = 2 * max_n * groups
        known = _head(bs, pad, gen, requires_grad)
        known["aux_outputs"] = [_head(bs, pad, gen, requires_grad) for _ in range(NUM_LAYERS - 1)]
        out["dn_meta"] = {"pad_size": pad, "num_dn_group": groups, "output_known_lbs_bboxes": known}
    return out


# --- matcher ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_matcher_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    q = 5
    sizes = [1 + seed % 4, 4 - seed % 4]
    targets = _targets(sizes, gen)
    outputs = _head(len(sizes), q, gen)
    matcher = _matcher()
    result = matcher(outputs, targets)
    for i, (t, (src, tgt)) in enumerate(zip(targets, result)):
        n = len(t["labels"])
        assert src.dtype == tgt.dtype == torch.int64 and len(src) == len(tgt) == n
        assert len(set(src.tolist())) == n and sorted(tgt.tolist()) == list(range(n))
        cost = matcher.cost_matrix(outputs["pred_logits"][i], outputs["pred_boxes"][i], t["labels"], t["boxes"])
        got = cost[src, tgt].sum().item()
        best = min(sum(cost[p[j], j].item() for j in range(n)) for p in itertools.permutations(range(q), n))
        assert got == pytest.approx(best, abs=1e-5)


def test_matcher_cost_formula_by_hand():
    matcher = _matcher()
    logits = torch.tensor([[0.3, -1.2]])
    box = torch.tensor([[0.5, 0.5, 0.2, 0.2]])
    tgt_box = torch.tensor([[0.6, 0.5, 0.2, 0.2]])
    p = torch.sigmoid(torch.tensor(-1.2)).item()
    pos = 0.25 * (1 - p) ** 2 * -math.log(p + 1e-8)
    neg = 0.75 * p**2 * -math.log(1 - p + 1e-8)
    # L1 = 0.1; GIoU of [.4,.4,.6,.6] vs [.5,.4,.7,.6] = (0.02 / 0.06) - 0 = 1/3 (enclosing box == union)
    expected = 2.0 * (pos - neg) + 5.0 * 0.1 + 2.0 * -(1 / 3)
    got = matcher.cost_matrix(logits, box, torch.tensor([1]), tgt_box)
    assert got.shape == (1, 1) and got.item() == pytest.approx(expected, abs=1e-5)


def test_matcher_empty_targets():
    gen = torch.Generator().manual_seed(0)
    outputs = _head(3, 4, gen)
    targets = _targets([2, 0, 3], gen)
    result = _matcher()(outputs, targets)
    assert [len(s) for s, _ in result] == [2, 0, 3]
    assert result[1][0].dtype == result[1][1].dtype == torch.int64
    all_empty = _matcher()(outputs, _targets([0, 0, 0], gen))
    assert all(len(s) == 0 and len(t) == 0 and s.dtype == torch.int64 for s, t in all_empty)


def test_matcher_more_targets_than_queries_is_an_error():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="only 3 queries"):
        _matcher()(_head(1, 3, gen), _targets([4], gen))


def test_matcher_non_finite_cost_is_an_error():
    gen = torch.Generator().manual_seed(0)
    outputs = _head(1, 3, gen)
    outputs["pred_boxes"][0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        _matcher()(outputs, _targets([2], gen))


# --- criterion: box and class terms -------------------------------------------------------------------------


def _single(pred_box, tgt_box, logits=None):
    logits = torch.zeros(1, 1, NUM_CLASSES) if logits is None else logits
    outputs = {"pred_logits": logits, "pred_boxes": torch.tensor([[pred_box]]), "dn_meta": None}
    targets = [{"labels": torch.tensor([2]), "boxes": torch.tensor([tgt_box])}]
    return outputs, targets


def test_box_losses_by_hand():
    crit = _criterion(
        losses=("boxes",), weight_dict={"loss_bbox": 1.0, "loss_giou": 1.0, "loss_bbox_dn": 1.0, "loss_giou_dn": 1.0}
    )
    tgt = [0.5, 0.5, 0.2, 0.2]
    perfect = crit(*_single(tgt, tgt))
    assert perfect["loss_bbox"].item() == 0.0
    assert perfect["loss_giou"].item() == pytest.approx(0.0, abs=1e-5)
    # shifted right by half a width: L1 0.1; IoU 0.02/0.06 = 1/3, enclosing box = union -> 1 - GIoU = 2/3
    shifted = crit(*_single([0.6, 0.5, 0.2, 0.2], tgt))
    assert shifted["loss_bbox"].item() == pytest.approx(0.1, abs=1e-6)
    assert shifted["loss_giou"].item() == pytest.approx(2 / 3, abs=1e-5)
    # disjoint: L1 0.3; IoU 0, union 0.08, enclosing 0.5 x 0.2 = 0.1 -> GIoU -0.2 -> loss 1.2
    disjoint = crit(*_single([0.8, 0.5, 0.2, 0.2], tgt))
    assert disjoint["loss_bbox"].item() == pytest.approx(0.3, abs=1e-6)
    assert disjoint["loss_giou"].item() == pytest.approx(1.2, abs=1e-5)
    # weights are applied
    crit.weight_dict.update({"loss_bbox": 5.0, "loss_giou": 2.0})
    weighted = crit(*_single([0.6, 0.5, 0.2, 0.2], tgt))
    assert weighted["loss_bbox"].item() == pytest.approx(0.5, abs=1e-5)
    assert weighted["loss_giou"].item() == pytest.approx(4 / 3, abs=1e-5)


def test_focal_loss_decreases_as_target_logit_rises_and_matches_upstream_scale():
    crit = _criterion(losses=("labels",), weight_dict={"loss_ce": 1.0, "loss_ce_dn": 1.0})
    values = []
    for z in (-4.0, -1.0, 0.0, 2.0, 5.0):
        logits = torch.full((1, 1, NUM_CLASSES), -3.0)
        logits[0, 0, 2] = z
        values.append(crit(*_single([0.5, 0.5, 0.2, 0.2], [0.5, 0.5, 0.2, 0.2], logits))["loss_ce"].item())
    assert all(a > b for a, b in zip(values, values[1:]))
    # upstream: FL(...).mean(1).sum() / num_boxes * Q, i.e. the plain sum here (Q = 1, num_boxes = 1)
    p_pos, p_neg = torch.sigmoid(torch.tensor(5.0)).item(), torch.sigmoid(torch.tensor(-3.0)).item()
    expected = 0.25 * (1 - p_pos) ** 2 * -math.log(p_pos) + (NUM_CLASSES - 1) * 0.75 * p_neg**2 * -math.log(1 - p_neg)
    assert values[-1] == pytest.approx(expected, rel=1e-5)


def _upstream_style_reference(outputs, targets, indices, alpha=0.25):
    """Independent re-statement of upstream SetCriterion's formulas (one-hot with a background column dropped,
    ``FL.mean(1).sum() / num_boxes * Q``, diagonal of the pairwise GIoU)."""
    logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
    bs, q, c = logits.shape
    num_boxes = max(sum(len(t["labels"]) for t in targets), 1)
    cls = torch.full((bs, q), c, dtype=torch.int64)
    for b, (s, j) in enumerate(indices):
        cls[b, s] = targets[b]["labels"][j]
    onehot = torch.nn.functional.one_hot(cls, c + 1)[..., :c].float()
    prob = logits.sigmoid()
    ce = torch.nn.functional.binary_cross_entropy_with_logits(logits, onehot, reduction="none")
    p_t = prob * onehot + (1 - prob) * (1 - onehot)
    fl = (alpha * onehot + (1 - alpha) * (1 - onehot)) * ce * (1 - p_t) ** 2
    loss_ce = fl.mean(1).sum() / num_boxes * q
    src = torch.cat([boxes[b, s] for b, (s, _) in enumerate(indices)])
    tgt = torch.cat([targets[b]["boxes"][j] for b, (_, j) in enumerate(indices)])
    loss_bbox = (src - tgt).abs().sum() / num_boxes
    giou = torch.diag(generalized_box_iou(box_convert(src, "cxcywh", "xyxy"), box_convert(tgt, "cxcywh", "xyxy")))
    return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": (1 - giou).sum() / num_boxes}


def test_main_terms_match_upstream_formulas():
    gen = torch.Generator().manual_seed(3)
    targets = _targets([3, 0, 2], gen)
    outputs = _outputs(targets, gen=gen, dn=False)
    crit = _criterion(weight_dict={k: 1.0 for k in dino_weight_dict(NUM_LAYERS)})
    got = crit(outputs, targets)
    ref = _upstream_style_reference(outputs, targets, _matcher()(outputs, targets))
    for k, v in ref.items():
        assert got[k].item() == pytest.approx(v.item(), rel=1e-5, abs=1e-6), k


def test_num_boxes_normalisation_is_per_batch_total():
    gen = torch.Generator().manual_seed(4)
    targets = _targets([2, 1], gen)
    outputs = _outputs(targets, gen=gen, dn=False)
    crit = _criterion()
    single = crit(outputs, targets)
    doubled = {k: torch.cat([v, v]) for k, v in outputs.items() if k in ("pred_logits", "pred_boxes")}
    doubled["dn_meta"] = None
    twice = crit(doubled, targets + targets)  # twice the boxes, twice the sum: same mean
    for k in ("loss_ce", "loss_bbox", "loss_giou"):
        assert twice[k].item() == pytest.approx(single[k].item(), rel=1e-5)


def test_num_boxes_all_reduced_in_a_process_group(tmp_path):
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    gen = torch.Generator().manual_seed(5)
    targets = _targets([2, 3], gen)
    outputs = _outputs(targets, gen=gen)
    expected = _criterion()(outputs, targets)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        got = _criterion()(outputs, targets)
    finally:
        dist.destroy_process_group()
    for k, v in expected.items():
        assert got[k].item() == pytest.approx(v.item(), rel=1e-6), k


# --- denoising ----------------------------------------------------------------------------------------------


def test_dn_positive_indices_layout():
    # 2 groups, at most 2 targets per image -> single_pad = 4: [pos0, pos1, neg0, neg1] per group
    targets = [
        {"labels": torch.tensor([3, 5])},
        {"labels": torch.tensor([1])},
        {"labels": torch.zeros(0, dtype=torch.int64)},
    ]
    idx = dn_positive_indices({"pad_size": 8, "num_dn_group": 2}, targets)
    assert idx[0][0].tolist() == [0, 1, 4, 5] and idx[0][1].tolist() == [0, 1, 0, 1]
    assert idx[1][0].tolist() == [0, 4] and idx[1][1].tolist() == [0, 0]
    assert idx[2][0].numel() == 0 and idx[2][0].dtype == torch.int64
    with pytest.raises(ValueError):
        dn_positive_indices({"pad_size": 7, "num_dn_group": 2}, targets)


def test_dn_losses_use_exactly_the_positive_queries():
    gen = torch.Generator().manual_seed(6)
    targets = _targets([2, 1], gen)
    outputs = _outputs(targets, gen=gen, groups=2)
    known = outputs["dn_meta"]["output_known_lbs_bboxes"]
    # put the targets exactly at the positive slots of the last dn layer; negatives and padding stay random
    for b, (q, j) in enumerate(dn_positive_indices(outputs["dn_meta"], targets)):
        known["pred_boxes"][b, q] = targets[b]["boxes"][j]
    crit = _criterion()
    base = crit(outputs, targets)
    assert base["loss_bbox_dn"].item() == 0.0
    assert base["loss_giou_dn"].item() == pytest.approx(0.0, abs=1e-5)
    assert base["loss_bbox_dn_0"].item() > 0
    # a negative / padding slot changes the class term (it is background) but never the box terms
    known["pred_boxes"][0, 2] = torch.tensor([0.1, 0.1, 0.05, 0.05])  # negative of target 0, group 0
    known["pred_boxes"][1, 1] = torch.tensor([0.9, 0.9, 0.05, 0.05])  # padding of image 1 (1 target)
    moved = crit(outputs, targets)
    assert moved["loss_bbox_dn"].item() == 0.0
    # moving a positive does change them, normalised by num_boxes * num_dn_group = 3 * 2
    known["pred_boxes"][1, 4, 0] += 0.06  # image 1, group 1, target 0
    shifted = crit(outputs, targets)
    assert shifted["loss_bbox_dn"].item() == pytest.approx(5.0 * 0.06 / 6, rel=1e-4)


def _expected_keys() -> set[str]:
    return set(dino_weight_dict(num_decoder_layers=NUM_LAYERS))


@pytest.mark.parametrize(
    "sizes,dn", [([2, 3], True), ([2, 3], False), ([2, 0], True), ([0, 0], True), ([0, 0], False), ([1], True)]
)
def test_all_keys_present_and_finite(sizes, dn):
    gen = torch.Generator().manual_seed(7)
    targets = _targets(sizes, gen)
    outputs = _outputs(targets, gen=gen, dn=dn)
    losses = _criterion()(outputs, targets)
    assert set(losses) == _expected_keys()
    for k, v in losses.items():
        assert v.dtype == torch.float32 and v.dim() == 0 and torch.isfinite(v), k
    if outputs["dn_meta"] is None:
        assert all(v.item() == 0.0 for k, v in losses.items() if "_dn" in k)
    else:
        assert all(v.item() > 0.0 for k, v in losses.items() if "_dn" in k)
    if sum(sizes) == 0:
        assert losses["loss_bbox"].item() == 0.0 and losses["loss_ce"].item() > 0  # all queries are background
    assert torch.isfinite(DinoCriterion.total(losses))


def test_missing_weight_is_an_error():
    gen = torch.Generator().manual_seed(8)
    targets = _targets([1], gen)
    crit = _criterion(weight_dict=dino_weight_dict(num_decoder_layers=NUM_LAYERS, two_stage=False))
    with pytest.raises(KeyError, match="interm"):
        crit(_outputs(targets, gen=gen), targets)


def test_weights_follow_dino_4scale():
    w = dino_weight_dict()
    assert (w["loss_ce"], w["loss_bbox"], w["loss_giou"]) == (1.0, 5.0, 2.0)
    assert (w["loss_ce_dn_4"], w["loss_bbox_dn_4"], w["loss_giou_dn_4"]) == (1.0, 5.0, 2.0)
    assert (w["loss_ce_interm"], w["loss_bbox_interm"], w["loss_giou_interm"]) == (1.0, 5.0, 2.0)
    assert "loss_ce_5" not in w and "loss_ce_dn_interm" not in w
    assert len(w) == 6 * 6 + 3
    no_dn = dino_weight_dict(use_dn=False)
    assert set(no_dn) == set(w) and no_dn["loss_bbox_dn"] == no_dn["loss_giou_dn_2"] == 0.0
    assert no_dn["loss_bbox_2"] == 5.0


def test_without_dn_weights_dn_terms_are_logged_but_not_counted():
    gen = torch.Generator().manual_seed(13)
    targets = _targets([2, 1], gen)
    outputs = _outputs(targets, gen=gen)  # even if a dn part came through, use_dn=False weighs it 0
    crit = _criterion(weight_dict=dino_weight_dict(num_decoder_layers=NUM_LAYERS, use_dn=False))
    losses = crit(outputs, targets)
    assert set(losses) == _expected_keys()
    assert all(v.item() == 0.0 for k, v in losses.items() if "_dn" in k)


def test_gradients_flow_to_logits_and_boxes():
    gen = torch.Generator().manual_seed(9)
    targets = _targets([2, 1], gen)
    outputs = _outputs(targets, gen=gen, requires_grad=True)
    crit = _criterion()
    DinoCriterion.total(crit(outputs, targets)).backward()
    known = outputs["dn_meta"]["output_known_lbs_bboxes"]
    heads = [outputs, outputs["interm_outputs"], known, *outputs["aux_outputs"], *known["aux_outputs"]]
    for head in heads:
        for key in ("pred_logits", "pred_boxes"):
            g = head[key].grad
            assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, key


def test_float32_under_autocast_with_bf16_inputs():
    gen = torch.Generator().manual_seed(10)
    targets = _targets([2, 1], gen)
    outputs = _outputs(targets, gen=gen)
    ref = _criterion()(outputs, targets)

    def to_bf16(x):
        if isinstance(x, torch.Tensor):
            return x.to(torch.bfloat16) if x.is_floating_point() else x
        if isinstance(x, dict):
            return {k: to_bf16(v) for k, v in x.items()}
        if isinstance(x, list):
            return [to_bf16(v) for v in x]
        return x

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _criterion()(to_bf16(outputs), targets)
    for k, v in got.items():
        assert v.dtype == torch.float32, k
        assert v.item() == pytest.approx(ref[k].item(), rel=0.05, abs=1e-2), k


def test_unknown_loss_and_bad_labels_are_errors():
    with pytest.raises(ValueError, match="unknown losses"):
        _criterion(losses=("labels", "masks"))
    gen = torch.Generator().manual_seed(11)
    targets = _targets([2], gen)
    targets[0]["labels"][1] = NUM_CLASSES
    with pytest.raises(ValueError, match="labels must lie"):
        _criterion()(_outputs(targets, gen=gen), targets)


# --- post-processing ----------------------------------------------------------------------------------------


def test_postprocess_topk_by_hand():
    logits = torch.full((2, 3, 4), -10.0)
    logits[0, 1, 2] = 3.0  # best of image 0: query 1, class 2
    logits[0, 2, 0] = 1.0  # second: query 2, class 0
    logits[0, 1, 3] = 0.0  # third: query 1 again, class 3
    logits[1, 0, 1] = 2.0
    boxes = torch.tensor(
        [
            [[0.5, 0.5, 0.2, 0.2], [0.25, 0.5, 0.5, 1.0], [0.5, 0.25, 1.0, 0.5]],
            [[0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 0.1, 0.1], [0.5, 0.5, 0.1, 0.1]],
        ]
    )
    sizes = torch.tensor([[100, 200], [50, 40]])  # (H, W)
    res = PostProcess(num_select=3)({"pred_logits": logits, "pred_boxes": boxes}, sizes)
    assert len(res) == 2
    r0 = res[0]
    assert r0["scores"].shape == (3,) and r0["labels"].dtype == torch.int64 and r0["boxes"].dtype == torch.float32
    assert torch.all(r0["scores"][:-1] >= r0["scores"][1:])
    assert r0["labels"].tolist() == [2, 0, 3]
    torch.testing.assert_close(r0["scores"], torch.sigmoid(torch.tensor([3.0, 1.0, 0.0])))
    # query 1: cx .25 cy .5 w .5 h 1 -> x 0..0.5, y 0..1 -> pixels (W=200, H=100)
    torch.testing.assert_close(r0["boxes"][0], torch.tensor([0.0, 0.0, 100.0, 100.0]))
    # query 2: cx .5 cy .25 w 1 h .5 -> x 0..1, y 0..0.5
    torch.testing.assert_close(r0["boxes"][1], torch.tensor([0.0, 0.0, 200.0, 50.0]))
    torch.testing.assert_close(r0["boxes"][2], r0["boxes"][0])
    r1 = res[1]
    assert r1["labels"][0].item() == 1
    torch.testing.assert_close(r1["boxes"][0], torch.tensor([0.0, 0.0, 40.0, 50.0]))  # whole image, W=40, H=50


def test_postprocess_defaults_and_ranges():
    gen = torch.Generator().manual_seed(12)
    out = _head(2, 100, gen)
    res = PostProcess()(out, [(480, 640), (300, 200)])  # num_select 300 <= Q * C = 700
    for r, (h, w) in zip(res, [(480, 640), (300, 200)]):
        assert r["scores"].shape == (300,) and r["boxes"].shape == (300, 4)
        assert torch.all(r["scores"][:-1] >= r["scores"][1:])
        assert r["labels"].min() >= 0 and r["labels"].max() < NUM_CLASSES
        assert torch.all(r["boxes"][:, 2] >= r["boxes"][:, 0]) and torch.all(r["boxes"][:, 3] >= r["boxes"][:, 1])
        assert r["boxes"][:, 0::2].max() <= w * 1.5 and r["boxes"][:, 1::2].max() <= h * 1.5
    small = PostProcess(num_select=300)(_head(1, 4, gen), torch.tensor([[10, 10]]))
    assert small[0]["scores"].shape == (4 * NUM_CLASSES,)
