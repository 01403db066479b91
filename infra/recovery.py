"""EC2 job recovery: relaunch an interrupted job from its launch template until it ends, within its caps.

Deployed with TrainingStack as a Lambda function (``infra.recovery.handler``; infra/constructs/recovery.py)
behind three EventBridge rules: the spot interruption warning and rebalance recommendation, instance state
changes (stopping, shutting-down, terminated), and a tick every :data:`TICK_S` seconds for retries. It
decides per job from durable state only: the instance's tags, the job record and the exit records
(:mod:`infra.job_record`). Event shapes: EC2 user guide, "Spot Instance interruption notices" and
"State change events for Amazon EC2 instances"; "EC2 instance rebalance recommendations".

Decisions (docs/infrastructure.md has the state diagram):

- an event about an instance that is not the job's current attempt, or of another environment: nothing;
- interruption warning: the attempt is marked warned (the instance still holds the data volume);
- the current instance ``terminated`` with a recorded exit 0 -> ``done``; 2 or 3 -> ``failed``; no recorded
  exit (spot reclaim, or it vanished) -> relaunch, once the data volume is free and no other live instance of
  the job exists; ``stopping``/``shutting-down`` only close the attempt;
- relaunch: same launch template, same tags (image by digest). Capacity refusals (:data:`CAPACITY_CODES`)
  back off exponentially (:data:`BACKOFF_BASE_S` x 2^round, at most :data:`BACKOFF_MAX_S`; the tick retries);
  after :data:`SPOT_ONLY_ROUNDS` rounds each round also tries the fallback types, then on-demand when allowed;
- caps: ``max_recoveries`` relaunches, ``max_cost_usd`` of catalog price x hours: the job is ``capped`` and the
  topic told; the tick also ends a running attempt once the spend reaches the cap.

Idempotent: a lease in the record (conditional S3 writes) lets one invocation relaunch at a time; a relaunch
that finds the record changed under it (``stop``) terminates what it launched. boto3 only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from botocore.exceptions import ClientError

from infra import job_record as jr
from infra.cli.session import CAPACITY_ERRORS

#: Error codes of RunInstances that mean "no capacity / not at this price / not here": retried, then fallen back.
CAPACITY_CODES = frozenset(CAPACITY_ERRORS) | {"InsufficientCapacity", "SpotMaxPriceTooLow"}
ON_DEMAND_DESCRIPTION = "trainstack on-demand fallback (spot options removed)"
LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]
TICK_S = 120
BACKOFF_BASE_S = 120
BACKOFF_MAX_S = 1800
SPOT_ONLY_ROUNDS = 2
LEASE_S = 300
VOLUME_WAIT_S = 60


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


def run_job_instance(ec2, template_id: str, tags: list[dict], market: str) -> tuple[str, str]:
    """Run one instance of a job from ``template_id``: its default version for ``market="spot"``, the
    spot-free copy (:func:`on_demand_version`) for ``"on-demand"``. ``tags`` go on the instance; the job and
    environment tags also on its volumes and spot request. Returns (instance id, version). Raises botocore
    ClientError (capacity codes: :data:`CAPACITY_CODES`)."""
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
    )
    return out["Instances"][0]["InstanceId"], version


def live_job_instances(ec2, env: str, job: str) -> list[str]:
    """Ids of the instances of ``job`` in environment ``env`` that are not terminated (they may hold the data
    volume). Raises botocore ClientError."""
    res = ec2.describe_instances(
        Filters=[
            {"Name": "tag:trainstack:env", "Values": [env]},
            {"Name": "tag:trainstack:job", "Values": [job]},
            {"Name": "instance-state-name", "Values": LIVE_STATES},
        ]
    )["Reservations"]
    return [i["InstanceId"] for r in res for i in r["Instances"]]


@dataclass
class Settings:
    """The deployed environment, from the function's environment variables (infra/constructs/recovery.py)."""

    env: str
    bucket: str
    topic_arn: str
    volume_id: str
    launch_templates: dict[str, str]  # instance type -> launch template id

    @classmethod
    def from_environ(cls, environ=os.environ) -> Settings:
        """Raises KeyError naming a missing ``TRAINSTACK_*`` variable."""
        return cls(
            env=environ["TRAINSTACK_ENV"],
            bucket=environ["TRAINSTACK_BUCKET"],
            topic_arn=environ["TRAINSTACK_TOPIC_ARN"],
            volume_id=environ["TRAINSTACK_VOLUME_ID"],
            launch_templates=json.loads(environ["TRAINSTACK_LAUNCH_TEMPLATES"]),
        )


class Controller:
    """The decisions of the module docstring, on boto3 clients ``ec2``, ``s3``, ``sns``; ``now`` gives epoch
    seconds (tests move it). Every public method returns a list of short lines saying what it did."""

    def __init__(self, settings: Settings, ec2, s3, sns, now: Callable[[], float] = time.time) -> None:
        self.s, self.ec2, self.s3, self.sns, self.now = settings, ec2, s3, sns, now

    # ------------------------------------------------------------------ events
    def handle(self, event: dict) -> list[str]:
        """Dispatch one EventBridge event (EC2 interruption warning, rebalance recommendation, state change, or
        the scheduled tick)."""
        kind = event.get("detail-type", "")
        if kind == "Scheduled Event":
            return self.tick()
        iid = event.get("detail", {}).get("instance-id")
        if not iid:
            return [f"ignored: {kind!r} without an instance id"]
        job = self._job_of(iid)
        if job is None:
            return [f"ignored: {iid} is not a job instance of {self.s.env}"]
        stored = jr.load(self.s3, self.s.bucket, job)
        if stored is None:
            return [f"ignored: job {job} has no record"]
        att = jr.current(stored.record)
        if att is None or att["instance_id"] != iid:
            return [f"ignored: {iid} is not the current attempt of job {job}"]
        if kind == "EC2 Spot Instance Interruption Warning":
            return self._mark(stored, lambda r: self._warned(r, iid), f"{job}: {iid} warned")
        if kind == "EC2 Instance Rebalance Recommendation":
            return [f"{job}: rebalance recommendation for {iid} noted (the job keeps running)"]
        if kind == "EC2 Instance State-change Notification":
            return self._ended(stored, iid, event["detail"].get("state", ""))
        return [f"ignored: {kind!r}"]

    def tick(self) -> list[str]:
        """Every job that is not final: retry a due relaunch, take over an expired lease, notice a current
        instance that ended without an event, enforce the cost cap on a running attempt."""
        out = []
        for job in jr.list_jobs(self.s3, self.s.bucket):
            stored = jr.load(self.s3, self.s.bucket, job)
            if stored is None or stored.record["state"] in jr.FINAL_STATES:
                continue
            r, now = stored.record, self.now()
            if r["state"] == jr.WAITING and (r["next_try_at"] or 0) <= now:
                out += self.relaunch(stored)
            elif r["state"] == jr.RELAUNCHING and (r["lease_until"] or 0) <= now:
                out += self.relaunch(stored, take_over=True)
            elif r["state"] in (jr.RUNNING, jr.WARNED) and jr.current(r):
                iid = jr.current(r)["instance_id"]
                state = self._instance_state(iid)
                if state in ("terminated", None):
                    out += self._ended(stored, iid, "terminated")
                elif self._over_cost(r):
                    out += self._cap(stored, f"spend reached the cap of ${r['max_cost_usd']:.2f}", terminate=iid)
        return out

    # ------------------------------------------------------------------ decisions
    def _warned(self, r: dict, iid: str) -> None:
        jr.current(r)["warned_at"] = jr.current(r).get("warned_at") or self.now()
        r["state"], r["reason"] = jr.WARNED, f"spot interruption warning for {iid}"

    def _ended(self, stored: jr.Stored, iid: str, state: str) -> list[str]:
        r = stored.record
        job, att = r["job"], jr.current(r)
        if r["state"] in jr.FINAL_STATES or state != "terminated":
            if att["end"] is None and state in ("shutting-down", "terminated", "stopping"):
                return self._mark(stored, lambda x: self._close(x, state), f"{job}: {iid} {state}")
            return [f"{job}: {iid} {state}, nothing to do (state {r['state']})"]
        code = jr.exit_code(self.s3, self.s.bucket, job, iid)
        if code in jr.FINAL_EXIT_CODES:
            final = jr.DONE if code == 0 else jr.FAILED
            why = "done (exit 0)" if code == 0 else f"exit {code}: not retried"

            def finish(x: dict) -> None:
                self._close(x, f"exit {code}")
                x["state"], x["reason"] = final, why

            lines = self._mark(stored, finish, f"{job}: {final} ({why})")
            self._tell(job, f"job {job} {why}")
            return lines
        why = "spot interruption" if att.get("warned_at") else "ended without a recorded exit"
        if att["end"] is None or att.get("ended_by") in (None, "shutting-down", "stopping", "terminated"):
            att["end"] = att["end"] or self.now()
            att["ended_by"] = why
        if not r["recover"]:
            r["state"], r["reason"] = jr.ENDED, f"{why}; launched with --no-recover"
            return self._save(stored, f"{job}: {why}, not relaunched (--no-recover)")
        return self.relaunch(stored)

    def _close(self, r: dict, by: str) -> None:
        att = jr.current(r)
        att["end"] = att["end"] or self.now()
        att["ended_by"] = by

    def _over_cost(self, r: dict) -> bool:
        return r["max_cost_usd"] is not None and jr.spend_usd(r, self.now()) >= r["max_cost_usd"]

    def relaunch(self, stored: jr.Stored, take_over: bool = False) -> list[str]:
        """Launch the job's next attempt (see the module docstring); returns what happened."""
        r, now = stored.record, self.now()
        job = r["job"]
        if r["state"] == jr.RELAUNCHING and (r["lease_until"] or 0) > now and not take_over:
            return [f"{job}: another invocation is relaunching it"]
        if r["recoveries"] >= r["max_recoveries"]:
            return self._cap(stored, f"{r['recoveries']} recoveries, the --max-recoveries cap")
        if self._over_cost(r):
            return self._cap(stored, f"spend ${jr.spend_usd(r, now):.2f} reached the cap of ${r['max_cost_usd']:.2f}")
        holder = self._volume_holder()
        live = self._live_instances(job)
        if holder or live:
            r["state"], r["reason"] = jr.WAITING, f"waiting for {holder or live[0]} to release the data volume"
            r["next_try_at"], r["lease_until"] = now + VOLUME_WAIT_S, None
            return self._save(stored, f"{job}: {r['reason']}")
        r["state"], r["reason"], r["lease_until"] = jr.RELAUNCHING, "relaunching", now + LEASE_S
        try:
            stored = jr.save(self.s3, self.s.bucket, stored)
        except jr.Conflict:
            return [f"{job}: the record changed under this invocation; another one handles it"]
        r = stored.record
        errors = []
        for itype, market in self._options(r):
            try:
                iid, version = run_job_instance(self.ec2, self.s.launch_templates[itype], r["tags"], market)
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                if code not in CAPACITY_CODES:
                    r["state"], r["reason"], r["lease_until"] = jr.FAILED, f"relaunch refused: {code}", None
                    self._tell(job, f"job {job}: relaunch refused by EC2 ({code}); not retried")
                    return self._save(stored, f"{job}: relaunch refused ({code})")
                errors.append(f"{itype} {market}: {code}")
                continue
            return self._launched(stored, iid, itype, market, version)
        r["capacity_rounds"] += 1
        wait = min(BACKOFF_BASE_S * 2 ** (r["capacity_rounds"] - 1), BACKOFF_MAX_S)
        r["state"], r["lease_until"], r["next_try_at"] = jr.WAITING, None, now + wait
        r["reason"] = f"no capacity (round {r['capacity_rounds']}); next try in {wait} s"
        r["notes"] = errors
        return self._save(stored, f"{job}: {'; '.join(errors)}; retry in {wait} s")

    def _options(self, r: dict) -> list[tuple[str, str]]:
        """(type, market) in the order tried this round: the job's type on spot; after SPOT_ONLY_ROUNDS
        failed rounds also the fallback types on spot, then every type on-demand when allowed."""
        types = [r["instance_type"]]
        if r["capacity_rounds"] < SPOT_ONLY_ROUNDS:
            return [(types[0], "spot")]
        types += [t for t in r["fallback_types"] if t in self.s.launch_templates]
        out = [(t, "spot") for t in types]
        if r["on_demand_fallback"]:
            out += [(t, "on-demand") for t in types]
        return out

    def _launched(self, stored: jr.Stored, iid: str, itype: str, market: str, version: str) -> list[str]:
        r = stored.record
        r["attempts"].append(
            {
                "instance_id": iid,
                "type": itype,
                "market": market,
                "version": version,
                "start": self.now(),
                "end": None,
                "ended_by": None,
                "warned_at": None,
            }
        )
        r["recoveries"] += 1
        r["state"], r["reason"] = jr.RUNNING, f"relaunched as {iid} ({itype}, {market})"
        r["capacity_rounds"], r["next_try_at"], r["lease_until"], r["notes"] = 0, None, None, []
        try:
            jr.save(self.s3, self.s.bucket, stored)
        except jr.Conflict:  # stopped (or otherwise changed) while this invocation launched: undo
            self.ec2.terminate_instances(InstanceIds=[iid])
            return [f"{r['job']}: the record changed during the relaunch; terminated {iid}"]
        self._tell(r["job"], f"job {r['job']} relaunched as {iid} ({itype}, {market}), recovery {r['recoveries']}")
        return [f"{r['job']}: relaunched as {iid} ({itype}, {market})"]

    def _cap(self, stored: jr.Stored, why: str, terminate: Optional[str] = None) -> list[str]:
        """Mark the job ``capped``, then terminate ``terminate`` (the running attempt over the cost cap) and tell the
        topic, both only once that is saved: when another writer changed the record since it was read, nothing
        is done and the next tick decides again from the record as it is then."""
        r = stored.record
        r["state"], r["reason"], r["lease_until"] = jr.CAPPED, f"stopped: {why}", None
        if terminate:
            self._close(r, "cost cap")
        if not self._saved(stored):
            return [self._not_saved(stored)]
        if terminate:
            self.ec2.terminate_instances(InstanceIds=[terminate])
        self._tell(r["job"], f"job {r['job']} stopped: {why}")
        return [f"{r['job']}: capped ({why})"]

    # ------------------------------------------------------------------ helpers
    def _mark(self, stored: jr.Stored, change: Callable[[dict], None], line: str) -> list[str]:
        change(stored.record)
        return self._save(stored, line)

    def _save(self, stored: jr.Stored, line: str) -> list[str]:
        """[``line``] when the record was saved, else [:meth:`_not_saved`'s line]."""
        return [line if self._saved(stored) else self._not_saved(stored)]

    def _saved(self, stored: jr.Stored) -> bool:
        """Write the record (a conditional write); False when another writer changed it since it was read."""
        try:
            jr.save(self.s3, self.s.bucket, stored)
        except jr.Conflict:
            return False
        return True

    @staticmethod
    def _not_saved(stored: jr.Stored) -> str:
        return f"{stored.record['job']}: not saved, the record changed"

    def _tell(self, job: str, message: str) -> None:
        self.sns.publish(TopicArn=self.s.topic_arn, Subject=f"trainstack {self.s.env}: {job}"[:100], Message=message)

    def _job_of(self, iid: str) -> Optional[str]:
        try:
            res = self.ec2.describe_instances(InstanceIds=[iid])["Reservations"]
        except ClientError:
            return None
        for inst in (i for r in res for i in r["Instances"]):
            tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
            if tags.get("trainstack:env") == self.s.env:
                return tags.get("trainstack:job")
        return None

    def _instance_state(self, iid: str) -> Optional[str]:
        try:
            res = self.ec2.describe_instances(InstanceIds=[iid])["Reservations"]
        except ClientError:
            return None
        found = [i["State"]["Name"] for r in res for i in r["Instances"]]
        return found[0] if found else None

    def _volume_holder(self) -> Optional[str]:
        vol = self.ec2.describe_volumes(VolumeIds=[self.s.volume_id])["Volumes"][0]
        held = [a["InstanceId"] for a in vol.get("Attachments", []) if a.get("State") in ("attaching", "attached")]
        return held[0] if held else None

    def _live_instances(self, job: str) -> list[str]:
        return live_job_instances(self.ec2, self.s.env, job)


def handler(event: dict, context: object = None) -> dict:
    """The Lambda entry point: one EventBridge event -> :meth:`Controller.handle`. Returns {"actions": [...]}
    (also printed, so each decision is in the function's log)."""
    import boto3

    ctl = Controller(Settings.from_environ(), boto3.client("ec2"), boto3.client("s3"), boto3.client("sns"))
    actions = ctl.handle(event)
    for line in actions:
        print(line)
    return {"actions": actions}
