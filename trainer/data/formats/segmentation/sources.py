"""Several segmentation datasets in one run (seed 001: RID + Roofline + AIRS): each source has its folders,
pairing rule, its own classes and palette, a class map onto the run's shared label set, ``max_samples`` and a
``weight``; :class:`MultiSourceDataset` draws them together in one epoch and tags every sample with its source
so the evaluator can report per-dataset metrics.

A source is a mapping in the config's ``datasets`` list (keys: :data:`SOURCE_KEYS`); without ``datasets`` the
flat segmentation fields describe the one source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data.formats.segmentation.pairs import PairingRule, parse_palette, scan_pairs
from trainer.errors import DataError

#: Keys a ``datasets`` entry may have; ``name`` and ``data_dir`` are required.
SOURCE_KEYS = (
    "name",
    "data_dir",
    "seg_images",
    "seg_masks",
    "mask_suffix",
    "image_glob",
    "classes",
    "palette",
    "palette_tolerance",
    "unknown_colour",
    "class_map",
    "max_samples",
    "weight",
    "val_fraction",
)


@dataclass
class SegSource:
    """One dataset of a run. ``classes``: its own class names by mask id; ``lut``: int64 (256+,) own id -> shared
    id (``ignore_index`` for classes mapped to ``ignore``); ``weight``: repeats per epoch (see
    :class:`MultiSourceDataset`)."""

    name: str
    rule: PairingRule
    classes: list[str]
    lut: torch.Tensor
    palette: Optional[np.ndarray] = None
    palette_tolerance: int = 0
    unknown_colour: str = "error"
    max_samples: int = 0
    weight: float = 1.0
    val_fraction: float = 0.0
    splits: dict = field(default_factory=dict)


def _lut(own: list[str], shared: list[str], class_map: dict, ignore_index: int, where: str) -> torch.Tensor:
    """Own id -> shared id. ``class_map`` maps own names to shared names or ``ignore``; unmapped names map to the
    shared class of the same name.

    Raises:
        DataError: a name in ``class_map`` the source does not have, a target that is not a shared class, or an
            own class with no shared class of its name and no mapping (named with ``where``).
    """
    unknown = [k for k in class_map if k not in own]
    if unknown:
        raise DataError(f"{where}.class_map: {unknown} are not classes of this dataset ({own})")
    lut = torch.full((max(ignore_index, len(own)) + 1,), ignore_index, dtype=torch.int64)
    for i, name in enumerate(own):
        target = str(class_map.get(name, name))
        if target == "ignore":
            continue
        if target not in shared:
            raise DataError(
                f"{where}.class_map: class {name!r} maps to {target!r}, which is not one of the shared classes "
                f"{shared} (map it to one of them or to 'ignore')"
            )
        lut[i] = shared.index(target)
    return lut


def build_sources(cfg) -> list[SegSource]:
    """The run's sources from ``cfg.datasets`` (or one from the flat fields), scanned for both splits.

    Raises:
        DataError: an entry that is not a mapping, an unknown or missing key, a bad class map or palette, or any
            scan failure (the entry named as ``datasets[i]`` / its name).
    """
    shared, ignore = list(cfg.classes), cfg.ignore_index
    entries = cfg.datasets or [{"name": Path(cfg.data_dir).resolve().name or "data", "data_dir": "."}]
    flat = {
        k: getattr(cfg, k)
        for k in SOURCE_KEYS
        if k not in ("name", "data_dir", "class_map", "weight", "classes") and hasattr(cfg, k)
    }
    sources, names = [], set()
    for i, entry in enumerate(entries):
        where = f"datasets[{i}]"
        if not isinstance(entry, dict):
            raise DataError(f"{where}: expected a mapping of {', '.join(SOURCE_KEYS)}, got {entry!r}")
        bad = [k for k in entry if k not in SOURCE_KEYS]
        missing = [k for k in ("name", "data_dir") if k not in entry]
        if bad or missing:
            raise DataError(
                f"{where}: " + (f"unknown keys {bad}; known: {', '.join(SOURCE_KEYS)}" if bad else f"missing {missing}")
            )
        e = {**flat, "classes": shared, "class_map": {}, "weight": 1.0, **entry}
        name = str(e["name"])
        if name in names:
            raise DataError(f"{where}.name: {name!r} is used twice; dataset names must differ")
        names.add(name)
        where = f"datasets[{i}] ({name})"
        own = [str(c) for c in e["classes"]]
        if not isinstance(e["class_map"], dict):
            raise DataError(f"{where}.class_map: expected a mapping own class -> shared class or 'ignore'")
        weight = float(e["weight"])
        if not weight > 0:
            raise DataError(f"{where}.weight: got {e['weight']!r}; expected a number > 0")
        palette = parse_palette(list(e["palette"]), len(own)) if e.get("palette") else None
        root = Path(cfg.data_dir) / str(e["data_dir"])  # relative to the run's data_dir; absolute as given
        if not root.is_dir():
            raise DataError(f"{where}.data_dir: {root} is not a folder")
        rule = PairingRule(root, e["seg_images"], e["seg_masks"], e["mask_suffix"], e["image_glob"])
        src = SegSource(
            name,
            rule,
            own,
            _lut(own, shared, e["class_map"], ignore, where),
            palette,
            int(e["palette_tolerance"]),
            str(e["unknown_colour"]),
            int(e["max_samples"]),
            weight,
            float(e["val_fraction"]),
        )
        train_name = cfg.train_split if rule.has_splits else "train"
        val_name = cfg.val_split if rule.has_splits else "val"
        try:
            src.splits["train"] = scan_pairs(
                rule, train_name, cfg.max_bad_fraction, val_fraction=src.val_fraction, max_samples=src.max_samples
            )
            src.splits["val"] = scan_pairs(rule, val_name, cfg.max_bad_fraction, val_fraction=src.val_fraction)
        except DataError as err:
            raise DataError(f"{where}: {err}") from None
        sources.append(src)
    return sources


class MultiSourceDataset(Dataset):
    """The sources' datasets as one, keyed by ``(epoch, index)``; each item gets its source id appended:
    ``(image, mask, own_bad, source)``.

    Training together (``weights`` given): source ``s`` with ``n_s`` pairs and weight ``w_s`` fills
    ``round(w_s * n_s)`` (at least 1) positions per epoch; position ``k`` reads pair
    ``(k + epoch * round(w_s * n_s)) % n_s``, so weight 2 shows every pair twice an epoch and weight 0.5 shows half
    of them, a different half the next epoch. One after another (``epochs_per_dataset`` = E > 0): epoch ``e``
    trains on source ``(e // E) % S`` only, every epoch ``max_s round(w_s * n_s)`` samples long (a smaller source
    cycles through its pairs), so the sampler's length never changes. Evaluation: every pair once, in source order.
    """

    def __init__(self, datasets: list[Dataset], weights: Optional[list[float]] = None, epochs_per_dataset: int = 0):
        self.datasets = datasets
        sizes = [len(d) for d in datasets]
        self.counts = [max(1, round(w * n)) for w, n in zip(weights, sizes)] if weights else sizes
        self.offsets = np.cumsum([0, *self.counts])
        self.epochs_per_dataset = epochs_per_dataset

    def __len__(self) -> int:
        return max(self.counts) if self.epochs_per_dataset else int(self.offsets[-1])

    def locate(self, epoch: int, index: int) -> tuple[int, int]:
        """(source id, index within that source) of global position ``index`` in ``epoch``."""
        if self.epochs_per_dataset:
            s = (epoch // self.epochs_per_dataset) % len(self.datasets)
            return s, (index + epoch * len(self)) % len(self.datasets[s])
        s = int(np.searchsorted(self.offsets, index, side="right") - 1)
        k = index - int(self.offsets[s])
        return s, (k + epoch * self.counts[s]) % len(self.datasets[s])

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        s, local = self.locate(epoch, index)
        item = self.datasets[s][(epoch, local)]
        return item if not isinstance(item, tuple) else (*item[:3], s)
