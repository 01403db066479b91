"""The matcher's batched solver (``matcher: batched``): torch-linear-assignment solves every
(prediction set, image) of a step at once on the cost's device, SciPy per (set, image) is the reference. Compared on
random, tied and real (a DINO forward on facemask's most crowded images) cost matrices: the same targets matched,
one query each, the same optimal total cost (with ties the queries may differ). On the CPU the package solves each
matrix with SciPy too, so these tests prove the padding, the transposition and the index bookkeeping around it;
``test_the_triton_solver_matches_scipy_on_cuda`` runs the Triton kernel itself (skipped without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from trainer.config import ConfigError, load_config
from trainer.engine.distributed import DistInfo
from trainer.models.dino.criterion import DinoCriterion, dino_weight_dict
from trainer.models.dino.matcher import HungarianMatcher, _solve_batched, pad_targets

pytestmark = pytest.mark.filterwarnings("ignore:ms_deform_attn. using the PyTorch reference:RuntimeWarning")

C = 7  # classes
CUDA = torch.cuda.is_available()


def _matcher(solver: str) -> HungarianMatcher:
    return HungarianMatcher(2.0, 5.0, 2.0, 0.25, solver=solver)


def _boxes(*shape, gen) -> torch.Tensor:
    return torch.cat(
        [torch.rand(*shape, 2, generator=gen) * 0.6 + 0.2, torch.rand(*shape, 2, generator=gen) * 0.3 + 0.05], -1
    )


def _inputs(s, sizes, q, seed):
    gen = torch.Generator().manual_seed(seed)
    b = len(sizes)
    targets = [{"labels": torch.randint(0, C, (n,), generator=gen), "boxes": _boxes(n, gen=gen)} for n in sizes]
    labels, tboxes = pad_targets(targets, torch.device("cpu"))
    return torch.randn(s, b, q, C, generator=gen), _boxes(s, b, q, gen=gen), labels, tboxes, targets


def _by_block(pairs: torch.Tensor) -> dict:
    """{(set, image): {target: query}} from (4, K) pair rows."""
    out: dict = {}
    for s, i, q, t in pairs.cpu().T.tolist():
        assert t not in out.setdefault((s, i), {}), "a target matched twice"
        out[(s, i)][t] = q
    return out


def _assert_same_optimum(logits, boxes, labels, tboxes, sizes):
    """Both solvers: the same (set, image, target) rows, one query per target, SciPy's total cost per block."""
    ref = _matcher("scipy").match_pairs(logits, boxes, labels, tboxes, sizes)
    got = _matcher("batched").match_pairs(logits, boxes, labels, tboxes, sizes)
    assert got.dtype == torch.int64 and got.shape == ref.shape == (4, logits.shape[0] * sum(sizes))
    assert got.device == logits.device
    cost = _matcher("scipy").batched_cost(logits, boxes, labels, tboxes).double().cpu()
    a, b = _by_block(ref), _by_block(got)
    assert a.keys() == b.keys()
    for (s, i), ref_block in a.items():
        block = b[(s, i)]
        assert sorted(block) == list(range(sizes[i])) and len(set(block.values())) == sizes[i]
        total = sum(cost[s, i, q, t].item() for t, q in block.items())
        best = sum(cost[s, i, q, t].item() for t, q in ref_block.items())
        assert total == pytest.approx(best, rel=1e-6, abs=1e-5), (s, i)
    return ref, got


@pytest.mark.parametrize(
    "sizes, q, seed",
    [([3, 1, 7], 12, 0), ([0, 5, 12], 12, 1), ([4, 0], 5, 2), ([1], 9, 3), ([9, 9], 30, 4), ([0, 0], 6, 5)],
)
def test_random_costs_give_scipys_optimum(sizes, q, seed):
    logits, boxes, labels, tboxes, _ = _inputs(3, sizes, q, seed)
    ref, got = _assert_same_optimum(logits, boxes, labels, tboxes, sizes)
    if sum(sizes):  # continuous random costs have one optimum: the very same pairs, in another order
        assert sorted(map(tuple, ref.T.tolist())) == sorted(map(tuple, got.T.tolist()))


def test_tied_costs_give_an_optimum_of_equal_cost():
    """Every query predicts the same logits and one of two boxes: many assignments share the optimal cost."""
    logits, boxes, labels, tboxes, _ = _inputs(2, [4, 6], 10, 7)
    logits = torch.zeros_like(logits)
    boxes = boxes[:, :, :2].repeat(1, 1, 5, 1)
    _assert_same_optimum(logits, boxes, labels, tboxes, [4, 6])
    # the solver itself on integer matrices (ties everywhere), rows <= columns as the matcher hands it
    gen = torch.Generator().manual_seed(0)
    cost = torch.randint(0, 3, (16, 5, 9), generator=gen).float()
    cols = _solve_batched(cost)
    for k in range(16):
        r, c = linear_sum_assignment(cost[k].numpy())
        assert len(set(cols[k].tolist())) == 5 and cost[k, torch.arange(5), cols[k]].sum() == cost[k, r, c].sum()


def test_padded_targets_and_non_finite_costs_never_reach_the_real_rows():
    """The image with fewer targets is padded (labels 0, boxes 0): its padded columns cost 0 in the solve, and a
    NaN prediction is made finite for the solver (the loss stays non-finite for the engine to stop on)."""
    logits, boxes, labels, tboxes, _ = _inputs(1, [2, 6], 8, 9)
    _assert_same_optimum(logits, boxes, labels, tboxes, [2, 6])
    boxes[0, 1, 3] = float("nan")
    pairs = _matcher("batched").match_pairs(logits, boxes, labels, tboxes, [2, 6])
    assert pairs.shape == (4, 8) and sorted(_by_block(pairs)[(0, 1)]) == list(range(6))
    with pytest.raises(ValueError, match="NaN"):
        _matcher("scipy").match_pairs(logits, boxes, labels, tboxes, [2, 6])


def test_more_targets_than_queries_is_the_same_error():
    logits, boxes, labels, tboxes, _ = _inputs(1, [4], 3, 0)
    with pytest.raises(ValueError, match="only 3 queries"):
        _matcher("batched").match_pairs(logits, boxes, labels, tboxes, [4])


def test_the_criterion_gives_the_same_loss_with_either_solver():
    from tests.models.test_dino_loss import _outputs, _targets

    gen = torch.Generator().manual_seed(3)
    targets = _targets([3, 0, 5], gen)
    out = _outputs(targets, q=12, gen=gen)
    weights = dino_weight_dict(num_decoder_layers=3)
    a = DinoCriterion(C, _matcher("scipy"), weights)(out, targets)
    b = DinoCriterion(C, _matcher("batched"), weights)(out, targets)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def real_sets(shared_data):
    """The stacked prediction sets (S = 6 decoder layers + encoder proposals) of a DINO-4scale-shaped model (width
    64, 900 queries, 192 px) on facemask's most crowded images (up to 115 boxes before the training transform), as the criterion stacks them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import dino_step

    args = dino_step.parser().parse_args(
        [
            "--data",
            str(shared_data / "facemask-coco"),
            "--image-size",
            "192",
            "--real-batches",
            "2",
            "--hidden-dim",
            "64",
        ]
    )
    rig, real = dino_step.build(args)
    sets = []
    with torch.no_grad():
        for batch in real:
            out = rig.model(batch["image"], batch["mask"], batch["targets"])
            layers = [out, *out["aux_outputs"], out["interm_outputs"]]
            labels, tboxes = pad_targets(batch["targets"], torch.device("cpu"))
            sizes = [len(t["labels"]) for t in batch["targets"]]
            stack = [torch.stack([x[k] for x in layers]) for k in ("pred_logits", "pred_boxes")]
            sets.append((*stack, labels, tboxes, sizes))
    return sets


def test_real_costs_from_a_dino_forward_give_scipys_optimum(real_sets):
    assert max(max(s[-1]) for s in real_sets) >= 50  # crowded images (the training transform may crop some boxes)
    for logits, boxes, labels, tboxes, sizes in real_sets:
        assert logits.shape[:3] == (7, 2, 900)
        _assert_same_optimum(logits, boxes, labels, tboxes, sizes)


def test_the_config_picks_the_solver_and_refuses_a_missing_package(monkeypatch):
    from trainer.tasks import build_task

    cpu = DistInfo(0, 0, 1, torch.device("cpu"))
    for choice, solver in (("scipy", "scipy"), ("auto", "scipy"), ("batched", "batched")):  # auto: CUDA only
        task = build_task(load_config(None, {"task": "detection", "data_dir": "x", "matcher": choice}), cpu)
        assert task.matcher_solver() == solver
    cfg = load_config(None, {"task": "detection", "data_dir": "x", "matcher": "batched"})
    monkeypatch.setitem(sys.modules, "torch_linear_assignment", None)
    with pytest.raises(ConfigError, match=r"^matcher: batched: torch-linear-assignment does not import"):
        build_task(cfg, cpu).check_config()
    with pytest.raises(ConfigError, match=r"^matcher: got 'hungarian'"):
        load_config(None, {"task": "detection", "data_dir": "x", "matcher": "hungarian"})


@pytest.mark.skipif(not CUDA, reason="needs CUDA (the Triton kernel)")
def test_the_triton_solver_matches_scipy_on_cuda(real_sets):
    for sizes, q, seed in (([3, 1, 7], 12, 0), ([0, 5, 12], 12, 1), ([40, 100], 900, 2)):
        logits, boxes, labels, tboxes, _ = _inputs(7, sizes, q, seed)
        _assert_same_optimum(*(x.cuda() for x in (logits, boxes, labels, tboxes)), sizes)
    for logits, boxes, labels, tboxes, sizes in real_sets:
        _assert_same_optimum(*(x.cuda() for x in (logits, boxes, labels, tboxes)), sizes)
    cost = torch.randint(0, 3, (16, 5, 9), generator=torch.Generator().manual_seed(0)).float()
    cols = _solve_batched(cost.cuda()).cpu()
    for k in range(16):
        r, c = linear_sum_assignment(cost[k].numpy())
        assert cost[k, torch.arange(5), cols[k]].sum() == cost[k, r, c].sum()
