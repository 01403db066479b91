"""moto's server on 127.0.0.1 with what AWS itself provides to every account seeded first.

``python -m tests.e2e.emulator_server --port P`` runs ``moto.server.main`` (the same Flask server as the
``moto_server`` command) in this process after putting into moto's in-process backends what a real account finds
there without creating it:

- the Deep Learning AMI's SSM public parameter (``infra.config.DLAMI_SSM_PARAMETER``), whose value is an
  Amazon-owned Ubuntu image from moto's own AMI list (``ec2.describe_images(Owners=["amazon"])``): moto's
  ``put_parameter`` refuses names under ``/aws/`` (reserved, as in AWS), and moto ships only some public
  parameters (``ParameterDict._check_loading_status`` in ``moto/ssm/models.py``), not this one;
- the default VPC and its subnets: moto creates them itself for each region on first use (nothing to seed).

Nothing else is created here: the bootstrap stack, the stacks and every resource come from the CDK CLI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

ACCOUNT = "123456789012"  # moto's default account
REGIONS = ("us-east-1",)


def dlami_image_id(region: str) -> str:
    """The image the DLAMI parameter points to: moto's own "Deep Learning AMI Ubuntu Linux" x86_64 image
    (owner 898082745236, the DLAMI's publisher; moto's list has no Ubuntu 22.04 DLAMI).

    Raises:
        LookupError: moto's image list has no such image (another moto version).
    """
    from moto.ec2.models import ec2_backends

    images = [
        a
        for a in ec2_backends[ACCOUNT][region].amis.values()
        if (a.name or "").startswith("Deep Learning AMI Ubuntu") and a.architecture == "x86_64"
    ]
    if not images:
        raise LookupError(f"moto has no 'Deep Learning AMI Ubuntu' x86_64 image in {region}")
    return sorted(images, key=lambda a: a.id)[0].id


def seed(regions=REGIONS) -> dict[str, str]:
    """Put the DLAMI public parameter into moto's SSM backend of each region; returns region -> image id."""
    from moto.ssm.models import Parameter, ParameterDict, ssm_backends

    from infra.config import DLAMI_SSM_PARAMETER

    seeded = {}
    for region in regions:
        image = dlami_image_id(region)
        params = ssm_backends[ACCOUNT][region]._parameters
        # defaultdict.__getitem__, as ParameterDict._load_latest_amis does: the subclass's own lookup would
        # try to load moto's bundled public parameters for the name first
        super(ParameterDict, params).__getitem__(DLAMI_SSM_PARAMETER).append(
            Parameter(
                account_id=ACCOUNT,
                name=DLAMI_SSM_PARAMETER,
                value=image,
                parameter_type="String",
                description=None,
                allowed_pattern=None,
                keyid=None,
                last_modified_date=datetime.datetime.now(datetime.UTC),
                version=1,
                data_type="aws:ec2:image",
            )
        )
        seeded[region] = image
    return seeded


def patch_moto() -> None:
    """Work around moto's CloudFormation change-set path, which the CDK CLI always takes (CreateChangeSet then
    ExecuteChangeSet; moto's CreateStack path is right). In moto 5.2.5:

    - ``CloudFormationBackend.create_change_set`` makes the new stack without ``cross_stack_resources``, so
      ``Fn::ImportValue`` of another stack's export fails ("No export named ... found");
    - ``CloudFormationBackend.execute_change_set`` applies the template but never rebuilds the stack's
      ``output_map`` nor registers its exports, so the stack has no outputs and no exports.

    The patched functions do what ``create_stack`` / ``Stack.update`` do on the direct path; nothing is dropped.
    """
    from moto.cloudformation.models import CloudFormationBackend

    from tests.e2e import cfn_providers  # registers the handlers moto's CloudFormation lacks

    cfn_providers.route_custom_types()

    create_change_set = CloudFormationBackend.create_change_set
    execute_change_set = CloudFormationBackend.execute_change_set

    def create_change_set_with_imports(self, *args, **kwargs):
        change_set_id, stack_id = create_change_set(self, *args, **kwargs)
        stack = self.stacks[stack_id]
        stack.cross_stack_resources = self.exports
        stack.resource_map.cross_stack_resources = self.exports
        return change_set_id, stack_id

    def execute_change_set_with_outputs(self, change_set_name, stack_name=None):
        change_set = self.change_sets.get(change_set_name) or next(
            (c for c in self.change_sets.values() if c.change_set_name == change_set_name), None
        )
        stack = change_set.stack if change_set is not None else None
        if stack is not None:
            stack.cross_stack_resources = self.exports
            stack.resource_map.cross_stack_resources = self.exports
        execute_change_set(self, change_set_name, stack_name)
        if stack is None:
            return
        stack._parse_template()
        stack.description = stack.template_dict.get("Description")
        for name in [n for n, e in self.exports.items() if e.exporting_stack_id == stack.stack_id]:
            del self.exports[name]
        stack.output_map = stack._create_output_map()
        self._validate_export_uniqueness(stack)
        for export in stack.exports:
            self.exports[export.name] = export

    # moto's ``Stack.delete`` deletes the resources but keeps the stack's ``output_map`` and the resource map's
    # template; a later DescribeStacks or ListStackResources of the deleted stack (the CLI reads both) evaluates
    # them, and ``ResourceMap.__getitem__`` then creates the resources anew: a destroyed data stack left a second
    # bucket, volume and VPC. A deleted stack keeps neither.
    from moto.cloudformation.models import Stack

    class NoOutputs(dict):
        exports: list = []

    stack_delete = Stack.delete

    def delete_without_outputs(self):
        stack_delete(self)
        self.output_map = NoOutputs()
        self.resource_map._resource_json_map = {}

    Stack.delete = delete_without_outputs

    CloudFormationBackend.create_change_set = create_change_set_with_imports
    CloudFormationBackend.execute_change_set = execute_change_set_with_outputs

    # moto's ``Key.create_from_cloudformation_json`` (moto/kms/models.py) passes CloudFormation's tags
    # ({"Key", "Value"}) to ``KmsBackend.create_key``, whose tagger wants {"TagKey", "TagValue"} (KeyError), and
    # the key policy as the template's JSON object where KMS takes a string.
    from moto.kms.models import Key

    create_key = Key.create_from_cloudformation_json.__func__

    def create_key_with_cfn_tags(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs):
        props = dict(cloudformation_json["Properties"])
        props["Tags"] = [{"TagKey": t["Key"], "TagValue": t["Value"]} for t in props.get("Tags", [])]
        if not isinstance(props.get("KeyPolicy"), str):
            props["KeyPolicy"] = json.dumps(props.get("KeyPolicy"))
        return create_key(
            cls, resource_name, {**cloudformation_json, "Properties": props}, account_id, region_name, **kwargs
        )

    Key.create_from_cloudformation_json = classmethod(create_key_with_cfn_tags)

    # moto's ``IAMPolicyStatement._check_conditions`` (moto/iam/access_control.py) counts a condition whose key the
    # request does not carry as met, and ``is_action_permitted`` answers DENIED when conditions are not met. IAM
    # does the opposite on both: a key absent from the request context does not match (IAM user guide, "IAM JSON
    # policy elements: Condition operators"; ...IfExists and Null excepted), and a statement whose condition does
    # not hold does not apply. moto's S3 bucket-policy check passes no request context at all (its
    # ``put_bucket_policy`` docstring: "Conditions are not taken into account"), so the CDK bootstrap bucket's
    # "Deny s3:* when aws:SecureTransport is false" denied every asset upload.
    from moto.iam.access_control import IAMPolicyStatement, PermissionResult
    from moto.iam.policy_conditions import TrustRelationShipConditions

    check_conditions = IAMPolicyStatement._check_conditions
    is_action_permitted = IAMPolicyStatement.is_action_permitted

    def check_conditions_absent_keys(self, incoming_condition_values):
        given = incoming_condition_values or {}
        for condition in TrustRelationShipConditions(self._statement.get("Condition") or {}):
            operator = str(getattr(condition, "_condition", ""))
            if operator.endswith("IfExists") or operator == "Null":
                continue
            if any(key not in given for key in condition.context_keys):
                return False
        return check_conditions(self, incoming_condition_values)

    def is_action_permitted_neutral(self, action, resource="*", principal=None, incoming_condition_values=None):
        if not self._check_conditions(incoming_condition_values):
            return PermissionResult.NEUTRAL
        return is_action_permitted(self, action, resource, principal, incoming_condition_values)

    # moto's ``FakeBucket.create_from_cloudformation_json`` (moto/s3/models.py) applies the encryption and tags of
    # an AWS::S3::Bucket but not its VersioningConfiguration or PublicAccessBlockConfiguration; the same backend
    # calls as PutBucketVersioning and PutPublicAccessBlock apply them.
    from moto.s3.models import FakeBucket, s3_backends

    create_bucket = FakeBucket.create_from_cloudformation_json.__func__

    def create_bucket_complete(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs):
        bucket = create_bucket(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs)
        props, backend = cloudformation_json.get("Properties", {}), s3_backends[account_id]["aws"]
        if "VersioningConfiguration" in props:
            backend.put_bucket_versioning(bucket.name, props["VersioningConfiguration"]["Status"])
        if "PublicAccessBlockConfiguration" in props:
            backend.put_public_access_block(bucket.name, props["PublicAccessBlockConfiguration"])
        return bucket

    FakeBucket.create_from_cloudformation_json = classmethod(create_bucket_complete)

    # ``S3Backend.delete_bucket`` returns None for a bucket that still has objects, and moto's
    # ``FakeBucket.delete_from_cloudformation_json`` takes that as deleted; it also deletes a stack's resources in
    # no dependency order. So an ephemeral bucket was "deleted" before its Custom::S3AutoDeleteObjects emptied it
    # and stayed. DeleteBucket's BucketNotEmpty instead: moto's deletion loop retries it after the custom resource.
    from moto.s3.exceptions import BucketNotEmpty

    def delete_bucket_or_refuse(cls, resource_name, cloudformation_json, account_id, region_name):
        backend = s3_backends[account_id]["aws"]
        if resource_name in backend.buckets and backend.delete_bucket(resource_name) is None:
            raise BucketNotEmpty(resource_name)

    FakeBucket.delete_from_cloudformation_json = classmethod(delete_bucket_or_refuse)

    # moto's ``Repository.create_from_cloudformation_json`` (moto/ecr/models.py) stores CloudFormation's
    # ImageScanningConfiguration ({"ScanOnPush": ...}) where the API's shape ({"scanOnPush": ...}) is expected,
    # and ignores LifecyclePolicy (applied here as PutLifecyclePolicy does)...
    from moto.ecr.models import Repository, ecr_backends

    create_repository = Repository.create_from_cloudformation_json.__func__

    def create_repository_api_shape(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs):
        props = dict(cloudformation_json.get("Properties", {}))
        if "ImageScanningConfiguration" in props:
            props["ImageScanningConfiguration"] = {"scanOnPush": props["ImageScanningConfiguration"].get("ScanOnPush")}
        repository = create_repository(
            cls, resource_name, {**cloudformation_json, "Properties": props}, account_id, region_name, **kwargs
        )
        text = props.get("LifecyclePolicy", {}).get("LifecyclePolicyText")
        if text:
            ecr_backends[account_id][region_name].put_lifecycle_policy(account_id, repository.name, text)
        return repository

    Repository.create_from_cloudformation_json = classmethod(create_repository_api_shape)

    # ... and ``Repository.delete`` ignores EmptyOnDelete: DeleteRepository with force, as CloudFormation does.
    def delete_repository(self, account_id, region_name):
        ecr_backends[account_id][region_name].delete_repository(self.name, force=True)

    Repository.delete = delete_repository

    # moto's ``Role.create_from_cloudformation_json`` (moto/iam/models.py) creates the role and its inline
    # Policies but never attaches ManagedPolicyArns; AttachRolePolicy's backend call does (the AWS-managed
    # policies exist: the server runs with MOTO_IAM_LOAD_MANAGED_POLICIES=true).
    from moto.iam.models import Role, iam_backends
    from moto.utilities.utils import get_partition

    create_role = Role.create_from_cloudformation_json.__func__

    def create_role_attached(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs):
        role = create_role(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs)
        backend = iam_backends[account_id][get_partition(region_name)]
        for arn in cloudformation_json.get("Properties", {}).get("ManagedPolicyArns", []):
            backend.attach_role_policy(arn, role.name)
        return role

    Role.create_from_cloudformation_json = classmethod(create_role_attached)
    delete_role = Role.delete_from_cloudformation_json.__func__

    def delete_role_detached(cls, resource_name, cloudformation_json, account_id, region_name):
        # CloudFormation detaches what it attached before DeleteRole (which refuses a role with policies attached)
        backend = iam_backends[account_id][get_partition(region_name)]
        for role in [r for r in backend.roles.values() if r.name == resource_name]:
            for arn in list(role.managed_policies):
                backend.detach_role_policy(arn, role.name)
        delete_role(cls, resource_name, cloudformation_json, account_id, region_name)

    Role.delete_from_cloudformation_json = classmethod(delete_role_detached)

    # moto's ``Volume.create_from_cloudformation_json`` (moto/ec2/models/elastic_block_store.py) passes only Size
    # and AvailabilityZone to ``create_volume``: a gp3 volume at 16,000 IOPS came out gp2, unencrypted, untagged.
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.elastic_block_store import Volume

    def create_volume_complete(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs):
        props = cloudformation_json["Properties"]
        backend = ec2_backends[account_id][region_name]
        volume = backend.create_volume(
            size=props.get("Size"),
            zone_name=props.get("AvailabilityZone"),
            snapshot_id=props.get("SnapshotId"),
            encrypted=bool(props.get("Encrypted", False)),
            kms_key_id=props.get("KmsKeyId"),
            volume_type=props.get("VolumeType"),
            iops=props.get("Iops"),
            throughput=props.get("Throughput"),
            multi_attach_enabled=props.get("MultiAttachEnabled"),
        )
        tags = {t["Key"]: t["Value"] for t in props.get("Tags", [])}
        if tags:
            backend.create_tags([volume.id], tags)
        return volume

    Volume.create_from_cloudformation_json = classmethod(create_volume_complete)
    # ... and it has no delete: a destroyed stack left its volume (DeleteVolume's backend call; DeletionPolicy
    # Snapshot is not emulated, the volume is deleted without one)
    Volume.delete = lambda self, account_id, region_name: ec2_backends[account_id][region_name].delete_volume(self.id)

    _patch_ec2_deletes()

    IAMPolicyStatement._check_conditions = check_conditions_absent_keys
    IAMPolicyStatement.is_action_permitted = is_action_permitted_neutral


def _patch_ec2_deletes() -> None:
    """moto's CloudFormation models of these EC2 types have no ``delete`` (moto/ec2/models: ``FlowLogs``,
    ``VPCEndPoint``, ``VPCGatewayAttachment``, ``InternetGateway``, ``RouteTable``, ``Route``,
    ``SubnetRouteTableAssociation``), so a stack deletion left them behind and then failed on the VPC ("has
    dependencies"). Each gets the backend call its Delete/Detach/Disassociate API makes."""
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.flow_logs import FlowLogs
    from moto.ec2.models.internet_gateways import InternetGateway
    from moto.ec2.models.route_tables import Route, RouteTable
    from moto.ec2.models.subnets import SubnetRouteTableAssociation
    from moto.ec2.models.vpcs import VPCEndPoint
    from moto.ec2.models.vpn_gateway import VPCGatewayAttachment

    def backend(account_id, region_name):
        return ec2_backends[account_id][region_name]

    def disassociate(self, account_id, region_name):
        ec2 = backend(account_id, region_name)
        table = ec2.get_route_table(self.route_table_id)
        for association_id, subnet_id in list(table.associations.items()):
            if subnet_id == self.subnet_id:
                ec2.disassociate_route_table(association_id)

    def idempotent(delete):
        """What went with its parent (a route with its table) is deleted: CloudFormation succeeds there too."""

        def run(self, account_id, region_name):
            try:
                delete(self, account_id, region_name)
            except Exception as e:
                if "NotFound" not in str(getattr(e, "code", "")) and "does not exist" not in str(e):
                    raise

        return run

    FlowLogs.delete = idempotent(lambda self, a, r: backend(a, r).delete_flow_logs([self.id]))
    VPCEndPoint.delete = idempotent(lambda self, a, r: backend(a, r).delete_vpc_endpoints([self.id]))
    VPCGatewayAttachment.delete = idempotent(
        lambda self, a, r: backend(a, r).detach_internet_gateway(self.gateway_id, self.vpc_id)
        if self.gateway_id.startswith("igw-")
        else None
    )
    InternetGateway.delete = idempotent(lambda self, a, r: backend(a, r).delete_internet_gateway(self.id))
    RouteTable.delete = idempotent(lambda self, a, r: backend(a, r).delete_route_table(self.id))
    Route.delete = idempotent(
        lambda self, a, r: backend(a, r).delete_route(self.route_table.id, self.destination_cidr_block)
    )
    SubnetRouteTableAssociation.delete = idempotent(disassociate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    os.environ["MOTO_IAM_LOAD_MANAGED_POLICIES"] = "true"  # AWS-managed policies exist in every account
    patch_moto()
    for region, image in seed().items():
        print(f"seeded {region}: DLAMI parameter -> {image}", flush=True)
    serve(args.port)


def serve(port: int) -> None:
    """What ``moto.server.main`` does for ``-H 127.0.0.1 -p PORT`` (moto 5.2.5), its app wrapped in the fault
    layer of :mod:`tests.e2e.faults` (configured by ``TRAINSTACK_E2E_FAULTS``; none when unset)."""
    import signal
    import sys

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.server import MotoRequestHandler
    from werkzeug.serving import run_simple

    from tests.e2e.faults import Faults

    os.environ.setdefault("MOTO_PORT", str(port))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    app.debug = True
    run_simple("127.0.0.1", port, Faults.from_env(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
