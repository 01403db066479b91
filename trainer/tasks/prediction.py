"""What the tasks' prediction methods share (:meth:`trainer.tasks.base.Task.predict_inputs` and
:meth:`~trainer.tasks.base.Task.render_predictions`, run by ``python -m trainer predict``): reading the input
images, drawing labelled boxes and captions (``torchvision.utils.draw_bounding_boxes``), writing PNGs, and the
top-k records of classifiers. Below the ``predict`` command, which imports the tasks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

#: Colours of the drawn boxes, by label (tab10).
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
#: Drawn images whose shorter side is below this are upscaled (nearest, by an integer factor) so labels fit.
MIN_DRAWN_SIDE = 256


def draw_labelled_boxes(image, boxes, labels: list[str], colors: list[str], min_side: int = MIN_DRAWN_SIDE):
    """``image`` uint8 (3, H, W) with ``boxes`` (N, 4) xyxy in its pixels drawn in ``colors`` and captioned
    with ``labels`` (``torchvision.utils.draw_bounding_boxes``). An image whose shorter side is below
    ``min_side`` is first upscaled (nearest, integer factor; boxes scaled along) so the captions are legible.
    Returns a uint8 (3, H', W') tensor."""
    import torch
    from torchvision.utils import draw_bounding_boxes

    image = image.as_subclass(torch.Tensor).to("cpu", torch.uint8)
    boxes = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4).cpu()
    h, w = int(image.shape[-2]), int(image.shape[-1])
    scale = max(1, math.ceil(min_side / max(1, min(h, w))))
    if scale > 1:
        image = image.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
        boxes = boxes * scale
    limits = torch.tensor([image.shape[-1], image.shape[-2]] * 2, dtype=torch.float32) - 1
    boxes = torch.minimum(boxes.clamp(min=0), limits)
    if not len(boxes):
        return image.contiguous()
    width = max(1, round(min(image.shape[-2:]) / 200))
    return draw_bounding_boxes(image, boxes, labels=labels, colors=colors, width=width, fill_labels=True)


def read_images(paths: list[str]) -> tuple[list[str], list, list]:
    """Decode ``paths`` for prediction: ``(decoded paths, uint8 (3, H, W) images, BadSample per unreadable
    file)``. The header is checked with PIL first (:func:`~trainer.data.formats.image_decode.check_header`), so a
    file that is not an image is named by PIL's message instead of reaching the decoders (libpng prints to
    stderr); then :func:`~trainer.data.formats.image_decode.decode_file`. Never raises for a bad file."""
    from trainer.data.formats.image_decode import check_header, decode_file
    from trainer.data.samples import BadSample, describe_error

    kept, images, bad = [], [], []
    for path in paths:
        try:
            check_header(path)
            img = decode_file(path)
        except Exception as e:  # noqa: BLE001 - corrupt, truncated, too large or unsupported: named, skipped
            bad.append(BadSample(path, describe_error(e)))
            continue
        kept.append(path)
        images.append(img)
    return kept, images, bad


def save_png(image, path: str | Path) -> Path:
    """Write uint8 (3, H, W) ``image`` as a PNG at ``path`` (``OSError`` when it cannot be written)."""
    from torchvision.io import encode_png

    path = Path(path)
    path.write_bytes(encode_png(image.contiguous()).numpy().tobytes())
    return path


def render_top_k(
    paths: list[str],
    images: list,
    outputs,
    label_space: dict,
    out_dir: str | Path,
    out_names: Optional[list[str]] = None,
    k: int = 5,
) -> list[dict]:
    """Classifier outputs as records and pictures (classification and video).

    ``outputs``: logits (N, C) for the N inputs ``paths``; ``images``: uint8 (3, H, W) per input (the image, or a
    clip's middle frame), drawn framed and captioned with the top-1 class and its softmax probability into
    ``out_dir/<out_names[i]>`` (default ``<stem>.png``). Returns ``{"file", "top5": [{"label", "score"}, ...]}``
    per input (top-k for fewer than ``k`` classes). Raises OSError when a file cannot be written.
    """
    import torch

    probs = outputs.float().softmax(dim=1).cpu()
    classes = list(label_space.get("classes") or [str(i) for i in range(probs.shape[1])])
    scores, indices = probs.topk(min(k, probs.shape[1]), dim=1)
    records = []
    for i, path in enumerate(paths):
        top = [{"label": classes[j], "score": round(float(s), 4)} for s, j in zip(scores[i], indices[i].tolist())]
        img = images[i]
        h, w = int(img.shape[-2]), int(img.shape[-1])
        drawn = draw_labelled_boxes(
            img,
            torch.tensor([[0.0, 0.0, float(w), float(h)]]),
            [f"{top[0]['label']} {top[0]['score']:.2f}"],
            [color_of(int(indices[i, 0]))],
        )
        save_png(drawn, Path(out_dir) / (out_names[i] if out_names else f"{Path(path).stem}.png"))
        records.append({"file": Path(path).name, "top5": top})
    return records


def color_of(label: int) -> str:
    """The drawing colour of class index ``label``."""
    return PALETTE[int(label) % len(PALETTE)]


def same_size_groups(sizes) -> list[list[int]]:
    """Indices of a batch grouped by their images' own (h, w) (``sizes``: (B, 2) ints), in order of first
    appearance: each group can run as one forward without padding, so an image's result does not depend on the
    other images of its batch (``predict``'s batch-size independence). A folder of same-size images is one group;
    B distinct sizes are B forwards (the cost)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (h, w) in enumerate(sizes):
        groups.setdefault((int(h), int(w)), []).append(i)
    return list(groups.values())
