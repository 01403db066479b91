"""What moto (the pinned version, requirements.txt) still lacks, for each workaround of the e2e tier: the patches in
tests/e2e/emulator_server.py (``patch_moto``, ``_patch_ec2_deletes``, ``seed``) and the CloudFormation handlers of
tests/e2e/cfn_providers.py. Each check reads the unpatched moto of this process (nothing here imports
cfn_providers or patches moto). A check that fails after a moto upgrade says which workaround the new version makes
unnecessary: remove it there (and this check) once the e2e tests pass without it.

Last compared on 2026-12-07: moto 5.2.5 (pinned) and 5.2.6 (PyPI's newest) lack every one of these."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent


def _source(function) -> str:
    return inspect.getsource(function)


def test_change_sets_neither_import_nor_export():
    """``patch_moto``: the change-set path (the CDK CLI's) sees no other stack's exports and builds no outputs."""
    from moto.cloudformation.models import ChangeSet, CloudFormationBackend

    assert "cross_stack_resources" not in _source(CloudFormationBackend.create_change_set)
    applied = _source(CloudFormationBackend.execute_change_set) + _source(ChangeSet.apply)
    assert "output_map" not in applied and "exports" not in applied


def test_a_deleted_stack_keeps_its_outputs():
    from moto.cloudformation.models import Stack

    assert "output_map" not in _source(Stack.delete)


def test_cloudformation_models_drop_properties_the_templates_set():
    """KMS key tags in CloudFormation's shape; bucket versioning and public-access block; ECR scan-on-push shape,
    lifecycle policy and EmptyOnDelete; role managed policies; volume type, IOPS, encryption and tags; a non-empty
    bucket taken as deleted."""
    from moto.ec2.models.elastic_block_store import Volume
    from moto.ecr.models import Repository
    from moto.iam.models import Role
    from moto.kms.models import Key
    from moto.s3.models import FakeBucket

    assert "TagKey" not in _source(Key.create_from_cloudformation_json)
    bucket = _source(FakeBucket.create_from_cloudformation_json)
    assert "VersioningConfiguration" not in bucket and "PublicAccessBlock" not in bucket
    assert "BucketNotEmpty" not in _source(FakeBucket.delete_from_cloudformation_json)
    repository = _source(Repository.create_from_cloudformation_json)
    assert "LifecyclePolicy" not in repository and "scanOnPush" not in repository
    assert "force" not in _source(Repository.delete)
    assert "ManagedPolicyArns" not in _source(Role.create_from_cloudformation_json)
    assert "VolumeType" not in _source(Volume.create_from_cloudformation_json)
    assert "delete" not in Volume.__dict__


def test_ec2_network_models_have_no_delete():
    """``_patch_ec2_deletes``."""
    from moto.ec2.models.flow_logs import FlowLogs
    from moto.ec2.models.internet_gateways import InternetGateway
    from moto.ec2.models.route_tables import Route, RouteTable
    from moto.ec2.models.subnets import SubnetRouteTableAssociation
    from moto.ec2.models.vpcs import VPCEndPoint
    from moto.ec2.models.vpn_gateway import VPCGatewayAttachment

    models = (FlowLogs, InternetGateway, Route, RouteTable, SubnetRouteTableAssociation, VPCEndPoint)
    assert [m.__name__ for m in (*models, VPCGatewayAttachment) if "delete" in m.__dict__] == []


def test_iam_conditions_count_an_absent_key_as_met_and_an_unmet_condition_as_a_deny():
    """IAM: a key absent from the request context does not match, and a statement whose condition does not hold
    does not apply (IAM user guide, "IAM JSON policy elements: Condition operators")."""
    from moto.iam.access_control import IAMPolicyStatement, PermissionResult

    tls_only = {"Effect": "Deny", "Action": "s3:*", "Resource": "*"}
    tls_only["Condition"] = {"Bool": {"aws:SecureTransport": "false"}}
    assert IAMPolicyStatement(tls_only).is_action_permitted("s3:PutObject") == PermissionResult.DENIED
    tagged = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    tagged["Condition"] = {"StringEquals": {"aws:ResourceTag/env": "a"}}
    other = IAMPolicyStatement(tagged).is_action_permitted("s3:PutObject", incoming_condition_values={})
    assert other == PermissionResult.PERMITTED


HANDLED = re.findall(r'return "(AWS::[\w:]+)"', (E2E / "cfn_providers.py").read_text())


@pytest.mark.parametrize("resource_type", HANDLED)
def test_cloudformation_has_no_handler_for_the_types_cfn_providers_adds(resource_type):
    from moto.cloudformation.parsing import resource_class_from_type

    assert resource_class_from_type(resource_type) is None


def test_custom_resources_go_to_the_lambda_backed_model():
    """``route_custom_types``: moto sends Custom::S3AutoDeleteObjects to its CustomModel (runs Lambda in Docker)."""
    from moto.cloudformation.custom_model import CustomModel
    from moto.cloudformation.parsing import resource_class_from_type

    assert len(HANDLED) == 8 and resource_class_from_type("Custom::S3AutoDeleteObjects") is CustomModel


def test_the_dlami_public_parameter_is_not_bundled():
    """``seed``: moto ships some public SSM parameters, not the Deep Learning AMI's."""
    import boto3
    from moto import mock_aws

    from infra.config import DLAMI_SSM_PARAMETER

    with mock_aws():
        ssm = boto3.client("ssm", region_name="us-east-1")
        with pytest.raises(ssm.exceptions.ParameterNotFound):
            ssm.get_parameter(Name=DLAMI_SSM_PARAMETER)
