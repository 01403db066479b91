"""Evaluators: a task's validation metric as an object with ``reset`` / ``update`` / ``compute``, synchronised
across ranks in ``compute`` (the shape of torchmetrics' ``Metric``: per-batch state on the device, one collective
at the end).

Two kinds cover the tasks:

* :class:`SumEvaluator` keeps a float64 vector of summable statistics (correct counts, loss sums, a confusion
  matrix flattened) and all-reduces it once: top-k accuracy, mIoU.
* :class:`GatherEvaluator` keeps per-sample records on the host (predicted boxes, scores, labels) and gathers
  every rank's records to every rank (``all_gather_object``) before computing: COCO mAP, which cannot be summed.

Both are collective: every rank calls ``compute`` the same number of times. Each evaluator also names its
metrics' directions (:attr:`Evaluator.directions`: ``"max"`` or ``"min"``), used to pick the best checkpoint and
to stop at a target value.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.distributed as tdist

#: Allowed directions of a metric: higher is better / lower is better.
DIRECTIONS = ("max", "min")


def metric_key(name: str) -> str:
    """A class or category name as a metric key suffix: lower case, runs of other characters as ``_`` (``with
    mask`` -> ``with_mask``), so ``key=value`` metric lines and SageMaker regexes stay simple; ``class`` when
    nothing is left."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "class"


def better(a: float, b: Optional[float], direction: str) -> bool:
    """True when metric value ``a`` is better than ``b`` (``b`` None or NaN: always) in ``direction``
    ("max"/"min"); an undefined (NaN) ``a`` never is."""
    if a != a:
        return False
    if b is None or b != b:
        return True
    return a > b if direction == "max" else a < b


def reached(value: float, target: float, direction: str) -> bool:
    """True when ``value`` meets ``target``: ``>=`` for "max" metrics, ``<=`` for "min" metrics."""
    return value >= target if direction == "max" else value <= target


class Evaluator(ABC):
    """Validation metric state of one rank.

    Attributes:
        directions: metric name -> "max" | "min", for every metric :meth:`compute` returns.
    """

    directions: dict[str, str] = {}

    @abstractmethod
    def reset(self) -> None:
        """Forget all updates (called before each evaluation pass)."""

    @abstractmethod
    def update(self, outputs: Any, batch: dict) -> None:
        """Add one evaluation batch: the model's ``outputs`` for the device ``batch`` the task prepared."""

    @abstractmethod
    def compute(self) -> dict[str, float]:
        """Metrics over every rank's updates (collective: all ranks call it). Returns name -> float."""


class SumEvaluator(Evaluator):
    """Evaluator over a float64 vector of summable statistics, summed over batches and then over ranks.

    Subclasses define :attr:`size` (vector length), :meth:`statistics` (one batch's vector on the device) and
    :meth:`metrics` (names -> values from the summed vector). A rank whose share was empty contributes zeros.
    """

    size: int = 1

    def __init__(self, device: torch.device):
        self.device = device
        self.sums = torch.zeros(self.size, dtype=torch.float64, device=device)

    def reset(self) -> None:
        self.sums = torch.zeros(self.size, dtype=torch.float64, device=self.device)

    def update(self, outputs: Any, batch: dict) -> None:
        self.sums += self.statistics(outputs, batch)

    def compute(self) -> dict[str, float]:
        total = self.sums.clone()
        if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
            tdist.all_reduce(total)
        return self.metrics(total)

    @abstractmethod
    def statistics(self, outputs: Any, batch: dict) -> torch.Tensor:
        """float64 (size,) vector for one batch (on the device)."""

    @abstractmethod
    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """Named metrics from the float64 (size,) vector summed over all batches and ranks."""


class GatherEvaluator(Evaluator):
    """Evaluator over per-sample records gathered from every rank (for metrics that cannot be summed).

    Subclasses define :meth:`records` (picklable host-side records of one batch, e.g. one dict per image with its
    boxes, scores and labels as lists) and :meth:`metrics` (names -> values from all ranks' records, in rank order).
    Memory: every rank holds every record once during :meth:`compute`.
    """

    def __init__(self) -> None:
        self.items: list = []

    def reset(self) -> None:
        self.items = []

    def update(self, outputs: Any, batch: dict) -> None:
        self.items.extend(self.records(outputs, batch))

    def compute(self) -> dict[str, float]:
        items = self.items
        if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
            parts: list = [None] * tdist.get_world_size()
            tdist.all_gather_object(parts, items)
            items = [x for part in parts for x in part]
        return self.metrics(items)

    @abstractmethod
    def records(self, outputs: Any, batch: dict) -> list:
        """Picklable per-sample records of one batch (host memory)."""

    @abstractmethod
    def metrics(self, records: list) -> dict[str, float]:
        """Named metrics from every rank's records."""
