"""IAM: the CLI's AWS calls checked against the synthesized role policies, so a missing action fails a test.

How (offline): every boto3 call the CLI makes is recorded (``before-parameter-build`` hook) as an IAM action
and, where it matters, the resource ARN it is authorized on; the GitHub deploy role's policy is read from the
synthesized CiStack (tokens resolved for moto's account and region) and evaluated by
``tests.infra_helpers.is_allowed``: Allow statements, wildcard actions and resources. Conditions are not
evaluated (they only narrow an Allow). moto's own IAM enforcement (``INITIAL_NO_AUTH_ACTION_COUNT``) was not
used: moto 5.2 checks actions against resource ``*`` only, so every resource-scoped statement of these policies
would read as a denial. What ``docker`` does against ECR (pull the base image, push layers) is not a boto3
call: those actions are derived from the fake docker's recorded command lines.
"""

from __future__ import annotations

import json

import pytest

from infra.cli import session as cli_session
from infra.cli.main import main
from tests import moto_env
from tests.infra.test_infra_cli import _fake_docker
from tests.infra_helpers import CallRecorder, docker_registry_actions, is_allowed, policy_statements

E = ["--env", moto_env.ENV]
ACCOUNT, REGION = moto_env.ACCOUNT, moto_env.REGION


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    return moto_env.synthesize(tmp_path_factory.mktemp("cdk-iam"), github_repo=moto_env.GITHUB_REPO)


@pytest.fixture(scope="module")
def deploy_role(templates):
    """The resolved statements of the GitHub OIDC deploy role (CiStack)."""
    return policy_statements(templates["CiStack"], "GithubDeployRoleDefaultPolicy", ACCOUNT, REGION)


@pytest.fixture
def aws(templates, monkeypatch):
    with moto_env.deployed(templates, monkeypatch) as session:
        yield session


def _outputs(aws, stack: str) -> dict:
    st = aws.client("cloudformation").describe_stacks(StackName=f"{moto_env.ENV}-{stack}")["Stacks"][0]
    return {o["OutputKey"]: o["OutputValue"] for o in st.get("Outputs", [])}


def _busy_environment(aws) -> tuple[str, str, str]:
    """An instance with its idle alarm, a stray volume and a RUNNING execution; returns (instance, alarm,
    execution ARN)."""
    assert main(E + ["launch", "g5.2xlarge", "--job", "j"]) == 0
    res = aws.client("ec2").describe_instances(Filters=[{"Name": "tag:trainstack:env", "Values": [moto_env.ENV]}])
    iid = res["Reservations"][0]["Instances"][0]["InstanceId"]
    alarm = f"trainstack-{moto_env.ENV}-gpu-idle-{iid}"
    aws.client("cloudwatch").put_metric_alarm(
        AlarmName=alarm,
        Namespace=f"Trainstack/{moto_env.ENV}",
        MetricName="nvidia_smi_utilization_gpu",
        Statistic="Average",
        Period=60,
        EvaluationPeriods=30,
        Threshold=5,
        ComparisonOperator="LessThanThreshold",
        Dimensions=[{"Name": "InstanceId", "Value": iid}],
        AlarmActions=[f"arn:aws:automate:{REGION}:ec2:terminate"],
    )
    aws.client("ec2").create_volume(
        AvailabilityZone=f"{REGION}a",
        Size=10,
        TagSpecifications=[{"ResourceType": "volume", "Tags": [{"Key": "trainstack:env", "Value": moto_env.ENV}]}],
    )
    sm = _outputs(aws, "TrainingStack")["StateMachinescalingplan"]
    ex = aws.client("stepfunctions").start_execution(stateMachineArn=sm, input=json.dumps({"run_name": "r"}))
    return iid, alarm, ex["executionArn"]


def _s3_as_iam(rec: CallRecorder) -> list[tuple[str, str]]:
    """Take the S3 calls out of ``rec`` and return them as (IAM action, resource ARN) for ``denied(extra=...)``:
    ListObjectsV2 is authorized as ``s3:ListBucket`` on the bucket, Get/PutObject on the object (IAM user guide,
    "Actions, resources, and condition keys for Amazon S3")."""
    out, kept = [], []
    for action, params in rec.calls:
        if not action.startswith("s3:"):
            kept.append((action, params))
        elif action == "s3:ListObjectsV2":
            out.append(("s3:ListBucket", f"arn:aws:s3:::{params['Bucket']}"))
        else:
            out.append((action, f"arn:aws:s3:::{params['Bucket']}/{params['Key']}"))
    rec.calls = kept
    return out


def test_evaluator_denies_what_the_policy_lacks(deploy_role):
    """The check can fail: an action or resource outside the policy is denied."""
    execution = f"arn:aws:states:{REGION}:{ACCOUNT}:execution:trainstack-test-scaling-plan:r-1"
    assert is_allowed(deploy_role, "states:StopExecution", execution)
    assert not is_allowed(deploy_role, "states:StopExecution", execution.replace("trainstack-", "other-"))
    assert not is_allowed(deploy_role, "states:DeleteStateMachine", execution)
    without = [s for s in deploy_role if "states:StopExecution" not in json.dumps(s)]
    assert not is_allowed(without, "states:StopExecution", execution)


def test_teardown_runs_with_only_the_deploy_roles_permissions(aws, deploy_role, monkeypatch, capsys):
    """teardown --yes --wait as destroy.yml runs it: the instance holding the data volume is terminated and
    waited for until the volume is detached, all within the deploy role's policy."""
    from infra.cli import instances

    iid, alarm, execution = _busy_environment(aws)
    volume = _outputs(aws, "DataStack")["DataVolumeId"]
    aws.client("ec2").attach_volume(VolumeId=volume, InstanceId=iid, Device="/dev/sdf")
    monkeypatch.setattr(instances, "WAIT_DELAY_S", 0.01)
    rec = CallRecorder()
    rec.install(monkeypatch, cli_session)
    assert main(E + ["teardown", "--yes", "--wait"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "removed 1 executions" in out and "removed 1 alarms" in out and "released:" in out
    ec2 = aws.client("ec2")
    assert ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"] == "terminated"
    assert ec2.describe_volumes(VolumeIds=[volume])["Volumes"][0]["State"] == "available"
    actions = {a for a, _ in rec.calls}
    assert {"states:StopExecution", "ec2:TerminateInstances", "cloudwatch:DeleteAlarms"} <= actions
    assert {"ec2:DescribeInstances", "ec2:DescribeVolumes"} <= actions
    s3_calls = _s3_as_iam(rec)  # the job j marked stopped first (the recovery function relaunches nothing)
    assert {a for a, _ in s3_calls} == {"s3:ListBucket", "s3:GetObject", "s3:PutObject"}
    assert rec.denied(deploy_role, ACCOUNT, REGION, extra=s3_calls) == []
    assert "removed 1 jobs: j" in out
    assert aws.client("stepfunctions").describe_execution(executionArn=execution)["status"] == "ABORTED"
    assert not aws.client("cloudwatch").describe_alarms(AlarmNames=[alarm])["MetricAlarms"]


@pytest.mark.parametrize("broken", ["ROLLBACK_COMPLETE", "UPDATE_ROLLBACK_FAILED", "DELETE_FAILED", "missing"])
def test_teardown_works_on_a_rolled_back_or_half_deleted_environment(aws, deploy_role, monkeypatch, capsys, broken):
    """A training stack whose deploy rolled back has no outputs (or is gone): teardown still stops what bills,
    finding the state machines by name; other commands still refuse the stack."""
    from moto.cloudformation.models import cloudformation_backends

    iid, alarm, execution = _busy_environment(aws)
    backend = cloudformation_backends[ACCOUNT][REGION]
    stack = next(s for s in backend.stacks.values() if s.name == f"{moto_env.ENV}-TrainingStack")
    if broken == "missing":
        del backend.stacks[stack.stack_id]
    else:
        stack.status = broken
        stack.output_map = {}
    assert main(E + ["status"]) == 2
    capsys.readouterr()
    rec = CallRecorder()
    rec.install(monkeypatch, cli_session)
    assert main(E + ["teardown", "--yes"]) == 0, capsys.readouterr().err
    assert "states:ListStateMachines" in {a for a, _ in rec.calls}
    assert rec.denied(deploy_role, ACCOUNT, REGION, extra=_s3_as_iam(rec)) == []
    assert aws.client("stepfunctions").describe_execution(executionArn=execution)["status"] == "ABORTED"
    state = aws.client("ec2").describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] in ("shutting-down", "terminated")
    data_volume = _outputs(aws, "DataStack")["DataVolumeId"]
    assert data_volume in {v["VolumeId"] for v in aws.client("ec2").describe_volumes()["Volumes"]}


def test_push_image_registry_logins_and_pulls_are_allowed(aws, deploy_role, monkeypatch, capsys, tmp_path):
    """push-image's GetAuthorizationToken, docker's pull of the Deep Learning Container base image (account
    763104351884) and its push to this environment's repository: all within the deploy role's policy."""
    fake, calls = _fake_docker(tmp_path)  # the same stand-in as the CLI tests (it answers --version)
    rec = CallRecorder()
    rec.install(monkeypatch, cli_session)
    assert main(E + ["push-image", "--tag", "c0ffee", "--docker", str(fake)]) == 0
    argv = [json.loads(line)[0] for line in calls.read_text().splitlines()]
    docker = docker_registry_actions(argv, ACCOUNT, REGION)
    assert any(r == "arn:aws:ecr:us-east-1:763104351884:repository/pytorch" for _, r in docker)  # the DLC base
    assert any(r.endswith(f":repository/trainstack-{moto_env.ENV}") for _, r in docker)
    assert "ecr:GetAuthorizationToken" in {a for a, _ in rec.calls}
    assert rec.denied(deploy_role, ACCOUNT, REGION, extra=docker) == []


# ------------------------------------------------------------------------------------------------------------------
# The recovery role's RunInstances: what a new template version (the role may make one: the on-demand copy) or an
# override can change is refused, by every statement evaluated with its conditions (tests.infra_helpers.authorized).
LT = {"g5.2xlarge": "lt-g52x", "g5.12xlarge": "lt-g512x", "p4d.24xlarge": "lt-p4d"}
AMI, IMPORTED = "ami-0dlami", "<IMPORT>"  # the template's AMI parameter; subnet and security group are imports


@pytest.fixture(scope="module")
def recovery_role(templates):
    from tests.infra_helpers import resources

    t = templates["TrainingStack"]
    refs = {
        lid: LT[res["Properties"]["LaunchTemplateData"]["InstanceType"]]
        for lid, res in resources(t, "AWS::EC2::LaunchTemplate").items()
    }
    refs.update({p: AMI for p, v in t.get("Parameters", {}).items() if "Image::Id" in v.get("Type", "")})
    assert len(refs) == len(LT) + 1, refs
    return policy_statements(t, "RecoveryRoleDefaultPolicy", ACCOUNT, REGION, refs=refs, unknown=IMPORTED)


def _run_instances(template: str, **change) -> dict[str, dict[str, str]]:
    """The resources IAM authorizes for one RunInstances from launch template ``template`` and the request
    context of each (EC2 user guide, "Example policies for working with the Amazon EC2 API": RunInstances is
    authorized on the instance, its image, subnet, security group, network interface, volumes and spot request,
    and the launch template; the template's own values are marked ec2:IsLaunchTemplateResource). ``change``
    sets what a new version or an override changes: instance_type, image, subnet, security_group, tokens
    (IMDS HttpTokens), encrypted, env_tag, from_template (False: the subnet/SG/AMI came as overrides)."""
    arn = f"arn:aws:ec2:{REGION}:{ACCOUNT}"
    itype = change.get("instance_type", next((t for t, i in LT.items() if i == template), "g5.2xlarge"))
    common = {"ec2:LaunchTemplate": f"{arn}:launch-template/{template}"}
    common["aws:RequestTag/trainstack:env"] = change.get("env_tag", moto_env.ENV)
    named = {"ec2:IsLaunchTemplateResource": "true" if change.get("from_template", True) else "false"}
    return {
        f"{arn}:launch-template/{template}": common,
        f"{arn}:instance/i-new": {
            **common,
            "ec2:InstanceType": itype,
            "ec2:MetadataHttpTokens": change.get("tokens", "required"),
        },
        f"arn:aws:ec2:{REGION}::image/{change.get('image', AMI)}": {**common, **named, "ec2:Owner": "amazon"},
        f"{arn}:subnet/{change.get('subnet', IMPORTED)}": {**common, **named},
        f"{arn}:security-group/{change.get('security_group', IMPORTED)}": {**common, **named},
        f"{arn}:network-interface/*": common,
        f"{arn}:volume/*": {**common, "ec2:Encrypted": change.get("encrypted", "true")},
        f"{arn}:spot-instances-request/*": common,
    }


def _refused(statements, request: dict[str, dict[str, str]]) -> list[str]:
    from tests.infra_helpers import authorized

    return [r for r, ctx in request.items() if not authorized(statements, "ec2:RunInstances", r, ctx)]


def test_recovery_launches_each_template_as_deployed(recovery_role):
    for template in LT.values():
        assert _refused(recovery_role, _run_instances(template)) == [], template


@pytest.mark.parametrize(
    "change, refused",
    [
        ({"instance_type": "p4d.24xlarge"}, "instance/"),  # a new version of the g5 template with another type
        ({"instance_type": "g5.12xlarge"}, "instance/"),  # another type of this environment, wrong template
        ({"image": "ami-0other"}, "image/"),  # another AMI, even Amazon's
        ({"subnet": "subnet-0other"}, "subnet/"),
        ({"security_group": "sg-0open"}, "security-group/"),
        ({"tokens": "optional"}, "instance/"),  # IMDSv1 back on
        ({"encrypted": "false"}, "volume/"),
        ({"env_tag": "prod"}, "instance/"),
        ({"from_template": False}, "subnet/"),  # the template's own subnet, given as an override
    ],
)
def test_recovery_role_refuses_a_launch_a_new_template_version_or_override_changes(recovery_role, change, refused):
    """The recovery role may create launch template versions (the on-demand copy): a version, or an override,
    with another instance type, AMI, subnet, security group, IMDS setting or unencrypted volume is refused by
    IAM. (Before, any type and any subnet, security group or Amazon AMI named by a new version was allowed.)"""
    got = _refused(recovery_role, _run_instances("lt-g52x", **change))
    assert any(refused in r for r in got), got
    assert _refused(recovery_role, _run_instances("lt-other")), "a template of another environment"


def test_status_runs_with_only_the_deploy_roles_permissions(aws, deploy_role, monkeypatch, capsys):
    """deploy.yml's "What runs now" step: `status` now reads the job records and the recovery failure queue's
    depth; every call is within the deploy role's policy."""
    assert main(E + ["launch", "g5.2xlarge", "--job", "j"]) == 0
    url = _outputs(aws, "TrainingStack")["RecoveryFailureQueueUrl"]
    aws.client("sqs").send_message(QueueUrl=url, MessageBody="{}")
    rec = CallRecorder()
    rec.install(monkeypatch, cli_session)
    capsys.readouterr()
    assert main(E + ["status"]) == 0, capsys.readouterr().err
    assert "1 event(s)" in capsys.readouterr().out
    assert "sqs:GetQueueAttributes" in {a for a, _ in rec.calls}
    s3_calls = _s3_as_iam(rec)
    assert {a for a, _ in s3_calls} == {"s3:ListBucket", "s3:GetObject"}
    assert rec.denied(deploy_role, ACCOUNT, REGION, extra=s3_calls) == []
