"""Task registry: task name (config field ``task``) -> Task class."""

from trainer.tasks.base import Task, TaskData
from trainer.tasks.classification import ClassificationTask

TASKS: dict[str, type[Task]] = {"classification": ClassificationTask}

__all__ = ["TASKS", "Task", "TaskData", "ClassificationTask"]
