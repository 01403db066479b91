"""Experiment-tracking sinks (rank 0 only): the enabled trackers of a run, fed off the training thread.

:class:`trainer.engine.logging.MetricsLogger` fans every metric row out to :class:`TrackingSinks`, which hands it
to the backends named by the ``tracking`` config field (:mod:`trainer.engine.trackers`: MLflow, W&B) through a
queue and one daemon thread, so a training step never waits for a tracking server.

A tracker that cannot be reached (bad URI, missing package, network) never costs the training run: the sink
prints one ``WARNING: tracking <name>: ...`` line and disables itself.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from trainer.engine.trackers import Tracker

#: Items (metric rows, tags, params, artifacts) that may wait for a slow tracker before new rows are dropped from
#: the trackers (the JSONL and TensorBoard files keep every row).
MAX_PENDING = 10_000
#: Seconds :meth:`TrackingSinks.finish` waits for the trackers to take the items still queued.
FLUSH_TIMEOUT_S = 60.0
#: Seconds the trackers get after a second Ctrl-C (exit 130) to take what is queued and end KILLED: the user asked
#: to stop now, so the flush is short.
ABORT_FLUSH_TIMEOUT_S = 10.0
_STOP = object()


def root_cause(e: BaseException, limit: int = 300) -> str:
    """One line for a tracker's failure that keeps its root cause: ``Type: message`` of ``e`` (cut to ``limit``
    characters), followed by ``; cause: Type: message`` of the innermost exception it was raised from (MLflow and
    W&B wrap the network error that explains it in a long message of their own, which used to be cut before it)."""

    def one(x: BaseException) -> str:
        text = " ".join(str(x).split()) or type(x).__name__
        return f"{type(x).__name__}: {text[:limit] + ('...' if len(text) > limit else '')}"

    inner, seen = e, {id(e)}
    while True:
        nxt = inner.__cause__ or inner.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        inner = nxt
    return one(e) + (f"; cause: {one(inner)}" if inner is not e else "")


class TrackingSinks:
    """The enabled trackers of a run; each call goes to every live sink. The first exception of a sink prints
    ``WARNING: tracking <name>: <what> failed (...); training continues without it`` through ``warn`` and disables
    that sink (a tracker never stops training).

    Delivery is off the training thread: :meth:`start` and :meth:`attach` run in the caller (they return run ids
    that the next checkpoint stores), everything after them — params, tags, metric rows, artifacts, and
    :meth:`finish`/:meth:`detach` — goes in order through a queue to one daemon thread, so a training step pays
    for a dict copy and a ``Queue.put`` (microseconds: docs/benchmarks.md) whatever the tracking server's latency.
    The thread hands every run of consecutive metric rows to :meth:`Tracker.log_rows` at once (MLflow: one
    ``log_batch`` for up to :data:`~trainer.engine.trackers.MLFLOW_BATCH_METRICS` metrics). When more than ``max_pending`` items wait,
    new rows are dropped from the trackers with one WARNING line (the JSONL keeps them). :meth:`finish` and
    :meth:`detach` wait up to ``flush_timeout_s`` seconds for the queue to drain, then warn how many items were
    not delivered and return. ``background=False`` runs every call in the caller (``predict --track``, which
    reports what was uploaded).
    """

    def __init__(
        self,
        trackers: list,
        warn: Callable[[str], None],
        continues: str = "training continues",
        background: bool = True,
        max_pending: int = MAX_PENDING,
        flush_timeout_s: float = FLUSH_TIMEOUT_S,
    ):
        self.live = list(trackers)
        self.warn = warn
        self.continues = continues
        self.run_ids: dict = {}
        self.background = background
        self.flush_timeout_s = flush_timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: Optional[threading.Thread] = None
        self._dropped = 0

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for t in list(self.live):
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - any tracker failure (import, network, server) disables it
                self.live.remove(t)
                self.warn(f"WARNING: tracking {t.name}: {what} failed ({root_cause(e)}); {self.continues} without it")

    # .. the delivery thread ..............................................................................
    def _deliver(self) -> None:
        """The daemon thread: take items in order; consecutive metric rows go to each tracker as one batch."""
        item = self._queue.get()
        while item is not _STOP:
            what, payload = item
            item = None
            if what != "log_metrics":
                self._each(what, payload)
            else:
                rows = [payload]
                while item is None:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is not _STOP and nxt[0] == "log_metrics":
                        rows.append(nxt[1])
                    else:
                        item = nxt  # the next non-row item (or the stop), handled after this batch
                self._each("log_metrics", lambda t, rows=rows: t.log_rows(rows))
            if item is None:
                item = self._queue.get()

    def _submit(self, what: str, payload) -> None:
        if not self.background:
            self._each(what, payload if what != "log_metrics" else (lambda t: t.log_rows([payload])))
            return
        if not self.live:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._deliver, name="trainstack-tracking", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait((what, payload))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                self.warn(
                    f"WARNING: tracking: {self._queue.maxsize} items wait for the trackers; new items are dropped "
                    "until they catch up (metrics.jsonl keeps every row)"
                )

    def _close(self, what: str, call: Callable[[Tracker], None], timeout_s: Optional[float] = None) -> None:
        """Queue the closing call, wait up to ``timeout_s`` (default ``flush_timeout_s``) for the thread to deliver
        everything."""
        timeout_s = self.flush_timeout_s if timeout_s is None else timeout_s
        if self._thread is None:
            self._each(what, call)
        else:
            deadline = time.monotonic() + timeout_s
            stop_queued = False
            try:
                self._queue.put((what, call), timeout=max(timeout_s, 0.001))
                self._queue.put(_STOP, timeout=max(deadline - time.monotonic(), 0.001))
                stop_queued = True
            except queue.Full:
                pass
            self._thread.join(max(deadline - time.monotonic(), 0.0))
            if self._thread.is_alive():
                self.warn(
                    f"WARNING: tracking: {self._queue.qsize() - stop_queued} items were not delivered within "
                    f"{timeout_s:g} s ({what} included); metrics.jsonl keeps every row"
                    + ("; ending the tracked runs without them" if what == "finish" else "")
                )
                if what == "finish":  # a true end state (not RUNNING for ever) matters more than the last rows
                    self._each(what, call)
            self._thread = None
        if self._dropped:
            self.warn(f"WARNING: tracking: {self._dropped} items were dropped while the trackers lagged behind")
        self.live = []

    # .. the calls ........................................................................................
    def start(self, run_ids: dict) -> None:
        """Start every sink, continuing the run ids of ``run_ids`` (tracker name -> id, from a checkpoint)."""

        self.run_ids = {k: v for k, v in run_ids.items() if v}  # kept for the next resume if a start fails

        def go(t: Tracker) -> None:
            self.run_ids[t.name] = t.start(run_ids.get(t.name))

        self._each("start", go)

    def log_params(self, params: dict) -> None:
        """:meth:`Tracker.log_params` on every live sink."""
        params = dict(params)
        self._submit("log_params", lambda t: t.log_params(params))

    def log_metrics(self, kind: str, step: int, values: dict) -> None:
        """:meth:`Tracker.log_metrics` on every live sink (``values`` is copied: the caller may reuse it)."""
        self._submit("log_metrics", (kind, step, dict(values), time.time()))

    def set_tags(self, tags: dict) -> None:
        """:meth:`Tracker.set_tags` on every live sink."""
        tags = dict(tags)
        self._submit("set_tags", lambda t: t.set_tags(tags))

    def log_artifact(self, path: Path, base: Optional[Path] = None) -> None:
        """:meth:`Tracker.log_artifact` on every live sink."""
        self._submit("log_artifact", lambda t: t.log_artifact(path, base))

    def attach(self, run_ids: dict) -> None:
        """:meth:`Tracker.attach` every sink to its run in ``run_ids`` (tracker name -> id, one per sink)."""
        self.run_ids = dict(run_ids)
        self._each("attach", lambda t: t.attach(run_ids[t.name]))

    def detach(self) -> None:
        """:meth:`Tracker.detach` on every live sink after everything queued; the sinks are then closed."""
        self._close("detach", lambda t: t.detach())

    def finish(self, status: str = "FINISHED", timeout_s: Optional[float] = None) -> None:
        """:meth:`Tracker.finish` on every live sink after everything queued (waiting at most ``timeout_s``
        seconds, default ``flush_timeout_s``); the sinks are then closed."""
        self._close("finish", lambda t: t.finish(status), timeout_s)
