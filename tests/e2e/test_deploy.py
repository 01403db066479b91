"""`cdk bootstrap` and `cdk deploy TrainingStack` by the project's CDK CLI into the emulated account, then every
resource of the three stacks read back through the AWS APIs (tests/e2e/resources.py).

No resource type is removed from a template: the CLI synthesizes, publishes the templates and the recovery
function's code to the bootstrap bucket, and creates the stacks through change sets in dependency order, as
against AWS. What the emulator cannot create is printed with its count (docs/infrastructure.md, "What the
emulator cannot show").
"""

from __future__ import annotations

import collections
import json

import pytest

from tests.e2e.emulator import ACCOUNT, REGION
from tests.e2e.resources import check_stack

#: one emulator server and a CDK CLI / act run after another: minutes, several processes
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ENV = "e2e"
#: faults the emulator injects into the CDK CLI's calls (tests/e2e/faults.py): a throttled change set of the first
#: application stack (the 1st CreateChangeSet is the bootstrap's) and a SlowDown on the first asset upload
FAULTS = [
    {"name": "changeset-throttled", "service": "cloudformation", "operation": "CreateChangeSet",
     "agent": "aws-sdk-js", "nth": 2, "fault": "throttle"},
    {"name": "asset-slowdown", "service": "s3", "operation": "PutObject", "agent": "aws-sdk-js", "fault": "throttle"},
]  # fmt: skip
STACKS = ("DataStack", "MonitoringStack", "TrainingStack")


def bootstrap_bucket_objects(journey) -> dict[str, bytes]:
    s3 = journey.emulator.client("s3")
    bucket = f"cdk-hnb659fds-assets-{ACCOUNT}-{REGION}"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def test_cdk_deploy_creates_every_resource(journey):
    journey.run("cdk bootstrap", ["npx", "cdk", "bootstrap", f"aws://{ACCOUNT}/{REGION}", "--no-notices"])
    cfn = journey.emulator.client("cloudformation")
    toolkit = cfn.describe_stacks(StackName="CDKToolkit")["Stacks"][0]
    journey.verified(f"CDKToolkit {toolkit['StackStatus']}")

    proc = journey.run(
        "cdk deploy TrainingStack",
        ["npx", "cdk", "deploy", "TrainingStack", "-c", f"env={ENV}", "--require-approval", "never", "--no-notices"],
    )
    order = [
        line.split()[0] for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "deploying... [" in line
    ]
    # the data and monitoring stacks are independent (either may go first); the training stack needs both
    assert sorted(order[:2]) == ["DataStack", "MonitoringStack"] and order[2:] == ["TrainingStack"], order
    journey.verified("deployed in order " + " -> ".join(order))
    journey.verified(journey.emulator.assert_absorbed("changeset-throttled", "asset-slowdown"))

    assets = bootstrap_bucket_objects(journey)
    outputs: dict[str, str] = {}
    for cid in STACKS:
        stack = cfn.describe_stacks(StackName=f"{ENV}-{cid}")["Stacks"][0]
        assert stack["StackStatus"] == "CREATE_COMPLETE", stack["StackStatus"]
        outputs.update({o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])})
    session = journey.emulator.session()
    not_created = collections.Counter()
    for cid in STACKS:
        template = json.loads((journey.ws / "cdk.out" / f"{cid}.template.json").read_text())
        result = check_stack(session, journey.emulator.endpoint, f"{ENV}-{cid}", template, assets, outputs)
        kinds = ", ".join(f"{n} {t.split('::', 1)[1]}" for t, n in sorted(result["checked"].items()))
        print(f"  {ENV}-{cid}: {sum(result['checked'].values())} resources checked through the AWS APIs: {kinds}")
        for line in result["lines"]:
            print(f"      {line}")
        not_created.update(result["not_created"])
        expected = {k: v for k, v in collections.Counter(r["Type"] for r in template["Resources"].values()).items()}
        assert result["checked"] + result["not_created"] == collections.Counter(expected)
    print("  not created by the emulator: " + ", ".join(f"{t} x{n}" for t, n in sorted(not_created.items())))
    journey.verified(f"{len(STACKS)} stacks, every resource read back; not created: {dict(not_created)}")
