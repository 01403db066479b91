"""The tasks: one plug-in package each (classification, detection, segmentation, video) behind
:class:`trainer.tasks.base.Task`, and :func:`build_task`, the one constructor call the engine and planning make.

The name -> plug-in registry itself lives below the config in :mod:`trainer.registry` (pure Python, so the config
schema and ``infra/`` can list and validate task names without importing a task); its functions are re-exported
here. A new task adds one line there (or calls :func:`register_task` from a plug-in package) and subclasses
:class:`trainer.tasks.base.Task`; the engine needs no change.
"""

from __future__ import annotations

from typing import Any

from trainer.registry import register_task, task_class, task_names


def build_task(cfg: Any, dist: Any) -> Any:
    """The task of ``cfg.task`` for one rank: ``task_class(cfg.task)(cfg, dist)`` (the only constructor call the
    engine and planning make). ``cfg``: a validated :class:`trainer.config.TrainConfig`; ``dist``: a
    :class:`trainer.engine.distributed.DistInfo`."""
    return task_class(cfg.task)(cfg, dist)


__all__ = ["build_task", "register_task", "task_class", "task_names"]
