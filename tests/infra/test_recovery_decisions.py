"""Recovery brings back only what AWS took, and says so loudly when it cannot, in moto.

Events are full EventBridge envelopes (tests/infra/test_recovery.py). StateReason is what EC2 reports (EC2 API
reference, "StateReason"): moto's TerminateInstances records ``Client.UserInitiatedShutdown: User initiated
shutdown`` as EC2 does for an API termination (teardown, stop, an alarm's terminate action); a spot reclaim
(``Server.SpotInstanceTermination``) or a shutdown inside the instance (``Client.InstanceInitiatedShutdown``)
is injected on moto's instance object after the termination (``_set_state_reason``), so DescribeInstances
returns it as AWS would. The GPU-idle alarm's event is EventBridge's "CloudWatch Alarm State Change" envelope
(CloudWatch user guide, "Alarm events and EventBridge").
"""

from __future__ import annotations

import json

import pytest
from botocore.exceptions import ClientError

from infra import job_record as jr
from infra import recovery
from infra.cli.main import main
from tests import moto_env
from tests.infra import test_recovery as base
from tests.infra.test_recovery import (
    INSIDE,
    TICK,
    Clock,
    E,
    Ec2,
    _controller,
    _interrupt,
    _launch,
    _live,
    _outputs,
    _record,
    _set_state_reason,
    _topic_messages,
    state,
)

pytestmark = pytest.mark.slow  # a moto deployment per test (CDK synthesis once per module)
templates, aws = base.templates, base.aws  # the same fixtures as tests/infra/test_recovery.py


def idle_alarm(iid: str, value: str = "ALARM") -> dict:
    """The "CloudWatch Alarm State Change" event of an instance's GPU-idle alarm, as EventBridge delivers it."""
    name = f"trainstack-{moto_env.ENV}-gpu-idle-{iid}"
    return {
        "version": "0",
        "id": "c4c1c1c9-6542-e61b-6ef0-8c4d36933a92",
        "detail-type": "CloudWatch Alarm State Change",
        "source": "aws.cloudwatch",
        "account": moto_env.ACCOUNT,
        "time": "2026-11-21T03:00:00Z",
        "region": moto_env.REGION,
        "resources": [f"arn:aws:cloudwatch:{moto_env.REGION}:{moto_env.ACCOUNT}:alarm:{name}"],
        "detail": {
            "alarmName": name,
            "state": {
                "value": value,
                "reason": "Threshold Crossed: 30 datapoints were less than the threshold (5.0).",
                "timestamp": "2026-11-21T03:00:00.000+0000",
            },
            "previousState": {"value": "OK", "reason": "", "timestamp": "2026-11-21T02:30:00.000+0000"},
            "configuration": {"metrics": [], "description": ""},
        },
    }


def _run(aws, *argv: str, capsys) -> tuple[int, str, str]:
    try:
        rc = main(E + list(argv))
    except SystemExit as e:
        rc = e.code
    got = capsys.readouterr()
    return rc, got.out, got.err


# ---------------------------------------------------------------------------------------------- D1 (money)
def test_d1_teardown_marks_jobs_stopped_before_terminating_and_nothing_comes_back(aws, capsys):
    iid = _launch(aws, "td")
    ctl = _controller(aws, Clock())
    rc, out, _ = _run(aws, "teardown", "--yes", capsys=capsys)
    for ev in (state(iid, "shutting-down"), state(iid, "terminated"), TICK):
        ctl.handle(ev)
    assert _live(aws, "td") == [] and _record(aws, "td")["state"] == jr.STOPPED
    assert rc == 0 and "removed 1 jobs: td" in out


def test_d1_an_api_termination_without_a_mark_is_not_a_reclaim(aws):
    """A termination through the EC2 API that nobody recorded (console, an older CLI): StateReason
    ``Client.UserInitiatedShutdown``, no spot warning: the job ends and is not relaunched."""
    iid = _launch(aws, "api")
    ctl = _controller(aws, Clock())
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    lines = ctl.handle(state(iid, "terminated")) + ctl.handle(TICK)
    assert _live(aws, "api") == [], lines
    r = _record(aws, "api")
    assert r["state"] == jr.ENDED and "Client.UserInitiatedShutdown: User initiated shutdown" in r["reason"]
    assert r["attempts"][0]["ended_by"] == "Client.UserInitiatedShutdown" and r["recoveries"] == 0
    assert any("not a spot reclaim" in m for m in _topic_messages(aws))


def test_d1_a_shutdown_inside_the_instance_is_not_relaunched(aws):
    iid = _launch(aws, "boot")
    ctl = _controller(aws, Clock())
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    _set_state_reason(iid, INSIDE)
    ctl.handle(state(iid, "terminated"))
    assert _live(aws, "boot") == [] and _record(aws, "boot")["state"] == jr.ENDED


def test_d1_stop_instance_marks_its_job_stopped_first(aws, capsys):
    iid = _launch(aws, "si")
    rc, out, _ = _run(aws, "stop", iid, capsys=capsys)
    assert rc == 0 and iid in out
    r = _record(aws, "si")
    assert r["state"] == jr.STOPPED and iid in r["reason"]


def test_d1_idle_alarm_fails_a_hung_job_and_it_is_not_relaunched(aws):
    iid = _launch(aws, "hung")
    ctl = _controller(aws, Clock())
    lines = ctl.handle(idle_alarm(iid))
    assert lines == [f"hung: failed (GPU idle: {iid} ended by its idle alarm (Threshold Crossed: 30 datapoints "
                     "were less than the threshold (5.0).))"], lines  # fmt: skip
    aws.client("ec2").terminate_instances(InstanceIds=[iid])  # the alarm's terminate action (the EC2 API)
    for ev in (state(iid, "shutting-down"), state(iid, "terminated"), TICK):
        ctl.handle(ev)
    r = _record(aws, "hung")
    assert _live(aws, "hung") == [] and r["state"] == jr.FAILED and "idle alarm" in r["reason"]
    assert any("job hung failed: GPU idle" in m for m in _topic_messages(aws))


def test_d1_idle_alarm_after_the_termination_event_still_fails_the_job(aws):
    iid = _launch(aws, "late")
    ctl = _controller(aws, Clock())
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    ctl.handle(state(iid, "terminated"))
    assert _record(aws, "late")["state"] == jr.ENDED
    ctl.handle(idle_alarm(iid))
    assert _record(aws, "late")["state"] == jr.FAILED and _live(aws, "late") == []


def test_d1_kept_instances_idle_alarm_only_notifies(aws):
    iid = _launch(aws, "kept", "--keep")
    ctl = _controller(aws, Clock())
    assert "the alarm only notifies" in ctl.handle(idle_alarm(iid))[0]
    assert "ignored" in ctl.handle(idle_alarm(iid, "OK"))[0]
    assert _record(aws, "kept")["state"] == jr.RUNNING


# ---------------------------------------------------------------------------------------------- D3
def test_d3_one_bad_record_is_skipped_and_reported_the_others_proceed(aws, monkeypatch):
    good = _launch(aws, "good")
    bucket = _outputs(aws)["BucketName"]
    s3 = aws.client("s3")
    s3.put_object(Bucket=bucket, Key=jr.record_key("broken"), Body=b'{"job": "broken", "state": ')
    ctl = _controller(aws, Clock())
    aws.client("ec2").terminate_instances(InstanceIds=[good])
    _set_state_reason(
        good, ("Server.SpotInstanceTermination", "Server.SpotInstanceTermination: Spot instance termination")
    )
    lines = ctl.handle(TICK)
    assert any(line.startswith("broken: skipped this tick: JSONDecodeError") for line in lines), lines
    assert len(_live(aws, "good")) == 1 and _record(aws, "good")["recoveries"] == 1
    assert ctl.failures and ctl.failures[0].startswith("broken:")
    # the Lambda entry point fails the invocation after the tick, so the Errors alarm and the queue hear of it
    o = _outputs(aws)
    keys = {"LaunchTemplateIdg52xlarge": "g5.2xlarge"}
    for k, v in {
        "TRAINSTACK_ENV": moto_env.ENV,
        "TRAINSTACK_BUCKET": bucket,
        "TRAINSTACK_TOPIC_ARN": o["AlarmTopicArn"],
        "TRAINSTACK_VOLUME_ID": o["DataVolumeId"],
        "TRAINSTACK_LAUNCH_TEMPLATES": json.dumps({keys[k]: v for k, v in o.items() if k in keys}),
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(recovery.RecoveryError, match="broken: skipped"):
        recovery.handler(TICK)


def test_d3_a_type_without_a_launch_template_fails_that_job_only(aws):
    iid = _launch(aws, "gone-type")
    bucket = _outputs(aws)["BucketName"]
    stored = jr.load(aws.client("s3"), bucket, "gone-type")
    stored.record["instance_type"] = "g5.48xlarge"  # redeployed without its launch template
    jr.save(aws.client("s3"), bucket, stored)
    ctl = _controller(aws, Clock())
    ctl.s.launch_templates.pop("g5.48xlarge", None)
    ctl.handle(_interrupt(aws, iid)[-1])
    r = _record(aws, "gone-type")
    assert r["state"] == jr.FAILED and "no launch template for g5.48xlarge" in r["reason"]


# ---------------------------------------------------------------------------------------------- D4
@pytest.mark.parametrize("code", ["RequestLimitExceeded", "InternalError", "Unavailable", "ServiceUnavailable"])
def test_d4_transient_run_instances_errors_back_off_and_retry(aws, code):
    iid = _launch(aws, "tr")
    clock = Clock()
    ec2 = Ec2(aws.client("ec2"), refuse={("g5.2xlarge", "spot"): code})
    ctl = _controller(aws, clock, ec2)
    ctl.handle(_interrupt(aws, iid)[-1])
    r = _record(aws, "tr")
    assert r["state"] == jr.WAITING and f"EC2 error {code} (transient" in r["reason"], r["reason"]
    assert r["next_try_at"] == clock.t0 + recovery.BACKOFF_BASE_S and r["capacity_rounds"] == 0
    ec2.refuse = {}
    clock.t += recovery.BACKOFF_BASE_S
    ctl.handle(TICK)
    assert len(_live(aws, "tr")) == 1 and _record(aws, "tr")["state"] == jr.RUNNING


def test_d4_permission_errors_are_final(aws):
    iid = _launch(aws, "perm")
    ec2 = Ec2(aws.client("ec2"), refuse={("g5.2xlarge", "spot"): "UnauthorizedOperation"})
    _controller(aws, Clock(), ec2).handle(_interrupt(aws, iid)[-1])
    assert _record(aws, "perm")["state"] == jr.FAILED


# ---------------------------------------------------------------------------------------------- D5
class FlakyDescribe(Ec2):
    """DescribeInstances by instance id throttled (``RequestLimitExceeded``) while ``failing``."""

    failing = True

    def describe_instances(self, **kw):
        if self.failing and "InstanceIds" in kw:
            raise ClientError({"Error": {"Code": "RequestLimitExceeded", "Message": "slow down"}}, "DescribeInstances")
        return self.real.describe_instances(**kw)


def test_d5_an_unreadable_instance_is_unknown_never_gone(aws):
    iid = _launch(aws, "unk", "--max-cost-usd", "5")
    clock = Clock()
    ec2 = FlakyDescribe(aws.client("ec2"))
    ctl = _controller(aws, clock, ec2)
    lines = ctl.handle(TICK)
    assert any("state unknown" in line for line in lines), lines
    r = _record(aws, "unk")
    assert r["state"] == jr.RUNNING and r["attempts"][0]["end"] is None and ec2.tried == []
    assert _live(aws, "unk") == [iid]
    clock.t += 3600 * 100  # the spend keeps counting while the instance is unknown: the cap still ends it
    assert "capped" in ctl.handle(TICK)[-1]
    # the event path: the invocation fails (Lambda retries it) instead of dropping the event
    with pytest.raises(recovery.Unknown):
        ctl.handle(state(iid, "terminated"))


# ---------------------------------------------------------------------------------------------- D6
def test_d6_a_second_job_in_the_environment_is_refused_at_launch(aws, capsys):
    _launch(aws, "first")
    rc, _, err = _run(aws, "launch", "g5.2xlarge", "--job", "second", capsys=capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "job first is running in environment" in err and "one job per environment" in err
    assert _live(aws, "second") == []


def test_d6_a_relaunch_waits_while_another_jobs_instance_lives(aws):
    iid = _launch(aws, "a")
    other = aws.client("ec2").run_instances(
        ImageId="ami-12c6146b",
        MinCount=1,
        MaxCount=1,
        TagSpecifications=[
            {
                "ResourceType": "instance",
                "Tags": [{"Key": "trainstack:env", "Value": moto_env.ENV}, {"Key": "trainstack:job", "Value": "b"}],
            }
        ],
    )["Instances"][0]["InstanceId"]
    lines = _controller(aws, Clock()).handle(_interrupt(aws, iid)[-1])
    assert f"waiting for {other} to release the data volume" in lines[0] and _live(aws, "a") == []


# ---------------------------------------------------------------------------------------------- D7
def test_d7_run_instances_is_pinned_to_the_templates_and_records_are_not_instance_writable(templates):
    from tests.infra_helpers import _glob, is_allowed, policy_statements

    fn = policy_statements(
        templates["TrainingStack"], "RecoveryRoleDefaultPolicy", moto_env.ACCOUNT, moto_env.REGION, unknown="<X>"
    )
    run = [s for s in fn if s["Action"] == "ec2:RunInstances" and s["Effect"] == "Allow"]
    image = next(s for s in run if any(":image/" in r for r in json.dumps(s["Resource"]).split('"')))
    assert image["Condition"]["Bool"] == {"ec2:IsLaunchTemplateResource": "true"}
    assert image["Condition"]["StringEquals"] == {"ec2:Owner": ["amazon", moto_env.ACCOUNT]}
    subnet = next(s for s in run if any(":subnet/" in r for r in s["Resource"]))
    assert subnet["Condition"]["Bool"] == {"ec2:IsLaunchTemplateResource": "true"}
    assert all("ec2:LaunchTemplate" in s["Condition"]["ArnLike"] for s in run)
    inst = policy_statements(
        templates["TrainingStack"], "InstanceRoleDefaultPolicy", moto_env.ACCOUNT, moto_env.REGION, unknown="<X>"
    )
    assert is_allowed(inst, "s3:PutObject", "<X>/jobs/j/exits/i-1.json")

    def denied(action: str, key: str) -> bool:
        return any(
            s["Effect"] == "Deny"
            and action in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
            and any(_glob(r, key) for r in (s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]]))
            for s in inst
        )

    assert denied("s3:PutObject", "<X>/jobs/j/record.json") and denied("s3:DeleteObject", "<X>/jobs/j/record.json")
    assert not denied("s3:PutObject", "<X>/jobs/j/exits/i-1.json")


# ---------------------------------------------------------------------------------------------- D8
def test_d8_a_kept_job_ends_done_and_the_cost_cap_leaves_its_instance(aws):
    iid = _launch(aws, "keep", "--keep", "--max-cost-usd", "1")
    bucket = _outputs(aws)["BucketName"]
    key = jr.EXIT_KEY.format(job="keep", instance_id=iid)
    aws.client("s3").put_object(Bucket=bucket, Key=key, Body=b'{"exit_code": 0}')
    clock = Clock()
    ctl = _controller(aws, clock)
    lines = ctl.handle(TICK)
    r = _record(aws, "keep")
    assert r["state"] == jr.DONE and "kept up" in r["reason"], lines
    clock.t += 3600 * 100
    ctl.handle(TICK)
    assert _live(aws, "keep") == [iid] and _record(aws, "keep")["state"] == jr.DONE


# ---------------------------------------------------------------------------------------------- D9
def test_d9_status_shows_the_next_try_as_a_time_and_the_refusals(aws, capsys):
    iid = _launch(aws, "st9")
    clock = Clock()
    ec2 = Ec2(aws.client("ec2"), refuse={("g5.2xlarge", "spot"): "InsufficientInstanceCapacity"})
    _controller(aws, clock, ec2).handle(_interrupt(aws, iid)[-1])
    capsys.readouterr()
    rc, out, _ = _run(aws, "status", "st9", capsys=capsys)
    when = recovery.iso(clock.t0 + recovery.BACKOFF_BASE_S)
    assert rc == 0 and f"next try: {when}" in out and "next try in" not in out, out
    row = next(line for line in out.splitlines() if "InsufficientInstanceCapacity" in line)
    assert "g5.2xlarge" in row and "spot" in row and recovery.iso(clock.t0) in row


# ---------------------------------------------------------------------------------------------- D2
def test_d2_the_function_has_an_on_failure_queue_and_an_errors_alarm(templates):
    from tests.infra_helpers import resources

    t = templates["TrainingStack"]
    ((qid, _),) = resources(t, "AWS::SQS::Queue").items()
    (cfg,) = resources(t, "AWS::Lambda::EventInvokeConfig").values()
    dest = cfg["Properties"]["DestinationConfig"]["OnFailure"]["Destination"]
    assert dest == {"Fn::GetAtt": [qid, "Arn"]} and cfg["Properties"]["MaximumRetryAttempts"] == 2
    rules = [r for r in resources(t, "AWS::Events::Rule").values() if "recovery" in r["Properties"]["Description"]]
    assert all(r["Properties"]["Targets"][0]["DeadLetterConfig"]["Arn"] == {"Fn::GetAtt": [qid, "Arn"]} for r in rules)
    alarm = next(
        a["Properties"]
        for a in resources(t, "AWS::CloudWatch::Alarm").values()
        if a["Properties"].get("AlarmName", "").endswith("-recovery-failures")
    )
    names = {m.get("MetricStat", {}).get("Metric", {}).get("MetricName") for m in alarm["Metrics"]}
    assert {"Errors", "Throttles"} <= names
    assert alarm["Threshold"] == 1 and alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    # its actions are the monitoring stack's alarm topic (imported by its export)
    mon = templates["MonitoringStack"]
    exports = {o["Export"]["Name"]: o["Value"] for o in mon["Outputs"].values() if "Export" in o}
    ((topic_id, _),) = resources(mon, "AWS::SNS::Topic").items()
    for actions in (alarm["AlarmActions"], alarm["OKActions"]):
        ((action,),) = [actions]
        assert exports[action["Fn::ImportValue"]] == {"Ref": topic_id}


def test_handler_clients_retry_throttling_in_botocore_standard_mode(monkeypatch):
    """RequestLimitExceeded and 5xx are first retried inside the call by botocore's standard retry mode (exponential
    backoff with jitter, the EC2 API throttling guide's advice); only what still fails waits for the next tick."""
    import boto3

    class Built(Exception):
        pass

    seen = {}

    def client(name, **kw):
        seen[name] = kw.get("config")
        raise Built

    monkeypatch.setattr(boto3, "client", client)
    with pytest.raises(Built):
        recovery.handler({"detail-type": "Scheduled Event"})
    assert seen["ec2"].retries == {"mode": "standard", "max_attempts": 5}
