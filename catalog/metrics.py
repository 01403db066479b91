"""The metric names the trainer prints on its ``key=value`` epoch lines, per task: what SageMaker's
``MetricDefinitions`` (infra/constructs/sagemaker_job.py) and the CloudWatch metric filters of EC2 runs
(infra/stacks/monitoring.py) extract. Pure Python: both ``infra/`` and ``trainer/`` import it, and
tests/tasks/test_classification.py checks each task's evaluator against its row here.

SageMaker accepts at most 40 metric definitions per training job (AWS docs, "Define metrics",
CreateTrainingJob ``AlgorithmSpecification.MetricDefinitions``: "Maximum number of 40 items").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

#: Keys of every epoch line, whatever the task (engine: loss, throughput, time).
COMMON = ("train_loss", "images_per_s", "epoch_time_s")

#: The keys of the top-k classifiers' evaluator (classification and video).
_TOP_K = ("val_top1", "val_top5", "val_loss", "ema_val_top1", "ema_val_top5", "ema_val_loss", "train_top1")

#: Task name -> the keys its evaluator and training statistics add (``val_<metric>``, ``ema_val_<metric>`` with
#: EMA on, ``train_<statistic>`` and ``train_<loss term>``); the first is the task's headline metric (graphed and
#: filtered on EC2). Per-class keys whose names come from the data (detection's ``val_ap_<category>``,
#: segmentation's ``val_iou_<class>``) are not
#: listed: they are in the JSONL and TensorBoard, not in SageMaker's fixed list.
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "classification": _TOP_K,
    "detection": (
        "val_map",
        "val_map_50",
        "val_map_75",
        "val_map_small",
        "val_map_medium",
        "val_map_large",
        "val_mar_100",
        "ema_val_map",
        "ema_val_map_50",
        "ema_val_map_75",
        "train_loss_ce",
        "train_loss_bbox",
        "train_loss_giou",
        "train_loss_ce_dn",
        "train_loss_bbox_dn",
        "train_loss_giou_dn",
        "train_loss_ce_interm",
        "train_loss_bbox_interm",
        "train_loss_giou_interm",
    ),
    "segmentation": (
        "val_miou",
        "val_pixel_acc",
        "val_mean_acc",
        "ema_val_miou",
        "ema_val_pixel_acc",
        "train_loss_ce",
        "train_loss_dice",
    ),
    "video": _TOP_K,  # clip classification: the same evaluator (TopKEvaluator)
}

#: SageMaker's limit on MetricDefinitions per training job.
MAX_METRIC_DEFINITIONS = 40


def metric_names(tasks: Optional[Iterable[str]] = None) -> tuple[str, ...]:
    """:data:`COMMON` then each task's keys (all tasks by default), without repeats, in a stable order.

    Raises:
        KeyError: a task without a row in :data:`TASK_METRICS`.
    """
    out = list(COMMON)
    for task in sorted(TASK_METRICS) if tasks is None else tasks:
        out += [k for k in TASK_METRICS[task] if k not in out]
    return tuple(out)


def headline_metrics(tasks: Optional[Iterable[str]] = None) -> tuple[str, ...]:
    """The headline metric of each task (first of its row; tasks that share one, such as classification and video's
    ``val_top1``, give it once), then ``train_loss`` and ``images_per_s``."""
    names = sorted(TASK_METRICS) if tasks is None else list(tasks)
    return tuple(dict.fromkeys(TASK_METRICS[t][0] for t in names)) + ("train_loss", "images_per_s")


def metric_definitions(tasks: Optional[Iterable[str]] = None) -> list[dict[str, str]]:
    """SageMaker ``MetricDefinitions``: ``{"Name": key, "Regex": "key=([0-9.eE+-]+)"}`` per :func:`metric_names`.

    Raises:
        ValueError: more than :data:`MAX_METRIC_DEFINITIONS` names.
    """
    names = metric_names(tasks)
    if len(names) > MAX_METRIC_DEFINITIONS:
        raise ValueError(f"{len(names)} metric definitions; SageMaker accepts at most {MAX_METRIC_DEFINITIONS}")
    return [{"Name": n, "Regex": f"(?:^| ){n}=([0-9.eE+-]+)"} for n in names]
