"""What a loader yields, whatever the format: the batch contract shared by every task and the engine.

A collate function returns a dict with at least ``"bad"``: a list of :class:`BadSample` for the files of that
batch that could not be decoded (possibly empty). Everything else in the dict is the task's business. In training
a bad file is replaced by another sample (batch shapes never change); in evaluation it is dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import DataError


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


def describe_error(e: BaseException) -> str:
    """``"<ExceptionType>: <message>"`` for a decoder's error: one line of at most 200 characters, cut at a word,
    without C++ source locations (:func:`trainer.errors.error_detail`)."""
    from trainer.errors import error_detail

    return error_detail(e)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """Deterministic 63-bit seed for the augmentation of sample ``index`` in ``epoch`` (SplitMix64-style)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEEA4DEB8F35) & (2**64 - 1)
    return (x ^ (x >> 29)) & (2**63 - 1)


@contextlib.contextmanager
def seeded_for_sample(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Seed torch's default CPU generator (which torchvision.transforms.v2 draws from) with
    :func:`sample_seed` for the body, then put the caller's state back. About 2 us, where ``torch.manual_seed``
    also reseeds CUDA and costs ~55 us. Augmentation thereby depends on (seed, epoch, index) only."""
    gen = torch.default_generator
    saved = gen.get_state()
    gen.manual_seed(sample_seed(seed, epoch, index))
    try:
        yield
    finally:
        gen.set_state(saved)


def decode_or_replace(
    decode: Callable[[int], Any], index: int, n: int, max_tries: int
) -> tuple[Any, int, tuple[BadSample, ...]]:
    """Training's rule for an undecodable file: ``decode(index)``, and when it returns a :class:`BadSample` the
    next indices (``index + 1``, ``+ 2`` ... modulo ``n``) until one decodes, so batch shapes never change.

    Returns ``(item, index used, own)`` with ``own`` = ``(the BadSample of index,)`` when it was replaced, else
    ``()`` (each bad file is reported once, by its own index).

    Raises:
        DataError: ``min(max_tries, n)`` consecutive samples are bad (names the first).
    """
    item = decode(index)
    if not isinstance(item, BadSample):
        return item, index, ()
    own, tries = (item,), min(max_tries, n)
    for k in range(1, tries):
        used = (index + k) % n
        item = decode(used)
        if not isinstance(item, BadSample):
            return item, used, own
    raise DataError(f"{tries} consecutive files cannot be decoded, starting at {own[0].path} ({own[0].error})")
