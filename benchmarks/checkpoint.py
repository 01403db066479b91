"""Checkpoint costs on CPU: SIGTERM-to-durable time and the training stall of a periodic checkpoint.

ResNet-50 + SGD momentum + EMA: ~25.6 M parameters x 3 copies (weights, momentum, EMA) ~ 300 MB of state.
The trainer's real ``fit`` runs on in-memory batches of real photos (loader excluded, so step times are the
model's), single process.

* stall: per-step wall times with ``--checkpoint-every-steps K``; a step followed by a checkpoint pays the
  host snapshot (the background thread does serialisation, hashing, writing and fsync) and any CPU
  contention from that thread during the next steps. Reported: median step without a checkpoint, median of
  steps that took one, and of the steps right after.
  Also the whole epoch with and without periodic checkpoints: (difference) / (number of checkpoints) is
  the full cost of one checkpoint including the background thread's competition for the CPU.
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
    return in_memory_trainer(args.data, args.model, args.size, args.batch, batches, stop, use_ema=True, **extra)


def main() -> None:
    ap = in_memory_parser(__doc__, "resnet50", 64, 8, 24)
    ap.add_argument("--every", type=int, default=6)
    ap.add_argument("--signal-after", type=int, default=4)
    args = ap.parse_args()
    batches, _ = in_memory_batches(args.data, args.size, args.batch, args.steps)

    # 1. stall of periodic checkpoints
    t = _trainer(args, batches, checkpoint_every_steps=args.every)
    state_bytes = sum(v.numel() * v.element_size() for v in t.model.state_dict().values()) * 3
    times, saved = [], []
    orig_save = t.save_checkpoint

    def timed_save(*a, **k):
        saved.append(len(times))
        return orig_save(*a, **k)

    t.save_checkpoint = timed_save
    orig_control = t._control
    last = [time.perf_counter()]

    def stamp():  # called once per optimizer step, before a possible checkpoint
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        return orig_control()

    t._control = stamp
    last[0] = time.perf_counter()
    t.train_epoch()
    t.ckpt.wait()
    # saved holds len(times) at each save, i.e. the index of the interval that contains the save:
    # times[s] = snapshot of step s-1's checkpoint + step s; times[s + 1] = the step after.
    with_save = [times[s] for s in saved if s < len(times)]
    after = [times[s + 1] for s in saved if s + 1 < len(times)]
    plain = [x for j, x in enumerate(times[1:], 1) if j not in saved and j - 1 not in saved]
    ck_size = sum(f.stat().st_size for d in t.ckpt.list() for f in d.iterdir())

    total_with = sum(times)
    t0 = _trainer(args, batches)
    t0.train_epoch()  # warm-up of the allocator for the same shapes
    start = time.perf_counter()
    t0.step_in_epoch = 0
    t0.train_epoch()
    total_without = time.perf_counter() - start

    # 2. SIGTERM-to-durable
    stop = StopFlag()
    handlers = SignalHandlers(stop)
    t2 = _trainer(args, batches, stop=stop)
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
    print(
        json.dumps(
            {
                "model": args.model,
                "batch": args.batch,
                "size": args.size,
                "threads": torch.get_num_threads(),
                "state_mb_weights_momentum_ema": round(state_bytes / 2**20, 1),
                "checkpoint_files_mb": round(ck_size / 2**20 / max(len(t.ckpt.list()), 1), 1),
                "step_s_median_no_checkpoint": round(statistics.median(plain), 3),
                "step_s_median_with_checkpoint_snapshot": round(statistics.median(with_save), 3),
                "step_s_median_step_after_checkpoint": round(statistics.median(after), 3) if after else None,
                "stall_s_median": round(statistics.median(with_save) - statistics.median(plain), 3),
                "epoch_s_with_periodic": round(total_with, 3),
                "epoch_s_without": round(total_without, 3),
                "checkpoints_in_epoch": len(saved),
                "cost_per_checkpoint_s": round((total_with - total_without) / max(len(saved), 1), 3),
                "sigterm_to_durable_s": round(durable, 3),
                "interrupted": t2.interrupted,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
