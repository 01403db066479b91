"""Loader workers start from a fork server, never by forking the (threaded) training process, and survive a
stop signal to the process group; the server is a fork of the training process taken while it is single-threaded,
or a fresh interpreter. Why: trainer/data/loading.py's ``worker_context`` and docs/benchmarks.md
(a rank's val worker deadlocked inside CPython 3.11's ``os.fork``)."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset

from trainer.data.loading import (
    build_loader,
    iterate,
    shutdown_all,
    start_worker_server,
    worker_context,
    worker_server_pid,
)

REPO = Path(__file__).resolve().parents[2]


def _loader(n: int = 12, workers: int = 2, persistent: bool = False):
    ds = TensorDataset(torch.arange(float(n)))
    return build_loader(
        ds,
        BatchSampler(SequentialSampler(ds), 4, drop_last=False),
        torch.utils.data.default_collate,
        num_workers=workers,
        prefetch_factor=2,
        pin_memory=False,
        persistent_workers=persistent,
    )


def test_workers_start_from_the_fork_server_and_preload_the_dataset_module():
    loader = _loader()
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    worker_context(loader.dataset, torch.utils.data.default_collate)
    preload = multiprocessing.forkserver._forkserver._preload_modules  # the one server of this process
    assert {"__main__", "torch", "torchvision", "trainer.data.loading", "torch.utils.data.dataset"} <= set(preload)
    assert "torch.utils.data._utils.collate" in preload
    assert _loader(workers=0).multiprocessing_context is None  # no workers, no server


def test_one_server_preloads_the_modules_of_every_loader_and_starts_early():
    """Training and validation datasets can live in different modules; the server imports both (a later
    loader's list does not replace an earlier one's), and ``start_worker_server`` starts it before any
    iteration so that its imports overlap the trainer's set-up."""
    from torchvision.datasets import FakeData

    worker_context(TensorDataset(torch.arange(2.0)))
    worker_context(FakeData(size=2))
    preload = multiprocessing.forkserver._forkserver._preload_modules
    assert {"torch.utils.data.dataset", "torchvision.datasets.fakedata"} <= set(preload)
    start_worker_server()
    pid = worker_server_pid()
    assert pid is not None and os.waitpid(pid, os.WNOHANG) == (0, 0)  # running, not exited
    start_worker_server()
    assert worker_server_pid() == pid  # one server per process


def test_iterating_a_loader_never_forks_this_process(monkeypatch):
    """With threads running, ``os.fork`` here could leave a worker deadlocked; the loader must not call it,
    for a fresh iterator each epoch (non-persistent) or a persistent one."""

    def no_fork():
        raise AssertionError("os.fork called by the loader")

    monkeypatch.setattr(os, "fork", no_fork)
    try:
        for persistent in (False, True):
            loader = _loader(persistent=persistent)
            for _ in range(2):
                got = torch.cat([b[0] for b in iterate(loader)])
                assert got.tolist() == [float(i) for i in range(12)]
    finally:
        shutdown_all()


_FORKED = textwrap.dedent(
    """
    import os, sys, threading, torch
    from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset
    from trainer.data.loading import build_loader, fork_worker_server, iterate, worker_server_note, worker_server_pid

    def main():
        if sys.argv[1] == "thread":  # another Python thread alive: no fork
            done = threading.Event()
            threading.Thread(target=done.wait).start()
        print("forked", fork_worker_server(), fork_worker_server())  # the second call: a server runs already
        ds = TensorDataset(torch.arange(12.0))
        for persistent in (False, True):
            loader = build_loader(ds, BatchSampler(SequentialSampler(ds), 4, drop_last=False),
                                  torch.utils.data.default_collate, num_workers=2, prefetch_factor=1,
                                  pin_memory=False, persistent_workers=persistent)
            for _ in range(2):
                print("batches", [b[0].tolist() for b in iterate(loader)])
        pid = worker_server_pid()
        stat = open(f"/proc/{pid}/stat").read()
        print("parent is me", int(stat[stat.rindex(")") + 1:].split()[1]) == os.getpid())
        print("same program", open(f"/proc/{pid}/cmdline").read() == open("/proc/self/cmdline").read())
        masks = dict(l.split(":\t") for l in open(f"/proc/{pid}/status").read().splitlines() if l.startswith("Sig"))
        stop = (1 << 1) | (1 << 14)  # SIGINT (2), SIGTERM (15)
        print("stop signals blocked and ignored", all(int(masks[k], 16) & stop == stop for k in ("SigBlk", "SigIgn")))
        print(worker_server_note(2))
        if sys.argv[1] == "thread":
            done.set()

    if __name__ == "__main__":
        main()
    """
)


def test_a_single_threaded_process_forks_its_worker_server_and_a_threaded_one_starts_a_fresh_one(tmp_path):
    """``fork_worker_server`` (``python -m trainer train`` calls it at its start): the server is a fork of the
    process (its child, the same program), ignores and blocks the stop signals, and serves persistent and
    non-persistent loaders; with another thread alive it declines and the first loader starts a fresh
    interpreter instead, with the same signal set-up."""
    script = tmp_path / "forked.py"
    script.write_text(_FORKED)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    batches = "batches [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]"
    for mode, forked, how in (("alone", "True False", "a fork of this process"), ("thread", "False False", "a fresh")):
        p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        lines = p.stdout.splitlines()
        assert lines[0] == f"forked {forked}" and lines[1:5] == [batches] * 4, p.stdout
        assert "parent is me True" in lines and "stop signals blocked and ignored True" in lines, p.stdout
        assert f"same program {mode == 'alone'}" in lines, p.stdout
        assert lines[-1].startswith(f"loader: 2 worker(s) per loader, started from a fork server: {how}"), p.stdout


_SIGNALLED = textwrap.dedent(
    """
    import signal, sys, time, torch
    from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset
    from trainer.data.loading import build_loader, fork_worker_server, iterate

    def main():
        if sys.argv[1] == "forked":
            assert fork_worker_server()
        signal.signal(signal.SIGTERM, lambda *a: print("trainer got SIGTERM", flush=True))
        ds = TensorDataset(torch.arange(16.0))
        loader = build_loader(ds, BatchSampler(SequentialSampler(ds), 4, drop_last=False),
                              torch.utils.data.default_collate, num_workers=2, prefetch_factor=1,
                              pin_memory=False, persistent_workers=True)
        it = iterate(loader)
        print("first", next(it)[0].tolist(), flush=True)
        sys.stdin.readline()  # the test signals the process group, waits past the workers' 5 s watchdog
        rest = [b[0].tolist() for b in it] + [b[0].tolist() for b in iterate(loader)]
        print("rest", rest, flush=True)

    if __name__ == "__main__":
        main()
    """
)


def test_a_stop_signal_to_the_process_group_leaves_the_workers_and_their_server_running(tmp_path):
    """systemd / ``docker stop`` signal the whole group: the workers and the fork server they watch must keep
    serving batches until the trainer has written its stop checkpoint (the trainer decides when to stop). Both
    kinds of server, side by side: a fork of the trainer (``fork_worker_server``) and a fresh interpreter."""
    script = tmp_path / "signalled.py"
    script.write_text(_SIGNALLED)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = {
        server: subprocess.Popen(
            [sys.executable, str(script), server],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for server in ("forked", "fresh")
    }
    results = {}
    try:
        for p in procs.values():
            assert p.stdout.readline().strip() == "first [0.0, 1.0, 2.0, 3.0]"
        for p in procs.values():
            os.killpg(p.pid, signal.SIGTERM)
        time.sleep(7)  # torch's worker watchdog checks its parent every 5 s
        for server, p in procs.items():
            results[server] = p.communicate("go\n", timeout=120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    rest = [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]
    for server, (out, err) in results.items():
        assert procs[server].returncode == 0, (server, err[-3000:])
        assert "trainer got SIGTERM" in out, server
        assert f"rest {rest + [[0.0, 1.0, 2.0, 3.0]] + rest}" in out, (server, out + err[-3000:])
