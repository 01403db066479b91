"""Relaunching a job's next attempt: the part of the recovery controller (infra/recovery.py) that calls
RunInstances, with its capacity ladder, backoff and lease.

A round tries (type, market) options in order: the job's type on spot; after :data:`SPOT_ONLY_ROUNDS` refused
rounds also the fallback types on spot, then every type on-demand when allowed. Capacity refusals
(:data:`infra.recovery_ec2.CAPACITY_CODES`) go on to the next option; a throttling or server error ends the round;
both back off (:func:`backoff_s`) on their own round counts; a permission or configuration error
(:func:`infra.recovery_ec2.error_kind` ``"final"``) fails the job. boto3 only.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from infra import job_record as jr
from infra.recovery_ec2 import error_code, error_kind, run_job_instance

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
    ``_cap``, ``_save``, ``_tell``, ``_over_cost``, ``_volume_holder`` and ``_live_instances``)."""

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
