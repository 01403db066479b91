"""Segmentation metrics (confusion matrix -> mIoU, pixel / mean accuracy) and loss, on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trainer.engine.evaluation import metric_key
from trainer.tasks.segmentation.evaluator import ConfusionMatrixEvaluator, confusion_from_sums
from trainer.tasks.segmentation.loss import SegmentationLoss

CPU = torch.device("cpu")
NAMES = ["background", "Flat roof", "roof-south"]

# One 2x3 image, 3 classes, the last pixel ignored (its prediction must not count).
TARGET = torch.tensor([[[0, 0, 1], [1, 2, 255]]])
PRED = torch.tensor([[[0, 1, 1], [1, 1, 0]]])
# Counted (target, pred): (0,0) (0,1) (1,1) (1,1) (2,1) ->
# cm = [[1, 1, 0], [0, 2, 0], [0, 1, 0]]; TP = [1, 2, 0], target = [2, 2, 1], pred = [1, 4, 0]
# union = [2, 4, 1]; IoU = [1/2, 2/4, 0]; mIoU = 1/3; pixel acc = 3/5; mean acc = (1/2 + 1 + 0) / 3 = 1/2.
EXPECTED = {
    "miou": 100 / 3,
    "pixel_acc": 60.0,
    "mean_acc": 50.0,
    "iou_background": 50.0,
    "iou_flat_roof": 50.0,
    "iou_roof_south": 0.0,
}


def _evaluate(evaluator: ConfusionMatrixEvaluator, outputs, mask) -> dict[str, float]:
    evaluator.reset()
    evaluator.update(outputs, {"mask": mask})
    return evaluator.compute()


def _assert_metrics(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, abs=1e-9), k


def test_hand_computed_example():
    ev = ConfusionMatrixEvaluator(3, NAMES, CPU)
    _assert_metrics(_evaluate(ev, PRED, TARGET), EXPECTED)
    assert torch.equal(
        confusion_from_sums(ev.sums, 3), torch.tensor([[1, 1, 0], [0, 2, 0], [0, 1, 0]], dtype=torch.float64)
    )
    assert ev.directions == dict.fromkeys(EXPECTED, "max")


def test_per_class_iou_agrees_with_sklearn():
    from sklearn.metrics import jaccard_score

    keep = TARGET != 255
    ref = jaccard_score(TARGET[keep].numpy(), PRED[keep].numpy(), labels=[0, 1, 2], average=None)
    got = _evaluate(ConfusionMatrixEvaluator(3, NAMES, CPU), PRED, TARGET)
    assert [got[f"iou_{metric_key(n)}"] for n in NAMES] == pytest.approx(list(100 * ref))


def test_logits_and_labels_give_the_same_metrics():
    logits = 4.0 * F.one_hot(PRED, 3).permute(0, 3, 1, 2).float() + 0.1 * torch.randn(1, 3, 2, 3)
    _assert_metrics(_evaluate(ConfusionMatrixEvaluator(3, NAMES, CPU), logits, TARGET), EXPECTED)


def test_batches_and_images_sum_to_the_same_matrix():
    ev = ConfusionMatrixEvaluator(3, NAMES, CPU)
    ev.update(PRED[:, :1], {"mask": TARGET[:, :1]})
    ev.update(PRED[:, 1:], {"mask": TARGET[:, 1:]})
    _assert_metrics(ev.compute(), EXPECTED)
    stacked = _evaluate(ev, PRED.reshape(2, 1, 3), TARGET.reshape(2, 1, 3))
    _assert_metrics(stacked, EXPECTED)


def test_a_class_absent_from_target_and_prediction_is_left_out_of_miou():
    got = _evaluate(ConfusionMatrixEvaluator(4, [*NAMES, "tree"], CPU), PRED, TARGET)
    # class 3 has union 0: mIoU stays (1/2 + 1/2 + 0) / 3, not / 4; its own IoU reads 0
    _assert_metrics(got, {**EXPECTED, "iou_tree": 0.0})


def test_a_class_only_predicted_counts_in_miou_and_not_in_mean_acc():
    target = torch.tensor([[[0, 0], [1, 1]]])
    pred = torch.tensor([[[0, 2], [1, 1]]])
    got = _evaluate(ConfusionMatrixEvaluator(3, ["a", "b", "c"], CPU), pred, target)
    # IoU: a 1/2, b 1, c 0/1 -> mIoU 1/2; recall: a 1/2, b 1 (c has no target pixel) -> 3/4; pixel acc 3/4
    _assert_metrics(
        got, {"miou": 50.0, "pixel_acc": 75.0, "mean_acc": 75.0, "iou_a": 50.0, "iou_b": 100.0, "iou_c": 0.0}
    )


def test_nothing_counted_gives_zeros():
    got = _evaluate(ConfusionMatrixEvaluator(3, NAMES, CPU), PRED, torch.full_like(TARGET, 255))
    _assert_metrics(got, dict.fromkeys(EXPECTED, 0.0))


def test_bad_inputs():
    with pytest.raises(ValueError, match="2 class names for num_classes=3"):
        ConfusionMatrixEvaluator(3, NAMES[:2], CPU)
    with pytest.raises(ValueError, match="clashing metric keys"):
        ConfusionMatrixEvaluator(2, ["flat roof", "flat-roof"], CPU)
    ev = ConfusionMatrixEvaluator(3, NAMES, CPU)
    with pytest.raises(ValueError, match=r"labels outside \[0, 3\) that are not ignore_index=255"):
        ev.update(PRED, {"mask": torch.tensor([[[0, 0, 1], [1, 3, 255]]])})
    with pytest.raises(ValueError, match="outputs must be float logits"):
        ev.update(PRED.float(), {"mask": TARGET})


# Loss ------------------------------------------------------------------------------------------------------------


def test_uniform_logits_give_the_hand_computed_loss():
    # zero logits: CE = log 3 at every counted pixel. Dice on p = 1/3 over the 5 counted pixels, target sizes
    # [2, 2, 1]: dice_c = 2 * |T_c| / 3 / (5/3 + |T_c|) = [4/11, 4/11, 1/4] -> loss mean(1 - dice) = 89/132.
    loss_fn = SegmentationLoss(3, ce_weight=2.0, dice_weight=0.5)
    out = loss_fn(torch.zeros(1, 3, 2, 3), TARGET)
    assert out["loss_ce"].item() == pytest.approx(math.log(3), rel=1e-6)
    assert out["loss_dice"].item() == pytest.approx(89 / 132, rel=1e-6)
    assert out["loss"].item() == pytest.approx(2 * math.log(3) + 0.5 * 89 / 132, rel=1e-6)


def test_all_ignored_batch_gives_zero_and_zero_gradients():
    logits = torch.randn(2, 3, 4, 4, requires_grad=True)
    out = SegmentationLoss(3)(logits, torch.full((2, 4, 4), 255))
    assert out["loss_ce"].item() == 0.0
    assert out["loss_dice"].item() == 0.0
    out["loss"].backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_perfect_prediction_gives_near_zero_loss():
    target = torch.tensor([[[0, 1, 2], [2, 1, 255]]])
    logits = 30.0 * F.one_hot(target.clamp_max(2), 3).permute(0, 3, 1, 2).float()
    out = SegmentationLoss(3)(logits, target)
    assert out["loss_ce"].item() < 1e-6
    assert out["loss_dice"].item() < 1e-6


def test_gradients_flow_and_skip_ignored_pixels():
    logits = torch.randn(1, 3, 2, 3, requires_grad=True)
    SegmentationLoss(3)(logits, TARGET)["loss"].backward()
    grad = logits.grad
    assert torch.isfinite(grad).all()
    assert grad[0, :, 1, 2].abs().sum() == 0  # the ignored pixel
    assert (grad[0, :, :, :2].abs().sum(dim=0) > 0).all()


def test_loss_is_float32_under_autocast():
    logits = torch.zeros(1, 3, 2, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = SegmentationLoss(3)(logits, TARGET)
    assert {v.dtype for v in out.values()} == {torch.float32}
    assert out["loss_ce"].item() == pytest.approx(math.log(3), rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ce_weight": -1.0}, "ce_weight must be a finite number >= 0"),
        ({"dice_weight": math.nan}, "dice_weight must be a finite number >= 0"),
        ({"ce_weight": 0.0, "dice_weight": 0.0}, "both 0"),
    ],
)
def test_bad_loss_weights(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SegmentationLoss(3, **kwargs)


def test_metric_key_turns_class_names_into_line_safe_keys():
    assert [metric_key(n) for n in ["Flat roof", "roof-south", "  N/A  ", "PV_module 2", "---"]] == [
        "flat_roof",
        "roof_south",
        "n_a",
        "pv_module_2",
        "class",
    ]
