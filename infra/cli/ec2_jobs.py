"""``status JOB``, ``logs JOB`` and ``stop JOB`` for EC2 jobs: read (and for ``stop`` end) the job record that
``launch`` writes and the recovery controller keeps (infra/job_record.py, infra/recovery.py).

Time lost per interruption comes from the container log streams (``<instance id>/<job>`` in the train log
group, one per attempt): the interrupted attempt's last ``step=N`` line, the next attempt's
``checkpoint: resuming from ...ckpt-<step>`` line (the last durable checkpoint; else its first step - 1) and
its first ``step=`` line. These are the lines ``trainer/engine/logging.py`` and ``checkpoint.py`` print.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Optional

from botocore.exceptions import ClientError

from infra import job_record as jr
from infra.cli.outputs import Outputs
from infra.cli.session import Aws, CliError, explain
from infra.recovery import iso
from infra.recovery_ec2 import live_job_instances, terminate_instances

_STEP = re.compile(r"^step=(\d+) ")
_RESUME = re.compile(r"resuming from \S*ckpt-(\d+)")


def bad_record(aws: Aws, outputs: Outputs, job: str, what: str) -> CliError:
    """The error for a record that cannot be read (exit 2): its S3 key, what is wrong and what to do."""
    where = f"s3://{outputs.bucket}/{jr.record_key(job)}"
    return CliError(
        f"job {job}: record {where} {what}",
        f"fix or delete that object (the job's instances: `python -m infra --env {aws.env} status`)",
    )


def load(aws: Aws, outputs: Outputs, job: str, s3=None) -> Optional[jr.Stored]:
    """The job's record, or None when ``job`` has none. Raises CliError when S3 refuses the read, or (exit 2,
    :func:`bad_record`) when the record is not JSON or lacks what ``job_record.check`` checks."""
    s3 = s3 or aws.client("s3")
    try:
        return jr.load(s3, outputs.bucket, job)
    except ClientError as e:
        raise explain(e, f"reading the record of job {job}") from None
    except jr.Corrupt as e:
        raise bad_record(aws, outputs, job, str(e).split(": ", 1)[1]) from None


def overview(aws: Aws, outputs: Outputs, s3=None, now: Optional[float] = None) -> list[dict]:
    """One row per EC2 job of the environment (job, state, spend_usd, reason), newest records included; a
    record that cannot be read is a row of state ``unreadable`` whose reason says which key and why, and the
    others still come. Raises CliError when S3 refuses the listing."""
    s3, now = s3 or aws.client("s3"), time.time() if now is None else now
    try:
        names = jr.list_jobs(s3, outputs.bucket)
    except ClientError as e:
        raise explain(e, "listing the job records") from None
    rows = []
    for name in names:
        try:
            stored = load(aws, outputs, name, s3)
        except CliError as e:
            rows.append({"job": name, "state": "unreadable", "spend_usd": "?", "reason": e.message})
            continue
        if stored is not None:
            r = stored.record
            spend = f"{jr.spend_usd(r, now):.2f}"
            rows.append({"job": name, "state": r["state"], "spend_usd": spend, "reason": r["reason"]})
    return rows


def failure_queue_depth(outputs: Outputs, sqs) -> Optional[int]:
    """Messages waiting in the recovery's failure queue (``ApproximateNumberOfMessages``: visible ones; Amazon
    SQS API reference, "GetQueueAttributes"), or None when the stacks do not name the queue. Raises CliError
    when SQS refuses the read."""
    if not outputs.recovery_failure_queue_url:
        return None
    try:
        got = sqs.get_queue_attributes(
            QueueUrl=outputs.recovery_failure_queue_url, AttributeNames=["ApproximateNumberOfMessages"]
        )
    except ClientError as e:
        raise explain(e, "reading the recovery failure queue") from None
    return int(got["Attributes"]["ApproximateNumberOfMessages"])


def failure_queue_line(outputs: Outputs, depth: Optional[int]) -> Optional[str]:
    """What ``status`` says when the failure queue holds messages (None when it holds none)."""
    if not depth:
        return None
    url = outputs.recovery_failure_queue_url
    return (
        f"recovery failure queue: {depth} event(s) the recovery could not handle (the jobs they name were not "
        f"acted on); read them: aws sqs receive-message --queue-url {url} --max-number-of-messages 10; fix what "
        f"they say (the function's log: /aws/lambda/trainstack-{outputs.env}-recovery), then delete them "
        f"(aws sqs purge-queue --queue-url {url}); the alarm trainstack-{outputs.env}-recovery-failure-queue "
        "stays in ALARM until then"
    )


def stream_name(instance_id: str, job: str) -> str:
    """The container log stream of one attempt (the user data's ``awslogs-stream``)."""
    return f"{instance_id}/{job}"


def _steps(logs, group: str, stream: str) -> dict:
    """First/last ``step=`` line (step, epoch ms) and the resumed checkpoint step of one log stream."""
    out = {"first": None, "last": None, "resumed_at": None}
    try:
        pages = logs.get_paginator("filter_log_events").paginate(logGroupName=group, logStreamNames=[stream])
        events = [e for page in pages for e in page["events"]]
    except ClientError:
        return out
    for e in sorted(events, key=lambda e: e["timestamp"]):
        m = _STEP.match(e["message"])
        if m:
            point = (int(m.group(1)), e["timestamp"])
            out["first"] = out["first"] or point
            out["last"] = point
        r = _RESUME.search(e["message"])
        if r and out["resumed_at"] is None:
            out["resumed_at"] = int(r.group(1))
    return out


def _when(epoch: Optional[float]) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S")


def status(aws: Aws, outputs: Outputs, stored: jr.Stored, logs=None, now: Optional[float] = None) -> dict:
    """The job's state, its attempts (instance, type, market, start, end, why it ended), time lost per
    interruption (``steps_redone``: last step before it minus the checkpoint resumed from; ``idle_s``:
    seconds from that last step to the next attempt's first step) and spend so far (USD) against the cap."""
    logs = logs or aws.client("logs")
    r, now = stored.record, time.time() if now is None else now
    steps = [_steps(logs, outputs.train_log_group, stream_name(a["instance_id"], r["job"])) for a in r["attempts"]]
    lost = []
    for k in range(len(r["attempts"]) - 1):
        before, after = steps[k], steps[k + 1]
        if before["last"] is None or after["first"] is None:
            lost.append({"after": r["attempts"][k]["instance_id"], "steps_redone": None, "idle_s": None})
            continue
        resumed = after["resumed_at"] if after["resumed_at"] is not None else after["first"][0] - 1
        lost.append(
            {
                "after": r["attempts"][k]["instance_id"],
                "last_step": before["last"][0],
                "resumed_at_step": resumed,
                "steps_redone": max(0, before["last"][0] - resumed),
                "idle_s": round((after["first"][1] - before["last"][1]) / 1000.0, 1),
            }
        )
    return {
        "job": r["job"],
        "state": r["state"],
        "reason": r["reason"],
        "recover": r["recover"],
        "recoveries": f"{r['recoveries']} of {r['max_recoveries']}",
        "spend_usd": round(jr.spend_usd(r, now), 2),
        "max_cost_usd": r["max_cost_usd"],
        "next_try_at": iso(r["next_try_at"]) if r["state"] == jr.WAITING else None,
        "refusals": [
            {"type": k.split(" ")[0], "market": k.split(" ")[-1], "code": v["code"], "at": iso(v["at"])}
            for k, v in sorted(r.get("refusals", {}).items())
        ],
        "attempts": [
            {
                "instance_id": a["instance_id"],
                "type": a["type"],
                "market": a["market"],
                "start": _when(a["start"]),
                "end": _when(a["end"]),
                "ended_by": a["ended_by"] or ("-" if a["end"] is None else "?"),
            }
            for a in r["attempts"]
        ],
        "time_lost": lost,
    }


def print_status(info: dict, table) -> None:
    """Print :func:`status` for people; ``table(rows, cols)`` prints a table (infra.cli.main)."""
    cap = f"${info['max_cost_usd']:.2f}" if info["max_cost_usd"] is not None else "no cap"
    print(f"job {info['job']}: {info['state']} ({info['reason']})")
    print(f"recovery: {'on' if info['recover'] else 'off (--no-recover)'}, recoveries {info['recoveries']}")
    print(f"spend so far: ${info['spend_usd']:.2f} of {cap} (catalog price x hours)")
    if info["next_try_at"]:
        print(f"next try: {info['next_try_at']}")
    if info["refusals"]:
        print("last refusal per type and market:")
        table(info["refusals"], ["type", "market", "code", "at"])
    print("attempts:")
    table(info["attempts"], ["instance_id", "type", "market", "start", "end", "ended_by"])
    print("time lost per interruption:")
    rows = [
        {
            **x,
            "steps_redone": "?" if x["steps_redone"] is None else x["steps_redone"],
            "idle_s": "?" if x["idle_s"] is None else x["idle_s"],
        }
        for x in info["time_lost"]
    ]
    table(rows, ["after", "last_step", "resumed_at_step", "steps_redone", "idle_s"])


def stop(aws: Aws, outputs: Outputs, job: str, ec2=None, s3=None) -> str:
    """Mark the job ``stopped`` (the controller then relaunches nothing, and a relaunch in flight terminates
    what it launched), terminate its live instances and close the attempts whose instance is already gone
    (:func:`close_gone_attempts`: no state-change event will come for them, and an open attempt's spend grows
    with the clock). Returns what was done. Raises CliError when the job has no record, its record cannot be
    read (exit 2, before anything changes) or AWS refuses a call."""
    ec2, s3 = ec2 or aws.client("ec2"), s3 or aws.client("s3")
    load(aws, outputs, job, s3)
    try:
        r = jr.end(s3, outputs.bucket, job, jr.STOPPED, "stopped by `python -m infra stop`")
    except jr.Conflict:
        raise CliError(f"job {job}: its record kept changing", "rerun the stop", code=75) from None
    except ClientError as e:
        raise explain(e, f"stopping job {job}") from None
    if r is None:
        raise CliError(f"no EC2 job {job!r} in environment {aws.env}", "`python -m infra status` lists them")
    try:
        live = live_job_instances(ec2, aws.env, job)
        if live:
            terminate_instances(ec2, live)  # a job stopped right after its launch: EC2 may not know the id yet
        unseen = [a["instance_id"] for a in r["attempts"] if a["end"] is None and a["instance_id"] not in live]
        live += terminate_unseen(ec2, unseen)
        closed = close_gone_attempts(s3, outputs.bucket, job, live, ec2)
    except ClientError as e:
        raise explain(e, f"terminating the instances of job {job}") from None
    except jr.Conflict:
        raise CliError(f"job {job}: its record kept changing", "rerun the stop", code=75) from None
    gone = f"; closed the attempt of {' '.join(closed)} (instance already gone)" if closed else ""
    return f"stopped job {job} ({r['state']}); terminated: {' '.join(live) or '-'}{gone}"


def terminate_unseen(ec2, instance_ids: list[str]) -> list[str]:
    """Terminate, one by one, the instances of open attempts that the tag-filtered listing did not show, and return
    those that were still running: a filtered DescribeInstances may not show an instance launched moments before
    (EC2 developer guide, "Eventual consistency in the Amazon EC2 API"), and TerminateInstances of one already
    terminated is a no-op. An id EC2 still does not know after :data:`~infra.recovery_ec2.NEW_ID_WAITS_S` is gone
    (EC2 forgets terminated instances after about an hour). Raises botocore ClientError."""
    stopped = []
    for iid in instance_ids:
        try:
            got = terminate_instances(ec2, [iid])
        except ClientError as e:
            if e.response.get("Error", {}).get("Code", "") == "InvalidInstanceID.NotFound":
                continue
            raise
        if any(c["PreviousState"]["Name"] not in ("shutting-down", "terminated") for c in got):
            stopped.append(iid)
    return stopped


_GMT = re.compile(r"\((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) GMT\)")


def ended_at(ec2, instance_id: str) -> Optional[float]:
    """When EC2 says ``instance_id`` was terminated (epoch seconds), or None when it does not say: the time in
    a terminated instance's ``StateTransitionReason`` ("User initiated (YYYY-MM-DD HH:MM:SS GMT)"; EC2 API
    reference, "Instance"; EC2 keeps terminated instances visible for about an hour, then NotFound).
    Raises botocore ClientError other than NotFound."""
    try:
        res = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    except ClientError as e:
        if e.response.get("Error", {}).get("Code", "").startswith("InvalidInstanceID"):
            return None
        raise
    for inst in (i for r in res for i in r["Instances"]):
        m = _GMT.search(inst.get("StateTransitionReason") or "")
        if inst["State"]["Name"] == "terminated" and m:
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    return None


def close_gone_attempts(
    s3, bucket: str, job: str, live: list[str], ec2, now: Optional[float] = None, tries: int = 10
) -> list[str]:
    """End the open attempts of ``job`` whose instance is not in ``live`` (terminated, or no longer known to
    EC2): ``end`` = the termination time EC2 gives (:func:`ended_at`) or ``now``, ``ended_by`` = ``gone``.
    A conditional write, read again when another writer came in between. Returns the instance ids closed.
    Raises :class:`infra.job_record.Conflict` when the record kept changing, botocore ClientError."""
    for _ in range(tries):
        stored = jr.load(s3, bucket, job)
        if stored is None:
            return []
        gone = [a for a in stored.record["attempts"] if a["end"] is None and a["instance_id"] not in live]
        if not gone:
            return []
        for a in gone:
            at = ended_at(ec2, a["instance_id"])
            a["end"] = max(a["start"], at if at is not None else (time.time() if now is None else now))
            a["ended_by"] = a["ended_by"] or "gone"
        try:
            jr.save(s3, bucket, stored)
        except jr.Conflict:
            continue
        return [a["instance_id"] for a in gone]
    raise jr.Conflict(job)


def refuse_kept_instance(aws: Aws, job: str, ec2) -> None:
    """Raise CliError (exit 2) when an instance tagged with ``job`` still lives (a kept or stopped instance of
    its last run): it holds the environment's data volume, so a new instance of the job could not attach it.
    Raises CliError when EC2 refuses the listing."""
    try:
        live = live_job_instances(ec2, aws.env, job)
    except ClientError as e:
        raise explain(e, f"listing the instances of job {job}") from None
    if live:
        raise CliError(
            f"job {job}: its instance {live[0]} (kept or stopped, of its last run) still holds the data volume",
            f"`python -m infra --env {aws.env} stop {job}` terminates it (the volume and checkpoints stay), then "
            "launch again; or pick another --job",
        )
