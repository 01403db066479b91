"""Data order as a pure function of (seed, epoch, rank): resumable without any loader state.

:class:`EpochSampler` yields ``(epoch, index)`` keys so that datasets can derive per-sample augmentation
seeds and the epoch's resolution from the key itself, even inside persistent loader workers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler):
    """Shard ``num_samples`` indices over ``world_size`` ranks.

    * ``shuffle=True`` (training): permutation from ``torch.Generator().manual_seed(seed + epoch)``, padded
      by wrapping around to a multiple of ``world_size`` so every rank gets the same count (as
      ``torch.utils.data.DistributedSampler``); rank ``r`` takes positions ``r, r + W, r + 2W, ...``.
    * ``shuffle=False`` (evaluation): plain order, no padding (ranks may differ by one sample), so metrics
      summed over ranks count every sample exactly once.

    ``set_epoch(epoch, start=k)`` skips the first ``k`` keys of this rank's sequence (mid-epoch resume).
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, shuffle: bool = True, seed: int = 0):
        if num_samples <= 0:
            raise ValueError("EpochSampler: num_samples must be > 0")
        self.n, self.rank, self.world, self.shuffle, self.seed = num_samples, rank, world_size, shuffle, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch (changes the permutation) and skip ``start`` keys of this rank's share."""
        self.epoch, self.start = epoch, start

    def indices(self) -> list[int]:
        """This rank's full index sequence for the current epoch (before skipping ``start``)."""
        if not self.shuffle:
            return list(range(self.rank, self.n, self.world))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        total = -(-self.n // self.world) * self.world
        perm += (perm * (total // self.n + 1))[: total - self.n]
        return perm[self.rank : total : self.world]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for i in self.indices()[self.start :]:
            yield (self.epoch, i)

    def __len__(self) -> int:
        return len(self.indices()) - self.start
