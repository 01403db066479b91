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
from datetime import UTC, datetime
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from infra import job_record as jr
from infra.recovery_ec2 import (  # noqa: F401  (re-exported: infra/cli imports them from here)
    CAPACITY_CODES,
    LIVE_STATES,
    ON_DEMAND_DESCRIPTION,
    RECLAIM_CODE,
    InstanceInfo,
    Unknown,
    describe_instance,
    error_code,
    error_kind,
    live_job_instances,
    on_demand_version,
    run_job_instance,
)

TICK_S = 120
BACKOFF_BASE_S = 120
BACKOFF_MAX_S = 1800
SPOT_ONLY_ROUNDS = 2
LEASE_S = 300
VOLUME_WAIT_S = 60
ALARM_EVENT = "CloudWatch Alarm State Change"


class RecoveryError(Exception):
    """Raised by :func:`handler` after a tick in which some jobs could not be handled (each named in the
    message; the other jobs were handled): the invocation then counts as an error (the function's Errors alarm,
    infra/constructs/recovery.py) and its event goes to the on-failure destination after Lambda's retries."""


def iso(epoch: Optional[float]) -> Optional[str]:
    """``epoch`` (seconds) as ISO 8601 UTC, e.g. ``2026-11-28T06:40:00Z``; None stays None."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def backoff_s(rounds: int) -> int:
    """Seconds before the next try after ``rounds`` (>= 1) refused rounds: :data:`BACKOFF_BASE_S` x 2^(rounds-1),
    at most :data:`BACKOFF_MAX_S`."""
    return min(BACKOFF_BASE_S * 2 ** (rounds - 1), BACKOFF_MAX_S)


@dataclass
class Settings:
    """The deployed environment, from the function's environment variables (infra/constructs/recovery.py).
    ``idle_alarm_prefix``: name prefix of the per-instance GPU-idle alarms (``<prefix><instance id>``,
    infra/stacks/monitoring.py)."""

    env: str
    bucket: str
    topic_arn: str
    volume_id: str
    launch_templates: dict[str, str]  # instance type -> launch template id
    idle_alarm_prefix: str = ""

    def __post_init__(self) -> None:
        self.idle_alarm_prefix = self.idle_alarm_prefix or f"trainstack-{self.env}-gpu-idle-"

    @classmethod
    def from_environ(cls, environ=os.environ) -> Settings:
        """Raises KeyError naming a missing ``TRAINSTACK_*`` variable."""
        return cls(
            env=environ["TRAINSTACK_ENV"],
            bucket=environ["TRAINSTACK_BUCKET"],
            topic_arn=environ["TRAINSTACK_TOPIC_ARN"],
            volume_id=environ["TRAINSTACK_VOLUME_ID"],
            launch_templates=json.loads(environ["TRAINSTACK_LAUNCH_TEMPLATES"]),
            idle_alarm_prefix=environ.get("TRAINSTACK_IDLE_ALARM_PREFIX", ""),
        )


class Controller:
    """The decisions of the module docstring, on boto3 clients ``ec2``, ``s3``, ``sns``; ``now`` gives epoch
    seconds (tests move it). Every public method returns a list of short lines saying what it did;
    ``failures`` lists the jobs the last tick had to skip (malformed record, an error it could not handle)."""

    def __init__(self, settings: Settings, ec2, s3, sns, now: Callable[[], float] = time.time) -> None:
        self.s, self.ec2, self.s3, self.sns, self.now = settings, ec2, s3, sns, now
        self.failures: list[str] = []

    # ------------------------------------------------------------------ events
    def handle(self, event: dict) -> list[str]:
        """Dispatch one EventBridge event (EC2 interruption warning, rebalance recommendation, state change, the
        GPU-idle alarm going to ALARM, or the scheduled tick). Raises :class:`infra.recovery_ec2.Unknown` when
        EC2 cannot say whose instance it is (the invocation fails and Lambda retries it: no event is dropped)."""
        kind = event.get("detail-type", "")
        if kind == "Scheduled Event":
            return self.tick()
        if kind == ALARM_EVENT:
            return self._idle_alarm(event)
        iid = event.get("detail", {}).get("instance-id")
        if not iid:
            return [f"ignored: {kind!r} without an instance id"]
        found = self._current(iid)
        if isinstance(found, str):
            return [found]
        stored, info = found
        job = stored.record["job"]
        if kind == "EC2 Spot Instance Interruption Warning":
            return self._mark(stored, lambda r: self._warned(r, iid), f"{job}: {iid} warned")
        if kind == "EC2 Instance Rebalance Recommendation":
            return [f"{job}: rebalance recommendation for {iid} noted (the job keeps running)"]
        if kind == "EC2 Instance State-change Notification":
            return self._ended(stored, iid, event["detail"].get("state", ""), info)
        return [f"ignored: {kind!r}"]

    def _current(self, iid: str):
        """(stored record, InstanceInfo) when ``iid`` is this environment's instance and its job's current
        attempt, else the line saying why the event is ignored. Raises Unknown (see :meth:`handle`)."""
        info = describe_instance(self.ec2, iid)
        tags = info.tags or {}
        job = tags.get("trainstack:job") if tags.get("trainstack:env") == self.s.env else None
        if job is None:
            return f"ignored: {iid} is not a job instance of {self.s.env}"
        stored = jr.load(self.s3, self.s.bucket, job)
        if stored is None:
            return f"ignored: job {job} has no record"
        att = jr.current(stored.record)
        if att is None or att["instance_id"] != iid:
            return f"ignored: {iid} is not the current attempt of job {job}"
        return stored, info

    def tick(self) -> list[str]:
        """Every job that is not final, each on its own (a malformed record or an error while handling one job is
        a line in the output and in :attr:`failures`, and the other jobs go on): retry a due relaunch, take over an
        expired lease, notice a current instance that ended without an event or whose job exited while the
        instance stays up (``--keep``), enforce the cost cap on a running attempt."""
        out, self.failures = [], []
        for job in jr.list_jobs(self.s3, self.s.bucket):
            try:
                out += self._tick_job(job)
            except Exception as e:  # noqa: BLE001  (one bad record never stops the tick for the others)
                line = f"{job}: skipped this tick: {type(e).__name__}: {e}"
                out.append(line)
                self.failures.append(line)
        return out

    def _tick_job(self, job: str) -> list[str]:
        stored = jr.load(self.s3, self.s.bucket, job)
        if stored is None or stored.record["state"] in jr.FINAL_STATES:
            return []
        r, now = stored.record, self.now()
        if r["state"] == jr.WAITING and (r["next_try_at"] or 0) <= now:
            return self.relaunch(stored)
        if r["state"] == jr.RELAUNCHING and (r["lease_until"] or 0) <= now:
            return self.relaunch(stored, take_over=True)
        if r["state"] not in (jr.RUNNING, jr.WARNED) or not jr.current(r):
            return []
        iid, out = jr.current(r)["instance_id"], []
        try:
            info = describe_instance(self.ec2, iid)
        except Unknown as e:  # never "gone": the attempt stays open and its spend keeps counting
            info = None
            out.append(f"{job}: {e}; decided on a later tick")
        if info is not None and info.state in ("terminated", "gone"):
            return self._ended(stored, iid, "terminated", info)
        if info is not None and info.state in ("pending", "running"):
            code = jr.exit_code(self.s3, self.s.bucket, job, iid)
            if code in jr.FINAL_EXIT_CODES:  # exited, the instance still up (kept, or shutting down in a minute)
                kept = (info.tags or {}).get("trainstack:keep") == "true"
                return self._finish(stored, code, f"; {iid} kept up (trainstack:keep=true)" if kept else "")
        if self._over_cost(r):
            return out + self._cap(stored, f"spend reached the cap of ${r['max_cost_usd']:.2f}", terminate=iid)
        return out

    # ------------------------------------------------------------------ decisions
    def _warned(self, r: dict, iid: str) -> None:
        jr.current(r)["warned_at"] = jr.current(r).get("warned_at") or self.now()
        r["state"], r["reason"] = jr.WARNED, f"spot interruption warning for {iid}"

    def _ended(self, stored: jr.Stored, iid: str, state: str, info: InstanceInfo) -> list[str]:
        """The current attempt's instance ``state`` (stopping, shutting-down, terminated): a terminated one
        with a final exit record ends the job; without one it is relaunched only when EC2 reclaimed it
        (StateReason :data:`RECLAIM_CODE`, or, when EC2 no longer says why, a spot warning came first);
        anything else (teardown, stop, the idle alarm, a shutdown inside the instance) ends the job unrelaunched.
        """
        r = stored.record
        job, att = r["job"], jr.current(r)
        if r["state"] in jr.FINAL_STATES or state != "terminated":
            if att["end"] is None and state in ("shutting-down", "terminated", "stopping"):
                return self._mark(stored, lambda x: self._close(x, state), f"{job}: {iid} {state}")
            return [f"{job}: {iid} {state}, nothing to do (state {r['state']})"]
        code = jr.exit_code(self.s3, self.s.bucket, job, iid)
        if code in jr.FINAL_EXIT_CODES:
            return self._finish(stored, code)
        reclaimed = info.reason_code == RECLAIM_CODE or (not info.reason_code and att.get("warned_at"))
        if not reclaimed:
            cause = info.reason or info.reason_code or "EC2 gave no reason and no spot warning came"
            why = f"{iid} ended by {cause}: not a spot reclaim"
            self._close(r, info.reason_code or "terminated")
            r["state"], r["reason"], r["lease_until"] = jr.ENDED, f"{why}; not relaunched", None
            lines = self._save(stored, f"{job}: {why}, not relaunched")
            if lines[0].startswith(f"{job}: {iid} ended"):
                self._tell(job, f"job {job}: {why}; not relaunched")
            return lines
        why = "spot interruption"
        if att["end"] is None or att.get("ended_by") in (None, "shutting-down", "stopping", "terminated"):
            att["end"] = att["end"] or self.now()
            att["ended_by"] = why
        if not r["recover"]:
            r["state"], r["reason"] = jr.ENDED, f"{why}; launched with --no-recover"
            return self._save(stored, f"{job}: {why}, not relaunched (--no-recover)")
        return self.relaunch(stored)

    def _finish(self, stored: jr.Stored, code: int, note: str = "") -> list[str]:
        """End the job from its final exit ``code`` (0 done, 2/3 failed), close the attempt, tell the topic."""
        r = stored.record
        job = r["job"]
        final = jr.DONE if code == 0 else jr.FAILED
        why = ("done (exit 0)" if code == 0 else f"exit {code}: not retried") + note

        def finish(x: dict) -> None:
            self._close(x, f"exit {code}")
            x["state"], x["reason"], x["lease_until"] = final, why, None

        lines = self._mark(stored, finish, f"{job}: {final} ({why})")
        if lines[0].startswith(f"{job}: {final}"):
            self._tell(job, f"job {job} {why}")
        return lines

    def _idle_alarm(self, event: dict) -> list[str]:
        """The GPU-idle alarm of a job's current instance went to ALARM: its action stops or terminates the
        instance (infra/stacks/monitoring.py), so the job is marked ``failed`` (a hung job is not relaunched)
        first; a kept instance's alarm only notifies and changes nothing."""
        d = event.get("detail", {})
        name, value = d.get("alarmName", ""), (d.get("state") or {}).get("value")
        if not name.startswith(self.s.idle_alarm_prefix) or value != "ALARM":
            return [f"ignored: alarm {name!r} {value}"]
        iid = name[len(self.s.idle_alarm_prefix) :]
        found = self._current(iid)
        if isinstance(found, str):
            return [found]
        stored, info = found
        r, job = stored.record, stored.record["job"]
        if (info.tags or {}).get("trainstack:keep") == "true":
            return [f"{job}: idle alarm of {iid}, kept up (trainstack:keep=true): the alarm only notifies"]
        if r["state"] in (jr.DONE, jr.FAILED, jr.STOPPED, jr.CAPPED):
            return [f"{job}: idle alarm of {iid}, nothing to do (state {r['state']})"]
        why = f"GPU idle: {iid} ended by its idle alarm ({(d.get('state') or {}).get('reason', '')})"

        def fail(x: dict) -> None:
            self._close(x, "idle alarm")
            x["state"], x["reason"], x["lease_until"] = jr.FAILED, f"{why}; a hung job is not relaunched", None

        lines = self._mark(stored, fail, f"{job}: failed ({why})")
        if lines[0].startswith(f"{job}: failed"):
            self._tell(job, f"job {job} failed: {why}; not relaunched")
        return lines

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
        options = self._options(r)
        if not options:
            r["state"], r["lease_until"] = jr.FAILED, None
            r["reason"] = f"relaunch impossible: no launch template for {r['instance_type']} in {self.s.env}"
            self._tell(job, f"job {job}: {r['reason']} (redeployed without it?); not retried")
            return self._save(stored, f"{job}: {r['reason']}")
        holder = self._volume_holder()
        live = self._live_instances()  # any job's: one writer per data volume
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
        errors, transient = [], None
        for itype, market in options:
            try:
                iid, version = run_job_instance(self.ec2, self.s.launch_templates[itype], r["tags"], market)
            except (ClientError, BotoCoreError) as e:
                code, kind = error_code(e), error_kind(e)
                r.setdefault("refusals", {})[f"{itype} {market}"] = {"code": code, "at": now}
                if kind == "final":
                    r["state"], r["reason"], r["lease_until"] = jr.FAILED, f"relaunch refused: {code}", None
                    self._tell(job, f"job {job}: relaunch refused by EC2 ({code}); not retried")
                    return self._save(stored, f"{job}: relaunch refused ({code})")
                errors.append(f"{itype} {market}: {code}")
                if kind == "transient":  # throttled or EC2 failing: this round ends, a later tick tries again
                    transient = code
                    break
                continue
            return self._launched(stored, iid, itype, market, version)
        if transient:
            r["transient_rounds"] = r.get("transient_rounds", 0) + 1
            wait = backoff_s(r["transient_rounds"])
            what = f"EC2 error {transient} (transient, round {r['transient_rounds']})"
        else:
            r["capacity_rounds"] += 1
            wait = backoff_s(r["capacity_rounds"])
            what = f"no capacity (round {r['capacity_rounds']})"
        r["state"], r["lease_until"], r["next_try_at"] = jr.WAITING, None, now + wait
        r["reason"] = f"{what}; next try at {iso(now + wait)}"
        r["notes"] = errors
        return self._save(stored, f"{job}: {'; '.join(errors)}; retry in {wait} s")

    def _options(self, r: dict) -> list[tuple[str, str]]:
        """(type, market) in the order tried this round: the job's type on spot; after SPOT_ONLY_ROUNDS
        failed rounds also the fallback types on spot, then every type on-demand when allowed. Types without a
        launch template in this environment are left out."""
        types = [t for t in [r["instance_type"]] if t in self.s.launch_templates]
        if r["capacity_rounds"] < SPOT_ONLY_ROUNDS:
            return [(t, "spot") for t in types]
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
        r["transient_rounds"] = 0
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

    def _volume_holder(self) -> Optional[str]:
        vol = self.ec2.describe_volumes(VolumeIds=[self.s.volume_id])["Volumes"][0]
        held = [a["InstanceId"] for a in vol.get("Attachments", []) if a.get("State") in ("attaching", "attached")]
        return held[0] if held else None

    def _live_instances(self) -> list[str]:
        return live_job_instances(self.ec2, self.s.env)


def handler(event: dict, context: object = None) -> dict:
    """The Lambda entry point: one EventBridge event -> :meth:`Controller.handle`. Returns {"actions": [...]}
    (also printed, so each decision is in the function's log). Raises :class:`RecoveryError` after a tick that
    skipped jobs and :class:`infra.recovery_ec2.Unknown` when EC2 could not be asked: the invocation fails, so
    Lambda retries it, then sends it to the on-failure destination, and the Errors alarm tells the topic."""
    import boto3

    ctl = Controller(Settings.from_environ(), boto3.client("ec2"), boto3.client("s3"), boto3.client("sns"))
    actions = ctl.handle(event)
    for line in actions:
        print(line)
    if ctl.failures:
        raise RecoveryError(f"{len(ctl.failures)} job(s) skipped: " + " | ".join(ctl.failures))
    return {"actions": actions}
