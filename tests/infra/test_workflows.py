"""GitHub Actions workflows (schema-validated offline with check-jsonschema's vendored schema) and the OIDC
deploy role they assume."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.infra_helpers import REPO, resources, synth

WORKFLOWS = REPO / ".github" / "workflows"


def _load(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def _steps(wf: dict) -> list[dict]:
    return [s for job in wf["jobs"].values() for s in job["steps"]]


def _runs(wf: dict) -> str:
    return "\n".join(s.get("run", "") for s in _steps(wf))


def _check_jsonschema(*files) -> subprocess.CompletedProcess:
    exe = shutil.which("check-jsonschema", path=str(REPO / ".venv" / "bin")) or shutil.which("check-jsonschema")
    assert exe, "check-jsonschema is not installed (requirements.txt)"
    return subprocess.run(
        [exe, "--builtin-schema", "vendor.github-workflows", *map(str, files)], capture_output=True, text=True
    )


def test_workflows_match_the_github_schema(tmp_path):
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} == {"ci.yml", "deploy.yml", "destroy.yml", "image.yml"}
    proc = _check_jsonschema(*files)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text("name: x\non: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    stepz: []\n")
    assert _check_jsonschema(broken).returncode != 0  # the check can fail


def test_ci_runs_the_readme_test_command():
    wf = _load("ci.yml")
    assert "bash .ci/run" in _runs(wf)
    assert "pull_request" in wf["on"] and "push" in wf["on"]


def test_workflows_set_up_the_makefiles_node_major():
    """Every actions/setup-node step asks for the major version of the Makefile's NODE_VERSION, the Node that
    `make setup` installs when the machine's is older (so there it keeps the runner's)."""
    import re

    major = re.search(r"^NODE_VERSION\s*:=\s*(\d+)\.", (REPO / "Makefile").read_text(), re.M).group(1)
    found = {
        f.name: [
            str(s.get("with", {}).get("node-version"))
            for s in _steps(_load(f.name))
            if s.get("uses", "").startswith("actions/setup-node@")
        ]
        for f in sorted(WORKFLOWS.glob("*.yml"))
    }
    assert all(found[name] for name in ("ci.yml", "deploy.yml", "destroy.yml")), found  # they run make setup
    assert {v for versions in found.values() for v in versions} == {major}, found


def _prerequisites_step(wf: dict) -> str:
    steps = _steps(wf)
    tests = next(i for i, s in enumerate(steps) if "bash .ci/run" in s.get("run", ""))
    found = [s["run"] for s in steps[:tests] if "nvidia-cuda-nvcc" in s.get("run", "")]
    assert found, "ci.yml installs no nvcc before `make test` (ubuntu-latest has none)"
    return found[0]


def test_ci_installs_what_make_test_needs_on_a_hosted_runner():
    """ubuntu-latest runs as a non-root user with passwordless sudo and no CUDA toolkit: before `bash .ci/run`
    the workflow installs the Makefile's FFCV and image-tool apt packages with sudo (the Makefile's `ffcv` and
    `image-tools` targets refuse without root; the runner's docker engine is the builder) and nvcc from NVIDIA's wheels for torch's CUDA version, exporting CUDA_HOME."""
    import re

    run = _prerequisites_step(_load("ci.yml"))
    makefile = (REPO / "Makefile").read_text()
    apt = re.search(r"^FFCV_APT := (.+)$", makefile, re.M).group(1).split()
    install = next(line for line in run.splitlines() if "apt-get" in line and " install " in line)
    assert install.lstrip().startswith("sudo ") and install.split()[-len(apt) :] == apt
    image_apt = re.search(r"^IMAGE_APT := (.+)$", makefile, re.M).group(1).split()  # make image-tools
    installs = [line.split() for line in run.splitlines() if "apt-get" in line and " install " in line]
    assert any(words[0] == "sudo" and words[-len(image_apt) :] == image_apt for words in installs), installs
    torch_cuda = _torch_cuda_version()
    pins = dict(re.findall(r"(nvidia-[a-z-]+)==([0-9.]+)", run))
    assert pins["nvidia-cuda-nvcc"].startswith(torch_cuda + "."), (pins, torch_cuda)
    assert {"nvidia-cuda-crt", "nvidia-nvvm"} <= set(pins)  # nvcc's own parts (the wheel's dependencies)
    assert 'CUDA_HOME=$cuda" >> "$GITHUB_ENV"' in run
    assert run.index("make setup") < run.index("pip install")  # into the venv make creates


def _torch_cuda_version() -> str:
    """torch.version.cuda of the venv's torch, read from torch/version.py (no torch import)."""
    import importlib.util
    import runpy

    spec = importlib.util.find_spec("torch")
    return runpy.run_path(str(Path(spec.submodule_search_locations[0]) / "version.py"))["cuda"]


@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) is not installed")
def test_ci_finds_nvcc_from_the_wheel_as_a_non_root_user_without_nvcc_on_path(tmp_path):
    """The prerequisite step's CUDA_HOME lines, run as user nobody with PATH=/usr/bin:/bin (no nvcc) against a
    venv whose nvidia/cu13 holds the nvcc wheel's layout (a stub nvcc): CUDA_HOME (which torch's extension builder
    takes first) goes to $GITHUB_ENV. Without the wheel the step fails (no CUDA_HOME written)."""
    import os
    import stat
    import tempfile

    run = _prerequisites_step(_load("ci.yml"))
    lines = run.splitlines()
    script = "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("cuda=")) :])
    work = Path(tempfile.mkdtemp(prefix="ci-nvcc-"))
    try:
        site = work / "site"
        (work / ".venv" / "bin").mkdir(parents=True)
        # the system interpreter: user nobody may not enter the venv's (here under /root); the step only
        # imports nvidia (from PYTHONPATH)
        system_python = shutil.which("python3", path="/usr/bin:/bin")
        if not system_python:
            pytest.skip("no /usr/bin/python3 for user nobody")
        (work / ".venv" / "bin" / "python").symlink_to(system_python)
        env_file = work / "github_env"
        env_file.touch()

        def step() -> subprocess.CompletedProcess:
            return subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-e", "-c", script],
                cwd=work,
                capture_output=True,
                text=True,
                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "GITHUB_ENV": str(env_file), "HOME": str(work)},
            )

        assert step().returncode != 0 and env_file.read_text() == ""  # no wheel: nothing found
        cu13 = site / "nvidia" / "cu13"
        (cu13 / "bin").mkdir(parents=True)
        (cu13 / "lib").mkdir()
        (cu13 / "lib" / "libcudart.so.13").touch()
        (cu13 / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
        (cu13 / "bin" / "nvcc").chmod(0o755)
        for d in [work, *work.rglob("*")]:
            if d.is_dir():
                d.chmod(0o777)
        env_file.chmod(0o666)
        proc = step()
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert env_file.read_text().strip() == f"CUDA_HOME={cu13}"
        assert os.path.islink(cu13 / "lib" / "libcudart.so")
        assert stat.S_IMODE((cu13 / "bin" / "nvcc").stat().st_mode) & stat.S_IXOTH
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("name", ["deploy.yml", "destroy.yml", "image.yml"])
def test_aws_workflows_use_oidc_not_keys(name):
    wf = _load(name)
    assert wf["permissions"]["id-token"] == "write"
    creds = [s for s in _steps(wf) if s.get("uses", "").startswith("aws-actions/configure-aws-credentials@")]
    assert creds and all("role-to-assume" in s["with"] and "aws-access-key-id" not in s["with"] for s in creds)
    assert "concurrency" in wf
    assert "AWS_SECRET_ACCESS_KEY" not in (WORKFLOWS / name).read_text()


def test_deploy_targets_training_stack_per_environment():
    wf = _load("deploy.yml")
    assert 'npx cdk deploy TrainingStack -c env="$TRAINSTACK_ENV"' in _runs(wf)
    assert wf["concurrency"]["cancel-in-progress"] is False  # never interrupt a CloudFormation update
    assert set(wf["on"]) >= {"push", "pull_request", "workflow_dispatch"}


def test_destroy_on_pr_close_removes_data_unless_kept():
    wf = _load("destroy.yml")
    assert wf["on"]["pull_request"]["types"] == ["closed"] and "workflow_dispatch" in wf["on"]
    runs = _runs(wf)
    assert "teardown --yes --wait" in runs  # the data stack goes only once the instances are gone
    assert "npx cdk destroy TrainingStack MonitoringStack" in runs
    data_step = next(s for s in _steps(wf) if "DataStack" in s.get("run", ""))
    assert "keep-data" in data_step["if"] and "!inputs.keep_data" in data_step["if"]
    # stop billing before CloudFormation deletes the roles the instances use
    order = [s.get("run", "") for s in _steps(wf)]
    assert next(i for i, r in enumerate(order) if "teardown" in r) < next(
        i for i, r in enumerate(order) if "destroy" in r
    )


def test_image_pushes_with_the_cli():
    assert "python -m infra" in _runs(_load("image.yml")) and "push-image" in _runs(_load("image.yml"))


@pytest.mark.parametrize(
    "args, expected",
    [
        (["42", "", "main"], "pr-42"),
        (["", "Staging", ""], "staging"),
        (["", "", "Feature/Big_Thing-2026-long-name"], "feature-big-thing-20"),
        (["", "", "2026-hotfix"], "hotfix"),
    ],
)
def test_env_name_script_gives_valid_cdk_env_names(args, expected):
    from infra.config import ENV_RE

    out = subprocess.run(
        ["bash", str(REPO / ".github" / "scripts" / "env-name.sh"), *args], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == f"TRAINSTACK_ENV={expected}" and ENV_RE.match(expected)


def test_github_oidc_role_is_scoped_to_the_repository(tmp_path):
    _, _, raw = synth({"env": "dev", "github_repo": "acme/trainstack"}, tmp_path)  # cdk-nag runs here too
    ci = raw["CiStack"]
    (provider,) = resources(ci, "AWS::IAM::OIDCProvider").values()
    assert provider["Properties"]["Url"] == "https://token.actions.githubusercontent.com"
    assert provider["Properties"]["ClientIdList"] == ["sts.amazonaws.com"]
    (role,) = resources(ci, "AWS::IAM::Role").values()
    (stmt,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert stmt["Action"] == "sts:AssumeRoleWithWebIdentity"
    assert stmt["Condition"]["StringEquals"] == {"token.actions.githubusercontent.com:aud": "sts.amazonaws.com"}
    subs = stmt["Condition"]["StringLike"]["token.actions.githubusercontent.com:sub"]
    assert all(s.startswith("repo:acme/trainstack:") for s in subs)
    policy = json.dumps(next(iter(resources(ci, "AWS::IAM::Policy").values())))
    assert "cdk-hnb659fds-*" in policy and "trainstack-*" in policy
    _, _, raw2 = synth({"env": "dev"}, tmp_path / "no-ci")
    assert "CiStack" not in raw2  # only when github_repo is set


def _free_disk_step(wf: dict) -> dict:
    return next(s for s in _steps(wf) if "MIN_FREE_GB" in s.get("run", ""))


@pytest.mark.parametrize("free_gb, ok", [(14, False), (52, True)])
def test_image_workflow_frees_disk_and_stops_early_when_too_little(tmp_path, free_gb, ok):
    """The GPU base image (~28 GB unpacked) does not fit a standard hosted runner as it comes: the first step
    frees disk and fails with a clear error (naming IMAGE_RUNNER) when still too little is free. Run here
    under bash with stub sudo/docker/df."""
    wf = _load("image.yml")
    job = wf["jobs"]["image"]
    assert "vars.IMAGE_RUNNER" in job["runs-on"]
    steps = _steps(wf)
    assert steps.index(_free_disk_step(wf)) < next(i for i, s in enumerate(steps) if "push-image" in s.get("run", ""))
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "calls"
    for name, body in (
        ("sudo", f'echo "sudo $*" >> {log}'),
        ("docker", f'echo "docker $*" >> {log}'),
        ("df", f'echo "Avail"; echo " {free_gb}G"'),
    ):
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    proc = subprocess.run(
        ["bash", "-e", "-c", _free_disk_step(wf)["run"]],
        capture_output=True,
        text=True,
        env={"PATH": f"{stubs}:/usr/bin:/bin", "MIN_FREE_GB": job["env"]["MIN_FREE_GB"]},
    )
    assert (proc.returncode == 0) == ok, proc.stdout + proc.stderr
    assert "sudo rm -rf /usr/share/dotnet" in log.read_text() and "docker system prune" in log.read_text()
    if not ok:
        assert "::error::" in proc.stdout and "IMAGE_RUNNER" in proc.stdout
