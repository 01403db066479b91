"""The task-agnostic training loop: DDP, precision, accumulation, clipping, EMA, schedule, evaluation,
checkpoints, early stop. Tasks (trainer/tasks) supply data, model, loss and metrics.

One optimizer step = ``accumulate_grad_batches`` micro-batches per rank; DDP gradient all-reduce happens
only on the last micro-batch (``no_sync`` on the others). All per-step statistics stay on the device and are
read back (one synchronisation) only every ``log_every_steps`` steps and at the end of the epoch.

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
from trainer.data.loading import build_split_loaders, iterate, shutdown_all
from trainer.data.samples import BadSample
from trainer.engine import distributed as dist
from trainer.engine.checkpoint import CheckpointError, CheckpointManager, restore_rng
from trainer.engine.evaluation import better, reached
from trainer.engine.interruption import StopFlag
from trainer.engine.logging import MetricsLogger
from trainer.engine.optim import build_scheduler, linear_scaling_warning
from trainer.engine.resume import ResumeMixin
from trainer.engine.step import build_train_step
from trainer.errors import DataError, NonFiniteLossError
from trainer.tasks import build_task

_NONE = 2**62  # "no non-finite loss seen" marker for the MIN all-reduce


class _EpochStats:
    """Running training statistics of the current epoch (device tensors + host counters), checkpointed
    mid-epoch so a resumed epoch reports the same totals as an uninterrupted one."""

    def __init__(self, device: torch.device, saved: Optional[dict] = None):
        saved = saved or {}
        f64 = dict(dtype=torch.float64, device=device)
        self.loss_sum = torch.tensor(saved.get("loss_sum", 0.0), **f64)
        self.count = torch.tensor(saved.get("count", 0.0), **f64)
        self.extra = torch.tensor(saved["extra"], **f64) if saved.get("extra") is not None else None
        self.terms = {k: torch.tensor(v, **f64) for k, v in (saved.get("terms") or {}).items()}
        self.images = int(saved.get("images", 0))
        self.data_wait = float(saved.get("data_wait", 0.0))
        self.elapsed = float(saved.get("elapsed", 0.0))
        self.bad = [BadSample(p, e) for p, e in saved.get("bad", [])]

    def state_dict(self) -> dict:
        return {
            "loss_sum": self.loss_sum.item(),
            "count": self.count.item(),
            "extra": self.extra.tolist() if self.extra is not None else None,
            "images": self.images,
            "terms": {k: v.item() for k, v in self.terms.items()},
            "data_wait": self.data_wait,
            "elapsed": self.elapsed,
            "bad": [[b.path, b.error] for b in self.bad],
        }


class Trainer(ResumeMixin):
    """Builds everything from a validated :class:`TrainConfig` and runs :meth:`fit`.

    Raises (before any training step): ``ConfigError`` (bad value, e.g. a global batch that does not split
    over ranks: checked before the data is read), ``DataError`` (unusable data), ``CheckpointError``
    (checkpoint folder not writable; resume target invalid, of another label space or model, or config
    changed without ``force_resume``).
    """

    def __init__(self, cfg: TrainConfig, info: dist.DistInfo, stop: Optional[StopFlag] = None):
        self.cfg, self.info, self.device = cfg, info, info.device
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
        for line in data.report:
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
        :func:`~trainer.engine.tracking.resolve_mlflow_uri` (``tracking_uri``, ``MLFLOW_TRACKING_URI``, the resumed
        checkpoint's, else ``<log_dir>/mlruns``); the resolved URI goes into every checkpoint (``tracking_uri``)."""
        cfg = self.cfg
        if not (cfg.tracking and self.info.is_main):
            return
        from trainer.engine.tracking import build_trackers, system_facts

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

    # .. evaluation ..........................................................................................
    def _batches_on_every_rank(self) -> int:
        """Val batches that every rank runs this evaluation: the minimum over ranks of ``len(val order) //
        eval batch`` (one MIN all-reduce on the control group). The val order is not padded, so ranks may
        differ by one batch; a collective stop check after this many batches would deadlock."""
        n = torch.tensor([len(self.val_sampler) // self.eval_batch], dtype=torch.int64)
        if self.info.distributed:
            tdist.all_reduce(n, op=tdist.ReduceOp.MIN, group=self._ctrl_group)
        return int(n.item())

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> Optional[tuple[dict, int, list]]:
        """Metrics of ``model`` on the whole validation split (the task's evaluator, synchronised over ranks),
        its bad-file count (all ranks) and this rank's undecodable files (:class:`BadSample` list).

        Collective. Before each of the first :meth:`_batches_on_every_rank` batches all ranks agree on the stop
        flag (:meth:`_control`); when any rank was asked to stop, every rank returns None at the same batch,
        without computing the metrics (the caller has made the epoch's training durable beforehand)."""
        was_training = model.training
        model.eval()
        bad, bad_files = 0, []
        self.evaluator.reset()
        self.val_sampler.set_epoch(self.epoch)
        checked = self._batches_on_every_rank()
        for i, batch in enumerate(iterate(self.val_loader, before_fork=self.ckpt.join)):
            if i < checked and self._control()[0]:
                model.train(was_training)
                return None
            bad += len(batch["bad"])
            bad_files += batch["bad"]
            b = self.task.eval_batch(batch)
            if b["n"] == 0:
                continue
            with self.precision.autocast(self.device):
                out = self.task.predict(model, b)
            self.evaluator.update(out, b)
        metrics = self.evaluator.compute()
        n_bad = torch.tensor([float(bad)], dtype=torch.float64, device=self.device)
        dist.all_reduce_sum(n_bad)
        model.train(was_training)
        return metrics, int(n_bad.item()), bad_files

    # .. training ............................................................................................
    def _sync_checks(self, first_bad: torch.Tensor, bad_paths: list, where: str) -> None:
        """Collective health check (all ranks call it at the same step, all raise together).

        Raises NonFiniteLossError when any rank saw a NaN/inf loss (naming the first such global step) and
        DataError when the epoch's undecodable files already exceed ``max_bad_fraction``.
        """
        t = first_bad.clone()
        n_bad = torch.tensor([float(len(bad_paths))], dtype=torch.float64, device=self.device)
        if self.info.distributed:
            tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
            tdist.all_reduce(n_bad)
        step, n_bad = int(t.item()), int(n_bad.item())
        if step != _NONE:
            good = self.final_checkpoint()
            raise NonFiniteLossError(
                f"loss became NaN/inf at global step {step} (epoch {self.epoch + 1}); stopping without saving. "
                f"Last good checkpoint: {good if good else 'none yet'}. Lower lr, add "
                f"warmup_epochs or gradient_clip, or try precision=32."
            )
        epoch_total = self.steps_per_epoch * self.accum * self.micro * self.info.world_size
        if n_bad > self.cfg.max_bad_fraction * epoch_total:
            examples = "; ".join(f"{b.path} ({b.error})" for b in bad_paths[:3])
            raise DataError(
                f"{where}: {n_bad} file(s) could not be decoded, more than max_bad_fraction="
                f"{self.cfg.max_bad_fraction} of the {epoch_total} files of an epoch; e.g. {examples}"
            )

    def _control(self) -> tuple[bool, bool]:
        """At an optimizer-step boundary (and before each evaluation batch that every rank runs, where only
        the stop answer is used): do all ranks agree to stop, and is a periodic checkpoint due?

        One all-reduce (MAX) of three CPU ints on a gloo group (never the GPU stream): [stop requested on any
        rank, periodic checkpoint due, rank 0's background checkpoint write failed], read back with one
        ``tolist``; a single process decides on the Python values and makes no tensor at all. Step-based
        periodicity is the same on every rank; time-based is decided by rank 0's clock. Raises CheckpointError on
        every rank when the write failed (so a full disk stops training at the next step, not at the next
        checkpoint).
        """
        cfg = self.cfg
        due = bool(cfg.checkpoint_every_steps and self.global_step % cfg.checkpoint_every_steps == 0)
        if cfg.checkpoint_every_minutes and self.info.is_main:
            due |= time.monotonic() - self._last_save >= cfg.checkpoint_every_minutes * 60.0
        flags = [int(self.stop.requested), int(due), int(self.ckpt.failed)]
        if self.info.distributed:
            shared = torch.tensor(flags, dtype=torch.int32)
            tdist.all_reduce(shared, op=tdist.ReduceOp.MAX, group=self._ctrl_group)
            flags = shared.tolist()
        if flags[2]:
            self._raise_writer_failure()
        return bool(flags[0]), bool(flags[1])

    def _writer_check(self, wait: bool) -> None:
        """Collective: raise CheckpointError on every rank if rank 0's checkpoint write failed (``wait``:
        first let a write in progress finish)."""
        if self.info.is_main and wait:
            self.ckpt.join()
        failed = torch.tensor([int(self.ckpt.failed)], dtype=torch.int32)
        if self.info.distributed:
            tdist.all_reduce(failed, op=tdist.ReduceOp.MAX, group=self._ctrl_group)
        if failed[0]:
            self._raise_writer_failure()

    def _raise_writer_failure(self) -> None:
        if self.info.is_main:
            self.ckpt.wait()  # raises the writer's CheckpointError (path + OS error)
        raise CheckpointError(f"{self.ckpt.dir}: the checkpoint write on rank 0 failed (rank 0 names the error)")

    def _save_mid_epoch(self, stats: _EpochStats, first_bad: torch.Tensor) -> None:
        self._sync_checks(first_bad, stats.bad, f"train epoch {self.epoch + 1}")
        self.save_checkpoint(epoch_stats=stats.state_dict())

    def _interrupt(self) -> None:
        """Wait until the stop checkpoint is durable, record why, and mark the run interrupted."""
        self._writer_check(wait=True)
        path = self.ckpt.wait() if self.info.is_main else None
        reason = self.stop.reason or "stop requested by another rank"
        self.interrupted = reason
        if self.info.is_main:
            took = ""
            if self.stop.requested_at is not None and self.ckpt.last_durable is not None:
                delay = self.ckpt.last_durable[1] - self.stop.requested_at
                took = (
                    f", durable {delay:.2f} s after the request"
                    if delay >= 0
                    else f", durable {-delay:.2f} s before the request"
                )
            if self.step_in_epoch >= self.steps_per_epoch:
                where = (
                    f"epoch {self.epoch + 1} of {self.cfg.epochs} trained, its evaluation not finished; "
                    f"the resumed run evaluates it without training it again"
                )
            elif self.step_in_epoch:
                where = (
                    f"in epoch {self.epoch + 1} of {self.cfg.epochs}, after step {self.step_in_epoch} of "
                    f"{self.steps_per_epoch}"
                )
            else:
                where = f"after epoch {self.epoch} of {self.cfg.epochs}"
            self.ckpt.mark_interrupted(reason, path, self.global_step)
            self.log.info(
                f"interrupted: {reason}; stopped at global step {self.global_step} ({where}); "
                f"checkpoint {path}{took}. Run the same command to resume."
            )

    def train_epoch(self) -> Optional[dict]:
        """Run the optimizer steps of ``self.epoch`` from ``self.step_in_epoch``; return train metrics, or
        None when the run was interrupted (a durable checkpoint exists, ``self.interrupted`` says why)."""
        cfg, task, dev = self.cfg, self.task, self.device
        self.sampler.set_epoch(self.epoch, start=self.step_in_epoch * self.accum * self.micro)
        self.train_model.train()
        st = _EpochStats(dev, self._resumed_epoch_stats)
        self._resumed_epoch_stats = None
        first_bad = torch.full((), _NONE, dtype=torch.int64, device=dev)
        step_dev = torch.full((), self.global_step, dtype=torch.int64, device=dev)
        # resumed after the epoch's last step (its evaluation pending): no loader workers for zero batches
        it = (
            iterate(self.train_loader, before_fork=self.ckpt.join)
            if self.step_in_epoch < self.steps_per_epoch
            else None
        )
        t0, images0 = time.perf_counter(), st.images
        window_loss = torch.zeros((), dtype=torch.float64, device=dev)
        window_n = torch.zeros((), dtype=torch.float64, device=dev)
        self.log.start_epoch(self.epoch + 1, self.steps_per_epoch, initial=self.step_in_epoch)
        while self.step_in_epoch < self.steps_per_epoch:
            for micro_i in range(self.accum):
                tw = time.perf_counter()
                batch = next(it)
                st.data_wait += time.perf_counter() - tw
                st.bad += batch["bad"]
                b = task.train_batch(batch)
                n = b["n"]
                st.images += n
                out = self.step.micro_step(b, sync=micro_i == self.accum - 1)
                ld = out.loss.detach()
                first_bad = torch.where((first_bad == _NONE) & ~torch.isfinite(ld), step_dev, first_bad)
                weighted = ld.double() * n
                st.loss_sum += weighted
                st.count += n
                window_loss += weighted
                window_n += n
                for k, v in out.terms.items():
                    v = v.detach().double() * n
                    st.terms[k] = st.terms[k] + v if k in st.terms else v
                s = task.train_statistics(out, b)
                if s is not None:
                    st.extra = s if st.extra is None else st.extra + s
            self.step.optimizer_step()
            self.scheduler.step()
            self.step_in_epoch += 1
            self.global_step += 1
            step_dev += 1
            log_now = self.global_step % cfg.log_every_steps == 0
            if log_now:
                self._sync_checks(first_bad, st.bad, f"train epoch {self.epoch + 1}")
            self.log.step(
                self.global_step,
                self._step_values(window_loss, window_n, t0, st.images - images0) if log_now else {},
                cfg.log_every_steps,
                last_of_epoch=self.step_in_epoch == self.steps_per_epoch,
            )
            if log_now:
                window_loss.zero_()
                window_n.zero_()
            stop, due = self._control()
            if stop or due:
                st.elapsed += time.perf_counter() - t0
                t0, images0 = time.perf_counter(), st.images
                self._save_mid_epoch(st, first_bad)
                if stop:
                    self.log.end_epoch()
                    self._interrupt()
                    return None
        self.log.end_epoch()
        self._sync_checks(first_bad, st.bad, f"train epoch {self.epoch + 1}")
        st.elapsed += time.perf_counter() - t0  # saved in the pre-evaluation checkpoint
        self._last_epoch_stats = st
        elapsed = st.elapsed
        totals = torch.stack([st.loss_sum, st.count, torch.tensor(float(st.images), dtype=torch.float64, device=dev)])
        dist.all_reduce_sum(totals)
        all_bad = list({b.path: b for b in self._gather_bad(st.bad)}.values())  # padding repeats a few
        out = {"train_loss": totals[0].item() / max(totals[1].item(), 1.0), "bad_files": len(all_bad)}
        for k, v in sorted(st.terms.items()):
            v = v.clone()
            dist.all_reduce_sum(v)
            out[f"train_{k}"] = v.item() / max(totals[1].item(), 1.0)
        if st.extra is not None:
            dist.all_reduce_sum(st.extra)
            out.update({f"train_{k}": v for k, v in task.train_metrics(st.extra).items()})
        out["images_per_s"] = totals[2].item() / max(elapsed, 1e-9)
        out["epoch_time_s"] = elapsed
        out["data_wait_s"] = st.data_wait
        if all_bad:
            self.log.info(
                f"data: {len(all_bad)} file(s) skipped this epoch: "
                + "; ".join(f"{b.path} ({b.error})" for b in all_bad[:5])
                + (" ..." if len(all_bad) > 5 else "")
            )
        return out

    def _step_values(self, window_loss, window_n, t0, images) -> dict:
        return {
            "loss": window_loss.item() / max(window_n.item(), 1.0),
            "lr": self.optimizer.param_groups[0]["lr"],
            "images_per_s": images * self.info.world_size / max(time.perf_counter() - t0, 1e-9),
        }

    def _gather_bad(self, bad_paths: list) -> list:
        if not self.info.distributed:
            return bad_paths
        out = [None] * self.info.world_size
        tdist.all_gather_object(out, bad_paths)
        return [b for part in out for b in part]

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
