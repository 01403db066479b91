"""Options of ``python -m trainer plan`` and ``probe`` that are not training fields, and the plan's error.

Their own home, apart from :mod:`trainer.planning.plan` and :mod:`trainer.planning.probe`, because the command line
builds the ``plan`` and ``probe`` parsers from these dataclasses' fields: a usage error or ``--help`` then answers
without importing torch (0.1 s instead of ~2 s on a 2-vCPU VM; tests/test_architecture.py). Nothing here imports
torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import catalog
from catalog import REFERENCE_GPU
from trainer.config import ConfigError


class PlanError(ValueError):
    """The plan cannot be made (unknown type, impossible batch, unusable probe report); one-line message."""


@dataclass
class PlanOptions:
    """Flags of ``plan`` that are not training fields (the number of epochs is the config's ``epochs``)."""

    probe_report: Optional[str] = None
    prices: Optional[str] = None
    platform: Optional[str] = None
    instances: tuple = ()
    nproc_per_node: Optional[int] = None
    margin: float = 0.10
    dataset_size: Optional[int] = None
    num_classes: Optional[int] = None
    model_memory_gib: Optional[float] = None
    images_per_second: Optional[float] = None
    throughput_gpu: str = REFERENCE_GPU
    scaling_efficiency: float = 0.9
    jobs_per_instance: int = 1
    out: Optional[str] = None

    def validate(self) -> PlanOptions:
        """Raise PlanError naming the first bad option."""
        if self.platform not in (None, "ec2", "sagemaker"):
            raise PlanError(f"--platform: got {self.platform!r}; allowed: ec2, sagemaker")
        if not 0 <= self.margin < 1:
            raise PlanError(f"--margin: got {self.margin}; must be in [0, 1)")
        if not 0 < self.scaling_efficiency <= 1:
            raise PlanError(f"--scaling-efficiency: got {self.scaling_efficiency}; must be in (0, 1]")
        if not isinstance(self.jobs_per_instance, int) or self.jobs_per_instance < 1:
            raise PlanError(f"--jobs-per-instance: got {self.jobs_per_instance}; must be an integer >= 1")
        for name in ("nproc_per_node", "dataset_size", "num_classes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise PlanError(f"--{name.replace('_', '-')}: got {v}; must be >= 1")
        for name in ("model_memory_gib", "images_per_second"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise PlanError(f"--{name.replace('_', '-')}: got {v}; must be a number > 0")
        if self.throughput_gpu not in catalog.GPU_MODELS:
            raise PlanError(
                f"--throughput-gpu: unknown GPU {self.throughput_gpu!r}; catalog GPUs: " + ", ".join(catalog.GPU_MODELS)
            )
        return self


@dataclass
class ProbeOptions:
    """Flags of ``probe`` that are not training fields (units in the names)."""

    out_dir: str = "runs/probe"
    start_batch: int = 8
    max_batch: int = 1024
    granularity: int = 8
    margin: float = 0.10
    memory_limit_gib: Optional[float] = None
    steps: int = 3
    workers: tuple = (0, 2, 4, 8)
    prefetch: tuple = (2, 4)
    loader_batches: int = 8

    def validate(self) -> ProbeOptions:
        """Raise ConfigError naming the first bad option."""
        for name in ("start_batch", "max_batch", "granularity", "steps", "loader_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"probe --{name.replace('_', '-')}: got {getattr(self, name)}; must be >= 1")
        if self.start_batch > self.max_batch:
            raise ConfigError(f"probe --start-batch {self.start_batch} is larger than --max-batch {self.max_batch}")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"probe --margin: got {self.margin}; must be in [0, 1)")
        if self.memory_limit_gib is not None and self.memory_limit_gib <= 0:
            raise ConfigError(f"probe --memory-limit-gib: got {self.memory_limit_gib}; must be > 0")
        if any(w < 0 for w in self.workers) or any(p < 1 for p in self.prefetch):
            raise ConfigError("probe --workers must be >= 0 and --prefetch >= 1")
        return self
