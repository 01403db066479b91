"""The CLI around EC2 job records, in moto: a record that cannot be read is one line (its S3 key, what is wrong)
and exit 2, never a traceback, and ``status`` still lists the other jobs; ``stop`` of a job whose instance is
already gone closes its attempt (spend stops growing); ``launch`` of a job whose kept instance still holds the
data volume is refused before anything is created; ``status`` says when the recovery's failure queue holds
messages, and an alarm on that queue's depth tells the alarm topic.
"""

from __future__ import annotations

import json
import time

import pytest

from infra import job_record as jr
from infra.cli.main import main
from tests import moto_env
from tests.infra import test_recovery as base
from tests.infra.test_recovery import E, _launch, _live, _outputs, _record

pytestmark = pytest.mark.slow  # a moto deployment per test (CDK synthesis once per module)
templates, aws = base.templates, base.aws  # the same fixtures as tests/infra/test_recovery.py


def _run(*argv: str, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(E + list(argv))
    got = capsys.readouterr()
    return rc, got.out, got.err


def _put_record(aws, job: str, body: bytes) -> str:
    bucket = _outputs(aws)["BucketName"]
    aws.client("s3").put_object(Bucket=bucket, Key=jr.record_key(job), Body=body)
    return f"s3://{bucket}/{jr.record_key(job)}"


@pytest.mark.parametrize(
    "body, what",
    [
        (b'{"job": "bad", "state": "runn', "is not JSON"),
        (json.dumps({"job": "bad", "state": "running"}).encode(), "lacks field 'reason'"),
        (b"[1, 2]", "is a JSON list"),
    ],
)
def test_a_corrupt_record_is_one_line_and_exit_2_and_status_lists_the_other_jobs(aws, capsys, body, what):
    """A record that is not JSON or lacks fields crashed `status JOB` and `stop JOB` with a traceback."""
    _launch(aws, "good")
    where = _put_record(aws, "bad", body)
    for argv in (["status", "bad"], ["stop", "bad"]):
        rc, out, err = _run(*argv, capsys=capsys)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1, (argv, out, err)
        assert where in err and what in err and "Traceback" not in err, err
    rc, out, err = _run("status", capsys=capsys)
    assert rc == 0, err
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith(("good ", "bad "))}
    assert "running" in rows["good"] and "unreadable" in rows["bad"] and where in rows["bad"], out
    rc, out, _ = _run("status", "--json", capsys=capsys)
    jobs = {j["job"]: j for j in json.loads(out)["ec2_jobs"]}
    assert jobs["good"]["state"] == "running" and jobs["bad"]["state"] == "unreadable"


def test_stop_of_a_job_whose_instance_is_gone_closes_the_attempt(aws, capsys):
    """`stop` of a job whose instance had already ended (no state-change event left to close its attempt) left
    the attempt open: its spend grew with the clock for ever."""
    iid = _launch(aws, "gone")
    aws.client("ec2").terminate_instances(InstanceIds=[iid])
    rc, out, err = _run("stop", "gone", capsys=capsys)
    assert rc == 0 and f"closed the attempt of {iid}" in out, (out, err)
    (att,) = _record(aws, "gone")["attempts"]
    assert att["end"] is not None and att["end"] <= time.time() + 1 and att["ended_by"] == "gone", att
    rec = _record(aws, "gone")
    assert jr.spend_usd(rec, time.time()) == jr.spend_usd(rec, time.time() + 100 * 3600)


def test_launch_of_a_job_whose_kept_instance_holds_the_volume_is_refused(aws, capsys):
    """A job kept up after it finished (record `done`, instance alive) was launched again: a second instance of
    the job, waiting for a data volume the first still holds."""
    iid = _launch(aws, "kept", "--keep")
    stored = jr.load(aws.client("s3"), _outputs(aws)["BucketName"], "kept")
    stored.record["state"], stored.record["reason"] = jr.DONE, "exit 0; instance kept up (--keep)"
    jr.save(aws.client("s3"), _outputs(aws)["BucketName"], stored)
    rc, out, err = _run("launch", "g5.2xlarge", "--job", "kept", capsys=capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and iid in err and "stop kept" in err, (out, err)
    assert _live(aws, "kept") == [iid] and _record(aws, "kept")["state"] == jr.DONE


def test_status_says_when_the_failure_queue_holds_messages(aws, capsys):
    rc, out, _ = _run("status", capsys=capsys)
    assert rc == 0 and "failure queue" not in out
    url = _outputs(aws)["RecoveryFailureQueueUrl"]
    for n in range(3):
        aws.client("sqs").send_message(QueueUrl=url, MessageBody=json.dumps({"requestContext": {"n": n}}))
    rc, out, _ = _run("status", capsys=capsys)
    (line,) = [x for x in out.splitlines() if "failure queue" in x]
    assert rc == 0 and "3 event(s)" in line and f"receive-message --queue-url {url}" in line and "purge-queue" in line
    rc, out, _ = _run("status", "--json", capsys=capsys)
    assert json.loads(out)["recovery_failures"] == 3


def test_the_failure_queue_depth_alarms_to_the_topic(templates):
    """Nothing alarmed on the failure queue: events the recovery could not handle waited there unseen."""
    from tests.infra_helpers import resources

    t = templates["TrainingStack"]
    ((qid, _),) = resources(t, "AWS::SQS::Queue").items()
    alarms = {a["Properties"]["AlarmName"]: a["Properties"] for a in resources(t, "AWS::CloudWatch::Alarm").values()}
    q = alarms[f"trainstack-{moto_env.ENV}-recovery-failure-queue"]
    assert q["MetricName"] == "ApproximateNumberOfMessagesVisible" and q["Namespace"] == "AWS/SQS"
    assert q["Dimensions"] == [{"Name": "QueueName", "Value": {"Fn::GetAtt": [qid, "QueueName"]}}]
    assert q["Threshold"] == 0 and q["ComparisonOperator"] == "GreaterThanThreshold"
    assert q["TreatMissingData"] == "notBreaching"
    fn = alarms[f"trainstack-{moto_env.ENV}-recovery-failures"]
    assert q["AlarmActions"] == fn["AlarmActions"] and q["OKActions"] == fn["OKActions"]  # the same topic
