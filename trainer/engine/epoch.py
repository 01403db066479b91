"""One epoch's passes over the data, the part of :class:`~trainer.engine.trainer.Trainer` that runs between
checkpoints: the training pass (:meth:`EpochMixin.train_epoch`), the evaluation pass (:meth:`EpochMixin.evaluate`),
and the collective checks they share (stop agreement and periodic checkpoints, the background writer's health,
non-finite loss and undecodable files, the stop checkpoint of an interrupted run).

One optimizer step = ``accumulate_grad_batches`` micro-batches per rank; DDP gradient all-reduce happens
only on the last micro-batch (``no_sync`` on the others). All per-step statistics stay on the device and are
read back (one synchronisation) only every ``log_every_steps`` steps and at the end of the epoch; the running
statistics of an unfinished epoch (:class:`_EpochStats`) go into mid-epoch checkpoints.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as tdist

from trainer.data.loading import iterate
from trainer.data.samples import BadSample
from trainer.engine import distributed as dist
from trainer.engine.checkpoint import CheckpointError
from trainer.errors import DataError, NonFiniteLossError

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


class EpochMixin:
    """Trainer methods that run one epoch's training or evaluation pass and the collective checks between steps.
    Expects the attributes :class:`~trainer.engine.trainer.Trainer` sets in ``__init__`` (cfg, info, device, task,
    log, ckpt, stop, step, optimizer, scheduler, train/val loaders and orders, evaluator, precision, micro, accum,
    steps_per_epoch, eval_batch, progress counters, ``_ctrl_group``, ``_last_save``) and its ``save_checkpoint``
    and ``final_checkpoint``. Raises as each method says (CheckpointError, DataError, NonFiniteLossError)."""

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
