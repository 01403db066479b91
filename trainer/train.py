"""Run one training job from a validated config: process group, trainer, summary, exit code."""

from __future__ import annotations

import sys

from trainer import distributed as dist
from trainer.checkpoint import CheckpointError
from trainer.cli import EXIT_NONFINITE, EXIT_OK, EXIT_USAGE
from trainer.config import ConfigError, TrainConfig
from trainer.data.imagefolder import DataError


def run(cfg: TrainConfig) -> int:
    """Train with ``cfg`` in this process (one rank of torchrun, or alone).

    Returns an exit code: 0 done, 2 config/data/checkpoint error, 3 non-finite loss. Errors are printed
    as one line naming the field, file or step; rank 0 prints, other ranks stay quiet.
    """
    from trainer.loop import NonFiniteLossError, Trainer

    info = dist.init(cfg.device)
    trainer = None
    try:
        trainer = Trainer(cfg, info)
        last = trainer.fit()
        plot = trainer.close()
        if info.is_main:
            latest = trainer.ckpt.pointer("latest")
            print(f"done: best {trainer.task.primary_metric}={trainer.best:.2f} "
                  f"last val_{trainer.task.primary_metric}={last.get('val_' + trainer.task.primary_metric, float('nan')):.2f}"
                  if trainer.best is not None and last else "done: nothing left to train", flush=True)
            print(f"checkpoint: {trainer.ckpt.dir / latest if latest else '-'}", flush=True)
            print(f"metrics: {trainer.log.dir / 'metrics.jsonl'}  tensorboard: {trainer.log.dir / 'tb'}", flush=True)
            print(f"plot: {plot if plot else '-'}", flush=True)
        return EXIT_OK
    except (ConfigError, DataError, CheckpointError) as e:
        if info.is_main:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except NonFiniteLossError as e:
        if info.is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)
        if trainer is not None:
            trainer.close()
        return EXIT_NONFINITE
    finally:
        dist.shutdown()
