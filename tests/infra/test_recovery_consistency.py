"""Recovery under EC2's eventual consistency and lost answers, in moto with EventBridge's envelopes.

What moto does not do is injected with botocore event hooks on the controller's EC2 client: ``before-call``
raising what EC2 answers (``InvalidInstanceID.NotFound`` right after RunInstances, EC2 developer guide, "Eventual
consistency in the Amazon EC2 API"; ``RequestLimitExceeded`` on TerminateInstances), ``after-call`` raising a
read timeout after moto made the instance (an answer lost on the way back), ``before-call`` answering a repeated
client token with the first call's instance (EC2 developer guide, "Ensuring idempotency in Amazon EC2 API
requests"), ``after-call`` hiding a new instance from DescribeInstances. StateReasons of an instance EC2 ends at
launch (EC2 API reference, "StateReason") are set on moto's instance object (``_set_state_reason``).
"""

from __future__ import annotations

import json

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError, ReadTimeoutError

from infra import job_record as jr
from infra import recovery, recovery_settings
from infra.cli.main import main
from tests import moto_env
from tests.infra import test_recovery as base
from tests.infra.test_recovery import TICK, Clock, _controller, _launch, _live, _record, state, warning
from tests.infra.test_recovery_decisions import idle_alarm

pytestmark = pytest.mark.slow  # a moto deployment per test (CDK synthesis once per module)
templates, aws = base.templates, base.aws  # the same fixtures as tests/infra/test_recovery.py


def _error(code: str, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} (injected)"}, "ResponseMetadata": {}}, operation)


def _by_id(params: dict) -> bool:
    """A DescribeInstances request naming instance ids (the query body's ``InstanceId.N``), not a filter."""
    return any(k.startswith("InstanceId.") for k in params.get("body", {}))


def _hook(ctl: recovery.Controller, event: str, fn) -> None:
    ctl.ec2.real.meta.events.register(event, fn)


# ---------------------------------------------------------------------------------------------- unknown state
def test_not_found_for_a_young_attempt_is_unknown_and_decided_later(aws):
    """NotFound right after RunInstances "does not mean the instance does not exist": nothing final is written,
    no relaunch; once EC2 describes the instance again the job simply goes on."""
    iid = _launch(aws, "nf")
    clock = Clock()
    ctl = _controller(aws, clock)
    hidden = [True]

    def not_found(params, **_):
        if hidden[0] and _by_id(params):
            raise _error("InvalidInstanceID.NotFound", "DescribeInstances")

    _hook(ctl, "before-call.ec2.DescribeInstances", not_found)
    lines = ctl.handle(TICK)
    r = _record(aws, "nf")
    assert r["state"] == jr.RUNNING and r["attempts"][0]["end"] is None, lines
    assert any("state unknown (DescribeInstances: InvalidInstanceID.NotFound)" in line for line in lines), lines
    assert ctl.ec2.tried == [] and _live(aws, "nf") == [iid]
    hidden[0] = False
    clock.t += 60
    ctl.handle(TICK)
    assert _record(aws, "nf")["state"] == jr.RUNNING and _live(aws, "nf") == [iid]


def test_a_terminated_event_ec2_does_not_confirm_decides_nothing(aws):
    """The state-change event says terminated while DescribeInstances still shows the instance running with no
    StateReason: unknown. The tick decides when EC2 confirms (here: a spot reclaim, relaunched)."""
    iid = _launch(aws, "ev")
    ctl = _controller(aws, Clock())
    lines = ctl.handle(state(iid, "terminated"))
    r = _record(aws, "ev")
    assert r["state"] == jr.RUNNING and "EC2 still says running: unknown" in lines[0], lines
    assert not any("not relaunched" in m for m in base._topic_messages(aws))
    base._interrupt(aws, iid)  # EC2 now confirms: terminated, Server.SpotInstanceTermination
    assert any("relaunched as" in line for line in ctl.handle(TICK))
    assert len(_live(aws, "ev")) == 1 and _record(aws, "ev")["recoveries"] == 1


def test_a_termination_without_reason_or_warning_waits_the_grace(aws):
    """Spot notices are best effort: "no StateReason, no warning" is not read as a user's termination until the
    grace has passed since it was first seen."""
    from moto.ec2.models import ec2_backends

    iid = _launch(aws, "nr")
    clock = Clock()
    ctl = _controller(aws, clock)
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    ec2_backends[moto_env.ACCOUNT][moto_env.REGION].get_instance(iid).state_reason = None
    assert "no reason and no spot warning came: unknown" in ctl.handle(state(iid, "terminated"))[0]
    clock.t += 60
    ctl.handle(TICK)
    assert _record(aws, "nr")["state"] == jr.RUNNING
    clock.t += recovery_settings.UNKNOWN_GRACE_S
    ctl.handle(TICK)
    assert _record(aws, "nr")["state"] == jr.ENDED


# ---------------------------------------------------------------------------------------------- nothing left running
def test_a_throttled_terminate_at_the_cost_cap_is_retried_and_the_message_sent(aws):
    iid = _launch(aws, "thr", "--max-cost-usd", "1")
    clock = Clock()
    ctl = _controller(aws, clock)
    throttled = [True]

    def throttle(**_):
        if throttled[0]:
            raise _error("RequestLimitExceeded", "TerminateInstances")

    _hook(ctl, "before-call.ec2.TerminateInstances", throttle)
    clock.t += 10 * 3600
    lines = ctl.handle(TICK)
    assert "capped" in lines[0] and "RequestLimitExceeded" in lines[0], lines
    assert _record(aws, "thr")["state"] == jr.CAPPED and _live(aws, "thr") == [iid]
    assert sum("job thr stopped" in m for m in base._topic_messages(aws)) == 1
    lines = ctl.handle(TICK)  # still throttled: backs off
    r = _record(aws, "thr")
    assert r["terminate_rounds"] == 1 and r["terminate_next_at"] == clock.t + recovery.BACKOFF_BASE_S, lines
    throttled[0] = False
    ctl.handle(TICK)  # not due yet
    assert _live(aws, "thr") == [iid]
    clock.t += recovery.BACKOFF_BASE_S
    assert any("terminated" in line for line in ctl.handle(TICK))
    assert _live(aws, "thr") == [] and _record(aws, "thr")["terminate_rounds"] == 0
    assert sum("job thr stopped" in m for m in base._topic_messages(aws)) == 1


def test_a_stopped_job_whose_instance_still_runs_is_terminated_by_the_tick(aws):
    """``stop`` wrote ``stopped`` but its TerminateInstances never got through: the tick ends the instance."""
    iid = _launch(aws, "left")
    jr.end(aws.client("s3"), base._outputs(aws)["BucketName"], "left", jr.STOPPED, "stopped by `python -m infra stop`")
    ctl = _controller(aws, Clock())
    assert _live(aws, "left") == [iid]
    ctl.handle(TICK)
    assert _live(aws, "left") == [] and _record(aws, "left")["state"] == jr.STOPPED


# ---------------------------------------------------------------------------------------------- ended at launch
@pytest.mark.parametrize("code", ["Server.InternalError", "Server.InsufficientInstanceCapacity"])
def test_an_instance_ec2_ends_at_launch_goes_to_the_capacity_ladder(aws, code):
    iid = _launch(aws, "lf")
    clock = Clock()
    ctl = _controller(aws, clock)
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    base._set_state_reason(iid, (code, f"{code}: launch failed"))
    lines = ctl.handle(state(iid, "terminated"))
    r = _record(aws, "lf")
    assert r["state"] == jr.WAITING and r["capacity_rounds"] == 1, lines
    assert r["next_try_at"] == clock.t0 + recovery.BACKOFF_BASE_S and code in r["reason"]
    assert r["attempts"][0]["ended_by"] == code and r["refusals"]["g5.2xlarge spot"]["code"] == code
    ctl.handle(TICK)
    assert _live(aws, "lf") == []  # backing off
    clock.t += recovery.BACKOFF_BASE_S
    assert any("relaunched as" in line for line in ctl.handle(TICK))
    assert len(_live(aws, "lf")) == 1


def test_client_internal_error_at_launch_fails_naming_the_kms_key(aws):
    iid = _launch(aws, "kms")
    ctl = _controller(aws, Clock())
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    base._set_state_reason(iid, ("Client.InternalError", "Client.InternalError: Client error on launch"))
    ctl.handle(state(iid, "terminated"))
    ctl.handle(TICK)
    r = _record(aws, "kms")
    assert r["state"] == jr.FAILED and "KMS key of its encrypted EBS volumes" in r["reason"], r["reason"]
    assert "Client.InternalError" in r["reason"] and _live(aws, "kms") == []
    assert any("job kms failed" in m and "KMS key" in m for m in base._topic_messages(aws))


# ---------------------------------------------------------------------------------------------- lost answers
def _lose_first_answer(ctl: recovery.Controller) -> list[str]:
    """RunInstances' first answer is lost after moto made the instance (a read timeout); returns the ids made."""
    made: list[str] = []

    def lose(parsed, **_):
        iid = parsed["Instances"][0]["InstanceId"]
        if not made:
            made.append(iid)
            raise ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com/")
        if iid not in made:
            made.append(iid)

    _hook(ctl, "after-call.ec2.RunInstances", lose)
    return made


def test_a_lost_run_instances_answer_is_adopted_and_the_finished_job_not_launched_again(aws):
    old = _launch(aws, "lost")
    clock = Clock()
    ctl = _controller(aws, clock)
    made = _lose_first_answer(ctl)
    ctl.handle(base._interrupt(aws, old)[-1])
    (orphan,) = made
    r = _record(aws, "lost")
    assert r["state"] == jr.WAITING and _live(aws, "lost") == [orphan]
    token = r.get("launch", {}).get("g5.2xlarge spot")  # kept: the answer was lost, not a refusal
    clock.t += recovery.BACKOFF_BASE_S
    lines = ctl.handle(TICK)
    assert any(f"adopted {orphan}" in line for line in lines), lines
    assert token
    r = _record(aws, "lost")
    assert [a["instance_id"] for a in r["attempts"]] == [old, orphan] and r["state"] == jr.RUNNING
    assert _live(aws, "lost") == [orphan] and len(made) == 1 and r["recoveries"] == 1
    # the adopted attempt trains to its end: done, and never launched again
    bucket = base._outputs(aws)["BucketName"]
    key = jr.EXIT_KEY.format(job="lost", instance_id=orphan)
    aws.client("s3").put_object(Bucket=bucket, Key=key, Body=b'{"exit_code": 0}')
    aws.client("ec2").terminate_instances(InstanceIds=[orphan])
    base._set_state_reason(orphan, base.INSIDE)
    for _ in range(3):
        clock.t += recovery.BACKOFF_MAX_S
        ctl.handle(TICK)
    assert _record(aws, "lost")["state"] == jr.DONE and len(base._job_instances(aws, "lost")) == 2


def test_a_retry_reuses_the_client_token_so_an_unseen_instance_is_not_duplicated(aws):
    """The lost launch is not yet visible to DescribeInstances: the next round repeats RunInstances with the
    client token kept in the record, and EC2 answers with the instance the first call made."""
    old = _launch(aws, "tok")
    clock = Clock()
    ctl = _controller(aws, clock)
    made = _lose_first_answer(ctl)
    answers: dict[str, dict] = {}
    tokens: list[str] = []

    def idempotent(params, context, **_):  # EC2: the same token and parameters -> the first call's answer
        token = context["client_token"] = params["body"].get("ClientToken")
        tokens.append(token)
        if token in answers:
            return AWSResponse("https://ec2.us-east-1.amazonaws.com/", 200, {}, None), answers[token]
        return None

    def remember(parsed, context, **_):
        answers.setdefault(context["client_token"], parsed)

    def hide(parsed, **_):  # the new instance not yet listed (eventual consistency)
        for res in parsed.get("Reservations", []):
            res["Instances"] = [i for i in res["Instances"] if i["InstanceId"] not in made]

    _hook(ctl, "before-call.ec2.RunInstances", idempotent)
    ctl.ec2.real.meta.events.register_first("after-call.ec2.RunInstances", remember)
    _hook(ctl, "after-call.ec2.DescribeInstances", hide)
    ctl.handle(base._interrupt(aws, old)[-1])
    clock.t += recovery.BACKOFF_BASE_S
    ctl.handle(TICK)
    (orphan,) = made
    assert len(tokens) == 2 and tokens[0] and tokens[0] == tokens[1], tokens
    r = _record(aws, "tok")
    assert r["attempts"][-1]["instance_id"] == orphan and r["attempts"][-1]["client_token"] == tokens[0]
    assert r["launch"] == {} and len(base._job_instances(aws, "tok")) == 2


# ---------------------------------------------------------------------------------------------- late notices
def test_a_late_warning_never_reopens_a_stopped_or_done_job(aws, capsys):
    iid = _launch(aws, "late")
    ctl = _controller(aws, Clock())
    assert main(base.E + ["stop", "late"]) == 0
    assert "ignored" in ctl.handle(warning(iid))[0]
    base._set_state_reason(iid, base.RECLAIM)
    for ev in (state(iid, "terminated"), TICK):
        ctl.handle(ev)
    assert _record(aws, "late")["state"] == jr.STOPPED and _live(aws, "late") == []
    assert len(base._job_instances(aws, "late")) == 1
    done = _launch(aws, "fin")
    bucket = base._outputs(aws)["BucketName"]
    key = jr.EXIT_KEY.format(job="fin", instance_id=done)
    aws.client("s3").put_object(Bucket=bucket, Key=key, Body=b'{"exit_code": 0}')
    ctl.handle(TICK)
    assert _record(aws, "fin")["state"] == jr.DONE
    assert "ignored" in ctl.handle(warning(done))[0] and _record(aws, "fin")["state"] == jr.DONE


# ---------------------------------------------------------------------------------------------- low items
def test_a_redelivered_terminated_event_keeps_the_capacity_backoff(aws):
    iid = _launch(aws, "redo", "--on-demand-fallback")
    clock = Clock()
    ec2 = base.Ec2(aws.client("ec2"), refuse={("g5.2xlarge", "spot"): "InsufficientInstanceCapacity"})
    ctl = _controller(aws, clock, ec2)
    ev = base._interrupt(aws, iid)[-1]
    ctl.handle(ev)
    for _ in range(3):  # EventBridge delivers at least once
        clock.t += 5
        assert "already handled" in ctl.handle(ev)[0]
    assert ec2.tried == [("g5.2xlarge", "spot")] and _live(aws, "redo") == []
    assert _record(aws, "redo")["next_try_at"] == clock.t0 + recovery.BACKOFF_BASE_S


def test_a_leftover_idle_alarm_does_not_fail_a_job_waiting_for_capacity(aws):
    iid = _launch(aws, "idle")
    ec2 = base.Ec2(aws.client("ec2"), refuse={("g5.2xlarge", "spot"): "InsufficientInstanceCapacity"})
    ctl = _controller(aws, Clock(), ec2)
    ctl.handle(base._interrupt(aws, iid)[-1])
    assert "nothing to do" in ctl.handle(idle_alarm(iid))[0]
    assert _record(aws, "idle")["state"] == jr.WAITING


def test_an_unreadable_record_is_reported_once_and_the_others_go_on(aws, monkeypatch):
    """Not JSON, or a field missing: named, told once, the other jobs handled; only the first invocation fails,
    so the failure alarm goes back to OK."""
    good = _launch(aws, "good")
    o = base._outputs(aws)
    bucket, s3 = o["BucketName"], aws.client("s3")
    s3.put_object(Bucket=bucket, Key=jr.record_key("broken"), Body=b'{"job": "broken", "state": ')
    s3.put_object(Bucket=bucket, Key=jr.record_key("partial"), Body=b'{"job": "partial", "state": "running"}')
    aws.client("ec2").terminate_instances(InstanceIds=[good])
    base._set_state_reason(good, base.RECLAIM)
    for k, v in {
        "TRAINSTACK_ENV": moto_env.ENV,
        "TRAINSTACK_BUCKET": bucket,
        "TRAINSTACK_TOPIC_ARN": o["AlarmTopicArn"],
        "TRAINSTACK_VOLUME_ID": o["DataVolumeId"],
        "TRAINSTACK_LAUNCH_TEMPLATES": json.dumps({"g5.2xlarge": o["LaunchTemplateIdg52xlarge"]}),
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(recovery.RecoveryError) as raised:
        recovery.handler(TICK)
    assert "broken: skipped this tick: JSONDecodeError" in str(raised.value)
    assert "partial: skipped this tick: KeyError: record of job partial unreadable: lacks field" in str(raised.value)
    assert len(_live(aws, "good")) == 1 and _record(aws, "good")["recoveries"] == 1
    out = recovery.handler(TICK)["actions"]  # the next tick: logged, not failed
    assert sum("reported before" in line for line in out) == 2, out
    told = [m for m in base._topic_messages(aws) if "unreadable" in m]
    assert len(told) == 2 and any("job broken" in m for m in told) and any("job partial" in m for m in told)
