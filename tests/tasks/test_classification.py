"""The classification plug-in against the task contract (trainer/tasks/base.py), without training: device batches,
the model step, the evaluator, the example batch planning runs on, the target check, and its metric names as
catalog/metrics.py lists them for SageMaker and CloudWatch."""

from __future__ import annotations

import pytest
import torch

from catalog.metrics import TASK_METRICS
from trainer.config import ConfigError, load_config
from trainer.engine.distributed import DistInfo
from trainer.tasks import build_task, task_names
from trainer.tasks.base import StepOutput

CPU = DistInfo(0, 0, 1, torch.device("cpu"))


def _task(**kw):
    base = dict(model="resnet18", image_size=32, num_workers=0, device="cpu", precision="32")
    return build_task(load_config(None, {**base, **kw}), CPU)


def test_every_registered_task_has_its_metric_names_in_the_catalog():
    assert set(task_names()) <= set(TASK_METRICS)


def test_classification_reports_exactly_the_catalogued_metrics():
    task = _task(use_ema=True)
    ev = task.evaluator()
    val = set(ev.directions)
    train = set(task.train_metrics(torch.tensor([3.0, 4.0], dtype=torch.float64)))
    keys = {f"val_{k}" for k in val} | {f"ema_val_{k}" for k in val} | {f"train_{k}" for k in train}
    assert keys == set(TASK_METRICS["classification"])
    assert TASK_METRICS["classification"][0] == f"val_{task.target_metric}"  # the headline is the target metric


def test_example_batch_model_step_and_evaluator_follow_the_contract():
    task = _task(mixup_alpha=0.2, channels_last=True)
    model = task.build_model(5)
    batch = task.example_batch(4, num_outputs=5)
    assert batch["image"].shape == (4, 3, 32, 32) and batch["image"].dtype == torch.float32
    assert batch["image"].is_contiguous(memory_format=torch.channels_last)
    assert batch["label"].shape == (4, 5) and batch["n"] == 4  # MixUp on: soft labels
    out = task.model_step(model, batch)
    assert isinstance(out, StepOutput) and out.loss.dim() == 0 and out.loss.dtype == torch.float32
    assert out.loss.requires_grad and out.outputs.shape == (4, 5) and out.n == 4
    ev_batch = task.example_batch(6, image_size=48, num_outputs=5, train=False)
    assert ev_batch["label"].shape == (6,) and ev_batch["image"].shape[-1] == 48
    ev = task.evaluator()
    ev.reset()
    logits = torch.nn.functional.one_hot(ev_batch["label"], 5).float() * 10
    ev.update(logits, ev_batch)
    m = ev.compute()
    assert m["top1"] == 100.0 and m["top5"] == 100.0 and m["loss"] < 1e-3
    ev.reset()
    assert ev.compute()["top1"] == 0.0  # reset forgets; an empty share counts nothing


def test_collated_batches_become_device_batches():
    task = _task()
    raw = {
        "image": torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8),
        "label": torch.tensor([0, 1, 2]),
        "bad": [],
    }
    b = task.eval_batch(raw)
    assert b["n"] == 3 and b["image"].dtype == torch.float32 and torch.equal(b["label"], raw["label"])
    empty = task.eval_batch(
        {
            "image": torch.empty((0, 3, 1, 1), dtype=torch.uint8),
            "label": torch.empty((0,), dtype=torch.int64),
            "bad": [],
        }
    )
    assert empty["n"] == 0


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"target_value": 178}, r"target_value: got 178.0; top1 is a percentage: give a value in \(0, 100\]"),
        (
            {"target_metric": "map", "target_value": 50},
            r"target_metric: got 'map'; task classification reports "
            r"loss, top1, top5",
        ),
    ],
)
def test_target_is_checked_before_any_data_is_read(kw, match):
    with pytest.raises(ConfigError, match=match):
        _task(data_dir="/nonexistent", **kw).check_config()


def test_a_loss_target_may_be_any_positive_number():
    _task(target_metric="val_loss", target_value=250.0).check_config()


def test_decode_device_cuda_batches_equal_the_worker_path_on_a_cpu_device(shared_data):
    root = str(shared_data / "hymenoptera")
    with pytest.raises(ConfigError, match=r"^decode_device: got 'cuda' but the training device is cpu"):
        _task(data_dir=root, decode_device="cuda").check_config()
    tasks = [_task(data_dir=root, decode_device=d, image_size=64, channels_last=False) for d in ("cpu", "cuda")]
    data = [t.build_data() for t in tasks]
    assert any("data: decode: JPEGs on cpu (nvJPEG" in line for line in data[1].report)
    keys = [(1, i) for i in (0, 5, 77, 150)]
    for split, fn in (("train", "train_batch"), ("val", "eval_batch")):
        a, b = (getattr(t, fn)(d.collate([getattr(d, split)[k] for k in keys])) for t, d in zip(tasks, data))
        assert a["n"] == b["n"] == 4 and torch.equal(a["label"], b["label"]) and torch.equal(a["image"], b["image"])
