"""Run one training job from a validated config: process group, stop sources, trainer, summary, exit code."""

from __future__ import annotations

import sys

from trainer import distributed as dist
from trainer import sagemaker
from trainer.checkpoint import CheckpointError
from trainer.cli import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_OK, EXIT_USAGE
from trainer.config import ConfigError, TrainConfig
from trainer.data.imagefolder import DataError
from trainer.interruption import SignalHandlers, SpotNoticePoller, StopFlag


def run(cfg: TrainConfig) -> int:
    """Train with ``cfg`` in this process (one rank of torchrun, or alone).

    Returns an exit code: 0 done, 2 config/data/checkpoint error, 3 non-finite loss, 75 interrupted with a
    durable checkpoint (run the same command again to resume). Errors are printed as one line naming the
    field, file or step; rank 0 prints, other ranks stay quiet.
    """
    from trainer.loop import NonFiniteLossError, Trainer

    info = dist.init(cfg.device)
    cfg, notes = sagemaker.apply_defaults(cfg)
    stop = StopFlag()
    handlers = SignalHandlers(stop)
    poller = None
    trainer = None
    try:
        if info.is_main:
            for n in notes:
                print(n, flush=True)
        if info.local_rank == 0:  # one poller per host
            poller = SpotNoticePoller(stop, interval_s=cfg.spot_poll_interval_s, rebalance=cfg.stop_on_rebalance,
                                      log=lambda m: print(m, flush=True))
            poller.start()
        trainer = Trainer(cfg, info, stop)
        last = trainer.fit()
        plot = trainer.close()
        if info.is_main:
            latest = trainer.ckpt.pointer("latest")
            if trainer.interrupted:
                print(f"interrupted: exit {EXIT_INTERRUPTED} (resume me): {trainer.interrupted}", flush=True)
            elif trainer.best is not None and last:
                m = trainer.task.primary_metric
                print(f"done: best {m}={trainer.best:.2f} last val_{m}={last.get('val_' + m, float('nan')):.2f}",
                      flush=True)
            else:
                print("done: nothing left to train", flush=True)
            print(f"checkpoint: {trainer.ckpt.dir / latest if latest else '-'}", flush=True)
            print(f"metrics: {trainer.log.dir / 'metrics.jsonl'}  tensorboard: {trainer.log.dir / 'tb'}", flush=True)
            print(f"plot: {plot if plot else '-'}", flush=True)
        return EXIT_INTERRUPTED if trainer.interrupted else EXIT_OK
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
        if poller is not None:
            poller.stop()
        handlers.restore()
        dist.shutdown()
