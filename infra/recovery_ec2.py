"""The EC2 calls of job recovery (infra/recovery.py) and of ``launch``/``stop`` (infra/cli/instances.py,
infra/cli/ec2_jobs.py): run a job's instance from its launch template, find live instances, read why an
instance ended (its ``StateReason``), and sort EC2 errors into capacity, transient and final.

``StateReason`` codes: EC2 API reference, "StateReason"
(https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_StateReason.html): ``Server.SpotInstanceTermination``
is the only one that means "EC2 took the spot instance back"; ``Client.UserInitiatedShutdown`` (the EC2 API:
``teardown``, ``stop``, a CloudWatch alarm's terminate/stop action) and ``Client.InstanceInitiatedShutdown``
(``shutdown -h`` inside the instance: the user data after a final exit or a failed boot step) are not.
``Server.InternalError`` and ``Server.InsufficientInstanceCapacity`` end an instance during its launch (EC2 ran out
of capacity or failed after accepting it): retried like a capacity refusal. ``Client.InternalError`` at launch is
what an encrypted EBS volume gives when the instance cannot use its KMS key (EC2 user guide, "Troubleshoot Amazon
EC2 instance launch issues", "Instance terminates immediately"): final.
Error codes: EC2 API reference, "Error codes for the Amazon EC2 API" (client errors, server errors,
``RequestLimitExceeded`` for request throttling). Eventual consistency: EC2 developer guide, "Eventual consistency
in the Amazon EC2 API": ``InvalidInstanceID.NotFound`` right after RunInstances "does not mean the instance does
not exist"; Describe calls are to be retried with backoff "up to a few minutes". boto3 only: the recovery function
imports this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from infra.cli.session import CAPACITY_ERRORS

#: Error codes of RunInstances that mean "no capacity / not at this price / not here": retried, then fallen back.
CAPACITY_CODES = frozenset(CAPACITY_ERRORS) | {"InsufficientCapacity", "SpotMaxPriceTooLow"}
#: Error codes that say "try again later" (throttling and EC2's own server errors): backed off, never final.
TRANSIENT_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "InternalError",
        "InternalFailure",
        "Unavailable",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestTimeout",
        "RequestExpired",
    }
)
#: Codes (or code prefixes/suffixes, below) of permission and configuration errors: the only final ones.
FINAL_CODES = frozenset(
    {"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "AuthFailure", "OptInRequired", "Blocked"}
)
#: The StateReason code of a spot reclaim: the one termination that recovery relaunches.
RECLAIM_CODE = "Server.SpotInstanceTermination"
#: StateReason codes of an instance EC2 ended during its launch for want of capacity or by its own fault: the
#: job goes back to the capacity ladder (backoff, fallback types, on-demand) as a refused RunInstances does.
LAUNCH_RETRY_CODES = frozenset({"Server.InternalError", "Server.InsufficientInstanceCapacity"})
#: StateReason code of an instance ended at launch because it could not use the KMS key of its encrypted EBS
#: volumes (no grant for the instance's role or EC2): final, the job fails naming it.
KMS_CODE = "Client.InternalError"
ON_DEMAND_DESCRIPTION = "trainstack on-demand fallback (spot options removed)"
LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


def error_code(err: BaseException) -> str:
    """The EC2 error code of a botocore error (``"<ExceptionName>"`` for errors without an answer, e.g. a
    connection timeout)."""
    if isinstance(err, ClientError):
        return err.response.get("Error", {}).get("Code", "") or "Unknown"
    return type(err).__name__


def error_kind(err: BaseException) -> str:
    """``"capacity"`` (:data:`CAPACITY_CODES`), ``"final"`` (permission or configuration: :data:`FINAL_CODES`,
    ``Invalid*``, ``*NotFound``, ``*.Malformed``, ``MissingParameter``) or ``"transient"`` (everything else:
    throttling, EC2 server errors, HTTP 5xx, no answer at all): only a final error ends a job."""
    code = error_code(err)
    if isinstance(err, BotoCoreError):
        return "transient"
    if code in CAPACITY_CODES:
        return "capacity"
    if code in TRANSIENT_CODES:
        return "transient"
    status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) if isinstance(err, ClientError) else 0
    if status >= 500:
        return "transient"
    if (
        code in FINAL_CODES
        or code.startswith("Invalid")
        or code.endswith(("NotFound", ".Malformed"))
        or code == "MissingParameter"
    ):
        return "final"
    return "transient"


@dataclass
class InstanceInfo:
    """What DescribeInstances says of one instance: ``state`` (``pending`` ... ``terminated``; ``"gone"`` when
    EC2 no longer knows the id), ``reason_code``/``reason`` (its StateReason code and message, empty when it has
    none) and ``tags`` (key -> value)."""

    state: str
    reason_code: str = ""
    reason: str = ""
    tags: Optional[dict] = None


class Unknown(Exception):
    """DescribeInstances did not answer (throttled, refused, no network): the instance's state is unknown, which
    is never the same as gone. ``code`` is the EC2 error code."""

    def __init__(self, instance_id: str, code: str) -> None:
        super().__init__(f"{instance_id}: state unknown (DescribeInstances: {code})")
        self.code = code


def describe_instance(ec2, instance_id: str, young: bool = False) -> InstanceInfo:
    """:class:`InstanceInfo` of ``instance_id``; ``state="gone"`` only when EC2 answers that the id does not exist
    (``InvalidInstanceID.NotFound``: terminated instances stay visible for about an hour) and the instance is not
    ``young`` (launched within the caller's grace period: then NotFound is eventual consistency, not an answer).
    Raises :class:`Unknown` for a young instance EC2 does not find yet and for every other error."""
    try:
        res = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    except ClientError as e:
        code = error_code(e)
        if code == "InvalidInstanceID.Malformed" or (code == "InvalidInstanceID.NotFound" and not young):
            return InstanceInfo("gone")
        raise Unknown(instance_id, code) from None
    except BotoCoreError as e:
        raise Unknown(instance_id, error_code(e)) from None
    found = [i for r in res for i in r["Instances"]]
    if not found:
        if young:
            raise Unknown(instance_id, "not listed yet")
        return InstanceInfo("gone")
    inst = found[0]
    sr = inst.get("StateReason") or {}
    return InstanceInfo(
        inst["State"]["Name"],
        sr.get("Code", ""),
        sr.get("Message", ""),
        {t["Key"]: t["Value"] for t in inst.get("Tags", [])},
    )


def on_demand_version(ec2, template_id: str) -> str:
    """A version of the launch template without spot options, made from the template's *current* default.

    A launch template's ``InstanceMarketOptions`` cannot be removed by RunInstances, so the fallback copies the
    default version's data without them into a new, non-default version described as
    ``<ON_DEMAND_DESCRIPTION> (from version N)``. It is reused only while N is still the default: after a
    redeploy (new default version: new AMI, user data, volume id) a fresh copy is made. Returns the version
    number as a string. Raises botocore ClientError from EC2.
    """
    default = ec2.describe_launch_template_versions(LaunchTemplateId=template_id, Versions=["$Default"])[
        "LaunchTemplateVersions"
    ][0]
    description = f"{ON_DEMAND_DESCRIPTION} (from version {default['VersionNumber']})"
    pages = ec2.get_paginator("describe_launch_template_versions").paginate(LaunchTemplateId=template_id)
    for v in (v for page in pages for v in page["LaunchTemplateVersions"]):
        if v.get("VersionDescription") == description:
            return str(v["VersionNumber"])
    data = dict(default["LaunchTemplateData"])
    data.pop("InstanceMarketOptions", None)
    made = ec2.create_launch_template_version(
        LaunchTemplateId=template_id, VersionDescription=description, LaunchTemplateData=data
    )
    return str(made["LaunchTemplateVersion"]["VersionNumber"])


def run_job_instance(
    ec2, template_id: str, tags: list[dict], market: str, client_token: Optional[str] = None
) -> tuple[str, str]:
    """Run one instance of a job from ``template_id``: its default version for ``market="spot"``, the
    spot-free copy (:func:`on_demand_version`) for ``"on-demand"``. ``tags`` go on the instance; the job and
    environment tags also on its volumes and spot request. ``client_token`` (at most 64 ASCII characters) makes
    the call idempotent: repeated with the same token and parameters, EC2 answers with the instance the first call
    made instead of making another (EC2 developer guide, "Ensuring idempotency in Amazon EC2 API requests").
    Returns (instance id, version). Raises botocore ClientError (capacity codes: :data:`CAPACITY_CODES`) or
    BotoCoreError (no answer: the instance may exist)."""
    version = "$Default" if market == "spot" else on_demand_version(ec2, template_id)
    small = [t for t in tags if t["Key"] in ("trainstack:env", "trainstack:job")]
    spec = [{"ResourceType": "instance", "Tags": tags}, {"ResourceType": "volume", "Tags": small}]
    if market == "spot":
        spec.append({"ResourceType": "spot-instances-request", "Tags": small})
    out = ec2.run_instances(
        LaunchTemplate={"LaunchTemplateId": template_id, "Version": version},
        MinCount=1,
        MaxCount=1,
        TagSpecifications=spec,
        **({"ClientToken": client_token} if client_token else {}),
    )
    return out["Instances"][0]["InstanceId"], version


@dataclass
class LiveInstance:
    """A job instance that is not terminated: ``id``, ``job`` (its ``trainstack:job`` tag), ``state``, ``kept``
    (tag ``trainstack:keep=true``), ``launched`` (LaunchTime, epoch seconds), ``type``, ``market``."""

    id: str
    job: str
    state: str
    kept: bool
    launched: float
    type: str
    market: str


def live_instances(ec2, env: str, job: Optional[str] = None) -> list[LiveInstance]:
    """The instances of ``job`` (of any job when None) in environment ``env`` that are not terminated (they may
    hold the data volume), in launch order. Raises botocore ClientError."""
    filters = [{"Name": "tag:trainstack:env", "Values": [env]}, {"Name": "instance-state-name", "Values": LIVE_STATES}]
    filters.append(
        {"Name": "tag:trainstack:job", "Values": [job]} if job else {"Name": "tag-key", "Values": ["trainstack:job"]}
    )
    pages = ec2.get_paginator("describe_instances").paginate(Filters=filters)
    out = []
    for i in (i for page in pages for r in page["Reservations"] for i in r["Instances"]):
        tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
        out.append(
            LiveInstance(
                i["InstanceId"],
                tags.get("trainstack:job", ""),
                i["State"]["Name"],
                tags.get("trainstack:keep") == "true",
                i["LaunchTime"].timestamp(),
                i.get("InstanceType", ""),
                "spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
            )
        )
    return sorted(out, key=lambda x: x.launched)


def live_job_instances(ec2, env: str, job: Optional[str] = None) -> list[str]:
    """Ids of :func:`live_instances`. Raises botocore ClientError."""
    return [i.id for i in live_instances(ec2, env, job)]


#: Seconds between TerminateInstances tries while EC2 answers NotFound for an instance it just made.
NEW_ID_WAITS_S = (1, 2, 4, 8)


def terminate_instances(ec2, instance_ids: list[str], sleep=time.sleep) -> list[dict]:
    """TerminateInstances of ``instance_ids``, tried again after :data:`NEW_ID_WAITS_S` seconds while EC2 answers
    ``InvalidInstanceID.NotFound``: right after RunInstances an id may not have reached every part of EC2 yet,
    which "does not mean the instance does not exist" (EC2 developer guide, "Eventual consistency in the Amazon
    EC2 API"); botocore does not retry that code. Returns the answer's ``TerminatingInstances`` (each with its
    ``PreviousState``). Raises botocore ClientError (NotFound after the last wait too)."""
    for wait in (*NEW_ID_WAITS_S, None):
        try:
            return ec2.terminate_instances(InstanceIds=instance_ids).get("TerminatingInstances", [])
        except ClientError as e:
            if wait is None or error_code(e) != "InvalidInstanceID.NotFound":
                raise
        sleep(wait)
