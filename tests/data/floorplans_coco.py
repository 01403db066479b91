"""Test helper: a COCO detection JSON for the R3D floor plans (``../shared/data/r3d-floorplans``), two classes as in
seed 000: category 1 = wall, 2 = room.

The R3D set (DeepFloorplan) stores, beside each plan ``<split>/N.jpg``, colour-coded masks of the same size:
``N_rooms.png`` (one colour per room type: bathroom (192, 255, 255), living/kitchen/dining (224, 255, 192),
bedroom (255, 224, 128), closet (192, 192, 224), hall (255, 160, 96), balcony (255, 224, 224), others; black =
not a room) and ``N_wall.png`` (white walls on black).

Instances:

* **rooms**: the connected components (``scipy.ndimage.label``, 4-connectivity) of each room colour separately, so
  two touching rooms of different types stay two rooms; near-black colours (every channel < 16, a few stray
  pixels in some masks) and white count as background. Components under ``min_room_fraction`` (0.1 %) of the
  image are dropped (stray pixels, slivers).
* **walls**: one instance per connected component of the wall mask, i.e. per wall *piece*: the R3D wall masks
  are broken by door and window openings, so a plan gives ~4-15 pieces, each a straight run or an L/T/+-shaped
  group of walls meeting at corners; its box spans the whole piece. We do not split pieces further at corners
  or junctions (a skeleton-based split into straight segments would give thinner, more numerous boxes, but
  depends on a junction heuristic; connected components are reproducible and match the mask as drawn).
  Components under ``min_wall_fraction`` (0.02 %) of the image are dropped.

Boxes are ``[x, y, w, h]`` in pixels (``x, y`` the top-left pixel's corner, ``w, h`` the extent in pixels), so a
component spanning columns 3..7 has ``x = 3, w = 5``. The images are not copied: ``file_name`` is relative to
``root/split``, which :func:`build_floorplans_coco` returns as the image folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

WALL, ROOM = 1, 2


def _component_boxes(mask: np.ndarray, min_pixels: float) -> list[tuple[list[int], int]]:
    """``[([x, y, w, h], pixel count), ...]`` of the 4-connected components of a boolean mask of at least
    ``min_pixels`` pixels, in label order."""
    lab, n = ndimage.label(mask)
    if n == 0:
        return []
    counts = np.bincount(lab.ravel(), minlength=n + 1)
    out = []
    for k, sl in enumerate(ndimage.find_objects(lab), start=1):
        if sl is None or counts[k] < min_pixels:
            continue
        ys, xs = sl
        out.append(([xs.start, ys.start, xs.stop - xs.start, ys.stop - ys.start], int(counts[k])))
    return out


def plan_instances(
    rooms_rgb: np.ndarray, wall_rgb: np.ndarray, min_room_fraction: float = 0.001, min_wall_fraction: float = 0.0002
) -> list[tuple[int, list[int], int]]:
    """``[(category_id, [x, y, w, h], area in pixels), ...]`` of one plan from its rooms and wall masks
    (uint8 (H, W, 3) each): walls first, then rooms by colour."""
    h, w = wall_rgb.shape[:2]
    found = [(WALL, b, a) for b, a in _component_boxes(wall_rgb.max(axis=-1) > 127, min_wall_fraction * h * w)]
    flat = rooms_rgb.reshape(-1, 3)
    colours = np.unique(flat, axis=0)
    for c in colours:
        if c.max() < 16 or c.min() == 255:  # background (black, near-black noise) or white
            continue
        mask = (rooms_rgb == c).all(axis=-1)
        found += [(ROOM, b, a) for b, a in _component_boxes(mask, min_room_fraction * h * w)]
    return found


def build_floorplans_coco(
    root: str | Path, out_dir: str | Path, split: str = "train", limit: int | None = None, skip_mismatched: bool = False
) -> tuple[Path, Path]:
    """Write ``out_dir/floorplans_<split>.json`` for the plans of ``root/split`` (sorted by name, the first
    ``limit`` when given) and return ``(json path, image folder root/split)``. Image ids are 0, 1, ... in that
    order; annotation ids 0, 1, ...; ``iscrowd`` 0 everywhere. A plan whose masks differ in size from it (R3D
    train has three, 6 px smaller) raises ValueError, or is left out with ``skip_mismatched``."""
    root, out_dir = Path(root), Path(out_dir)
    folder = root / split
    plans = sorted(p for p in folder.glob("*.jpg") if p.stem.isdigit())[:limit]
    images, annotations = [], []
    for plan in plans:
        with Image.open(plan) as im:
            w, h = im.size
        rooms = np.asarray(Image.open(folder / f"{plan.stem}_rooms.png").convert("RGB"))
        wall = np.asarray(Image.open(folder / f"{plan.stem}_wall.png").convert("RGB"))
        if rooms.shape[:2] != (h, w) or wall.shape[:2] != (h, w):
            if skip_mismatched:
                continue
            raise ValueError(f"{plan}: masks {rooms.shape[:2]}, {wall.shape[:2]} differ from the plan's {(h, w)}")
        image_id = len(images)
        images.append({"id": image_id, "file_name": plan.name, "width": w, "height": h})
        for cat, box, area in plan_instances(rooms, wall):
            annotations.append(
                {
                    "id": len(annotations),
                    "image_id": image_id,
                    "category_id": cat,
                    "bbox": box,
                    "area": area,
                    "iscrowd": 0,
                }
            )
    data = {
        "info": {"description": f"R3D floor plans ({split}), walls and rooms as boxes; built by floorplans_coco.py"},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": WALL, "name": "wall"}, {"id": ROOM, "name": "room"}],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"floorplans_{split}.json"
    path.write_text(json.dumps(data))
    return path, folder
