"""What a loader yields, whatever the format: the batch contract shared by every task and the engine.

A collate function returns a dict with at least ``"bad"``: a list of :class:`BadSample` for the files of that
batch that could not be decoded (possibly empty). Everything else in the dict is the task's business. In training
a bad file is replaced by another sample (batch shapes never change); in evaluation it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BadSample:
    """Placeholder returned for a file that could not be decoded: its ``path`` and the decoder's ``error``."""

    path: str
    error: str


def collate_skip_bad(items: list) -> dict:
    """Stack good samples; list the replaced/dropped files.

    Returns ``{"image": uint8 (B, 3, h, w), "label": int64 (B,), "bad": [BadSample, ...]}``. In training B
    is always the micro-batch (bad files were replaced; each listed once, by its own index: see
    :class:`ImageFolderDataset`); in evaluation it shrinks by the dropped files.
    """
    good = [it for it in items if not isinstance(it, BadSample)]
    bad = [it for it in items if isinstance(it, BadSample)] + [b for g in good for b in g[2]]
    if good:
        images = torch.stack([g[0] for g in good])
        labels = torch.tensor([g[1] for g in good], dtype=torch.int64)
    else:
        images = torch.empty((0, 3, 1, 1), dtype=torch.uint8)
        labels = torch.empty((0,), dtype=torch.int64)
    return {"image": images, "label": labels, "bad": bad}
