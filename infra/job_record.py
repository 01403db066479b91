"""The durable record of one EC2 job: ``s3://<data bucket>/jobs/<job>/record.json``, and its exit records.

One JSON object per job, written by ``python -m infra launch`` and updated by the recovery controller
(:mod:`infra.recovery`) and by ``stop``/``teardown`` (:func:`end`, before they terminate anything); ``status``, ``logs`` and ``stop`` read it. Every update is a
conditional write (S3 ``PutObject`` with ``If-Match`` on the ETag read, or ``If-None-Match: *`` when created;
Amazon S3 user guide, "Add preconditions to S3 operations with conditional requests"), so two writers never
overwrite each other: the second gets :class:`Conflict` and reads again.

Exit records, ``jobs/<job>/exits/<instance id>.json`` (``{"exit_code": N}``), are written by the instance's
user data when the training container ends with a final code (0 done, 2 bad input, 3 non-finite loss); an
instance that ends without one was interrupted.

Record fields: ``job``, ``env``, ``state`` (:data:`STATES`), ``reason``, ``recover`` (bool),
``instance_type``, ``fallback_types``, ``on_demand_fallback``, ``max_recoveries``, ``max_cost_usd`` (USD or
None), ``prices`` (type -> {"spot", "on-demand"}: USD per hour from the catalog at launch), ``tags`` (the
instance tags, image digest included), ``attempts`` (each: ``instance_id``, ``type``, ``market``,
``version``, ``start``, ``end`` (epoch seconds or None), ``ended_by``, ``warned_at``), ``recoveries``,
``capacity_rounds``, ``transient_rounds`` (rounds ended by a throttling/server error), ``next_try_at``,
``lease_until`` (epoch seconds or None), ``notes`` (the last round's errors), ``refusals`` ("<type> <market>" ->
{"code", "at"}: EC2's last refusal of each), ``launch`` (the next attempt's RunInstances client tokens,
"<type> <market>" -> token, kept until that attempt is recorded; each attempt keeps its ``client_token``),
``terminate_rounds``/``terminate_next_at`` (a final job's live instances not yet terminated: tries and the next).
Older records lack the last three and read as empty.
boto3 only: the recovery function imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from botocore.exceptions import ClientError

PREFIX = "jobs/"
#: Where the user data writes an instance's final exit code (``{job}``/``{instance_id}`` filled in; the shell
#: fills them with ``$JOB``/``$IID``).
EXIT_KEY = PREFIX + "{job}/exits/{instance_id}.json"
#: Final exit codes of the trainer (trainer/errors.py): done, bad input, non-finite loss.
FINAL_EXIT_CODES = (0, 2, 3)

#: Job states. Final ones take no further action.
RUNNING, WARNED, RELAUNCHING, WAITING = "running", "interrupting", "relaunching", "waiting"
DONE, FAILED, STOPPED, CAPPED, ENDED = "done", "failed", "stopped", "capped", "ended"
STATES = (RUNNING, WARNED, RELAUNCHING, WAITING, DONE, FAILED, STOPPED, CAPPED, ENDED)
FINAL_STATES = (DONE, FAILED, STOPPED, CAPPED, ENDED)


#: Fields every record has (written by ``launch``); a record without one of them is :class:`Corrupt`.
REQUIRED = (
    "job", "state", "reason", "recover", "instance_type", "fallback_types", "on_demand_fallback", "max_recoveries",
    "max_cost_usd", "prices", "tags", "attempts", "recoveries", "capacity_rounds", "next_try_at", "lease_until",
)  # fmt: skip
#: The type of the fields that the controller and the CLI compute with (a wrong one is as bad as a missing one).
TYPES = {
    "job": str, "state": str, "reason": str, "recover": bool, "attempts": list, "recoveries": int,
    "max_recoveries": int, "prices": dict,
}  # fmt: skip
ATTEMPT_REQUIRED = ("instance_id", "type", "market", "start", "end", "ended_by")


class Conflict(Exception):
    """Another writer changed (or created) the record since it was read: read it again."""


class Corrupt(ValueError):
    """A record that is not JSON, or lacks a field of :data:`REQUIRED` / :data:`ATTEMPT_REQUIRED`, or has a state
    outside :data:`STATES`: nothing can be decided from it. ``job`` names it, ``etag`` is the object's ETag (so
    that a report can be made once per version of the object), ``cause`` the kind of fault (``JSONDecodeError``,
    ``KeyError`` for a missing field, ``ValueError``)."""

    def __init__(self, job: str, etag: str, what: str, cause: str = "ValueError") -> None:
        super().__init__(f"record of job {job} unreadable: {what}")
        self.job, self.etag, self.cause = job, etag, cause


def check(job: str, etag: str, record: object) -> dict:
    """``record`` when it has every field the controller reads, else raises :class:`Corrupt` naming the first
    missing or wrong one."""
    if not isinstance(record, dict):
        raise Corrupt(job, etag, f"is a JSON {type(record).__name__}, not an object")
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise Corrupt(job, etag, f"lacks field {missing[0]!r}{more}", "KeyError")
    wrong = [k for k, kind in TYPES.items() if not isinstance(record[k], kind)]
    if wrong:
        k = wrong[0]
        raise Corrupt(job, etag, f"field {k!r} is {record[k]!r}, expected a {TYPES[k].__name__}")
    if record["state"] not in STATES:
        raise Corrupt(job, etag, f"state {record['state']!r} is not one of {', '.join(STATES)}")
    if not isinstance(record["attempts"], list) or not all(
        isinstance(a, dict) and all(k in a for k in ATTEMPT_REQUIRED) for a in record["attempts"]
    ):
        raise Corrupt(job, etag, f"attempts: expected a list of objects with {', '.join(ATTEMPT_REQUIRED)}")
    return record


@dataclass
class Stored:
    """A record as read (``etag`` is what the next conditional write must match)."""

    record: dict
    etag: str


def record_key(job: str) -> str:
    """The S3 key of ``job``'s record."""
    return f"{PREFIX}{job}/record.json"


def new_record(
    job: str,
    env: str,
    instance_type: str,
    tags: list[dict],
    prices: dict[str, dict[str, float]],
    *,
    recover: bool = True,
    fallback_types: tuple[str, ...] = (),
    on_demand_fallback: bool = False,
    max_recoveries: int = 10,
    max_cost_usd: Optional[float] = None,
) -> dict:
    """A record for a job about to be launched (no attempt yet; state ``running``)."""
    return {
        "job": job,
        "env": env,
        "state": RUNNING,
        "reason": "launched",
        "recover": recover,
        "instance_type": instance_type,
        "fallback_types": list(fallback_types),
        "on_demand_fallback": on_demand_fallback,
        "max_recoveries": max_recoveries,
        "max_cost_usd": max_cost_usd,
        "prices": prices,
        "tags": tags,
        "attempts": [],
        "recoveries": 0,
        "capacity_rounds": 0,
        "transient_rounds": 0,
        "next_try_at": None,
        "lease_until": None,
        "notes": [],
        "refusals": {},
        "launch": {},
    }


def _is(err: ClientError, *codes: str) -> bool:
    return err.response.get("Error", {}).get("Code", "") in codes


def load(s3, bucket: str, job: str) -> Optional[Stored]:
    """The record of ``job``, or None when there is none. Raises :class:`Corrupt` (a ValueError) for a record
    that is not JSON or lacks a field, botocore ClientError for other S3 errors."""
    try:
        got = s3.get_object(Bucket=bucket, Key=record_key(job))
    except ClientError as e:
        if _is(e, "NoSuchKey", "404"):
            return None
        raise
    body = got["Body"].read()
    try:
        record = json.loads(body)
    except ValueError as e:
        raise Corrupt(job, got["ETag"], f"is not JSON ({e})", type(e).__name__) from None
    return Stored(check(job, got["ETag"], record), got["ETag"])


def _put(s3, bucket: str, record: dict, **condition) -> Stored:
    """Write ``record`` with ``condition`` (``IfNoneMatch``/``IfMatch``); raises :class:`Conflict` when S3 refuses
    the precondition, unless the refused request was a retry and the object holds exactly these bytes: then the
    first request wrote them and its answer was lost (a 500 or a reset after S3 ran it; botocore retried it, and
    the retry's precondition no longer held; Amazon S3 user guide, "Amazon S3 error best practices": a PUT that
    got InternalError may have been applied)."""
    body = json.dumps(record, indent=1, sort_keys=True).encode()
    key = record_key(record["job"])
    try:
        out = s3.put_object(Bucket=bucket, Key=key, Body=body, **condition)
    except ClientError as e:
        if not _is(e, "PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
            raise
        if condition and e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0:
            got = s3.get_object(Bucket=bucket, Key=key)
            if got["Body"].read() == body:
                return Stored(record, got["ETag"])
        raise Conflict(record["job"]) from None
    return Stored(record, out["ETag"])


def create(s3, bucket: str, record: dict) -> Stored:
    """Write a new record; raises :class:`Conflict` when the job already has one."""
    return _put(s3, bucket, record, IfNoneMatch="*")


def save(s3, bucket: str, stored: Stored) -> Stored:
    """Write ``stored.record`` if nobody changed it since it was read; raises :class:`Conflict` otherwise."""
    return _put(s3, bucket, stored.record, IfMatch=stored.etag)


def replace(s3, bucket: str, record: dict) -> Stored:
    """Write ``record`` unconditionally (``launch`` reusing a job name whose run is final)."""
    return _put(s3, bucket, record)


def end(s3, bucket: str, job: str, state: str, reason: str, tries: int = 10) -> Optional[dict]:
    """Mark ``job`` ended on purpose (``state``, e.g. :data:`STOPPED`, with ``reason``) *before* its instances are
    terminated, so that the recovery controller relaunches nothing: a conditional write, read again when another
    writer came in between. A job already final keeps its state (``done`` stays ``done``). Returns the record as
    written (or as found when final), None when the job has no record. Raises :class:`Conflict` when the
    record kept changing ``tries`` times, botocore ClientError for S3 errors."""
    for _ in range(tries):
        stored = load(s3, bucket, job)
        if stored is None:
            return None
        r = stored.record
        if r["state"] in FINAL_STATES and r["state"] != STOPPED:
            return r
        r["state"], r["reason"], r["lease_until"] = state, reason, None
        try:
            return save(s3, bucket, stored).record
        except Conflict:
            continue
    raise Conflict(job)


def exit_code(s3, bucket: str, job: str, instance_id: str) -> Optional[int]:
    """The final exit code the user data recorded for ``instance_id``, or None (none: it was interrupted)."""
    try:
        got = s3.get_object(Bucket=bucket, Key=EXIT_KEY.format(job=job, instance_id=instance_id))
    except ClientError as e:
        if _is(e, "NoSuchKey", "404"):
            return None
        raise
    try:
        return int(json.loads(got["Body"].read())["exit_code"])
    except (ValueError, KeyError, TypeError):
        return None


def list_jobs(s3, bucket: str) -> list[str]:
    """Names of the jobs with a record in ``bucket``."""
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX, Delimiter="/"):
        out += [p["Prefix"][len(PREFIX) : -1] for p in page.get("CommonPrefixes", [])]
    return out


def unfinished(s3, bucket: str) -> list[tuple[str, Optional[dict]]]:
    """(name, record) of every job in ``bucket`` whose record is not final; a record that is not JSON comes with
    None (it may be anything: the caller decides). Raises botocore ClientError for S3 errors."""
    out = []
    for name in list_jobs(s3, bucket):
        try:
            stored = load(s3, bucket, name)
        except ValueError:
            out.append((name, None))
            continue
        if stored is not None and stored.record.get("state") not in FINAL_STATES:
            out.append((name, stored.record))
    return out


def current(record: dict) -> Optional[dict]:
    """The latest attempt, or None before the first launch."""
    return record["attempts"][-1] if record["attempts"] else None


def spend_usd(record: dict, now: float) -> float:
    """USD spent so far: each attempt's hours (start to end, or to ``now`` while it runs) times the catalog
    price of its type and market recorded at launch (on-demand when a spot price is missing)."""
    total = 0.0
    for a in record["attempts"]:
        price = record["prices"].get(a["type"], {})
        usd_per_hour = price.get(a["market"], price.get("on-demand", 0.0))
        total += max(0.0, ((a["end"] or now) - a["start"]) / 3600.0) * usd_per_hour
    return total
