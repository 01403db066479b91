"""EC2 job recovery: relaunch an interrupted job from its launch template until it ends, within its caps.

Deployed with TrainingStack as a Lambda function (``infra.recovery.handler``; infra/constructs/recovery.py)
behind four EventBridge rules: the spot interruption warning and rebalance recommendation, instance state
changes (stopping, shutting-down, terminated), this environment's GPU-idle alarms going to ALARM, and a tick
every :data:`~infra.recovery_settings.TICK_S` seconds for retries. It decides per job from durable state only: the instance's tags and
``StateReason``, the job record and the exit records (:mod:`infra.job_record`). Event shapes: EC2 user guide,
"Spot Instance interruption notices" and "State change events for Amazon EC2 instances"; "EC2 instance
rebalance recommendations"; CloudWatch user guide, "Alarm events and EventBridge".

Decisions (docs/infrastructure.md has the state diagram):

- an event about an instance that is not the job's current attempt, or of another environment: nothing;
- interruption warning or rebalance recommendation: the attempt is marked warned (the instance still holds the
  data volume); ignored for a job that is final or whose attempt is already closed (a late notice never reopens it);
- what EC2 has not confirmed is *unknown* and decides nothing: ``InvalidInstanceID.NotFound`` for an attempt
  younger than :attr:`~infra.recovery_settings.Settings.unknown_grace_s` (EC2 developer guide, "Eventual consistency in the Amazon EC2
  API"), a ``terminated`` event while DescribeInstances still shows the instance up, or a terminated instance
  without a StateReason and without a spot warning (spot notices are best effort) until the grace has passed
  since it was first seen so; the tick looks again;
- the current instance ``terminated`` with a recorded exit 0 -> ``done``; 2 or 3 -> ``failed``; no recorded
  exit: relaunched only when EC2 reclaimed it (StateReason ``Server.SpotInstanceTermination``, or a warned
  attempt EC2 no longer describes), once the data volume is free and no job instance of the environment lives;
  ended at launch by ``Server.InternalError``/``Server.InsufficientInstanceCapacity`` -> the capacity ladder
  (backoff, fallback types, on-demand); by ``Client.InternalError`` -> ``failed`` (the EBS volumes' KMS key);
  any other reason (``Client.UserInitiatedShutdown``, ``Client.InstanceInitiatedShutdown``) -> ``ended``;
  ``stopping``/``shutting-down`` only close the attempt; a termination already handled (the job waits or is
  relaunching) changes nothing, so a redelivered event never skips the backoff. ``stop``/``teardown`` mark the
  job ``stopped`` first;
- the GPU-idle alarm of the current instance in ALARM -> ``failed`` (a hung job; the alarm ends the instance);
  a leftover alarm of an ended attempt while the job waits for capacity changes nothing;
- an exit record while the instance is still up (``--keep``) -> ``done``/``failed``, the instance left alone;
- relaunch (:mod:`infra.recovery_launch`): same launch template, same tags (image by digest), a client token
  kept in the record; a live instance tagged with the job that no attempt holds (a launch whose answer was
  lost) is adopted instead; capacity refusals back off and fall back; throttling and EC2 server errors back off;
  permission/configuration errors -> ``failed``;
- caps: ``max_recoveries`` relaunches, ``max_cost_usd`` of catalog price x hours: the job is ``capped`` and the
  topic told; the tick also ends a running attempt once the spend reaches the cap;
- a final job whose attempt's instance still runs (a terminate that was throttled, a job that exited and did
  not shut down) has it terminated by the tick, backing off while EC2 refuses (kept instances of a finished job
  stay); stopped instances are left alone;
- the tick handles each job on its own: a job it cannot handle is skipped and named in :attr:`Controller.failures`
  (the handler then fails the invocation: on-failure queue, Errors alarm); an unreadable record is reported once
  per version of it (a topic message), then only logged, so it does not hold the alarm; an instance EC2 does not
  describe is unknown, never gone.

Idempotent: a lease in the record (conditional S3 writes) lets one invocation relaunch at a time; a relaunch
that finds the record changed under it (``stop``) terminates what it launched. boto3 only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from infra import job_record as jr
from infra.recovery_ec2 import (
    KMS_CODE,
    LAUNCH_RETRY_CODES,
    RECLAIM_CODE,
    InstanceInfo,
    LiveInstance,
    Unknown,
    describe_instance,
    error_code,
    live_instances,
    live_job_instances,
)
from infra.recovery_final import UNREADABLE_KEY, FinalMixin  # noqa: F401  (re-exported for the tests)
from infra.recovery_launch import (  # noqa: F401  (re-exported: the tests and infra/cli read them from here)
    BACKOFF_BASE_S,
    BACKOFF_MAX_S,
    LEASE_S,
    SPOT_ONLY_ROUNDS,
    VOLUME_WAIT_S,
    RelaunchMixin,
    backoff_s,
    iso,
)
from infra.recovery_settings import Settings

ALARM_EVENT = "CloudWatch Alarm State Change"
WARNING_EVENT = "EC2 Spot Instance Interruption Warning"
REBALANCE_EVENT = "EC2 Instance Rebalance Recommendation"


class RecoveryError(Exception):
    """Raised by :func:`handler` after a tick in which some jobs could not be handled (each named in the
    message; the other jobs were handled): the invocation then counts as an error (the function's Errors alarm,
    infra/constructs/recovery.py) and its event goes to the on-failure destination after Lambda's retries."""


class Controller(RelaunchMixin, FinalMixin):
    """The decisions of the module docstring, on boto3 clients ``ec2``, ``s3``, ``sns``; ``now`` gives epoch
    seconds (tests move it). Every public method returns a list of short lines saying what it did;
    ``failures`` lists the jobs the last tick had to skip (malformed record, an error it could not handle)."""

    def __init__(self, settings: Settings, ec2, s3, sns, now: Callable[[], float] = time.time) -> None:
        self.s, self.ec2, self.s3, self.sns, self.now = settings, ec2, s3, sns, now
        self.failures: list[str] = []
        self.unreadable: list[jr.Corrupt] = []

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
        job, r = stored.record["job"], stored.record
        if kind in (WARNING_EVENT, REBALANCE_EVENT) and (
            r["state"] not in (jr.RUNNING, jr.WARNED) or jr.current(r)["end"]
        ):
            return [f"{job}: {kind} for {iid} ignored (state {r['state']}: the attempt has ended)"]
        if kind == WARNING_EVENT:
            return self._mark(stored, lambda r: self._warned(r, iid), f"{job}: {iid} warned")
        if kind == REBALANCE_EVENT:
            return [f"{job}: rebalance recommendation for {iid} noted (the job keeps running)"]
        if kind == "EC2 Instance State-change Notification":
            return self._ended(stored, iid, event["detail"].get("state", ""), info)
        return [f"ignored: {kind!r}"]

    def _current(self, iid: str):
        """(stored record, InstanceInfo) when ``iid`` is this environment's instance and its job's current
        attempt, else the line saying why the event is ignored. Raises Unknown (see :meth:`handle`)."""
        info = describe_instance(self.ec2, iid)
        if info.state == "gone":
            return f"unknown: EC2 does not find {iid} (it may be new); the tick decides"
        tags = info.tags or {}
        job = tags.get("trainstack:job") if tags.get("trainstack:env") == self.s.env else None
        if job is None:
            return f"ignored: {iid} is not a job instance of {self.s.env}"
        try:
            stored = jr.load(self.s3, self.s.bucket, job)
        except jr.Corrupt as e:
            return f"ignored: {e} (the tick reports it)"
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
        out, self.failures, self.unreadable = [], [], []
        try:
            live: Optional[list[LiveInstance]] = live_instances(self.ec2, self.s.env)
        except (ClientError, BotoCoreError) as e:
            live = None  # final jobs' leftovers wait for the next tick
            out.append(f"live instances unknown (DescribeInstances: {error_code(e)}); leftovers checked next tick")
        for job in jr.list_jobs(self.s3, self.s.bucket):
            try:
                out += self._tick_job(job, live)
            except jr.Corrupt as e:
                out.append(self._unreadable_line(e))
            except Exception as e:  # noqa: BLE001  (one bad record never stops the tick for the others)
                line = f"{job}: skipped this tick: {type(e).__name__}: {e}"
                out.append(line)
                self.failures.append(line)
        return out

    def _tick_job(self, job: str, live: Optional[list[LiveInstance]]) -> list[str]:
        stored = jr.load(self.s3, self.s.bucket, job)
        if stored is None:
            return []
        if stored.record["state"] in jr.FINAL_STATES:
            return [] if live is None else self._leftovers(stored, [i for i in live if i.job == job])
        r, now = stored.record, self.now()
        if r["state"] == jr.WAITING and (r["next_try_at"] or 0) <= now:
            return self.relaunch(stored)
        if r["state"] == jr.RELAUNCHING and (r["lease_until"] or 0) <= now:
            return self.relaunch(stored, take_over=True)
        if r["state"] not in (jr.RUNNING, jr.WARNED) or not jr.current(r):
            return []
        att, out = jr.current(r), []
        iid, young = att["instance_id"], now - att["start"] < self.s.unknown_grace_s
        try:
            info = describe_instance(self.ec2, iid, young=young)
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
        anything else (teardown, stop, the idle alarm, a shutdown inside the instance) ends the job unrelaunched;
        an instance ended at launch goes back to the capacity ladder or fails (:meth:`_ended_at_launch`). What EC2
        has not confirmed decides nothing (module docstring): a line, and the tick looks again.
        """
        r = stored.record
        job, att = r["job"], jr.current(r)
        if r["state"] in jr.FINAL_STATES or state != "terminated":
            if att["end"] is None and state in ("shutting-down", "terminated", "stopping"):
                return self._mark(stored, lambda x: self._close(x, state), f"{job}: {iid} {state}")
            return [f"{job}: {iid} {state}, nothing to do (state {r['state']})"]
        if r["state"] == jr.RELAUNCHING:  # another invocation holds the lease (or it expired: take it over)
            return self.relaunch(stored)
        if r["state"] not in (jr.RUNNING, jr.WARNED):  # handled already: the backoff of that decision stands
            return [f"{job}: {iid} terminated, already handled (state {r['state']}: {r['reason']})"]
        code = jr.exit_code(self.s3, self.s.bucket, job, iid)
        if code in jr.FINAL_EXIT_CODES:
            return self._finish(stored, code)
        if info.state not in ("terminated", "gone"):
            return [
                f"{job}: {iid} terminated by the event, EC2 still says {info.state}: unknown, decided on a later tick"
            ]
        reclaimed = info.reason_code == RECLAIM_CODE or (not info.reason_code and att.get("warned_at"))
        if info.reason_code in LAUNCH_RETRY_CODES or info.reason_code == KMS_CODE:
            return self._ended_at_launch(stored, iid, info)
        if not reclaimed and not info.reason_code and info.state == "terminated":
            first = att.get("unknown_since")
            line = f"{job}: {iid} terminated, EC2 gives no reason and no spot warning came: unknown"
            if first is None:
                att["unknown_since"] = self.now()
                return self._save(stored, f"{line} (decided after {self.s.unknown_grace_s:.0f} s)")
            if self.now() - first < self.s.unknown_grace_s:
                return [f"{line} since {iso(first)}"]
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
        if r["state"] in (jr.DONE, jr.FAILED, jr.STOPPED, jr.CAPPED, jr.WAITING, jr.RELAUNCHING):
            return [f"{job}: idle alarm of {iid}, nothing to do (state {r['state']}: that attempt has ended)"]
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
    Lambda retries it, then sends it to the on-failure destination, and the Errors alarm tells the topic. An
    unreadable record fails only the invocation that first reports it (:meth:`Controller.report_unreadable`)."""
    import boto3
    from botocore.config import Config

    # botocore's standard retry mode retries throttling (RequestLimitExceeded) and 5xx answers within the call with
    # exponential backoff and jitter, as the EC2 API throttling guide asks
    # (https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-throttling.html,
    # https://boto3.amazonaws.com/v1/documentation/api/latest/guide/retries.html); what still fails is left to the
    # next tick (infra/recovery_ec2.py error_kind).
    cfg = Config(retries={"mode": "standard", "max_attempts": 5})
    ec2, s3, sns = (boto3.client(name, config=cfg) for name in ("ec2", "s3", "sns"))
    ctl = Controller(Settings.from_environ(), ec2, s3, sns)
    actions = ctl.handle(event)
    actions += ctl.report_unreadable()
    for line in actions:
        print(line)
    if ctl.failures:
        raise RecoveryError(f"{len(ctl.failures)} job(s) skipped: " + " | ".join(ctl.failures))
    return {"actions": actions}
