"""Trainstack trainer: the compute side (never imports aws_cdk).

Entry: ``python -m trainer train`` (trainer/cli.py) -> :class:`trainer.config.TrainConfig` ->
:func:`trainer.engine.run.run` -> :class:`trainer.engine.trainer.Trainer` with a task from ``trainer/tasks``.
"""
