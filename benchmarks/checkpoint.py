"""Checkpoint costs (CPU, or ``--device cuda``): SIGTERM-to-durable time and the training stall of a periodic
checkpoint, for the writer process on shared memory, the writer thread on reused host buffers, and the writer
thread with a fresh host copy per checkpoint (the earlier staging), measured side by side in alternating rounds. The
last line is ``stall_steps=X``: the full cost of one periodic checkpoint (epoch time with periodic checkpoints minus
without, per checkpoint) in steps, for the first of ``--variants`` (default: the writer process).

ResNet-50 + SGD momentum + EMA: ~25.6 M parameters x 3 copies (weights, momentum, EMA) ~ 300 MB of state.
The trainer's real ``fit`` runs on in-memory batches of real photos (loader excluded, so step times are the
model's), single process.

* stall: per-step wall times with ``--checkpoint-every-steps K``; a step followed by a checkpoint pays the
  host snapshot (the background thread does serialisation, hashing, writing and fsync) and any CPU
  contention from that thread during the next steps. Reported: median step without a checkpoint, median of
  steps that took one, and of the steps right after (the first epoch of each trainer is a warm-up).
  Also the whole epoch with and without periodic checkpoints: (difference) / (number of checkpoints) is
  the full cost of one checkpoint including the background thread's competition for the CPU. The epoch goes
  on ``--steps`` mod ``--every`` steps after its last checkpoint (``--steps`` a multiple of ``--every`` is
  refused, exit 2): a run's checkpoint is followed by more steps, and ending the window on one would add its
  whole background write (serialisation, hashing, fsync) to the figure as if training had waited for it.
* SIGTERM-to-durable: a real SIGTERM to this process after ``--signal-after`` steps; the time from the
  signal handler setting the flag to the checkpoint being durable (includes finishing the current step).

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint.py --data ../shared/data/imagenette-subset
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time

import torch
from overhead import in_memory_batches, in_memory_parser, in_memory_trainer

from trainer.engine.interruption import SignalHandlers, StopFlag


def _trainer(args, batches, stop=None, **extra):
    return in_memory_trainer(
        args.data, args.model, args.size, args.batch, batches, stop, device=args.device, use_ema=True, **extra
    )


class _ClonePerCheckpoint:
    """The earlier staging, kept for comparison: a fresh host copy of every tensor at each checkpoint (allocation,
    page faults, and on a GPU a synchronous device-to-host copy)."""

    def stage(self, obj):
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
        if isinstance(obj, dict):
            return {k: self.stage(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.stage(v) for v in obj)
        return obj

    def ready(self):
        pass


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_stall(args, batches, writer: str = "process", staging=None) -> dict:
    """Per-step times of one epoch with a checkpoint every ``--every`` steps, and the epoch without any
    checkpoint (after a warm-up epoch of each); ``writer`` is the ``checkpoint_writer``; ``staging`` replaces
    the manager's StagingBuffers."""
    t = _trainer(args, batches, checkpoint_every_steps=args.every, checkpoint_writer=writer)
    if staging is not None:  # the earlier staging: a clone per checkpoint
        t.ckpt._staging = staging
    times, saved = [], []
    orig_save = t.save_checkpoint

    def timed_save(*a, **k):
        saved.append(len(times))
        return orig_save(*a, **k)

    orig_control = t._control
    last = [time.perf_counter()]

    def stamp():  # called once per optimizer step, before a possible checkpoint
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        return orig_control()

    t.train_epoch()  # warm-up: allocator, oneDNN/cuDNN, and the staging buffers of the first checkpoint
    t.ckpt.wait()
    t.step_in_epoch, t.epoch = 0, t.epoch + 1
    t.save_checkpoint, t._control = timed_save, stamp
    _sync(args.device)
    last[0] = start = time.perf_counter()
    t.train_epoch()
    t.ckpt.wait()
    _sync(args.device)
    total_with = time.perf_counter() - start
    with_save = [times[s] for s in saved if s < len(times)]
    after = [times[s + 1] for s in saved if s + 1 < len(times)]
    plain = [x for j, x in enumerate(times[1:], 1) if j not in saved and j - 1 not in saved]
    ck_size = sum(f.stat().st_size for d in t.ckpt.list() for f in d.iterdir())

    t0 = _trainer(args, batches, checkpoint_writer=writer)
    t0.train_epoch()  # warm-up of the allocator for the same shapes
    t0.step_in_epoch = 0
    _sync(args.device)
    start = time.perf_counter()
    t0.train_epoch()
    _sync(args.device)
    total_without = time.perf_counter() - start
    step = total_without / len(batches)
    cost = (total_with - total_without) / max(len(saved), 1)
    t.ckpt.close()
    t0.ckpt.close()
    return {
        "writer": t.ckpt.writer,
        "checkpoint_files_mb": round(ck_size / 2**20 / max(len(t.ckpt.list()), 1), 1),
        "step_s_mean_no_checkpoint": round(step, 4),
        "step_s_median_no_checkpoint": round(statistics.median(plain), 4),
        "step_s_median_with_checkpoint_snapshot": round(statistics.median(with_save), 4),
        "step_s_median_step_after_checkpoint": round(statistics.median(after), 4) if after else None,
        "epoch_s_with_periodic": round(total_with, 3),
        "epoch_s_without": round(total_without, 3),
        "checkpoints_in_epoch": len(saved),
        "cost_per_checkpoint_s": round(cost, 4),
        "stall_steps": round(cost / step, 2),
    }


def main() -> None:
    ap = in_memory_parser(__doc__, "resnet50", 64, 8, 24)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--signal-after", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of each variant (median reported)")
    ap.add_argument(
        "--variants",
        default="process,thread,clone_per_checkpoint",
        help="comma-separated: process (writer process on shared memory), thread (writer thread, reused "
        "buffers), clone_per_checkpoint (writer thread, a fresh host copy per checkpoint: the earlier staging); the "
        "first is the one of the stall_steps line and of SIGTERM-to-durable",
    )
    args = ap.parse_args()
    if args.every < 1 or args.steps % args.every == 0:
        ap.exit(
            2,
            f"error: --steps {args.steps} must not be a multiple of --every {args.every}: the measured epoch would "
            "end on a checkpoint and its time would hold that checkpoint's whole background write\n",
        )
    batches, _ = in_memory_batches(args.data, args.size, args.batch, args.steps)
    state_bytes = None

    # 1. stall of periodic checkpoints, the variants alternating round by round
    variants = {
        "process": lambda: measure_stall(args, batches, "process"),
        "thread": lambda: measure_stall(args, batches, "thread"),
        "clone_per_checkpoint": lambda: measure_stall(args, batches, "thread", _ClonePerCheckpoint()),
    }
    rounds = {k: [] for k in args.variants.split(",")}
    for _ in range(args.rounds):
        for k in rounds:
            rounds[k].append(variants[k]())
    stall = {
        k: {f: statistics.median(r[f] for r in v) if isinstance(v[0][f], (int, float)) else v[0][f] for f in v[0]}
        for k, v in rounds.items()
    }
    t = _trainer(args, batches)
    state_bytes = sum(v.numel() * v.element_size() for v in t.model.state_dict().values()) * 3

    # 2. SIGTERM-to-durable
    stop = StopFlag()
    handlers = SignalHandlers(stop)
    first = args.variants.split(",")[0]
    t2 = _trainer(args, batches, stop=stop, checkpoint_writer="thread" if first == "clone_per_checkpoint" else first)
    count = [0]
    orig2 = t2._control

    def ctl():
        count[0] += 1
        if count[0] == args.signal_after:
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return orig2()

    t2._control = ctl
    t2.train_epoch()
    handlers.restore()
    durable = t2.ckpt.last_durable[1] - stop.requested_at
    t2.ckpt.close()
    print(
        json.dumps(
            {
                "model": args.model,
                "device": args.device,
                "batch": args.batch,
                "size": args.size,
                "threads": torch.get_num_threads(),
                "state_mb_weights_momentum_ema": round(state_bytes / 2**20, 1),
                "every": args.every,
                "rounds": args.rounds,
                "stall": stall,
                "sigterm_to_durable_s": round(durable, 3),
                "interrupted": t2.interrupted,
            },
            indent=1,
        )
    )
    print(f"stall_steps={stall[first]['stall_steps']:.2f}")


if __name__ == "__main__":
    main()
