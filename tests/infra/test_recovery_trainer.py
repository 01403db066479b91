"""EC2 job recovery with the trainer: a CPU job SIGTERMed as the spot notice would,
relaunched by the recovery controller's decision, ends bit-identical to an uninterrupted run.

The stacks are deployed into moto (in-process, as tests/infra/test_recovery.py does) and the job is launched
through the CLI. What an instance runs is read from the deployed launch template's user data: its
``train --config "$CONFIG" --checkpoint-dir /data/checkpoints/"$JOB" --log-dir /data/runs/"$JOB" $ARGS`` line,
expanded by bash with the instance's tags (``trainstack:config``, ``trainstack:job``, ``trainstack:args``) and
``NPROC``, with /data moved to a temporary folder standing in for the data volume. ``NPROC`` is 1 for g5.2xlarge,
so the image's ``train`` entrypoint (images/training/train, which ``docker run IMAGE train`` starts) runs one
rank, ``python -m trainer train`` with those flags, and passes its exit status on (0, 75 after SIGTERM with a
durable checkpoint; tests/sagemaker/test_entrypoint.py runs the entrypoint itself): this test runs that rank
directly, which saves the entrypoint's and torchrun's ~6 s per run on 2 vCPUs. The trainer helpers are those
of tests/engine/test_interruption.py.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_interruption import EXIT_INTERRUPTED, _assert_same_state, _cmd, _env, _final_state, _run_until

from infra import job_record as jr
from tests import forkserver, moto_env
from tests.infra.test_recovery import (
    RECLAIM,
    Clock,
    _controller,
    _job_instances,
    _launch,
    _live,
    _outputs,
    _record,
    _set_state_reason,
    state,
    warning,
)
from tests.infra_helpers import REPO

JOB = "digits-bx"
#: The trainer config inside the image (``launch --config``); the flags below override what differs.
CONFIG = "configs/digits.yaml"
#: ``launch --args``: test_interruption's run (ShuffleNetV2 x0.5, 32 px with progressive resizing, EMA,
#: MixUp/CutMix, 9 steps per epoch), 2 epochs, data on the volume. Checkpoint and log dirs come from the user data.
TRAIN_FLAGS = _cmd(Path("/data/digits"), Path("/unused"), 1, epochs=2)[4:]
for _flag in ("--checkpoint-dir", "--log-dir"):
    del TRAIN_FLAGS[TRAIN_FLAGS.index(_flag) : TRAIN_FLAGS.index(_flag) + 2]
ARGS = " ".join(TRAIN_FLAGS)
#: Mid-epoch 1 (steps 9-17, 32 px): the stop checkpoint holds EMA, optimizer, scheduler and loader position.
STOP_STEP = 12
#: The one rank the entrypoint starts when NPROC is 1.
TRAIN = [sys.executable, "-m", "trainer", "train"]


def _volume(root: Path, data: Path) -> Path:
    """A folder standing in for the data volume mounted at /data, with the dataset at /data/digits."""
    root.mkdir(parents=True)
    (root / "digits").symlink_to(data)
    return root


def _relocate(words: list[str], volume: Path) -> list[str]:
    """``words`` with the volume's mount point /data replaced by ``volume``."""
    return [f"{volume}{w[len('/data') :]}" if w.startswith("/data/") else w for w in words]


def _instance_command(user_data: str, tags: dict, volume: Path) -> list[str]:
    """The trainer command with which ``user_data`` (a launch template's) runs the job on an instance with
    ``tags``: its ``train ...`` line expanded by bash (``$ARGS`` unquoted, as trainstack-run has it), /data moved
    to ``volume``; the user data's ``NPROC`` must be 1 (one rank, see the module docstring)."""
    (line,) = re.findall(r"^\s*train (--config .*)$", user_data, re.M)
    (nproc,) = re.findall(r"^NPROC=(\d+)$", user_data, re.M)
    env = {"CONFIG": tags["trainstack:config"], "JOB": tags["trainstack:job"], "ARGS": tags["trainstack:args"]}
    words = subprocess.run(
        ["bash", "-c", f"set -f; printf '%s\\0' {line}"], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\0")[:-1]
    assert nproc == "1", nproc
    return [*TRAIN, *_relocate(words, volume)]


def _launched_command(aws, iid: str, volume: Path) -> list[str]:
    """:func:`_instance_command` for instance ``iid``: the user data of the launch template version it was run
    from (moto keeps the template id and version in the instance's ``aws:ec2launchtemplate:*`` tags)."""
    ec2 = aws.client("ec2")
    inst = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    version = ec2.describe_launch_template_versions(
        LaunchTemplateId=tags["aws:ec2launchtemplate:id"], Versions=[tags["aws:ec2launchtemplate:version"]]
    )["LaunchTemplateVersions"][0]
    user_data = base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()
    return _instance_command(user_data, tags, volume)


@pytest.fixture(scope="module")
def reference(tiny_digits, tmp_path_factory):
    """The uninterrupted run, started before the CDK synthesis of :func:`aws` (module scope: set up first) so
    the two overlap; yields (its volume, a function waiting for it and returning its final state)."""
    volume = _volume(tmp_path_factory.mktemp("reference") / "data", tiny_digits)
    argv = ["--config", CONFIG, "--checkpoint-dir", f"{volume}/checkpoints/{JOB}", "--log-dir", f"{volume}/runs/{JOB}"]
    cmd = [*TRAIN, *argv, *_relocate(TRAIN_FLAGS, volume)]
    p = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def final_state() -> dict:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, out[-3000:]
        return _final_state(volume / "checkpoints", JOB)

    yield volume, cmd, final_state
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture
def aws(tmp_path_factory, monkeypatch):
    with moto_env.deployed(moto_env.synthesize(tmp_path_factory.mktemp("cdk-recovery-trainer")), monkeypatch) as s:
        yield s


def test_spot_interrupted_job_relaunched_by_the_controller_ends_bit_identical(reference, aws, tmp_path, tiny_digits):
    ref_volume, ref_cmd, ref_state = reference
    first = _launch(aws, JOB, "--config", CONFIG, "--args", ARGS)
    ec2, s3, bucket = aws.client("ec2"), aws.client("s3"), _outputs(aws)["BucketName"]
    ec2.attach_volume(VolumeId=_outputs(aws)["DataVolumeId"], InstanceId=first, Device="/dev/sdf")  # user data
    # the instance's command is the reference's, but for the volume's mount point
    assert _launched_command(aws, first, ref_volume) == ref_cmd
    volume = _volume(tmp_path / "data", tiny_digits)
    cmd = _launched_command(aws, first, volume)
    ctl = _controller(aws, Clock())

    # the notice: EventBridge delivers the warning to the controller, the trainer gets SIGTERM (its IMDS poller,
    # or `docker stop` at shutdown) and exits 75 with a durable checkpoint; then EC2 reclaims the instance
    assert ctl.handle(warning(first)) == [f"{JOB}: {first} warned"]
    rc, log = _run_until(cmd, STOP_STEP, signal.SIGTERM)
    assert rc == EXIT_INTERRUPTED, log[-3000:]
    marker = json.loads((volume / "checkpoints" / JOB / "interrupted.json").read_text())
    assert marker["reason"] == "SIGTERM" and STOP_STEP <= marker["global_step"] < 18, marker
    ec2.terminate_instances(InstanceIds=[first])  # moto detaches the data volume, as EC2 does
    _set_state_reason(first, RECLAIM)  # EC2 took it back (moto records every termination as the user's)
    lines = ctl.handle(state(first, "shutting-down")) + ctl.handle(state(first, "terminated"))
    (second,) = _live(aws, JOB)
    assert lines[-1] == f"{JOB}: relaunched as {second} (g5.2xlarge, spot)", lines

    # the relaunched instance runs the same command on the same volume: it resumes and finishes
    again = _launched_command(aws, second, volume)
    assert again == cmd
    p = forkserver.run(again, cwd=REPO, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "the previous run was interrupted: SIGTERM" in p.stdout and "resuming from" in p.stdout
    _assert_same_state(ref_state(), _final_state(volume / "checkpoints", JOB))

    # trainstack-done's exit record, then the instance's shutdown: the job is done, nothing more is launched
    record = {"exit_code": p.returncode, "instance_id": second}
    s3.put_object(Bucket=bucket, Key=jr.EXIT_KEY.format(job=JOB, instance_id=second), Body=json.dumps(record))
    ec2.terminate_instances(InstanceIds=[second])
    assert ctl.handle(state(second, "terminated")) == [f"{JOB}: done (done (exit 0))"]
    r = _record(aws, JOB)
    assert r["state"] == jr.DONE and r["recoveries"] == 1 and len(_job_instances(aws, JOB)) == 2
    assert [a["ended_by"] for a in r["attempts"]] == ["spot interruption", "exit 0"]
