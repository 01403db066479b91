"""EC2 side of the CLI: launch from the stack's spot launch template, list, stop, and the teardown sweep.

The job is described by instance tags that the launch template's user data reads through IMDS
(``trainstack:job``, ``trainstack:config``, ``trainstack:image-tag``, ``trainstack:args``, ``trainstack:keep``);
every instance, volume and spot request also carries ``trainstack:env`` so that ``teardown`` finds them.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Optional

from botocore.exceptions import ClientError, WaiterError

import catalog
from infra import job_record as jr
from infra.cli.ec2_jobs import load as load_record
from infra.cli.ec2_jobs import refuse_kept_instance
from infra.cli.outputs import Outputs, image_exists
from infra.cli.session import CAPACITY_ERRORS, Aws, CliError, explain
from infra.recovery_ec2 import on_demand_version, run_job_instance  # noqa: F401  (on_demand_version: re-exported)

LIVE_STATES = ["pending", "running", "stopping", "stopped"]
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass
class Launched:
    """``instance_id``, launch template ``version`` used, ``market`` ("spot" or "on-demand")."""

    instance_id: str
    version: str
    market: str


def check_request(instance_type: str, job: str, fallback_types: tuple[str, ...] = ()) -> None:
    """The checks of :func:`launch` that need no AWS call: the job name, ``instance_type`` being an EC2
    type of the catalog, and each ``fallback_types`` entry an EC2 type of the catalog other than it.
    Raises CliError (or catalog.CatalogError listing the known types)."""
    for name in fallback_types:
        known = catalog.names("ec2")
        if name not in known or name == instance_type:
            raise CliError(
                f"--fallback-types {name!r}: expected EC2 types of the catalog other than {instance_type}, "
                f"comma-separated (known: {', '.join(known)})"
            )
    if not _JOB_RE.match(job):
        raise CliError(f"job name {job!r}: expected 1-63 letters, digits, '.', '_' or '-'")
    if catalog.get(instance_type).platform != "ec2":
        ec2_type = instance_type.removeprefix("ml.")
        raise CliError(
            f"{instance_type} is a SageMaker type; launch runs EC2 types",
            f"`python -m infra submit --machine train-{ec2_type.replace('.', '-')} ...`, or launch {ec2_type}",
        )


def _tags(env: str, job: str, config: str, image_tag: str, digest: str, args: str, keep: bool) -> list[dict]:
    tags = {
        "Name": f"trainstack-{env}-{job}",
        "trainstack:env": env,
        "trainstack:job": job,
        "trainstack:config": config,
        "trainstack:image-tag": image_tag,
        "trainstack:image-digest": digest,
        "trainstack:keep": str(keep).lower(),
    }
    if args:
        tags["trainstack:args"] = args
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def check_offered(ec2, instance_type: str, az: str) -> None:
    """Raise CliError when EC2 does not offer ``instance_type`` in ``az`` (AZ names differ per account: the
    default ``<region>a`` may have no p4d), naming the AZs that do. A refused or failed lookup skips the check
    (the launch then reports what EC2 says)."""
    if not az:
        return
    try:
        found = ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}]
        )["InstanceTypeOfferings"]
    except ClientError:
        return
    zones = sorted({o["Location"] for o in found})
    if az not in zones:
        raise CliError(
            f"{instance_type} is not offered in {az}, the AZ of this environment's data volume "
            f"(offered in: {', '.join(zones) or 'no AZ of this region'})",
            "redeploy the environment in one of those AZs (-c availability_zone=...; the data volume "
            "moves only through a snapshot), or launch another type",
        )


def launch(
    aws: Aws,
    outputs: Outputs,
    instance_type: str,
    job: str,
    config: str,
    image_tag: str,
    args: str = "",
    keep: bool = False,
    on_demand_fallback: bool = False,
    ec2=None,
    ecr=None,
    recover: bool = True,
    fallback_types: tuple[str, ...] = (),
    max_recoveries: int = 10,
    max_cost_usd: Optional[float] = None,
    s3=None,
) -> Launched:
    """Run one instance from the stack's launch template for ``instance_type`` (spot unless it falls back),
    running ``image_tag`` pinned to its digest, and write the job's record (infra/job_record.py) that the
    recovery controller (infra/recovery.py) relaunches it from: ``recover``, ``fallback_types`` (each with a
    launch template and offered in the data volume's AZ), ``on_demand_fallback``, ``max_recoveries``,
    ``max_cost_usd`` (USD, catalog price x hours), and the catalog prices of every type it may run.

    Raises CliError for a bad job name, a type without a launch template or not offered in the environment's
    AZ, a job of that name that is still running or recovering or whose kept instance still holds the data
    volume (next: stop it), a record of that name that cannot be read, an image tag not in the
    repository (next: push-image), or capacity/spot errors (with the next option) when no fallback is asked
    for or the fallback fails too.
    """
    check_request(instance_type, job, fallback_types)
    ec2 = ec2 or aws.client("ec2")
    s3 = s3 or aws.client("s3")
    template_id = outputs.launch_template(instance_type)
    check_offered(ec2, instance_type, outputs.availability_zone)
    for name in fallback_types:
        outputs.launch_template(name)
        check_offered(ec2, name, outputs.availability_zone)
    old = load_record(aws, outputs, job, s3)
    if old is not None and old.record["state"] not in jr.FINAL_STATES:
        raise CliError(
            f"job {job} is {old.record['state']} ({old.record['reason']})",
            f"`python -m infra --env {aws.env} stop {job}` first, or pick another --job",
        )
    refuse_kept_instance(aws, job, ec2)
    # The instance runs the image by digest (tag trainstack:image-digest, read by the user data into
    # /etc/trainstack.env), so every restart of the job after exit 75 runs the image it started with.
    digest = image_exists(aws, outputs, image_tag, ecr)
    other = other_running_job(aws, outputs, job, ec2, s3)
    if other is not None:
        raise CliError(
            f"job {other[0]} is {other[1]} in environment {aws.env}: one job per environment (its data volume "
            "has one writer)",
            f"`python -m infra --env {aws.env} stop {other[0]}` first, or launch in another environment",
        )
    tags = _tags(aws.env, job, config, image_tag, digest, args, keep)
    try:
        got = Launched(*run_job_instance(ec2, template_id, tags, "spot"), market="spot")
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if not (on_demand_fallback and code in CAPACITY_ERRORS):
            raise explain(e, f"launching spot {instance_type}", instance_type) from None
        try:
            got = Launched(*run_job_instance(ec2, template_id, tags, "on-demand"), market="on-demand")
        except ClientError as e:
            raise explain(
                e, f"launching on-demand {instance_type} (after the spot launch failed)", instance_type
            ) from None
    prices = {
        t: {"spot": catalog.get(t).spot.usd_per_hour, "on-demand": catalog.get(t).on_demand.usd_per_hour}
        for t in (instance_type, *fallback_types)
    }
    record = jr.new_record(
        job,
        aws.env,
        instance_type,
        tags,
        prices,
        recover=recover,
        fallback_types=fallback_types,
        on_demand_fallback=on_demand_fallback,
        max_recoveries=max_recoveries,
        max_cost_usd=max_cost_usd,
    )
    record["attempts"].append(
        {
            "instance_id": got.instance_id,
            "type": instance_type,
            "market": got.market,
            "version": got.version,
            "start": time.time(),
            "end": None,
            "ended_by": None,
            "warned_at": None,
        }
    )
    try:
        jr.replace(s3, outputs.bucket, record) if old else jr.create(s3, outputs.bucket, record)
    except (ClientError, jr.Conflict) as e:
        ec2.terminate_instances(InstanceIds=[got.instance_id])
        raise CliError(
            f"job {job}: its record could not be written ({e}); {got.instance_id} was terminated again",
            "rerun the launch",
        ) from None
    return got


def other_running_job(aws: Aws, outputs: Outputs, job: str, ec2, s3) -> Optional[tuple[str, str]]:
    """(name, what it is doing) of a job other than ``job`` that may still write the environment's data volume:
    one whose record is not final, or a live instance tagged with another job. None when there is none. A record
    that cannot be parsed is passed over (the recovery tick reports it). Raises CliError when AWS refuses a call."""
    try:
        for name, record in jr.unfinished(s3, outputs.bucket):
            if name != job and record is not None:
                return name, str(record["state"])
    except ClientError as e:
        raise explain(e, "reading the job records of the environment") from None
    for inst in list_instances(aws, ec2):
        if inst["job"] not in ("-", job):
            return inst["job"], f"running on {inst['instance_id']}"
    return None


def list_instances(aws: Aws, ec2=None) -> list[dict]:
    """This environment's live instances: id, type, state, market, job, launch time, AZ."""
    ec2 = ec2 or aws.client("ec2")
    try:
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[
                {"Name": "tag:trainstack:env", "Values": [aws.env]},
                {"Name": "instance-state-name", "Values": LIVE_STATES},
            ]
        )
        found = [i for page in pages for r in page["Reservations"] for i in r["Instances"]]
    except ClientError as e:
        raise explain(e, "listing instances") from None
    out = []
    for i in found:
        tags = {t["Key"]: t["Value"] for t in i.get("Tags", [])}
        out.append(
            {
                "instance_id": i["InstanceId"],
                "type": i["InstanceType"],
                "state": i["State"]["Name"],
                "market": "spot" if i.get("InstanceLifecycle") == "spot" else "on-demand",
                "job": tags.get("trainstack:job", "-"),
                "launch_time": i["LaunchTime"],
                "az": i.get("Placement", {}).get("AvailabilityZone", "-"),
            }
        )
    return out


def stop_instance(aws: Aws, instance_id: str, ec2=None, outputs: Optional[Outputs] = None, s3=None) -> str:
    """Stop an on-demand instance, terminate a spot one (one-time spot cannot be stopped). Returns the action.
    When it is the current attempt of a job, the job's record is marked ``stopped`` first (infra/job_record.py
    ``end``), so that recovery does not bring it back.

    Raises CliError if the instance is not this environment's, or AWS refuses a call.
    """
    ec2 = ec2 or aws.client("ec2")
    mine = {i["instance_id"]: i for i in list_instances(aws, ec2)}
    if instance_id not in mine:
        raise CliError(
            f"{instance_id} is not a live instance of environment {aws.env}", "`python -m infra status` lists them"
        )
    job = mine[instance_id]["job"]
    if outputs is not None and outputs.bucket and job != "-":
        s3 = s3 or aws.client("s3")
        try:
            stored = jr.load(s3, outputs.bucket, job)
            if stored is not None and (jr.current(stored.record) or {}).get("instance_id") == instance_id:
                jr.end(s3, outputs.bucket, job, jr.STOPPED, f"stopped by `python -m infra stop {instance_id}`")
        except jr.Conflict:
            raise CliError(f"job {job}: its record kept changing", "rerun the stop", code=75) from None
        except ClientError as e:
            raise explain(e, f"stopping job {job}") from None
    try:
        if mine[instance_id]["market"] == "spot":
            ec2.terminate_instances(InstanceIds=[instance_id])
            return "terminated"
        ec2.stop_instances(InstanceIds=[instance_id])
        return "stopped"
    except ClientError as e:
        raise explain(e, f"stopping {instance_id}") from None


def idle_alarm_prefix(env: str) -> str:
    """Name prefix of an environment's per-instance idle alarms (``<prefix><instance id>``), as the user data
    creates them (infra.stacks.monitoring.idle_alarm_name)."""
    return f"trainstack-{env}-gpu-idle-"


def end_jobs(aws: Aws, outputs: Optional[Outputs], apply: bool, s3=None) -> list[str]:
    """The EC2 jobs of this environment whose record is not final; with ``apply`` each is marked ``stopped``
    first (infra/job_record.py ``end``), so that the recovery controller relaunches none of the instances
    ``teardown`` then terminates. A record that cannot be parsed is listed and left alone. Raises CliError when
    AWS refuses a call."""
    if outputs is None or not outputs.bucket:
        return []
    s3 = s3 or aws.client("s3")
    found = []
    try:
        for name, record in jr.unfinished(s3, outputs.bucket):
            found.append(name if record is not None else f"{name}(unreadable record)")
            if apply and record is not None:
                jr.end(s3, outputs.bucket, name, jr.STOPPED, "stopped by `python -m infra teardown`")
    except jr.Conflict as e:
        raise CliError(f"job {e}: its record kept changing", "rerun the teardown", code=75) from None
    except ClientError as e:
        raise explain(e, "stopping the jobs of the environment") from None
    return found


def sweep(aws: Aws, outputs: Optional[Outputs], apply: bool, ec2=None, cw=None) -> dict[str, list[str]]:
    """Find (and with ``apply`` remove) what keeps billing: the EC2 jobs (marked ``stopped`` first:
    :func:`end_jobs`), live instances, open spot requests and unattached volumes of this environment, and its
    per-instance idle alarms (all of them: the instances go too). The data volume (``trainstack:role=data`` or
    the stack's volume id) is never touched.
    Returns {"jobs": [...], "instances": [...], "spot_requests": [...], "volumes": [...], "alarms": [...]}.
    Raises CliError when AWS refuses a call.
    """
    jobs = end_jobs(aws, outputs, apply)
    ec2 = ec2 or aws.client("ec2")
    cw = cw or aws.client("cloudwatch")
    env_filter = [{"Name": "tag:trainstack:env", "Values": [aws.env]}]
    try:
        instances = [i["instance_id"] for i in list_instances(aws, ec2)]
        requests = [
            r["SpotInstanceRequestId"]
            for r in ec2.describe_spot_instance_requests(
                Filters=env_filter + [{"Name": "state", "Values": ["open", "active"]}]
            )["SpotInstanceRequests"]
        ]
        vols = ec2.describe_volumes(Filters=env_filter + [{"Name": "status", "Values": ["available"]}])["Volumes"]
        data_ids = {outputs.volume_id} if outputs and outputs.volume_id else set()
        volumes = [
            v["VolumeId"]
            for v in vols
            if v["VolumeId"] not in data_ids
            and {t["Key"]: t["Value"] for t in v.get("Tags", [])}.get("trainstack:role") != "data"
        ]
        own_alarm = re.compile(re.escape(idle_alarm_prefix(aws.env)) + r"i-[0-9a-f]+")
        alarms = [
            a["AlarmName"]
            for page in cw.get_paginator("describe_alarms").paginate(
                AlarmNamePrefix=idle_alarm_prefix(aws.env), AlarmTypes=["MetricAlarm"]
            )
            for a in page["MetricAlarms"]
            if own_alarm.fullmatch(a["AlarmName"])  # not those of an environment named <env>-gpu-idle-...
        ]
        if apply:
            if requests:
                ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=requests)
            if instances:
                ec2.terminate_instances(InstanceIds=instances)
            for vid in volumes:
                ec2.delete_volume(VolumeId=vid)
            for start in range(0, len(alarms), 100):  # DeleteAlarms takes at most 100 names
                cw.delete_alarms(AlarmNames=alarms[start : start + 100])
    except ClientError as e:
        raise explain(e, "sweeping the environment") from None
    return {"jobs": jobs, "instances": instances, "spot_requests": requests, "volumes": volumes, "alarms": alarms}


#: How long ``teardown --wait`` waits for terminated instances to be gone and the data volume free: 40 polls
#: 15 s apart (10 min; a p4d/p5 may take several minutes to terminate).
WAIT_DELAY_S = 15
WAIT_ATTEMPTS = 40


def wait_until_released(
    aws: Aws, outputs: Optional[Outputs], instance_ids: list[str], ec2=None, delay_s: Optional[float] = None
) -> None:
    """Block until ``instance_ids`` are ``terminated`` and the data volume is ``available`` (detached).

    ``cdk destroy DataStack`` right after a terminate request fails while instances are still shutting down:
    the data volume is still attached (its deletion or snapshot then fails) and their network interfaces keep
    the security groups and subnets (DependencyViolation). EC2 waiters ``instance_terminated`` and
    ``volume_available`` (DescribeInstances/DescribeVolumes, EC2 API reference). Raises CliError (exit 75,
    transient) when they are not released within ``WAIT_ATTEMPTS`` x ``delay_s`` seconds.
    """
    ec2 = ec2 or aws.client("ec2")
    delay_s = WAIT_DELAY_S if delay_s is None else delay_s
    config = {"Delay": delay_s, "MaxAttempts": WAIT_ATTEMPTS}
    try:
        if instance_ids:
            ec2.get_waiter("instance_terminated").wait(InstanceIds=instance_ids, WaiterConfig=config)
        if outputs and outputs.volume_id:
            ec2.get_waiter("volume_available").wait(VolumeIds=[outputs.volume_id], WaiterConfig=config)
    except WaiterError as e:
        raise CliError(
            f"instances or the data volume were not released after {WAIT_ATTEMPTS * delay_s:.0f} s ({e})",
            "rerun `python -m infra teardown --yes --wait` before `cdk destroy DataStack`",
            code=75,
        ) from None
