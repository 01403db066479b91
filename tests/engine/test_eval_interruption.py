"""Spot-safe evaluation: an epoch's training is durable before it is evaluated (``ckpt-<step>-m``,
evaluation pending), a stop request during the evaluation is agreed between evaluation batches (exit 75 within
seconds, not after the whole evaluation), a SIGKILL during it loses no training, the resumed run evaluates the
epoch without training it again and ends bit-identical to an uninterrupted run, and the pre-evaluation
checkpoint is deleted once the epoch-end one is durable.

"During the evaluation" is hit deterministically: the trainer prints ``evaluating epoch N of M`` after the
pre-evaluation checkpoint is durable and before the first evaluation batch; the tests signal at that line and
make the evaluation long enough through the config only (``eval_batch_size=1``: one batch per image).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from test_interruption import REPO, _assert_same_state, _cmd, _env, _final_state, _run_until

from tests import forkserver
from trainer.engine.checkpoint import CheckpointManager

EXIT_INTERRUPTED = 75
#: Seconds between SIGTERM and SIGKILL in these tests (EC2 spot and SageMaker give 120 s).
GRACE_S = 30
#: Two epochs of two steps (the loop's features of test_interruption's runs, fewer steps): training is the slow
#: part on 2 vCPUs; one image per evaluation batch makes the evaluation long enough to be signalled in (with
#: ResNet-18, not test_interruption's smaller model, whose evaluation would be a shorter window to signal in).
SHORT = dict(epochs=2, max_steps_per_epoch=2, batch_size=16, lr=0.01, eval_batch_size=1, model="resnet18")


def _odd_digits(tiny_digits, tmp_path_factory):
    """tiny_digits with 79 val images: 2 ranks get 40 and 39 (the val order is not padded), so with one image
    per evaluation batch rank 0 runs one batch more than rank 1."""
    root = tmp_path_factory.mktemp("odd_digits")
    shutil.copytree(tiny_digits, root, dirs_exist_ok=True)
    sorted((root / "val" / "9").iterdir())[-1].unlink()
    return root


def _steps_trained(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step=(\d+) ", log, re.M)]


def _epoch_rows(out) -> list[int]:
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r["epoch"] for r in rows if r["kind"] == "epoch"]


def _children(pid: int) -> set[int]:
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            kids.add(int(stat.parent.name))
    return kids


def _sigkill_tree_at(cmd: list[str], pattern: str, timeout: float = 300) -> tuple[int, str]:
    """Run ``cmd``; at the first output line matching ``pattern`` SIGKILL it and every descendant, as a lost
    instance does. (torchrun starts its ranks in sessions of their own, so ``killpg`` of torchrun's group
    would leave them running.) The tree is SIGSTOPped first (until no new process appears), so nothing forks
    or writes between the listing and the kill."""
    p = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, sent = [], False
    try:
        for line in p.stdout:
            lines.append(line)
            if not sent and re.search(pattern, line):
                stopped = {p.pid}
                os.kill(p.pid, signal.SIGSTOP)
                while new := set().union(*(_children(q) for q in stopped)) - stopped:
                    for q in new:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(q, signal.SIGSTOP)
                    stopped |= new
                for q in stopped:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(q, signal.SIGKILL)
                sent = True
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    assert sent, "the run ended before the pattern was printed:\n" + "".join(lines[-30:])
    return p.returncode, "".join(lines)


@pytest.fixture(scope="module")
def ddp_case(tiny_digits, tmp_path_factory):
    """2 ranks, 2 epochs x 2 steps, EMA (two evaluations per epoch), one image per evaluation batch; the
    uninterrupted run's final state and epoch rows."""
    data = _odd_digits(tiny_digits, tmp_path_factory)
    out = tmp_path_factory.mktemp("eval_reference")
    cmd = _cmd(data, out, 2, **SHORT)
    p = forkserver.run(cmd, cwd=REPO, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert not [d for d in (out / "ck").iterdir() if d.name.endswith("-m")]  # pre-eval ones pruned
    return data, _final_state(out), _epoch_rows(out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_then_sigkill_during_evaluation_ddp_classification(ddp_case, tmp_path):
    """One run of the same command, three processes: SIGTERM during epoch 1's evaluation (exit 75 within the
    grace, epoch 1 trained and durable); the resumed run evaluates epoch 1 without training it again, trains
    epoch 2 and is SIGKILLed during epoch 2's evaluation, with no SIGTERM at all (a lost instance), and loses no
    training; the third run only evaluates epoch 2 and ends bit-identical to the uninterrupted reference.
    (One chain instead of a separate single-process SIGKILL run with its own reference: that cost ~50 s more.)"""
    data, reference, reference_epochs = ddp_case
    out = tmp_path / "run"
    ck = out / "ck"
    cmd = _cmd(data, out, 2, **SHORT)

    # 1. SIGTERM during epoch 1's evaluation
    rc, log = _run_until(cmd, 0, signal.SIGTERM, pattern=r"^evaluating epoch 1 of 2", grace=GRACE_S)
    # torchrun itself answers SIGTERM with exit 1 (its SignalException); the ranks exit 75 within the grace
    assert rc != -signal.SIGKILL, log[-3000:]
    assert "interrupted: exit 75 (resume me): SIGTERM" in log, log[-3000:]
    assert "epoch 1 of 2 trained, its evaluation not finished" in log, log[-3000:]
    assert not re.search(r"^epoch=1 ", log, re.M)  # the evaluation did not run to its end
    assert (ck / "latest").read_text() == "ckpt-000000002-m"
    marker = json.loads((ck / "interrupted.json").read_text())
    assert marker["checkpoint"] == "ckpt-000000002-m" and marker["global_step"] == 2
    manifest = CheckpointManager.validate(ck / "ckpt-000000002-m")
    assert manifest["progress"] == {"epoch": 0, "step_in_epoch": 2, "global_step": 2}

    # 2. resumed: evaluates epoch 1 without training it, trains epoch 2; SIGKILL during epoch 2's evaluation
    rc, log = _sigkill_tree_at(cmd, r"^evaluating epoch 2 of 2")
    assert rc == -signal.SIGKILL, log[-3000:]
    assert "epoch 1 of 2 is trained (global step 2); evaluating it" in log, log[-3000:]
    assert min(_steps_trained(log)) == 3  # epoch 1 not trained again
    assert re.search(r"^epoch=1 ", log, re.M), log[-3000:]  # epoch 1's evaluation ran to its end
    assert (ck / "latest").read_text() == "ckpt-000000004-m"
    manifest = CheckpointManager.validate(ck / "ckpt-000000004-m")
    assert manifest["progress"] == {"epoch": 1, "step_in_epoch": 2, "global_step": 4}

    # 3. resumed: evaluates epoch 2 only; the end state is the uninterrupted run's
    p = forkserver.run(cmd, cwd=REPO, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "epoch 2 of 2 is trained (global step 4); evaluating it" in p.stdout
    assert _steps_trained(p.stdout) == []  # nothing trained again
    _assert_same_state(reference, _final_state(out))
    assert _epoch_rows(out) == reference_epochs == [1, 2]
    # the pre-evaluation checkpoints are superseded and deleted
    assert sorted(d.name for d in ck.iterdir() if d.name.startswith("ckpt-")) == [
        "ckpt-000000002",
        "ckpt-000000004",
    ]


@pytest.mark.slow
def test_sigterm_during_evaluation_detection(shared_data, tmp_path):
    """DINO (EMA, AdamW, a loader worker): SIGTERM during epoch 1's evaluation, exit 75; the same command
    evaluates epoch 1 without training it again and ends bit-identical to an uninterrupted run, val mAP too."""
    env = _env(OMP_NUM_THREADS="1")
    from test_detection_resume import _command

    ref = _command(shared_data, tmp_path, "reference", n_train=4, n_val=6, eval_batch_size=1)
    p = forkserver.run(ref, cwd=REPO, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    cmd = _command(shared_data, tmp_path, "interrupted", n_train=4, n_val=6, eval_batch_size=1)
    rc, log = _run_until(cmd, 0, signal.SIGTERM, env=env, pattern=r"^evaluating epoch 1 of 2", grace=GRACE_S)
    assert rc == EXIT_INTERRUPTED and "its evaluation not finished" in log, log[-3000:]
    assert (tmp_path / "interrupted" / "ck" / "latest").read_text() == "ckpt-000000002-m"
    p = forkserver.run(cmd, cwd=REPO, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "epoch 1 of 2 is trained (global step 2); evaluating it" in p.stdout
    assert min(_steps_trained(p.stdout)) == 3
    reference, resumed = _final_state(tmp_path / "reference"), _final_state(tmp_path / "interrupted")
    _assert_same_state(reference, resumed)
    assert [h["val_map"] for h in reference["history"]] == [h["val_map"] for h in resumed["history"]]


# --- which checkpoint auto-resume takes while the pre-evaluation one is superseded ----------------------------
def _save(mgr: CheckpointManager, epoch: int, step_in_epoch: int, global_step: int) -> None:
    progress = {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step}
    mgr.save({"w": torch.full((2,), float(global_step))}, progress, blocking=True)


def test_resume_choice_in_every_window(tmp_path):
    """Pre-evaluation only -> it; the epoch-end one renamed into place but ``latest`` not yet moved -> still the
    pre-evaluation one (the rerun evaluates the epoch again: same result); ``latest`` moved -> the epoch-end one;
    after pruning only the epoch-end one is left. Without a ``latest`` pointer the epoch-end one ranks first."""
    mgr = CheckpointManager(tmp_path / "ck")
    _save(mgr, 1, 0, 3)  # epoch 1's end
    _save(mgr, 1, 3, 6)  # epoch 2 trained, evaluation pending
    assert mgr.find_resume()[0].name == "ckpt-000000006-m"
    assert sorted(p.name for p in mgr.list()) == ["ckpt-000000003", "ckpt-000000006-m"]

    _save(mgr, 2, 0, 6)  # epoch 2 evaluated: the pre-evaluation checkpoint is pruned once this is durable
    assert [p.name for p in mgr.list()] == ["ckpt-000000006", "ckpt-000000003"]
    assert mgr.find_resume()[0].name == "ckpt-000000006"

    # the window between the epoch-end checkpoint's rename and the move of `latest`
    shutil.copytree(tmp_path / "ck" / "ckpt-000000006", tmp_path / "ck" / "ckpt-000000006-m")
    manifest = json.loads((tmp_path / "ck" / "ckpt-000000006-m" / "manifest.json").read_text())
    manifest["progress"] = {"epoch": 1, "step_in_epoch": 3, "global_step": 6}
    (tmp_path / "ck" / "ckpt-000000006-m" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "ck" / "latest").write_text("ckpt-000000006-m")
    assert mgr.find_resume()[0].name == "ckpt-000000006-m"
    (tmp_path / "ck" / "latest").write_text("ckpt-000000006")  # moved; the -m one not yet deleted
    assert mgr.find_resume()[0].name == "ckpt-000000006"
    (tmp_path / "ck" / "latest").unlink()
    assert [p.name for p in mgr.list()] == ["ckpt-000000006", "ckpt-000000006-m", "ckpt-000000003"]
    assert mgr.find_resume()[0].name == "ckpt-000000006"
