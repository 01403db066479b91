"""The task-agnostic training run: DDP, precision, accumulation, clipping, EMA, schedule, evaluation,
checkpoints, early stop. Tasks (trainer/tasks) supply data, model, loss and metrics.

:class:`Trainer` builds everything and runs the epochs (:meth:`Trainer.fit`: train, save, evaluate, pick the best,
stop at the target); the passes within an epoch and the collective checks between steps are
:class:`~trainer.engine.epoch.EpochMixin`'s (:mod:`trainer.engine.epoch`), resuming from a checkpoint is
:class:`~trainer.engine.resume.ResumeMixin`'s (:mod:`trainer.engine.resume`).

Log lines count epochs and steps from 1 (``epoch=1`` is the first epoch, "continuing in epoch 2 of 3");
the checkpoint's ``progress`` fields stay 0-based (see :mod:`trainer.engine.checkpoint`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.config import ConfigError, TrainConfig
from trainer.data.loading import build_split_loaders, shutdown_all
from trainer.engine import distributed as dist
from trainer.engine.checkpoint import CheckpointError, CheckpointManager
from trainer.engine.checkpoint_files import restore_rng
from trainer.engine.epoch import EpochMixin, _EpochStats
from trainer.engine.evaluation import better, reached
from trainer.engine.interruption import StopFlag
from trainer.engine.logging import MetricsLogger
from trainer.engine.optim import build_scheduler, linear_scaling_warning
from trainer.engine.resume import ResumeMixin
from trainer.engine.step import build_train_step
from trainer.errors import DataError, NonFiniteLossError  # noqa: F401 - NonFiniteLossError re-exported
from trainer.tasks import build_task


class Trainer(EpochMixin, ResumeMixin):
    """Builds everything from a validated :class:`TrainConfig` and runs :meth:`fit`.

    Raises (before any training step): ``ConfigError`` (bad value, e.g. a global batch that does not split
    over ranks: checked before the data is read), ``DataError`` (unusable data), ``CheckpointError``
    (checkpoint folder not writable; resume target invalid, of another label space or model, or config
    changed without ``force_resume``).

    ``evaluation_only`` (``python -m trainer evaluate``): the same build, but no checkpoint writer is started and
    no interrupted-run record is read, since nothing is trained or saved.
    """

    def __init__(
        self, cfg: TrainConfig, info: dist.DistInfo, stop: Optional[StopFlag] = None, *, evaluation_only: bool = False
    ):
        self.cfg, self.info, self.device = cfg, info, info.device
        self.evaluation_only = evaluation_only  # ``evaluate``: no checkpoint writer, no interrupted-run record
        self.stop = stop or StopFlag()  # set by signal handlers / the spot poller (trainer.engine.run)
        self.interrupted: Optional[str] = None
        self.resumed_from: Optional[Path] = None
        self._resumed_epoch_stats: Optional[dict] = None
        self._last_epoch_stats: Optional[_EpochStats] = None
        self.log = MetricsLogger(cfg.log_dir, enabled=info.is_main)
        torch.manual_seed(cfg.seed)
        self.micro = cfg.micro_batch_size(info.world_size)  # config checks first: no data read yet
        self.accum = cfg.accumulate_grad_batches
        self.task = build_task(cfg, info)
        self.task.check_config()
        self.stop_metric, self.stop_direction = self.task.check_target()
        self.best_metric = self.task.target_metric
        self.best_direction = self.task.metric_directions()[self.best_metric]
        self.ckpt = self._open_checkpoint_dir()
        try:
            self._build(cfg, info)
        except BaseException:
            self.ckpt.release_lock()  # a run that never trained leaves the folder to the next one at once
            raise

    def _build(self, cfg: TrainConfig, info: dist.DistInfo) -> None:
        """The rest of :meth:`__init__`, once rank 0 holds the checkpoint folder's lock: data, loaders, model,
        optimizer, resume, tracking."""
        if self.ckpt.lock_note:
            self.log.info("WARNING: " + self.ckpt.lock_note)
        data = self.task.build_data()
        self.label_space = dict(data.label_space)
        self.val_left_out = data.val_left_out
        for line in dict.fromkeys(data.report):  # once each: ``evaluate`` reads its split as train and val
            self.log.info(line)
        self.eval_batch = cfg.eval_batch_size or 2 * self.micro
        loaders = build_split_loaders(cfg, info, data, self.micro, self.eval_batch)
        self.train_loader, self.val_loader = loaders.train, loaders.val
        self.sampler, self.val_sampler = loaders.train_order, loaders.val_order
        for line in loaders.notes:
            self.log.info(line)
        per_rank = len(self.sampler)
        self.steps_per_epoch = per_rank // self.micro // self.accum
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"batch_size: global batch {cfg.batch_size} is larger than the training set "
                f"({len(data.train)} files); lower batch_size to at most "
                f"{per_rank * info.world_size}"
            )
        if cfg.max_steps_per_epoch:
            self.steps_per_epoch = min(self.steps_per_epoch, cfg.max_steps_per_epoch)

        wrap = (
            (lambda m: DDP(m, device_ids=[self.device.index] if self.device.type == "cuda" else None))
            if info.distributed
            else None
        )
        self.step = build_train_step(cfg, self.task, self.task.build_model(data.num_outputs), self.device, wrap=wrap)
        self.precision, self.model, self.train_model = self.step.precision, self.step.model, self.step.train_model
        self.optimizer, self.scaler, self.ema = self.step.optimizer, self.step.scaler, self.step.ema
        self.scheduler = build_scheduler(cfg, self.optimizer, self.steps_per_epoch)
        self.evaluator = self.task.evaluator()
        # Stop/periodic agreement runs on gloo over CPU tensors, so it never synchronises the GPU stream.
        self._ctrl_group = tdist.new_group(backend="gloo") if info.distributed and self.device.type == "cuda" else None
        self._last_save = time.monotonic()
        self.epoch, self.step_in_epoch, self.global_step = 0, 0, 0
        self.best: Optional[float] = None
        self.history: list[dict] = []
        self._tracking_ids: dict = {}
        self._tracking_uri: Optional[str] = None  # the MLflow store's resolved URI, kept in the checkpoint
        self._resume_if_asked()
        if self.resumed_from is not None:
            dropped = self.log.resume_at(self.global_step, evaluated=self.step_in_epoch < self.steps_per_epoch)
            if dropped:
                self.log.info(
                    f"metrics: dropped {dropped} row(s) of {self.log.dir / 'metrics.jsonl'} logged after "
                    f"global step {self.global_step} by the previous run (trained again now)"
                )
        self._start_tracking()
        if self.evaluation_only:
            return
        try:
            if info.is_main:
                self.log.info(self.ckpt.prepare(self._state()))
            previous = self.ckpt.pop_interrupted() if info.is_main else None
        except BaseException as e:  # run.run never holds this trainer: end its tracked run here
            self.log.finish_tracking("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise
        if previous:
            self.log.info(f"checkpoint: the previous run was interrupted: {previous.get('reason')}")
        torch.manual_seed(cfg.seed * 1000 + info.rank + 1 + self.global_step)  # per-rank MixUp/CutMix stream
        if self.global_step and self._rank_state is not None:
            restore_rng(self._rank_state["rng"])

    def _start_tracking(self) -> None:
        """Start the ``tracking`` sinks on rank 0 (continuing the run ids of a resumed checkpoint): the flat
        config as params; task, model, seed, config file (``TRAINSTACK_CONFIG_FILE``, set by the command line),
        sweep trial and sweep folder (``TRAINSTACK_SWEEP_TRIAL``, ``TRAINSTACK_SWEEP``, set by ``sweep``), world
        size and the system facts as tags. A failing tracker is a warning (MetricsLogger). MLflow's store:
        :func:`~trainer.engine.trackers.resolve_mlflow_uri` (``tracking_uri``, ``MLFLOW_TRACKING_URI``, the resumed
        checkpoint's, else ``<log_dir>/mlruns``); the resolved URI goes into every checkpoint (``tracking_uri``)."""
        cfg = self.cfg
        if not (cfg.tracking and self.info.is_main):
            return
        from trainer.engine.trackers import build_trackers, system_facts

        trackers = build_trackers(
            cfg.tracking,
            cfg.tracking_uri,
            cfg.tracking_experiment,
            cfg.tracking_run_name,
            self.log.dir,
            stored_uri=self._tracking_uri,
        )
        self._tracking_uri = next((t.uri for t in trackers if t.name == "mlflow"), self._tracking_uri)
        tags = {"task": cfg.task, "model": cfg.model, "seed": cfg.seed, "world_size": self.info.world_size}
        config_file = os.environ.get("TRAINSTACK_CONFIG_FILE")
        if config_file:
            tags["config"] = Path(config_file).name
        for tag, var in (("trial", "TRAINSTACK_SWEEP_TRIAL"), ("sweep", "TRAINSTACK_SWEEP")):  # set by `sweep`
            if os.environ.get(var):
                tags[tag] = os.environ[var]
        tags.update(system_facts())
        self.log.start_tracking(trackers, self._tracking_ids, cfg.to_dict(), tags)

    def _open_checkpoint_dir(self) -> CheckpointManager:
        """The :class:`CheckpointManager`; rank 0 checks that the folder can be created and written, and every
        rank raises its CheckpointError (collective, before any data is read)."""
        cfg, info = self.cfg, self.info
        ckpt, err = None, None
        try:
            ckpt = CheckpointManager(
                cfg.checkpoint_dir,
                info.rank,
                info.world_size,
                cfg.checkpoint_interval,
                writer=cfg.checkpoint_writer,
                keep_last=cfg.keep_last_checkpoints,
            )
        except CheckpointError as e:
            err = str(e)
        err = dist.broadcast_object(err)
        if err:
            raise CheckpointError(err)
        return ckpt

    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "config": self.cfg.to_dict(),
            "fingerprint": self.cfg.fingerprint(),
            "best_metric": self.best,
            "history": self.history,
            "world_size": self.info.world_size,
            "label_space": self.label_space,
            "tracking": self.log.tracking_ids() or self._tracking_ids,
            "tracking_uri": self._tracking_uri,
        }

    def save_checkpoint(self, is_best: bool = False, epoch_stats: Optional[dict] = None) -> Optional[Path]:
        """Write a checkpoint of the current state (collective; see :class:`CheckpointManager`).

        ``epoch_stats``: this rank's running statistics of an unfinished epoch (mid-epoch saves).
        Raises CheckpointError (every rank) when the previous checkpoint's write failed."""
        self._writer_check(wait=True)
        progress = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step}
        path = self.ckpt.save(self._state(), progress, rank_state={"epoch_stats": epoch_stats}, is_best=is_best)
        self._last_save = time.monotonic()
        return path

    def fit(self) -> dict:
        """Train until ``epochs``, ``target_value`` of the target metric or an agreed stop request; return the last epoch's
        metrics. Every checkpoint started is durable when this returns or raises, except after
        ``KeyboardInterrupt`` (a second Ctrl-C): then the one being written is abandoned (:meth:`abort`). A run
        that raises lets go of the checkpoint folder's writer lock (it writes no more checkpoints).

        Raises CheckpointError (every rank) when a checkpoint could not be written."""
        try:
            last = self._fit()
        except KeyboardInterrupt:
            self.abort()
            raise
        except BaseException:
            self.ckpt.join()  # its own error, if any, must not hide the one that got us here
            self.ckpt.release_lock()  # a failed run writes no more checkpoints
            raise
        self._writer_check(wait=True)
        return last

    def abort(self) -> Optional[Path]:
        """Abandon the checkpoint being written (its ``.tmp-ckpt-*`` folder is removed; complete checkpoints
        stay) and stop the loader workers. Returns :meth:`final_checkpoint`. Idempotent."""
        self.ckpt.abort()
        self.ckpt.close()
        self.ckpt.release_lock()
        shutdown_all()
        return self.final_checkpoint()

    def final_checkpoint(self) -> Optional[Path]:
        """The newest checkpoint this run can vouch for: the last one it made durable, else the one it
        resumed from, else None (rank 0; on other ranks only the resumed one is known)."""
        if self.ckpt.last_durable is not None:
            return self.ckpt.last_durable[0]
        return self.resumed_from

    def _fit(self) -> dict:
        cfg = self.cfg
        warn = linear_scaling_warning(cfg)
        if warn:
            self.log.info("WARNING: " + warn)
        self.log.info(
            f"train: model={cfg.model} world_size={self.info.world_size} device={self.device} "
            f"precision={self.precision.name} global_batch={cfg.batch_size} micro_batch={self.micro} "
            f"accumulate={self.accum} steps_per_epoch={self.steps_per_epoch} epochs={cfg.epochs}"
        )
        last: dict = {}
        metric, stop_metric = self.best_metric, self.stop_metric
        while self.epoch < cfg.epochs:
            trains = self.step_in_epoch < self.steps_per_epoch  # False: resumed with its evaluation pending
            train = self.train_epoch()
            if train is None:
                break
            if trains:
                self._save_before_evaluation()
            self.log.info(
                f"evaluating epoch {self.epoch + 1} of {cfg.epochs} (its training is in checkpoint "
                f"{self.final_checkpoint()})"
            )
            evaluated = self.evaluate(self.model)
            if evaluated is None:
                self._interrupt()
                break
            val, val_bad, val_bad_files = evaluated
            if val_bad:
                val_bad_files = self._gather_bad(val_bad_files)
                self._check_val_bad(val_bad, val_bad_files)
            row = {
                "lr": self.optimizer.param_groups[0]["lr"],
                **train,
                **{f"val_{k}": v for k, v in val.items()},
                "val_bad_files": val_bad + self.val_left_out,
            }
            score, stop_value = val[metric], val[stop_metric]
            if self.ema is not None:  # the better of the raw and the EMA weights counts
                evaluated = self.evaluate(self.ema.module)
                if evaluated is None:
                    self._interrupt()
                    break
                ema_val = evaluated[0]
                row.update({f"ema_val_{k}": v for k, v in ema_val.items()})
                if better(ema_val[metric], score, self.best_direction):
                    score = ema_val[metric]
                if better(ema_val[stop_metric], stop_value, self.stop_direction):
                    stop_value = ema_val[stop_metric]
            row.update(self.task.epoch_fields(self.epoch))
            is_best = better(score, self.best, self.best_direction)
            if is_best:
                self.best = score
            self.epoch += 1
            self.step_in_epoch = 0
            self.history.append({"epoch": self.epoch, **row})
            self.log.epoch(self.epoch, self.global_step, row)
            self.save_checkpoint(is_best=is_best)
            last = row
            if self._control()[0]:
                self._interrupt()
                break
            if cfg.target_value is not None and reached(stop_value, cfg.target_value, self.stop_direction):
                self.log.info(
                    f"target reached: val {stop_metric}={stop_value:.2f} "
                    f"{'>=' if self.stop_direction == 'max' else '<='} {cfg.target_value} after epoch "
                    f"{self.epoch}; stopping"
                )
                break
        return last

    def _save_before_evaluation(self) -> None:
        """Make the epoch's training durable before it is evaluated (collective): a checkpoint at its last
        step (``step_in_epoch == steps_per_epoch``, named ``ckpt-<step>-m``, with every rank's epoch statistics),
        which a resumed run evaluates without training again. Blocks until rank 0's write is durable, so a stop
        or a SIGKILL during the evaluation loses no training; the epoch-end checkpoint written after the
        evaluation supersedes it and the writer's pruning deletes it. Raises CheckpointError (every rank) when
        the write failed."""
        self.save_checkpoint(epoch_stats=self._last_epoch_stats.state_dict() if self._last_epoch_stats else None)
        self._writer_check(wait=True)

    def _check_val_bad(self, n_bad: int, files: list) -> None:
        """After an epoch's evaluation: name the undecodable val files; above ``max_bad_fraction`` raise
        DataError naming the checkpoint of the epoch's training (written before the evaluation, evaluated
        again on resume)."""
        total = getattr(self.val_sampler, "n", None) or len(self.val_sampler.indices()) * self.info.world_size
        names = "; ".join(f"{b.path} ({b.error})" for b in files[:5]) + (" ..." if len(files) > 5 else "")
        if n_bad <= self.cfg.max_bad_fraction * total:
            self.log.info(f"data: {n_bad} val file(s) could not be decoded (left out of the metrics): {names}")
            return
        self._writer_check(wait=True)
        saved = self.final_checkpoint()
        raise DataError(
            f"val: {n_bad} of {total} files could not be decoded, more than max_bad_fraction="
            f"{self.cfg.max_bad_fraction} ({names}); the training of epoch {self.epoch + 1} is saved in "
            f"{saved}: fix or remove those files and run the same command again to evaluate it"
        )

    def close(self, status: Optional[str] = None) -> Optional[Path]:
        """Wait for the last checkpoint, close the metric sinks and draw the curves PNG (rank 0); returns
        the PNG's path. The tracked runs end with ``status`` (default: KILLED when the run was interrupted, else
        FINISHED; :func:`trainer.engine.run.run` passes FAILED for a non-finite loss)."""
        self.ckpt.wait()
        self.ckpt.close()
        self.ckpt.release_lock()
        shutdown_all()
        tags = {}
        if self.log.tracking is not None:
            final, best = self.final_checkpoint(), self.ckpt.pointer("best")
            if final is not None:  # absolute: a tag must name the folder from wherever it is read
                tags["checkpoint_final"] = str(Path(final).resolve())
            if best:
                tags["checkpoint_best"] = str((self.ckpt.dir / best).resolve())
        return self.log.close(tags, status=status or ("KILLED" if self.interrupted else "FINISHED"))
