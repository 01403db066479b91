"""Relaunching a job's next attempt: the part of the recovery controller (infra/recovery.py) that calls
RunInstances, with its capacity ladder, backoff and lease.

A round tries (type, market) options in order: the job's type on spot; after :data:`SPOT_ONLY_ROUNDS` refused
rounds also the fallback types on spot, then every type on-demand when allowed. Capacity refusals
(:data:`infra.recovery_ec2.CAPACITY_CODES`) go on to the next option; a throttling or server error ends the round;
both back off (:func:`backoff_s`) on their own round counts; a permission or configuration error
(:func:`infra.recovery_ec2.error_kind` ``"final"``) fails the job. An instance EC2 ends during its launch
(``Server.*`` StateReasons) counts as a refused round too (:meth:`RelaunchMixin._ended_at_launch`).

No second instance for one attempt (EC2 developer guide, "Ensuring idempotency in Amazon EC2 API requests"):
each (type, market) option of the next attempt has a client token, saved in the record (``launch``) before
RunInstances is called and reused by every retry and by an invocation taking over an expired lease, so a call
whose answer was lost (read timeout, the function timed out) returns, when repeated, the instance it made. A
token is dropped once EC2 answers with an error (that request made nothing) and moved to the attempt once it is
recorded. Before launching, a live instance tagged with the job that no attempt holds, launched since the job's
first attempt, is adopted as the attempt (recorded, counted, its spend from its launch time), never waited for or
duplicated. boto3 only.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from infra import job_record as jr
from infra.recovery_ec2 import (
    KMS_CODE,
    InstanceInfo,
    error_code,
    error_kind,
    live_instances,
    run_job_instance,
)

BACKOFF_BASE_S = 120
BACKOFF_MAX_S = 1800
SPOT_ONLY_ROUNDS = 2
LEASE_S = 300
VOLUME_WAIT_S = 60


def iso(epoch: Optional[float]) -> Optional[str]:
    """``epoch`` (seconds) as ISO 8601 UTC, e.g. ``2026-11-28T06:40:00Z``; None stays None."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def backoff_s(rounds: int) -> int:
    """Seconds before the next try after ``rounds`` (>= 1) refused rounds: :data:`BACKOFF_BASE_S` x 2^(rounds-1),
    at most :data:`BACKOFF_MAX_S`."""
    return min(BACKOFF_BASE_S * 2 ** (rounds - 1), BACKOFF_MAX_S)


class RelaunchMixin:
    """:meth:`relaunch` for :class:`infra.recovery.Controller` (which provides ``s``, ``ec2``, ``s3``, ``now``,
    ``_cap``, ``_close``, ``_save``, ``_tell``, ``_over_cost``, ``_volume_holder`` and ``_live_instances``)."""

    def relaunch(self, stored: jr.Stored, take_over: bool = False) -> list[str]:
        """Launch the job's next attempt (see the module docstring); returns what happened."""
        r, now = stored.record, self.now()
        job = r["job"]
        if r["state"] == jr.RELAUNCHING and (r["lease_until"] or 0) > now and not take_over:
            return [f"{job}: another invocation is relaunching it"]
        adopted = self._adopt(stored)  # first: an instance that exists is recorded whatever the caps say
        if adopted is not None:
            return adopted
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
        tokens = r.setdefault("launch", {})
        for itype, market in options:  # saved before RunInstances: a retry or a take-over reuses them
            tokens.setdefault(f"{itype} {market}", f"{job[:24]}-{uuid.uuid4().hex}")
        try:
            stored = jr.save(self.s3, self.s.bucket, stored)
        except jr.Conflict:
            return [f"{job}: the record changed under this invocation; another one handles it"]
        r = stored.record
        errors, transient = [], None
        for itype, market in options:
            token = r["launch"][f"{itype} {market}"]
            try:
                iid, version = run_job_instance(self.ec2, self.s.launch_templates[itype], r["tags"], market, token)
            except (ClientError, BotoCoreError) as e:
                code, kind = error_code(e), error_kind(e)
                if isinstance(e, ClientError):  # an answer: that request made no instance, its token is spent
                    r["launch"].pop(f"{itype} {market}", None)
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
            return self._launched(stored, iid, itype, market, version, token)
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

    def _adopt(self, stored: jr.Stored) -> Optional[list[str]]:
        """Record as the next attempt a live (pending/running) instance tagged with the job that no attempt holds
        and that was launched since the job's first attempt (a relaunch whose answer was lost); any further such
        instance is a duplicate and terminated. None when there is none."""
        r = stored.record
        known = {a["instance_id"] for a in r["attempts"]}
        since = min((a["start"] for a in r["attempts"]), default=0.0) - 1.0  # LaunchTime is in whole seconds
        found = [
            i
            for i in live_instances(self.ec2, self.s.env, r["job"])
            if i.id not in known and i.state in ("pending", "running") and i.launched >= since
        ]
        if not found:
            return None
        first, extra = found[0], [i.id for i in found[1:]]
        lines = self._launched(stored, first.id, first.type, first.market, None, None, start=first.launched)
        if extra and lines[0].startswith(f"{r['job']}: adopted"):
            try:
                self.ec2.terminate_instances(InstanceIds=extra)
                lines.append(f"{r['job']}: terminated duplicate(s) {' '.join(extra)}")
            except (ClientError, BotoCoreError) as e:
                lines.append(f"{r['job']}: terminating duplicate(s) {' '.join(extra)} failed ({error_code(e)})")
        return lines

    def _launched(
        self,
        stored: jr.Stored,
        iid: str,
        itype: str,
        market: str,
        version: Optional[str],
        token: Optional[str],
        start: Optional[float] = None,
    ) -> list[str]:
        """Record ``iid`` as the job's next attempt (launched by this invocation with client ``token``, or, with
        ``start``, adopted: launched then by an earlier one) and tell the topic; when the record changed in the
        meantime, undo (:meth:`_undo_launch`)."""
        r = stored.record
        how = "relaunched as" if start is None else "adopted"
        attempt = {
            "instance_id": iid,
            "type": itype,
            "market": market,
            "version": version,
            "start": self.now() if start is None else start,
            "end": None,
            "ended_by": None,
            "warned_at": None,
            "client_token": token,
        }
        r["attempts"].append(attempt)
        r["recoveries"] += 1
        r["state"], r["reason"] = jr.RUNNING, f"{how} {iid} ({itype}, {market})"
        if start is not None:
            r["reason"] += ": launched by an earlier relaunch whose answer was lost"
        r["capacity_rounds"], r["next_try_at"], r["lease_until"], r["notes"] = 0, None, None, []
        r["transient_rounds"], r["launch"] = 0, {}
        try:
            jr.save(self.s3, self.s.bucket, stored)
        except jr.Conflict:  # stopped (or otherwise changed) while this invocation launched: undo
            return self._undo_launch(r["job"], attempt)
        self._tell(r["job"], f"job {r['job']} {how} {iid} ({itype}, {market}), recovery {r['recoveries']}")
        return [f"{r['job']}: {how} {iid} ({itype}, {market})"]

    def _undo_launch(self, job: str, attempt: dict) -> list[str]:
        """The record changed while ``attempt`` was launched. When another invocation recorded the same instance
        (a take-over reusing the client token), nothing; else the instance is terminated, and a final record
        (``stop``) gets it as a closed attempt first, so its spend counts and the tick terminates it should
        EC2 refuse now."""
        iid = attempt["instance_id"]
        for _ in range(5):
            fresh = jr.load(self.s3, self.s.bucket, job)
            if fresh is None or fresh.record["state"] not in jr.FINAL_STATES:
                break
            if any(a["instance_id"] == iid for a in fresh.record["attempts"]):
                break
            attempt["end"], attempt["ended_by"] = self.now(), f"{fresh.record['state']} during the relaunch"
            fresh.record["attempts"].append(attempt)
            try:
                jr.save(self.s3, self.s.bucket, fresh)
                break
            except jr.Conflict:
                continue
        if fresh is not None and fresh.record["state"] not in jr.FINAL_STATES:
            if any(a["instance_id"] == iid for a in fresh.record["attempts"]):
                return [f"{job}: {iid} was recorded by another invocation"]
        try:
            self.ec2.terminate_instances(InstanceIds=[iid])
        except (ClientError, BotoCoreError) as e:
            return [f"{job}: the record changed during the relaunch; terminating {iid} failed ({error_code(e)})"]
        return [f"{job}: the record changed during the relaunch; terminated {iid}"]

    def _ended_at_launch(self, stored: jr.Stored, iid: str, info: InstanceInfo) -> list[str]:
        """EC2 ended ``iid`` during its launch: ``Server.InternalError``/``Server.InsufficientInstanceCapacity``
        count as a refused capacity round (backoff, then fallback types and on-demand, as a refused RunInstances);
        :data:`KMS_CODE` fails the job, naming the KMS key of the encrypted EBS volumes."""
        r, now = stored.record, self.now()
        job, att, code = r["job"], jr.current(r), info.reason_code
        self._close(r, code)
        said = info.reason if info.reason.startswith(code) else f"{code}: {info.reason}".rstrip(": ")
        if code == KMS_CODE:
            why = (
                f"{iid} ended at launch by {said}: the instance could not use the KMS key of its encrypted EBS "
                "volumes (give the instance role and EC2 use of the key: kms:CreateGrant, kms:Decrypt, "
                "kms:GenerateDataKeyWithoutPlaintext)"
            )
            r["state"], r["reason"], r["lease_until"] = jr.FAILED, f"{why}; not retried", None
            lines = self._save(stored, f"{job}: failed ({why})")
            if lines[0].startswith(f"{job}: failed"):
                self._tell(job, f"job {job} failed: {why}; not retried")
            return lines
        r.setdefault("refusals", {})[f"{att['type']} {att['market']}"] = {"code": code, "at": now}
        if not r["recover"]:
            r["state"], r["reason"], r["lease_until"] = jr.ENDED, f"{iid} ended at launch by {said}; --no-recover", None
            return self._save(stored, f"{job}: {iid} ended at launch ({code}), not relaunched (--no-recover)")
        r["capacity_rounds"] += 1
        wait = backoff_s(r["capacity_rounds"])
        r["state"], r["lease_until"], r["next_try_at"] = jr.WAITING, None, now + wait
        r["reason"] = f"{iid} ended at launch by {said} (round {r['capacity_rounds']}); next try at {iso(now + wait)}"
        r["notes"] = [f"{att['type']} {att['market']}: {code}"]
        return self._save(stored, f"{job}: {iid} ended at launch ({code}); retry in {wait} s")
