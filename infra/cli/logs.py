"""``logs``: the tail of an EC2 run's container log or a SageMaker job's log, from CloudWatch Logs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Optional

from botocore.exceptions import ClientError

from infra.cli.outputs import Outputs
from infra.cli.session import Aws, CliError, explain

SAGEMAKER_LOG_GROUP = "/aws/sagemaker/TrainingJobs"


def source(aws: Aws, outputs: Outputs, target: str) -> tuple[str, str]:
    """(log group, stream prefix) for an instance id (``i-...``) or a training job name."""
    if target.startswith("i-"):
        return outputs.train_log_group, f"{target}/"
    if target.startswith(f"trainstack-{aws.env}-"):
        return SAGEMAKER_LOG_GROUP, f"{target}/"
    raise CliError(
        f"{target!r} is neither an instance id (i-...) nor a training job of {aws.env}",
        "`python -m infra status` lists both",
    )


def tail(
    aws: Aws,
    outputs: Outputs,
    target: str,
    lines: int = 50,
    follow: bool = False,
    poll_s: float = 5.0,
    max_polls: Optional[int] = None,
    logs=None,
    sleep: Callable[[float], None] = time.sleep,
    streams: Optional[Callable[[], list[str]]] = None,
) -> Iterator[str]:
    """Yield the last ``lines`` log lines, then (``follow``) new ones every ``poll_s`` seconds. ``streams``
    (an EC2 job): called at every poll for the container log streams of its attempts so far, so the tail
    follows the job onto each relaunched instance."""
    logs = logs or aws.client("logs")
    group, prefix = (outputs.train_log_group, "") if streams else source(aws, outputs, target)
    start, seen, polls = 0, set(), 0
    while True:
        try:
            events = []
            kwargs = {"logGroupName": group, "startTime": start}
            if streams:
                kwargs["logStreamNames"] = streams()[-100:]  # FilterLogEvents takes at most 100 names
            else:
                kwargs["logStreamNamePrefix"] = prefix
            for page in logs.get_paginator("filter_log_events").paginate(**kwargs):
                events += page["events"]
        except ClientError as e:
            raise explain(e, f"reading {group}") from None
        fresh = sorted((e for e in events if e["eventId"] not in seen), key=lambda e: e["timestamp"])
        if polls == 0:
            fresh = fresh[-lines:]
        for e in fresh:
            seen.add(e["eventId"])
            start = max(start, e["timestamp"])
            yield e["message"].rstrip("\n")
        polls += 1
        if not follow or (max_polls is not None and polls >= max_polls):
            return
        sleep(poll_s)
