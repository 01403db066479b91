"""EC2 job recovery end to end in moto (in-process): the stacks deployed, a job launched through the CLI, its
instance terminated as an interruption, and ``infra.recovery`` fed the events EventBridge would deliver.

Event shapes: EC2 user guide, "Spot Instance interruption notices" (EC2 Spot Instance Interruption Warning),
"State change events for Amazon EC2 instances", "EC2 instance rebalance recommendations"; the scheduled tick
is EventBridge's "Scheduled Event". moto runs every instance on-demand (it ignores the template's spot
options) and detaches volumes when an instance terminates.
"""

from __future__ import annotations

import json
import time

import pytest
from botocore.exceptions import ClientError

import catalog
from infra import job_record as jr
from infra import recovery, recovery_settings
from infra.cli.main import main
from tests import moto_env

E = ["--env", moto_env.ENV]


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    return moto_env.synthesize(tmp_path_factory.mktemp("cdk-recovery"))


@pytest.fixture
def aws(templates, monkeypatch):
    with moto_env.deployed(templates, monkeypatch) as session:
        yield session


def _outputs(aws) -> dict:
    out = {}
    for stack in ("DataStack", "MonitoringStack", "TrainingStack"):
        st = aws.client("cloudformation").describe_stacks(StackName=f"{moto_env.ENV}-{stack}")["Stacks"][0]
        out.update({o["OutputKey"]: o["OutputValue"] for o in st["Outputs"]})
    return out


class Clock:
    """The controller's clock: starts at the wall-clock time (``launch`` stamps its attempt with it), moved by
    the tests."""

    def __init__(self) -> None:
        self.t = self.t0 = time.time()

    def __call__(self) -> float:
        return self.t


class Ec2:
    """The moto EC2 client, with RunInstances calls recorded and, per (type, version) in ``refuse``, refused
    with that error code; ``during`` runs after each successful RunInstances (a concurrent actor)."""

    def __init__(self, real, refuse=None, during=None) -> None:
        self.real, self.refuse, self.during, self.tried = real, refuse or {}, during, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def run_instances(self, **kw):
        lt = kw["LaunchTemplate"]
        itype = self.real.describe_launch_template_versions(LaunchTemplateId=lt["LaunchTemplateId"], Versions=["1"])[
            "LaunchTemplateVersions"
        ][0]["LaunchTemplateData"]["InstanceType"]
        market = "spot" if lt["Version"] == "$Default" else "on-demand"
        self.tried.append((itype, market))
        if (itype, market) in self.refuse:
            code = self.refuse[(itype, market)]
            raise ClientError({"Error": {"Code": code, "Message": "no capacity"}}, "RunInstances")
        out = self.real.run_instances(**kw)
        if self.during:
            self.during(out["Instances"][0]["InstanceId"])
        return out


def _controller(aws, clock, ec2=None) -> recovery.Controller:
    o = _outputs(aws)
    keys = {"LaunchTemplateId" + n.replace(".", "").replace("-", ""): n for n in catalog.names("ec2")}
    settings = recovery_settings.Settings(
        env=moto_env.ENV,
        bucket=o["BucketName"],
        topic_arn=o["AlarmTopicArn"],
        volume_id=o["DataVolumeId"],
        launch_templates={keys[k]: v for k, v in o.items() if k in keys},
    )
    return recovery.Controller(settings, ec2 or Ec2(aws.client("ec2")), aws.client("s3"), aws.client("sns"), now=clock)


def _event(kind: str, iid: str, **detail) -> dict:
    """An event as EventBridge delivers it (the EC2 user guide's examples, this account and region)."""
    return {
        "version": "0",
        "id": "7bf73129-1428-4cd3-a780-95db273d1602",
        "detail-type": kind,
        "source": "aws.ec2",
        "account": moto_env.ACCOUNT,
        "time": "2026-11-21T02:00:00Z",
        "region": moto_env.REGION,
        "resources": [f"arn:aws:ec2:{moto_env.REGION}:{moto_env.ACCOUNT}:instance/{iid}"],
        "detail": {"instance-id": iid, **detail},
    }


def warning(iid):
    return _event("EC2 Spot Instance Interruption Warning", iid, **{"instance-action": "terminate"})


def rebalance(iid):
    return _event("EC2 Instance Rebalance Recommendation", iid)


def state(iid, name):
    return _event("EC2 Instance State-change Notification", iid, state=name)


TICK = {
    "version": "0",
    "id": "53dc4d37-cffa-4f76-80c9-8b7d4a4d2eaa",
    "detail-type": "Scheduled Event",
    "source": "aws.events",
    "account": moto_env.ACCOUNT,
    "time": "2026-11-21T02:00:00Z",
    "region": moto_env.REGION,
    "resources": [f"arn:aws:events:{moto_env.REGION}:{moto_env.ACCOUNT}:rule/trainstack-test-tick"],
    "detail": {},
}


def _job_instances(aws, job: str) -> list[dict]:
    res = aws.client("ec2").describe_instances(Filters=[{"Name": "tag:trainstack:job", "Values": [job]}])
    return sorted((i for r in res["Reservations"] for i in r["Instances"]), key=lambda i: i["LaunchTime"])


def _live(aws, job: str) -> list[str]:
    return [
        i["InstanceId"] for i in _job_instances(aws, job) if i["State"]["Name"] not in ("terminated", "shutting-down")
    ]


def _record(aws, job: str) -> dict:
    return jr.load(aws.client("s3"), _outputs(aws)["BucketName"], job).record


def _launch(aws, job: str, *flags: str) -> str:
    assert main(E + ["launch", "g5.2xlarge", "--job", job, *flags]) == 0
    (iid,) = _live(aws, job)
    return iid


RECLAIM = ("Server.SpotInstanceTermination", "Server.SpotInstanceTermination: Spot instance termination")
USER = ("Client.UserInitiatedShutdown", "Client.UserInitiatedShutdown: User initiated shutdown")
INSIDE = ("Client.InstanceInitiatedShutdown", "Client.InstanceInitiatedShutdown: Instance initiated shutdown")


def _set_state_reason(iid: str, reason: tuple[str, str]) -> None:
    """Give moto's instance the StateReason EC2 reports (code, message). moto's TerminateInstances always
    records ``Client.UserInitiatedShutdown`` (right for teardown/stop/an alarm action, which call the EC2 API)
    and has no spot reclaim, so a reclaim is the API termination with its StateReason then replaced on moto's
    instance object, which DescribeInstances serializes as AWS does (``StateReason: {Code, Message}``)."""
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    inst = ec2_backends[moto_env.ACCOUNT][moto_env.REGION].get_instance(iid)
    inst.state_reason = StateReason(reason[1], reason[0])


def _interrupt(aws, iid: str) -> list[dict]:
    """What EC2 does to a reclaimed spot instance: the warning, then shutting-down and terminated with
    StateReason ``Server.SpotInstanceTermination`` (injected: :func:`_set_state_reason`)."""
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    _set_state_reason(iid, RECLAIM)
    return [warning(iid), state(iid, "shutting-down"), state(iid, "terminated")]


def _reclaim(aws, iid: str) -> dict:
    """A spot reclaim without a warning having reached the function: the terminated event only."""
    return _interrupt(aws, iid)[-1]


def _topic_messages(aws) -> list[str]:
    from moto.sns.models import sns_backends

    topics = sns_backends[moto_env.ACCOUNT][moto_env.REGION].topics
    return [m[1] for t in topics.values() for m in t.sent_notifications]


def _tags(inst: dict) -> dict:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", []) if not t["Key"].startswith("aws:")}


# ---------------------------------------------------------------------------------------------- item 3 bullets
def test_interruption_relaunches_exactly_one_instance_with_the_same_tags_and_template(aws, capsys):
    old = _launch(aws, "r1", "--args", "--epochs 90")
    assert "recovery: on" in capsys.readouterr().out
    volume = _outputs(aws)["DataVolumeId"]
    ec2 = aws.client("ec2")
    ec2.attach_volume(VolumeId=volume, InstanceId=old, Device="/dev/sdf")  # as the user data does
    clock = Clock()
    ctl = _controller(aws, clock)
    # the warning comes 2 minutes before: the instance still holds the volume, nothing is launched
    assert ctl.handle(warning(old)) == [f"r1: {old} warned"]
    assert ctl.handle(rebalance(old))[0].startswith("r1: rebalance recommendation")
    assert _live(aws, "r1") == [old] and _record(aws, "r1")["state"] == jr.WARNED
    events = _interrupt(aws, old)
    lines = []
    for ev in events + [rebalance(old), state(old, "terminated"), warning(old)]:  # duplicates and stragglers
        lines += ctl.handle(ev)
    assert sum("relaunched as" in line for line in lines) == 1, lines
    (new,) = _live(aws, "r1")
    first, second = _job_instances(aws, "r1")
    assert _tags(first) == _tags(second) and _tags(second)["trainstack:args"] == "--epochs 90"
    assert _tags(second)["trainstack:image-digest"] == _tags(first)["trainstack:image-digest"]
    assert first["ImageId"] == second["ImageId"] and second["InstanceType"] == "g5.2xlarge"
    r = _record(aws, "r1")
    assert [a["instance_id"] for a in r["attempts"]] == [old, new] and r["recoveries"] == 1
    assert r["attempts"][0]["ended_by"] == "spot interruption" and r["attempts"][1]["market"] == "spot"
    assert r["state"] == jr.RUNNING
    assert any(f"relaunched as {new}" in m for m in _topic_messages(aws))
    assert main(E + ["status", "r1"]) == 0
    out = capsys.readouterr().out
    assert old in out and new in out and "spot interruption" in out and "recoveries 1 of 10" in out


def test_relaunch_waits_until_the_data_volume_is_released(aws):
    old = _launch(aws, "vol")
    volume = _outputs(aws)["DataVolumeId"]
    other = aws.client("ec2").run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]
    aws.client("ec2").attach_volume(VolumeId=volume, InstanceId=other["InstanceId"], Device="/dev/sdf")
    clock = Clock()
    ctl = _controller(aws, clock)
    assert "release the data volume" in ctl.handle(_reclaim(aws, old))[0]
    assert _live(aws, "vol") == [] and _record(aws, "vol")["state"] == jr.WAITING
    aws.client("ec2").detach_volume(VolumeId=volume, InstanceId=other["InstanceId"], Device="/dev/sdf")
    clock.t += recovery.VOLUME_WAIT_S
    assert any("relaunched as" in line for line in ctl.handle(TICK))
    assert len(_live(aws, "vol")) == 1


@pytest.mark.parametrize(("code", "final"), [(0, jr.DONE), (2, jr.FAILED), (3, jr.FAILED)])
def test_done_and_bad_config_jobs_are_not_relaunched(aws, code, final):
    iid = _launch(aws, "fin")
    bucket = _outputs(aws)["BucketName"]
    key = jr.EXIT_KEY.format(job="fin", instance_id=iid)
    aws.client("s3").put_object(Bucket=bucket, Key=key, Body=json.dumps({"exit_code": code}).encode())
    ctl = _controller(aws, Clock())
    for ev in _interrupt(aws, iid)[1:] + [TICK]:
        ctl.handle(ev)
    assert _live(aws, "fin") == [] and len(_job_instances(aws, "fin")) == 1
    r = _record(aws, "fin")
    assert r["state"] == final and r["attempts"][0]["ended_by"] == f"exit {code}"
    assert any(f"job fin {'done' if code == 0 else f'exit {code}'}" in m for m in _topic_messages(aws))


def test_capacity_errors_back_off_then_fallback_type_then_on_demand(aws):
    iid = _launch(aws, "cap", "--fallback-types", "g5.12xlarge", "--on-demand-fallback")
    clock = Clock()
    ec2 = Ec2(
        aws.client("ec2"),
        refuse={("g5.2xlarge", "spot"): "InsufficientInstanceCapacity", ("g5.12xlarge", "spot"): "SpotMaxPriceTooLow"},
    )
    ctl = _controller(aws, clock, ec2)
    for ev in _interrupt(aws, iid)[1:]:
        ctl.handle(ev)
    assert ec2.tried == [("g5.2xlarge", "spot")]
    r = _record(aws, "cap")
    assert r["state"] == jr.WAITING and r["next_try_at"] == clock.t0 + recovery.BACKOFF_BASE_S
    ctl.handle(TICK)  # not due yet: nothing tried
    assert len(ec2.tried) == 1
    clock.t += recovery.BACKOFF_BASE_S
    ctl.handle(TICK)
    assert ec2.tried[1:] == [("g5.2xlarge", "spot")]
    assert _record(aws, "cap")["next_try_at"] == clock.t + 2 * recovery.BACKOFF_BASE_S  # doubled
    clock.t += 2 * recovery.BACKOFF_BASE_S
    lines = ctl.handle(TICK)
    assert ec2.tried[2:] == [("g5.2xlarge", "spot"), ("g5.12xlarge", "spot"), ("g5.2xlarge", "on-demand")], lines
    (new,) = _live(aws, "cap")
    r = _record(aws, "cap")
    assert r["attempts"][-1]["instance_id"] == new and r["attempts"][-1]["market"] == "on-demand"
    assert r["state"] == jr.RUNNING and r["capacity_rounds"] == 0


def test_fallback_type_is_used_when_the_jobs_type_has_no_spot_capacity(aws):
    iid = _launch(aws, "fb", "--fallback-types", "g5.12xlarge")
    clock = Clock()
    ec2 = Ec2(aws.client("ec2"), refuse={("g5.2xlarge", "spot"): "InsufficientInstanceCapacity"})
    ctl = _controller(aws, clock, ec2)
    ctl.handle(_interrupt(aws, iid)[-1])
    for _ in range(recovery.SPOT_ONLY_ROUNDS):
        clock.t += recovery.BACKOFF_MAX_S
        ctl.handle(TICK)
    (new,) = _live(aws, "fb")
    assert (
        aws.client("ec2").describe_instances(InstanceIds=[new])["Reservations"][0]["Instances"][0]["InstanceType"]
        == "g5.12xlarge"
    )
    assert ("g5.2xlarge", "on-demand") not in ec2.tried  # not allowed without --on-demand-fallback


def test_recovery_cap_stops_the_job_with_a_message(aws):
    iid = _launch(aws, "rc", "--max-recoveries", "1")
    ctl = _controller(aws, Clock())
    ctl.handle(_interrupt(aws, iid)[-1])
    (second,) = _live(aws, "rc")
    lines = ctl.handle(_interrupt(aws, second)[-1])
    assert _live(aws, "rc") == [] and "capped" in lines[0]
    r = _record(aws, "rc")
    assert r["state"] == jr.CAPPED and "--max-recoveries" in r["reason"]
    assert any("job rc stopped: 1 recoveries" in m for m in _topic_messages(aws))


def test_cost_cap_ends_a_running_attempt_and_stops_recovery(aws):
    iid = _launch(aws, "cc", "--max-cost-usd", "2")
    clock = Clock()
    ctl = _controller(aws, clock)
    bucket = _outputs(aws)["BucketName"]
    stored = jr.load(aws.client("s3"), bucket, "cc")
    stored.record["attempts"][0]["start"] = clock.t0  # launch stamped it a moment before the clock started
    jr.save(aws.client("s3"), bucket, stored)
    price = stored.record["prices"]["g5.2xlarge"]["spot"]
    clock.t += 3600 * (1.9 / price)  # $1.90 spent: still under the cap
    ctl.handle(TICK)
    assert _live(aws, "cc") == [iid]
    clock.t += 3600 * (0.2 / price)
    lines = ctl.handle(TICK)
    assert "capped" in lines[0] and _live(aws, "cc") == []
    r = _record(aws, "cc")
    assert r["state"] == jr.CAPPED and "$2.00" in r["reason"]
    ctl.handle(state(iid, "terminated"))
    assert _live(aws, "cc") == []  # the cap's own termination is not an interruption


class S3:
    """The moto S3 client; ``before_put`` runs once, before the first write of a job record (a concurrent writer)."""

    def __init__(self, real, before_put) -> None:
        self.real, self.before_put = real, before_put

    def __getattr__(self, name):
        return getattr(self.real, name)

    def put_object(self, **kw):
        if kw["Key"].endswith("/record.json") and self.before_put:
            hook, self.before_put = self.before_put, None
            hook()
        return self.real.put_object(**kw)


def test_cost_cap_acts_only_on_a_saved_decision(aws):
    """The tick's cost cap races an interruption warning handled by another invocation: its conditional write
    fails, so it neither terminates the instance nor tells the topic; the next tick caps the job once."""
    iid = _launch(aws, "race", "--max-cost-usd", "1")
    clock = Clock()
    other = _controller(aws, clock)
    ctl = _controller(aws, clock)
    ctl.s3 = S3(ctl.s3, lambda: other.handle(warning(iid)))
    clock.t += 10 * 3600
    assert ctl.tick() == ["race: not saved, the record changed"]
    assert _live(aws, "race") == [iid] and _record(aws, "race")["state"] == jr.WARNED
    assert not any("job race stopped" in m for m in _topic_messages(aws))
    assert "capped" in ctl.tick()[0]
    assert _live(aws, "race") == [] and _record(aws, "race")["state"] == jr.CAPPED
    assert sum("job race stopped" in m for m in _topic_messages(aws)) == 1


def test_a_second_invocation_during_a_relaunch_does_nothing(aws):
    iid = _launch(aws, "dup")
    clock = Clock()
    inner = []
    ec2 = Ec2(aws.client("ec2"))
    ctl = _controller(aws, clock, ec2)
    ec2.during = lambda new: inner.extend(ctl.handle(state(iid, "terminated")) + ctl.handle(TICK))
    ctl.handle(_interrupt(aws, iid)[-1])
    assert len(_live(aws, "dup")) == 1 and len(ec2.tried) == 1
    assert any("another invocation is relaunching it" in line for line in inner), inner


def test_stop_during_a_relaunch_leaves_nothing_running(aws, capsys):
    iid = _launch(aws, "st")
    ec2 = Ec2(aws.client("ec2"))
    ctl = _controller(aws, Clock(), ec2)
    ec2.during = lambda new: main(E + ["stop", "st"])
    lines = ctl.handle(_interrupt(aws, iid)[-1])
    assert "the record changed during the relaunch" in lines[0]
    assert _live(aws, "st") == [] and len(ec2.tried) == 1
    assert _record(aws, "st")["state"] == jr.STOPPED
    ctl.handle(TICK)
    assert _live(aws, "st") == []
    assert "stopped job st" in capsys.readouterr().out


def test_no_recover_is_a_one_shot_run(aws, capsys):
    iid = _launch(aws, "one", "--no-recover")
    assert "recovery: off" in capsys.readouterr().out
    ctl = _controller(aws, Clock())
    ctl.handle(_interrupt(aws, iid)[-1])
    assert _live(aws, "one") == [] and _record(aws, "one")["state"] == jr.ENDED


def test_events_of_other_instances_are_ignored(aws):
    other = aws.client("ec2").run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]
    ctl = _controller(aws, Clock())
    assert "is not a job instance" in ctl.handle(state(other["InstanceId"], "terminated"))[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-recoveries", "x"], "--max-recoveries: got 'x'; expected a whole number >= 0"),
        (["--max-cost-usd", "-5"], "--max-cost-usd: got '-5'; expected an amount in USD > 0"),
        (["--fallback-types", "g5.3xlarge"], "--fallback-types 'g5.3xlarge': expected EC2 types of the catalog"),
        (["--fallback-types", "g5.12xlarge,"], "--fallback-types: got 'g5.12xlarge,'; expected EC2 types"),
    ],
)
def test_bad_launch_flags_are_one_line_exit_2(flags, message, capsys):
    try:
        rc = main(E + ["launch", "g5.2xlarge", "--job", "j", *flags])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_logs_follow_goes_on_to_the_relaunched_instance(aws, capsys, monkeypatch):
    """``logs JOB --follow`` through the CLI against moto's CloudWatch Logs: the first instance's container
    stream (``<instance>/<job>``, the user data's awslogs-stream), then, after the controller relaunched the job,
    the new instance's stream, every line once and in order; Ctrl-C (KeyboardInterrupt) ends it with 0. The
    polls' sleeps are where the job moves on."""
    import functools
    import itertools

    from infra.cli import ec2_jobs
    from infra.cli import logs as logs_cli

    first = _launch(aws, "lf")
    logs, group = aws.client("logs"), _outputs(aws)["TrainLogGroup"]
    ms = itertools.count(int(time.time() * 1000))  # each line 1 ms after the one before

    def put(iid: str, *lines: str) -> None:
        stream = ec2_jobs.stream_name(iid, "lf")
        if not logs.describe_log_streams(logGroupName=group, logStreamNamePrefix=stream)["logStreams"]:
            logs.create_log_stream(logGroupName=group, logStreamName=stream)
        events = [{"timestamp": next(ms), "message": line} for line in lines]
        logs.put_log_events(logGroupName=group, logStreamName=stream, logEvents=events)

    put(first, "step=1 loss=2.3", "step=2 loss=2.2")
    ctl = _controller(aws, Clock())
    second = []

    def interrupt_and_relaunch() -> None:
        put(first, "step=3 loss=2.1", "step=4 interrupted: SIGTERM")
        for ev in _interrupt(aws, first):
            ctl.handle(ev)
        second.extend(_live(aws, "lf"))
        put(second[0], "step=4 checkpoint: resuming from /data/checkpoints/lf/ckpt-000000004", "step=5 loss=2.0")

    stages = iter([interrupt_and_relaunch, lambda: put(second[0], "step=6 loss=1.9")])

    def sleep(seconds: float) -> None:
        stage = next(stages, None)
        if stage is None:
            raise KeyboardInterrupt  # the user's Ctrl-C
        stage()

    monkeypatch.setattr(logs_cli, "tail", functools.partial(logs_cli.tail, sleep=sleep))
    capsys.readouterr()
    assert main(E + ["logs", "lf", "--follow"]) == 0
    assert len(second) == 1 and second[0] != first
    assert capsys.readouterr().out.splitlines() == [
        "step=1 loss=2.3",
        "step=2 loss=2.2",
        "step=3 loss=2.1",
        "step=4 interrupted: SIGTERM",
        "step=4 checkpoint: resuming from /data/checkpoints/lf/ckpt-000000004",
        "step=5 loss=2.0",
        "step=6 loss=1.9",
    ]


# ---------------------------------------------------------------------------------------------- IAM and synthesis
def _role_statements(templates) -> list[dict]:
    """The recovery role's statements, launch templates and instance role resolved to moto's ids."""
    from tests.infra_helpers import policy_statements

    return policy_statements(
        templates["TrainingStack"], "RecoveryRoleDefaultPolicy", moto_env.ACCOUNT, moto_env.REGION, unknown="<IMPORT>"
    )


def test_recovery_role_allows_what_the_controller_calls_and_nothing_wider(aws, templates):
    """Every call the controller makes in a relaunch with capacity errors, an on-demand fallback and a cost
    cap, checked against the synthesized policy; the policy's scope checked against what it must refuse."""
    import boto3

    from tests.infra_helpers import CallRecorder, is_allowed

    statements = _role_statements(templates)
    rec = CallRecorder()
    session = boto3.Session(region_name=moto_env.REGION)
    session.events.register("before-parameter-build.*.*", rec._hook)
    iid = _launch(aws, "iam", "--on-demand-fallback", "--max-cost-usd", "1")
    clock = Clock()
    ec2 = Ec2(session.client("ec2"), refuse={("g5.2xlarge", "spot"): "InsufficientInstanceCapacity"})
    ctl = recovery.Controller(_controller(aws, clock).s, ec2, session.client("s3"), session.client("sns"), now=clock)
    lines = ctl.handle(_reclaim(aws, iid))
    for _ in range(recovery.SPOT_ONLY_ROUNDS):
        clock.t += recovery.BACKOFF_MAX_S
        lines += ctl.handle(TICK)
    clock.t += 10 * 3600
    lines += ctl.handle(TICK)
    assert "capped" in lines[-1], lines
    o = _outputs(aws)
    bucket = o["BucketName"]
    actions = set()
    for action, params in rec.calls:
        actions.add(action)
        if action in ("s3:GetObject", "s3:PutObject"):
            resource = f"<IMPORT>/{params['Key']}"
        elif action == "ec2:TerminateInstances":
            resource = f"arn:aws:ec2:{moto_env.REGION}:{moto_env.ACCOUNT}:instance/{params['InstanceIds'][0]}"
        elif action == "sns:Publish":  # the topic's ARN is an import from the monitoring stack
            resource = "<IMPORT>"
        elif action == "s3:ListObjectsV2":
            action, resource = "s3:ListBucket", "<IMPORT>"
        else:
            resource = None
        assert is_allowed(statements, action, resource), (action, resource)
        if action.startswith("s3:"):
            assert params["Bucket"] == bucket  # the data bucket (its ARN is an import in the policy)
    assert {
        "ec2:RunInstances",
        "ec2:CreateLaunchTemplateVersion",
        "ec2:TerminateInstances",
        "sns:Publish",
    } <= actions, lines
    assert {"s3:GetObject", "s3:PutObject"} <= actions
    # what it must not do: other buckets' keys, other actions, roles other than the instance role
    assert not is_allowed(statements, "s3:PutObject", "<IMPORT>/datasets/x")
    assert not is_allowed(statements, "s3:DeleteObject", "<IMPORT>/jobs/x/record.json")
    assert not is_allowed(statements, "ec2:ModifyInstanceAttribute", None)
    assert not is_allowed(statements, "iam:PassRole", f"arn:aws:iam::{moto_env.ACCOUNT}:role/Admin")
    run = [s for s in statements if s["Action"] == "ec2:RunInstances"]
    allow = next(s for s in run if s["Effect"] == "Allow")
    assert list(allow["Condition"]) == ["ArnLike"] and allow["Condition"]["ArnLike"]["ec2:LaunchTemplate"]
    deny = next(s for s in run if s["Effect"] == "Deny")
    assert deny["Condition"] == {"StringNotEquals": {"aws:RequestTag/trainstack:env": moto_env.ENV}}
    passrole = next(s for s in statements if s["Action"] == "iam:PassRole")
    assert passrole["Condition"] == {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}
    raw = [
        st
        for lid, res in templates["TrainingStack"]["Resources"].items()
        if lid.startswith("RecoveryRoleDefaultPolicy")
        for st in res["Properties"]["PolicyDocument"]["Statement"]
        if st["Action"] == "iam:PassRole"
    ]
    assert [st["Resource"]["Fn::GetAtt"][0].startswith("InstanceRole") for st in raw] == [True]


def test_synthesized_rules_target_the_function_with_the_handler(templates):
    from tests.infra_helpers import resources

    t = templates["TrainingStack"]
    ((fn_id, fn),) = resources(t, "AWS::Lambda::Function").items()
    p = fn["Properties"]
    assert p["Handler"] == "infra.recovery.handler" and p["Runtime"].startswith("python3.")
    assert set(p["Environment"]["Variables"]) == {
        "TRAINSTACK_ENV",
        "TRAINSTACK_BUCKET",
        "TRAINSTACK_TOPIC_ARN",
        "TRAINSTACK_VOLUME_ID",
        "TRAINSTACK_LAUNCH_TEMPLATES",
        "TRAINSTACK_IDLE_ALARM_PREFIX",
    }
    assert p["Environment"]["Variables"]["TRAINSTACK_IDLE_ALARM_PREFIX"] == f"trainstack-{moto_env.ENV}-gpu-idle-"
    rules = {
        r["Properties"]["Description"].split(": ", 1)[1]: r["Properties"]
        for r in resources(t, "AWS::Events::Rule").values()
        if "recovery" in r["Properties"]["Description"]
    }
    assert len(rules) == 4
    patterns = [r.get("EventPattern") for r in rules.values()]
    assert {
        "source": ["aws.ec2"],
        "detail-type": ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"],
    } in patterns
    assert {
        "source": ["aws.ec2"],
        "detail-type": ["EC2 Instance State-change Notification"],
        "detail": {"state": ["stopping", "shutting-down", "terminated"]},
    } in patterns
    assert any(r.get("ScheduleExpression") == f"rate({recovery_settings.TICK_S // 60} minutes)" for r in rules.values())
    assert {
        "source": ["aws.cloudwatch"],
        "detail-type": ["CloudWatch Alarm State Change"],
        "detail": {"alarmName": [{"prefix": f"trainstack-{moto_env.ENV}-gpu-idle-"}], "state": {"value": ["ALARM"]}},
    } in patterns
    for r in rules.values():
        assert r["Targets"][0]["Arn"] == {"Fn::GetAtt": [fn_id, "Arn"]}
