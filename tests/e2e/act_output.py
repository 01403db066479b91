"""What act printed: its ``--json`` lines rendered as text, the step and job results, and a one-line summary
(tests/e2e/act_runner.py runs act; this module only reads its output)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """One step stage act reported: step_id has one element per nesting level (composite actions' steps: 2)."""

    job_id: str
    step_id: tuple[str, ...]
    stage: str  # Pre, Main or Post
    name: str
    result: str  # success, failure, ...
    seconds: float | None


def render(line: str) -> str:
    """One act --json line as act prints it without --json: ``[workflow/job] message``, output as ``  | ...``."""
    try:
        entry = json.loads(line)
    except ValueError:
        return line.rstrip("\n")
    if not isinstance(entry, dict) or "msg" not in entry:
        return line.rstrip("\n")
    msg = str(entry["msg"]).rstrip("\n")
    if entry.get("raw_output"):
        msg = f"  | {msg}"
    return f"[{entry['job']}] {msg}" if entry.get("job") else f"{entry.get('level', 'info')}: {msg}"


def _entries(output: str):
    for line in output.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            yield entry


def step_results(output: str) -> list[StepResult]:
    """The step stages act reported in its --json output, in order (not its "Set up job"/"Complete job").
    Steps skipped by ``if:`` or after a failure are not reported."""
    return [
        StepResult(
            job_id=e.get("jobID", ""),
            step_id=tuple(e["stepID"]),
            stage=e.get("stage", ""),
            name=str(e.get("step", "")),
            result=e["stepResult"],
            seconds=e["executionTime"] / 1e9 if "executionTime" in e else None,
        )
        for e in _entries(output)
        if "stepResult" in e and "stepID" in e
    ]


def job_results(output: str) -> dict[str, str]:
    """Job id -> success/failure as act reported it."""
    return {e.get("jobID", ""): e["jobResult"] for e in _entries(output) if "jobResult" in e}


def _short(text: str, width: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def summary(workflow: str, output: str, wf: dict | None = None) -> str:
    """E.g. ``destroy.yml: 8 steps ran, all succeeded: ...; not run: ...``: the Main stage of each top-level
    step, failures of any stage (a composite action's failing step fails the action too), with wf also the
    steps that did not run (``if:`` false, or after a failure)."""
    results = step_results(output)
    main = [r for r in results if r.stage == "Main" and len(r.step_id) == 1]
    failed = [r for r in results if r.result != "success" and len(r.step_id) == 1]
    ran = ", ".join(f"{_short(r.name)}" + ("" if r.result == "success" else f" ({r.result})") for r in main)
    head = f"{workflow}: {len(main)} steps ran, " + (
        "all succeeded"
        if not failed
        else f"{len(failed)} failed ({', '.join(f'{r.stage} {_short(r.name)}' for r in failed)})"
    )
    text = f"{head}: {ran}"
    if wf is not None:
        done = {(r.job_id, r.step_id[0]) for r in main}
        skipped = [
            _short(step.get("name") or step.get("uses") or step.get("run") or f"step {i}")
            for job_id, job in (wf.get("jobs") or {}).items()
            for i, step in enumerate(job.get("steps") or [])
            if (job_id, str(i)) not in done
        ]
        if skipped:
            text += f"; not run: {', '.join(skipped)}"
    return text
