"""How a training process tells whoever started it why it stopped, so the message is seen once.

A process that ends with a known outcome (bad config, data or checkpoint: exit 2; non-finite loss: 3;
interrupted after a durable checkpoint: 75; see :mod:`trainer.errors`) calls :func:`report`, which leaves:

* a **record** ``rank-<RANK>.json`` = ``{"exit": int, "error": str, "rank": int}`` in ``$TRAINSTACK_FAILURE_DIR``
  when that is set: the image's entrypoint (:mod:`trainer.sagemaker.entrypoint`) sets it, reads the records after
  torchrun exits (:func:`read_records`), exits with the lowest rank's status and writes its message to
  SageMaker's failure file;
* **torchrun's error file** ``$TORCHELASTIC_ERROR_FILE`` (torchrun sets one per worker), in the layout of
  ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception``, with the one-line message as
  ``py_callstack``: torchrun's "Root Cause" then names the error instead of "To enable traceback see ...";
  ``extraInfo.trainstack_exit`` holds the status (read by :mod:`trainer.launch`);
* the line ``error: <message>`` on stderr, printed by global rank 0 only and only when neither file was written
  (a single process): under torchrun its report shows the line, under the entrypoint the entrypoint does.

Standard library only: :mod:`trainer.cli` reports config errors with it before torch is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

FAILURE_DIR_ENV = "TRAINSTACK_FAILURE_DIR"
TORCHELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

#: What each reported exit status tells a launcher or a restart policy.
MEANINGS = {
    2: "bad config, data or checkpoint: fix the input, a retry fails the same way",
    3: "the loss became NaN/inf: checkpoints before that step are intact",
    75: "interrupted after a durable checkpoint: run the same command again to resume",
}

#: Longest time a rank other than local rank 0 waits, under torchrun, after an input error for local rank 0 to
#: report (see :func:`fail`); torchrun ends the wait as soon as local rank 0 exits.
PEER_GRACE_S = 30.0


def one_line(exc: BaseException, with_type: bool = True) -> str:
    """``"<Type>: <message>"`` on one line. An error re-raised from a DataLoader worker carries the worker's
    traceback in its message; only its last line (the original error) is kept."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Original Traceback") for line in lines):
        lines = lines[-1:]
    text = " ".join(lines) or repr(exc)
    return f"{type(exc).__name__}: {text}" if with_type else text


def env_rank(env: Optional[Mapping[str, str]] = None, name: str = "RANK") -> int:
    """This process's rank from torchrun's ``$RANK`` (or ``name``, e.g. ``LOCAL_RANK``); 0 when unset or not
    an integer."""
    env = os.environ if env is None else env
    try:
        return int(env.get(name, "0") or 0)
    except ValueError:
        return 0


def _flat(message: str) -> str:
    """``message`` on one line (a YAML parser's error, for one, spans several)."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_record(directory: str | Path, code: int, message: str, rank: int) -> Path:
    """Write ``rank-<rank>.json`` (``{"exit", "error", "rank"}``) into ``directory`` atomically; returns it."""
    path = Path(directory) / f"rank-{rank}.json"
    _atomic_write(path, json.dumps({"exit": int(code), "error": message, "rank": int(rank)}) + "\n")
    return path


def torchelastic_error(code: int, message: str) -> dict:
    """torchrun's per-worker error record for ``message`` (what ``ErrorHandler.record_exception`` writes, with
    the one-line message in place of a Python call stack, and the exit status as ``trainstack_exit``)."""
    meaning = MEANINGS.get(code, "")
    shown = f"error: {message}" if code != 75 else message
    return {
        "message": {
            "message": shown,
            "extraInfo": {
                "py_callstack": f"{shown} (exit {code}{': ' + meaning if meaning else ''})",
                "timestamp": str(int(time.time())),
                "trainstack_exit": int(code),
            },
        }
    }


def reported_exit(error_file_data: object) -> Optional[int]:
    """The status :func:`report` stored in a torchrun error record, or None if the record is not ours."""
    msg = error_file_data.get("message") if isinstance(error_file_data, dict) else None
    extra = msg.get("extraInfo") if isinstance(msg, dict) else None
    code = extra.get("trainstack_exit") if isinstance(extra, dict) else None
    return code if isinstance(code, int) else None


def _write_torchelastic(path: str, code: int, message: str) -> bool:
    try:
        Path(path).write_text(json.dumps(torchelastic_error(code, message)))
        return True
    except OSError:
        return False


def report(
    code: int, message: str, *, echo: bool = True, env: Optional[Mapping[str, str]] = None, torchrun_file: bool = True
) -> bool:
    """Hand ``message`` (one line, without ``error:``) and exit status ``code`` to the launcher (see module doc).

    Args:
        code: the exit status this process is about to return.
        message: e.g. ``"DataError: data split 'val': folder /d/val does not exist"``.
        echo: print ``error: <message>`` on stderr (global rank 0) when no launcher file was written.
        env: environment to read (default ``os.environ``).
        torchrun_file: also write ``$TORCHELASTIC_ERROR_FILE`` when it is set.

    Returns True when a launcher file was written (the launcher shows the message), False otherwise.
    Never raises for an unwritable file: the line is printed instead.
    """
    env = os.environ if env is None else env
    message = _flat(message)
    rank, handed = env_rank(env), False
    if env.get(FAILURE_DIR_ENV):
        try:
            write_record(env[FAILURE_DIR_ENV], code, message, rank)
            handed = True
        except OSError:
            pass
    if torchrun_file and env.get(TORCHELASTIC_ERROR_FILE_ENV):
        handed = _write_torchelastic(env[TORCHELASTIC_ERROR_FILE_ENV], code, message) or handed
    if echo and not handed and rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return handed


def fail(code: int, message: str, env: Optional[Mapping[str, str]] = None) -> int:
    """:func:`report` an error and return ``code``; under torchrun, make local rank 0 the one that shows it.

    Every rank of a host usually meets the same input error (same config, same data). torchrun lists every failed
    rank with its error file, so a rank other than local rank 0 with an input error or NaN (2, 3) writes its
    torchrun error file only after local rank 0 has written its own (found beside it in torchrun's per-rank
    folders): the same message becomes a short note pointing at the root cause, dated after it; a different
    one is written in full. It then waits for torchrun to stop it when local rank 0 exits, at most
    :data:`PEER_GRACE_S` in all; without local rank 0's file by then (it hangs, or the folders are laid out
    differently) it writes its own message in full. The entrypoint's record is written at once either way.
    """
    env, message = (os.environ if env is None else env), _flat(message)
    torchrun = env.get(TORCHELASTIC_ERROR_FILE_ENV)
    peer = bool(torchrun) and code in (2, 3) and env_rank(env, "LOCAL_RANK") != 0
    report(code, message, env=env, torchrun_file=not peer)
    if peer:
        _report_as_peer(Path(torchrun), code, message, env_rank(env, "LOCAL_RANK"))
    return code


def _read_json(path: Optional[Path]) -> Optional[dict]:
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def _report_as_peer(path: Path, code: int, message: str, local_rank: int) -> None:
    """See :func:`fail`: wait for local rank 0's torchrun error file, then write ours as a note or in full."""
    first = path.parent.parent / "0" / path.name if path.parent.name == str(local_rank) else None
    deadline = time.monotonic() + PEER_GRACE_S
    theirs = None
    while time.monotonic() < deadline:
        theirs = _read_json(first)
        if reported_exit(theirs) is not None:
            break
        time.sleep(0.1)
    else:
        _write_torchelastic(str(path), code, message)
        return
    ours = torchelastic_error(code, message)
    if theirs["message"].get("message") == ours["message"]["message"]:
        ours["message"]["extraInfo"]["py_callstack"] = (
            f"exit {code}: the same error as local rank 0 (the root cause below)"
        )
    try:
        ours["message"]["extraInfo"]["timestamp"] = str(int(theirs["message"]["extraInfo"]["timestamp"]) + 1)
    except (KeyError, TypeError, ValueError):
        pass
    try:
        path.write_text(json.dumps(ours))
    except OSError:
        pass
    time.sleep(max(0.0, deadline - time.monotonic()))  # torchrun stops this rank once local rank 0 exits


def read_records(directory: str | Path) -> list[dict]:
    """The records in ``directory``, lowest rank first; unreadable or malformed files are skipped."""
    out = []
    for path in Path(directory).glob("rank-*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("exit"), int) and isinstance(rec.get("rank"), int):
            out.append({"exit": rec["exit"], "error": str(rec.get("error", "")), "rank": rec["rank"]})
    return sorted(out, key=lambda r: r["rank"])
