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
from infra.recovery_ec2 import live_job_instances

_STEP = re.compile(r"^step=(\d+) ")
_RESUME = re.compile(r"resuming from \S*ckpt-(\d+)")


def load(aws: Aws, outputs: Outputs, job: str, s3=None) -> Optional[jr.Stored]:
    """The job's record, or None when ``job`` has none. Raises CliError when S3 refuses the read."""
    s3 = s3 or aws.client("s3")
    try:
        return jr.load(s3, outputs.bucket, job)
    except ClientError as e:
        raise explain(e, f"reading the record of job {job}") from None


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
    what it launched) and terminate its live instances. Returns what was done. Raises CliError when the job
    has no record or AWS refuses a call."""
    ec2, s3 = ec2 or aws.client("ec2"), s3 or aws.client("s3")
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
            ec2.terminate_instances(InstanceIds=live)
    except ClientError as e:
        raise explain(e, f"terminating the instances of job {job}") from None
    return f"stopped job {job} ({r['state']}); terminated: {' '.join(live) or '-'}"
