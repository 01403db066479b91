"""The training engine: the loop (:mod:`.trainer`), one optimizer step (:mod:`.step`), the job runner (:mod:`.run`),
checkpoints, process groups, stop sources, log sinks, optimizer/schedule/EMA/precision builders.

It knows no task: everything task-specific arrives through :class:`trainer.tasks.base.Task` (a test enforces that
no task name appears here).
"""
