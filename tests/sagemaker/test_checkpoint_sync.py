"""A SageMaker managed-spot job interrupted while its newest checkpoint is still being uploaded to S3 resumes from
the previous one and ends bit-identical to an uninterrupted job (the stand-in for SageMaker's checkpoint sync:
tests/sagemaker/checkpoint_sync.py). With ``keep_last_checkpoints: 1`` the trainer deleted the previous
checkpoint the moment the newest was durable in the container, SageMaker deleted it in S3 too, and the next job
found no complete checkpoint: it started over from step 0."""

from __future__ import annotations

import re
import signal
import sys

import pytest
from checkpoint_sync import prefix_at_the_end, restore
from conftest import REPO
from test_entrypoint import TRAIN, _sm_job
from test_interruption import _assert_same_state, _final_state, _run_until

from tests import forkserver

pytestmark = pytest.mark.slow

#: 300 training scans at batch 32: 9 steps per epoch; a periodic checkpoint every 2 steps; EMA (compared too). Two
#: epochs, so that a SIGTERM that a loaded machine delivers late still stops the job before its end.
JOB = dict(epochs=2, checkpoint_every_steps=2, log_every_steps=1, use_ema=True, ema_decay=0.9)


def test_an_upload_cut_off_by_the_interruption_falls_back_to_the_previous_checkpoint(tmp_path, tiny_digits):
    ref_root, env = _sm_job(tmp_path / "reference", tiny_digits, **JOB)
    ref = forkserver.run([sys.executable, str(TRAIN)], cwd=REPO, env=env, timeout=600)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]

    # first attempt: SIGTERM (SageMaker stopping the container) after the step-4 checkpoint
    root, env = _sm_job(tmp_path / "attempt1", tiny_digits, **JOB)
    rc, log = _run_until([sys.executable, str(TRAIN)], 5, signal.SIGTERM, env=env)
    assert rc == 75, log[-3000:]
    local = root / "checkpoints"
    newest = (local / "latest").read_text().strip()
    older = sorted(p.name for p in local.glob("ckpt-*") if p.name != newest)
    assert older, f"the previous checkpoint was pruned in the container (and so in S3): {sorted(local.iterdir())}"
    # the reclaim cuts off the newest checkpoint's state.pt (its largest object, uploaded last); the rest is there
    prefix = tmp_path / "s3" / "bucket" / "checkpoints" / "job"
    prefix_at_the_end(local, prefix, in_flight=frozenset({f"{newest}/state.pt"}))

    # the restarted job: a new container whose checkpoint folder SageMaker fills from the prefix
    root2, env2 = _sm_job(tmp_path / "attempt2", tiny_digits, **JOB)
    restore(prefix, root2 / "checkpoints")
    res = forkserver.run([sys.executable, str(TRAIN)], cwd=REPO, env=env2, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"checkpoint: skipping {newest}: " in res.stdout and "missing" in res.stdout, res.stdout[-3000:]
    resumed = re.search(r"checkpoint: resuming from \S*/(ckpt-\d+(?:-m)?) ", res.stdout)
    assert resumed and resumed.group(1) == older[-1], res.stdout[-3000:]
    _assert_same_state(_final_state(ref_root, "checkpoints"), _final_state(root2, "checkpoints"))
