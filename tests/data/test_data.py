"""Data: scanning, decoding (GIF, corrupt and truncated JPEG), bad-file replacement, layout errors,
sampler sharding and determinism, progressive resize schedule."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from trainer.data.formats.image_decode import decode_file
from trainer.data.formats.imagefolder import (
    BadSample,
    DataError,
    ImageFolderDataset,
    check_same_classes,
    collate_skip_bad,
    scan_split,
)
from trainer.data.sampler import EpochSampler
from trainer.data.transforms import progressive_size, train_transform, val_transform


def _tt(epoch):
    return train_transform(64, 0.5, 0.5)


def _vt(epoch):
    return val_transform(64, 0.875)


def _folder_with_bad_files(src: Path, dst: Path, per_class: int = 6) -> tuple[Path, list[Path]]:
    """Copy a few hymenoptera photos and add a garbage .jpg and a truncated .jpg to train/ants."""
    for split in ("train", "val"):
        for cls in ("ants", "bees"):
            out = dst / split / cls
            out.mkdir(parents=True)
            for f in sorted((src / split / cls).glob("*.jpg"))[:per_class]:
                shutil.copy(f, out / f.name)
    garbage = dst / "train" / "ants" / "zz_garbage.jpg"
    garbage.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg " * 20)
    good = sorted((src / "train" / "bees").glob("*.jpg"))[0].read_bytes()
    truncated = dst / "train" / "bees" / "zz_truncated.jpg"
    truncated.write_bytes(good[: len(good) // 3])
    return dst, [garbage, truncated]


def test_hymenoptera_scan_reports_gif_and_decodes_it(shared_data):
    scan = scan_split(shared_data / "hymenoptera", "train")
    assert scan.classes == ["ants", "bees"]
    assert scan.formats.get(".gif") == 1 and len(scan.samples) == 245
    assert "1 .gif" in scan.census()
    gif = next(p for p, _ in scan.samples if p.endswith(".gif"))
    img = decode_file(gif)
    assert img.dtype == torch.uint8 and img.shape == (3, 300, 300)


def test_corrupt_and_truncated_jpeg_are_replaced_and_reported(shared_data, tmp_path):
    root, bad = _folder_with_bad_files(shared_data / "hymenoptera", tmp_path / "d")
    scan = scan_split(root, "train")
    ds = ImageFolderDataset(scan, _tt, seed=0)
    paths = [p for p, _ in scan.samples]
    for b in bad:
        img, label, skipped = ds[(0, paths.index(str(b)))]
        assert img.shape == (3, 64, 64) and img.dtype == torch.uint8
        assert [s.path for s in skipped] == [str(b)] and "RuntimeError" in skipped[0].error
    batch = collate_skip_bad([ds[(0, i)] for i in range(len(ds))])
    assert batch["image"].shape[0] == len(ds)  # training batches keep their size
    assert sorted(s.path for s in batch["bad"]) == sorted(map(str, bad))


def test_eval_mode_drops_bad_files(shared_data, tmp_path):
    root, bad = _folder_with_bad_files(shared_data / "hymenoptera", tmp_path / "d")
    ds = ImageFolderDataset(scan_split(root, "train"), _vt, replace_bad=False)
    items = [ds[i] for i in range(len(ds))]
    batch = collate_skip_bad(items)
    assert batch["image"].shape[0] == len(ds) - 2
    assert all(isinstance(b, BadSample) for b in batch["bad"]) and len(batch["bad"]) == 2


def test_all_files_bad_raises(tmp_path):
    for split in ("train", "val"):
        for c in ("a", "b"):
            d = tmp_path / split / c
            d.mkdir(parents=True)
            for i in range(3):
                (d / f"{i}.jpg").write_bytes(b"not an image")
    ds = ImageFolderDataset(scan_split(tmp_path, "train"), _tt)
    with pytest.raises(DataError, match="consecutive files cannot be decoded"):
        ds[(0, 0)]


def test_layout_errors(tmp_path):
    with pytest.raises(DataError, match="data split 'val': folder .* does not exist"):
        (tmp_path / "train" / "a").mkdir(parents=True)
        scan_split(tmp_path, "val")
    (tmp_path / "train" / "b").mkdir()
    (tmp_path / "train" / "a" / "x.png").write_bytes(b"")
    with pytest.raises(DataError, match=r"class folder\(s\) with no images: .*train/b"):
        scan_split(tmp_path, "train")
    (tmp_path / "train" / "b" / "y.png").write_bytes(b"")
    (tmp_path / "val" / "a").mkdir(parents=True)
    (tmp_path / "val" / "c").mkdir(parents=True)
    (tmp_path / "val" / "a" / "x.png").write_bytes(b"")
    (tmp_path / "val" / "c" / "x.png").write_bytes(b"")
    with pytest.raises(DataError, match=r"only in train: \['b'\]; only in val: \['c'\]"):
        check_same_classes(scan_split(tmp_path, "train"), scan_split(tmp_path, "val"))


def test_augmentation_is_a_pure_function_of_seed_epoch_index(tiny_digits):
    scan = scan_split(tiny_digits, "train")
    ds = ImageFolderDataset(scan, _tt, seed=3)
    a = ds[(2, 5)][0]
    torch.manual_seed(123)  # global RNG state must not matter, and must not be consumed
    state = torch.get_rng_state()
    _ = ds[(2, 7)]
    b = ds[(2, 5)][0]
    assert torch.equal(a, b) and torch.equal(state, torch.get_rng_state())
    assert not torch.equal(ds[(3, 5)][0], a) or not torch.equal(ds[(2, 6)][0], a)


def test_sampler_shards_cover_and_resume():
    n, w = 10, 3
    shards = [EpochSampler(n, r, w, shuffle=True, seed=1) for r in range(w)]
    for s in shards:
        s.set_epoch(4)
    idx = [i for s in shards for (_, i) in s]
    assert len(idx) == 12 and set(idx) == set(range(n))  # padded to a multiple of the world size
    assert len({len(list(s)) for s in shards}) == 1
    s = shards[0]
    full = list(s)
    s.set_epoch(4, start=2)
    assert list(s) == full[2:] and all(e == 4 for e, _ in full)
    s.set_epoch(5)
    assert [i for _, i in s] != [i for _, i in full]
    evals = [list(EpochSampler(n, r, w, shuffle=False)) for r in range(w)]
    assert sorted(i for part in evals for _, i in part) == list(range(n))  # eval: each sample once


def test_progressive_schedule_matches_seed_003():
    sizes = [progressive_size(e, 60, 160, 224, 3) for e in range(60)]
    assert sizes[0] == sizes[19] == 160 and sizes[20] == sizes[39] == 192 and sizes[40] == sizes[59] == 224
    assert progressive_size(7, 10, 160, 224, 1) == 224


def test_builtin_digits_written_once(tmp_path, monkeypatch):
    from trainer.data.formats.digits import ensure_digits

    monkeypatch.setenv("TRAINSTACK_CACHE", str(tmp_path))
    root = ensure_digits()
    assert len(scan_split(root, "train").samples) == 1437 and len(scan_split(root, "val").samples) == 360
    mtime = (root / "val").stat().st_mtime
    assert ensure_digits() == root and (root / "val").stat().st_mtime == mtime
