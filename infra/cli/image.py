"""``push-image``: build images/training/Dockerfile, log in to ECR through boto3, tag with the git commit, push.

The Docker work is done by the ``docker`` CLI (``--docker`` picks another binary; tests use a fake one that
records its arguments); the ECR credentials come from ``ecr:GetAuthorizationToken`` (base64 ``AWS:password``),
for this account's repository and, when the base image is an AWS Deep Learning Container, for its registry.
"""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path
from typing import Optional

from botocore.exceptions import ClientError

from infra.cli.outputs import Outputs
from infra.cli.session import Aws, CliError, explain

DOCKERFILE = "images/training/Dockerfile"


def git_tag(repo: Path) -> str:
    """Short commit of ``repo``; ``-dirty`` appended when the tree has uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        raise CliError(f"cannot read the git commit of {repo}: {e}", "pass --tag") from None
    return sha + ("-dirty" if dirty else "")


def _login(docker: str, ecr, registries: list[str], run) -> list[str]:
    """``docker login`` to each ECR registry with one GetAuthorizationToken (the token is valid for every
    registry the caller may pull from in the region, e.g. the DLC account 763104351884: AWS DLC docs)."""
    auth = ecr.get_authorization_token()["authorizationData"][0]
    user, password = base64.b64decode(auth["authorizationToken"]).decode().split(":", 1)
    for registry in registries:
        run([docker, "login", "--username", user, "--password-stdin", registry], input_text=password)
    return registries


def dockerfile_base_image(repo: Path) -> str:
    """The default of ``ARG BASE_IMAGE=...`` in the training Dockerfile."""
    text = (repo / DOCKERFILE).read_text()
    match = re.search(r"^ARG\s+BASE_IMAGE=(\S+)", text, re.M)
    if not match:
        raise CliError(f"{DOCKERFILE} has no `ARG BASE_IMAGE=...` default", "pass --base-image")
    return match.group(1).strip('"')


def push_image(
    aws: Aws,
    outputs: Outputs,
    repo: Path,
    tag: Optional[str] = None,
    base_image: Optional[str] = None,
    docker: str = "docker",
    ecr=None,
) -> str:
    """Build, tag ``<repository>:<tag>`` (and ``:latest``) and push; returns the pushed image URI.

    Raises CliError when docker is missing or fails, or ECR refuses (with the next step).
    """
    ecr = ecr or aws.client("ecr")
    tag = tag or git_tag(repo)
    image = f"{outputs.repository_uri}:{tag}"

    def run(cmd: list[str], input_text: Optional[str] = None) -> None:
        try:
            proc = subprocess.run(cmd, cwd=repo, input=input_text, text=True, capture_output=input_text is not None)
        except FileNotFoundError:
            raise CliError(f"{cmd[0]!r} not found", "install Docker, or pass --docker PATH") from None
        if proc.returncode != 0:
            shown = " ".join(cmd[:3])
            raise CliError(f"`{shown} ...` failed with exit {proc.returncode}: {(proc.stderr or '')[-500:]}")

    base = base_image or dockerfile_base_image(repo)
    registries = [outputs.repository_uri.split("/", 1)[0]]
    if ".dkr.ecr." in base.split("/", 1)[0]:
        registries.append(base.split("/", 1)[0])
    try:
        _login(docker, ecr, registries, run)
        build = [
            docker,
            "build",
            "-f",
            DOCKERFILE,
            "-t",
            image,
            "-t",
            f"{outputs.repository_uri}:latest",
            "--build-arg",
            f"BASE_IMAGE={base}",
        ]
        run(build + ["."])
    except ClientError as e:
        raise explain(e, "logging in to ECR") from None
    run([docker, "push", image])
    run([docker, "push", f"{outputs.repository_uri}:latest"])
    return image
