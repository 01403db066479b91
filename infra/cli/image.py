"""``push-image``: build images/training/Dockerfile, log in to ECR through boto3, tag with the git commit, push,
and print the digest the registry stored.

The build and push are done by the OCI builder this machine has (infra/cli/builder.py: a docker engine, podman
or buildah; ``--builder`` picks a binary); the ECR credentials come from ``ecr:GetAuthorizationToken`` (base64 ``AWS:password``)
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
import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from botocore.exceptions import ClientError

from infra.cli import builder as oci
from infra.cli import image_inputs
from infra.cli.outputs import Outputs
from infra.cli.session import Aws, CliError, explain

DOCKERFILE = "images/training/Dockerfile"


def parse_dockerfile(path: Path) -> tuple[str, list[tuple[str, str]], dict]:
    """(WORKDIR, [(source, destination)] of every COPY in order, ENV assignments) of a Dockerfile.

    Handles line continuations, ``COPY --flag=... SRC... DEST`` with several sources, and ``ENV K=V K=V``.
    Raises ValueError for a COPY form this parser does not understand (JSON form, --from stages).
    """
    text = path.read_text().replace("\\\n", " ")
    workdir, copies, env = "/", [], {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True) if line.strip() else []
        if not words:
            continue
        op, args = words[0].upper(), words[1:]
        if op == "WORKDIR":
            workdir = args[0]
        elif op == "ENV":
            env.update(a.split("=", 1) for a in args if "=" in a)
        elif op == "COPY":
            flags = [a for a in args if a.startswith("--")]
            paths = [a for a in args if not a.startswith("--")]
            if any(f.startswith("--from") for f in flags) or len(paths) < 2 or paths[0].startswith("["):
                raise ValueError(f"{path}: COPY {args}: form not understood (multi-stage or JSON form)")
            dest = paths[-1]
            dest = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
            copies += [(src, dest) for src in paths[:-1]]
    return workdir, copies, env


def untracked_copied(repo: Path, dockerfile: str = DOCKERFILE) -> list[str]:
    """The files under ``dockerfile``'s COPY sources (relative to ``repo``) that git does not track and does not
    ignore: they go into the image although no commit holds them. Sorted paths relative to ``repo``."""
    sources = sorted({src for src, _ in parse_dockerfile(repo / dockerfile)[1]})
    out = subprocess.run(
        ["git", "ls-files", "-z", "--others", "--exclude-standard", "--", *sources],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    return sorted(p for p in out.decode().split("\0") if p)


def git_tag(repo: Path, dockerfile: str = DOCKERFILE) -> str:
    """Image tag of ``repo``'s checkout: the short commit (12 hex), and for a tree whose image would hold
    anything no commit holds ``<commit>-dirty-<8 hex>``: the SHA-256 of the uncommitted changes to tracked files
    (``git diff HEAD``) followed by the path and content of each untracked, not ignored file under the
    Dockerfile's COPY sources (:func:`untracked_copied`). Other changes get another (immutable) tag, the same
    changes the same one, and a clean tree of that commit never finds a tag built from a dirty one.
    push-image's default tag and launch/submit's default ``--image-tag``. Raises CliError when git cannot say."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
        ).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=repo, check=True, capture_output=True).stdout
        untracked = untracked_copied(repo, dockerfile)
    except (OSError, subprocess.CalledProcessError) as e:
        raise CliError(f"cannot read the git commit of {repo}: {e}", "pass --tag / --image-tag") from None
    if not diff and not untracked:
        return sha
    digest = hashlib.sha256(diff)
    for rel in untracked:
        path = repo / rel
        content = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        digest.update(b"\0untracked\0" + rel.encode() + b"\0" + content)
    return f"{sha}-dirty-{digest.hexdigest()[:8]}"


def registry_region(registry: str) -> str:
    """``<account>.dkr.ecr.<region>.amazonaws.com`` -> ``<region>``."""
    match = re.match(r"^\d{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?$", registry)
    if not match:
        raise CliError(f"{registry!r} is not an ECR registry host (<account>.dkr.ecr.<region>.amazonaws.com)")
    return match.group(1)


def _login(
    b: oci.Builder, ecr_in: Callable[[str], object], registries: list[str], tls_verify: bool = True
) -> list[str]:
    """Logs ``b`` in to each ECR registry with a GetAuthorizationToken from the registry's own region
    (``ecr_in(region)`` gives that region's client). One token per region serves every registry there that the
    caller may pull from (the DLC account 763104351884 included: AWS DLC docs), but only that region: the
    environment's token did not log in to the DLC registry in us-east-1 from any other region. A registry that
    is not an ECR host (a test's local registry standing in for the repository) gets the repository region's
    token."""
    tokens: dict[str, tuple[str, str]] = {}
    for registry in registries:
        region = registry_region(registry) if ".dkr.ecr." in registry else registries_region_default(registries)
        if region not in tokens:
            auth = ecr_in(region).get_authorization_token()["authorizationData"][0]
            tokens[region] = tuple(base64.b64decode(auth["authorizationToken"]).decode().split(":", 1))
        user, password = tokens[region]
        b.login(registry, user, password, tls_verify=tls_verify or ".dkr.ecr." in registry)
    return registries


def registries_region_default(registries: list[str]) -> str:
    """The region of the first ECR host in ``registries`` (us-east-1 when none is one)."""
    return next((registry_region(r) for r in registries if ".dkr.ecr." in r), "us-east-1")


def dockerfile_arg(repo: Path, name: str, dockerfile: str = DOCKERFILE) -> str:
    """The default of ``ARG <name>=...`` in ``dockerfile`` (the first one). Raises CliError when it has none."""
    text = (repo / dockerfile).read_text()
    match = re.search(rf"^ARG\s+{name}=(\"[^\"]*\"|\S+)", text, re.M)
    if not match:
        raise CliError(f"{dockerfile} has no `ARG {name}=...` default", f"pass the {name} build argument")
    return match.group(1).strip('"')


def dockerfile_base_image(repo: Path) -> str:
    """The default of ``ARG BASE_IMAGE=...`` in the training Dockerfile."""
    return dockerfile_arg(repo, "BASE_IMAGE")


def default_archs(repo: Path) -> str:
    """The op's default architecture list, ``ARG TORCH_CUDA_ARCH_LIST=...`` of the training Dockerfile (what
    push-image builds unless told otherwise, and so what image-smoke tests)."""
    return dockerfile_arg(repo, "TORCH_CUDA_ARCH_LIST")


def vcs_revision(repo: Path) -> str:
    """The full commit of ``repo``'s checkout, with git_tag's ``-dirty-<8 hex>`` suffix for a tree with
    uncommitted changes (the OCI ``revision`` label). Raises CliError when git cannot say."""
    tag = git_tag(repo)
    full = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    return full + tag[12:]


def source_url(repo: Path) -> str:
    """Where the source lives (the OCI ``source`` label): GitHub Actions' ``$GITHUB_SERVER_URL/$GITHUB_REPOSITORY``,
    else the checkout's ``origin`` remote, else ``""``."""
    if os.environ.get("GITHUB_SERVER_URL") and os.environ.get("GITHUB_REPOSITORY"):
        return f"{os.environ['GITHUB_SERVER_URL']}/{os.environ['GITHUB_REPOSITORY']}"
    got = subprocess.run(["git", "remote", "get-url", "origin"], cwd=repo, capture_output=True, text=True)
    return got.stdout.strip() if got.returncode == 0 else ""


def build_args(b: oci.Builder, repo: Path, base: str, archs: Optional[str] = None, msda: str = "cuda") -> dict:
    """The build arguments of images/training/Dockerfile, the same for push-image and image-smoke, so that the
    two build one image (same layers, same configuration, same digest for the same commit, base and ``archs``):
    ``BASE_IMAGE``, ``MSDA``, ``TORCH_CUDA_ARCH_LIST`` (default: the Dockerfile's), and the OCI labels' values
    ``BASE_DIGEST`` (the base's digest in the builder's store, pulled first when it is not there; empty for
    ``scratch``), ``VCS_REF`` (:func:`vcs_revision`) and ``SOURCE_URL`` (:func:`source_url`). Raises CliError when
    the base cannot be pulled."""
    digest = ""
    if base != "scratch":
        if not b.exists(base):
            b.pull(base)
        digest = b.image_digest(base)
    return {
        "BASE_IMAGE": base,
        "MSDA": msda,
        "TORCH_CUDA_ARCH_LIST": archs or default_archs(repo),
        "BASE_DIGEST": digest,
        "VCS_REF": vcs_revision(repo),
        "SOURCE_URL": source_url(repo),
    }


def push_image(
    aws: Aws,
    outputs: Outputs,
    repo: Path,
    tag: Optional[str] = None,
    base_image: Optional[str] = None,
    builder: Optional[str] = None,
    ecr_in: Optional[Callable[[str], object]] = None,
    push_to: Optional[str] = None,
    tls_verify: bool = True,
    dockerfile: str = DOCKERFILE,
    ca_bundle: Optional[str] = None,
    archs: Optional[str] = None,
) -> str:
    """Build, tag ``<repository>:<tag>``, push; returns ``<repository>:<tag>@<digest>``, the digest being the
    one the registry stored for the pushed manifest (or ``<repository>:<tag> (already pushed)`` when the tag
    was in the repository already: nothing is built or pushed then).

    ``builder``: docker, podman or buildah binary (default: :func:`infra.cli.builder.find`). ``ecr_in(region)``:
    the ECR client of a region (default: the session's). ``push_to``: a ``registry/repository`` that receives
    the blobs and manifest instead of the ECR repository (tests: a registry on 127.0.0.1, without TLS when
    ``tls_verify`` is False); the ECR API still answers the tag lookup and the login token. ``dockerfile``:
    relative to ``repo``. ``ca_bundle``: a CA file bind-mounted over the base's bundle for the build's RUN
    steps (podman/buildah; behind a TLS-inspecting proxy). ``archs``: the op's TORCH_CUDA_ARCH_LIST (default: the
    Dockerfile's, what image-smoke tests). Raises CliError with exit 2 before anything is built for a bad tag or
    ``archs``, a missing ``ca_bundle`` and a ``builder`` that is not one (infra/cli/image_inputs.py); CliError when
    no builder is found, the build or push fails, or ECR refuses (with the next step).
    """
    tag = image_inputs.check_tag(tag or git_tag(repo))
    archs = image_inputs.check_archs(archs) if archs is not None else None
    ca_bundle = image_inputs.check_ca_bundle(ca_bundle)
    ecr_in = ecr_in or (lambda region: aws.session.client("ecr", region_name=region))
    if tagged_digest(ecr_in(aws.region), outputs.repository_name, tag):
        return f"{outputs.repository_uri}:{tag} (already pushed)"
    b = oci.find(builder)
    image = f"{push_to or outputs.repository_uri}:{tag}"
    base = base_image or dockerfile_base_image(repo)
    registries = [image.split("/", 1)[0]]
    if ".dkr.ecr." in base.split("/", 1)[0]:
        registries.append(base.split("/", 1)[0])
    try:
        _login(b, ecr_in, registries, tls_verify)
    except ClientError as e:
        raise explain(e, "logging in to ECR") from None
    args = build_args(b, repo, base, archs) if dockerfile == DOCKERFILE else {"BASE_IMAGE": base}
    b.build(repo, dockerfile, image, args, oci.ca_mounts(b, ca_bundle, base))
    digest = b.push(image, tls_verify=tls_verify)
    return f"{image}@{digest}"


def tagged_digest(ecr, repository_name: str, tag: str) -> Optional[str]:
    """Digest of ``repository:tag``, or None when the tag is not there. Raises CliError when ECR refuses."""
    try:
        found = ecr.describe_images(repositoryName=repository_name, imageIds=[{"imageTag": tag}])
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ImageNotFoundException":
            return None
        raise explain(e, f"looking for image tag {tag}") from None
    return found["imageDetails"][0].get("imageDigest")
