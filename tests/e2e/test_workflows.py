"""The GitHub workflows run whole by nektos/act against the emulated account, with the events GitHub sends, and
the CLI steps a user runs between them.

Journey: ``cdk bootstrap``; ``cdk deploy CiStack -c github_repo=acme/trainstack`` (the one-time deploy role,
its ARN the repository variable AWS_DEPLOY_ROLE_ARN); deploy.yml for pull request 7 opened (environment pr-7,
run as that role: the credentials stand-in calls AssumeRoleWithWebIdentity); ``python -m infra --env pr-7``
status, launch of a job from the deployed launch template (the instance carries the job's tags and user data),
status, stop; destroy.yml for pull request 7 closed, after which the emulator holds nothing of pr-7; destroy.yml
again (exit 0, nothing changes); and a by-hand environment (deploy.yml ``workflow_dispatch``) destroyed with
keep_data, which leaves exactly its data stack's resources.

image.yml and ci.yml are not run: both would change this machine (image.yml frees disk with ``sudo rm -rf``
and ``docker system prune``; ci.yml installs apt packages), image.yml needs the ~28 GB Deep Learning Container
from ECR, and ci.yml is ``make test`` itself (docs/infrastructure.md, "Try the whole journey").
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

from tests.e2e import act_runner
from tests.e2e.emulator import ACCOUNT, REGION

#: one emulator server and a CDK CLI / act run after another: minutes, several processes
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

#: faults the emulator injects into our CLI's calls (boto3's User-Agent; tests/e2e/faults.py): the launch's
#: RunInstances throttled, then its retry run but answered 500 (the retry after it must not make a second instance:
#: botocore's client token); the job record's create throttled, then run but answered 500 (its retry gets 412);
#: the first read of the stack outputs throttled; stop's TerminateInstances of the new instance NotFound (eventual
#: consistency)
FAULTS = [
    {"name": "run-throttled", "service": "ec2", "operation": "RunInstances", "agent": "Boto3/", "fault": "throttle"},
    {"name": "run-lost", "service": "ec2", "operation": "RunInstances", "agent": "Boto3/", "nth": 2, "fault": "lost"},
    {"name": "record-slowdown", "service": "s3", "operation": "PutObject", "agent": "Boto3/", "path": "jobs/",
     "fault": "throttle"},
    {"name": "record-lost", "service": "s3", "operation": "PutObject", "agent": "Boto3/", "path": "jobs/", "nth": 2,
     "fault": "lost"},
    {"name": "outputs-throttled", "service": "cloudformation", "operation": "DescribeStacks", "agent": "Boto3/",
     "fault": "throttle"},
    {"name": "terminate-not-found", "service": "ec2", "operation": "TerminateInstances", "agent": "Boto3/",
     "fault": "not_found_new"},
]  # fmt: skip
REPO_NAME = "acme/trainstack"
PR_ENV = "pr-7"
HAND_ENV = "byhand"


def payload(journey, name: str, **changes) -> Path:
    """tests/e2e/events/NAME.json with top-level ``changes`` (e.g. ``inputs``), written to the run folder."""
    body = json.loads((act_runner.EVENTS / f"{name}.json").read_text())
    body.update(changes)
    path = journey.folder / f"{name}-{len(journey.steps)}.json"
    path.write_text(json.dumps(body))
    return path


def act(journey, workflow: str, event: str, event_file) -> str:
    """Run one workflow by act; records the step and returns act's summary line (jobs and steps run)."""
    started = time.monotonic()
    log = journey.folder / f"{len(journey.steps) + 1:02d}-act-{workflow}.log"
    try:
        result = act_runner.run_workflow(
            workflow,
            event,
            event_file,
            repo=journey.ws,
            endpoint_url=journey.emulator.endpoint,
            variables={"AWS_DEPLOY_ROLE_ARN": journey.state["role_arn"], "AWS_REGION": REGION},
            env={"PATH": journey.emulator.env()["PATH"]},
            timeout_s=600,
            log=log,
        )
    except act_runner.ActError as e:
        pytest.fail(f"act {workflow} ({event}): {e}")
    journey.steps.append((f"act {workflow} ({event})", time.monotonic() - started, ""))
    journey.state["act_log"] = log.read_text()
    return act_runner.summary(workflow, result.stdout)


def env_resources(journey, env: str) -> dict[str, list[str]]:
    """What the emulator holds of environment ``env``, by kind (empty lists: nothing)."""
    c = journey.emulator.client
    cfn = c("cloudformation")
    stacks = [s["StackName"] for s in cfn.describe_stacks()["Stacks"] if s["StackName"].startswith(f"{env}-")]
    tag = [{"Name": "tag:trainstack:env", "Values": [env]}]
    reservations = c("ec2").describe_instances(Filters=tag)["Reservations"]
    instances = [i["InstanceId"] for r in reservations for i in r["Instances"] if i["State"]["Name"] != "terminated"]
    volumes = [v["VolumeId"] for v in c("ec2").describe_volumes(Filters=tag)["Volumes"]]
    buckets = [b["Name"] for b in c("s3").list_buckets()["Buckets"] if b["Name"].startswith(f"{env}-")]
    prefix = f"trainstack-{env}-"
    alarms = [
        a["AlarmName"] for a in c("cloudwatch").describe_alarms()["MetricAlarms"] if a["AlarmName"].startswith(prefix)
    ]
    rules = [r["Name"] for r in c("events").list_rules()["Rules"] if r["Name"].startswith(f"{env}-")]
    functions = [
        f["FunctionName"] for f in c("lambda").list_functions()["Functions"] if f["FunctionName"].startswith(prefix)
    ]
    groups = [
        g["logGroupName"]
        for g in c("logs").describe_log_groups()["logGroups"]
        if f"/{env}/" in g["logGroupName"] or g["logGroupName"].startswith((f"{env}-", prefix))
    ]
    queues = [u for u in c("sqs").list_queues().get("QueueUrls", []) if f"/{prefix}" in u]
    vpcs = [v["VpcId"] for v in c("ec2").describe_vpcs(Filters=tag)["Vpcs"]]
    return {
        "stacks": stacks, "instances": instances, "volumes": volumes, "buckets": buckets, "alarms": alarms,
        "rules": rules, "functions": functions, "log groups": groups, "queues": queues, "vpcs": vpcs,
    }  # fmt: skip


def left(resources: dict[str, list[str]]) -> str:
    return "; ".join(f"{k}: {', '.join(v)}" for k, v in resources.items() if v) or "nothing"


def test_setup_once_bootstrap_and_the_deploy_role(journey):
    journey.run("cdk bootstrap", ["npx", "cdk", "bootstrap", f"aws://{ACCOUNT}/{REGION}", "--no-notices"])
    journey.verified("CDKToolkit created")
    journey.run(
        "cdk deploy CiStack",
        [
            "npx",
            "cdk",
            "deploy",
            "CiStack",
            "-c",
            f"github_repo={REPO_NAME}",
            "--require-approval",
            "never",
            "--no-notices",
        ],
    )
    outputs = journey.emulator.client("cloudformation").describe_stacks(StackName="trainstack-ci")["Stacks"][0][
        "Outputs"
    ]
    journey.state["role_arn"] = next(o["OutputValue"] for o in outputs if o["OutputKey"] == "GithubDeployRoleArn")
    journey.verified(f"deploy role {journey.state['role_arn']} (AWS_DEPLOY_ROLE_ARN)")


def test_deploy_workflow_for_a_pull_request(journey):
    if "role_arn" not in journey.state:
        pytest.skip("needs the deploy role of the previous step")
    print(" ", act(journey, "deploy.yml", "pull_request", payload(journey, "pull_request_opened_7")))
    cfn = journey.emulator.client("cloudformation")
    for cid in ("DataStack", "MonitoringStack", "TrainingStack"):
        stack = cfn.describe_stacks(StackName=f"{PR_ENV}-{cid}")["Stacks"][0]
        assert stack["StackStatus"] == "CREATE_COMPLETE", stack
    # the credentials stand-in assumed the CI stack's deploy role for the token of pull request 7
    role = journey.state["role_arn"]
    assumed = f"assumed {role} as arn:aws:sts::{ACCOUNT}:assumed-role/{role.rsplit('/', 1)[-1]}/"
    assert assumed in journey.state["act_log"], "the job did not assume the deploy role"
    assert f"with sub repo:{REPO_NAME}:pull_request" in journey.state["act_log"]
    data = cfn.describe_stacks(StackName=f"{PR_ENV}-DataStack")["Stacks"][0]
    assert "volume on destroy: delete" in data["Description"], data["Description"]  # ephemeral=true
    journey.verified(f"{PR_ENV}: 3 stacks CREATE_COMPLETE as the deploy role, ephemeral (volume deleted on destroy)")


def test_the_cli_launches_watches_and_stops_a_job(journey):
    if not journey.state.get("role_arn"):
        pytest.skip("needs the deployed environment")
    py = [".venv/bin/python", "-m", "infra", "--env", PR_ENV]
    ecr = journey.emulator.client("ecr")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"digest": "sha256:" + "1" * 64, "size": 1, "mediaType": "x"}, "layers": []}  # fmt: skip
    # push-image needs an OCI builder and a registry (make image-smoke tests that path); ECR gets the manifest
    ecr.put_image(repositoryName=f"trainstack-{PR_ENV}", imageManifest=json.dumps(manifest), imageTag="e2e0001")
    journey.run("status (empty)", [*py, "status"])
    journey.verified("exit 0")
    proc = journey.run(
        "launch", [*py, "launch", "g5.2xlarge", "--job", "e2e-job", "--image-tag", "e2e0001", "--args", "--epochs 1"]
    )
    ec2 = journey.emulator.client("ec2")
    found = ec2.describe_instances(Filters=[{"Name": "tag:trainstack:job", "Values": ["e2e-job"]}])["Reservations"]
    inst = [i for r in found for i in r["Instances"]]
    assert len(inst) == 1, proc.stdout + proc.stderr
    inst = inst[0]
    tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
    assert tags.get("trainstack:env") == PR_ENV and tags.get("trainstack:job") == "e2e-job", tags
    assert inst["InstanceType"] == "g5.2xlarge" and inst["State"]["Name"] == "running", inst["State"]
    user_data = base64.b64decode(
        ec2.describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")["UserData"]["Value"]
    ).decode()
    outputs = {
        o["OutputKey"]: o["OutputValue"]
        for o in journey.emulator.client("cloudformation").describe_stacks(StackName=f"{PR_ENV}-DataStack")["Stacks"][
            0
        ]["Outputs"]
    }
    assert outputs["DataVolumeId"] in user_data, "the instance's user data does not name the data volume"
    journey.verified(f"{inst['InstanceId']} g5.2xlarge running, tags {sorted(k for k in tags if k.startswith('trainstack:'))}, "
                     f"user data of the launch template ({len(user_data)} B)")  # fmt: skip
    proc = journey.run("status (job)", [*py, "status"])
    assert "e2e-job" in proc.stdout, proc.stdout
    journey.verified("lists e2e-job")
    journey.run("stop", [*py, "stop", "e2e-job"])
    state = ec2.describe_instances(InstanceIds=[inst["InstanceId"]])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state in ("shutting-down", "terminated"), state
    journey.verified(f"instance {state}")
    journey.verified(journey.emulator.assert_absorbed(*(f["name"] for f in FAULTS)))


def test_destroy_workflow_leaves_nothing_and_runs_twice(journey):
    if not journey.state.get("role_arn"):
        pytest.skip("needs the deployed environment")
    print(" ", act(journey, "destroy.yml", "pull_request", payload(journey, "pull_request_closed_7")))
    assert left(env_resources(journey, PR_ENV)) == "nothing"
    journey.verified(f"the emulator holds nothing of {PR_ENV}")
    before = env_resources(journey, PR_ENV)
    print(" ", act(journey, "destroy.yml", "pull_request", payload(journey, "pull_request_closed_7")))
    assert env_resources(journey, PR_ENV) == before
    journey.verified("second destroy: exit 0, nothing changed")


def test_destroy_by_hand_keeps_exactly_the_data_stack(journey):
    if not journey.state.get("role_arn"):
        pytest.skip("needs the deploy role")
    dispatch = {"inputs": {"env": HAND_ENV}, "workflow": ".github/workflows/deploy.yml"}
    print(
        " ", act(journey, "deploy.yml", "workflow_dispatch", payload(journey, "workflow_dispatch_destroy", **dispatch))
    )
    cfn = journey.emulator.client("cloudformation")
    data_ids = {
        r["PhysicalResourceId"]
        for r in cfn.list_stack_resources(StackName=f"{HAND_ENV}-DataStack")["StackResourceSummaries"]
        if r.get("PhysicalResourceId")
    }
    destroy = {"inputs": {"env": HAND_ENV, "keep_data": "true"}}
    print(
        " ", act(journey, "destroy.yml", "workflow_dispatch", payload(journey, "workflow_dispatch_destroy", **destroy))
    )
    remaining = env_resources(journey, HAND_ENV)
    assert remaining["stacks"] == [f"{HAND_ENV}-DataStack"], remaining["stacks"]
    others = {k: v for k, v in remaining.items() if k != "stacks"}
    stray = [x for v in others.values() for x in v if x not in data_ids and not x.startswith(f"{HAND_ENV}-datastack")]
    assert not stray, f"left besides the data stack's resources: {stray}"
    assert remaining["volumes"] and remaining["buckets"], remaining
    journey.verified(f"kept only {HAND_ENV}-DataStack: {left(remaining)}")
