"""Planning: measure (probe, loader probe), predict (step memory, loader RAM) and rank instance types (plan),
all on the engine's own :class:`trainer.engine.step.TrainStep` and the task's example batch."""
