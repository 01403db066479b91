"""The COCO reader's label space (:mod:`trainer.data.formats.coco`, which re-exports these): one map both ways
between a model's class index, the JSON's category id and its name (:class:`LabelMap`), and the relabelling of a
scanned split into a label space (:func:`apply_label_space`).

``contiguous`` numbers the K declared categories 0..K-1 in id order; ``coco_ids`` keeps the category id itself
as the label, with max id + 1 classes, as upstream DINO does (IDEA-Research/DINO ``datasets/coco.py`` takes
``obj["category_id"]`` as the label; ``config/DINO/DINO_4scale.py``: ``num_classes = 91`` and
``dn_labelbook_size = 91`` for COCO 2017, whose ids run 1..90).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from trainer.data.formats.coco import CocoSplit

#: What a class index means: the k-th category in id order, or the category id itself (upstream DINO).
LABEL_SPACES = ("contiguous", "coco_ids")


@dataclass(frozen=True)
class LabelMap:
    """Class index <-> COCO category id <-> name, for one label space (:data:`LABEL_SPACES`).

    ``category_ids`` / ``names``: the declared categories sorted by id. ``contiguous``: label k is the k-th of
    them, ``num_classes`` = K. ``coco_ids``: the label is the id (labels no category declares, e.g. COCO 2017's
    0, 12, 26, ..., are classes that never occur), ``num_classes`` = max id + 1 (COCO 2017: 91, as upstream's
    ``num_classes`` and ``dn_labelbook_size``).
    """

    kind: str
    category_ids: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self):
        if self.kind not in LABEL_SPACES:
            raise ValueError(f"label_space: got {self.kind!r}; expected one of {', '.join(LABEL_SPACES)}")
        if self.kind == "coco_ids" and self.category_ids and min(self.category_ids) < 0:
            raise ValueError(
                f"label_space: coco_ids needs category ids >= 0 (they become class indices); got {min(self.category_ids)}"
            )

    @property
    def num_classes(self) -> int:
        """Outputs of the class heads."""
        if self.kind == "coco_ids":
            return max(self.category_ids, default=-1) + 1
        return len(self.category_ids)

    def label(self, category_id: int) -> int:
        """The class index of JSON ``category_id`` (KeyError when not declared)."""
        if category_id not in self.category_ids:
            raise KeyError(category_id)
        return category_id if self.kind == "coco_ids" else self.category_ids.index(category_id)

    def category_id(self, label: int) -> int | None:
        """The JSON category id of class ``label``; None for a label no category declares."""
        if self.kind == "coco_ids":
            return label if label in self.category_ids else None
        return self.category_ids[label] if 0 <= label < len(self.category_ids) else None

    def name(self, label: int) -> str | None:
        """The category name of class ``label``; None for a label no category declares."""
        cid = self.category_id(label)
        return None if cid is None else self.names[self.category_ids.index(cid)]

    def dense(self) -> tuple[list[int], list[str]]:
        """Per class index ``0..num_classes-1``: its category id and name (``coco_ids``: the index itself and
        ``""`` where no category is declared), for code that indexes by label."""
        ids = [self.category_id(k) for k in range(self.num_classes)]
        return [k if c is None else c for k, c in enumerate(ids)], [self.name(k) or "" for k in range(self.num_classes)]

    def to_label_space(self) -> dict:
        """The JSON form stored in checkpoints: ``{"categories": names, "category_ids": ids}`` (declared, in id
        order), plus ``"label_space": "coco_ids"`` and ``"num_classes"`` in that space (absent for contiguous, so
        checkpoints written before the option compare equal)."""
        out = {"categories": list(self.names), "category_ids": list(self.category_ids)}
        if self.kind != "contiguous":
            out.update(label_space=self.kind, num_classes=self.num_classes)
        return out

    @classmethod
    def from_label_space(cls, label_space: dict) -> LabelMap:
        """The map of a checkpoint's ``label_space`` (:meth:`to_label_space`; without ``category_ids``: 0..K-1)."""
        names = tuple(label_space.get("categories") or ())
        ids = tuple(int(i) for i in (label_space.get("category_ids") or range(len(names))))
        return cls(str(label_space.get("label_space") or "contiguous"), ids, names)


def apply_label_space(split: CocoSplit, kind: str, max_category_id: int = 10_000) -> CocoSplit:
    """``split`` (labels contiguous, as :func:`scan_coco` returns it) with its box and crowd labels in label space
    ``kind`` (:data:`LABEL_SPACES`); the same split for ``contiguous``.

    ``max_category_id``: with ``coco_ids`` the class heads get max id + 1 outputs, so a larger id is refused
    (config field ``max_category_id``).

    Raises:
        ValueError: an unknown ``kind``, or ``coco_ids`` with a negative category id or one above
            ``max_category_id`` (one phrase naming the id and its category).
    """
    target = LabelMap(kind, tuple(split.label_to_category_id), tuple(split.categories))
    if kind == "coco_ids" and target.category_ids and max(target.category_ids) > max_category_id:
        big = max(target.category_ids)
        raise ValueError(
            f"label_space: coco_ids makes category id {big} ({target.names[target.category_ids.index(big)]!r}) "
            f"class index {big}, a head of {big + 1} outputs; ids must be <= max_category_id ({max_category_id}): "
            "renumber the categories, raise max_category_id, or use label_space: contiguous"
        )
    if kind == split.label_space:
        return split
    ids = np.asarray(split.label_to_category_id, dtype=np.int64)
    if kind == "coco_ids":  # from contiguous
        labels, crowd = ids[split.labels], ids[split.crowd_labels]
    else:
        back = {c: target.label(c) for c in target.category_ids}
        labels = np.asarray([back[int(c)] for c in split.labels], dtype=np.int64)
        crowd = np.asarray([back[int(c)] for c in split.crowd_labels], dtype=np.int64)
    return replace(split, labels=labels, crowd_labels=crowd, label_space=kind)
