"""The bad-input table, infra side: ``python -m infra ...`` and the CDK app (``app.py`` through cdk.json).

Every row runs a real subprocess. Nothing leaves the machine: AWS endpoints are ``AWS_ENDPOINT_URL`` on
127.0.0.1 (a closed port, or the tests' own ``moto_server``), credentials are fake, proxies are cleared and
the AWS config files are ``/dev/null``. The CDK rows run ``app.py`` with the context in ``CDK_CONTEXT_JSON``,
as the CDK CLI passes it; ``npx cdk synth`` itself adds a trailing "Subprocess exited with error 2" line after
ours, so its contract (our line exactly once, no traceback, no ``b'...'`` Node banner) is a plain test here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.bad_input_table import REPO, Case, run_case

ENDPOINT_ENV = "AWS_ENDPOINT_URL"


def _closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _aws_env(endpoint: str) -> dict:
    """Fake credentials, one region, every AWS call to ``endpoint``, one attempt, no proxies, no config files."""
    return {
        ENDPOINT_ENV: endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_RETRY_MODE": "standard",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "false",
        "TRAINSTACK_ENV": "",
        "HTTP_PROXY": "",
        "HTTPS_PROXY": "",
        "http_proxy": "",
        "https_proxy": "",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


#: Offline rows: a closed local port, so a row that reached AWS would exit 75, not its expected status.
OFFLINE = _aws_env(f"http://127.0.0.1:{_closed_port()}")


def infra_cmd(*args: str) -> list[str]:
    """``python -m infra ARGS`` with this interpreter, without a profile or session token from the caller."""
    unset = [
        a for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN") for a in ("-u", k)
    ]
    return ["env", *unset, sys.executable, "-m", "infra", *args]


def _app_cmd(tmp: Path) -> list[str]:
    """The CDK app as cdk.json runs it (the context comes from CDK_CONTEXT_JSON in the row's env)."""
    return [sys.executable, str(REPO / "app.py")]


def _no_output(tmp: Path) -> None:
    assert not any(tmp.iterdir()), f"the command wrote {sorted(p.name for p in tmp.iterdir())}"


def _write(name: str, data: bytes):
    def setup(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(data)
        return infra_cmd("submit", "--run-name", "r1", "--config", str(tmp / name))

    return setup


def _no_templates(tmp: Path) -> None:
    assert not list(tmp.glob("cdk.out/*.template.json")), "templates written despite the bad context"


def _cdk(context: dict, message: str, row: str) -> Case:
    """A CDK-app row: ``app.py`` with ``context`` as the CDK CLI passes it (CDK_CONTEXT_JSON)."""
    env = {"CDK_CONTEXT_JSON": json.dumps(context), "CDK_OUTDIR": "cdk.out"}
    return Case(row, _app_cmd, 2, message, _no_templates, env=env, timeout=180)


def _credential_process_fails(tmp: Path) -> list[str]:
    (tmp / "aws-config").write_text("[default]\nregion = us-east-1\ncredential_process = /bin/false\n")
    return [
        "env",
        "-u",
        "AWS_ACCESS_KEY_ID",
        "-u",
        "AWS_SECRET_ACCESS_KEY",
        f"AWS_CONFIG_FILE={tmp / 'aws-config'}",
        *infra_cmd("status"),
    ]


CASES = [
    # --- network: python -m infra with AWS unreachable (a closed port on 127.0.0.1)
    Case(
        "infra-network-unreachable",
        lambda tmp: infra_cmd("status"),
        75,
        "cannot reach http://127.0.0.1:",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-network-unreachable-launch",
        lambda tmp: infra_cmd("launch", "g5.2xlarge", "--job", "j1"),
        75,
        "then rerun (nothing was changed)",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    # --- --env: the stacks' rule, checked before any AWS call
    Case(
        "infra-env-invalid-characters",
        lambda tmp: infra_cmd("--env", "Bad Name!", "status"),
        2,
        "--env 'Bad Name!': expected lower-case letters, digits and '-'",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-env-too-long",
        lambda tmp: infra_cmd("--env", "a" * 21, "status"),
        2,
        "at most 20 characters",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-trainstack-env-invalid",
        lambda tmp: infra_cmd("status"),
        2,
        "TRAINSTACK_ENV 'Prod': expected lower-case",
        _no_output,
        env={**OFFLINE, "TRAINSTACK_ENV": "Prod"},
        timeout=60,
    ),
    # --- submit / launch inputs, checked before any AWS call
    Case(
        "infra-submit-yaml-does-not-parse",
        _write("bad.yaml", b"epochs: [1\n"),
        2,
        "bad.yaml is not valid YAML at line 2, column 1",
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-submit-config-not-text",
        _write("bin.yaml", b"\xff\xfe\x00\x01"),
        2,
        "bin.yaml cannot be read as UTF-8 text",
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-submit-config-missing",
        lambda tmp: infra_cmd("submit", "--run-name", "r1", "--config", str(tmp / "nope.yaml")),
        2,
        "nope.yaml does not exist",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-submit-config-is-a-directory",
        lambda tmp: infra_cmd("submit", "--run-name", "r1", "--config", str(tmp)),
        2,
        "is a directory; expected a YAML file",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-submit-data-not-s3",
        lambda tmp: infra_cmd("submit", "--run-name", "r1", "--data", "/data"),
        2,
        "--data '/data': expected an s3:// URI",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-launch-unknown-type",
        lambda tmp: infra_cmd("launch", "g5.3xlarge", "--job", "j1"),
        2,
        "unknown instance type 'g5.3xlarge'",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-launch-sagemaker-type",
        lambda tmp: infra_cmd("launch", "ml.g5.2xlarge", "--job", "j1"),
        2,
        "--machine train-g5-2xlarge",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-logs-lines-zero",
        lambda tmp: infra_cmd("logs", "i-0123", "-n", "0"),
        2,
        "-n/--lines: got '0'; expected a whole number >= 1",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    # --- credentials that botocore cannot load (an expired SSO token reads the same)
    Case(
        "infra-credential-process-fails",
        _credential_process_fails,
        2,
        "AWS credentials could not be loaded",
        env=OFFLINE,
        timeout=60,
    ),
    # --- the CDK app (what `npx cdk synth -c KEY=VALUE` runs): one line, exit 2, nothing synthesized
    # --- sweep: every trial validated, and the tuning job's name limit, before any AWS call
    Case(
        "infra-sweep-bad-trial-value",
        lambda tmp: infra_cmd(
            "sweep",
            "--name",
            "r",
            "--machine",
            "train-g5-xlarge",
            "--config",
            str(REPO / "configs" / "seed001_roofs_gpu.yaml"),
            "--image-tag",
            "x",
            "--grid",
            "lr=[0.1, -1]",
        ),
        2,
        "trial t001 (lr=-1): lr: got -1.0; must be a finite number > 0",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    Case(
        "infra-sweep-tuning-name-too-long",
        lambda tmp: infra_cmd(
            "sweep",
            "--name",
            "a-rather-long-sweep-name",
            "--strategy",
            "tuning",
            "--machine",
            "train-g5-xlarge",
            "--config",
            str(REPO / "configs" / "seed001_roofs_gpu.yaml"),
            "--image-tag",
            "x",
            "--grid",
            "lr=[0.1, 0.03]",
        ),
        2,
        "SageMaker takes at most 32; next: use a name of at most",
        _no_output,
        env=OFFLINE,
        timeout=60,
    ),
    _cdk(
        {"data_volume_iops": "100"},
        "error: context data_volume_iops: got 100; expected 3000..80000",
        "cdk-context-out-of-range",
    ),
    _cdk({"env": "PR_42"}, "error: context env: got 'PR_42'; expected lower-case letters", "cdk-context-env"),
    _cdk({"ssh_cidr": "bad"}, "error: context ssh_cidr: got 'bad'; expected an IPv4 CIDR", "cdk-context-cidr"),
    _cdk(
        {"mlflow_tracking_server_arn": "arn:aws:s3:::bucket"},
        "error: context mlflow_tracking_server_arn: got 'arn:aws:s3:::bucket'; expected "
        "arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME",
        "cdk-context-mlflow-arn",
    ),
    _cdk({"prices": "[1]"}, "error: context prices: got [1]; expected a JSON object", "cdk-context-prices-list"),
    _cdk({"budget_usd": "nan"}, "error: context budget_usd: got 'nan'; expected a finite number", "cdk-context-nan"),
    _cdk(
        {"scaling_phases": '[{"name": "gpu", "instance_type": "ml.g5.xlarge", "hyperparameters": [1]}]'},
        "error: context scaling_phases[0].hyperparameters: got [1]",
        "cdk-context-phase-hyperparameters",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path):
    run_case(case, tmp_path)


# ---------------------------------------------------------------- npx cdk synth (the CDK CLI's own lines follow)


@pytest.mark.skipif(not (REPO / "node_modules" / ".bin" / "cdk").exists(), reason="npm ci not run (make setup does)")
@pytest.mark.parametrize(
    "context, line",
    [
        (
            "data_volume_iops=100",
            "error: context data_volume_iops: got 100; expected 3000..80000 and at most 500 IOPS per GiB (gp3 limits)",
        ),
        (
            "ssh_cidr=bad",
            "error: context ssh_cidr: got 'bad'; expected an IPv4 CIDR narrower than 0.0.0.0/0 "
            "(cdk-nag AwsSolutions-EC23), like 203.0.113.7/32",
        ),
    ],
)
def test_cdk_synth_bad_context_prints_one_line(context, line, tmp_path):
    """`npx cdk synth -c KEY=BAD` through cdk.json: our line once, no traceback, no ``b'...'`` Node banner.

    The JSII_SILENCE_* variables are removed from the environment: the app must silence the banner itself.
    The CDK CLI prints its own "Subprocess exited with error 2" after our line, so it is not the last one.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("JSII_SILENCE_")}
    env["CDK_DISABLE_CLI_TELEMETRY"] = "true"
    proc = subprocess.run(
        [
            "npx",
            "--no-install",
            "cdk",
            "synth",
            "--quiet",
            "-c",
            context,
            "--output",
            str(tmp_path / "cdk.out"),
            "--no-notices",
            "--no-version-reporting",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert proc.stderr.splitlines().count(line) == 1, out[-3000:]
    assert "Traceback" not in out and "b'" not in out, out[-3000:]
    assert not list((tmp_path / "cdk.out").glob("*.template.json"))


# ---------------------------------------------------------------- moto_server from the venv


@pytest.fixture
def moto_server(tmp_path, monkeypatch):
    """``moto_server`` (moto's ``server`` extra: flask) on a free port of 127.0.0.1; yields its URL.

    Waits at most 60 s for it to answer and always stops it.
    """
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    exe = Path(sys.executable).with_name("moto_server")
    assert exe.exists(), f"{exe} missing: requirements.txt installs moto[all,server]"
    port = _closed_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "moto_server.log").open("w")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (
                f"moto_server exited {proc.returncode}:\n" + (tmp_path / "moto_server.log").read_text()[-3000:]
            )
            try:
                opener.open(f"{url}/moto-api/", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not answer within 60 s"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_moto_server_from_the_venv_serves_boto3_and_the_cli(moto_server, tmp_path):
    """The venv's ``moto_server`` runs (flask installed), answers boto3, and the CLI's "stack not deployed"
    line names the real environment (``-c env=test``), never a ``<env>`` placeholder."""
    import boto3
    from botocore.config import Config

    s3 = boto3.client(
        "s3",
        endpoint_url=moto_server,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"max_attempts": 1}),
    )
    s3.create_bucket(Bucket="trainstack-probe")
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["trainstack-probe"]

    case = Case(
        "infra-stack-not-deployed",
        lambda tmp: infra_cmd("--env", "test", "status"),
        2,
        "deploy it: `npx cdk deploy TrainingStack -c env=test`",
        env=_aws_env(moto_server),
        timeout=120,
    )
    proc = run_case(case, tmp_path)
    assert "<env>" not in proc.stderr and "test-DataStack does not exist" in proc.stderr
