"""The engine knows no task: a plug-in regression task (tests/fake_task.py) trains through the same Trainer with
its targets inside the model's forward, two logged loss terms, a gathering evaluator and a lower-is-better
target metric; evaluators synchronise across two gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from trainer import registry
from trainer.config import ConfigError, load_config
from trainer.engine.distributed import DistInfo
from trainer.engine.evaluation import GatherEvaluator, SumEvaluator, better, reached
from trainer.engine.trainer import Trainer

CPU = DistInfo(0, 0, 1, torch.device("cpu"))


@pytest.fixture
def regression(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "regression", "fake_task:RegressionTask")


def _cfg(tmp_path, **kw):
    base = dict(
        task="regression",
        batch_size=32,
        epochs=4,
        lr=0.05,
        optimizer="adamw",
        momentum=0.9,
        weight_decay=0.0,
        scheduler="cosine",
        num_workers=0,
        precision="32",
        device="cpu",
        checkpoint_dir=str(tmp_path / "ck"),
        log_dir=str(tmp_path / "logs"),
        log_every_steps=1000,
    )
    base.update(kw)
    return load_config(None, base)


def test_a_task_that_is_not_classification_trains_with_targets_in_the_forward_and_logged_terms(regression, tmp_path):
    t = Trainer(_cfg(tmp_path), CPU)
    last = t.fit()
    t.close()
    assert t.model.seen_targets == 4 * 8 * 32  # the model step handed the targets to the forward, every step
    assert {"train_mse", "train_l1", "val_median_abs_error", "val_mse"} <= set(last)
    first = t.history[0]
    assert last["train_mse"] < first["train_mse"] and last["val_median_abs_error"] < first["val_median_abs_error"]
    assert last["train_loss"] == pytest.approx(last["train_mse"] + 0.1 * last["train_l1"], rel=1e-6)
    assert last["val_count"] == 64.0  # every val sample once
    assert t.best == min(r["val_median_abs_error"] for r in t.history)  # "min" direction picks the best
    assert "image_size" not in last  # no classification field leaks into the row


def test_lower_is_better_target_stops_early_and_an_unknown_target_metric_is_refused(regression, tmp_path):
    t = Trainer(_cfg(tmp_path / "a", target_metric="mse", target_value=100.0), CPU)
    t.fit()
    t.close()
    assert len(t.history) == 1  # mse <= 100 after the first epoch
    with pytest.raises(
        ConfigError,
        match=r"target_metric: got 'top1'; task regression reports "
        r"median_abs_error, mse",
    ):
        Trainer(_cfg(tmp_path / "b", target_metric="top1", target_value=50.0), CPU)


def test_better_and_reached_follow_the_direction():
    assert better(2.0, 1.0, "max") and not better(2.0, 1.0, "min") and better(0.5, None, "min")
    nan = float("nan")  # an undefined metric (COCO's AP without ground truth) is never best, never blocks one
    assert not better(nan, None, "max") and not better(nan, 1.0, "max") and better(1.0, nan, "max")
    assert reached(0.1, 0.2, "min") and not reached(0.1, 0.2, "max") and reached(0.2, 0.2, "max")


class _Sum(SumEvaluator):
    size = 2
    directions = {"mean": "max"}

    def statistics(self, outputs, batch):
        return torch.tensor([float(outputs.sum()), float(outputs.numel())], dtype=torch.float64)

    def metrics(self, sums):
        return {"mean": (sums[0] / sums[1]).item(), "n": sums[1].item()}


class _Gather(GatherEvaluator):
    directions = {"median": "max"}

    def records(self, outputs, batch):
        return outputs.tolist()

    def metrics(self, records):
        return {"median": float(torch.tensor(records).median()), "n": float(len(records)), "max": max(records)}


def _rank(rank: int, world: int, init: str, out_dir: str) -> None:
    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        values = torch.arange(5, dtype=torch.float32) + 10 * rank  # rank 0: 0..4, rank 1: 10..14
        s, g = _Sum(torch.device("cpu")), _Gather()
        for ev in (s, g):
            ev.reset()
            ev.update(values[:3], {})
            ev.update(values[3:], {})
        res = {"sum": s.compute(), "gather": g.compute()}
        torch.save(res, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        tdist.destroy_process_group()


@pytest.mark.multiprocess
def test_summing_and_gathering_evaluators_synchronise_two_ranks(tmp_path):
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rdzv'}", str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        res = torch.load(tmp_path / f"r{r}.pt")
        assert res["sum"] == {"mean": 7.0, "n": 10.0}
        assert res["gather"] == {"median": 4.0, "n": 10.0, "max": 14.0}  # torch's median: the lower middle


def test_lr_scales_split_the_parameter_groups_and_a_plain_run_keeps_its_two_groups():
    from trainer.engine.optim import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    plain = param_groups(model, 1e-4, True)
    assert [len(g["params"]) for g in plain] == [2, 4] and "lr" not in plain[0]
    scaled = param_groups(model, 1e-4, True, lr=1e-4, lr_scales={"0.": 0.1})
    assert scaled[0]["lr"] == 1e-4  # the base lr first: the loop logs param_groups[0]["lr"]
    got = sorted((g["lr"], g["weight_decay"], len(g["params"])) for g in scaled)
    assert got == [(pytest.approx(1e-5), 0.0, 1), (pytest.approx(1e-5), 1e-4, 1), (1e-4, 0.0, 3), (1e-4, 1e-4, 1)]


def test_a_field_added_after_a_checkpoint_is_no_change_while_it_keeps_its_default():
    from trainer.config import TrainConfig
    from trainer.engine.resume import config_diff as _config_diff

    now = TrainConfig().to_dict()
    old = {k: v for k, v in now.items() if k != "label_smoothing"}  # as written before the field existed
    assert _config_diff(old, now) == []
    assert _config_diff(old, {**now, "label_smoothing": 0.1}) == ["label_smoothing: checkpoint None -> now 0.1"]


def test_a_field_with_a_legacy_value_reads_as_what_the_older_trainer_used():
    """pad_value arrived on 2026-11-28 (default mean); detection checkpoints written before it padded black, so
    resuming one with the new default is a config change (refused without --force-resume), and keeping black is
    not. Other tasks' checkpoints never read the detection field."""
    from trainer.config import TrainConfig, saved_config
    from trainer.engine.resume import config_diff as _config_diff

    now = {**TrainConfig().to_dict(), "task": "detection"}
    old = {k: v for k, v in now.items() if k != "pad_value"}  # a detection checkpoint from before the field
    assert saved_config(old)["pad_value"] == "black"
    assert _config_diff(old, now) == ["pad_value: checkpoint 'black' -> now 'mean'"]
    assert _config_diff(old, {**now, "pad_value": "black"}) == []
    cls_now = {**TrainConfig().to_dict(), "task": "classification"}
    cls_old = {k: v for k, v in cls_now.items() if k != "pad_value"}
    assert "pad_value" not in saved_config(cls_old) and _config_diff(cls_old, cls_now) == []
