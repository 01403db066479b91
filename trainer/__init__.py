"""Trainstack trainer: the compute side (never imports aws_cdk).

Entry: ``python -m trainer train`` (trainer/cli.py) -> :class:`trainer.config.TrainConfig` ->
:func:`trainer.train.run` -> :class:`trainer.loop.Trainer` with a task from ``trainer/tasks``.
"""
