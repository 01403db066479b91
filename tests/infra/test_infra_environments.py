"""Environment lifecycle and network, from the synthesized templates: what ``cdk destroy`` leaves behind, that an
environment can be deployed again under the same name, EFA's self-referencing egress, and the decisions of
infra review item 9 (vendedlogs log groups, Lustre 2.15, immutable commit tags).

moto cannot show these: its CloudFormation cannot deploy the buckets' auto-delete custom resource (its code is
a CDK asset in the bootstrap bucket) and deletes the data stack's VPC before its dependencies
(DependencyViolation), so the rules are checked on the templates CloudFormation would get.
"""

from __future__ import annotations

import pytest
import yaml

from tests.infra_helpers import REPO, resources, synth

PR = {"env": "pr-7", "ephemeral": "true", "fsx": "PERSISTENT_2"}
#: Properties that fix a resource's physical name: a retained resource holding one blocks a re-deploy.
NAME_PROPERTIES = ("BucketName", "FileSystemName", "RepositoryName", "LogGroupName", "VolumeName", "TopicName")


@pytest.fixture(scope="module")
def pr_env(tmp_path_factory):
    return synth(PR, tmp_path_factory.mktemp("cdk-pr"))[2]


@pytest.fixture(scope="module")
def default_env(tmp_path_factory):
    return synth({"env": "dev", "fsx": "SCRATCH_2"}, tmp_path_factory.mktemp("cdk-dev"))[2]


def _left_behind(templates: dict) -> dict[str, str]:
    """Logical id -> DeletionPolicy of every resource ``cdk destroy`` does not delete."""
    return {
        f"{cid}/{lid}": r["DeletionPolicy"]
        for cid, t in templates.items()
        for lid, r in t["Resources"].items()
        if r.get("DeletionPolicy") in ("Retain", "Snapshot", "RetainExceptOnCreate")
    }


def test_pr_environment_destroy_leaves_nothing_behind(pr_env, tmp_path):
    """A closed pull request's `cdk destroy DataStack` leaves no bucket and no 400 GiB volume snapshot (one per
    closed PR, that nothing deleted); -c data_volume_removal still chooses, and long-lived environments keep
    their snapshot (test_default_environment_retains_buckets_and_snapshots_the_volume)."""
    left = _left_behind(pr_env)
    assert left == {}, left
    (vol,) = resources(pr_env["DataStack"], "AWS::EC2::Volume").values()
    assert vol["DeletionPolicy"] == "Delete"
    kept = synth({**PR, "data_volume_removal": "snapshot"}, tmp_path)[2]
    assert list(_left_behind(kept).values()) == ["Snapshot"]
    buckets = resources(pr_env["DataStack"], "AWS::S3::Bucket")
    assert len(buckets) == 2 and all(b["DeletionPolicy"] == "Delete" for b in buckets.values())
    auto_delete = resources(pr_env["DataStack"], "Custom::S3AutoDeleteObjects")
    assert len(auto_delete) == 2  # versioned buckets are emptied (all versions) before CloudFormation deletes them
    (fs,) = resources(pr_env["DataStack"], "AWS::FSx::FileSystem").values()
    assert fs["DeletionPolicy"] == "Delete"  # a retained file system keeps its subnet and SG: the VPC would stay


def test_scratch2_data_repository_association_is_documented_for_lustre_215():
    """The deploy-free half of the SCRATCH_2 decision: botocore's FSx service model (the API reference) says
    DRAs are supported on Lustre 2.12 and 2.15 except SCRATCH_1, and that ImportPath cannot be combined with
    one. If AWS changes either sentence, this fails and the decision in DataStack._fsx must be looked at."""
    import re

    import botocore.session

    def text(html: str) -> str:
        return " ".join(re.sub(r"<[^>]+>", "", html).split())

    model = botocore.session.get_session().get_service_model("fsx")
    dra = text(model.operation_model("CreateDataRepositoryAssociation").documentation)
    assert "supported on all FSx for Lustre 2.12 and 2.15 file systems, excluding scratch_1" in dra
    import_path = text(model.shape_for("CreateFileSystemLustreConfiguration").members["ImportPath"].documentation)
    assert "not supported for file systems with a data repository association" in import_path


def test_default_environment_retains_buckets_and_snapshots_the_volume(default_env):
    left = _left_behind(default_env)
    kinds = sorted(default_env[k.split("/")[0]]["Resources"][k.split("/")[1]]["Type"] for k in left)
    assert kinds == ["AWS::EC2::Volume", "AWS::S3::Bucket", "AWS::S3::Bucket"], left


@pytest.mark.parametrize("which", ["pr_env", "default_env"])
def test_nothing_retained_has_a_fixed_name(which, request):
    """The same environment name can be deployed again after a destroy: nothing that survives it holds a
    physical name the new stacks would ask for (a retained ``trainstack-NAME-...`` bucket did)."""
    templates = request.getfixturevalue(which)
    for cid, t in templates.items():
        for lid, r in t["Resources"].items():
            if r.get("DeletionPolicy") in ("Retain", "Snapshot", "RetainExceptOnCreate"):
                named = [p for p in NAME_PROPERTIES if p in r.get("Properties", {})]
                assert not named, (cid, lid, named)


def test_destroy_workflow_removes_a_closed_prs_data_unless_labelled_keep_data():
    wf = yaml.safe_load((REPO / ".github/workflows/destroy.yml").read_text())
    steps = wf["jobs"]["destroy"]["steps"]
    data = next(s for s in steps if "cdk destroy DataStack" in s.get("run", ""))
    cond = data["if"]
    assert "github.event_name == 'pull_request'" in cond and "'keep-data'" in cond and "!inputs.keep_data" in cond
    assert wf[True]["workflow_dispatch"]["inputs"]["keep_data"]["default"] is True  # by hand: data kept by default
    names = [s.get("run", "") for s in steps]
    assert names.index(data["run"]) > next(i for i, r in enumerate(names) if "TrainingStack MonitoringStack" in r)
    deploy = yaml.safe_load((REPO / ".github/workflows/deploy.yml").read_text())
    step = next(s for s in deploy["jobs"]["deploy"]["steps"] if "cdk deploy" in s.get("run", ""))
    assert (
        '-c ephemeral="$EPHEMERAL"' in step["run"]
        and step["env"]["EPHEMERAL"] == "${{ github.event_name == 'pull_request' }}"
    )


def test_efa_security_group_keeps_its_self_referencing_egress(default_env):
    data = default_env["DataStack"]
    sg_id = next(k for k in resources(data, "AWS::EC2::SecurityGroup") if k.startswith("InstanceSg"))
    sg = data["Resources"][sg_id]["Properties"]
    inline = sg.get("SecurityGroupEgress", [])
    assert not any(r.get("CidrIp") == "0.0.0.0/0" and r.get("IpProtocol") == "-1" for r in inline)
    egress = [
        r["Properties"]
        for r in resources(data, "AWS::EC2::SecurityGroupEgress").values()
        if r["Properties"]["GroupId"] == {"Fn::GetAtt": [sg_id, "GroupId"]}
    ]
    assert any(
        e["IpProtocol"] == "-1" and e.get("DestinationSecurityGroupId") == {"Fn::GetAtt": [sg_id, "GroupId"]}
        for e in egress
    ), egress
    assert {(r.get("FromPort"), r.get("CidrIp")) for r in inline} >= {(443, "0.0.0.0/0"), (80, "0.0.0.0/0")}


def test_review_decisions_in_the_templates(default_env):
    """State-machine log groups under /aws/vendedlogs/ (no account log resource policy to outgrow; the other log
    group is the recovery function's, /aws/lambda/<name>, where Lambda writes), SCRATCH_2
    pinned to Lustre 2.15 and linked through a data repository association, every image tag immutable (no
    moving ``latest``: a restarted job runs the image it started with)."""
    training = default_env["TrainingStack"]
    names = [lg["Properties"].get("LogGroupName") for lg in resources(training, "AWS::Logs::LogGroup").values()]
    states = [n for n in names if n != "/aws/lambda/trainstack-dev-recovery"]  # the recovery function's own
    assert len(states) == len(names) - 1, names
    assert states and all(n.startswith("/aws/vendedlogs/states/trainstack-dev-") for n in states), names
    (fs,) = resources(default_env["DataStack"], "AWS::FSx::FileSystem").values()
    assert fs["Properties"]["LustreConfiguration"]["DeploymentType"] == "SCRATCH_2"
    assert fs["Properties"]["FileSystemTypeVersion"] == "2.15"
    assert not {"ImportPath", "ExportPath", "AutoImportPolicy"} & set(fs["Properties"]["LustreConfiguration"])
    (dra,) = resources(default_env["DataStack"], "AWS::FSx::DataRepositoryAssociation").values()
    assert dra["Properties"]["S3"]["AutoExportPolicy"]["Events"] == ["NEW", "CHANGED", "DELETED"]
    (repo,) = resources(training, "AWS::ECR::Repository").values()
    assert repo["Properties"]["ImageTagMutability"] == "IMMUTABLE"
    assert "ImageTagMutabilityExclusionFilters" not in repo["Properties"]
