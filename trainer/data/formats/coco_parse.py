"""Reading and structural validation of a COCO detection JSON into flat arrays (:func:`parse`); the policy and
the messages are :mod:`trainer.data.formats.coco`'s (its module docstring).

The file is read by ``json`` with an object hook that turns each annotation and image object into a small tuple
(:func:`_compact`) and the cyclic garbage collector paused (:func:`_no_gc`), then checked over whole columns: the types of
a column at once (``set(map(type, column))``), ids, references and boxes with numpy. Anything irregular sends the data through the per-entry checks, which name
the entry in the same words as before; so the fast path changes speed and memory, never a message.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import json
import math
import operator
from pathlib import Path

import numpy as np

from trainer.data.formats.coco_cache import ParsedCoco
from trainer.data.formats.columns import StringColumn
from trainer.errors import DataError

#: A box may overhang its image by this many pixels on any side (it is clipped); more makes the image bad.
BOX_TOLERANCE_PX = 1.0

#: How many examples a one-line error or report names.
EXAMPLES = 3

_REQUIRED = {
    "images": {
        "id": "an integer",
        "file_name": "a string",
        "width": "a positive integer",
        "height": "a positive integer",
    },
    "annotations": {"id": "an integer", "image_id": "an integer", "category_id": "an integer", "bbox": "[x, y, w, h]"},
    "categories": {"id": "an integer", "name": "a string"},
}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _key_problem(section: str, key: str, value) -> bool:
    """True when ``value`` is not what ``section``'s ``key`` must be."""
    if key in ("id", "image_id", "category_id"):
        return not _is_int(value)
    if key in ("width", "height"):
        return not (_is_int(value) and value > 0)
    if key in ("file_name", "name"):
        return not (isinstance(value, str) and value)
    if key == "bbox":
        return not (isinstance(value, (list, tuple)) and len(value) == 4 and all(_is_num(v) for v in value))
    if key == "iscrowd":
        return value not in (0, 1) or isinstance(value, float) and not value.is_integer()
    return False


def _examples(items: list[str], n: int = EXAMPLES) -> str:
    return "; ".join(items[:n]) + (f"; (+{len(items) - n} more)" if len(items) > n else "")


def _compact(d: dict):
    """``json``'s ``object_hook``: an object with an annotation's keys becomes the tuple ``(id, image_id,
    category_id, bbox, iscrowd)``, one with an image's ``(id, file_name, width, height)`` (values unchecked), so
    the file never exists as a million dicts (COCO train: a tenth less memory than plain ``json.load``, and
    faster). JSON itself has no tuples, so a tuple is always ours. Any other object stays a dict; one in the
    wrong section sends the file through the per-entry checks (:func:`parse`)."""
    try:
        return d["id"], d["image_id"], d["category_id"], d["bbox"], d.get("iscrowd", 0)
    except KeyError:
        pass
    try:
        return d["id"], d["file_name"], d["width"], d["height"]
    except KeyError:
        return d


@contextlib.contextmanager
def _no_gc():
    """Cyclic garbage collection paused: parsing creates millions of containers and none of them is garbage,
    yet each generation-2 pass would walk them all (a third of ``json.load``'s time on COCO train)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_json(path: Path, where: str, compact: bool = False):
    """The JSON at ``path`` (``compact``: with :func:`_compact` as the object hook).

    Raises:
        DataError: missing, a folder, not JSON (line and column), not UTF-8.
    """
    if not path.is_file():
        what = "is a folder" if path.exists() else "does not exist"
        raise DataError(f"{where}: annotations file {path} {what} (expected a COCO detection JSON)")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, object_hook=_compact if compact else None)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: {path} is not UTF-8 text (byte {e.start}); expected a COCO JSON") from None


def _check_entries(data: dict, where: str) -> None:
    """Raise on a missing/non-list top-level key, a non-object entry or a missing/malformed required key."""
    for section in _REQUIRED:
        if section not in data:
            raise DataError(
                f"{where}: missing top-level key '{section}' (a COCO detection file has 'images', 'annotations' "
                f"and 'categories'; present: {', '.join(map(repr, sorted(data))) or 'none'})"
            )
        if not isinstance(data[section], list):
            raise DataError(f"{where}: '{section}' is a {type(data[section]).__name__}, expected a list of objects")
    for section, required in _REQUIRED.items():
        bad = []
        for k, e in enumerate(data[section]):
            if not isinstance(e, dict):
                bad.append(f"entry #{k} is not an object (got {type(e).__name__} {e!r:.40})")
                continue
            name = f"entry #{k} (id {e['id']!r})" if "id" in e else f"entry #{k}"
            missing = [key for key in required if key not in e]
            if missing:
                bad.append(f"{name} has no {', '.join(map(repr, missing))}")
                continue
            wrong = [key for key in (*required, "iscrowd") if key in e and _key_problem(section, key, e[key])]
            if wrong:
                bad.append(
                    f"{name} has {', '.join(f'{key}={e[key]!r}' for key in wrong)}, expected "
                    + ", ".join(f"{key} = {required.get(key, '0 or 1')}" for key in wrong)
                )
        if bad:
            expected = ", ".join(f"{key} ({what})" for key, what in required.items())
            raise DataError(
                f"{where}: {len(bad)} '{section}' entr{'y is' if len(bad) == 1 else 'ies are'} malformed "
                f"(each needs {expected}): {_examples(bad)}"
            )


def _check_unique(ids: dict[str, list], where: str) -> None:
    """Raise on a repeated id; ``ids``: section -> its ids in file order."""
    for section in ("images", "annotations", "categories"):
        counts = collections.Counter(ids[section])
        dupes = [f"{i} ({n} entries)" for i, n in counts.items() if n > 1]
        if dupes:
            raise DataError(
                f"{where}: {len(dupes)} duplicate id(s) in '{section}': {_examples(dupes)}; each id must appear once"
            )


def _int64(values: list, where: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise DataError(f"{where}: an id does not fit in a signed 64-bit integer (expected ids below 2**63)") from None


def _repeats(ids: np.ndarray) -> bool:
    """Whether any id appears twice (a sort: numpy's hash-based ``unique`` is ~50x slower on 1M ids)."""
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def _only(values: list, types: set) -> bool:
    """Every value's exact type is in ``types`` (bool is not int here)."""
    return set(map(type, values)) <= types


def _columns(data: dict) -> dict | None:
    """The sections as columns (tuples of values in file order), when every entry was read as a well-formed
    object; None when anything is off (:func:`_check_entries` then names it). Types are checked a column at a
    time (``set(map(type, column))``, a C loop), never entry by entry."""
    ims, anns, cats = data["images"], data["annotations"], data["categories"]
    if not (_only(ims, {tuple}) and _only(anns, {tuple}) and _only(cats, {dict})):
        return None
    if not (set(map(len, ims)) <= {4} and set(map(len, anns)) <= {5}):
        return None
    try:
        c = {
            k: list(map(operator.itemgetter(i), ims)) for i, k in enumerate(("img_id", "file_name", "width", "height"))
        }
        for i, k in enumerate(("ann_id", "image_id", "category_id", "bbox", "iscrowd")):
            c[k] = list(map(operator.itemgetter(i), anns))
        c["cat_id"], c["name"] = [e["id"] for e in cats], [e["name"] for e in cats]
        ok = (
            all(
                _only(c[k], {int}) for k in ("img_id", "width", "height", "ann_id", "image_id", "category_id", "cat_id")
            )
            and all(_only(c[k], {str}) and all(c[k]) for k in ("file_name", "name"))
            and min(c["width"], default=1) > 0
            and min(c["height"], default=1) > 0
            and _only(c["bbox"], {list})
            and set(map(len, c["bbox"])) <= {4}
            and set(c["iscrowd"]) <= {0, 1}
        )
        if not ok:
            return None
        flat = list(itertools.chain.from_iterable(c["bbox"]))
        if not _only(flat, {int, float}):
            return None
        xywh = np.asarray(flat, dtype=np.float64).reshape(-1, 4)
        del flat
        if not np.isfinite(xywh).all():
            return None
    except (KeyError, TypeError, AttributeError, OverflowError):
        return None
    c["xywh"] = xywh
    del c["bbox"]  # the lists stay reachable from the entries, for messages, until parse drops them
    return c


def _as_compact(data: dict) -> dict:
    """Plain dicts (already through :func:`_check_entries`) in the form :func:`_compact` gives."""
    return {
        **data,
        "images": [_compact(e) for e in data["images"]],
        "annotations": [_compact(e) for e in data["annotations"]],
    }


def _top_level(data, where: str) -> None:
    if not isinstance(data, dict):
        raise DataError(
            f"{where}: the top level is a {type(data).__name__}, expected an object with 'images', "
            "'annotations' and 'categories'"
        )


def parse(path: Path, split_name: str) -> ParsedCoco:
    """Read and validate the JSON at ``path`` (the fatal list of :mod:`trainer.data.formats.coco`) into flat
    arrays, boxes grouped by image and the bad ones found; numpy over whole columns.

    Raises:
        DataError: a structural problem, in the same words as the per-entry checks.
    """
    with _no_gc():
        return _parse(path, split_name)


def _parse(path: Path, split_name: str) -> ParsedCoco:
    where = f"data split '{split_name}': {path}"
    data = load_json(path, f"data split '{split_name}'", compact=True)
    _top_level(data, where)
    c = _columns(data) if all(isinstance(data.get(s), list) for s in _REQUIRED) else None
    if c is None:  # something is irregular: read plain dicts again and let the per-entry checks name it
        data = load_json(path, f"data split '{split_name}'")
        _top_level(data, where)
        _check_entries(data, where)
        data = _as_compact(data)
        c = _columns(data)
        if c is None:
            raise DataError(f"{where}: a number does not fit in 64 bits (expected ids below 2**63, finite boxes)")
    img_id, ann_id, cat_id = _int64(c["img_id"], where), _int64(c["ann_id"], where), _int64(c["cat_id"], where)
    if any(_repeats(a) for a in (img_id, ann_id, cat_id)):
        _check_unique({"images": c["img_id"], "annotations": c["ann_id"], "categories": c["cat_id"]}, where)
    if not len(img_id):
        raise DataError(f"{where}: 'images' is empty (expected at least one image)")
    if not len(cat_id):
        raise DataError(f"{where}: 'categories' is empty (expected at least one {{id, name}})")

    anns = data["annotations"]
    cat_order = np.argsort(cat_id, kind="stable")
    cats_sorted = cat_id[cat_order]
    a_img, a_cat = _int64(c["image_id"], where), _int64(c["category_id"], where)
    img_order = np.argsort(img_id, kind="stable")
    pos = np.minimum(np.searchsorted(img_id[img_order], a_img), len(img_id) - 1)
    known_img = img_id[img_order][pos] == a_img
    k = img_order[pos]  # image index of each annotation
    label = np.minimum(np.searchsorted(cats_sorted, a_cat), len(cats_sorted) - 1)
    known_cat = cats_sorted[label] == a_cat
    if not known_img.all():
        unknown = [f"annotation {anns[j][0]} -> image_id {anns[j][1]}" for j in np.flatnonzero(~known_img)]
        raise DataError(
            f"{where}: {len(unknown)} annotation(s) refer to an image_id not in 'images': {_examples(unknown)}"
        )
    if not known_cat.all():
        unknown = [f"annotation {anns[j][0]} -> category_id {anns[j][2]}" for j in np.flatnonzero(~known_cat)]
        raise DataError(
            f"{where}: {len(unknown)} annotation(s) refer to a category_id not in 'categories' (ids "
            f"{', '.join(str(int(i)) for i in cats_sorted[:10])}{', ...' if len(cats_sorted) > 10 else ''}): "
            f"{_examples(unknown)}"
        )

    # boxes: the checks of the module docstring, on whole columns (float64, as Python floats)
    W = np.asarray(c["width"], dtype=np.float64)[k]
    H = np.asarray(c["height"], dtype=np.float64)[k]
    x, y, w, h = c["xywh"].T
    x1, y1, t = x + w, y + h, BOX_TOLERANCE_PX
    cx0, cx1, cy0, cy1 = np.clip(x, 0.0, W), np.clip(x1, 0.0, W), np.clip(y, 0.0, H), np.clip(y1, 0.0, H)
    nonpos = (w <= 0) | (h <= 0)
    outside = ~nonpos & ((x < -t) | (y < -t) | (x1 > W + t) | (y1 > H + t))
    no_area = ~nonpos & ~outside & ((cx1 <= cx0) | (cy1 <= cy0))
    bad = nonpos | outside | no_area
    bad_j = np.flatnonzero(bad)
    bad_images, first = np.unique(k[bad_j], return_index=True)  # first bad box of each image, in file order
    why = []
    for j in bad_j[first]:
        (a_id, _, _, a_box, _), im = anns[j], data["images"][k[j]]
        size = f"{im[2]}x{im[3]}"
        if nonpos[j]:
            why.append(f"annotation {a_id} bbox {a_box} has a non-positive width or height")
        elif outside[j]:
            why.append(f"annotation {a_id} bbox {a_box} lies outside the {size} image by more than {t:g} px")
        else:
            why.append(f"annotation {a_id} bbox {a_box} has no area inside the {size} image")
    del data, anns  # the objects go before the arrays below are built (the peak stays the parse's)

    xyxy = np.stack([cx0, cy0, cx1, cy1], axis=1).astype(np.float32)
    crowd = np.asarray(c["iscrowd"], dtype=np.float64) != 0
    n = len(img_id)

    def grouped(sel):
        order = np.flatnonzero(sel)[np.argsort(k[sel], kind="stable")]
        start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(k[sel], minlength=n), out=start[1:])
        return xyxy[order], label[order].astype(np.int64), start

    boxes, labels, box_start = grouped(~bad & ~crowd)
    crowd_boxes, crowd_labels, crowd_start = grouped(~bad & crowd)
    names = c["name"]
    return ParsedCoco(
        cat_ids=cats_sorted,
        cat_names=StringColumn.from_strings(names[i] for i in cat_order),
        image_ids=img_id,
        sizes=np.stack([np.asarray(c["height"], dtype=np.int64), np.asarray(c["width"], dtype=np.int64)], axis=1),
        file_names=StringColumn.from_strings(c["file_name"]),
        boxes=boxes,
        labels=labels,
        box_start=box_start,
        crowd_boxes=crowd_boxes,
        crowd_labels=crowd_labels,
        crowd_start=crowd_start,
        bad_images=bad_images.astype(np.int64),
        bad_why=StringColumn.from_strings(why),
        n_bad_boxes=int(bad.sum()),
    )
