"""Fixed detection canvases: ``canvases: auto`` bounds the padded batch shapes of a facemask
epoch to at most 4 in training and 2 in evaluation (the CPU proxy of the GPU's first-seen-shape cost, pinned as
a count), every image still fits at the top-left with its padding mask, and bad settings are one-line errors."""

from __future__ import annotations

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.data.formats import canvases as cv
from trainer.data.formats.coco_dataset import collate_detection
from trainer.data.sampler import EpochSampler
from trainer.engine.distributed import DistInfo
from trainer.tasks import build_task

CPU = DistInfo(0, 0, 1, torch.device("cpu"))


def _task(shared_data, **over):
    cfg = load_config(
        None,
        {
            "task": "detection",
            "model": "resnet18",
            "data_dir": str(shared_data / "facemask-coco"),
            "train_split": "train",
            "val_split": "val",
            "coco_annotations": "annotations/custom_{split}.json",
            "coco_images": "{split}2017",
            "batch_size": 2,
            "device": "cpu",
            **over,
        },
    )
    return build_task(cfg, CPU)


def _epoch_shapes(data, epoch: int, micro: int, collate_canvases, multiple: int = 64) -> set:
    """The padded (H, W) of every micro-batch of ``epoch`` in the training order, from the transformed sizes."""
    order = EpochSampler(len(data.train), shuffle=True, seed=0)
    order.set_epoch(epoch)
    sizes = cv.batch_sizes(lambda i: data.train.transformed_size(epoch, i), [i for _, i in order], micro)
    if not collate_canvases:
        return {(cv.round_up(h, multiple), cv.round_up(w, multiple)) for h, w in sizes}
    return {cv.fit_canvas(cv.round_up(h, multiple), cv.round_up(w, multiple), collate_canvases) for h, w in sizes}


def test_auto_canvases_bound_the_shapes_of_a_facemask_epoch(shared_data):
    task = _task(shared_data, canvases="auto", seed=0)
    data = task.build_data()
    train_c = data.collate.keywords["canvases"]
    eval_c = data.val_collate.keywords["canvases"]
    assert 1 < len(train_c) <= cv.MAX_CANVASES and 1 <= len(eval_c) <= cv.MAX_EVAL_CANVASES
    # the covers: the crop branch's long side (800 x 600 / 384 = 1250) either way, landscape photos at 1333 wide
    assert max(train_c, key=lambda c: c[0] * c[1]) == (1344, 1344)
    val_max = [data.val.transformed_size(0, i) for i in range(len(data.val))]
    cover = (cv.round_up(max(h for h, _ in val_max), 64), cv.round_up(max(w for _, w in val_max), 64))
    assert cv.fit_canvas(*cover, eval_c) is not None
    assert all(h % 64 == 0 and w % 64 == 0 for h, w in train_c + eval_c)
    assert any(line.startswith("data: canvases (auto): training ") for line in data.report)
    # epoch 2 was not among the epochs auto looked at: still at most 4 shapes, against dozens without canvases
    with_canvases = _epoch_shapes(data, 2, 2, train_c)
    without = _epoch_shapes(data, 2, 2, [])
    assert len(with_canvases) <= 4 and len(without) > 20, (with_canvases, len(without))
    evaluation = {
        cv.fit_canvas(cv.round_up(h, 64), cv.round_up(w, 64), eval_c)
        for h, w in cv.batch_sizes(lambda i: data.val.transformed_size(0, i), range(len(data.val)), 4)
    }
    assert len(evaluation) <= 2
    # the real collate puts each image top-left on its canvas, with the padding mask
    items = [data.train[(0, i)] for i in (0, 1)]
    batch = data.collate(items)
    assert tuple(batch["image"].shape[-2:]) in train_c
    for k, (img, _, _) in enumerate(items):
        h, w = img.shape[-2:]
        assert torch.equal(batch["image"][k, :, :h, :w], img.as_subclass(torch.Tensor))
        assert not batch["mask"][k, :h, :w].any() and batch["mask"][k].sum() == batch["mask"][k].numel() - h * w
    assert task.input_size() == (1344, 1344)  # plan predicts memory for the largest canvas


def test_transformed_size_is_the_size_of_the_transformed_image(shared_data):
    data = _task(shared_data, seed=3).build_data()
    for epoch in (0, 5):
        for i in (0, 7, 100, 400):
            assert data.train.transformed_size(epoch, i) == tuple(data.train[(epoch, i)][0].shape[-2:])
    assert data.val.transformed_size(0, 3) == tuple(data.val[(0, 3)][0].shape[-2:])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("832x1344,big", "expected auto, empty, or canvases as HxW,HxW,... in pixels; got 'big'"),
        ("800x1344,1344x1344", "canvas 800x1344: each side must be a multiple of pad_to_multiple (64)"),
        (
            "64x64,128x128,192x192,256x256,1344x1344",
            "at most 4 canvases, got 5",
        ),
    ],
)
def test_bad_canvases_are_one_line_config_errors(shared_data, value, message):
    with pytest.raises(ConfigError) as e:
        _task(shared_data, canvases=value).check_config()
    assert str(e.value).startswith(f"canvases: got {value!r}; {message}") and "\n" not in str(e.value)


def test_a_canvas_list_without_the_cover_is_refused_when_the_data_is_read(shared_data):
    task = _task(shared_data, canvases="832x1344")
    task.check_config()
    with pytest.raises(ConfigError) as e:
        task.build_data()
    assert str(e.value) == (
        "canvases: got '832x1344'; no canvas holds every training batch this data and recipe can make: add one "
        "of at least 1344x1344"
    )


def test_a_canvas_list_from_yaml_and_the_smallest_fitting_canvas(shared_data, tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("task: detection\ncanvases: [[832, 1344], [1344, 1344]]\n")
    cfg = load_config(str(yaml), {})
    assert cfg.canvases == "832x1344,1344x1344"
    canvases = cv.parse_canvases(cfg.canvases, 64)
    assert canvases == [(832, 1344), (1344, 1344)]
    img = torch.zeros(3, 700, 1300, dtype=torch.uint8)
    tgt = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64), "image_id": 1, "orig_size": (1, 1)}
    assert collate_detection([(img, tgt, ())], 64, canvases)["image"].shape[-2:] == (832, 1344)
    tall = torch.zeros(3, 900, 600, dtype=torch.uint8)
    assert collate_detection([(img, tgt, ()), (tall, tgt, ())], 64, canvases)["image"].shape[-2:] == (1344, 1344)
    huge = torch.zeros(3, 1400, 600, dtype=torch.uint8)  # no canvas holds it: padded as without canvases
    assert collate_detection([(huge, tgt, ())], 64, canvases)["image"].shape[-2:] == (1408, 640)


def test_pick_canvases_keeps_the_cover_and_lowers_the_padded_area():
    sizes = [(480, 640)] * 10 + [(800, 1333)] * 5 + [(1333, 800)]
    cover = (1344, 1344)
    one = cv.pick_canvases(sizes, cover, 1, 64)
    three = cv.pick_canvases(sizes, cover, 3, 64)
    assert one == [cover] and cover in three and len(three) == 3
    assert set(three) == {(512, 640), (832, 1344), cover}

    def area(cs):
        return sum(a * b for a, b in (cv.fit_canvas(cv.round_up(h, 64), cv.round_up(w, 64), cs) for h, w in sizes))

    assert area(three) < area(one)
    share = cv.padding_share([[(480, 640)], [(800, 1333)]], three, 64)
    assert 0 < share < cv.padding_share([[(480, 640)], [(800, 1333)]], [cover], 64)
