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
