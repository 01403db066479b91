"""Writes of the CLI whose answer is lost (the call ran, the answer never came: botocore retries it) do not do
twice what they did once, in moto in-process.

A botocore ``needs-retry`` hook makes the client retry a call that succeeded, as it does after a 500 or a reset
(tests/e2e/faults.py injects the same fault into the emulated account's answers).

The job record's conditional write (``If-None-Match: *`` on create, ``If-Match`` on save) whose retry S3 refuses
with 412 because the first request already wrote it is taken as written, not as another writer's conflict.
(RunInstances needs nothing of ours: botocore fills its ``ClientToken``, an idempotency token in EC2's service
model, once per call, so the retry carries the same one.)
"""

from __future__ import annotations

import json

import boto3
import pytest
from moto import mock_aws

from infra import job_record as jr

REGION, BUCKET = "us-east-1", "trainstack-t-data"


def lose_first_answer(client, operation: str) -> list[dict]:
    """Make ``client`` retry the first successful ``operation`` once (its answer lost); returns the params of every
    request sent for it."""
    sent: list[dict] = []

    def retry_once(response, attempts, **_):
        if attempts == 1 and response is not None and response[0].status_code == 200:
            return 0  # retry now: the caller never saw the answer
        return None

    client.meta.events.register_first(
        f"needs-retry.{client.meta.service_model.endpoint_prefix}.{operation}", retry_once
    )
    client.meta.events.register(f"provide-client-params.*.{operation}", lambda params, **_: sent.append(dict(params)))
    return sent


@pytest.fixture
def session(monkeypatch):
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        s = boto3.Session(region_name=REGION)
        s.client("s3").create_bucket(Bucket=BUCKET)
        yield s


def test_a_record_create_whose_answer_was_lost_is_written_not_a_conflict(session):
    """The retried If-None-Match create got 412 (the first request had created it) and launch took it as another
    launch's record: it terminated its own instance and failed."""
    s3 = session.client("s3")
    sent = lose_first_answer(s3, "PutObject")
    record = {"job": "j1", "state": "running"}
    stored = jr.create(s3, BUCKET, record)
    assert len(sent) == 1 and stored.record == record  # one call to the client, two requests on the wire
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=jr.record_key("j1"))["Body"].read()) == record
    # If-Match save: the same; and a real conflict (another writer's bytes) is still a conflict
    stored.record["state"] = "stopped"
    assert jr.save(s3, BUCKET, stored).record["state"] == "stopped"
    other = session.client("s3")
    other.put_object(Bucket=BUCKET, Key=jr.record_key("j1"), Body=b'{"job": "j1", "state": "done"}')
    with pytest.raises(jr.Conflict):
        jr.save(session.client("s3"), BUCKET, stored)


def _job_with_one_open_attempt(session) -> tuple:
    """(ec2, s3, instance id): a running instance tagged as job j1 of environment t, and j1's record with one open
    attempt on it."""
    ec2, s3 = session.client("ec2"), session.client("s3")
    tags = [{"Key": "trainstack:env", "Value": "t"}, {"Key": "trainstack:job", "Value": "j1"}]
    iid = ec2.run_instances(
        ImageId="ami-12c6146b", MinCount=1, MaxCount=1, TagSpecifications=[{"ResourceType": "instance", "Tags": tags}]
    )["Instances"][0]["InstanceId"]
    record = jr.new_record("j1", "t", "g5.2xlarge", tags, {})
    record["attempts"].append({"instance_id": iid, "type": "g5.2xlarge", "market": "spot", "start": 0.0, "end": None,
                               "ended_by": None})  # fmt: skip
    jr.create(s3, BUCKET, record)
    return ec2, s3, iid


def test_stop_right_after_launch_survives_not_found_for_the_new_instance(session, monkeypatch):
    """stop's TerminateInstances got InvalidInstanceID.NotFound for an instance launched moments before (EC2's
    eventual consistency; botocore does not retry that code) and stop failed, leaving the instance running."""
    from types import SimpleNamespace

    from infra import recovery_ec2
    from infra.cli import ec2_jobs
    from infra.cli.outputs import Outputs
    from infra.cli.session import Aws

    monkeypatch.setattr(recovery_ec2, "NEW_ID_WAITS_S", (0,), raising=False)
    ec2, s3, iid = _job_with_one_open_attempt(session)
    refused = []

    def not_yet(params, **_):
        if not refused:
            refused.append(params)
            error = {"Code": "InvalidInstanceID.NotFound", "Message": f"The instance ID '{iid}' does not exist"}
            return SimpleNamespace(status_code=400, headers={}), {"Error": error}
        return None

    ec2.meta.events.register_first("before-call.ec2.TerminateInstances", not_yet)
    outputs = Outputs("t", BUCKET, "", "", "", "", "")
    said = ec2_jobs.stop(Aws(session, REGION, "123456789012", "t"), outputs, "j1", ec2=ec2, s3=s3)
    assert refused and f"terminated: {iid}" in said, said
    state = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated"), state


def test_stop_terminates_a_new_instance_the_filtered_listing_does_not_show_yet(session, monkeypatch):
    """stop listed the job's instances by tag; a DescribeInstances with filters may not show an instance launched
    moments before (eventual consistency), and stop closed its attempt as gone and left the instance running."""
    from types import SimpleNamespace

    from infra.cli import ec2_jobs
    from infra.cli.outputs import Outputs
    from infra.cli.session import Aws

    ec2, s3, iid = _job_with_one_open_attempt(session)

    def not_listed_yet(params, **_):
        if "Filter.1.Name" in (params.get("body") or {}):  # the tag-filtered listing (query form): not there yet
            return SimpleNamespace(status_code=200, headers={}), {"Reservations": []}
        return None

    ec2.meta.events.register_first("before-call.ec2.DescribeInstances", not_listed_yet)
    said = ec2_jobs.stop(Aws(session, REGION, "123456789012", "t"), Outputs("t", BUCKET, "", "", "", "", ""), "j1",
                         ec2=ec2, s3=s3)  # fmt: skip
    assert f"terminated: {iid}" in said and "closed the attempt" not in said, said
    state = ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated"), state
