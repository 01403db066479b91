"""The emulated account for the e2e tier: moto's server on 127.0.0.1 and a copy of the repository to run in.

:class:`Emulator` starts ``python -m tests.e2e.emulator_server`` on a free port, waits until it answers, and
stops it; its log stays in the run folder (the test prints its path when a step fails). :func:`workspace`
copies the repository's files (tracked and untracked-but-not-ignored, modification times kept, so ``make setup``
sees its stamps newer than the requirements) into a folder with ``.venv`` and ``node_modules`` linked: the CDK
CLI's ``cdk.out`` and ``cdk.context.json`` and act's runs stay out of the checkout that pytest runs in.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACCOUNT = "123456789012"  # moto's default account
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """moto's server (with :mod:`tests.e2e.emulator_server`'s seeds and fixes) on ``127.0.0.1:port``.

    ``endpoint`` says ``localhost``: moto's CloudFormation reads the bucket of a ``TemplateURL`` from the host name
    unless it is ``localhost`` (``get_stack_from_s3_url`` in ``moto/cloudformation/utils.py``), and the CDK CLI
    builds its template URLs from the endpoint it is given.
    """

    def __init__(self, folder: Path, faults: list[dict] = ()):
        self.folder = folder
        self.port = free_port()
        self.endpoint = f"http://localhost:{self.port}"
        self.log = folder / "emulator.log"
        self.proc: subprocess.Popen | None = None
        self.faults = list(faults)  # rules of tests/e2e/faults.py
        self.faults_seen = folder / "faults-seen.json"

    def start(self, timeout_s: float = 60.0) -> Emulator:
        self.folder.mkdir(parents=True, exist_ok=True)
        rules = self.folder / "fault-rules.json"
        rules.write_text(json.dumps(self.faults, indent=1))
        faults = {"TRAINSTACK_E2E_FAULTS": str(rules), "TRAINSTACK_E2E_FAULTS_SEEN": str(self.faults_seen)}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.emulator_server", "--port", str(self.port)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **faults},
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the emulator exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/data.json", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the emulator did not answer on 127.0.0.1:{self.port} within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every command the journey runs: fake credentials, this endpoint, no shared
        config or profile from the machine, the venv (and its Node) first on PATH, the CDK CLI quiet."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CDK_"))}
        env.update(
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_REGION=REGION,
            AWS_DEFAULT_REGION=REGION,
            AWS_ENDPOINT_URL=self.endpoint,
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            AWS_EC2_METADATA_DISABLED="true",
            CDK_DISABLE_VERSION_CHECK="1",
            CDK_DISABLE_CLI_TELEMETRY="true",
            PATH=f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        )
        env.update(extra)
        return env

    def session(self):
        """A boto3 session for the tests' own reads: its User-Agent carries ``faults.CHECK_AGENT``, so no fault
        rule ever touches them."""
        import boto3

        from tests.e2e.faults import CHECK_AGENT

        session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION)
        session._session.user_agent_extra = CHECK_AGENT
        return session

    def client(self, service: str):
        return self.session().client(service, endpoint_url=self.endpoint)

    def injected(self) -> list[dict]:
        """The faults the server injected so far (tests/e2e/faults.py: name, fault, service, operation, retried)."""
        return json.loads(self.faults_seen.read_text()) if self.faults_seen.exists() else []

    def assert_absorbed(self, *names: str) -> str:
        """Assert that each fault rule in ``names`` was injected and its operation called again by the same caller
        and answered with a success (2xx; after a lost answer, with any answer: the journey's own checks say whether
        the caller took it right); returns a line for the journey's summary.
        Raises AssertionError naming the rule otherwise."""
        seen = {e["name"]: e for e in self.injected()}
        for name in names:
            assert name in seen, f"fault {name!r} was never injected (rules: {self.faults}; injected: {list(seen)})"
            retried = seen[name]["retried"]
            assert retried, f"fault {name!r} ({seen[name]['operation']}): the caller never called it again"
            # after a lost answer the retry may be refused (S3's 412); a retry that got a fault of its own is counted
            # under that fault
            if seen[name]["fault"] != "lost" and not retried["faulted"]:
                assert 200 <= retried["status"] < 300, f"fault {name!r}: its retry was answered {retried['status']}"
        return "absorbed: " + ", ".join(f"{n} ({seen[n]['operation']} {seen[n]['fault']})" for n in names)


def workspace(dest: Path) -> Path:
    """Copy the repository's files into ``dest`` (see the module docstring); returns ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file() or rel == "cdk.context.json":  # deleted; or the lookups of another account
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    for linked in (".venv", "node_modules"):
        (dest / linked).symlink_to(REPO / linked)
    git = ["git", "-c", "user.name=e2e", "-c", "user.email=e2e@localhost"]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A", "."], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "e2e workspace"], cwd=dest, check=True)
    return dest
