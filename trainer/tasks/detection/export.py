"""DINO as a served graph (``python -m trainer export --format onnx|torchscript`` on a detection checkpoint).

The graph takes evaluation-resized images and the size of each on its input, builds the padding mask DINO was
trained with from those sizes, and ends in DINO's post-processing (top ``num_select`` (query, class) pairs,
:class:`~trainer.models.dino.postprocess.PostProcess`). The ONNX graph has a dynamic height and width (the level
sizes stay symbolic under torch.export), so one image at its own size gives ``predict``'s detections; TorchScript
(``torch.jit.trace``) records the level sizes as constants and takes the fixed square canvas it was traced at. The
deformable attention runs as the PyTorch reference (:func:`trainer.ops.msda.reference_graph`), so the graph holds
standard ONNX operators only (``GridSample``, opset >= 16) and needs neither our extension nor a custom-op library
at serving time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def canvas_side(max_size: int, pad_to_multiple: int) -> int:
    """Side S in pixels of the square canvas an exported DINO takes at most (and TorchScript's fixed input):
    ``max_size`` (the longest side an evaluation resize gives, landscape or portrait) rounded up to
    ``pad_to_multiple``, so every feature level's grid is an exact stride of it (DINO-4scale at 1333: 1344)."""
    m = max(1, int(pad_to_multiple))
    return -(-int(max_size) // m) * m


def smallest_side(level_strides: list[int]) -> int:
    """The smallest image side in pixels the dynamic ONNX graph takes: one more than the coarsest level's stride
    (:meth:`~trainer.models.dino.config.DinoConfig.level_strides`), so that level's grid is at least 2 wide
    (torch.export specialises a size of 1; DINO-4scale: 65)."""
    return int(level_strides[-1]) + 1


class DinoExport(nn.Module):
    """DINO behind in-graph normalisation and padding mask, followed by its post-processing.

    Args:
        model: the trained :class:`~trainer.models.dino.model.DINO` (eval mode, float32).
        num_select: detections kept per image (top (query, class) pairs by sigmoid score).

    ``forward(image, image_size)``:

    - ``image``: float32 (B, 3, H, W) RGB pixel values in [0, 255], each image resized as in evaluation (shorter
      side ``eval_size``, longer at most ``max_size``) at the top-left; one image at its own size (H, W) is what
      ``predict`` runs. The rest of a padded batch is set in the graph to the training collate's padding, whatever
      it holds: 0 after normalisation (the mean colour) for ``pad_value`` ``mean``, pixel 0 (black) for ``black``.
    - ``image_size``: int64 (B, 2), the (h, w) in pixels each image occupies.

    Returns ``(scores, labels, boxes)``: float32 (B, K) sigmoid scores sorted descending, int64 (B, K) class
    indices (the model's contiguous ids; the metadata maps them to COCO category ids), float32 (B, K, 4) boxes
    (x1, y1, x2, y2) normalised to [0, 1] of the image (multiply by the original width, height, width, height
    for pixels, as :class:`PostProcess` does with ``orig_size``); K = min(``num_select``, queries x classes).
    """

    def __init__(self, model: nn.Module, num_select: int, pad_value: str = "mean"):
        super().__init__()
        self.pad_mean = pad_value == "mean"
        from trainer.data.transforms import pixel_mean_std

        self.model, self.num_select = model, int(num_select)
        mean, std = pixel_mean_std()
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("inv_std", 1.0 / std, persistent=False)

    def forward(self, image: Tensor, image_size: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        from trainer.models.dino.postprocess import top_detections
        from trainer.ops.msda import reference_graph

        _, _, h, w = image.shape
        rows = torch.arange(h, device=image.device)[None, :, None] >= image_size[:, 0, None, None]
        cols = torch.arange(w, device=image.device)[None, None, :] >= image_size[:, 1, None, None]
        mask = rows | cols  # (B, S, S) True on padding, as the collate's
        x = (image.masked_fill(mask[:, None], 0.0) - self.mean) * self.inv_std  # black padding
        if self.pad_mean:  # the mean colour: 0 after normalisation, as the collate's (fill_padding)
            x = x.masked_fill(mask[:, None], 0.0)
        with reference_graph():
            out = self.model(x, mask)
        return top_detections(out["pred_logits"].float(), out["pred_boxes"].float(), self.num_select)


def place_on_canvas(images: Tensor, mask: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """A collated evaluation batch as :class:`DinoExport`'s inputs.

    Args:
        images: float32 (B, 3, H, W) pixel values in [0, 255], padded to a common size.
        mask: bool (B, H, W), True on padding (each image's valid region at the top-left).
        side: the canvas side S (:func:`canvas_side`), >= H and W.

    Returns:
        (float32 (B, 3, S, S) canvas, zeros outside the images; int64 (B, 2) the valid (h, w) of each).

    Raises:
        ValueError: the batch is larger than the canvas.
    """
    b, _, h, w = images.shape
    if h > side or w > side:
        raise ValueError(f"a {h}x{w} batch does not fit the {side}x{side} canvas")
    canvas = images.new_zeros(b, 3, side, side)
    canvas[:, :, :h, :w] = images
    sizes = torch.stack([(~mask[:, :, 0]).sum(1), (~mask[:, 0, :]).sum(1)], 1).to(torch.int64)
    return canvas, sizes


def match_detections(reference: list, exported: list, iou: float = 0.9) -> tuple[int, int]:
    """How many of the reference detections the exported model also gives: per image, a reference (label, box)
    counts when an exported detection of the same label overlaps it with IoU >= ``iou`` (tied scores may order
    the top-k differently, so this compares sets, not ranks).

    Args:
        reference, exported: numpy ``[scores (B, K), labels (B, K), boxes (B, K, 4) xyxy]``.

    Returns:
        (matched, total) over the batch.
    """
    from torchvision.ops import box_iou

    matched = total = 0
    for i in range(reference[0].shape[0]):
        ious = box_iou(torch.from_numpy(reference[2][i]).double(), torch.from_numpy(exported[2][i]).double())
        same = torch.from_numpy(reference[1][i])[:, None] == torch.from_numpy(exported[1][i])[None, :]
        matched += int(((ious >= iou) & same).any(1).sum())
        total += int(reference[1][i].shape[0])
    return matched, total
