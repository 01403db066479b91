"""Instance catalog: the one copy of the instance facts and prices that the stacks, the planner and the CLI read.

Importable without torch and without aws_cdk (``python -c "import catalog"`` needs only the standard
library). Every other module asks this one; there is no second table anywhere.

Sources
-------
* Hardware (vCPUs, RAM in MiB, GPU model/count/memory in MiB, network, EFA, instance store) is what
  ``ec2:DescribeInstanceTypes`` reports; ``tests/test_catalog.py`` checks every EC2 entry against the copy of that
  data shipped with moto (``moto/ec2/resources/instance_types.json.gz``) and fails on any difference. p3 types are
  not in moto's copy; their figures come from the EC2 "Accelerated computing" instance-type page.
  Note: EC2 reports the A10G and L4 as 22,888 MiB (22.35 GiB) usable, not the "24 GB" the seeds plan with.
* On-demand prices: us-east-1, Linux, USD/hour, from the AWS EC2 and SageMaker pricing pages as recorded on the
  date given per price. p4d/p5 list prices were reduced by AWS in June 2025 ("up to 45 %" for P5); the figures
  here are the ones the seeds plan with and are marked so. Prices change: override them (CDK context
  ``prices``, ``plan --prices FILE``) rather than editing code when they do.
* Spot prices are *typical* figures, not quotes: seed 003 records ~$11/h for p4d.24xlarge; for the others an
  estimate of 35 % of on-demand (AWS: "up to 90 % off"; spot price history of the g5 family in us-east-1 sat
  around 30-45 % of on-demand in 2025). Each carries ``estimate=True`` where it is one.
* SageMaker managed spot is billed at the ml.* spot rate; savings "up to 90 %" (SageMaker docs, "Managed Spot
  Training"). The same 35 % estimate is used.

Seed corrections carried here: ml.g5.2xlarge has 1 GPU (seed 000 plans 2); ml.g5.2xlarge costs $1.515/h, not
$2.41 (seed 000); ml.g5.xlarge $1.408/h, not $1.21.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional


class CatalogError(ValueError):
    """Unknown instance type, or a price override that is not a positive number of USD/hour."""


@dataclass(frozen=True)
class Price:
    """An hourly price in USD for one instance in us-east-1 (Linux), with when and where it was read."""

    usd_per_hour: float
    date: str
    source: str
    estimate: bool = False


@dataclass(frozen=True)
class GpuModel:
    """Facts about one GPU model.

    ``relative_throughput`` is ResNet-50 v1.5 training throughput (mixed precision, images/s per GPU) relative to
    one A100-SXM4-40GB, from NVIDIA's "Deep Learning Performance" data-center training tables (A100 ~2,600,
    H100 SXM ~5,000+, V100 ~1,400, A10 ~800, L4 ~530 images/s; 2023-2024 releases). It is only the planner's
    fallback when no probe report of the user's own workload exists.

    ``cuda_context_mib`` is the GPU memory (MiB) a training process holds outside PyTorch's caching allocator:
    the CUDA context with the kernels loaded lazily by the step (``mem_get_info`` used minus ``memory_reserved``
    after a step, ``benchmarks/memory_prediction.py --device cuda``); the planner adds it to every prediction.
    ``cuda_context_measured`` says whether it was measured on that GPU; ``cuda_context_source`` says where it comes
    from. H100: measured, 771 MiB (shared/gpu-check, 2026-11-25, H100 80GB HBM3, torch 2.11.0+cu130).
    A100, A10G, L4, V100: ASSUMED, not measured: 800 MiB, the H100's figure rounded up. The context holds the
    driver's per-device state, which grows with the SM count (local memory reserved per resident thread), and
    the lazily loaded kernels, which a given torch build and training step share across GPUs; the H100 has the
    most SMs of these (132 vs A100 108, V100 80, A10G 80, L4 58), so its figure is taken as an upper estimate.
    Public reports put a bare context at ~300-400 MiB with lazy loading (CUDA >= 11.7; pytorch/pytorch#107667,
    #109888); a step's cuDNN/cuBLAS kernels add to it. The V100 (sm_70) is not supported by CUDA 13 builds, so it
    runs a CUDA 12 build of torch, whose context may differ. Replace each with a measurement when a GPU is lent.
    """

    name: str
    compute_capability: str  # for TORCH_CUDA_ARCH_LIST
    bf16: bool
    relative_throughput: float
    cuda_context_mib: int
    cuda_context_measured: bool

    @property
    def cuda_context_bytes(self) -> int:
        """``cuda_context_mib`` in bytes."""
        return self.cuda_context_mib * 1024**2

    @property
    def cuda_context_source(self) -> str:
        """Where ``cuda_context_mib`` comes from, for reports."""
        if self.cuda_context_measured:
            return f"measured on {self.name} ({self.cuda_context_mib} MiB, shared/gpu-check 2026-11-25)"
        return f"ASSUMED for {self.name} ({self.cuda_context_mib} MiB: the H100's measured figure, rounded up)"


#: The images/s that ``relative_throughput`` 1.0 stands for: ResNet-50 v1.5 training, mixed precision, 224 px,
#: one A100 (NVIDIA "Deep Learning Performance", data-center training tables, 2023-2024). The planner's
#: fallback when neither a probe report nor ``--images-per-second`` is given.
REFERENCE_GPU = "A100"
REFERENCE_IMAGES_PER_S = 2600.0

GPU_MODELS: dict[str, GpuModel] = {
    "A100": GpuModel("A100", "8.0", True, 1.0, 800, False),
    "H100": GpuModel("H100", "9.0", True, 1.9, 771, True),
    "A10G": GpuModel("A10G", "8.6", True, 0.31, 800, False),
    "L4": GpuModel("L4", "8.9", True, 0.2, 800, False),
    "V100": GpuModel("V100", "7.0", False, 0.54, 800, False),
}


@dataclass(frozen=True)
class InstanceType:
    """One EC2 or SageMaker (``ml.*``) instance type.

    Units: ``memory_mib`` host RAM in MiB; ``gpu_memory_mib`` per GPU in MiB as EC2 reports it (usable memory);
    ``network_gbps`` the peak of the network performance string in Gbit/s; prices in USD/hour.
    """

    name: str
    vcpus: int
    memory_mib: int
    gpus: int
    gpu_model: Optional[str]
    gpu_memory_mib: int
    network: str
    network_gbps: float
    efa: bool
    max_efa_interfaces: int
    instance_store_gb: int
    on_demand: Price
    spot: Price

    @property
    def platform(self) -> str:
        """``"sagemaker"`` for ``ml.*`` types, else ``"ec2"``."""
        return "sagemaker" if self.name.startswith("ml.") else "ec2"

    @property
    def ec2_name(self) -> str:
        """The EC2 type with the same hardware (``ml.g5.2xlarge`` -> ``g5.2xlarge``)."""
        return self.name[3:] if self.name.startswith("ml.") else self.name

    @property
    def processes_per_host(self) -> int:
        """DDP processes to start on one host: one per GPU, or 1 on a CPU-only type."""
        return max(self.gpus, 1)

    @property
    def gpu(self) -> Optional[GpuModel]:
        """The GPU model's facts, or None for a CPU-only type."""
        return GPU_MODELS.get(self.gpu_model) if self.gpu_model else None

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    @property
    def gpu_memory_gib(self) -> float:
        return self.gpu_memory_mib / 1024


_D_SEEDS = "2025-06 (as planned in seeds 003/004)"
_EC2_PAGE = "AWS EC2 On-Demand pricing page, us-east-1 Linux"
_SM_PAGE = "AWS SageMaker pricing page, training, us-east-1"
_SPOT_EST = "estimate: 35 % of on-demand (typical us-east-1 spot history, 2025)"

# name: (vcpus, memory MiB, gpus, gpu model, gpu MiB, network, Gbit/s, EFA, max EFA interfaces, instance store GB)
_HARDWARE: dict[str, tuple] = {
    "m5.xlarge": (4, 16384, 0, None, 0, "Up to 10 Gigabit", 10, False, 0, 0),
    "g5.xlarge": (4, 16384, 1, "A10G", 22888, "Up to 10 Gigabit", 10, False, 0, 250),
    "g5.2xlarge": (8, 32768, 1, "A10G", 22888, "Up to 10 Gigabit", 10, False, 0, 450),
    "g5.4xlarge": (16, 65536, 1, "A10G", 22888, "Up to 25 Gigabit", 25, False, 0, 600),
    "g5.8xlarge": (32, 131072, 1, "A10G", 22888, "25 Gigabit", 25, True, 1, 900),
    "g5.12xlarge": (48, 196608, 4, "A10G", 22888, "40 Gigabit", 40, True, 1, 3800),
    "g5.16xlarge": (64, 262144, 1, "A10G", 22888, "25 Gigabit", 25, True, 1, 1900),
    "g5.24xlarge": (96, 393216, 4, "A10G", 22888, "50 Gigabit", 50, True, 1, 3800),
    "g5.48xlarge": (192, 786432, 8, "A10G", 22888, "100 Gigabit", 100, True, 1, 7600),
    "g6.12xlarge": (48, 196608, 4, "L4", 22888, "40 Gigabit", 40, True, 1, 3760),
    "p3.2xlarge": (8, 62464, 1, "V100", 16384, "Up to 10 Gigabit", 10, False, 0, 0),
    "p3.8xlarge": (32, 249856, 4, "V100", 16384, "10 Gigabit", 10, False, 0, 0),
    "p4d.24xlarge": (96, 1179648, 8, "A100", 40960, "4x 100 Gigabit", 400, True, 4, 8000),
    "p5.48xlarge": (192, 2097152, 8, "H100", 81920, "3200 Gigabit", 3200, True, 32, 30400),
}

# name: (on-demand USD/h, date, source)   -- EC2
_EC2_ON_DEMAND: dict[str, tuple] = {
    "m5.xlarge": (0.192, "2025-06", _EC2_PAGE),
    "g5.xlarge": (1.006, _D_SEEDS, _EC2_PAGE + " (seed 004 rounds to $1.01)"),
    "g5.2xlarge": (1.212, _D_SEEDS, _EC2_PAGE + " (seed 004 rounds to $1.21)"),
    "g5.4xlarge": (1.624, _D_SEEDS, _EC2_PAGE),
    "g5.8xlarge": (2.448, _D_SEEDS, _EC2_PAGE),
    "g5.12xlarge": (5.672, _D_SEEDS, _EC2_PAGE),
    "g5.16xlarge": (4.096, "2025-06", _EC2_PAGE),
    "g5.24xlarge": (8.144, "2025-06", _EC2_PAGE),
    "g5.48xlarge": (16.288, "2025-06", _EC2_PAGE),
    "g6.12xlarge": (4.6016, "2025-06", _EC2_PAGE),
    "p3.2xlarge": (3.06, _D_SEEDS, _EC2_PAGE),
    "p3.8xlarge": (12.24, _D_SEEDS, _EC2_PAGE),
    "p4d.24xlarge": (32.7726, _D_SEEDS, _EC2_PAGE + "; list price before the June 2025 P4/P5 reduction"),
    "p5.48xlarge": (98.32, "2025-05", _EC2_PAGE + "; list price before the June 2025 P5 reduction (up to 45 %)"),
}

# SageMaker training prices; hardware is the EC2 type's.
_SAGEMAKER_ON_DEMAND: dict[str, tuple] = {
    "ml.m5.xlarge": (0.23, "2025-06", _SM_PAGE),
    "ml.g5.xlarge": (1.408, "2025-06", _SM_PAGE + " (seed 000 says $1.21: wrong)"),
    "ml.g5.2xlarge": (1.515, "2025-06", _SM_PAGE + " (seed 000 says $2.41 for '2 GPUs': wrong, 1 GPU)"),
    "ml.g5.4xlarge": (2.03, "2025-06", _SM_PAGE),
    "ml.g5.8xlarge": (3.06, "2025-06", _SM_PAGE),
    "ml.g5.12xlarge": (7.09, "2025-06", _SM_PAGE),
    "ml.g5.16xlarge": (5.12, "2025-06", _SM_PAGE),
    "ml.g5.24xlarge": (10.18, "2025-06", _SM_PAGE),
    "ml.g5.48xlarge": (20.36, "2025-06", _SM_PAGE),
    "ml.p3.2xlarge": (3.825, "2025-06", _SM_PAGE + " (seed 000: $3.83)"),
    "ml.p3.8xlarge": (14.688, "2025-06", _SM_PAGE),
    "ml.p4d.24xlarge": (37.688, "2025-05", _SM_PAGE + "; before the June 2025 P4 reduction (seed 000: $40.96)"),
}

# Typical spot prices that are recorded rather than estimated.
_SPOT_RECORDED: dict[str, tuple] = {
    "p4d.24xlarge": (11.0, "2025", "seed 003: describe-spot-price-history, 'aim for < $12/hr', ~$11/h"),
}

SPOT_FRACTION_ESTIMATE = 0.35


def _build() -> dict[str, InstanceType]:
    out: dict[str, InstanceType] = {}
    for table in (_EC2_ON_DEMAND, _SAGEMAKER_ON_DEMAND):
        for name, (usd, date, source) in table.items():
            hw = _HARDWARE[name[3:] if name.startswith("ml.") else name]
            if name in _SPOT_RECORDED:
                s_usd, s_date, s_src = _SPOT_RECORDED[name]
                spot = Price(s_usd, s_date, s_src)
            else:
                spot = Price(round(usd * SPOT_FRACTION_ESTIMATE, 4), date, _SPOT_EST, estimate=True)
            out[name] = InstanceType(name, *hw, on_demand=Price(usd, date, source), spot=spot)
    return out


INSTANCE_TYPES: dict[str, InstanceType] = _build()

#: The types the training stack builds spot launch templates for by default (seeds 002-004).
DEFAULT_LAUNCH_TEMPLATE_TYPES: tuple[str, ...] = ("p4d.24xlarge", "g5.2xlarge", "g5.12xlarge")


def get(name: str, catalog: Optional[Mapping[str, InstanceType]] = None) -> InstanceType:
    """Return the catalog entry for ``name`` (e.g. ``"g5.2xlarge"`` or ``"ml.g5.2xlarge"``).

    Raises CatalogError naming the type and listing the known ones (closest family first).
    """
    cat = INSTANCE_TYPES if catalog is None else catalog
    try:
        return cat[name]
    except KeyError:
        family = name.split(".")[-2] if "." in name else name
        near = [k for k in cat if family and family in k] or sorted(cat)
        raise CatalogError(
            f"unknown instance type {name!r}; the catalog (catalog/__init__.py) knows: {', '.join(sorted(near))}"
        ) from None


def check_processes_per_host(it: InstanceType, nproc: int) -> Optional[tuple[str, str]]:
    """``None`` when ``nproc`` processes per host suit ``it``; else ``("error"|"warning", message)``.

    More processes than GPUs is an error (seed 000 plans 2 on ml.g5.2xlarge, which has 1 GPU: the extra rank
    has no GPU of its own); fewer leaves GPUs idle (a warning). CPU-only types run 1.
    """
    want = it.processes_per_host
    if nproc > want:
        return "error", (
            f"--nproc-per-node {nproc} on {it.name}, which has {it.gpus} GPU(s): the extra ranks "
            f"find no GPU of their own; use {want}"
        )
    if nproc < want:
        return "warning", f"--nproc-per-node {nproc} leaves {want - nproc} GPU(s) of {it.name} idle; use {want}"
    return None


def names(platform: Optional[str] = None) -> list[str]:
    """All catalog names, optionally only ``"ec2"`` or ``"sagemaker"`` ones, sorted."""
    return sorted(n for n, t in INSTANCE_TYPES.items() if platform is None or t.platform == platform)


def with_prices(
    overrides: Mapping[str, Mapping[str, float]],
    catalog: Optional[Mapping[str, InstanceType]] = None,
    source: str = "override",
) -> dict[str, InstanceType]:
    """Return a copy of the catalog with some prices replaced.

    ``overrides`` maps an instance name to ``{"on_demand": USD/h, "spot": USD/h}`` (either key optional), as
    given in CDK context ``prices`` or a ``plan --prices`` JSON file. Raises CatalogError for an unknown type,
    an unknown key or a price that is not a positive number.
    """
    cat = dict(INSTANCE_TYPES if catalog is None else catalog)
    for name, prices in overrides.items():
        it = get(name, cat)
        if not isinstance(prices, Mapping):
            raise CatalogError(f"prices[{name!r}] must be a mapping like {{'on_demand': 1.2, 'spot': 0.4}}")
        changes = {}
        for key, value in prices.items():
            if key not in ("on_demand", "spot"):
                raise CatalogError(f"prices[{name!r}]: unknown key {key!r}; expected 'on_demand' or 'spot'")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise CatalogError(f"prices[{name!r}][{key!r}] must be a positive number of USD/hour, got {value!r}")
            changes[key] = Price(float(value), "override", source)
        cat[name] = replace(it, **changes)
    return cat


def load_price_file(path: str | Path) -> dict[str, InstanceType]:
    """Catalog with the prices of a JSON file ``{"g5.2xlarge": {"spot": 0.45}, ...}`` applied.

    Raises CatalogError if the file is missing, is not JSON or does not have that shape.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CatalogError(f"price file {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise CatalogError(f"price file {p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CatalogError(f"price file {p}: expected an object mapping instance type -> prices")
    return with_prices(data, source=str(p))
