"""The CPU proxy of DINO's GPU step (benchmarks/dino_step.py): host syncs and ATen operator calls per
training step, counted with torch.profiler on the CPU. Counts, not times: they do not depend on the machine, the
thread count or the layer widths, so the DINO-4scale architecture (6 + 6 layers, 4 levels, 900 queries, dn 100)
runs here at width 64 and 192 px to stay quick. The same step used to make 451 host syncs and about
41,000 ATen calls (docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dino_step  # noqa: E402

pytestmark = pytest.mark.slow

#: Ceilings pinned from the measured counts (example and facemask batches alike: 2 host-copy calls, which are one
#: device-to-host copy, ``.cpu().numpy()``; 14,066 / 14,070 ATen calls at 2026-11-25), with a little room.
MAX_HOST_SYNCS = 2
MAX_ATEN_CALLS = 14_400


@pytest.fixture(scope="module")
def counts(shared_data):
    args = dino_step.parser().parse_args(
        [
            "--data",
            str(shared_data / "facemask-coco"),
            "--image-size",
            "192",
            "--num-queries",
            "900",
            "--steps",
            "1",
            "--real-batches",
            "1",
            "--hidden-dim",
            "64",
            "--dim-feedforward",
            "128",
        ]
    )
    return dino_step.measure(args)


def test_one_host_sync_per_step_and_no_data_dependent_shapes(counts):
    assert set(counts) == {"example", "facemask"}  # the real collate's batch with the most boxes is profiled too
    for kind, r in counts.items():
        assert r["syncs"] == {"aten::_local_scalar_dense": 0, "aten::nonzero": 0}, kind
        assert r["host_copies"] == {"tolist": 0, "numpy": 1, "cpu": 1}, kind  # the matcher's one copy
        assert r["host_syncs"] <= MAX_HOST_SYNCS, kind


def test_aten_calls_per_step_stay_under_the_ceiling(counts):
    for kind, r in counts.items():
        assert 5_000 < r["aten_calls"] <= MAX_ATEN_CALLS, (kind, r["aten_calls"], r["top"])
        assert r["matcher_share"] < 0.5, kind


def test_the_counting_rule_counts_a_multi_tensor_op_once():
    class E:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent

    fused = E("aten::_fused_adamw_")
    top = E("aten::mm")
    events = [fused, E("aten::_local_scalar_dense", fused), E("aten::add_", E("aten::copy_", fused)), top]
    events += [E("cudaLaunchKernel", fused)]
    calls, aten = dino_step.count_calls(events)
    assert aten == 2 and calls.get("aten::_local_scalar_dense", 0) == 0 and calls["cudaLaunchKernel"] == 1


def test_the_batched_matcher_reads_nothing_back(monkeypatch):
    """``--matcher batched``: the matcher's own code makes no host read, so with the solver
    standing in on the device (on CUDA torch-linear-assignment's Triton kernel, which reads nothing back with its
    validation off; on the CPU the package would loop over SciPy) a step has no host copy and no sync at all."""
    from trainer.models.dino import matcher

    monkeypatch.setattr(matcher, "_solve_batched", lambda cost: cost.argmin(-1))
    args = dino_step.parser().parse_args(
        ["--image-size", "128", "--num-queries", "100", "--steps", "1", "--hidden-dim", "32", "--dim-feedforward", "64"]
        + ["--matcher", "batched"]
    )
    results = dino_step.measure(args)
    assert set(results) == {"example"}  # 8 boxes per image: the matcher pads nothing away, the count is the same
    for kind, r in results.items():
        assert r["syncs"] == {"aten::_local_scalar_dense": 0, "aten::nonzero": 0}, kind
        assert r["host_copies"] == {"tolist": 0, "numpy": 0, "cpu": 0}, kind


#: The eager remainder of a ``cuda_graphs`` step (denoising's layout, the matcher, the loss and its backward, clipping
#: and AdamW), pinned from the measured 2,640 of 14,086 ATen calls at 2026-11-27 (2,632 of 14,042 at this test's 128 px
#: and 100 queries), with a little room.
MAX_EAGER_ATEN_CALLS_WITH_GRAPHS = 2_800


def test_cuda_graphs_leave_a_fifth_of_the_step_to_the_host():
    """``--cuda-graphs`` with ``profiling.graph_stand_in`` marking on the CPU what one graph
    replay launches on CUDA: the dense part's forward and backward are more than 80 % of the step's ATen calls,
    what stays eager is under the ceiling, and the only host reads are outside the graphs (the matcher's copy)."""
    args = dino_step.parser().parse_args(
        ["--image-size", "128", "--num-queries", "100", "--steps", "1", "--hidden-dim", "32", "--dim-feedforward", "64"]
        + ["--canvases", "auto", "--dn-max-boxes", "100", "--cuda-graphs"]
    )
    r = dino_step.measure(args)["example"]
    assert r["captured_aten_calls"] + r["eager_aten_calls"] == r["aten_calls"]
    assert r["captured_aten_calls"] > 0.8 * r["aten_calls"], r
    assert 1_000 < r["eager_aten_calls"] <= MAX_EAGER_ATEN_CALLS_WITH_GRAPHS, r
    assert r["host_copies"] == {"tolist": 0, "numpy": 1, "cpu": 1}
    assert r["syncs"] == {"aten::_local_scalar_dense": 0, "aten::nonzero": 0}
