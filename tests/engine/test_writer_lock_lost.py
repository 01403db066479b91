"""The writer lock cannot be stepped around: a run whose lock file is deleted (and re-created by a second run)
notices at its next checkpoint and stops with exit 2 naming the newcomer, and never deletes a lock file that is
not its own. Before, deleting ``writer.lock`` let a second ``train`` in on the same folder (every metrics row twice)
and the first one's end deleted the second's lock file. A stale lock file of another user in a writable folder is
replaced (or named for what it is), where it used to give "cannot create the lock file ... choose a writable
folder"."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from test_bad_inputs_engine import _env, tiny_data
from test_writer_lock import _start

from trainer.engine.checkpoint import CheckpointManager
from trainer.engine.durable import LOCK_FILE, WriterLock
from trainer.errors import CheckpointError


def test_a_run_whose_lock_file_was_replaced_says_so_and_leaves_the_newcomers_file(tmp_path: Path):
    first = WriterLock(tmp_path)
    assert first.acquire() is None
    (tmp_path / LOCK_FILE).unlink()  # someone "clears a stale lock" by hand
    second = WriterLock(tmp_path)
    assert second.acquire() is None  # nothing can stop this: the first one's lock is on a file that has no name
    with pytest.raises(CheckpointError) as e:
        first.check()
    msg = str(e.value)
    assert f"lock file {tmp_path / LOCK_FILE} was replaced while this run held it" in msg and "\n" not in msg
    assert f"pid {os.getpid()} on host " in msg  # the newcomer, read from its file
    first.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()  # the newcomer's file survives
    second.check()
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_deleted_lock_file_is_noticed(tmp_path: Path):
    lock = WriterLock(tmp_path)
    lock.acquire()
    lock.check()
    (tmp_path / LOCK_FILE).unlink()
    with pytest.raises(CheckpointError, match="was deleted while this run held it"):
        lock.check()
    lock.release()


def test_the_checkpoint_writer_stops_before_writing_into_a_folder_another_run_locked(tmp_path: Path):
    mgr = CheckpointManager(tmp_path)
    progress = {"epoch": 0, "step_in_epoch": 1, "global_step": 1}
    mgr.save({"w": torch.zeros(2)}, progress, blocking=True)
    (tmp_path / LOCK_FILE).unlink()
    newcomer = WriterLock(tmp_path)
    newcomer.acquire()
    mgr.join()
    assert mgr.failed  # what every rank polls: all of them stop
    with pytest.raises(CheckpointError, match="was replaced while this run held it"):
        mgr.save({"w": torch.ones(2)}, {**progress, "step_in_epoch": 2, "global_step": 2})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == ["ckpt-000000001-m"]
    assert mgr.pointer("latest") == "ckpt-000000001-m"
    mgr.release_lock()
    assert (tmp_path / LOCK_FILE).exists()
    newcomer.release()


def _as_other_user(uid: int, fn):
    """``fn()`` with effective uid ``uid`` (root only; restored after)."""
    os.seteuid(uid)
    try:
        return fn()
    finally:
        os.seteuid(0)


def _stale_lock_of_another_user(root: Path) -> tuple[Path, int]:
    """A folder anyone may write, holding a lock file left by a gone run of another user (uid 4321, mode 0644)
    when running as root, else by this user (mode 0444): either way this process cannot open it for writing."""
    lock = root / LOCK_FILE
    lock.write_text(json.dumps({"pid": 999999, "host": "old-host", "started": "2026-01-01T00:00:00Z"}))
    if os.geteuid() == 0:
        os.chown(lock, 4321, 4321)
        root.chmod(0o777)
        return lock, 4321
    lock.chmod(0o444)
    return lock, os.geteuid()


def test_a_stale_lock_file_of_another_user_is_replaced(tmp_path: Path):
    root = Path(tempfile.mkdtemp(prefix="stale-lock-"))  # /tmp: reachable by another uid, unlike tmp_path
    try:
        lock_file, owner = _stale_lock_of_another_user(root)
        me = 65534 if os.geteuid() == 0 else os.geteuid()
        lock = WriterLock(root)

        def take():
            assert lock.acquire() is None
            st = lock_file.stat()
            record = json.loads(lock_file.read_text())
            lock.release()
            return st, record

        st, record = _as_other_user(me, take) if os.geteuid() == 0 else take()
        assert st.st_uid == me and record["pid"] == os.getpid()
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def test_a_stale_lock_file_of_another_user_that_cannot_be_replaced_is_named_for_what_it_is(tmp_path: Path):
    root = Path(tempfile.mkdtemp(prefix="stale-lock-"))
    try:
        lock_file, owner = _stale_lock_of_another_user(root)
        root.chmod(0o555)  # nobody but root may delete in it now
        if os.geteuid() != 0:
            pytest.skip("needs root: a folder this user cannot write would not hold a lock file of another user")
        with pytest.raises(CheckpointError) as e:
            _as_other_user(65534, WriterLock(root).acquire)
        msg = str(e.value)
        assert f"the lock file {lock_file} is held by uid {owner}, pid 999999 on host old-host" in msg, msg
        assert "stale: no process holds its lock, but it cannot be replaced (Permission denied" in msg, msg
        assert "choose a writable folder" not in msg
    finally:
        root.chmod(0o755)
        subprocess.run(["rm", "-rf", str(root)], check=False)


def test_a_stale_lock_file_still_held_by_a_run_of_another_user_is_refused_naming_it(tmp_path: Path):
    root = Path(tempfile.mkdtemp(prefix="stale-lock-"))
    held = None
    try:
        lock_file, _ = _stale_lock_of_another_user(root)
        held = os.open(lock_file, os.O_RDONLY)

        fcntl.flock(held, fcntl.LOCK_EX)  # the other user's run is alive
        me = 65534 if os.geteuid() == 0 else os.geteuid()
        with pytest.raises(CheckpointError, match="is being written by another run: pid 999999 on host old-host"):
            _as_other_user(me, WriterLock(root).acquire) if os.geteuid() == 0 else WriterLock(root).acquire()
        assert lock_file.exists()
    finally:
        if held is not None:
            os.close(held)
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_train_whose_lock_file_is_taken_over_stops_with_exit_2_and_leaves_the_newcomers_lock(tmp_path: Path):
    """Must show: delete ``writer.lock`` during a run and let a newcomer lock the folder: the run stops at its
    next checkpoint with exit 2 and one line naming the newcomer; the newcomer's lock file survives its end."""
    tiny_data(tmp_path / "data", train=40)
    extra = dict(model="shufflenet_v2_x0_5", epochs=1000, max_steps_per_epoch=5, checkpoint_every_steps=1)
    run, out = _start(tmp_path, _env(), "-m", "trainer", checkpoint_writer="thread", **extra)
    ck, newcomer = tmp_path / "ck", WriterLock(tmp_path / "ck")
    try:
        deadline = time.monotonic() + 300
        while not (ck / "latest").exists():
            assert run.poll() is None and time.monotonic() < deadline, "".join(out.lines[-30:])
            time.sleep(0.1)
        (ck / LOCK_FILE).unlink()
        assert newcomer.acquire() is None
        run.wait(300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    time.sleep(0.5)  # the reader thread's last lines
    errors = [line for line in out.lines if line.startswith("error:")]
    assert run.returncode == 2 and not any("Traceback" in line for line in out.lines), "".join(out.lines[-30:])
    assert len(errors) == 1 and "was replaced while this run held it" in errors[0], "".join(out.lines[-30:])
    assert f"pid {os.getpid()} on host " in errors[0]
    assert json.loads((ck / LOCK_FILE).read_text())["pid"] == os.getpid()
    newcomer.release()
