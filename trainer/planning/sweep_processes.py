"""The processes of ``python -m trainer sweep`` (:mod:`trainer.planning.sweep`): the cheap probe and the trials,
each a ``python -m trainer`` subprocess in its own session that dies with the sweep, and the stop signals that the
sweep turns into SIGTERM for them (module doc of :mod:`trainer.planning.sweep`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from trainer.config import FIELDS, ConfigError, flag_of
from trainer.errors import EXIT_INTERRUPTED, EXIT_OK


def train_flags(values: dict[str, Any]) -> list[str]:
    """``train`` flags for ``values`` (field -> value): ``--batch-size 64``; booleans ``--x`` / ``--no-x``."""
    out: list[str] = []
    for name, v in values.items():
        flag = flag_of(FIELDS[name])
        if isinstance(FIELDS[name].default, bool):
            out.append(flag if v in (True, "true", "True") else "--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out


def trial_dirs(out: Path, name: str) -> dict[str, Path]:
    """A trial's paths under ``out``: its folder, ``checkpoints/``, ``logs/``, ``train.log``, ``status.json``."""
    d = out / name
    return {
        "dir": d,
        "checkpoints": d / "checkpoints",
        "logs": d / "logs",
        "log": d / "train.log",
        "status": d / "status.json",
    }


class SweepInterrupted(Exception):
    """A stop signal came before any trial started (during the probe); the message is the one line to print.
    The sweep exits 75 (run the same command again)."""


def cheap_probe(config: str, overrides: dict, cfg, out_dir: Path) -> Path:
    """Probe the config once, cheaply, for the host RAM of one training process: ``python -m trainer probe``
    (a subprocess of this interpreter, output in ``out_dir/probe.log``) with ``--config config`` and
    ``overrides`` (``cfg`` is their validated config), at one batch (the per-process batch), one timed step, the
    config's own ``num_workers``/``prefetch_factor``, 2 loader batches (~10 s on 2 vCPUs). It measures the
    process's RSS high-water mark (``host_rss_hwm_bytes``, what the planner takes as one job's process RSS), the
    step's memory (GPU memory on CUDA) and the loader workers' memory. Reused when ``out_dir/probe.json`` exists.

    The probe runs in its own session (a terminal's Ctrl-C reaches only the sweep) and dies with the sweep
    (:func:`die_with_parent`). SIGTERM, SIGINT or SIGHUP to the sweep meanwhile stops it: SIGTERM to the probe
    (SIGKILL after 10 s), then :class:`SweepInterrupted`.

    Raises:
        ConfigError: the probe failed (names its log).
        SweepInterrupted: a stop signal came during the probe (the probe was stopped; nothing was trained).
    """
    path = out_dir / "probe.json"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    micro = str(max(1, cfg.batch_size // cfg.accumulate_grad_batches))
    argv = [sys.executable, "-m", "trainer", "probe", "--config", config, *train_flags(overrides)]
    argv += ["--out-dir", str(out_dir), "--start-batch", micro, "--max-batch", micro, "--steps", "1"]
    argv += ["--workers", str(cfg.num_workers), "--prefetch", str(cfg.prefetch_factor), "--loader-batches", "2"]
    with open(out_dir / "probe.log", "w") as fh:
        fh.write(f"$ {' '.join(argv)}\n")
        fh.flush()
        stop = _Stop()
        old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
        try:
            proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent()
            )
            while (rc := proc.poll()) is None and stop.signum is None:
                time.sleep(0.1)
            if stop.signum is not None:
                _stop_process(proc)
                raise SweepInterrupted(
                    f"sweep: {signal.Signals(stop.signum).name} during the probe: the probe (pid {proc.pid}) was "
                    f"stopped, nothing was trained; run the same command again (probe log {out_dir / 'probe.log'})"
                )
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if rc != 0 or not path.exists():
        raise ConfigError(
            f"sweep probe: exit {rc}, see {out_dir / 'probe.log'}; fix the base config or give --probe-report"
        )
    return path


def _stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to ``proc``; SIGKILL when it has not ended ``grace_s`` seconds later; waits for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


#: Signals that stop the sweep (forwarded to the trials as SIGTERM).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def die_with_parent() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child get SIGTERM when this process dies (Linux
    ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, kept across ``exec``: prctl(2)), and SIGTERM at once when this process
    died between the fork and the ``prctl`` (:func:`trainer.parent_death.die_with_parent`). None off Linux
    (nothing to arm). The sweep starts its children from its main thread, the thread the signal follows."""
    from trainer import parent_death

    if parent_death.load() is None:
        return None
    parent = os.getpid()
    return lambda: parent_death.die_with_parent(signal.SIGTERM, parent)


class _Stop:
    """Set by SIGTERM/SIGINT/SIGHUP: the sweep stops starting trials and forwards SIGTERM once to the running
    ones."""

    def __init__(self):
        self.signum: Optional[int] = None

    def __call__(self, signum, frame) -> None:
        self.signum = signum


def run_trials(todo: list[tuple[str, list[str]]], out: Path, k: int, gpus: int, log: Callable) -> tuple[bool, int]:
    """Run ``todo`` (trial name, train argv) ``k`` at a time; write each ``status.json``. Returns (whether a signal
    stopped the sweep: running trials were sent SIGTERM and waited for; how many trials were not started because
    another process holds their checkpoint folder's lock)."""
    from trainer.engine.durable import describe_holder, lock_holder

    threads = str(max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) // k))
    stop = _Stop()
    old = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    held = 0
    running: dict[int, tuple[str, subprocess.Popen, float, Any]] = {}  # slot -> (name, proc, start, log file)
    queue = list(todo)
    forwarded = False
    try:
        while queue or running:
            if stop.signum is not None and not forwarded:
                for name, proc, _, _ in running.values():
                    log(f"sweep: {name}: forwarding SIGTERM (checkpoint and exit 75)")
                    proc.send_signal(signal.SIGTERM)
                forwarded, queue = True, []
            while queue and len(running) < k and stop.signum is None:
                slot = next(s for s in range(k) if s not in running)
                name, argv = queue.pop(0)
                paths = trial_dirs(out, name)
                holder = lock_holder(paths["checkpoints"])
                if holder is not None:
                    held += 1
                    log(
                        f"sweep: {name}: not started: its checkpoint_dir {paths['checkpoints']} is being written by "
                        f"{describe_holder(holder)} (a trial of an earlier sweep?); run the same command again once "
                        "it has ended"
                    )
                    continue
                paths["dir"].mkdir(parents=True, exist_ok=True)
                env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
                if gpus > 1:
                    env["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
                fh = open(paths["log"], "a")
                fh.write(f"$ {' '.join(argv)}\n")
                fh.flush()
                env["TRAINSTACK_SWEEP_TRIAL"] = name  # the trial's tag in the trackers
                env["TRAINSTACK_SWEEP"] = str(out)
                proc = subprocess.Popen(
                    argv,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=die_with_parent(),
                )
                running[slot] = (name, proc, time.monotonic(), fh)
                log(f"sweep: {name}: started (slot {slot}, {threads} CPU thread(s)); log {paths['log']}")
            for slot, (name, proc, t0, fh) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                fh.close()
                del running[slot]
                paths = trial_dirs(out, name)
                prev = json.loads(paths["status"].read_text()) if paths["status"].exists() else {}
                # a trial stopped by the forwarded SIGTERM before its handler was installed dies of it (rc < 0)
                stopped = rc == EXIT_INTERRUPTED or (forwarded and rc < 0)
                state = "done" if rc == EXIT_OK else "interrupted" if stopped else "failed"
                wall = prev.get("wall_s", 0.0) + time.monotonic() - t0
                paths["status"].write_text(json.dumps({"status": state, "rc": rc, "wall_s": round(wall, 2)}) + "\n")
                log(f"sweep: {name}: {state} (exit {rc}, {wall:.1f} s)")
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return stop.signum is not None, held
