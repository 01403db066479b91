"""The task registry: the one place that maps a task name (config field ``task``) to its plug-in class.

Pure Python (no torch import), and below the config: :mod:`trainer.config` validates ``task`` against
:func:`task_names`, and ``infra/`` lists them, without importing a task; the task's module is imported only by
:func:`task_class` (and :func:`trainer.tasks.build_task`). :mod:`trainer.tasks` re-exports these functions.
"""

from __future__ import annotations

import importlib

#: task name -> "module:Class" (imported lazily)
_REGISTRY: dict[str, str] = {
    "classification": "trainer.tasks.classification.task:ClassificationTask",
    "detection": "trainer.tasks.detection.task:DetectionTask",
    "segmentation": "trainer.tasks.segmentation.task:SegmentationTask",
    "video": "trainer.tasks.video.task:VideoTask",
}


def register_task(name: str, target: str) -> None:
    """Register task ``name`` as ``"package.module:Class"`` (a :class:`trainer.tasks.base.Task` subclass).

    Raises:
        ValueError: ``name`` is already registered for another class, or ``target`` is not ``module:Class``.
    """
    if ":" not in target:
        raise ValueError(f"register_task({name!r}): target must be 'module:Class', got {target!r}")
    if _REGISTRY.get(name, target) != target:
        raise ValueError(f"register_task({name!r}): already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = target


def task_names() -> tuple[str, ...]:
    """Registered task names, sorted (the values the config field ``task`` accepts)."""
    return tuple(sorted(_REGISTRY))


def task_class(name: str) -> type:
    """Import and return the Task subclass registered as ``name``.

    Raises:
        KeyError: ``name`` is not registered (the config validates ``task`` first, so users never see this).
    """
    module, _, attr = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), attr)
