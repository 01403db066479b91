"""A deployed environment inside moto (in-process, no network): the synthesized stacks created by moto's
CloudFormation, so the CLI reads real stack outputs, launch templates, volumes and state machines.

This is the unit tests' fast helper and it trims the templates (below). The whole templates, unstripped, are
deployed by the CDK CLI itself into moto's server in tests/e2e/ (docs/infrastructure.md, "Try the whole journey
without an AWS account"), which also fixes the moto gaps listed here in its harness.

What moto cannot do, and what this harness does about it (the tests say so where it matters):
- moto's CloudFormation has no ``AWS::KMS::Key``: the monitoring template is deployed without the key and
  without the topic's ``KmsMasterKeyId`` (the real template, with both, is checked by test_infra_stacks.py).
- The DLAMI's SSM public parameter cannot be written in moto (reserved ``/aws/`` names): the app is
  synthesized with ``-c ami_parameter=/trainstack/test/ami-id``, the substitution the context key exists for.
- moto's CloudFormation skips (with a warning) AWS::CloudWatch::Alarm, AWS::Logs::MetricFilter,
  AWS::S3::BucketPolicy and AWS::SNS::TopicPolicy, and cannot resolve the dashboard's alarm references, so
  the dashboard is dropped too. None of these is read by the CLI.
- The recovery function's code is a CDK asset in the bootstrap bucket, which moto does not have: the function,
  its permissions and the EventBridge rules that target it are dropped; tests/infra/test_recovery.py calls
  ``infra.recovery`` in-process with the events EventBridge would deliver (the synthesized rules and function
  are checked by test_infra_stacks.py).
- moto ignores spot options set only in a launch template (the instance runs on-demand) and does not run
  Step Functions definitions against SageMaker.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

ENV = "test"
REGION = "us-east-1"
AMI_PARAMETER = "/trainstack/test/ami-id"
UNSUPPORTED = (
    "AWS::KMS::Key",
    "AWS::CDK::Metadata",
    "AWS::CloudWatch::Dashboard",
    "AWS::Lambda::Function",
    "AWS::Lambda::Permission",
    "AWS::Events::Rule",
)


ACCOUNT = "123456789012"  # moto's default account
GITHUB_REPO = "acme/trainstack"


def synthesize(outdir: Path, **context) -> dict[str, dict]:
    """The templates for environment ``test`` (construct id -> template); ``context`` adds CDK context
    (``github_repo=GITHUB_REPO`` adds the CiStack with the GitHub deploy role, which :func:`deploy` skips).
    Synthesized once per test run and context, shared by every module and pytest-xdist worker that asks
    (:func:`tests.shared_once.shared_once`): a synthesis costs 10-40 s of the 2 vCPUs."""
    from tests.infra_helpers import synth
    from tests.shared_once import shared_once

    full = {"env": ENV, "ami_parameter": AMI_PARAMETER, **context}
    key = "synth-" + hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def make(folder: Path) -> None:
        _, _, raw = synth(full, outdir)
        (folder / "templates.json").write_text(json.dumps(raw))

    return json.loads((shared_once(key, make) / "templates.json").read_text())


#: Stands in for imports of the dropped KMS key's ARN (the recovery role's grant to publish to the topic).
DROPPED_KEY_ARN = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/dropped-in-moto"


def _no_key_imports(value):
    if isinstance(value, dict):
        if "TopicKey" in str(value.get("Fn::ImportValue", "")):
            return DROPPED_KEY_ARN
        return {k: _no_key_imports(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_key_imports(v) for v in value]
    return value


def _strip_unsupported(template: dict) -> dict:
    t = _no_key_imports(copy.deepcopy(template))
    dropped = {k for k, v in t["Resources"].items() if v["Type"] in UNSUPPORTED}
    for k in dropped:
        del t["Resources"][k]
    for res in t["Resources"].values():
        props = res.get("Properties", {})
        if res["Type"] == "AWS::SNS::Topic":
            props.pop("KmsMasterKeyId", None)
        if isinstance(res.get("DependsOn"), list):
            res["DependsOn"] = [d for d in res["DependsOn"] if d not in dropped]
    for name, out in list(t.get("Outputs", {}).items()):  # outputs of dropped resources go with them
        if any(f'"{k}"' in json.dumps(out) for k in dropped):
            del t["Outputs"][name]
    return t


def amazon_ami(ec2, index: int = 0) -> str:
    """The id of the ``index``-th Amazon-owned image of moto's AMI list (an active ``mock_aws``; ``ec2``: its
    client), asked for by id: ``describe_images(Owners=["amazon"])`` unfiltered answers all ~1,300 of moto's
    images, whose serialisation alone took ~2 s of every deployment. Raises botocore's ClientError
    (InvalidAMIID.NotFound) when moto no longer lists that image."""
    from moto.ec2.models.amis import AMIS

    (image,) = ec2.describe_images(Owners=["amazon"], ImageIds=[AMIS[index]["ami_id"]])["Images"]
    return image["ImageId"]


def deploy(templates: dict[str, dict]) -> dict[str, str]:
    """Create the stacks (inside an active ``mock_aws``); returns construct id -> stack status."""
    import boto3

    ssm = boto3.client("ssm", region_name=REGION)
    ec2 = boto3.client("ec2", region_name=REGION)
    ami = amazon_ami(ec2)
    ssm.put_parameter(Name="/cdk-bootstrap/hnb659fds/version", Value="30", Type="String")
    ssm.put_parameter(Name=AMI_PARAMETER, Value=ami, Type="String")
    cfn = boto3.client("cloudformation", region_name=REGION)
    status = {}
    with _json_templates_read_as_json():
        for cid in ("DataStack", "MonitoringStack", "TrainingStack"):
            cfn.create_stack(
                StackName=f"{ENV}-{cid}",
                TemplateBody=json.dumps(_strip_unsupported(templates[cid])),
                Capabilities=["CAPABILITY_IAM", "CAPABILITY_NAMED_IAM"],
            )
            status[cid] = cfn.describe_stacks(StackName=f"{ENV}-{cid}")["Stacks"][0]["StackStatus"]
    return status


@contextlib.contextmanager
def _json_templates_read_as_json() -> Iterator[None]:
    """While it lasts, moto's CloudFormation reads a JSON template body with ``json`` (as CloudFormation does)
    instead of PyYAML's pure-Python loader, which took ~1 s of every deployment for the three templates; a body
    that is not JSON still goes to moto's own YAML-then-JSON parser."""
    from moto.cloudformation.models import Stack

    yaml_first = Stack.parse_template

    def json_first(template: str) -> dict:
        try:
            return json.loads(template)
        except ValueError:
            return yaml_first(template)

    Stack.parse_template = staticmethod(json_first)
    try:
        yield
    finally:
        Stack.parse_template = staticmethod(yaml_first)


def fake_credentials(monkeypatch) -> None:
    """Credentials and region for moto; never real ones (and no request leaves the process). While ``monkeypatch``
    lasts, every botocore session also reads its data files through one shared loader (:func:`_shared_loader`)."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    import botocore.session

    monkeypatch.setattr(botocore.session, "create_loader", _shared_loader)


@functools.cache
def _shared_loader(search_path_string=None):
    """botocore's data loader for ``search_path_string`` (``AWS_DATA_PATH``), one per value for the whole test
    process: a session reads its service models, endpoints and partitions through its loader, which caches
    what it decoded, as the clients of one session share them. Every session a test makes (``mock_aws`` drops
    boto3's default session; the CLI makes its own) had a fresh loader and decoded the same JSON again: ~1.5 s
    of each moto test."""
    from botocore.loaders import create_loader

    return create_loader(search_path_string)


def put_image(session, tag: str, repository: str = f"trainstack-{ENV}", seed: str = "1") -> str:
    """An image manifest tagged ``tag`` in ``repository`` (what a real push leaves there); returns its digest.
    Another ``seed`` gives another manifest, so another digest."""
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"digest": "sha256:" + seed * 64, "size": 1, "mediaType": "x"},
            "layers": [],
        }
    )
    ecr = session.client("ecr")
    ecr.put_image(repositoryName=repository, imageManifest=manifest, imageTag=tag)
    return ecr.describe_images(repositoryName=repository, imageIds=[{"imageTag": tag}])["imageDetails"][0][
        "imageDigest"
    ]


@contextlib.contextmanager
def deployed(templates: dict[str, dict], monkeypatch) -> Iterator:
    """Fake credentials, moto active, every template deployed (all stacks CREATE_COMPLETE) and the image of
    this checkout pushed (its commit tag, what ``launch``/``submit`` run by default); yields a boto3 Session
    in :data:`REGION`. Everything is undone on exit."""
    import boto3
    from moto import mock_aws

    from infra.cli.image import git_tag
    from tests.infra_helpers import REPO

    fake_credentials(monkeypatch)
    with mock_aws():
        status = deploy(templates)
        assert set(status.values()) == {"CREATE_COMPLETE"}, status
        session = boto3.Session(region_name=REGION)
        put_image(session, git_tag(REPO))
        yield session
