"""Stop requests: SIGTERM/SIGINT/SIGHUP and the EC2 spot interruption notice, turned into one flag.

Sources (any of them sets :class:`StopFlag`; nothing else happens in a signal handler or the poller):

* ``SIGTERM`` — SageMaker stop and managed-spot reclaim, EC2 shutdown (systemd sends it to every process of
  the unit), ``docker stop``. Repeats are ignored.
* ``SIGHUP`` — the terminal or SSH session closed (the kernel sends it to the session's foreground process
  group). Stops like SIGTERM (durable checkpoint, exit 75, the tracked runs end KILLED), and first points the
  standard output and error that are terminals at ``/dev/null`` (``nohup`` does the same). A write to the terminal
  of a closed SSH session fails with EIO, which would crash the stop checkpoint's log lines; since the terminal
  can go before the signal arrives, ``sys.stdout``/``sys.stderr`` on a terminal are wrapped while the handlers
  are installed so that EIO does the same instead of raising (:class:`TerminalStream`). Output going to a file
  or pipe is left as it is.
* ``SIGINT`` — Ctrl-C. The first one prints (global rank 0) "SIGINT: stopping at the next step; Ctrl-C again to
  abort without saving" on stderr and stops like SIGTERM (durable checkpoint, exit 75). The second raises
  ``KeyboardInterrupt`` in the main thread and ignores any further SIGINT: the trainer abandons the checkpoint
  being written (:meth:`trainer.engine.trainer.Trainer.abort`, which removes its ``.tmp-ckpt-*`` folder; complete
  checkpoints stay) and ``trainer.engine.run`` prints one line and exits 130 (128 + SIGINT).
* EC2 spot interruption notice over IMDSv2 (AWS docs, "Spot Instance interruption notices"):
  ``PUT /latest/api/token`` (header ``X-aws-ec2-metadata-token-ttl-seconds``), then every 5 s
  ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``: 404 = nothing scheduled,
  200 = JSON ``{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}`` about two minutes ahead. Optionally
  ``/latest/meta-data/events/recommendations/rebalance`` (an earlier, softer signal). The endpoint is botocore's
  ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (default ``http://169.254.169.254``), so tests serve it from
  127.0.0.1. Off EC2 one short probe (1 s timeout) fails and nothing polls afterwards.

The training loop reads the flag only at optimizer-step boundaries and before evaluation batches (those that every
rank runs), and all ranks agree on it there (``EpochMixin._control`` in ``trainer.engine.epoch``), so a stop is always at a consistent
point. An epoch's training is durable before its evaluation starts, so a stop during the evaluation only skips
the rest of it (the resumed run evaluates the epoch again).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Optional

DEFAULT_IMDS_ENDPOINT = "http://169.254.169.254"
TOKEN_TTL_S = 21600


class StopFlag:
    """Thread- and signal-safe "please stop" flag with the first reason and its time (``time.monotonic``)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: Optional[str] = None
        self.requested_at: Optional[float] = None

    def request(self, reason: str) -> None:
        """Set the flag; only the first reason and time are kept."""
        if not self._event.is_set():
            self.reason, self.requested_at = reason, time.monotonic()
            self._event.set()

    @property
    def requested(self) -> bool:
        """True once any source asked to stop."""
        return self._event.is_set()


#: Printed (stderr, global rank 0) at the first Ctrl-C.
FIRST_SIGINT_MESSAGE = "SIGINT: stopping at the next step; Ctrl-C again to abort without saving"


class SignalHandlers:
    """Install SIGTERM/SIGINT/SIGHUP handlers that set ``flag``; :meth:`restore` puts the old ones back.

    The first SIGINT also prints :data:`FIRST_SIGINT_MESSAGE` when ``announce`` (default: global rank 0, from
    torchrun's ``RANK``); the second raises ``KeyboardInterrupt`` and SIGINT is ignored from then on, so the
    clean-up that follows cannot be interrupted half-way. Must be created in the main thread (Python's rule
    for ``signal.signal``).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, flag: StopFlag, announce: Optional[bool] = None):
        self.flag = flag
        self.announce = announce if announce is not None else os.environ.get("RANK", "0") in ("", "0")
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        self._sigints = 0
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = (TerminalStream.wrap(s) for s in self._streams)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                raise KeyboardInterrupt
            if self.announce:
                # os.write, not print: a handler that prints while the main thread is inside print() on the
                # same stream raises "reentrant call".
                try:
                    os.write(2, (FIRST_SIGINT_MESSAGE + "\n").encode())
                except OSError:
                    pass
        elif signum == signal.SIGHUP:
            detach_from_terminal()
        self.flag.request(signal.Signals(signum).name)

    def restore(self) -> None:
        """Reinstall the handlers that were active before."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        for name, stream in zip(("stdout", "stderr"), self._streams):
            if isinstance(getattr(sys, name), TerminalStream):  # ours, not replaced since
                setattr(sys, name, stream)


def detach_from_terminal() -> None:
    """Point file descriptors 1 and 2 at ``/dev/null`` where they are terminals (after SIGHUP: the terminal may
    be gone, and writing to it fails with EIO); files and pipes are kept."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for fd in (1, 2):
            if os.isatty(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


class TerminalStream:
    """A text stream on a terminal whose writes survive the terminal's loss: a write or flush that fails with EIO
    (the SSH session or terminal closed) points descriptors 1 and 2 at ``/dev/null`` (:func:`detach_from_terminal`)
    and drops the text instead of raising. Every other attribute is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    @classmethod
    def wrap(cls, stream):
        """``stream`` wrapped when it is a terminal, else ``stream`` itself."""
        try:
            tty = stream is not None and stream.isatty()
        except (AttributeError, ValueError, OSError):
            tty = False
        return cls(stream) if tty and not isinstance(stream, cls) else stream

    def write(self, text: str) -> int:
        """Write ``text``; returns its length also when the terminal is gone."""
        try:
            return self._stream.write(text)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            detach_from_terminal()
            return len(text)

    def flush(self) -> None:
        """Flush the wrapped stream (into ``/dev/null`` once the terminal is gone)."""
        try:
            self._stream.flush()
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            detach_from_terminal()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class SpotNoticePoller:
    """Background thread polling the IMDSv2 spot ``instance-action`` (and optionally ``rebalance``) paths.

    Args:
        flag: set with a reason such as ``"EC2 spot interruption notice: terminate at 2026-...Z"``.
        interval_s: seconds between polls (AWS recommends 5).
        rebalance: also stop on a rebalance recommendation.
        endpoint: IMDS base URL; default from ``AWS_EC2_METADATA_SERVICE_ENDPOINT``.
        probe_timeout_s: timeout of the single start-up probe and of each request.

    :meth:`start` returns False (and starts nothing) when the token request fails: not on EC2, or IMDS off.
    """

    def __init__(
        self,
        flag: StopFlag,
        interval_s: float = 5.0,
        rebalance: bool = False,
        endpoint: Optional[str] = None,
        probe_timeout_s: float = 1.0,
        log: Callable[[str], None] = print,
    ):
        self.flag, self.interval_s, self.rebalance = flag, interval_s, rebalance
        self.endpoint = (
            endpoint or os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT") or DEFAULT_IMDS_ENDPOINT
        ).rstrip("/")
        self.timeout = probe_timeout_s
        self.log = log
        self._token: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _fetch_token(self) -> str:
        req = urllib.request.Request(
            f"{self.endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return r.read().decode().strip()

    def _get(self, path: str) -> Optional[str]:
        """Body of ``GET path`` (200), or None (404). Refreshes the token once on 401."""
        for attempt in range(2):
            req = urllib.request.Request(
                f"{self.endpoint}{path}", headers={"X-aws-ec2-metadata-token": self._token or ""}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return r.read().decode()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:
                    self._token = self._fetch_token()
                    continue
                raise
        return None

    def start(self) -> bool:
        """Probe IMDS once; start the polling thread if it answered. Returns whether polling runs."""
        try:
            self._token = self._fetch_token()
        except (OSError, urllib.error.URLError, ValueError):
            return False
        self._thread = threading.Thread(target=self._run, name="spot-notice-poller", daemon=True)
        self._thread.start()
        self.log(f"interruption: polling EC2 spot instance-action every {self.interval_s:g} s at {self.endpoint}")
        return True

    def poll_once(self) -> bool:
        """One poll; returns True when a stop was requested. Network errors count as "nothing yet"."""
        try:
            body = self._get("/latest/meta-data/spot/instance-action")
            if body is not None:
                try:
                    notice = json.loads(body)
                    what = f"{notice.get('action', '?')} at {notice.get('time', '?')}"
                except ValueError:
                    what = body.strip()[:100]
                self.flag.request(f"EC2 spot interruption notice: {what}")
                return True
            if self.rebalance and self._get("/latest/meta-data/events/recommendations/rebalance") is not None:
                self.flag.request("EC2 rebalance recommendation")
                return True
        except (OSError, urllib.error.URLError, ValueError):
            pass
        return False

    def _run(self) -> None:
        while not self._stop.is_set() and not self.flag.requested:
            if self.poll_once():
                return
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        """Stop polling (returns at once; the daemon thread ends within one interval)."""
        self._stop.set()
