"""``python -m infra`` against the synthesized stacks deployed into moto (in-process; nothing leaves the machine).

Each README journey command is run here: push-image, launch, submit, status, logs, stop, teardown, cost.
What moto cannot show is said where it matters: it ignores spot options set only in a launch template (the
instance comes back on-demand; the test checks the template's spot options instead) and it does not run
Step Functions definitions against SageMaker (the execution and its input are checked instead).
"""

from __future__ import annotations

import json
import stat
import sys
import time

import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from infra.cli.main import main
from tests import moto_env
from tests.infra_helpers import REPO as REPO_ROOT

E = ["--env", moto_env.ENV]


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    return moto_env.synthesize(tmp_path_factory.mktemp("cdk-moto"))


@pytest.fixture
def aws(templates, monkeypatch):
    with moto_env.deployed(templates, monkeypatch) as session:
        yield session


def _outputs(aws, stack: str) -> dict:
    st = aws.client("cloudformation").describe_stacks(StackName=f"{moto_env.ENV}-{stack}")["Stacks"][0]
    return {o["OutputKey"]: o["OutputValue"] for o in st["Outputs"]}


def _push_fake_image(aws, tag: str) -> str:
    return moto_env.put_image(aws, tag)


def _instances(aws) -> list[dict]:
    res = aws.client("ec2").describe_instances(Filters=[{"Name": "tag:trainstack:env", "Values": [moto_env.ENV]}])
    return [i for r in res["Reservations"] for i in r["Instances"]]


def test_status_and_cost_of_an_empty_environment(aws, capsys):
    assert main(E + ["status"]) == 0
    out = capsys.readouterr().out
    assert out.count("(none)") == 4  # instances, ec2 jobs, executions, SageMaker jobs
    assert main(E + ["cost"]) == 0
    assert "total so far: $0.00" in capsys.readouterr().out


def test_launch_uses_the_stacks_spot_template_and_tags_the_job(aws, capsys):
    digest = _push_fake_image(aws, "abc123")
    assert main(E + ["launch", "g5.2xlarge", "--job", "resnet-a", "--image-tag", "abc123", "--args", "--epochs 5"]) == 0
    assert "launched i-" in capsys.readouterr().out
    (inst,) = _instances(aws)
    assert main(E + ["status", inst["InstanceId"]]) == 0
    assert json.loads(capsys.readouterr().out)["job"] == "resnet-a"
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags["trainstack:job"] == "resnet-a" and tags["trainstack:image-tag"] == "abc123"
    assert tags["trainstack:image-digest"] == digest  # the user data runs the image by this digest
    assert tags["trainstack:args"] == "--epochs 5" and tags["trainstack:config"] == "configs/p4d_resnet50.yaml"
    assert inst["InstanceType"] == "g5.2xlarge"
    lt_id = _outputs(aws, "TrainingStack")["LaunchTemplateIdg52xlarge"]
    data = aws.client("ec2").describe_launch_template_versions(LaunchTemplateId=lt_id)["LaunchTemplateVersions"][0][
        "LaunchTemplateData"
    ]
    # moto ignores these options when it runs the instance; the template itself says spot:
    assert data["InstanceMarketOptions"]["MarketType"] == "spot"
    assert data["MetadataOptions"]["HttpTokens"] == "required"


def test_launch_and_submit_default_to_this_checkouts_image_pinned_by_digest(aws, capsys):
    """No ``latest``: without --image-tag, launch and submit run the image of this checkout's commit (the tag
    push-image gives it, immutable in the repository); launch pins its digest on the instance, submit records
    it in the execution input. A tag that was never pushed is one clear line, exit 2."""
    from infra.cli.image import git_tag
    from tests.infra_helpers import REPO

    tag = git_tag(REPO)
    digest = aws.client("ecr").describe_images(repositoryName="trainstack-test", imageIds=[{"imageTag": tag}])[
        "imageDetails"
    ][0]["imageDigest"]
    assert main(E + ["launch", "g5.2xlarge", "--job", "j"]) == 0
    (inst,) = _instances(aws)
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert (tags["trainstack:image-tag"], tags["trainstack:image-digest"]) == (tag, digest)
    assert main(E + ["submit", "--run-name", "r1"]) == 0
    arn = capsys.readouterr().out.split("started ")[1].strip()
    payload = json.loads(aws.client("stepfunctions").describe_execution(executionArn=arn)["input"])
    assert (payload["image_tag"], payload["image_digest"]) == (tag, digest)
    assert main(E + ["launch", "g5.2xlarge", "--job", "k", "--image-tag", "latest"]) == 2
    err = capsys.readouterr().err
    assert "push-image" in err and len(err.strip().splitlines()) == 1 and len(_instances(aws)) == 1


def test_launch_errors_name_the_type_and_what_exists(aws, capsys):
    assert main(E + ["launch", "g5.4xlarge", "--job", "x"]) == 2
    err = capsys.readouterr().err
    assert "no launch template for g5.4xlarge" in err and "g5.2xlarge" in err and "launch_template_types" in err
    assert main(E + ["launch", "g5.3xlarge", "--job", "x"]) == 2
    assert "unknown instance type 'g5.3xlarge'" in capsys.readouterr().err
    assert main(E + ["launch", "g5.2xlarge", "--job", "bad name!"]) == 2


def _capacity_failing_client(aws, fail_versions=("$Default",)):
    real = aws.client("ec2")

    class Ec2:
        def __getattr__(self, name):
            return getattr(real, name)

        def run_instances(self, **kw):
            if kw["LaunchTemplate"]["Version"] in fail_versions:
                raise ClientError(
                    {
                        "Error": {
                            "Code": "InsufficientInstanceCapacity",
                            "Message": "We currently do not have sufficient capacity",
                        }
                    },
                    "RunInstances",
                )
            return real.run_instances(**kw)

    return Ec2()


def test_spot_capacity_error_suggests_fallback_and_fallback_launches_on_demand(aws, capsys, monkeypatch):
    from infra.cli import instances

    client = _capacity_failing_client(aws)
    real_launch = instances.launch
    monkeypatch.setattr(instances, "launch", lambda *a, **k: real_launch(*a, **{**k, "ec2": client}))
    assert main(E + ["launch", "p4d.24xlarge", "--job", "big"]) == 75
    err = capsys.readouterr().err
    assert "InsufficientInstanceCapacity" in err and "--on-demand-fallback" in err
    assert main(E + ["launch", "p4d.24xlarge", "--job", "big", "--on-demand-fallback"]) == 0
    assert "on-demand, launch template version 2" in capsys.readouterr().out
    lt_id = _outputs(aws, "TrainingStack")["LaunchTemplateIdp4d24xlarge"]
    versions = {
        v["VersionNumber"]: v
        for v in aws.client("ec2").describe_launch_template_versions(LaunchTemplateId=lt_id)["LaunchTemplateVersions"]
    }
    assert "InstanceMarketOptions" in versions[1]["LaunchTemplateData"]
    assert "InstanceMarketOptions" not in versions[2]["LaunchTemplateData"]
    assert versions[2]["LaunchTemplateData"]["InstanceType"] == "p4d.24xlarge"
    assert main(E + ["stop", "big"]) == 0  # one job per environment
    assert main(E + ["launch", "p4d.24xlarge", "--job", "big2", "--on-demand-fallback"]) == 0  # reuses v2
    assert (
        len(aws.client("ec2").describe_launch_template_versions(LaunchTemplateId=lt_id)["LaunchTemplateVersions"]) == 2
    )


def test_on_demand_fallback_follows_a_redeploy(aws, capsys, monkeypatch):
    """A redeploy makes a new default launch-template version (new AMI, user data, volume id): the fallback's
    spot-free copy is made again from it, never the stale copy of the old default."""
    from infra.cli import instances

    client = _capacity_failing_client(aws)
    real_launch = instances.launch
    monkeypatch.setattr(instances, "launch", lambda *a, **k: real_launch(*a, **{**k, "ec2": client}))
    ec2 = aws.client("ec2")
    lt_id = _outputs(aws, "TrainingStack")["LaunchTemplateIdp4d24xlarge"]
    assert main(E + ["launch", "p4d.24xlarge", "--job", "a", "--on-demand-fallback"]) == 0
    assert "launch template version 2" in capsys.readouterr().out
    assert main(E + ["stop", "a"]) == 0  # one job per environment
    assert main(E + ["launch", "p4d.24xlarge", "--job", "b", "--on-demand-fallback"]) == 0
    assert "launch template version 2" in capsys.readouterr().out  # same default: the copy is reused
    # "cdk deploy" again with another AMI: CloudFormation adds version 3 and makes it the default
    v1 = ec2.describe_launch_template_versions(LaunchTemplateId=lt_id, Versions=["1"])["LaunchTemplateVersions"][0]
    new_ami = moto_env.amazon_ami(ec2, 1)
    assert new_ami != v1["LaunchTemplateData"]["ImageId"]
    ec2.create_launch_template_version(
        LaunchTemplateId=lt_id, SourceVersion="1", LaunchTemplateData={"ImageId": new_ami, "UserData": "bmV3"}
    )
    ec2.modify_launch_template(LaunchTemplateId=lt_id, DefaultVersion="3")
    assert main(E + ["stop", "b"]) == 0
    assert main(E + ["launch", "p4d.24xlarge", "--job", "c", "--on-demand-fallback"]) == 0
    assert "launch template version 4" in capsys.readouterr().out
    v4 = ec2.describe_launch_template_versions(LaunchTemplateId=lt_id, Versions=["4"])["LaunchTemplateVersions"][0]
    assert v4["LaunchTemplateData"]["ImageId"] == new_ami and v4["LaunchTemplateData"]["UserData"] == "bmV3"
    assert "InstanceMarketOptions" not in v4["LaunchTemplateData"] and "from version 3" in v4["VersionDescription"]
    launched = [i for i in _instances(aws) if {"Key": "trainstack:job", "Value": "c"} in i["Tags"]]
    assert launched and launched[0]["ImageId"] == new_ami


def test_launch_refuses_a_type_the_az_does_not_offer(aws, capsys, monkeypatch):
    from infra.cli import instances

    real = aws.client("ec2")

    class Ec2:
        def __getattr__(self, name):
            return getattr(real, name)

        def describe_instance_type_offerings(self, **kw):  # as in an account whose us-east-1a has no p4d
            return {
                "InstanceTypeOfferings": [
                    {"InstanceType": "p4d.24xlarge", "LocationType": "availability-zone", "Location": az}
                    for az in ("us-east-1b", "us-east-1c")
                ]
            }

    real_launch = instances.launch
    monkeypatch.setattr(instances, "launch", lambda *a, **k: real_launch(*a, **{**k, "ec2": Ec2()}))
    assert main(E + ["launch", "p4d.24xlarge", "--job", "big"]) == 2
    err = capsys.readouterr().err
    assert "not offered in us-east-1a" in err and "us-east-1b, us-east-1c" in err and "availability_zone" in err
    assert not _instances(aws)


def test_network_loss_mid_command_is_exit_75_and_says_to_check_status(aws, capsys, monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    from infra.cli import instances

    real = aws.client("ec2")

    class Ec2:
        def __getattr__(self, name):
            return getattr(real, name)

        def run_instances(self, **kw):
            raise EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com/")

    real_launch = instances.launch
    monkeypatch.setattr(instances, "launch", lambda *a, **k: real_launch(*a, **{**k, "ec2": Ec2()}))
    assert main(E + ["launch", "g5.2xlarge", "--job", "j"]) == 75
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "cannot reach https://ec2.us-east-1.amazonaws.com/" in err and "python -m infra status" in err


def test_submit_starts_a_managed_spot_execution_with_the_config_as_hyperparameters(aws, capsys):
    assert main(E + ["submit", "--run-name", "digits-a", "--config", "configs/digits.yaml", "--image-tag", "nope"]) == 2
    assert "push-image" in capsys.readouterr().err  # image 'nope' is missing
    _push_fake_image(aws, "abc123")
    assert (
        main(
            E
            + [
                "submit",
                "--run-name",
                "digits-a",
                "--config",
                "configs/digits.yaml",
                "--image-tag",
                "abc123",
                "--set",
                "epochs=3",
                "--data",
                "s3://bucket/datasets/digits/",
            ]
        )
        == 0
    )
    arn = capsys.readouterr().out.split("started ")[1].strip()
    ex = aws.client("stepfunctions").describe_execution(executionArn=arn)
    assert ":stateMachine:" not in arn and "trainstack-test-train-g5-2xlarge" in arn
    payload = json.loads(ex["input"])
    assert payload["run_name"] == "digits-a" and payload["image_tag"] == "abc123"
    assert payload["hyperparameters"]["epochs"] == "3" and "data_dir" not in payload["hyperparameters"]
    assert payload["data_s3_uri"] == "s3://bucket/datasets/digits/"
    assert main(E + ["status"]) == 0
    assert "digits-a-" in capsys.readouterr().out
    assert main(E + ["status", arn]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert detail["status"] == "RUNNING" and detail["input"]["run_name"] == "digits-a"
    assert main(E + ["stop", arn]) == 0
    assert aws.client("stepfunctions").describe_execution(executionArn=arn)["status"] == "ABORTED"


def test_submit_refuses_two_processes_on_a_one_gpu_type_and_bad_configs(aws, capsys, tmp_path):
    assert main(E + ["submit", "--run-name", "dino", "--machine", "train-g5-2xlarge", "--nproc-per-node", "2"]) == 2
    assert "--nproc-per-node 2 on ml.g5.2xlarge, which has 1 GPU(s)" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_sise: 64\n")
    assert main(E + ["submit", "--run-name", "x", "--config", str(bad)]) == 2
    assert "batch_sise" in capsys.readouterr().err
    assert main(E + ["submit", "--run-name", "x", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(E + ["submit", "--run-name", "x", "--machine", "train-p9"]) == 2
    assert "scaling-plan" in capsys.readouterr().err  # lists what exists
    assert main(E + ["submit", "--run-name", "plan-1", "--machine", "scaling-plan"]) == 0


def test_logs_tail_of_an_instance(aws, capsys):
    logs = aws.client("logs")
    group = _outputs(aws, "MonitoringStack")["TrainLogGroup"]
    logs.create_log_stream(logGroupName=group, logStreamName="i-0123/resnet-a")
    logs.put_log_events(
        logGroupName=group,
        logStreamName="i-0123/resnet-a",
        logEvents=[
            {"timestamp": int(time.time() * 1000) - 5000 + i, "message": f"epoch={i} train_loss=1.{i}"}
            for i in range(5)
        ],
    )
    assert main(E + ["logs", "i-0123", "-n", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"epoch={i} train_loss=1.{i}" for i in (2, 3, 4)]
    assert main(E + ["logs", "someone-elses-job"]) == 2


def test_teardown_removes_what_bills_and_keeps_the_data_volume(aws, capsys):
    ec2 = aws.client("ec2")
    assert main(E + ["launch", "g5.2xlarge", "--job", "j"]) == 0
    stray = ec2.create_volume(
        AvailabilityZone="us-east-1a",
        Size=10,
        TagSpecifications=[{"ResourceType": "volume", "Tags": [{"Key": "trainstack:env", "Value": moto_env.ENV}]}],
    )["VolumeId"]
    other = ec2.create_volume(AvailabilityZone="us-east-1a", Size=10)["VolumeId"]  # not ours
    data_volume = _outputs(aws, "DataStack")["DataVolumeId"]
    capsys.readouterr()
    assert main(E + ["teardown"]) == 0
    plan = capsys.readouterr().out
    assert "would remove" in plan and stray in plan and data_volume not in plan.split("kept:")[0]
    assert _instances(aws)[0]["State"]["Name"] == "running"  # dry run touched nothing
    assert main(E + ["teardown", "--yes"]) == 0
    assert {i["State"]["Name"] for i in _instances(aws)} <= {"shutting-down", "terminated"}
    left = {v["VolumeId"] for v in ec2.describe_volumes()["Volumes"]}
    assert stray not in left and other in left and data_volume in left


def test_teardown_leaves_an_environment_whose_name_extends_this_one_alone(aws, capsys):
    """``test`` and ``test-x``: with the training stack's outputs gone (a rolled-back deploy), teardown finds
    this environment's state machines by name; ``trainstack-test-`` also begins test-x's, whose runs and
    idle alarms must survive ``teardown --yes`` of test."""
    from moto.cloudformation.models import cloudformation_backends

    sfn, cw = aws.client("stepfunctions"), aws.client("cloudwatch")
    role = f"arn:aws:iam::{moto_env.ACCOUNT}:role/other"
    definition = json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}})
    other = sfn.create_state_machine(name="trainstack-test-x-train-g5-2xlarge", definition=definition, roleArn=role)
    other_run = sfn.start_execution(stateMachineArn=other["stateMachineArn"])["executionArn"]
    mine = _outputs(aws, "TrainingStack")["StateMachinescalingplan"]
    my_run = sfn.start_execution(stateMachineArn=mine, input=json.dumps({"run_name": "r"}))["executionArn"]
    alarms = {"trainstack-test-gpu-idle-i-0abc", "trainstack-test-gpu-idle-x-gpu-idle-i-0abc"}
    for name in alarms:
        cw.put_metric_alarm(
            AlarmName=name,
            Namespace="N",
            MetricName="M",
            Statistic="Average",
            Period=60,
            EvaluationPeriods=1,
            Threshold=5,
            ComparisonOperator="LessThanThreshold",
        )
    backend = cloudformation_backends[moto_env.ACCOUNT][moto_env.REGION]
    stack = next(s for s in backend.stacks.values() if s.name == f"{moto_env.ENV}-TrainingStack")
    stack.status, stack.output_map = "ROLLBACK_COMPLETE", {}
    assert main(E + ["teardown", "--yes"]) == 0, capsys.readouterr().err
    assert sfn.describe_execution(executionArn=my_run)["status"] == "ABORTED"
    assert sfn.describe_execution(executionArn=other_run)["status"] == "RUNNING"
    left = {a["AlarmName"] for a in cw.describe_alarms()["MetricAlarms"]}
    assert left == {"trainstack-test-gpu-idle-x-gpu-idle-i-0abc"}


def test_stop_one_instance(aws, capsys):
    assert main(E + ["launch", "g5.2xlarge", "--job", "j"]) == 0
    iid = _instances(aws)[0]["InstanceId"]
    assert main(E + ["stop", iid]) == 0
    assert "stopped" in capsys.readouterr().out  # moto runs it on-demand, so it is stopped, not terminated
    assert main(E + ["stop", "i-notmine"]) == 2


def test_cost_prices_running_instances_from_the_catalog(aws, capsys):
    import catalog

    assert main(E + ["launch", "g5.2xlarge", "--job", "j"]) == 0
    assert "recovery: on" in capsys.readouterr().out  # launch says what recovery will do
    assert main(E + ["cost", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    (row,) = est["rows"]
    assert row["type"] == "g5.2xlarge" and row["usd_per_hour"] == catalog.get("g5.2xlarge").on_demand.usd_per_hour
    assert row["price_source"] == "catalog on-demand" and row["usd"] >= 0


FAKE_DIGEST = "5e" * 32


def _fake_docker(tmp_path):
    """A ``docker`` that records ``[argv, stdin]`` per call in a JSON-lines file and, on ``push``, prints the
    digest line ``docker push`` ends with; returns (binary, file)."""
    calls = tmp_path / "docker-calls.jsonl"
    fake = tmp_path / "docker"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\nstdin = sys.stdin.read() if 'login' in sys.argv else ''\n"
        f"open({str(calls)!r}, 'a').write(json.dumps([sys.argv[1:], stdin]) + '\\n')\n"
        f"if sys.argv[1] == 'push': print('c0ffee: digest: sha256:{FAKE_DIGEST} size: 529')\n"
        "if sys.argv[1] == '--version': print('Docker version 28.2.2, build fake')\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake, calls


def test_push_image_logs_in_builds_tags_with_commit_and_pushes(aws, capsys, tmp_path):
    fake, calls = _fake_docker(tmp_path)
    assert main(E + ["push-image", "--tag", "c0ffee", "--docker", str(fake)]) == 0
    repo = _outputs(aws, "TrainingStack")["RepositoryUri"]
    assert f"pushed {repo}:c0ffee@sha256:{FAKE_DIGEST}" in capsys.readouterr().out  # the digest docker printed
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    logins = [(argv, stdin) for argv, stdin in recorded if argv[0] == "login"]
    assert {argv[-1] for argv, _ in logins} >= {repo.split("/")[0], "763104351884.dkr.ecr.us-east-1.amazonaws.com"}
    assert all(argv[1:4] == ["--username", "AWS", "--password-stdin"] and stdin for argv, stdin in logins)
    build = next(argv for argv, _ in recorded if argv[0] == "build")
    assert f"{repo}:c0ffee" in build and "images/training/Dockerfile" in build
    assert any(a.startswith("BASE_IMAGE=763104351884.dkr.ecr.") for a in build)
    # image-smoke's build arguments (infra/cli/image.py build_args): the Dockerfile's architectures, the labels
    from infra.cli.image import default_archs, vcs_revision

    assert "TORCH_CUDA_ARCH_LIST=8.0;8.6;9.0" in build and default_archs(REPO_ROOT) == "8.0;8.6;9.0"
    assert f"VCS_REF={vcs_revision(REPO_ROOT)}" in build and "MSDA=cuda" in build
    assert [argv for argv, _ in recorded if argv[0] == "push"] == [["push", f"{repo}:c0ffee"]]  # no `latest`
    assert not any(":latest" in a for argv, _ in recorded for a in argv)


def test_push_image_again_for_a_pushed_commit_succeeds_without_pushing(aws, capsys, tmp_path):
    """Re-running the image workflow for a commit whose image is in the repository: the tag is immutable, so
    a second build and push would fail; push-image says it is there and does nothing (exit 0)."""
    fake, calls = _fake_docker(tmp_path)
    _push_fake_image(aws, "c0ffee")
    assert main(E + ["push-image", "--tag", "c0ffee", "--docker", str(fake)]) == 0
    assert "c0ffee (already pushed)" in capsys.readouterr().out
    assert not calls.exists()  # no login, build or push


def test_push_image_logs_in_to_each_registry_with_its_own_regions_token(aws, capsys, tmp_path):
    """An environment in eu-west-1 building FROM the Deep Learning Container registry in us-east-1: an ECR
    token is valid in one region only, so each registry gets a GetAuthorizationToken from its own region.
    Two-region moto session; each region's token is made recognisable (moto's are all alike)."""
    import base64

    import boto3

    from infra.cli import image
    from infra.cli.outputs import Outputs
    from infra.cli.session import Aws

    session = boto3.Session(region_name="eu-west-1")

    def regional_token(parsed, context, **_):
        token = base64.b64encode(f"AWS:token-of-{context['client_region']}".encode()).decode()
        parsed["authorizationData"][0]["authorizationToken"] = token

    session.events.register("after-call.ecr.GetAuthorizationToken", regional_token)
    repo = session.client("ecr").create_repository(repositoryName="trainstack-eu")["repository"]["repositoryUri"]
    outputs = Outputs("eu", "b", "vol-1", "eu-west-1a", repo, "arn:topic", "/trainstack/eu/train")
    fake, calls = _fake_docker(tmp_path)
    pushed = image.push_image(
        Aws(session, "eu-west-1", moto_env.ACCOUNT, "eu"), outputs, REPO_ROOT, "c0ffee", builder=str(fake)
    )
    assert pushed == f"{repo}:c0ffee@sha256:{FAKE_DIGEST}"
    logins = {argv[-1]: stdin for argv, stdin in map(json.loads, calls.read_text().splitlines()) if argv[0] == "login"}
    assert logins == {
        repo.split("/")[0]: "token-of-eu-west-1",
        "763104351884.dkr.ecr.us-east-1.amazonaws.com": "token-of-us-east-1",
    }


def test_clear_errors_no_credentials_no_stack_wrong_region(templates, monkeypatch, capsys):
    moto_env.fake_credentials(monkeypatch)
    with mock_aws():
        assert main(E + ["status"]) == 2  # nothing deployed
        err = capsys.readouterr().err
        assert "test-DataStack does not exist" in err and "cdk deploy TrainingStack -c env=test`" in err
        assert "<env>" not in err and len(err.strip().splitlines()) == 1
        assert main(E + ["teardown", "--yes"]) == 0  # an environment already destroyed: nothing to do, exit 0
        out = capsys.readouterr().out
        assert "no stack of environment test is deployed" in out and "removed 0 instances" in out
    with mock_aws():
        assert main(E + ["--region", "mars-north-1", "status"]) == 2
        assert "unknown AWS region 'mars-north-1'" in capsys.readouterr().err
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no IMDS probe: botocore fails before any request
    assert main(E + ["status"]) == 2
    assert "no AWS credentials found" in capsys.readouterr().err


def test_cli_imports_no_torch():
    import subprocess

    code = "import sys, infra.cli.main, infra.cli.jobs; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
