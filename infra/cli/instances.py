"""EC2 side of the CLI: launch from the stack's spot launch template, list, stop, and the teardown sweep.

The job is described by instance tags that the launch template's user data reads through IMDS
(``trainstack:job``, ``trainstack:config``, ``trainstack:image-tag``, ``trainstack:args``, ``trainstack:keep``);
every instance, volume and spot request also carries ``trainstack:env`` so that ``teardown`` finds them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from botocore.exceptions import ClientError, WaiterError

import catalog
from infra.cli.outputs import Outputs, image_exists
from infra.cli.session import CAPACITY_ERRORS, Aws, CliError, explain

ON_DEMAND_DESCRIPTION = "trainstack on-demand fallback (spot options removed)"
LIVE_STATES = ["pending", "running", "stopping", "stopped"]
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass
class Launched:
    """``instance_id``, ``market`` ("spot" or "on-demand"), launch template ``version`` used."""

    instance_id: str
    market: str
    version: str


def check_request(instance_type: str, job: str) -> None:
    """The checks of :func:`launch` that need no AWS call: the job name, and ``instance_type`` being an EC2
    type of the catalog. Raises CliError (or catalog.CatalogError listing the known types)."""
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
) -> Launched:
    """Run one instance from the stack's launch template for ``instance_type`` (spot unless it falls back),
    running ``image_tag`` pinned to its digest.

    Raises CliError for a bad job name, a type without a launch template or not offered in the environment's
    AZ, an image tag not in the repository (next: push-image), or capacity/spot errors (with the next option)
    when no fallback is asked for or the fallback fails too.
    """
    check_request(instance_type, job)
    ec2 = ec2 or aws.client("ec2")
    template_id = outputs.launch_template(instance_type)
    check_offered(ec2, instance_type, outputs.availability_zone)
    # The instance runs the image by digest (tag trainstack:image-digest, read by the user data into
    # /etc/trainstack.env), so every restart of the job after exit 75 runs the image it started with.
    digest = image_exists(aws, outputs, image_tag, ecr)
    tags = _tags(aws.env, job, config, image_tag, digest, args, keep)
    spec = [
        {"ResourceType": "instance", "Tags": tags},
        {"ResourceType": "volume", "Tags": [t for t in tags if t["Key"] in ("trainstack:env", "trainstack:job")]},
    ]

    def run(version: str, market: str) -> Launched:
        extra = [{"ResourceType": "spot-instances-request", "Tags": spec[1]["Tags"]}] if market == "spot" else []
        out = ec2.run_instances(
            LaunchTemplate={"LaunchTemplateId": template_id, "Version": version},
            MinCount=1,
            MaxCount=1,
            TagSpecifications=spec + extra,
        )
        return Launched(out["Instances"][0]["InstanceId"], market, version)

    try:
        return run("$Default", "spot")
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if not (on_demand_fallback and code in CAPACITY_ERRORS):
            raise explain(e, f"launching spot {instance_type}", instance_type) from None
    try:
        return run(on_demand_version(ec2, template_id), "on-demand")
    except ClientError as e:
        raise explain(e, f"launching on-demand {instance_type} (after the spot launch failed)", instance_type) from None


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


def stop_instance(aws: Aws, instance_id: str, ec2=None) -> str:
    """Stop an on-demand instance, terminate a spot one (one-time spot cannot be stopped). Returns the action.

    Raises CliError if the instance is not this environment's.
    """
    ec2 = ec2 or aws.client("ec2")
    mine = {i["instance_id"]: i for i in list_instances(aws, ec2)}
    if instance_id not in mine:
        raise CliError(
            f"{instance_id} is not a live instance of environment {aws.env}", "`python -m infra status` lists them"
        )
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


def sweep(aws: Aws, outputs: Optional[Outputs], apply: bool, ec2=None, cw=None) -> dict[str, list[str]]:
    """Find (and with ``apply`` remove) what keeps billing: live instances, open spot requests and unattached
    volumes of this environment, and its per-instance idle alarms (all of them: the instances go too). The
    data volume (``trainstack:role=data`` or the stack's volume id) is never touched.
    Returns {"instances": [...], "spot_requests": [...], "volumes": [...], "alarms": [...]}.
    Raises CliError when AWS refuses a call.
    """
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
    return {"instances": instances, "spot_requests": requests, "volumes": volumes, "alarms": alarms}


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
