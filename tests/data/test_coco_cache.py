"""The COCO parse cache (keyed by SHA-256, mapped by later readers), once-per-node ordering, the flat columns."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from trainer.data.formats import coco_cache
from trainer.data.formats.coco import CocoSplit, DataError, scan_coco
from trainer.data.formats.columns import IntColumn, StringColumn


def _data(tmp: Path) -> dict:
    """5 images (one in a sub-folder, one without boxes), sparse category ids, crowd, a bad box, a 1-px overhang,
    iscrowd written as true/1.0, int and float coordinates mixed."""
    (tmp / "img" / "sub").mkdir(parents=True)
    names = ["a.jpg", "sub/b.jpg", "c.jpg", "d.jpg", "e.jpg"]
    for n in names:
        (tmp / "img" / n).write_bytes(b"")
    return {
        "images": [
            {"id": 50 - k, "file_name": n, "width": 64, "height": 48, "license": 1} for k, n in enumerate(names)
        ],
        "annotations": [
            {
                "id": 1,
                "image_id": 50,
                "category_id": 90,
                "bbox": [1, 2, 10.5, 20],
                "area": 210.0,
                "segmentation": {"size": [48, 64], "counts": "PPYo1"},
            },  # nested RLE object
            {"id": 2, "image_id": 49, "category_id": 3, "bbox": [0, 0, 64.5, 48], "iscrowd": 0},  # overhang: clipped
            {"id": 3, "image_id": 50, "category_id": 3, "bbox": [5, 5, 5, 5], "iscrowd": True},
            {"id": 4, "image_id": 48, "category_id": 90, "bbox": [60, 40, 30, 30]},  # outside: image 48 left out
            {"id": 5, "image_id": 47, "category_id": 3, "bbox": [3.25, 4, 8, 8], "iscrowd": 1.0},
            {"id": 6, "image_id": 50, "category_id": 3, "bbox": [30, 20, 4, 4]},
        ],
        "categories": [{"id": 90, "name": "z"}, {"id": 3, "name": "c"}],
        # what real files carry besides: objects the reader ignores, some shaped like an annotation
        "info": {"id": 1, "image_id": 2, "category_id": 3, "bbox": [0, 0, 1, 1], "year": 2017},
        "licenses": [{"id": 1, "name": "cc", "url": "http://x"}],
    }


def _write(tmp: Path, data: dict) -> Path:
    p = tmp / "ann.json"
    p.write_text(json.dumps(data))
    return p


def _same(a: CocoSplit, b: CocoSplit) -> None:
    for f in fields(CocoSplit):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_split_from_the_cache_equals_the_parse_and_is_keyed_by_content(tmp_path):
    ann = _write(tmp_path, _data(tmp_path))
    plain = scan_coco(ann, tmp_path / "img", "train", 0.5)
    assert plain.image_ids == [50, 49, 47, 46] and plain.label_to_category_id == [3, 90]
    assert plain.paths[1] == str(tmp_path / "img" / "sub/b.jpg") and plain.sizes[0] == (48, 64)
    assert plain.targets(0)[0].tolist() == [[1, 2, 11.5, 22], [30, 20, 34, 24]]
    assert plain.targets(0)[1].tolist() == [1, 0] and plain.crowd(0)[0].tolist() == [[5, 5, 10, 10]]
    assert plain.targets(1)[0].tolist() == [[0, 0, 64, 48]] and plain.crowd(2)[1].tolist() == [0]
    assert [r for *_, r in plain.left_out] == [
        "annotation 4 bbox [60, 40, 30, 30] lies outside the 64x48 image by more than 1 px"
    ]
    cache = tmp_path / "cache"
    built = scan_coco(ann, tmp_path / "img", "train", 0.5, cache_dir=cache)
    (folder,) = cache.iterdir()
    assert folder.name == f"coco-{coco_cache.sha256_file(ann)}-v{coco_cache.FORMAT}"
    hit = scan_coco(ann, tmp_path / "img", "train", 0.5, cache_dir=cache)
    _same(plain, built)
    _same(plain, hit)
    # other bytes, other key: a second folder, never the stale parse
    data = _data(tmp_path / "2")
    data["annotations"][0]["bbox"] = [1, 2, 3, 4]
    ann2 = _write(tmp_path, data)
    changed = scan_coco(ann2, tmp_path / "2" / "img", "train", 0.5, cache_dir=cache)
    assert changed.targets(0)[0].tolist()[0] == [1, 2, 4, 6] and len(list(cache.iterdir())) == 2


def test_a_cache_hit_is_mapped_and_the_disk_is_still_checked(tmp_path):
    data = _data(tmp_path)
    data["annotations"].pop(3)  # no bad box: nothing left out, the arrays are the cache's own
    ann = _write(tmp_path, data)
    cache = tmp_path / "cache"
    scan_coco(ann, tmp_path / "img", "train", cache_dir=cache)
    hit = scan_coco(ann, tmp_path / "img", "train", cache_dir=cache)
    assert isinstance(hit.boxes, np.memmap) and not hit.boxes.flags.writeable and len(hit) == 5
    (tmp_path / "img" / "c.jpg").unlink()  # the JSON did not change, the folder did
    with pytest.raises(DataError, match=r"1 of 5 images cannot be used .*image 48 \(c.jpg\): file .*c.jpg does not"):
        scan_coco(ann, tmp_path / "img", "train", 0.0, cache_dir=cache)


def test_a_damaged_cache_entry_is_replaced_by_the_next_parse(tmp_path):
    ann, cache = _write(tmp_path, _data(tmp_path)), tmp_path / "cache"
    first = scan_coco(ann, tmp_path / "img", "train", 0.5, cache_dir=cache)
    (folder,) = [p for p in cache.iterdir() if p.name.startswith("coco-")]
    arrays = sorted(folder.glob("*.npy"))
    arrays[0].write_bytes(arrays[0].read_bytes()[:20])  # truncated: the entry no longer loads
    assert coco_cache.load(folder) is None
    _same(scan_coco(ann, tmp_path / "img", "train", 0.5, cache_dir=cache), first)  # parsed again, same split
    assert coco_cache.load(folder) is not None  # and the entry repaired for the next run
    assert [p.name for p in cache.iterdir()] == [folder.name]  # nothing left beside it


def test_an_unwritable_cache_dir_falls_back(tmp_path):
    ann = _write(tmp_path, _data(tmp_path))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    split = scan_coco(ann, tmp_path / "img", "train", 0.5, cache_dir=blocker / "cache")  # mkdir fails: parsed
    assert len(split) == 4
    assert coco_cache.writable_cache_dir(blocker / "cache") != blocker / "cache"


def test_bad_json_is_never_cached(tmp_path):
    data = _data(tmp_path)
    data["images"][0]["id"] = 49  # duplicate id
    cache = tmp_path / "cache"
    for _ in range(2):
        with pytest.raises(DataError, match=r"duplicate id\(s\) in 'images': 49 \(2 entries\)"):
            scan_coco(_write(tmp_path, data), tmp_path / "img", "train", cache_dir=cache)
    assert not cache.exists() or not list(cache.iterdir())


def test_once_per_node_rank_0_first_and_failures_reach_the_barrier():
    log = []

    def make(rank):
        def f():
            log.append(f"make {rank}")
            return rank

        return f

    for rank in (0, 1):
        assert coco_cache.once_per_node(make(rank), rank, lambda: log.append("barrier")) == rank
    assert log == ["make 0", "barrier", "barrier", "make 1"]

    def broken():
        raise DataError("bad file")

    log.clear()
    with pytest.raises(DataError, match="bad file"):
        coco_cache.once_per_node(broken, 0, lambda: log.append("barrier"))
    assert log == ["barrier"]
    assert coco_cache.once_per_node(make(3), 0, None) == 3


def test_columns_read_like_lists_and_pickle_flat():
    names = ["a.jpg", "sub/b é.png", "bad-\udcff.jpg", ""]
    col = StringColumn.from_strings(names, root="/data")
    assert list(col) == [f"/data/{n}" if n else "/data" for n in names] and col.name(2) == names[2]
    assert col.take([2, 0]) == ["/data/bad-\udcff.jpg", "/data/a.jpg"] and col[-4] == "/data/a.jpg"
    with pytest.raises(IndexError):
        col[4]
    ids = IntColumn([7, 8, 9])
    assert ids == [7, 8, 9] and ids.index(8) == 1 and 9 in ids and isinstance(ids[0], int)
    sizes = IntColumn(np.array([[48, 64], [30, 40]]))
    h, w = sizes[1]
    assert (h, w) == (30, 40) and sizes == [(48, 64), (30, 40)] and sizes.take([1]) == [(30, 40)]
    back = pickle.loads(pickle.dumps(col))
    assert back == col and back.data.dtype == np.uint8  # one buffer, no object per string


def test_an_irregular_file_takes_the_per_entry_checks_and_a_regular_one_does_not(tmp_path, monkeypatch):
    """The compact read handles a valid file alone; an entry it cannot read (here an image without
    'height') sends the file through the per-entry checks, which name it as before."""
    from trainer.data.formats import coco_parse

    calls = []
    monkeypatch.setattr(coco_parse, "_check_entries", lambda *a: calls.append(a))
    ann = _write(tmp_path, _data(tmp_path))
    scan_coco(ann, tmp_path / "img", "train", 0.5)
    assert calls == []
    monkeypatch.undo()
    data = json.loads(ann.read_text())
    del data["images"][2]["height"]
    with pytest.raises(DataError, match=r"'images' entry is malformed .*entry #2 \(id 48\) has no 'height'"):
        scan_coco(_write(tmp_path, data), tmp_path / "img", "train", 0.5)
