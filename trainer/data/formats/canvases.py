"""Fixed canvases for detection batches: every batch is padded to one of at most :data:`MAX_CANVASES` (H, W)
shapes for the whole run, instead of to its own largest image.

A first-seen input shape costs a GPU more than a repeated one: cuDNN autotunes each new convolution shape, the
caching allocator carves new blocks, and ``torch.compile`` or a CUDA graph needs one graph per shape. With
DINO's multi-scale recipe and per-batch padding, a facemask epoch makes ~93 distinct padded shapes at
``pad_to_multiple`` 64 (docs/benchmarks.md). Fixed canvases are how RT-DETR/D-FINE (a fixed 640 x 640 input per
scale) and Co-DINO's large-scale-jitter recipe (every image padded to 1024 x 1024) avoid that; here the recipe
stays DINO's and only the padding changes, each image at the top-left with the padding mask as before.

The config field ``canvases`` (:func:`parse_canvases`): ``""`` off (today's per-batch padding), ``auto``
(:func:`auto_canvases`: chosen from the training set's image sizes through the real transform), or a list
``"HxW,HxW,..."``. Every set of canvases holds a *cover*: a canvas as large as the largest batch the
transforms can make from this data (:func:`train_size_bound`, and the evaluation sizes themselves), so no batch
misses every canvas; a list without one is refused when the data is read. Should a batch still fit no canvas,
the collate pads it as without canvases (one more shape) rather than fail.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

from trainer.data.sampler import EpochSampler

#: At most this many training canvases (and 2 evaluation canvases): shapes a GPU sees for the whole run.
MAX_CANVASES = 4
MAX_EVAL_CANVASES = 2
_PAIR = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")

Canvas = tuple[int, int]


def round_up(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple`` (pixels)."""
    m = max(1, int(multiple))
    return -(-int(x) // m) * m


def cover_canvas(max_size: int, multiple: int) -> Canvas:
    """The canvas that holds any image of any data set: ``max_size`` on both sides rounded up to ``multiple``
    (DINO's resizes cap the longest side at ``max_size``, and crops can turn a landscape photo portrait). What
    ``plan`` assumes for ``auto`` before reading the data."""
    side = round_up(max_size, multiple)
    return side, side


def train_size_bound(
    sizes: Sequence[Canvas],
    scales: Sequence[int],
    max_size: int,
    crop_size: tuple[int, int],
    crop_prob: float,
) -> Canvas:
    """Largest (h, w) in pixels DINO's training transform can give images of ``sizes`` ((H, W) of the files):
    the resize branch is RandomShortestSize(``max(scales)``, ``max_size``) (torchvision's arithmetic:
    ``r = min(S / short, max_size / long)``, sides truncated); with ``crop_prob`` > 0 the crop branch's crops
    have an aspect ratio of at most ``crop_size[1] / crop_size[0]``, either orientation, resized the same way.
    """
    s = max(scales)
    h_max = w_max = 0
    for h0, w0 in sizes:
        r = min(s / min(h0, w0), max_size / max(h0, w0))
        h_max, w_max = max(h_max, int(h0 * r)), max(w_max, int(w0 * r))
    if crop_prob > 0:
        long = min(int(-(-s * crop_size[1] // crop_size[0])), max_size)
        h_max, w_max = max(h_max, long), max(w_max, long)
    return h_max, w_max


def parse_canvases(text: str, multiple: int) -> list[Canvas] | str:
    """The ``canvases`` field: ``[]`` (off), ``"auto"``, or the list of (H, W) canvases in pixels, sorted by
    area.

    Raises:
        ValueError: (one phrase, the caller names the field) an entry that is not ``HxW`` with positive
            integers, a side that is not a multiple of ``multiple``, or more than :data:`MAX_CANVASES` entries.
    """
    t = (text or "").strip()
    if not t:
        return []
    if t.lower() == "auto":
        return "auto"
    out: list[Canvas] = []
    for part in t.split(","):
        m = _PAIR.match(part)
        if not m or int(m.group(1)) <= 0 or int(m.group(2)) <= 0:
            raise ValueError(f"expected auto, empty, or canvases as HxW,HxW,... in pixels; got {part.strip()!r}")
        h, w = int(m.group(1)), int(m.group(2))
        if h % multiple or w % multiple:
            raise ValueError(f"canvas {h}x{w}: each side must be a multiple of pad_to_multiple ({multiple})")
        out.append((h, w))
    if len(set(out)) > MAX_CANVASES:
        raise ValueError(f"at most {MAX_CANVASES} canvases, got {len(set(out))}")
    return sorted(set(out), key=lambda c: (c[0] * c[1], c))


def fit_canvas(h: int, w: int, canvases: Sequence[Canvas]) -> Canvas | None:
    """The smallest-area canvas (ties: the first in order) of ``canvases`` that holds an ``h`` x ``w`` batch,
    or None when none does."""
    best = None
    for c in canvases:
        if c[0] >= h and c[1] >= w and (best is None or c[0] * c[1] < best[0] * best[1]):
            best = c
    return best


def pick_canvases(batch_sizes: Sequence[Canvas], cover: Canvas, k: int, multiple: int) -> list[Canvas]:
    """At most ``k`` canvases for batches of largest image sizes ``batch_sizes`` ((h, w) pixels each): always
    ``cover``, then greedily the candidate (a batch's size rounded up to ``multiple``) that most reduces the
    summed canvas area over ``batch_sizes``, while one does. Sorted by area. The batches are counted per distinct
    rounded size first, so the work grows with the distinct sizes (hundreds on COCO), not the batches."""
    need = Counter((round_up(h, multiple), round_up(w, multiple)) for h, w in batch_sizes)
    chosen = [cover]

    def cost(cs: list[Canvas]) -> int:
        total = 0
        for (h, w), n in need.items():
            a, b = fit_canvas(h, w, cs)
            total += a * b * n
        return total

    best_cost = cost(chosen)
    candidates = sorted(set(need) - {cover})
    while len(chosen) < k and candidates:
        trial = min(candidates, key=lambda c: (cost(chosen + [c]), c))
        c_cost = cost(chosen + [trial])
        if c_cost >= best_cost:
            break
        chosen.append(trial)
        candidates.remove(trial)
        best_cost = c_cost
    return sorted(chosen, key=lambda c: (c[0] * c[1], c))


def batch_sizes(sizes: Callable[[int], Canvas], order: Sequence[int], micro_batch: int) -> list[Canvas]:
    """(largest h, largest w) of each micro-batch of ``order`` (dataset indices in loader order), where
    ``sizes(i)`` is image ``i``'s (h, w) after the transform; a last incomplete batch counts too."""
    out = []
    for s in range(0, len(order), max(1, micro_batch)):
        hw = [sizes(i) for i in order[s : s + micro_batch]]
        out.append((max(h for h, _ in hw), max(w for _, w in hw)))
    return out


def padding_share(batch_hw: Sequence[Sequence[Canvas]], canvases: Sequence[Canvas], multiple: int) -> float:
    """Share of padded pixels (0..1) over batches given as lists of their images' (h, w): each batch padded
    to its fitting canvas, or (``canvases`` empty) to its largest h and w rounded up to ``multiple``."""
    image_px = padded_px = 0
    for items in batch_hw:
        h, w = max(a for a, _ in items), max(b for _, b in items)
        ph, pw = (round_up(h, multiple), round_up(w, multiple))
        ph, pw = (fit_canvas(ph, pw, canvases) or (ph, pw)) if canvases else (ph, pw)
        padded_px += ph * pw * len(items)
        image_px += sum(a * b for a, b in items)
    return 1.0 - image_px / max(1, padded_px)


def choose_canvases(
    setting: list[Canvas] | str,
    train_ds,
    val_ds,
    train_recipe: tuple,
    max_size: int,
    multiple: int,
    micro_batch: int,
    eval_batch: int,
    seed: int,
) -> tuple[list[Canvas], list[Canvas]]:
    """(training canvases, evaluation canvases) for a parsed ``setting`` (``"auto"`` or a list) over two
    :class:`~trainer.data.formats.coco_dataset.CocoDetectionDataset` (their ``transformed_size``).

    Each set holds a cover: for training the largest batch the recipe can make from this data
    (:func:`train_size_bound`; ``train_recipe`` = (scales, crop_size, crop_prob)), for evaluation its largest
    sizes. ``auto`` adds the canvases that cover epoch 0's and epoch 1's micro-batches (the training order of one
    process, ``seed``) and the evaluation batches with the least padded area (:func:`pick_canvases`); a list is
    used as given for training, and its canvases that evaluation batches fit for evaluation.

    Raises:
        ValueError: a list none of whose canvases holds a cover (one phrase naming the size it needs).
    """
    scales, crop, crop_prob = train_recipe
    bound = train_size_bound(train_ds.split.sizes, scales, max_size, crop, crop_prob)
    val_batches = batch_sizes(lambda i: val_ds.transformed_size(0, i), range(len(val_ds)), eval_batch)
    covers = [
        (round_up(bound[0], multiple), round_up(bound[1], multiple)),
        (round_up(max(h for h, _ in val_batches), multiple), round_up(max(w for _, w in val_batches), multiple)),
    ]
    if setting == "auto":
        train_batches = []
        for epoch in (0, 1):
            order = EpochSampler(len(train_ds), shuffle=True, seed=seed)
            order.set_epoch(epoch)
            train_batches += batch_sizes(
                lambda i, e=epoch: train_ds.transformed_size(e, i), [i for _, i in order], micro_batch
            )
        return (
            pick_canvases(train_batches, covers[0], MAX_CANVASES, multiple),
            pick_canvases(val_batches, covers[1], MAX_EVAL_CANVASES, multiple),
        )
    for (h, w), what in zip(covers, ("training", "evaluation")):
        if fit_canvas(h, w, setting) is None:
            raise ValueError(
                f"no canvas holds every {what} batch this data and recipe can make: add one of at least {h}x{w}"
            )
    fits = {fit_canvas(round_up(h, multiple), round_up(w, multiple), setting) for h, w in val_batches}
    return list(setting), sorted(fits, key=lambda c: (c[0] * c[1], c))
