"""``push-image``: build images/training/Dockerfile, log in to ECR through boto3, tag with the git commit, push.

The Docker work is done by the ``docker`` CLI (``--docker`` picks another binary; tests use a fake one that
records its arguments); the ECR credentials come from ``ecr:GetAuthorizationToken`` (base64 ``AWS:password``)
in each registry's own region (a token is valid for one region: ECR user guide, "Private registry
authentication"), for this account's repository and, when the base image is an AWS Deep Learning Container,
for its registry (``763104351884.dkr.ecr.us-east-1...`` whatever the environment's region).

Tags are immutable (the repository says so) and only the commit tag is pushed: no ``latest`` that moves under
a running job. Pushing a tag that is already in the repository builds and pushes nothing (a re-run of the
image workflow for the same commit succeeds instead of failing on the immutable tag).
"""

from __future__ import annotations

import base64
import hashlib
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from botocore.exceptions import ClientError

from infra.cli.outputs import Outputs
from infra.cli.session import Aws, CliError, explain

DOCKERFILE = "images/training/Dockerfile"


def git_tag(repo: Path) -> str:
    """Image tag of ``repo``'s checkout: the short commit (12 hex), and for a tree with uncommitted changes
    ``<commit>-dirty-<8 hex of the diff's SHA-256>``, so that other changes get another (immutable) tag and the
    same changes the same one. push-image's default tag and launch/submit's default ``--image-tag``."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
        ).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=repo, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CliError(f"cannot read the git commit of {repo}: {e}", "pass --tag / --image-tag") from None
    return sha + (f"-dirty-{hashlib.sha256(diff).hexdigest()[:8]}" if diff else "")


def registry_region(registry: str) -> str:
    """``<account>.dkr.ecr.<region>.amazonaws.com`` -> ``<region>``."""
    match = re.match(r"^\d{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$", registry)
    if not match:
        raise CliError(f"{registry!r} is not an ECR registry host (<account>.dkr.ecr.<region>.amazonaws.com)")
    return match.group(1)


def _login(docker: str, ecr_in: Callable[[str], object], registries: list[str], run) -> list[str]:
    """``docker login`` to each ECR registry with a GetAuthorizationToken from the registry's own region
    (``ecr_in(region)`` gives that region's client). One token per region serves every registry there that the
    caller may pull from (the DLC account 763104351884 included: AWS DLC docs), but only that region: the
    environment's token did not log in to the DLC registry in us-east-1 from any other region."""
    tokens: dict[str, tuple[str, str]] = {}
    for registry in registries:
        region = registry_region(registry)
        if region not in tokens:
            auth = ecr_in(region).get_authorization_token()["authorizationData"][0]
            tokens[region] = tuple(base64.b64decode(auth["authorizationToken"]).decode().split(":", 1))
        user, password = tokens[region]
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
    ecr_in: Optional[Callable[[str], object]] = None,
) -> str:
    """Build, tag ``<repository>:<tag>`` and push; returns the image URI (with `` (already pushed)`` when the
    tag was in the repository already: nothing is built or pushed then).

    ``ecr_in(region)``: the ECR client of a region (default: the session's). Raises CliError when docker is
    missing or fails, or ECR refuses (with the next step).
    """
    ecr_in = ecr_in or (lambda region: aws.session.client("ecr", region_name=region))
    tag = tag or git_tag(repo)
    image = f"{outputs.repository_uri}:{tag}"
    if tagged_digest(ecr_in(aws.region), outputs.repository_name, tag):
        return f"{image} (already pushed)"

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
        _login(docker, ecr_in, registries, run)
        run([docker, "build", "-f", DOCKERFILE, "-t", image, "--build-arg", f"BASE_IMAGE={base}", "."])
    except ClientError as e:
        raise explain(e, "logging in to ECR") from None
    run([docker, "push", image])
    return image


def tagged_digest(ecr, repository_name: str, tag: str) -> Optional[str]:
    """Digest of ``repository:tag``, or None when the tag is not there. Raises CliError when ECR refuses."""
    try:
        found = ecr.describe_images(repositoryName=repository_name, imageIds=[{"imageTag": tag}])
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ImageNotFoundException":
            return None
        raise explain(e, f"looking for image tag {tag}") from None
    return found["imageDetails"][0].get("imageDigest")
