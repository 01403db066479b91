"""push-image for real: the OCI builder this machine has builds, logs in with the ECR token and pushes to a real
OCI registry (the distribution registry, Debian's ``docker-registry``, on 127.0.0.1), and the digest push-image
prints is the one the registry serves (``skopeo inspect``) and the one ``launch`` and ``submit`` pin.

The ECR API (tag lookup, GetAuthorizationToken, the stacks) is moto's, in process. moto has no registry endpoint,
so the test hands the manifest the local registry received to moto's PutImage with its digest: what ECR's own
registry front end records when a client PUTs a manifest. Nothing leaves 127.0.0.1.

The image is small (``FROM scratch`` and two files of this checkout) so that this runs in ``make test``; the
training image itself goes through the same push in ``make image-smoke``'s build (docs/training-image.md).
``make test`` installs buildah, skopeo and docker-registry (``make image-tools``, as root) and sets
TRAINSTACK_REQUIRE_IMAGE_TOOLS=1, so there a missing tool fails the test instead of skipping it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.cli.main import main
from tests import moto_env
from tests.infra.test_infra_cli import E, _instances, aws, templates  # noqa: F401  (fixtures)
from tests.infra_helpers import REPO as REPO_ROOT

TOOLS = ("skopeo", "docker-registry")


def _builder_or_skip():
    from infra.cli import builder
    from infra.cli.session import CliError

    missing = [t for t in TOOLS if not shutil.which(t)]
    try:
        b = builder.find()
    except CliError:
        b, missing = None, [*missing, "an OCI builder (buildah)"]
    if missing:
        if os.environ.get("TRAINSTACK_REQUIRE_IMAGE_TOOLS") == "1":
            pytest.fail(f"missing {', '.join(missing)}: run `make image-tools` as root")
        pytest.skip(f"needs {', '.join(missing)} (make image-tools, as root)")
    return b


@contextlib.contextmanager
def local_registry(tmp_path: Path):
    """infra.cli.registry's registry on 127.0.0.1, failing the test (not raising CliError) when it does not start."""
    from infra.cli.registry import local_registry as serve
    from infra.cli.session import CliError

    try:
        with serve(tmp_path) as address:
            yield address
    except CliError as e:
        raise AssertionError(str(e)) from None


def _skopeo(*args: str) -> bytes:
    return subprocess.run(["skopeo", *args], check=True, capture_output=True).stdout


def test_push_image_to_a_real_registry_records_the_digest_launch_and_submit_pin(aws, tmp_path, capsys):  # noqa: F811
    from infra.cli import image
    from infra.cli.outputs import load as load_outputs
    from infra.cli.session import open_session

    b = _builder_or_skip()
    containerfile = tmp_path / "Containerfile"
    containerfile.write_text("ARG BASE_IMAGE=scratch\nFROM ${BASE_IMAGE}\nCOPY README.md requirements.txt /\n")
    session = open_session(moto_env.ENV, None, None)
    outputs = load_outputs(session)
    tag = "c0ffee01"
    with local_registry(tmp_path) as registry:
        repo = f"{registry}/{outputs.repository_name}"
        pushed = image.push_image(
            session,
            outputs,
            REPO_ROOT,
            tag,
            base_image="scratch",
            builder=b.binary,
            push_to=repo,
            tls_verify=False,
            dockerfile=str(containerfile),
        )
        name, digest = pushed.split("@")
        assert name == f"{repo}:{tag}" and digest.startswith("sha256:") and len(digest) == 71, pushed
        ref = f"docker://{repo}:{tag}"
        served = json.loads(_skopeo("inspect", "--tls-verify=false", ref))
        raw = _skopeo("inspect", "--raw", "--tls-verify=false", ref)
        assert served["Digest"] == digest == "sha256:" + hashlib.sha256(raw).hexdigest()
        assert len(served["Layers"]) == 1  # the one COPY layer
        # the registry's side of ECR: the manifest it received becomes the tag's image record
        ecr = aws.client("ecr")
        ecr.put_image(
            repositoryName=outputs.repository_name, imageManifest=raw.decode(), imageTag=tag, imageDigest=digest
        )

        assert main(E + ["launch", "g5.2xlarge", "--job", "j", "--image-tag", tag]) == 0
        (inst,) = _instances(aws)
        assert {t["Key"]: t["Value"] for t in inst["Tags"]}["trainstack:image-digest"] == digest
        assert main(E + ["submit", "--run-name", "r1", "--image-tag", tag]) == 0
        arn = capsys.readouterr().out.split("started ")[1].strip()
        payload = json.loads(aws.client("stepfunctions").describe_execution(executionArn=arn)["input"])
        assert (payload["image_tag"], payload["image_digest"]) == (tag, digest)
        # the tag is immutable and there: a second push-image builds and pushes nothing
        again = image.push_image(session, outputs, REPO_ROOT, tag, base_image="scratch", builder=b.binary, push_to=repo)
        assert again.endswith(f":{tag} (already pushed)")
    subprocess.run([b.binary, "rmi", f"{repo}:{tag}"], check=True, capture_output=True)  # leave no image behind


@pytest.mark.skipif(
    not os.environ.get("TRAINSTACK_SMOKE_RECORD"),
    reason="by hand after make image-smoke: TRAINSTACK_SMOKE_RECORD=runs/image-smoke/<record>.json (builds the "
    "7 GiB training image from the builder's cache and pushes it; docs/training-image.md)",
)
def test_push_image_pushes_the_digest_image_smoke_printed(aws, tmp_path):  # noqa: F811
    """push-image for the commit, base and architectures of a passed image-smoke record builds the same image (from
    the layer cache) and its push stores the digest the smoke printed: the smoke tested what push-image ships."""
    from infra.cli import image
    from infra.cli.outputs import load as load_outputs
    from infra.cli.session import open_session

    record = json.loads(Path(os.environ["TRAINSTACK_SMOKE_RECORD"]).read_text())
    assert record["pushed_digest"], "the record is of a --build-only run: no pushed digest to compare"
    args = record["build_args"]
    assert args["VCS_REF"] == image.vcs_revision(REPO_ROOT), "the record is of another commit or tree"
    b = _builder_or_skip()
    session = open_session(moto_env.ENV, None, None)
    outputs = load_outputs(session)
    with local_registry(tmp_path) as registry:
        pushed = image.push_image(
            session,
            outputs,
            REPO_ROOT,
            "smoke-digest",  # a tag of its own: the aws fixture records this commit's tag as pushed already
            base_image=args["BASE_IMAGE"],
            builder=b.binary,
            push_to=f"{registry}/{outputs.repository_name}",
            tls_verify=False,
            archs=args["TORCH_CUDA_ARCH_LIST"],
        )
    assert "@" in pushed and pushed.split("@")[1] == record["digest"], (pushed, record["digest"])
