"""The Node that `make setup` leaves first on the PATH make sets (the venv's bin first: its `node` link when the
machine's Node was older than the Makefile's NODE_MIN_MAJOR) is new enough, and jsii and the CDK CLI run on it
without a Node version warning. Offline: the CLI's AWS calls go to a closed port on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.infra_helpers import REPO

VENV_BIN = Path(sys.executable).parent  # make runs the tests with $(VENV)/bin/python and puts $(VENV)/bin first
MAKE_PATH = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def _makefile_value(name: str) -> str:
    return re.search(rf"^{name}\s*:=\s*(\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)


def _node_lines(*procs: subprocess.CompletedProcess) -> list[str]:
    """Output lines that mention Node: jsii's banner (b'!!  Node 20 is end-of-life ...'), the AWS SDK's
    NodeVersionSupportWarning ("... will require node >=22. You are running node v20...")."""
    return [line for p in procs for line in (p.stdout + p.stderr).splitlines() if "node" in line.lower()]


def test_node_first_on_makes_path_is_new_enough():
    node = shutil.which("node", path=MAKE_PATH)
    assert node, f"no node on {MAKE_PATH}: make setup"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    assert int(version.lstrip("v").split(".")[0]) >= int(_makefile_value("NODE_MIN_MAJOR")), (
        f"{node} is {version}: make setup installs Node {_makefile_value('NODE_VERSION')} into the venv"
    )


def test_jsii_runs_on_it_without_a_node_banner():
    """A jsii library (constructs, aws-cdk-lib's) from Python, without infra/__init__.py's JSII_SILENCE_* defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSII_")}
    proc = subprocess.run(
        [sys.executable, "-c", "import constructs; print(constructs.RootConstruct('root').node.id)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PATH": MAKE_PATH},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "root", proc.stdout + proc.stderr
    assert not _node_lines(proc)


@pytest.mark.skipif(not (REPO / "node_modules" / ".bin" / "cdk").exists(), reason="no node_modules: make setup")
def test_cdk_cli_runs_on_it_without_a_node_warning(tmp_path):
    """`npx cdk --version` prints package.json's pin. The AWS SDK warns when a command builds an AWS client, which
    `cdk ls` does with credentials set: fake ones, every endpoint a closed port on 127.0.0.1, an app without stacks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CDK_"))}
    env.update(
        PATH=MAKE_PATH,
        CDK_DISABLE_VERSION_CHECK="1",
        CDK_DISABLE_CLI_TELEMETRY="true",
        npm_config_update_notifier="false",
    )
    pinned = json.loads((REPO / "package.json").read_text())["devDependencies"]["aws-cdk"]
    version = subprocess.run(
        ["npx", "--no-install", "cdk", "--version"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env
    )
    assert version.returncode == 0 and version.stdout.split()[:1] == [pinned], version.stdout + version.stderr

    app = tmp_path / "cdk.out"
    app.mkdir()
    (app / "manifest.json").write_text(json.dumps({"version": "48.0.0", "artifacts": {}}))
    env.update(
        AWS_ACCESS_KEY_ID="AKIAIOSFODNN7EXAMPLE",
        AWS_SECRET_ACCESS_KEY="fake",
        AWS_REGION="us-east-1",
        AWS_ENDPOINT_URL="http://127.0.0.1:9",
        AWS_MAX_ATTEMPTS="1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
    )
    ls = subprocess.run(
        ["npx", "--no-install", "cdk", "ls", "--app", str(app), "--no-notices", "--no-version-reporting"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert "no stacks" in ls.stdout + ls.stderr, ls.stdout + ls.stderr
    assert not _node_lines(version, ls)
