"""Temporal sampling: which frames of a video make a clip. A pure function of its arguments (no global RNG), so a
sample's clip depends only on (seed, epoch, index) through :func:`trainer.data.samples.sample_seed`."""

from __future__ import annotations

import random

CLIP_MODES = ("uniform", "random")
SHORT_CLIP_RULES = ("pad", "reject")


def clip_span(num_frames: int, stride: int) -> int:
    """Frames covered by a window of ``num_frames`` frames taken every ``stride``-th frame: ``(T-1)*stride+1``."""
    return (num_frames - 1) * stride + 1


def clip_indices(
    num_frames: int, T: int, stride: int, mode: str = "uniform", rng_seed: int = 0, short_clips: str = "pad"
) -> list[int] | None:
    """Frame indices (decode order, non-decreasing) of a ``T``-frame clip from a video of ``num_frames`` frames.

    The window covers ``span = (T-1)*stride+1`` frames and takes every ``stride``-th one. ``mode``:
    ``"uniform"`` the centred window (start ``(num_frames - span) // 2``; evaluation), ``"random"`` a start drawn
    uniformly from ``0 .. num_frames - span`` with ``random.Random(rng_seed)``. A video shorter than the span:
    ``short_clips="pad"`` takes the frames that exist at that stride from frame 0 and repeats the last index up
    to ``T`` (e.g. 5 frames, T=4, stride 2 -> ``[0, 2, 4, 4]``); ``"reject"`` returns None.

    Raises:
        ValueError: ``num_frames`` < 1, ``T`` < 1, ``stride`` < 1, or an unknown ``mode`` / ``short_clips``.
    """
    if T < 1 or stride < 1:
        raise ValueError(f"clip_indices: T and stride must be >= 1, got T={T}, stride={stride}")
    if mode not in CLIP_MODES:
        raise ValueError(f"clip_indices: mode must be one of {CLIP_MODES}, got {mode!r}")
    if short_clips not in SHORT_CLIP_RULES:
        raise ValueError(f"clip_indices: short_clips must be one of {SHORT_CLIP_RULES}, got {short_clips!r}")
    if num_frames < 1:
        raise ValueError(f"clip_indices: num_frames must be >= 1, got {num_frames}")
    span = clip_span(T, stride)
    if num_frames >= span:
        slack = num_frames - span
        start = slack // 2 if mode == "uniform" else random.Random(rng_seed).randint(0, slack)
        return [start + k * stride for k in range(T)]
    if short_clips == "reject":
        return None
    idx = list(range(0, num_frames, stride))
    return idx + [idx[-1]] * (T - len(idx))
