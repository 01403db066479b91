"""The task seam: what the task-agnostic loop needs from classification, detection, segmentation, video.

A task owns its data (datasets + collate), model, loss and metrics. The loop owns everything else
(devices, DDP, precision, accumulation, clipping, EMA, schedules, checkpoints, logging), so a new task plugs
in by subclassing :class:`Task` and registering itself in :data:`trainer.tasks.TASKS`, with no loop change.

Batch contract: the collate function returns a dict with at least ``"bad"`` (a list of
:class:`trainer.data.imagefolder.BadSample`, possibly empty); everything else is the task's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from trainer.config import TrainConfig
from trainer.distributed import DistInfo


@dataclass
class TaskData:
    """Datasets and their description.

    ``train``/``val`` accept ``(epoch, index)`` keys; ``collate`` builds the batch dict; ``num_outputs`` is
    what the model head needs (classes); ``report`` holds log lines (census, ignored files...).

    ``label_space`` says what the model's outputs mean, as plain JSON-like values (e.g. classification:
    ``{"classes": ["ants", "bees"]}``; detection: its category names; segmentation: its class ids). The loop
    stores it in every checkpoint and refuses to resume one whose label space differs (also with
    ``force_resume``), naming the difference. Empty: the task does not describe it; nothing is checked.
    """

    train: Dataset
    val: Dataset
    collate: Callable[[list], dict]
    num_outputs: int
    report: list[str] = field(default_factory=list)
    label_space: dict = field(default_factory=dict)


class Task(ABC):
    """Base class of a training task. ``primary_metric`` (higher is better, in %) selects ``best`` and is
    compared with ``target_accuracy``."""

    name: str = "task"
    primary_metric: str = "top1"
    eval_stat_size: int = 1  #: length of the vector returned by :meth:`eval_sums`

    def __init__(self, cfg: TrainConfig, dist: DistInfo):
        self.cfg, self.dist = cfg, dist

    def check_config(self) -> None:
        """Raise ``ConfigError`` for a config this task cannot train, before any data is read (e.g. a model
        that needs a fixed input size). Called by the loop before :meth:`build_data`; the default accepts all.
        """

    @abstractmethod
    def build_data(self) -> TaskData:
        """Scan/prepare the data. Raises ``DataError`` before training starts when it is unusable."""

    @abstractmethod
    def build_model(self, num_outputs: int) -> nn.Module:
        """Create the model on CPU with freshly initialised (seeded) weights."""

    @abstractmethod
    def train_inputs(self, batch: dict) -> tuple[Any, Any, int]:
        """Move a training batch to the device and augment it: returns ``(inputs, targets, n_samples)``."""

    @abstractmethod
    def eval_inputs(self, batch: dict) -> tuple[Any, Any, int]:
        """Like :meth:`train_inputs` for evaluation (no augmentation)."""

    @abstractmethod
    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Scalar mean loss of a micro-batch (float32)."""

    @abstractmethod
    def eval_sums(self, outputs: Any, targets: Any) -> torch.Tensor:
        """Float64 vector of summable statistics for one eval batch (summed over batches and ranks)."""

    @abstractmethod
    def eval_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """Turn the summed statistics into named metrics (must include :attr:`primary_metric`)."""

    def train_sums(self, outputs: Any, targets: Any) -> torch.Tensor | None:
        """Optional float64 vector of training statistics per micro-batch (e.g. correct count, count)."""
        return None

    def train_metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """Named training metrics from the summed :meth:`train_sums` (besides the loss)."""
        return {}
