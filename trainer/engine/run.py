"""Run one training job from a validated config: process group, stop sources, trainer, summary, exit code."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from trainer import failures
from trainer.config import TrainConfig
from trainer.config.validation import check_mlflow_uri
from trainer.engine import distributed as dist
from trainer.engine.interruption import SignalHandlers, SpotNoticePoller, StopFlag
from trainer.errors import EXIT_ABORTED, EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_OK, exit_code


def _summary(trainer, last: dict, plot: Optional[Path]) -> None:
    """Rank 0's closing lines: outcome, the last durable checkpoint of this run, metrics, plot."""
    if trainer.interrupted:
        print(f"interrupted: exit {EXIT_INTERRUPTED} (resume me): {trainer.interrupted}", flush=True)
    elif trainer.best is not None and last:
        m = trainer.best_metric
        print(f"done: best {m}={trainer.best:.2f} last val_{m}={last.get('val_' + m, float('nan')):.2f}", flush=True)
    else:
        print("done: nothing left to train", flush=True)
    path = trainer.final_checkpoint()  # made durable by this run, else the one it resumed from
    print(f"checkpoint: {path if path else '-'}", flush=True)
    print(f"metrics: {trainer.log.dir / 'metrics.jsonl'}  tensorboard: {trainer.log.dir / 'tb'}", flush=True)
    print(f"plot: {plot if plot else '-'}", flush=True)


def _aborted(checkpoint_dir: str, is_main: bool, trainer=None) -> int:
    """A second Ctrl-C: abandon the checkpoint being written, end the tracked runs KILLED (waiting at most
    :data:`~trainer.engine.tracking.ABORT_FLUSH_TIMEOUT_S` for the rows still queued), say so naming the last
    durable checkpoint, remove half-written checkpoint folders (rank 0), return 130."""
    from trainer.engine.tracking import ABORT_FLUSH_TIMEOUT_S

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third Ctrl-C must not interrupt the clean-up
    try:
        durable = trainer.abort() if trainer is not None else None
        if trainer is not None:
            try:
                trainer.log.finish_tracking("KILLED", timeout_s=ABORT_FLUSH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a tracker's failure must not hide the abort
                pass
        if is_main:
            print(
                "aborted by a second Ctrl-C; no checkpoint written for the current step; last durable "
                f"checkpoint: {durable if durable else 'none'}",
                file=sys.stderr,
                flush=True,
            )
            for tmp in Path(checkpoint_dir).glob(".tmp-ckpt-*"):
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    return EXIT_ABORTED


def _fork_worker_server(cfg: TrainConfig) -> None:
    """Start the loader workers' server as a fork of this process while it has no other thread
    (:func:`trainer.data.loading.fork_worker_server`), the task's modules imported first so that the server has
    them too; a process that cannot fork safely gets the fresh server at its first loader instead."""
    from trainer.data.loading import fork_worker_server
    from trainer.registry import task_class

    task_class(cfg.task)
    fork_worker_server()


def run(cfg: TrainConfig, notes: Sequence[str] = ()) -> int:
    """Train with ``cfg`` in this process (one rank of torchrun, or alone).

    ``notes``: lines printed by rank 0 before training (e.g. the SageMaker defaults the caller applied: the
    engine knows no cloud; ``python -m trainer train`` applies :func:`trainer.sagemaker.job.apply_defaults`).

    Returns an exit code (:mod:`trainer.errors`): 0 done; 2 config, data or checkpoint error (ConfigError,
    DataError, CheckpointError, raised anywhere from process-group set-up to the last step); 3 non-finite loss;
    75 interrupted with a durable checkpoint (run the same command again to resume); 130 aborted by a second
    Ctrl-C. The tracked runs (``tracking``) end FINISHED (0), KILLED (75, 130) or FAILED (2, 3, and any exception
    that is a bug). Rank 0 holds the checkpoint folder's writer lock from the trainer's start to its end (a second
    run on the same folder exits 2 naming this one: :class:`~trainer.engine.durable.WriterLock`). Those errors end as one line (:func:`trainer.failures.fail`: printed by rank 0, or handed to
    torchrun / the image's entrypoint, which show it once). Any other exception is a bug and propagates with its
    traceback (exit 1).
    """
    from trainer.engine.trainer import Trainer

    stop = StopFlag()
    handlers = poller = trainer = info = None
    failure: Optional[tuple[int, str]] = None
    try:
        if "mlflow" in cfg.tracking and not cfg.tracking_uri:  # the store MLflow would use: refused before any work
            check_mlflow_uri(os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI")
        if cfg.num_workers > 0 and not cfg.use_ffcv:
            _fork_worker_server(cfg)
        info = dist.init(cfg.device)
        handlers = SignalHandlers(stop)
        if info.is_main:
            for n in notes:
                print(n, flush=True)
        if info.local_rank == 0:  # one poller per host
            poller = SpotNoticePoller(
                stop,
                interval_s=cfg.spot_poll_interval_s,
                rebalance=cfg.stop_on_rebalance,
                log=lambda m: print(m, flush=True),
            )
            poller.start()
        trainer = Trainer(cfg, info, stop)
        last = trainer.fit()
        plot = trainer.close()
        if info.is_main:
            _summary(trainer, last, plot)
        if trainer.interrupted:
            failures.report(EXIT_INTERRUPTED, f"interrupted ({trainer.interrupted})", echo=False)
            return EXIT_INTERRUPTED
        return EXIT_OK
    except KeyboardInterrupt:
        return _aborted(cfg.checkpoint_dir, info.is_main if info else failures.env_rank() == 0, trainer)
    except Exception as e:  # noqa: BLE001 - mapped by exit_code; anything unknown is re-raised
        code = exit_code(e)
        if trainer is not None:  # the tracked runs end FAILED (2, 3, a crash), never RUNNING or FINISHED
            try:
                if code == EXIT_NONFINITE:
                    trainer.close(status="FAILED")
                else:
                    trainer.log.finish_tracking("FAILED")
            except Exception:  # noqa: BLE001 - the error itself is what the user must see
                pass
        if code == 1:
            raise
        failure = (code, failures.one_line(e, with_type=False))
    finally:
        if trainer is not None:
            trainer.ckpt.release_lock()
        if poller is not None:
            poller.stop()
        if handlers is not None:
            handlers.restore()
        dist.shutdown()
    return failures.fail(*failure)
