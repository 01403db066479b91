"""COCO detection data: scan and census of the real facemask set, category maps (sparse ids), crowd boxes and
negatives, the bad-input table (fatal vs skipped-and-counted), bad image files while loading, determinism, box
geometry through DINO's transforms, eval sizes, the padding collate and a 1-worker DataLoader."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import BatchSampler
from torchvision import tv_tensors

from trainer.data.formats.coco import DataError, LabelMap, apply_label_space, check_coco_files, scan_coco
from trainer.data.formats.coco_dataset import (
    MEAN_PIXEL,
    CocoDetectionDataset,
    collate_detection,
    eval_transform_for_epoch,
    train_transform_for_epoch,
)
from trainer.data.loading import build_loader
from trainer.data.sampler import EpochSampler
from trainer.data.samples import BadSample

#: Small sizes for CPU tests (DINO's are 480..800 / 1333 / 400..600 / 384..600 / 800).
SMALL = dict(train_scales=(160, 192), max_size=256, crop_resize_scales=(128, 160), crop_size=(96, 160))


def _tt():
    return train_transform_for_epoch(**SMALL)


def _vt():
    return eval_transform_for_epoch(eval_size=160, max_size=256)


@pytest.fixture(scope="module")
def facemask(shared_data) -> Path:
    return shared_data / "facemask-coco"


@pytest.fixture(scope="module")
def fm_train(facemask):
    return scan_coco(facemask / "annotations" / "custom_train.json", facemask / "train2017", "train")


# --- small synthetic splits -------------------------------------------------------------------------------
def _png(path: Path, w: int, h: int, seed: int = 0, box=None, colour=(255, 0, 0)) -> None:
    """A noisy dark w x h PNG; ``box`` (x0, y0, x1, y1) is filled with ``colour``."""
    a = np.random.RandomState(seed).randint(0, 60, (h, w, 3)).astype(np.uint8)
    if box is not None:
        x0, y0, x1, y1 = box
        a[y0:y1, x0:x1] = colour
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(a).save(path)


def _small(tmp: Path, n: int = 4, w: int = 40, h: int = 30) -> dict:
    """``n`` images (ids 10, 11, ...) of w x h, one box each (ids 100, 101, ...), categories 1 and 2."""
    for k in range(n):
        _png(tmp / "img" / f"{k}.png", w, h, seed=k)
    return {
        "images": [{"id": 10 + k, "file_name": f"{k}.png", "width": w, "height": h} for k in range(n)],
        "annotations": [
            {"id": 100 + k, "image_id": 10 + k, "category_id": 1 + k % 2, "bbox": [2, 3, 10, 8], "iscrowd": 0}
            for k in range(n)
        ],
        "categories": [{"id": 1, "name": "wall"}, {"id": 2, "name": "room"}],
    }


def _write(tmp: Path, data) -> Path:
    p = tmp / "ann.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


# --- real data --------------------------------------------------------------------------------------------
def test_facemask_census_and_category_map(facemask, fm_train):
    assert fm_train.census() == "677 images, 3 categories, 3,106 boxes, 0 crowd, 0 images without boxes"
    assert fm_train.categories == ["mask_weared_incorrect", "with_mask", "without_mask"]
    assert fm_train.label_to_category_id == [0, 1, 2] and fm_train.category_id_to_label == {0: 0, 1: 1, 2: 2}
    assert fm_train.report == [] and fm_train.boxes.dtype == np.float32 and fm_train.labels.dtype == np.int64
    val = scan_coco(facemask / "annotations" / "custom_val.json", facemask / "val2017", "val")
    assert val.census() == "171 images, 3 categories, 915 boxes, 0 crowd, 0 images without boxes"
    # first annotation of the file: image 0, category 1, bbox [76, 68, 53, 43] -> XYXY [76, 68, 129, 111]
    i = fm_train.image_ids.index(0)
    boxes, labels = fm_train.targets(i)
    assert [76, 68, 129, 111] in boxes.tolist() and set(labels.tolist()) <= {0, 1, 2}
    ds = CocoDetectionDataset(fm_train, _vt(), replace_bad=False)
    t = ds.raw_target(i)
    assert isinstance(t["boxes"], tv_tensors.BoundingBoxes) and t["boxes"].dtype == torch.float32
    assert t["orig_size"] == (225, 400) and t["image_id"] == 0 and t["labels"].dtype == torch.int64


def test_sparse_category_ids_crowd_and_negatives(facemask, fm_train, tmp_path):
    src = sorted((facemask / "train2017").glob("*.jpg"))[:4]
    images = []
    for k, f in enumerate(src):
        shutil.copy(f, tmp_path / f.name)
        w, h = Image.open(f).size
        images.append({"id": 7 + k, "file_name": f.name, "width": w, "height": h})
    data = {
        "images": images,
        "categories": [{"id": 90, "name": "c90"}, {"id": 1, "name": "c1"}, {"id": 5, "name": "c5"}],
        "annotations": [
            {"id": 1, "image_id": 7, "category_id": 90, "bbox": [1, 2, 10, 20]},
            {"id": 2, "image_id": 7, "category_id": 1, "bbox": [5, 5, 5, 5]},
            {"id": 3, "image_id": 8, "category_id": 5, "bbox": [0, 0, 30, 30]},
            {"id": 4, "image_id": 8, "category_id": 1, "bbox": [40, 40, 50, 50], "iscrowd": 1},
            {"id": 5, "image_id": 9, "category_id": 90, "bbox": [3, 3, 8, 8], "iscrowd": 1},  # only crowd
        ],  # image 10: no annotation at all (a negative)
    }
    split = scan_coco(_write(tmp_path, data), tmp_path, "sparse")
    assert split.label_to_category_id == [1, 5, 90] and split.categories == ["c1", "c5", "c90"]
    assert split.census() == "4 images, 3 categories, 3 boxes, 2 crowd, 2 images without boxes"
    assert split.image_ids == [7, 8, 9, 10]
    b, lab = split.targets(0)
    assert b.tolist() == [[1, 2, 11, 22], [5, 5, 10, 10]] and lab.tolist() == [2, 0]
    b, lab = split.targets(1)
    assert b.tolist() == [[0, 0, 30, 30]] and lab.tolist() == [1]  # the crowd box is no target
    assert split.crowd(1)[0].tolist() == [[40, 40, 90, 90]] and split.crowd(1)[1].tolist() == [0]
    assert [split.label_to_category_id[x] for x in lab.tolist()] == [5]  # back to the JSON's ids
    ds = CocoDetectionDataset(split, _vt(), replace_bad=False)
    for i in (2, 3):  # crowd-only and unannotated images stay, with no boxes
        img, t, own = ds[i]
        assert t["boxes"].shape == (0, 4) and t["labels"].shape == (0,) and img.shape[0] == 3 and own == ()
    batch = collate_detection([ds[i] for i in range(4)])
    assert [t["boxes"].shape[0] for t in batch["targets"]] == [2, 1, 0, 0]
    # coco_ids: the label is the JSON id (upstream DINO), 91 classes; one map both ways
    ids = apply_label_space(split, "coco_ids")
    assert ids.targets(0)[1].tolist() == [90, 1] and ids.crowd(1)[1].tolist() == [1] and ids.label_space == "coco_ids"
    m = ids.label_map
    assert m.num_classes == 91 and m.label(90) == 90 and m.category_id(5) == 5 and m.name(90) == "c90"
    assert m.category_id(2) is None and m.name(2) is None  # an id no category declares: a class never seen
    dense_ids, dense_names = m.dense()
    assert len(dense_ids) == 91 and dense_ids[90] == 90 and dense_names[5] == "c5" and dense_names[0] == ""
    assert m.to_label_space() == {
        "categories": ["c1", "c5", "c90"],
        "category_ids": [1, 5, 90],
        "label_space": "coco_ids",
        "num_classes": 91,
    }
    assert LabelMap.from_label_space(m.to_label_space()) == m
    c = split.label_map  # contiguous: the checkpoint's label space as before the option (resume compares equal)
    assert c.num_classes == 3 and c.label(90) == 2 and c.category_id(2) == 90 and c.name(0) == "c1"
    assert c.to_label_space() == {"categories": ["c1", "c5", "c90"], "category_ids": [1, 5, 90]}
    assert LabelMap.from_label_space({"categories": ["a", "b"]}).category_id(1) == 1  # older checkpoints: no ids
    back = apply_label_space(ids, "contiguous")
    assert back.labels.tolist() == split.labels.tolist() and back.crowd_labels.tolist() == split.crowd_labels.tolist()
    with pytest.raises(ValueError, match="label_space: got 'names'"):
        apply_label_space(split, "names")
    with pytest.raises(ValueError, match=r"category id 90 \('c90'\).* <= max_category_id \(89\)"):
        apply_label_space(split, "coco_ids", max_category_id=89)
    with pytest.raises(ValueError, match="coco_ids needs category ids >= 0"):
        LabelMap("coco_ids", (-1, 2), ("a", "b"))


# --- bad inputs -------------------------------------------------------------------------------------------
def _mut(fn):
    def apply(d, tmp):
        fn(d, tmp)
        return d

    return apply


def _set(section, k, **kv):
    return _mut(lambda d, t: d[section][k].update(kv))


def _drop(section, k, key):
    return _mut(lambda d, t: d[section][k].pop(key))


def _many_unknown_images(d, t):
    for a in d["annotations"]:
        a["image_id"] = 900 + a["id"]
    d["annotations"].append({"id": 104, "image_id": 999, "category_id": 1, "bbox": [0, 0, 1, 1]})


# (row id, mutation of the base data, fragments expected in the one-line message). Fatal unless noted.
BAD = [
    ("not-json", lambda d, t: '{"images": [1, 2,,]}', ["is not valid JSON", "Expecting value at line 1 column 18"]),
    ("top-level-list", lambda d, t: [d], ["the top level is a list"]),
    ("missing-top-key", _mut(lambda d, t: d.pop("categories")), ["missing top-level key 'categories'"]),
    ("top-key-not-list", _mut(lambda d, t: d.update(images={})), ["'images' is a dict, expected a list"]),
    ("image-no-file_name", _drop("images", 1, "file_name"), ["'images' entry", "entry #1 (id 11) has no 'file_name'"]),
    ("image-width-text", _set("images", 2, width="40"), ["entry #2 (id 12) has width='40'", "a positive integer"]),
    ("ann-no-bbox", _drop("annotations", 0, "bbox"), ["'annotations' entry", "(id 100) has no 'bbox'"]),
    ("ann-no-category", _drop("annotations", 3, "category_id"), ["(id 103) has no 'category_id'"]),
    ("ann-bbox-3-numbers", _set("annotations", 1, bbox=[1, 2, 3]), ["(id 101) has bbox=[1, 2, 3]", "[x, y, w, h]"]),
    ("ann-iscrowd-2", _set("annotations", 1, iscrowd=2), ["(id 101) has iscrowd=2", "0 or 1"]),
    ("cat-no-name", _drop("categories", 1, "name"), ["'categories' entry", "entry #1 (id 2) has no 'name'"]),
    ("entry-not-object", _mut(lambda d, t: d["annotations"].append(7)), ["entry #4 is not an object (got int 7)"]),
    ("dup-image-id", _set("images", 2, id=10), ["duplicate id(s) in 'images': 10 (2 entries)"]),
    ("dup-ann-id", _set("annotations", 3, id=101), ["duplicate id(s) in 'annotations': 101 (2 entries)"]),
    ("dup-cat-id", _set("categories", 1, id=1), ["duplicate id(s) in 'categories': 1 (2 entries)"]),
    ("unknown-image", _set("annotations", 2, image_id=55), ["1 annotation(s)", "annotation 102 -> image_id 55"]),
    (
        "unknown-images-first-3",
        _mut(_many_unknown_images),
        ["5 annotation(s) refer to an image_id", "annotation 100 -> image_id 1000; annotation 101", "(+2 more)"],
    ),
    ("unknown-category", _set("annotations", 0, category_id=0), ["annotation 100 -> category_id 0", "(ids 1, 2)"]),
    ("no-images", _mut(lambda d, t: d.update(images=[], annotations=[])), ["'images' is empty"]),
    ("no-categories", _mut(lambda d, t: d.update(categories=[], annotations=[])), ["'categories' is empty"]),
    # skipped-and-counted problems, here over max_bad_fraction=0 -> DataError naming the image and why
    (
        "box-zero-width",
        _set("annotations", 1, bbox=[2, 3, 0, 8]),
        [
            "1 of 4 images cannot be used",
            "image 11 (1.png)",
            "annotation 101 bbox [2, 3, 0, 8] has a non-positive width",
        ],
    ),
    (
        "box-negative-h",
        _set("annotations", 2, bbox=[2, 3, 5, -1]),
        ["annotation 102 bbox [2, 3, 5, -1] has a non-positive"],
    ),
    (
        "box-outside",
        _set("annotations", 3, bbox=[35, 3, 6.5, 8]),
        ["annotation 103 bbox [35, 3, 6.5, 8] lies outside the 40x30 image by more than 1 px"],
    ),
    ("box-above", _set("annotations", 0, bbox=[2, -1.5, 5, 5]), ["annotation 100", "lies outside"]),
    ("box-on-edge", _set("annotations", 0, bbox=[40.2, 3, 0.5, 5]), ["annotation 100", "has no area inside the 40x30"]),
    (
        "file-missing",
        _mut(lambda d, t: (t / "img" / "2.png").unlink()),
        ["image 12 (2.png): file", "2.png does not exist"],
    ),
    ("max_bad_fraction", _set("annotations", 0, bbox=[2, 3, 0, 8]), ["more than max_bad_fraction=0.0"]),
]


@pytest.mark.parametrize("mutate, fragments", [pytest.param(m, f, id=i) for i, m, f in BAD])
def test_bad_input_table(tmp_path, mutate, fragments):
    data = mutate(_small(tmp_path), tmp_path)
    path = _write(tmp_path, data)
    with pytest.raises(DataError) as e:
        scan_coco(path, tmp_path / "img", "train", max_bad_fraction=0.0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data split 'train': {path}")
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_missing_annotations_file_or_image_folder(tmp_path):
    with pytest.raises(DataError, match=r"annotations file .*nope\.json does not exist"):
        scan_coco(tmp_path / "nope.json", tmp_path, "val")
    path = _write(tmp_path, _small(tmp_path))
    with pytest.raises(DataError, match=r"ann\.json: image folder .*/pics does not exist"):
        scan_coco(path, tmp_path / "pics", "val")


def test_bad_boxes_and_missing_files_under_max_bad_fraction_are_left_out_and_reported(tmp_path):
    data = _small(tmp_path, n=10)
    data["annotations"][1]["bbox"] = [2, 3, 0, 8]  # image 11: degenerate box
    (tmp_path / "img" / "5.png").unlink()  # image 15: no file
    data["annotations"][0]["bbox"] = [-0.5, 3, 41, 27.8]  # overhangs by <= 1 px: clipped, kept
    data["annotations"].append({"id": 200, "image_id": 11, "category_id": 2, "bbox": [30, 3, 20, 8]})  # 2nd bad
    path = _write(tmp_path, data)
    split = scan_coco(path, tmp_path / "img", "train", max_bad_fraction=0.2)
    assert len(split) == 8 and 11 not in split.image_ids and 15 not in split.image_ids
    assert split.targets(0)[0].tolist() == [[0, 3, 40, 30]]
    assert [(i, why.split(" ")[0]) for i, _, why in split.left_out] == [(11, "annotation"), (15, "file")]
    (line,) = split.report
    assert "2 of 10 image(s) left out (1 with a bad box (2 box(es) in all), 1 missing file(s)" in line
    assert "image 11 (1.png): annotation 101 bbox [2, 3, 0, 8]" in line and "image 15 (5.png): file" in line
    assert split.census().endswith("; 2 images left out (bad box or missing file)")
    data["annotations"][2]["bbox"] = [0, 0, 0, 0]  # 3 of 10 > 0.2
    with pytest.raises(DataError, match=r"3 of 10 images cannot be used .* more than max_bad_fraction=0\.2"):
        scan_coco(_write(tmp_path, data), tmp_path / "img", "train", max_bad_fraction=0.2)
    with pytest.raises(DataError, match="10 of 10 images cannot be used"):  # all bad: fatal whatever the fraction
        shutil.rmtree(tmp_path / "img")
        (tmp_path / "img").mkdir()
        scan_coco(path, tmp_path / "img", "train", max_bad_fraction=1.0)


def test_undecodable_and_wrong_size_files_replaced_in_training_dropped_in_eval(tmp_path):
    data = _small(tmp_path, n=6)
    (tmp_path / "img" / "1.png").write_bytes(b"\x89PNG not really")
    _png(tmp_path / "img" / "3.png", 20, 30)  # the JSON says 40x30
    split = scan_coco(_write(tmp_path, data), tmp_path / "img", "train")  # scan checks existence only
    train = CocoDetectionDataset(split, _tt(), seed=0)
    img, t, own = train[(0, 1)]
    assert own[0].path.endswith("1.png") and t["image_id"] == 12 and img.dtype == torch.uint8
    img, t, own = train[(0, 3)]
    assert "SizeMismatch: decoded 20x30 but ann.json says width=40 height=30" in own[0].error and t["image_id"] == 14
    batch = collate_detection([train[(0, i)] for i in range(6)])
    assert batch["image"].shape[0] == 6 and len(batch["bad"]) == 2
    val = CocoDetectionDataset(split, _vt(), replace_bad=False)
    batch = collate_detection([val[i] for i in range(6)])
    assert [t["image_id"] for t in batch["targets"]] == [10, 12, 14, 15] and len(batch["bad"]) == 2
    assert all(isinstance(b, BadSample) for b in batch["bad"])
    kept, lines = check_coco_files(split, max_bad_fraction=0.5)  # the val split's up-front check
    assert kept.image_ids == [10, 12, 13, 14, 15] and "1 of 6 file(s) cannot be read" in lines[0]
    assert kept.targets(1)[0].tolist() == split.targets(2)[0].tolist()
    with pytest.raises(DataError, match=r"1 of 6 image files cannot be read, more than max_bad_fraction=0\.1"):
        check_coco_files(split, max_bad_fraction=0.1)
    empty = collate_detection([val[1]])
    assert empty["image"].shape == (0, 3, 1, 1) and empty["targets"] == [] and len(empty["bad"]) == 1


# --- augmentation -----------------------------------------------------------------------------------------
def test_augmentation_is_a_pure_function_of_seed_epoch_index(fm_train):
    ds = CocoDetectionDataset(fm_train, _tt(), seed=3)
    a_img, a_t, _ = ds[(2, 5)]
    torch.manual_seed(123)  # the global RNG state must not matter and must not be consumed
    state = torch.get_rng_state()
    _ = ds[(2, 7)]
    b_img, b_t, _ = ds[(2, 5)]
    assert (
        torch.equal(a_img, b_img)
        and torch.equal(a_t["boxes"], b_t["boxes"])
        and torch.equal(state, torch.get_rng_state())
    )
    assert torch.equal(a_t["labels"], b_t["labels"])
    others = [ds[(e, 5)] for e in (3, 4, 5)]
    assert any(o[0].shape != a_img.shape or not torch.equal(o[0], a_img) for o in others)


def test_boxes_stay_on_their_pixels_through_flip_resize_and_crop(tmp_path):
    """Draw a red rectangle, annotate it; after every train augmentation the box must still frame the red
    pixels (within the 1-2 px of resampling), flipped or not, cropped or not."""
    box = (20, 10, 70, 40)  # x0, y0, x1, y1 in a 120 x 90 image
    _png(tmp_path / "img" / "a.png", 120, 90, box=box)
    data = {
        "images": [{"id": 1, "file_name": "a.png", "width": 120, "height": 90}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 3, "bbox": [20, 10, 50, 30]}],
        "categories": [{"id": 3, "name": "red"}],
    }
    split = scan_coco(_write(tmp_path, data), tmp_path / "img", "t")
    ds = CocoDetectionDataset(split, _tt(), seed=0)
    flips = 0
    for epoch in range(24):
        img, t, _ = ds[(epoch, 0)]
        red = (img[0].int() > 150) & (img[1].int() < 100)
        if t["boxes"].shape[0] == 0:  # cropped away (or to a sliver): sanitized
            assert red.sum() < 0.01 * red.numel()
            continue
        ys, xs = torch.nonzero(red, as_tuple=True)
        x0, y0, x1, y1 = t["boxes"][0].tolist()
        assert abs(xs.min().item() - x0) <= 2 and abs(xs.max().item() + 1 - x1) <= 2, (epoch, t["boxes"], xs)
        assert abs(ys.min().item() - y0) <= 2 and abs(ys.max().item() + 1 - y1) <= 2
        assert t["labels"].tolist() == [0] and t["boxes"].canvas_size == tuple(img.shape[1:])
        assert min(img.shape[1:]) in (160, 192) or max(img.shape[1:]) == 256
        flips += x0 / img.shape[2] > 1 - x1 / img.shape[2]  # the box's left margin grew: flipped
    assert 0 < flips < 24


def test_eval_transform_sizes(fm_train):
    ds = CocoDetectionDataset(fm_train, _vt(), replace_bad=False)
    i = fm_train.image_ids.index(0)  # 400 x 225
    img, t, _ = ds[(0, i)]
    # shorter side 160 would make the longer 284 > 256: the longer side is capped, 225 * 256 / 400 = 144
    assert tuple(img.shape) == (3, 144, 256) and t["orig_size"] == (225, 400)
    raw = ds.raw_target(i)["boxes"]
    assert torch.allclose(t["boxes"], raw * torch.tensor([256 / 400, 144 / 225] * 2), atol=1e-4)
    big = CocoDetectionDataset(fm_train, eval_transform_for_epoch(eval_size=100, max_size=1333), replace_bad=False)
    assert tuple(big[(7, i)][0].shape) == (3, 100, 177)  # shorter side 100, 400 * 100 / 225 = 177.8
    assert torch.equal(big[(7, i)][0], big[(0, i)][0])  # deterministic


def test_transform_sizes_are_checked():
    with pytest.raises(ValueError, match="train_scales"):
        train_transform_for_epoch(train_scales=[], max_size=256)
    with pytest.raises(ValueError, match="crop_size"):
        train_transform_for_epoch(crop_size=(600, 384))


# --- collate and loader -----------------------------------------------------------------------------------
def test_collate_pads_masks_and_normalises_boxes():
    a = tv_tensors.Image(torch.full((3, 4, 6), 7, dtype=torch.uint8))
    ta = {
        "boxes": tv_tensors.BoundingBoxes(
            [[0.0, 0.0, 3.0, 2.0], [3.0, 1.0, 6.0, 4.0]], format="XYXY", canvas_size=(4, 6)
        ),
        "labels": torch.tensor([2, 0]),
        "image_id": 11,
        "orig_size": (40, 60),
    }
    b = tv_tensors.Image(torch.full((3, 5, 3), 9, dtype=torch.uint8))
    tb = {
        "boxes": tv_tensors.BoundingBoxes(torch.zeros((0, 4)), format="XYXY", canvas_size=(5, 3)),
        "labels": torch.zeros((0,), dtype=torch.int64),
        "image_id": 12,
        "orig_size": (50, 30),
    }
    bad = BadSample("x.jpg", "RuntimeError: no")
    items = [(a, ta, ()), bad, (b, tb, (BadSample("y.jpg", "e"),))]
    mean = collate_detection(items)  # DINO's default: the mean colour (upstream pads the normalised image with 0)
    assert (
        mean["pad_value"] == "mean" and (mean["image"][0, :, 4:, :].permute(1, 2, 0) == torch.tensor(MEAN_PIXEL)).all()
    )
    assert (mean["image"][0, :, :4, :6] == 7).all() and torch.equal(
        mean["mask"], collate_detection(items, 1, (), "black")["mask"]
    )
    batch = collate_detection(items, pad_value="black")
    assert batch["image"].shape == (2, 3, 5, 6) and batch["image"].dtype == torch.uint8
    assert type(batch["image"]) is torch.Tensor
    assert (batch["image"][0, :, :4, :6] == 7).all() and (batch["image"][0, :, 4:, :] == 0).all()
    assert (batch["image"][1, :, :5, :3] == 9).all() and (batch["image"][1, :, :, 3:] == 0).all()
    m = batch["mask"]
    assert m.dtype == torch.bool and m.shape == (2, 5, 6)
    assert not m[0, :4, :6].any() and m[0, 4].all() and int(m[0].sum()) == 6
    assert not m[1, :, :3].any() and m[1, :, 3:].all() and int(m[1].sum()) == 15
    t0, t1 = batch["targets"]
    # [0,0,3,2] in 6x4 -> cx 1.5/6, cy 1/4, w 3/6, h 2/4; [3,1,6,4] -> cx 4.5/6, cy 2.5/4, w 3/6, h 3/4
    assert torch.allclose(t0["boxes"], torch.tensor([[0.25, 0.25, 0.5, 0.5], [0.75, 0.625, 0.5, 0.75]]))
    assert t0["boxes"].dtype == torch.float32 and type(t0["boxes"]) is torch.Tensor
    assert t0["labels"].tolist() == [2, 0] and t0["labels"].dtype == torch.int64 and t0["image_id"] == 11
    assert t0["orig_size"].tolist() == [40, 60] and t0["size"].tolist() == [4, 6] and t0["size"].dtype == torch.int64
    assert t1["boxes"].shape == (0, 4) and t1["size"].tolist() == [5, 3] and t1["orig_size"].tolist() == [50, 30]
    assert [x.path for x in batch["bad"]] == ["x.jpg", "y.jpg"]


def test_one_worker_loader_pickles_dataset_and_transforms(fm_train):
    ds = CocoDetectionDataset(fm_train, _tt(), seed=1)
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[(0, 3)][0], ds[(0, 3)][0])
    order = EpochSampler(len(ds), shuffle=True, seed=0)
    order.set_epoch(1)
    loader = build_loader(
        ds,
        BatchSampler(order, 4, drop_last=True),
        collate_detection,
        num_workers=1,
        prefetch_factor=2,
        pin_memory=False,
        persistent_workers=False,
    )
    it = iter(loader)
    first = next(it)
    del it
    keys = list(order)[:4]
    direct = collate_detection([ds[k] for k in keys])
    assert torch.equal(first["image"], direct["image"]) and torch.equal(first["mask"], direct["mask"])
    assert [t["image_id"] for t in first["targets"]] == [fm_train.image_ids[i] for _, i in keys]
    for t, d in zip(first["targets"], direct["targets"]):
        assert torch.equal(t["boxes"], d["boxes"]) and ((t["boxes"] >= 0) & (t["boxes"] <= 1)).all()
    assert first["bad"] == []


def test_floorplans_coco_builds_and_scans(shared_data, tmp_path):
    from floorplans_coco import build_floorplans_coco

    ann, images = build_floorplans_coco(shared_data / "r3d-floorplans", tmp_path, split="train", limit=3)
    split = scan_coco(ann, images, "floorplans")
    assert split.categories == ["wall", "room"] and split.label_to_category_id == [1, 2]
    assert len(split) == 3 and len(split.boxes) > 3 and set(split.labels.tolist()) == {0, 1}
    data = json.loads(ann.read_text())
    assert data["images"][0]["file_name"].endswith(".jpg") and all(a["iscrowd"] == 0 for a in data["annotations"])
