"""The launch templates' user data, run under bash: every absolute path it writes is moved into a temporary
root, and ``aws``, ``curl``, ``docker``, ``mount``, ``apt-get``, ``systemctl``, ``shutdown`` (and ``sleep``,
``blkid``, ``mkfs.ext4``, ``mountpoint``) are stubs on PATH that log their arguments and fail on demand.

Checked: a failure at each step shuts the instance down and deletes its idle alarm (the watchdog comes
first); a clean boot creates the alarm before any volume/FSx/agent step and deletes nothing; after the job
``trainstack-done`` writes the exit record the recovery controller reads, deletes the alarm and shuts down on
0/2/3, does nothing on 75 (systemd restarts the job);
``--keep`` instances are never shut down and their alarm only notifies; the user data's AWS calls are allowed by
the synthesized instance role; the systemd units pass ``systemd-analyze verify`` where it is installed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.config import from_context
from infra.constructs import user_data
from infra.stacks.monitoring import idle_alarm_name, instance_idle_alarm_command
from tests.infra_helpers import implied_permissions

IID = "i-0abc1234567890def"
VOL = "vol-0123456789abcdef0"
TOPIC = "arn:aws:sns:us-east-1:123456789012:trainstack-test-alarms"
ALARM = f"trainstack-test-gpu-idle-{IID}"
DIGEST = "sha256:" + "ab" * 32
REPO_URI = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack-test"
BUCKET = "trainstack-test-data-bucket"
JOB = "digits-1"
_RELOCATED = re.compile(r"(?<![\w.:-])/(var/log|etc|usr/local/bin|usr/bin/docker|dev/disk|data|fsx|opt/aws|tmp/cwa)")

STUB = r"""#!/bin/bash
name=$(basename "$0")
line="$name $*"
echo "$line" >> "$STUB_LOG"
if [ -n "${STUB_FAIL:-}" ] && [[ "$line" == "$STUB_FAIL"* ]]; then echo "stub: '$line' fails" >&2; exit 1; fi
case "$name" in
  curl)
    case "$*" in
      *api/token*) echo TOKEN ;;
      *meta-data/instance-id*) echo "$STUB_IID" ;;
      *placement/region*) echo us-east-1 ;;
      *instance-life-cycle*) echo spot ;;
      *tags/instance/trainstack:keep*) if [ -n "${STUB_KEEP:-}" ]; then echo "$STUB_KEEP"; else exit 22; fi ;;
      *tags/instance/trainstack:image-digest*) if [ -n "${STUB_DIGEST:-}" ]; then echo "$STUB_DIGEST"; else exit 22; fi ;;
      *tags/instance/trainstack:job*) if [ -n "${STUB_JOB:-}" ]; then echo "$STUB_JOB"; else exit 22; fi ;;
      *tags/instance/*) exit 22 ;;
    esac ;;
  aws)
    case "$*" in
      *describe-volumes*) if [ -e "$STUB_DIR/attached" ]; then echo "$STUB_IID"; else echo None; fi ;;
      *attach-volume*) touch "$STUB_DIR/attached"; [ -n "${STUB_NO_DEVICE:-}" ] || touch "$STUB_DEV" ;;
      *get-login-password*) echo password ;;
      "s3 cp - "*) cat > "$STUB_DIR/s3-object" ;;
    esac ;;
  docker) if [[ "$*" == *--password-stdin* ]]; then cat >/dev/null; fi ;;
  mountpoint) exit 1 ;;
  blkid) exit 2 ;;
esac
exit 0
"""
STUBS = (
    "curl",
    "aws",
    "docker",
    "mount",
    "mountpoint",
    "blkid",
    "mkfs.ext4",
    "apt-get",
    "systemctl",
    "shutdown",
    "sleep",
    "amazon-cloudwatch-agent-ctl",
)


def _script(fsx: bool = False) -> str:
    cfg = from_context({"env": "test"}.get)
    return user_data.render(
        user_data.UserDataParams(
            env="test",
            volume_id=VOL,
            repository_uri=REPO_URI,
            train_log_group="/trainstack/test/train",
            idle_alarm_command=instance_idle_alarm_command(cfg, TOPIC),
            idle_alarm_prefix=idle_alarm_name(cfg),
            nproc_per_node=8,
            efa=True,
            default_config="configs/x.yaml",
            default_image_tag=None,
            fsx_dns_name="fs-1.fsx.us-east-1.amazonaws.com" if fsx else None,
            fsx_mount_name="abcdef" if fsx else None,
            jobs_bucket=BUCKET,
        )
    )


class Boot:
    """One run of the relocated user data: ``rc``, ``calls`` (stub command lines), ``log`` (its own log)."""

    def __init__(self, tmp: Path, fsx: bool = False, **env: str) -> None:
        self.root = tmp / "root"
        self.bin = tmp / "bin"
        for d in (
            self.root / "etc",
            self.root / "var/log",
            self.bin,
            self.root / "opt/aws/amazon-cloudwatch-agent/bin",
            self.root / "dev/disk/by-id",
            self.root / "usr/bin",
            self.root / "usr/local/bin",
            self.root / "etc/systemd/system",
        ):
            d.mkdir(parents=True, exist_ok=True)
        (self.root / "etc/fstab").touch()
        for name in STUBS:
            (self.bin / name).write_text(STUB)
            (self.bin / name).chmod(0o755)
        for target in ("opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl", "usr/bin/docker"):
            (self.root / target).write_text(STUB)
            (self.root / target).chmod(0o755)
        self.script = tmp / "user-data.sh"
        self.script.write_text("#!/bin/bash\n" + self.relocate(_script(fsx)))
        self.stub_log = tmp / "calls.log"
        self.env = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "STUB_LOG": str(self.stub_log),
            "STUB_DIR": str(tmp),
            "STUB_IID": IID,
            "STUB_DIGEST": DIGEST,
            "STUB_JOB": JOB,
            "HOME": str(tmp),
            "STUB_DEV": str(self.root / f"dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_{VOL.replace('-', '')}"),
            **env,
        }

    def relocate(self, text: str) -> str:
        return _RELOCATED.sub(lambda m: f"{self.root}/{m.group(1)}", text)

    def run(self, *cmd: str, **env: str) -> Boot:
        self.stub_log.unlink(missing_ok=True)
        proc = subprocess.run(
            list(cmd) or ["bash", str(self.script)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**self.env, **env},
        )
        self.rc = proc.returncode
        self.out = proc.stdout + proc.stderr
        self.calls = self.stub_log.read_text().splitlines() if self.stub_log.exists() else []
        log = self.root / "var/log/trainstack-user-data.log"
        self.log = log.read_text() if log.exists() else ""
        return self

    def index(self, prefix: str) -> int:
        return next((i for i, c in enumerate(self.calls) if c.startswith(prefix)), -1)

    @property
    def shut_down(self) -> bool:
        return any(c.startswith("shutdown -h") for c in self.calls)

    @property
    def alarm_deleted(self) -> bool:
        return any(c.startswith("aws cloudwatch delete-alarms") and ALARM in c for c in self.calls)


def test_clean_boot_creates_the_alarm_first_and_starts_the_job(tmp_path):
    boot = Boot(tmp_path).run()
    assert boot.rc == 0, boot.log + boot.out
    put = boot.index("aws cloudwatch put-metric-alarm")
    assert put >= 0 and ALARM in boot.calls[put]
    # watchdog first: before the volume, the agent and the service
    for later in (
        "aws ec2 describe-volumes",
        "amazon-cloudwatch-agent-ctl",
        "docker login",
        "systemctl enable --now trainstack-train.service",
    ):
        assert put < boot.index(later), (later, boot.calls)
    assert "arn:aws:automate:us-east-1:ec2:terminate" in boot.calls[put]  # one-time spot: terminate, not stop
    assert boot.index("systemctl enable --now trainstack-alarm.service") >= 0
    assert not boot.shut_down and not boot.alarm_deleted
    assert not any("dpkg -i" in c for c in boot.calls)
    assert all("DPkg::Lock::Timeout=" in c for c in boot.calls if c.startswith("apt-get"))


@pytest.mark.parametrize(
    "fail, alarm_exists",
    [
        ("curl -sS --retry 5 -X PUT", False),  # IMDS
        ("aws cloudwatch put-metric-alarm", True),  # e.g. AWS refusing the alarm
        ("systemctl enable --now trainstack-alarm.service", True),
        ("aws ec2 describe-volumes", True),
        ("NO_DEVICE", True),  # the volume never shows up
        ("mount", True),
        ("apt-get", True),  # dpkg lock held past the timeout (FSx client)
        ("curl -sSfo", True),  # agent download
        ("amazon-cloudwatch-agent-ctl", True),
        ("docker login", True),
        ("systemctl enable --now trainstack-train.service", True),
    ],
)
def test_a_failing_step_shuts_down_and_deletes_the_alarm(tmp_path, fail, alarm_exists):
    boot = Boot(tmp_path, fsx=True)
    (boot.root / "opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl").unlink()  # agent not installed
    (boot.bin / "amazon-cloudwatch-agent-ctl").unlink()
    env = {"STUB_NO_DEVICE": "1"} if fail == "NO_DEVICE" else {"STUB_FAIL": fail}
    if fail == "amazon-cloudwatch-agent-ctl":
        ctl = boot.root / "opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl"
        ctl.write_text(STUB)
        ctl.chmod(0o755)
        env["PATH"] = f"{ctl.parent}:{boot.env['PATH']}"
    boot.run(**env)
    assert boot.rc != 0, boot.log
    assert boot.shut_down, (fail, boot.calls[-5:], boot.log[-2000:])
    assert "failed with exit" in boot.log
    assert boot.alarm_deleted == alarm_exists, boot.calls
    assert boot.index("systemctl enable --now trainstack-train.service") == -1 or fail.endswith("train.service")


def test_the_job_runs_its_image_by_digest_and_restarts_on_the_same_one(tmp_path):
    """launch tags the instance with the image's digest; the boot writes ``IMAGE=<repo>@<digest>`` once into
    /etc/trainstack.env, which every (re)start of trainstack-run reads: a job restarting after exit 75 pulls
    and runs that digest, whatever was pushed since. Without any image tag (and no stack default) the boot
    fails at the training step with one line saying what is missing."""
    boot = Boot(tmp_path).run()
    assert boot.rc == 0, boot.log
    env = (boot.root / "etc/trainstack.env").read_text()
    assert f"IMAGE={REPO_URI}@{DIGEST}" in env.splitlines()
    run = boot.root / "usr/local/bin/trainstack-run"
    for _ in range(2):  # start, then the restart after exit 75
        again = boot.run("bash", str(run))
        assert any(c == f"docker pull {REPO_URI}@{DIGEST}" for c in again.calls), again.calls
        assert any(c.startswith("docker run") and f"{REPO_URI}@{DIGEST} train" in c for c in again.calls)
    bare = Boot(tmp_path / "bare").run(STUB_DIGEST="")
    assert bare.rc != 0 and bare.shut_down and "step training-service failed" in bare.log
    assert "no image: tag the instance trainstack:image-digest" in bare.log


def test_a_kept_instance_is_never_shut_down_and_its_alarm_only_notifies(tmp_path):
    boot = Boot(tmp_path, STUB_KEEP="true").run(STUB_FAIL="aws ec2 describe-volumes")
    assert boot.rc != 0 and not boot.shut_down and not boot.alarm_deleted
    put = boot.calls[boot.index("aws cloudwatch put-metric-alarm")]
    assert "arn:aws:automate" not in put and TOPIC in put
    assert "trainstack:keep=true" in boot.log


@pytest.mark.parametrize(
    "exit_status, keep, shut_down, deleted",
    [
        ("0", "", True, True),  # done
        ("2", "", True, True),  # bad config: not retried (RestartPreventExitStatus)
        ("3", "", True, True),  # non-finite loss: not retried
        ("75", "", False, False),  # interrupted after a checkpoint: systemd restarts the job, it resumes
        ("1", "", False, False),  # a crash: restarted
        ("0", "true", False, True),  # kept: stays up, its alarm goes
    ],
)
def test_after_the_job_trainstack_done(tmp_path, exit_status, keep, shut_down, deleted):
    boot = Boot(tmp_path, STUB_KEEP=keep).run()
    assert boot.rc == 0, boot.log
    done = boot.root / "usr/local/bin/trainstack-done"
    unit = (boot.root / "etc/systemd/system/trainstack-train.service").read_text()
    assert "Restart=on-failure" in unit and "RestartPreventExitStatus=2 3" in unit
    after = boot.run("bash", str(done), EXIT_CODE="exited", EXIT_STATUS=exit_status, SERVICE_RESULT="exit-code")
    assert after.rc == 0, after.out
    assert after.shut_down == shut_down and after.alarm_deleted == deleted, after.calls


@pytest.mark.parametrize("exit_status", ["0", "2", "3", "75", "1"])
def test_trainstack_done_writes_the_exit_record_the_controller_reads(tmp_path, monkeypatch, exit_status):
    """On a final exit (0/2/3) ``trainstack-done`` writes ``{"exit_code": N, "instance_id": ...}`` to
    ``s3://<bucket>/jobs/<job>/exits/<instance>.json`` before it shuts the instance down; stored under that key in
    (moto's) S3, :func:`infra.job_record.exit_code`, what the recovery controller calls, reads N back. After 75 or
    a crash there is no record (the controller then counts the instance's end as an interruption)."""
    from moto import mock_aws

    from infra import job_record as jr
    from tests import moto_env

    boot = Boot(tmp_path).run()
    assert boot.rc == 0, boot.log
    done = boot.root / "usr/local/bin/trainstack-done"
    after = boot.run("bash", str(done), EXIT_CODE="exited", EXIT_STATUS=exit_status)
    assert after.rc == 0, after.out
    puts = [c for c in after.calls if c.startswith("aws s3 cp")]
    if exit_status in ("75", "1"):
        assert puts == [] and not (tmp_path / "s3-object").exists()
        return
    key = jr.EXIT_KEY.format(job=JOB, instance_id=IID)
    assert puts == [f"aws s3 cp - s3://{BUCKET}/{key}"]
    assert after.calls.index(puts[0]) < after.index("shutdown -h")  # written before the instance goes
    body = (tmp_path / "s3-object").read_bytes()
    assert json.loads(body) == {"exit_code": int(exit_status), "instance_id": IID}
    moto_env.fake_credentials(monkeypatch)
    with mock_aws():
        import boto3

        s3 = boto3.client("s3", region_name=moto_env.REGION)
        s3.create_bucket(Bucket=BUCKET)
        assert jr.exit_code(s3, BUCKET, JOB, IID) is None  # no record yet: an interruption
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)
        assert jr.exit_code(s3, BUCKET, JOB, IID) == int(exit_status)


def test_an_exit_record_that_cannot_be_written_still_ends_the_instance(tmp_path):
    """S3 refusing the exit record is logged and the instance still deletes its alarm and shuts down (the
    controller then finds no record and relaunches: a done job may run once more, a stuck instance never)."""
    boot = Boot(tmp_path).run()
    done = boot.root / "usr/local/bin/trainstack-done"
    after = boot.run("bash", str(done), EXIT_CODE="exited", EXIT_STATUS="0", STUB_FAIL="aws s3 cp")
    assert after.rc == 0 and after.shut_down and after.alarm_deleted, after.calls
    assert f"could not write the exit record s3://{BUCKET}/jobs/{JOB}/exits/{IID}.json" in after.out


def test_the_alarm_unit_deletes_the_alarm_at_every_shutdown(tmp_path):
    boot = Boot(tmp_path).run()
    unit = (boot.root / "etc/systemd/system/trainstack-alarm.service").read_text()
    assert f"ExecStop={boot.root}/usr/local/bin/trainstack-alarm delete" in unit
    assert f"ExecStart={boot.root}/usr/local/bin/trainstack-alarm create" in unit
    deleted = boot.run("bash", str(boot.root / "usr/local/bin/trainstack-alarm"), "delete")
    assert deleted.rc == 0 and deleted.alarm_deleted


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    boot = Boot(tmp_path).run()
    assert boot.rc == 0, boot.log
    units = [boot.root / "etc/systemd/system" / u for u in ("trainstack-train.service", "trainstack-alarm.service")]
    docker = tmp_path / "docker.service"  # the unit requires docker.service, which this machine may not have
    docker.write_text("[Unit]\nDescription=stand-in\n[Service]\nExecStart=/bin/true\n")

    def verify(*files: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(docker), *map(str, files)], capture_output=True, text=True
        )

    proc = verify(*units)
    assert proc.returncode == 0 and "trainstack" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    broken = tmp_path / "broken.service"  # the check can fail
    broken.write_text(
        units[0]
        .read_text()
        .replace("Restart=on-failure", "Restart=sometimes")
        .replace("ExecStart=", "ExecStart=relative/path ")
    )
    assert verify(broken).returncode != 0


def test_user_data_aws_calls_are_allowed_by_the_instance_role(tmp_path, tmp_path_factory):
    from tests import moto_env
    from tests.infra_helpers import is_allowed, policy_statements

    raw = moto_env.synthesize(tmp_path_factory.mktemp("cdk-ud"))
    role = policy_statements(
        raw["TrainingStack"], "InstanceRoleDefaultPolicy", moto_env.ACCOUNT, moto_env.REGION, unknown="<TOKEN>"
    )
    boot = Boot(tmp_path).run()
    aws_calls = [c for c in boot.calls if c.startswith("aws ")]
    boot.run("bash", str(boot.root / "usr/local/bin/trainstack-done"), EXIT_CODE="exited", EXIT_STATUS="0")
    aws_calls += [c for c in boot.calls if c.startswith("aws ")]
    assert {c.split()[2] for c in aws_calls} >= {
        "describe-volumes",
        "attach-volume",
        "put-metric-alarm",
        "delete-alarms",
        "get-login-password",
        "cp",
    }
    denied = []
    for c in aws_calls:
        words = shlex.split(c)
        service, op = words[1], words[2]
        action = {
            "describe-volumes": "ec2:DescribeVolumes",
            "attach-volume": "ec2:AttachVolume",
            "put-metric-alarm": "cloudwatch:PutMetricAlarm",
            "delete-alarms": "cloudwatch:DeleteAlarms",
            "get-login-password": "ecr:GetAuthorizationToken",
            "cp": "s3:PutObject",
        }[op]
        resource = None
        if op == "cp":  # the exit record; the data bucket's ARN is an import from the data stack (<TOKEN>)
            resource = "<TOKEN>/" + words[4].removeprefix(f"s3://{BUCKET}/")
        if service == "cloudwatch":
            name = words[words.index("--alarm-name" if op == "put-metric-alarm" else "--alarm-names") + 1]
            resource = f"arn:aws:cloudwatch:{moto_env.REGION}:{moto_env.ACCOUNT}:alarm:{name}"
        if not is_allowed(role, action, resource):
            denied.append(c)
        if op == "put-metric-alarm":
            actions = words[words.index("--alarm-actions") + 1 :]
            for act, res, ctx in implied_permissions(action, actions, moto_env.ACCOUNT):
                if not is_allowed(role, act, res, ctx):
                    denied.append(f"{act} on {res} (implied by {op} with {' '.join(actions)})")
    assert denied == []


def test_the_idle_alarms_ec2_action_may_create_cloudwatchs_service_linked_role(tmp_path_factory):
    """In an account without AWSServiceRoleForCloudWatchEvents, the boot's first step (an alarm whose action
    terminates or stops the instance) needs iam:CreateServiceLinkedRole: without it the step fails and the
    watchdog shuts every instance down at boot. The grant is for that role only; the check can fail."""
    from tests import moto_env
    from tests.infra_helpers import is_allowed, policy_statements

    raw = moto_env.synthesize(tmp_path_factory.mktemp("cdk-slr"))
    role = policy_statements(
        raw["TrainingStack"], "InstanceRoleDefaultPolicy", moto_env.ACCOUNT, moto_env.REGION, unknown="<TOKEN>"
    )
    ((action, resource, context),) = implied_permissions(
        "cloudwatch:PutMetricAlarm", ["arn:aws:automate:us-east-1:ec2:terminate", TOPIC], moto_env.ACCOUNT
    )
    assert is_allowed(role, action, resource, context)
    other = resource.replace(
        "events.amazonaws.com/AWSServiceRoleForCloudWatchEvents", "ecs.amazonaws.com/AWSServiceRoleForECS"
    )
    assert not is_allowed(role, action, other)
    assert not is_allowed(role, action, resource, {"iam:AWSServiceName": "ecs.amazonaws.com"})
    without = [s for s in role if s["Action"] != "iam:CreateServiceLinkedRole"]
    assert not is_allowed(without, action, resource, context)
    assert implied_permissions("cloudwatch:PutMetricAlarm", [TOPIC], moto_env.ACCOUNT) == []  # a kept instance
