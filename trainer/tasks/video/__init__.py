"""The video task (seed 004): clip classification, optionally on cached per-frame features."""
