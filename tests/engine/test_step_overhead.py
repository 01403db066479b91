"""The CPU proxy of the trainer's cost over a bare PyTorch loop (``benchmarks/overhead.py --profile``):
per optimizer step, the trainer must not wait for the device (no ``.item()``, boolean indexing or host copy, no
tensor built from Python data on the training device, which on CUDA is a blocking copy) and may add only a
pinned number of ATen calls (a proxy for kernel launches) to what the bare loop makes. Counts, not times:
marginal per-step counts (a pass over 4 batches minus a pass over 2), so they do not depend on the machine or
the thread count. The trainer used to make 3 host syncs and 1 device tensor from host data per step
(docs/benchmarks.md), and the EMA 2 more on CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overhead  # noqa: E402

from trainer.tasks.classification.task import build_classifier  # noqa: E402

pytestmark = pytest.mark.slow

#: resnet18 at 32 px, batch 4, EMA + gradient clipping on (2026-11-26: 227 extra ATen calls per step: the
#: loss/NaN/accuracy statistics, the clip's foreach norm and its 62-way stack, the EMA's foreach lerp), a little room.
MAX_EXTRA_ATEN_CALLS = 240


def test_the_trainer_step_never_waits_for_the_device_and_adds_few_operator_calls(shared_data):
    data = str(shared_data / "imagenette-subset")
    cpu = torch.device("cpu")
    batches, n_classes = overhead.in_memory_batches(data, 32, 4, 4)
    trainer = overhead.in_memory_trainer(
        data,
        "resnet18",
        32,
        4,
        batches,
        channels_last=False,
        no_decay_norm_bias=False,
        use_ema=True,
        gradient_clip=1.0,
    )
    ours = overhead.step_counts(overhead.trainer_loop(trainer), batches, cpu)
    torch.manual_seed(0)
    bare = overhead.minimal_loop(
        build_classifier("resnet18", n_classes), batches, cpu, "32", False, trainer.cfg.weight_decay
    )
    base = overhead.step_counts(bare, batches, cpu)
    assert ours["host_syncs"] == 0, ours["calls"]
    assert ours["device_tensors_from_host"] == 0
    assert base["host_syncs"] == 0 and base["aten_calls"] > 1000  # the bare loop ran the model
    extra = ours["aten_calls"] - base["aten_calls"]
    assert 0 < extra <= MAX_EXTRA_ATEN_CALLS, extra
