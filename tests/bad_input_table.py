"""The bad-input table's row type and runner, shared by ``tests/test_bad_inputs_*.py``.

Each row is what a user sees: an input (a setup function that prepares files in a temporary folder and
returns the command to run), the exit status, a fragment of the one error line, and a check of what
survived (checkpoints, files already written). The runner asserts the contract every bad input must keep:
the expected exit status, the fragment in the *last* non-empty line of stderr, no Python traceback
anywhere in the output, and the row's own survival check. An exit-2 line has the one error format,
``error: <where>: <what>; <expected>`` (:data:`ERROR_LINE`): no exception type name or command name in front of
the field or file, no C++ source location, no ``weights_only=False`` advice.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tests import forkserver

REPO = Path(__file__).resolve().parents[1]

#: ``error: <where>: <what>`` where <where> (a field, flag, file or sub-command) is not a Python exception type.
ERROR_LINE = re.compile(r"^error: (?!\w+(?:Error|Exception): )(?!config: )\S[^:]*: \S")
_NOT_IN_A_LINE = re.compile(r"\.(?:c|cc|cpp|cu|h|hpp):\d+|weights_only=False")


def check_error_line(line: str) -> None:
    """Assert that ``line`` (an exit-2 stderr line) keeps the one error format (module doc)."""
    assert ERROR_LINE.match(line), f"not 'error: <where>: <what>': {line!r}"
    assert not _NOT_IN_A_LINE.search(line), f"C++ source location or weights_only advice: {line!r}"


@dataclass
class Case:
    """One row: ``setup(tmp) -> argv`` (a full command line, run with the repo on PYTHONPATH and ``tmp`` as
    the working directory), expected ``exit`` status, ``message`` fragment of the last stderr line, and
    ``survived(tmp)`` (asserts; may be None). ``env`` adds environment variables; ``timeout`` in seconds."""

    id: str
    setup: Callable[[Path], list[str]]
    exit: int
    message: str
    survived: Optional[Callable[[Path], None]] = None
    env: dict = field(default_factory=dict)
    timeout: int = 300


def trainer_cmd(*args: str) -> list[str]:
    """``python -m trainer ARGS`` with this interpreter."""
    return [sys.executable, "-m", "trainer", *args]


def run_case(case: Case, tmp: Path) -> subprocess.CompletedProcess:
    """Run ``case`` in ``tmp`` and assert the bad-input contract (see module doc); returns the process."""
    argv = case.setup(tmp)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **case.env}
    proc = forkserver.run(argv, cwd=tmp, env=env, timeout=case.timeout)
    out = proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback (most recent call last)" not in out, f"{case.id}: traceback\n{out[-4000:]}"
    assert proc.returncode == case.exit, f"{case.id}: exit {proc.returncode}, expected {case.exit}\n{out[-4000:]}"
    assert lines and case.message in lines[-1], (
        f"{case.id}: last stderr line {lines[-1:]!r} lacks {case.message!r}\n{out[-4000:]}"
    )
    if case.exit == 2:
        check_error_line(lines[-1])
    if case.survived is not None:
        case.survived(tmp)
    return proc
