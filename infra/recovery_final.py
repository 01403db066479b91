"""Ending EC2 jobs, the part of the recovery controller (infra/recovery.py) that makes sure a final job leaves
nothing running and that an unreadable record is said once: the cost/recovery cap (:meth:`FinalMixin._cap`), the
tick's termination of a final job's leftover instances (:meth:`FinalMixin._leftovers`), and the report of
unreadable records (:meth:`FinalMixin.report_unreadable`).

A job's final state is written before its instance is terminated (so no invocation relaunches it meanwhile); the
termination may then be refused (``RequestLimitExceeded`` after botocore's own retries, EC2 API reference, "Error
codes for the Amazon EC2 API"), which is why the tick, not the decision, owns "nothing left running": every tick
lists the environment's live job instances once and terminates those of final jobs, backing off while EC2 refuses
(EC2 developer guide, "Request throttling for the Amazon EC2 API"). boto3 only.
"""

from __future__ import annotations

import json
from typing import Optional

from botocore.exceptions import BotoCoreError, ClientError

from infra import job_record as jr
from infra.recovery_ec2 import LiveInstance, error_code, error_kind
from infra.recovery_launch import backoff_s, iso

#: Where the handler notes that an unreadable record was reported (``{"etag": ...}``): once per version.
UNREADABLE_KEY = jr.PREFIX + "{job}/record-unreadable.json"


class FinalMixin:
    """:meth:`_cap`, :meth:`_leftovers`, :meth:`report_unreadable` for :class:`infra.recovery.Controller` (which
    provides ``s``, ``ec2``, ``s3``, ``now``, ``failures``, ``unreadable``, ``_close``, ``_save``, ``_saved``,
    ``_not_saved`` and ``_tell``)."""

    def _cap(self, stored: jr.Stored, why: str, terminate: Optional[str] = None) -> list[str]:
        """Mark the job ``capped``, then tell the topic and terminate ``terminate`` (the running attempt over the
        cost cap), both only once that is saved: when another writer changed the record since it was read, nothing
        is done and the next tick decides again from the record as it is then. A terminate EC2 refuses
        (throttled) is left to the tick (:meth:`_leftovers`); the message goes out regardless."""
        r = stored.record
        r["state"], r["reason"], r["lease_until"] = jr.CAPPED, f"stopped: {why}", None
        if terminate:
            self._close(r, "cost cap")
        if not self._saved(stored):
            return [self._not_saved(stored)]
        self._tell(r["job"], f"job {r['job']} stopped: {why}")
        line = f"{r['job']}: capped ({why})"
        if terminate:
            try:
                self.ec2.terminate_instances(InstanceIds=[terminate])
            except (ClientError, BotoCoreError) as e:
                line += f"; terminating {terminate} failed ({error_code(e)}): the tick terminates it"
        return [line]

    def _leftovers(self, stored: jr.Stored, live: list[LiveInstance]) -> list[str]:
        """A final job's attempts whose instances still run (a terminate EC2 refused, a job that exited and did
        not shut down): terminate them, after :attr:`~infra.recovery_settings.Settings.unknown_grace_s` past the attempt's end for a
        ``done``/``failed`` job (its instance shuts itself down) and never a kept instance of one. EC2 refusing
        backs off (:func:`backoff_s` per refused round, ``terminate_rounds``/``terminate_next_at`` in the record);
        a permission error is also a tick failure. Instances that no attempt holds (a new launch reusing the job
        name) and stopped ones are left alone."""
        r, now = stored.record, self.now()
        job = r["job"]
        ends = {a["instance_id"]: a["end"] for a in r["attempts"]}
        finished = r["state"] in (jr.DONE, jr.FAILED)
        doomed = [
            i.id
            for i in live
            if i.id in ends
            and i.state in ("pending", "running")
            and not (finished and (i.kept or now - (ends[i.id] or now) < self.s.unknown_grace_s))
        ]
        if not doomed:
            if r.get("terminate_rounds"):
                r["terminate_rounds"], r["terminate_next_at"] = 0, None
                return self._save(stored, f"{job}: no instance left running")
            return []
        if (r.get("terminate_next_at") or 0) > now:
            return [
                f"{job}: {' '.join(doomed)} still running ({r['state']}); next terminate at {iso(r['terminate_next_at'])}"
            ]
        try:
            self.ec2.terminate_instances(InstanceIds=doomed)
        except (ClientError, BotoCoreError) as e:
            n = r.get("terminate_rounds", 0) + 1
            r["terminate_rounds"], r["terminate_next_at"] = n, now + backoff_s(n)
            line = f"{job}: terminating {' '.join(doomed)} ({r['state']}) failed ({error_code(e)}); retry at {iso(now + backoff_s(n))}"
            if error_kind(e) == "final":
                self.failures.append(line)
            return self._save(stored, line)
        if r.get("terminate_rounds"):
            r["terminate_rounds"], r["terminate_next_at"] = 0, None
            self._saved(stored)  # a conflict only leaves the old count; the next tick finds nothing to terminate
        return [f"{job}: terminated {' '.join(doomed)}, still running after the job ended ({r['state']})"]

    def _unreadable_line(self, e: jr.Corrupt) -> str:
        """The tick's line for an unreadable record; the first sighting of each version of it is also a failure
        and queued in :attr:`unreadable` for :meth:`report_unreadable`."""
        line = f"{e.job}: skipped this tick: {e.cause}: {e}"
        try:
            got = self.s3.get_object(Bucket=self.s.bucket, Key=UNREADABLE_KEY.format(job=e.job))
            reported = json.loads(got["Body"].read()).get("etag") == e.etag
        except (ClientError, ValueError, AttributeError):
            reported = False
        if reported:
            return line + " (reported before; fix or delete the record)"
        self.failures.append(line)
        self.unreadable.append(e)
        return line

    def report_unreadable(self) -> list[str]:
        """Tell the topic once about each record in :attr:`unreadable` and note it (:data:`UNREADABLE_KEY`), so
        later ticks log it without failing the invocation again. Returns what it did."""
        out = []
        for e in self.unreadable:
            key = jr.record_key(e.job)
            self._tell(
                e.job, f"job {e.job}: {e}; recovery skips it until s3://{self.s.bucket}/{key} is fixed or deleted"
            )
            body = json.dumps({"etag": e.etag, "error": str(e)}).encode()
            self.s3.put_object(Bucket=self.s.bucket, Key=UNREADABLE_KEY.format(job=e.job), Body=body)
            out.append(f"{e.job}: unreadable record reported")
        self.unreadable = []
        return out
